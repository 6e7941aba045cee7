"""An exported HydraHead model in PyTorch (written by hydrahead-jax's ``export_hf``; needs only torch and transformers).

The decoder is the teacher's (Llama / Qwen2 / Qwen3: RMSNorm, SwiGLU MLP, RoPE by ``rope_parameters``) except its
attention. Layer i keeps f = ``layer_fa_groups[i]`` KV groups (one KV head and its G = Hq/Hkv query heads each) as
softmax attention; they are stored first in q/k/v_proj's columns and o_proj's rows. The other groups are linear
attention, as ``config.hybrid`` sets:

    q, k, v = x W_q, x W_k, x W_v (+ biases, + per-head q/k RMSNorm)                [B,T,Hq,D], [B,T,Hkv,D]
    o_FA    = softmax(RoPE(q_FA) RoPE(k_FA)ᵀ / √D, causal) v_FA                      torch SDPA, growing KV cache
    Gated DeltaNet head h (query head of LA group h // G), from q, k, v of its group:
      q, k, v ← causal depthwise conv (use_conv; W taps, no activation) → RoPE (la_rope) → M^q q, M^k k (gdn_qk_map)
      g_t = −exp(A_log) · softplus(x_t W_a + dt_bias),  α_t = exp(g_t),  β_t = sigmoid(x_t W_b + b)
      S_t = α_t S_{t−1} + β_t k̂_t (v_t − α_t S_{t−1}ᵀ k̂_t)ᵀ     (k̂, q̂ L2-normalised, eps 1e-6; S ∈ R^{D×D} fp32)
      o_t = S_tᵀ q̂_t / √D  →  RMSNorm(o_t) · w · silu(x_t W_z + b_z)                 (use_output_gate)
    fusion  la_scale: γ_h ⊙ o_h (+ μ_h) on the LA heads; la_only: the same after a per-head RMS normalisation;
            both: every head RMS-normalised and scaled; none: unchanged
    window  (la_window > 0) each LA head also attends with softmax to the first la_sinks and last la_window tokens
            (RoPE'd teacher q/k/v) and adds its fused GDN output: o_h = window_h + γ_h ⊙ GDN_h + μ_h
    out     = concat(o_FA, o_LA) W_o

A layer with f = Hkv is the teacher's layer. The decode cache (``HydraHeadCache``) keeps k, v of the FA groups
(growing) and, per LA layer, the GDN state [B, H_LA, D, D], the conv's last W−1 inputs and the window's sinks and
ring of keys/values: constant in size. The GDN recurrence runs through flash-linear-attention's
``chunk_gated_delta_rule`` on CUDA when it is installed, else through the token loop ``gated_delta_rule`` here.
Padding (an attention mask with zeros) is refused: run one sequence per row, or rows of equal length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .configuration_hydrahead import HydraHeadConfig

try:  # flash-linear-attention's fused kernel (CUDA); the token loop below is the portable definition
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_chunk_gated_delta_rule = None

L2NORM_EPS = 1e-6  # flash-linear-attention's eps inside the L2 norm's sqrt
# HybridConfig's defaults for the options an exported config may leave out (switched-off options are not written)
HYBRID_DEFAULTS = {
    "use_conv": True,
    "conv_size": 4,
    "use_output_gate": True,
    "la_rope": False,
    "fusion": "la_scale",
    "fusion_granularity": "head",
    "fusion_bias": False,
    "gdn_beta": 0.5,
    "gdn_beta_bias": False,
    "gdn_qk_map": False,
    "la_window": 0,
    "la_sinks": 4,
}
# The output dataclass names its cache field "cache" in recent transformers, "past_key_values" before.
CACHE_FIELD = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean_c x_c² + eps) over the last axis, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σ_c x_c² + eps) over the last axis, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) ⊙ up(x))."""

    def __init__(self, config: HydraHeadConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------------ RoPE


def rope_tables(config: HydraHeadConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, D/2] float32 for ``positions`` [B, T], times the RoPE type's attention factor.

    inv_freq is θ^(−2i/D) for plain RoPE, else transformers' own function of the ``rope_type``; ``dynamic`` and
    ``longrope`` take the length max(positions) + 1 of this call (a decode step: the length so far)."""
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    d = config.head_dim
    if kind == "default":
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        factor = 1.0
    else:
        length = int(positions.max()) + 1 if kind in ("dynamic", "longrope") else None
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=length)
    angles = positions.float()[..., None] * inv_freq.float().to(positions.device)
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [B, T, H, D] (half-split pairs: coordinate i with i + D/2) by the tables [B, T, D/2]."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


# ------------------------------------------------------------------------------------------ Gated DeltaNet


def gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None):
    """The gated delta rule over q, k [B,T,H,K], v [B,T,H,V], g, β [B,T,H] from ``state`` [B,H,K,V] (None: 0):
    per token S ← α S + β k̂ (v − α Sᵀ k̂)ᵀ, o = Sᵀ q̂ / √K (k̂, q̂ L2-normalised; fp32). Returns (o [B,T,H,V] fp32,
    the final state). flash-linear-attention's chunked kernel on CUDA when installed; the token loop otherwise."""
    scale = q.shape[-1] ** -0.5
    if fla_chunk_gated_delta_rule is not None and q.is_cuda:
        o, final = fla_chunk_gated_delta_rule(
            q, k, v, g.float(), beta.float(), scale=scale, initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o.float(), final.float()
    q, k, v = l2_normalize(q), l2_normalize(k), v.float()
    b, t, h, dk = q.shape
    s = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=q.device) if state is None else state.float()
    alpha, beta = g.float().exp(), beta.float()
    out = []
    for i in range(t):
        s = s * alpha[:, i, :, None, None]
        recalled = torch.einsum("bhkv,bhk->bhv", s, k[:, i])  # what the decayed state returns for k
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i, :, None] * (v[:, i] - recalled))
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]) * scale)
    return torch.stack(out, dim=1), s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None):
    """y_t = Σ_j w_j x_{t−(W−1)+j} per channel; x [B,T,C], weight [W,C], history [B,W−1,C] (the inputs before x;
    None: zeros). Returns (y, the new history: the last W−1 inputs)."""
    width, t = weight.shape[0], x.shape[1]
    if history is None:
        history = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    padded = torch.cat([history.to(x.dtype), x], dim=1)
    y = sum(weight[j].to(x.dtype) * padded[:, j : j + t] for j in range(width))
    return y, padded[:, t:]


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet heads of one layer's ``num_kv`` LA groups (module doc)."""

    def __init__(self, config: HydraHeadConfig, hybrid: dict, num_kv: int):
        super().__init__()
        self.hybrid, self.eps = hybrid, config.rms_norm_eps
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.num_kv, d, hd = num_kv, config.hidden_size, config.head_dim
        heads = num_kv * self.group
        self.a_proj = nn.Linear(d, heads, bias=False)
        self.b_proj = nn.Linear(d, heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(heads))
        self.beta_offset = math.log(hybrid["gdn_beta"] / (1.0 - hybrid["gdn_beta"]))
        self.beta_bias = nn.Parameter(torch.zeros(heads)) if hybrid["gdn_beta_bias"] else None
        if hybrid["use_conv"]:
            self.conv_weight = nn.Parameter(torch.zeros(hybrid["conv_size"], (heads + 2 * num_kv) * hd))
        if hybrid["gdn_qk_map"]:
            self.q_map = nn.Parameter(torch.zeros(heads, hd, hd))
            self.k_map = nn.Parameter(torch.zeros(num_kv, hd, hd))
        if hybrid["use_output_gate"]:
            self.z_proj = nn.Linear(d, heads * hd, bias=True)
            self.o_norm_weight = nn.Parameter(torch.ones(heads, hd))

    def conv(self, q, k, v, history):
        """The conv over q, then k, then v channels (weight and history in that order), each on its own."""
        sizes = [x.shape[2] * x.shape[3] for x in (q, k, v)]
        weights = self.conv_weight.split(sizes, dim=1)
        histories = [None] * 3 if history is None else history.split(sizes, dim=2)
        outs, states = [], []
        for x, w, h in zip((q, k, v), weights, histories):
            y, h = causal_conv(x.flatten(2), w, h)
            outs.append(y.view(x.shape))
            states.append(h)
        return (*outs, torch.cat(states, dim=2))

    def forward(self, x, q, k, v, cos, sin, cache: dict | None):
        """x [B,T,d]; q [B,T,H,D], k, v [B,T,n_kv,D] before RoPE → (o [B,T,H,D], cache updated in place)."""
        hc = self.hybrid
        if hc["use_conv"]:
            q, k, v, conv_state = self.conv(q, k, v, None if cache is None else cache.get("conv"))
            if cache is not None:
                cache["conv"] = conv_state
        if hc["la_rope"]:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if hc["gdn_qk_map"]:
            q = torch.einsum("bthd,hde->bthe", q, self.q_map.to(q.dtype))
            k = torch.einsum("bthd,hde->bthe", k, self.k_map.to(k.dtype))
        k, v = k.repeat_interleave(self.group, dim=2), v.repeat_interleave(self.group, dim=2)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        offset = self.beta_offset if self.beta_bias is None else self.beta_bias.float()
        beta = torch.sigmoid(self.b_proj(x).float() + offset)
        o, state = gated_delta_rule(q, k, v, g, beta, None if cache is None else cache.get("gdn"))
        if cache is not None:
            cache["gdn"] = state
        if hc["use_output_gate"]:
            z = self.z_proj(x).view(o.shape).float()
            o = rms_normalize(o, self.eps) * self.o_norm_weight.float() * F.silu(z)
        return o.to(q.dtype)


class ScaleFusion(nn.Module):
    """ô_h = γ_h ⊙ o_h (+ μ_h), after o_h / sqrt(mean_D o_h² + ε) when ``normalize``; γ per head or per channel."""

    def __init__(self, heads: int, head_dim: int, hybrid: dict, eps: float):
        super().__init__()
        self.eps, self.normalize = eps, hybrid["fusion"] != "la_scale"
        per_channel = hybrid["fusion_granularity"] == "channel"
        self.gamma = nn.Parameter(torch.ones(heads, head_dim) if per_channel else torch.ones(heads))
        self.mu = nn.Parameter(torch.zeros(heads, head_dim)) if hybrid["fusion_bias"] else None

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        gamma = self.gamma.float() if self.gamma.ndim == 2 else self.gamma.float()[:, None]
        y = (rms_normalize(o, self.eps) if self.normalize else o.float()) * gamma
        return (y if self.mu is None else y + self.mu.float()).to(o.dtype)


# --------------------------------------------------------------------------------------- streaming window


def window_attention(q, k, v, *, window: int, sinks: int) -> torch.Tensor:
    """Streaming attention of a whole sequence, q [B,T,Hq,D] over its own k, v [B,T,Hkv,D] (positions 0 … T−1):
    query i sees key j ≤ i when j < sinks (the sinks) or j > i − window (the window). fp32 out."""
    t = q.shape[1]
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    visible = (j <= i) & ((j < sinks) | (j > i - window))
    return _masked_softmax_attention(q, k, v, visible)


def _masked_softmax_attention(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    """softmax_j(q·k_j/√D over visible [.., T, S]) v in fp32, query head h reading KV head h // (Hq/Hkv)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.float().repeat_interleave(group, dim=2), v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs, v)


def window_slot(position: int, *, window: int, sinks: int) -> int:
    """The cache slot of the token at ``position``: itself for a sink, else sinks + (position − sinks) mod window."""
    return position if position < sinks else sinks + (position - sinks) % window


def window_step(q, k, v, cache: dict, position: int, *, window: int, sinks: int) -> torch.Tensor:
    """One token at ``position``: its k, v into its slot of the sinks + ring cache, then attention over the
    filled slots (the sinks seen so far and the last min(window, position + 1 − sinks) tokens)."""
    slot = window_slot(position, window=window, sinks=sinks)
    cache["win_k"][:, slot], cache["win_v"][:, slot] = k[:, 0], v[:, 0]
    s = torch.arange(sinks + window, device=q.device)
    filled = torch.where(s < sinks, s <= position, (s - sinks) < min(window, position + 1 - sinks))
    return _masked_softmax_attention(q, cache["win_k"], cache["win_v"], filled[None, :])


def window_fill(cache: dict, k, v, *, window: int, sinks: int) -> None:
    """The window cache after a prefill of k, v [B,T,n,D] at positions 0 … T−1: its sinks and last tokens."""
    b, t, n, d = k.shape
    cache["win_k"] = k.new_zeros(b, sinks + window, n, d)
    cache["win_v"] = v.new_zeros(b, sinks + window, n, d)
    for p in [p for p in range(t) if p < sinks or p >= max(sinks, t - window)]:
        slot = window_slot(p, window=window, sinks=sinks)
        cache["win_k"][:, slot], cache["win_v"][:, slot] = k[:, p], v[:, p]


# ----------------------------------------------------------------------------------------------- the layer


class HydraHeadAttention(nn.Module):
    """One layer's attention: its first f KV groups softmax, the rest Gated DeltaNet, fused before o_proj."""

    def __init__(self, config: HydraHeadConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, hq, hkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.group, self.fa = hq // hkv, int(config.layer_fa_groups[layer_idx])
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, hq * hd, bias=bias)
        self.k_proj = nn.Linear(d, hkv * hd, bias=bias)
        self.v_proj = nn.Linear(d, hkv * hd, bias=bias)
        self.o_proj = nn.Linear(hq * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.hybrid = {**HYBRID_DEFAULTS, **config.hybrid} if self.fa < hkv else None
        self.gdn = self.fusion = None
        if self.hybrid is not None:
            self.gdn = GatedDeltaNet(config, self.hybrid, hkv - self.fa)
            fused = {"la_scale": hq - self.fa * self.group, "la_only": hq - self.fa * self.group, "both": hq}
            if self.hybrid["fusion"] in fused:
                self.fusion = ScaleFusion(fused[self.hybrid["fusion"]], hd, self.hybrid, config.rms_norm_eps)

    def project(self, x):
        b, t, _ = x.shape
        hd = self.config.head_dim
        q = self.q_proj(x).view(b, t, -1, hd)
        k = self.k_proj(x).view(b, t, -1, hd)
        v = self.v_proj(x).view(b, t, -1, hd)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def softmax_groups(self, q, k, v, cache: dict | None):
        """The FA groups: SDPA over the new tokens and, with a cache, the cached ones (k, v after RoPE)."""
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            cache["k"], cache["v"] = k, v
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=self.config.head_dim**-0.5)
        return out.transpose(1, 2)

    def forward(self, x, cos, sin, start: int, cache: dict | None):
        """x [B,T,d] at positions start … start+T−1 (T > 1 only from an empty cache) → [B,T,d]."""
        b, t, _ = x.shape
        q, k, v = self.project(x)
        fa_heads, parts = self.fa * self.group, []
        if self.fa:
            q_fa, k_fa = apply_rope(q[:, :, :fa_heads], cos, sin), apply_rope(k[:, :, : self.fa], cos, sin)
            parts.append(self.softmax_groups(q_fa, k_fa, v[:, :, : self.fa], cache))
        if self.hybrid is not None:
            hc = self.hybrid
            o_la = self.gdn(x, q[:, :, fa_heads:], k[:, :, self.fa :], v[:, :, self.fa :], cos, sin, cache)
            if hc["fusion"] in ("la_scale", "la_only"):
                o_la = self.fusion(o_la)
            if hc["la_window"]:
                o_la = self.window(q, k, v, cos, sin, start, cache) + o_la.float()
            parts.append(o_la.to(q.dtype))
        out = torch.cat(parts, dim=2)
        if self.hybrid is not None and self.hybrid["fusion"] == "both":
            out = self.fusion(out)
        return self.o_proj(out.reshape(b, t, -1))

    def window(self, q, k, v, cos, sin, start: int, cache: dict | None):
        """The LA heads' streaming softmax attention (RoPE'd teacher q, k), filling or stepping its cache."""
        size = dict(window=self.hybrid["la_window"], sinks=self.hybrid["la_sinks"])
        fa_heads = self.fa * self.group
        q_la, k_la = apply_rope(q[:, :, fa_heads:], cos, sin), apply_rope(k[:, :, self.fa :], cos, sin)
        v_la = v[:, :, self.fa :]
        if cache is not None and start > 0:
            return window_step(q_la, k_la, v_la, cache, start, **size)
        if cache is not None:
            window_fill(cache, k_la, v_la, **size)
        return window_attention(q_la, k_la, v_la, **size)


class HydraHeadDecoderLayer(nn.Module):
    def __init__(self, config: HydraHeadConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HydraHeadAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, start: int, cache: dict | None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, start, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class HydraHeadCache:
    """The decode cache: per layer a dict (``k``, ``v`` of its FA groups, growing; ``gdn``, ``conv``, ``win_k``,
    ``win_v`` of its LA groups, constant in size) and ``seen``, the tokens it holds."""

    is_compileable = False

    def __init__(self, num_layers: int):
        self.layers = [{} for _ in range(num_layers)]
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            for name, value in layer.items():
                layer[name] = value.index_select(0, beam_idx.to(value.device))

    def state_bytes(self) -> int:
        """Bytes of the constant-size part (GDN, conv and window states)."""
        return sum(v.numel() * v.element_size() for lay in self.layers for n, v in lay.items() if n not in ("k", "v"))


class HydraHeadPreTrainedModel(PreTrainedModel):
    config_class = HydraHeadConfig
    base_model_prefix = "model"
    _no_split_modules = ["HydraHeadDecoderLayer"]
    supports_gradient_checkpointing = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # it keeps its own cache (HydraHeadCache): GDN states beside a KV cache

    def _init_weights(self, module):
        """Every weight comes from the exported checkpoint; fresh modules get small normal weights."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class HydraHeadModel(HydraHeadPreTrainedModel):
    def __init__(self, config: HydraHeadConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HydraHeadDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, cache: HydraHeadCache | None = None) -> torch.Tensor:
        """Final normalised hidden states [B,T,d]; with a cache, the tokens continue it (updated in place). A
        multi-token call on a non-empty cache runs token by token (the window and FA paths prefill from empty)."""
        if cache is not None and cache.seen and input_ids.shape[1] > 1:
            return torch.cat([self(input_ids[:, i : i + 1], cache) for i in range(input_ids.shape[1])], dim=1)
        start = cache.seen if cache is not None else 0
        b, t = input_ids.shape
        positions = torch.arange(start, start + t, device=input_ids.device).expand(b, t)
        cos, sin = rope_tables(self.config, positions)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, start, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.seen += t
        return self.norm(h)


class HydraHeadForCausalLM(HydraHeadPreTrainedModel, GenerationMixin):
    def __init__(self, config: HydraHeadConfig):
        super().__init__(config)
        self.model = HydraHeadModel(config)
        # Tied embeddings: the logits read the embedding table itself (no lm_head module, nothing to tie).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: HydraHeadCache | None = None,
        past_key_values: HydraHeadCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "HydraHead models take no padding (its Gated DeltaNet state would read the pad tokens): "
                "run one sequence per row, or rows of equal length (lm-eval: batch_size=1)."
            )
        if cache is None and (use_cache if use_cache is not None else self.config.use_cache):
            cache = HydraHeadCache(self.config.num_hidden_layers)
        start = cache.seen if cache is not None else 0
        if position_ids is not None and not bool(
            (position_ids == torch.arange(start, start + input_ids.shape[1], device=position_ids.device)).all()
        ):
            raise ValueError("HydraHead models run tokens at consecutive positions from their cache's length.")
        h = self.model(input_ids, cache)
        h = h[:, -logits_to_keep:] if logits_to_keep else h
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, weight).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(
        self, input_ids, cache=None, past_key_values=None, attention_mask=None, use_cache=True, **kwargs
    ):
        """Only the tokens the cache has not seen (all of them on the first step)."""
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            input_ids = input_ids[:, cache.seen :]
        return {"input_ids": input_ids, CACHE_FIELD: cache, "attention_mask": attention_mask, "use_cache": use_cache}

    def _reorder_cache(self, cache, beam_idx):
        cache.reorder_cache(beam_idx)
        return cache

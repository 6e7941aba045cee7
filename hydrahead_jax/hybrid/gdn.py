"""Gated DeltaNet heads for the linear-attention (LA) KV groups of one layer, reusing the teacher's q/k/v.

For LA query head h (KV head h // G of the layer's LA groups), with x_t the layer input:

    q_t, k_t, v_t = teacher projections (+ q/k norm) → causal depthwise conv (optional) → RoPE (optional)
    a_t = x_t W_a,  b_t = x_t W_b                                         (new, one scalar per head)
    g_t = −exp(A_log) · softplus(a_t + dt_bias),   α_t = exp(g_t),   β_t = sigmoid(b_t)
    S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t k̂_t v_tᵀ                 (k̂, q̂ L2-normalised, S fp32)
    o_t = scale · S_tᵀ q̂_t                                               (scale = D^-½)
    o_t ← RMSNorm(o_t) · w · silu(x_t W_z + b_z)                          (optional output gate)

Un-shared heads: every LA query head has its own state and its own α, β; its k and v are those of its KV head,
repeated head-granularly (k for query head h = k of KV head h // G), so the teacher's GQA pairing is kept.

Initialisation (the student should start close to the teacher):
- conv: identity (last tap 1, others 0) and *no* SiLU: flash-linear-attention applies SiLU after the conv, but
  silu(v) would change the teacher's values at init; a linear conv starts as exactly the teacher's q/k/v.
- A_log = 0 (A = 1), W_a = 0 and dt_bias = softplus⁻¹(dt) with dt spread geometrically over [1e-3, 1e-1]
  across the layer's LA heads: decays α ∈ [0.905, 0.999], i.e. memories of ~10 to ~1000 tokens, long like
  the softmax heads they replace, and a spread so that different heads can specialise.
- W_b = 0: β = 0.5 for every token, a moderate write strength (β = 1 would overwrite a key's value fully).
- W_z = 0, b_z = silu⁻¹(1) ≈ 1.2785: the gate is exactly 1 at init, so the gated norm is a plain RMSNorm.
Zero kernels still get gradients (∂L/∂W = xᵀ ∂L/∂a), and they make the initial student independent of the seed.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.models.kernel_sharding import BH, BHD, BHKV, BTH, BTHD, kernel_call
from hydrahead_jax.models.layers import apply_rope, param_init, rms_normalize
from pallas_kernels.gated_delta import chunk_gated_delta_rule, gated_delta_rule_step

DT_MIN, DT_MAX = 1e-3, 1e-1
SILU_INV_ONE = 1.2784645427610738  # z with silu(z) = z·sigmoid(z) = 1


def inverse_softplus(y: np.ndarray) -> np.ndarray:
    """x with softplus(x) = log(1 + eˣ) = y, for y > 0."""
    return y + np.log(-np.expm1(-y))


def initial_dt(n_heads: int) -> np.ndarray:
    """dt per head, geometrically spaced in [DT_MIN, DT_MAX] (one head: their geometric mean)."""
    if n_heads == 1:
        return np.array([math.sqrt(DT_MIN * DT_MAX)])
    return np.geomspace(DT_MIN, DT_MAX, n_heads)


@jax.custom_vjp
def _conv_valid(padded: jax.Array, weight: jax.Array) -> jax.Array:
    """y_t = Σ_j w_j · padded_{t+j} for t < len(padded) − W + 1; padded [B,W−1+T,C], weight [W,C], both fp32.

    VJP:  ∂L/∂padded_s = Σ_j w_j ∂L/∂y_{s−j},   ∂L/∂w_j = Σ_{b,t} ∂L/∂y_t ⊙ padded_{t+j}.
    Written by hand so the backward keeps only ``padded``: autodiff of the shifted slices kept W−1 shifted copies
    of the activations (one per tap) alive for the weight gradient, and XLA CPU materialised each of them.
    """
    width = weight.shape[0]
    t = padded.shape[1] - width + 1
    return sum(padded[:, j : j + t] * weight[j] for j in range(width))


def _conv_valid_fwd(padded, weight):
    return _conv_valid(padded, weight), (padded, weight)


def _conv_valid_bwd(res, dy):
    padded, weight = res
    width = weight.shape[0]
    t = dy.shape[1]
    dpadded = sum(jax.lax.pad(dy * weight[j], 0.0, [(0, 0, 0), (j, width - 1 - j, 0), (0, 0, 0)]) for j in range(width))
    dweight = jnp.stack([jnp.sum(dy * padded[:, j : j + t], axis=(0, 1)) for j in range(width)])
    return dpadded, dweight


_conv_valid.defvjp(_conv_valid_fwd, _conv_valid_bwd)


def causal_depthwise_conv(x: jax.Array, weight: jax.Array, state: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """y_t = Σ_j w_j · x_{t−(W−1)+j} over channels independently; x [B,T,C], weight [W,C], state [B,W−1,C].

    ``state`` holds the W−1 inputs before x (zeros at the start of a sequence); returns (y, the new state = the
    last W−1 inputs), so a sequence run in pieces (prefill, then one token at a time) equals one run over all.
    """
    width = weight.shape[0]
    t = x.shape[1]
    x32 = x.astype(jnp.float32)
    if state is None:
        padded = jax.lax.pad(x32, 0.0, [(0, 0, 0), (width - 1, 0, 0), (0, 0, 0)])
    else:
        padded = jnp.concatenate([state.astype(jnp.float32), x32], axis=1)  # [B, W−1+T, C]
    y = _conv_valid(padded, weight.astype(jnp.float32))
    return y.astype(x.dtype), padded[:, t:].astype(x.dtype)


class GatedDeltaNetHeads(nnx.Module):
    """The GDN heads of one layer's LA groups; all its parameters live under this submodule (path ``gdn``)."""

    def __init__(self, cfg: ModelConfig, hybrid_cfg: HybridConfig, la_groups: tuple[int, ...], *, rngs: nnx.Rngs):
        if not la_groups:
            raise ValueError(
                "GatedDeltaNetHeads needs at least one LA group; a layer without LA groups has no GDN heads."
            )
        self.cfg, self.hybrid_cfg = cfg, hybrid_cfg
        self.la_groups = tuple(la_groups)
        self.num_kv = len(la_groups)
        self.num_heads = self.num_kv * cfg.group_size
        d, n, hd = cfg.hidden_size, self.num_heads, cfg.head_dim
        pdt = cfg.jnp_param_dtype
        zeros = nnx.initializers.zeros_init()
        linear = dict(dtype=cfg.jnp_dtype, param_dtype=pdt, rngs=rngs)
        self.a_proj = nnx.Linear(d, n, use_bias=False, kernel_init=param_init(zeros, ("embed", None)), **linear)
        self.b_proj = nnx.Linear(d, n, use_bias=False, kernel_init=param_init(zeros, ("embed", None)), **linear)
        self.A_log = nnx.Param(jnp.zeros((n,), pdt), out_sharding=("norm",), eager_sharding=False)
        self.dt_bias = nnx.Param(
            jnp.asarray(inverse_softplus(initial_dt(n)), pdt), out_sharding=("norm",), eager_sharding=False
        )
        if hybrid_cfg.use_conv:
            channels = (n + 2 * self.num_kv) * hd  # q of the LA query heads, k and v of their KV heads
            weight = jnp.zeros((hybrid_cfg.conv_size, channels), pdt).at[-1].set(1)
            self.conv_weight = nnx.Param(weight, out_sharding=(None, None), eager_sharding=False)
        if hybrid_cfg.use_output_gate:
            self.z_proj = nnx.Linear(
                d,
                n * hd,
                use_bias=True,
                kernel_init=param_init(zeros, ("embed", "heads")),
                bias_init=param_init(nnx.initializers.constant(SILU_INV_ONE), ("heads",)),
                **linear,
            )
            self.o_norm_weight = nnx.Param(jnp.ones((n, hd), pdt), out_sharding=(None, "norm"), eager_sharding=False)

    # ------------------------------------------------------------------------------------------ pieces
    def decay_and_beta(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """g (log decay ≤ 0) and β, both [B,T,H_la] fp32, from the layer input x [B,T,d]."""
        a = self.a_proj(x).astype(jnp.float32)
        dt = jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * dt
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        return g, beta

    def conv(self, q, k, v, state):
        """Causal conv over the q/k/v channels (weight and state: q, then k, then v channels); returns (q, k, v,
        new conv state). Each tensor is convolved on its own: concatenating them first costs an activation-sized
        copy forward and backward."""
        splits = np.cumsum([x.shape[2] * x.shape[3] for x in (q, k)]).tolist()
        weights = jnp.split(self.conv_weight[...], splits, axis=1)
        states = [None] * 3 if state is None else jnp.split(state, splits, axis=2)
        outs, new_states = [], []
        for x, w, st in zip((q, k, v), weights, states):
            y, st = causal_depthwise_conv(x.reshape(x.shape[0], x.shape[1], -1), w, st)
            outs.append(y.reshape(x.shape))
            new_states.append(st)
        return (*outs, jnp.concatenate(new_states, axis=-1))

    def output_gate(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """Per-head gated RMSNorm: RMSNorm(o) · w · silu(z), z = x W_z + b_z (fp32 inside)."""
        b, t = o.shape[:2]
        z = self.z_proj(x).reshape(b, t, self.num_heads, self.cfg.head_dim).astype(jnp.float32)
        o32 = rms_normalize(o, self.cfg.rms_norm_eps)
        return (o32 * self.o_norm_weight[...].astype(jnp.float32) * jax.nn.silu(z)).astype(o.dtype)

    # ------------------------------------------------------------------------------------------ forward
    def __call__(
        self,
        x: jax.Array,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        cache: dict[str, Any] | None = None,
    ) -> tuple[jax.Array, dict[str, Any] | None]:
        """x [B,T,d]; q [B,T,H_la,D] and k, v [B,T,H_kv_la,D] from the teacher's projections, *before* RoPE.

        Without a cache: the chunked rule from a zero state (training). With one (keys ``gdn_state``
        [B,H_la,D,D] fp32 and, with the conv, ``conv_state`` [B,W−1,C]): T == 1 takes the one-token step,
        T > 1 the chunked rule from the cached state; both return the updated cache.
        """
        hc, cfg = self.hybrid_cfg, self.cfg
        new_cache = None if cache is None else dict(cache)
        if hc.use_conv:
            q, k, v, conv_state = self.conv(q, k, v, None if cache is None else cache["conv_state"])
            if cache is not None:
                new_cache["conv_state"] = conv_state.astype(cache["conv_state"].dtype)
        if hc.la_rope:
            rope = dict(theta=cfg.rope_theta, interleaved=cfg.rope_interleaved)
            q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
        k = jnp.repeat(k, cfg.group_size, axis=2)  # query head h reads KV head h // G
        v = jnp.repeat(v, cfg.group_size, axis=2)
        g, beta = self.decay_and_beta(x)
        # Both rules run per device inside shard_map over the mesh axes of batch and heads (``kernel_call``).
        if cache is not None and q.shape[1] == 1:
            step = functools.partial(gated_delta_rule_step, use_qk_l2norm=True)
            token = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o, state = kernel_call(
                step, *token, cache["gdn_state"], in_axes=(BHD, BHD, BHD, BH, BH, BHKV), out_axes=(BHD, BHKV)
            )
            o = o[:, None]
        else:
            chunked = functools.partial(
                chunk_gated_delta_rule,
                output_final_state=cache is not None,
                use_qk_l2norm=True,
                chunk_size=hc.gdn_chunk_size,
                implementation=hc.gdn_implementation,
            )
            initial_state = None if cache is None else cache["gdn_state"]
            o, state = kernel_call(
                lambda q, k, v, g, beta, state: chunked(q, k, v, g, beta, initial_state=state),
                *(q, k, v, g, beta, initial_state),
                in_axes=(BTHD, BTHD, BTHD, BTH, BTH, None if cache is None else BHKV),
                out_axes=(BTHD, None if cache is None else BHKV),
            )
        if cache is not None:
            new_cache["gdn_state"] = state
        if hc.use_output_gate:
            o = self.output_gate(o, x)
        return o, new_cache

    def init_cache(self, batch: int, dtype) -> dict[str, Any]:
        """gdn_state [B, H_la, D, D] fp32 (+ conv_state [B, W−1, C] in the compute dtype)."""
        hd = self.cfg.head_dim
        cache = {"gdn_state": jnp.zeros((batch, self.num_heads, hd, hd), jnp.float32)}
        if self.hybrid_cfg.use_conv:
            channels = self.conv_weight.shape[1]
            cache["conv_state"] = jnp.zeros((batch, self.hybrid_cfg.conv_size - 1, channels), dtype)
        return cache

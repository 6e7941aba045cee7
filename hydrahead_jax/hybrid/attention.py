"""The HydraHead attention block: a teacher attention layer whose KV groups are split into softmax (FA) groups and
Gated DeltaNet (LA) groups, recombined by scale-normalised fusion before the teacher's o_proj.

A *KV group* g is KV head g together with query heads g·G … g·G+G−1 (G = num_heads / num_kv_heads). The head map
gives each layer its FA groups; every other group is LA:

    q, k, v = teacher projections (+ q/k norm)                     [B,T,Hq,D], [B,T,Hkv,D]
    o_FA = softmax attention(RoPE(q_FA), RoPE(k_FA), v_FA)          KV cache for FA groups only
    o_LA = GatedDeltaNet(x, q_LA, k_LA, v_LA)                       constant-size state (hybrid/gdn.py)
    o    = fusion(concat(o_FA, o_LA))                               (hybrid/fusion.py)
    out  = o · W_o                                                  the teacher's o_proj

Stored order. A student's layer keeps its KV groups permuted so that its f FA groups come first (``group_order``,
``permute_groups``: the q/k/v projection columns and biases and the o_proj rows move with their heads, exact in
real arithmetic since o_proj sums over heads): q_FA is then q[:, :, :f·G], q_LA the rest, with no gather and no
re-ordering before o_proj. The head map keeps the original group indices (``Transformer.group_order`` maps stored
to original). Layers then differ only in f, their *kind*: the model's layers are one stack with one parameter
shape (``Transformer.layers``), the GDN heads held at the model's largest LA head count, and the scan body
switches on f, so each distinct f compiles once whatever the depth.

Fusion (our design; the paper's formula is not public). ``la_scale`` (the default) touches only the LA heads and
does not normalise them: the kept FA heads are the teacher's heads, unchanged, and each LA head h is scaled and
offset,

    ô_{t,h} = γ_h ⊙ o_{t,h} (+ μ_h)                                  (``la_scale``)

so the output gate's per-token magnitude (RMSNorm(o)·w·silu(z), ``hybrid/gdn.py``) survives: an LA head can go
quiet where its teacher head is idle. The normalising modes divide each touched head by its per-token RMS first,

    ô_{t,h} = γ_h ⊙ o_{t,h} / sqrt(mean_c o_{t,h,c}² + ε) (+ μ_h)   (``la_only``: the LA heads; ``both``: all heads)

γ_h ∈ R (``head``) or R^D (``channel``), learnable, initialised from the teacher's measured per-head output RMS or
by a least-squares fit to the teacher's head outputs (``hybrid/fusion.py``). The optional offset μ_h ∈ R^D
(``fusion_bias``) carries the part of a teacher head's output that does not depend on the token (attention-sink
heads output nearly a constant). ``both`` also renormalises the kept FA heads per token, so they are no longer
the teacher's heads (measured on the SmolLM2 demo student: bench/RESULTS.md); ``none`` leaves outputs untouched.

Decode cache of a layer (``init_cache``): k, v [B, S, n_FA, D] for the FA groups; gdn_state [B, H_LA, D, D] fp32
and, with the conv, conv_state [B, conv_size−1, C] for the LA groups, and with ``la_window`` their sinks and ring of
recent keys and values win_k, win_v [B, la_sinks + la_window, n_LA, D] (the model stacks it per kind).

A layer whose groups are all FA is the teacher's layer unchanged (no GDN, no fusion: its GDN and fusion slots stay
zero and unused), whatever the HybridConfig says; its parameters are exactly the teacher's. The block subclasses
the teacher's ``Attention``, so parameter paths (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, plus gdn and
fusion) match the teacher's (the student's in its stored group order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import window as streaming
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.gdn import (
    GatedDeltaNetHeads,
    gated_rms_norm_grads,
    map_arrays,
    place_la_groups,
    take_la_groups,
)
from hydrahead_jax.models.attention import Attention, HeadProbe, LayerCache, check_segments
from hydrahead_jax.models.kernel_sharding import sequence_axes
from hydrahead_jax.models.layers import rms_normalize


class ScaleFusion(nnx.Module):
    """A learnable γ (plus, with ``bias``, a learnable offset μ [H, D], zero at construction) for ``num_heads``
    head slots, after a per-head RMS normalisation when ``normalize``; a layer fusing fewer heads uses the first
    ones (``__call__``)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        granularity: str,
        eps: float,
        param_dtype,
        bias: bool = False,
        normalize: bool = True,
    ):
        self.num_heads = int(num_heads)
        self.granularity = granularity
        self.eps = eps
        self.normalize = normalize
        shape = (num_heads,) if granularity == "head" else (num_heads, head_dim)
        self.gamma = nnx.Param(
            jnp.ones(shape, param_dtype), out_sharding=("norm",) + (None,) * (len(shape) - 1), eager_sharding=False
        )
        if bias:
            self.mu = nnx.Param(
                jnp.zeros((num_heads, head_dim), param_dtype), out_sharding=("norm", None), eager_sharding=False
            )
        else:
            self.mu = None

    def __call__(self, o: jax.Array) -> jax.Array:
        """o [B,T,H',D], H' ≤ num_heads heads fused by the first H' slots → same shape and dtype."""
        n = o.shape[2]
        gamma = self.gamma[...][:n]
        gamma = gamma[:, None] if self.granularity == "head" else gamma
        mu = None if self.mu is None else self.mu[...][:n]
        if self.normalize:
            return _scale_rms_norm(o, gamma, mu, self.eps)
        y = o.astype(jnp.float32) * gamma.astype(jnp.float32)
        return (y if mu is None else y + mu.astype(jnp.float32)).astype(o.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scale_rms_norm(o: jax.Array, gamma: jax.Array, mu: jax.Array | None, eps: float) -> jax.Array:
    """γ ⊙ o / sqrt(mean_D o² + eps) (+ μ) per head, fp32 inside, in o's dtype; γ [H, 1] or [H, D], μ [H, D] or None.

    Hand-written VJP (``gated_rms_norm_grads`` without a gate, and ∂L/∂μ = Σ_{b,t} ∂L/∂y) that keeps only o (in its
    own dtype), γ and μ and recomputes the normalisation: autodiff kept the fp32 normalised o from the forward to
    the backward next to the output (which o_proj keeps), and that pair sat at the hybrid layer's peak.
    """
    y = rms_normalize(o, eps) * gamma.astype(jnp.float32)
    return (y if mu is None else y + mu.astype(jnp.float32)).astype(o.dtype)


def _scale_rms_norm_fwd(o, gamma, mu, eps):
    return _scale_rms_norm(o, gamma, mu, eps), (o, gamma, mu)


def _scale_rms_norm_bwd(eps, res, dy):
    # The barrier keeps XLA from merging the recomputed normalisation with the forward's (which would keep it).
    (o, gamma, mu), dy = jax.lax.optimization_barrier((res, dy))
    do, _, dgamma = gated_rms_norm_grads(o, None, gamma, dy, eps)
    dmu = None if mu is None else jnp.sum(dy.astype(jnp.float32), axis=tuple(range(dy.ndim - 2))).astype(mu.dtype)
    return do, dgamma.astype(gamma.dtype), dmu


_scale_rms_norm.defvjp(_scale_rms_norm_fwd, _scale_rms_norm_bwd)


def abstract_gdn_heads(cfg: ModelConfig, hybrid_cfg: HybridConfig, num_groups: int) -> GatedDeltaNetHeads:
    """GDN heads of ``num_groups`` LA groups as shapes only (its structure and shapes, nothing allocated). Built
    with no mesh in context: it is also built while a train step traces under the run's mesh, and a mesh would
    have ``nnx.eval_shape`` turn the parameters' logical axis names (``norm``, ...) into mesh axes it lacks."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(lambda: GatedDeltaNetHeads(cfg, hybrid_cfg, tuple(range(num_groups)), rngs=nnx.Rngs(0)))


class HydraHeadAttention(Attention):
    """The teacher's attention with some KV groups run as Gated DeltaNet heads (submodule ``gdn``) and head outputs
    fused (submodule ``fusion``), in the form every layer of a student shares (the layers are one stack).

    The layer's parameters hold its KV groups permuted so that its FA groups come first (``permute_groups``); the
    layer's static ``kind`` (``Transformer.layer_kinds``) is its FA-group count f: groups 0 … f−1 of the stored
    order are softmax, groups f … Hkv−1 Gated DeltaNet. ``fa_counts``: every f the model's layers use. The GDN
    heads (and, for ``la_scale`` and ``la_only``, the fusion slots) are held at the largest LA head count of the
    model; a layer with fewer LA groups uses the first ones, the others stay zero (they receive no gradient).
    ``layer_fa``: this layer's f, for its initial values (the GDN decay spread over its own LA heads, unused slots
    zero).
    f = Hkv is the teacher's layer unchanged (no GDN, no fusion), whatever the HybridConfig says."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        fa_counts: tuple[int, ...],
        layer_fa: int | None = None,
        hybrid_cfg: HybridConfig | None = None,
        attention_impl: str = "auto",
        context_parallel: str = "allgather",
    ):
        super().__init__(cfg, rngs=rngs, attention_impl=attention_impl, context_parallel=context_parallel)
        self.fa_counts = tuple(sorted({int(f) for f in fa_counts}))
        if not self.fa_counts or not all(0 <= f <= cfg.num_kv_heads for f in self.fa_counts):
            raise ValueError(f"fa_counts={tuple(fa_counts)} must be FA-group counts in [0, {cfg.num_kv_heads}].")
        layer_fa = self.fa_counts[0] if layer_fa is None else int(layer_fa)
        if layer_fa not in self.fa_counts:
            raise ValueError(f"layer_fa={layer_fa} is not one of fa_counts={self.fa_counts}.")
        self.max_la_groups = cfg.num_kv_heads - self.fa_counts[0]
        if self.max_la_groups and hybrid_cfg is None:
            raise ValueError(
                f"fa_counts={self.fa_counts} leaves KV groups without softmax attention; pass "
                "hybrid_cfg=HybridConfig(...) to run them as Gated DeltaNet heads."
            )
        # A model without LA groups is the teacher: nothing to fuse, so no hybrid machinery.
        self.hybrid_cfg = hybrid_cfg if self.max_la_groups else None
        if self.hybrid_cfg is None:
            return
        hc = self.hybrid_cfg
        self.gdn = GatedDeltaNetHeads(cfg, hc, tuple(range(self.max_la_groups)), rngs=rngs)
        la = cfg.num_kv_heads - layer_fa
        if la < self.max_la_groups:
            # this layer's own initial GDN values in front, zeros in the slots it does not use
            own = GatedDeltaNetHeads(cfg, hc, tuple(range(la)), rngs=nnx.Rngs(0)) if la else None
            full = nnx.state(self.gdn)
            values = (
                jax.tree.map(jnp.zeros_like, full)
                if own is None
                else place_la_groups(nnx.state(own), cfg, la, self.max_la_groups)
            )
            nnx.update(self.gdn, values)
        if hc.fusion != "none":
            slots = cfg.num_heads if hc.fusion == "both" else self.max_la_groups * cfg.group_size
            self.fusion = ScaleFusion(
                slots,
                cfg.head_dim,
                granularity=hc.fusion_granularity,
                eps=cfg.rms_norm_eps,
                param_dtype=cfg.jnp_param_dtype,
                bias=hc.fusion_bias,
                normalize=hc.fusion != "la_scale",
            )
            used = self.fused_heads(layer_fa)
            if used < slots:
                self.fusion.gamma.set_value(self.fusion.gamma[...].at[used:].set(0))
        else:
            self.fusion = None

    def resolve_kind(self, kind: int | None) -> int:
        """``kind``, or for None the one FA count of an attention built for a single one (a lone block)."""
        if kind is not None:
            return int(kind)
        if len(self.fa_counts) != 1:
            raise ValueError(f"this attention serves layers of FA counts {self.fa_counts}: pass the layer's kind.")
        return self.fa_counts[0]

    def is_hybrid(self, kind: int) -> bool:
        """Whether a layer of this kind (FA-group count) has LA groups."""
        return self.hybrid_cfg is not None and kind < self.cfg.num_kv_heads

    def fused_heads(self, kind: int) -> int:
        """How many heads a layer of this kind fuses (the first slots of ``fusion``): its LA query heads for
        ``la_scale`` and ``la_only``, all query heads for ``both``, 0 for a softmax-only layer."""
        if not self.is_hybrid(kind) or self.fusion is None:
            return 0
        if self.hybrid_cfg.fusion in ("la_scale", "la_only"):
            return (self.cfg.num_kv_heads - kind) * self.cfg.group_size
        return self.cfg.num_heads

    def unused_parameters(self, kind: int) -> int:
        """How many entries of ``gdn`` and ``fusion`` (one layer's slice of them) a layer of this kind does not use:
        the zero slots of the shapes every layer shares. A parameter count of the model without them counts each
        layer's own GDN heads and fusion scales only."""
        if self.hybrid_cfg is None:
            return 0

        def gdn_size(groups: int) -> int:
            if not groups:
                return 0
            shape = abstract_gdn_heads(self.cfg, self.hybrid_cfg, groups)
            return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shape, nnx.Param)))

        own = self.cfg.num_kv_heads - kind if self.is_hybrid(kind) else 0
        unused = gdn_size(self.max_la_groups) - gdn_size(own)
        if self.fusion is not None:
            per_slot = (1 if self.hybrid_cfg.fusion_granularity == "head" else self.cfg.head_dim) + (
                0 if self.fusion.mu is None else self.cfg.head_dim
            )
            unused += (self.fusion.num_heads - self.fused_heads(kind)) * per_slot
        return unused

    def gdn_heads(self, kind: int) -> GatedDeltaNetHeads:
        """The GDN heads of a layer of this kind: ``gdn`` restricted to its Hkv − kind LA groups (a view whose
        parameters are slices of ``gdn``'s, so gradients reach the stacked parameters)."""
        n = self.cfg.num_kv_heads - kind
        if n == self.max_la_groups:
            return self.gdn
        graphdef, _ = nnx.split(abstract_gdn_heads(self.cfg, self.hybrid_cfg, n))
        return nnx.merge(graphdef, take_la_groups(nnx.state(self.gdn), self.cfg, self.max_la_groups, n))

    def head_outputs(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache | None = None,
        cache_index: jax.Array | None = None,
        probe: HeadProbe | None = None,
        segment_ids: jax.Array | None = None,
        kind: int | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """All head outputs [B,T,Hq,D] in the stored (FA-first) order, before o_proj (and the new cache), of a
        layer with ``kind`` FA groups. With ``segment_ids`` (packed documents) the FA groups attend within each
        document and the GDN heads restart their state and conv at each document start."""
        kind = self.resolve_kind(kind)
        if not self.is_hybrid(kind):
            return super().head_outputs(x, positions, cache, cache_index, probe, segment_ids)
        if probe is not None:
            raise ValueError("head-selection probes run on the teacher, not on a HydraHead student.")
        check_segments(segment_ids, cache, probe)
        return self._fused_outputs(x, positions, cache, cache_index, segment_ids, kind, fuse=True)

    def fusion_inputs(self, x: jax.Array, positions: jax.Array, kind: int | None = None) -> jax.Array:
        """What the fusion of a layer of this kind receives (no cache): the LA heads' outputs for ``la_scale`` and
        ``la_only``, every head's for ``both``; [B,T,fused_heads(kind),D]. The fusion's calibration fits γ, μ on
        it."""
        kind = self.resolve_kind(kind)
        if not self.fused_heads(kind):
            raise ValueError("this layer has no fusion (fusion='none', or every KV group is FA).")
        return self._fused_outputs(x, positions, None, None, None, kind, fuse=False)[0]

    def _fused_outputs(self, x, positions, cache, cache_index, segment_ids, f: int, *, fuse: bool):
        """``head_outputs`` of a hybrid layer with f FA groups; ``fuse=False`` returns the fusion's input instead
        (no cache). The stored order puts the FA heads first: no gather, no re-ordering."""
        q, k, v = self.project_heads(x)
        fa_heads = f * self.cfg.group_size
        new_cache = None if cache is None else dict(cache)
        parts = []
        if f:
            fa_cache = None if cache is None else {"k": cache["k"], "v": cache["v"]}
            o_fa, fa_cache = self.full_attention(
                self.rope(q[:, :, :fa_heads], positions),
                self.rope(k[:, :, :f], positions),
                v[:, :, :f],
                fa_cache,
                cache_index,
                segment_ids,
            )
            parts.append(o_fa)
            if cache is not None:
                new_cache.update(fa_cache)
        la_cache = None if cache is None else {key: cache[key] for key in ("gdn_state", "conv_state") if key in cache}
        o_la, la_cache = self.gdn_heads(f)(
            x, q[:, :, fa_heads:], k[:, :, f:], v[:, :, f:], positions, la_cache, segment_ids=segment_ids
        )
        if cache is not None:
            new_cache.update(la_cache)
        if self.hybrid_cfg.fusion in ("la_scale", "la_only"):  # the FA heads pass through as the teacher's
            if not fuse:
                return o_la, None
            o_la = self.fusion(o_la)
        if self.hybrid_cfg.la_window:  # the window attention plus the fused GDN heads (la_window needs la_scale)
            o_window, window_cache = self._window(q, k, v, f, positions, cache, cache_index, segment_ids)
            o_la = o_window + o_la.astype(jnp.float32)
            if cache is not None:
                new_cache.update(window_cache)
        parts.append(o_la.astype(q.dtype))
        out = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        if self.hybrid_cfg.fusion == "both":
            if not fuse:
                return out, None
            out = self.fusion(out)
        return out, new_cache

    def window_outputs(self, x: jax.Array, positions: jax.Array, kind: int | None = None) -> jax.Array | None:
        """The LA heads' window attention [B,T,H_LA,D] float32 of a layer of this kind (no cache), or None without
        ``la_window``: the part of the LA heads' output the fusion's fit leaves out of its target."""
        kind = self.resolve_kind(kind)
        if not self.is_hybrid(kind) or not self.hybrid_cfg.la_window:
            return None
        q, k, v = self.project_heads(x)
        return self._window(q, k, v, kind, positions, None, None, None)[0]

    def _window(self, q, k, v, f: int, positions, cache, cache_index, segment_ids):
        """(window attention of the LA heads, their new window cache or None): q, k, v before RoPE, every head."""
        hc, fa_heads = self.hybrid_cfg, f * self.cfg.group_size
        q_la, k_la = self.rope(q[:, :, fa_heads:], positions), self.rope(k[:, :, f:], positions)
        v_la = v[:, :, f:]
        size = dict(window=hc.la_window, sinks=hc.la_sinks)
        if cache is not None and q.shape[1] == 1:
            return streaming.decode_step(q_la, k_la, v_la, cache, cache_index, scale=self.scale, **size)
        if q.shape[1] > 1 and sequence_axes():
            raise ValueError(
                "HybridConfig.la_window runs on whole rows: it has no context-parallel form yet; run with "
                "mesh.sequence=1, or la_window=0."
            )
        out = streaming.streaming_attention(
            q_la, k_la, v_la, scale=self.scale, positions=positions, segment_ids=segment_ids, **size
        )
        if cache is None:
            return out, None
        return out, streaming.fill_cache(cache, k_la, v_la, **size)

    def init_cache(self, batch: int, max_len: int, dtype, kind: int | None = None) -> LayerCache:
        """Cache of a layer of this kind: k, v [B, max_len, kind, D] for its FA groups (none when every group is
        LA), plus, with LA groups, gdn_state [B, H_LA, D, D] fp32 and conv_state [B, conv_size−1, C], and with
        ``la_window`` win_k, win_v [B, la_sinks + la_window, n_LA, D] (hybrid/window.py)."""
        kind = self.resolve_kind(kind)
        if not self.is_hybrid(kind):
            return super().init_cache(batch, max_len, dtype)
        cache: LayerCache = {}
        if kind:
            shape = (batch, max_len, kind, self.cfg.head_dim)
            cache.update(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
        n = self.cfg.num_kv_heads - kind  # the cache depends on shapes only: an abstract module of n groups
        cache.update(abstract_gdn_heads(self.cfg, self.hybrid_cfg, n).init_cache(batch, dtype))
        if self.hybrid_cfg.la_window:
            hc = self.hybrid_cfg
            cache.update(
                streaming.init_cache(batch, n, self.cfg.head_dim, window=hc.la_window, sinks=hc.la_sinks, dtype=dtype)
            )
        return cache


def group_order(fa_groups, num_kv_heads: int) -> tuple[int, ...]:
    """The stored KV-group order of a layer with these FA groups: its FA groups, then its LA groups (each
    sorted); stored group j is original group ``group_order[j]``."""
    fa = sorted(int(g) for g in fa_groups)
    return tuple(fa) + tuple(g for g in range(num_kv_heads) if g not in fa)


def group_columns(order: tuple[int, ...], heads_per_group: int, head_dim: int) -> np.ndarray:
    """Indices into a [.., groups·heads_per_group·head_dim] axis laid out group-major that list the entries of
    the groups in ``order``: the stored position p holds original entry ``group_columns(order)[p]``."""
    width = heads_per_group * head_dim
    return np.concatenate([np.arange(g * width, (g + 1) * width) for g in order])


# The layer-stacked projection parameters (leading axis L) whose entries lie group-major along one axis, with each
# layer's KV groups in its stored order (FA groups first): {path under a layer: (that axis, "q" when it holds the
# group's query heads, "kv" when its one KV head)} — q/k/v columns and biases, o_proj rows.
GROUPED_PARAMS = {
    ("self_attn", "q_proj", "kernel"): (2, "q"),
    ("self_attn", "q_proj", "bias"): (1, "q"),
    ("self_attn", "k_proj", "kernel"): (2, "kv"),
    ("self_attn", "k_proj", "bias"): (1, "kv"),
    ("self_attn", "v_proj", "kernel"): (2, "kv"),
    ("self_attn", "v_proj", "bias"): (1, "kv"),
    ("self_attn", "o_proj", "kernel"): (1, "q"),
}


def permute_groups(layers_state: nnx.State, cfg: ModelConfig, orders) -> nnx.State:
    """Layer-stacked parameters (``Transformer.layers``' state, leading axis L) with layer l's KV groups in
    ``orders[l]``: stored group j = original group orders[l][j] in the q/k/v kernels' columns and biases and in
    o_proj's rows, each group's query heads with it. Exact (a permutation of the heads, and the sum over heads in
    o_proj is over the same terms); q/k norms act per dimension and stay."""
    index = {
        "q": np.stack([group_columns(o, cfg.group_size, cfg.head_dim) for o in orders]),  # [L, Hq·D]
        "kv": np.stack([group_columns(o, 1, cfg.head_dim) for o in orders]),  # [L, Hkv·D]
    }

    def permute(path, a):
        key = tuple(str(p) for p in path)
        if key not in GROUPED_PARAMS:
            return a
        axis, heads = GROUPED_PARAMS[key]
        idx = index[heads]
        shape = [idx.shape[0]] + [1] * (a.ndim - 1)
        shape[axis] = idx.shape[1]
        return jnp.take_along_axis(a, jnp.asarray(idx.reshape(shape)), axis=axis)

    return map_arrays(permute, layers_state)

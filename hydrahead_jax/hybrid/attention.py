"""The HydraHead attention block: a teacher attention layer whose KV groups are split into softmax (FA) groups and
Gated DeltaNet (LA) groups, recombined by scale-normalised fusion before the teacher's o_proj.

A *KV group* g is KV head g together with query heads g·G … g·G+G−1 (G = num_heads / num_kv_heads). The head map
gives each layer its FA groups; every other group is LA:

    q, k, v = teacher projections (+ q/k norm)                     [B,T,Hq,D], [B,T,Hkv,D]
    o_FA = softmax attention(RoPE(q_FA), RoPE(k_FA), v_FA)          KV cache for FA groups only
    o_LA = GatedDeltaNet(x, q_LA, k_LA, v_LA)                       constant-size state (hybrid/gdn.py)
    o    = fusion(concat(o_FA, o_LA) in original head order)       (hybrid/fusion.py)
    out  = o · W_o                                                  the teacher's o_proj

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
and, with the conv, conv_state [B, conv_size−1, C] for the LA groups.

A layer whose groups are all FA is the teacher's layer unchanged (no GDN, no fusion), whatever the HybridConfig
says; its parameters are exactly the teacher's. The block subclasses the teacher's ``Attention``, so parameter
paths (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, plus gdn and fusion) match the teacher's and checkpoints of
either load into the other's shared parameters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.gdn import GatedDeltaNetHeads, gated_rms_norm_grads
from hydrahead_jax.models.attention import Attention, HeadProbe, LayerCache, check_segments
from hydrahead_jax.models.layers import rms_normalize


def group_heads(groups: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Query-head indices of the given KV groups, in order."""
    return tuple(g * group_size + j for g in groups for j in range(group_size))


def take_heads(x: jax.Array, heads: tuple[int, ...]) -> jax.Array:
    """x[:, :, heads] with static indices: a slice when they are contiguous, a gather otherwise."""
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        return jax.lax.slice_in_dim(x, heads[0], heads[0] + len(heads), axis=2)
    return jnp.take(x, np.asarray(heads), axis=2)


class ScaleFusion(nnx.Module):
    """A learnable γ (plus, with ``bias``, a learnable offset μ [H, D], zero at construction) for the query heads
    ``heads`` (original indices, sorted), after a per-head RMS normalisation when ``normalize``."""

    def __init__(
        self,
        heads: tuple[int, ...],
        head_dim: int,
        *,
        granularity: str,
        eps: float,
        param_dtype,
        bias: bool = False,
        normalize: bool = True,
    ):
        self.heads = tuple(heads)
        self.granularity = granularity
        self.eps = eps
        self.normalize = normalize
        shape = (len(heads),) if granularity == "head" else (len(heads), head_dim)
        self.gamma = nnx.Param(
            jnp.ones(shape, param_dtype), out_sharding=("norm",) + (None,) * (len(shape) - 1), eager_sharding=False
        )
        if bias:
            self.mu = nnx.Param(
                jnp.zeros((len(heads), head_dim), param_dtype), out_sharding=("norm", None), eager_sharding=False
            )
        else:
            self.mu = None

    def __call__(self, o: jax.Array) -> jax.Array:
        """o [B,T,len(heads),D], the touched heads in the order of ``heads`` → same shape and dtype."""
        gamma = self.gamma[...]
        gamma = gamma[:, None] if self.granularity == "head" else gamma
        mu = None if self.mu is None else self.mu[...]
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


class HydraHeadAttention(Attention):
    """The teacher's attention with the KV groups not in ``fa_groups`` run as Gated DeltaNet heads (submodule
    ``gdn``) and head outputs fused (submodule ``fusion``); ``fa_groups`` = every group gives the teacher's layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        fa_groups: tuple[int, ...],
        hybrid_cfg: HybridConfig | None = None,
        attention_impl: str = "auto",
        context_parallel: str = "allgather",
    ):
        super().__init__(cfg, rngs=rngs, attention_impl=attention_impl, context_parallel=context_parallel)
        all_groups = tuple(range(cfg.num_kv_heads))
        self.fa_groups = tuple(sorted(int(g) for g in fa_groups))
        bad = [g for g in self.fa_groups if not 0 <= g < cfg.num_kv_heads]
        if bad or len(set(self.fa_groups)) != len(self.fa_groups):
            raise ValueError(
                f"fa_groups={tuple(fa_groups)} must be distinct KV group indices in [0, {cfg.num_kv_heads})."
            )
        self.la_groups = tuple(g for g in all_groups if g not in self.fa_groups)
        if self.la_groups and hybrid_cfg is None:
            raise ValueError(
                f"fa_groups={self.fa_groups} leaves KV groups {self.la_groups} without softmax "
                "attention; pass hybrid_cfg=HybridConfig(...) to run them as Gated DeltaNet heads."
            )
        # A layer without LA groups is the teacher's layer: nothing to fuse, so no hybrid machinery.
        self.hybrid_cfg = hybrid_cfg if self.la_groups else None
        if self.hybrid_cfg is None:
            return
        hc = self.hybrid_cfg
        self.fa_heads = group_heads(self.fa_groups, cfg.group_size)
        self.la_heads = group_heads(self.la_groups, cfg.group_size)
        # concat(o_FA, o_LA)[..., order[h], :] is head h in the original order.
        self.head_order = tuple(int(i) for i in np.argsort(np.asarray(self.fa_heads + self.la_heads)))
        self.gdn = GatedDeltaNetHeads(cfg, hc, self.la_groups, rngs=rngs)
        if hc.fusion != "none":
            heads = tuple(range(cfg.num_heads)) if hc.fusion == "both" else self.la_heads
            self.fusion = ScaleFusion(
                heads,
                cfg.head_dim,
                granularity=hc.fusion_granularity,
                eps=cfg.rms_norm_eps,
                param_dtype=cfg.jnp_param_dtype,
                bias=hc.fusion_bias,
                normalize=hc.fusion != "la_scale",
            )
        else:
            self.fusion = None

    def head_outputs(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache | None = None,
        cache_index: jax.Array | None = None,
        probe: HeadProbe | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """All head outputs [B,T,Hq,D] in the original order, before o_proj (and the new cache). With
        ``segment_ids`` (packed documents) the FA groups attend within each document and the GDN heads restart
        their state and conv at each document start."""
        if self.hybrid_cfg is None:
            return super().head_outputs(x, positions, cache, cache_index, probe, segment_ids)
        if probe is not None:
            raise ValueError("head-selection probes run on the teacher, not on a HydraHead student.")
        check_segments(segment_ids, cache, probe)
        return self._fused_outputs(x, positions, cache, cache_index, segment_ids, fuse=True)

    def fusion_inputs(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """What the fusion receives, in the order of ``fusion.heads`` (no cache): the LA heads' outputs for
        ``la_scale`` and ``la_only``, every head's for ``both``; [B,T,len(fusion.heads),D]. The fusion's calibration fits γ, μ on it."""
        if getattr(self, "fusion", None) is None:
            raise ValueError("this layer has no fusion (fusion='none', or every KV group is FA).")
        return self._fused_outputs(x, positions, None, None, None, fuse=False)[0]

    def _fused_outputs(self, x, positions, cache, cache_index, segment_ids, *, fuse: bool):
        """``head_outputs`` of a hybrid layer; ``fuse=False`` returns the fusion's input instead (no cache)."""
        q, k, v = self.project_heads(x)
        new_cache = None if cache is None else dict(cache)
        parts = []
        if self.fa_groups:
            q_fa = self.rope(take_heads(q, self.fa_heads), positions)
            k_fa = self.rope(take_heads(k, self.fa_groups), positions)
            fa_cache = None if cache is None else {"k": cache["k"], "v": cache["v"]}
            o_fa, fa_cache = self.full_attention(
                q_fa, k_fa, take_heads(v, self.fa_groups), fa_cache, cache_index, segment_ids
            )
            parts.append(o_fa)
            if cache is not None:
                new_cache.update(fa_cache)
        la_cache = None if cache is None else {key: cache[key] for key in ("gdn_state", "conv_state") if key in cache}
        o_la, la_cache = self.gdn(
            x,
            take_heads(q, self.la_heads),
            take_heads(k, self.la_groups),
            take_heads(v, self.la_groups),
            positions,
            la_cache,
            segment_ids=segment_ids,
        )
        if cache is not None:
            new_cache.update(la_cache)
        if self.hybrid_cfg.fusion in ("la_scale", "la_only"):  # the FA heads pass through as the teacher's
            if not fuse:
                return o_la, None
            o_la = self.fusion(o_la)
        parts.append(o_la.astype(q.dtype))
        out = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        if self.fa_groups:
            out = take_heads(out, self.head_order)
        if self.hybrid_cfg.fusion == "both":
            if not fuse:
                return out, None
            out = self.fusion(out)
        return out, new_cache

    def init_cache(self, batch: int, max_len: int, dtype) -> LayerCache:
        """k, v [B, max_len, n_FA, D] for the FA groups (none when every group is LA), plus, in a layer with LA
        groups, gdn_state [B, H_LA, D, D] fp32 and conv_state [B, conv_size−1, C]."""
        if self.hybrid_cfg is None:
            return super().init_cache(batch, max_len, dtype)
        cache: LayerCache = {}
        if self.fa_groups:
            shape = (batch, max_len, len(self.fa_groups), self.cfg.head_dim)
            cache.update(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
        cache.update(self.gdn.init_cache(batch, dtype))
        return cache

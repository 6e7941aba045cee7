"""Grouped-query attention over the teacher's q/k/v/o projections: the teacher's softmax attention, and the
HydraHead hybrid block of a student.

A *KV group* g is KV head g together with query heads g·G … g·G+G−1 (G = num_heads / num_kv_heads). The teacher
runs full attention (FA) on every group. A HydraHead layer (``hybrid_cfg`` given, ``fa_groups`` a strict subset)
splits the groups:

    q, k, v = teacher projections (+ q/k norm)                     [B,T,Hq,D], [B,T,Hkv,D]
    o_FA = softmax attention(RoPE(q_FA), RoPE(k_FA), v_FA)          KV cache for FA groups only
    o_LA = GatedDeltaNet(x, q_LA, k_LA, v_LA)                       constant-size state (hybrid/gdn.py)
    o    = fusion(concat(o_FA, o_LA) in original head order)       (hybrid/fusion.py)
    out  = o · W_o                                                  the teacher's o_proj

A layer whose groups are all FA is the teacher's layer unchanged (no fusion), whatever ``hybrid_cfg`` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.models.layers import RMSNorm, apply_rope, dense
from pallas_kernels.flash_attention import flash_attention

if TYPE_CHECKING:
    from hydrahead_jax.hybrid.config import HybridConfig

LayerCache = dict[str, Any]


def group_heads(groups: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Query-head indices of the given KV groups, in order."""
    return tuple(g * group_size + j for g in groups for j in range(group_size))


def take_heads(x: jax.Array, heads: tuple[int, ...]) -> jax.Array:
    """x[:, :, heads] with static indices: a slice when they are contiguous, a gather otherwise."""
    if heads == tuple(range(heads[0], heads[0] + len(heads))):
        return jax.lax.slice_in_dim(x, heads[0], heads[0] + len(heads), axis=2)
    return jnp.take(x, np.asarray(heads), axis=2)


def cached_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, scale: float
) -> jax.Array:
    """Softmax attention of a few new queries q [B,T,Hq,D] against a cache [B,S,Hkv,D] holding ``length`` valid keys.

    The T new queries sit at positions length−T … length−1: query t sees keys j ≤ length − T + t. Scores are
    [B, Hq, T, S] — cheap for decoding (T = 1); long prompts go through ``flash_attention`` instead.
    """
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache.astype(jnp.float32)) * scale
    key_pos = jnp.arange(k_cache.shape[1])
    query_pos = length - t + jnp.arange(t)
    visible = key_pos[None, :] <= query_pos[:, None]  # [T, S]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


class Attention(nnx.Module):
    """Teacher attention: q/k/v projections (+ Qwen2 biases, Qwen3 q/k RMSNorm), RoPE, GQA softmax, o_proj.

    With ``hybrid_cfg`` and ``fa_groups`` a strict subset of the KV groups it is the HydraHead block: the other
    groups run Gated DeltaNet (submodule ``gdn``), outputs pass scale-normalised fusion (submodule ``fusion``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        fa_groups: tuple[int, ...] | None = None,
        attention_impl: str = "auto",
        hybrid_cfg: HybridConfig | None = None,
    ):
        self.cfg = cfg
        self.attention_impl = attention_impl
        all_groups = tuple(range(cfg.num_kv_heads))
        self.fa_groups = all_groups if fa_groups is None else tuple(sorted(int(g) for g in fa_groups))
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
        kw = dict(rngs=rngs, param_dtype=cfg.jnp_param_dtype, dtype=cfg.jnp_dtype)
        d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = dense(d, h * hd, ("embed", "heads"), use_bias=cfg.attention_bias, **kw)
        self.k_proj = dense(d, hkv * hd, ("embed", "kv_heads"), use_bias=cfg.attention_bias, **kw)
        self.v_proj = dense(d, hkv * hd, ("embed", "kv_heads"), use_bias=cfg.attention_bias, **kw)
        self.o_proj = dense(h * hd, d, ("heads", "embed"), **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        if self.hybrid_cfg is not None:
            self._init_hybrid(rngs)

    def _init_hybrid(self, rngs: nnx.Rngs):
        # Imported here: hydrahead_jax.hybrid imports the model package, which imports this module.
        from hydrahead_jax.hybrid.fusion import ScaleFusion
        from hydrahead_jax.hybrid.gdn import GatedDeltaNetHeads

        cfg, hc = self.cfg, self.hybrid_cfg
        self.fa_heads = group_heads(self.fa_groups, cfg.group_size)
        self.la_heads = group_heads(self.la_groups, cfg.group_size)
        # concat(o_FA, o_LA)[..., order[h], :] is head h in the original order.
        self.head_order = tuple(int(i) for i in np.argsort(np.asarray(self.fa_heads + self.la_heads)))
        self.gdn = GatedDeltaNetHeads(cfg, hc, self.la_groups, rngs=rngs)
        if hc.fusion != "none":
            heads = self.la_heads if hc.fusion == "la_only" else tuple(range(cfg.num_heads))
            self.fusion = ScaleFusion(
                heads,
                cfg.head_dim,
                granularity=hc.fusion_granularity,
                eps=cfg.rms_norm_eps,
                param_dtype=cfg.jnp_param_dtype,
            )
        else:
            self.fusion = None

    @property
    def scale(self) -> float:
        return self.cfg.head_dim**-0.5

    def project_heads(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B,T,d] → q [B,T,Hq,D], k, v [B,T,Hkv,D], with q/k norm but before RoPE."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, theta=self.cfg.rope_theta, interleaved=self.cfg.rope_interleaved)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B,T,d] → q [B,T,Hq,D], k, v [B,T,Hkv,D], with q/k norm and RoPE applied to q and k."""
        q, k, v = self.project_heads(x)
        return self.rope(q, positions), self.rope(k, positions), v

    def full_attention(self, q, k, v, cache: LayerCache | None, cache_index) -> tuple[jax.Array, LayerCache | None]:
        """Softmax attention of the FA groups' heads; q [B,T,Hq_fa,D], k/v [B,T,Hkv_fa,D].

        Without a cache, or when filling an empty one (prefill, T > 1), it runs blockwise ``flash_attention``
        over the new tokens; a decode step (T == 1) writes its k/v at ``cache_index`` and attends to the cache.
        """
        t = q.shape[1]
        if cache is not None:
            new_k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), cache_index, 1)
            new_v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), cache_index, 1)
            cache = {**cache, "k": new_k, "v": new_v}
            if t == 1:
                return cached_attention(q, new_k, new_v, cache_index + t, self.scale), cache
        out = flash_attention(q, k, v, causal=True, scale=self.scale, implementation=self.attention_impl)
        return out, cache

    def __call__(
        self, x: jax.Array, positions: jax.Array, cache: LayerCache | None = None, cache_index: jax.Array | None = None
    ) -> tuple[jax.Array, LayerCache | None]:
        b, t, _ = x.shape
        if self.hybrid_cfg is not None:
            out, cache = self.hybrid_heads(x, positions, cache, cache_index)
            return self.o_proj(out.reshape(b, t, -1)), cache
        q, k, v = self.project(x, positions)
        out, cache = self.full_attention(q, k, v, cache, cache_index)
        return self.o_proj(out.reshape(b, t, -1)), cache

    def hybrid_heads(self, x, positions, cache: LayerCache | None, cache_index) -> tuple[jax.Array, LayerCache | None]:
        """HydraHead: all head outputs [B,T,Hq,D] in the original order, before o_proj (and the new cache)."""
        q, k, v = self.project_heads(x)
        new_cache = None if cache is None else dict(cache)
        parts = []
        if self.fa_groups:
            q_fa = self.rope(take_heads(q, self.fa_heads), positions)
            k_fa = self.rope(take_heads(k, self.fa_groups), positions)
            fa_cache = None if cache is None else {"k": cache["k"], "v": cache["v"]}
            o_fa, fa_cache = self.full_attention(q_fa, k_fa, take_heads(v, self.fa_groups), fa_cache, cache_index)
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
        )
        if cache is not None:
            new_cache.update(la_cache)
        if self.hybrid_cfg.fusion == "la_only":
            o_la = self.fusion(o_la)
        parts.append(o_la.astype(q.dtype))
        out = jnp.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        if self.fa_groups:
            out = take_heads(out, self.head_order)
        if self.hybrid_cfg.fusion == "both":
            out = self.fusion(out)
        return out, new_cache

    def init_cache(self, batch: int, max_len: int, dtype) -> LayerCache:
        """KV cache for the FA groups only: k, v [B, max_len, n_fa_groups, D]; plus, in a HydraHead layer, the LA
        groups' constant-size state: gdn_state [B, H_la, D, D] fp32 and conv_state [B, conv_size−1, C]."""
        cache: LayerCache = {}
        if self.fa_groups:
            shape = (batch, max_len, len(self.fa_groups), self.cfg.head_dim)
            cache.update(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
        if self.hybrid_cfg is not None:
            cache.update(self.gdn.init_cache(batch, dtype))
        return cache

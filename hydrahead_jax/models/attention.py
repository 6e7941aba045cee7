"""Grouped-query softmax attention over the teacher's q/k/v/o projections, with a KV cache for decoding.

A *KV group* g is KV head g together with query heads g·G … g·G+G−1 (G = num_heads / num_kv_heads). The module
runs full attention (FA) on the groups listed in ``fa_groups`` — all of them for the teacher — and keeps a decode
cache only for those groups. HydraHead students route the remaining groups through Gated DeltaNet heads.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.models.layers import RMSNorm, apply_rope, dense
from pallas_kernels.flash_attention import flash_attention

LayerCache = dict[str, Any]


def group_heads(groups: tuple[int, ...], group_size: int) -> tuple[int, ...]:
    """Query-head indices of the given KV groups, in order."""
    return tuple(g * group_size + j for g in groups for j in range(group_size))


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array,
                     scale: float) -> jax.Array:
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
    """Teacher attention: q/k/v projections (+ Qwen2 biases, Qwen3 q/k RMSNorm), RoPE, GQA softmax, o_proj."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fa_groups: tuple[int, ...] | None = None,
                 attention_impl: str = "auto"):
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.fa_groups = tuple(range(cfg.num_kv_heads)) if fa_groups is None else tuple(fa_groups)
        kw = dict(rngs=rngs, param_dtype=cfg.jnp_param_dtype, dtype=cfg.jnp_dtype)
        d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = dense(d, h * hd, ("embed", "heads"), use_bias=cfg.attention_bias, **kw)
        self.k_proj = dense(d, hkv * hd, ("embed", "kv_heads"), use_bias=cfg.attention_bias, **kw)
        self.v_proj = dense(d, hkv * hd, ("embed", "kv_heads"), use_bias=cfg.attention_bias, **kw)
        self.o_proj = dense(h * hd, d, ("heads", "embed"), **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)

    @property
    def scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B,T,d] → q [B,T,Hq,D], k, v [B,T,Hkv,D], with q/k norm and RoPE applied to q and k."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = dict(theta=cfg.rope_theta, interleaved=cfg.rope_interleaved)
        return apply_rope(q, positions, **rope), apply_rope(k, positions, **rope), v

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

    def __call__(self, x: jax.Array, positions: jax.Array, cache: LayerCache | None = None,
                 cache_index: jax.Array | None = None) -> tuple[jax.Array, LayerCache | None]:
        b, t, _ = x.shape
        q, k, v = self.project(x, positions)
        out, cache = self.full_attention(q, k, v, cache, cache_index)
        return self.o_proj(out.reshape(b, t, -1)), cache

    def init_cache(self, batch: int, max_len: int, dtype) -> LayerCache:
        """KV cache for the FA groups only: k, v [B, max_len, n_fa_groups, D]."""
        shape = (batch, max_len, len(self.fa_groups), self.cfg.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

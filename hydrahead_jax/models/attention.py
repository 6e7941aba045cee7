"""The teacher's grouped-query attention over its q/k/v/o projections, and the dense reference softmax attention.

    q, k, v = x W_q, x W_k, x W_v (+ Qwen2 biases, + Qwen3 per-head q/k RMSNorm)   [B,T,Hq,D], [B,T,Hkv,D]
    o_h     = softmax_j(RoPE(q)_h · RoPE(k)_{h//G, j} · D^-½, j ≤ t) · v_{h//G}    per query head h, G = Hq / Hkv
    out     = concat_h(o_h) · W_o

``Attention.head_outputs`` returns the per-head outputs o [B,T,Hq,D] before o_proj: the one place they are
computed. ``__call__`` is o_proj of it; fusion calibration reads it; a ``HeadProbe`` (head selection) reads the
attention probabilities through it and may replace heads' outputs before o_proj. The HydraHead block
(``hydrahead_jax.hybrid.attention``) is a subclass that overrides ``head_outputs``; this module knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.context_parallel.attention import check_mode, sequence_parallel_attention
from hydrahead_jax.context_parallel.layout import MODEL_LAYOUT, from_layout
from hydrahead_jax.models.kernel_sharding import BS, BSHD, BT, BTHD, kernel_call, sequence_axes
from hydrahead_jax.models.layers import RMSNorm, apply_rope, dense
from pallas_kernels.flash_attention import flash_attention

LayerCache = dict[str, Any]
# The entries of a layer cache indexed by token along axis 1 ([B, S, …]: the FA groups' keys and values); every
# other entry is a constant-size state that each call replaces whole.
TOKEN_CACHE_KEYS = ("k", "v")


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, query_positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Causal GQA softmax attention with the whole score matrix: the reference the decode path and probes share.

    q [B,T,Hq,D] sits at ``query_positions`` ([T] or [B,T]); k, v [B,S,Hkv,D] hold keys at positions 0 … S−1.
    Query t sees key j when j ≤ query_positions[t]; query head h reads KV head h // (Hq/Hkv):

        probs_{h,t,j} = softmax_j(q_{t,h} · k_{j,h//G} · scale  masked to j ≤ p_t),   out_{t,h} = Σ_j probs_{h,t,j} v_j

    Returns (out [B,T,Hq,D], probs [B,Hq,T,S]), both float32. Scores are [B,Hq,T,S]: cheap for decoding (T = 1) and
    for probing short prompts; training and long prefills use the blockwise ``flash_attention``.
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, hkv, hq // hkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    query_positions = jnp.asarray(query_positions)
    if query_positions.ndim == 1:
        query_positions = query_positions[None]
    visible = jnp.arange(s)[None, None, :] <= query_positions[:, :, None]  # [B or 1, T, S]
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d), probs.reshape(b, hq, t, s)


def cached_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, length: jax.Array, scale: float
) -> jax.Array:
    """Softmax attention of a few new queries q [B,T,Hq,D] against a cache [B,S,Hkv,D] holding ``length`` valid keys.

    The T new queries sit at positions length−T … length−1 (``dense_attention`` with those query positions); the
    output has q's dtype.
    """
    t = q.shape[1]
    out, _ = dense_attention(q, k_cache, v_cache, scale, length - t + jnp.arange(t))
    return out.astype(q.dtype)


def check_segments(segment_ids: jax.Array | None, cache: LayerCache | None, probe: HeadProbe | None) -> None:
    """Packed documents (``segment_ids`` [B,T], one id per document in a row) are a training-time layout: a row
    holds several whole documents, each attended on its own. Decoding (a cache) and the selection probes run one
    sequence per row, so they take no segment ids; refuse the combinations instead of ignoring the ids."""
    if segment_ids is None:
        return
    if cache is not None:
        raise ValueError(
            "segment_ids (packed documents) cannot be combined with a KV/state cache: prefill and decode one "
            "document per row (pass segment_ids=None)."
        )
    if probe is not None:
        raise ValueError("head-selection probes run one sequence per row; call them with segment_ids=None.")
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids must be [batch, time] int32; got shape {segment_ids.shape}.")


@dataclasses.dataclass
class HeadProbe:
    """An intervention on the teacher's attention, for head-selection probes (``Block(..., probe=HeadProbe(...))``).

    With a probe the layer attends (with ``dense_attention`` when it records or has a context) and then

        o_h ← keep_h · o_h + (1 − keep_h) · fill_h        before o_proj

    keep: broadcastable to [B,T,Hq] (1 keeps a head's output, 0 replaces it); None keeps every head.
    fill: broadcastable to [B,T,Hq,D], the replacement (zeros: zero-ablation; a mean output: mean-ablation).
    context: None when the tokens are the whole sequence. Otherwise the post-RoPE keys and values (k, v
        [B,S,Hkv,D]) of a whole sequence the tokens belong to; the tokens, at ``positions`` in it, write their own
        keys/values there and attend to it causally (re-running a few rows of a sequence against its clean pass).
    record: when a dict, receives "k", "v" (the tokens' post-RoPE keys/values), "probs" [B,Hq,T,S] and "heads"
        (the per-head outputs after the replacement, float32).
    """

    keep: jax.Array | None = None
    fill: jax.Array | None = None
    context: tuple[jax.Array, jax.Array] | None = None
    record: dict | None = None

    def run(self, attn: Attention, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array) -> jax.Array:
        """q [B,T,Hq,D], k/v [B,T,Hkv,D] after RoPE → the edited per-head outputs [B,T,Hq,D] (float32).

        The dense reference attention when probabilities are recorded or a context is given; otherwise the
        layer's own blockwise attention, so an intervention alone keeps no [T, S] score matrix.
        """
        if self.record is None and self.context is None:
            heads = attn.full_attention(q, k, v, None, None)[0].astype(jnp.float32)
        else:
            k_all, v_all = k, v
            if self.context is not None:
                rows = jnp.arange(q.shape[0])[:, None]
                k_all = self.context[0].at[rows, positions].set(k.astype(self.context[0].dtype))
                v_all = self.context[1].at[rows, positions].set(v.astype(self.context[1].dtype))
            heads, probs = dense_attention(q, k_all, v_all, attn.scale, positions)
        if self.keep is not None:
            keep = jnp.asarray(self.keep, jnp.float32)[..., None]
            fill = 0.0 if self.fill is None else jnp.asarray(self.fill, jnp.float32)
            heads = heads * keep + fill * (1.0 - keep)
        if self.record is not None:
            self.record.update(k=k, v=v, probs=probs, heads=heads)
        return heads


class Attention(nnx.Module):
    """Teacher attention: q/k/v projections (+ Qwen2 biases, Qwen3 q/k RMSNorm), RoPE, GQA softmax, o_proj.

    attention_impl: the ``flash_attention`` backend. context_parallel: how softmax attention gets its keys when the
    tokens are split over the ``sequence`` mesh axis ("allgather" or "ring"; ``sequence_parallel_attention``).
    """

    # Under a sequence mesh the block hands this module its row in the sharded token order (the model's
    # ``SHARDED_ORDER_ATTR``): full_attention and the GDN heads run their context-parallel kernels on it.
    takes_sharded_order = True

    def __init__(
        self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention_impl: str = "auto", context_parallel: str = "allgather"
    ):
        check_mode(context_parallel)
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.context_parallel = context_parallel
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
        """RoPE of the config, with its scaling (``ModelConfig.rope_scaling``), on q or k heads [B,T,H,D]."""
        cfg = self.cfg
        return apply_rope(
            x, positions, theta=cfg.rope_theta, interleaved=cfg.rope_interleaved, scaling=cfg.rope_scaling
        )

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B,T,d] → q [B,T,Hq,D], k, v [B,T,Hkv,D], with q/k norm and RoPE applied to q and k."""
        q, k, v = self.project_heads(x)
        return self.rope(q, positions), self.rope(k, positions), v

    def full_attention(
        self, q, k, v, cache: LayerCache | None, cache_index, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, LayerCache | None]:
        """Softmax attention of q [B,T,Hq',D] over k/v [B,T,Hkv',D] (any whole number of KV groups).

        Without a cache, or when filling an empty one (prefill, T > 1), it runs blockwise ``flash_attention``
        over the new tokens (per device, inside ``shard_map`` over the mesh axes of batch and heads when traced
        under a mesh: ``kernel_call``); a decode step (T == 1) writes its k/v at ``cache_index`` and attends to the
        cache. ``segment_ids`` [B,T] (packed documents, no cache): a token attends only to the earlier tokens of
        its own segment.

        Context parallelism (``sequence_axes()`` non-empty and T > 1): q/k/v are in the sharded token order
        (``MODEL_LAYOUT``) and ``sequence_parallel_attention`` runs per device with ``self.context_parallel``; the
        outputs stay in that order, and a cache is filled with the keys/values in natural order, as unsharded.
        """
        t = q.shape[1]
        axes = sequence_axes() if t > 1 else ()
        if cache is not None:
            k_new, v_new = k, v
            if axes:  # the cache is not split over the sequence: it holds the tokens in natural order
                mesh = jax.sharding.get_abstract_mesh()
                n = math.prod(mesh.shape[a] for a in axes)
                k_new, v_new = from_layout(k, n, MODEL_LAYOUT), from_layout(v, n, MODEL_LAYOUT)
            new_k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k_new.astype(cache["k"].dtype), cache_index, 1)
            new_v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v_new.astype(cache["v"].dtype), cache_index, 1)
            cache = {**cache, "k": new_k, "v": new_v}
            if t == 1:
                return cached_attention(q, new_k, new_v, cache_index + t, self.scale), cache
        if axes:
            kernel = functools.partial(
                sequence_parallel_attention,
                axis_name=axes,
                layout=MODEL_LAYOUT,
                mode=self.context_parallel,
                scale=self.scale,
                implementation=self.attention_impl,
            )
            out = kernel_call(
                kernel,
                *(q, k, v, segment_ids),
                in_axes=(BSHD, BSHD, BSHD, None if segment_ids is None else BS),
                out_axes=BSHD,
            )
            return out, cache
        kernel = functools.partial(flash_attention, causal=True, scale=self.scale, implementation=self.attention_impl)
        out = kernel_call(
            lambda q, k, v, segment_ids: kernel(q, k, v, segment_ids=segment_ids),
            *(q, k, v, segment_ids),
            in_axes=(BTHD, BTHD, BTHD, None if segment_ids is None else BT),
            out_axes=BTHD,
        )
        return out, cache

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
        """Per-head outputs o [B,T,Hq,D] before o_proj (and the new cache), for x [B,T,d] at ``positions``.

        With a ``probe`` (no cache) the probe runs the attention (``HeadProbe.run``) and may edit the outputs.
        ``segment_ids`` [B,T]: packed documents (see ``check_segments``); ``positions`` are then per document.
        ``kind``: the layer's static kind in a stack of layers (``Transformer.layer_kinds``, its FA-group count);
        the teacher's attention runs every group as softmax and ignores it.
        """
        check_segments(segment_ids, cache, probe)
        if probe is not None and x.shape[1] > 1 and sequence_axes():
            raise ValueError(
                "head-selection probes run unsharded: trace them without a sequence mesh axis (mesh sequence=1)."
            )
        q, k, v = self.project(x, positions)
        if probe is None:
            return self.full_attention(q, k, v, cache, cache_index, segment_ids)
        if cache is not None:
            raise ValueError("a HeadProbe runs on whole sequences (or rows of one via its context), not with a cache.")
        return probe.run(self, q, k, v, positions).astype(q.dtype), None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: LayerCache | None = None,
        cache_index: jax.Array | None = None,
        probe: HeadProbe | None = None,
        segment_ids: jax.Array | None = None,
        kind: int | None = None,
        heads_out: dict | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """(o_proj of ``head_outputs``, the new cache); ``heads_out`` (a dict) also receives the head outputs
        [B,T,Hq,D] before o_proj as "heads" (in the module's stored head order)."""
        b, t, _ = x.shape
        heads, cache = self.head_outputs(x, positions, cache, cache_index, probe, segment_ids, kind)
        if heads_out is not None:
            heads_out["heads"] = heads
        return self.o_proj(heads.reshape(b, t, -1)), cache

    def init_cache(self, batch: int, max_len: int, dtype, kind: int | None = None) -> LayerCache:
        """KV cache: k, v [B, max_len, Hkv, D]."""
        shape = (batch, max_len, self.cfg.num_kv_heads, self.cfg.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

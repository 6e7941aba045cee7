"""Blockwise (FlashAttention-2 style) attention in plain XLA: never materialises the [T, S] scores.

Forward, per query block Q_i (a `lax.map` over blocks) and key blocks K_j (a `fori_loop` whose upper
bound skips the blocks a causal mask hides entirely):
  s = scale · Q_i K_jᵀ (masked),   m' = max(m, rowmax s),   l' = e^{m-m'} l + rowsum e^{s-m'},
  acc' = e^{m-m'} acc + e^{s-m'} V_j;          O_i = acc / l,   lse_i = m + log l.
Backward recomputes P = exp(s - lse) block by block from the saved (O, lse) only:
  dV_j = Σ_i P_ijᵀ dO_i,   dP = dO_i V_jᵀ,   dS = P ∘ (dP − Δ_i) with Δ_i = rowsum(dO_i ∘ O_i),
  dQ_i = scale Σ_j dS K_j,   dK_j = scale Σ_i dSᵀ Q_i,
in two passes (dQ: map over query blocks; dK/dV: map over key blocks) so that nothing larger than one
[bq, bk] tile per head is ever alive. GQA keeps q as [B, T, Hkv, G, D]: the G query heads of a KV head
share its K/V tile and dK/dV sum over G inside the einsum — K/V are never repeated in memory.

Segment ids (packed documents) add `q_seg[b, i] == kv_seg[b, j]` to the mask, and narrow each loop to the
blocks whose segment-id ranges meet those of the mapped block (_common.segment_tile_spans, joined over the
batch since one block holds every row): with sorted ids a ~500-token document at 8K reads only its own
one or two key blocks. A query with no visible key has m = MASK_VALUE or -inf and outputs 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention._common import MASK_VALUE, cdiv, has_visible_key, pad_axis, segment_tile_spans

_F32 = jnp.float32


def _visible(q_pos, k_pos, *, causal: bool, q_offset: int, kv_len: int, q_seg=None, k_seg=None):
    """Bool mask broadcastable to the [B, Hkv, G, bq, bk] scores: key k_pos is a real (unpadded) key that query
    q_pos may attend to ([bq, bk]; [B, 1, 1, bq, bk] with the blocks' segment ids q_seg [B, bq], k_seg [B, bk])."""
    ok = (k_pos < kv_len)[None, :]
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + q_offset)
    if q_seg is not None:
        ok = ok & (q_seg[:, :, None] == k_seg[:, None, :])[:, None, None]
    return ok


def _segment_spans(q_seg, kv_seg, *, bq, bk, nq, nk):
    """Segment spans (see _common.segment_tile_spans) joined over the batch: (k_lo, k_hi) [nq] and (q_lo, q_hi)
    [nk]; None without segment ids. An empty span stays empty ([n, 0)) instead of widening the others to 0."""
    if q_seg is None:
        return None
    spans = segment_tile_spans(q_seg, kv_seg, bq=bq, bk=bk, tp=nq * bq, sp=nk * bk)

    def join(lo, hi, n):
        return jnp.where(hi > lo, lo, n).min(0), hi.max(0)

    return join(*spans[0], nk), join(*spans[1], nq)


def _blocked_ids(seg, block, n):
    """[B, L] ids -> [B, n, block] (zero-padded: padded rows/keys are sliced off or masked by length)."""
    return None if seg is None else pad_axis(seg, 1, n * block).reshape(seg.shape[0], n, block)


def _num_k_blocks(i, *, bq: int, bk: int, nk: int, causal: bool, q_offset: int):
    """Key blocks query block i needs: all of them, or (causal) up to the one holding its last key."""
    if not causal:
        return nk
    return jnp.minimum(nk, (i * bq + bq - 1 + q_offset) // bk + 1)


def _first_q_block(j, *, bq: int, bk: int, causal: bool, q_offset: int):
    """First query block that sees any key of key block j (causal); 0 otherwise."""
    if not causal:
        return 0
    return jnp.maximum(0, j * bk - q_offset) // bq


def _forward(q, k, v, q_seg, kv_seg, *, scale, causal, q_offset, bq, bk):
    """q [B,T,Hkv,G,D], k/v [B,S,Hkv,D], segment ids [B,T] / [B,S] or None
    -> (out [B,T,Hkv,G,D] in q.dtype, lse [B,Hkv,G,T] fp32)."""
    b, t, hkv, g, d = q.shape
    s = k.shape[1]
    nq, nk = cdiv(t, bq), cdiv(s, bk)
    qb = pad_axis(q, 1, nq * bq).reshape(b, nq, bq, hkv, g, d).swapaxes(0, 1)
    kb = pad_axis(k, 1, nk * bk).reshape(b, nk, bk, hkv, d)
    vb = pad_axis(v, 1, nk * bk).reshape(b, nk, bk, hkv, d)
    qsb, ksb = _blocked_ids(q_seg, bq, nq), _blocked_ids(kv_seg, bk, nk)
    spans = _segment_spans(q_seg, kv_seg, bq=bq, bk=bk, nq=nq, nk=nk)

    def q_block(args):
        i, q_i = args  # q_i [B, bq, Hkv, G, D]
        q_pos = i * bq + jnp.arange(bq)
        q_seg_i = None if qsb is None else qsb[:, i]

        def body(j, carry):
            m, l, acc = carry
            k_j, v_j = kb[:, j], vb[:, j]  # [B, bk, Hkv, D]
            sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
            k_seg_j = None if ksb is None else ksb[:, j]
            vis = _visible(
                q_pos, j * bk + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=s, q_seg=q_seg_i, k_seg=k_seg_j
            )
            sc = jnp.where(vis, sc, MASK_VALUE)
            m_new = jnp.maximum(m, sc.max(-1))
            corr = jnp.exp(m - m_new)
            p = jnp.exp(sc - m_new[..., None])
            l = corr * l + p.sum(-1)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v_j, preferred_element_type=_F32)
            return m_new, l, corr[..., None] * acc + pv

        init = (
            jnp.full((b, hkv, g, bq), -jnp.inf, _F32),
            jnp.zeros((b, hkv, g, bq), _F32),
            jnp.zeros((b, hkv, g, bq, d), _F32),
        )
        lo, hi = 0, _num_k_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset)
        if spans is not None:
            lo, hi = spans[0][0][i], jnp.minimum(hi, spans[0][1][i])
        m, l, acc = lax.fori_loop(lo, hi, body, init)
        if spans is None:
            # Every row sees key 0 (q_offset >= 0), so l >= 1 for real rows; padded rows are sliced off.
            out = acc / l[..., None]
        else:  # a query of a segment absent from the keys it may see outputs 0
            out = jnp.where(has_visible_key(m)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return jnp.moveaxis(out.astype(q.dtype), 3, 1), m + jnp.log(l)  # [B,bq,Hkv,G,D], [B,Hkv,G,bq]

    out, lse = lax.map(q_block, (jnp.arange(nq), qb))
    out = out.swapaxes(0, 1).reshape(b, nq * bq, hkv, g, d)[:, :t]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, nq * bq)[..., :t]
    return out, lse


def _backward(q, k, v, q_seg, kv_seg, out, lse, do, *, scale, causal, q_offset, bq_dq, bk_dq, bq_dkv, bk_dkv):
    """Recomputing backward. Shapes as in _forward; returns (dq, dk, dv) in the input dtypes. Entries of P that
    the mask hides are zeroed by the select, whatever lse holds for a query without visible keys."""
    b, t, hkv, g, d = q.shape
    s = k.shape[1]
    # Δ = rowsum(dO ∘ O): the softmax-Jacobian term, one fp32 number per query row.
    delta = jnp.einsum("bthgd,bthgd->bhgt", do.astype(_F32), out.astype(_F32), precision=lax.Precision.HIGHEST)

    def blocked_q(bq):
        nq = cdiv(t, bq)
        rs = lambda x: pad_axis(x, 1, nq * bq).reshape(b, nq, bq, hkv, g, d)
        rs_row = lambda x: pad_axis(x, 3, nq * bq).reshape(b, hkv, g, nq, bq)
        # Padded query rows have dO = 0 and Δ = 0, hence dS = P ∘ 0 = 0: they add nothing to dK/dV.
        return nq, rs(q), rs(do), rs_row(lse), rs_row(delta)

    def blocked_k(bk):
        nk = cdiv(s, bk)
        rs = lambda x: pad_axis(x, 1, nk * bk).reshape(b, nk, bk, hkv, d)
        return nk, rs(k), rs(v)

    def probs(q_i, k_j, lse_i, q_pos, k_pos, q_seg_i, k_seg_j):
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
        vis = _visible(q_pos, k_pos, causal=causal, q_offset=q_offset, kv_len=s, q_seg=q_seg_i, k_seg=k_seg_j)
        return jnp.where(vis, jnp.exp(sc - lse_i[..., None]), 0.0)

    def block_ids(ids, i):
        return None if ids is None else ids[:, i]

    # ---- dQ: map over query blocks, loop over the key blocks each one sees.
    nq, qb, dob, lseb, deltab = blocked_q(bq_dq)
    nk, kb, vb = blocked_k(bk_dq)
    qsb, ksb = _blocked_ids(q_seg, bq_dq, nq), _blocked_ids(kv_seg, bk_dq, nk)
    spans = _segment_spans(q_seg, kv_seg, bq=bq_dq, bk=bk_dq, nq=nq, nk=nk)

    def dq_block(i):
        q_i, do_i = qb[:, i], dob[:, i]
        lse_i, delta_i = lseb[:, :, :, i], deltab[:, :, :, i]
        q_pos = i * bq_dq + jnp.arange(bq_dq)

        def body(j, dq):
            k_j, v_j = kb[:, j], vb[:, j]
            k_pos = j * bk_dq + jnp.arange(bk_dq)
            p = probs(q_i, k_j, lse_i, q_pos, k_pos, block_ids(qsb, i), block_ids(ksb, j))
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp - delta_i[..., None])
            return dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k_j, preferred_element_type=_F32)

        lo, hi = 0, _num_k_blocks(i, bq=bq_dq, bk=bk_dq, nk=nk, causal=causal, q_offset=q_offset)
        if spans is not None:
            lo, hi = spans[0][0][i], jnp.minimum(hi, spans[0][1][i])
        dq = lax.fori_loop(lo, hi, body, jnp.zeros((b, bq_dq, hkv, g, d), _F32))
        return (dq * scale).astype(q.dtype)

    dq = lax.map(dq_block, jnp.arange(nq)).swapaxes(0, 1).reshape(b, nq * bq_dq, hkv, g, d)[:, :t]

    # ---- dK, dV: map over key blocks, loop over the query blocks that see each one.
    nq, qb, dob, lseb, deltab = blocked_q(bq_dkv)
    nk, kb, vb = blocked_k(bk_dkv)
    qsb, ksb = _blocked_ids(q_seg, bq_dkv, nq), _blocked_ids(kv_seg, bk_dkv, nk)
    spans = _segment_spans(q_seg, kv_seg, bq=bq_dkv, bk=bk_dkv, nq=nq, nk=nk)

    def dkv_block(j):
        k_j, v_j = kb[:, j], vb[:, j]
        k_pos = j * bk_dkv + jnp.arange(bk_dkv)

        def body(i, carry):
            dk, dv = carry
            q_i, do_i = qb[:, i], dob[:, i]
            lse_i, delta_i = lseb[:, :, :, i], deltab[:, :, :, i]
            p = probs(q_i, k_j, lse_i, i * bq_dkv + jnp.arange(bq_dkv), k_pos, block_ids(qsb, i), block_ids(ksb, j))
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), do_i, preferred_element_type=_F32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp - delta_i[..., None])
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q_i, preferred_element_type=_F32)
            return dk, dv

        lo, hi = _first_q_block(j, bq=bq_dkv, bk=bk_dkv, causal=causal, q_offset=q_offset), nq
        if spans is not None:
            lo, hi = jnp.maximum(lo, spans[1][0][j]), spans[1][1][j]
        zeros = jnp.zeros((b, bk_dkv, hkv, d), _F32)
        dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dk, dv = lax.map(dkv_block, jnp.arange(nk))
    dk = dk.swapaxes(0, 1).reshape(b, nk * bk_dkv, hkv, d)[:, :s]
    dv = dv.swapaxes(0, 1).reshape(b, nk * bk_dkv, hkv, d)[:, :s]
    return dq, dk, dv


def _clamp_block(block: int, length: int) -> int:
    # A block longer than the (8-rounded) sequence only adds padding work.
    return max(1, min(block, -(-length // 8) * 8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, q_seg, kv_seg, scale, causal, q_offset, blocks):
    fwd = functools.partial(_forward, scale=scale, causal=causal, q_offset=q_offset, bq=blocks[0], bk=blocks[1])
    return fwd(q, k, v, q_seg, kv_seg)[0]


def _attention_fwd(q, k, v, q_seg, kv_seg, scale, causal, q_offset, blocks):
    fwd = functools.partial(_forward, scale=scale, causal=causal, q_offset=q_offset, bq=blocks[0], bk=blocks[1])
    out, lse = fwd(q, k, v, q_seg, kv_seg)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _attention_bwd(scale, causal, q_offset, blocks, res, do):
    q, k, v, q_seg, kv_seg, out, lse = res
    return (
        *_backward(
            q,
            k,
            v,
            q_seg,
            kv_seg,
            out,
            lse,
            do,
            scale=scale,
            causal=causal,
            q_offset=q_offset,
            bq_dq=blocks[2],
            bk_dq=blocks[3],
            bq_dkv=blocks[4],
            bk_dkv=blocks[5],
        ),
        None,
        None,
    )  # integer segment ids take no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_xla(
    q, k, v, *, causal: bool, scale: float, q_offset: int, block_sizes, segment_ids=None, kv_segment_ids=None
):
    """Blockwise attention with a recomputing custom VJP. Arguments already validated by the API.

    q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D]; block_sizes is a BlockSizes; segment ids int32 [B,T] and [B,S]
    (both or neither).
    """
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    bs = block_sizes
    (bq_dq, bk_dq), (bq_dkv, bk_dkv) = bs.dq, bs.dkv
    blocks = (
        _clamp_block(bs.block_q, t),
        _clamp_block(bs.block_k, s),
        _clamp_block(bq_dq, t),
        _clamp_block(bk_dq, s),
        _clamp_block(bq_dkv, t),
        _clamp_block(bk_dkv, s),
    )
    q5 = q.reshape(b, t, hkv, hq // hkv, d)
    out = _attention(q5, k, v, segment_ids, kv_segment_ids, scale, causal, q_offset, blocks)
    return out.reshape(b, t, hq, d)

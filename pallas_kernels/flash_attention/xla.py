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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.flash_attention._common import MASK_VALUE, cdiv, pad_axis

_F32 = jnp.float32


def _visible(q_pos, k_pos, *, causal: bool, q_offset: int, kv_len: int):
    """[bq, bk] bool: key k_pos is a real (unpadded) key that query q_pos may attend to."""
    ok = (k_pos < kv_len)[None, :]
    if causal:
        ok = ok & (k_pos[None, :] <= q_pos[:, None] + q_offset)
    return ok


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


def _forward(q, k, v, *, scale, causal, q_offset, bq, bk):
    """q [B,T,Hkv,G,D], k/v [B,S,Hkv,D] -> (out [B,T,Hkv,G,D] in q.dtype, lse [B,Hkv,G,T] fp32)."""
    b, t, hkv, g, d = q.shape
    s = k.shape[1]
    nq, nk = cdiv(t, bq), cdiv(s, bk)
    qb = pad_axis(q, 1, nq * bq).reshape(b, nq, bq, hkv, g, d).swapaxes(0, 1)
    kb = pad_axis(k, 1, nk * bk).reshape(b, nk, bk, hkv, d)
    vb = pad_axis(v, 1, nk * bk).reshape(b, nk, bk, hkv, d)

    def q_block(args):
        i, q_i = args  # q_i [B, bq, Hkv, G, D]
        q_pos = i * bq + jnp.arange(bq)

        def body(j, carry):
            m, l, acc = carry
            k_j, v_j = kb[:, j], vb[:, j]  # [B, bk, Hkv, D]
            sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
            vis = _visible(q_pos, j * bk + jnp.arange(bk), causal=causal, q_offset=q_offset, kv_len=s)
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
        hi = _num_k_blocks(i, bq=bq, bk=bk, nk=nk, causal=causal, q_offset=q_offset)
        m, l, acc = lax.fori_loop(0, hi, body, init)
        # Every row sees key 0 (q_offset >= 0), so l >= 1 for real rows; padded rows are sliced off.
        out = (acc / l[..., None]).astype(q.dtype)
        return jnp.moveaxis(out, 3, 1), m + jnp.log(l)  # [B,bq,Hkv,G,D], [B,Hkv,G,bq]

    out, lse = lax.map(q_block, (jnp.arange(nq), qb))
    out = out.swapaxes(0, 1).reshape(b, nq * bq, hkv, g, d)[:, :t]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, nq * bq)[..., :t]
    return out, lse


def _backward(q, k, v, out, lse, do, *, scale, causal, q_offset, bq_dq, bk_dq, bq_dkv, bk_dkv):
    """Recomputing backward. Shapes as in _forward; returns (dq, dk, dv) in the input dtypes."""
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

    def probs(q_i, k_j, lse_i, q_pos, k_pos):
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
        vis = _visible(q_pos, k_pos, causal=causal, q_offset=q_offset, kv_len=s)
        return jnp.where(vis, jnp.exp(sc - lse_i[..., None]), 0.0)

    # ---- dQ: map over query blocks, loop over the key blocks each one sees.
    nq, qb, dob, lseb, deltab = blocked_q(bq_dq)
    nk, kb, vb = blocked_k(bk_dq)

    def dq_block(i):
        q_i, do_i = qb[:, i], dob[:, i]
        lse_i, delta_i = lseb[:, :, :, i], deltab[:, :, :, i]
        q_pos = i * bq_dq + jnp.arange(bq_dq)

        def body(j, dq):
            k_j, v_j = kb[:, j], vb[:, j]
            p = probs(q_i, k_j, lse_i, q_pos, j * bk_dq + jnp.arange(bk_dq))
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp - delta_i[..., None])
            return dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), k_j, preferred_element_type=_F32)

        hi = _num_k_blocks(i, bq=bq_dq, bk=bk_dq, nk=nk, causal=causal, q_offset=q_offset)
        dq = lax.fori_loop(0, hi, body, jnp.zeros((b, bq_dq, hkv, g, d), _F32))
        return (dq * scale).astype(q.dtype)

    dq = lax.map(dq_block, jnp.arange(nq)).swapaxes(0, 1).reshape(b, nq * bq_dq, hkv, g, d)[:, :t]

    # ---- dK, dV: map over key blocks, loop over the query blocks that see each one.
    nq, qb, dob, lseb, deltab = blocked_q(bq_dkv)
    nk, kb, vb = blocked_k(bk_dkv)

    def dkv_block(j):
        k_j, v_j = kb[:, j], vb[:, j]
        k_pos = j * bk_dkv + jnp.arange(bk_dkv)

        def body(i, carry):
            dk, dv = carry
            q_i, do_i = qb[:, i], dob[:, i]
            lse_i, delta_i = lseb[:, :, :, i], deltab[:, :, :, i]
            p = probs(q_i, k_j, lse_i, i * bq_dkv + jnp.arange(bq_dkv), k_pos)
            dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), do_i, preferred_element_type=_F32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=_F32)
            ds = p * (dp - delta_i[..., None])
            dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), q_i, preferred_element_type=_F32)
            return dk, dv

        lo = _first_q_block(j, bq=bq_dkv, bk=bk_dkv, causal=causal, q_offset=q_offset)
        zeros = jnp.zeros((b, bk_dkv, hkv, d), _F32)
        dk, dv = lax.fori_loop(lo, nq, body, (zeros, zeros))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    dk, dv = lax.map(dkv_block, jnp.arange(nk))
    dk = dk.swapaxes(0, 1).reshape(b, nk * bk_dkv, hkv, d)[:, :s]
    dv = dv.swapaxes(0, 1).reshape(b, nk * bk_dkv, hkv, d)[:, :s]
    return dq, dk, dv


def _clamp_block(block: int, length: int) -> int:
    # A block longer than the (8-rounded) sequence only adds padding work.
    return max(1, min(block, -(-length // 8) * 8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, scale, causal, q_offset, blocks):
    out, _ = _forward(q, k, v, scale=scale, causal=causal, q_offset=q_offset, bq=blocks[0], bk=blocks[1])
    return out


def _attention_fwd(q, k, v, scale, causal, q_offset, blocks):
    out, lse = _forward(q, k, v, scale=scale, causal=causal, q_offset=q_offset, bq=blocks[0], bk=blocks[1])
    return out, (q, k, v, out, lse)


def _attention_bwd(scale, causal, q_offset, blocks, res, do):
    q, k, v, out, lse = res
    return _backward(
        q,
        k,
        v,
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
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_xla(q, k, v, *, causal: bool, scale: float, q_offset: int, block_sizes):
    """Blockwise attention with a recomputing custom VJP. Arguments already validated by the API.

    q [B,T,Hq,D], k/v [B,S,Hkv,D] -> [B,T,Hq,D]; block_sizes is a BlockSizes.
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
    out = _attention(q.reshape(b, t, hkv, hq // hkv, d), k, v, scale, causal, q_offset, blocks)
    return out.reshape(b, t, hq, d)

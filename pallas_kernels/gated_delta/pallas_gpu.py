"""Pallas GPU (Triton lowering) gated delta rule: the WY prologue, a sequential state kernel and chunk-parallel
kernels.

Prologue (1 kernel for half-precision inputs, forward and again in the backward's recomputation):
  ``gated_delta_prologue``, grid (B, H, N): W, U and the cumulative decay G of each chunk by blocked forward
                          substitution (`_prologue_kernel`); fp32 inputs keep chunk_math's exact XLA prologue, and
                          the prologue's VJP stays chunk_math's (XLA) for both.
Forward (2 kernels):
  ``gated_delta_state``   grid (B, H, V/BV): one program per value tile loops over the chunks with `fori_loop`,
                          carrying only its K×BV slice of the state in fp32 registers and storing each chunk-start
                          state S_n ([B,H,N,K,V] in the operand dtype). Value tiles are independent (the recurrence
                          never mixes value columns), and the loop body has no C×C product to recompute per tile.
  ``gated_delta_output``  grid (B, H, N), chunk-parallel from S_n (chunk_parallel.py).
Backward (3 kernels): ``gated_delta_dv_local`` (chunk-parallel ((q kᵀ) ⊙ D)ᵀ dO), ``gated_delta_dstate`` (the
reverse sequential dS pass, same layout as the state kernel, storing dν and each dS_{n+1}), ``gated_delta_grads``
(chunk-parallel dq, dk, dW, dG).

Dots take the operand dtype (bf16 inputs → bf16 tensor-core dots) with fp32 accumulation. Tiles, warps and stages
per key dimension come from `GPU_CONFIGS`, sized so every kernel fits the H200's 232,448 B of shared memory per
block (checked for every configuration by tests/test_compile_tier_gated_delta.py). With segment ids every kernel
also reads the document column (chunk_parallel.py), in G's layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import pallas_triton

from . import chunk_math, chunk_parallel

plt = pallas_triton()

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """Launch configuration of the gated delta kernels for one (padded) key dimension.

    block_v_seq: value columns per program of the sequential kernels (state, dstate): their grid is
    (B, H, V/block_v_seq), and the fp32 K×block_v_seq state lives in registers. block_v_par: value columns per
    step of the chunk-parallel kernels' inner loop. warps_*/stages_*: Triton num_warps / num_stages (stages only
    matter for the sequential kernels' chunk loop, whose next chunk's loads they prefetch).
    """

    block_v_seq: int
    block_v_par: int
    warps_seq: int
    warps_par: int
    stages_seq: int


# Padded key dimension → configuration. Smaller value tiles for wider keys keep the K×BV state and the (C,K)
# operand tiles within registers and shared memory (tests/test_compile_tier_gated_delta.py checks every entry).
GPU_CONFIGS = {
    16: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=4, stages_seq=2),
    32: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=4, stages_seq=2),
    64: GpuConfig(block_v_seq=64, block_v_par=64, warps_seq=4, warps_par=8, stages_seq=2),
    128: GpuConfig(block_v_seq=32, block_v_par=64, warps_seq=4, warps_par=8, stages_seq=2),
    256: GpuConfig(block_v_seq=32, block_v_par=32, warps_seq=8, warps_par=8, stages_seq=1),
}


# Dots of fp32 inputs: three TF32 tensor-core passes (~fp32 accuracy). Precision.HIGHEST lowers to FMA loops on
# CUDA cores: every kernel at 255 registers with spills, and a 16-minute Triton compile at K=128. (Interpret mode
# keeps HIGHEST: exact fp32 on the CPU.)
FP32_DOTS = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def gpu_config(kp: int, vp: int, block_v: int | None = None) -> GpuConfig:
    """The table's entry for padded key dim ``kp`` (the largest for wider keys), value tiles capped at ``vp``;
    ``block_v`` overrides both value tiles (tests use it to exercise several tiles at small V)."""
    cfg = GPU_CONFIGS.get(kp) or GPU_CONFIGS[max(GPU_CONFIGS)]
    seq, par = (block_v, block_v) if block_v else (cfg.block_v_seq, cfg.block_v_par)
    return dataclasses.replace(cfg, block_v_seq=min(seq, vp), block_v_par=min(par, vp))


def _params(warps, stages=1):
    return plt.CompilerParams(num_warps=warps, num_stages=stages)


def _state_kernel(k_ref, w_ref, u_ref, g_ref, doc_ref, s0_ref, states_ref, sT_ref, *, C, N, prec):
    def body(n, s):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        states_ref[n, :, :] = s.astype(states_ref.dtype)
        doc = chunk_parallel.load(doc_ref, (rows, slice(None)))
        return chunk_math.state_step(k_ref[rows, :], w_ref[rows, :], u_ref[rows, :], g_ref[rows, :], s, prec, doc)

    sT_ref[...] = jax.lax.fori_loop(0, N, body, s0_ref[...].astype(_F32))


def _dstate_kernel(
    q_ref, k_ref, w_ref, g_ref, doc_ref, do_ref, dvl_ref, dsT_ref, dvn_ref, ds_after_ref, ds0_ref, *, C, N, prec
):
    def body(i, ds):
        n = N - 1 - i
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        ds_after_ref[n, :, :] = ds.astype(ds_after_ref.dtype)
        q, k, w, g, do, dvl = (r[rows, :] for r in (q_ref, k_ref, w_ref, g_ref, do_ref, dvl_ref))
        doc = chunk_parallel.load(doc_ref, (rows, slice(None)))
        dvn, ds = chunk_math.dstate_step(q, k, w, g, do, dvl, ds, prec, doc)
        dvn_ref[rows, :] = dvn
        return ds

    ds0_ref[...] = jax.lax.fori_loop(0, N, body, dsT_ref[...].astype(_F32))


# ------------------------------------------------------------------------------------ the WY prologue as a kernel

PROLOGUE_BLOCK = 16  # rows per block of the prologue's blocked forward substitution (Triton's smallest dot side)
PROLOGUE_COLUMNS = 32  # key / value columns per product in the prologue: smaller live operands, fewer spills


def _unit_lower_inverse_block(a, row, col):
    """(I + a)⁻¹ of one strictly lower (S,S) fp32 block, by forward substitution over its rows in registers:

        T = I;  for r = 1 … S−1:  T[r, :] = e_r − Σ_{j<r} a[r, j] T[j, :]

    (rows j < r of T are final when row r is formed). Each step reads row r of ``a`` and writes row r of T with
    masked reductions over the block: a register tensor cannot be indexed by row in Triton. The steps are a loop,
    not unrolled: unrolled, the C / S blocks' substitutions were most of the kernel's Triton IR, its compile time
    and its spills."""

    def substitute(r, t):
        a_r = jnp.sum(jnp.where(row == r, a, 0.0), axis=0, keepdims=True)  # (1,S): a[r, j] in column j
        a_col = jnp.sum(jnp.where(row == col, a_r, 0.0), axis=1, keepdims=True)  # (S,1): a[r, j] in row j
        return jnp.where(row == r, t - jnp.sum(a_col * t, axis=0, keepdims=True), t)

    return jax.lax.fori_loop(1, a.shape[0], substitute, (row == col).astype(_F32))


def _prologue_kernel(k_ref, v_ref, g_ref, beta_ref, *refs, C, prec):
    """One chunk's WY quantities (chunk_math's module docstring, part 1), every product in fp32 at ``prec``:

        G = cumsum(g),  A_ij = β_i (k_i·k_j) e^{G_i − G_j} (i > j),  T = (I + A)⁻¹,  W = T (β e^G k),  U = T (β v)

    T by blocked forward substitution over b = C / S row blocks of S = PROLOGUE_BLOCK rows: each diagonal block
    inverted in registers (`_unit_lower_inverse_block`), then column by column

        T_ij = −T_ii Σ_{m=j}^{i−1} A_im T_mj    (i > j)

    and W_i = Σ_{j≤i} T_ij R_j, U_i likewise, on the tensor cores, in a loop over column slices of PROLOGUE_COLUMNS
    (a loop, so the kernel's size and Triton compile time do not grow with K). A's blocks are formed from k's row
    blocks as they are needed (their Gram products loop over the same slices), so neither A, T nor the fp32 W/U
    pass through HBM before the kernel writes W (operand dtype), U and G (fp32). fp32 operands, not bf16:
    ν = U − W S is a small difference of larger terms (`chunk_math.hi_lo`), and U is used unrounded.
    With a document column (``refs`` then starts with it), G is the segment-local sum, A couples tokens of one
    document only and W's right-hand side keeps the rows that read the carried state (doc = 0), as in
    ``chunk_math.chunk_prep``."""
    doc_ref, w_ref, u_ref, gcum_ref = refs if len(refs) == 4 else (None, *refs)
    S = PROLOGUE_BLOCK
    nb = C // S
    row = jax.lax.broadcasted_iota(jnp.int32, (S, S), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (S, S), 1)
    rows = [pl.ds(i * S, S) for i in range(nb)]
    as_row = functools.partial(chunk_math._as_row, row=row, col=col)
    beta = [beta_ref[r, :] for r in rows]
    gs = [g_ref[r, :] for r in rows]
    docs = None if doc_ref is None else [doc_ref[r, :] for r in rows]

    def couples(i, m):  # which (row of block i, row of block m) pairs A and G couple: earlier tokens, one document
        keep = (row >= col) if m == i else (row >= 0)
        return keep if docs is None else keep & (docs[i] == as_row(docs[m]))

    gcum = []
    for i in range(nb):  # G_i = Σ of g over the earlier tokens of i's document, block by block
        gcum.append(
            sum(jnp.sum(jnp.where(couples(i, m), as_row(gs[m]), 0.0), axis=1, keepdims=True) for m in range(i + 1))
        )
        gcum_ref[rows[i], :] = gcum[i]

    def column_slices(ref):  # (number of slices, their width): the feature axis in PROLOGUE_COLUMNS-wide slices
        width = min(PROLOGUE_COLUMNS, ref.shape[-1])
        return ref.shape[-1] // width, width

    def columns(c, width):
        return pl.ds(pl.multiple_of(c * width, width), width)

    def a_block(i, m):  # A_im, strictly lower on the diagonal (m == i)
        keep = couples(i, m) & (row > col) if m == i else couples(i, m)
        decay = jnp.exp(jnp.where(keep, gcum[i] - as_row(gcum[m]), -jnp.inf))
        n, width = column_slices(k_ref)

        def add_slice(c, gram):
            ks = [k_ref[rows[x], columns(c, width)].astype(_F32) for x in (i, m)]
            return gram + chunk_math.dot(ks[0], ks[1], prec, trans_b=True)

        gram = jax.lax.fori_loop(0, n, add_slice, jnp.zeros((S, S), _F32))
        return beta[i] * gram * decay

    def read_decay(j):  # r ⊙ e^G: only the document the chunk began in reads the carried state
        return jnp.exp(gcum[j] if docs is None else jnp.where(docs[j] == 0, gcum[j], -jnp.inf))

    a = {(i, m): a_block(i, m) for i in range(nb) for m in range(i)}
    t = {(i, i): _unit_lower_inverse_block(a_block(i, i), row, col) for i in range(nb)}
    for j in range(nb):
        for i in range(j + 1, nb):
            acc = sum(chunk_math.dot(a[i, m], t[m, j], prec) for m in range(j, i))
            t[i, j] = -chunk_math.dot(t[i, i], acc, prec)

    def solve(in_ref, out_ref, row_scale):  # out_i = Σ_{j≤i} T_ij (row_scale_j ⊙ in_j), one column slice at a time
        n, width = column_slices(in_ref)

        def one_slice(c, carry):
            cs = columns(c, width)
            rhs = [row_scale[j] * in_ref[rows[j], cs].astype(_F32) for j in range(nb)]
            for i in range(nb):
                out = sum(chunk_math.dot(t[i, j], rhs[j], prec) for j in range(i + 1))
                out_ref[rows[i], cs] = out.astype(out_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n, one_slice, 0)

    solve(k_ref, w_ref, [beta[j] * read_decay(j) for j in range(nb)])
    solve(v_ref, u_ref, beta)


def prologue(cfg, q, k, v, g, beta, doc, *, interpret=False):
    """`chunk_math.make_rule`'s ``prologue_call``: half-precision runs take `prologue_call` (the kernel), fp32 runs
    chunk_math's XLA prologue, which is exact fp32. The kernel's products are one TF32 pass (W is rounded to the
    operand dtype anyway: TF32's 10-bit mantissa is finer than bf16's 7); the ~fp32 an fp32 run needs would take
    TF32×3, which splits every operand in two, spills registers and multiplies the kernel's Triton compile time
    (bench/RESULTS.md, the gated delta compile table). ``doc``: `chunk_documents`' [B,N,C] or None."""
    if cfg.operand_dtype == jnp.float32:
        return chunk_math._prepare(cfg, q, k, v, g, beta, doc)
    doc_column = None if doc is None else chunk_math._doc_operand(doc, q.shape[2])
    return prologue_call(cfg, q, k, v, g, beta, doc_column, interpret=interpret)


def prologue_call(cfg, q, k, v, g, beta, doc, *, interpret=False):
    """The operands of ``chunk_math._prepare`` (q, k, W [B,H,Tp,Kp], U [B,H,Tp,Vp], G [B,H,Tp,1]) with W, U and G
    from `_prologue_kernel`, one program per (batch, head, chunk); ``doc`` the document column [B,H,Tp,1] or None.
    q, k (L2 norm, scale) and the layout come from ``chunk_math.chunk_inputs``. Products: one TF32 pass on a GPU
    (see `prologue`), exact fp32 in interpret mode."""
    C = cfg.chunk_size
    if C % PROLOGUE_BLOCK:
        raise ValueError(f"the prologue kernel needs a chunk size that is a multiple of {PROLOGUE_BLOCK}, got {C}")
    q, k, v, g, beta = chunk_math.chunk_inputs(
        q, k, v, g, beta, scale=cfg.scale, use_qk_l2norm=cfg.use_qk_l2norm, chunk_size=C
    )
    B, H, N = q.shape[:3]
    Kp, Vp, Tp = cfg.key_dim_padded, cfg.value_dim_padded, N * C
    q, k, v, g, beta = (chunk_math.flat_padded(x, dp) for x, dp in zip((q, k, v, g, beta), (Kp, Kp, Vp, 1, 1)))
    prec = jax.lax.Precision.HIGHEST if interpret else jax.lax.Precision.DEFAULT
    chunk = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, n, 0))  # noqa: E731
    operands = [k, v, g, beta] + ([] if doc is None else [doc])
    w, u, gcum = pl.pallas_call(
        functools.partial(_prologue_kernel, C=C, prec=prec),
        grid=(B, H, N),
        in_specs=[chunk(Kp), chunk(Vp), chunk(1), chunk(1)] + ([] if doc is None else [chunk(1)]),
        out_specs=[chunk(Kp), chunk(Vp), chunk(1)],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Tp, Kp), cfg.operand_dtype),
            jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, Tp, 1), _F32),
        ],
        compiler_params=_params(gpu_config(Kp, Vp).warps_par),
        interpret=interpret,
        name="gated_delta_prologue",
    )(*operands)
    return q, k, w, u, gcum


def _seq_specs(Tp, Kp, N, bv):
    """Block specs of the (B, H, V/bv) sequential grid: whole-sequence (T,K) and (T,bv) slabs, states, G."""
    full_k = pl.BlockSpec((None, None, Tp, Kp), lambda b, h, j: (b, h, 0, 0))
    tile_v = pl.BlockSpec((None, None, Tp, bv), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((None, None, Kp, bv), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((None, None, N, Kp, bv), lambda b, h, j: (b, h, 0, 0, j))
    g_spec = pl.BlockSpec((None, None, Tp, 1), lambda b, h, j: (b, h, 0, 0))
    return full_k, tile_v, state, states, g_spec


def fwd_call(q, k, w, u, g, doc, s0, *, prec, chunk_size=64, interpret=False, block_v=None):
    """(o [B,H,Tp,Vp] operand dtype, s_final [B,H,Kp,Vp] fp32, states [B,H,N,Kp,Vp] operand dtype)."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    cfg = gpu_config(Kp, Vp, block_v)
    bv = cfg.block_v_seq
    full_k, tile_v, state, states_spec, g_spec = _seq_specs(Tp, Kp, N, bv)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_state_kernel, C=C, N=N, prec=prec),
        [k, w, u, g, s0],
        [full_k, full_k, tile_v, g_spec, state],
        doc,
        g_spec,
        4,
    )
    states, s_final = pl.pallas_call(
        kernel,
        grid=(B, H, Vp // bv),
        in_specs=in_specs,
        out_specs=[states_spec, state],
        out_shape=[jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype), jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32)],
        compiler_params=_params(cfg.warps_seq, cfg.stages_seq),
        interpret=interpret,
        name="gated_delta_state",
    )(*operands)
    o = chunk_parallel.output_call(
        q,
        k,
        w,
        u,
        g,
        doc,
        states,
        chunk_size=C,
        block_v=cfg.block_v_par,
        prec=prec,
        compiler_params=_params(cfg.warps_par),
        interpret=interpret,
    )
    return o, s_final, states


def bwd_call(q, k, w, u, g, doc, states, do, dsT, *, prec, chunk_size=64, interpret=False, block_v=None):
    """(dq, dk, dw, du, dg, ds0), fp32, from the stored chunk-start states."""
    B, H, Tp, Kp = q.shape
    Vp = u.shape[-1]
    C, N = chunk_size, Tp // chunk_size
    cfg = gpu_config(Kp, Vp, block_v)
    bv = cfg.block_v_seq
    par = dict(chunk_size=C, block_v=cfg.block_v_par, prec=prec, compiler_params=_params(cfg.warps_par))
    dvl = chunk_parallel.dv_local_call(q, k, g, doc, do, interpret=interpret, **par)
    full_k, tile_v, state, states_spec, g_spec = _seq_specs(Tp, Kp, N, bv)
    kernel, operands, in_specs = chunk_parallel.with_documents(
        functools.partial(_dstate_kernel, C=C, N=N, prec=prec),
        [q, k, w, g, do, dvl, dsT],
        [full_k, full_k, full_k, g_spec, tile_v, tile_v, state],
        doc,
        g_spec,
        4,
    )
    dvn, ds_after, ds0 = pl.pallas_call(
        kernel,
        grid=(B, H, Vp // bv),
        in_specs=in_specs,
        out_specs=[tile_v, states_spec, state],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Tp, Vp), _F32),
            jax.ShapeDtypeStruct((B, H, N, Kp, Vp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Kp, Vp), _F32),
        ],
        compiler_params=_params(cfg.warps_seq, cfg.stages_seq),
        interpret=interpret,
        name="gated_delta_dstate",
    )(*operands)
    dq, dk, dw, dg = chunk_parallel.grads_call(
        q, k, w, u, g, doc, states, do, dvn, ds_after, interpret=interpret, **par
    )
    return dq, dk, dw, dvn, dg, ds0


@functools.cache
def rule(chunk_size=64, interpret=False, block_v=None):
    """The custom_vjp rule for one static configuration (cached so jit sees one function)."""
    kw = dict(chunk_size=chunk_size, interpret=interpret, block_v=block_v)
    return chunk_math.make_rule(
        functools.partial(fwd_call, **kw),
        functools.partial(bwd_call, **kw),
        prologue_call=functools.partial(prologue, interpret=interpret),
    )


def chunk_gated_delta_rule_pallas_gpu(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm,
    chunk_size=64,
    segment_ids=None,
    interpret=False,
    block_v=None,
    prec=None,
):
    if prec is None and jnp.dtype(q.dtype) == jnp.float32 and not interpret:
        prec = FP32_DOTS
    return chunk_math.chunked_gated_delta_rule(
        rule(chunk_size, interpret, block_v),
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        pad_pow2=True,
        segment_ids=segment_ids,
        prec=prec,
    )

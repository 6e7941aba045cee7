"""The depthwise causal convolution of the Gated DeltaNet heads, and its sequence-parallel form.

``causal_depthwise_conv`` is the conv on a whole row (with a hand-written VJP and packed-document masking);
``sequence_parallel_causal_conv`` runs it on a row split over devices (the W−1 inputs before each chunk come as a
halo all-gathered from the chunks' tails). Both sit here, below ``hybrid.gdn`` (the model's heads, which call
them) and beside ``context_parallel.gated_delta`` (the sequence-parallel gated delta rule, whose chunk helpers the
sharded conv shares), so neither imports the other's package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hydrahead_jax.context_parallel.gated_delta import (
    AxisName,
    _chunks_to_batch,
    _gather_natural,
    _local_chunks,
    _my_chunks,
    _per_chunk_to_batch,
)


def _conv_inputs(x: jax.Array, state: jax.Array | None, width: int) -> jax.Array:
    """p = [state; x] in fp32, [B, W−1+T, C] (zeros for a missing state)."""
    x32 = x.astype(jnp.float32)
    if state is None:
        return jax.lax.pad(x32, 0.0, [(0, 0, 0), (width - 1, 0, 0), (0, 0, 0)])
    return jnp.concatenate([state.astype(jnp.float32), x32], axis=1)


def _tap(a: jax.Array, tap_mask: jax.Array | None, j: int) -> jax.Array:
    """a [B,T,C] with the rows where tap j crosses a document start zeroed (a unchanged without a mask)."""
    return a if tap_mask is None else a * tap_mask[j][..., None].astype(a.dtype)


@jax.custom_vjp
def _causal_conv(x: jax.Array, weight: jax.Array, state: jax.Array | None, tap_mask: jax.Array | None) -> jax.Array:
    """y_t = Σ_j w_j · m_{j,t} · p_{t+j} with p = [state; x] (fp32 inside), y in x.dtype.

    x [B,T,C], weight [W,C], state [B,W−1,C] or None (zeros), tap_mask [W,B,T] bool or None (all ones).
    VJP (d = m ⊙ ∂L/∂y per tap):  ∂L/∂p_s = Σ_j w_j d_{j,s−j},  ∂L/∂w_j = Σ_{b,t} d_{j,t} ⊙ p_{t+j}.
    Written by hand so the backward keeps only x (in its own dtype) and the state: autodiff of the shifted slices
    kept W−1 shifted fp32 copies of the activations (one per tap) alive for the weight gradient; here the fp32
    p is rebuilt in the backward, where it lives only while the conv's own gradients are formed.
    """
    width, t = weight.shape[0], x.shape[1]
    p = _conv_inputs(x, state, width)
    w32 = weight.astype(jnp.float32)
    return sum(_tap(p[:, j : j + t], tap_mask, j) * w32[j] for j in range(width)).astype(x.dtype)


def _causal_conv_fwd(x, weight, state, tap_mask):
    return _causal_conv(x, weight, state, tap_mask), (x, weight, state, tap_mask)


def _causal_conv_bwd(res, dy):
    # The barrier (with dy) keeps XLA from merging the fp32 window rebuilt here with the forward's, and from
    # scheduling it early: either would keep W shifted fp32 copies alive from the forward to here, the very
    # residuals this VJP exists to avoid.
    (x, weight, state, tap_mask), dy = jax.lax.optimization_barrier((res, dy))
    width, t = weight.shape[0], x.shape[1]
    w32, dy32 = weight.astype(jnp.float32), dy.astype(jnp.float32)
    p = _conv_inputs(x, state, width)
    d = [_tap(dy32, tap_mask, j) for j in range(width)]
    dp = sum(jax.lax.pad(d[j] * w32[j], 0.0, [(0, 0, 0), (j, width - 1 - j, 0), (0, 0, 0)]) for j in range(width))
    dweight = jnp.stack([jnp.sum(d[j] * p[:, j : j + t], axis=(0, 1)) for j in range(width)]).astype(weight.dtype)
    dstate = None if state is None else dp[:, : width - 1].astype(state.dtype)
    return dp[:, width - 1 :].astype(x.dtype), dweight, dstate, None


_causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


def causal_depthwise_conv(
    x: jax.Array, weight: jax.Array, state: jax.Array | None, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """y_t = Σ_j w_j · x_{t−(W−1)+j} over channels independently; x [B,T,C], weight [W,C], state [B,W−1,C].

    ``state`` holds the W−1 inputs before x (zeros at the start of a sequence); returns (y in x.dtype, the new
    state = the last W−1 inputs), so a sequence run in pieces (prefill, then one token at a time) equals one run
    over all.

    Packed documents: with ``segment_ids`` [B,T] int32 (one id per document of the row), a tap never reads
    across a document start:

        y_t = Σ_j w_j · x_{t−(W−1)+j} · [s_{t−(W−1)+j} = s_t],

    where the W−1 state positions before the row carry the id s_0: the state belongs to the document that
    continues at t = 0, and later documents start from zeros. The new state keeps only the inputs of the row's
    last document (others zeroed), so that document continues correctly in the next call.
    """
    width, t = weight.shape[0], x.shape[1]
    if segment_ids is None:
        tap_mask = None
    else:
        if segment_ids.shape != x.shape[:2] or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(
                f"causal_depthwise_conv: segment_ids must be integer [batch, time] = {x.shape[:2]} (one id per "
                f"document of the packed row); got {segment_ids.dtype} {segment_ids.shape}"
            )
        seg = jnp.concatenate([jnp.repeat(segment_ids[:, :1], width - 1, axis=1), segment_ids], axis=1)
        tap_mask = jnp.stack([seg[:, j : j + t] == segment_ids for j in range(width)])  # [W, B, T]
    y = _causal_conv(x, weight, state, tap_mask)
    history = jnp.zeros((x.shape[0], width - 1, x.shape[2]), x.dtype) if state is None else state.astype(x.dtype)
    new_state = jnp.concatenate([history, x], axis=1)[:, t:]
    if segment_ids is not None:
        new_state = new_state * (seg[:, t:] == segment_ids[:, -1:])[..., None].astype(new_state.dtype)
    return y, new_state


def sequence_parallel_causal_conv(
    x: jax.Array,
    weight: jax.Array,
    state: jax.Array | None,
    segment_ids: jax.Array | None = None,
    *,
    axis_name: AxisName,
    layout: str,
) -> tuple[jax.Array, jax.Array]:
    """``causal_depthwise_conv`` over a row split over ``axis_name``; call per device inside shard_map.

    x [B, Tl, C] and segment_ids [B, Tl] (or None): this device's tokens in ``layout`` order; weight [W, C];
    state [B, W−1, C] (the W−1 inputs before the row, the same on every device) or None (zeros). Returns (this
    device's y [B, Tl, C] in x.dtype, the row's new conv state [B, W−1, C]: its last W−1 inputs, the same on every
    device), equal to the unsharded conv.

    Halo: natural chunk j needs the W−1 inputs before it. Every device all-gathers the last m = min(W−1, c) inputs
    of every chunk (and their ids); laid out naturally after the row's state they form a history h in which the
    W−1 inputs before chunk j are h[j·m : j·m + W−1] (m = W−1: chunk j−1's tail; m = c: the whole row so far).
    That halo is chunk j's conv state. Packed documents: a halo input counts only if no document starts between it
    and the chunk's first token (ids may recur), i.e. every id from it up to the chunk start equals the chunk's
    first id; the row's state carries the row's first id (as in ``causal_depthwise_conv``).
    """
    B, Tl, C = x.shape
    width = weight.shape[0]
    cps, c = _local_chunks(Tl, layout, "sequence_parallel_causal_conv")
    if width == 1:  # no tap reaches another token
        return causal_depthwise_conv(x, weight, state, segment_ids)
    halo_len, m = width - 1, min(width - 1, c)
    dtype = x.dtype if state is None else jnp.result_type(x.dtype, state.dtype)
    tails = _gather_natural(jnp.swapaxes(x.reshape(B, cps, c, C)[:, :, c - m :], 0, 1), axis_name, layout)
    n = tails.shape[0] // cps
    history = jnp.concatenate(
        [
            jnp.zeros((B, halo_len, C), dtype) if state is None else state.astype(dtype),
            jnp.moveaxis(tails, 0, 1).reshape(B, -1, C).astype(dtype),
        ],
        axis=1,
    )  # [B, W−1 + 2n·m, C], natural order
    mine = _my_chunks(axis_name, n, layout)
    halos = jnp.stack([jax.lax.dynamic_slice_in_dim(history, j * m, halo_len, axis=1) for j in mine])  # [cps,B,W−1,C]
    halos = _per_chunk_to_batch(halos)
    x_chunks = _chunks_to_batch(x, cps)
    seg_chunks = None
    if segment_ids is not None:
        seg = segment_ids.reshape(B, cps, c)
        tail_ids = _gather_natural(jnp.swapaxes(seg[:, :, c - m :], 0, 1), axis_name, layout)  # [2n, B, m]
        row_first = _gather_natural(jnp.swapaxes(seg[:, :, :1], 0, 1), axis_name, layout)[0]  # [B, 1]
        history_ids = jnp.concatenate(
            [jnp.repeat(row_first, halo_len, axis=1), jnp.moveaxis(tail_ids, 0, 1).reshape(B, -1)], axis=1
        )
        halo_ids = _per_chunk_to_batch(
            jnp.stack([jax.lax.dynamic_slice_in_dim(history_ids, j * m, halo_len, axis=1) for j in mine])
        )
        seg_chunks = _chunks_to_batch(segment_ids, cps)
        same = halo_ids == seg_chunks[:, :1]
        counts = jnp.flip(jnp.cumprod(jnp.flip(same, axis=1), axis=1), axis=1)  # no id change up to the chunk
        halos = halos * counts[..., None].astype(halos.dtype)
    y, _ = causal_depthwise_conv(x_chunks, weight, halos, seg_chunks)
    new_state = history[:, -halo_len:].astype(x.dtype)
    if segment_ids is not None:  # the row's last document only, as the unsharded conv keeps it
        last_ids = history_ids[:, -halo_len:]
        new_state = new_state * (last_ids == last_ids[:, -1:])[..., None].astype(new_state.dtype)
    return y.reshape(B, Tl, C), new_state

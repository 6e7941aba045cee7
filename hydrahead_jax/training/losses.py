"""Losses of the three training stages. Every loss is a masked mean over tokens; m_{b,t} ∈ {0, 1} is loss_mask.

Stage 1 (align), per layer l, with the TEACHER's normalised attention input x̂ˡ and attention output yˡ:

    L_align = Σ_l  Σ_{b,t} m_{b,t} · ‖ Attn_student^l(x̂ˡ_{b,t}) − yˡ_{b,t} ‖² / d   /  Σ_{b,t} m_{b,t}

(the sum over layers, not the mean, so each layer's gradient does not shrink with depth; layers are independent
because every student block reads the teacher's input, not its own previous output.) With per-head targets
(``align_target="heads"``) each layer compares the head outputs before o_proj instead, every student head h with
its teacher head (the same query head; with the default fusion the FA heads match to rounding, so the LA heads
carry the loss):

    L_align = Σ_l  Σ_{b,t} m_{b,t} · Σ_h ‖ o_student^{l,h}(x̂ˡ_{b,t}) − o_teacher^{l,h}_{b,t} ‖² / (Hq·D)  /  Σ_{b,t} m_{b,t}

(o_proj, shared by all heads, no longer weighs the heads' errors: a head whose output o_proj nearly cancels
still learns its teacher head.)

Stage 2 (distil), with p = softmax(z_teacher / τ), q = softmax(z_student / τ) per token:

    L_KL = Σ_{b,t} m_{b,t} · Σ_v p_v (log p_v − log q_v)  /  Σ m   (× τ² so gradients keep their scale)

Stage 3 (long), next-token cross-entropy, optionally + w · L_KL:

    L_CE = Σ_{b,t} m_{b,t} · (logsumexp(z_{b,t}) − z_{b,t,y_{b,t}})  /  Σ m

Logits are never materialised for the whole batch: the final hidden states [B,T,d] are cut into tiles of R rows
× C tokens and a ``lax.scan`` computes each tile's [R,C,V] logits with ``logits_from_hidden``. The tile body is
rematerialised (``jax.checkpoint``), so the backward pass also holds only one tile of logits at a time: the loss
buffer is R · C · V f32 values (per device: R / data-parallel devices rows), set by the config, whatever B and T.
R = 0 (or R ≥ B) keeps all rows in every tile. The R rows of tile r are rows r, r + n_r, r + 2·n_r, ... (n_r = B/R,
``interleaved_row_groups``): rows sharded contiguously over the data-parallel devices stay on their device, and
every device works on every tile.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[jax.Array], jax.Array]
# place_rows(x, axis) -> x with its row axis ``axis`` constrained to the batch's data-parallel sharding (or None).
# XLA's propagation loses the row sharding through the tiling reshapes; without the constraint every device
# would compute every row of a tile.
RowPlacer = Callable[[jax.Array, int], jax.Array] | None


def place(place_rows: RowPlacer, tree, axis: int):
    return tree if place_rows is None else jax.tree.map(lambda x: place_rows(x, axis), tree)


def masked_mean(per_token: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(jnp.float32)
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def align_loss(
    run_layers,
    teacher_inputs: jax.Array,
    teacher_outputs: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    heads: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Σ_l masked-mean MSE of student attention l on the teacher's input l against the teacher's output l.

    ``run_layers(fn, xs)`` returns [fn(attention_l, xs_l) for every layer l] stacked (one scan over the student's
    layers: ``Transformer.scan_layers``), ``attention_l(x, positions, segment_ids=..., heads_out=...) -> (out,
    cache)`` being the student's attention block of layer l (``segment_ids``: packed documents, or None;
    ``heads_out``: a dict that receives its head outputs before o_proj, ``Attention.__call__``);
    ``teacher_inputs`` are [L,B,T,d] and ``teacher_outputs`` [L,B,T,d], or with ``heads`` the teacher's head
    outputs [L,B,T,Hq,D] in the student's stored head order (all already stop-gradient'ed by the caller).
    Returns (total, per-layer losses [L]).
    """

    def layer_loss(attention, xy):
        x, y = xy
        if heads:
            seen: dict = {}
            attention(x, positions, segment_ids=segment_ids, heads_out=seen)
            out = seen["heads"]
        else:
            out, _ = attention(x, positions, segment_ids=segment_ids)
        sq = jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32))
        sq = jnp.mean(sq.reshape(sq.shape[:2] + (-1,)), axis=-1)  # [B,T]
        return masked_mean(sq, mask)

    per_layer = run_layers(layer_loss, (teacher_inputs, teacher_outputs))
    return jnp.sum(per_layer), per_layer


def interleaved_row_groups(x: jax.Array, groups: int) -> jax.Array:
    """[B, ...] → [groups, B/groups, ...], group g = rows g, g + groups, g + 2·groups, ... (x[g::groups]).

    Row i·groups + g of a batch whose rows are sharded contiguously over D devices lives on device
    ⌊i·groups·D / B⌋, so when (B/groups) % D == 0 every group keeps B/(groups·D) rows on each device: splitting
    needs no communication and no device idles in a group.
    """
    b = x.shape[0]
    if b % groups:
        raise ValueError(f"cannot split {b} rows into {groups} equal groups; choose a divisor of {b}.")
    return jnp.swapaxes(x.reshape((b // groups, groups) + x.shape[1:]), 0, 1)


def _chunked(h: jax.Array, chunk: int, rows: int = 0, place_rows: RowPlacer = None) -> jax.Array:
    """[B,T,...] → [n_r·n_t, R, C, ...]: tiles of R rows (``interleaved_row_groups``; R = B when rows is 0 or ≥ B)
    × C tokens, T zero-padded to a multiple of C (padding is masked out by the caller)."""
    b, t = h.shape[:2]
    chunk = max(1, min(int(chunk), t))
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        h = jnp.pad(h, [(0, 0), (0, pad)] + [(0, 0)] * (h.ndim - 2))
    if not rows or rows >= b:
        h = h.reshape((b, n, chunk) + h.shape[2:])
        return place(place_rows, jnp.moveaxis(h, 1, 0), 1)
    g = interleaved_row_groups(h, b // check_row_chunk(rows, b))  # [n_r, R, n·C, ...]
    g = g.reshape(g.shape[:2] + (n, chunk) + g.shape[3:])
    g = jnp.moveaxis(g, 2, 1)  # [n_r, n, R, C, ...]
    return place(place_rows, g.reshape((g.shape[0] * n,) + g.shape[2:]), 1)


def check_row_chunk(rows: int, batch_rows: int) -> int:
    """The rows per logits tile, refused unless it divides the batch rows."""
    if rows <= 0 or batch_rows % rows:
        raise ValueError(
            f"loss_chunk_rows={rows} must be a positive divisor of the {batch_rows} rows a (micro-)batch holds "
            "(or 0 for all rows); pick a divisor that is also a multiple of the data-parallel device count."
        )
    return rows


def _scan_token_chunks(body, xs, chunk_totals_init, place_rows: RowPlacer = None):
    """Sum of body(chunk) over chunks, body rematerialised so backward keeps only one chunk's logits alive."""
    body = jax.checkpoint(body)

    def step(carry, x):
        return jax.tree.map(jnp.add, carry, body(place(place_rows, x, 0))), None

    total, _ = jax.lax.scan(step, chunk_totals_init, xs)
    return total


def _log_probs(logits_fn: LogitsFn, hidden: jax.Array, temperature: float) -> jax.Array:
    """log softmax(z / τ) in f32 of one tile's logits z = logits_fn(hidden)."""
    return jax.nn.log_softmax(logits_fn(hidden).astype(jnp.float32) / temperature, axis=-1)


def _kl_per_token(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """Σ_v p_v (log p_v − log q_v) over the last axis."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _teacher_student_tiles(student_hidden, teacher_hidden, mask, chunk, rows, place_rows):
    """(student, teacher, mask) tiles of ``_chunked``; the teacher's hidden states are stop-gradient'ed."""
    return (
        _chunked(student_hidden, chunk, rows, place_rows),
        _chunked(jax.lax.stop_gradient(teacher_hidden), chunk, rows, place_rows),
        _chunked(mask.astype(jnp.float32), chunk, rows, place_rows),
    )


def chunked_kl(
    student_hidden: jax.Array,
    teacher_hidden: jax.Array,
    student_logits: LogitsFn,
    teacher_logits: LogitsFn,
    mask: jax.Array,
    *,
    chunk: int = 512,
    rows: int = 0,
    temperature: float = 1.0,
    place_rows: RowPlacer = None,
) -> jax.Array:
    """Masked mean over tokens of KL(softmax(z_t/τ) ‖ softmax(z_s/τ)) · τ², in tiles of ``rows`` × ``chunk``."""
    tiles = _teacher_student_tiles(student_hidden, teacher_hidden, mask, chunk, rows, place_rows)

    def body(x):
        h_s, h_t, m = x
        log_q = _log_probs(student_logits, h_s, temperature)
        log_p = jax.lax.stop_gradient(_log_probs(teacher_logits, h_t, temperature))
        return jnp.sum(_kl_per_token(log_p, log_q) * m)

    total = _scan_token_chunks(body, tiles, jnp.zeros((), jnp.float32), place_rows)
    return total / jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0) * temperature**2


def chunked_teacher_agreement(
    student_hidden: jax.Array,
    teacher_hidden: jax.Array,
    student_logits: LogitsFn,
    teacher_logits: LogitsFn,
    mask: jax.Array,
    *,
    chunk: int = 512,
    rows: int = 0,
    place_rows: RowPlacer = None,
) -> tuple[jax.Array, jax.Array]:
    """(KL, top-1 agreement) of the student's full next-token distribution with the teacher's, at temperature 1,
    as masked means over tokens, in one pass over tiles of ``rows`` × ``chunk`` (an evaluation yardstick):

        KL   = Σ m_{b,t} · Σ_v p_v (log p_v − log q_v) / Σ m      (nats/token)
        top1 = Σ m_{b,t} · [argmax_v p_v = argmax_v q_v] / Σ m    (ties: the lowest token id)
    """
    tiles = _teacher_student_tiles(student_hidden, teacher_hidden, mask, chunk, rows, place_rows)

    def body(x):
        h_s, h_t, m = x
        log_q = _log_probs(student_logits, h_s, 1.0)
        log_p = jax.lax.stop_gradient(_log_probs(teacher_logits, h_t, 1.0))
        same = (jnp.argmax(log_p, axis=-1) == jnp.argmax(log_q, axis=-1)).astype(jnp.float32)
        return jnp.sum(_kl_per_token(log_p, log_q) * m), jnp.sum(same * m)

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    kl, same = _scan_token_chunks(body, tiles, zeros, place_rows)
    denom = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
    return kl / denom, same / denom


def chunked_cross_entropy(
    hidden: jax.Array,
    logits_fn: LogitsFn,
    targets: jax.Array,
    mask: jax.Array,
    *,
    chunk: int = 512,
    rows: int = 0,
    place_rows: RowPlacer = None,
) -> tuple[jax.Array, jax.Array]:
    """(masked mean next-token CE, masked token accuracy), in tiles of ``rows`` × ``chunk``."""
    hs = _chunked(hidden, chunk, rows, place_rows)
    ys = _chunked(targets.astype(jnp.int32), chunk, rows, place_rows)
    ms = _chunked(mask.astype(jnp.float32), chunk, rows, place_rows)

    def body(x):
        h, y, m = x
        z = logits_fn(h).astype(jnp.float32)  # [B,C,V]
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
        correct = (jnp.argmax(z, axis=-1) == y).astype(jnp.float32)
        return jnp.sum(nll * m), jnp.sum(jax.lax.stop_gradient(correct) * m)

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    nll, correct = _scan_token_chunks(body, (hs, ys, ms), zeros, place_rows)
    denom = jnp.maximum(jnp.sum(mask.astype(jnp.float32)), 1.0)
    return nll / denom, correct / denom

"""Probes that score every (layer, KV group) of a teacher: the retrieval score and causal ablation.

Both run the teacher's own blocks (``Block(..., probe=HeadProbe(...))``: exact softmax with its probabilities, and
per-head outputs replaced before o_proj), on its own parameters. The decoder's layers are stacked into one pytree
so a forward is a ``lax.scan`` over layers and an ablation restart is a ``lax.fori_loop`` from a traced layer
index: each compiles once, whatever the layer count.

**Retrieval score** (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"). The
teacher greedily decodes a needle-in-a-haystack prompt; at decode step i it emits token w_i from query position
P−1+i (P = prompt length). Query head h *copies* at step i when

    argmax_j  softmax(q_{P−1+i} · k_j · scale)_j   (j ≤ P−1+i, causal)   ∈ needle positions   and   x_j = w_i,

and each needle position is counted at most once per head. score(h) = copied needle tokens / needle length,
averaged over the prompts the teacher answers correctly. One teacher-forced pass over prompt + generated tokens
gives every step's attention row at once (causality makes it identical to the decode-time rows).

**Causal ablation.** For KV group g of layer l (its query heads' outputs before o_proj, o_h = Σ_j p_hj v_j),
replace o_h by 0 (zero-ablation) or by its mean over the probe batch's positions μ_h (mean-ablation):

    attn_l' = attn_l − Σ_{h∈g} (o_h − μ_h) · W_o[h]          (W_o[h]: head h's input rows of o_proj)

and measure the drop in the answer's log-probability, Δ = log p(answer) − log p'(answer), averaged over prompts.
Layers < l are unaffected, so the probe restarts from the clean residual stream at layer l and runs the
G = num_kv_heads variants of that layer as one batch: a model with L layers costs L batched restarts per prompt
batch (compute ≈ G·L/2 clean forwards).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.models.attention import HeadProbe
from hydrahead_jax.models.generate import generate

# ------------------------------------------------------------------------------------------------------------
# The teacher as arrays: its own blocks, run through ``Block(..., probe=HeadProbe(...))``.


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
    """The static (hashable) half of the functional teacher: graph definitions and shapes."""

    layer_def: Any
    model_def: Any
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class FunctionalTeacher:
    """The teacher as arrays: one block graphdef with layer-stacked state [L, ...] (for ``lax.scan`` and
    ``fori_loop`` over layers) and the whole model's state (its embedding, final norm and output head)."""

    spec: TeacherSpec
    layers: Any  # nnx.State whose leaves are stacked over layers
    model: Any  # nnx.State of the whole model

    def __getattr__(self, name):  # shapes and graphdefs read through to the spec
        if name == "spec":
            raise AttributeError(name)
        return getattr(self.spec, name)


def functional_teacher(model) -> FunctionalTeacher:
    """The decoder's layer stack as a graphdef and layer-stacked state; the model must be a plain teacher."""
    attn = model.layers.self_attn
    identity = tuple(range(model.cfg.num_kv_heads))
    if getattr(attn, "hybrid_cfg", None) is not None or any(o != identity for o in model.group_order):
        raise ValueError(
            "head selection probes a plain teacher (all layers softmax attention, KV groups in their original "
            "order), not a hybrid student."
        )
    layer_def, layers = nnx.split(model.layers)
    model_def, model_state = nnx.split(model)
    cfg = model.cfg
    spec = TeacherSpec(layer_def, model_def, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    return FunctionalTeacher(spec, layers, model_state)


def _layer(teacher: TeacherSpec, layers_state, i):
    """Block ``i`` (a traced index) of the stacked state."""
    state = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), layers_state)
    return nnx.merge(teacher.layer_def, state)


def _log_probs(teacher: TeacherSpec, model_state, h):
    """log softmax of the teacher's logits for residual-stream rows h [..., d] (final norm, then output head)."""
    model = nnx.merge(teacher.model_def, model_state)
    return jax.nn.log_softmax(model.logits_from_hidden(model.norm(h)), axis=-1)


def _answer_logprobs(teacher, model_state, h, rows, targets):
    """log p(targets[b,i] | prefix) read at positions rows[b,i]: h [B,T,d] → (logp [B,N], argmax [B,N])."""
    h_rows = jnp.take_along_axis(h, rows[..., None], axis=1)  # [B,N,d]
    logp = _log_probs(teacher, model_state, h_rows)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return target_logp, jnp.argmax(logp, axis=-1).astype(jnp.int32)


def _group_variants(teacher: TeacherSpec, batch: int) -> jax.Array:
    """keep [Hkv·B, 1, Hq]: variant g (variant-major, B rows each) replaces the query heads of KV group g."""
    keep = 1.0 - jnp.repeat(jnp.eye(teacher.num_kv_heads, dtype=jnp.float32), teacher.group_size, axis=1)
    return jnp.repeat(keep, batch, axis=0)[:, None, :]


@functools.partial(jax.jit, static_argnames=("teacher", "collect"))
def _clean_forward(
    teacher: TeacherSpec, layers_state, model_state, ids, rows, targets, head_keep, head_fill, *, collect: bool
):
    """Forward over ids [B,T] with per-layer head replacement; answer log-probs and per-layer probes.

    head_keep [L,Hq] (1 keep, 0 replace) and head_fill [L,Hq,D] (the replacement) implement multi-group ablation;
    all-ones keeps the clean teacher. Returns a dict with ``logp``/``pred`` [B,N], ``argmax`` [L,B,Hq,N] (the
    attention argmax of each answer-predicting row) and, if ``collect``, the residual stream entering each layer
    ``h_in`` [L,B,T,d], the per-head outputs ``heads`` [L,B,T,Hq,D] and the post-RoPE keys/values ``k``/``v``
    [L,B,T,Hkv,D].
    """
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = nnx.merge(teacher.model_def, model_state).embed_tokens(ids)

    def body(h, xs):
        layer_state, keep, fill = xs
        seen: dict = {}
        h_out, _ = nnx.merge(teacher.layer_def, layer_state)(
            h, positions, probe=HeadProbe(keep=keep, fill=fill, record=seen)
        )
        # probs[b, h, rows[b, i], :] → argmax over keys: which position each answer step attends to most.
        row_probs = jnp.take_along_axis(seen["probs"], rows[:, None, :, None], axis=2)  # [B,Hq,N,T]
        out = {"argmax": jnp.argmax(row_probs, axis=-1).astype(jnp.int32)}
        if collect:
            out.update(h_in=h, heads=seen["heads"], k=seen["k"], v=seen["v"])
        return h_out, out

    h, per_layer = jax.lax.scan(body, h, (layers_state, head_keep, head_fill))
    logp, pred = _answer_logprobs(teacher, model_state, h, rows, targets)
    return {"logp": logp, "pred": pred, **per_layer}


@functools.partial(jax.jit, static_argnames=("teacher",))
def _ablate_layer(teacher: TeacherSpec, layers_state, model_state, layer, h_in, fill, rows, targets):
    """Answer log-probs with each KV group of ``layer`` ablated in turn: [Hkv, B].

    h_in [B,T,d]: clean residual stream entering ``layer``; fill [Hq,D]: the replacement (zeros or the batch
    mean). The G variants of the batch run as one batch of G·B rows (variant-major) from ``layer`` on.
    """
    b, t, _ = h_in.shape
    hkv = teacher.num_kv_heads
    rep = lambda x: jnp.tile(x, (hkv,) + (1,) * (x.ndim - 1))  # noqa: E731  (variant-major batch)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (hkv * b, t))
    ablate = HeadProbe(keep=_group_variants(teacher, b), fill=fill)
    h, _ = _layer(teacher, layers_state, layer)(rep(h_in), positions, probe=ablate)

    def body(i, h):
        h, _ = _layer(teacher, layers_state, i)(h, positions)
        return h

    h = jax.lax.fori_loop(layer + 1, teacher.num_layers, body, h)
    logp, _ = _answer_logprobs(teacher, model_state, h, rep(rows), rep(targets))
    return logp.reshape(hkv, b, -1)


@functools.partial(jax.jit, static_argnames=("teacher",))
def _ablate_layer_rows(
    teacher: TeacherSpec, layers_state, model_state, layer, h_rows, fill, keys, values, rows, targets
):
    """As ``_ablate_layer`` but the group is ablated only at the answer-predicting rows (scope "answer").

    Every other position keeps its clean residual stream, so the layers need only the rows: their queries attend
    to the clean keys/values (``keys``/``values`` [L,B,T,Hkv,D] from the clean pass) with the rows' own
    keys/values written in (``HeadProbe.context``). h_rows [B,N,d]: the clean stream entering ``layer`` at the
    rows. Returns [Hkv, B, N].
    """
    hkv = teacher.num_kv_heads
    b, n, _ = h_rows.shape
    rep = lambda x: jnp.tile(x, (hkv,) + (1,) * (x.ndim - 1))  # noqa: E731  (variant-major batch)
    rows_v = rep(rows)

    def context(i):
        return rep(jax.lax.dynamic_index_in_dim(keys, i, keepdims=False)), rep(
            jax.lax.dynamic_index_in_dim(values, i, keepdims=False)
        )

    ablate = HeadProbe(keep=_group_variants(teacher, b), fill=fill, context=context(layer))
    h, _ = _layer(teacher, layers_state, layer)(rep(h_rows), rows_v, probe=ablate)

    def body(i, h):
        h, _ = _layer(teacher, layers_state, i)(h, rows_v, probe=HeadProbe(context=context(i)))
        return h

    h = jax.lax.fori_loop(layer + 1, teacher.num_layers, body, h)
    logp = _log_probs(teacher, model_state, h)
    target_logp = jnp.take_along_axis(logp, rep(targets)[..., None], axis=-1)[..., 0]
    return target_logp.reshape(hkv, b, n)


# ------------------------------------------------------------------------------------------------------------
# Batching prompts: right-padding is harmless under causal attention (no real position sees a pad).


@dataclasses.dataclass
class ProbeBatch:
    """Sequences right-padded to a common length, with the rows that predict each answer token."""

    ids: np.ndarray  # [B,T] int32
    lengths: np.ndarray  # [B] real tokens per sequence
    rows: np.ndarray  # [B,N] row P−1+i predicts the i-th continuation token
    targets: np.ndarray  # [B,N] the continuation tokens
    row_mask: np.ndarray  # [B,N] bool: real continuation tokens


def make_batch(
    prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *, pad_id: int = 0, multiple: int = 64
) -> ProbeBatch:
    """Pack prompt + continuation sequences; T is rounded up to ``multiple`` so few shapes get compiled."""
    if len(prompts) != len(continuations) or not prompts:
        raise ValueError("make_batch needs one continuation per prompt and at least one prompt.")
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    if any(len(c) == 0 for c in continuations) or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt and every continuation (answer) must have at least one token.")
    t = -(-max(map(len, seqs)) // multiple) * multiple
    n = max(map(len, continuations))
    b = len(seqs)
    ids = np.full((b, t), pad_id, np.int32)
    rows = np.zeros((b, n), np.int32)
    targets = np.zeros((b, n), np.int32)
    mask = np.zeros((b, n), bool)
    for i, (p, c, s) in enumerate(zip(prompts, continuations, seqs)):
        ids[i, : len(s)] = s
        # Unused rows repeat the last real one, so a scatter into these rows never writes anything different.
        rows[i] = len(p) - 1 + np.minimum(np.arange(n), len(c) - 1)
        targets[i] = np.asarray(c)[np.minimum(np.arange(n), len(c) - 1)]
        mask[i, : len(c)] = True
    return ProbeBatch(ids, np.array([len(s) for s in seqs]), rows, targets, mask)


def _no_ablation(teacher: FunctionalTeacher):
    keep = jnp.ones((teacher.num_layers, teacher.num_heads), jnp.float32)
    fill = jnp.zeros((teacher.num_layers, teacher.num_heads, teacher.head_dim), jnp.float32)
    return keep, fill


def run_forward(
    teacher: FunctionalTeacher, batch: ProbeBatch, *, head_keep=None, head_fill=None, collect: bool = False
) -> dict[str, np.ndarray]:
    """The probing forward on a batch (clean unless head_keep/head_fill are given); results as numpy arrays."""
    keep0, fill0 = _no_ablation(teacher)
    keep = keep0 if head_keep is None else jnp.asarray(head_keep, jnp.float32)
    fill = fill0 if head_fill is None else jnp.asarray(head_fill, jnp.float32)
    out = _clean_forward(
        teacher.spec,
        teacher.layers,
        teacher.model,
        jnp.asarray(batch.ids),
        jnp.asarray(batch.rows),
        jnp.asarray(batch.targets),
        keep,
        fill,
        collect=collect,
    )
    return {k: np.asarray(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------------------
# Retrieval score.


def count_copies(
    argmax: np.ndarray, generated: Sequence[int], prompt_ids: Sequence[int], needle_positions: Sequence[int]
) -> np.ndarray:
    """Copied-needle fraction per head for one prompt: argmax [L,Hq,N] (decode step i's attention argmax).

    Head (l, h) copies at step i when argmax[l,h,i] is a needle position j with prompt_ids[j] == generated[i];
    each needle position counts once per head. Returns [L,Hq] = copied positions / len(needle_positions).
    """
    needles = [int(j) for j in needle_positions]
    if not needles:
        raise ValueError("a retrieval prompt needs at least one needle position.")
    needle_set = set(needles)
    num_layers, num_heads, _ = argmax.shape
    copied = np.zeros((num_layers, num_heads), np.float64)
    for l in range(num_layers):
        for h in range(num_heads):
            seen = set()
            for i, w in enumerate(generated):
                j = int(argmax[l, h, i])
                if j in needle_set and j not in seen and int(prompt_ids[j]) == int(w):
                    seen.add(j)
            copied[l, h] = len(seen)
    return copied / len(needles)


def aggregate_groups(head_scores: np.ndarray, num_kv_heads: int, how: str = "mean") -> np.ndarray:
    """[L,Hq] per-query-head scores → [L,Hkv] per KV group (mean or max over the group's query heads)."""
    num_layers, num_heads = head_scores.shape
    grouped = head_scores.reshape(num_layers, num_kv_heads, num_heads // num_kv_heads)
    if how == "mean":
        return grouped.mean(-1)
    if how == "max":
        return grouped.max(-1)
    raise ValueError(f"group aggregation {how!r} is unknown; use 'mean' or 'max'.")


def _greedy(model, prompt_ids, max_new_tokens: int, eos_id):
    out = generate(model, np.asarray([prompt_ids], np.int32), max_new_tokens, eos_id=eos_id)[0].tolist()
    if eos_id is not None and eos_id in out:
        out = out[: out.index(eos_id)]
    return out


def answered(generated_text: str, answer_text: str) -> bool:
    """The model answers correctly when the answer string appears in what it generated (Wu et al.'s criterion)."""
    return answer_text.strip() != "" and answer_text.strip() in generated_text


def retrieval_scores(
    model,
    tokenizer,
    examples: Sequence[Any],
    *,
    decode: str = "greedy",
    max_extra_tokens: int = 4,
    batch_size: int = 8,
    group_aggregate: str = "mean",
    teacher: FunctionalTeacher | None = None,
) -> dict[str, Any]:
    """Retrieval score of every query head and KV group over NIAH ``examples``.

    examples: objects with ``prompt_ids``, ``answer_ids``, ``answer_text``, ``needle_positions`` (the synthetic
    task dataclass). decode="greedy" generates len(answer)+max_extra_tokens tokens and judges correctness by
    containment; decode="teacher_forced" uses the gold answer and calls a prompt correct when every answer
    token is the argmax (which is exactly when greedy decoding would emit the answer first), skipping generation.
    """
    if decode not in ("greedy", "teacher_forced"):
        raise ValueError(f"decode={decode!r} is unknown; use 'greedy' or 'teacher_forced'.")
    teacher = functional_teacher(model) if teacher is None else teacher
    eos_id = getattr(tokenizer, "eos_id", None)
    generated = []
    for ex in examples:
        if decode == "greedy":
            gen = _greedy(model, list(ex.prompt_ids), len(ex.answer_ids) + max_extra_tokens, eos_id)
            generated.append(gen if gen else list(ex.answer_ids[:1]))
        else:
            generated.append(list(ex.answer_ids))
    head_sum = np.zeros((teacher.num_layers, teacher.num_heads))
    details = []
    for start in range(0, len(examples), batch_size):
        chunk = list(range(start, min(start + batch_size, len(examples))))
        batch = make_batch([examples[i].prompt_ids for i in chunk], [generated[i] for i in chunk])
        out = run_forward(teacher, batch)
        for bi, i in enumerate(chunk):
            ex, gen = examples[i], generated[i]
            if decode == "greedy":
                correct = answered(tokenizer.decode(gen), ex.answer_text)
            else:
                correct = bool(np.all(out["pred"][bi, : len(gen)] == np.asarray(gen)))
            argmax = out["argmax"][:, bi, :, : len(gen)]  # [L,Hq,N]
            copies = count_copies(argmax, gen, ex.prompt_ids, ex.needle_positions)
            if correct:
                head_sum += copies
            details.append(
                {
                    "task": getattr(ex, "task", "niah"),
                    "length": int(len(ex.prompt_ids)),
                    "depth": getattr(ex, "depth", None),
                    "answer": ex.answer_text,
                    "generated": tokenizer.decode(gen),
                    "correct": bool(correct),
                }
            )
    n_correct = sum(d["correct"] for d in details)
    head_scores = head_sum / max(n_correct, 1)
    return {
        "head_scores": head_scores,
        "group_scores": aggregate_groups(head_scores, teacher.num_kv_heads, group_aggregate),
        "num_prompts": len(examples),
        "num_correct": int(n_correct),
        "prompts": details,
    }


# ------------------------------------------------------------------------------------------------------------
# Causal ablation.


def head_means(heads: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Mean per-head output over the batch's real positions: heads [L,B,T,Hq,D] → [L,Hq,D]."""
    t = heads.shape[2]
    valid = (np.arange(t)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)  # [B,T]
    total = np.einsum("lbthd,bt->lhd", heads.astype(np.float64), valid)
    return (total / valid.sum()).astype(np.float32)


ABLATION_SCOPES = ("all", "answer")


def ablation_scores(
    teacher: FunctionalTeacher, batch: ProbeBatch, *, mode: str = "mean", scope: str = "all"
) -> dict[str, np.ndarray]:
    """Drop in the answer log-probability when each KV group is ablated alone, on one prompt batch.

    scope="all" ablates the group at every position (the faithful intervention; ≈ Hkv·L/2 clean forwards).
    scope="answer" ablates it only at the rows that predict the answer tokens, where a retrieval head copies
    the needle into the output (≈ one clean forward in all); every other position keeps its clean state.

    Returns ``drop`` [L,Hkv,B] = log p(answer) − log p_ablated(answer) (summed over answer tokens), the clean
    ``logp`` [B], and ``clean_correct`` [B] (every answer token is the argmax).
    """
    if mode not in ("mean", "zero"):
        raise ValueError(f"ablation mode {mode!r} is unknown; use 'mean' or 'zero'.")
    if scope not in ABLATION_SCOPES:
        raise ValueError(f"ablation scope {scope!r} is unknown; use one of {ABLATION_SCOPES}.")
    clean = run_forward(teacher, batch, collect=True)
    mask = batch.row_mask
    clean_logp = (clean["logp"] * mask).sum(-1)
    fills = (
        head_means(clean["heads"], batch.lengths)
        if mode == "mean"
        else np.zeros((teacher.num_layers, teacher.num_heads, teacher.head_dim), np.float32)
    )
    drops = np.zeros((teacher.num_layers, teacher.num_kv_heads, len(batch.ids)))
    rows, targets = jnp.asarray(batch.rows), jnp.asarray(batch.targets)
    take_rows = lambda x: np.take_along_axis(x, batch.rows.reshape(batch.rows.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731  [B,T,...] → [B,N,...]
    keys, values = jnp.asarray(clean["k"]), jnp.asarray(clean["v"])
    for layer in range(teacher.num_layers):
        h_in, fill = clean["h_in"][layer], jnp.asarray(fills[layer])
        if scope == "all":
            logp = _ablate_layer(
                teacher.spec, teacher.layers, teacher.model, jnp.int32(layer), jnp.asarray(h_in), fill, rows, targets
            )
        else:
            logp = _ablate_layer_rows(
                teacher.spec,
                teacher.layers,
                teacher.model,
                jnp.int32(layer),
                jnp.asarray(take_rows(h_in)),
                fill,
                keys,
                values,
                rows,
                targets,
            )
        drops[layer] = clean_logp[None] - (np.asarray(logp) * mask[None]).sum(-1)
    correct = np.all((clean["pred"] == batch.targets) | ~mask, axis=-1)
    return {"drop": drops, "logp": clean_logp, "clean_correct": correct}


def group_ablation_masks(groups_per_layer: Sequence[Sequence[int]], num_heads: int, num_kv_heads: int) -> np.ndarray:
    """head_keep [L,Hq] that ablates the listed KV groups of every layer (0 on their query heads, 1 elsewhere)."""
    gs = num_heads // num_kv_heads
    keep = np.ones((len(groups_per_layer), num_heads), np.float32)
    for l, groups in enumerate(groups_per_layer):
        for g in groups:
            keep[l, g * gs : (g + 1) * gs] = 0.0
    return keep

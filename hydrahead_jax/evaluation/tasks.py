"""One unit of work per function: a retrieval prompt, a held-out text window, an efficiency point.

Each returns plain dicts (records) that carry their settings, so results.json is self-describing.

Perplexity of a window w of T tokens: NLL = −(1/(T−1)) Σ_{t<T−1} log p(w_{t+1} | w_{≤t}); the reported value
for a (source, length) cell is exp(mean NLL over all predicted tokens of all its windows). ``ppl_tail`` is the
same over the last quarter of each window's positions, where long context should help most.

Agreement with the teacher at every position t: top-1 = [argmax p_S(·|t) = argmax p_T(·|t)],
KL(T‖S) = Σ_v p_T(v|t) (log p_T(v|t) − log p_S(v|t)) in nats; reported as means over positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hydrahead_jax.evaluation.runner import Runner, cache_len_for, peak_device_bytes
from hydrahead_jax.evaluation.scoring import exact_match, normalize_words


def retrieval(runner: Runner, tok, example, *, answer_margin: int = 2) -> dict:
    """Greedy answer to one synthetic prompt through the decode cache, scored by exact match, and the answer's
    teacher-forced likelihood: ``answer_nll`` = −(1/n) Σ_j log p(a_j | prompt, a_<j) over the n answer tokens, in
    nats per token. Exact match is all or nothing; the NLL tells a model that reads the needle partly (or not at
    all: for a random 7-digit needle, chance is about ln 10 = 2.3 nats per digit) from one that reads it."""
    words = len(normalize_words(example.answer_text))
    # room for the answer plus a separator per listed value and a little slack
    max_new = len(example.answer_ids) + words + answer_margin
    gen = runner.generate(example.prompt_ids[None], max_new, eos_id=tok.eos_id, score_ids=example.answer_ids[None])
    ids = [int(t) for t in gen.tokens[0]]
    if tok.eos_id is not None and tok.eos_id in ids:
        ids = ids[: ids.index(tok.eos_id)]
    prediction = tok.decode(ids)
    return {
        "length": int(example.length),
        "depth": float(example.depth),
        "seed": int(example.seed),
        "answer": example.answer_text,
        "prediction": prediction,
        "correct": bool(exact_match(prediction, example.answer_text)),
        "answer_nll": float(-gen.score_logprobs[0].mean()),
        "answer_tokens": int(len(example.answer_ids)),
        "prefill_s": gen.prefill_s,
    }


@jax.jit
def _agreement(lp_t: jax.Array, lp_s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position top-1 match and KL(T‖S) from log-probs [B, C, V]."""
    kl = jnp.sum(jnp.exp(lp_t) * (lp_t - lp_s), axis=-1)
    top1 = jnp.argmax(lp_t, axis=-1) == jnp.argmax(lp_s, axis=-1)
    return top1, kl


def text_window(
    runner: Runner,
    ids: np.ndarray,
    *,
    want_nll: bool,
    hidden: jax.Array | None = None,
    teacher: Runner | None = None,
    teacher_hidden: jax.Array | None = None,
) -> dict:
    """NLL per predicted token and, with a teacher, agreement on one window ids [T].

    ``hidden``: the model's final hidden states [1, T, d] on ``ids`` when already computed (else computed here);
    ``teacher_hidden``: the teacher's on the same ids.

    Returns {"nll": float64 [T−1] or None, "top1": bool [T] or None, "kl": float64 [T] or None}.
    """
    ids = np.asarray(ids, np.int32)[None]
    h = runner.hidden_states(ids) if hidden is None else hidden
    t = ids.shape[1]
    nll = np.zeros(t - 1, np.float64) if want_nll else None
    top1, kl = (np.zeros(t, bool), np.zeros(t, np.float64)) if teacher is not None else (None, None)
    # one pass over position chunks serves both: the NLL uses positions 0 … T−2 (the last has no target)
    teacher_chunks = teacher.log_probs_chunks(teacher_hidden) if teacher is not None else None
    for start, lp in runner.log_probs_chunks(h):
        c = lp.shape[1]
        if want_nll:
            stop = min(start + c, t - 1)
            targets = jnp.asarray(ids[:, start + 1 : stop + 1])
            nll[start:stop] = -np.asarray(jnp.take_along_axis(lp[:, : stop - start], targets[..., None], axis=-1))[
                0, :, 0
            ]
        if teacher_chunks is not None:
            _, lp_t = next(teacher_chunks)
            m, k = _agreement(lp_t, lp)
            top1[start : start + c], kl[start : start + c] = np.asarray(m)[0], np.asarray(k, np.float64)[0]
    return {"nll": nll, "top1": top1, "kl": kl}


def efficiency(runner: Runner, prompt: np.ndarray, *, decode_steps: int) -> dict:
    """Prefill time, per-token decode time and compiled memory at the prompt's context length."""
    length = prompt.shape[1]
    cache_len = cache_len_for(length + decode_steps + 1)
    gen = runner.generate(prompt, decode_steps + 1, cache_len=cache_len)
    decode = np.asarray(gen.decode_s)
    return {
        "prefill_s": gen.prefill_s,
        "decode_s_per_token": float(np.median(decode)),
        "decode_steps": int(len(decode)),
        "prefill_memory_bytes": gen.prefill_bytes,
        "decode_memory_bytes": gen.decode_bytes,
        "cache_len": cache_len,
        "device_peak_bytes": peak_device_bytes(),
    }


def cache_sizes(model, length: int) -> dict:
    """Decode-cache bytes at ``length`` from the shapes ``init_cache`` allocates (the int32 position counter
    excluded): KV bytes per token (the slope) and constant state bytes (the intercept).

    Cross-checked against ``hybrid.cache_bytes`` when that accepts the model.
    """

    def nbytes(n):
        shapes = jax.eval_shape(lambda: model.init_cache(1, n))["layers"]
        return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))

    total, doubled = nbytes(length), nbytes(2 * length)
    per_token = (doubled - total) // length
    out = {"kv_bytes_per_token": per_token, "state_bytes": total - per_token * length, "total_bytes": total}
    try:
        from hydrahead_jax.hybrid import cache_bytes

        expected = cache_bytes(model, context_len=length)
    except (ImportError, AttributeError, TypeError, ValueError):
        expected = None  # e.g. a plain decoder whose attention has no hybrid config
    if expected is not None and {k: int(v) for k, v in expected.items()} != out:
        raise AssertionError(f"decode cache sizes disagree: init_cache allocates {out}, cache_bytes says {expected}.")
    return out

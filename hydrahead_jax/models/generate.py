"""Autoregressive generation with a decode cache: one prefill over the prompt, then one token per step.

Works for every model variant: the cache holds whatever each layer's attention keeps (KV for softmax groups,
a constant-size state for linear-attention groups). Functions are jitted on (graphdef, state) so that a
generation loop costs one compiled call per token and no graph walk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, input_ids, cache):
    model = nnx.merge(graphdef, state)
    logits, cache = model(input_ids, cache=cache)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode_step(graphdef, state, token, cache):
    model = nnx.merge(graphdef, state)
    logits, cache = model(token[:, None], cache=cache)
    return logits[:, -1], cache


def _pick(logits: jax.Array, temperature: float, key: jax.Array | None) -> jax.Array:
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def decode_loop(
    logits: jax.Array,
    cache,
    step: Callable[[jax.Array, Any], tuple[jax.Array, Any]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    return_logits: bool = False,
):
    """The token loop every generator shares: from the prefill's last-position ``logits`` [B, V] and ``cache``,
    pick a token (greedy when temperature is 0), then ``logits, cache = step(token, cache)`` until
    ``max_new_tokens`` tokens, or until every sequence has produced ``eos_id``. No step runs after the last token.

    Returns new tokens [B, N] (np.int32), and with ``return_logits`` the logits that chose each, [B, N, V].
    """
    key = jax.random.key(seed)
    tokens, all_logits = [], []
    done = np.zeros(logits.shape[0], bool)
    while True:
        key, sub = jax.random.split(key)
        token = _pick(logits, temperature, sub)
        tokens.append(np.asarray(token))
        if return_logits:
            all_logits.append(np.asarray(logits))
        if eos_id is not None:
            done |= tokens[-1] == eos_id
        if len(tokens) == max_new_tokens or done.all():
            break
        logits, cache = step(token, cache)
    out = np.stack(tokens, axis=1)
    return (out, np.stack(all_logits, axis=1)) if return_logits else out


def generate(
    model: nnx.Module,
    prompt_ids: Sequence[Sequence[int]] | np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    return_logits: bool = False,
):
    """Continue equal-length prompts [B, T]; greedy when temperature is 0. Returns new tokens [B, N] (np.int32).

    Stops early once every sequence has produced ``eos_id``. With ``return_logits`` also returns the logits
    that chose each new token, [B, N, V].
    """
    ids = jnp.asarray(np.asarray(prompt_ids, dtype=np.int32))
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [batch, length>0] token ids of equal length, got shape {ids.shape}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    batch, length = ids.shape
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = _prefill(graphdef, state, ids, cache)
    return decode_loop(
        logits,
        cache,
        lambda token, cache: _decode_step(graphdef, state, token, cache),
        max_new_tokens,
        temperature=temperature,
        seed=seed,
        eos_id=eos_id,
        return_logits=return_logits,
    )


def greedy_continuations(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    prefill_length: int,
    cache_length: int,
    eos_id: int | None = None,
    stop: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """Greedy continuations of prompts of different lengths, as one batch through the decode cache.

    Every row runs through the same positions 0, 1, …: the first ``prefill_length`` tokens (at most the shortest
    prompt) in one prefill, then one token per step, which is row i's own prompt token n while n < len(prompts[i])
    (teacher forcing: the logits of that step are not used) and its greedy pick after. No padding ever enters a
    row, so each row's continuation is that of its prompt alone, and the compiled programs depend only on
    (rows, ``prefill_length``, ``cache_length``), not on the prompts' lengths: a caller that rounds those two to a
    few sizes runs many prompts on a few programs.

    A row is finished after ``max_new_tokens`` tokens, after ``eos_id`` (kept in its output), or when
    ``stop(row, its tokens so far)`` is true; finished rows keep stepping (their outputs frozen) until every row
    is finished. ``cache_length`` must hold the longest prompt plus ``max_new_tokens``.
    """
    lengths = [len(p) for p in prompts]
    if not prompts or not 1 <= prefill_length <= min(lengths):
        raise ValueError(
            f"prefill_length={prefill_length} must lie in [1, shortest prompt = {min(lengths, default=0)}]."
        )
    if cache_length < max(lengths) + max_new_tokens or max_new_tokens < 1:
        raise ValueError(
            f"cache_length={cache_length} must hold the longest prompt ({max(lengths)}) plus max_new_tokens="
            f"{max_new_tokens} (>= 1)."
        )
    graphdef, state = nnx.split(model)
    head = np.asarray([p[:prefill_length] for p in prompts], np.int32)
    logits, cache = _prefill(graphdef, state, jnp.asarray(head), model.init_cache(len(prompts), cache_length))
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    position = prefill_length  # of the token the next step feeds
    while True:
        picked = np.asarray(_pick(logits, 0.0, None))
        feed = picked.copy()
        for i, prompt in enumerate(prompts):
            if position < lengths[i]:
                feed[i] = prompt[position]
            elif not done[i]:
                out[i].append(int(picked[i]))
                done[i] = (
                    len(out[i]) == max_new_tokens
                    or (eos_id is not None and out[i][-1] == eos_id)
                    or (stop is not None and stop(i, out[i]))
                )
        if done.all():
            return out
        logits, cache = _decode_step(graphdef, state, jnp.asarray(feed), cache)
        position += 1

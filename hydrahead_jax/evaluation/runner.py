"""Compiled inference pieces for evaluation: prefill, one-token decode, hidden states, chunked log-probs.

Why not ``models.generate``: it returns logits for every prompt position from prefill ([B, T, V] f32 is 6.4 GB at
32K tokens with a 49K vocabulary) and times prefill and decode together. Here prefill projects only the last
position, each executable is compiled ahead of time so its memory need (``memory_analysis``) is known before
anything is allocated, and prefill and decode are timed separately. The token loop itself is the one of
``models.generate`` (``decode_loop``).

Memory accounting: ``need_bytes = argument + output + temp − alias`` of the compiled executable (XLA's own
buffer assignment). Parameters are among the arguments and already resident, so ``extra_bytes`` (need minus the
parameters) is what running it adds.

Context parallelism (``Runner(mesh=...)`` with a ``sequence`` axis of n > 1, ``eval.py --mesh-sequence n``): the
parameters are placed on the mesh by the logical-axis rules and every executable is compiled and run under it, so a
prefill (and a perplexity forward) splits the prompt's tokens over the n devices (``Transformer.hidden_states``)
and decoding runs unsplit over ``sequence`` from the filled cache (a decode step has one token). A prompt of T
tokens is prefilled up to its largest multiple of 2n, T' = T − (T mod 2n) (a prefill must not write end-padding into
the cache), and its last T − T' tokens are fed as decode steps: the same cache and last-position logits as one
prefill of T tokens. Memory figures are then per device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.compilation import executable_cache
from hydrahead_jax.models.generate import decode_loop


class OutOfMemory(RuntimeError):
    """A computation that does not fit in the memory available; the message says how much it needs."""


def _tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def available_memory_bytes() -> tuple[int, str]:
    """Free memory on the default device and where the number comes from.

    Accelerators: ``bytes_limit − bytes_in_use`` from ``Device.memory_stats()``. CPU (no memory_stats): the host's
    ``MemAvailable`` from /proc/meminfo, else physical memory from ``os.sysconf``.
    """
    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), "device memory_stats"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "/proc/meminfo MemAvailable"
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "physical memory (sysconf)"


def peak_device_bytes() -> int | None:
    """The device's peak bytes in use so far (accelerators only; None on CPU)."""
    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def compiled_bytes(compiled) -> int | None:
    """argument + output + temp − alias of a compiled executable, or None when XLA does not report it."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes)


def is_allocation_error(err: BaseException) -> bool:
    text = str(err)
    return (
        isinstance(err, MemoryError)
        or "RESOURCE_EXHAUSTED" in text
        or "Out of memory" in text
        or "out of memory" in text
    )


# (graphdef, parameter shapes, executable key) → compiled executable, shared by every Runner of this process.
_EXECUTABLES: dict = executable_cache()  # emptied by compilation.release_compiled


# Jitted bodies; the graphdef is static, so one trace per (model structure, shapes).


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, ids, cache):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(ids, cache=cache)
    return model.logits_from_hidden(h[:, -1]), cache


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(3,))
def _decode(graphdef, state, token, cache):
    model = nnx.merge(graphdef, state)
    h, cache = model.hidden_states(token[:, None], cache=cache)
    return model.logits_from_hidden(h[:, -1]), cache


@functools.partial(jax.jit, static_argnums=(0,))
def _hidden(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    h, _ = model.hidden_states(ids)
    return h


@functools.partial(jax.jit, static_argnums=(0,))
def _log_probs(graphdef, state, h):
    """log softmax of the logits of hidden states h [B, C, d] → [B, C, V] (float32)."""
    model = nnx.merge(graphdef, state)
    return jax.nn.log_softmax(model.logits_from_hidden(h), axis=-1)


def cache_len_for(total_tokens: int, bucket: int = 256) -> int:
    """Cache capacity for ``total_tokens`` (prompt + new tokens), rounded up so prompts of one nominal length
    share a compiled decode step."""
    return -(-total_tokens // bucket) * bucket


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # int32 [B, N] greedy tokens
    prefill_s: float  # wall time of the prefill call (compiled; compile time excluded)
    decode_s: list[float]  # wall time of each decode step after the first token
    prefill_bytes: int | None  # compiled need of prefill
    decode_bytes: int | None  # compiled need of one decode step
    score_logprobs: np.ndarray | None = None  # float64 [B, n]: log p(score_ids[:, j] | prompt, score_ids[:, :j])


class Runner:
    """Evaluation-time inference for one model, with executables compiled per shape and memory-checked.

    ``memory_limit`` (bytes, optional) caps what a computation may add beyond the resident parameters; by
    default the limit is the free memory reported by ``available_memory_bytes()`` at the time of the check.
    ``mesh`` (optional): run under this device mesh (context parallelism over its ``sequence`` axis; module doc).
    """

    def __init__(self, model: nnx.Module, *, memory_limit: int | None = None, logits_chunk: int = 1024, mesh=None):
        self.model = model
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        if mesh is None:
            self.param_bytes = _tree_bytes(self.state)
        else:
            from hydrahead_jax.training.sharding import state_shardings  # only with a mesh: loading needs no training

            self.state = jax.device_put(nnx.as_pure(self.state), state_shardings(self.state, mesh))
            self.param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.state))
        # models of one structure (a teacher and its same-shaped copies) share compiled executables
        self._signature = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(self.state))
        self.memory_limit = memory_limit
        self.logits_chunk = logits_chunk
        self._compiled: dict = {}
        self._refused: dict[tuple, str] = {}
        self.last_check: dict = {}

    # -- compilation with a memory check ---------------------------------------------------------------

    def _check(self, what: str, compiled) -> int | None:
        need = compiled_bytes(compiled)
        if need is None:
            return None
        extra = max(need - self.param_bytes, 0)
        if self.memory_limit is not None:
            limit, source = self.memory_limit, "--memory-limit"
        else:
            limit, source = available_memory_bytes()
            limit = int(limit * 0.9)  # leave room for the allocator and the rest of the process
        self.last_check = {
            "what": what,
            "need_bytes": need,
            "extra_bytes": extra,
            "limit_bytes": limit,
            "limit_source": source,
        }
        if extra > limit:
            raise OutOfMemory(
                f"{what} needs {extra / 2**30:.2f} GiB beyond the parameters (XLA memory_analysis) "
                f"but only {limit / 2**30:.2f} GiB is available ({source})."
            )
        return need

    def _get(self, key, fn, *args):
        """The compiled executable for ``key`` (compiled once) and its memory need; a shape found not to fit is
        remembered, so later requests fail fast without compiling again."""
        if key in self._refused:
            raise OutOfMemory(self._refused[key])
        if key not in self._compiled:
            shared = (self.graphdef, self._signature, self.mesh, key)
            try:
                if shared not in _EXECUTABLES:
                    with self._on_mesh():
                        _EXECUTABLES[shared] = fn.lower(self.graphdef, *args).compile()
                compiled = _EXECUTABLES[shared]
                need = self._check(f"{key[0]} {key[1:]}", compiled)
            except OutOfMemory as err:
                self._refused[key] = str(err)
                raise
            except Exception as err:  # XLA can refuse to compile what it cannot allocate
                if is_allocation_error(err):
                    self._refused[key] = f"{key[0]} at shape {key[1:]} could not be compiled: {str(err)[:300]}"
                    raise OutOfMemory(self._refused[key]) from err
                raise
            self._compiled[key] = (compiled, need)
        return self._compiled[key]

    def _on_mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    @property
    def sequence_parts(self) -> int:
        """Prefill lengths must be multiples of this: 2n under context parallelism over n devices, else 1."""
        n = 1 if self.mesh is None else int(self.mesh.shape.get("sequence", 1))
        return 2 * n if n > 1 else 1

    def _call(self, compiled, *args):
        if self.mesh is not None:  # inputs (the cache a prefill returned, host arrays) where the executable wants them
            args = jax.device_put(args, compiled.input_shardings[0])
        try:
            with self._on_mesh():
                return jax.block_until_ready(compiled(*args))
        except Exception as err:
            if is_allocation_error(err):
                raise OutOfMemory(f"allocation failed while running: {str(err)[:300]}") from err
            raise

    def prefill_executable(self, batch: int, length: int, cache_len: int):
        cache = jax.eval_shape(lambda: self.model.init_cache(batch, cache_len))
        ids = jax.ShapeDtypeStruct((batch, length), jnp.int32)
        return self._get(("prefill", batch, length, cache_len), _prefill, self.state, ids, cache)

    def decode_executable(self, batch: int, cache_len: int):
        cache = jax.eval_shape(lambda: self.model.init_cache(batch, cache_len))
        tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return self._get(("decode", batch, cache_len), _decode, self.state, tok, cache)

    def check_fits(self, batch: int, length: int, cache_len: int) -> None:
        """Compile prefill and decode for these shapes; raises OutOfMemory before allocating anything big."""
        if length - length % self.sequence_parts:
            self.prefill_executable(batch, length - length % self.sequence_parts, cache_len)
        self.decode_executable(batch, cache_len)

    # -- generation --------------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: np.ndarray,
        max_new_tokens: int,
        *,
        eos_id: int | None = None,
        cache_len: int | None = None,
        score_ids: np.ndarray | None = None,
    ) -> Generation:
        """Greedy continuation of equal-length prompts [B, T] through the model's decode cache.

        ``score_ids`` [B, n] (optional): also score this continuation teacher-forced,
        ``score_logprobs[:, j] = log p(score_ids[:, j] | prompt, score_ids[:, :j])``: the first from the prefill's
        logits, the rest from n − 1 decode steps on a copy of the prefilled cache (so the greedy continuation is
        unchanged, and the score costs n − 1 decode steps rather than another prefill)."""
        ids = np.asarray(prompt_ids, np.int32)
        if ids.ndim == 1:
            ids = ids[None]
        b, t = ids.shape
        n_score = 0 if score_ids is None else np.asarray(score_ids).shape[-1]
        cache_len = cache_len or cache_len_for(t + max(max_new_tokens, n_score))
        if cache_len < t + max(max_new_tokens, n_score):
            raise ValueError(
                f"cache_len={cache_len} cannot hold {t} prompt + {max(max_new_tokens, n_score)} new tokens."
            )
        head = t - t % self.sequence_parts  # the prefilled tokens; the rest are fed as decode steps (module doc)
        prefill, prefill_bytes = self.prefill_executable(b, head, cache_len) if head else (None, None)
        decode, decode_bytes = self.decode_executable(b, cache_len)
        cache = self.model.init_cache(b, cache_len)
        start = time.perf_counter()
        if head:
            logits, cache = self._call(prefill, self.state, jnp.asarray(ids[:, :head]), cache)
        for i in range(head, t):
            logits, cache = self._call(decode, self.state, jnp.asarray(ids[:, i]), cache)
        prefill_s = time.perf_counter() - start
        scores = None if score_ids is None else self._score(decode, logits, cache, score_ids)
        times = []

        def timed_step(token, cache):
            start = time.perf_counter()
            out = self._call(decode, self.state, token, cache)
            times.append(time.perf_counter() - start)
            return out

        tokens = decode_loop(logits, cache, timed_step, max_new_tokens, eos_id=eos_id)
        return Generation(tokens, prefill_s, times, prefill_bytes, decode_bytes, scores)

    def _score(self, decode, logits, cache, score_ids) -> np.ndarray:
        """Teacher-forced log-probs [B, n] of ``score_ids`` after the prefill's ``logits`` and ``cache`` (which
        stays as it is: the steps run on a copy, the decode step donating it)."""
        score_ids = np.asarray(score_ids, np.int32).reshape(logits.shape[0], -1)
        cache = jax.tree.map(jnp.copy, cache)
        out = []
        for j in range(score_ids.shape[1]):
            lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), np.float64)
            out.append(lp[np.arange(lp.shape[0]), score_ids[:, j]])
            if j + 1 < score_ids.shape[1]:
                logits, cache = self._call(decode, self.state, jnp.asarray(score_ids[:, j]), cache)
        return np.stack(out, axis=1)

    # -- scoring text --------------------------------------------------------------------------------------

    def hidden_states(self, ids: np.ndarray) -> jax.Array:
        """Final hidden states [B, T, d] of a full causal forward pass (no cache)."""
        ids = jnp.asarray(np.asarray(ids, np.int32))
        compiled, _ = self._get(
            ("forward", *ids.shape), _hidden, self.state, jax.ShapeDtypeStruct(ids.shape, jnp.int32)
        )
        return self._call(compiled, self.state, ids)

    def log_probs_chunks(self, h: jax.Array):
        """Yield (start, log_probs [B, C, V]) over chunks of the positions of h [B, T, d].

        Chunking bounds memory to B·C·V floats instead of B·T·V; the last chunk is shorter when C ∤ T.
        """
        t = h.shape[1]
        for start in range(0, t, self.logits_chunk):
            chunk = h[:, start : start + self.logits_chunk]
            compiled, _ = self._get(
                ("log_probs", *chunk.shape), _log_probs, self.state, jax.ShapeDtypeStruct(chunk.shape, chunk.dtype)
            )
            yield start, self._call(compiled, self.state, chunk)

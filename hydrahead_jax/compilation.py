"""Compiled executables across a long process: the persistent compilation cache, and releasing what is compiled.

A run that compiles many programs in one process (every stage of a conversion, then an evaluation; the comparison
trains and evaluates many variants) keeps each XLA:CPU executable's JIT code in memory mappings of its own. The
kernel limits a process's mappings (``vm.max_map_count``, 65,530 by default), and past it LLVM fails with "Cannot
allocate memory" although RAM is free: measured, the demo's selection probe alone leaves ~7,000 mappings. Work
that will not run a program again drops it with ``release_compiled()``; the persistent cache makes compiling it
again, where it is needed after all, a disk read.
"""

from __future__ import annotations

import gc
import os

import jax

# Module-level caches of compiled executables (evaluation.runner's), cleared by release_compiled.
_EXECUTABLE_CACHES: list[dict] = []


def executable_cache() -> dict:
    """A dict for compiled executables that ``release_compiled()`` empties."""
    cache: dict = {}
    _EXECUTABLE_CACHES.append(cache)
    return cache


def release_compiled() -> None:
    """Drop every compiled executable this process holds: ours (``executable_cache``) and jax's jit caches.
    Objects that kept an executable themselves (a Runner's own table) keep it until they are dropped."""
    for cache in _EXECUTABLE_CACHES:
        cache.clear()
    jax.clear_caches()
    gc.collect()


def memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit ``vm.max_map_count``), or None where
    /proc does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            held = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as limit:
            return held, int(limit.read())
    except OSError:
        return None


# The persistent cache's size limit. Any limit makes jax hold a file lock around every read and write of the cache:
# without one, a process can read an entry another process is still writing (the processes of a multi-process run
# on one machine, a run beside an evaluation) and crash deserialising it. The least recently used entries go first.
# The price: each write lists the whole cache under the lock, cheap while only programs that took >= 1 s to compile
# are kept (tens per run; the test suite, which would keep thousands of small ones, does without the lock).
CACHE_MAX_BYTES = 20 * 2**30


def use_persistent_cache() -> None:
    """Compiled programs persist under the data cache (``$JAX_COMPILATION_CACHE_DIR`` wins when set, with the
    other ``$JAX_*`` cache settings): a resumed (preempted) run, the next stage with the same shapes, or a variant
    of the same shape reads them instead of compiling again."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        from hydrahead_jax.data.corpus import cache_dir

        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)

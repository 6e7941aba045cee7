"""Test setup: 8 simulated CPU devices (must be set before JAX initialises) and shared fixtures."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Most of the suite's time is XLA:CPU compiling small programs (tiny models, interpret-mode Pallas kernels) that
# then run for milliseconds, and LLVM's optimisation passes are the bulk of each compile. At level 0 the generated
# code computes the same operations in the same order (fast-math stays off either way; at most a fused multiply-add
# rounds differently), so every assertion checks the same values, while a test that is mostly compilation runs
# 1.5-1.7x faster. Set in os.environ, so the train.py and bench subprocesses of the tests inherit it; an explicit
# level in $XLA_FLAGS wins (=3 is XLA's default).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

# One persistent compilation cache for the pytest workers and the train.py / bench subprocesses they start (which
# inherit os.environ): many tests compile the same tiny programs again (every train.py run of the tiny recipe, the
# processes of a resume test), and every program is worth keeping (threshold 0). The size limit is what makes the
# sharing safe: with one, jax locks the cache around each read and write, so no process deserialises an entry
# another is still writing (without it, two workers crashed that way).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "hydrahead_test_jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(20 * 2**30))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import collections  # noqa: E402
import fcntl  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gensim_wheel():
    """The gensim 4.4.0 wheel that carries the default corpus, from the project cache ($HYDRAHEAD_CACHE or
    ~/.cache/hydrahead_jax): on a new machine it is fetched from PyPI once, as `make demo` does. Tests copy it into
    their own cache folders. A lock keeps parallel pytest workers from downloading it twice at once."""
    from hydrahead_jax.data.corpus import cache_dir, fetch_gensim_wheel

    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".gensim-download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return fetch_gensim_wheel(cache)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """Files that hold a test marked ``slow`` run first, then the other files by their number of tests, most first
    (each file's own order kept). `make test` hands whole files to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``): starting the long files first leaves only short ones for the end, so the two workers
    finish together instead of one running a long file alone (xdist's own order, by number of tests only, left the
    two-process training run and the fault injection, files of few but long tests, for the end)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    counts = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.path not in slow_files, -counts[item.path]))  # stable within a file


@pytest.fixture(scope="session")
def show(request):
    """A function that prints past pytest's output capture: the tables the compile tiers report (per-chip memory,
    VMEM, registers) appear in the run's output whether the tests pass or not."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def show(text: str) -> None:
        with capture.global_and_fixture_disabled():
            print(text, flush=True)

    return show

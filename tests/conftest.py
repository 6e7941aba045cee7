"""Test setup: 8 simulated CPU devices (must be set before JAX initialises) and shared fixtures."""

import os

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

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# No persistent compilation cache in the test processes themselves: deserialising XLA:CPU executables that two
# pytest workers write and read at once crashed workers (a segfault in the cache read, an abort in a compile);
# the train.py and bench subprocesses get one from train_helpers, each run reading what an earlier run wrote.
# jax's lock around the cache (on with a size limit, as hydrahead_jax.compilation sets it) would make sharing
# safe, but each write then lists and reads the whole cache under the lock: with the thousands of small programs
# the suite compiles, the workers spent their time waiting on it (a run measured 2026-12-04 was past 45 min at
# 41 % of the tests, against 36 min for the whole suite without it).


import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import io  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

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


def _made_once(tmp_path_factory, name: str, make) -> tuple[Path, str]:
    """(folder, text) of something several test files read and none writes, made once per test session: under
    xdist the workers share it through their common temporary folder, the first to ask makes it under a lock
    (``make(folder)`` returns the text to keep, e.g. what it printed), the others wait for it. A test that would
    write to it copies it first (``shutil.copytree``)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a worker that died while making it left
                done.write_text(make(folder))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder, done.read_text()


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    config: object  # the recipe (train_helpers.finished_run_config())
    workdir: Path
    final: Path  # the export
    stdout: str  # what the run printed


@pytest.fixture(scope="session")
def tiny_finished_run(tmp_path_factory):
    """One finished in-process run of the tiny recipe on the 8 simulated devices
    (``train_helpers.finished_run_config``: every stage and the export), shared by the tests that only read it (the
    held-out evaluation's, the pipeline's)."""
    from train_helpers import finished_run_config

    from hydrahead_jax.run_config import RunConfig
    from hydrahead_jax.training.pipeline import run_pipeline

    c = finished_run_config()

    def make(workdir):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_pipeline(RunConfig.from_recipe(c), workdir)
        return out.getvalue()

    workdir, stdout = _made_once(tmp_path_factory, "tiny_finished_run", make)
    return FinishedRun(config=c, workdir=workdir, final=workdir / "final", stdout=stdout)


@pytest.fixture(scope="session")
def tiny_train_py_run(tmp_path_factory) -> Path:
    """The workdir of one plain ``train.py --config configs/tiny.py`` run (one device, a subprocess as users run
    it), shared by the tests that only read it (the memory plan's, the fault injection's reference)."""
    from train_helpers import run_train

    def make(workdir):
        proc = run_train(workdir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    return _made_once(tmp_path_factory, "tiny_train_py_run", make)[0]


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drops JAX's compiled programs once a test leaves this process past half its memory-mapping limit.

    Each compiled program holds mappings until released (hydrahead_jax/compilation.py); a pytest worker compiles
    tens of thousands of small ones. A serial run of the files up to test_streaming_heads.py held 28,836 mappings a
    tenth of the way through and 61,553 at its peak, against vm.max_map_count = 65,530; the workers' crashes
    (a segmentation fault inside ``backend_compile_and_load``, in a different test each time, late in a long-lived
    worker) match that limit. A later test that needs a released program compiles it again."""
    yield
    from hydrahead_jax.compilation import memory_mappings, release_compiled

    mappings = memory_mappings()
    if mappings is not None and mappings[0] > mappings[1] // 2:
        release_compiled()


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: only the tests that run are ordered
def pytest_collection_modifyitems(config, items):
    """Files that hold a test marked ``slow`` run first, then the other files by their number of tests, most first
    (each file's own order kept). `make test` hands whole files to its workers in this order (``--dist loadfile
    --no-loadscope-reorder``): starting the long files first leaves only short ones for the end, so the workers
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


def pytest_sessionfinish(session, exitstatus):
    """A run whose ``-m`` leaves none of the tests asked for (`make test PYTEST_ARGS='-k two_processes'`: only
    end-to-end tests match) ran its tier's share of them, none: exit 0 rather than pytest's 5 ("no tests ran").
    Under pytest-xdist the workers deselect, so the controller knows only that nothing ran."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("markexpr"):
        print(f"\nno test left after -m {session.config.getoption('markexpr')!r}")
        session.exitstatus = pytest.ExitCode.OK


@pytest.fixture(scope="session")
def libtpu():
    """The TPU compiler (libtpu), for the tests that compile for TPU chips (libtpu's compile-only devices): `make
    test-all` installs it in a folder of its own ($HYDRAHEAD_LIBTPU_DIR, .venv/libtpu), outside the venv's
    site-packages, since every JAX process that can import libtpu initialises it at start and on a machine without a
    TPU prints its errors. The folder goes on this test process's import path only: the train.py and bench
    subprocesses of the tests never load it. JAX_PLATFORMS=cpu (above) keeps it from becoming this process's
    backend; jax's ``get_topology_desc`` loads it for compile-only devices."""
    import importlib.util
    import sys

    if importlib.util.find_spec("libtpu") is None:
        folder = Path(os.environ.get("HYDRAHEAD_LIBTPU_DIR") or Path(__file__).resolve().parents[1] / ".venv/libtpu")
        if not (folder / "libtpu").is_dir():
            pytest.fail(f"the TPU compiler is not installed in {folder}: `make libtpu` (or `make test-all`) does it")
        sys.path.insert(0, str(folder))
        importlib.invalidate_caches()

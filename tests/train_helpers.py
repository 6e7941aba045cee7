"""Helpers for the training tests: the recipe configs (configs/ lives at the repo root, outside the package)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def tiny_config():
    from configs import tiny

    return tiny.get_config()


def run_train(workdir, *overrides, timeout=600, wait=True, config=None):
    """train.py on configs/tiny.py (or the recipe file ``config``) in a subprocess with ONE CPU device (the tests'
    8-device flag removed)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    )
    env["JAX_PLATFORMS"] = "cpu"
    # Reruns of the same stage (resume tests) reuse compiled steps instead of compiling again.
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "hydrahead_test_jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config",
        str(config or ROOT / "configs" / "tiny.py"),
        "--workdir",
        str(workdir),
        *overrides,
    ]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

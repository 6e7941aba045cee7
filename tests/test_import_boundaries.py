"""Package boundaries: ``hydrahead_jax.models`` is the teacher alone (it imports nothing from ``hybrid``,
``selection`` or ``training``), ``hydrahead_jax.context_parallel`` likewise (the hybrid calls it, never the other
way), and ``pallas_kernels`` stands alone (it never imports ``hydrahead_jax``).

Two independent checks: the import statements in the source (``ast``, so a lazy import inside a function counts
too), and the modules a fresh interpreter has loaded after importing the package.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS_MUST_NOT_IMPORT = ("hydrahead_jax.hybrid", "hydrahead_jax.selection", "hydrahead_jax.training")
# context_parallel (the sequence-parallel attention, gated delta rule and causal conv) sits below the hybrid model
# that calls it: importing hybrid back would be a cycle.
CONTEXT_PARALLEL_MUST_NOT_IMPORT = MODELS_MUST_NOT_IMPORT
BOUNDARIES = {
    # the PyTorch code copied into every Hugging Face export (export_hf): it must load without this project
    "hydrahead_jax/hf_remote": ("hydrahead_jax",),
    "hydrahead_jax/models": MODELS_MUST_NOT_IMPORT,
    "hydrahead_jax/context_parallel": CONTEXT_PARALLEL_MUST_NOT_IMPORT,
    "pallas_kernels": ("hydrahead_jax",),
}


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module an ``import`` or ``from … import`` anywhere in the file names (relative imports resolved)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports of a forbidden package by a file under ``folder``; the folder's own package may import itself."""
    own = folder.replace("/", ".")
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for name in sorted(imported_modules(path, package)):
            inside = name == own or name.startswith(own + ".")
            if not inside and any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(BOUNDARIES))
def test_source_imports_stay_inside_the_boundary(folder):
    assert (ROOT / folder).is_dir()
    assert violations(folder, BOUNDARIES[folder]) == []


def test_the_ast_check_sees_lazy_and_relative_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from hydrahead_jax.hybrid import build\n\nfrom ..selection import probes\n")
    names = imported_modules(source, "hydrahead_jax.models")
    assert "hydrahead_jax.hybrid" in names and "hydrahead_jax.selection" in names


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("hydrahead_jax.models", MODELS_MUST_NOT_IMPORT),
        ("hydrahead_jax.context_parallel", CONTEXT_PARALLEL_MUST_NOT_IMPORT),
        ("pallas_kernels", ("hydrahead_jax",)),
    ],
)
def test_a_fresh_import_loads_nothing_across_the_boundary(package, forbidden):
    code = (
        f"import json, sys, {package}, {package}.generate\n"
        if package == "hydrahead_jax.models"
        else f"import json, sys, {package}\n"
    )
    code += "print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert package in loaded
    crossing = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert crossing == []

"""The evaluation's journal: every finished unit of the suite, so that a run stopped part-way (a kill, a preempted
job, a full disk) goes on where it stopped when the same command is run again.

``<out>/progress.jsonl`` holds one JSON line per line of work: first a header naming the run (the suite settings
and, per model, its name, spec and a digest of its parameters), then one entry per finished unit with what the
unit added to the suite's records. A rerun with the same ``--out`` replays the entries and runs only the units
that are missing; a journal of other settings or other models is refused before any work, naming what differs,
and never overwritten. Only a last line cut short by the kill is dropped (that unit runs again).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NAME = "progress.jsonl"
VERSION = 1


class JournalError(ValueError):
    """A journal that belongs to another run or cannot be read; the message names the fix."""


def params_digest(model: nnx.Module) -> str:
    """A digest of a model's parameters: per leaf its path, shape, dtype and the float32 sum and sum of squares of
    its values (two reductions on the device, so a multi-GB model is not copied to the host). Equal for the same
    weights loaded again on the same backend; a retrained or different checkpoint changes it."""
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(state)

    def moments(xs):
        return [jnp.stack([jnp.sum(x.astype(jnp.float32)), jnp.sum(jnp.square(x.astype(jnp.float32)))]) for x in xs]

    sums = jax.jit(moments)([x for _, x in leaves])
    h = hashlib.sha256()
    for (path, x), s in zip(leaves, sums):
        h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{x.dtype}|".encode())
        h.update(np.asarray(s, np.float32).tobytes())
    return h.hexdigest()[:16]


def to_json(x: Any) -> Any:
    """JSON-safe copy of a unit's records (numpy scalars and arrays to Python values; floats round-trip exactly)."""
    if isinstance(x, dict):
        return {k: to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def _flat(x: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): x}


def model_digests(out: str | Path) -> dict[str, str]:
    """{model name: parameter digest} from the header of the journal in ``out`` (a finished or stopped run's
    folder); empty where there is no journal."""
    path = Path(out) / NAME
    if not path.is_file():
        return {}
    with path.open() as f:
        header = json.loads(f.readline() or "{}")
    return {m["name"]: m["params"] for m in header.get("models", [])}


class Journal:
    """``<out>/progress.jsonl`` of the run named by ``header`` (JSON-safe)."""

    def __init__(self, out: str | Path, header: dict, *, per_run_folder: bool = False):
        """``per_run_folder``: the journal goes to ``out/<digest of the header>/`` instead, so each run (settings and
        models) has its own and another run never meets it (for a caller that reruns evaluations of changed
        models itself, as the comparison does)."""
        self.header = to_json({"journal": VERSION, **header})
        digest = hashlib.sha256(json.dumps(self.header, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(out) / (digest if per_run_folder else "") / NAME

    def load(self) -> list[dict]:
        """The finished units' entries of this run (none for a new run). Raises JournalError for a journal of
        another run; a last line cut short by a kill is dropped from the file (its unit runs again)."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        entries, good = [], 0
        for i, line in enumerate(lines):
            try:
                entries.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if i < len(lines) - 1:
                    raise JournalError(
                        f"{self.path}: line {i + 1} is not JSON, yet lines follow it (not a cut-short last line). "
                        f"Fix: another --out, or move {self.path} away to evaluate from the start."
                    ) from None
                break
            good += len(line) + 1
        if entries and entries[0] != self.header:
            a, b = _flat(entries[0]), _flat(self.header)
            diff = [
                f"{k}: {a.get(k, '(none)')!r} there, {b.get(k, '(none)')!r} now"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
            raise JournalError(
                f"{self.path} holds an evaluation of other settings or models ({'; '.join(diff[:4])}"
                f"{'; …' if len(diff) > 4 else ''}). Fix: run the command that started it to finish it, pass another "
                f"--out, or move {self.path} away to evaluate from the start."
            )
        if good != len(data):  # a cut-short last line dropped, or the newline after a whole one restored
            with open(self.path, "r+b") as f:
                f.truncate(min(good, len(data)))
                if good > len(data):
                    f.seek(0, os.SEEK_END)
                    f.write(b"\n")
        return entries[1:]

    def start(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write(self.header)

    def append(self, entry: dict) -> None:
        self._write(to_json(entry))

    def _write(self, obj: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

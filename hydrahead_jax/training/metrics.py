"""Progress bar (tokens/s, ETA), metrics.jsonl, TensorBoard event files and the held-out summary of one stage.

metrics.jsonl holds one row per training step {"stage", "step", "tokens_seen", "step_time_s", "tokens_per_s",
<metrics>} and one per held-out evaluation {"stage", "step", "tokens_seen", "split": "heldout", <metrics>}
(step 0: before the first update); at most one row per (stage, step, split)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import jax
from tqdm import tqdm

from hydrahead_jax.storage import RunPath, is_object_store, run_path, write_text_atomic


class NonFiniteLossError(RuntimeError):
    """A NaN/inf loss or gradient norm; the stage stops and its last good checkpoint is kept."""


def _drop_rows_after(path, stage: str, step: int) -> None:
    """Remove the rows of ``stage`` past ``step`` (logged by a run killed before its next checkpoint; the resumed
    run logs those steps again; step −1: all of them, a stage that starts over logs its step-0 held-out row
    again), so metrics.jsonl keeps one row per (step, split). Rewritten atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
            stale = row.get("stage") == stage and int(row.get("step", 0)) > step
        except (ValueError, TypeError, AttributeError):
            stale = not line.endswith("\n")  # a row cut short by the kill
        if not stale:
            kept.append(line)
    if len(kept) != len(lines):
        write_text_atomic(path, "".join(kept))


class JsonlAppender:
    """Appends lines to a JSON-lines file: a local file line-buffered as they come; an object, which cannot be
    appended to, rewritten whole with every line so far at most every ``flush_every_s`` and at ``flush``/``close``
    (a run killed in between loses those rows of the log only; the resumed stage logs its steps again)."""

    def __init__(self, path, *, flush_every_s: float = 30.0):
        self._path, self._every = path, flush_every_s
        self._local = not is_object_store(path)
        self._lines = None if self._local else (path.read_text().splitlines(keepends=True) if path.exists() else [])
        self._file = open(path, "a", buffering=1) if self._local else None
        self._flushed = time.monotonic()

    def write(self, line: str) -> None:
        if self._local:
            self._file.write(line)
            return
        self._lines.append(line)
        if time.monotonic() - self._flushed >= self._every:
            self.flush()

    def flush(self) -> None:
        if not self._local:
            self._path.write_text("".join(self._lines))
            self._flushed = time.monotonic()

    def close(self) -> None:
        if self._local:
            self._file.close()
        else:
            self.flush()


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch. Its writer module imports torch whenever torch is
    installed (3.4 s and several hundred MB at every start of a run on a machine with the dev extras), only to
    accept torch tensors, which nothing here passes; a ``None`` entry in ``sys.modules`` makes that import fail
    the way it does without torch. Where torch is already imported, tensorboardX gets it as usual."""
    block = "torch" not in sys.modules
    if block:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter
    finally:
        if block:
            del sys.modules["torch"]
    return SummaryWriter


class StageLogger:
    """Writes one JSON line per step to ``workdir/metrics.jsonl`` and scalars to ``workdir/tensorboard``."""

    def __init__(
        self,
        workdir: RunPath,
        stage: str,
        *,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        tensorboard: bool = True,
        progress: bool = True,
        heldout_file: RunPath | None = None,
        heldout_shape: tuple[int, int] | None = None,
    ):
        self.stage, self.tokens_per_step = stage, tokens_per_step
        path = run_path(workdir) / "metrics.jsonl"
        self._jsonl = self._tb = None
        # heldout.json: the held-out batch's shape (rows, seq_len) and the first and last held-out rows of the stage.
        self._heldout_file, self._heldout_shape = heldout_file, heldout_shape
        self._heldout_first = self._heldout_last = None
        primary = jax.process_index() == 0  # every process computes the same metrics; process 0 writes them
        if primary:
            _drop_rows_after(path, stage, start_step if start_step > 0 else -1)  # step 0 is logged again
            self._jsonl = JsonlAppender(path)
            if start_step > 0 and heldout_file is not None and heldout_file.exists():
                self._heldout_first = json.loads(heldout_file.read_text()).get("first")  # logged before the resume
        if tensorboard and primary:
            self._tb = _summary_writer_class()(os.fspath(run_path(workdir) / "tensorboard" / stage), flush_secs=10)
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            desc=stage,
            unit="step",
            disable=not (progress and primary),
            dynamic_ncols=True,
            smoothing=0.1,
        )
        self._last = time.perf_counter()

    def log(self, step: int, metrics: dict[str, float], *, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        now = time.perf_counter()
        dt = now - self._last
        self._last = now
        record = {
            "stage": self.stage,
            "step": int(step),
            "tokens_seen": int(step) * self.tokens_per_step,
            "step_time_s": round(dt, 4),
            "tokens_per_s": round(self.tokens_per_step / max(dt, 1e-9), 1),
        }
        record.update({k: float(v) for k, v in metrics.items()})
        record.update(extra or {})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, float) and math.isfinite(v) and k != "step":
                    self._tb.add_scalar(f"{self.stage}/{k}", v, step)
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{record['loss']:.4g}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        return record

    def log_heldout(self, step: int, metrics: dict[str, float]) -> dict[str, Any]:
        """One held-out row (metrics.jsonl, TensorBoard ``<stage>/heldout_<name>``, heldout.json's last row)."""
        record = {"stage": self.stage, "step": int(step), "tokens_seen": int(step) * self.tokens_per_step}
        record["split"] = "heldout"
        record.update({k: float(v) for k, v in metrics.items()})
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            if self._heldout_first is None or step == 0:
                self._heldout_first = record
            self._heldout_last = record
            if self._heldout_file is not None:
                rows, seq_len = self._heldout_shape or (None, None)
                summary = {"stage": self.stage, "rows": rows, "seq_len": seq_len}
                summary.update(first=self._heldout_first, last=record)
                write_text_atomic(self._heldout_file, json.dumps(summary, indent=2) + "\n")
                self._jsonl.flush()  # a held-out point is a flush point of an object-store log
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(f"{self.stage}/heldout_{k}", float(v), step)
        return record

    def heldout_summary(self) -> str | None:
        """``[stage] held-out (R rows x T tokens): loss a -> b, KL c -> d, top-1 e% -> f%`` (first -> last held-out
        row of the stage; process 0 only, None elsewhere or when nothing was evaluated)."""
        first, last = self._heldout_first, self._heldout_last
        if first is None or last is None:
            return None
        rows, seq_len = self._heldout_shape or ("?", "?")
        parts = [f"{label} {first[k]:.4g} -> {last[k]:.4g}" for k, label in (("loss", "loss"), ("kl", "KL"))]
        parts.append(f"top-1 {100 * first['top1']:.1f}% -> {100 * last['top1']:.1f}%")
        return (
            f"[{self.stage}] held-out ({rows} rows x {seq_len} tokens), step {first['step']} -> {last['step']}: "
            + ", ".join(parts)
        )

    def flush(self) -> None:
        """Write out what is logged so far (at a checkpoint: a resumed stage finds every row up to it)."""
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self):
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


GUARDED_METRICS = ("loss", "grad_norm", "params")  # a non-finite one of these stops the stage


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for k, v in metrics.items() if k in GUARDED_METRICS)


def check_finite(step: int, stage: str, metrics: dict[str, float], last_good_step: int | None, ckpt_dir: RunPath):
    """Raise NonFiniteLossError naming the values, the step and the checkpoint a rerun resumes from."""
    bad = {k: v for k, v in metrics.items() if k in GUARDED_METRICS and not math.isfinite(v)}
    if bad:
        keep = (
            f"the last good checkpoint (step {last_good_step}) in {ckpt_dir} is kept"
            if last_good_step is not None
            else f"no checkpoint of this stage was written yet in {ckpt_dir}"
        )
        raise NonFiniteLossError(
            f"stage {stage}: non-finite {', '.join(f'{k}={v}' for k, v in bad.items())} at step {step}; stopping "
            f"the stage ({keep}). Fix: lower the learning rate (--config.{stage}.lr=<smaller>) and rerun "
            "the same command on this workdir: it resumes from that checkpoint (lr and steps may change on resume)."
        )

"""Progress bar (tokens/s, ETA), metrics.jsonl and TensorBoard event files for one stage."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm


class NonFiniteLossError(RuntimeError):
    """A NaN/inf loss or gradient norm; the stage stops and its last good checkpoint is kept."""


def _drop_rows_after(path: Path, stage: str, step: int) -> None:
    """Remove the rows of ``stage`` past ``step`` (logged by a run killed before its next checkpoint; the resumed
    run logs those steps again), so metrics.jsonl keeps one row per step. Rewritten atomically."""
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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


class StageLogger:
    """Writes one JSON line per step to ``workdir/metrics.jsonl`` and scalars to ``workdir/tensorboard``."""

    def __init__(
        self,
        workdir: Path,
        stage: str,
        *,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        tensorboard: bool = True,
        progress: bool = True,
    ):
        self.stage, self.tokens_per_step = stage, tokens_per_step
        path = Path(workdir) / "metrics.jsonl"
        self._jsonl = self._tb = None
        primary = jax.process_index() == 0  # every process computes the same metrics; process 0 writes them
        if primary:
            _drop_rows_after(path, stage, start_step)
            self._jsonl = open(path, "a", buffering=1)
        if tensorboard and primary:
            from tensorboardX import SummaryWriter  # local: optional dependency at import time

            self._tb = SummaryWriter(str(Path(workdir) / "tensorboard" / stage), flush_secs=10)
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

    def close(self):
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


GUARDED_METRICS = ("loss", "grad_norm", "params")  # a non-finite one of these stops the stage


def all_finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(v) for k, v in metrics.items() if k in GUARDED_METRICS)


def check_finite(step: int, stage: str, metrics: dict[str, float], last_good_step: int | None, ckpt_dir: Path):
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

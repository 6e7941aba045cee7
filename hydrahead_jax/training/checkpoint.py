"""Orbax checkpoints of one stage, resume with fallback, and the workdir's config guard.

Layout of a stage directory (``workdir/stage1_align`` ...)::

    <step>/model      full student state (every Variable), sharded arrays
    <step>/opt        optax state of the trained parameters
    <step>/data       grain iterator state (one JSON per process)
    <step>/meta       {"step", "stage", "tokens_seen", "config_hash", "config"}
    DONE              written after the final step's save has finished

Orbax writes each step into a temporary directory and renames it when complete, so a run killed mid-save
(SIGKILL included) leaves either the whole step or none of it. A step that still does not restore (a disk
error, a corrupted file) is reported, moved to ``corrupt/`` and the previous step is tried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.run_config import STAGES, RunConfig

log = logging.getLogger(__name__)

DONE_MARKER = "DONE"
# What may change between a run and its resume without making it another run: nothing here changes the math or
# the data and its order. Everything else of the resolved config is in the fingerprint (the model, head map
# settings, data content and order, budgets, optimizer, losses).
RESUME_SAFE_KEYS = ("logging", "mesh", "distributed")
RESUME_SAFE_SECTION_KEYS = {
    "teacher": ("source",),  # where the checkpoint is mounted; the fingerprint holds its ModelConfig instead
    "data": ("num_threads", "prefetch"),  # loader threads and read-ahead
    "selection": ("head_map_path", "preset"),  # the map is copied into the workdir; the preset's values are kept
    **{s.config_key: ("checkpoint_every", "keep_checkpoints") for s in STAGES},
}


class ConfigMismatchError(RuntimeError):
    """The workdir holds a run of another configuration."""


def config_fingerprint(run: RunConfig, teacher_model: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(sha256 of the run-defining part of the config, that part), with the teacher's resolved ModelConfig."""
    core = {k: v for k, v in run.to_dict().items() if k not in RESUME_SAFE_KEYS}
    for section, keys in RESUME_SAFE_SECTION_KEYS.items():
        core[section] = {k: v for k, v in core[section].items() if k not in keys}
    core["teacher"]["model"] = teacher_model.to_dict()
    text = json.dumps(core, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), core


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_workdir_config(workdir: Path, run: RunConfig, teacher_model: ModelConfig, *, force_new: bool) -> str:
    """Refuse a workdir that holds a run of another config (unless force_new: the old run is moved aside).

    Returns the config's fingerprint (stored in every checkpoint's meta)."""
    path = workdir / "run_config.json"
    digest, core = config_fingerprint(run, teacher_model)
    if path.exists():
        old = json.loads(path.read_text())
        if old["config_hash"] != digest:
            if not force_new:
                a, b = _flat(old["config_core"]), _flat(core)
                diff = sorted(k for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>"))
                shown = "; ".join(f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in diff[:8])
                raise ConfigMismatchError(
                    f"workdir {workdir} holds a run of another config ({len(diff)} field(s) differ: {shown}). "
                    "Fix: use another --workdir, restore the old settings to resume, or pass --force_new to move "
                    "the old run aside and start over."
                )
            aside = workdir.parent / f"{workdir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            log.warning("--force_new: moving the previous run in %s to %s", workdir, aside)
            shutil.move(str(workdir), str(aside))
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"config_hash": digest, "config_core": core, "config": run.to_dict()}, indent=2, sort_keys=True, default=str
        )
    )
    return digest


class StageCheckpointer:
    """A CheckpointManager for one stage directory, with DONE marker and fallback restore."""

    def __init__(self, directory: str | Path, *, save_every: int, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(1, int(save_every)),
            max_to_keep=max(1, int(keep)),
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._open()

    def _open(self):
        self.manager = ocp.CheckpointManager(
            self.directory, options=self._options, item_names=("model", "opt", "data", "meta")
        )

    # ---------------------------------------------------------------------------------------------- state
    @property
    def done(self) -> bool:
        return (self.directory / DONE_MARKER).exists()

    def mark_done(self, step: int) -> None:
        self.manager.wait_until_finished()
        (self.directory / DONE_MARKER).write_text(json.dumps({"final_step": int(step)}))

    def clear_done(self) -> None:
        (self.directory / DONE_MARKER).unlink(missing_ok=True)

    def steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    # ---------------------------------------------------------------------------------------------- save
    def save(self, step: int, model_state, opt_state, iterator, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Start an (async) save of ``step``; returns False when the interval policy skips it."""
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(model_state),
            opt=ocp.args.StandardSave(opt_state),
            data=grain.checkpoint.CheckpointSave(iterator),
            meta=ocp.args.JsonSave(dict(meta, step=int(step))),
        )
        return self.manager.save(int(step), args=args, force=force)

    def should_save(self, step: int) -> bool:
        """Whether ``save(step)`` would write (the interval policy), without saving."""
        return self.manager.should_save(int(step))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ---------------------------------------------------------------------------------------------- restore
    def _quarantine(self, step: int, error: BaseException) -> None:
        target = self.directory / "corrupt" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        log.error(
            "checkpoint step %d in %s does not restore (%s: %s); moved to %s, falling back to the previous step",
            step,
            self.directory,
            type(error).__name__,
            str(error)[:300],
            target,
        )
        print(
            f"WARNING: checkpoint step {step} in {self.directory} does not restore "
            f"({type(error).__name__}: {str(error)[:200]}); moved to {target}; falling back to the previous "
            "good step.",
            flush=True,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        self.manager.close()
        shutil.move(str(self.directory / str(step)), str(target))
        self._open()

    def restore_latest(self, abstract_model, abstract_opt, iterator):
        """(step, model_state, opt_state, meta) of the newest step that restores, or None when none does.

        Restores the grain iterator in place. Steps that fail are quarantined (see module doc)."""
        for step in reversed(self.steps()):
            try:
                out = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        model=ocp.args.StandardRestore(abstract_model),
                        opt=ocp.args.StandardRestore(abstract_opt),
                        data=grain.checkpoint.CheckpointRestore(iterator),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as error:  # noqa: BLE001 — any failure means "this step is unusable"
                self._quarantine(step, error)
                continue
            return step, out["model"], out["opt"], out["meta"]
        return None

    def restore_model(self, abstract_model):
        """Model state of the final step of a finished stage, or None (and DONE cleared) when it does not restore."""
        steps = self.steps()
        if not steps:
            self.clear_done()
            return None
        step = steps[-1]
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(abstract_model)))
        except Exception as error:  # noqa: BLE001
            self._quarantine(step, error)
            self.clear_done()
            return None
        return out["model"]

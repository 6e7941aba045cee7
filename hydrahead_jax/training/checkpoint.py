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

Multi-process runs: every process calls save and restore (each writes and reads its own shards, and its own
iterator state under ``data``); Orbax writes the metadata once. The files of the workdir itself (run_config.json,
DONE, a quarantined step's move) are written by process 0 alone, and every process waits at a barrier after each
such write, so none reads a state the others have not reached.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import grain
import jax
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
    "hybrid": ("attention_context_parallel",),  # how FA heads get their keys across devices: same values
    # checkpoint interval and kept count; the held-out evaluation (reads the state, never changes it)
    **{s.config_key: ("checkpoint_every", "keep_checkpoints", "heldout_rows", "heldout_every") for s in STAGES},
}
# What may change to continue a run with other settings (the run goes on from its checkpoints, no --force_new):
# a stage's learning rate (the fix a non-finite stop advises) and its budget. The schedule follows the new values
# from the resumed step on. A finished stage given more steps continues to the new count, and the finished stages
# after it are moved aside and rerun (their input changed); fewer steps than a finished stage ran change nothing.
CONTINUABLE_STAGE_KEYS = ("lr", "steps", "tokens")


_BARRIERS = itertools.count()  # every process passes the same barriers in the same order: the same names


def is_primary() -> bool:
    """Whether this process writes the workdir's own files (process 0; the only one of a one-process run)."""
    return jax.process_index() == 0


def sync_processes(what: str) -> None:
    """Wait until every process got here (a no-op for one process). ``what`` names the barrier in a timeout."""
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"hydrahead:{what}:{next(_BARRIERS)}")


class ConfigMismatchError(RuntimeError):
    """The workdir holds a run of another configuration."""


class WorkdirError(RuntimeError):
    """The workdir cannot be used: another process holds its lock, or it is not a writable directory."""


class WorkdirLock:
    """One process owns a workdir at a time: an exclusive ``fcntl.flock`` on ``workdir/.lock``.

    The kernel drops the lock when its process exits, however it exits (SIGKILL, OOM kill, a lost node on a
    local disk), so a killed run never leaves its workdir stuck; the file's content (pid, host, start time) only
    names the holder in the second process's error. The pipeline locks an existing workdir before any check (a
    second run is refused at once) and creates a new one only after every check passed (a refused run leaves no
    directory behind). On a multi-host run the coordinator process (index 0) holds
    it for all. Network filesystems must support flock (NFSv4 and Lustre do; where they do not, flock may fail
    with ENOLCK, reported with the path)."""

    NAME = ".lock"

    def __init__(self, workdir: Path, *, enabled: bool = True):
        self.workdir = Path(workdir)
        self.enabled = enabled
        self._file = None

    def acquire(self) -> None:
        """Take the lock (a no-op when held already, or when not enabled) or raise WorkdirError naming the holder."""
        if self._file is not None or not self.enabled:
            return
        path = self.workdir / self.NAME
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+")
        except (FileExistsError, NotADirectoryError):
            raise WorkdirError(
                f"--workdir {self.workdir} is not a directory (a file is in the way); pass a directory path."
            ) from None
        except PermissionError as err:
            raise WorkdirError(
                f"--workdir {self.workdir} is not writable ({err.strerror}: {err.filename}); pass a directory you "
                "can write to."
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown process"
            handle.close()
            raise WorkdirError(
                f"workdir {self.workdir} is in use by another run ({holder}); wait for it to finish or stop it, or "
                "use another --workdir."
            ) from None
        except OSError as err:
            handle.close()
            raise WorkdirError(f"cannot lock {path} ({err}); use a --workdir on a filesystem with flock.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def config_fingerprint(
    run: RunConfig, teacher_model: ModelConfig, data_digest: str | None = None
) -> tuple[str, dict[str, Any]]:
    """(sha256 of the run-defining part of the config, that part), with the teacher's resolved ModelConfig and,
    when given, the corpus by its content (``data_digest``: the token store's content address) instead of the
    path it is read from, so a corpus mounted elsewhere after a restart is the same run."""
    core = {k: v for k, v in run.to_dict().items() if k not in RESUME_SAFE_KEYS}
    for section, keys in RESUME_SAFE_SECTION_KEYS.items():
        core[section] = {k: v for k, v in core[section].items() if k not in keys}
    for stage in STAGES:
        core[stage.config_key] = {k: v for k, v in core[stage.config_key].items() if k not in CONTINUABLE_STAGE_KEYS}
    core["teacher"]["model"] = teacher_model.to_dict()
    if data_digest is not None:
        core["data"]["source"] = f"content:{data_digest}"
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


def check_workdir_config(
    workdir: Path, run: RunConfig, teacher_model: ModelConfig, *, force_new: bool, data_digest: str | None = None
) -> str:
    """Refuse a workdir that holds a run of another config (unless force_new: the old run is moved aside).

    Returns the config's fingerprint (stored in every checkpoint's meta); see ``config_fingerprint``."""
    path = workdir / "run_config.json"
    digest, core = config_fingerprint(run, teacher_model, data_digest)
    try:
        if is_primary():
            _claim_workdir(workdir, path, run, digest, core, force_new=force_new)
    finally:
        sync_processes("workdir config")  # the others read nothing of the workdir before it is settled
    if not is_primary() and (not path.exists() or read_run_config(path)["config_hash"] != digest):
        raise ConfigMismatchError(f"process 0 refused workdir {workdir} (its error says why and how to fix it).")
    return digest


def _claim_workdir(workdir: Path, path: Path, run: RunConfig, digest: str, core, *, force_new: bool) -> None:
    if path.exists():
        old = read_run_config(path)
        changed = _continued_settings(old.get("config", {}), run.to_dict())
        if changed and old["config_hash"] == digest:
            print(f"continuing the run in {workdir} with changed settings: {changed}", flush=True)
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
            aside.mkdir()
            for entry in workdir.iterdir():
                if entry.name != WorkdirLock.NAME:  # this process's lock stays: no other run slips in meanwhile
                    shutil.move(str(entry), str(aside / entry.name))
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"config_hash": digest, "config_core": core, "config": run.to_dict()}, indent=2, sort_keys=True, default=str
        )
    )


def read_run_config(path: Path) -> dict[str, Any]:
    """The workdir's run_config.json, or a one-line ConfigMismatchError naming it when it is damaged."""
    try:
        old = json.loads(path.read_text())
        missing = {"config_hash", "config_core"} - set(old)
        if missing:
            raise KeyError(f"no {sorted(missing)}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigMismatchError(
            f"{path} is damaged ({type(err).__name__}: {err}), so this workdir's run cannot be identified. Fix: "
            "pass --force_new to move the old run aside and start over, or use another --workdir."
        ) from None
    return old


def _continued_settings(old: dict[str, Any], new: dict[str, Any]) -> str:
    """'stage2.lr: 1e6 -> 0.001; ...' for the CONTINUABLE_STAGE_KEYS that differ ('' when none)."""
    out = []
    for stage in STAGES:
        a, b = old.get(stage.config_key, {}), new[stage.config_key]
        out += [f"{stage.config_key}.{k}: {a.get(k)!r} -> {b[k]!r}" for k in CONTINUABLE_STAGE_KEYS if a.get(k) != b[k]]
    return "; ".join(out)


def finished_step(directory: Path) -> int | None:
    """The final step of a finished stage (its DONE marker), or None while it is unfinished."""
    marker = Path(directory) / DONE_MARKER
    if not marker.exists():
        return None
    try:
        return int(json.loads(marker.read_text())["final_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged marker: the stage resumes from its checkpoints and writes it again


class StageCheckpointer:
    """A CheckpointManager for one stage directory, with DONE marker and fallback restore."""

    def __init__(self, directory: str | Path, *, save_every: int, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(1, int(save_every)),
            # keep confirmed steps plus the newest one, whose own loss is read one step after it is saved
            # (trainer.py): retracting that one must never leave the stage without a good checkpoint.
            max_to_keep=max(1, int(keep)) + 1,
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
        if is_primary():
            (self.directory / DONE_MARKER).write_text(json.dumps({"final_step": int(step)}))
        sync_processes("mark done")

    def clear_done(self) -> None:
        if is_primary():
            (self.directory / DONE_MARKER).unlink(missing_ok=True)
        sync_processes("clear done")

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

    def retract_from(self, step: int) -> int | None:
        """Delete every checkpoint of ``step`` or later (states that led to a non-finite loss); returns the
        newest step left, or None."""
        self.manager.wait_until_finished()
        for s in self.steps():
            if s >= step:
                log.info("deleting checkpoint step %d in %s: the step after it was non-finite", s, self.directory)
                self.manager.delete(s)
        left = self.steps()
        return left[-1] if left else None

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
        self.manager.close()
        if is_primary():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        sync_processes("quarantine")
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

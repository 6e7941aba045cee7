"""Orbax checkpoints of one stage, resume with fallback, and the workdir's config guard.

Layout of a stage directory (``workdir/stage1_align`` ...)::

    <step>/model      full student state (every Variable), sharded arrays
    <step>/opt        optax state of the trained parameters
    <step>/meta       {"step", "stage", "config_hash", "config", "data_position"}
    DONE              written after the final step's save has finished

The data position is global (``training.data.DataPosition``: the global batches read), so a checkpoint resumes on
any number of processes and any mesh: the arrays are restored onto the new run's shardings, and each process reads
its own rows of the batches that follow. Older checkpoints hold grain's iterator state per process instead
(``<step>/data/process_<i>-of-<n>.json``), each the same number of batches, read from there
(``legacy_data_position``).

Orbax writes each step into a temporary directory and renames it when complete, so a run killed mid-save
(SIGKILL included) leaves either the whole step or none of it. A step that still does not restore (a disk
error, a corrupted file) is reported, moved to ``corrupt/`` and the previous step is tried. Only damage shown by
the step's own files moves it; a checkpoint of another structure, or a read that keeps failing, stops the run
with nothing moved (see "restore errors" below).

Multi-process runs: every process calls save and restore (each writes and reads its own shards, whatever the
process count that wrote them); Orbax writes the metadata and the meta once. The files of the workdir itself
(run_config.json, DONE, a quarantined step's move) are written by process 0 alone, and every process waits at a barrier after each
such write, so none reads a state the others have not reached.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.run_config import STAGES, RunConfig
from hydrahead_jax.storage import file_size, files_under, is_object_store, move, run_path
from hydrahead_jax.training.data import DataPosition

log = logging.getLogger(__name__)

DONE_MARKER = "DONE"
# What may change between a run and its resume without making it another run: nothing here changes the math or
# the data and its order. Everything else of the resolved config is in the fingerprint (the model, head map
# settings, data content and order, budgets, optimizer, losses).
RESUME_SAFE_KEYS = ("logging", "mesh", "distributed")
RESUME_SAFE_SECTION_KEYS = {
    "teacher": ("source",),  # where the checkpoint is mounted; the fingerprint holds its ModelConfig instead
    # loader threads, read-ahead, tokenising processes, where stores are kept (the digest names their content)
    "data": ("num_threads", "prefetch", "prepare_workers", "store_root"),
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
    """One run owns a workdir at a time: ``workdir/.lock``, held by process 0 for all the processes of a run.

    On a disk it is an exclusive ``fcntl.flock``: the kernel drops it when its process exits, however it exits
    (SIGKILL, OOM kill, a lost node on a local disk), so a killed run never leaves its workdir stuck; the file's
    content (pid, host, start time) only names the holder in the second run's error. Network filesystems must
    support flock (NFSv4 and Lustre do; where they do not, flock fails with ENOLCK, reported with the path).

    On an object store (gs://, s3://), which has no locks, it is a lease (``LeaseLock``). The pipeline locks an
    existing workdir before any check (a second run is refused at once) and creates a new one only after every
    check passed (a refused run leaves no directory behind)."""

    NAME = ".lock"

    def __init__(self, workdir, *, enabled: bool = True):
        self.workdir = workdir
        self.enabled = enabled
        self._file = None
        self._lease = LeaseLock(workdir / self.NAME) if is_object_store(workdir) else None

    def acquire(self) -> None:
        """Take the lock (a no-op when held already, or when not enabled) or raise WorkdirError naming the holder."""
        if not self.enabled:
            return
        if self._lease is not None:
            self._lease.acquire()
            return
        if self._file is not None:
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
        if self._lease is not None:
            self._lease.release()
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class LeaseLock:
    """The workdir lock on an object store: a lease object renewed while the run lives.

    The object holds {"holder": "pid P on host H", "host", "pid", "token", "expires" (unix time)}. ``acquire``
    refuses a lease that another run holds and that has not expired; a lease whose holder is gone is taken over:
    at once when its host is this host and its pid is not alive (a run killed here and started again), otherwise
    once ``expires`` has passed (at most LEASE_S after the holder stopped renewing). A thread renews the lease every
    LEASE_S / 4; ``release`` deletes it. The store offers no compare-and-set to fsspec, so taking the lease is a
    write followed by a read back after SETTLE_S: of two runs started within that time, one or both see the
    other's token and stop; neither trains on unguarded."""

    LEASE_S = 120.0
    SETTLE_S = 1.0

    def __init__(self, path):
        self.path = path
        self._token = None
        self._stop = threading.Event()
        self._thread = None

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def _write(self) -> None:
        lease = {
            "holder": f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self._token,
            "expires": time.time() + self.LEASE_S,
        }
        self.path.write_text(json.dumps(lease))

    def _held_by_another(self, lease: dict | None) -> bool:
        if lease is None or lease.get("token") == self._token:
            return False
        if lease.get("host") == socket.gethostname() and not _pid_alive(int(lease.get("pid", -1))):
            return False
        return float(lease.get("expires", 0)) > time.time()

    def acquire(self) -> None:
        if self._token is not None:
            return
        lease = self._read()
        if self._held_by_another(lease):
            raise WorkdirError(_lease_message(self.path, lease))
        self._token = uuid.uuid4().hex
        self._write()
        time.sleep(self.SETTLE_S)
        lease = self._read()
        if lease is None or lease.get("token") != self._token:
            self._token = None
            raise WorkdirError(_lease_message(self.path, lease or {"holder": "a run that started at the same time"}))
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="workdir-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.LEASE_S / 4):
            try:
                self._write()
            except OSError as err:  # a store hiccup: the next renewal tries again, well before the lease expires
                log.warning("renewing the workdir lease %s failed (%s)", self.path, err)

    def release(self) -> None:
        if self._token is None:
            return
        self._stop.set()
        self._thread.join()
        if (self._read() or {}).get("token") == self._token:
            self.path.unlink(missing_ok=True)
        self._token = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return pid > 0


def _lease_message(path, lease: dict) -> str:
    expires = lease.get("expires")
    until = f"; its lease expires at {time.strftime('%H:%M:%S', time.localtime(expires))}" if expires else ""
    return (
        f"workdir {path.parent} is in use by another run ({lease.get('holder', 'unknown')}{until}); wait for it to "
        f"finish or stop it, or use another --workdir. A run that died on another host frees it when the lease "
        f"expires; delete {path} only if you know that run is gone."
    )


def config_fingerprint(
    run: RunConfig, teacher_model: ModelConfig, data_digest: str | None = None
) -> tuple[str, dict[str, Any]]:
    """(sha256 of the run-defining part of the config, that part), with the teacher's resolved ModelConfig and,
    when given, the corpus by its content (``data_digest``: the token stores' content addresses with each stage's
    weights, ``training.data.data_digest``) instead of the paths it is read from, so a corpus mounted elsewhere
    after a restart is the same run. The ``sources`` lists are left out: the digest holds them (and a run without
    them fingerprints as it did before they existed)."""
    core = {k: v for k, v in run.to_dict().items() if k not in RESUME_SAFE_KEYS}
    for section, keys in RESUME_SAFE_SECTION_KEYS.items():
        core[section] = {k: v for k, v in core[section].items() if k not in keys}
    for stage in STAGES:
        core[stage.config_key] = {k: v for k, v in core[stage.config_key].items() if k not in CONTINUABLE_STAGE_KEYS}
    core["teacher"]["model"] = teacher_model.to_dict()
    for section in ("data", *(s.config_key for s in STAGES)):
        core[section].pop("sources", None)  # the paths: the data digest holds what each stage reads (or the source)
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
                    move(entry, aside / entry.name)
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
    marker = run_path(directory) / DONE_MARKER
    if not marker.exists():
        return None
    try:
        return int(json.loads(marker.read_text())["final_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a damaged marker: the stage resumes from its checkpoints and writes it again


class StageCheckpointer:
    """A CheckpointManager for one stage directory, with DONE marker and fallback restore.

    ``stage`` (a stage name) words the fix in a mismatch error (``--restart_stage=<stage>``)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        save_every: int,
        keep: int = 2,
        async_save: bool = True,
        stage: str | None = None,
    ):
        self.directory = run_path(directory)
        self.stage = stage
        self.quarantined: list[tuple[int, str]] = []  # (step, what is damaged) of the steps set aside
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
        # "data": the per-process iterator state of older checkpoints, read by legacy_data_position only.
        self.manager = _Manager(self.directory, options=self._options, item_names=("model", "opt", "data", "meta"))

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

    def latest_step(self) -> int | None:
        """The newest step saved or being saved, from this manager's own record (no directory read): the same on
        every process, where a listing could still miss a save in flight on one of them."""
        return self.manager.latest_step()

    # ---------------------------------------------------------------------------------------------- save
    def save(
        self, step: int, model_state, opt_state, position: DataPosition, meta: dict[str, Any], *, force: bool = False
    ) -> bool:
        """Start an (async) save of ``step``, its data ``position`` in the meta; returns False when the interval
        policy skips it."""
        meta = dict(meta, step=int(step), **{DataPosition.META_KEY: position.to_json()})
        args = ocp.args.Composite(
            model=ocp.args.StandardSave(model_state),
            opt=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta),
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
    def _quarantine(self, step: int, damage: str) -> None:
        target = self.directory / "corrupt" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        log.error("checkpoint step %d in %s is damaged (%s); moving it to %s", step, self.directory, damage, target)
        print(
            f"WARNING: checkpoint step {step} in {self.directory} is damaged ({damage}); moved to {target}; "
            "falling back to the previous step.",
            flush=True,
        )
        self.quarantined.append((step, damage))
        self.manager.close()
        if is_primary():
            target.parent.mkdir(parents=True, exist_ok=True)
            move(self.directory / str(step), target)
        sync_processes("quarantine")
        self._open()

    def _restore(self, step: int, targets: dict[str, Any], *, batch_size: int | None = None):
        """``manager.restore`` of the items in ``targets`` (abstract trees) and "meta" (the JSON), and given the
        run's global ``batch_size``, the step's DataPosition under "position"; sorted by what a failure is: see
        ``restore_step``."""
        step_dir = self.directory / str(step)

        def restore():
            items = {name: ocp.args.StandardRestore(target) for name, target in targets.items()}
            out = dict(self.manager.restore(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore())))
            if batch_size is not None:
                out["position"] = self._position(step_dir, out["meta"], batch_size)
            return out

        def check():
            check_step_files(step_dir, list(targets) + ["meta"], pytree_items=tuple(targets))
            stored = {name: stored_metadata(step_dir / name) for name in targets}
            check_matches(stored, targets, where=f"checkpoint step {step} in {self.directory}")

        return restore_step(step_dir, restore, check=check, hint=self._hint)

    def _position(self, step_dir: Path, meta: dict[str, Any], batch_size: int) -> DataPosition:
        """The data position of the checkpoint in ``step_dir``: its meta's, or (written before positions were
        global) the batches its per-process iterator states read, of this run's ``batch_size`` (the workdir's config
        check refused another). CheckpointMismatchError where it is not a whole number of this run's batches."""
        try:
            position = DataPosition.from_meta(meta)
        except ValueError as err:
            raise CheckpointMismatchError(f"{step_dir}/meta: {err}.") from None
        if position is None:
            return DataPosition(legacy_data_position(step_dir / "data"), batch_size)
        if position.batch_size != batch_size:
            key = next((s.config_key for s in STAGES if s.name == self.stage), "<stage>")
            raise CheckpointMismatchError(
                f"{step_dir} read global batches of {position.batch_size} rows and this run's are {batch_size}: "
                f"its data position is no whole batch of this run (resume with --config.{key}.batch_size="
                f"{position.batch_size})."
            )
        return position

    @property
    def _hint(self) -> str:
        flag = f"--restart_stage={self.stage}" if self.stage else "--restart_stage=<this stage>"
        return (
            f"Fix: run the code and recipe that wrote it, or pass {flag} to move this stage's checkpoints aside and "
            "train it from step 0."
        )

    def restore_latest(self, abstract_model, abstract_opt, batch_size: int):
        """(step, model_state, opt_state, data position) of the newest step that restores, or None when every
        step is damaged (each then in ``corrupt/``, listed in ``self.quarantined``) or there is none.
        ``batch_size``: the run's global batch (a position of another one is refused).

        The arrays are placed by the targets' shardings, whatever mesh and process count wrote them. Only a step
        whose own files are damaged is set aside; a checkpoint of another structure or without a data position
        (CheckpointMismatchError) or a read that keeps failing (CheckpointReadError) stops the run with nothing
        moved, and any other error propagates as it is."""
        for step in reversed(self.steps()):
            try:
                out = self._restore(step, {"model": abstract_model, "opt": abstract_opt}, batch_size=batch_size)
            except DamagedCheckpointError as damage:
                self._quarantine(step, str(damage))
                continue
            return step, out["model"], out["opt"], out["position"]
        return None

    def restore_model(self, abstract_model):
        """Model state of the final step of a finished stage, or None (DONE cleared: the stage resumes from its
        checkpoints) when there is none or that step is damaged (moved to ``corrupt/``). Other failures raise,
        as in ``restore_latest``."""
        steps = self.steps()
        if not steps:
            self.clear_done()
            return None
        step = steps[-1]
        try:
            out = self._restore(step, {"model": abstract_model})
        except DamagedCheckpointError as damage:
            self._quarantine(step, str(damage))
            self.clear_done()
            return None
        return out["model"]


class _Manager(ocp.CheckpointManager):
    """Orbax's CheckpointManager without its own look at the preemption sync point: the trainer asks it once per
    step with a count of its own (``trainer.PreemptionWatch``) and saves on it with ``force``. Orbax asks with the
    step it saves, which starts again at every stage and, asked between the trainer's calls, would hand the
    coordination service another count than the one every process's loop goes by."""

    def reached_preemption(self, step: int) -> bool:
        return False


_LEGACY_STATE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def legacy_data_position(data_dir: Path) -> int:
    """The global batches read by a checkpoint written before positions were global: its ``data`` folder holds
    grain's iterator state per process (``process_<i>-of-<n>.json``: ``{"next_index": batches}``), and every
    process reads its rows of the same global batches, so every file holds the same number. DamagedCheckpointError
    when the folder or a process's file is missing; CheckpointMismatchError when the files name no one number."""
    data_dir = run_path(data_dir)
    found = sorted(data_dir.glob("process_*-of-*.json")) if data_dir.is_dir() else []
    counts = {int(m[2]) for p in found if (m := _LEGACY_STATE.fullmatch(p.name))}
    if not counts:
        raise DamagedCheckpointError(f"{data_dir} is missing (and the meta holds no data position)")
    files = [data_dir / f"process_{i}-of-{n}.json" for n in counts for i in range(n)]
    missing = next((p for p in files if not p.is_file()), None)
    if missing is not None:
        raise DamagedCheckpointError(f"{missing} is missing")
    batches = {p.name: json.loads(p.read_text()).get("next_index") for p in files}
    if len(set(batches.values())) != 1 or not isinstance(batches[files[0].name], int):
        raise CheckpointMismatchError(f"{data_dir} holds iterator states of no one data position ({batches}).")
    return batches[files[0].name]


# ------------------------------------------------------------------------------------------------ restore errors
# A failed restore is one of three things, and only the first moves anything:
#   damage    the step's own files are missing, truncated or do not decode (named from the files themselves or
#             from the TensorStore status that reports them: DATA_LOSS, OUT_OF_RANGE, a truncated stream);
#   mismatch  the stored tree differs from this run's (paths, shapes, kinds of dtype): the code or the recipe
#             changed; stopping is the only safe answer;
#   transient an OSError, MemoryError, a resource or availability status: retried with backoff, then reported.
# Anything else is a bug and propagates unchanged. Orbax, Levanter and MaxText never restart on an error they
# do not recognise either.
RESTORE_ATTEMPTS = 4  # one try and three retries
RESTORE_BACKOFF_S = 2.0  # waits of 2, 4, 8 s: a network filesystem's hiccup passes, a real outage is reported
_DAMAGE_STATUSES = ("DATA_LOSS", "OUT_OF_RANGE")
_TRANSIENT_STATUSES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "ABORTED")
_SHORT = 300


class DamagedCheckpointError(Exception):
    """A checkpoint's own files are damaged; the message names the file and what is wrong with it."""


class CheckpointMismatchError(RuntimeError):
    """A checkpoint holds another tree than the run restores into (the code or the recipe changed)."""


class CheckpointReadError(RuntimeError):
    """A checkpoint could not be read after retries (the filesystem, permissions, memory); nothing was moved."""


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _one_line(text: str) -> str:
    text = text.split("[tensorstore_spec", 1)[0]
    return " ".join(text.split())[:_SHORT]


# The JSON files of a checkpoint: Orbax's metadata (step, item, sharding, per-process array metadata), the meta
# item's JSON and grain's iterator state (*.json). The array data (OCDBT manifests and ``d/`` files) are binary.
_JSON_NAMES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")


def _is_json_file(path: Path) -> bool:
    return path.name in _JSON_NAMES or path.suffix == ".json" or path.parent.name == "array_metadatas"


def _json_damage(directory: Path) -> str | None:
    """The first JSON file of a checkpoint directory that does not parse, or None."""
    for path in (p for p in files_under(directory) if _is_json_file(p)):
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as err:
            return f"{path} does not decode as JSON ({_one_line(str(err))})"
    return None


def _tensorstore_damage(message: str, directory: Path) -> str | None:
    """Damage of ``directory``'s files reported by a TensorStore status, worded with the file."""
    if not message.startswith(_DAMAGE_STATUSES) and not (
        message.startswith("FAILED_PRECONDITION") and "Truncated" in message
    ):
        return None
    root = str(directory)
    named = [m for m in _quoted_paths(message) if m.startswith(root)]
    if not named:
        return None
    files = [m for m in named if run_path(m).is_file()]
    # "Requested byte range [a, b) is not valid for value of size N": the data file of N bytes is the short one.
    size = message.rsplit("value of size ", 1)[-1].split()[0] if "value of size " in message else None
    if size is not None and size.isdigit():
        first = run_path(named[0])
        files += [str(p) for p in files_under(first) if file_size(p) == int(size)] if first.is_dir() else []
    where = ", ".join(dict.fromkeys(files)) if files else named[-1]
    return f"{where}: {_one_line(message)}"


def _quoted_paths(message: str) -> list[str]:
    parts = message.split('"')
    return [parts[i] for i in range(1, len(parts), 2) if parts[i].startswith("/") or is_object_store(parts[i])]


def damage_in(error: BaseException, directory: Path) -> str | None:
    """What is damaged in the checkpoint ``directory`` (naming the file), when ``error`` or the files themselves
    show it; None when neither does (then the error is not evidence of damage)."""
    directory = run_path(directory)
    if not directory.is_dir():
        return f"{directory} is missing"
    for err in _chain(error):
        if isinstance(err, (ValueError, UnicodeDecodeError)) and not str(err).startswith(
            _DAMAGE_STATUSES + _TRANSIENT_STATUSES
        ):
            found = _json_damage(directory)  # json.JSONDecodeError names no file: find the one that does not parse
            if found:
                return found
        if isinstance(err, (OSError, ValueError, KeyError)):  # "File …/meta/metadata not found.", grain's, ENOENT
            named = [str(err.filename)] if getattr(err, "filename", None) else []
            named += [w.strip("'\".,:;()[]") for w in str(err).split()]
            missing = [n for n in named if n.startswith(f"{directory}/") and not run_path(n).exists()]
            if missing:
                return f"{missing[0]} is missing"
        found = _tensorstore_damage(str(err), directory)
        if found:
            return found
    return None


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is of the kind a retry can cure: an OSError, a MemoryError, a status of unavailability
    or exhausted resources (an XLA out-of-memory while placing the arrays included)."""
    for err in _chain(error):
        if isinstance(err, (OSError, MemoryError)):
            return True
        if str(err).startswith(_TRANSIENT_STATUSES) or "RESOURCE_EXHAUSTED" in str(err)[:200]:
            return True
    return False


# Every pytree item Orbax writes (OCDBT format) has these; without them no array of the item can be found.
PYTREE_FILES = ("_METADATA", "manifest.ocdbt")


def check_step_files(step_dir: Path, items: list[str], pytree_items: tuple[str, ...] = ()) -> None:
    """DamagedCheckpointError when a saved item's folder is missing, a pytree item lacks one of PYTREE_FILES,
    or one of the step's JSON files does not parse."""
    step_dir = run_path(step_dir)
    for item in items:
        if not (step_dir / item).is_dir():
            raise DamagedCheckpointError(f"{step_dir / item} is missing")
    for item in pytree_items:
        for name in PYTREE_FILES:
            if not (step_dir / item / name).is_file():
                raise DamagedCheckpointError(f"{step_dir / item / name} is missing")
    found = _json_damage(step_dir)
    if found:
        raise DamagedCheckpointError(found)


def stored_metadata(item_dir: Path):
    """Orbax's metadata of a saved pytree (paths, shapes, dtypes; from its ``_METADATA``, no array is read)."""
    from etils import epath

    return ocp.StandardCheckpointHandler().metadata(epath.Path(item_dir))


def _stored_leaves(metadata) -> dict[str, tuple[tuple[int, ...], Any]]:
    tree = getattr(metadata, "tree", metadata)
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "name"))
    return {str(m.name): (tuple(m.shape), m.dtype) for m in leaves if hasattr(m, "shape")}


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _target_leaves(target) -> dict[str, tuple[tuple[int, ...], Any]]:
    """{Orbax's name of the array ("0.mu.layers.0.attn.q_proj.kernel"): (shape, dtype)} of a restore target."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(target)
    return {".".join(_key_name(k) for k in path): (tuple(x.shape), x.dtype) for path, x in leaves}


def _kind(dtype) -> str:
    """floating / integer / bool / other: Orbax casts between dtypes of one kind (bf16 → f32 exactly), not across
    kinds (numpy's own ``kind`` calls bfloat16 'V', so the jnp categories decide)."""
    jnp = jax.numpy
    for kind in (jnp.floating, jnp.integer, jnp.bool_, jnp.complexfloating):
        if jnp.issubdtype(dtype, kind):
            return kind.__name__
    return str(dtype)


def check_matches(stored: dict[str, Any], targets: dict[str, Any], *, where: str) -> None:
    """CheckpointMismatchError naming the differing arrays when the stored trees (Orbax item metadata) differ
    from the restore targets in their paths, shapes or dtype kinds."""
    diffs = []
    for item, target in targets.items():
        have, want = _stored_leaves(stored[item]), _target_leaves(target)
        for name in sorted(set(have) | set(want)):
            if name not in want:
                diffs.append(f"{item}/{name}: stored, not in this run")
            elif name not in have:
                diffs.append(f"{item}/{name}: in this run, not stored")
            elif have[name][0] != want[name][0] or _kind(have[name][1]) != _kind(want[name][1]):
                (s, sd), (t, td) = have[name], want[name]
                diffs.append(f"{item}/{name}: stored {sd}{list(s)}, this run {td}{list(t)}")
        if per_layer_names(have) and not per_layer_names(want):
            raise CheckpointMismatchError(
                f"{where} was written when the model's layers were stored one by one ({item}/…layers.0.…), before "
                "they became one scanned stack; this code cannot resume it."
            )
    if diffs:
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        raise CheckpointMismatchError(f"{where} holds another model than this run ({len(diffs)} differ: {shown}).")


def per_layer_names(names) -> bool:
    """Whether Orbax array names (``_stored_leaves``) hold the layers one by one (layers.0.…, layers.1.…: the
    layout before ``Transformer.layers`` was one stack) rather than stacked (layers.self_attn.…)."""
    return any(re.search(r"(^|\.)layers\.\d+\.", str(name)) for name in names)


def restore_step(directory: Path, restore, *, check=None, hint: str = ""):
    """``restore()`` of the checkpoint in ``directory``, with every failure sorted (see above).

    ``check()`` runs first on each attempt (file and structure checks that raise DamagedCheckpointError or
    CheckpointMismatchError). Raises DamagedCheckpointError (the caller decides whether to set the step aside),
    CheckpointMismatchError (with ``hint``, the fix) or, after RESTORE_ATTEMPTS tries of a transient error,
    CheckpointReadError; anything else propagates unchanged."""
    for attempt in range(1, RESTORE_ATTEMPTS + 1):
        try:
            if check is not None:
                check()
            return restore()
        except DamagedCheckpointError:
            raise
        except CheckpointMismatchError as err:
            raise CheckpointMismatchError(f"{err} {hint}".strip()) from None
        except Exception as error:  # noqa: BLE001 — sorted here; what is neither damage nor transient re-raises
            damage = damage_in(error, directory)
            if damage is not None:
                raise DamagedCheckpointError(damage) from error
            if not is_transient(error):
                if "Structure mismatch" in str(error) or "not compatible with the stored shape" in str(error):
                    raise CheckpointMismatchError(
                        f"{directory} holds another model than this run ({_one_line(str(error))}). {hint}".strip()
                    ) from None
                raise
            cause = f"{type(error).__name__}: {_one_line(str(error))}"
            if attempt == RESTORE_ATTEMPTS:
                raise CheckpointReadError(
                    f"{directory} could not be read after {attempt} attempts ({cause}); nothing was moved. Fix the "
                    "filesystem, permissions or memory it names, then rerun the same command to resume."
                ) from None
            wait = RESTORE_BACKOFF_S * 2 ** (attempt - 1)
            log.warning("reading %s failed (%s); retrying in %.0f s", directory, cause, wait)
            print(
                f"reading {directory} failed ({cause}); retry {attempt}/{RESTORE_ATTEMPTS - 1} in {wait:.0f} s",
                flush=True,
            )
            time.sleep(wait)
    raise AssertionError("unreachable")

"""Convert a pretrained decoder into a HydraHead hybrid: stage 0 select → 1 align → 2 distil → 3 long → export.

    python train.py --config configs/tiny.py --workdir runs/tiny
    python train.py --config configs/smollm2_hydrahead.py --workdir runs/smollm2_demo --config.stage2.steps=100
    python train.py --config configs/qwen3_1p7b_hydrahead.py:7to1 --workdir gs://.../run --until_stage distil
    python train.py --config configs/tiny.py --workdir runs/t --config.selection.niah_lengths=256,512

The recipe (with its --config.a.b=value overrides) is converted here, once, into a validated
hydrahead_jax.run_config.RunConfig; a bad key or value is refused with the key and the fix before any work.
Rerunning on the same workdir resumes: finished stages are skipped, an unfinished one continues from its last
checkpoint exactly. A workdir that holds a run of another config is refused unless --force_new; a stage's lr
and steps/tokens may change on a rerun (it continues with them; a finished stage given more steps trains on and
the stages after it rerun). A checkpoint whose files are damaged is set aside and the previous one used; one
that does not match the run, or cannot be read, stops the run with nothing moved (--restart_stage=NAME trains
that stage over instead). One run owns a workdir at a time (a lock a killed run does not leave behind).
SIGTERM (preemption) checkpoints the last finished step and exits with status 143; rerun to resume. On several
processes a SIGTERM to any one of them reaches all (JAX's coordination service), and every process stops after the
same step, saves it once and exits with 143. A stage resumes on another number of processes or another mesh (the
global batch stays: config.<stage>.batch_size is part of the run).

Multi-process (--config.distributed=True): every process runs the same command; jax.distributed.initialize()
joins them before any other JAX call. Under SLURM, Open MPI, Kubernetes (JobSet) or on a Cloud TPU slice JAX finds
the coordinator itself; elsewhere (several processes on one machine, another scheduler) give each process
--coordinator_address=HOST:PORT (or the JAX_COORDINATOR_ADDRESS environment variable), --num_processes and its
--process_id. On CPU the processes exchange collectives over gloo (TCP). Under SLURM JAX gives each process the one
GPU numbered SLURM_LOCALID; with one process per node pass --local_device_ids=all (scripts/launch/slurm.sbatch).

    python train.py --config configs/tiny.py --workdir runs/t --config.distributed=True \
        --config.mesh.data=2 --config.mesh.sequence=4 \
        --coordinator_address=localhost:12345 --num_processes=2 --process_id=0   # and =1 in the second process
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from hydrahead_jax.config import ConfigError
from hydrahead_jax.run_config import STAGE_NAMES, RunConfig, section_fields

# accept_new_attributes: an unknown leaf key reaches RunConfig.from_recipe, which refuses it with the valid keys.
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training recipe (a configs/*.py file).", lock_config=False, accept_new_attributes=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, head map, final model).")
_ONLY = flags.DEFINE_enum("only_stage", None, STAGE_NAMES, "Run only this stage (earlier ones must have finished).")
_UNTIL = flags.DEFINE_enum("until_stage", None, STAGE_NAMES, "Run the stages up to and including this one.")
_FORCE_NEW = flags.DEFINE_bool(
    "force_new",
    False,
    "Start over in a workdir that holds a run of another config "
    "(the old run is moved aside to WORKDIR.replaced-<time>).",
)
_RESTART = flags.DEFINE_enum(
    "restart_stage",
    None,
    STAGE_NAMES[1:],
    "Train this stage from step 0 (its checkpoints are moved aside to <stage dir>.restarted-<time>; the stages "
    "after it rerun): the consent to start over a stage whose checkpoints do not restore.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "config.distributed: HOST:PORT of process 0's coordinator, where JAX does not detect the cluster itself.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "config.distributed: the number of processes.", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "config.distributed: this process's index.", lower_bound=0)
_LOCAL_DEVICES = flags.DEFINE_string(
    "local_device_ids",
    None,
    "config.distributed: the devices of its host this process uses. 'all': every one (one process per host, e.g. "
    "SLURM's --ntasks-per-node=1, where JAX would otherwise give the process only the GPU numbered SLURM_LOCALID); "
    "a list such as 0,1,2,3: those (several processes per host). Unset: JAX's choice (under SLURM one device per "
    "process; on a TPU VM every chip of the host).",
)
flags.mark_flags_as_required(["config", "workdir"])
PREEMPTED_EXIT_STATUS = 143  # SIGTERM: the last finished step was checkpointed, rerun to resume


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def _unknown_section(argv) -> str | None:
    """The first --config.a.b=... override under a section the recipe schema does not have (ml_collections can
    only add leaf keys), worded with the keys that section does have."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        keys = arg[len("--config.") :].split("=", 1)[0].split(".")
        for depth in range(len(keys) - 1):
            valid = section_fields(tuple(keys[:depth]))
            if valid is not None and keys[depth] not in valid:
                where = ".".join(["config"] + keys[:depth])
                return (
                    f"unknown config key {'.'.join(keys)!r} in {arg!r}: {where} has no field {keys[depth]!r}; "
                    f"its fields are {valid}."
                )
    return None


def _config_file_error(argv, error: OSError) -> str:
    """One line for a --config file that does not load (ml_collections words it over several lines)."""
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if given is None and "--config" in argv[:-1]:
        given = argv[argv.index("--config") + 1]
    cause = [line.strip() for line in str(error).splitlines() if "Errno" in line or "Error" in line]
    return f"--config {given}: the recipe does not load ({cause[-1] if cause else error}); give a configs/*.py file."


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError, TypeError, ValueError, flags.Error) as error:
        _fail(_unknown_section(argv) or str(error))
    except OSError as error:  # the --config file itself: missing, unreadable
        _fail(_config_file_error(argv, error))


def _cluster_coordinates() -> dict:
    """The explicit coordinates of --coordinator_address/--num_processes/--process_id ({} when none is given:
    JAX detects the cluster); refused in one line when they are incomplete or inconsistent."""
    given = {
        "coordinator_address": _COORDINATOR.value,
        "num_processes": _NUM_PROCESSES.value,
        "process_id": _PROCESS_ID.value,
    }
    if all(v is None for v in given.values()):
        return {}
    if given["num_processes"] is None or given["process_id"] is None:
        raise ConfigError(
            "--num_processes and --process_id go together (every process gets the same --num_processes and its own "
            "--process_id); pass both, or neither to let JAX detect the cluster."
        )
    if given["process_id"] >= given["num_processes"]:
        raise ConfigError(
            f"--process_id={given['process_id']} is not below --num_processes={given['num_processes']}; "
            "number the processes 0 … num_processes − 1."
        )
    if given["coordinator_address"] is None and not os.environ.get("JAX_COORDINATOR_ADDRESS"):
        raise ConfigError(
            "--num_processes/--process_id need the coordinator: pass --coordinator_address=HOST:PORT (process 0's "
            "host and a free port, the same in every process) or set JAX_COORDINATOR_ADDRESS."
        )
    return {k: v for k, v in given.items() if v is not None}


def local_device_ids(value: str | None) -> list[int] | None:
    """--local_device_ids as jax.distributed.initialize takes it: None (JAX decides), [] for 'all' (an empty list
    restricts nothing and stops JAX's cluster detection from choosing one device), or the listed ids."""
    if value is None:
        return None
    if value.strip() == "all":
        return []
    try:
        ids = [int(part) for part in value.split(",")]
    except ValueError:
        ids = None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(
            f"--local_device_ids={value!r}: give 'all' or distinct device numbers of this host separated by commas "
            "(e.g. 0,1,2,3)."
        )
    return ids


def _join_cluster(jax) -> None:
    """jax.distributed.initialize(), with a one-line error when no cluster is there to join."""
    coordinates = _cluster_coordinates()
    devices = local_device_ids(_LOCAL_DEVICES.value)
    if devices is not None:
        coordinates["local_device_ids"] = devices
    try:
        jax.distributed.initialize(**coordinates)  # before any other JAX call: every host joins the same mesh
    except (ValueError, RuntimeError) as err:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"config.distributed=True, but no cluster to join was found ({cause}). Fix: on one machine pass "
            "--config.distributed=False; on a cluster launch under a scheduler JAX detects (SLURM, Open MPI, "
            "Kubernetes, Cloud TPU) or give every process --coordinator_address=HOST:PORT (or set "
            "JAX_COORDINATOR_ADDRESS), --num_processes and its --process_id."
        ) from None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; options are given as --flag=value.")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO; progress comes from the tqdm bars
    import jax

    from hydrahead_jax.compilation import use_persistent_cache
    from hydrahead_jax.training.errors import USER_ERRORS
    from hydrahead_jax.training.pipeline import run_pipeline
    from hydrahead_jax.training.trainer import Preempted

    try:
        recipe = _CONFIG.value
        recipe.keys()  # a --config file that does not load raises here, at its first use
    except OSError as error:
        _fail(_config_file_error(sys.argv, error))
    try:
        run = RunConfig.from_recipe(recipe)  # the edge: everything below reads the typed config
        if run.distributed:
            _join_cluster(jax)
        elif _cluster_coordinates() or _LOCAL_DEVICES.value is not None:
            raise ConfigError(
                "--coordinator_address/--num_processes/--process_id/--local_device_ids are for a multi-process run; "
                "pass --config.distributed=True as well, or drop them."
            )
        use_persistent_cache()
        run_pipeline(
            run,
            _WORKDIR.value,
            only_stage=_ONLY.value,
            until_stage=_UNTIL.value,
            force_new=_FORCE_NEW.value,
            restart_stage=_RESTART.value,
        )
    except USER_ERRORS as error:
        _fail(str(error))
    except Preempted as stop:
        # 128 + SIGTERM: what a job killed by SIGTERM reports, so schedulers that requeue on it still do.
        print(f"preempted: {stop}", file=sys.stderr, flush=True)
        sys.exit(PREEMPTED_EXIT_STATUS)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

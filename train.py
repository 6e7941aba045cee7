"""Convert a pretrained decoder into a HydraHead hybrid: stage 0 select → 1 align → 2 distil → 3 long → export.

    python train.py --config configs/tiny.py --workdir runs/tiny
    python train.py --config configs/smollm2_hydrahead.py --workdir runs/smollm2_demo --config.stage2.steps=100
    python train.py --config configs/qwen3_1p7b_hydrahead.py:7to1 --workdir gs://.../run --until_stage distil

Rerunning on the same workdir resumes: finished stages are skipped, an unfinished one continues from its last
checkpoint exactly. A workdir that holds a run of another config is refused unless --force_new.
"""

import importlib.util
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training recipe (a configs/*.py file).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, head map, final model).")
_STAGES = ("select", "align", "distil", "long")
_ONLY = flags.DEFINE_enum("only_stage", None, _STAGES, "Run only this stage (earlier ones must have finished).")
_UNTIL = flags.DEFINE_enum("until_stage", None, _STAGES, "Run the stages up to and including this one.")
_FORCE_NEW = flags.DEFINE_bool(
    "force_new",
    False,
    "Start over in a workdir that holds a run of another config "
    "(the old run is moved aside to WORKDIR.replaced-<time>).",
)
flags.mark_flags_as_required(["config", "workdir"])


def _unknown_override(argv) -> str | None:
    """The first --config.a.b=... override whose key the recipe does not define, with the keys it does define."""
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
        path = argv[argv.index("--config") + 1]
    if path is None:
        return None
    file, _, arg = path.partition(":")
    spec = importlib.util.spec_from_file_location("_recipe", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
    for a in argv:
        if not a.startswith("--config."):
            continue
        node, keys = config, a[len("--config.") :].split("=", 1)[0].split(".")
        for depth, key in enumerate(keys):
            if not hasattr(node, "keys") or key not in node:
                where = ".".join(["config"] + keys[:depth])
                valid = sorted(node.keys()) if hasattr(node, "keys") else []
                return f"unknown config key {'.'.join(keys)!r} in {a!r}: {where} has no field {key!r}" + (
                    f"; its fields are {valid}." if valid else "."
                )
            node = node[key]
    return None


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error) as error:
        message = None
        try:
            message = _unknown_override(argv)
        except Exception:  # noqa: BLE001 — fall back to the original error below
            pass
        print(f"error: {message or error}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; options are given as --flag=value.")
    config = _CONFIG.value
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO; progress comes from the tqdm bars
    import os

    import jax

    from hydrahead_jax.data.corpus import cache_dir

    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        # Persistent compilation cache: a resumed (preempted) run, or the next stage with the same shapes, reuses
        # compiled steps instead of paying minutes of XLA compilation again.
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    if config.distributed:
        jax.distributed.initialize()  # before any other JAX call: every host joins the same device mesh
    from hydrahead_jax.training.errors import USER_ERRORS
    from hydrahead_jax.training.pipeline import run_pipeline

    try:
        run_pipeline(
            config, _WORKDIR.value, only_stage=_ONLY.value, until_stage=_UNTIL.value, force_new=_FORCE_NEW.value
        )
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)

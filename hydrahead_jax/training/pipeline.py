"""The whole conversion: stage 0 (select) → 1 (align) → 2 (distil) → 3 (long) → export to ``workdir/final``.

``run_pipeline(config, workdir)`` is what ``train.py`` calls. Every stage checkpoints into its own directory;
rerunning on the same workdir skips finished stages and resumes the unfinished one exactly.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HeadMapError, HybridConfig, build_model, build_student, new_param_filter
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import StageCheckpointer, check_workdir_config, config_fingerprint
from hydrahead_jax.training.data import make_stage_iterator, prepare_store
from hydrahead_jax.training.errors import StageOrderError
from hydrahead_jax.training.export import export_final
from hydrahead_jax.training.steps import cast_like, f32_param_target
from hydrahead_jax.training.trainer import StageSpec, TeacherHandle, abstract_with_shardings, run_stage

log = logging.getLogger(__name__)

STAGES = ("select", "align", "distil", "long")
STAGE_KEYS = {"align": "stage1", "distil": "stage2", "long": "stage3"}
STAGE_DIRS = {"align": "stage1_align", "distil": "stage2_distil", "long": "stage3_long"}


def stage_range(only_stage: str | None, until_stage: str | None) -> list[str]:
    for name, value in (("--only_stage", only_stage), ("--until_stage", until_stage)):
        if value and value not in STAGES:
            raise ValueError(f"{name}={value!r}; choose one of {STAGES}.")
    if only_stage and until_stage:
        raise ValueError("give --only_stage or --until_stage, not both.")
    if only_stage:
        return [only_stage]
    return list(STAGES[: STAGES.index(until_stage) + 1]) if until_stage else list(STAGES)


# ------------------------------------------------------------------------------------------------ models
def load_teacher(teacher_cfg):
    """(teacher Transformer, tokenizer or None, ModelConfig) from config.teacher."""
    if teacher_cfg.source == "random":
        from hydrahead_jax.models import Transformer

        cfg = ModelConfig.from_dict(dict(teacher_cfg.model))
        return Transformer(cfg, rngs=nnx.Rngs(int(teacher_cfg.seed))), None, cfg
    from hydrahead_jax.models import load_pretrained

    model, tokenizer = load_pretrained(teacher_cfg.source, dtype=teacher_cfg.dtype)
    return model, tokenizer, model.cfg


LOCAL_METHODS = ("given", "all_fa", "all_la")  # everything else is hydrahead_jax.selection.run_selection's


def select_heads(sel_cfg, teacher, tokenizer, cfg: ModelConfig, workdir: Path) -> HeadMap:
    """Stage 0: the head map (written to workdir/head_map.json; reused when already there).

    ``given`` loads ``selection.head_map_path``; ``all_fa`` / ``all_la`` are the trivial maps; the probe methods
    (retrieval, ablation, combined) and the baselines (random, layerwise) run ``run_selection`` on the teacher.
    """
    out = workdir / "head_map.json"
    if out.exists():
        return HeadMap.load(out, cfg)
    method = sel_cfg.method
    if method == "given":
        if not sel_cfg.head_map_path:
            raise HeadMapError("selection.method='given' needs selection.head_map_path (a head map JSON file).")
        head_map = HeadMap.load(sel_cfg.head_map_path, cfg)
    elif method == "all_fa":
        head_map = HeadMap.all_fa(cfg)
    elif method == "all_la":
        head_map = HeadMap.all_la(cfg)
    else:
        from hydrahead_jax.selection import METHODS, run_selection

        if method not in METHODS:
            raise HeadMapError(f"selection.method={method!r}; choose one of {LOCAL_METHODS + tuple(METHODS)}.")
        if tokenizer is None and method in ("retrieval", "ablation", "combined"):
            raise HeadMapError(
                f"selection.method={method!r} probes the teacher with text prompts and needs a "
                "tokenizer; a random teacher has none — use 'layerwise', 'random' or 'given'."
            )
        settings = {k: v for k, v in sel_cfg.to_dict().items() if k != "head_map_path"}
        head_map = run_selection(teacher, tokenizer, settings, workdir / "selection")
    head_map.validate(cfg)
    head_map.save(out)
    print(
        f"[select] head map ({head_map.method}): {head_map.num_fa_groups()} FA groups of "
        f"{cfg.num_layers * cfg.num_kv_heads}, written to {out}",
        flush=True,
    )
    return head_map


# ------------------------------------------------------------------------------------------------ pipeline
def run_pipeline(
    config,
    workdir: str | Path,
    *,
    only_stage: str | None = None,
    until_stage: str | None = None,
    force_new: bool = False,
) -> Path | None:
    """Run the requested stages; returns workdir/final when the last stage finished (and was exported)."""
    workdir = Path(workdir).absolute()
    stages = stage_range(only_stage, until_stage)
    resolved = config.to_dict()
    check_workdir_config(workdir, resolved, force_new=force_new)
    digest, _ = config_fingerprint(resolved)
    hybrid_cfg = HybridConfig.from_dict(dict(config.hybrid))
    mesh = shd.make_mesh(**dict(config.mesh))
    print(
        f"mesh {dict(mesh.shape)} over {mesh.devices.size} device(s) of {jax.process_count()} process(es)", flush=True
    )

    teacher, tokenizer, cfg = load_teacher(config.teacher)
    # Validate a given head map against the model before any work (clear error, nothing trained).
    if config.selection.method == "given" and config.selection.head_map_path:
        HeadMap.load(config.selection.head_map_path, cfg)
    head_map = select_heads(config.selection, teacher, tokenizer, cfg, workdir)
    if stages == ["select"]:
        return None
    store = None if config.data.source == "copy" else prepare_store(config.data, tokenizer)
    teacher_handle = TeacherHandle(teacher, mesh)
    nnx.update(teacher, teacher_handle.state)  # the module and the handle share the placed arrays: one copy

    abstract_model = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid_cfg, nnx.Rngs(int(config.seed))))
    student_graphdef, abstract_student = nnx.split(abstract_model)

    def iterator_factory(key: str, seed: int, batch_size: int | None = None):
        scfg = config[key]
        return lambda: make_stage_iterator(
            config.data,
            seq_len=int(scfg.seq_len),
            batch_size=int(batch_size or scfg.batch_size),
            seed=seed,
            vocab_size=cfg.vocab_size,
            synthetic_rate=float(scfg.get("synthetic_rate", 0.0)),
            tokenizer=tokenizer,
            store_path=store,
        )

    def initial_stage1():
        calib = iterator_factory("stage1", int(config.seed) + 7919, int(config.hybrid_calibration_rows))()
        ids = jax.numpy.asarray(next(calib)["input_ids"])
        # build_student copies the teacher's arrays, so the student's state can be donated to the jitted step.
        student = build_student(teacher, head_map, hybrid_cfg, rngs=nnx.Rngs(int(config.seed)), calibration_ids=ids)
        return nnx.as_pure(nnx.state(student))

    previous = None
    for index, kind in enumerate(("align", "distil", "long")):
        key = STAGE_KEYS[kind]
        directory = workdir / STAGE_DIRS[kind]
        if kind not in stages:
            continue
        if previous is None and kind != "align":
            previous = _final_of_previous(workdir, kind, abstract_student, mesh)
        scfg = config[key]
        trainable = new_param_filter if scfg.train == "new" else nnx.Param
        if scfg.train not in ("new", "all"):
            raise ValueError(f"config.{key}.train={scfg.train!r}; choose 'new' (GDN + fusion) or 'all'.")
        spec = StageSpec(
            kind=kind,
            config_key=key,
            directory=directory,
            stage_cfg=scfg,
            trainable=trainable,
            make_iterator=iterator_factory(key, int(config.seed) + 1000 * (index + 1)),
            meta={"stage": kind, "config_hash": digest, "config": resolved},
        )
        init = initial_stage1 if kind == "align" else (lambda prev=previous: prev)
        previous = run_stage(
            spec,
            student_graphdef=student_graphdef,
            abstract_student=abstract_student,
            initial_student=init,
            teacher=teacher_handle,
            mesh=mesh,
            workdir=workdir,
            logging_cfg=config.logging,
        )
    if "long" in stages:
        final = export_final(
            workdir / "final",
            student_graphdef,
            cast_like(previous, nnx.as_pure(abstract_student)),  # the master copy is training state: export as built
            cfg,
            head_map,
            hybrid_cfg,
            teacher_source=config.teacher.source,
            resolved_config=resolved,
        )
        print(f"exported the HydraHead model to {final}", flush=True)
        return final
    return None


def _final_of_previous(workdir: Path, kind: str, abstract_student, mesh):
    """Final full state of the stage before ``kind`` (which must have finished)."""
    order = ("align", "distil", "long")
    prev = order[order.index(kind) - 1]
    ckpt = StageCheckpointer(workdir / STAGE_DIRS[prev], save_every=1)
    try:
        if not ckpt.done:
            raise StageOrderError(
                f"stage {kind!r} starts from the final checkpoint of stage {prev!r}, which has not "
                f"finished in {workdir}; run it first (e.g. --until_stage {prev})."
            )
        target = abstract_with_shardings(  # f32 Params: the stage saved its trained ones in their master dtype
            nnx.as_pure(f32_param_target(abstract_student)), shd.state_shardings(abstract_student, mesh)
        )
        state = ckpt.restore_model(target)
        if state is None:
            raise StageOrderError(
                f"the final checkpoint of stage {prev!r} in {workdir} does not restore; rerun that "
                f"stage (--only_stage {prev}) to resume it from its last good step."
            )
        return state
    finally:
        ckpt.close()


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())

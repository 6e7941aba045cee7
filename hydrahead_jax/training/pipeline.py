"""The whole conversion: stage 0 (select) → 1 (align) → 2 (distil) → 3 (long) → export to ``workdir/final``.

``run_pipeline(run_config, workdir)`` is what ``train.py`` calls with the RunConfig it converted the recipe into.
The stages are the rows of ``run_config.STAGES``. Every stage checkpoints into its own directory; rerunning on the
same workdir skips finished stages and resumes the unfinished one exactly.
"""

from __future__ import annotations

import logging
import time

import jax
from flax import nnx

from hydrahead_jax.compilation import release_compiled
from hydrahead_jax.config import ConfigError, ModelConfig, with_rope_extension
from hydrahead_jax.data.corpus import CorpusError
from hydrahead_jax.data.preparation import check_source
from hydrahead_jax.data.protocol import check_tokenizer
from hydrahead_jax.export import export_final
from hydrahead_jax.hybrid import HeadMap, build_model, build_student
from hydrahead_jax.hybrid.build import fa_slice_mask, trainable_filter
from hydrahead_jax.run_config import (
    PROBE_METHODS,
    SELECT,
    STAGE_NAMES,
    STAGES,
    RunConfig,
    SelectionStageConfig,
    Stage,
    TeacherConfig,
)
from hydrahead_jax.selection import SelectionError
from hydrahead_jax.selection.select import validate_config
from hydrahead_jax.storage import RunPath, move, run_path
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.checkpoint import (
    StageCheckpointer,
    WorkdirLock,
    check_workdir_config,
    finished_step,
    is_primary,
    sync_processes,
)
from hydrahead_jax.training.data import (
    HELDOUT_SEED_OFFSET,
    data_digest,
    make_heldout_batch,
    make_stage_iterator,
    mixture_line,
    prepare_stores,
    stage_stores,
)
from hydrahead_jax.training.errors import StageOrderError
from hydrahead_jax.training.steps import cast_like, f32_param_target
from hydrahead_jax.training.trainer import StageSpec, TeacherHandle, abstract_with_shardings, run_stage

log = logging.getLogger(__name__)


def stage_range(only_stage: str | None, until_stage: str | None) -> list[str]:
    for name, value in (("--only_stage", only_stage), ("--until_stage", until_stage)):
        if value and value not in STAGE_NAMES:
            raise ValueError(f"{name}={value!r}; choose one of {STAGE_NAMES}.")
    if only_stage and until_stage:
        raise ValueError("give --only_stage or --until_stage, not both.")
    if only_stage:
        return [only_stage]
    return list(STAGE_NAMES[: STAGE_NAMES.index(until_stage) + 1]) if until_stage else list(STAGE_NAMES)


def check_restart_stage(restart_stage: str | None, stages: list[str]) -> None:
    """ConfigError unless ``restart_stage`` (--restart_stage) is None or a training stage among ``stages``."""
    if restart_stage is None:
        return
    trained = [s.name for s in STAGES]
    if restart_stage not in trained:
        raise ConfigError(f"--restart_stage={restart_stage!r}; choose one of the training stages {trained}.")
    if restart_stage not in stages:
        raise ConfigError(
            f"--restart_stage={restart_stage} is not among the stages this run runs ({stages}); drop "
            f"--only_stage/--until_stage or include {restart_stage} in them."
        )


# ------------------------------------------------------------------------------------------------ models
def load_teacher(teacher_cfg: TeacherConfig):
    """(teacher Transformer, tokenizer or None, ModelConfig) from config.teacher."""
    if teacher_cfg.source == "random":
        from hydrahead_jax.models import Transformer

        cfg = teacher_cfg.model
        return Transformer(cfg, rngs=nnx.Rngs(teacher_cfg.seed)), None, cfg
    from hydrahead_jax.models import load_pretrained

    try:
        model, tokenizer = load_pretrained(teacher_cfg.source, dtype=teacher_cfg.dtype)
    except (OSError, ValueError, RuntimeError) as err:  # CheckpointError is a ValueError and names the file
        detail = " ".join(str(err).split())[:400]
        raise ConfigError(
            f"config.teacher.source={teacher_cfg.source!r} does not load ({type(err).__name__}: {detail}). Fix: name "
            "'smollm2-135m', a .gguf file or a complete Hugging Face folder (config.json, *.safetensors, "
            "tokenizer.json); re-download a checkpoint whose files are cut short."
        ) from None
    return model, tokenizer, model.cfg


def check_batch_sizes(run: RunConfig, mesh) -> None:
    """Every stage's batch splits evenly over the devices that hold batch rows (mesh axes data x fsdp)."""
    rows = mesh.shape["data"] * mesh.shape["fsdp"]
    for stage in STAGES:
        size = run.stage(stage).batch_size
        if size % rows:
            raise ConfigError(
                f"config.{stage.config_key}.batch_size={size} is not divisible by the {rows} devices of the data "
                f"axis (mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']}). Fix: "
                f"--config.{stage.config_key}.batch_size={max(rows, size - size % rows)}, or a smaller mesh.data."
            )


def validate_against_teacher(run: RunConfig, cfg: ModelConfig, tokenizer) -> None:
    """The checks that need the loaded teacher, before any work: its tokenizer against its vocabulary, the
    selection settings against its shape and context (and every probe prompt against its length), a given head
    map against the model, a corpus or probe method without a tokenizer, a corpus that is not there."""
    if tokenizer is not None:
        check_tokenizer(tokenizer, cfg.vocab_size, model_name=f"the teacher {run.teacher.source!r}")
    sel = run.selection
    if sel.method in PROBE_METHODS and tokenizer is None:
        raise SelectionError(
            f"selection.method={sel.method!r} probes the teacher with text prompts, and {run.teacher.source!r} "
            "comes without a tokenizer; use 'layerwise', 'random' or 'given', or a checkpoint with its tokenizer."
        )
    if run.data.source != "copy" and tokenizer is None:
        raise SelectionError(
            f"data.source={run.data.source!r} is tokenised with the teacher's tokenizer, and "
            f"{run.teacher.source!r} comes without one; use data.source='copy' or a checkpoint with its tokenizer."
        )
    for key, path in corpus_paths(run):
        try:
            check_source(path)
        except CorpusError as err:
            raise CorpusError(
                f"config.{key}: {err} Fix: --config.{key}=<a corpus file (.txt/.md, .jsonl[.gz|.zst], .parquet, "
                ".arrow), a folder or glob of them, a prepared token store, or enwiki>."
            ) from None
    if sel.method == "given":
        if run_path(sel.head_map_path).is_dir():
            raise ConfigError(
                f"config.selection.head_map_path={sel.head_map_path!r} is a directory; name its head_map.json file."
            )
        HeadMap.load(sel.head_map_path, cfg)
    elif sel.method not in ("all_fa", "all_la"):
        validate_config(sel.settings, cfg, tokenizer if sel.method in PROBE_METHODS else None)
    for stage in STAGES:
        student_config(run, cfg, stage)  # a stage-3 RoPE extension the teacher's RoPE cannot take is refused now


def corpus_paths(run: RunConfig) -> list[tuple[str, str]]:
    """(config key, path) of every corpus the run names: data.source, or the sources lists that replace it."""
    if run.data.source == "copy":
        return []
    keyed = [
        (f"{section}.sources[{i}].path", s.path)
        for section, specs in [("data", run.data.sources)] + [(st.config_key, run.stage(st).sources) for st in STAGES]
        for i, s in enumerate(specs)
    ]
    uses_source = any(not run.stage(st).sources for st in STAGES) and not run.data.sources
    return ([("data.source", run.data.source)] if uses_source else []) + keyed


def student_config(run: RunConfig, cfg: ModelConfig, stage: Stage) -> ModelConfig:
    """The student's ModelConfig in ``stage``: the teacher's, with the RoPE extension of the first stage up to
    and including ``stage`` that sets one (``StageConfig.rope_scaling``; only the long stage may). The extension
    changes no parameter, so a state passes unchanged from the stage before it."""
    for s in STAGES[: STAGES.index(stage) + 1]:
        spec = run.stage(s).rope_scaling
        if spec:
            try:
                return with_rope_extension(cfg, spec)
            except ConfigError as err:
                raise ConfigError(f"config.{s.config_key}.rope_scaling: {err}") from None
    return cfg


def select_heads(sel: SelectionStageConfig, teacher, tokenizer, cfg: ModelConfig, workdir: RunPath) -> HeadMap:
    """Stage 0: the head map (written to workdir/head_map.json; reused when already there).

    Process 0 alone makes and writes it; every process then builds its student from that one file, so the hosts
    of a run cannot disagree on the map. ``given`` loads ``selection.head_map_path``; ``all_fa`` / ``all_la`` are
    the trivial maps; the probe methods (retrieval, ablation, combined) and the baselines (random, layerwise) run
    ``run_selection`` on the teacher.
    """
    out = workdir / "head_map.json"
    try:
        if is_primary() and not out.exists():
            _new_head_map(sel, teacher, tokenizer, cfg, workdir).save(out)
    finally:
        sync_processes("head map")  # the others read the map once process 0 has written it (or failed)
    if not out.exists():
        raise SelectionError(f"process 0 wrote no head map to {out} (its error says why and how to fix it).")
    return HeadMap.load(out, cfg)


def _new_head_map(sel: SelectionStageConfig, teacher, tokenizer, cfg: ModelConfig, workdir) -> HeadMap:
    """The head map that ``sel`` asks for, validated against ``cfg`` and announced."""
    if sel.method == "given":
        head_map = HeadMap.load(sel.head_map_path, cfg)
    elif sel.method == "all_fa":
        head_map = HeadMap.all_fa(cfg)
    elif sel.method == "all_la":
        head_map = HeadMap.all_la(cfg)
    else:
        from hydrahead_jax.selection import run_selection

        head_map = run_selection(teacher, tokenizer, sel.settings, workdir / "selection")
    head_map.validate(cfg)
    print(
        f"[select] head map ({head_map.method}): {head_map.num_fa_groups()} FA groups of "
        f"{cfg.num_layers * cfg.num_kv_heads}, written to {workdir / 'head_map.json'}",
        flush=True,
    )
    return head_map


def calibration_ids(run: RunConfig, vocab_size: int, tokenizer, store=None) -> jax.Array:
    """The fusion's calibration batch, int32 [hybrid_calibration_rows, stage 1's seq_len]: the first rows of stage
    1's data under seed ``run.seed + 7919`` (no training iterator uses it), read whole by every process, which must
    all build the same student. ``store``: stage 1's token store(s) (``stage_stores``; None for the copy source)."""
    scfg, rows = run.stage(STAGES[0]), run.hybrid_calibration_rows
    batches = make_stage_iterator(
        run.data,
        seq_len=scfg.seq_len,
        batch_size=rows,
        seed=run.seed + 7919,
        vocab_size=vocab_size,
        synthetic_rate=scfg.synthetic_rate,
        tokenizer=tokenizer,
        store_path=store,
        batch_rows=range(rows),
    )
    return jax.numpy.asarray(next(batches)["input_ids"], jax.numpy.int32)


def initial_student(run: RunConfig, teacher, tokenizer, head_map: HeadMap, store=None):
    """The student before stage 1, exactly as the pipeline builds it: the teacher's weights, new parameters at
    their initial values (seed ``run.seed``), fusion scales calibrated on ``calibration_ids``."""
    ids = calibration_ids(run, teacher.cfg.vocab_size, tokenizer, store)
    return build_student(teacher, head_map, run.hybrid, rngs=nnx.Rngs(run.seed), calibration_ids=ids)


# ------------------------------------------------------------------------------------------------ pipeline
def run_pipeline(
    run: RunConfig,
    workdir: str | RunPath,
    *,
    only_stage: str | None = None,
    until_stage: str | None = None,
    force_new: bool = False,
    restart_stage: str | None = None,
) -> RunPath | None:
    """Run the requested stages; returns workdir/final when the last stage finished (and was exported).

    ``restart_stage`` (a training stage's name) moves that stage's checkpoints aside (``<dir>.restarted-<time>``)
    and trains it from step 0; the finished stages after it rerun (their input changed). It is the consent to
    start over a stage whose checkpoints do not restore for another reason than damage (see checkpoint.py).

    The workdir is locked for the whole call (``WorkdirLock``: a second run on it is refused at once). Every
    check runs before any work: the RunConfig validated itself at the edge; here the stage range, the mesh
    against the devices, then (once the teacher is loaded) the tokenizer, selection settings and head map
    against it, and the workdir's config fingerprint."""
    workdir = run_path(workdir, what="--workdir")
    stages = stage_range(only_stage, until_stage)
    check_restart_stage(restart_stage, stages)
    lock = WorkdirLock(workdir, enabled=jax.process_index() == 0)  # one process locks for a multi-host run
    try:
        if workdir.exists():
            lock.acquire()  # a workdir in use is refused at once, before the teacher loads
        return _run_locked(run, workdir, stages, force_new, lock, restart_stage)
    finally:
        lock.release()


def _run_locked(
    run: RunConfig,
    workdir: RunPath,
    stages: list[str],
    force_new: bool,
    lock: WorkdirLock,
    restart_stage: str | None,
) -> RunPath | None:
    run.mesh.check_devices(jax.device_count())
    mesh = shd.make_mesh(run.mesh.data, run.mesh.fsdp, run.mesh.tensor, sequence=run.mesh.sequence)
    check_batch_sizes(run, mesh)
    run.check_sequence_split(int(mesh.shape["sequence"]))  # mesh.sequence=-1 (fill) is known only now
    print(
        f"mesh {dict(mesh.shape)} over {mesh.devices.size} device(s) of {jax.process_count()} process(es)", flush=True
    )
    teacher, tokenizer, cfg = load_teacher(run.teacher)
    validate_against_teacher(run, cfg, tokenizer)
    lock.acquire()  # a new workdir is created (and claimed) only by a run that passed every check
    # The corpora are tokenised (once; content-addressed in the cache) before the workdir check, so that a run is
    # identified by its data's content, not by the paths the corpora are mounted at.
    stores = prepare_stores(run, tokenizer)
    digest = check_workdir_config(workdir, run, cfg, force_new=force_new, data_digest=data_digest(run, stores))
    resolved = run.to_dict()
    # The held-out batches are read (whole, by every process: see trainer.HeldoutEval) before any work, so a
    # validation split that cannot give them is refused now.
    heldout = {
        stage.name: make_heldout_batch(
            run.data,
            seq_len=run.stage(stage).seq_len,
            rows=run.stage(stage).heldout_rows,
            seed=run.seed + HELDOUT_SEED_OFFSET + index,
            vocab_size=cfg.vocab_size,
            store_path=stage_stores(run, stage, stores),
            config_key=stage.config_key,
        )
        for index, stage in enumerate(STAGES)
        if stage.name in stages and run.stage(stage).heldout_rows > 0
    }

    head_map = select_heads(run.selection, teacher, tokenizer, cfg, workdir)
    release_compiled()  # the probe's programs do not run again (compilation.py)
    if stages == [SELECT]:
        return None
    teacher_handle = TeacherHandle(teacher, mesh)
    nnx.update(teacher, teacher_handle.state)  # the module and the handle share the placed arrays: one copy

    def abstract_model(stage: Stage):
        stage_cfg = student_config(run, cfg, stage)
        return nnx.split(nnx.eval_shape(lambda: build_model(stage_cfg, head_map, run.hybrid, nnx.Rngs(run.seed))))

    student_graphdef, abstract_student = abstract_model(STAGES[0])

    def iterator_factory(stage: Stage, seed: int):
        scfg = run.stage(stage)
        # A process reads the rows its devices hold (put_batch assembles the global batch from them).
        rows = shd.process_batch_rows(shd.batch_sharding(mesh, 2), scfg.batch_size)

        def make(start_batch: int):
            if run.stage_sources(stage):  # the realised mixture of the rows this (re)start reads
                print(f"[{stage.directory}] {mixture_line(run, stage, start_batch)}", flush=True)
            return make_stage_iterator(
                run.data,
                seq_len=scfg.seq_len,
                batch_size=scfg.batch_size,
                seed=seed,
                vocab_size=cfg.vocab_size,
                synthetic_rate=scfg.synthetic_rate,
                synthetic_loss=scfg.synthetic_loss,
                tokenizer=tokenizer,
                store_path=stage_stores(run, stage, stores),
                batch_rows=rows,
                start_batch=start_batch,
            )

        return make

    def initial_first_stage():
        # build_student copies the teacher's arrays, so the student's state can be donated to the jitted step.
        store = stage_stores(run, STAGES[0], stores)
        return nnx.as_pure(nnx.state(initial_student(run, teacher, tokenizer, head_map, store)))

    previous = None
    extended = False  # a finished stage continues to a raised step count: the finished stages after it are stale
    for index, stage in enumerate(STAGES):
        if stage.name not in stages:
            continue
        if previous is None and index > 0:
            previous = final_state_before(workdir, index, abstract_student, mesh)
        scfg = run.stage(stage)
        student_graphdef, abstract_student = abstract_model(stage)  # the same state; RoPE may differ by stage
        stage_dir = workdir / stage.directory
        final_step = finished_step(stage_dir)
        if stage.name == restart_stage and stage_dir.exists():
            set_aside(stage_dir, "restarted", "--restart_stage: training it from step 0")
            extended = True  # the stages after it start from its new final state
        elif extended and stage_dir.exists():
            set_aside(stage_dir, "superseded", "an earlier stage trained on: rerunning it")
        elif final_step is not None and final_step < scfg.total_steps:
            extended = True
        spec = StageSpec(
            stage=stage,
            config=scfg,
            directory=stage_dir,
            trainable=trainable_filter(scfg.train, scfg.lr_scales),
            update_mask=fa_slice_mask(scfg.train, head_map.fa_counts(), cfg.num_kv_heads),
            make_iterator=iterator_factory(stage, run.seed + 1000 * (index + 1)),
            meta={"stage": stage.name, "config_hash": digest, "config": resolved},
            mask_documents=run.data.mask_documents,
            heldout=heldout.get(stage.name),
        )
        # The previous stage's state is handed over, not kept: the trainer drops it once split into master
        # parameters and frozen Variables, so two model-sized states are not alive through the stage.
        handoff, previous = [previous], None
        init = initial_first_stage if index == 0 else handoff.pop
        previous = run_stage(
            spec,
            student_graphdef=student_graphdef,
            abstract_student=abstract_student,
            initial_student=init,
            teacher=teacher_handle,
            mesh=mesh,
            workdir=workdir,
            logging_cfg=run.logging,
        )
        release_compiled()  # nor do the stage's
    if STAGES[-1].name in stages:
        final = export_final(
            workdir / "final",
            student_graphdef,
            cast_like(previous, nnx.as_pure(abstract_student)),  # the master copy is training state: export as built
            student_config(run, cfg, STAGES[-1]),
            head_map,
            run.hybrid,
            tokenizer=tokenizer,
            resolved_config=resolved,
        )
        print(f"exported the HydraHead model to {final}", flush=True)
        return final
    return None


def set_aside(stage_dir, why: str, note: str) -> None:
    """Move a stage's folder to ``<dir>.<why>-<time>``: process 0 alone, between two barriers, so every process
    has decided on the folder before it moves and sees it gone after."""
    sync_processes(f"before moving {stage_dir.name}")
    if is_primary():
        aside = stage_dir.with_name(f"{stage_dir.name}.{why}-{time.strftime('%Y%m%d-%H%M%S')}")
        print(f"[{stage_dir.name}] {note} (old run moved to {aside})", flush=True)
        move(stage_dir, aside)
    sync_processes(f"moved {stage_dir.name}")


def final_state_before(workdir: RunPath, index: int, abstract_student, mesh):
    """Final full state of the stage before STAGES[index] (which must have finished)."""
    stage, prev = STAGES[index], STAGES[index - 1]
    if finished_step(workdir / prev.directory) is None:  # checked before a CheckpointManager (and its threads) exists
        raise StageOrderError(
            f"stage {stage.name!r} starts from the final checkpoint of stage {prev.name!r}, which has not "
            f"finished in {workdir}; run it first (e.g. --until_stage {prev.name})."
        )
    ckpt = StageCheckpointer(workdir / prev.directory, save_every=1, stage=prev.name)
    try:
        target = abstract_with_shardings(  # f32 Params: the stage saved its trained ones in their master dtype
            nnx.as_pure(f32_param_target(abstract_student)), shd.state_shardings(abstract_student, mesh)
        )
        state = ckpt.restore_model(target)
        if state is None:
            raise StageOrderError(
                f"the final checkpoint of stage {prev.name!r} in {workdir} does not restore; rerun that "
                f"stage (--only_stage {prev.name}) to resume it from its last good step."
            )
        return state
    finally:
        ckpt.close()

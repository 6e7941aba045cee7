"""Check the conversion pipeline end to end on a GPU (one part of bench/gpu_check.sh): every stage trained with the
Pallas kernels and cuDNN attention, step by step against the same run on the CPU's XLA path, with tokens/s and
model FLOP utilisation (MFU) per stage.

    python bench/gpu_check_end_to_end.py [--mode full|quick|dry-run] [--deadline UNIX_TIME] [--out DIR]

1. Models (``MODELS``), each converted by the product's pipeline (``run_pipeline``: select → align → distil → long
   → export) for ``STEPS`` steps per stage, each run in a process of its own (``--worker``):
   * "tiny": the tiny recipe (configs/tiny.py: a random teacher, layer-wise 1:1, the seeded copy rows). On a GPU at
     shapes its kernels take (``TINY_GPU``): head_dim 64, the head size both kernels are checked at by the other
     parts (cuDNN needs a multiple of 8), GDN chunk 64 (the Triton kernel's checked chunk), 4 rows of 512 tokens
     and, in the long stage, 2 of 1024 (whole chunks, even lengths as cuDNN's backward needs), 4 layers of 2 KV
     groups of 2 heads, so the layer-wise 1:1 map gives 2 FA and 2 LA layers; hidden 256, vocab 1024: small enough
     that a CPU run of the same steps costs ~80 s of CPU time (measured on the 2-core development machine), large
     enough that a step is not just kernel launches. The dry run keeps configs/tiny.py's own shapes.
   * "reproduction": the reproduction's teacher (bench/results/reproduction/teacher/hf, trained by
     hydrahead_jax.experiments.small_teacher: 8 layers x 4 KV groups, head_dim 16) converted by its arm
     ``REPRODUCTION_ARM`` (``reproduce.base_recipe`` + ``reproduce.ARMS``: layer-wise 3:1, the study's batch,
     row length and learning rates) on MQAR documents written in its vocabulary (the recall part of the study's
     corpus; the study's Wikipedia text needs a download the GPU machine cannot make). Not in --quick.
2. Runs of each model, one recipe and seed (the same teacher, head map, data and initial student in each):
   * device: on the GPU in bfloat16, ``hybrid.attention_implementation="cudnn"`` (the student's FA groups; the
     teacher's "auto" takes cuDNN for the same calls) and ``gdn_implementation="pallas"`` (the Triton kernel),
     named, not "auto": a call either does not cover raises instead of falling back. ``data.mask_documents=False``:
     a copy or MQAR row is one document, and cuDNN takes no segment ids.
   * oracle: the CPU (JAX_PLATFORMS=cpu), float32, ``implementation="xla"`` for both (the pure-JAX paths).
   * baseline: the CPU, bfloat16, "xla": what bfloat16 alone costs.
   The dry run (a CPU): device = float32 with "pallas" for both (the GPU kernels in interpret mode) against the
   oracle; no baseline. On a GPU machine the CPU runs start at once, side by side on the cores the device run
   leaves (``GPU_HOST_CORES``), and the device runs follow one another, so the timings see an idle GPU and host.
3. Checks, per model and stage: the per-step ``loss`` and ``grad_norm`` of metrics.jsonl, each a vector over the
   stage's steps, Frobenius-relative error against the oracle's (``Report.check``):
   * bfloat16: ≤ BF16_FACTOR (2) x the baseline's own error against the same oracle: the kernel parts' protocol
     (bench/_gpu_check.py), here over whole training steps, so the limit scales with what each curve can bear.
     Measured on the CPU at the tiny GPU shapes over 8 steps, the baseline's own errors are: align loss 3.5e-3,
     grad norm 5.6e-3; distil 2.1e-4, 4.5e-3; long 2.3e-5, 2.1e-3 (the losses that average over the vocabulary
     lose least). The GPU run may lose at most as much again (its own roundings, in another order); a wrong mask,
     decay, gate or gradient moves a curve by 1e-2 or more.
   * float32 (the dry run): ≤ ``F32_STEP_LIMIT``. Both runs compute in float32 on one CPU and differ only in the
     order of the sums inside the two kernels (unit roundoff 6e-8), carried through a few AdamW steps; measured
     ≤ 1e-6 on the tiny recipe (the limit leaves 100x), and a wrong mask, decay, gate or gradient in either kernel
     moves the curves by 1e-3 or more. The dry run's workers compile with JAX_DISABLE_MOST_OPTIMIZATIONS=1 (the
     compiles are most of its time; both runs compared compile alike).
4. Speed of the device run, per stage: ms per step (median over steps ``TIMED_FROM_STEP`` on: step 1 compiles,
   step 2 may still wait on the first read-back), tokens/s = B·T / that, model FLOPs per token (``stage_flops``),
   TFLOP/s, and MFU = TFLOP/s / the device's dense bf16 peak (``PEAK_BF16``, from the device kind; n/a on a CPU,
   whose peak is not known here). Tiny models keep a GPU far from its peak: these MFUs measure the pipeline's
   overhead (launches, small matmuls), not the kernels, whose own TFLOP/s the other two parts give.

   Model FLOPs per token of a training step, 2 FLOPs per multiply-add of each weight matrix a token passes
   (elementwise work not counted):
       F = 4·N_S + 2·N_train + 3·A_S + (2·N_T + A_T)
   N_S: the student weights the stage's loss runs through (align: the attention blocks of every layer, fed the
   teacher's layer inputs; distil and long: every layer and the output head), N_train ⊆ N_S: those the stage
   trains (align: the GDN weights), A_S: the student's attention FLOPs; forward 2·N_S + A_S, backward 2·N_S + 2·A_S
   (activation gradients through every weight of N_S: an upper bound in align, whose inputs need none) plus
   2·N_train (weight gradients). 2·N_T + A_T: the teacher's forward where the loss reads it (align: its layers;
   distil: its layers and output head; long: only with kl_weight > 0). A layer's GDN weights count at the fraction
   of its heads that are LA. Attention per token and head at T tokens: FA (causal) 2·T·D (q·kᵀ and p·v over T/2
   keys on average, as the kernel parts count it); LA, the chunked gated delta rule at chunk C:
   ``gdn_flops_fwd`` / T (the matmuls listed in bench/gpu_check_gated_delta.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# This process only watches its runs; a GPU it touches must not be preallocated away from them.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
from _gpu_check import Budget, Report, first_line, run_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STAGE_DIRS = ("stage1_align", "stage2_distil", "stage3_long")
STAGE_KEYS = ("stage1", "stage2", "stage3")
NAMES = ("loss", "grad_norm")
STEPS = {"full": 8, "quick": 5, "dry-run": 3}
MODELS = {"full": ("tiny", "reproduction"), "quick": ("tiny",), "dry-run": ("tiny",)}
TIMED_FROM_STEP = 3
F32_STEP_LIMIT = 1e-4
# Dense (no sparsity) bf16 peaks of the datasheets, by the first name found in JAX's device kind.
PEAK_BF16 = (("H200", 989.4e12), ("H100 PCIe", 756e12), ("H100", 989.4e12), ("A100", 312e12))
REPRODUCTION_TEACHER = ROOT / "bench" / "results" / "reproduction" / "teacher" / "hf"
REPRODUCTION_ARM = "layer_3to1"
MQAR_DOCS = 64  # 32K tokens of the study's MQAR rows: the data windows of a few steps, and a valid split
GPU_HOST_CORES = 4  # of a GPU machine's cores, kept for the device run's process; the CPU runs share the others
TINY_GPU = {
    "teacher.model.vocab_size": 1024,
    "teacher.model.hidden_size": 256,
    "teacher.model.intermediate_size": 768,
    "teacher.model.num_layers": 4,
    "teacher.model.num_heads": 4,
    "teacher.model.num_kv_heads": 2,
    "teacher.model.head_dim": 64,
    "hybrid.gdn_chunk_size": 64,
    **{f"{k}.{f}": v for k in ("stage1", "stage2") for f, v in (("seq_len", 512), ("batch_size", 4))},
    **{"stage3.seq_len": 1024, "stage3.batch_size": 2},
    **{f"{k}.loss_chunk": 256 for k in STAGE_KEYS},
}
# The reproduction's rows in the dry run: the study's 8 x 512-token rows would cost minutes in interpret mode.
REPRODUCTION_DRY = {
    f"{k}.{f}": v for k in STAGE_KEYS for f, v in (("seq_len", 64), ("batch_size", 2), ("loss_chunk", 64))
}


@dataclasses.dataclass(frozen=True)
class RunKind:
    """One run of a model: the platform it runs on, its compute dtype and the two kernels' implementations."""

    platform: str  # "gpu" or "cpu"
    dtype: str
    attention: str
    gdn: str


RUNS = {
    "gpu": {
        "device": RunKind("gpu", "bfloat16", "cudnn", "pallas"),
        "oracle": RunKind("cpu", "float32", "xla", "xla"),
        "baseline": RunKind("cpu", "bfloat16", "xla", "xla"),
    },
    "dry-run": {
        "device": RunKind("cpu", "float32", "pallas", "pallas"),
        "oracle": RunKind("cpu", "float32", "xla", "xla"),
    },
}


# ---------------------------------------------------------------------------------------------- recipes
def set_keys(recipe: dict, values: dict) -> dict:
    """Set dotted keys ("stage1.steps") of a nested recipe dict in place; returns it."""
    for dotted, value in values.items():
        *path, last = dotted.split(".")
        section = recipe
        for key in path:
            section = section[key]
        section[last] = value
    return recipe


def common_settings(steps: int) -> dict:
    """What every run of this check sets: its step count, one checkpoint (the stage's last: a save between timed
    steps would be timed), no held-out evaluation (another compile), no TensorBoard or progress bar, and one
    causal sequence per row (module doc: cuDNN takes no segment ids)."""
    per_stage = {f"{k}.{f}": v for k in STAGE_KEYS for f, v in (("steps", steps), ("checkpoint_every", steps))}
    per_stage.update({f"{k}.heldout_rows": 0 for k in STAGE_KEYS})
    return {**per_stage, "logging.tensorboard": False, "logging.progress": False, "data.mask_documents": False}


def tiny_recipe(mode: str, work: Path) -> dict:
    from configs.tiny import get_config

    recipe = get_config().to_dict()
    return set_keys(recipe, {} if mode == "dry-run" else TINY_GPU)


def reproduction_recipe(mode: str, work: Path) -> dict:
    """The arm's recipe of the study (module doc) on MQAR documents written into ``work``."""
    from hydrahead_jax.experiments.reproduce import ARMS, Study, base_recipe

    study = Study()
    corpus = write_mqar_corpus(study, work / "mqar.jsonl")
    recipe = base_recipe(study, {"corpus": corpus, "heldout": corpus}, REPRODUCTION_TEACHER, seed=0)
    set_keys(recipe, ARMS[REPRODUCTION_ARM])
    return set_keys(recipe, REPRODUCTION_DRY if mode == "dry-run" else {})


def write_mqar_corpus(study, path: Path) -> Path:
    """``MQAR_DOCS`` MQAR rows of the study's length and pair range, as text in the teacher's vocabulary."""
    from hydrahead_jax.data.mqar import mqar_example, text
    from hydrahead_jax.experiments.small_teacher import load_folder_tokenizer

    tokenizer = load_folder_tokenizer(REPRODUCTION_TEACHER)
    symbols = study.teacher.symbols.ids(tokenizer)
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(MQAR_DOCS):
        pairs = int(rng.integers(1, study.teacher.max_pairs + 1))
        ids = mqar_example(rng, symbols, num_pairs=pairs, length=study.seq_len).ids
        lines.append(json.dumps({"text": text(ids, tokenizer)}) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


RECIPES = {"tiny": tiny_recipe, "reproduction": reproduction_recipe}


def run_recipe(recipe: dict, kind: RunKind, steps: int) -> dict:
    """A copy of ``recipe`` for one run: its dtype and implementations, and ``common_settings``. The dtype: a random
    teacher's compute dtype, its parameters kept float32 (random draws in bfloat16 would make another teacher, not
    a rounded one); a checkpoint's loader casts the stored weights to it."""
    recipe = json.loads(json.dumps(recipe))
    if recipe["teacher"]["source"] == "random":
        set_keys(recipe, {"teacher.model.dtype": kind.dtype})
    else:
        set_keys(recipe, {"teacher.dtype": kind.dtype})
    implementations = {"hybrid.attention_implementation": kind.attention, "hybrid.gdn_implementation": kind.gdn}
    return set_keys(recipe, {**implementations, **common_settings(steps)})


# ---------------------------------------------------------------------------------------------- the runs
@dataclasses.dataclass
class Job:
    """One pipeline run in its own process; ``folder`` holds recipe.json, workdir/, cache/ and log.txt."""

    model: str
    run: str
    kind: RunKind
    folder: Path
    lane: str  # runs of a lane share its cores; the "gpu" lane runs one at a time
    dry_run: bool = False
    proc: subprocess.Popen | None = None
    rc: int | None = None
    why_not: str = ""  # set when the run was not started or was stopped for time
    started: float = 0.0
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.model}/{self.run}"

    @property
    def workdir(self) -> Path:
        return self.folder / "workdir"

    def log_tail(self, lines: int = 1) -> str:
        path = self.folder / "log.txt"
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
        return " | ".join(text[-lines:])[-400:] or "(no output)"


def launch(job: Job, cores: set[int] | None) -> None:
    """Start ``job``'s worker: the CPU forced with JAX_PLATFORMS=cpu, its own cache folder (corpus store and
    compilation cache: processes side by side never share an entry), pinned to ``cores`` when given."""
    env = dict(os.environ, HYDRAHEAD_CACHE=str(job.folder / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    # One device each, as the GPU run has: a test suite's forced host devices would split the CPU runs' batches.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    if job.kind.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    if job.dry_run:  # compiling is most of a dry run's time; both runs compared compile alike
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    command = [
        sys.executable,
        __file__,
        "--worker",
        str(job.folder / "recipe.json"),
        str(job.workdir),
        job.kind.platform,
    ]
    with open(job.folder / "log.txt", "w") as log:
        job.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )
    job.started = time.time()
    print(
        f"  started {job.name} ({job.kind.platform}, {job.kind.dtype}, attention {job.kind.attention}, gdn "
        f"{job.kind.gdn})",
        flush=True,
    )


def stop(job: Job, why: str) -> None:
    """Kill ``job``'s process group (the worker and anything it started)."""
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.proc.wait()
    job.rc, job.why_not, job.seconds = job.proc.returncode, why, time.time() - job.started


def lanes_for(on_gpu: bool) -> dict[str, tuple[int, set[int] | None]]:
    """{lane: (runs at a time, cores or None)}. A GPU machine: the device runs one at a time on the first
    ``GPU_HOST_CORES`` cores, the CPU runs all at once on the rest; the dry run: as many runs as cores, unpinned."""
    cores = sorted(os.sched_getaffinity(0))
    if not on_gpu:
        return {"cpu": (max(1, len(cores)), None)}
    host = GPU_HOST_CORES if len(cores) > 2 * GPU_HOST_CORES else max(1, len(cores) // 4)
    return {"gpu": (1, set(cores[:host])), "cpu": (1 << 10, set(cores[host:]))}


def run_jobs(jobs: list[Job], budget: Budget, lanes: dict) -> None:
    """Start each job in order once its lane has room and the budget allows a run as long as the lane's longest
    so far; wait; stop what is still running at the deadline, or when this process is stopped (the workers run
    in sessions of their own: nothing else would end them)."""
    pending, running = list(jobs), []
    try:
        _schedule(jobs, pending, running, budget, lanes)
    finally:
        for job in running:
            if job.proc.poll() is None:
                stop(job, "stopped with the check")


def _schedule(jobs: list[Job], pending: list[Job], running: list[Job], budget: Budget, lanes: dict) -> None:
    while pending or running:
        for job in list(pending):
            width, cores = lanes[job.lane]
            if sum(j.lane == job.lane for j in running) >= width:
                continue
            longest = max([j.seconds for j in jobs if j.lane == job.lane and j.rc is not None] + [0.0])
            pending.remove(job)
            if not budget.allows(1.2 * longest):
                job.why_not = f"time budget ({budget.left():.0f} s left, ~{1.2 * longest:.0f} s needed)"
                continue
            launch(job, cores)
            running.append(job)
        time.sleep(0.2)
        for job in list(running):
            if job.proc.poll() is not None:
                job.rc, job.seconds = job.proc.returncode, time.time() - job.started
                running.remove(job)
                print(f"  finished {job.name} in {job.seconds:.0f} s (exit {job.rc})", flush=True)
            elif budget.left() <= 0:
                stop(job, f"stopped at the time budget after {time.time() - job.started:.0f} s")
                running.remove(job)


def worker(recipe_path: str, workdir: str, platform: str) -> int:
    """One run: the recipe converted as train.py converts it (RunConfig.from_recipe), then ``run_pipeline``."""
    import jax

    from hydrahead_jax.compilation import use_persistent_cache
    from hydrahead_jax.run_config import RunConfig
    from hydrahead_jax.training.pipeline import run_pipeline

    if jax.default_backend() != platform:
        raise SystemExit(f"this run needs the {platform}, JAX sees {jax.devices()}")
    run = RunConfig.from_recipe(json.loads(Path(recipe_path).read_text()))
    use_persistent_cache()
    dev = jax.devices()[0]
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / "device.json").write_text(json.dumps(dict(platform=dev.platform, kind=dev.device_kind)))
    run_pipeline(run, workdir)
    return 0


# ---------------------------------------------------------------------------------------------- reading a run
def step_rows(workdir: Path) -> dict[str, list[dict]]:
    """{stage directory: its training rows of metrics.jsonl, by step} (held-out rows left out)."""
    rows: dict[str, list[dict]] = {s: [] for s in STAGE_DIRS}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") is None and row["stage"] in rows:
            rows[row["stage"]].append(row)
    return {s: sorted(r, key=lambda row: row["step"]) for s, r in rows.items()}


def curves(rows: list[dict], steps: int) -> list[np.ndarray]:
    """(loss, grad_norm) over steps 1 … steps; a ValueError when the run logged other steps."""
    logged = [r["step"] for r in rows]
    if logged != list(range(1, steps + 1)):
        raise ValueError(f"metrics.jsonl has steps {logged}, expected 1 … {steps}")
    return [np.array([r[name] for r in rows], np.float64) for name in NAMES]


# ---------------------------------------------------------------------------------------------- model FLOPs
WEIGHT_NAMES = ("kernel", "conv_weight")  # matrices (and the depthwise conv) a token is multiplied by


@dataclasses.dataclass(frozen=True)
class FlopModel:
    """What the FLOP count (module doc) reads of an exported student: its shapes, FA heads per layer and the
    weight matrices (names along their path → element count, layers stacked)."""

    cfg: object  # ModelConfig
    fa_heads: tuple[int, ...]
    chunk: int
    weights: dict[tuple[str, ...], int]

    @property
    def la_fraction(self) -> float:
        """The mean over layers of the share of LA heads (a stacked GDN weight counts at this share)."""
        heads = self.cfg.num_heads
        return sum(heads - f for f in self.fa_heads) / (heads * len(self.fa_heads))

    def is_head(self, names: tuple[str, ...]) -> bool:
        tied = self.cfg.tie_word_embeddings
        return names == ("lm_head", "kernel") or (tied and names == ("embed_tokens", "embedding"))

    def weight_flops(self, part: str, names_set=None, la_fraction: float | None = None) -> float:
        """2·N of the weights in ``part`` ("attention": the layers' attention blocks; "layers"; "all": layers and
        output head), restricted to ``names_set`` when given; GDN weights at ``la_fraction``."""
        share = self.la_fraction if la_fraction is None else la_fraction
        total = 0.0
        for names, size in self.weights.items():
            if names_set is not None and names not in names_set:
                continue
            if names[0] == "layers" and (part != "attention" or "self_attn" in names):
                total += size * (share if "gdn" in names else 1.0)
            elif part == "all" and self.is_head(names):
                total += size
        return 2 * total

    def attention_flops(self, t: int, teacher: bool = False) -> float:
        """A per token at T = t tokens (module doc); the teacher's heads are all FA."""
        from gpu_check_gated_delta import gdn_flops_fwd

        d, heads = self.cfg.head_dim, self.cfg.num_heads * self.cfg.num_layers
        fa = heads if teacher else sum(self.fa_heads)
        return fa * 2 * t * d + (heads - fa) * gdn_flops_fwd(1, t, 1, d, d, self.chunk) / t


def flop_model(workdir: Path):
    """(the FLOP model, the resolved config, the abstract student) of a finished run's export (workdir/final)."""
    import jax
    from flax import nnx

    from hydrahead_jax.config import ModelConfig
    from hydrahead_jax.hybrid import HeadMap, build_model
    from hydrahead_jax.hybrid.build import path_names
    from hydrahead_jax.hybrid.config import HybridConfig

    final = workdir / "final"
    cfg = ModelConfig.from_dict(json.loads((final / "model_config.json").read_text()))
    head_map = HeadMap.load(final / "head_map.json", cfg)
    hybrid = HybridConfig.from_dict(json.loads((final / "hybrid_config.json").read_text()))
    model = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid, nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    weights = {path_names(p): math.prod(x.shape) for p, x in leaves}
    group = cfg.num_heads // cfg.num_kv_heads
    fa_heads = tuple(group * n for n in head_map.fa_counts())
    resolved = json.loads((workdir / "run_config.json").read_text())["config"]
    fm = FlopModel(cfg, fa_heads, hybrid.gdn_chunk_size, {n: s for n, s in weights.items() if is_weight(n)})
    return fm, resolved, model


def is_weight(names: tuple[str, ...]) -> bool:
    return names[-1] in WEIGHT_NAMES or names == ("embed_tokens", "embedding")


def trained_names(model, stage_cfg: dict) -> set[tuple[str, ...]]:
    """The paths of the parameters the stage trains (its ``train`` filter and lr scales, as the pipeline's)."""
    import jax
    from flax import nnx

    from hydrahead_jax.hybrid.build import path_names, trainable_filter

    scales = {g: stage_cfg[f"lr_scale_{g}"] for g in ("new", "attention", "other")}
    state = nnx.state(model, trainable_filter(stage_cfg["train"], scales))
    return {path_names(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}


def stage_flops(fm: FlopModel, loss: str, stage_cfg: dict, trained: set) -> float:
    """F per token of one training step of a stage (module doc)."""
    t = stage_cfg["seq_len"]
    part = "attention" if loss == "align" else "all"
    student = 2 * fm.weight_flops(part) + fm.weight_flops(part, trained) + 3 * fm.attention_flops(t)
    teacher_part = {"align": "layers", "distil": "all"}.get(loss, "all" if stage_cfg["kl_weight"] > 0 else None)
    if teacher_part is None:
        return student
    return student + fm.weight_flops(teacher_part, la_fraction=0.0) + fm.attention_flops(t, teacher=True)


def peak_flops(device_kind: str) -> float | None:
    return next((peak for name, peak in PEAK_BF16 if name in device_kind), None)


# ---------------------------------------------------------------------------------------------- the report
def compare(report: Report, job_of: dict[str, Job], model: str, steps: int) -> None:
    """One check row per stage: the device run's curves against the oracle's (module doc, 3)."""
    device, oracle, baseline = (job_of.get(f"{model}/{r}") for r in ("device", "oracle", "baseline"))
    dtype = device.kind.dtype
    runs = [j for j in (device, oracle, baseline) if j is not None]
    missing = [j for j in runs if j.rc is None or j.why_not]
    failed = [j for j in runs if j.rc not in (0, None) and not j.why_not]
    unseen = interpret_unseen(device) if device.rc == 0 else []
    for stage in STAGE_DIRS:
        case = f"{model} {stage}"
        if unseen:
            report.check_error(case, dtype, RuntimeError(f"the device run did not run the Pallas {unseen}"))
            continue
        if failed:
            why = "; ".join(f"{j.name} exited {j.rc}: {j.log_tail()}" for j in failed)
            report.check_error(case, dtype, RuntimeError(why))
            continue
        if missing:
            report.check_skipped(case, dtype, "; ".join(f"{j.name}: {j.why_not or 'not finished'}" for j in missing))
            continue
        try:
            got, want = (curves(step_rows(j.workdir)[stage], steps) for j in (device, oracle))
            base = None if baseline is None else curves(step_rows(baseline.workdir)[stage], steps)
            report.check(case, dtype, NAMES, got, want, base, f32_limit=F32_STEP_LIMIT)
        except Exception as e:  # a run that finished without its metrics: a failed check, the others go on
            report.check_error(case, dtype, e)


def interpret_unseen(device: Job) -> list[str]:
    """The ops a CPU device run asked to run as Pallas but whose interpret-mode warning (pallas_kernels.dispatch,
    once per op and process) its log lacks: the evidence, off a GPU, that the switches reached the kernels."""
    if device.kind.platform != "cpu":
        return []  # a GPU run names its kernels: neither falls back (module doc)
    log = (device.folder / "log.txt").read_text(errors="replace")
    ops = [("flash_attention", device.kind.attention), ("chunk_gated_delta_rule", device.kind.gdn)]
    return [op for op, impl in ops if impl == "pallas" and f"{op}: implementation='pallas_gpu' on cpu" not in log]


def speed_rows(report: Report, device: Job, model: str) -> None:
    """tokens/s, model FLOPs per token and MFU per stage of a finished device run (module doc, 4)."""
    from hydrahead_jax.run_config import STAGES

    fm, resolved, student = flop_model(device.workdir)
    kind = json.loads((device.workdir / "device.json").read_text())["kind"]
    peak = peak_flops(kind) if device.kind.platform == "gpu" else None
    rows = step_rows(device.workdir)
    for stage in STAGES:
        cfg = resolved[stage.config_key]
        times = [r["step_time_s"] for r in rows[stage.directory] if r["step"] >= TIMED_FROM_STEP]
        step_s = float(np.median(times))
        tokens_per_s = cfg["batch_size"] * cfg["seq_len"] / step_s
        flops = stage_flops(fm, stage.loss, cfg, trained_names(student, cfg))
        report.bench_row(
            model=model,
            stage=stage.directory,
            B=cfg["batch_size"],
            T=cfg["seq_len"],
            dtype=device.kind.dtype,
            ms=1e3 * step_s,
            tokens_per_s=tokens_per_s,
            flops_per_token=flops,
            tflops=flops * tokens_per_s / 1e12,
            mfu=None if peak is None else flops * tokens_per_s / peak,
            first_step_s=rows[stage.directory][0]["step_time_s"],
            steps_timed=len(times),
        )
    fa = ",".join(str(h // (fm.cfg.num_heads // fm.cfg.num_kv_heads)) for h in fm.fa_heads)
    report.info[f"{model} FA groups per layer"] = f"[{fa}] of {fm.cfg.num_kv_heads}"
    if peak is None:
        report.note(f"{model}: MFU n/a: no bf16 peak is known for {kind!r} ({device.kind.platform})")


def plan(mode: str, on_gpu: bool, work: Path) -> list[Job]:
    """Every run, each with its recipe written, model by model (the order they start in, lane by lane)."""
    steps, kinds = STEPS[mode], RUNS["gpu" if on_gpu else "dry-run"]
    jobs = []
    for model in MODELS[mode]:
        recipe = RECIPES[model](mode, work / model)
        for run, kind in kinds.items():
            folder = work / model / run
            folder.mkdir(parents=True)
            (folder / "recipe.json").write_text(json.dumps(run_recipe(recipe, kind, steps), indent=1))
            lane = "gpu" if on_gpu and kind.platform == "gpu" else "cpu"
            jobs.append(Job(model, run, kind, folder, lane, dry_run=mode == "dry-run"))
    return jobs


def preflight(report: Report) -> None:
    """The pipeline's imports, refused in one line naming the fix (a GPU machine's own Python lacks some)."""
    from importlib.metadata import version

    try:
        import configs.tiny  # noqa: F401
        import hydrahead_jax.training.pipeline  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"this Python cannot import the training pipeline ({e}): install the project's dependencies, or on a "
            "machine without a package registry carry the wheels of `bash bench/gpu_check.sh --fetch-wheels` "
            "(.venv-gpu/wheels) and run with --no-install"
        ) from None
    report.info.update({name: version(name) for name in ("flax", "optax", "orbax-checkpoint", "grain")})


def steps(report: Report, budget: Budget, mode: str, on_gpu: bool) -> None:
    preflight(report)
    report.info["steps per stage"] = STEPS[mode]
    with tempfile.TemporaryDirectory(prefix="gpu_check_end_to_end-") as tmp:
        jobs = plan(mode, on_gpu, Path(tmp))
        print(f"{len(jobs)} runs in {tmp}", flush=True)
        run_jobs(jobs, budget, lanes_for(on_gpu))
        job_of = {j.name: j for j in jobs}
        for model in MODELS[mode]:
            compare(report, job_of, model, STEPS[mode])
            device = job_of[f"{model}/device"]
            if device.rc == 0 and not device.why_not:
                try:
                    speed_rows(report, device, model)
                except Exception as e:  # the speed rows are informative: their loss is noted, not a failed check
                    report.note(f"{model}: speed rows not written: {first_line(e)}")
            report.note(f"{model}: " + ", ".join(f"{j.run} {j.seconds:.0f} s" for j in jobs if j.model == model))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(*argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # gpu_check.sh's timeout: unwind, stopping the workers
    return run_script("end_to_end", __doc__.splitlines()[0], argv, steps, table="end_to_end")


if __name__ == "__main__":
    sys.exit(main())

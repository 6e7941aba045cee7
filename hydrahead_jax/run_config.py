"""The typed run configuration and the table of stages.

A recipe (``configs/*.py``: an ml_collections ConfigDict, with ``--config.a.b=value`` overrides) is converted
ONCE, at the edge (``train.py``), by ``RunConfig.from_recipe`` into the frozen dataclasses below. Everything below
the edge reads typed fields; every default lives here (the recipes' skeleton, ``recipe_defaults()``, is built from
these classes), and every check that needs no model runs during the conversion, so a bad key or value is refused
before any work, with the key and the fix in the message. Checks that need the teacher (its vocabulary, context
length, KV groups) run in the pipeline right after the teacher loads, still before selection and stage 1.

The stage table ``STAGES`` is the one list of the training stages: their CLI name, config key, checkpoint
directory, loss and default trainable parameters. train.py, the pipeline, the train step and the evaluation (which
reads an export's train_config.json by it) all use it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any

from hydrahead_jax.config import DTYPE_NAMES, ConfigError, ModelConfig, parse_rope_extension
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.selection.select import METHODS, SelectionConfig, SelectionError, validate_config

# ------------------------------------------------------------------------------------------------ stage table


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage. ``loss`` names the objective ``training.steps.compute_loss`` computes;
    ``default_train`` the parameters it trains unless ``config.<key>.train`` says otherwise
    ('new': the GDN heads and fusion scales only; 'all': every student parameter)."""

    name: str  # --only_stage / --until_stage
    config_key: str  # the recipe's section
    directory: str  # under the workdir
    loss: str
    default_train: str


STAGES = (
    Stage("align", "stage1", "stage1_align", loss="align", default_train="new"),
    Stage("distil", "stage2", "stage2_distil", loss="distil", default_train="all"),
    Stage("long", "stage3", "stage3_long", loss="long", default_train="all"),
)
SELECT = "select"  # stage 0: the head map
STAGE_NAMES = (SELECT,) + tuple(s.name for s in STAGES)
TRAIN_CHOICES = ("new", "all", "new+la_qkv", "new+la_qkvo")  # hybrid.build.TRAIN_FILTERS
ALIGN_TARGETS = ("layer", "heads")  # StageConfig.align_target: the align stage's per-layer or per-head targets
SYNTHETIC_LOSSES = ("answer", "full")  # data.mixture.synthetic_row's loss choices
MASTER_DTYPES = ("float32", "param")
LOCAL_SELECTION_METHODS = ("given", "all_fa", "all_la")  # head maps the pipeline makes without probing
PROBE_METHODS = ("retrieval", "ablation", "combined")  # need the teacher's tokenizer


def stage_by_key(config_key: str) -> Stage:
    return next(s for s in STAGES if s.config_key == config_key)


# ------------------------------------------------------------------------------------------------ sections


class _FieldError(ConfigError):
    """A bad value of one field; ``from_recipe`` re-words it with the full key (config.stage2.lr)."""

    def __init__(self, section: str, field: str, value: Any, rule: str, fix: str):
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        super().__init__(f"{section}.{field}={value!r}: {rule}. Fix: {fix}.")


def _require(ok: bool, section: str, field: str, value: Any, rule: str, fix: str) -> None:
    if not ok:
        raise _FieldError(section, field, value, rule, fix)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes (data, fsdp, sequence, tensor); one of them may be -1: every device the others leave.

    ``sequence`` > 1 is context parallelism: each row's tokens are split over that many devices (the sequence
    length must then be a multiple of 2 × sequence: the load-balanced zig-zag order gives every device two chunks).
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1

    def __post_init__(self):
        for name in ("data", "fsdp", "tensor", "sequence"):
            value = getattr(self, name)
            _require(value == -1 or value >= 1, "mesh", name, value, "must be -1 (fill) or >= 1", "1")
        _require(self.sizes.count(-1) <= 1, "mesh", "data", self.data, "only one mesh axis may be -1 (fill)", "-1")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.data, self.fsdp, self.tensor, self.sequence)

    def check_devices(self, num_devices: int) -> None:
        """Refuse, in one line, a mesh this machine cannot build (before the teacher is loaded)."""
        fixed = math.prod(s for s in self.sizes if s != -1)
        fill = -1 in self.sizes
        if (num_devices % fixed) if fill else (num_devices != fixed):
            shape = f"data={self.data} x fsdp={self.fsdp} x tensor={self.tensor}"
            shape += f" x sequence={self.sequence}" if self.sequence != 1 else ""
            raise ConfigError(
                f"config.mesh ({shape}) needs {'a multiple of ' if fill else ''}{fixed} devices, but "
                f"{num_devices} are visible. Fix: on this machine pass --config.mesh.fsdp=1 --config.mesh.tensor=1 "
                "--config.mesh.sequence=1 (or sizes whose product divides the device count); the recipe's mesh is "
                "meant for its cluster."
            )


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """``source``: "random" (``model`` gives the shapes), "smollm2-135m", a .gguf file or a Hugging Face folder."""

    source: str = "random"
    dtype: str = "float32"
    seed: int = 0
    model: ModelConfig | None = None  # only for source="random"

    def __post_init__(self):
        _require(bool(self.source), "teacher", "source", self.source, "is empty", "name a checkpoint or 'random'")
        _require(self.dtype in DTYPE_NAMES, "teacher", "dtype", self.dtype, f"choose one of {DTYPE_NAMES}", "float32")
        if self.source == "random":
            _require(
                self.model is not None,
                "teacher",
                "model",
                None,
                "a random teacher needs its shapes",
                "set teacher.model.{vocab_size,hidden_size,...} as configs/tiny.py does",
            )
        else:
            _require(
                self.model is None,
                "teacher",
                "model",
                "<set>",
                f"the shapes of {self.source!r} come from the checkpoint",
                "leave teacher.model empty (it is only for source='random')",
            )


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One weighted corpus source: ``path`` as ``data.source`` names a corpus ("enwiki", a file, folder, glob or
    gs:// URL, or a prepared token store's folder), its ``weight`` in the mixture (relative to the stage's other
    sources), and ``min_doc_tokens``: only documents of at least that many tokens are read from it (0: all)."""

    path: str
    weight: float = 1.0
    min_doc_tokens: int = 0

    def __post_init__(self):
        where = "sources[]"
        _require(bool(self.path), where, "path", self.path, "is empty", "name a corpus path")
        _require(self.path != "copy", where, "path", self.path, "'copy' is no corpus to mix", "a corpus path")
        _require(
            math.isfinite(self.weight) and self.weight > 0,
            where,
            "weight",
            self.weight,
            "must be finite and > 0",
            "give the source a weight > 0, e.g. 1.0",
        )
        _require(
            self.min_doc_tokens >= 0,
            where,
            "min_doc_tokens",
            self.min_doc_tokens,
            "must be >= 0",
            "0 (every document) or a positive token count",
        )


SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(SourceSpec))


def parse_sources(key: str, value: Any) -> tuple[SourceSpec, ...]:
    """A recipe's sources list (dicts {path, weight?, min_doc_tokens?}, or bare path strings: weight 1) as
    SourceSpecs; a bad entry is refused naming ``key``, the entry and the fix."""
    if isinstance(value, (str, Mapping)) or not isinstance(value, (list, tuple)):
        value = (value,)
    out = []
    for i, item in enumerate(value):
        entry = _as_dict(item) if not isinstance(item, str) else {"path": item}
        where = f"{key}[{i}]"
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown or "path" not in entry:
            raise ConfigError(
                f"{where}={entry!r}: a source is {{'path': ..., 'weight': ..., 'min_doc_tokens': ...}} (path "
                f"required{'; unknown ' + str(unknown) if unknown else ''}). Fix: --{key}=\"({{'path': '/data/a', "
                "'weight': 1.0},)\"."
            )
        hints = typing.get_type_hints(SourceSpec)
        values = {k: _coerce(where, k, v, hints[k]) for k, v in entry.items()}
        try:
            out.append(SourceSpec(**values))
        except _FieldError as err:
            raise ConfigError(_reword(where, err)) from None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """``source``: "copy" (seeded copy rows, no tokenizer), "enwiki", or a corpus: files (.txt/.md, .jsonl, .jsonl.gz,
    .jsonl.zst, .parquet, .arrow), a folder, a glob or gs:// URL of them, or a prepared token store's folder.
    ``sources``: weighted corpus sources ({path, weight, min_doc_tokens}; ``SourceSpec``) read instead of
    ``source`` by every stage that names none of its own (``StageConfig.sources``)."""

    source: str = "enwiki"
    sources: tuple[SourceSpec, ...] = ()
    validation_fraction: float = 0.02
    txt_split: str = "file"  # .txt files: "file" = one document per file, "paragraphs" = one per paragraph
    text_field: str = "text"  # .jsonl / .parquet column
    num_threads: int = 2  # grain reader threads (does not change the data or its order)
    prefetch: int = 8  # batches read ahead (does not change the data or its order)
    copy_repeats: int = 4  # "copy" source: repeats of each row's random block
    # worker processes (one core each) that tokenise a missing store on each host (data.preparation)
    prepare_workers: int = 1
    # where train.py keeps prepared stores, by identity ("": $HYDRAHEAD_CACHE/corpora); a multi-host run needs a
    # folder every host sees (gs://BUCKET/stores): the hosts share the tokenising
    store_root: str = ""
    # Rows pack several documents. True: the model runs each on its own (attention within the document, the
    # linear-attention state and conv restart at its start, RoPE at per-document positions); False: a row is one
    # causal sequence at positions 0 … T−1 (the behaviour before packed documents were masked). The loss never
    # counts a target from the next document either way.
    mask_documents: bool = True

    def __post_init__(self):
        _require(bool(self.source), "data", "source", self.source, "is empty", "use 'enwiki' or a corpus path")
        _require(
            0.0 <= self.validation_fraction < 1.0,
            "data",
            "validation_fraction",
            self.validation_fraction,
            "must be in [0, 1)",
            "0.02",
        )
        _require(
            self.txt_split in ("file", "paragraphs"),
            "data",
            "txt_split",
            self.txt_split,
            "choose file or paragraphs",
            "file",
        )
        _require(self.num_threads >= 1, "data", "num_threads", self.num_threads, "must be >= 1", "2")
        _require(self.prefetch >= 1, "data", "prefetch", self.prefetch, "must be >= 1", "8")
        _require(self.copy_repeats >= 1, "data", "copy_repeats", self.copy_repeats, "must be >= 1", "4")
        _require(self.prepare_workers >= 1, "data", "prepare_workers", self.prepare_workers, "must be >= 1", "1")


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One training stage: budget (``steps``, or ``tokens`` when steps == 0), data shape, AdamW with a linear
    warmup and a cosine decay to lr·end_lr_ratio, the parameters it trains (``train``: "new" the GDN and fusion
    parameters, "all" every parameter, "new+la_qkv" / "new+la_qkvo" the new ones plus the LA groups' slices of the
    copied q/k/v (and o) projections, the FA groups' slices kept the teacher's; ``Stage`` has the defaults), loss
    weights, checkpoint interval, and ``remat``: recompute each student layer in the backward pass (keeps one
    layer's activations instead of all of them, for about one more forward pass of compute). Memory:
    ``micro_batches`` accumulates the f32 gradient over that many row groups per step (the same loss and gradient as
    the whole batch); the logits loss works on tiles of ``loss_chunk_rows`` rows (0: all rows of a micro-batch) ×
    ``loss_chunk`` tokens. ``master_dtype``: "float32" trains f32 master parameters and AdamW moments while the
    model computes in its own dtype; "param" keeps them in the model's parameter dtype. Held-out evaluation:
    ``heldout_rows`` fixed rows of the corpus validation split (0: none) are evaluated before the first update,
    every ``heldout_every`` steps (0: only at the start and the end) and after the last step."""

    train: str  # no default here: the stage table's default_train (configs/common.py fills it in)
    steps: int = 0
    tokens: int = 0
    seq_len: int = 256
    batch_size: int = 8  # global rows per step
    lr: float = 1e-3
    warmup_steps: int = 10
    warmup_fraction: float = 0.0  # > 0: warm-up over this fraction of the stage's steps (replaces warmup_steps)
    warmup_start_ratio: float = 0.0  # the warm-up starts at lr · this (0: at lr 0)
    end_lr_ratio: float = 0.1
    # learning rate of each parameter group = lr · its scale (``training.steps.PARAM_GROUPS``): the new GDN/fusion
    # parameters, the copied attention weights, everything else; a group whose scale is 0 is frozen (not trained).
    lr_scale_new: float = 1.0
    lr_scale_attention: float = 1.0
    lr_scale_other: float = 1.0
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 = no clipping
    loss_chunk: int = 512  # tokens per chunk of the logits losses
    loss_chunk_rows: int = 0  # rows per device in one logits tile; 0 = all rows of a micro-batch
    micro_batches: int = 1  # gradient accumulation: row groups per step
    master_dtype: str = "float32"  # "float32" (f32 master weights + AdamW moments) or "param"
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # confirmed checkpoints kept, plus the newest while its next step's loss is read
    synthetic_rate: float = 0.0  # fraction of synthetic retrieval rows (corpus sources only)
    # this stage's weighted corpus sources (SourceSpec); empty: data.sources, or data.source alone
    sources: tuple[SourceSpec, ...] = ()
    # where a synthetic row carries loss: "answer" (its answer tokens) or "full" (every token of the row: stage 2's KL
    # to the teacher, stage 3's KL/CE, over the haystack, needle and question too)
    synthetic_loss: str = "answer"
    kl_weight: float = 0.0  # long stage: + kl_weight · KL(teacher ‖ student)
    ce_weight: float = 0.0  # next-token cross-entropy weight (the long stage needs it or kl_weight > 0)
    temperature: float = 1.0  # of the KL
    remat: bool = False
    # align stage: what each layer is held to: "layer" (its attention output, after o_proj) or "heads" (each head's
    # output before o_proj against its teacher head's: training.losses.align_loss)
    align_target: str = "layer"
    heldout_rows: int = 4  # rows of the fixed held-out batch (at the stage's seq_len); 0 = no held-out evaluation
    heldout_every: int = 0  # held-out evaluation every this many steps, besides step 0 and the last step
    # long stage: a RoPE scaling for the student's FA heads from this stage on, carried into the export:
    # "TYPE:FACTOR[:ORIGINAL_LENGTH]", e.g. "yarn:4" (config.with_rope_extension); "" keeps the teacher's RoPE
    rope_scaling: str = ""

    def __post_init__(self):
        s = "stage"
        if self.rope_scaling:
            try:
                parse_rope_extension(self.rope_scaling)
            except ConfigError as err:
                raise _FieldError(s, "rope_scaling", self.rope_scaling, str(err), "yarn:4") from None
        _require(self.train in TRAIN_CHOICES, s, "train", self.train, f"choose one of {TRAIN_CHOICES}", "all")
        _require(self.steps >= 0, s, "steps", self.steps, "must be >= 0", "a step count, or 0 to use tokens")
        _require(self.tokens >= 0, s, "tokens", self.tokens, "must be >= 0", "a token budget, or 0 to use steps")
        _require(
            self.steps > 0 or self.tokens > 0, s, "steps", self.steps, "a stage needs steps > 0 or tokens > 0", "100"
        )
        for name in ("seq_len", "batch_size", "loss_chunk", "checkpoint_every", "keep_checkpoints"):
            _require(getattr(self, name) >= 1, s, name, getattr(self, name), "must be >= 1", "a positive integer")
        _require(math.isfinite(self.lr) and self.lr > 0, s, "lr", self.lr, "must be a finite number > 0", "1e-4")
        _require(self.warmup_steps >= 0, s, "warmup_steps", self.warmup_steps, "must be >= 0", "10")
        _require(
            0 <= self.warmup_fraction < 1,
            s,
            "warmup_fraction",
            self.warmup_fraction,
            "must be in [0, 1) (a fraction of the stage's steps; 0 uses warmup_steps)",
            "0.05",
        )
        _require(
            0 <= self.warmup_start_ratio <= 1,
            s,
            "warmup_start_ratio",
            self.warmup_start_ratio,
            "must be in [0, 1] (the first step's lr as a fraction of lr)",
            "0.1",
        )
        for name in ("lr_scale_new", "lr_scale_attention", "lr_scale_other"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0, s, name, value, "must be a finite number >= 0 (0 freezes)", "1.0"
            )
        _require(0 <= self.end_lr_ratio <= 1, s, "end_lr_ratio", self.end_lr_ratio, "must be in [0, 1]", "0.1")
        for name in ("weight_decay", "clip_norm", "kl_weight", "ce_weight"):
            _require(getattr(self, name) >= 0, s, name, getattr(self, name), "must be >= 0", "0")
        _require(0 <= self.synthetic_rate < 1, s, "synthetic_rate", self.synthetic_rate, "must be in [0, 1)", "0.1")
        _require(
            self.synthetic_loss in SYNTHETIC_LOSSES,
            s,
            "synthetic_loss",
            self.synthetic_loss,
            f"choose one of {SYNTHETIC_LOSSES}",
            "full",
        )
        _require(
            self.align_target in ALIGN_TARGETS,
            s,
            "align_target",
            self.align_target,
            f"choose one of {ALIGN_TARGETS}",
            "heads",
        )
        _require(self.temperature > 0, s, "temperature", self.temperature, "must be > 0", "1.0")
        _require(self.loss_chunk_rows >= 0, s, "loss_chunk_rows", self.loss_chunk_rows, "must be >= 0", "0 (all rows)")
        _require(self.micro_batches >= 1, s, "micro_batches", self.micro_batches, "must be >= 1", "1")
        _require(self.heldout_rows >= 0, s, "heldout_rows", self.heldout_rows, "must be >= 0", "4, or 0 for none")
        _require(
            self.heldout_every >= 0,
            s,
            "heldout_every",
            self.heldout_every,
            "must be >= 0",
            "a step interval, or 0 to evaluate only at the start and the end",
        )
        _require(
            self.batch_size % self.micro_batches == 0,
            s,
            "micro_batches",
            self.micro_batches,
            f"must divide batch_size={self.batch_size}",
            "a divisor of batch_size",
        )
        _require(
            self.master_dtype in MASTER_DTYPES,
            s,
            "master_dtype",
            self.master_dtype,
            f"choose one of {MASTER_DTYPES}",
            "float32",
        )

    @property
    def total_steps(self) -> int:
        """``steps`` when > 0, else ⌈tokens / (batch_size · seq_len)⌉."""
        if self.steps > 0:
            return self.steps
        return max(1, -(-self.tokens // (self.batch_size * self.seq_len)))

    @property
    def warmup(self) -> int:
        """Warm-up steps: ``warmup_fraction`` of the stage's steps (at least 1) when set, else ``warmup_steps``."""
        if self.warmup_fraction > 0:
            return max(1, round(self.warmup_fraction * self.total_steps))
        return self.warmup_steps

    @property
    def lr_scales(self) -> dict[str, float]:
        """{parameter group: lr scale} (``training.steps.PARAM_GROUPS``)."""
        return {"new": self.lr_scale_new, "attention": self.lr_scale_attention, "other": self.lr_scale_other}

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True  # tqdm bar with throughput and ETA
    async_save: bool = True  # Orbax saves in the background (waited for at the end of a stage)


@dataclasses.dataclass(frozen=True)
class SelectionStageConfig:
    """Stage 0. ``settings.method`` is a probe method or baseline (hydrahead_jax.selection) or one of
    ``LOCAL_SELECTION_METHODS`` ("given": ``head_map_path``; "all_fa" / "all_la"). ``preset`` supplied the
    settings the recipe left unset (``SelectionConfig.from_any``)."""

    settings: SelectionConfig
    preset: str = "demo"
    head_map_path: str = ""

    @property
    def method(self) -> str:
        return self.settings.method

    def __post_init__(self):
        method = self.settings.method
        if method in LOCAL_SELECTION_METHODS:
            _require(
                method != "given" or bool(self.head_map_path),
                "selection",
                "head_map_path",
                self.head_map_path,
                "method='given' needs a head map file",
                "--config.selection.head_map_path=/path/to/head_map.json",
            )
        else:
            _require(
                method in METHODS,
                "selection",
                "method",
                method,
                f"choose one of {LOCAL_SELECTION_METHODS + METHODS}",
                "combined",
            )
            validate_config(self.settings)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.settings.to_dict(), preset=self.preset, head_map_path=self.head_map_path)


# ------------------------------------------------------------------------------------------------ the run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The whole run, typed and validated (see the module doc)."""

    teacher: TeacherConfig
    data: DataConfig
    selection: SelectionStageConfig
    hybrid: HybridConfig
    stage1: StageConfig
    stage2: StageConfig
    stage3: StageConfig
    mesh: MeshConfig
    logging: LoggingConfig
    seed: int = 0
    # Multi-process (GPU clusters, TPU pods, several processes on one machine): train.py calls
    # jax.distributed.initialize() first; coordinates come from the scheduler JAX detects or from train.py's
    # --coordinator_address/--num_processes/--process_id. Every process runs the same command.
    distributed: bool = False
    hybrid_calibration_rows: int = 4  # stage-1 rows that calibrate the fusion scales

    def __post_init__(self):
        _require(
            self.hybrid_calibration_rows >= 1,
            "config",
            "hybrid_calibration_rows",
            self.hybrid_calibration_rows,
            "must be >= 1",
            "4",
        )
        random_teacher = self.teacher.source == "random"
        mixed = [s.config_key for s in STAGES if self.stage(s).sources] + (["data"] if self.data.sources else [])
        if self.data.source == "copy" and mixed:
            raise ConfigError(
                f"config.{mixed[0]}.sources names corpora, and data.source='copy' reads none. Fix: "
                f"--config.{mixed[0]}.sources='()', or a corpus data.source."
            )
        if random_teacher and self.data.source != "copy":
            raise ConfigError(
                f"config.data.source={self.data.source!r} is tokenised with the teacher's tokenizer, and a random "
                "teacher has none. Fix: --config.data.source=copy, or a pretrained teacher.source."
            )
        if random_teacher and self.selection.method in PROBE_METHODS:
            raise ConfigError(
                f"config.selection.method={self.selection.method!r} probes the teacher with text prompts and needs "
                "its tokenizer; a random teacher has none. Fix: --config.selection.method=layerwise (or random, "
                "given, all_fa, all_la)."
            )
        for stage in STAGES:
            cfg = self.stage(stage)
            where = f"config.{stage.config_key}"
            if cfg.synthetic_rate > 0 and self.data.source == "copy":
                raise ConfigError(
                    f"{where}.synthetic_rate={cfg.synthetic_rate}: synthetic retrieval rows are mixed into a corpus, "
                    f"and data.source='copy' has none. Fix: --{where}.synthetic_rate=0, or a corpus data.source."
                )
            if cfg.rope_scaling and stage.loss != "long":
                raise ConfigError(
                    f"{where}.rope_scaling={cfg.rope_scaling!r}: context extension applies from the long stage "
                    f"(stage 3) on. Fix: --{where}.rope_scaling='' and set config.stage3.rope_scaling instead."
                )
            if stage.loss == "long" and cfg.ce_weight == 0 and cfg.kl_weight == 0:
                raise ConfigError(
                    f"{where}: ce_weight and kl_weight are both 0, so the {stage.name} stage has no loss. "
                    f"Fix: --{where}.ce_weight=1.0."
                )

        if self.mesh.sequence > 1:
            self.check_sequence_split(self.mesh.sequence)

    def check_sequence_split(self, sequence: int) -> None:
        """Under context parallelism over ``sequence`` devices every stage's rows split into 2 × sequence equal
        chunks (the load-balanced zig-zag order gives each device an early and a late chunk). Training rows are
        never padded: padded tokens would still cost every layer's compute and memory."""
        if sequence > 1 and self.hybrid.la_window:
            raise ConfigError(
                f"config.hybrid.la_window={self.hybrid.la_window}: the LA heads' window attention has no "
                f"context-parallel form yet, and mesh.sequence={sequence}. Fix: --config.mesh.sequence=1, or "
                "--config.hybrid.la_window=0."
            )
        parts = 2 * sequence
        for stage in STAGES:
            seq_len = self.stage(stage).seq_len
            if seq_len % parts:
                up = seq_len + parts - seq_len % parts
                choices = f"{up} or {up - parts}" if up > parts else f"{up}"
                raise ConfigError(
                    f"config.{stage.config_key}.seq_len={seq_len} does not split over mesh.sequence={sequence}: "
                    f"context parallelism needs a multiple of 2 x sequence = {parts} tokens. Fix: "
                    f"--config.{stage.config_key}.seq_len={choices}, or a smaller --config.mesh.sequence."
                )

    def stage(self, stage: Stage) -> StageConfig:
        return getattr(self, stage.config_key)

    def stage_sources(self, stage: Stage) -> tuple[SourceSpec, ...]:
        """The corpus sources ``stage`` reads: its own ``sources``, else ``data.sources``, else ``data.source``
        alone (none for the copy source)."""
        if self.data.source == "copy":
            return ()
        return self.stage(stage).sources or self.data.sources or (SourceSpec(self.data.source),)

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-able data, in the recipe's shape (written with every run and export)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if hasattr(value, "to_dict") else _plain(value)
        return out

    @classmethod
    def from_recipe(cls, recipe: Any) -> RunConfig:
        """Convert a recipe (ConfigDict or nested dict, overrides applied) into a validated RunConfig.

        Raises ConfigError naming the key and the fix: unknown keys (with the valid ones), values of the wrong
        type, values out of range, and combinations that cannot run."""
        raw = _as_dict(recipe)
        _refuse_unknown("config", raw, {f.name for f in dataclasses.fields(cls)})
        missing = [s.config_key for s in STAGES if s.config_key not in raw] + (
            ["selection"] if "selection" not in raw else []
        )
        if missing:
            raise ConfigError(f"the recipe defines no {missing}; build it on configs/common.py's base().")
        values: dict[str, Any] = {}
        for key in ("seed", "distributed", "hybrid_calibration_rows"):
            if key in raw:
                values[key] = _coerce("config", key, raw[key], _hint(cls, key))
        values["mesh"] = _section(MeshConfig, "mesh", raw.get("mesh", {}))
        teacher = dict(raw.get("teacher", {}))
        model = _as_dict(teacher.pop("model", None) or {})
        if model:
            try:
                teacher["model"] = ModelConfig.from_dict(model)
            except (ConfigError, TypeError) as err:
                raise ConfigError(f"config.teacher.model: {err}") from None
        values["teacher"] = _section(TeacherConfig, "teacher", teacher)
        values["data"] = _section(DataConfig, "data", raw.get("data", {}))
        values["logging"] = _section(LoggingConfig, "logging", raw.get("logging", {}))
        hybrid = _as_dict(raw.get("hybrid", {}))
        _refuse_unknown("config.hybrid", hybrid, {f.name for f in dataclasses.fields(HybridConfig)})
        try:
            values["hybrid"] = HybridConfig.from_dict(hybrid)
        except (ConfigError, TypeError) as err:
            raise ConfigError(f"config.hybrid: {err}") from None
        for stage in STAGES:
            values[stage.config_key] = _section(StageConfig, stage.config_key, raw[stage.config_key])
        values["selection"] = _selection(raw["selection"])
        try:
            return cls(**values)
        except _FieldError as err:
            raise ConfigError(_reword("config", err)) from None


def recipe_defaults() -> dict[str, Any]:
    """The recipe skeleton (every key, with its default), which ``configs/common.base`` turns into a ConfigDict.
    Selection settings are None: "the preset's value" (``SelectionConfig.from_any``)."""

    def defaults(cls, skip=()):
        return {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if f.name not in skip and f.default is not dataclasses.MISSING
        }

    return {
        "seed": RunConfig.seed,
        "distributed": RunConfig.distributed,
        "mesh": defaults(MeshConfig),
        "teacher": dict(defaults(TeacherConfig, skip=("model",)), model={}),
        "data": defaults(DataConfig),
        "selection": dict(
            {f.name: None for f in dataclasses.fields(SelectionConfig)},
            preset=SelectionStageConfig.preset,
            head_map_path=SelectionStageConfig.head_map_path,
        ),
        "hybrid": defaults(HybridConfig),
        "hybrid_calibration_rows": RunConfig.hybrid_calibration_rows,
        **{s.config_key: stage_defaults(s.config_key) for s in STAGES},
        "logging": defaults(LoggingConfig),
    }


def stage_defaults(config_key: str, **overrides) -> dict[str, Any]:
    """Every StageConfig field of the stage ``config_key``: the defaults, its table's ``train``, then overrides."""
    out = {f.name: f.default for f in dataclasses.fields(StageConfig) if f.name != "train"}
    out["train"] = stage_by_key(config_key).default_train
    unknown = sorted(set(overrides) - set(out))
    if unknown:
        raise ConfigError(f"unknown stage settings {unknown}; valid ones are {sorted(out)}.")
    out.update(overrides)
    return out


# ------------------------------------------------------------------------------------------------ conversion


def _as_dict(value: Any) -> dict[str, Any]:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"expected a section (a ConfigDict / dict), got {value!r}.")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _refuse_unknown(where: str, raw: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        key = f"{where}.{unknown[0]}".removeprefix("config.")
        raise ConfigError(
            f"unknown config key {key!r}: {where} has no field {unknown[0]!r}; its fields are {sorted(known)}."
        )


def _hint(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _coerce(where: str, name: str, value: Any, hint) -> Any:
    """``value`` as the field's type: ints stay ints (no bools), ints widen to floats, strings stay strings."""
    key = f"{where}.{name}"
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected True or False.")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer.")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number.")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string.")
        return value
    if hint == tuple[SourceSpec, ...]:
        return parse_sources(key, value)
    return value


def _reword(where: str, err: _FieldError) -> str:
    """A _FieldError with the full key: config.stage2.lr=-1.0: must be > 0. Fix: --config.stage2.lr=1e-4."""
    key = f"{where}.{err.field}"
    fix = err.fix if " " in err.fix else f"--{key}={err.fix}"
    return f"{key}={err.value!r}: {err.rule}. Fix: {fix}."


def _section(cls, key: str, raw: Any):
    data = _as_dict(raw)
    where = f"config.{key}"
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    _refuse_unknown(where, data, known)
    values = {k: v if k == "model" else _coerce(where, k, v, hints[k]) for k, v in data.items()}
    try:
        return cls(**values)
    except _FieldError as err:
        raise ConfigError(_reword(where, err)) from None
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{where}: {err}") from None


def _selection(raw: Any) -> SelectionStageConfig:
    data = _as_dict(raw)
    preset = data.pop("preset", None) or "demo"
    head_map_path = data.pop("head_map_path", None) or ""
    _refuse_unknown("config.selection", data, {f.name for f in dataclasses.fields(SelectionConfig)})
    try:
        settings = SelectionConfig.from_any(dict(data, preset=preset))
        return SelectionStageConfig(settings=settings, preset=preset, head_map_path=head_map_path)
    except _FieldError as err:
        raise ConfigError(_reword("config.selection", err)) from None
    except SelectionError as err:
        text = str(err)
        if not text.startswith("selection."):
            text = f"selection: {text}"
        raise ConfigError(f"config.{text}") from None


def section_fields(path: tuple[str, ...]) -> list[str] | None:
    """The keys of the recipe section at ``path`` (``()`` = the top level), or None when ``path`` names no
    section: what an error about an unknown ``--config.a.b`` key lists as the valid choices."""
    sections = {
        (): RunConfig,
        ("mesh",): MeshConfig,
        ("teacher",): TeacherConfig,
        ("teacher", "model"): ModelConfig,
        ("data",): DataConfig,
        ("hybrid",): HybridConfig,
        ("logging",): LoggingConfig,
        **{(s.config_key,): StageConfig for s in STAGES},
    }
    if path == ("selection",):
        return sorted([f.name for f in dataclasses.fields(SelectionConfig)] + ["preset", "head_map_path"])
    cls = sections.get(tuple(path))
    return None if cls is None else sorted(f.name for f in dataclasses.fields(cls))

"""The jitted, sharded train step of each stage (functional: nnx.split → jax.jit → nnx.merge).

Train state (a plain pytree, donated to the step):
    {"params": trainable student Params in the MASTER dtype, "frozen": every other student Variable,
     "opt_state": optax state of "params", "step": int32}
The teacher is a separate pytree argument: never differentiated, never donated, held once for the whole run.

Mixed precision (``StepSettings.master_dtype``): the trained parameters and the AdamW moments are kept in f32
(the master copy) while the model computes in its own dtypes (the config's param/compute dtype, bf16 for the
Qwen3 recipe). Each step casts the master to the model's parameter dtypes inside the differentiated function,

    θ_compute = cast(θ_master),   g = ∂L/∂θ_master = cast⁻¹(∂L/∂θ_compute)   (f32),

so gradients, their micro-batch sum, the global norm, clipping and the AdamW update are all f32 and an update far
below one bf16 ulp of θ (lr 1e-5 on a weight near 1.0, whose ulp is 2⁻⁷) still accumulates in the master. When the
model's parameters already are f32 (or master_dtype is "param") the cast is skipped: the step is exactly the plain
one. The frozen teacher and the frozen student Variables stay in the model dtype.

Gradient accumulation (``StepSettings.micro_batches`` = M): the global batch's rows are split into M interleaved
groups (``losses.interleaved_row_groups``) and a ``lax.scan`` sums each group's f32 gradient. Every loss is a
masked token mean Σ_i S_i / Σ_i N_i over the groups i (S: masked token sum, N: mask count), so group i's loss
is weighted by N_i / N:

    L = Σ_i (N_i / N) · L_i,      ∇L = Σ_i (N_i / N) · ∇L_i

which is the full batch's loss and gradient up to f32 summation order, with one group's activations alive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hydrahead_jax.hybrid.attention import group_columns
from hydrahead_jax.hybrid.build import PARAM_GROUPS, param_group
from hydrahead_jax.models.transformer import call_attention, sequence_shards, to_model_order
from hydrahead_jax.run_config import ALIGN_TARGETS, STAGES
from hydrahead_jax.training import losses
from hydrahead_jax.training import sharding as shd

STAGE_KINDS = tuple(s.loss for s in STAGES)  # the losses compute_loss knows, one per row of the stage table


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Per-stage loss options; the trainer fills every field from the stage's StageConfig (where the defaults
    of a run live; the defaults here serve direct callers: tests and benchmarks)."""

    kind: str  # align | distil | long
    kl_weight: float = 0.0  # stage 3: + w · KL(teacher ‖ student)
    ce_weight: float = 1.0  # next-token CE weight (stage 3; stage 2 adds CE too when > 0)
    temperature: float = 1.0
    mask_documents: bool = True  # packed rows: each document attended on its own (``token_layout``)
    chunk: int = 512  # token chunk of the logits loops
    chunk_rows: int = 0  # global rows per logits tile (0: all rows of the micro-batch); tile = chunk_rows × chunk × V
    remat: bool = False  # rematerialise each student layer (attention block in stage 1) in the backward pass
    align_target: str = "layer"  # stage 1: "layer" (each layer's output) or "heads" (each head before o_proj)

    def __post_init__(self):
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"loss kind {self.kind!r}; choose one of {STAGE_KINDS}.")
        if self.align_target not in ALIGN_TARGETS:
            raise ValueError(f"align_target {self.align_target!r}; choose one of {ALIGN_TARGETS}.")

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("align", "distil") or self.kl_weight > 0


def stored_heads(student: nnx.Module, teacher: nnx.Module, teacher_heads: jax.Array) -> jax.Array:
    """The teacher's head outputs [L,B,T,Hq,D] (in the teacher's stored order) in the student's: a model's stored
    head j of layer l is original head ``group_columns(model.group_order[l], G, 1)[j]`` (a student's FA groups
    first; the teacher's order is normally the original one)."""
    cfg = student.cfg
    columns = lambda model: np.stack([group_columns(o, cfg.group_size, 1) for o in model.group_order])  # noqa: E731
    teacher_position = np.argsort(columns(teacher), axis=1)  # [L, Hq]: original head → teacher's stored position
    index = np.take_along_axis(teacher_position, columns(student), axis=1)  # student's stored j → teacher's
    if (index == np.arange(cfg.num_heads)).all():
        return teacher_heads
    return jnp.take_along_axis(teacher_heads, jnp.asarray(index)[:, None, None, :, None], axis=3)


def token_layout(batch: dict[str, jax.Array], mask_documents: bool) -> tuple[jax.Array, jax.Array | None]:
    """(positions [B,T], segment_ids [B,T] or None) the model runs a batch with.

    Rows pack several documents (``data.rows.pack_row``: segment ids 1, 2, … per document, 0 for padding, and
    positions restarting at 0 in each). With ``mask_documents`` the model gets both, so every document is run on
    its own (attention, linear-attention state, conv and RoPE restart at its first token). Without it (or for a
    batch that carries no segment ids: one sequence per row) a row is one causal sequence at positions 0 … T−1.
    Either way ``loss_mask`` drops the targets that cross a document boundary.
    """
    ids = batch["input_ids"]
    if mask_documents and "segment_ids" in batch:
        return batch["positions"], batch["segment_ids"]
    b, t = ids.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), None


def compute_loss(
    student: nnx.Module,
    teacher: nnx.Module | None,
    batch: dict[str, jax.Array],
    settings: LossSettings,
    place_rows: losses.RowPlacer = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss and metrics of one batch for the stage ``settings.kind`` (``place_rows``: see ``row_placer``)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    positions, segment_ids = token_layout(batch, settings.mask_documents)
    if settings.kind == "align":
        inter: dict[str, list] = {}
        heads = settings.align_target == "heads"
        teacher.hidden_states(
            ids, positions=positions, segment_ids=segment_ids, intermediates=inter, record_heads=heads
        )
        # Under context parallelism the student's attention runs in the model's sharded token order (the teacher
        # returned natural order); the masked mean over tokens does not depend on their order.
        n = sequence_shards(ids.shape[1])
        order = lambda x, axis=1: None if x is None else to_model_order(jax.lax.stop_gradient(x), n, axis)  # noqa: E731
        t_in = order(inter["attn_inputs"], 2)  # [L,B,T,d]
        t_out = order(stored_heads(student, teacher, inter["attn_heads"]) if heads else inter["attn_outputs"], 2)

        def run_layers(fn, xs):
            def layer(block, kind, carry, x, slot):
                return carry, fn(functools.partial(call_attention, block.self_attn, kind=kind), x)

            return student.scan_layers(layer, None, xs, remat=settings.remat)[1]

        total, per_layer = losses.align_loss(
            run_layers, t_in, t_out, order(positions), order(mask), order(segment_ids), heads=heads
        )
        return total, {"loss": total, "align_mse_mean": jnp.mean(per_layer)}

    h_s, _ = student.hidden_states(ids, positions=positions, segment_ids=segment_ids, remat=settings.remat)
    metrics: dict[str, jax.Array] = {}
    total = jnp.zeros((), jnp.float32)
    if settings.kind == "distil" or settings.kl_weight > 0:
        h_t, _ = teacher.hidden_states(ids, positions=positions, segment_ids=segment_ids)
        kl = losses.chunked_kl(
            h_s,
            h_t,
            student.logits_from_hidden,
            teacher.logits_from_hidden,
            mask,
            chunk=settings.chunk,
            rows=settings.chunk_rows,
            temperature=settings.temperature,
            place_rows=place_rows,
        )
        metrics["kl"] = kl
        total = total + (1.0 if settings.kind == "distil" else settings.kl_weight) * kl
    if settings.kind == "long" or settings.ce_weight > 0:
        ce, acc = losses.chunked_cross_entropy(
            h_s,
            student.logits_from_hidden,
            batch["targets"],
            mask,
            chunk=settings.chunk,
            rows=settings.chunk_rows,
            place_rows=place_rows,
        )
        metrics["ce"], metrics["accuracy"] = ce, acc
        total = total + settings.ce_weight * ce
    metrics["loss"] = total
    return total, metrics


MASTER_DTYPES = ("float32", "param")


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """How one optimizer step is computed (from the stage config): micro-batches and the master dtype.

    micro_batches: gradient-accumulation groups per step (1: the whole batch at once).
    master_dtype: "float32" keeps trained parameters and optimizer state in f32 while the model computes in its
        own dtype; "param" keeps them in the model's parameter dtype (no master copy: half the optimizer memory,
        but bf16 updates below one ulp round away).
    """

    micro_batches: int = 1
    master_dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches!r} must be an integer >= 1.")
        if self.master_dtype not in MASTER_DTYPES:
            raise ValueError(f"master_dtype={self.master_dtype!r}; choose one of {MASTER_DTYPES}.")

    def check_batch(self, batch_size: int, data_parallel: int, chunk_rows: int = 0) -> None:
        """Refuse a batch the micro-batches and loss tiles cannot split evenly over the data-parallel devices."""
        m = self.micro_batches
        if batch_size % m or (batch_size // m) % data_parallel:
            fits = [
                k for k in range(1, batch_size + 1) if batch_size % k == 0 and (batch_size // k) % data_parallel == 0
            ]
            raise ValueError(
                f"batch_size={batch_size} cannot be split into micro_batches={m} groups whose rows divide "
                f"over the {data_parallel} data-parallel devices (data × fsdp); choose micro_batches in {fits} "
                "or change batch_size."
            )
        rows = batch_size // m
        if chunk_rows and chunk_rows < rows and rows % chunk_rows:
            raise ValueError(
                f"loss_chunk_rows={chunk_rows // data_parallel} (rows per device) must divide the "
                f"{rows // data_parallel} rows per device of a micro-batch (or be 0 for all rows)."
            )


def stage_settings(
    stage_cfg, kind: str, data_parallel: int = 1, mask_documents: bool = True
) -> tuple[LossSettings, StepSettings]:
    """(LossSettings, StepSettings) of one stage's typed config (``run_config.StageConfig``).

    The config's ``loss_chunk_rows`` counts rows per data-parallel device (what bounds one device's logits tile,
    whatever the mesh); the loss gets the global count, × ``data_parallel``. Refuses a batch the micro-batches
    or tiles cannot split evenly (``StepSettings.check_batch``)."""
    loss = LossSettings(
        kind=kind,
        kl_weight=stage_cfg.kl_weight,
        ce_weight=stage_cfg.ce_weight,
        temperature=stage_cfg.temperature,
        chunk=stage_cfg.loss_chunk,
        chunk_rows=stage_cfg.loss_chunk_rows * int(data_parallel),
        remat=stage_cfg.remat,
        mask_documents=mask_documents,
        align_target=stage_cfg.align_target,
    )
    step = StepSettings(micro_batches=stage_cfg.micro_batches, master_dtype=stage_cfg.master_dtype)
    step.check_batch(stage_cfg.batch_size, int(data_parallel), loss.chunk_rows)
    return loss, step


def uses_master(model_params, settings: StepSettings) -> bool:
    """True when the master copy differs from the model's parameters (some trained leaf is not f32)."""
    return settings.master_dtype == "float32" and any(
        jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float32 for x in jax.tree.leaves(model_params)
    )


def to_master(params, settings: StepSettings):
    """Trained parameters in the master dtype (floating leaves → f32; exact, no-op when already f32)."""
    if settings.master_dtype != "float32":
        return params
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def cast_like(tree, like):
    """Each leaf of ``tree`` cast to the dtype of the matching leaf of ``like`` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda x, ref: x if x.dtype == ref.dtype else x.astype(ref.dtype), tree, like)


def f32_param_target(abstract_state: nnx.State) -> nnx.State:
    """Abstract state with every floating nnx.Param in f32: the restore target of a student checkpoint, whatever
    master dtype each stage saved its trained parameters in (Orbax casts on restore; bf16 → f32 is exact)."""

    def one(v):
        if isinstance(v, nnx.Param):
            a = v.get_value()
            if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != jnp.float32:
                return v.copy(jax.ShapeDtypeStruct(a.shape, jnp.float32))
        return v

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Structure, dtypes and shardings of one stage's train state, shared by the trainer and the memory plan.

    ``abstract_state``: {"params" (master dtype), "frozen", "opt_state", "step"} as ShapeDtypeStructs carrying
    their shardings; ``model_params``: the trained parameters as the model declares them (compute dtypes)."""

    graphdef: Any
    model_params: Any
    abstract_state: dict[str, Any]
    shardings: dict[str, Any]
    batch_sharding: Any


def abstract_with_shardings(abstract_pure, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_pure, shardings)


def stage_layout(student_graphdef, abstract_student, trainable, tx, mesh, step_settings: StepSettings) -> StageLayout:
    """Split the abstract student by the ``trainable`` filter and lay out params, optimizer state and batch."""
    gd, abs_params, abs_frozen = nnx.split(nnx.merge(student_graphdef, abstract_student), trainable, ...)
    p_sh, f_sh = shd.state_shardings(abs_params, mesh), shd.state_shardings(abs_frozen, mesh)
    model_params = nnx.as_pure(abs_params)
    master = jax.eval_shape(lambda p: to_master(p, step_settings), model_params)
    o_sh = shd.optimizer_shardings(tx, master, p_sh, mesh)
    shardings = {"params": p_sh, "frozen": f_sh, "opt_state": o_sh, "step": shd.replicated(mesh)}
    abstract_state = {
        "params": abstract_with_shardings(master, p_sh),
        "frozen": abstract_with_shardings(nnx.as_pure(abs_frozen), f_sh),
        "opt_state": abstract_with_shardings(jax.eval_shape(tx.init, master), o_sh),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=shd.replicated(mesh)),
    }
    return StageLayout(gd, model_params, abstract_state, shardings, shd.batch_sharding(mesh, 2))


def row_placer(batch_sharding) -> losses.RowPlacer:
    """place_rows(x, axis): constrain x's axis ``axis`` to the rows' sharding of ``batch_sharding`` (a
    NamedSharding of [B, T] batches), every other axis replicated. None when there is no sharding to keep."""
    if batch_sharding is None:
        return None
    mesh, spec = batch_sharding.mesh, batch_sharding.spec
    rows = spec[0] if len(spec) else None

    def place(x, axis):
        parts = [None] * x.ndim
        parts[axis] = rows
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*parts)))

    return place


def jit_train_step(step_fn, layout: StageLayout, teacher_shardings):
    """``jax.jit`` of a ``make_train_step`` step with the layout's shardings (the learning rate replicated, as the
    step counter); the train state is donated."""
    return jax.jit(
        step_fn,
        in_shardings=(layout.shardings, teacher_shardings, layout.batch_sharding, layout.shardings["step"]),
        out_shardings=(layout.shardings, layout.shardings["step"]),
        donate_argnums=(0,),
    )


def _model_merger(student_graphdef, teacher_graphdef, model_params, step_settings: StepSettings):
    """merge(params, frozen, teacher_state) -> (student, teacher or None) modules; the trained ``params`` are cast
    from the master dtype to the model's own (``model_params``) when the two differ (``uses_master``)."""
    cast = model_params is not None and uses_master(model_params, step_settings)

    def merge(params, frozen, teacher_state):
        if cast:
            params = cast_like(params, model_params)
        student = nnx.merge(student_graphdef, params, frozen)
        teacher = None if teacher_state is None else nnx.merge(teacher_graphdef, teacher_state)
        return student, teacher

    return merge


def token_weighted_groups(batch, groups: int, place_rows: losses.RowPlacer = None):
    """(the batch as ``groups`` interleaved row groups [groups, B/groups, ...], weights N_i / N [groups]), N_i the
    loss-mask count of group i: Σ_i (N_i/N)·L_i of masked token means L_i is the whole batch's mean."""
    grouped = losses.place(place_rows, jax.tree.map(lambda x: losses.interleaved_row_groups(x, groups), batch), 1)
    counts = jnp.sum(grouped["loss_mask"].astype(jnp.float32), axis=tuple(range(1, batch["loss_mask"].ndim + 1)))
    return grouped, counts / jnp.maximum(jnp.sum(counts), 1.0)


def make_train_step(
    student_graphdef,
    teacher_graphdef,
    tx: optax.GradientTransformation,
    settings: LossSettings,
    *,
    step_settings: StepSettings = StepSettings(),
    model_params=None,
    batch_sharding=None,
):
    """step(state, teacher_state, batch, learning_rate) -> (state, metrics); pure, to be wrapped in jax.jit by the
    caller. ``learning_rate`` (f32 scalar) is this step's value of the stage's schedule, computed by the caller:
    it reaches ``tx`` as the ``learning_rate`` extra argument (``make_optimizer``), so the compiled step does not
    depend on the schedule's lr, warmup or budget, and a run at another budget or learning rate (a sweep, the
    reproduction's 2x / 4x budgets, a resumed stage given a new lr) reuses the compiled program.

    ``model_params``: the trained parameters as the model declares them (arrays or ShapeDtypeStructs; their
    dtypes are what the model computes with). Needed when the master copy differs from them (``uses_master``);
    state["params"] then holds the master and each step casts it to these dtypes. ``batch_sharding``: the batch's
    NamedSharding; micro-batches and logits tiles keep their rows on it (``row_placer``)."""
    place_rows = row_placer(batch_sharding)
    merge = _model_merger(student_graphdef, teacher_graphdef, model_params, step_settings)
    m = step_settings.micro_batches

    def loss_fn(params, frozen, teacher_state, batch, weight):
        student, teacher = merge(params, frozen, teacher_state)
        loss, metrics = compute_loss(student, teacher, batch, settings, place_rows)
        if weight is None:
            return loss, metrics
        return loss * weight, jax.tree.map(lambda x: x * weight, metrics)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulated(params, frozen, teacher_state, batch):
        """Σ_i (N_i/N)·(∇L_i, metrics_i) over the M interleaved row groups, summed in f32."""
        groups, weights = token_weighted_groups(batch, m, place_rows)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        first = jax.tree.map(lambda x: x[0], groups)
        metric_shapes = jax.eval_shape(lambda *a: loss_fn(*a, None)[1], params, frozen, teacher_state, first)
        zero_metrics = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), metric_shapes)

        def body(carry, xs):
            group, weight = xs
            group = losses.place(place_rows, group, 0)
            (_, metrics), grads = grad_fn(params, frozen, teacher_state, group, weight)
            add = lambda a, b: a + b.astype(jnp.float32)  # noqa: E731
            return (jax.tree.map(add, carry[0], grads), jax.tree.map(add, carry[1], metrics)), None

        (grads, metrics), _ = jax.lax.scan(body, (zeros, zero_metrics), (groups, weights))
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metrics

    def step(state, teacher_state, batch, learning_rate):
        if m == 1:
            (_, metrics), grads = grad_fn(state["params"], state["frozen"], teacher_state, batch, None)
        else:
            grads, metrics = accumulated(state["params"], state["frozen"], teacher_state, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"], learning_rate=learning_rate)
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=learning_rate)
        new_state = {"params": params, "frozen": state["frozen"], "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    return step


def scale_by_param_group(scales: dict[str, float]) -> optax.GradientTransformation:
    """updates_p · scales[param_group(p)]: after AdamW (whose update is −lr_t · (m̂/(√v̂+ε) + wd·θ)) this is a
    per-group learning rate lr_t · s_group, weight decay included."""

    def update(updates, state, params=None):
        del params
        scaled = jax.tree_util.tree_map_with_path(
            lambda path, u: u * jnp.asarray(scales[param_group(path)], u.dtype), updates
        )
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def mask_updates(mask) -> optax.GradientTransformation:
    """u ⊙ mask(path, u.shape) for the parameters the mask covers (``hybrid.build.fa_slice_mask``: 0 on a slice
    that stays fixed), the rest unchanged."""

    def apply(path, u):
        m = mask(path, u.shape)
        return u if m is None else u * jnp.asarray(m, u.dtype)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(apply, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_given_learning_rate() -> optax.GradientTransformationExtraArgs:
    """u ↦ −η·u, η the ``learning_rate`` extra argument of ``update`` (the step's schedule value, computed by the
    caller): the learning rate is an input of the compiled step rather than a constant of it. The state counts
    updates exactly as ``optax.scale_by_schedule``'s (``ScaleByScheduleState``), so an optimizer state saved with a
    schedule inside the step restores into this one."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, learning_rate, **extra_args):
        del params, extra_args
        scaled = jax.tree.map(lambda u: jnp.asarray(-learning_rate, u.dtype) * u, updates)
        return scaled, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    end_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    clip_norm: float = 1.0,
    b2: float = 0.95,
    warmup_start_ratio: float = 0.0,
    lr_scales: dict[str, float] | None = None,
    update_mask=None,
):
    """AdamW on a warmup (linear from lr·warmup_start_ratio) + cosine schedule to lr·end_lr_ratio, after
    global-norm clipping; with ``lr_scales`` ({group: scale}, ``PARAM_GROUPS``) each parameter group's updates are
    scaled, a per-group learning rate. ``update_mask`` (``mask_updates``) zeroes the gradient of the slices it
    masks before the clipping (they count in neither the global norm nor Adam's moments) and their final update
    (AdamW's decoupled weight decay −lr·wd·θ would move them otherwise): those entries stay exactly as they are.

    Returns (tx, schedule); the schedule is the base lr (a group's is scale × it). ``tx.update`` takes the step's
    learning rate as its ``learning_rate`` extra argument (``scale_by_given_learning_rate``): the caller passes
    ``schedule(step)``, which is what ``optax.adamw(schedule)`` would compute inside the step (AdamW here is
    ``optax.adamw``'s own chain — Adam's scaling, the decoupled weight decay, −η — with the same state)."""
    warmup = max(0, min(int(warmup_steps), int(total_steps) - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=lr * warmup_start_ratio,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(int(total_steps), warmup + 1),
        end_value=lr * end_lr_ratio,
    )
    parts = [mask_updates(update_mask)] if update_mask is not None else []
    if clip_norm and clip_norm > 0:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(
        optax.chain(
            optax.scale_by_adam(b1=0.9, b2=b2),
            optax.add_decayed_weights(weight_decay),
            scale_by_given_learning_rate(),
        )
    )
    if lr_scales is not None and any(lr_scales[g] != 1.0 for g in PARAM_GROUPS):
        parts.append(scale_by_param_group(lr_scales))
    if update_mask is not None:
        parts.append(mask_updates(update_mask))
    return optax.chain(*parts), schedule


def stage_optimizer(stage_cfg, total_steps: int, update_mask=None):
    """``make_optimizer`` with one stage's typed config (and the update mask of its ``train`` choice,
    ``hybrid.build.fa_slice_mask``). Returns (tx, schedule)."""
    return make_optimizer(
        lr=stage_cfg.lr,
        warmup_steps=stage_cfg.warmup,
        total_steps=total_steps,
        end_lr_ratio=stage_cfg.end_lr_ratio,
        weight_decay=stage_cfg.weight_decay,
        clip_norm=stage_cfg.clip_norm,
        warmup_start_ratio=stage_cfg.warmup_start_ratio,
        lr_scales=stage_cfg.lr_scales,
        update_mask=update_mask,
    )


def heldout_metrics(
    student: nnx.Module,
    teacher: nnx.Module,
    batch: dict[str, jax.Array],
    settings: LossSettings,
    place_rows: losses.RowPlacer = None,
) -> dict[str, jax.Array]:
    """The stage's own loss and metrics (``compute_loss``) on one batch, plus the yardstick every stage shares:
    ``kl`` = KL(teacher ‖ student) at temperature 1 (nats/token) and ``top1`` = the fraction of tokens whose
    argmax agrees, from the student's full logits (``losses.chunked_teacher_agreement``). ``kl`` replaces a
    stage's own KL metric (tempered when config.<stage>.temperature ≠ 1; it is in ``loss`` then)."""
    _, metrics = compute_loss(student, teacher, batch, settings, place_rows)
    positions, segment_ids = token_layout(batch, settings.mask_documents)
    ids = batch["input_ids"]
    h_s, _ = student.hidden_states(ids, positions=positions, segment_ids=segment_ids)
    h_t, _ = teacher.hidden_states(ids, positions=positions, segment_ids=segment_ids)
    kl, top1 = losses.chunked_teacher_agreement(
        h_s,
        h_t,
        student.logits_from_hidden,
        teacher.logits_from_hidden,
        batch["loss_mask"],
        chunk=settings.chunk,
        rows=settings.chunk_rows,
        place_rows=place_rows,
    )
    return dict(metrics, kl=kl, top1=top1)


def make_eval_step(
    student_graphdef,
    teacher_graphdef,
    settings: LossSettings,
    *,
    step_settings: StepSettings = StepSettings(),
    model_params=None,
    batch_sharding=None,
    groups: int = 1,
):
    """evaluate(params, frozen, teacher_state, batch) -> ``heldout_metrics``; pure, no gradient, no update.

    ``params`` are the train state's (master dtype; cast like the train step's). ``groups`` > 1 evaluates the
    batch as that many interleaved row groups one after the other (a ``lax.scan``, one group's activations alive)
    and combines them weighted by their token counts (``token_weighted_groups``): the whole batch's masked means.
    """
    place_rows = row_placer(batch_sharding)
    merge = _model_merger(student_graphdef, teacher_graphdef, model_params, step_settings)

    def metrics_of(params, frozen, teacher_state, batch):
        student, teacher = merge(params, frozen, teacher_state)
        return heldout_metrics(student, teacher, batch, settings, place_rows)

    def evaluate(params, frozen, teacher_state, batch):
        if groups == 1:
            return metrics_of(params, frozen, teacher_state, batch)
        grouped, weights = token_weighted_groups(batch, groups, place_rows)

        def body(total, xs):
            group, weight = xs
            metrics = metrics_of(params, frozen, teacher_state, losses.place(place_rows, group, 0))
            return jax.tree.map(lambda t, x: t + weight * x.astype(jnp.float32), total, metrics), None

        first = jax.tree.map(lambda x: x[0], grouped)
        shapes = jax.eval_shape(metrics_of, params, frozen, teacher_state, first)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
        total, _ = jax.lax.scan(body, zeros, (grouped, weights))
        return total

    return evaluate


def jit_eval_step(eval_fn, layout: StageLayout, teacher_shardings):
    """``jax.jit`` of a ``make_eval_step`` function with the layout's shardings; nothing is donated (the train
    state goes on training), the metrics come back replicated."""
    return jax.jit(
        eval_fn,
        in_shardings=(
            layout.shardings["params"],
            layout.shardings["frozen"],
            teacher_shardings,
            layout.batch_sharding,
        ),
        out_shardings=layout.shardings["step"],
    )

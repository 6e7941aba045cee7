"""The jitted, sharded train step of each stage (functional: nnx.split → jax.jit → nnx.merge).

Train state (a plain pytree, donated to the step):
    {"params": trainable student Params, "frozen": every other student Variable,
     "opt_state": optax state of "params", "step": int32}
The teacher is a separate pytree argument: never differentiated, never donated, held once for the whole run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hydrahead_jax.models.transformer import remat_call
from hydrahead_jax.run_config import STAGES
from hydrahead_jax.training import losses

STAGE_KINDS = tuple(s.loss for s in STAGES)  # the losses compute_loss knows, one per row of the stage table


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Per-stage loss options; the trainer fills every field from the stage's StageConfig (where the defaults
    of a run live; the defaults here serve direct callers: tests and benchmarks)."""

    kind: str  # align | distil | long
    kl_weight: float = 0.0  # stage 3: + w · KL(teacher ‖ student)
    ce_weight: float = 1.0  # next-token CE weight (stage 3; stage 2 adds CE too when > 0)
    temperature: float = 1.0
    chunk: int = 512  # token chunk of the logits loops
    remat: bool = False  # rematerialise each student layer (attention block in stage 1) in the backward pass

    def __post_init__(self):
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"loss kind {self.kind!r}; choose one of {STAGE_KINDS}.")

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("align", "distil") or self.kl_weight > 0


def _positions(ids: jax.Array) -> jax.Array:
    # Packed rows are attended as one causal sequence (no segment masking in the model), so positions run
    # 0..T−1 over the row; loss_mask already drops the cross-document targets.
    b, t = ids.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def compute_loss(
    student: nnx.Module, teacher: nnx.Module | None, batch: dict[str, jax.Array], settings: LossSettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Scalar loss and metrics of one batch for the stage ``settings.kind``."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    positions = _positions(ids)
    if settings.kind == "align":
        inter: dict[str, list] = {}
        teacher.hidden_states(ids, positions=positions, intermediates=inter)
        t_in = [jax.lax.stop_gradient(x) for x in inter["attn_inputs"]]
        t_out = [jax.lax.stop_gradient(y) for y in inter["attn_outputs"]]
        attns = [layer.self_attn for layer in student.layers]
        if settings.remat:
            attns = [functools.partial(remat_call, attn) for attn in attns]
        total, per_layer = losses.align_loss(attns, t_in, t_out, positions, mask)
        return total, {"loss": total, "align_mse_mean": jnp.mean(per_layer)}

    h_s, _ = student.hidden_states(ids, positions=positions, remat=settings.remat)
    metrics: dict[str, jax.Array] = {}
    total = jnp.zeros((), jnp.float32)
    if settings.kind == "distil" or settings.kl_weight > 0:
        h_t, _ = teacher.hidden_states(ids, positions=positions)
        kl = losses.chunked_kl(
            h_s,
            h_t,
            student.logits_from_hidden,
            teacher.logits_from_hidden,
            mask,
            chunk=settings.chunk,
            temperature=settings.temperature,
        )
        metrics["kl"] = kl
        total = total + (1.0 if settings.kind == "distil" else settings.kl_weight) * kl
    if settings.kind == "long" or settings.ce_weight > 0:
        ce, acc = losses.chunked_cross_entropy(
            h_s, student.logits_from_hidden, batch["targets"], mask, chunk=settings.chunk
        )
        metrics["ce"], metrics["accuracy"] = ce, acc
        total = total + settings.ce_weight * ce
    metrics["loss"] = total
    return total, metrics


def make_train_step(
    student_graphdef,
    teacher_graphdef,
    tx: optax.GradientTransformation,
    settings: LossSettings,
    schedule: Callable[[Any], Any],
):
    """step(state, teacher_state, batch) -> (state, metrics); pure, to be wrapped in jax.jit by the caller."""

    def loss_fn(params, frozen, teacher_state, batch):
        student = nnx.merge(student_graphdef, params, frozen)
        teacher = None if teacher_state is None else nnx.merge(teacher_graphdef, teacher_state)
        return compute_loss(student, teacher, batch, settings)

    def step(state, teacher_state, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["frozen"], teacher_state, batch
        )
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state["step"]))
        new_state = {"params": params, "frozen": state["frozen"], "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    return step


def make_optimizer(
    *,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    end_lr_ratio: float = 0.1,
    weight_decay: float = 0.0,
    clip_norm: float = 1.0,
    b2: float = 0.95,
):
    """AdamW on a warmup (linear from 0) + cosine schedule to lr·end_lr_ratio, after global-norm clipping.

    Returns (tx, schedule)."""
    warmup = max(0, min(int(warmup_steps), int(total_steps) - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(int(total_steps), warmup + 1),
        end_value=lr * end_lr_ratio,
    )
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip_norm > 0 else []
    parts.append(optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=weight_decay))
    return optax.chain(*parts), schedule

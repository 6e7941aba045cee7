"""Calibration of the fusion scales γ and offsets μ (the fusion itself is ``hybrid.attention.ScaleFusion``).

Below, n is what the fusion scales: the student's fusion input at initialisation, RMS-normalised per token for
the normalising modes (n_t = RMSNorm(o^student_t), ``la_only``, ``both``) and as it is for ``la_scale`` (n_t =
o^student_t, the output gate's result), computed from the teacher's own layer input (the layer-wise target of
stage 1).

``fusion_init="rms"``: γ puts each fused head on the teacher head's measured attention-output RMS (before o_proj)
on a calibration batch (μ, when there is one, stays 0):

    γ_h = sqrt(mean_{b,t,c} o^teacher_{b,t,h,c}²) / sqrt(mean_{b,t,c} n_{b,t,h,c}²)       (``head``)
    γ_{h,c} = sqrt(mean_{b,t} o^teacher_{b,t,h,c}²) / sqrt(mean_{b,t} n_{b,t,h,c}²)       (``channel``)

For the normalising modes the denominator is 1 by construction (n has unit RMS per token, up to ε) and is not
computed: γ is the teacher's RMS, the paper-style initialisation.

``fusion_init="fit"``: γ (and μ with ``fusion_bias``) minimise the squared error of the fused head output against
the teacher's:

    min_{γ_h, μ_h} Σ_t ‖γ_h n_{t,h} + μ_h − o^teacher_{t,h}‖²

With an offset, per head (sums over tokens t and channels c; n̄, ō the per-channel means over tokens):

    γ_h = Σ_{t,c} (n − n̄)(o − ō) / Σ_{t,c} (n − n̄)²,    μ_h = ō_h − γ_h n̄_h
    (``channel``: the same with sums over t only, one γ per channel)

and without one γ_h = Σ_{t,c} n·o / Σ_{t,c} n². γ = 0, μ = ō is "mean ablation" (the head replaced by its
average output), a point of the search, so the fitted head's error on the calibration batch is never above mean
ablation's, nor above the best rescaling of today's output. A head whose n does not vary gets γ = 0. γ = 0 is
not a trap for training: ∂L/∂γ = Σ ⟨∂L/∂ô, n⟩ does not vanish, so the first update moves γ off 0 and the GDN
parameters (whose gradient is proportional to γ) start learning from there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.hybrid.attention import HydraHeadAttention, group_columns
from hydrahead_jax.models.attention import Attention
from hydrahead_jax.models.layers import rms_normalize


def _positions(input_ids: jax.Array) -> jax.Array:
    b, t = input_ids.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _head_rms(graphdef, state, input_ids, granularity):
    teacher = nnx.merge(graphdef, state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    positions = _positions(input_ids)
    axes = (0, 1, 3) if granularity == "head" else (0, 1)

    def rms(block, kind, carry, x, slot):
        heads, _ = block.self_attn.head_outputs(x, positions)  # [B,T,Hq,D], before o_proj
        return carry, jnp.sqrt(jnp.mean(jnp.square(heads.astype(jnp.float32)), axis=axes))

    return teacher.scan_layers(rms, None, inter["attn_inputs"])[1]


def teacher_head_rms(teacher: nnx.Module, input_ids, granularity: str = "head") -> np.ndarray:
    """The teacher's per-head attention-output RMS (before o_proj): [L, Hq] (head) or [L, Hq, D] (channel)."""
    graphdef, state = nnx.split(teacher)
    return np.asarray(_head_rms(graphdef, state, _calibration_ids(teacher, input_ids), granularity))


def _calibration_ids(teacher: nnx.Module, input_ids) -> jax.Array:
    """``input_ids`` as int32 [B,T], after checking that ``teacher`` is a plain softmax model."""
    attn = teacher.layers.self_attn
    student = isinstance(attn, HydraHeadAttention) and attn.hybrid_cfg is not None
    identity = tuple(range(teacher.cfg.num_kv_heads))
    if not isinstance(attn, Attention) or student or any(o != identity for o in teacher.group_order):
        raise ValueError(
            "the teacher is not plain softmax attention; calibrate against the teacher model, not a student."
        )
    ids = jnp.asarray(np.asarray(input_ids, dtype=np.int32))
    if ids.ndim != 2:
        raise ValueError(f"calibration input_ids must be [batch, length], got shape {ids.shape}.")
    return ids


def fused_heads(student: nnx.Module, layer: int) -> np.ndarray:
    """The original query-head indices of the heads layer ``layer`` of ``student`` fuses, in the order of its
    fusion slots (its stored order: FA groups first, ``hybrid.attention.group_order``)."""
    attn, f = student.layers.self_attn, student.layer_kinds[layer]
    stored = group_columns(student.group_order[layer], student.cfg.group_size, 1)
    return stored[len(stored) - attn.fused_heads(f) :]


def fit_scale_and_offset(n: jax.Array, o: jax.Array, granularity: str, bias: bool) -> tuple[jax.Array, jax.Array]:
    """The least-squares (γ, μ) of γ ⊙ n + μ ≈ o (module doc); n, o [N, H, D] (N tokens) → γ [H] (``head``) or
    [H, D] (``channel``), μ [H, D] (zeros without ``bias``), fp32."""
    n, o = n.astype(jnp.float32), o.astype(jnp.float32)
    axes = (0, 2) if granularity == "head" else (0,)
    if bias:
        n_mean, o_mean = jnp.mean(n, axis=0), jnp.mean(o, axis=0)
        n, o = n - n_mean, o - o_mean
    cov, var = jnp.sum(n * o, axis=axes), jnp.sum(n * n, axis=axes)
    # a constant n (var 0, up to rounding) carries nothing to scale: γ = 0 and μ the teacher's mean
    tiny = 1e-6 * jnp.sum(jnp.ones_like(n), axis=axes)
    gamma = jnp.where(var > tiny, cov / jnp.maximum(var, tiny), 0.0)
    if not bias:
        return gamma, jnp.zeros(o.shape[1:], jnp.float32)
    g = gamma[:, None] if granularity == "head" else gamma
    return gamma, o_mean - g * n_mean


@functools.partial(jax.jit, static_argnums=(0, 2))
def _fusion_fits(teacher_graphdef, teacher_state, student_graphdef, student_state, input_ids):
    """(γ [L, slots(, D)], μ [L, slots, D]) of every layer of the student, in its fusion slots: the fit of its
    fusion input to the teacher's heads on the teacher's own layer inputs (zeros for a layer without fusion).

    The teacher's heads are computed with the student's own copies of the teacher's projections (its softmax
    path over every group, ``Attention.head_outputs``): the teacher's heads in the student's stored order."""
    teacher = nnx.merge(teacher_graphdef, teacher_state)
    student = nnx.merge(student_graphdef, student_state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    positions = _positions(input_ids)

    def fit(block, kind, carry, x, slot):
        attn = block.self_attn
        used = attn.fused_heads(kind)
        mu = jnp.zeros((attn.fusion.num_heads, student.cfg.head_dim), jnp.float32)
        gamma = jnp.zeros(attn.fusion.gamma.shape, jnp.float32)
        if not used:
            return carry, (gamma, mu)
        target, _ = Attention.head_outputs(attn, x, positions)  # [B,T,Hq,D], before o_proj
        target = target[:, :, target.shape[2] - used :]
        window = attn.window_outputs(x, positions, kind)
        if window is not None:  # la_window: the fused GDN heads fit what the window attention leaves
            target = target - window
        n = attn.fusion_inputs(x, positions, kind)
        if attn.fusion.normalize:
            n = rms_normalize(n, attn.fusion.eps)
        flat = (-1, used, n.shape[-1])
        g, m = fit_scale_and_offset(
            n.reshape(flat), target.reshape(flat), attn.fusion.granularity, attn.fusion.mu is not None
        )
        return carry, (gamma.at[:used].set(g), mu.at[:used].set(m))

    return student.scan_layers(fit, None, inter["attn_inputs"])[1]


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _fusion_input_rms(teacher_graphdef, teacher_state, student_graphdef, student_state, input_ids, granularity):
    """The RMS of every layer's fusion input, [L, slots] (``head``) or [L, slots, D] (``channel``) in its fusion
    slots (zeros where a layer fuses nothing), from the teacher's layer inputs: the denominator of the "rms" init
    for the un-normalised ``la_scale``."""
    teacher = nnx.merge(teacher_graphdef, teacher_state)
    student = nnx.merge(student_graphdef, student_state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    positions = _positions(input_ids)
    axes = (0, 1, 3) if granularity == "head" else (0, 1)

    def rms(block, kind, carry, x, slot):
        attn = block.self_attn
        used = attn.fused_heads(kind)
        out = jnp.zeros(attn.fusion.gamma.shape, jnp.float32)
        if not used:
            return carry, out
        n = attn.fusion_inputs(x, positions, kind).astype(jnp.float32)
        return carry, out.at[:used].set(jnp.sqrt(jnp.mean(jnp.square(n), axis=axes)))

    return student.scan_layers(rms, None, inter["attn_inputs"])[1]


def calibrate_fusion(student: nnx.Module, teacher: nnx.Module, input_ids) -> dict[int, np.ndarray]:
    """Set every fusion γ (and μ) of ``student`` from the teacher on ``input_ids`` [B,T], as the student's
    ``fusion_init`` says: the teacher's per-head output RMS over the fusion input's ("rms"; μ stays 0) or the
    least-squares fit ("fit").

    Returns {layer index: the γ written, for the heads ``fused_heads(student, layer)``}. Layers without fusion
    are left alone.
    """
    if student.cfg.num_layers != teacher.cfg.num_layers:
        raise ValueError(
            f"student has {student.cfg.num_layers} layers, teacher {teacher.cfg.num_layers}: not the "
            "teacher this student was built from."
        )
    attn = student.layers.self_attn
    fusion = getattr(attn, "fusion", None)
    used = [0 if fusion is None else attn.fused_heads(f) for f in student.layer_kinds]
    if not any(used):
        return {}
    ids = _calibration_ids(teacher, input_ids)
    if attn.hybrid_cfg.fusion_init == "fit":
        teacher_graphdef, teacher_state = nnx.split(teacher)
        student_graphdef, student_state = nnx.split(student)
        gammas, mus = (
            np.asarray(a) for a in _fusion_fits(teacher_graphdef, teacher_state, student_graphdef, student_state, ids)
        )
    else:
        rms = teacher_head_rms(teacher, ids, fusion.granularity)
        gammas = np.zeros(fusion.gamma.shape, np.float32)
        for i, n in enumerate(used):
            if n:
                gammas[i, :n] = rms[i][fused_heads(student, i)]
        if not fusion.normalize:  # un-normalised input: scale its RMS to the teacher's (a silent head keeps γ = 0)
            teacher_graphdef, teacher_state = nnx.split(teacher)
            student_graphdef, student_state = nnx.split(student)
            n_rms = np.asarray(
                _fusion_input_rms(
                    teacher_graphdef, teacher_state, student_graphdef, student_state, ids, fusion.granularity
                ),
                np.float64,
            )
            gammas = np.where(n_rms > 0, gammas / np.maximum(n_rms, 1e-30), 0.0).astype(np.float32)
        mus = None
    keep = np.asarray([n == 0 for n in used])  # layers without fusion keep their (unused) values

    def write(var, values):
        old = np.asarray(var[...], np.float32)
        var.set_value(jnp.asarray(np.where(keep.reshape((-1,) + (1,) * (old.ndim - 1)), old, values), var.dtype))

    write(fusion.gamma, gammas)
    if mus is not None and fusion.mu is not None:
        write(fusion.mu, mus)
    return {i: gammas[i, :n] for i, n in enumerate(used) if n}

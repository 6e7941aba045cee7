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

from hydrahead_jax.hybrid.attention import HydraHeadAttention
from hydrahead_jax.models.attention import Attention
from hydrahead_jax.models.layers import rms_normalize


@functools.partial(jax.jit, static_argnums=(0, 3))
def _head_rms(graphdef, state, input_ids, granularity):
    teacher = nnx.merge(graphdef, state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    axes = (0, 1, 3) if granularity == "head" else (0, 1)
    rms = []
    for layer, x in zip(teacher.layers, inter["attn_inputs"]):
        heads, _ = layer.self_attn.head_outputs(x, positions)  # [B,T,Hq,D], before o_proj
        rms.append(jnp.sqrt(jnp.mean(jnp.square(heads.astype(jnp.float32)), axis=axes)))
    return jnp.stack(rms)


def teacher_head_rms(teacher: nnx.Module, input_ids, granularity: str = "head") -> np.ndarray:
    """The teacher's per-head attention-output RMS (before o_proj): [L, Hq] (head) or [L, Hq, D] (channel)."""
    graphdef, state = nnx.split(teacher)
    return np.asarray(_head_rms(graphdef, state, _calibration_ids(teacher, input_ids), granularity))


def _calibration_ids(teacher: nnx.Module, input_ids) -> jax.Array:
    """``input_ids`` as int32 [B,T], after checking that ``teacher`` is a plain softmax model."""
    for i, layer in enumerate(teacher.layers):
        attn = layer.self_attn
        student = isinstance(attn, HydraHeadAttention) and attn.hybrid_cfg is not None
        if not isinstance(attn, Attention) or student:
            raise ValueError(
                f"teacher layer {i} is not plain softmax attention; calibrate against the teacher model, not a student."
            )
    ids = jnp.asarray(np.asarray(input_ids, dtype=np.int32))
    if ids.ndim != 2:
        raise ValueError(f"calibration input_ids must be [batch, length], got shape {ids.shape}.")
    return ids


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
    """{layer: (γ, μ)} of every fused layer of the student: the fit of its fusion input to the teacher's heads."""
    teacher = nnx.merge(teacher_graphdef, teacher_state)
    student = nnx.merge(student_graphdef, student_state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    fits = {}
    for i, (t_layer, s_layer, x) in enumerate(zip(teacher.layers, student.layers, inter["attn_inputs"])):
        fusion = getattr(s_layer.self_attn, "fusion", None)
        if fusion is None:
            continue
        target, _ = t_layer.self_attn.head_outputs(x, positions)  # [B,T,Hq,D], before o_proj
        target = target[:, :, np.asarray(fusion.heads)]
        n = s_layer.self_attn.fusion_inputs(x, positions)
        if fusion.normalize:
            n = rms_normalize(n, fusion.eps)
        d = n.shape[-1]
        flat = (b * t, len(fusion.heads), d)
        fits[i] = fit_scale_and_offset(n.reshape(flat), target.reshape(flat), fusion.granularity, fusion.mu is not None)
    return fits


@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _fusion_input_rms(teacher_graphdef, teacher_state, student_graphdef, student_state, input_ids, granularity):
    """{layer: RMS of the fusion input} [H] or [H, D] of every un-normalised fused layer (``la_scale``), from the
    teacher's layer inputs."""
    teacher = nnx.merge(teacher_graphdef, teacher_state)
    student = nnx.merge(student_graphdef, student_state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    axes = (0, 1, 3) if granularity == "head" else (0, 1)
    out = {}
    for i, (s_layer, x) in enumerate(zip(student.layers, inter["attn_inputs"])):
        fusion = getattr(s_layer.self_attn, "fusion", None)
        if fusion is None or fusion.normalize:
            continue
        n = s_layer.self_attn.fusion_inputs(x, positions).astype(jnp.float32)
        out[i] = jnp.sqrt(jnp.mean(jnp.square(n), axis=axes))
    return out


def calibrate_fusion(student: nnx.Module, teacher: nnx.Module, input_ids) -> dict[int, np.ndarray]:
    """Set every fusion γ (and μ) of ``student`` from the teacher on ``input_ids`` [B,T], as the student's
    ``fusion_init`` says: the teacher's per-head output RMS over the fusion input's ("rms"; μ stays 0) or the
    least-squares fit ("fit").

    Returns {layer index: the γ written}. Layers without fusion are left alone.
    """
    if len(student.layers) != len(teacher.layers):
        raise ValueError(
            f"student has {len(student.layers)} layers, teacher {len(teacher.layers)}: not the "
            "teacher this student was built from."
        )
    fusions = {
        i: layer.self_attn.fusion
        for i, layer in enumerate(student.layers)
        if getattr(layer.self_attn, "fusion", None) is not None
    }
    if not fusions:
        return {}
    hybrid_cfg = student.layers[next(iter(fusions))].self_attn.hybrid_cfg
    if hybrid_cfg.fusion_init == "fit":
        ids = _calibration_ids(teacher, input_ids)
        teacher_graphdef, teacher_state = nnx.split(teacher)
        student_graphdef, student_state = nnx.split(student)
        fits = _fusion_fits(teacher_graphdef, teacher_state, student_graphdef, student_state, ids)
        written = {}
        for i, fusion in fusions.items():
            gamma, mu = (np.asarray(a) for a in fits[i])
            fusion.gamma.set_value(jnp.asarray(gamma, fusion.gamma.dtype))
            if fusion.mu is not None:
                fusion.mu.set_value(jnp.asarray(mu, fusion.mu.dtype))
            written[i] = gamma
        return written
    granularity = next(iter(fusions.values())).granularity
    rms = teacher_head_rms(teacher, input_ids, granularity)
    input_rms = {}
    if any(not f.normalize for f in fusions.values()):
        teacher_graphdef, teacher_state = nnx.split(teacher)
        student_graphdef, student_state = nnx.split(student)
        ids = _calibration_ids(teacher, input_ids)
        input_rms = _fusion_input_rms(
            teacher_graphdef, teacher_state, student_graphdef, student_state, ids, granularity
        )
    written = {}
    for i, fusion in fusions.items():
        gamma = rms[i][np.asarray(fusion.heads)]
        if i in input_rms:  # un-normalised input: scale its RMS to the teacher's (a silent head keeps γ = 0)
            n_rms = np.asarray(input_rms[i], np.float64)
            gamma = np.where(n_rms > 0, gamma / np.maximum(n_rms, 1e-30), 0.0)
        fusion.gamma.set_value(jnp.asarray(gamma, fusion.gamma.dtype))
        written[i] = gamma
    return written

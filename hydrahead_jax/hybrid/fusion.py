"""Calibration of the fusion scales γ (the fusion itself is ``hybrid.attention.ScaleFusion``).

γ starts at the teacher's measured per-head attention-output RMS (before o_proj) on a calibration batch, so the
fused heads start on the teacher's scale:

    γ_h = sqrt(mean_{b,t,c} o^teacher_{b,t,h,c}²)       (``head``)
    γ_{h,c} = sqrt(mean_{b,t} o^teacher_{b,t,h,c}²)     (``channel``)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.hybrid.attention import HydraHeadAttention
from hydrahead_jax.models.attention import Attention


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
    graphdef, state = nnx.split(teacher)
    return np.asarray(_head_rms(graphdef, state, ids, granularity))


def calibrate_fusion(student: nnx.Module, teacher: nnx.Module, input_ids) -> dict[int, np.ndarray]:
    """Set every fusion γ of ``student`` to the teacher's measured per-head output RMS on ``input_ids``.

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
    granularity = next(iter(fusions.values())).granularity
    rms = teacher_head_rms(teacher, input_ids, granularity)
    written = {}
    for i, fusion in fusions.items():
        gamma = rms[i][np.asarray(fusion.heads)]
        fusion.gamma.set_value(jnp.asarray(gamma, fusion.gamma.dtype))
        written[i] = gamma
    return written

"""Scale-normalised fusion of head outputs (our design; the paper's formula is not public).

For every head h the fusion touches (the LA heads for ``la_only``, all heads of the layer for ``both``):

    ô_{t,h} = γ_h ⊙ o_{t,h} / sqrt(mean_c o_{t,h,c}² + ε)          γ_h ∈ R (``head``) or R^D (``channel``)

then heads are concatenated in their original order and go through the teacher's o_proj. FA and LA heads
produce outputs of very different magnitude (a softmax average of values vs a delta-rule state read-out);
normalising each head and rescaling it to what the teacher's head produced puts them on the teacher's scale.
γ is learnable and initialised from the teacher's measured per-head output RMS on a calibration batch:

    γ_h = sqrt(mean_{b,t,c} o^teacher_{b,t,h,c}²)       (``head``)
    γ_{h,c} = sqrt(mean_{b,t} o^teacher_{b,t,h,c}²)     (``channel``)

``none`` leaves outputs untouched. A layer whose groups are all FA has no LA head to balance: it stays the
teacher's layer, without fusion, so an all-FA head map reproduces the teacher exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.models.attention import Attention


class ScaleFusion(nnx.Module):
    """Per-head RMS normalisation times a learnable γ for the query heads ``heads`` (original indices, sorted)."""

    def __init__(self, heads: tuple[int, ...], head_dim: int, *, granularity: str, eps: float, param_dtype):
        self.heads = tuple(heads)
        self.granularity = granularity
        self.eps = eps
        shape = (len(heads),) if granularity == "head" else (len(heads), head_dim)
        self.gamma = nnx.Param(
            jnp.ones(shape, param_dtype), out_sharding=("norm",) + (None,) * (len(shape) - 1), eager_sharding=False
        )

    def __call__(self, o: jax.Array) -> jax.Array:
        """o [B,T,len(heads),D], the touched heads in the order of ``heads`` → same shape and dtype."""
        o32 = o.astype(jnp.float32)
        o32 = o32 * jax.lax.rsqrt(jnp.mean(jnp.square(o32), axis=-1, keepdims=True) + self.eps)
        gamma = self.gamma[...].astype(jnp.float32)
        gamma = gamma[:, None] if self.granularity == "head" else gamma
        return (o32 * gamma).astype(o.dtype)


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
        attn = layer.self_attn
        q, k, v = attn.project(x, positions)
        out, _ = attn.full_attention(q, k, v, None, None)  # [B,T,Hq,D], before o_proj
        rms.append(jnp.sqrt(jnp.mean(jnp.square(out.astype(jnp.float32)), axis=axes)))
    return jnp.stack(rms)


def teacher_head_rms(teacher: nnx.Module, input_ids, granularity: str = "head") -> np.ndarray:
    """The teacher's per-head attention-output RMS (before o_proj): [L, Hq] (head) or [L, Hq, D] (channel)."""
    for i, layer in enumerate(teacher.layers):
        attn = layer.self_attn
        if not isinstance(attn, Attention) or attn.hybrid_cfg is not None:
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

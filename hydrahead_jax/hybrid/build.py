"""Build HydraHead students: from a loaded teacher (weights copied exactly) or at random (restore targets)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.attention import HydraHeadAttention, group_order, permute_groups
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.fusion import calibrate_fusion
from hydrahead_jax.hybrid.head_map import HeadMap
from hydrahead_jax.models.transformer import Transformer

# The parameters a student has and its teacher does not: Gated DeltaNet heads and fusion scales (stage 1 trains
# only these). Every other parameter is a copy of a teacher weight.
new_param_filter = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("gdn"), nnx.PathContains("fusion")))


def build_model(
    cfg: ModelConfig, head_map: HeadMap, hybrid_cfg: HybridConfig | None = None, rngs: nnx.Rngs | None = None
) -> Transformer:
    """A randomly initialised HydraHead model of ``cfg`` with the FA groups of ``head_map`` (layers with every
    group FA are plain softmax layers; layers with none are all Gated DeltaNet): the teacher's ``Transformer``
    with a ``HydraHeadAttention`` per layer, plugged in through its ``attention_factory``. Layer l's kind is its
    FA-group count and its parameters store its FA groups first (``group_order``)."""
    hybrid_cfg = HybridConfig() if hybrid_cfg is None else hybrid_cfg
    head_map.validate(cfg)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    counts = tuple(len(groups) for groups in head_map.fa_groups)

    def factory(i: int, r: nnx.Rngs) -> HydraHeadAttention:
        return HydraHeadAttention(
            cfg,
            rngs=r,
            fa_counts=counts,
            layer_fa=counts[i],
            hybrid_cfg=hybrid_cfg,
            attention_impl=hybrid_cfg.attention_implementation,
            context_parallel=hybrid_cfg.attention_context_parallel,
        )

    orders = tuple(group_order(groups, cfg.num_kv_heads) for groups in head_map.fa_groups)
    return Transformer(cfg, rngs=rngs, attention_factory=factory, layer_kinds=counts, group_order=orders)


def build_student(
    teacher: Transformer,
    head_map: HeadMap,
    hybrid_cfg: HybridConfig | None = None,
    *,
    rngs: nnx.Rngs | None = None,
    calibration_ids=None,
) -> Transformer:
    """A HydraHead student of ``teacher``: every teacher parameter (embeddings, norms, MLP, q/k/v/o and their
    biases, q/k norms, lm_head) copied exactly, each layer's KV groups permuted so its FA groups come first
    (``permute_groups``), new GDN/fusion parameters at their initial values, and the fusion scales set from the
    teacher on ``calibration_ids`` [B,T] when given. The student owns its arrays (copies), so it can be donated to
    a jitted step while the teacher stays usable."""
    student = build_model(teacher.cfg, head_map, hybrid_cfg, rngs)
    if any(o != tuple(range(teacher.cfg.num_kv_heads)) for o in teacher.group_order):
        raise ValueError("build_student needs the teacher (its KV groups in their original order), not a student.")
    teacher_params = nnx.state(teacher, nnx.Param)
    student_params = dict(nnx.to_flat_state(nnx.state(student, nnx.Param)))
    for path, var in nnx.to_flat_state(teacher_params):
        target = student_params.get(path)
        if target is None:
            raise ValueError(
                f"teacher parameter {'/'.join(map(str, path))} has no place in the student; "
                "was the teacher built from the same ModelConfig?"
            )
        if target.shape != var.shape or target.dtype != var.dtype:
            raise ValueError(
                f"teacher parameter {'/'.join(map(str, path))} is {var.shape} {var.dtype}, the "
                f"student's {target.shape} {target.dtype}."
            )
    # Copies, not shared buffers: donating the student's state to a train step must not delete the teacher's.
    params = jax.tree.map(jnp.copy, teacher_params)
    params["layers"] = permute_groups(params["layers"], teacher.cfg, student.group_order)
    nnx.update(student, params)
    if calibration_ids is not None:
        calibrate_fusion(student, teacher, calibration_ids)
    return student


def reused_param_paths(student: Transformer) -> list[tuple]:
    """Paths of the student's parameters that come from the teacher (all but ``new_param_filter``)."""
    new = {p for p, _ in nnx.to_flat_state(nnx.state(student, new_param_filter))}
    return [p for p, _ in nnx.to_flat_state(nnx.state(student, nnx.Param)) if p not in new]

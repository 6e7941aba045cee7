"""Build HydraHead students: from a loaded teacher (weights copied exactly) or at random (restore targets)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.attention import GROUPED_PARAMS, HydraHeadAttention, group_order, permute_groups
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.fusion import calibrate_fusion
from hydrahead_jax.hybrid.gdn_init import calibrate_gdn
from hydrahead_jax.hybrid.head_map import HeadMap
from hydrahead_jax.models.transformer import Transformer

# The parameters a student has and its teacher does not: Gated DeltaNet heads and fusion scales (stage 1 trains
# only these). Every other parameter is a copy of a teacher weight.
new_param_filter = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("gdn"), nnx.PathContains("fusion")))

PARAM_GROUPS = ("new", "attention", "other")  # the groups of per-group learning rates (StageConfig.lr_scale_*)


def _projections(*names: str):
    return nnx.All(nnx.Param, nnx.PathContains("self_attn"), nnx.Any(*(nnx.PathContains(n) for n in names)))


# StageConfig.train -> the parameters it may train. "new+la_qkv" adds the copied q/k/v projections (kernels and
# biases) and "new+la_qkvo" o_proj too, their updates restricted to the LA groups' slices by ``fa_slice_mask``: the
# kept FA groups read the same matrices and stay the teacher's exactly.
TRAIN_FILTERS = {
    "new": new_param_filter,
    "all": nnx.Param,
    "new+la_qkv": nnx.Any(new_param_filter, _projections("q_proj", "k_proj", "v_proj")),
    "new+la_qkvo": nnx.Any(new_param_filter, _projections("q_proj", "k_proj", "v_proj", "o_proj")),
}


def path_names(path) -> tuple[str, ...]:
    """The names along a parameter's path (a jax key path or a tuple of names)."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def param_group(path) -> str:
    """The parameter group of a parameter's path (a jax key path or a tuple of names): "new" (the GDN heads and
    fusion, as ``new_param_filter``), "attention" (the copied attention weights under ``self_attn``: q/k/v/o and
    the q/k norms), "other" (embeddings, MLPs, layer norms, lm_head)."""
    names = path_names(path)
    if "gdn" in names or "fusion" in names:
        return "new"
    return "attention" if "self_attn" in names else "other"


def trainable_filter(train: str, lr_scales: dict[str, float] | None = None):
    """The nnx filter of the parameters a stage trains: ``TRAIN_FILTERS[train]`` without the groups whose
    learning-rate scale is 0 (frozen)."""
    base = TRAIN_FILTERS[train]
    frozen = {g for g, scale in (lr_scales or {}).items() if scale == 0}
    if not frozen:
        return base
    return nnx.All(base, lambda path, _: param_group(path) not in frozen)


def fa_slice_mask(train: str, layer_fa: tuple[int, ...], num_kv_heads: int):
    """The update mask of a ``train`` choice that trains the LA groups' slices of shared projections
    (``"new+la_qkv"``, ``"new+la_qkvo"``), else None.

    Returns ``mask(path, shape)``: for a stacked projection parameter of shape [L, ...] (``GROUPED_PARAMS``) a 0/1
    float32 array broadcastable to it, 0 on layer l's first ``layer_fa[l]`` KV groups along the group axis (its FA
    groups, stored first) and 1 on the rest; None for every other parameter (trained whole). An all-FA layer's
    projections are then frozen, an all-LA layer's trained whole."""
    if not train.startswith("new+la_"):
        return None
    layer_fa = tuple(int(f) for f in layer_fa)

    def mask(path, shape):
        names = path_names(path)
        if names[-3:] not in GROUPED_PARAMS:
            if {key[1] for key in GROUPED_PARAMS} & set(names):  # a projection in a path form the table lacks
                raise ValueError(f"fa_slice_mask: {'/'.join(names)} is a projection of no known layout.")
            return None
        axis = GROUPED_PARAMS[names[-3:]][0]
        if shape[0] != len(layer_fa) or shape[axis] % num_kv_heads:
            raise ValueError(
                f"{'/'.join(names)} has shape {tuple(shape)}: expected {len(layer_fa)} stacked layers and an axis "
                f"{axis} of {num_kv_heads} KV groups."
            )
        width = shape[axis] // num_kv_heads
        trained = np.arange(shape[axis])[None, :] >= np.asarray(layer_fa)[:, None] * width  # [L, groups·width]
        out = [1] * len(shape)
        out[0], out[axis] = shape[0], shape[axis]
        return trained.astype(np.float32).reshape(out)

    return mask


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
    counts = head_map.fa_counts()

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
    (``permute_groups``), new GDN/fusion parameters at their initial values; with ``calibration_ids`` [B,T] the
    GDN decays and β from the teacher's heads (``gdn_init="teacher"``) and then the fusion scales from the
    teacher's head outputs (``fusion_init``). The student owns its arrays (copies), so it can be donated to a
    jitted step while the teacher stays usable."""
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
        if (hybrid_cfg or HybridConfig()).gdn_init == "teacher":
            calibrate_gdn(student, teacher, calibration_ids)  # first: the fusion is fitted to these GDN heads
        calibrate_fusion(student, teacher, calibration_ids)
    return student


def reused_param_paths(student: Transformer) -> list[tuple]:
    """Paths of the student's parameters that come from the teacher (all but ``new_param_filter``)."""
    new = {p for p, _ in nnx.to_flat_state(nnx.state(student, new_param_filter))}
    return [p for p, _ in nnx.to_flat_state(nnx.state(student, nnx.Param)) if p not in new]

"""flash_attention(implementation="cudnn"): NVIDIA's cuDNN fused attention behind our API, and ``auto`` on a GPU.

What this proves on a CPU (no CUDA runtime here: ``assume_cuda_runtime`` answers cuDNN's probes as an H200 with
cuDNN 9.10 would, ``tracing_for("gpu")`` makes the dispatch resolve as on a GPU): ``auto`` picks cuDNN exactly
where it covers the call and our Triton kernel elsewhere, with the mask that equals ours (read off the traced
program and off the StableHLO lowered for CUDA); ``cudnn`` asked for a call it cannot compute fails with the
reason; the HydraHead student's bf16 training step traced for an H200 runs cuDNN, forward and backward, for every
FA group (the teacher's and the student's) and no Triton attention kernel. cuDNN's values and gradients against the
reference are checked on the GPU itself (bench/gpu_check_flash_attention.py, its "cudnn" rows).
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from train_helpers import tiny_config, tiny_models

from hydrahead_jax.hybrid import build_model
from hydrahead_jax.training.steps import LossSettings, make_optimizer, make_train_step
from pallas_kernels.dispatch import tracing_for
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.cudnn import assume_cuda_runtime, cudnn_mask

BF16 = jnp.bfloat16


def _struct(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _kernels(jaxpr_text: str) -> collections.Counter:
    """cuDNN attention primitives and named Pallas kernels in a traced program (nested jaxprs included)."""
    found = re.findall(r"\b(dot_product_attention_(?:fwd|bwd)_wrapper)\b", jaxpr_text)
    found += re.findall(r"name=((?:flash_attention|gated_delta)\w*)", jaxpr_text)
    return collections.Counter(found)


def _traced_grad(b, t, s, hq, hkv, d, dtype=BF16, *, runtime=True, **kwargs) -> str:
    def loss(q, k, v):
        return flash_attention(q, k, v, **kwargs).astype(jnp.float32).sum()

    args = [_struct((b, t, hq, d), dtype), _struct((b, s, hkv, d), dtype), _struct((b, s, hkv, d), dtype)]
    with tracing_for("gpu"):
        if not runtime:
            return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
        with assume_cuda_runtime():
            return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))


CUDNN = {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}
TRITON = {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}


@pytest.mark.parametrize(
    "b,t,s,hq,hkv,d,dtype,kwargs,want,mask",
    [
        pytest.param(2, 256, 256, 8, 2, 128, BF16, {}, CUDNN, "CAUSAL", id="gqa-causal-self"),
        pytest.param(1, 100, 100, 4, 4, 64, jnp.float16, {}, CUDNN, "CAUSAL", id="fp16-ragged-length"),
        pytest.param(1, 2, 300, 8, 2, 128, BF16, dict(q_offset=299), CUDNN, "NO_MASK", id="all-keys-visible"),
        pytest.param(1, 128, 384, 4, 1, 64, BF16, dict(causal=False), CUDNN, "NO_MASK", id="non-causal-S>T"),
        pytest.param(1, 128, 256, 4, 2, 64, BF16, {}, TRITON, None, id="prefill-continuation"),
        pytest.param(1, 256, 256, 4, 2, 64, jnp.float32, {}, TRITON, None, id="float32"),
        pytest.param(1, 256, 256, 4, 2, 260, BF16, {}, TRITON, None, id="head-dim-260"),
        pytest.param(1, 256, 256, 4, 2, 20, BF16, {}, TRITON, None, id="head-dim-20"),
        pytest.param(1, 255, 255, 4, 2, 64, BF16, {}, TRITON, None, id="odd-length"),
    ],
)
def test_auto_on_a_gpu_takes_cudnn_where_it_covers_the_call(b, t, s, hq, hkv, d, dtype, kwargs, want, mask):
    jaxpr = _traced_grad(b, t, s, hq, hkv, d, dtype, **kwargs)
    assert set(_kernels(jaxpr)) == want, _kernels(jaxpr)
    if mask is not None:
        assert set(re.findall(r"mask_type=MaskType\.(\w+)", jaxpr)) == {mask}


def test_packed_documents_take_our_kernel():
    def loss(q, ids):
        return flash_attention(q, q, q, segment_ids=ids).astype(jnp.float32).sum()

    with tracing_for("gpu"), assume_cuda_runtime():
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(_struct((1, 256, 4, 64)), _struct((1, 256), jnp.int32)))
    assert set(_kernels(jaxpr)) == TRITON


def test_without_a_cudnn_runtime_auto_takes_our_kernel():
    assert set(_kernels(_traced_grad(1, 256, 256, 4, 2, 64, runtime=False))) == TRITON


def test_the_cuda_lowering_holds_cudnns_fused_attention_with_our_mask():
    """Lowered to StableHLO for CUDA (no GPU needed): the custom calls XLA hands to cuDNN, forward and backward,
    with the causal mask in their backend config."""

    def loss(q, k, v):
        return flash_attention(q, k, v).astype(jnp.float32).sum()

    args = [_struct((2, 256, 8, 128)), _struct((2, 256, 2, 128)), _struct((2, 256, 2, 128))]
    with tracing_for("gpu"), assume_cuda_runtime():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = set(re.findall(r"custom_call @([\w$]+)", text))
    assert targets == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, targets
    # The backend config's quotes are escaped as \22 in the MLIR text.
    masks = set(re.findall(r"\\22mask_type\\22: \\22(\w+)\\22", text))
    assert masks == {"CAUSAL"}, masks


@pytest.mark.parametrize(
    "shape_q,shape_kv,dtype,kwargs,match",
    [
        ((1, 256, 4, 64), (1, 256, 2, 64), jnp.float32, {}, "bfloat16/float16"),
        ((1, 128, 4, 64), (1, 256, 2, 64), BF16, {}, "top-left"),
        ((1, 256, 4, 260), (1, 256, 2, 260), BF16, {}, "head dim 260"),
        ((1, 255, 4, 64), (1, 255, 2, 64), BF16, {}, "even lengths"),
        ((1, 256, 4, 64), (1, 256, 2, 64), BF16, dict(segment_ids=True), "segment ids"),
    ],
    ids=["float32", "prefill-continuation", "head-dim", "odd-length", "packed"],
)
def test_cudnn_refuses_what_it_does_not_cover(shape_q, shape_kv, dtype, kwargs, match):
    q, kv = jnp.zeros(shape_q, dtype), jnp.zeros(shape_kv, dtype)
    if kwargs.get("segment_ids"):
        kwargs = dict(segment_ids=jnp.ones(shape_q[:2], jnp.int32))
    with tracing_for("gpu"), assume_cuda_runtime(), pytest.raises(ValueError, match=match):
        jax.make_jaxpr(lambda q, kv: flash_attention(q, kv, kv, implementation="cudnn", **kwargs))(q, kv)


def test_cudnn_off_a_gpu_is_refused_with_the_fix():
    x = jnp.zeros((1, 128, 2, 64), BF16)
    with pytest.raises(ValueError, match="runs on a gpu only .* use 'auto' or 'xla'"):
        flash_attention(x, x, x, implementation="cudnn")
    with tracing_for("gpu"), pytest.raises(ValueError, match="no cuDNN runtime"):
        jax.make_jaxpr(lambda x: flash_attention(x, x, x, implementation="cudnn"))(x)


@pytest.mark.parametrize(
    "causal,q_offset,t,s,want",
    [(False, 0, 5, 9, "none"), (True, 8, 1, 9, "none"), (True, 0, 9, 9, "causal"), (True, 4, 5, 9, None)],
)
def test_cudnn_mask_equals_our_visibility_rule(causal, q_offset, t, s, want):
    """cuDNN's masks by hand: none (all visible) and top-left causal (j <= i); ours is j <= i + q_offset."""
    assert cudnn_mask(causal, q_offset, t, s) == want
    if want is not None:
        ours = [[(not causal) or j <= i + q_offset for j in range(s)] for i in range(t)]
        theirs = [[want == "none" or j <= i for j in range(s)] for i in range(t)]
        assert ours == theirs


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed-documents"])
def test_student_train_step_for_an_h200_runs_cudnn_for_every_fa_group(packed):
    """The tiny recipe's bf16 distillation step (forward, gradient, optimizer) traced for an H200: every FA group of
    the student and the teacher runs cuDNN, forward and (the student's) backward, and no Triton attention kernel is
    left; the LA heads keep our gated delta kernels. Packed documents (segment ids) keep our Triton kernel."""
    c = tiny_config()
    c.teacher.model.dtype = "bfloat16"
    c.teacher.model.head_dim = 16
    cfg, teacher, head_map, hybrid = tiny_models(c)
    assert hybrid.attention_implementation == "auto"
    student = build_model(cfg, head_map, hybrid, nnx.Rngs(0))
    gd, params, frozen = nnx.split(student, nnx.Param, ...)
    teacher_gd, teacher_state = nnx.split(teacher)
    tx, schedule = make_optimizer(lr=1e-3, warmup_steps=2, total_steps=10)
    step = make_train_step(gd, teacher_gd, tx, LossSettings(kind="distil", chunk=16))
    pure = nnx.as_pure(params)
    state = dict(params=pure, frozen=nnx.as_pure(frozen), opt_state=tx.init(pure), step=jnp.zeros((), jnp.int32))
    rows = _struct((2, int(c.stage2.seq_len)), jnp.int32)
    batch = {name: rows for name in ("input_ids", "targets", "positions")}
    batch["loss_mask"] = _struct(rows.shape, jnp.float32)
    if packed:
        batch["segment_ids"] = rows
    learning_rate = schedule(0)
    with tracing_for("gpu"), assume_cuda_runtime():
        kernels = _kernels(str(jax.make_jaxpr(step)(state, nnx.as_pure(teacher_state), batch, learning_rate)))
    attention = {k: n for k, n in kernels.items() if not k.startswith("gated_delta")}
    assert any(k.startswith("gated_delta") for k in kernels), kernels
    if packed:
        assert set(attention) == TRITON, kernels
    else:
        assert set(attention) == CUDNN, kernels


def test_every_stage_with_cudnn_named_runs_it_for_every_fa_group():
    """bench/gpu_check_end_to_end.py's device runs name ``attention_implementation="cudnn"`` (no fallback) with
    ``data.mask_documents=False``: each stage's bf16 train step, traced for an H200, takes cuDNN for every FA group
    (the teacher's and the student's; align trains only the GDN heads, so no attention backward there) and our
    gated delta kernels for the LA heads, and no call is refused, although the batch carries segment ids."""
    from hydrahead_jax.hybrid.build import trainable_filter

    c = tiny_config()
    c.teacher.model.dtype = "bfloat16"
    c.teacher.model.head_dim = 16
    c.hybrid.attention_implementation, c.hybrid.gdn_implementation = "cudnn", "pallas"
    cfg, teacher, head_map, hybrid = tiny_models(c)
    student = build_model(cfg, head_map, hybrid, nnx.Rngs(0))
    teacher_gd, teacher_state = nnx.split(teacher)
    rows = _struct((2, int(c.stage2.seq_len)), jnp.int32)
    batch = {name: rows for name in ("input_ids", "targets", "positions", "segment_ids")}
    batch["loss_mask"] = _struct(rows.shape, jnp.float32)
    backward = {"align": 0, "distil": 1, "long": 1}  # the student's FA layer; the teacher runs forward only
    for kind, train in (("align", "new"), ("distil", "all"), ("long", "all")):
        gd, params, frozen = nnx.split(student, trainable_filter(train), ...)
        tx, schedule = make_optimizer(lr=1e-3, warmup_steps=2, total_steps=10)
        step = make_train_step(gd, teacher_gd, tx, LossSettings(kind=kind, chunk=16, mask_documents=False))
        pure = nnx.as_pure(params)
        state = dict(params=pure, frozen=nnx.as_pure(frozen), opt_state=tx.init(pure), step=jnp.zeros((), jnp.int32))
        with tracing_for("gpu"), assume_cuda_runtime():
            kernels = _kernels(str(jax.make_jaxpr(step)(state, nnx.as_pure(teacher_state), batch, schedule(0))))
        assert not set(kernels) & TRITON and kernels["dot_product_attention_bwd_wrapper"] == backward[kind], kernels
        assert kernels["dot_product_attention_fwd_wrapper"] >= 1 and kernels["gated_delta_grads"] == 1, (kind, kernels)

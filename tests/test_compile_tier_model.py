"""Compile tier, model level: the tiny recipe's jitted train step compiles for an 8-chip TPU slice, Pallas kernels
included.

No TPU is needed: ``pallas_kernels.cross_compile.compile_for_tpu`` compiles with the real TPU compiler (libtpu's
compile-only devices) for every chip of a v5e slice, the arguments sharded over a mesh of them, so the kernels
resolve to their Mosaic (``pallas_tpu``) versions and XLA:TPU partitions and compiles the whole step as it would on
the slice. A Mosaic call left to XLA's partitioner on sharded operands fails there ("Mosaic kernels cannot be
automatically partitioned"): the control test removes the model's ``shard_map`` wrapping and sees exactly that
failure, so the passing case proves the wrapping, not a lenient compiler.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from train_helpers import tiny_config, tiny_models

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model, gdn
from hydrahead_jax.hybrid import attention as hybrid_attention
from hydrahead_jax.models import Transformer
from hydrahead_jax.models import attention as teacher_attention
from hydrahead_jax.models.attention import TOKEN_CACHE_KEYS
from hydrahead_jax.training import sharding as shd
from hydrahead_jax.training.steps import LossSettings, compute_loss, make_optimizer, make_train_step
from pallas_kernels.cross_compile import compile_for_tpu, format_tpu_table, tpu_mesh

# The compile tier is in the end-to-end tier (`make test-all`); libtpu from its own folder (conftest's `libtpu`).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("libtpu")]

SLICE = "v5e:2x4"  # 8 chips


def _specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


def compile_tiny_train_step(
    mesh_axes: dict[str, int], batch_size: int, *, gradient: bool = True, head_dim: int = 0, seq_len: int = 0
):
    """The tiny recipe's stage-2 (distillation) train step (``gradient=False``: its loss alone) compiled for the 8
    chips of a v5e slice on a mesh of ``mesh_axes`` (a ``TpuCompiled``), parameters and optimizer state placed by
    the logical-axis rules, the batch split over (data, fsdp). The recipe's kernel implementations are "auto":
    Mosaic on a TPU. ``head_dim`` / ``seq_len`` (0: the recipe's) reshape the 2-layer model and its rows."""
    c = tiny_config()
    if head_dim:
        c.teacher.model.head_dim = head_dim
    if seq_len:
        c.stage2.seq_len = seq_len
    scfg = c.stage2
    cfg, teacher, head_map, hybrid = tiny_models(c)
    assert hybrid.gdn_implementation == hybrid.attention_implementation == "auto"
    mesh = tpu_mesh(SLICE, mesh_axes)
    student = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid, nnx.Rngs(0)))
    gd, params, frozen = nnx.split(student, nnx.Param, ...)
    teacher_gd, teacher_state = nnx.split(teacher)
    tx, schedule = make_optimizer(lr=float(scfg.lr), warmup_steps=2, total_steps=int(scfg.steps))
    settings = LossSettings(kind="distil", chunk=int(scfg.loss_chunk))
    train_step = make_train_step(gd, teacher_gd, tx, settings)

    def step(state, teacher_state, batch):  # compile-only: the learning rate's value changes no operation
        return train_step(state, teacher_state, batch, schedule(0))

    if not gradient:

        def step(state, teacher_state, batch):
            student = nnx.merge(gd, state["params"], state["frozen"])
            return compute_loss(student, nnx.merge(teacher_gd, teacher_state), batch, settings)[0]

    p_sh = shd.state_shardings(params, mesh)
    pure_params = nnx.as_pure(params)
    state = {
        "params": pure_params,
        "frozen": nnx.as_pure(frozen),
        "opt_state": jax.eval_shape(tx.init, pure_params),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    state_specs = {
        "params": _specs(p_sh),
        "frozen": _specs(shd.state_shardings(frozen, mesh)),
        "opt_state": _specs(shd.optimizer_shardings(tx, pure_params, p_sh, mesh)),
        "step": jax.sharding.PartitionSpec(),
    }
    teacher_pure = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.as_pure(teacher_state))
    teacher_specs = _specs(shd.state_shardings(teacher_state, mesh))
    rows = jax.ShapeDtypeStruct((batch_size, int(scfg.seq_len)), jnp.int32)
    # The data pipeline's full batch: packed documents reach both kernels as segment ids (data.mask_documents).
    batch = {name: rows for name in ("input_ids", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(rows.shape, jnp.float32)
    batch_spec = shd.logical_to_spec(("batch", None), rows.shape, mesh)
    assert batch_spec != jax.sharding.PartitionSpec(None, None), "the batch must really be split for this test"
    return compile_for_tpu(
        step,
        state,
        teacher_pure,
        batch,
        topology=SLICE,
        mesh_axes=mesh_axes,
        in_specs=(state_specs, teacher_specs, jax.tree.map(lambda _: batch_spec, batch)),
    )


def mosaic_kernels(compiled) -> collections.Counter:
    """{kernel name: number of Mosaic calls} of a compiled program."""
    return collections.Counter(k.name for k in compiled.kernels)


@pytest.mark.parametrize(
    "mesh_axes, batch_size",
    [({"data": 8, "fsdp": 1, "tensor": 1}, 8), ({"data": 2, "fsdp": 2, "tensor": 2}, 4)],
    ids=["data8", "data2-fsdp2-tensor2"],
)
def test_tiny_train_step_compiles_for_a_tpu_slice(mesh_axes, batch_size, show):
    forward_program = compile_tiny_train_step(mesh_axes, batch_size, gradient=False)
    train_program = compile_tiny_train_step(mesh_axes, batch_size)
    rows = [(f"tiny recipe loss {mesh_axes}", forward_program), (f"tiny recipe train step {mesh_axes}", train_program)]
    show("\n" + format_tpu_table(rows))
    forward, train = mosaic_kernels(forward_program), mosaic_kernels(train_program)
    # Forward: the teacher's and the student's flash attention and the student's gated delta rule, each in its
    # model's scan body (both layers of the tiny student have one FA group: one kind, one body per model).
    families = ("flash_attention", "gated_delta")
    for counts in (forward, train):
        assert all(any(name.startswith(f) for name in counts) for f in families), counts
    assert sum(forward.values()) >= 3, forward
    # The gradient adds the backward kernels of the student's two kernels (in the backward scan body).
    assert sum(train.values()) >= sum(forward.values()) + 2, (forward, train)
    assert set(train) > set(forward), (forward, train)
    assert train_program.chips == 8 and train_program.peak_bytes < train_program.hbm_bytes


def test_two_layer_hybrid_compiles_with_splash_for_the_fa_groups(show):
    """At head dim 128 and 256-token rows (what splash covers), the 2-layer hybrid's train step compiled for the
    8-chip v5e slice with the batch over the chips runs Google's splash attention for every FA group (the
    student's and the teacher's, forward and backward, packed documents as segment ids) and our gated delta kernels
    for the LA heads; none of our flash attention kernels is left."""
    program = compile_tiny_train_step({"data": 8, "fsdp": 1, "tensor": 1}, 8, head_dim=128, seq_len=256)
    show("\n" + format_tpu_table([("2-layer hybrid d=128 T=256, splash", program)]))
    kernels = mosaic_kernels(program)
    splash = {n for n in kernels if n.startswith("splash_mha_")}
    assert {n.split("_")[2] for n in splash} == {"fwd", "dq", "dkv"}, kernels
    assert all("segmented" in n for n in splash), kernels
    assert any(n.startswith("gated_delta") for n in kernels), kernels
    assert not any(n.startswith("flash_attention") for n in kernels), kernels
    assert program.peak_bytes < program.hbm_bytes


def test_control_kernels_outside_shard_map_do_not_compile(monkeypatch):
    def unwrapped(kernel, *args, in_axes, out_axes):
        return kernel(*args)

    for module in (teacher_attention, gdn):
        monkeypatch.setattr(module, "kernel_call", unwrapped)
    assert hybrid_attention.Attention is teacher_attention.Attention
    with pytest.raises(Exception, match="cannot be automatically partitioned"):
        compile_tiny_train_step({"data": 8, "fsdp": 1, "tensor": 1}, 8)


def _stack_copies(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """The copy instructions of compiled HLO text whose result has one of ``shapes`` (whole cache stacks)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\S* copy(?:-start)?\(", line)
        if m and tuple(int(d) for d in m.group(1).split(",")) in shapes:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("student", [False, True], ids=["teacher", "student"])
def test_decode_step_for_a_tpu_chip_copies_no_cache_stack(student):
    """The jitted decode step (cache donated) of a 3-layer model with head dim 128 compiled for one v5e chip: the
    layers' k/v stacks are updated in place, never copied whole. The student has three layer kinds (FA counts 1,
    0, 2: the scan's body is a switch over them). A copy of a whole [L, B, S, …] stack is what a cache write that is
    not in place, or a layout the loop forces on the stacks, shows up as; SmolLM2's head dim 64 gets such a relayout
    around the loop (bench/RESULTS.md, "The decode fix"), so this guards head dims of 128 and up."""
    c = tiny_config()
    c.teacher.model.head_dim = 128
    c.teacher.model.num_layers = 3
    cfg = ModelConfig.from_dict(dict(c.teacher.model))
    hybrid = HybridConfig.from_dict(dict(c.hybrid))
    if student:
        head_map = HeadMap.from_fa_groups(cfg, [[0], [], [0, 1]], method="test")
        make = lambda: build_model(cfg, head_map, hybrid.replace(gdn_implementation="xla"), nnx.Rngs(0))  # noqa: E731
    else:
        make = lambda: Transformer(cfg, rngs=nnx.Rngs(0), attention_impl="xla")  # noqa: E731
    model = nnx.eval_shape(make)
    gd, state = nnx.split(model)
    context = 512
    cache = jax.eval_shape(lambda: model.init_cache(1, context))
    kinds = len(cache["layers"])
    assert kinds == (3 if student else 1)
    sharding = jax.sharding.NamedSharding(tpu_mesh(SLICE), jax.sharding.PartitionSpec())
    placed = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)  # noqa: E731

    def decode_step(state, token, cache):
        logits, cache = nnx.merge(gd, state)(token[:, None], cache=cache)
        return logits[:, -1], cache

    token = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=sharding)
    compiled = jax.jit(decode_step, donate_argnums=(2,)).lower(placed(state), token, placed(cache)).compile()
    # The token-indexed stacks (k, v: [L_kind, B, S, g, d], what grows with the context). The constant-size conv
    # states ([L_kind, B, 3, C], a few KiB) do get relaid around the loop (T(1,128) tiles outside, T(4,128) in it).
    stacks = {a.shape for layer in cache["layers"] for name, a in layer.items() if name in TOKEN_CACHE_KEYS}
    assert len(stacks) == (2 if student else 1) and all(s[2] == context for s in stacks), stacks
    copies = _stack_copies(compiled.as_text(), stacks)
    assert copies == [], "\n".join(copies)

"""Packed documents through the whole model: a row holding several documents (``segment_ids``, per-document
``positions``) gives, for every document, what running that document alone gives — hidden states, gradients and
the train step's losses — for the teacher and a HydraHead student (FA groups, GDN heads with conv, fusion).

The reference is independent of the masking code: each document is run on its own, with no segment ids and default
positions 0 … L−1, as one row of a batch of all the documents right-padded to a common length (the model is causal,
so padding after a document cannot change its tokens' results; one compile instead of one per length).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.data.rows import pack_row
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
from hydrahead_jax.models.transformer import Transformer
from hydrahead_jax.training.steps import LossSettings, compute_loss, token_layout

CFG = ModelConfig(
    vocab_size=53,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    rms_norm_eps=1e-5,
)
# GDN chunks of 16 tokens: the 23-token document spans two chunks, the 5- and 1-token ones sit inside one, and the
# 16-token one starts exactly on a chunk boundary in the first row. Rows end with padding (segment 0).
ROWS = ((5, 1, 10, 16, 3), (23, 1, 2, 9))
ROW_LEN = 40
HYBRID = HybridConfig(gdn_chunk_size=16, conv_size=4)


def _perturbed_teacher(seed=0):
    """A random teacher with biases and norm weights away from 0 and 1 (so every parameter matters)."""
    teacher = Transformer(CFG, rngs=nnx.Rngs(seed))
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(teacher, nnx.Param))):
        noise = jax.random.normal(jax.random.key(100 + i), var.shape) * 0.1
        var.set_value(var[...] + noise.astype(var.dtype))
    return teacher


@functools.cache
def _models():
    teacher = _perturbed_teacher()
    head_map = HeadMap.from_fa_groups(CFG, [[1], []], method="test")  # layer 0 hybrid, layer 1 all GDN
    student = build_student(teacher, head_map, HYBRID, rngs=nnx.Rngs(3))
    # Move the new GDN / fusion parameters off their initial values (zero projections, γ) so they matter too.
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(student, nnx.Param))):
        if "gdn" in path or "fusion" in path:
            noise = jax.random.normal(jax.random.key(200 + i), var.shape) * 0.2
            var.set_value(var[...] + noise.astype(var.dtype))
    return teacher, student


def models():
    teacher, student = _models()
    return nnx.clone(teacher), nnx.clone(student)


def documents(rows=ROWS, seed=0):
    """Per row: the documents' token arrays (random, seeded)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in row] for row in rows]


def packed_batch(docs_per_row, row_len=ROW_LEN):
    """The training batch ``pack_row`` builds from these documents (padding after the last one)."""
    rows = []
    for docs in docs_per_row:
        tokens = np.concatenate(docs)
        doc_ids = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
        pad = row_len + 1 - len(tokens)
        assert pad >= 1, "the documents must leave room for at least one padding token"
        rows.append(
            pack_row(np.concatenate([tokens, np.zeros(pad, np.int32)]), np.concatenate([doc_ids, -np.ones(pad)]))
        )
    return {key: jnp.asarray(np.stack([r[key] for r in rows])) for key in rows[0]}


def spans(docs):
    starts = np.cumsum([0] + [len(d) for d in docs])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def alone(docs_per_row):
    """Every document as its own row, right-padded with token 0 to the longest: (ids [N, L], weights [N, L])
    with weight 1 on the documents' tokens."""
    docs = [d for row in docs_per_row for d in row]
    length = max(len(d) for d in docs)
    ids = np.zeros((len(docs), length), np.int32)
    weights = np.zeros((len(docs), length), np.float32)
    for i, d in enumerate(docs):
        ids[i, : len(d)], weights[i, : len(d)] = d, 1.0
    return jnp.asarray(ids), weights


@functools.partial(jax.jit, static_argnums=0)
def _hidden(graphdef, state, ids, positions, segment_ids):
    return nnx.merge(graphdef, state).hidden_states(ids, positions=positions, segment_ids=segment_ids)[0]


def hidden(model, ids, positions=None, segment_ids=None):
    return np.asarray(_hidden(*nnx.split(model), ids, positions, segment_ids))


@pytest.mark.parametrize("which", ["teacher", "student"])
def test_packed_row_hidden_states_equal_each_document_alone(which):
    model = dict(zip(("teacher", "student"), models()))[which]
    docs_per_row = documents()
    batch = packed_batch(docs_per_row)
    packed = hidden(model, batch["input_ids"], batch["positions"], batch["segment_ids"])
    ids, _ = alone(docs_per_row)
    reference = hidden(model, ids)
    n = 0
    for row, docs in enumerate(docs_per_row):
        for doc, span in zip(docs, spans(docs)):
            np.testing.assert_allclose(packed[row, span], reference[n, : len(doc)], rtol=2e-5, atol=2e-5)
            n += 1
    # Without segment ids the same row is one causal sequence: later documents see the earlier ones.
    unmasked = hidden(model, batch["input_ids"])
    second = spans(docs_per_row[0])[2]
    assert np.max(np.abs(unmasked[0, second] - packed[0, second])) > 1e-3


def test_packed_row_gradients_equal_sum_over_documents():
    """∂/∂θ of Σ_t ⟨h_t, r_t⟩ over the packed rows equals the same loss over the documents run alone (r_t: fixed
    random vectors, the same for a token in both layouts), so every parameter's gradient sums per document."""
    _, student = models()
    docs_per_row = documents()
    batch = packed_batch(docs_per_row)
    ids, weights = alone(docs_per_row)
    r = np.asarray(jax.random.normal(jax.random.key(7), (ids.shape[0], ids.shape[1], CFG.hidden_size)))
    r = r * weights[..., None]  # padding after a document gets no weight
    r_packed = np.zeros((len(docs_per_row), ROW_LEN, CFG.hidden_size), np.float32)
    n = 0
    for row, docs in enumerate(docs_per_row):
        for doc, span in zip(docs, spans(docs)):
            r_packed[row, span] = r[n, : len(doc)]
            n += 1

    def packed_loss(model):
        h = model.hidden_states(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])[0]
        return jnp.sum(h.astype(jnp.float32) * r_packed)

    def alone_loss(model):
        return jnp.sum(model.hidden_states(ids)[0].astype(jnp.float32) * r)

    graphdef, params, rest = nnx.split(student, nnx.Param, ...)
    grad_of = lambda fn: jax.jit(jax.grad(lambda p: fn(nnx.merge(graphdef, p, rest))))  # noqa: E731
    flat_got = nnx.to_flat_state(grad_of(packed_loss)(params))
    flat_want = dict(nnx.to_flat_state(grad_of(alone_loss)(params)))
    for path, value in flat_got:
        expected = np.asarray(flat_want[path][...])
        np.testing.assert_allclose(np.asarray(value[...]), expected, rtol=1e-4, atol=2e-5 * np.abs(expected).max())
    assert len(flat_got) == len(flat_want)
    assert any("gdn" in p for p, _ in flat_got) and any("fusion" in p for p, _ in flat_got)


def test_one_hybrid_layer_values_and_input_gradients_per_document():
    """The HydraHead attention block alone (FA group + GDN heads + conv + fusion) on packed inputs x: its outputs and
    ∂/∂x of Σ⟨out, r⟩ equal those of each document's x run alone."""
    _, student = models()
    layer = functools.partial(student.layer(0).self_attn, kind=student.layer_kinds[0])
    docs_per_row = documents()
    batch = packed_batch(docs_per_row)
    rng = np.random.default_rng(5)
    x_packed = rng.normal(size=(len(docs_per_row), ROW_LEN, CFG.hidden_size)).astype(np.float32)
    ids, weights = alone(docs_per_row)
    x_alone = np.zeros((ids.shape[0], ids.shape[1], CFG.hidden_size), np.float32)
    r_packed = rng.normal(size=x_packed.shape).astype(np.float32)
    r_alone = np.zeros_like(x_alone)
    n = 0
    for row, docs in enumerate(docs_per_row):
        for doc, span in zip(docs, spans(docs)):
            x_alone[n, : len(doc)], r_alone[n, : len(doc)] = x_packed[row, span], r_packed[row, span]
            n += 1
    pad = (np.asarray(batch["segment_ids"]) == 0)[..., None]
    r_packed = np.where(pad, 0.0, r_packed)  # the padding tail is not a document

    @jax.jit
    def packed(x):
        out = layer(x, batch["positions"], segment_ids=batch["segment_ids"])[0]
        return out, jnp.sum(out * r_packed)

    @jax.jit
    def run_alone(x):
        t = x.shape[1]
        out = layer(x, jnp.broadcast_to(jnp.arange(t), x.shape[:2]))[0]
        return out, jnp.sum(out * r_alone)

    out_p, dx_p = packed(x_packed)[0], jax.grad(lambda x: packed(x)[1])(x_packed)
    out_a, dx_a = run_alone(x_alone)[0], jax.grad(lambda x: run_alone(x)[1])(x_alone)
    n = 0
    for row, docs in enumerate(docs_per_row):
        for doc, span in zip(docs, spans(docs)):
            np.testing.assert_allclose(out_p[row, span], out_a[n, : len(doc)], rtol=2e-5, atol=2e-5)
            np.testing.assert_allclose(dx_p[row, span], dx_a[n, : len(doc)], rtol=2e-5, atol=2e-5)
            n += 1


def alone_batch(docs_per_row):
    """The documents run alone as a training batch: each row one document (right-padded), its L−1 in-document next
    tokens as targets (mask 0 on its last token and on the padding)."""
    ids, weights = alone(docs_per_row)
    targets = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    mask = weights * np.concatenate([weights[:, 1:], np.zeros_like(weights[:, :1])], axis=1)
    return {"input_ids": ids, "targets": targets, "loss_mask": jnp.asarray(mask)}


@pytest.mark.parametrize("kind", ["align", "distil", "long"])
def test_train_loss_on_packed_rows_is_token_weighted_loss_of_the_documents(kind):
    """Every stage loss is a masked token mean, so on packed rows it must equal the loss of the documents run one
    by one, weighted by their in-document targets: Σ_i S_i / Σ_i N_i (what the batch of documents alone gives)."""
    teacher, student = models()
    docs_per_row = documents()
    settings = LossSettings(kind=kind, chunk=16, kl_weight=0.5 if kind == "long" else 0.0)
    loss = jax.jit(lambda b: compute_loss(student, teacher, b, settings)[0])
    packed = loss(packed_batch(docs_per_row))
    reference = alone_batch(docs_per_row)
    assert float(reference["loss_mask"].sum()) == sum(max(len(d) - 1, 0) for row in docs_per_row for d in row)
    np.testing.assert_allclose(float(packed), float(loss(reference)), rtol=2e-5)


def test_mask_documents_off_runs_the_row_as_one_sequence():
    """data.mask_documents=False: the packed row is one causal sequence at positions 0 … T−1 (the CE loss worked
    out from the plain forward's logits), and still no target crosses into the next document."""
    _, student = models()
    batch = packed_batch(documents())
    positions, segment_ids = token_layout(batch, mask_documents=False)
    assert segment_ids is None
    np.testing.assert_array_equal(np.asarray(positions), np.broadcast_to(np.arange(ROW_LEN), (2, ROW_LEN)))
    loss = jax.jit(
        lambda b, mask_documents: compute_loss(
            student, None, b, LossSettings(kind="long", chunk=16, mask_documents=mask_documents)
        )[0],
        static_argnums=1,
    )
    unmasked = loss(batch, False)
    logits = np.asarray(jax.jit(lambda ids: student(ids))(batch["input_ids"]), np.float64)
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    mask = np.asarray(batch["loss_mask"])
    np.testing.assert_allclose(float(unmasked), np.sum(nll * mask) / mask.sum(), rtol=2e-5)
    assert abs(float(loss(batch, True)) - float(unmasked)) > 1e-4  # the switch changes the math


def test_segment_ids_are_refused_where_they_cannot_apply():
    teacher, student = models()
    batch = packed_batch(documents())
    with pytest.raises(ValueError, match="per-document positions"):
        teacher.hidden_states(batch["input_ids"], segment_ids=batch["segment_ids"])
    cache = student.init_cache(2, ROW_LEN)
    with pytest.raises(ValueError, match="cannot be combined with a KV/state cache"):
        student.hidden_states(
            batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"], cache=cache
        )

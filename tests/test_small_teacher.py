"""The reproduction's teacher (experiments/small_teacher.py): the batches and labels of its phases (a two-stage recall
curriculum, then the mixture), checked against the MQAR rule worked out per row (the label after a queried key is
the value paired with it), its learning rate against the schedule worked out by hand, its loss against a numpy
loop, and training's resume against an uninterrupted run."""

import dataclasses
import json

import numpy as np
import pytest

from hydrahead_jax.experiments.reproduce import quick_study
from hydrahead_jax.experiments.small_teacher import (
    RecallStage,
    TeacherData,
    _optimizer,
    answer_loss,
    answer_positions,
    grow_layers,
    init_teacher,
    learning_rate,
    train_teacher,
    train_tokenizer,
    weighted_loss,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog near the river bank. " * 30,
    "Pack my box with five dozen liquor jugs, said the old sailor to the crew. " * 30,
]
# the quick study's tiny teacher (2 layers x 4 KV groups), with two curriculum stages (the first on one layer, then
# grown to two) and the mixture
RECIPE = dataclasses.replace(
    quick_study().teacher,
    vocab_size=300,
    seq_len=512,  # the needle prompts of this tiny vocabulary need most of it
    steps=3,
    recall=(
        RecallStage(steps=2, batch_size=16, seq_len=32, pairs=(2, 8), num_layers=1),
        RecallStage(1, 8, 64, (9, 16)),
    ),
    lm_head_init_scale=1.0,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(TEXT, RECIPE, tmp_path_factory.mktemp("tok") / "tok")


def answers_by_rule(row: np.ndarray, keys: set[int], values: set[int]) -> list[int]:
    """Positions t whose next token is determined: ids[t] is a key already paired earlier in the row (key, value)
    and ids[t + 1] is that value. The pairs come first, so the first occurrence of a key is its pair."""
    paired, out = {}, []
    for t in range(len(row) - 1):
        k, v = int(row[t]), int(row[t + 1])
        if k in keys and v in values:
            if k in paired:
                assert paired[k] == v, "a key is asked with the value it was paired with"
                out.append(t)
            else:
                paired[k] = v
    return out


def test_curriculum_then_mixture_batches_label_the_answers(tokenizer):
    data = TeacherData(RECIPE, tokenizer, TEXT)
    sym = RECIPE.symbols.ids(tokenizer)
    keys, values = set(sym.keys.tolist()), set(sym.values.tolist())
    ids, w = data.batch(0)
    assert ids.shape == (16, 32) and w.shape == (16, 31) and ids.dtype == np.int32
    counts = []
    for row, wr in zip(ids, w):
        expected = answers_by_rule(row, keys, values)
        assert np.flatnonzero(wr).tolist() == expected
        counts.append(len(expected))
    assert 2 <= min(counts) and max(counts) <= 8 and len(set(counts)) > 1  # pair counts drawn from (2, 8)
    again, w_again = data.batch(0)
    np.testing.assert_array_equal(again, ids)
    np.testing.assert_array_equal(w_again, w)
    assert not np.array_equal(data.batch(1)[0], ids)

    ids, w = data.batch(2)  # the second stage
    assert ids.shape == (8, 64) and w.shape == (8, 63)
    for row, wr in zip(ids, w):
        assert 9 <= len(answers_by_rule(row, keys, values)) == int(wr.sum()) <= 16
        assert np.flatnonzero(wr).tolist() == answers_by_rule(row, keys, values)

    ids, w = data.batch(3)  # the first mixture step
    mqar, needle, text = RECIPE.rows()
    assert ids.shape == (8, 512) and w.shape == (8, 511) and (mqar, needle, text) == (4, 2, 2)
    for row, wr in zip(ids[:mqar], w[:mqar]):
        assert np.flatnonzero(wr).tolist() == answers_by_rule(row, keys, values)
    assert (w[mqar:] == 1).all()  # needle and text rows: every position


def test_weighted_loss_is_the_mean_of_row_means():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(3, 5))
    weights = np.array([[0, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    rows = []
    for r in range(3):
        positions = np.flatnonzero(weights[r])
        rows.append(np.mean([-logp[r, t, targets[r, t]] for t in positions]))
    loss, accuracy = weighted_loss(logits, targets, weights)
    np.testing.assert_allclose(float(loss), np.mean(rows), rtol=1e-6)  # float32 sums of 5 terms
    answer_positions = [(0, 1), (0, 3), (2, 4)]  # row 1 labels every position: text, not an answer
    hits = [logits[r, t].argmax() == targets[r, t] for r, t in answer_positions]
    assert float(accuracy) == pytest.approx(np.mean(hits))


def test_the_recall_stages_loss_at_the_answers_alone_equals_the_full_loss(tokenizer):
    """The curriculum's step projects onto the vocabulary at the answers only; its loss and accuracy are the full
    projection's ``weighted_loss`` (itself checked against a numpy loop above) on the same rows."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(*init_teacher(RECIPE, tokenizer.vocab_size))
    for step in (0, 2):  # both stages: 2-8 and 9-16 pairs
        ids, weights = TeacherData(RECIPE, tokenizer, TEXT).batch(step)
        # each row's last answer made the untrained model's own prediction, so that the accuracy is not 0: only
        # later positions read it, and no later position is labelled
        predicted = np.asarray(model(jnp.asarray(ids[:, :-1])).argmax(-1))
        for row, w in enumerate(weights):
            last = np.flatnonzero(w)[-1]
            ids[row, last + 1] = predicted[row, last]
        slots = RECIPE.recall_stage(step).pairs[1]
        positions, mask = answer_positions(weights, slots)
        assert positions.shape == (len(ids), slots) and (mask.sum(-1) == weights.sum(-1)).all()
        loss, accuracy = answer_loss(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))
        full_loss, full_accuracy = weighted_loss(model(jnp.asarray(ids[:, :-1])), ids[:, 1:], weights)
        # measured relative difference 0 and 7e-8 on losses ~6.1-6.4 (float32 sums in another order)
        np.testing.assert_allclose(float(loss), float(full_loss), rtol=5e-7)
        assert float(accuracy) == float(full_accuracy) >= len(ids) / weights.sum()
    with pytest.raises(ValueError, match="more than the 8 slots"):
        answer_positions(TeacherData(RECIPE, tokenizer, TEXT).batch(2)[1], 8)


class Killed(Exception):
    pass


@pytest.fixture(scope="module")
def whole_run(tokenizer, tmp_path_factory):
    messages, workdir = [], tmp_path_factory.mktemp("whole")
    return train_teacher(RECIPE, tokenizer, TEXT, workdir, log=messages.append), messages, workdir


# right after the growth to two layers; inside the mixture. Kill and resume: the end-to-end tier (`make test-all`)
@pytest.mark.slow
@pytest.mark.parametrize("kill_step", [2, 4])
def test_a_killed_run_resumes_to_the_uninterrupted_one_across_phases(tokenizer, whole_run, kill_step, tmp_path):
    import safetensors.numpy

    whole, whole_messages, whole_dir = whole_run
    assert whole["steps"] == RECIPE.total_steps == 6
    assert whole["timed_steps"] == 3  # each phase's first step compiles: 1 of stage 1, 0 of stage 2, 2 of the mixture
    assert "[teacher] grown to 2 layers at step 2 (each layer into 2)" in whole_messages

    def kill(message):  # called after the checkpoint of the step is written
        if f"step {kill_step}/6" in message:
            raise Killed

    with pytest.raises(Killed):
        train_teacher(RECIPE, tokenizer, TEXT, tmp_path / "split", log=kill)
    messages = []
    resumed = train_teacher(RECIPE, tokenizer, TEXT, tmp_path / "split", log=messages.append)
    assert messages[0].startswith(f"[teacher] resuming at step {kill_step} of 6")
    assert resumed["steps"] == 6 - kill_step
    assert not any("grown" in m for m in messages)  # the checkpoint of step 2 holds the grown model
    a = safetensors.numpy.load_file(str(whole_dir / "hf" / "model.safetensors"))
    b = safetensors.numpy.load_file(str(tmp_path / "split" / "hf" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    log = [json.loads(line) for line in (tmp_path / "split" / "train_log.jsonl").read_text().splitlines()]
    # checkpoints: every 2 steps and at each phase's end (step 3); the killed run logged its last step again
    assert sorted({(entry["step"], entry["phase"]) for entry in log}) == [
        (2, "recall 1"),
        (3, "recall 2"),
        (4, "mixture"),
        (6, "mixture"),
    ]


def test_the_learning_rate_warms_up_once_and_decays_over_the_mixture_only():
    recipe = dataclasses.replace(
        RECIPE,
        lr=1e-2,
        warmup_steps=4,
        steps=10,
        recall=(RecallStage(3, 16, 32, (2, 8)), RecallStage(5, 8, 64, (4, 16))),
    )
    lr = learning_rate(recipe)
    # steps 0-3 warm up linearly, 4-7 (the rest of the curriculum, across its stage change) hold the peak, 8-17
    # (the mixture) follow 1e-2 * (0.1 + 0.9 * (1 + cos(pi * k / 10)) / 2) at its k-th step
    expected = [1e-2 * t / 4 for t in range(4)] + [1e-2] * 4
    expected += [1e-2 * (0.1 + 0.9 * (1 + np.cos(np.pi * k / 10)) / 2) for k in range(10)]
    np.testing.assert_allclose([float(lr(t)) for t in range(18)], expected, rtol=1e-6)  # float32 arithmetic


def test_gradient_clipping_is_the_recipes():
    import jax.numpy as jnp
    import optax

    recipe = dataclasses.replace(RECIPE, lr=1e-2, warmup_steps=1, weight_decay=0.0)
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.asarray([30.0, -40.0, 0.0, 0.0])}  # global norm 50
    # Adam's first update is lr * g_hat / (|g_hat| + eps) per coordinate: the same for any positive rescaling of g,
    # so the clip shows in the second moment after a step with a small gradient first
    small = {"w": jnp.asarray([0.3, -0.4, 0.0, 0.0])}  # norm 0.5, under both clips
    for clip, scale in ((None, 1.0), (1.0, 1 / 50)):
        tx = _optimizer(dataclasses.replace(recipe, grad_clip=clip))
        state = tx.init(params)
        _, state = tx.update(small, state, params)
        update, _ = tx.update(grads, state, params)
        ref = optax.adamw(learning_rate(recipe), weight_decay=0.0)
        ref_state = ref.init(params)
        _, ref_state = ref.update(small, ref_state, params)
        expected, _ = ref.update({"w": grads["w"] * scale}, ref_state, params)
        np.testing.assert_allclose(update["w"], expected["w"], rtol=1e-6)  # the same float32 operations


def test_a_checkpoint_of_another_recipe_is_refused(tokenizer, tmp_path):
    quiet = lambda *_: None  # noqa: E731
    one_stage = (RecallStage(1, 16, 32, (2, 8)),)
    train_teacher(dataclasses.replace(RECIPE, recall=one_stage, steps=1), tokenizer, TEXT, tmp_path, log=quiet)
    longer = (RecallStage(2, 16, 32, (2, 8)),)
    with pytest.raises(ValueError, match="checkpoint of another teacher recipe"):
        train_teacher(dataclasses.replace(RECIPE, recall=longer, steps=1), tokenizer, TEXT, tmp_path, log=quiet)


def test_bad_recall_stages_are_refused():
    with pytest.raises(ValueError, match="seq_len=32 < 4 x 9 pairs"):
        RecallStage(1, 16, 32, (2, 9))
    with pytest.raises(ValueError, match="fewest, most"):
        RecallStage(1, 16, 32, (3, 2))
    with pytest.raises(ValueError, match="steps and batch_size must be >= 1"):
        RecallStage(0, 16, 32, (2, 8))
    with pytest.raises(ValueError, match="num_layers=0 must be >= 1"):
        RecallStage(1, 16, 32, (2, 8), num_layers=0)
    for depth in (3, 4):  # 3 does not divide the recipe's 2 layers; 4 would shrink to 2
        with pytest.raises(ValueError, match=r"must each divide the next \(the model only grows"):
            dataclasses.replace(RECIPE, recall=(RecallStage(1, 16, 32, (2, 8), num_layers=depth),))


def test_a_grown_model_computes_the_function_of_the_one_it_grew_from(tokenizer):
    """Growing 2 layers into 8 (each into 4) changes no logit: the copies after each layer's first add nothing to
    the residual stream. Checked against the 2-layer model's own logits, after a random perturbation of every
    parameter (so no layer is near identity by initialisation, and the copies are told apart from the originals)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    deep = dataclasses.replace(RECIPE, num_layers=8, recall=())
    graphdef, params, rest = init_teacher(deep, tokenizer.vocab_size, num_layers=2)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    params = jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    ids = jnp.asarray(TeacherData(RECIPE, tokenizer, TEXT).batch(3)[0][:, :64])
    small = nnx.merge(graphdef, params, rest)(ids)
    big_graph, _, big_rest = init_teacher(deep, tokenizer.vocab_size)
    grown = grow_layers(params, 4, zero_outputs=True)
    np.testing.assert_array_equal(nnx.merge(big_graph, grown, big_rest)(ids), small)
    q, o = grown["layers"]["self_attn"]["q_proj"]["kernel"][...], grown["layers"]["self_attn"]["o_proj"]["kernel"][...]
    assert q.shape[0] == 8 and (q[5] == q[4]).all() and not (q[4] == q[3]).all()  # layers 4-7 copy layer 1
    assert (o[5] == 0).all() and (o[4] != 0).any()
    moments = grow_layers(params, 4, zero_outputs=False)["layers"]["self_attn"]["o_proj"]["kernel"][...]
    assert (moments[5] == moments[4]).all() and (moments[5] != 0).any()
    # the block's last copy keeping the work (grown_layer="last"): the same function, the circuit in layers 3 and 7
    last = grow_layers(params, 4, zero_outputs=True, keep=3)
    np.testing.assert_array_equal(nnx.merge(big_graph, last, big_rest)(ids), small)
    o = last["layers"]["self_attn"]["o_proj"]["kernel"][...]
    assert [bool((o[i] != 0).any()) for i in range(8)] == [False, False, False, True] * 2


def test_the_output_projection_starts_at_the_recipes_scale():
    big = dataclasses.replace(RECIPE, hidden_size=64, vocab_size=2048)
    for scale, expected in ((None, 0.02), (1.0, 64**-0.5), (0.5, 0.5 * 64**-0.5)):
        _, params, _ = init_teacher(dataclasses.replace(big, lm_head_init_scale=scale), 2048)
        kernel = np.asarray(params["lm_head"]["kernel"][...])
        assert kernel.shape == (64, 2048)
        # 131,072 draws: the sample std's relative standard error is 1/sqrt(2n) = 0.2 %; 2 % is 10 of them
        assert np.std(kernel) == pytest.approx(expected, rel=0.02)

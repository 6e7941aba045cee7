"""Head selection: probes against a hand-written reference forward, selection rules, errors, heatmap, the stage.

The reference forward below is written independently of hydrahead_jax.selection.probes: plain per-layer code with
KV heads repeated per query head (HF's repeat_kv), full T×T softmax, and head outputs overwritten in place.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_shapes import QWEN3_1P7B, SMOLLM2_135M

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.head_map import HeadMap
from hydrahead_jax.models import Transformer
from hydrahead_jax.selection import probes
from hydrahead_jax.selection.plot import plot_scores
from hydrahead_jax.selection.select import (
    SelectionConfig,
    SelectionError,
    combine_scores,
    fa_count,
    rank_normalise,
    run_selection,
    select_fa_groups,
    selection_budget,
    validate_config,
)

CFG = ModelConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=6,
    num_kv_heads=3,
    head_dim=8,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (21, 30, 14)]
    answers = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (3, 1, 4)]
    return probes.make_batch(prompts, answers, multiple=16)


def reference_forward(model, ids, edit=None):
    """logits [B,T,V], per-layer probs [B,Hq,T,T] and head outputs [B,T,Hq,D]; edit(l, heads) may rewrite heads."""
    cfg = model.cfg
    b, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    h = model.embed_tokens(jnp.asarray(ids))
    all_probs, all_heads = [], []
    for l in range(cfg.num_layers):
        layer = model.layer(l)
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h), pos)
        k = jnp.repeat(k, cfg.group_size, axis=2)
        v = jnp.repeat(v, cfg.group_size, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q, k) * cfg.head_dim**-0.5
        s = jnp.where(np.tril(np.ones((t, t), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, -1)
        heads = jnp.einsum("bhts,bshd->bthd", p, v)
        all_probs.append(np.asarray(p))
        all_heads.append(np.asarray(heads))
        if edit is not None:
            heads = jnp.asarray(edit(l, np.array(heads)))
        h = h + attn.o_proj(heads.reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return np.asarray(model.logits_from_hidden(model.norm(h))), all_probs, all_heads


def answer_logp(logits, batch):
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))
    vals = np.take_along_axis(np.take_along_axis(logp, batch.rows[..., None], 1), batch.targets[..., None], -1)
    return (vals[..., 0] * batch.row_mask).sum(-1)


# ------------------------------------------------------------------------------------------------ forward / argmax


def test_probe_forward_matches_reference(model, batch):
    out = probes.run_forward(probes.functional_teacher(model), batch, collect=True)
    logits, ref_probs, ref_heads = reference_forward(model, batch.ids)
    np.testing.assert_allclose(
        out["logp"][batch.row_mask],
        np.take_along_axis(
            np.take_along_axis(np.asarray(jax.nn.log_softmax(logits, -1)), batch.rows[..., None], 1),
            batch.targets[..., None],
            -1,
        )[..., 0][batch.row_mask],
        atol=2e-5,
    )
    for l in range(CFG.num_layers):
        expect = np.take_along_axis(ref_probs[l], batch.rows[:, None, :, None], axis=2).argmax(-1)
        np.testing.assert_array_equal(out["argmax"][l], expect)
        np.testing.assert_allclose(out["heads"][l], ref_heads[l], atol=2e-5)


def test_count_copies_hand_made():
    prompt = [5, 6, 42, 43, 7, 42]
    needles = [2, 3]  # tokens 42, 43
    generated = [42, 43, 9]
    argmax = np.zeros((1, 4, 3), np.int64)
    argmax[0, 0] = [2, 3, 0]  # copies both needle tokens → 1.0
    argmax[0, 1] = [2, 2, 2]  # the same needle position counts once → 0.5
    argmax[0, 2] = [5, 3, 3]  # position 5 holds 42 but is not a needle; then 43 once → 0.5
    argmax[0, 3] = [3, 2, 0]  # needle positions whose tokens differ from the emitted ones → 0
    np.testing.assert_allclose(probes.count_copies(argmax, generated, prompt, needles), [[1.0, 0.5, 0.5, 0.0]])
    np.testing.assert_allclose(probes.aggregate_groups(np.array([[1.0, 0.5, 0.5, 0.0]]), 2, "mean"), [[0.75, 0.25]])
    np.testing.assert_allclose(probes.aggregate_groups(np.array([[1.0, 0.5, 0.5, 0.0]]), 2, "max"), [[1.0, 0.5]])


def _copy_head_model(head: int):
    """Layer 0, query head ``head`` attends to the needle token (``_set_needle``): every embedding has a constant
    feature (dim 1), the needle token a large indicator (dim 0); q reads dim 1 and k reads dim 0 into the
    lowest-frequency rotary pair (half-split coordinates D/2−1 and D−1), whose angle stays < 1e-2 rad here."""
    m = Transformer(CFG, rngs=nnx.Rngs(5))
    d, hd = CFG.head_dim, CFG.head_dim
    q_kernel, k_kernel = m.layers.self_attn.q_proj.kernel, m.layers.self_attn.k_proj.kernel  # [layer, in, out]
    wq, wk = np.array(q_kernel[...][0]), np.array(k_kernel[...][0])
    wq[:, head * hd : (head + 1) * hd] = 0.0
    wq[1, head * hd + d // 2 - 1] = 60.0
    g = head // CFG.group_size
    wk[:, g * hd : (g + 1) * hd] = 0.0
    wk[0, g * hd + d // 2 - 1] = 60.0
    q_kernel.set_value(q_kernel[...].at[0].set(wq))
    k_kernel.set_value(k_kernel[...].at[0].set(wk))
    m.base_embedding = nnx.Variable(jnp.array(m.embed_tokens.embedding[...]) * 0.01)
    return m


def _set_needle(m, needle_token: int):
    emb = np.array(m.base_embedding[...])
    emb[:, 1] = 1.0
    emb[needle_token, 0] = 3.0
    m.embed_tokens.embedding.set_value(jnp.asarray(emb))


class _DigitsTokenizer:
    eos_id = None

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


class _Example:
    def __init__(self, prompt_ids, answer_ids, answer_text, needle_positions):
        self.prompt_ids, self.answer_ids = list(prompt_ids), list(answer_ids)
        self.answer_text, self.needle_positions = answer_text, list(needle_positions)


def test_retrieval_score_finds_the_copy_head():
    from hydrahead_jax.models.generate import generate

    rng = np.random.default_rng(1)
    base = rng.integers(10, CFG.vocab_size, 30)
    model = _copy_head_model(head=4)
    _set_needle(model, 0)
    first = int(generate(model, base[None].astype(np.int32), 2)[0, 0])
    # Put the token the model emits at the needle position and give that token the attention indicator: head 4
    # must point at the needle and copy it.
    _set_needle(model, first)
    prompt = base.copy()
    prompt[prompt == first] = (first + 1) % CFG.vocab_size or 1
    prompt[12] = first
    gen = generate(model, prompt[None].astype(np.int32), 2)[0].tolist()
    tok = _DigitsTokenizer()
    good = _Example(prompt, gen, tok.decode(gen), [12])
    wrong = _Example(prompt, gen, "no such answer", [12])  # not answered: must not count
    r = probes.retrieval_scores(model, tok, [good, wrong], decode="greedy", max_extra_tokens=0)
    assert r["num_correct"] == 1 and r["num_prompts"] == 2
    # Independent expectation from the reference forward's attention rows.
    seq = np.concatenate([prompt, gen])[None]
    _, ref_probs, _ = reference_forward(model, seq)
    rows = len(prompt) - 1 + np.arange(len(gen))
    argmax = np.stack([p[0][:, rows, :].argmax(-1) for p in ref_probs])  # [L,Hq,N]
    expect = probes.count_copies(argmax, gen, prompt, [12])
    np.testing.assert_allclose(r["head_scores"], expect)
    assert gen[0] == first and r["head_scores"][0, 4] == 1.0
    np.testing.assert_allclose(r["group_scores"], expect.reshape(3, 3, 2).mean(-1))


# ------------------------------------------------------------------------------------------------ ablation


@pytest.mark.parametrize("mode", ["zero", "mean"])
@pytest.mark.parametrize("scope", ["all", "answer"])
def test_ablation_equals_masked_forward(model, batch, mode, scope):
    teacher = probes.functional_teacher(model)
    result = probes.ablation_scores(teacher, batch, mode=mode, scope=scope)
    logits, _, ref_heads = reference_forward(model, batch.ids)
    clean = answer_logp(logits, batch)
    np.testing.assert_allclose(result["logp"], clean, atol=3e-5)
    t = batch.ids.shape[1]
    real = np.arange(t)[None, :] < batch.lengths[:, None]
    gs = CFG.group_size
    for layer, group in [(0, 0), (1, 2), (2, 1)]:
        heads = ref_heads[layer][..., group * gs : (group + 1) * gs, :]
        fill = heads[real].mean(0) if mode == "mean" else np.zeros_like(heads[0, 0])
        where = np.ones((len(batch.ids), t), bool)
        if scope == "answer":
            where = np.zeros_like(where)
            for b in range(len(batch.ids)):
                where[b, batch.rows[b][batch.row_mask[b]]] = True

        def edit(l, h, layer=layer, group=group, fill=fill, where=where):
            if l == layer:
                h[..., group * gs : (group + 1) * gs, :][where] = fill
            return h

        ablated = answer_logp(reference_forward(model, batch.ids, edit)[0], batch)
        np.testing.assert_allclose(result["drop"][layer, group], clean - ablated, atol=5e-5)
        assert np.abs(clean - ablated).max() > 1e-4  # the intervention is not a no-op on this model


def test_group_ablation_mask_forward(model, batch):
    teacher = probes.functional_teacher(model)
    groups = [[1], [], [0, 2]]
    keep = probes.group_ablation_masks(groups, CFG.num_heads, CFG.num_kv_heads)
    np.testing.assert_array_equal(keep[0], [1, 1, 0, 0, 1, 1])
    out = probes.run_forward(teacher, batch, head_keep=keep)

    def edit(l, h):
        for g in groups[l]:
            h[..., 2 * g : 2 * g + 2, :] = 0.0
        return h

    expect = answer_logp(reference_forward(model, batch.ids, edit)[0], batch)
    np.testing.assert_allclose((out["logp"] * batch.row_mask).sum(-1), expect, atol=3e-5)


# ------------------------------------------------------------------------------------------------ selection

SCORES = np.array([[0.1, 0.9, 0.3], [0.5, 0.2, 0.8], [0.05, 0.95, 0.6], [0.4, 0.4, 0.1]])


def test_per_layer_and_global_top_k():
    assert select_fa_groups(SCORES, ratio="2:1", allocation="per_layer") == [[1], [2], [1], [0]]  # tie → lower
    assert select_fa_groups(SCORES, ratio="1:2", allocation="per_layer") == [[1, 2], [0, 2], [1, 2], [0, 1]]
    # global, 3:1 of 12 groups → 3 FA: 0.95 (2,1), 0.9 (0,1), 0.8 (1,2)
    assert select_fa_groups(SCORES, ratio="3:1", allocation="global") == [[1], [2], [1], []]
    # 0.5 of 12 → 6: the 0.4 tie at layer 3 goes to the lower group index
    assert select_fa_groups(SCORES, ratio=0.5, allocation="global") == [[1], [0, 2], [1, 2], [0]]
    assert select_fa_groups(SCORES, ratio="11:1", allocation="global") == [[], [], [1], []]  # at least one


def test_whole_layers_takes_the_layers_with_the_highest_mean_score():
    # Layer means of SCORES: 1.3/3, 1.5/3, 1.6/3, 0.9/3. 3:1 of 12 groups → 3 groups → 1 whole layer of 3: layer 2.
    assert select_fa_groups(SCORES, ratio="3:1", allocation="whole_layers") == [[], [], [0, 1, 2], []]
    # 1:1 → 6 groups → 2 layers: layers 2 and 1 (the two highest means).
    assert select_fa_groups(SCORES, ratio="1:1", allocation="whole_layers") == [[], [0, 1, 2], [0, 1, 2], []]
    # 11:1 → round(1) group → the nearest whole layers is 0, raised to the one layer a non-zero ratio needs.
    assert select_fa_groups(SCORES, ratio="11:1", allocation="whole_layers") == [[], [], [0, 1, 2], []]
    # Ties between layer means go to the lower layer.
    tied = np.array([[1.0, 0.0], [0.0, 1.0], [0.2, 0.2]])
    assert select_fa_groups(tied, ratio="2:1", allocation="whole_layers") == [[0, 1], [], []]
    budget = selection_budget("7:1", "whole_layers", 30, 3)  # SmolLM2: 11 groups → 3.67 layers → 4 = 12 groups
    assert (budget["target_fa_groups"], budget["fa_groups"], budget["exact"]) == (11, 12, False)
    assert selection_budget("3:1", "whole_layers", 8, 4)["exact"]  # 8 groups = 2 layers of 4


def test_random_is_seeded_and_layerwise_matches_head_map():
    big = dict(num_layers=30, num_groups=3, ratio="7:1", allocation="global", method="random")
    a, b, c = (select_fa_groups(None, seed=s, **big) for s in (4, 4, 5))
    assert a == b and a != c
    assert sum(map(len, a)) == round(90 / 8) == 11
    cfg = CFG.replace(num_layers=8)
    assert (
        select_fa_groups(None, ratio="3:1", method="layerwise", layerwise_cfg=cfg)
        == HeadMap.layerwise(cfg, ratio="3:1").fa_groups
        == [[], [], [], [0, 1, 2], [], [], [], [0, 1, 2]]
    )


def test_rank_normalise_and_combined():
    np.testing.assert_allclose(rank_normalise(np.array([[3.0, 1.0], [2.0, 2.0]])), [[1.0, 0.0], [0.5, 0.5]])
    r = np.array([[0.0, 1.0], [0.5, 0.2]])
    a = np.array([[10.0, -1.0], [3.0, 4.0]])  # ranks: r → 0,1,2/3,1/3 ; a → 1,0,1/3,2/3
    np.testing.assert_allclose(combine_scores(r, a), [[0.5, 0.5], [0.5, 0.5]])


def test_bad_inputs_fail_before_probing(model, tmp_path):
    with pytest.raises(SelectionError, match="global"):
        fa_count("7:1", "per_layer", 30, 3)
    with pytest.raises(SelectionError, match="global"):
        select_fa_groups(SCORES, ratio="3:1", allocation="per_layer")
    with pytest.raises(SelectionError, match="no FA group"):
        fa_count("1:0", "global", 30, 3)
    with pytest.raises(SelectionError, match="parse ratio"):
        fa_count("seven to one", "global", 30, 3)
    with pytest.raises(SelectionError, match="unknown"):
        select_fa_groups(SCORES, ratio="3:1", method="magic")
    # tokenizer=None: any probe work would crash on it, so these errors must come first
    with pytest.raises(SelectionError, match="max_position_embeddings"):
        run_selection(model, None, SelectionConfig(niah_lengths=(512,)), tmp_path)
    with pytest.raises(SelectionError, match="method"):
        run_selection(model, None, {"method": "magic"}, tmp_path)
    with pytest.raises(SelectionError, match="per_layer"):
        run_selection(model, None, {"ratio": "7:1", "allocation": "per_layer"}, tmp_path)
    with pytest.raises(SelectionError, match="unknown selection settings"):
        SelectionConfig.from_any({"ratoi": "7:1"})
    validate_config(SelectionConfig(niah_lengths=(128,), ablation_length=128), CFG)  # fits: no error
    assert not os.listdir(tmp_path)


def test_heatmap_written(tmp_path):
    path = plot_scores(
        {"retrieval": SCORES, "ablation": SCORES[::-1]},
        [[1], [2], [], [0]],
        tmp_path / "h.png",
        head_scores=np.repeat(SCORES, 2, axis=1),
        title="t",
    )
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000
    with pytest.raises(ValueError, match="layers"):
        plot_scores({"r": SCORES}, [[1]], tmp_path / "x.png")


# ------------------------------------------------------------------------------------------------ the stage


def test_run_selection_end_to_end(tmp_path):
    from hydrahead_jax.data.synthetic import WORDS, Haystack
    from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer

    rng = np.random.default_rng(0)
    text = [" ".join(rng.choice(WORDS, 12)).capitalize() + "." for _ in range(300)]
    tok = train_bpe_tokenizer(
        text + ["The pass key is 12345. Remember it. One of the special magic numbers"], vocab_size=400
    )
    cfg = CFG.replace(vocab_size=tok.vocab_size, num_layers=2, max_position_embeddings=512)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    hay = Haystack(["\n".join(text)], tok)
    sel = dict(
        method="combined",
        ratio="2:1",
        allocation="per_layer",
        niah_prompts=2,
        niah_lengths=(320,),
        ablation_prompts=2,
        ablation_length=256,
        decode="teacher_forced",
        ablation_scope="all",
        ablation_mode="zero",
    )
    head_map = run_selection(model, tok, sel, tmp_path, haystack=hay, log=lambda *_: None)
    loaded = HeadMap.load(tmp_path / "head_map.json", cfg)
    assert loaded.fa_groups == head_map.fa_groups and all(len(g) == 1 for g in loaded.fa_groups)
    assert set(loaded.scores) == {"retrieval", "ablation", "combined"}
    combined = combine_scores(np.array(loaded.scores["retrieval"]), np.array(loaded.scores["ablation"]))
    np.testing.assert_allclose(np.array(loaded.scores["combined"]), combined, atol=2e-6)
    assert loaded.fa_groups == select_fa_groups(combined, ratio="2:1", allocation="per_layer")
    assert loaded.probe["settings"]["ablation_length"] == 256 and loaded.probe["ablation"]["num_prompts"] == 2
    assert (tmp_path / "head_scores.png").exists()
    json.loads((tmp_path / "head_map.json").read_text())
    assert loaded.budget["target_fa_groups"] == loaded.budget["fa_groups"] == 2 and loaded.budget["exact"]


@pytest.mark.parametrize(
    "cfg,allocation,hydrahead,layerwise",
    [
        (QWEN3_1P7B, "per_layer", 28, 24),  # 1 FA group in each of 28 layers; layer-wise 3.5 → 3 layers of 8
        (QWEN3_1P7B, "global", 28, 24),
        (SMOLLM2_135M, "global", 11, 12),  # 90 / 8 = 11.25 → 11; layer-wise 11 / 3 = 3.67 → 4 layers of 3
    ],
)
def test_baselines_at_hydraheads_kv_budget(tmp_path, cfg, allocation, hydrahead, layerwise):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # random and layer-wise read only the shape
    maps = {}
    for method in ("random", "layerwise"):
        sel = {"method": method, "ratio": "7:1", "allocation": allocation}
        maps[method] = run_selection(model, None, sel, tmp_path / method, log=lambda *_: None)
        assert HeadMap.load(tmp_path / method / "head_map.json", cfg).budget == maps[method].budget
    random, lw = maps["random"], maps["layerwise"]
    assert random.num_fa_groups() == hydrahead and random.budget["exact"]
    assert random.budget["target_fa_groups"] == random.budget["fa_groups"] == hydrahead
    if allocation == "per_layer":
        assert all(len(g) == 1 for g in random.fa_groups)
    assert lw.num_fa_groups() == layerwise and lw.budget["target_fa_groups"] == hydrahead
    assert lw.budget["exact"] is False and lw.budget["fa_groups"] == layerwise
    assert all(g in ([], list(range(cfg.num_kv_heads))) for g in lw.fa_groups)

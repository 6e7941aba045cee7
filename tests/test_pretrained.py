"""The real SmolLM2-135M teacher (GGUF, Q4_1) against transformers loading the same file."""

import jax
import numpy as np
import oracle
import pytest
from flax import nnx

from hydrahead_jax.models.loaders import resolve_source
from hydrahead_jax.models.pretrained import load_pretrained

# Real English prose, written for these tests (not in any training set we know of).
PARAGRAPH = (
    "The printing press changed Europe in ways its inventor could hardly have imagined. Before Johannes "
    "Gutenberg built his machine in Mainz around 1450, books were copied by hand, usually by monks, and a "
    "single Bible could take years to finish. Movable metal type made it possible to produce hundreds of "
    "identical pages in a day. Within fifty years, presses were running in more than two hundred cities, and "
    "millions of books had been printed. Cheaper books meant that more people learned to read, and new ideas "
    "spread faster than the authorities could control them. Scholars could compare the same text in "
    "different cities, which helped science grow, while pamphlets carried religious and political arguments "
    "to ordinary people."
)
# Held-out text: two paragraphs of different genres, scored together. A 135M model scores plain encyclopedic
# prose near 9.5 and narrative news near 62, so either alone sits on an edge of the sane 10..60 band.
HELD_OUT_ENCYCLOPEDIC = (
    "The Danube is the second-longest river in Europe, after the Volga. It rises in the Black Forest of "
    "Germany and flows for about 2,850 kilometres through Central and Southeastern Europe before emptying "
    "into the Black Sea. Along the way it passes through or forms the border of ten countries, more than any "
    "other river in the world, and four capital cities, including Vienna and Budapest, stand on its banks. "
    "For centuries the river served as a frontier of the Roman Empire and later as a major trade route. "
    "Today it is an important waterway for shipping, and its delta, a wide area of wetlands, is home to "
    "hundreds of species of birds."
)
HELD_OUT_NEWS = (
    "When the harbour authority announced last spring that the old ferry terminal would close, few residents "
    "expected the fight that followed. A group of fishermen, retired teachers and a local baker collected "
    "nearly four thousand signatures in three weeks, arguing that the terminal was the only reliable link "
    "between the island and the hospital on the mainland. Council members first dismissed the petition as "
    "nostalgia, but the numbers were hard to ignore: on winter mornings the terminal handled more passengers "
    "than the new bridge, which was often closed by high winds. In October the council quietly reversed its "
    "decision, promising repairs instead of demolition, though no budget has yet been approved."
)


PROMPT = "The capital of France is"
PAD_TO = 192  # one padded batch, one compilation: each jit of the 30-layer model costs ~10 s on this CPU


@pytest.fixture(scope="module")
def teacher():
    return load_pretrained("smollm2-135m")


@pytest.fixture(scope="module")
def torch_teacher():
    path = resolve_source("smollm2-135m")
    return oracle.load_torch_model(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def batch(teacher):
    """Rows: paragraph, two held-out paragraphs, the first one's tokens shuffled, prompt; right-padded (causal
    attention: padding after a row's end cannot change its logits).

    Returns (ids [5, PAD_TO], true lengths, logits [5, PAD_TO, V]) from one jitted forward.
    """
    model, tok = teacher
    rows = [tok.encode(PARAGRAPH), tok.encode(HELD_OUT_ENCYCLOPEDIC), tok.encode(HELD_OUT_NEWS)]
    rows.append(list(np.random.default_rng(0).permutation(rows[1])))
    rows.append(tok.encode(PROMPT))
    lengths = [len(r) for r in rows]
    assert max(lengths) <= PAD_TO
    ids = np.full((len(rows), PAD_TO), tok.eos_id, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))
    return ids, lengths, logits


def test_config_of_the_real_teacher(teacher):
    cfg = teacher[0].cfg
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama",
        30,
        576,
        9,
        3,
        64,
    )
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.rope_theta) == (49152, 1536, 100000.0)
    assert cfg.tie_word_embeddings and not cfg.rope_interleaved
    assert cfg.rms_norm_eps == pytest.approx(1e-5)


def test_logits_match_transformers_on_a_real_paragraph(batch, torch_teacher):
    ids, lengths, logits = batch
    n = lengths[0]
    assert 100 <= n <= 200
    expected = oracle.torch_logits(torch_teacher, ids[:1, :n])
    got = logits[:1, :n]
    agree = np.mean(got.argmax(-1) == expected.argmax(-1))
    diff = np.abs(got - expected).max()
    assert agree >= 0.99, f"argmax agreement {agree:.4f}"
    assert diff < 1e-3, f"max abs logit diff {diff:.2e}"


def _nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Next-token negative log-likelihoods of one row: logits [T, V], ids [T] -> [T-1]."""
    logp = np.asarray(jax.nn.log_softmax(logits[:-1].astype(np.float64), axis=-1))
    return -np.take_along_axis(logp, ids[1:, None], axis=-1)[:, 0]


def test_perplexity_on_held_out_text(batch):
    ids, n, logits = batch
    nll = [_nll(logits[r, : n[r]], ids[r, : n[r]]) for r in range(4)]
    ppl = float(np.exp(np.concatenate(nll[1:3]).mean()))
    # ~300 would mean the Q/K rows kept llama.cpp's interleaved layout under half-split RoPE.
    assert 10 <= ppl <= 60, f"perplexity {ppl:.1f}"
    # The score reflects language, not just token frequencies: the same tokens shuffled are far less likely.
    assert np.exp(nll[3].mean()) > 5 * np.exp(nll[1].mean())


def test_greedy_continuation_names_paris(teacher, batch):
    """Plain text, no chat template. The greedy next token after the prompt is " Paris"; the KV-cache generator
    (generate.py) is checked against the no-cache forward in the generation tests, so one step suffices here."""
    _, tok = teacher
    ids, lengths, logits = batch
    first = int(logits[4, lengths[4] - 1].argmax())
    assert "Paris" in tok.decode([first])


@pytest.mark.slow  # eval.py's suite on the real teacher: the end-to-end tier
def test_the_teacher_answers_needles_it_is_known_to_answer(tmp_path):
    """The evaluation's NIAH scoring on an outcome known in advance: the real teacher answers every needle at 512
    tokens (100 of 100 prompts in the recipe comparison, bench/RESULTS.md), so here every prompt is correct and the
    cell's accuracy is 1; each sample's flag is its prediction holding the needle's value."""
    import json

    from hydrahead_jax.evaluation import cli

    haystack = tmp_path / "haystack.txt"
    haystack.write_text("\n\n".join([PARAGRAPH, HELD_OUT_ENCYCLOPEDIC, HELD_OUT_NEWS] * 3))
    out = tmp_path / "eval"
    rc = cli.main(
        ["--model", "teacher:smollm2-135m", "--suite", "niah", "--lengths", "512", "--depths", "0.1,0.9"]
        + ["--samples", "2", "--haystack", str(haystack), "--out", str(out), "--no-progress"]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    cells = [r for r in res["results"] if r["task"] == "niah"]
    assert sorted(r["depth"] for r in cells) == [0.1, 0.9]
    assert all(r["n"] == 2 and r["value"] == 1.0 for r in cells), cells
    samples = [s for s in res["samples"] if s["task"] == "niah"]
    assert len(samples) == 4 and all(s["correct"] and s["answer"] in s["prediction"] for s in samples), samples

"""RULER tasks (hydrahead_jax.evaluation.ruler): hand-checkable prompts, the scorer and Wilson interval against
values worked out by hand, and ``eval.py --suite ruler`` end to end on a tiny random decoder."""

import collections
import json
import math
import re

import numpy as np
import pytest

from hydrahead_jax.data import synthetic
from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer
from hydrahead_jax.evaluation import ruler
from hydrahead_jax.evaluation.intervals import wilson_interval
from hydrahead_jax.evaluation.scoring import string_match_all
from hydrahead_jax.models.loaders import save_hf_folder


def _corpus(seed: int = 0, sentences: int = 1500) -> str:
    """Prose-like sentences over ~2000 distinct made-up words, so CWE has enough distinct corpus words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = sorted({"".join(rng.choice(letters, int(rng.integers(4, 9)))) for _ in range(2200)})
    lines = []
    for _ in range(sentences):
        words = [vocab[int(j)] for j in rng.integers(0, len(vocab), int(rng.integers(6, 14)))]
        lines.append(words[0].capitalize() + " " + " ".join(words[1:]) + ".")
    return "\n".join(" ".join(lines[i : i + 5]) for i in range(0, sentences, 5))


@pytest.fixture(scope="module")
def inputs():
    text = _corpus()
    templates = [ruler.NOISE, synthetic.NIAH_PREFIX, synthetic.VT_PREFIX, ruler.CWE_TEMPLATE, ruler.FWE_TEMPLATE]
    tok = train_bpe_tokenizer([text] + templates * 20, vocab_size=600, name="ruler-test-bpe")
    return ruler.RulerInputs(tok, synthetic.Haystack(text, tok))


# ------------------------------------------------------------------------------------------------ scoring


def test_string_match_all_by_hand():
    assert string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert string_match_all("7654321", ["1234567"]) == 0.0
    assert string_match_all("the values are 11, 22 and 44", ["11", "22", "33", "44"]) == 0.75
    assert string_match_all("ABCDE then fghij", ["abcde", "FGHIJ"]) == 1.0  # case-insensitive
    with pytest.raises(ValueError, match="at least one reference"):
        string_match_all("x", [])


def test_wilson_interval_by_hand():
    # p = 0.5, n = 50, z = 1.96: centre (0.5 + z²/100) / (1 + z²/50) = 0.5,
    # half-width z·sqrt(0.25/50 + z²/10000) / (1 + z²/50) = 1.96 · 0.073377 / 1.076829 = 0.133557; the same for 50
    # half-credit scores (a sum of 25, RULER's partial credit) as for 25 of 50 right
    for k in (25, 50 * 0.5):
        lo, hi = wilson_interval(k, 50)
        assert lo == pytest.approx(0.5 - 0.133557, abs=1e-5) and hi == pytest.approx(0.5 + 0.133557, abs=1e-5)
    # p = 0: the interval is [0, z²/(n + z²)] = [0, 3.841459/53.841459]
    lo, hi = wilson_interval(0, 50)
    assert lo == pytest.approx(0.0, abs=1e-12) and hi == pytest.approx(3.841459 / 53.841459, rel=1e-6)
    lo, hi = wilson_interval(50, 50)
    assert hi == 1.0 and lo == pytest.approx(50 / 53.841459, rel=1e-6)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(50.5, 50)


# ------------------------------------------------------------------------------------------------ prompts


def _text(inputs, ex) -> str:
    return inputs.tok.decode(ex.prompt_ids)


NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+?)\.")


@pytest.mark.parametrize(
    "task, keys, values_per_key, asked",
    [
        ("niah_single_1", 1, 1, 1),
        ("niah_single_2", 1, 1, 1),
        ("niah_single_3", 1, 1, 1),
        ("niah_multikey_1", 4, 1, 1),
        ("niah_multivalue", 1, 4, 1),
        ("niah_multiquery", 4, 1, 4),
    ],
)
def test_niah_prompts_hold_exactly_the_stated_needles(inputs, task, keys, values_per_key, asked):
    for seed in range(3):
        ex = ruler.build(task, inputs, length=2048, seed=seed, depth=0.3)
        text = _text(inputs, ex)
        needles = NEEDLE.findall(text)
        by_key = collections.defaultdict(list)
        for _, key, value in needles:
            by_key[key].append(value)
        assert len(by_key) == keys and all(len(v) == values_per_key for v in by_key.values())
        assert len(ex.answers) == asked * values_per_key
        for a in ex.answers:
            assert text.count(a) == 1  # each answer once, inside its needle
        question = text[text.rindex("What") :]
        asked_keys = [k for k in by_key if k in question]
        assert len(asked_keys) == asked and sorted(v for k in asked_keys for v in by_key[k]) == sorted(ex.answers)
        if task == "niah_single_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", ex.answers[0])
        else:
            assert all(a.isdigit() and len(a) == 7 for a in ex.answers)
        if task == "niah_single_1":
            assert "The grass is green." in text
        assert len(ex.prompt_ids) + ex.max_new_tokens == 2048  # prompt + RULER's 128-token budget = the length


@pytest.mark.parametrize("task", ["niah_multikey_2", "niah_multikey_3"])
def test_needle_haystack_is_all_distractor_needles(inputs, task):
    ex = ruler.build(task, inputs, length=2048, seed=1, depth=0.5)
    text = _text(inputs, ex)
    needles = NEEDLE.findall(text)
    assert len(needles) > 10
    body = text[text.index("afterwards.") + len("afterwards.") : text.rindex("\nWhat")]
    leftover = NEEDLE.sub("", body).strip()
    assert len(leftover) < len(needles[0][1]) + len(needles[0][2]) + 40  # nothing but needles, the last one cut
    keys = [k for _, k, _ in needles]
    assert len(set(keys)) == len(keys)  # every key once
    (answer,) = ex.answers
    assert [v for _, _, v in needles].count(answer) == 1
    asked = next(k for _, k, v in needles if v == answer)
    assert text.rstrip().endswith(f"for {asked} mentioned in the provided text is:")
    if task == "niah_multikey_3":
        assert all(len(k) == 36 and len(v) == 36 for _, k, v in needles[:-1])


def test_variable_tracking_chain(inputs):
    ex = ruler.build("vt", inputs, length=1024, seed=2, depth=0.2)
    text = _text(inputs, ex)
    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
    chain = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text))
    assert len(chain) == 5 and len(ex.answers) == 5
    for name in ex.answers:  # every listed variable resolves to the value
        x = chain[name]
        while x.startswith("VAR "):
            x = chain[x[4:]]
        assert x == value
    assert len(ex.prompt_ids) + ex.max_new_tokens == 1024


@pytest.mark.parametrize("length, freq_cw, freq_ucw", [(2048, 6, 1), (8192, 30, 3)])  # 4K+: 30/3
def test_common_words_counts(inputs, length, freq_cw, freq_ucw):
    ex = ruler.build("cwe", inputs, length=length, seed=0)
    text = _text(inputs, ex)
    listing = text[text.rindex(ruler.CWE_TEMPLATE.strip()) :]  # the real list, after the worked example
    entries = re.findall(r"(\d+)\. ([a-z]+)", listing.split("Question:")[0])
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))  # numbered 1 … N in order
    counts = collections.Counter(w for _, w in entries)
    assert sorted(w for w, c in counts.items() if c == freq_cw) == sorted(ex.answers) and len(ex.answers) == 10
    assert set(counts.values()) == {freq_cw, freq_ucw} and len(counts) > 20
    assert len(ex.prompt_ids) + ex.max_new_tokens <= length
    assert len(ex.prompt_ids) + ex.max_new_tokens > length - 40  # filled up to within a few entries


def test_extraction_words_are_whole_corpus_words(inputs):
    """The CWE / FWE word pool holds whole words of 4-12 letters: a longer word is left out, not cut to 12."""
    text = " ".join(["The parliamentary session voted. Extraordinarily long words stay out; short ones count."] * 30)
    pool = ruler.RulerInputs(inputs.tok, synthetic.Haystack(text, inputs.tok)).words(3)
    assert set(pool) == {"session", "voted", "long", "words", "stay", "short", "ones", "count"}


def test_frequent_words_counts(inputs):
    ex = ruler.build("fwe", inputs, length=2048, seed=0)
    text = _text(inputs, ex)
    body = text[len(ruler.FWE_TEMPLATE) : text.index("Question:")]
    counts = collections.Counter(body.split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == ex.answers
    assert counts[ranked[3]] > counts[ranked[4]]  # a clear top three
    assert len(ex.prompt_ids) + ex.max_new_tokens <= 2048
    # Zipf(2) by hand: the rank-k word occurs ⌊N / (k² ζ(2))⌋ times, ζ(2) = π²/6, for one N
    zeta2 = math.pi**2 / 6
    c1 = counts["..."]
    candidates = range(math.ceil(c1 * zeta2), math.ceil((c1 + 1) * zeta2))
    assert any(all(counts[ranked[k - 1]] == math.floor(n / (k * k * zeta2)) for k in (1, 2, 3, 4)) for n in candidates)


def test_same_seed_same_prompt_and_too_short_is_an_error(inputs):
    a = ruler.build("niah_multivalue", inputs, length=1024, seed=4, depth=0.5)
    b = ruler.build("niah_multivalue", inputs, length=1024, seed=4, depth=0.5)
    assert np.array_equal(a.prompt_ids, b.prompt_ids) and a.answers == b.answers
    with pytest.raises(ValueError, match="no room for a prompt"):
        ruler.build("niah_single_2", inputs, length=130, seed=0)
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.build("qa_squad", inputs, length=1024, seed=0)


# ------------------------------------------------------------------------------------------------ end to end


def _eval_ruler(inputs, tmp_path) -> tuple[dict, object]:
    """eval.py's main on a tiny random decoder saved with the test tokenizer: niah_single_2, vt and fwe at 512
    tokens, 2 samples each; returns (results.json, the output folder)."""
    import test_eval

    from hydrahead_jax.evaluation import cli

    tok = inputs.tok
    model = test_eval.random_model(test_eval.tiny_cfg(tok.vocab_size), 1)
    folder = save_hf_folder(model, tok, tmp_path / "teacher" / "tiny")
    (tmp_path / "hay.txt").write_text(_corpus(1, 400))
    out = tmp_path / "eval"
    rc = cli.main(
        [
            "--model", f"teacher:{folder}",
            "--suite", "ruler:niah_single_2,ruler:vt,ruler:fwe",
            "--lengths", "512",
            "--ruler-samples", "2",
            "--haystack", str(tmp_path / "hay.txt"),
            "--out", str(out),
            "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    return json.loads((out / "results.json").read_text()), out


def test_eval_suite_ruler_end_to_end(inputs, tmp_path):
    """eval.py --suite ruler:… on a tiny random decoder: records per sample, scores = string_match_all of the
    stored prediction, a table and the plot."""
    res, out = _eval_ruler(inputs, tmp_path)
    samples = res["ruler_samples"]
    assert sorted({(s["task"], s["sample"]) for s in samples}) == [
        (t, i) for t in ("fwe", "niah_single_2", "vt") for i in (0, 1)
    ]
    for s in samples:
        assert s["score"] == string_match_all(s["prediction"], s["answers"])
        kind = ruler.TASKS[s["task"]]["kind"]
        assert s["length"] + ruler.TOKENS_TO_GENERATE[kind] <= 512
    recs = {(r["task"], r["length"]): r for r in res["ruler"]}
    for task in ("niah_single_2", "vt", "fwe"):
        r = recs[(task, 512)]
        mine = [s["score"] for s in samples if s["task"] == task]
        assert r["n"] == 2 and r["value"] == pytest.approx(np.mean(mine))
        assert tuple(r["ci95"]) == pytest.approx(wilson_interval(sum(mine), 2))
    assert recs[("average", 512)]["value"] == pytest.approx(
        np.mean([recs[(t, 512)]["value"] for t in ("niah_single_2", "vt", "fwe")])
    )
    report = (out / "report.md").read_text()
    assert "## RULER" in report and "| niah_single_2 |" in report and "ruler_vs_length.png" in report
    assert (out / "ruler_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def copied_answer(prompt: str) -> str:
    """What a reader that copies from its prompt answers, without any answer key: for a NIAH question, the value
    its needle gives the asked key; for variable tracking, the one variable assigned the asked value directly (the
    chain's first hop); for word-frequency questions nothing (counting is not copying)."""
    if asked := re.search(r"What is the special magic \w+ for (\S+) mentioned", prompt):
        return re.search(rf"special magic \w+ for {re.escape(asked[1])} is: (\S+?)\.", prompt)[1]
    if asked := re.search(r"assigned the value (\d+) in the text above", prompt):
        return re.search(rf"VAR (\w+) = {asked[1]}\.", prompt)[1]
    return ""


def test_eval_suite_ruler_scores_a_model_that_copies_from_the_prompt(inputs, tmp_path, monkeypatch):
    """The same eval.py run with a stand-in whose generation is ``copied_answer`` of the prompt: its scores are
    known before the run. niah_single_2 asks for one value, which it copies: 1 on both samples. vt's answer is the
    chain's 5 variables, of which it names the first: 1/5. fwe: 0. So the RULER average is (1 + 0.2 + 0) / 3; a
    wrong answer key, a prediction scored against another sample's answers or a wrong aggregation would move
    them."""
    from hydrahead_jax.evaluation import suite
    from hydrahead_jax.evaluation.runner import Generation, Runner

    tok = inputs.tok

    class CopyingRunner(Runner):
        def generate(self, prompt_ids, max_new_tokens, *, eos_id=None, **_):
            answer = copied_answer(tok.decode([int(t) for t in np.asarray(prompt_ids)[0]]))
            ids = (tok.encode(" " + answer) if answer else []) + [eos_id]
            assert len(ids) <= max_new_tokens
            return Generation(np.asarray([ids], np.int32), 0.0, [], None, None)

    monkeypatch.setattr(suite, "Runner", CopyingRunner)
    res, _ = _eval_ruler(inputs, tmp_path)
    expected = {"niah_single_2": 1.0, "vt": 0.2, "fwe": 0.0}
    scores = {(s["task"], s["sample"]): s["score"] for s in res["ruler_samples"]}
    assert scores == {(task, i): value for task, value in expected.items() for i in (0, 1)}
    recs = {(r["task"], r["length"]): r["value"] for r in res["ruler"]}
    assert recs == pytest.approx({**{(t, 512): v for t, v in expected.items()}, ("average", 512): 0.4})


# ------------------------------------------------------------------------------------------------ --combine


def _finished_run(folder, length, scores, *, model="teacher:t", digest="d0", seed=0, layers=2):
    """The results.json and journal header of a finished RULER run of ``model`` at ``length``: niah_single_1 with
    the given per-prompt scores (what eval.py writes, without running a model)."""
    settings = {"suites": ["ruler:niah_single_1"], "seed": seed, "retrieval_lengths": [length]}
    settings |= {"ruler_lengths": [length], "ruler_samples": len(scores), "ppl_lengths": [length]}
    samples = [
        {"model": model, "task": "niah_single_1", "nominal_length": length, "sample": i, "score": s}
        for i, s in enumerate(scores)
    ]
    entry = {"name": model, "spec": model, "kind": "teacher", "train_length": None, "params": 10}
    entry |= {"config": {"num_layers": layers}, "fa_groups": 2, "kv_groups": 2, "fa_groups_per_layer": [1, 1]}
    results = {"settings": settings, "models": [entry], "teacher": model, "results": [], "samples": []}
    results |= {"ruler": ruler.aggregate(samples, {}), "ruler_samples": samples, "skipped": [], "notes": []}
    results |= {"seconds": [], "environment": {"backend": "cpu", "device": "cpu"}}
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    header = {"journal": 1, "settings": settings, "models": [{"name": model, "spec": model, "params": digest}]}
    (folder / "progress.jsonl").write_text(json.dumps(header) + "\n")
    return folder


def test_combine_reports_each_length_with_its_own_samples(tmp_path, capsys):
    """eval.py --combine: two runs of one model at 1K (4 prompts) and 2K (10 prompts) become one table, one plot
    and one results.json whose cells keep their own n and interval; the average is per length."""
    from hydrahead_jax.evaluation import cli

    a = _finished_run(tmp_path / "a", 1024, [1, 1, 0, 1])
    b = _finished_run(tmp_path / "b", 2048, [1] * 3 + [0] * 7, seed=10)
    out = tmp_path / "both"
    assert cli.main(["--combine", str(a), "--combine", str(b), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    cells = {(r["task"], r["length"]): r for r in res["ruler"]}
    # By hand (Wilson, z = 1.95996): 3 of 4 -> centre (0.75 + z²/8) / (1 + z²/4) = 0.6275, half-width
    # z·sqrt(0.75·0.25/4 + z²/64) / (1 + z²/4) = 0.3269; 3 of 10: centre 0.3555, half-width 0.2477.
    assert cells[("niah_single_1", 1024)]["n"] == 4 and cells[("niah_single_1", 1024)]["value"] == 0.75
    assert cells[("niah_single_1", 1024)]["ci95"] == pytest.approx([0.3006, 0.9544], abs=1e-4)
    assert cells[("niah_single_1", 2048)]["n"] == 10 and cells[("niah_single_1", 2048)]["value"] == 0.3
    assert cells[("niah_single_1", 2048)]["ci95"] == pytest.approx([0.1078, 0.6032], abs=1e-4)
    assert cells[("average", 1024)]["value"] == 0.75 and cells[("average", 2048)]["value"] == 0.3
    assert res["settings"]["ruler_lengths"] == [1024, 2048] and res["settings"]["seed"] == [0, 10]
    assert [c["folder"] for c in res["combined_from"]] == [str(a), str(b)]
    report = (out / "report.md").read_text()
    assert "| task | 1024 | 2048 |" in report
    assert "| niah_single_1 | 0.75 [0.30, 0.95] (n=4) | 0.30 [0.11, 0.60] (n=10) |" in report
    assert (out / "ruler_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_combine_refuses_what_cannot_be_joined(tmp_path, capsys):
    """A cell measured in two runs, one name for two models (journal digests differ; without a journal, configs),
    a folder without results, a single run, --model with --combine, --out among the inputs: each refused with
    what to do, nothing written."""
    from hydrahead_jax.evaluation import cli

    a = _finished_run(tmp_path / "a", 1024, [1, 0])
    again = _finished_run(tmp_path / "again", 1024, [1, 1])
    other = _finished_run(tmp_path / "other", 2048, [1, 1], digest="d1")
    unjournaled = _finished_run(tmp_path / "unjournaled", 4096, [1], layers=3)
    (unjournaled / "progress.jsonl").unlink()  # then the model's kind, size and config identify it
    out = tmp_path / "out"
    cases = [
        ([a, unjournaled], r"model 'teacher:t' of .*/a and of .*/unjournaled differ in config"),
        ([a, again], r"niah_single_1', 1024\) is measured in both .*/a and .*/again; combine runs of different"),
        ([a, other], r"model 'teacher:t' of .*/a and of .*/other differ in parameters; combine runs of the same"),
        ([a, tmp_path / "none"], r"--combine .*/none: no results.json there; give the --out folder"),
        ([a], r"--combine needs at least two finished runs"),
    ]
    for folders, message in cases:
        assert cli.main([*(x for f in folders for x in ("--combine", str(f))), "--out", str(out)]) == 2
        assert re.search(message, capsys.readouterr().err), message
    assert cli.main(["--combine", str(a), "--combine", str(other), "--out", str(a)]) == 2
    assert "is one of the --combine folders" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.main(["--model", "teacher:smollm2-135m", "--combine", str(a), "--out", str(out)])
    assert stop.value.code == 2 and "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.main(["--out", str(out)])
    assert stop.value.code == 2 and "give --model" in capsys.readouterr().err
    assert not out.exists()

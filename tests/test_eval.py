"""eval.py and hydrahead_jax.evaluation: scoring, perplexity/agreement against numpy, greedy decoding against a
cache-free reference, errors before anything runs, the skip-with-reason path, and the whole suite end to end on
tiny random models (a plain decoder saved as a Hugging Face folder, and a HydraHead hybrid)."""

import functools
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.data import synthetic
from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer
from hydrahead_jax.evaluation import (
    ModelSpecError,
    Settings,
    Suite,
    SuiteError,
    cli,
    exact_match,
    load_model,
    normalize_answer,
    parse_lengths,
    parse_suite,
    tasks,
    write_outputs,
)
from hydrahead_jax.evaluation.runner import OutOfMemory, Runner
from hydrahead_jax.models import Transformer
from hydrahead_jax.models.loaders import save_hf_folder

SUBJECTS = [
    "The river",
    "An old farmer",
    "The small village",
    "A quiet teacher",
    "The northern forest",
    "The city council",
    "A young painter",
    "The mountain road",
    "The harbor master",
    "A travelling merchant",
]
VERBS = ["watched", "crossed", "described", "remembered", "followed", "visited", "measured", "admired"]
OBJECTS = [
    "the morning fog over the fields",
    "a long line of carts",
    "the stone bridge near the mill",
    "the autumn market in the square",
    "the lights of distant ships",
    "an orchard of apple trees",
    "the bells of the chapel",
    "a map of the valley",
]


def prose(seed: int, sentences: int) -> str:
    """Deterministic English-like prose, one paragraph per 6 sentences (the haystack splits sentences)."""
    rng = np.random.default_rng(seed)
    out = [
        f"{SUBJECTS[rng.integers(10)]} {VERBS[rng.integers(8)]} {OBJECTS[rng.integers(8)]}." for _ in range(sentences)
    ]
    return "\n".join(" ".join(out[i : i + 6]) for i in range(0, sentences, 6))


def tiny_cfg(vocab: int, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        **kw,
    )


def random_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A tiny decoder with weights large enough that its logits are far from uniform."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if var.ndim == 1:
            var.set_value((1.0 + 0.1 * rng.standard_normal(var.shape)).astype(np.float32))
        else:
            var.set_value((rng.standard_normal(var.shape) / np.sqrt(var.shape[0])).astype(np.float32))
    return model


def perturbed(model: Transformer, scale: float, seed: int) -> Transformer:
    """A copy of ``model`` with every weight moved by relative noise ``scale``: a stand-in for a distilled student
    that agrees with its teacher on some tokens and not others."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, nnx.clone(state))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(copy, nnx.Param)):
        var.set_value((var[...] * (1 + scale * rng.standard_normal(var.shape))).astype(np.float32))
    return copy


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Texts, a BPE tokenizer trained on them and the task templates, two tiny decoders saved as HF folders."""
    root = tmp_path_factory.mktemp("eval")
    texts = {"haystack": prose(0, 300), "a": prose(1, 240), "b": prose(2, 240).upper()}
    for name, text in texts.items():
        (root / f"{name}.txt").write_text(text)
    templates = [
        synthetic.NIAH_PREFIX.format(noun_pl="numbers"),
        synthetic.PASSKEY_PREFIX,
        synthetic.KV_PREFIX,
        "What is the special magic number for mentioned in the provided text? Answer: The pass key is",
    ]
    tok = train_bpe_tokenizer(list(texts.values()) + templates * 20, vocab_size=400, name="eval-test-bpe")
    cfg = tiny_cfg(tok.vocab_size)
    teacher = random_model(cfg, 1)
    student = perturbed(teacher, 0.1, 2)
    return {
        "root": root,
        "tok": tok,
        "cfg": cfg,
        "teacher": teacher,
        "student": student,
        # the same folder name gives both the same config name, so they share compiled executables
        "teacher_dir": save_hf_folder(teacher, tok, root / "teacher" / "tiny"),
        "student_dir": save_hf_folder(student, tok, root / "student" / "tiny"),
    }


# ------------------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("7421", "7421", True),
        (" 7421. Remember it.", " 7421", True),  # leading space, trailing text and punctuation
        ("\n  7421\nWhat else", "7421", True),  # first line after leading whitespace
        ("74210", "7421", False),  # digit strings, not prefixes
        ("007421", "7421", False),
        ("The pass key is 7421", "7421", True),  # numbers: the first number of the first line
        ("7422", "7421", False),
        ("\n\n", "7421", False),
        ("1234567, 7654321.", " 1234567 7654321", True),  # lists of numbers
        ("1234567 7654322", " 1234567 7654321", False),
        ("Apple.", "apple", True),
        ("  APPLE   pie!! and more", "apple pie", True),
        ("apples", "apple", False),
        ("The apple", "apple", False),  # words: the answer must come first
        ("pie apple", "apple pie", False),
        ('3f2a-bc01"}', "3f2a-bc01", True),  # uuid-like values keep inner hyphens
        ('3f2a-bc02"', "3f2a-bc01", False),
        ("ABCDE, FGHIJ, KLMNO.", " ABCDE FGHIJ KLMNO", True),
    ],
)
def test_exact_match_hand_made_cases(prediction, answer, expected):
    assert exact_match(prediction, answer) is expected


def test_normalize_answer_and_empty_reference():
    assert normalize_answer("  Hello,   World!! \n") == "hello world"
    assert normalize_answer("a.b-c") == "a.b-c"
    with pytest.raises(ValueError, match="empty after normalisation"):
        exact_match("7421", " ... ")


# ------------------------------------------------------------------------------------------------ parsing and errors


def test_parse_suite_and_lengths():
    assert parse_suite("niah, ppl,niah") == ("niah", "ppl")
    assert parse_suite("demo") == ("niah", "passkey", "ppl", "agreement", "efficiency")
    assert parse_lengths("1k,2k,512,32k") == (1024, 2048, 512, 32768)
    with pytest.raises(SuiteError, match="unknown suite 'bogus'.*niah"):
        parse_suite("niah,bogus")
    with pytest.raises(SuiteError, match="cannot read length 'abc'"):
        parse_lengths("1k,abc")
    assert cli.parse_bytes("10MB") == 10 * 2**20 and cli.parse_bytes("2GiB") == 2 * 2**30


def test_cli_errors_come_before_any_model_loads(world, tmp_path, monkeypatch, capsys):
    def no_loading(_):
        raise AssertionError("models were loaded before the settings were checked")

    monkeypatch.setattr(cli, "load_models", no_loading)
    rc = cli.main(["--model", str(world["teacher_dir"]), "--suite", "niah,bogus", "--out", str(tmp_path / "o")])
    assert rc == 2 and "unknown suite 'bogus'" in capsys.readouterr().err
    rc = cli.main(["--model", str(world["teacher_dir"]), "--depths", "0,2", "--out", str(tmp_path / "o")])
    assert rc == 2 and "every depth must lie in [0, 1]" in capsys.readouterr().err
    rc = cli.main(
        [
            "--model",
            str(world["teacher_dir"]),
            "--ppl-windows",
            "4",
            "--window-split",
            "4",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 2 and "leaves no window after it" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_reports_unusable_inputs_before_the_suite_runs(world, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("too short\n")  # no sentence a haystack could use
    rc = cli.main(
        [
            "--model",
            str(world["teacher_dir"]),
            "--suite",
            "passkey",
            "--lengths",
            "256",
            "--haystack",
            str(tmp_path / "empty.txt"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "cannot prepare the evaluation inputs" in err and "haystack text has no sentences" in err
    assert not (tmp_path / "o").exists()


def test_cli_rejects_a_folder_that_is_not_a_model(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not weights")
    rc = cli.main(["--model", str(junk), "--suite", "ppl", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "is not a" in err and str(junk) in err
    rc = cli.main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------ numerics


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def full_logits(model: Transformer, ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of one plain causal forward pass (no cache), as float64."""
    return np.asarray(_forward(*nnx.split(model), jnp.asarray(ids)), np.float64)


def _np_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_perplexity_and_agreement_match_numpy_from_full_logits(world):
    teacher, student = world["teacher"], world["student"]
    ids = np.random.default_rng(0).integers(0, world["cfg"].vocab_size, 45).astype(np.int32)
    # chunk 16 over 44 / 45 positions: ragged last chunks on both paths
    s_run, t_run = Runner(student, logits_chunk=16), Runner(teacher, logits_chunk=16)
    out = tasks.text_window(s_run, ids, want_nll=True, teacher=t_run, teacher_hidden=t_run.hidden_states(ids[None]))

    lp_s = _np_log_softmax(full_logits(student, ids[None])[0])
    lp_t = _np_log_softmax(full_logits(teacher, ids[None])[0])
    ref_nll = -lp_s[np.arange(44), ids[1:]]
    np.testing.assert_allclose(out["nll"], ref_nll, rtol=1e-5, atol=1e-5)
    ref_kl = (np.exp(lp_t) * (lp_t - lp_s)).sum(-1)
    np.testing.assert_allclose(out["kl"], ref_kl, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(out["top1"], lp_t.argmax(-1) == lp_s.argmax(-1))
    assert ref_kl.mean() > 0.1 and 0 < out["top1"].mean() < 1  # two different models: a non-trivial case
    assert math.isclose(math.exp(out["nll"].mean()), math.exp(ref_nll.mean()), rel_tol=1e-6)


def test_greedy_generation_through_the_cache_matches_full_recomputation(world):
    model = world["teacher"]
    prompt = np.random.default_rng(1).integers(0, world["cfg"].vocab_size, (1, 23)).astype(np.int32)
    gen = Runner(model).generate(prompt, 6)
    # reference without a cache: each greedy token is the argmax of a full causal pass over the sequence so far;
    # causality lets one pass over prompt + generated tokens check every step at once
    seq = np.concatenate([prompt, gen.tokens], axis=1)
    np.testing.assert_array_equal(gen.tokens[0], full_logits(model, seq)[0, 22:28].argmax(-1))
    assert gen.prefill_bytes > 0 and len(gen.decode_s) == 5


def test_teacher_forced_answer_scores_match_a_full_forward_pass(world):
    """generate(..., score_ids=a): log p(a_j | prompt, a_<j) from the decode cache equals the log-softmax of one
    full causal pass over prompt + a (no cache), for the teacher and for a hybrid whose GDN state is in the cache;
    the greedy tokens are those of a generation without scoring (the scoring steps run on a copy of the cache)."""
    from hydrahead_jax.hybrid import HeadMap, build_student

    cfg = world["cfg"]
    hybrid = build_student(world["teacher"], HeadMap.from_fa_groups(cfg, [[0], []], method="test"))
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, (1, 23)).astype(np.int32)
    answer = rng.integers(0, cfg.vocab_size, (1, 5)).astype(np.int32)
    for name, model in (("teacher", world["teacher"]), ("hybrid", hybrid)):
        runner = Runner(model)
        scored = runner.generate(prompt, 6, score_ids=answer)
        np.testing.assert_array_equal(scored.tokens, runner.generate(prompt, 6).tokens, err_msg=name)
        lp = _np_log_softmax(full_logits(model, np.concatenate([prompt, answer[:, :-1]], axis=1)))[0, 22:]
        want = lp[np.arange(5), answer[0]]
        assert want.min() < -1.0  # random tokens: far from certain, so the check is not of values near 0
        # measured (2026-12-03): at most 2.1e-6 nats apart (teacher; hybrid 1.0e-6), the f32 cache path against
        # the f32 full pass
        np.testing.assert_allclose(scored.score_logprobs[0], want, rtol=0, atol=6e-6, err_msg=name)


def test_cache_sizes_of_the_teacher_by_hand(world):
    cfg = world["cfg"]
    sizes = tasks.cache_sizes(world["teacher"], 300)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, float32
    assert sizes == {"kv_bytes_per_token": per_token, "state_bytes": 0, "total_bytes": 300 * per_token}


def test_memory_limit_refuses_before_running(world):
    runner = Runner(world["teacher"], memory_limit=1 << 20)
    runner.check_fits(1, 128, 256)  # small: fits in 1 MiB beyond the parameters
    with pytest.raises(OutOfMemory, match=r"GiB beyond the parameters .*--memory-limit"):
        runner.check_fits(1, 8192, 8448)
    with pytest.raises(OutOfMemory):  # remembered: fails again without compiling
        runner.prefill_executable(1, 8192, 8448)


# ------------------------------------------------------------------------------------------------ end to end


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_eval_cli_end_to_end_with_teacher_student_and_a_skipped_length(world, tmp_path):
    root, out = world["root"], tmp_path / "eval"
    rc = cli.main(
        [
            "--model",
            f"teacher:{world['teacher_dir']}",
            "--model",
            f"student={world['student_dir']}",
            "--suite",
            "niah,passkey,kv,ppl,agreement,efficiency",
            "--lengths",
            "256,16k",
            "--ppl-lengths",
            "256",
            "--depths",
            "0,1",
            "--samples",
            "1",
            "--decode-steps",
            "3",
            "--memory-limit",
            "10MB",
            "--haystack",
            str(root / "haystack.txt"),
            "--text",
            f"a={root / 'a.txt'}",
            "--text",
            f"b={root / 'b.txt'}",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    names = ["teacher:tiny", "student"]
    assert [m["name"] for m in res["models"]] == names and res["teacher"] == "teacher:tiny"
    recs = res["results"]

    def find(**kw):
        return [r for r in recs if all(r.get(k) == v for k, v in kw.items())]

    # Outcomes known in advance: these random-weight models never write a needle's value (a real teacher that
    # answers every needle is tests/test_pretrained.py's), so every retrieval cell scores 0.
    for name in names:
        for depth in (0.0, 1.0):
            (r,) = find(model=name, task="niah", length=256, depth=depth)
            assert r["n"] == 1 and r["seeds"] == [0] and r["value"] == 0.0
            # the cell's answer NLL is its one prompt's (a random model: far from 0 nats per token)
            (sample,) = [
                x for x in res["samples"] if x["model"] == name and x["task"] == "niah" and x["target_depth"] == depth
            ]
            assert r["answer_nll"] == sample["answer_nll"] > 1.0 and r["answer_nll_ci95"] is None
        for task in ("passkey", "kv"):
            (r,) = find(model=name, task=task, length=256)
            assert r["value"] == 0.0
        for source in ("a", "b"):
            (r,) = find(model=name, task="ppl", source=source, length=256)
            assert r["n"] == 2 and r["tokens"] == 2 * 255 and r["value"] > 1
        (r,) = find(model=name, task="efficiency", metric="prefill_s", length=256)
        assert r["value"] > 0
        # 16K does not fit in the 10 MB limit: skipped with the reason, for every long-context task
        reasons = {(s["task"], s["length"]): s["reason"] for s in res["skipped"] if s["model"] == name}
        for task in ("niah", "passkey", "kv", "efficiency"):
            assert "--memory-limit" in reasons[(task, 16384)] and not find(model=name, task=task, length=16384)
    # agreement only for the student, against the teacher
    assert not find(model="teacher:tiny", task="agreement")
    (top1,) = find(model="student", task="agreement", metric="top1", source="a", length=256)
    (kl,) = find(model="student", task="agreement", metric="kl", source="a", length=256)
    assert 0 < top1["value"] < 1 and kl["value"] > 0 and top1["positions"] == 512
    # two windows: a bootstrap interval over them (the two windows' means, test_bootstrap_interval_over_rows)
    assert top1["windows"] == kl["windows"] == 2
    # the two windows' own means (256 positions each, so their mean is the pooled one), for paired comparisons
    assert len(kl["window_values"]) == 2 and np.mean(kl["window_values"]) == pytest.approx(kl["value"], rel=1e-12)
    assert kl["ci95"][0] < kl["value"] < kl["ci95"][1] and top1["ci95"][0] <= top1["value"] <= top1["ci95"][1]

    # perplexity against numpy over the same windows (the first two 256-token windows of the text)
    ids = np.asarray(world["tok"].encode((root / "a.txt").read_text()), np.int32)[:512].reshape(2, 256)
    lp = _np_log_softmax(full_logits(world["teacher"], ids))
    nll = -np.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)
    (r,) = find(model="teacher:tiny", task="ppl", source="a", length=256)
    assert math.isclose(r["value"], math.exp(nll.mean()), rel_tol=1e-5)

    # same prompts for both models; the stored flag is the documented exact match
    by_model = {
        n: {(s["task"], s["nominal_length"], s["target_depth"]): s for s in res["samples"] if s["model"] == n}
        for n in names
    }
    assert by_model[names[0]].keys() == by_model[names[1]].keys() and len(by_model[names[0]]) == 4
    for key, s in by_model[names[0]].items():
        assert s["answer"] == by_model[names[1]][key]["answer"]
        assert s["correct"] == exact_match(s["prediction"], s["answer"]) and not s["correct"]

    report = (out / "report.md").read_text()
    assert "| teacher:tiny | student |" in report and "## Skipped" in report and "--memory-limit" in report
    assert "Answer NLL" in report
    for png in (
        "niah_heatmap_teacher_tiny.png",
        "niah_heatmap_student.png",
        "retrieval_vs_length.png",
        "perplexity_vs_length.png",
        "efficiency_vs_length.png",
    ):
        assert _is_png(out / png), png


def test_windows_reported_apart_recombine_into_the_whole(world, tmp_path):
    """--window-split 2 of 4 windows: each group's KL and top-1 are the means of its windows' own values in the
    whole cell's record (equal windows, so the pooled mean), its perplexity recombines with the other group's into
    the whole cell's (geometric mean over equal token counts), and the report shows the groups as sources."""
    out = tmp_path / "eval"
    args = ["--model", f"teacher:{world['teacher_dir']}", "--model", f"student={world['student_dir']}"]
    args += ["--suite", "ppl,agreement", "--ppl-lengths", "64", "--ppl-windows", "4", "--window-split", "2"]
    args += ["--text", f"a={world['root'] / 'a.txt'}", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    recs = json.loads((out / "results.json").read_text())["results"]

    def one(**kw):
        (r,) = [r for r in recs if all(r.get(k) == v for k, v in kw.items())]
        return r

    for metric in ("kl", "top1"):
        whole = one(model="student", task="agreement", metric=metric, source="a")
        assert whole["windows"] == 4
        for label, part in (("a, windows 0-1", slice(0, 2)), ("a, windows 2-3", slice(2, 4))):
            group = one(model="student", task="agreement", metric=metric, source=label)
            assert group["windows"] == 2 and group["positions"] == 2 * 64  # as the whole cell: 64 per window
            assert group["value"] == pytest.approx(np.mean(whole["window_values"][part]), rel=1e-12)
    for model in ("teacher:tiny", "student"):
        whole = one(model=model, task="ppl", source="a")
        first, second = (one(model=model, task="ppl", source=f"a, windows {w}") for w in ("0-1", "2-3"))
        assert math.exp((math.log(first["value"]) + math.log(second["value"])) / 2) == pytest.approx(
            whole["value"], rel=1e-9
        )
    assert "| a, windows 2-3 @ 64 |" in (out / "report.md").read_text()


def test_suite_on_an_exported_hybrid_reports_constant_state_and_lengths_beyond_training(world, tmp_path):
    from hydrahead_jax.export import export_final
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student

    cfg = world["cfg"]
    head_map = HeadMap.from_fa_groups(cfg, [[0], []], method="test")  # layer 0: one FA group, layer 1: all GDN
    student = build_student(world["teacher"], head_map)
    graphdef, state = nnx.split(student)
    train_config = {
        "stage1": {"seq_len": 128},
        "stage3": {"seq_len": 256},
        "data": {"source": "enwiki", "validation_fraction": 0.05},
    }
    final = export_final(
        tmp_path / "run" / "final",
        graphdef,
        jax.tree.map(lambda x: x.copy(), nnx.as_pure(state)),
        cfg,
        head_map,
        HybridConfig(),
        teacher_source=str(world["teacher_dir"]),
        resolved_config=train_config,
    )
    hybrid = load_model(f"hybrid={final}")
    assert (hybrid.name, hybrid.kind, hybrid.train_length) == ("hybrid", "hydrahead", 256)
    assert hybrid.info["corpus"] == {"source": "enwiki", "validation_fraction": 0.05}
    assert hybrid.info["fa_groups"] == 1 and hybrid.info["kv_groups"] == 4
    ids = np.arange(40, dtype=np.int32)[None] % cfg.vocab_size
    np.testing.assert_array_equal(full_logits(hybrid.model, ids), full_logits(student, ids))

    settings = Settings(
        suites=("passkey", "efficiency"),
        retrieval_lengths=(512,),
        ppl_lengths=(256,),
        efficiency_lengths=(256, 512),
        samples=1,
        decode_steps=2,
        haystack=str(world["root"] / "haystack.txt"),
    )
    suite = Suite([hybrid], settings).run(progress=False)
    res = write_outputs(suite, tmp_path / "eval")
    eff = {(r["metric"], r["length"]): r for r in res["results"] if r["task"] == "efficiency"}
    # by hand: KV only for layer 0's one FA group (k and v, 16 dims, f32); GDN state per LA query head 16x16 f32
    # plus the 3-tap conv state over q, k (per LA head) and v channels
    kv = 2 * 1 * 16 * 4
    state = (2 * 16 * 16 * 4 + 3 * (2 + 2 * 1) * 16 * 4) + (4 * 16 * 16 * 4 + 3 * (4 + 2 * 2) * 16 * 4)
    for length in (256, 512):
        assert eff[("kv_bytes_per_token", length)]["value"] == kv
        assert eff[("state_bytes", length)]["value"] == state
        assert eff[("total_bytes", length)]["value"] == kv * length + state
    assert eff[("prefill_s", 512)]["beyond_train_length"] and not eff[("prefill_s", 256)]["beyond_train_length"]
    (passkey,) = [r for r in res["results"] if r["task"] == "passkey"]
    assert passkey["beyond_train_length"] and passkey["n"] == 1
    assert "| hybrid | hydrahead |" in (tmp_path / "eval" / "report.md").read_text()


def test_an_export_without_a_tokenizer_is_a_clear_error(world, tmp_path):
    from hydrahead_jax.export import export_final
    from hydrahead_jax.hybrid import HeadMap, HybridConfig

    graphdef, state = nnx.split(world["teacher"])
    final = export_final(
        tmp_path / "final",
        graphdef,
        jax.tree.map(lambda x: x.copy(), nnx.as_pure(state)),
        world["cfg"],
        HeadMap.all_fa(world["cfg"]),
        HybridConfig(),
        teacher_source=None,
    )
    with pytest.raises(ModelSpecError, match="records no tokenizer"):
        load_model(str(final))


# ------------------------------------------------------------------------------------------------ intervals
def test_wilson_intervals_against_hand_computed_values():
    from hydrahead_jax.evaluation.intervals import wilson_interval

    # by hand, z = 1.96: 0 of 100 → [0, z²/n / (1 + z²/n)] = [0, 0.0370]; 50 of 100 → 0.5 ± 0.0962;
    # 10 of 100 → [0.0552, 0.1744]; 4 of 4 → [1/(1 + z²/4), 1] = [0.5101, 1]
    for (k, n), want in {
        (0, 100): (0.0, 0.036994),
        (50, 100): (0.403832, 0.596168),
        (10, 100): (0.055229, 0.174366),
        (4, 4): (0.510109, 1.0),
    }.items():
        np.testing.assert_allclose(wilson_interval(k, n), want, atol=2e-6)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(5, 4)


def test_bootstrap_interval_over_rows():
    from hydrahead_jax.evaluation.intervals import bootstrap_interval

    # two rows: resampled means are x1 (p 1/4), their mean (p 1/2), x2 (p 1/4), so the 2.5 / 97.5 % points are x1, x2
    np.testing.assert_allclose(bootstrap_interval([1.0, 3.0], resamples=4000), (1.0, 3.0))
    # token weights: a row of 3 tokens at 0 and one of 1 token at 4 give means 0, 1, 4 (p 1/4, 1/2, 1/4)
    np.testing.assert_allclose(bootstrap_interval([0.0, 4.0], [3, 1], resamples=4000), (0.0, 4.0))
    assert bootstrap_interval([2.5]) is None  # one row: no spread to resample
    lo, hi = bootstrap_interval(np.random.default_rng(0).normal(1.0, 0.5, 400))
    assert lo < 1.0 < hi and 0.05 < hi - lo < 0.15  # ≈ 2 · 1.96 · 0.5 / √400 = 0.098


def test_report_pools_niah_depths_with_a_wilson_interval():
    from hydrahead_jax.evaluation.report import _fmt_record, pooled_accuracy

    cells = [{"value": 0.5, "n": 50}, {"value": 0.1, "n": 50}]  # 25 + 5 of 100 right
    pooled = pooled_accuracy(cells)
    assert pooled["n"] == 100 and pooled["value"] == 0.3
    np.testing.assert_allclose(pooled["ci95"], (0.219, 0.396), atol=1e-3)  # Wilson 30 / 100 by hand
    assert _fmt_record(pooled, "pct") == "30% [22–40]"
    assert pooled_accuracy([]) is None


def test_report_pools_answer_nll_over_depths_with_a_bootstrap_interval():
    """Two depths of one length pooled: the mean of the four prompts' NLLs, (1 + 3 + 2 + 2) / 4 = 2.00, inside
    its percentile-bootstrap interval, which lies within the values' range [1, 3]; a model without scored samples
    shows '–', and a task without any gives no rows."""
    from hydrahead_jax.evaluation.report import answer_nll_rows

    samples = [
        {"model": "a", "task": "niah", "nominal_length": 512, "target_depth": d, "answer_nll": x}
        for d, x in ((0.1, 1.0), (0.1, 3.0), (0.9, 2.0), (0.9, 2.0))
    ]
    samples.append({"model": "b", "task": "niah", "nominal_length": 512, "target_depth": 0.1, "answer_nll": None})
    ((length, cell_a, cell_b),) = answer_nll_rows(samples, "niah", ["a", "b"])
    mean, lo, hi = (float(x) for x in re.fullmatch(r"([\d.]+) \[([\d.]+)–([\d.]+)\]", cell_a).groups())
    assert (length, mean, cell_b) == ("512", 2.0, "–") and 1.0 <= lo < 2.0 < hi <= 3.0
    assert answer_nll_rows(samples, "passkey", ["a", "b"]) == []


def _without_timings(x):
    """A results.json tree without what differs between two runs of the same evaluation: times and environment."""
    if isinstance(x, dict):
        return {
            k: _without_timings(v)
            for k, v in x.items()
            if k not in ("seconds", "environment") and not k.endswith("_s") and not k.endswith("_s_per_token")
        }
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def test_an_evaluation_killed_part_way_resumes_where_it_stopped(world, tmp_path, monkeypatch, capsys):
    from hydrahead_jax.evaluation import journal as journal_mod

    root = world["root"]
    models = ["--model", f"teacher:{world['teacher_dir']}", "--model", f"student={world['student_dir']}"]
    inputs = ["--haystack", str(root / "haystack.txt"), "--text", f"a={root / 'a.txt'}"]
    suite = "--suite niah,ppl,agreement --lengths 256,16k --depths 0,1 --memory-limit 10MB --no-progress".split()
    args = [*models, *inputs, *suite, "--samples", "2"]
    assert cli.main([*args, "--out", str(tmp_path / "whole")]) == 0

    # The same evaluation killed after its 7th unit (before that unit's journal line is written), and the journal's
    # last line cut short as a kill mid-write leaves it.
    calls = {"n": 0}
    append = journal_mod.Journal.append

    def killed_after_six(self, entry):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        append(self, entry)

    monkeypatch.setattr(journal_mod.Journal, "append", killed_after_six)
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        cli.main([*args, "--out", str(out)])
    monkeypatch.setattr(journal_mod.Journal, "append", append)
    path = out / journal_mod.NAME
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 6 and not (out / "results.json").exists()  # the header and six units
    with open(path, "a") as f:
        f.write('{"key": "student|niah||256|1|0.0", "mod')

    capsys.readouterr()
    assert cli.main([*args, "--out", str(out)]) == 0
    assert "resuming: 6 of" in capsys.readouterr().err
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    resumed = json.loads((out / "results.json").read_text())
    assert _without_timings(resumed) == _without_timings(whole)
    keys = [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]]
    assert len(keys) == len(set(keys))  # every unit ran once: the six replayed ones were not run again

    # Another setting with the same --out: refused before any work, naming the difference; the journal is kept.
    before = path.read_text()
    assert cli.main([*models, *inputs, *suite, "--samples", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "settings.samples: 2 there, 3 now" in err and "another --out" in err
    assert path.read_text() == before


def test_journal_lines_cut_by_a_kill_and_journals_of_other_runs(tmp_path):
    from hydrahead_jax.evaluation.journal import NAME, Journal, JournalError

    header = {"settings": {"samples": 2}, "models": [{"name": "m", "params": "abc"}]}
    path = tmp_path / NAME
    # a kill inside the header's write: nothing finished, the stub is dropped and a whole header written
    path.write_text('{"journal": 1, "sett')
    journal = Journal(tmp_path, header)
    assert journal.load() == [] and path.read_bytes() == b""
    journal.start()
    journal.append({"key": "a", "n": np.float32(0.5), "arr": np.arange(2)})
    # a kill just before a line's newline: the whole entry is kept and the newline restored
    with open(path, "a") as f:
        f.write('{"key": "b"}')
    assert Journal(tmp_path, header).load() == [{"key": "a", "n": 0.5, "arr": [0, 1]}, {"key": "b"}]
    Journal(tmp_path, header).append({"key": "c"})
    assert [e["key"] for e in Journal(tmp_path, header).load()] == ["a", "b", "c"]
    # another run's journal is refused, naming the difference, and left as it is
    before = path.read_bytes()
    other = {"settings": {"samples": 3}, "models": [{"name": "m", "params": "abc"}]}
    with pytest.raises(JournalError, match="settings.samples: 2 there, 3 now"):
        Journal(tmp_path, other).load()
    assert path.read_bytes() == before
    # a damaged line with lines after it is not a kill's cut: refused, nothing changed
    path.write_bytes(before.replace(b'{"key": "b"}', b'{"key": "b'))
    with pytest.raises(JournalError, match="line 3 is not JSON"):
        Journal(tmp_path, header).load()
    # per_run_folder: each header in its own folder
    assert (
        Journal(tmp_path, header, per_run_folder=True).path.parent
        != Journal(tmp_path, other, per_run_folder=True).path.parent
    )


def test_an_evaluation_on_gs_writes_its_report_there_and_resumes_from_it(world, tmp_path, capsys):
    """--out gs://…: against a GCS API on 127.0.0.1 (gcs_emulator.py), the report, results and journal land in the
    bucket; a second run finds the journal there and replays every unit instead of running it again."""
    from gcs_emulator import BUCKET, emulator_env, gcs_emulator

    from hydrahead_jax.evaluation.journal import NAME
    from hydrahead_jax.storage import run_path

    root = world["root"]
    args = ["--model", f"student={world['student_dir']}", "--text", f"a={root / 'a.txt'}"]
    args += "--suite ppl --lengths 256 --samples 2 --no-progress".split()
    with gcs_emulator(tmp_path) as variables, emulator_env(variables):
        url = f"gs://{BUCKET}/eval"
        assert cli.main([*args, "--out", url]) == 0
        out = run_path(url)
        results = json.loads((out / "results.json").read_text())
        assert (out / "report.md").read_text() and len((out / NAME).read_text().splitlines()) > 1
        capsys.readouterr()
        assert cli.main([*args, "--out", url]) == 0
        assert "resuming:" in capsys.readouterr().err
        assert _without_timings(json.loads((out / "results.json").read_text())) == _without_timings(results)

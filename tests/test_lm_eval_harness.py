"""HydraHeadLM (hydrahead_jax.evaluation.harness) against lm-eval's own ``hf`` backend on the same model.

The local tasks under tests/lm_eval_tasks/ (a multiple-choice task, a rolling-loglikelihood task, a generation task
with stop sequences; JSONL beside the YAML, no hub) run through lm-eval twice: with ``HFLM`` on a tiny random
transformers folder (tests/oracle.py) and with ``HydraHeadLM`` on the same folder loaded by our loader. Every
request's log-likelihood must agree within ``LOGLIK_ATOL`` (+ ``LOGLIK_RTOL`` relative), every greedy flag,
accuracy and generated text exactly. ``max_length`` = 64 for both, so the rolling task's longer documents span
several windows and the generation task's longest prompts are left-truncated.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from lm_eval_helpers import MAX_LENGTH, TASKS, TASKS_DIR, lm_eval_run, loglik_values, responses
from oracle import import_oracle, save_tiny_hf_model

# Measured on the tiny Llama (float32, both sides; 2026-12-07): max |Δ log-likelihood| 3.05e-5 over the 31 results
# (27 choices, 4 rolling documents: sums of up to 250 token log-probs of about -6 each, the largest |value| 1448),
# float32 rounding of a different summation order (torch's SDPA vs XLA's dot products). The bound leaves 3x headroom.
LOGLIK_ATOL = 1e-4
LOGLIK_RTOL = 1e-6
# SmolLM2-135M (the Q4_1 GGUF dequantised to float32 by each side's own reader), choice and generation tasks:
# measured max |Δ log-likelihood| 3.9e-5 over 27 results; 5x headroom.
SMOLLM2_LOGLIK_ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama as a transformers folder, with lm-eval's hf backend and HydraHeadLM run on it."""
    import_oracle("torch")
    import_oracle("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from hydrahead_jax.evaluation.harness import HydraHeadLM

    folder = save_tiny_hf_model(tmp_path_factory.mktemp("lm_eval") / "llama", "llama")
    hf = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1, max_length=MAX_LENGTH)
    ours = HydraHeadLM(model=str(folder), max_length=MAX_LENGTH)
    started = time.perf_counter()
    hf_results = lm_eval_run(hf)
    hf_s = time.perf_counter() - started
    started = time.perf_counter()
    our_results = lm_eval_run(ours)
    our_s = time.perf_counter() - started
    print(f"\nlm-eval on the tiny Llama: hf {hf_s:.1f} s, HydraHeadLM {our_s:.1f} s, programs {sorted(ours.programs)}")
    return {"folder": folder, "hf": hf, "ours": ours, "hf_results": hf_results, "our_results": our_results}


def test_buckets():
    from hydrahead_jax.evaluation.harness import MIN_BUCKET, bucket, bucket_below

    assert [bucket(n) for n in (1, 16, 17, 64, 65)] == [MIN_BUCKET, 16, 32, 64, 128]
    assert bucket(65, cap=100) == 100 and bucket(101, cap=100) == 128  # the cap: the model's max length
    assert [bucket_below(n) for n in (1, 2, 3, 63, 64, 65)] == [1, 2, 2, 32, 64, 64]


@pytest.mark.slow
def test_every_request_agrees_with_lm_evals_hf_backend(tiny):
    hf, ours = responses(tiny["hf_results"]), responses(tiny["our_results"])
    assert set(hf) == set(ours) == set(TASKS)
    a, b = loglik_values(tiny["hf_results"]), loglik_values(tiny["our_results"])
    diff = np.abs(a - b)
    print(f"\nmax |Δ loglik| {diff.max():.2e} over {diff.size} values (largest |value| {np.abs(a).max():.0f})")
    np.testing.assert_allclose(b, a, rtol=LOGLIK_RTOL, atol=LOGLIK_ATOL)
    greedy = lambda docs: [[r[1] for r in resp] for resp in docs]  # noqa: E731
    assert greedy(ours["hh_choice"]) == greedy(hf["hh_choice"])
    assert ours["hh_generate"] == hf["hh_generate"]
    for task in TASKS:  # the aggregated metrics: accuracies equal, perplexities to the same tolerance
        h, o = tiny["hf_results"]["results"][task], tiny["our_results"]["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in h:
                assert o[metric] == h[metric], (task, metric)
        for metric in ("byte_perplexity,none", "bits_per_byte,none"):
            if metric in h:
                np.testing.assert_allclose(o[metric], h[metric], rtol=1e-5)
    # The rolling task reached past max_length (several windows per long document), the generation task's longest
    # prompt was left-truncated: both paths of HFLM's were compared.
    tok = tiny["ours"].tokenizer
    rolling = [json.loads(x)["text"] for x in (TASKS_DIR / "data" / "rolling.jsonl").read_text().splitlines()]
    assert max(len(tok.encode(t)) for t in rolling) > 2 * MAX_LENGTH
    questions = [json.loads(x)["question"] for x in (TASKS_DIR / "data" / "generate.jsonl").read_text().splitlines()]
    assert max(len(tok.encode(q)) for q in questions) > MAX_LENGTH - 12


@pytest.mark.slow
def test_a_task_compiles_a_handful_of_programs(tiny):
    # 27 choice requests and 7 rolling windows score in 2 length buckets, 6 prompts generate as one batch of 8 rows:
    # one prefill and one decode step.
    kinds = sorted(p[0] for p in tiny["ours"].programs)
    assert kinds.count("prefill") == 1 and kinds.count("decode") == 1
    assert kinds.count("score") <= 3, sorted(tiny["ours"].programs)


@pytest.mark.slow
def test_stop_sequences_cut_generations_as_hf_does(tiny):
    """Stop strings taken from the middle of the free generations, so every one is hit part-way."""
    from lm_eval.api.instance import Instance

    free = [resp[0] for resp in responses(tiny["hf_results"])["hh_generate"]]
    questions = [json.loads(x)["question"] for x in (TASKS_DIR / "data" / "generate.jsonl").read_text().splitlines()]
    requests = []
    for i, (question, text) in enumerate(zip(questions, free, strict=True)):
        stop = text[3:5] if len(text) >= 5 else "\n"
        kwargs = {"until": [stop, "never-generated"], "max_gen_toks": 12, "do_sample": False}
        requests.append(Instance("generate_until", {}, (question, kwargs), i))
    hf_out = tiny["hf"].generate_until(requests, disable_tqdm=True)
    our_out = tiny["ours"].generate_until(requests, disable_tqdm=True)
    assert our_out == hf_out
    assert sum(len(o) < len(f) for o, f in zip(our_out, free, strict=True)) >= 4  # the stops did cut


def test_sampling_is_refused_in_one_line(tiny_lm):
    from lm_eval.api.instance import Instance

    from hydrahead_jax.evaluation.harness import HarnessError

    request = Instance("generate_until", {}, ("Hello", {"until": ["\n"], "do_sample": True, "temperature": 0.7}), 0)
    with pytest.raises(HarnessError, match="decodes greedily"):
        tiny_lm.generate_until([request])


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    import_oracle("lm_eval")
    from hydrahead_jax.evaluation.harness import HydraHeadLM

    folder = save_tiny_hf_model(tmp_path_factory.mktemp("lm_eval_small") / "qwen3", "qwen3")
    return HydraHeadLM(model=str(folder), max_length=MAX_LENGTH)


def _full_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), V] of one forward pass over ``ids`` right-padded to MAX_LENGTH (one compiled program;
    positions before the padding do not read it)."""
    graphdef, state = nnx.split(model)
    row = np.zeros((1, MAX_LENGTH), np.int32)
    row[0, : len(ids)] = ids
    return np.asarray(_forward(graphdef, state, row), np.float64)[0, : len(ids)]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids)


def _full_forward_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[t+1] | ids[:t+1]) from one full forward pass (float64 log-softmax in numpy)."""
    logits = _full_logits(model, ids[:-1])
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(ids) - 1), ids[1:]]


def _hybrid_export(teacher_dir: Path, out: Path, **hybrid):
    """A tiny HydraHead student of the teacher folder (layer 0: one FA group; layer 1: all GDN), exported."""
    from hydrahead_jax.export import export_final
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
    from hydrahead_jax.models import load_pretrained

    teacher, _ = load_pretrained(str(teacher_dir))
    head_map = HeadMap.from_fa_groups(teacher.cfg, [[0], []], method="test")
    hybrid_cfg = HybridConfig(**hybrid)
    student = build_student(teacher, head_map, hybrid_cfg)
    graphdef, state = nnx.split(student)
    return export_final(
        out,
        graphdef,
        jax.tree.map(lambda x: x.copy(), nnx.as_pure(state)),
        teacher.cfg,
        head_map,
        hybrid_cfg,
        teacher_source=str(teacher_dir),
    )


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [{}, {"la_window": 8, "la_sinks": 2, "fusion_init": "fit"}], ids=["gdn", "stream"])
def test_an_exported_student_scores_as_its_own_full_forward_and_generates_through_its_cache(tmp_path, hybrid):
    """No transformers reference exists for a student (see the export_hf tests for that): here its padded,
    bucketed scores equal an unpadded full forward, and its greedy generation through the decode cache (ragged
    prompts, teacher-forced tails) equals greedy decoding by full recomputation."""
    import_oracle("lm_eval")
    from lm_eval.api.instance import Instance

    from hydrahead_jax.evaluation.harness import HydraHeadLM

    folder = save_tiny_hf_model(tmp_path / "teacher", "qwen2")
    lm = HydraHeadLM(model=str(_hybrid_export(folder, tmp_path / "final", **hybrid)), max_length=MAX_LENGTH)
    model, tok = lm.evaluated.model, lm.tokenizer
    pairs = [("The quick brown", " fox jumps"), ("Pack my box with five dozen", " liquor jugs."), ("x", " = 42")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    for (context, continuation), (logp, _) in zip(pairs, lm.loglikelihood(requests, disable_tqdm=True), strict=True):
        whole, head = tok.encode(context + continuation), tok.encode(context)
        expected = _full_forward_logprobs(model, whole)[len(head) - 1 :].sum()
        assert abs(logp - expected) < 1e-4 * max(1.0, abs(expected))
    prompts = ["How vexingly quick daft zebras jump!", "0123456789 (x + y)", "def f(a, b): return a"]
    kwargs = {"until": ["never-generated"], "max_gen_toks": 10}
    texts = lm.generate_until([Instance("generate_until", {}, (p, kwargs), i) for i, p in enumerate(prompts)], True)
    for prompt, text in zip(prompts, texts, strict=True):
        ids = tok.encode(prompt)
        for _ in range(10):  # greedy by full recomputation, stopping at EOS as the harness does
            nxt = int(np.argmax(_full_logits(model, ids)[-1]))
            ids.append(nxt)
            if nxt == tok.eos_id:
                break
        assert text == tok.decode(ids[len(tok.encode(prompt)) :], skip_special_tokens=True)


def test_eval_py_suite_lm_eval_writes_lm_evals_results_json(tiny_lm, tmp_path):
    """``eval.py --suite lm-eval`` on the tiny folder: the JSON lm-eval's own CLI would write, with the values
    HydraHeadLM gives in-process."""
    from hydrahead_jax.evaluation.cli import main

    folder = tiny_lm.evaluated.spec
    out = tmp_path / "eval"
    argv = ["--model", f"tiny={folder}", "--suite", "lm-eval", "--tasks", "hh_choice", "--limit", "3"]
    assert main([*argv, "--include-path", str(TASKS_DIR), "--out", str(out), "--no-progress"]) == 0
    written = json.loads((out / "lm_eval" / "tiny.json").read_text())
    assert written["results"]["hh_choice"]["sample_len"] == 3
    direct = lm_eval_run(tiny_lm, ["hh_choice"], limit=3)
    assert written["results"]["hh_choice"]["acc,none"] == direct["results"]["hh_choice"]["acc,none"]
    assert written["hydrahead_programs"] and "hh_choice" in (out / "lm_eval.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--suite", "lm-eval"], "needs --tasks"),
        (["--suite", "ppl", "--tasks", "hh_choice"], "add lm-eval to --suite"),
        (["--suite", "lm-eval", "--tasks", "no_such_task", "--include-path", str(TASKS_DIR)], "knows no task"),
    ],
)
def test_eval_py_lm_eval_errors_come_before_any_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    import_oracle("lm_eval")
    from hydrahead_jax.evaluation import cli

    monkeypatch.setattr(cli, "load_models", lambda _: pytest.fail("a model was loaded"))
    if "no_such_task" in argv:  # the defaults are not indexed (25 s) when the include path is checked first
        monkeypatch.setattr("lm_eval.tasks.TaskManager.__init__", _local_only(monkeypatch))
    assert cli.main(["--model", "teacher:x", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def _local_only(monkeypatch):
    from lm_eval.tasks import TaskManager

    original = TaskManager.__init__

    def init(self, *args, include_defaults=True, **kwargs):
        original(self, *args, include_defaults=False, **kwargs)

    return init


@pytest.mark.slow
def test_smollm2_gguf_agrees_with_lm_evals_hf_backend():
    """The real teacher: lm-eval's hf backend on the SmolLM2-135M GGUF (transformers dequantises it with
    ``gguf_file=``) against HydraHeadLM(teacher:smollm2-135m), on the choice and generation tasks."""
    import_oracle("torch")
    import_oracle("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from hydrahead_jax.evaluation.harness import HydraHeadLM
    from hydrahead_jax.models.loaders import resolve_source

    gguf = resolve_source("smollm2-135m")
    hf = HFLM(pretrained=str(gguf.parent), gguf_file=gguf.name, dtype="float32", device="cpu", batch_size=1)
    ours = HydraHeadLM(model="teacher:smollm2-135m")
    assert ours.max_length == hf.max_length and ours.prefix_token_id == hf.prefix_token_id
    tasks = ["hh_choice", "hh_generate"]
    hf_results, our_results = lm_eval_run(hf, tasks), lm_eval_run(ours, tasks)
    a, b = loglik_values(hf_results), loglik_values(our_results)
    print(f"\nSmolLM2: max |Δ loglik| {np.abs(a - b).max():.2e} over {a.size} values; programs {sorted(ours.programs)}")
    np.testing.assert_allclose(b, a, rtol=0, atol=SMOLLM2_LOGLIK_ATOL)
    assert our_results["results"]["hh_choice"]["acc,none"] == hf_results["results"]["hh_choice"]["acc,none"]
    assert responses(our_results)["hh_generate"] == responses(hf_results)["hh_generate"]
    print("SmolLM2 generations:", responses(our_results)["hh_generate"], file=sys.stderr)

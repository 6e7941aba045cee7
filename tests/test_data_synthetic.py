"""Synthetic retrieval tasks with the real SmolLM2 tokenizer over real held-out news text: answers sit
verbatim at the stated positions, and each prompt's text, parsed independently, implies the answer."""

import json
import re
import shutil

import numpy as np
import pytest

from hydrahead_jax.data.corpus import load_heldout_text
from hydrahead_jax.data.synthetic import NEEDLE_TYPES, TASKS, Haystack, generate


@pytest.fixture(scope="module")
def tok():
    from hydrahead_jax.models.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def hay(tok, tmp_path_factory, gensim_wheel):
    cache = tmp_path_factory.mktemp("cache")
    shutil.copy(gensim_wheel, cache)
    return Haystack(load_heldout_text(cache), tok)


CASES = [(t, n) for t in ("niah_single", "niah_multikey", "niah_multivalue") for n in NEEDLE_TYPES]
CASES += [("passkey", None), ("kv_retrieval", None), ("variable_tracking", None)]


def _make(task, needle_type, tok, hay, **kw):
    opts = {} if needle_type is None else {"needle_type": needle_type}
    return generate(task, tok, hay, **opts, **kw)


def _expected_from_text(task, text):
    """The answer string implied by the prompt text alone (an independent parse of what was built)."""
    if task.startswith("niah"):
        found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", text)
        asked = re.search(r"\nWhat (?:is|are all) the special magic \w+ for (\S+) mentioned", text).group(1)
        return "".join(" " + v for k, v in found if k == asked), len(found)
    if task == "passkey":
        return " " + re.search(r"The pass key is (\d+)\. Remember it\.", text).group(1), 1
    if task == "kv_retrieval":
        obj = json.loads(text[text.index("{") : text.index("}\n\nKey:") + 1])
        key = re.search(r'Key: "([0-9a-f-]+)"', text).group(1)
        return obj[key], len(obj)
    if task == "variable_tracking":
        assigns = dict((a, b) for a, b in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text))
        value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
        names = []
        frontier = [n for n, v in assigns.items() if v == value]
        while frontier:
            names += frontier
            frontier = [n for n, v in assigns.items() if v.startswith("VAR ") and v[4:] in frontier]
        return "".join(" " + n for n in names), len(assigns)
    raise AssertionError(task)


@pytest.mark.parametrize("task,needle_type", CASES)
def test_answer_tokens_at_stated_positions(task, needle_type, tok, hay):
    for length, seed in ((384, 0), (2048, 7)):
        ex = _make(task, needle_type, tok, hay, length=length, seed=seed)
        assert ex.task == task and ex.seed == seed and ex.length == len(ex.prompt_ids)
        if task == "kv_retrieval":
            assert length - 80 < ex.length <= length  # whole key-value pairs only (a pair is ~70 tokens)
        else:
            assert ex.length == length
        np.testing.assert_array_equal(ex.prompt_ids[ex.needle_positions], ex.answer_ids)
        assert tok.decode(ex.prompt_ids[ex.needle_positions]) == ex.answer_text
        assert ex.prompt_text == tok.decode(ex.prompt_ids) and ex.answer_text == tok.decode(ex.answer_ids)
        want, n_needles = _expected_from_text(task, ex.prompt_text)
        assert ex.answer_text == want
        assert np.all(np.diff(ex.needle_positions) > 0)
        if task in ("niah_multikey", "niah_multivalue"):
            assert n_needles == 4 and len(ex.needle_spans) == 4
        # the value text stands right after its lead-in in the decoded prompt
        before = tok.decode(ex.prompt_ids[: ex.needle_positions[0]])
        lead = {"passkey": "The pass key is", "kv_retrieval": '": "', "variable_tracking": "VAR"}.get(task, "is:")
        assert before.endswith(lead)


def test_count_answer_fills_exact_length(tok, hay):
    for task in ("niah_single", "passkey", "variable_tracking"):
        ex = generate(task, tok, hay, length=1025, seed=3, count_answer=True)
        assert len(ex.prompt_ids) + len(ex.answer_ids) == 1025
    ex = generate("kv_retrieval", tok, hay, length=1025, seed=3, count_answer=True)
    assert len(ex.prompt_ids) + len(ex.answer_ids) <= 1025


def test_depth_and_determinism(tok, hay):
    for depth in (0.0, 0.25, 0.5, 0.9):
        ex = generate("niah_single", tok, hay, length=4096, seed=1, depth=depth)
        # within one sentence (~60 tokens) plus the prefix of the requested depth
        assert abs(ex.depth - depth) < 0.05, (depth, ex.depth)
    a = generate("niah_multikey", tok, hay, length=1000, seed=5, needle_type="uuid")
    b = generate("niah_multikey", tok, hay, length=1000, seed=5, needle_type="uuid")
    c = generate("niah_multikey", tok, hay, length=1000, seed=6, needle_type="uuid")
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    assert a.answer_text == b.answer_text and a.answer_text != c.answer_text
    assert not np.array_equal(a.prompt_ids, c.prompt_ids)


def test_haystack_is_real_text_and_fill_is_exact(hay):
    rng = np.random.default_rng(0)
    for budget in (1, 17, 5000, 3 * hay.num_tokens // 2):  # the last wraps around the text
        assert sum(len(s) for s in hay.fill(rng, budget)) == budget


def test_bad_requests(tok, hay):
    with pytest.raises(ValueError, match="too short"):
        generate("niah_single", tok, hay, length=40, seed=0)
    with pytest.raises(ValueError, match="too short"):
        generate("kv_retrieval", tok, hay, length=30, seed=0)
    with pytest.raises(ValueError, match="unknown synthetic task 'nope'"):
        generate("nope", tok, hay, length=500, seed=0)
    with pytest.raises(ValueError, match="needle_type must be one of"):
        generate("niah_single", tok, hay, length=500, seed=0, needle_type="emoji")
    with pytest.raises(ValueError, match="depth must be in"):
        generate("passkey", tok, hay, length=500, seed=0, depth=1.5)
    assert set(TASKS) == {
        "niah_single",
        "niah_multikey",
        "niah_multivalue",
        "passkey",
        "kv_retrieval",
        "variable_tracking",
    }

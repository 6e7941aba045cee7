"""General-ability tasks built from held-out news: lm-eval tasks that no training, selection or recipe choice reads.

The held-out news (``data.load_heldout_text``: 300 stories, one per line) is read by evaluation only; of it the
demo's perplexity and agreement windows take the first 16 x 512 tokens and the recipe comparisons chose on the
first 8 x 512. These tasks use the stories from ``FIRST_STORY`` on, which start beyond those windows (the first 40
stories hold more than 16 x 512 SmolLM2 tokens: ``tests/test_news_tasks.py``).

* ``hh_news_cloze`` (LAMBADA's form): a story up to its last word; the model must give that word. lm-eval's
  ``loglikelihood`` request: ``acc`` is 1 when the word is the greedy continuation token by token, ``perplexity``
  the word's. Stories whose last word is shorter than ``MIN_WORD`` letters are left out.
* ``hh_news_continuation`` (StoryCloze's form): a story's first k sentences (k drawn from 2 … n − 1 per story) and
  four candidate next sentences: the true one and three drawn from other stories; ``acc`` by the summed
  log-likelihood, ``acc_norm`` per byte (lm-eval's ``multiple_choice``).

Both are deterministic from ``SEED``; lm-eval reads their documents through ``lm_eval_tasks/news_data.py``, which
calls ``documents``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"  # the YAMLs; eval.py --suite lm-eval always searches it
TASKS = ("hh_news_cloze", "hh_news_continuation")
FIRST_STORY = 40
MIN_WORD = 3
SEED = 20261207
DISTRACTORS = 3
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z]+)([^A-Za-z\s]*)$", re.S)


def stories() -> list[str]:
    """The held-out stories these tasks read (from ``FIRST_STORY`` on), whitespace-normalised."""
    from hydrahead_jax.data import load_heldout_text

    lines = [" ".join(line.split()) for line in load_heldout_text().splitlines()]
    return [line for line in lines if line][FIRST_STORY:]


def sentences(story: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(story) if s]


def cloze_documents(texts: list[str]) -> list[dict]:
    """{"context", "target"}: each story up to its last word (``target`` = " " + the word, punctuation after it
    dropped), where that word has at least ``MIN_WORD`` letters."""
    docs = []
    for text in texts:
        match = _LAST_WORD.match(text)
        if match and len(match.group(2)) >= MIN_WORD:
            docs.append({"context": match.group(1), "target": " " + match.group(2)})
    return docs


def continuation_documents(texts: list[str], seed: int = SEED) -> list[dict]:
    """{"context", "choices", "answer"}: a story's first k sentences and, in a shuffled order, its sentence k + 1
    among ``DISTRACTORS`` sentences of other stories (stories of fewer than 3 sentences are left out)."""
    rng = np.random.default_rng(seed)
    split = [sentences(t) for t in texts]
    docs = []
    for i, parts in enumerate(split):
        if len(parts) < 3:
            continue
        k = int(rng.integers(2, len(parts)))
        others = [j for j in range(len(split)) if j != i and split[j]]
        picks = rng.choice(others, DISTRACTORS, replace=False)
        choices = [parts[k]] + [split[j][int(rng.integers(len(split[j])))] for j in picks]
        order = rng.permutation(len(choices))
        docs.append(
            {
                "context": " ".join(parts[:k]),
                "choices": [choices[o] for o in order],
                "answer": int(np.argmax(order == 0)),
            }
        )
    return docs


def documents(task: str) -> list[dict]:
    """The documents of ``task`` (one of ``TASKS``)."""
    if task == "hh_news_cloze":
        return cloze_documents(stories())
    if task == "hh_news_continuation":
        return continuation_documents(stories())
    raise KeyError(f"unknown news task {task!r}; one of {TASKS}")

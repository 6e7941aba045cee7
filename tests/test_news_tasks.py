"""The general-ability news tasks (hydrahead_jax/evaluation/news_tasks.py and its lm-eval YAMLs): documents worked out
by hand, the held-out stories they read lying past the evaluation's windows, and lm-eval reading the packaged tasks
so that a model that knows the answers scores 1 and one that avoids them scores 0."""

import os

import pytest

from hydrahead_jax.evaluation import news_tasks

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def test_cloze_documents_by_hand():
    texts = ["The cat sat on the mat.", "He said it is.", 'Rain fell over "Sydney" today!', "single"]
    docs = news_tasks.cloze_documents(texts)
    # "is" has 2 letters (< MIN_WORD) and "single" has no context: both left out; punctuation after the word dropped
    assert docs == [
        {"context": "The cat sat on the", "target": " mat"},
        {"context": 'Rain fell over "Sydney"', "target": " today"},
    ]


def test_continuation_documents_hold_the_true_next_sentence():
    texts = [
        "One a. Two a. Three a. Four a.",
        "One b. Two b. Three b.",
        "One c. Two c. Three c. Four c. Five c.",
        "One d. Two d.",  # fewer than 3 sentences: no document of its own, still a source of distractors
        "One e. Two e. Three e.",
    ]
    docs = news_tasks.continuation_documents(texts, seed=3)
    assert len(docs) == 4
    for doc, story in zip(docs, [t for t in texts if len(news_tasks.sentences(t)) >= 3], strict=True):
        parts = news_tasks.sentences(story)
        k = len(news_tasks.sentences(doc["context"]))
        assert 2 <= k < len(parts) and doc["context"] == " ".join(parts[:k])
        assert doc["choices"][doc["answer"]] == parts[k]
        letter = parts[0][-2]  # the story's own letter: every distractor comes from another story
        others = [c for i, c in enumerate(doc["choices"]) if i != doc["answer"]]
        assert len(others) == news_tasks.DISTRACTORS and all(c[-2] != letter for c in others)
    assert docs == news_tasks.continuation_documents(texts, seed=3)  # deterministic from the seed


def test_the_stories_start_past_the_evaluations_windows():
    """The demo's perplexity and agreement read the first 16 x 512 tokens of the held-out news (eval
    --suite demo), the recipe comparisons the first 8 x 512: the stories before FIRST_STORY hold more than that."""
    from hydrahead_jax.data import load_heldout_text
    from hydrahead_jax.data.protocol import encode_document
    from hydrahead_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    lines = [" ".join(line.split()) for line in load_heldout_text().splitlines()]
    lines = [line for line in lines if line]
    before = "\n".join(load_heldout_text().splitlines()[: news_tasks.FIRST_STORY])
    assert len(encode_document(tok, before)) > 16 * 512
    assert news_tasks.stories() == lines[news_tasks.FIRST_STORY :] and len(news_tasks.stories()) == 260


class _Oracle:
    """An lm-eval LM that knows each task's answers (``right``) or avoids them (not ``right``)."""

    def __new__(cls, right: bool):
        from lm_eval.api.model import LM

        cloze = {(d["context"], d["target"]) for d in news_tasks.documents("hh_news_cloze")}
        truth = {(d["context"], " " + d["choices"][d["answer"]]) for d in news_tasks.documents("hh_news_continuation")}

        class Oracle(LM):
            def loglikelihood(self, requests, disable_tqdm=False):
                out = []
                for r in requests:
                    context, continuation = r.args
                    known = (context, continuation) in cloze or (context, continuation) in truth
                    out.append((0.0 if known == right else -10.0, known == right))
                return out

            # LM's other request types: the news tasks send loglikelihood requests only
            def loglikelihood_rolling(self, requests, disable_tqdm=False):
                raise AssertionError("the news tasks sent a loglikelihood_rolling request")

            def generate_until(self, requests, disable_tqdm=False):
                raise AssertionError("the news tasks sent a generate_until request")

        return Oracle()


@pytest.mark.parametrize("right", [True, False])
def test_lm_eval_reads_the_packaged_tasks_and_scores_an_oracle(right):
    from hydrahead_jax.evaluation.harness import evaluate, task_manager

    manager = task_manager(list(news_tasks.TASKS))  # no --include-path: the package's own folder
    results = evaluate(_Oracle(right), list(news_tasks.TASKS), manager=manager, limit=20)
    expected = 1.0 if right else 0.0
    assert results["results"]["hh_news_cloze"]["acc,none"] == expected
    assert results["results"]["hh_news_continuation"]["acc,none"] == expected
    assert results["n-samples"]["hh_news_continuation"]["effective"] == 20

"""Exact-match scoring of generated answers, after one documented normalisation.

A model continues the prompt freely, so the generation is first cut to the span that can hold the answer:

1. drop everything from the first EOS token on (done by the caller on ids), strip leading whitespace, and keep
   the first line (the text before the first newline);
2. normalise both prediction and answer: lowercase, collapse runs of whitespace to one space, strip the ends, and
   strip trailing punctuation from every whitespace-separated word (so ``"7421."`` → ``"7421"`` and lists written
   ``"a, b, c"`` read as ``"a b c"``);
3. compare:
   * numeric answers (every answer word is a digit string): the first ``k`` digit runs of the prediction's first
     line must equal the answer's ``k`` digit strings (digit strings, so ``"7421"`` ≠ ``"74210"`` and
     ``"007"`` ≠ ``"7"``);
   * otherwise the prediction's first ``k`` normalised words must equal the answer's ``k`` words, where ``k`` is
     the number of words in the answer (the model may go on after the answer; it may not start elsewhere).
"""

from __future__ import annotations

import re
import string

_TRAILING = string.punctuation + "…“”‘’«»"
_DIGITS = re.compile(r"\d+")


def first_line(text: str) -> str:
    """The text before the first newline, after leading whitespace is dropped."""
    return text.lstrip().split("\n", 1)[0]


def normalize_words(text: str) -> list[str]:
    """Lowercased whitespace-separated words, each without trailing punctuation (empty words dropped)."""
    words = (w.rstrip(_TRAILING) for w in text.lower().split())
    return [w for w in words if w]


def normalize_answer(text: str) -> str:
    """The normalised form of ``text``: lowercase, single spaces, no trailing punctuation on any word."""
    return " ".join(normalize_words(text))


def is_numeric_answer(answer: str) -> bool:
    words = normalize_words(answer)
    return bool(words) and all(w.isdigit() for w in words)


def exact_match(prediction: str, answer: str) -> bool:
    """Whether the generated ``prediction`` gives ``answer`` (see the module docstring for the rules)."""
    answer_words = normalize_words(answer)
    if not answer_words:
        raise ValueError(f"the reference answer {answer!r} is empty after normalisation; it cannot be scored.")
    line = first_line(prediction)
    if all(w.isdigit() for w in answer_words):
        return _DIGITS.findall(line)[: len(answer_words)] == answer_words
    return normalize_words(line)[: len(answer_words)] == answer_words


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's score of one generation: the fraction of ``references`` that occur in it, case-insensitively, as
    substrings (RULER's ``string_match_all``): Σ_r [lower(r) ⊂ lower(prediction)] / |references|."""
    if not references:
        raise ValueError("string_match_all needs at least one reference answer.")
    text = prediction.lower()
    return sum(r.lower() in text for r in references) / len(references)

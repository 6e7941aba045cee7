"""RULER (Hsieh et al., 2024, "What's the Real Context Size of Your Long-Context Language Models?"): the tasks
that need no downloaded data, built from this package's seeded generators and the corpus text.

    niah_single_1    one needle (word key → 7-digit number) in a repeated noise text ("The grass is green. ...")
    niah_single_2    one needle (word key → number) in corpus text
    niah_single_3    one needle (word key → uuid) in corpus text
    niah_multikey_1  the asked needle among 3 distractor needles with other keys, in corpus text
    niah_multikey_2  the asked needle in a haystack made only of distractor needles (word keys → numbers)
    niah_multikey_3  as multikey_2 with uuid keys and uuid values
    niah_multivalue  4 values for one key, all to be listed
    niah_multiquery  4 keys asked at once, each value to be listed
    vt               variable tracking: one chain of 4 hops (VAR X = 12345, VAR Y = VAR X, ...) in noise text
    cwe              common-words extraction: a numbered list where 10 words occur 30 times (6 below 4K tokens)
                     and the rest 3 times (1 below 4K); name the 10 (after one worked example)
    fwe              frequent-words extraction: coded 6-letter words with Zipf(α = 2) counts, the top one being
                     the noise word "..."; name the three most frequent real ones

Lengths count the prompt plus the tokens the task may generate (RULER's budget: 128 for NIAH, 30 for vt, 120 for
cwe, 50 for fwe), so prompt + generation ≤ the nominal length. Generation is greedy through the decode cache and
stops at EOS. Score of one sample (RULER's ``string_match_all``): the fraction of the reference answers that occur
in the generation (case-insensitive substrings); a cell's score is the mean over its samples, with a Wilson 95 %
interval over the samples (``intervals.wilson_interval`` of their sum). The RULER average of a model at a length is
the mean over tasks, as the paper reports it.

The wording follows RULER's templates for base models (the answer prefix ends the prompt); the text and code are
this package's own.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from hydrahead_jax.data import synthetic
from hydrahead_jax.data.protocol import document_start
from hydrahead_jax.evaluation.intervals import wilson_interval
from hydrahead_jax.evaluation.scoring import string_match_all

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
TASKS = {
    "niah_single_1": dict(kind="niah", filler="noise", needle_type="number"),
    "niah_single_2": dict(kind="niah", filler="corpus", needle_type="number"),
    "niah_single_3": dict(kind="niah", filler="corpus", needle_type="uuid"),
    "niah_multikey_1": dict(kind="niah", filler="corpus", num_keys=4),
    "niah_multikey_2": dict(kind="niah", filler="needles"),
    "niah_multikey_3": dict(kind="niah", filler="needles", key_type="uuid", needle_type="uuid"),
    "niah_multivalue": dict(kind="niah", filler="corpus", num_values=4),
    "niah_multiquery": dict(kind="niah", filler="corpus", num_queries=4),
    "vt": dict(kind="vt", filler="noise", num_hops=4),
    "cwe": dict(kind="cwe"),
    "fwe": dict(kind="fwe"),
}
SUITE_PREFIX = "ruler:"  # suite names: ruler:niah_single_1, …; the preset "ruler" is all of them
SUITE_NAMES = tuple(SUITE_PREFIX + t for t in TASKS)
LENGTHS = tuple(2**k * 1024 for k in range(8))  # 1K … 128K
DEFAULT_SAMPLES = 50

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
CWE_QUESTION = (
    "\nQuestion: What are the {n} most common words in the above list? "
    "Answer: The top {n} words that appear most often in the list are:"
)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
FWE_QUESTION = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently "
    "appeared words in the above coded text? Answer: According to the coded text above, the three most frequently "
    "appeared words are:"
)


@dataclasses.dataclass
class RulerExample:
    task: str
    prompt_ids: np.ndarray  # int32 [prompt length]
    answers: list[str]  # the references string_match_all looks for
    max_new_tokens: int
    nominal_length: int  # prompt + max_new_tokens ≤ nominal_length
    seed: int
    depth: float | None  # NIAH / vt: where the (first) needle sits, as a fraction of the prompt


class RulerInputs:
    """The fillers of one tokenizer: the corpus haystack, the noise haystack and the corpus word list (CWE)."""

    def __init__(self, tokenizer, corpus: synthetic.Haystack):
        self.tok = tokenizer
        self.start = document_start(tokenizer)  # what every prompt opens with (Llama 3: BOS), counted in its length
        self.corpus = corpus
        self.noise = synthetic.Haystack(" ".join([NOISE] * 4), tokenizer)
        self._words: list[str] | None = None
        self._token_counts: dict[str, int] = {}

    def words(self, needed: int) -> list[str]:
        """Distinct lowercase corpus words of 4–12 letters, in order of first appearance (at least ``needed``); whole
        words only, so a longer word never gives its first 12 letters."""
        if self._words is None or len(self._words) < needed:
            seen: dict[str, None] = {}
            for s in self.corpus.sentences:
                for w in re.findall(r"\b[a-z]{4,12}\b", self.tok.decode(s).lower()):
                    seen.setdefault(w)
                if len(seen) >= max(needed, 2000):
                    break
            self._words = list(seen)
        if len(self._words) < needed:
            raise ValueError(f"the corpus has {len(self._words)} distinct words; this length needs {needed}.")
        return self._words

    def count(self, pieces: list[str]) -> list[int]:
        """Tokens of each piece, each tokenised on its own (as the prompt assembles them)."""
        todo = [p for p in dict.fromkeys(pieces) if p not in self._token_counts]
        if todo:
            for p, ids in zip(todo, self.tok.encode_batch(todo)):
                self._token_counts[p] = len(ids)
        return [self._token_counts[p] for p in pieces]


def build(task: str, inputs: RulerInputs, *, length: int, seed: int, depth: float | None = None) -> RulerExample:
    """Sample ``seed`` of RULER task ``task`` at nominal ``length`` tokens (raises ValueError if it cannot fit)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {sorted(TASKS)}.")
    spec = dict(TASKS[task])
    kind = spec.pop("kind")
    budget = TOKENS_TO_GENERATE[kind]
    prompt_len = length - budget
    if prompt_len < 16:
        raise ValueError(f"{task}: length {length} leaves no room for a prompt beside {budget} generated tokens.")
    if kind in ("niah", "vt"):
        filler = spec.pop("filler")
        haystack = inputs.noise if filler == "noise" else inputs.corpus
        if kind == "niah":
            ex = synthetic.niah(
                inputs.tok,
                haystack,
                length=prompt_len,
                seed=seed,
                depth=depth,
                needle_haystack=filler == "needles",
                task=task,
                **spec,
            )
        else:
            ex = synthetic.variable_tracking(inputs.tok, haystack, length=prompt_len, seed=seed, depth=depth, **spec)
        return RulerExample(task, ex.prompt_ids, ex.answer_text.split(), budget, length, seed, ex.depth)
    make = common_words if kind == "cwe" else frequent_words
    ids, answers = make(inputs, prompt_len, np.random.default_rng([seed, sum(map(ord, task))]))
    return RulerExample(task, ids, answers, budget, length, seed, None)


def _assemble(inputs: RulerInputs, pieces: list[str]) -> np.ndarray:
    """The prompt: the document start, then each piece tokenised on its own."""
    ids = [t for piece in inputs.tok.encode_batch(pieces) for t in piece]
    return np.asarray(inputs.start + ids, np.int32)


def common_words(
    inputs: RulerInputs, prompt_len: int, rng: np.random.Generator, *, num_cw: int = 10
) -> tuple[np.ndarray, list[str]]:
    """CWE: a worked example, then a numbered list where ``num_cw`` words occur ``freq_cw`` times and as many
    others as fit occur ``freq_ucw`` times; returns (prompt ids, the ``num_cw`` common words)."""
    long = prompt_len + TOKENS_TO_GENERATE["cwe"] >= 4096
    freq_cw, freq_ucw = (30, 3) if long else (6, 1)  # RULER's settings at and below 4K
    ex_words, ex_cw, ex_ucw = (40, 10, 3) if long else (20, 3, 1)
    words = inputs.words(num_cw + ex_words + prompt_len // freq_ucw // 2)
    order = rng.permutation(len(words))
    common = [words[i] for i in order[:num_cw]]
    example_pool = [words[i] for i in order[num_cw : num_cw + ex_words]]
    pool = [words[i] for i in order[num_cw + ex_words :]]

    def listing(cw: list[str], ucw: list[str], f_cw: int, f_ucw: int) -> list[str]:
        items = cw * f_cw + ucw * f_ucw
        rng.shuffle(items)
        return [piece for i, w in enumerate(items) for piece in (f" {i + 1}.", " " + w)]

    ex_common = example_pool[:num_cw]
    example = (
        CWE_TEMPLATE
        + "".join(listing(ex_common, example_pool[num_cw:], ex_cw, ex_ucw)).lstrip()
        + CWE_QUESTION.format(n=num_cw)
        + "".join(f" {i + 1}. {w}" for i, w in enumerate(ex_common))
        + "\n"
    )
    head, question = example + CWE_TEMPLATE, CWE_QUESTION.format(n=num_cw)
    fixed = len(inputs.start) + sum(inputs.count([head, question]))
    # Tokens of the list = Σ over entries of tok(" i.") + tok(" word"): the numbers 1 … N whatever the order.
    n_common = num_cw * freq_cw
    used = fixed + sum(inputs.count([" " + w for w in common])) * freq_cw
    n_uncommon, numbers = 0, sum(inputs.count([f" {i + 1}." for i in range(n_common)]))
    word_tokens = inputs.count([" " + w for w in pool])
    while n_uncommon < len(pool):
        start = n_common + n_uncommon * freq_ucw
        extra = word_tokens[n_uncommon] * freq_ucw + sum(
            inputs.count([f" {i + 1}." for i in range(start, start + freq_ucw)])
        )
        if used + numbers + extra > prompt_len:
            break
        used, numbers, n_uncommon = used, numbers + extra, n_uncommon + 1
    if used + numbers > prompt_len or n_uncommon == 0:
        raise ValueError(f"cwe: a prompt of {prompt_len} tokens cannot hold the {num_cw} common words' list.")
    pieces = [head, *listing(common, pool[:n_uncommon], freq_cw, freq_ucw), question]
    return _assemble(inputs, pieces), common


def zipf_counts(n_words: int, vocab: int, alpha: float) -> np.ndarray:
    """⌊n_words · k^−α / ζ(α)⌋ for ranks k = 1 … vocab (RULER's FWE counts)."""
    from scipy.special import zeta

    k = np.arange(1, vocab + 1, dtype=np.float64)
    return np.floor(n_words * k**-alpha / zeta(alpha)).astype(np.int64)


def frequent_words(
    inputs: RulerInputs, prompt_len: int, rng: np.random.Generator, *, alpha: float = 2.0, word_len: int = 6
) -> tuple[np.ndarray, list[str]]:
    """FWE: coded words with Zipf counts; the rank-1 word is the noise "..."; returns (ids, ranks 2–4)."""
    vocab_size = max(prompt_len // 50, 16)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab: dict[str, None] = {}
    while len(vocab) < vocab_size:
        vocab.setdefault("".join(rng.choice(letters, word_len)))
    vocab = ["...", *list(vocab)[1:]]
    tokens = np.asarray(inputs.count([" " + w for w in vocab]))
    fixed = len(inputs.start) + sum(inputs.count([FWE_TEMPLATE, FWE_QUESTION]))

    def size(n: int) -> int:
        return fixed + int(zipf_counts(n, vocab_size, alpha) @ tokens)

    lo, hi = 1, 1
    while size(hi) <= prompt_len:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # largest n with size(n) ≤ prompt_len
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= prompt_len else (lo, mid)
    counts = zipf_counts(lo, vocab_size, alpha)
    if size(lo) > prompt_len or not counts[3] > counts[4] >= 1:
        raise ValueError(f"fwe: a prompt of {prompt_len} tokens is too short for a clear top three.")
    text = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(text)
    return _assemble(inputs, [FWE_TEMPLATE, *(" " + w for w in text), FWE_QUESTION]), vocab[1:4]


def score(prediction: str, example: RulerExample) -> float:
    return string_match_all(prediction, example.answers)


# ------------------------------------------------------------------------------------------------ reporting


def aggregate(samples: list[dict], train_lengths: dict[str, int | None]) -> list[dict]:
    """One record per (model, task, length) with the mean score, its Wilson interval and n, plus the RULER
    average over tasks per (model, length) (task "average", over the tasks present at that length)."""
    cells = defaultdict(list)
    for r in samples:
        cells[(r["model"], r["task"], r["nominal_length"])].append(r["score"])
    records = []
    for (model, task, length), scores in sorted(cells.items()):
        mean = float(np.mean(scores))
        lo, hi = wilson_interval(float(np.sum(scores)), len(scores))
        tl = train_lengths.get(model)
        records.append(
            {
                "model": model,
                "task": task,
                "metric": "ruler_score",
                "length": length,
                "value": mean,
                "ci95": [lo, hi],
                "n": len(scores),
                "beyond_train_length": None if tl is None else bool(length > tl),
            }
        )
    by_model_length = defaultdict(list)
    for r in records:
        by_model_length[(r["model"], r["length"])].append(r)
    for (model, length), rs in sorted(by_model_length.items()):
        records.append(
            {
                "model": model,
                "task": "average",
                "metric": "ruler_score",
                "length": length,
                "value": float(np.mean([r["value"] for r in rs])),
                "tasks": len(rs),
                "n": int(sum(r["n"] for r in rs)),
            }
        )
    return records


def render(records: list[dict], names: list[str], plots: list[str]) -> list[str]:
    """The report section: per model, a task × length table of score [95 % interval] and the average row."""
    if not records:
        return []
    lines = [
        "## RULER",
        "",
        "Score = fraction of the reference answers found in the greedy generation (RULER's string_match_all), "
        "mean over samples, [Wilson 95 % interval]; average = mean over tasks. Prompt + generation budget ≤ "
        "the length.",
        "",
    ]
    lengths = sorted({r["length"] for r in records})
    for name in names:
        mine = {(r["task"], r["length"]): r for r in records if r["model"] == name}
        if not mine:
            continue
        lines += [f"**{name}**", "", "| task | " + " | ".join(map(str, lengths)) + " |"]
        lines += ["|" + "---|" * (len(lengths) + 1)]
        for task in [*TASKS, "average"]:
            if not any((task, n) in mine for n in lengths):
                continue
            cells = []
            for n in lengths:
                r = mine.get((task, n))
                if r is None:
                    cells.append("–")
                elif "ci95" in r:
                    cells.append(f"{r['value']:.2f} [{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}] (n={r['n']})")
                else:
                    cells.append(f"**{r['value']:.2f}**")
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"![{p}]({p})" for p in plots] + [""]
    return lines


def plot(records: list[dict], names: list[str], out: Path, style, train_lengths: dict[str, int]) -> list[str]:
    """ruler_vs_length.png: one panel per task (and the average), score against length per model, with the
    Wilson band."""
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in [*TASKS, "average"] if any(r["task"] == t for r in records)]
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for name in names:
            pts = sorted(
                (r["length"], r["value"], r.get("ci95")) for r in records if r["task"] == task and r["model"] == name
            )
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            (line,) = ax.plot(xs, ys, marker="o", label=name, **style(name))
            if all(p[2] for p in pts):
                band = ([p[2][0] for p in pts], [p[2][1] for p in pts])
                ax.fill_between(xs, *band, color=line.get_color(), alpha=0.15)
        for tl in sorted(set(train_lengths.values())):
            ax.axvline(tl, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("context length (tokens)", fontsize=8)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("RULER score")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ruler_vs_length.png", dpi=110)
    plt.close(fig)
    return ["ruler_vs_length.png"]

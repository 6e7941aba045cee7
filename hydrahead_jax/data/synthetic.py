"""Seeded synthetic long-context retrieval tasks at any length (in tokens).

Tasks (RULER-style wording, plain text, no chat template, answerable by a small base model):
  niah_single        one needle "One of the special magic numbers for <key> is: <value>."
  niah_multikey      several needles with different keys; the question asks for one of them
  niah_multivalue    several values for the same key; the answer lists them in order of appearance
  niah_multiquery    several keys asked at once (``niah(num_queries=...)``); the answer lists their values
                     (``needle_haystack``: filler made of distractor needles; ``key_type="uuid"``: uuid keys)
  passkey            "The pass key is <5 digits>. Remember it."
  kv_retrieval       a JSON object of uuid keys → uuid values; the question names one key
  variable_tracking  a chain VAR A = 12345. VAR B = VAR A. ...; the answer lists every variable
Needle values are numbers, words or uuid-like strings (`needle_type`). NIAH, passkey and variable
tracking hide their needles between sentences of real corpus text (`Haystack`).

Exact positions: every piece of a prompt (prefix, haystack sentences, needle text, needle value,
question) is tokenised on its own and the id lists are concatenated, so the answer's tokens appear
verbatim in the prompt and `prompt_ids[needle_positions] == answer_ids` holds by construction (it is
also checked). Haystack sentences are tokenised with a leading space, as they would be mid-text. A prompt
is a document: its prefix is encoded with `encode_document`, so it opens with the tokenizer's BOS where the
tokenizer adds one (Llama 3), and the BOS counts toward the prompt's length.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from hydrahead_jax.data.protocol import TokenizerLike, document_start, encode_document

NEEDLE_TYPES = ("number", "word", "uuid")
_TYPE_NOUN = {"number": ("number", "numbers"), "word": ("word", "words"), "uuid": ("uuid", "uuids")}
WORDS = tuple(
    """
amber anchor apple arrow autumn badge bamboo banner barrel basket beacon berry blossom bottle breeze
bridge bronze bucket butter cabin cactus candle canyon carpet castle cedar chalk cherry circle cloud
clover cobalt comet copper coral cotton crater crystal dagger daisy delta desert diamond dolphin dragon
eagle ember falcon feather fern fiddle flame forest fossil fountain garden garnet ginger glacier granite
harbor hazel helmet honey horizon island ivory jacket jasmine jungle kettle lantern lemon lily lotus
magnet maple marble meadow mirror monsoon mountain nectar needle nickel oasis ocean olive onyx orchid
otter paddle panther pebble pepper pillow planet plum pocket prairie quartz quill rabbit raven ribbon
river rocket saddle sapphire scarlet shadow silver spruce stone summit tiger timber topaz tulip tunnel
valley velvet violet walnut willow window winter yarrow zephyr
""".split()
)
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")

NIAH_PREFIX = (
    "Some special magic {noun_pl} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {noun_pl} afterwards.\n"
)
PASSKEY_PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
VT_PREFIX = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
KV_PREFIX = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"


@dataclasses.dataclass
class SyntheticExample:
    """One prompt. `prompt_ids[needle_positions] == answer_ids`; `needle_spans` covers every needle
    value inserted (distractors included) as [start, end) token ranges of `prompt_ids`."""

    task: str
    prompt_ids: np.ndarray  # int32 [length]
    answer_ids: np.ndarray  # int32 [answer length]
    prompt_text: str
    answer_text: str
    needle_positions: np.ndarray  # int64 [answer length]
    length: int  # len(prompt_ids)
    depth: float  # position of the first answer token as a fraction of the prompt length
    seed: int
    needle_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class Haystack:
    """Filler text cut into sentences and tokenised once; `fill` draws consecutive sentences from a
    seeded start (wrapping around) up to an exact token budget."""

    def __init__(self, texts: str | Sequence[str], tokenizer: TokenizerLike, *, min_chars: int = 20):
        texts = [texts] if isinstance(texts, str) else list(texts)
        sentences = []
        for text in texts:
            for line in text.splitlines():
                line = line.strip()
                if len(line) < min_chars:  # headings and list fragments read badly as filler
                    continue
                sentences.extend(s for s in _SENTENCE_SPLIT.split(line) if s.strip())
        if not sentences:
            raise ValueError("haystack text has no sentences; pass real prose (e.g. the corpus text).")
        ids = tokenizer.encode_batch([" " + s for s in sentences])
        self.sentences = [np.asarray(x, np.int32) for x in ids if len(x)]
        self.num_tokens = int(sum(len(s) for s in self.sentences))

    @classmethod
    def from_store(cls, store, tokenizer: TokenizerLike, *, max_tokens: int = 2_000_000) -> Haystack:
        """Haystack from a token store split (a `CorpusStore`): decodes documents (without the tokenizer's document
        start and the EOS the store adds) up to `max_tokens`."""
        texts, total = [], 0
        eos, start = store.eos_id, document_start(tokenizer)
        for d in range(store.num_docs):
            ids = store.document(d)
            if start and list(ids[: len(start)]) == start:
                ids = ids[len(start) :]
            if eos is not None and len(ids) and ids[-1] == eos:
                ids = ids[:-1]
            texts.append(tokenizer.decode(ids))
            total += len(ids)
            if total >= max_tokens:
                break
        return cls(texts, tokenizer)

    def fill(self, rng: np.random.Generator, budget: int) -> list[np.ndarray]:
        """Consecutive sentences totalling exactly `budget` tokens (the last one cut at a token)."""
        out, total = [], 0
        i = int(rng.integers(len(self.sentences)))
        while total < budget:
            s = self.sentences[i % len(self.sentences)]
            s = s[: budget - total]
            out.append(s)
            total += len(s)
            i += 1
        return out


# A piece is (ids, tag): tag "answer:k" marks the k-th answer value, "needle" a distractor value.
Piece = tuple[list[int] | np.ndarray, str | None]


class _Builder:
    """Holds the tokenizer/rng of one example and turns pieces into a `SyntheticExample`."""

    def __init__(self, task: str, tokenizer: TokenizerLike, seed: int):
        self.task, self.tok, self.seed = task, tokenizer, seed
        self.rng = np.random.default_rng([seed, _task_salt(task)])

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def opening(self, text: str) -> list[int]:
        """The prompt's first piece: ``text`` as the start of a document (BOS first where the tokenizer adds one)."""
        return encode_document(self.tok, text)

    def value(self, needle_type: str) -> str:
        if needle_type == "number":
            return str(int(self.rng.integers(1_000_000, 10_000_000)))
        if needle_type == "word":
            return str(WORDS[int(self.rng.integers(len(WORDS)))])
        if needle_type == "uuid":
            h = self.rng.bytes(16).hex()
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        raise ValueError(f"needle_type must be one of {NEEDLE_TYPES}, not {needle_type!r}.")

    def distinct(self, make: Callable[[], str], n: int) -> list[str]:
        out: list[str] = []
        for _ in range(100 * n):
            v = make()
            if v not in out:
                out.append(v)
            if len(out) == n:
                return out
        raise ValueError(f"could not draw {n} distinct values; ask for fewer needles.")

    def key(self) -> str:
        return f"{WORDS[int(self.rng.integers(len(WORDS)))]}-{WORDS[int(self.rng.integers(len(WORDS)))]}"

    def finish(self, pieces: Sequence[Piece], answer_ids: list[int]) -> SyntheticExample:
        prompt: list[int] = []
        answer_spans: dict[int, tuple[int, int]] = {}
        spans = []
        for ids, tag in pieces:
            start = len(prompt)
            prompt.extend(int(t) for t in ids)
            if tag is not None:
                spans.append((start, len(prompt)))
                if tag.startswith("answer:"):
                    answer_spans[int(tag.split(":")[1])] = (start, len(prompt))
        positions = np.concatenate([np.arange(*answer_spans[k]) for k in sorted(answer_spans)]).astype(np.int64)
        prompt_ids = np.asarray(prompt, np.int32)
        answer = np.asarray(answer_ids, np.int32)
        if not np.array_equal(prompt_ids[positions], answer):
            raise RuntimeError(f"{self.task}: answer tokens are not verbatim at the needle positions (bug).")
        return SyntheticExample(
            task=self.task,
            prompt_ids=prompt_ids,
            answer_ids=answer,
            prompt_text=self.tok.decode(prompt_ids),
            answer_text=self.tok.decode(answer),
            needle_positions=positions,
            length=len(prompt_ids),
            depth=float(positions[0] / len(prompt_ids)),
            seed=self.seed,
            needle_spans=spans,
        )


def _task_salt(task: str) -> int:
    return int.from_bytes(task.encode()[:8].ljust(8, b"\0"), "little")


def _with_haystack(
    b: _Builder,
    haystack: Haystack,
    length: int,
    count_answer: bool,
    prefix: list[int],
    needles: list[tuple[float, list[Piece]]],
    question: list[int],
    answer_ids: list[int],
) -> SyntheticExample:
    """Prefix, haystack sentences with each needle inserted at the sentence boundary nearest its depth,
    question. Total length == `length` (prompt + answer when `count_answer`)."""
    fixed = len(prefix) + sum(len(ids) for _, ps in needles for ids, _ in ps) + len(question)
    fixed += len(answer_ids) if count_answer else 0
    budget = length - fixed
    if budget < 1:
        raise ValueError(f"{b.task}: length={length} is too short; the fixed parts alone take {fixed} tokens.")
    sentences = haystack.fill(b.rng, budget)
    bounds = np.concatenate([[0], np.cumsum([len(s) for s in sentences])])
    # needle i goes before sentence at[i]; stable order keeps needles sharing a boundary in depth order
    # never after the last sentence: it may be cut mid-word to hit the exact budget
    at = [min(int(np.argmin(np.abs(bounds - d * budget))), len(sentences) - 1) for d, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (at[i], needles[i][0], i))
    pieces: list[Piece] = [(prefix, None)]
    j = 0
    for s_idx in range(len(sentences) + 1):
        while j < len(order) and at[order[j]] == s_idx:
            pieces.extend(needles[order[j]][1])
            j += 1
        if s_idx < len(sentences):
            pieces.append((sentences[s_idx], None))
    pieces.append((question, None))
    return b.finish(pieces, answer_ids)


def _depth(b: _Builder, depth: float | None) -> float:
    if depth is None:
        return float(b.rng.uniform(0.0, 1.0))
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], not {depth}.")
    return float(depth)


class _NeedleFiller:
    """A haystack made of distractor needles (RULER's ``type_haystack: needle``): each "sentence" is one needle
    with a fresh key and value, none of them a key of the prompt's own needles."""

    def __init__(self, b: _Builder, noun_pl: str, needle_type: str, make_key: Callable[[], str], taken: list[str]):
        self.b, self.noun_pl, self.needle_type, self.make_key, self.taken = (
            b,
            noun_pl,
            needle_type,
            make_key,
            set(taken),
        )

    def fill(self, rng: np.random.Generator, budget: int) -> list[np.ndarray]:
        out, total = [], 0
        while total < budget:
            key = self.make_key()
            if key in self.taken:
                continue
            self.taken.add(key)
            value = self.b.value(self.needle_type)
            ids = np.asarray(self.b.ids(f" One of the special magic {self.noun_pl} for {key} is: {value}."), np.int32)
            out.append(ids[: budget - total])
            total += len(out[-1])
        return out


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def niah(
    tokenizer: TokenizerLike,
    haystack: Haystack,
    *,
    length: int,
    seed: int,
    depth: float | None = None,
    needle_type: str = "number",
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    key_type: str = "word",
    needle_haystack: bool = False,
    count_answer: bool = False,
    task: str | None = None,
) -> SyntheticExample:
    """Needle in a haystack. num_keys > 1: distractor needles with other keys (multi-key);
    num_values > 1: several values for the asked key, all to be listed (multi-value); num_queries > 1: that many
    keys asked at once, their values listed in the order asked (multi-query). key_type "word" (two words joined by
    a hyphen) or "uuid". needle_haystack: the filler is distractor needles instead of ``haystack`` text."""
    task = task or (
        "niah_single"
        if num_keys == 1 and num_values == 1 and num_queries == 1
        else "niah_multikey"
        if num_values == 1 and num_queries == 1
        else "niah_multivalue"
        if num_queries == 1
        else "niah_multiquery"
    )
    if num_values > 1 and num_queries > 1:
        raise ValueError("niah: ask either several values of one key or one value of several keys, not both.")
    if key_type not in ("word", "uuid"):
        raise ValueError(f"niah: key_type must be 'word' or 'uuid', not {key_type!r}.")
    b = _Builder(task, tokenizer, seed)
    b.value(needle_type)  # validates the type before any work
    noun, noun_pl = _TYPE_NOUN[needle_type]
    make_key = b.key if key_type == "word" else lambda: b.value("uuid")
    num_keys = max(num_keys, num_queries)
    keys = b.distinct(make_key, num_keys)
    values = b.distinct(lambda: b.value(needle_type), num_keys + num_values - 1)
    first = _depth(b, depth)
    # asked keys[:num_queries]; keys[0] holds values[:num_values], key k > 0 holds values[num_values + k - 1]
    placements = [
        (keys[0], v, first if i == 0 else float(b.rng.uniform(0, 1))) for i, v in enumerate(values[:num_values])
    ]
    placements += [(keys[k], values[num_values + k - 1], float(b.rng.uniform(0, 1))) for k in range(1, num_keys)]
    asked_keys = keys[:num_queries]
    if num_queries == 1:  # the values of the one asked key, in order of appearance
        asked = sorted((p for p in placements if p[0] == keys[0]), key=lambda p: p[2])
    else:  # one value per asked key, in the order asked
        asked = [next(p for p in placements if p[0] == k) for k in asked_keys]
    answer_index = {p[1]: i for i, p in enumerate(asked)}
    needles = []
    for key, value, d in placements:
        tag = f"answer:{answer_index[value]}" if value in answer_index else "needle"
        needles.append(
            (
                d,
                [
                    (b.ids(f" One of the special magic {noun_pl} for {key} is:"), None),
                    (b.ids(" " + value), tag),
                    (b.ids("."), None),
                ],
            )
        )
    answer_ids = [t for p in asked for t in b.ids(" " + p[1])]
    if num_values == 1 and num_queries == 1:
        q = (
            f"\nWhat is the special magic {noun} for {keys[0]} mentioned in the provided text? "
            f"Answer: The special magic {noun} for {keys[0]} mentioned in the provided text is:"
        )
    else:
        asked_text = _join(asked_keys)
        q = (
            f"\nWhat are all the special magic {noun_pl} for {asked_text} mentioned in the provided text? "
            f"Answer: The special magic {noun_pl} for {asked_text} mentioned in the provided text are:"
        )
    prefix = b.opening(NIAH_PREFIX.format(noun_pl=noun_pl))
    if needle_haystack:
        haystack = _NeedleFiller(b, noun_pl, needle_type, make_key, keys)
    return _with_haystack(b, haystack, length, count_answer, prefix, needles, b.ids(q), answer_ids)


def passkey(
    tokenizer: TokenizerLike,
    haystack: Haystack,
    *,
    length: int,
    seed: int,
    depth: float | None = None,
    count_answer: bool = False,
) -> SyntheticExample:
    b = _Builder("passkey", tokenizer, seed)
    key = " " + str(int(b.rng.integers(10_000, 100_000)))
    d = _depth(b, depth)
    needle = [(b.ids(" The pass key is"), None), (b.ids(key), "answer:0"), (b.ids(". Remember it."), None)]
    return _with_haystack(
        b,
        haystack,
        length,
        count_answer,
        b.opening(PASSKEY_PREFIX),
        [(d, needle)],
        b.ids("\nWhat is the pass key? The pass key is"),
        b.ids(key),
    )


def variable_tracking(
    tokenizer: TokenizerLike,
    haystack: Haystack,
    *,
    length: int,
    seed: int,
    depth: float | None = None,
    num_hops: int = 4,
    count_answer: bool = False,
) -> SyntheticExample:
    """A chain VAR N0 = v. VAR N1 = VAR N0. ... spread through the haystack from `depth` onwards."""
    b = _Builder("variable_tracking", tokenizer, seed)
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    names = b.distinct(lambda: "".join(b.rng.choice(letters, 5)), num_hops + 1)
    value = str(int(b.rng.integers(10_000, 100_000)))
    start = _depth(b, depth)
    depths = np.sort(b.rng.uniform(start, 1.0, num_hops)) if num_hops else np.zeros(0)
    needles = [(start, [(b.ids(" VAR"), None), (b.ids(" " + names[0]), "answer:0"), (b.ids(f" = {value}."), None)])]
    for i in range(1, num_hops + 1):
        needles.append(
            (
                float(depths[i - 1]),
                [
                    (b.ids(" VAR"), None),
                    (b.ids(" " + names[i]), f"answer:{i}"),
                    (b.ids(" = VAR"), None),
                    (b.ids(" " + names[i - 1]), None),
                    (b.ids("."), None),
                ],
            )
        )
    q = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
        f"According to the chain(s) of variable assignment in the text above, {num_hops + 1} variables are "
        f"assigned the value {value}, they are:"
    )
    answer_ids = [t for n in names for t in b.ids(" " + n)]
    return _with_haystack(b, haystack, length, count_answer, b.opening(VT_PREFIX), needles, b.ids(q), answer_ids)


def kv_retrieval(
    tokenizer: TokenizerLike,
    haystack: Haystack | None = None,
    *,
    length: int,
    seed: int,
    depth: float | None = None,
    count_answer: bool = False,
) -> SyntheticExample:
    """The context is the JSON object itself (no haystack): as many pairs as fit in `length`, so
    len(prompt_ids) <= length (within one pair of it)."""
    del haystack
    b = _Builder("kv_retrieval", tokenizer, seed)
    prefix = b.opening(KV_PREFIX)
    q_head = b.ids('}\n\nKey: "')
    q_tail = b.ids('"\nThe value associated with the specified key is: "')
    pairs: list[tuple[list[int], list[int], list[int], list[int]]] = []  # key piece, key ids, value, close
    total, max_key = len(prefix) + len(q_head) + len(q_tail), 0
    seen = set()
    while True:
        k, v = b.value("uuid"), b.value("uuid")
        if k in seen:
            continue
        seen.add(k)
        key_ids, val_ids = b.ids(k), b.ids(v)
        pair = (b.ids('"') + key_ids + b.ids('": "'), key_ids, val_ids, b.ids('", '))
        size = len(pair[0]) + len(val_ids) + len(pair[3])
        worst = max(max_key, len(key_ids)) + (max([len(val_ids)] + [len(p[2]) for p in pairs]) if count_answer else 0)
        if total + size + worst > length:
            break
        pairs.append(pair)
        total += size
        max_key = max(max_key, len(key_ids))
    if not pairs:
        raise ValueError(f"kv_retrieval: length={length} is too short for even one key-value pair.")
    target = int(round(_depth(b, depth) * (len(pairs) - 1)))
    pieces: list[Piece] = [(prefix, None)]
    for i, (head, _, val, close) in enumerate(pairs):
        pieces += [
            (head, None),
            (val, "answer:0" if i == target else "needle"),
            (close if i < len(pairs) - 1 else b.ids('"'), None),
        ]
    pieces += [(q_head, None), (pairs[target][1], None), (q_tail, None)]
    return b.finish(pieces, pairs[target][2])


TASKS: dict[str, Callable[..., SyntheticExample]] = {
    "niah_single": lambda tok, hay, **kw: niah(tok, hay, **kw),
    "niah_multikey": lambda tok, hay, **kw: niah(tok, hay, num_keys=kw.pop("num_keys", 4), **kw),
    "niah_multivalue": lambda tok, hay, **kw: niah(tok, hay, num_values=kw.pop("num_values", 4), **kw),
    "passkey": lambda tok, hay, **kw: passkey(tok, hay, **kw),
    "kv_retrieval": lambda tok, hay, **kw: kv_retrieval(tok, hay, **kw),
    "variable_tracking": lambda tok, hay, **kw: variable_tracking(tok, hay, **kw),
}


def generate(
    task: str, tokenizer: TokenizerLike, haystack: Haystack, *, length: int, seed: int, **options
) -> SyntheticExample:
    """One example of `task` (a key of TASKS); `options` go to the task (depth, needle_type, ...)."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {sorted(TASKS)}.")
    return TASKS[task](tokenizer, haystack, length=length, seed=seed, **options)

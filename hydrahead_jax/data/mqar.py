"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology") as token rows of recall symbols.

A sequence of ``length`` tokens with ``N`` pairs is

    k_1 v_1 k_2 v_2 … k_N v_N | f f k_{π1} v_{π1} f … k_{πN} v_{πN} f f …

the N key-value pairs first (keys distinct, values distinct), then a query region of ``length − 2N`` tokens cut
into ``(length − 2N) // 2`` two-token slots: N slots, chosen without replacement, hold a query (a key of the pairs,
each key asked once, in a random order) followed by its value; every other token is a filler symbol. The model is
scored at each query key: recall = P(argmax of the next-token distribution = the key's value). As in Zoology the
slot of each query is drawn with probability ∝ i^(a−1) (i = 1 … slots, ``power_a`` = a = 0.01), so most queries
come soon after the pairs and a few far from them, as repeated bigrams do in text.

Two differences from Zoology's generator, both because these rows also train a language model on every token:
the value follows its query in the input (Zoology leaves the answer out of the input and labels it), and the
non-query tokens are filler symbols of their own rather than random vocabulary tokens (a random key among the
fillers would teach the model that a key is not always followed by its value).

Keys, values and fillers are symbols added to the tokenizer (``MQARSymbols.tokens``): each is one token whatever
the text around it, so a sequence is also a document of text (``text``) that the corpus pipeline tokenises back to
exactly these ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hydrahead_jax.data.protocol import TokenizerLike


@dataclasses.dataclass(frozen=True)
class MQARSymbols:
    """The recall symbols: ``num_keys`` keys ``<k0>…``, ``num_values`` values ``<v0>…``, ``num_fillers`` fillers."""

    num_keys: int = 256
    num_values: int = 256
    num_fillers: int = 16

    def __post_init__(self):
        for name in ("num_keys", "num_values", "num_fillers"):
            if getattr(self, name) < 1:
                raise ValueError(f"MQARSymbols.{name}={getattr(self, name)} must be >= 1.")

    def tokens(self) -> list[str]:
        """Every symbol's text, keys then values then fillers (the tokenizer adds them in this order)."""
        return (
            [f"<k{i}>" for i in range(self.num_keys)]
            + [f"<v{i}>" for i in range(self.num_values)]
            + [f"<f{i}>" for i in range(self.num_fillers)]
        )

    def ids(self, tokenizer: TokenizerLike) -> SymbolIds:
        """The symbols' token ids; each symbol must encode to exactly one token."""
        tokens = self.tokens()
        ids = []
        for token in tokens:
            encoded = tokenizer.encode(token)
            if len(encoded) != 1:
                raise ValueError(
                    f"MQAR symbol {token!r} encodes to {len(encoded)} tokens with {tokenizer.name!r}; the recall "
                    "symbols must be added to the tokenizer as whole tokens (experiments.small_teacher.train_tokenizer)."
                )
            ids.append(encoded[0])
        k, v = self.num_keys, self.num_values
        arr = np.asarray(ids, np.int32)
        return SymbolIds(keys=arr[:k], values=arr[k : k + v], fillers=arr[k + v :])


@dataclasses.dataclass(frozen=True)
class SymbolIds:
    keys: np.ndarray
    values: np.ndarray
    fillers: np.ndarray


@dataclasses.dataclass(frozen=True)
class MQARExample:
    """One sequence: ``ids`` int32 [length]; the model is scored at ``query_positions`` (each a query key, whose
    next token ``ids[p + 1]`` is the answer ``answers``)."""

    ids: np.ndarray
    query_positions: np.ndarray
    answers: np.ndarray


def check_shape(num_pairs: int, length: int) -> None:
    """N pairs need 2N tokens of pairs and N query slots of two tokens: length >= 4N."""
    if num_pairs < 1 or length < 4 * num_pairs:
        raise ValueError(
            f"MQAR with {num_pairs} pairs needs length >= 4 x pairs = {4 * num_pairs} tokens (2N of pairs, N "
            f"two-token query slots), got {length}."
        )


def mqar_example(
    rng: np.random.Generator, symbols: SymbolIds, *, num_pairs: int, length: int, power_a: float = 0.01
) -> MQARExample:
    """One MQAR sequence (module doc) drawn from ``rng``."""
    check_shape(num_pairs, length)
    if num_pairs > min(len(symbols.keys), len(symbols.values)):
        raise ValueError(
            f"MQAR with {num_pairs} pairs needs that many distinct keys and values; the symbols have "
            f"{len(symbols.keys)} keys and {len(symbols.values)} values."
        )
    keys = rng.choice(symbols.keys, num_pairs, replace=False)
    values = rng.choice(symbols.values, num_pairs, replace=False)
    ids = rng.choice(symbols.fillers, length).astype(np.int32)
    ids[0 : 2 * num_pairs : 2] = keys
    ids[1 : 2 * num_pairs : 2] = values
    slots = (length - 2 * num_pairs) // 2
    weights = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
    chosen = rng.choice(slots, num_pairs, replace=False, p=weights / weights.sum())
    order = rng.permutation(num_pairs)  # which pair each chosen slot asks
    positions = 2 * num_pairs + 2 * np.sort(chosen)
    ids[positions] = keys[order]
    ids[positions + 1] = values[order]
    return MQARExample(ids, positions.astype(np.int64), values[order].astype(np.int32))


def mqar_batch(
    seed: int | list[int], symbols: SymbolIds, *, rows: int, num_pairs: int, length: int, power_a: float = 0.01
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rows`` sequences of one shape from ``seed``: ids int32 [rows, length], query positions int64 [rows, N],
    answers int32 [rows, N]."""
    rng = np.random.default_rng(seed)
    examples = [mqar_example(rng, symbols, num_pairs=num_pairs, length=length, power_a=power_a) for _ in range(rows)]
    return (
        np.stack([e.ids for e in examples]),
        np.stack([e.query_positions for e in examples]),
        np.stack([e.answers for e in examples]),
    )


def text(ids: np.ndarray, tokenizer: TokenizerLike) -> str:
    """A sequence as the document text that tokenises back to ``ids`` (the symbols, concatenated)."""
    return tokenizer.decode(ids)

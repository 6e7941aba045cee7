"""The tokenizer interface the data pipeline needs (structural: any object with these members works).

`hydrahead_jax.models.tokenizer.Tokenizer` satisfies it; tests use a small adapter around a
`tokenizers.Tokenizer`. Nothing here imports the model package, so the data code stays usable alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class TokenizerLike(Protocol):
    """What corpus preparation, the pipelines and the synthetic tasks call on a tokenizer."""

    name: str
    fingerprint: str  # stable hash of vocabulary + merges; identifies a token store's vocabulary
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    # The ids the tokenizer puts before each document (Llama 3: its BOS; SmolLM2, Qwen: none); see `encode_document`.
    document_start: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (a piece of text, not a whole document)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


def leading_special_ids(backend) -> tuple[int, ...]:
    """The ids a `tokenizers.Tokenizer`'s post-processor puts before a single sequence when asked for special tokens
    (``add_special_tokens=True``): ``(bos,)`` for Llama 3's template ``<|begin_of_text|> $A``, ``()`` for SmolLM2's
    and Qwen's (which add none). Tokens it appends after the sequence are not included: documents get their EOS from
    the corpus (``append_eos``), and a prompt must not end in one."""
    encoding = backend.encode("a", add_special_tokens=True)
    first = next((i for i, s in enumerate(encoding.sequence_ids) if s is not None), None)
    if first is None:
        raise ValueError("the tokenizer encodes 'a' to no token, so where its special tokens go cannot be told.")
    return tuple(int(i) for i in encoding.ids[:first])


def document_start(tokenizer: TokenizerLike) -> list[int]:
    """The ids every document begins with: the tokenizer's ``document_start`` (a tokenizer without one adds none)."""
    return [int(i) for i in getattr(tokenizer, "document_start", ())]


def encode_document(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of `text` as the start of a document: what transformers' tokenizer gives with
    ``add_special_tokens=True`` (Llama 3: ``<|begin_of_text|>`` first), less any special tokens appended at its end.
    Every document start (corpus rows, probe and evaluation prompts, held-out text) is encoded through here."""
    return document_start(tokenizer) + list(tokenizer.encode(text))


def encode_documents(tokenizer: TokenizerLike, texts: Sequence[str]) -> list[list[int]]:
    """`encode_document` of each text, tokenised as one batch."""
    start = document_start(tokenizer)
    return [start + list(ids) for ids in tokenizer.encode_batch(list(texts))]


class TokenizerModelMismatchError(ValueError):
    """A tokenizer that can produce ids the model has no embedding row for, or lacks a token the pipeline needs."""


def max_token_id(tokenizer: TokenizerLike) -> int:
    """The largest id the tokenizer can emit: from its full vocabulary when it exposes one (a
    `tokenizers.Tokenizer` backend; ids may be sparse), else vocab_size − 1."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_vocab"):
        vocab = backend.get_vocab(with_added_tokens=True)
        if vocab:
            return max(int(i) for i in vocab.values())
    return int(tokenizer.vocab_size) - 1


def check_tokenizer(tokenizer: TokenizerLike, vocab_rows: int, *, model_name: str = "the model") -> None:
    """Refuse a tokenizer whose ids reach past the model's ``vocab_rows`` embedding rows, or without an EOS id.

    An out-of-range id does not fail loudly in JAX: the embedding gather clamps or yields NaN, and the damage
    shows up much later (NaN probe scores, a "non-finite loss" blamed on the learning rate).
    """
    top = max_token_id(tokenizer)
    if top >= vocab_rows:
        raise TokenizerModelMismatchError(
            f"tokenizer {tokenizer.name!r} has token ids up to {top}, but {model_name} has only {vocab_rows} "
            f"embedding rows (ids 0..{vocab_rows - 1}). Fix: use the tokenizer that ships with the checkpoint "
            "(the same folder or .gguf), or a checkpoint whose vocab_size covers this tokenizer."
        )
    if tokenizer.eos_id is None:
        raise TokenizerModelMismatchError(
            f"tokenizer {tokenizer.name!r} defines no EOS token; documents are packed with EOS between them. Fix: "
            "use a tokenizer with an end-of-text token (eos_token in tokenizer_config.json)."
        )
    for name in ("eos_id", "bos_id"):
        value = getattr(tokenizer, name)
        if value is not None and not 0 <= int(value) < vocab_rows:
            raise TokenizerModelMismatchError(
                f"tokenizer {tokenizer.name!r}: {name}={value} is outside {model_name}'s {vocab_rows} embedding "
                "rows. Fix: use the tokenizer that ships with the checkpoint."
            )

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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

"""A `TokenizerLike` adapter around a `tokenizers.Tokenizer`, and a small byte-level BPE trainer.

Used by tests and demos that should not depend on the model package; the real SmolLM2 tokenizer is
`hydrahead_jax.models.tokenizer.load_tokenizer("smollm2-135m")`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hydrahead_jax.data.protocol import leading_special_ids

EOS_TOKEN = "<|endoftext|>"


class TokenizersAdapter:
    """Wraps a `tokenizers.Tokenizer` in the TokenizerLike protocol (no special tokens on encode; documents start
    with what its post-processor puts first, ``document_start``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        name: str = "tokenizers",
        eos_token: str | None = EOS_TOKEN,
        bos_token: str | None = None,
    ):
        self._tok = tokenizer
        self.name = name
        self.fingerprint = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.document_start = leading_special_ids(tokenizer)

    @property
    def backend(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (the name ``models.tokenizer.Tokenizer`` gives it)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 512, name: str = "tiny-bpe") -> TokenizersAdapter:
    """Byte-level BPE (GPT-2 style pre-tokenisation, digits split individually) trained on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return TokenizersAdapter(tok, name=name)

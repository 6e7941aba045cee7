"""Tokenizers for pretrained checkpoints: rebuilt from GGUF metadata, or read from a folder's tokenizer.json.

A GGUF file has no tokenizer.json; it stores llama.cpp's description of one (``tokenizer.ggml.*``): the model
type (``gpt2`` = byte-level BPE), the tokens in id order, the merges, each token's type (1 normal, 3 control,
4 user-defined) and the pre-tokenizer name (``tokenizer.ggml.pre``). We rebuild the same `tokenizers.Tokenizer`
the original repository ships, so ids agree with transformers and llama.cpp.

Whether a document starts with a BOS comes from the tokenizer itself, decided as transformers (>= 5) decides it: a
GGUF's ``tokenizer.ggml.add_bos_token`` (Llama 3: true; SmolLM2, Qwen: false; absent: no BOS), a folder's
tokenizer.json post-processor (Llama 3's template ``<|begin_of_text|> $A``; tokenizer_config.json's
``add_bos_token`` is ignored beside a tokenizer.json, as transformers ignores it). Both end up as the backend's
post-processor, which ``Tokenizer.document_start`` reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from hydrahead_jax.data.protocol import encode_document, leading_special_ids
from hydrahead_jax.models.loaders import CheckpointError, gguf_field, resolve_source
from hydrahead_jax.storage import run_path

# Pre-tokenizer regexes by llama.cpp's ``tokenizer.ggml.pre`` name (the split a vocabulary's merges were learned on).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "smollm" (and StarCoder's family): every digit on its own, then the GPT-2 split, which is what
# SmolLM2's tokenizer.json spells as Digits(individual_digits=True) + ByteLevel(use_regex=True).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")
_SPLIT_REGEXES = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_PLAIN_GPT2 = ("gpt2", "gpt-2", "default", "")
_CONTROL, _USER_DEFINED = 3, 4


def _byte_alphabet() -> set[str]:
    return set(pre_tokenizers.ByteLevel.alphabet())


def _pre_tokenizer(pre: str, path):
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_REGEXES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEXES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _PLAIN_GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise CheckpointError(
        f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: "
        f"{sorted(set(_DIGITS_THEN_GPT2) | set(_SPLIT_REGEXES) | set(_PLAIN_GPT2) - {''})}."
    )


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
    """Rebuild a byte-level BPE tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata."""
    from gguf import GGUFReader

    path = Path(path)
    reader = GGUFReader(path)
    kind = gguf_field(reader, "tokenizer.ggml.model", "<absent>")
    if kind != "gpt2":
        raise CheckpointError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2', used by SmolLM2, Llama 3, Qwen2/3) is."
        )
    tokens = list(gguf_field(reader, "tokenizer.ggml.tokens", path=path))
    merges = [tuple(m.split(" ")) for m in gguf_field(reader, "tokenizer.ggml.merges", path=path)]
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    alphabet = _byte_alphabet()
    byte_encoder = _bytes_to_unicode()
    # Byte-level vocabularies spell every token in the 256-character byte alphabet; a token written in raw text
    # (rare, a converter quirk) is re-spelled so that the BPE model can find it.
    vocab = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= alphabet else "".join(byte_encoder[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(str(gguf_field(reader, "tokenizer.ggml.pre", "default")), path)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) must match whole in text and be skippable on decode;
    # user-defined ones match whole but are ordinary text.
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL and set(t) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab
        ]
    )
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos_id = int(bos.contents()) if bos is not None else None
    eos_id = int(eos.contents()) if eos is not None else None
    # A byte-level GGUF without the flags adds nothing (as transformers reads one); Llama 3's files set add_bos_token.
    add_bos, add_eos = (bool(gguf_field(reader, f"tokenizer.ggml.add_{k}_token", False)) for k in ("bos", "eos"))
    if add_bos or add_eos:
        backend.post_processor = _special_tokens_template(
            backend, bos_id if add_bos else None, eos_id if add_eos else None
        )
    template = reader.fields.get("tokenizer.chat_template")
    return Tokenizer(
        backend,
        name=str(gguf_field(reader, "general.name", path.stem)),
        bos_id=bos_id,
        eos_id=eos_id,
        chat_template=template.contents() if template is not None else None,
    )


def _special_tokens_template(backend: HFTokenizer, bos_id: int | None, eos_id: int | None):
    """transformers' post-processor for add_bos_token/add_eos_token: ``[BOS] $A [EOS]`` for one sequence and
    ``[BOS] $A [EOS] [BOS] $B [EOS]`` for a pair (``TokenizersBackend.update_post_processor``); None: not added."""

    def piece(token_id: int | None, type_id: int) -> list[str]:
        return [] if token_id is None else [f"{backend.id_to_token(token_id)}:{type_id}"]

    single = " ".join([*piece(bos_id, 0), "$A:0", *piece(eos_id, 0)])
    pair = " ".join([single, *piece(bos_id, 1), "$B:1", *piece(eos_id, 1)])
    specials = [(backend.id_to_token(i), i) for i in (bos_id, eos_id) if i is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level alphabet's spelling of every byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_folder(path: str | os.PathLike) -> Tokenizer:
    """A Hugging Face folder's tokenizer.json, with bos/eos from tokenizer_config.json or config.json."""
    path = run_path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(
            f"{path}: tokenizer.json is missing; the folder needs a fast-tokenizer file "
            "(save it with AutoTokenizer.save_pretrained)."
        )
    backend = HFTokenizer.from_str(file.read_text())
    tok_cfg = _read_json(path / "tokenizer_config.json")
    model_cfg = _read_json(path / "config.json")

    def token_id(kind: str):
        spec = tok_cfg.get(f"{kind}_token")
        if isinstance(spec, dict):
            spec = spec.get("content")
        if isinstance(spec, str) and backend.token_to_id(spec) is not None:
            return backend.token_to_id(spec)
        value = model_cfg.get(f"{kind}_token_id")
        return value[0] if isinstance(value, list) else value

    return Tokenizer(
        backend,
        name=str(model_cfg.get("_name_or_path") or path.name),
        bos_id=token_id("bos"),
        eos_id=token_id("eos"),
        chat_template=tok_cfg.get("chat_template"),
    )


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}


def load_tokenizer(source: str | os.PathLike) -> Tokenizer:
    """The tokenizer of ``"smollm2-135m"``, a ``.gguf`` file or a Hugging Face folder."""
    path = resolve_source(source)
    return tokenizer_from_gguf(path) if path.is_file() else tokenizer_from_folder(path)


class Tokenizer:
    """A thin, stable interface over a `tokenizers.Tokenizer` (the data pipeline relies on these names).

    ``encode`` adds no BOS/EOS, but special-token strings in the text (``<|im_start|>``) map to their ids: it encodes
    a piece of text. ``encode_document`` encodes a whole document: ``document_start`` (the ids the backend's
    post-processor puts first, Llama 3's ``<|begin_of_text|>``; none for SmolLM2 and Qwen), then ``encode``.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        name: str,
        bos_id: int | None,
        eos_id: int | None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.name = name
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.document_start = leading_special_ids(backend)
        self._fingerprint = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def encode_document(self, text: str) -> list[int]:
        """Ids of ``text`` as a whole document (``data.protocol.encode_document``: ``document_start`` first)."""
        return encode_document(self, text)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def fingerprint(self) -> str:
        """sha256 over the vocabulary (token, id pairs incl. added tokens), the merges in order, the pre-tokenizer and,
        when there is one, ``document_start``.

        Two tokenizers with the same fingerprint produce the same ids, so a tokenised corpus cached under this
        key can be reused safely. A tokenizer that starts documents with nothing hashes exactly what it hashed
        before documents had a start (SmolLM2's, Qwen's: their token stores keep their names).
        """
        if self._fingerprint is None:
            vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
            model = json.loads(self.backend.to_str()).get("model", {})
            merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
            pre = json.loads(self.backend.to_str()).get("pre_tokenizer")
            identity = {"vocab": vocab, "merges": merges, "pre_tokenizer": pre}
            if self.document_start:
                identity["document_start"] = list(self.document_start)
            blob = json.dumps(identity, ensure_ascii=False, sort_keys=True)
            self._fingerprint = hashlib.sha256(blob.encode("utf-8")).hexdigest()
        return self._fingerprint

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role", "content"}]) with the checkpoint's Jinja chat template."""
        if not self.chat_template:
            raise ValueError(f"Tokenizer {self.name!r} has no chat template; format the prompt yourself.")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # jinja2 comes with torch/transformers but is not a core dependency
            raise ImportError("apply_chat_template needs jinja2: pip install jinja2") from e
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
        )

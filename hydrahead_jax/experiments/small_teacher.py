"""The reproduction's teacher: a small Llama-style decoder trained here, deterministically from a seed.

Vocabulary: a byte-level BPE (``data.tiny_tokenizer.train_bpe_tokenizer``) trained on the corpus's training
articles, plus the MQAR recall symbols (``data.mqar.MQARSymbols``) as whole tokens.

Data: step s of training reads a batch that depends only on (seed, s), so a resumed run sees exactly the batches
an uninterrupted one would. Each batch holds three kinds of rows of ``seq_len`` tokens, in fixed proportions:

* MQAR sequences (``data.mqar``) with a pair count drawn uniformly from 1 … ``max_pairs``,
* key-value needles inside text: the product's synthetic retrieval prompts (``data.synthetic``: NIAH with number
  and word needles, passkey, key-value retrieval) on a haystack of the training articles, followed by the answer,
* windows of the training articles' token stream (documents joined by EOS).

The loss is the next-token cross-entropy on every position. The trained model is written as a Hugging Face folder
(config.json, model.safetensors, tokenizer.json), so the product loads it as any pretrained teacher
(``teacher.source = <folder>``) and converts it with its own pipeline.

Resumable: a checkpoint (every parameter and AdamW moment, and the step) is written every ``checkpoint_every``
steps by a temporary file and a rename; a rerun continues from it. A checkpoint of another recipe is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.data.mqar import MQARSymbols, mqar_example

NEEDLE_TASKS = (
    ("niah_single", {"needle_type": "number"}),
    ("niah_single", {"needle_type": "word"}),
    ("passkey", {}),
    ("kv_retrieval", {}),
)

KV_MIN_LENGTH = 256  # a JSON object of uuid pairs needs about this many tokens of this vocabulary for two pairs


@dataclasses.dataclass(frozen=True)
class TeacherRecipe:
    """Shape, vocabulary, data mix and optimiser of the small teacher (the defaults: the study's teacher)."""

    seed: int = 0
    vocab_size: int = 2048  # BPE merges + bytes, before the recall symbols are added
    symbols: MQARSymbols = MQARSymbols()
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 16
    seq_len: int = 512
    batch_size: int = 16
    # Sized to the 45-minute budget from a measurement (--measure_teacher_steps=5, this recipe, the 2-core machine
    # shared, load ~17): 494.5 tokens per CPU second, so at most ~990 tokens/s on both cores alone; 45 min x 990
    # tokens/s / (16 x 512 tokens per step) = 326 steps (2.7M tokens). Whether that reaches the acceptance bar is
    # what the acceptance part measures; the wall-clock rate under that contention was 111 tokens/s.
    steps: int = 320
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    mqar_fraction: float = 0.5
    needle_fraction: float = 0.25  # the rest of each batch: text windows
    max_pairs: int = 64
    checkpoint_every: int = 100

    def __post_init__(self):
        if not 0 <= self.mqar_fraction + self.needle_fraction <= 1:
            raise ValueError("TeacherRecipe: mqar_fraction + needle_fraction must lie in [0, 1].")
        if self.seq_len < 4 * self.max_pairs:
            raise ValueError(f"TeacherRecipe: seq_len={self.seq_len} < 4 x max_pairs={self.max_pairs} (MQAR shape).")

    def model_config(self, vocab_rows: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_rows,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=4 * self.seq_len,
            name="reproduction-teacher",
        )

    def rows(self) -> tuple[int, int, int]:
        """(MQAR, needle, text) rows per batch."""
        mqar = round(self.batch_size * self.mqar_fraction)
        needle = round(self.batch_size * self.needle_fraction)
        return mqar, needle, self.batch_size - mqar - needle

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ vocabulary


def train_tokenizer(texts: list[str], recipe: TeacherRecipe, out: Path):
    """Byte-level BPE on ``texts`` plus the recall symbols, saved to ``out`` (tokenizer.json); returns it as the
    product's Tokenizer (``models.tokenizer.tokenizer_from_folder`` reads the same file)."""
    from tokenizers import AddedToken

    from hydrahead_jax.data.tiny_tokenizer import train_bpe_tokenizer

    adapter = train_bpe_tokenizer(texts, vocab_size=recipe.vocab_size, name="reproduction-bpe")
    backend = adapter.backend
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in recipe.symbols.tokens()])
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (out / "config.json").write_text(json.dumps({"_name_or_path": "reproduction-bpe"}))
    return load_folder_tokenizer(out)


def load_folder_tokenizer(folder: Path):
    from hydrahead_jax.models.tokenizer import tokenizer_from_folder

    return tokenizer_from_folder(folder)


# ------------------------------------------------------------------------------------------------ data


class TeacherData:
    """The batch of step s (module doc): a pure function of (recipe.seed, s)."""

    def __init__(self, recipe: TeacherRecipe, tokenizer, train_texts: list[str]):
        from hydrahead_jax.data.synthetic import Haystack

        self.recipe, self.tokenizer = recipe, tokenizer
        self.symbols = recipe.symbols.ids(tokenizer)
        eos = tokenizer.eos_id
        stream = []
        for ids in tokenizer.encode_batch(train_texts):
            stream.extend(ids + ([eos] if eos is not None else []))
        self.stream = np.asarray(stream, np.int32)
        if len(self.stream) <= recipe.seq_len:
            raise ValueError(f"the training text has {len(self.stream)} tokens, fewer than seq_len={recipe.seq_len}.")
        self.haystack = Haystack(train_texts, tokenizer)

    def needle_row(self, rng: np.random.Generator, seed: int) -> np.ndarray:
        from hydrahead_jax.data.synthetic import generate

        length = self.recipe.seq_len
        task, options = NEEDLE_TASKS[int(rng.integers(len(NEEDLE_TASKS)))]
        prompt_len = int(rng.integers(length * 3 // 4, length - 16))  # the prompts need most of a row
        if task == "kv_retrieval" and prompt_len < KV_MIN_LENGTH:
            task, options = "passkey", {}
        ex = generate(task, self.tokenizer, self.haystack, length=prompt_len, seed=seed, **options)
        eos = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        row = np.concatenate([ex.prompt_ids, ex.answer_ids, np.asarray(eos, np.int32)]).astype(np.int32)
        if len(row) < length:  # the rest of the row: text, as packed documents would follow
            row = np.concatenate([row, np.concatenate(self.haystack.fill(rng, length - len(row)))])
        return row[:length]

    def batch(self, step: int) -> np.ndarray:
        r = self.recipe
        rng = np.random.default_rng([r.seed, step])
        mqar, needle, text = r.rows()
        rows = []
        for _ in range(mqar):
            pairs = int(rng.integers(1, r.max_pairs + 1))
            rows.append(mqar_example(rng, self.symbols, num_pairs=pairs, length=r.seq_len).ids)
        for i in range(needle):
            rows.append(self.needle_row(rng, seed=int(step * r.batch_size + i)))
        starts = rng.integers(0, len(self.stream) - r.seq_len, size=text)
        rows.extend(self.stream[s : s + r.seq_len] for s in starts)
        return np.stack(rows).astype(np.int32)


# ------------------------------------------------------------------------------------------------ training


def _optimizer(recipe: TeacherRecipe):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, recipe.lr, max(1, min(recipe.warmup_steps, recipe.steps - 1)), max(2, recipe.steps), recipe.lr * 0.1
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=recipe.weight_decay))


def _save(path: Path, step: int, params, opt_state, digest: str) -> None:
    import jax

    leaves = jax.tree.leaves((params, opt_state))
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(
        tmp, step=np.int64(step), digest=np.asarray(digest), **{f"l{i}": np.asarray(x) for i, x in enumerate(leaves)}
    )
    tmp.replace(path)


def _restore(path: Path, params, opt_state, digest: str):
    import jax

    with np.load(path) as data:
        if str(data["digest"]) != digest:
            raise ValueError(
                f"{path} is a checkpoint of another teacher recipe; delete {path.parent} to train this one from "
                "the start, or rerun with the recipe it was trained with."
            )
        treedef = jax.tree.structure((params, opt_state))
        leaves = [jax.numpy.asarray(data[f"l{i}"]) for i in range(treedef.num_leaves)]
        return int(data["step"]), *jax.tree.unflatten(treedef, leaves)


def train_teacher(recipe: TeacherRecipe, tokenizer, train_texts: list[str], workdir: Path, *, log=print) -> dict:
    """Train (or continue training) the teacher in ``workdir`` (train.npz, train_log.jsonl) and export it to
    ``workdir/hf``; returns this call's steps, and over its timed steps (all but the first, which compiles) the
    tokens, wall and CPU seconds and both rates."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from hydrahead_jax.models import Transformer
    from hydrahead_jax.models.loaders import save_hf_folder

    workdir.mkdir(parents=True, exist_ok=True)
    cfg = recipe.model_config(tokenizer.vocab_size)
    model = Transformer(cfg, rngs=nnx.Rngs(recipe.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = _optimizer(recipe)
    opt_state = tx.init(params)
    digest = json.dumps(recipe.to_dict(), sort_keys=True, default=str) + f"|vocab={cfg.vocab_size}"
    ckpt = workdir / "train.npz"
    step = 0
    if ckpt.exists():
        step, params, opt_state = _restore(ckpt, params, opt_state, digest)
        log(f"[teacher] resuming at step {step} of {recipe.steps} from {ckpt}")

    def loss_fn(p, ids):
        m = nnx.merge(graphdef, p, rest)
        logits = m(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    @jax.jit
    def train_step(p, o, ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    data = TeacherData(recipe, tokenizer, train_texts)
    start_step, t0, losses = step, None, []
    with open(workdir / "train_log.jsonl", "a") as logfile:
        while step < recipe.steps:
            ids = jnp.asarray(data.batch(step))
            params, opt_state, loss = train_step(params, opt_state, ids)
            step += 1
            if t0 is None:  # the first step compiles: the throughput counts from the second
                jax.block_until_ready(loss)
                t0, cpu0, first = time.perf_counter(), time.process_time(), step
            losses.append(float(loss))
            if step % recipe.checkpoint_every == 0 or step == recipe.steps:
                _save(ckpt, step, params, opt_state, digest)
                mean = sum(losses) / len(losses)
                logfile.write(json.dumps({"step": step, "loss": mean, "time": time.time()}) + "\n")
                logfile.flush()
                log(f"[teacher] step {step}/{recipe.steps}: loss {mean:.3f}")
                losses = []
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    cpu = time.process_time() - cpu0 if t0 is not None else 0.0
    timed = step - first if t0 is not None else 0
    tokens = timed * recipe.batch_size * recipe.seq_len
    save_hf_folder(nnx.merge(graphdef, params, rest), tokenizer, workdir / "hf")
    return {
        "steps": step - start_step,
        "timed_steps": timed,
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 and timed else None,
        # CPU seconds of this process over the timed steps: on a shared machine the wall-clock rate understates
        # what the machine alone does; tokens per CPU second x cores bounds it from above
        "cpu_seconds": round(cpu, 1),
        "tokens_per_cpu_second": round(tokens / cpu, 1) if cpu > 0 and timed else None,
    }


def ablated_teacher(folder: Path, groups: list[tuple[int, int]]):
    """The teacher of ``folder`` with the KV groups ``groups`` [(layer, group)] zero-ablated: their query heads'
    attention outputs contribute nothing (their input columns of o_proj are zero), every other weight as trained."""
    from flax import nnx

    from hydrahead_jax.models import Transformer
    from hydrahead_jax.models.loaders import read_hf_folder
    from hydrahead_jax.models.transformer import load_hf_weights

    cfg, tensors = read_hf_folder(folder)
    hd, per_group = cfg.head_dim, cfg.group_size
    for layer, group in groups:
        w = tensors[f"model.layers.{layer}.self_attn.o_proj.weight"]  # [hidden, heads * head_dim]
        w[:, group * per_group * hd : (group + 1) * per_group * hd] = 0.0
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    load_hf_weights(model, tensors, source=str(folder))
    return model


def extrapolate(tokens_per_second: float, recipe: TeacherRecipe) -> float:
    """Seconds the whole teacher training takes at the measured throughput."""
    return math.ceil(recipe.steps * recipe.batch_size * recipe.seq_len / tokens_per_second)

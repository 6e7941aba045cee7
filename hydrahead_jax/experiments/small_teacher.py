"""The reproduction's teacher: a small Llama-style decoder trained here, deterministically from a seed.

Vocabulary: a byte-level BPE (``data.tiny_tokenizer.train_bpe_tokenizer``) trained on the corpus's training
articles, plus the MQAR recall symbols (``data.mqar.MQARSymbols``) as whole tokens.

Training runs in phases; step s of any reads a batch that depends only on (seed, s), so a resumed run sees
exactly the batches an uninterrupted one would.

1. Recall curriculum (``recall``: a tuple of ``RecallStage``, each a phase): MQAR rows only, with a stage's batch
   size, row length and pair range (uniform per row), usually from many short rows with a few pairs to fewer long
   rows with many, as Zoology's training set mixes them. A model learning MQAR first predicts any value seen in
   context (answer accuracy 1/n at n pairs), and has the lookup only when its induction circuit forms; measured
   here, the mixture's 16 rows of 512 tokens did not leave 1/n in 320 steps (2.6M tokens) while rows of 64 tokens
   do within a few hundred steps. In Zoology's rows every key is asked once, so a model that only excludes the
   values already asked scores the mean of 1/n, 1/(n-1), ..., 1 (0.52 at 4 pairs) without any lookup: the
   product-shaped pilots sat at 0.49-0.52 on 4-pair rows and fell to 0.02 on 1-64 pairs. The learning rate warms
   up once, at the start, and stays at ``lr`` through the curriculum, so a new row shape continues at the rate
   the previous one trained at.

   Growth: a stage may train a shallower model (``RecallStage.num_layers``), grown when a deeper stage follows.
   Leaving the exclusion plateau costs a shallow model less: measured on 4-pair rows of 16 tokens (hidden 64,
   4 heads, AdamW 3e-3 without clipping, one seed each), 2 layers left it at ~11M tokens with 512 and with 128 rows
   per batch, while 8 layers still sat at 0.52 after 15M tokens, each token costing twice as much. Growth makes
   each layer i of the shallow model k consecutive layers i·k … i·k + k - 1 (``grow_layers``): the first a copy,
   the others copies whose output projections (o_proj, down_proj) are zero, so the grown model computes exactly
   the shallow one's function and its new layers start attending as their source layer does; AdamW's moments
   are copied with the layers. This places the circuit the shallow model found in layers 0, k, 2k, … (or, with
   ``grown_layer="last"``, in layers k - 1, 2k - 1, …: the copy that keeps the work is the block's last): the
   later stages train every layer, and where retrieval ends up is what the study's probe measures.
2. Mixture (``steps``; its learning rate decays from ``lr`` to lr/10 on a cosine, after a warm-up only when no
   curriculum precedes it): rows of ``seq_len`` tokens of three kinds, in fixed proportions:

   * MQAR sequences (``data.mqar``) with a pair count drawn uniformly from 1 … ``max_pairs``,
   * key-value needles inside text: the product's synthetic retrieval prompts (``data.synthetic``: NIAH with
     number and word needles, passkey, key-value retrieval) on a haystack of the training articles, followed by
     the answer,
   * windows of the training articles' token stream (documents joined by EOS).

The loss of a row is the mean next-token cross-entropy over its labelled positions, and the batch's loss the mean
over its rows. An MQAR row labels its answers only (the value after each queried key, as Zoology labels them: its
keys and fillers are random draws no model can predict); needle and text rows label every position. The trained
model is written as a Hugging Face folder (config.json, model.safetensors, tokenizer.json), so the product loads it
as any pretrained teacher (``teacher.source = <folder>``) and converts it with its own pipeline.

Resumable: a checkpoint (every parameter and AdamW moment, and the step) is written every ``checkpoint_every``
steps and at every phase's start (after a growth: the grown model) by a temporary file and a rename; a rerun
continues from it. A checkpoint of another recipe is refused.
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

MIXTURE = "mixture"  # the last phase of training (module doc); the recall stages are "recall 1", "recall 2", ...
KV_MIN_LENGTH = 256  # a JSON object of uuid pairs needs about this many tokens of this vocabulary for two pairs


@dataclasses.dataclass(frozen=True)
class RecallStage:
    """One stage of the recall curriculum (module doc): ``steps`` steps of ``batch_size`` MQAR rows of ``seq_len``
    tokens, each with a pair count drawn uniformly from ``pairs`` = (fewest, most), on a model of ``num_layers``
    layers (None: the recipe's; fewer: the model grows after the stage, module doc)."""

    steps: int
    batch_size: int
    seq_len: int
    pairs: tuple[int, int]
    num_layers: int | None = None

    def __post_init__(self):
        low, high = self.pairs
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"RecallStage {self}: steps and batch_size must be >= 1.")
        if not 1 <= low <= high:
            raise ValueError(f"RecallStage: pairs={self.pairs} must be (fewest, most) with 1 <= fewest <= most.")
        if self.seq_len < 4 * high:
            raise ValueError(f"RecallStage: seq_len={self.seq_len} < 4 x {high} pairs (the most of pairs).")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"RecallStage: num_layers={self.num_layers} must be >= 1 (or None: the recipe's).")

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class TeacherRecipe:
    """Shape, vocabulary, data mix and optimiser of the small teacher (the defaults: the study's teacher)."""

    seed: int = 0
    vocab_size: int = 2048  # BPE merges + bytes, before the recall symbols are added
    symbols: MQARSymbols = MQARSymbols()
    # 8 layers x 4 KV groups: 7:1 = 4 FA groups = one whole layer, 3:1 = 8 groups = two whole layers, exact both ways
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 16
    seq_len: int = 512
    batch_size: int = 16
    # The mixture's steps, after the curriculum: with them this recipe trained in 2,494 s (41.6 of the 45 minutes;
    # the 2-core machine alone): the curriculum 1,280 s, the mixture 1,196 s (2.0 s per step of 16 x 512 tokens).
    steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    # Global-norm gradient clipping (None: none). Measured on the 2-layer model of this shape, 512 rows of 16 tokens,
    # 4 pairs, one seed each: with the clip at 1.0 it sat on the exclusion plateau (module doc) through 17.9M
    # tokens; without it, it left the plateau at ~12M tokens and reached 0.90 answer accuracy at 14.3M.
    grad_clip: float | None = None
    mqar_fraction: float = 0.5
    needle_fraction: float = 0.25  # the rest of each batch: text windows
    max_pairs: int = 64
    # The recall curriculum (module doc), in order. Its step counts come from a pilot of this shape (one seed, its
    # own data order; stages advanced when the 20-step mean answer accuracy passed 0.9): 2 layers on 4-pair rows of
    # 16 tokens left the exclusion plateau and passed 0.9 at step 6,312 (12.9M tokens; 8,000 leaves a margin for
    # another data order); grown to 8 layers, rows of 64 tokens with 4-16 pairs passed 0.9 in 419 steps, rows of 256
    # with 8-64 in 285 (its MQAR-64 recall then 0.87 at 256 tokens and 0.72 at 512).
    recall: tuple[RecallStage, ...] = (
        RecallStage(steps=8000, batch_size=128, seq_len=16, pairs=(4, 4), num_layers=2),
        RecallStage(steps=500, batch_size=128, seq_len=64, pairs=(4, 16)),
        RecallStage(steps=400, batch_size=32, seq_len=256, pairs=(8, 64)),
    )
    # The output projection's initial std as a multiple of 1/sqrt(hidden_size) (None: the Transformer's N(0, 0.02),
    # HF Llama's init, made for pretrained weights that overwrite it). MQAR's answer is a copy of an in-context
    # token, and the copy's logit grows through this matrix: at hidden 64, N(0, 1/64) instead of N(0, 0.02) brought
    # 8 layers on the same batches to answer accuracy 0.12 vs 0.005 at step 50, and 0.23 vs 0.15 at step 100.
    lm_head_init_scale: float | None = 1.0
    checkpoint_every: int = 100
    # Which copy of a grown layer keeps its output projections ("first" or "last" of its block, ``grow_layers``):
    # where the shallow model's circuit sits in the grown one (layers 0, k, ... or k - 1, 2k - 1, ...).
    grown_layer: str = "first"

    def __post_init__(self):
        if self.grown_layer not in ("first", "last"):
            raise ValueError(f"TeacherRecipe: grown_layer={self.grown_layer!r} must be 'first' or 'last'.")
        if not 0 <= self.mqar_fraction + self.needle_fraction <= 1:
            raise ValueError("TeacherRecipe: mqar_fraction + needle_fraction must lie in [0, 1].")
        if self.seq_len < 4 * self.max_pairs:
            raise ValueError(f"TeacherRecipe: seq_len={self.seq_len} < 4 x max_pairs={self.max_pairs} (MQAR shape).")
        depths = [self.depth_at(start) for _, start in self.phases]
        for shallow, deep in zip(depths, depths[1:]):
            if deep < shallow or deep % shallow:
                raise ValueError(
                    f"TeacherRecipe: the recall stages' depths {depths[:-1]} then the mixture's {self.num_layers} must "
                    "each divide the next (the model only grows, each layer into a whole number of layers)."
                )

    @property
    def recall_steps(self) -> int:
        return sum(stage.steps for stage in self.recall)

    @property
    def total_steps(self) -> int:
        return self.recall_steps + self.steps

    @property
    def phases(self) -> list[tuple[str, int]]:
        """(name, first step) of each phase, in order."""
        names = [f"recall {i + 1}" for i in range(len(self.recall))] + [MIXTURE]
        starts = np.cumsum([0] + [stage.steps for stage in self.recall]).tolist()
        return list(zip(names, starts, strict=True))

    @property
    def phase_tokens(self) -> dict[str, int]:
        """Tokens each phase trains on."""
        tokens = {f"recall {i + 1}": stage.tokens for i, stage in enumerate(self.recall)}
        return {**tokens, MIXTURE: self.steps * self.batch_size * self.seq_len}

    def phase_of(self, step: int) -> str:
        return next(name for name, start in reversed(self.phases) if step >= start)

    def recall_stage(self, step: int) -> RecallStage | None:
        """The curriculum stage step ``step`` trains in (None in the mixture)."""
        for stage in self.recall:
            if step < stage.steps:
                return stage
            step -= stage.steps
        return None

    def depth_at(self, step: int) -> int:
        """The model's number of layers at step ``step``."""
        stage = self.recall_stage(step)
        return self.num_layers if stage is None or stage.num_layers is None else stage.num_layers

    def model_config(self, vocab_rows: int, num_layers: int | None = None) -> ModelConfig:
        """The teacher's model config; ``num_layers`` overrides the depth (a curriculum stage's before growth)."""
        return ModelConfig(
            vocab_size=vocab_rows,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers if num_layers is None else num_layers,
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
        from hydrahead_jax.data.protocol import encode_documents
        from hydrahead_jax.data.synthetic import Haystack

        self.recipe, self.tokenizer = recipe, tokenizer
        self.symbols = recipe.symbols.ids(tokenizer)
        eos = tokenizer.eos_id
        stream = []
        for ids in encode_documents(tokenizer, train_texts):
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

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s rows and loss weights (module doc): ids int32 [rows, length] and weights float32
        [rows, length - 1], weight t labelling the prediction of ids[:, t + 1]."""
        r = self.recipe
        rng = np.random.default_rng([r.seed, step])
        stage = r.recall_stage(step)
        if stage is not None:
            (low, high), length = stage.pairs, stage.seq_len
            mqar, needle, text = stage.batch_size, 0, 0
        else:
            (mqar, needle, text), length = r.rows(), r.seq_len
            low, high = 1, r.max_pairs
        rows, weights = [], np.zeros((mqar + needle + text, length - 1), np.float32)
        for i in range(mqar):
            ex = mqar_example(rng, self.symbols, num_pairs=int(rng.integers(low, high + 1)), length=length)
            rows.append(ex.ids)
            weights[i, ex.query_positions] = 1.0
        for i in range(needle):
            rows.append(self.needle_row(rng, seed=int(step * r.batch_size + i)))
        starts = rng.integers(0, len(self.stream) - length, size=text)
        rows.extend(self.stream[s : s + length] for s in starts)
        weights[mqar:] = 1.0
        return np.stack(rows).astype(np.int32), weights


# ------------------------------------------------------------------------------------------------ training


def learning_rate(recipe: TeacherRecipe):
    """The learning rate by step (module doc): a linear warm-up to ``lr`` over ``warmup_steps`` from step 0, ``lr``
    through the recall curriculum, then a cosine decay to lr/10 over the mixture."""
    import optax

    peak, warmup = recipe.lr, recipe.warmup_steps
    if not recipe.recall:
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, max(1, min(warmup, recipe.steps - 1)), max(2, recipe.steps), peak * 0.1
        )
    warmup = max(1, min(warmup, recipe.recall_steps))
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak, warmup),
            optax.constant_schedule(peak),
            optax.cosine_decay_schedule(peak, max(1, recipe.steps), alpha=0.1),
        ],
        [warmup, recipe.recall_steps],
    )


def _optimizer(recipe: TeacherRecipe):
    import optax

    adamw = optax.adamw(learning_rate(recipe), weight_decay=recipe.weight_decay)
    return adamw if recipe.grad_clip is None else optax.chain(optax.clip_by_global_norm(recipe.grad_clip), adamw)


def _save(path: Path, step: int, params, opt_state, digest: str) -> None:
    import jax

    leaves = jax.tree.leaves((params, opt_state))
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(
        tmp, step=np.int64(step), digest=np.asarray(digest), **{f"l{i}": np.asarray(x) for i, x in enumerate(leaves)}
    )
    tmp.replace(path)


def _saved_step(path: Path) -> int:
    with np.load(path) as data:
        return int(data["step"])


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


def init_teacher(recipe: TeacherRecipe, vocab_rows: int, num_layers: int | None = None):
    """The untrained teacher as (graphdef, params, rest), from ``recipe.seed``, with ``num_layers`` layers (None:
    the recipe's); its output projection drawn from N(0, (lm_head_init_scale / sqrt(hidden_size))^2) when the recipe
    sets that scale."""
    import jax
    from flax import nnx

    from hydrahead_jax.models import Transformer

    cfg = recipe.model_config(vocab_rows, num_layers)
    graphdef, params, rest = nnx.split(Transformer(cfg, rngs=nnx.Rngs(recipe.seed)), nnx.Param, ...)
    if recipe.lm_head_init_scale is not None:
        if cfg.tie_word_embeddings:
            raise ValueError("TeacherRecipe.lm_head_init_scale needs an untied output projection.")
        kernel = params["lm_head"]["kernel"]
        std = recipe.lm_head_init_scale / math.sqrt(cfg.hidden_size)
        kernel[...] = std * jax.random.normal(jax.random.key(recipe.seed + 1), kernel.shape, kernel.dtype)
    return graphdef, params, rest


# the projections that write a layer's output into the residual stream: zero in a grown layer that starts as identity
OUTPUT_PROJECTIONS = ("o_proj", "down_proj")


def grow_layers(tree, factor: int, *, zero_outputs: bool, keep: int = 0):
    """Each layer of the stacked layers in ``tree`` (parameters, or an optimiser state holding their moments)
    becomes ``factor`` consecutive layers: layer i -> layers i·factor … i·factor + factor - 1, copies of it. With
    ``zero_outputs`` (parameters) every copy but copy ``keep`` of each block has zero output projections, so it
    adds nothing to the residual stream (a pre-norm layer with zero o_proj and down_proj is the identity) and the
    grown model computes exactly the function of the original: copy ``keep`` does the layer's work, the others
    start as identity maps that already attend as the layer does. Moments are copied whole: a new layer's first
    updates are scaled by its source layer's gradient statistics."""
    import jax
    import jax.numpy as jnp

    def grow(path, leaf):
        name = jax.tree_util.keystr(path)
        if "['layers']" not in name:
            return leaf
        grown = jnp.repeat(leaf, factor, axis=0)
        if zero_outputs and any(f"['{proj}']" in name for proj in OUTPUT_PROJECTIONS):
            kept = (jnp.arange(grown.shape[0]) % factor == keep).reshape((-1,) + (1,) * (grown.ndim - 1))
            grown = jnp.where(kept, grown, jnp.zeros_like(grown))
        return grown

    return jax.tree_util.tree_map_with_path(grow, tree)


def weighted_loss(logits, targets, weights):
    """The batch's loss (module doc): with c[r, t] the cross-entropy of targets[r, t] under logits[r, t] and w the
    weights, loss = mean_r (sum_t w[r, t] c[r, t] / sum_t w[r, t]); and the argmax accuracy over the MQAR answers
    (the positions of rows labelled at some but not every position)."""
    import jax.numpy as jnp
    import optax

    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    labelled = weights.sum(-1)
    loss = ((ce * weights).sum(-1) / labelled).mean()
    answers = weights * (labelled < weights.shape[-1])[:, None]
    hits = ((logits.argmax(-1) == targets) * answers).sum()
    return loss, hits / jnp.maximum(answers.sum(), 1.0)


def answer_positions(weights: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The labelled positions of each row of ``weights`` [rows, T] as (positions int32 [rows, slots], mask float32
    [rows, slots]), padded with position 0 under mask 0."""
    positions = np.zeros((len(weights), slots), np.int32)
    mask = np.zeros((len(weights), slots), np.float32)
    for row, w in enumerate(weights):
        (labelled,) = np.nonzero(w)
        if len(labelled) > slots:
            raise ValueError(f"row {row} has {len(labelled)} labelled positions, more than the {slots} slots.")
        positions[row, : len(labelled)] = labelled
        mask[row, : len(labelled)] = w[labelled]
    return positions, mask


def answer_loss(model, ids, positions, mask):
    """``weighted_loss`` of rows labelled only at ``positions`` (``answer_positions``), with the output projection
    applied at those positions alone: the recall stages' rows label a few answers each, and projecting every other
    position onto the vocabulary would be work for no loss."""
    import jax.numpy as jnp

    hidden, _ = model.hidden_states(ids[:, :-1])
    logits = model.logits_from_hidden(jnp.take_along_axis(hidden, positions[:, :, None], axis=1))
    targets = jnp.take_along_axis(ids[:, 1:], positions, axis=1)
    # weighted_loss's accuracy skips rows labelled at every position (text); here a row may fill all its slots
    loss, _ = weighted_loss(logits, targets, mask)
    hits = ((logits.argmax(-1) == targets) * mask).sum()
    return loss, hits / jnp.maximum(mask.sum(), 1.0)


def train_teacher(recipe: TeacherRecipe, tokenizer, train_texts: list[str], workdir: Path, *, log=print) -> dict:
    """Train (or continue training) the teacher in ``workdir`` (train.npz, train_log.jsonl) and export it to
    ``workdir/hf``; returns this call's steps and, per phase, over its timed steps (all but the first of each
    phase, which compiles) the tokens, wall and CPU seconds and both rates."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from hydrahead_jax.models.loaders import save_hf_folder

    workdir.mkdir(parents=True, exist_ok=True)
    tx = _optimizer(recipe)
    digest = json.dumps(recipe.to_dict(), sort_keys=True, default=str) + f"|vocab={tokenizer.vocab_size}"
    ckpt = workdir / "train.npz"
    step = _saved_step(ckpt) if ckpt.exists() else 0
    depth = recipe.depth_at(step)  # a checkpoint holds the model as the step after it trains it: grown already
    graphdef, params, rest = init_teacher(recipe, tokenizer.vocab_size, depth)
    opt_state = tx.init(params)
    if ckpt.exists():
        step, params, opt_state = _restore(ckpt, params, opt_state, digest)
        log(f"[teacher] resuming at step {step} of {recipe.total_steps} from {ckpt}")

    def train_steps(graphdef, rest):
        """The jitted update of each kind of batch, for the model of this graph (one per depth)."""

        def mixture_loss(p, ids, weights):
            return weighted_loss(nnx.merge(graphdef, p, rest)(ids[:, :-1]), ids[:, 1:], weights)

        def recall_loss(p, ids, positions, mask):
            return answer_loss(nnx.merge(graphdef, p, rest), ids, positions, mask)

        def update(loss_fn):
            @jax.jit
            def train_step(p, o, *batch):
                (loss, recall), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, *batch)
                updates, o = tx.update(grads, o, p)
                return optax.apply_updates(p, updates), o, loss, recall

            return train_step

        return update(mixture_loss), update(recall_loss)

    mixture_step, recall_step = train_steps(graphdef, rest)

    data = TeacherData(recipe, tokenizer, train_texts)
    start_step, losses, recalls = step, [], []
    since, since_tokens = time.perf_counter(), 0  # the throughput of the steps since the last log line
    starts = {start for _, start in recipe.phases} | {recipe.total_steps}  # each phase's first step, and the end
    timing = {}  # phase -> [steps, tokens, wall seconds, CPU seconds] over its timed steps
    with open(workdir / "train_log.jsonl", "a") as logfile:
        while step < recipe.total_steps:
            phase = recipe.phase_of(step)
            first_of_shape = step == start_step or step in starts  # compiles: not timed
            t0, cpu0 = time.perf_counter(), time.process_time()
            ids, weights = data.batch(step)
            stage = recipe.recall_stage(step)
            if stage is None:
                params, opt_state, loss, recall = mixture_step(
                    params, opt_state, jnp.asarray(ids), jnp.asarray(weights)
                )
            else:
                positions, mask = answer_positions(weights, stage.pairs[1])
                params, opt_state, loss, recall = recall_step(
                    params, opt_state, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)
                )
            since_tokens += ids.size
            losses.append(float(loss))
            recalls.append(float(recall))
            if not first_of_shape:
                t = timing.setdefault(phase, [0, 0, 0.0, 0.0])
                t[0] += 1
                t[1] += ids.size
                t[2] += time.perf_counter() - t0
                t[3] += time.process_time() - cpu0
            step += 1
            if step < recipe.total_steps and recipe.depth_at(step) > depth:
                factor, depth = recipe.depth_at(step) // depth, recipe.depth_at(step)
                graphdef, _, rest = init_teacher(recipe, tokenizer.vocab_size, depth)
                keep = 0 if recipe.grown_layer == "first" else factor - 1
                params = grow_layers(params, factor, zero_outputs=True, keep=keep)
                opt_state = grow_layers(opt_state, factor, zero_outputs=False)
                mixture_step, recall_step = train_steps(graphdef, rest)
                log(f"[teacher] grown to {depth} layers at step {step} (each layer into {factor})")
            if step % recipe.checkpoint_every == 0 or step in starts:
                _save(ckpt, step, params, opt_state, digest)
                loss_mean, recall_mean = sum(losses) / len(losses), sum(recalls) / len(recalls)
                entry = {"step": step, "phase": phase, "loss": loss_mean, "answer_accuracy": recall_mean}
                logfile.write(json.dumps({**entry, "time": time.time()}) + "\n")
                logfile.flush()
                log(
                    f"[teacher] step {step}/{recipe.total_steps} ({phase}): loss {loss_mean:.3f}, MQAR answer "
                    f"accuracy {recall_mean:.3f}, {since_tokens / (time.perf_counter() - since):,.0f} tokens/s"
                )
                losses, recalls = [], []
                since, since_tokens = time.perf_counter(), 0
    save_hf_folder(nnx.merge(graphdef, params, rest), tokenizer, workdir / "hf")
    phases = {
        name: {
            "timed_steps": n,
            "tokens": tokens,
            "seconds": round(seconds, 1),
            "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None,
            # CPU seconds of this process: on a shared machine the wall-clock rate understates what the machine
            # alone does; tokens per CPU second x cores bounds it from above
            "cpu_seconds": round(cpu, 1),
            "tokens_per_cpu_second": round(tokens / cpu, 1) if cpu > 0 else None,
        }
        for name, (n, tokens, seconds, cpu) in timing.items()
    }
    return {"steps": step - start_step, "timed_steps": sum(p["timed_steps"] for p in phases.values()), "phases": phases}


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


def extrapolate(rates: dict[str, float], recipe: TeacherRecipe) -> int:
    """Seconds to train ``recipe`` from scratch: each phase's tokens at that phase's rate (tokens/s)."""
    return math.ceil(sum(tokens / rates[phase] for phase, tokens in recipe.phase_tokens.items() if tokens))

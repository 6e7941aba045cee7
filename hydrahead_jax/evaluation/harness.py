"""EleutherAI's lm-evaluation-harness on our models, in-process: ``HydraHeadLM``, an ``lm_eval`` model backend.

    from hydrahead_jax.evaluation.harness import HydraHeadLM
    lm = HydraHeadLM(model="runs/x/final")            # any eval.py --model spec: teacher:smollm2-135m, a .gguf …
    results = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

It answers lm-eval's three request types as its ``hf`` backend (``HFLM``) does, so the numbers of a model are
comparable with those of a transformers model (tests/test_lm_eval_harness.py checks it against ``hf`` itself):

* ``loglikelihood(context, continuation)``: Σ log p(continuation tokens | context) and whether every one of them
  is the greedy pick. Tokens as ``HFLM``: the context is a document start (``encode_document``: the tokenizer's
  BOS where it adds one, Llama 3's; none for SmolLM2 and Qwen), the continuation's tokens are those of the whole
  text past the context's, an empty context is ``prefix_token_id`` (BOS, else EOS), and a row longer than
  ``max_length`` + 1 tokens loses its oldest tokens.
* ``loglikelihood_rolling(text)``: log p(text) scored in lm-eval's rolling windows of ``max_length`` tokens (the
  first conditioned on ``prefix_token_id``, every later one on the tokens before it; each token predicted once).
* ``generate_until(context, {until, max_gen_toks, …})``: greedy decoding through the model's decode cache
  (``models.generate.greedy_continuations``) until EOS, a stop string or ``max_gen_toks`` tokens; the text is
  cut at the first stop string. The context keeps its last ``max_length`` − ``max_gen_toks`` tokens.

Compiled programs. A scoring call runs rows right-padded to a length bucket (a power of two, at least
``MIN_BUCKET``, at most ``max_length``) with ``batch_tokens`` / bucket rows, padding rows added (a causal model's
scores at t do not read the padding after t); generation prefills a batch's first ``bucket_below(shortest prompt)``
tokens, feeds the rest of each prompt one token per decode step, and sizes the cache to a bucket. A task
therefore compiles one scoring program per bucket its requests reach and one prefill and one decode step per
(rows, prefill bucket, cache bucket), whatever the number of requests: ``programs`` lists them.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm

from hydrahead_jax.data.protocol import encode_document
from hydrahead_jax.evaluation.models import EvalModel, load_model
from hydrahead_jax.models.generate import greedy_continuations

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # shortest scoring row: shorter requests share its program


class HarnessError(ValueError):
    """A request or setting HydraHeadLM cannot serve; the message names the fix."""


def bucket(n: int, *, cap: int | None = None) -> int:
    """The scoring length of a row of n tokens: the smallest power of two >= max(n, MIN_BUCKET), or ``cap`` (the
    model's max length) where that power would pass it."""
    size = max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())
    return min(size, cap) if cap is not None and n <= cap else size


def bucket_below(n: int) -> int:
    """The largest power of two <= n (n >= 1): the prefill length of prompts of at least n tokens."""
    return 1 << (n.bit_length() - 1)


@functools.partial(jax.jit, static_argnums=(0,))
def _score(graphdef, state, ids: jax.Array, targets: jax.Array, scored: jax.Array):
    """For rows ``ids`` [B, T] and their next tokens ``targets`` [B, T]: Σ_t scored_t · log p(targets_t | ids_≤t)
    [B] (log p = logit − logsumexp over the vocabulary, float32) and whether argmax_v logits_t = targets_t at every
    scored t [B]."""
    logits = nnx.merge(graphdef, state)(ids)
    logp = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0] - jax.nn.logsumexp(logits, -1)
    greedy = (jnp.argmax(logits, -1) == targets) | ~scored
    return jnp.sum(jnp.where(scored, logp, 0.0), -1), jnp.all(greedy, -1)


@register_model("hydrahead")
class HydraHeadLM(TemplateLM):
    """An lm-eval model backend over one of our models (see the module doc).

    ``model``: an eval.py ``--model`` spec (``teacher:smollm2-135m``, an export folder ``runs/x/final``, a Hugging
    Face folder or ``.gguf``) or an already loaded ``EvalModel``. ``max_length``: the longest row scored and the
    rolling window (default the model config's ``max_position_embeddings``, as ``HFLM`` reads it).
    ``batch_tokens``: tokens per scoring call (rows = batch_tokens / bucket). ``batch_size``: prompts decoded
    together. lm-eval's ``device`` and ``max_batch_size`` are accepted and unused (JAX places the model)."""

    def __init__(
        self,
        model: str | EvalModel,
        *,
        max_length: int | None = None,
        batch_tokens: int = 2048,
        batch_size: int | str = 8,
        max_gen_toks: int = 256,
        device: str | None = None,
        max_batch_size: int | None = None,
    ):
        super().__init__()
        self.evaluated = load_model(model) if isinstance(model, str) else model
        self.tokenizer = self.evaluated.tokenizer
        if self.tokenizer.eos_id is None:
            raise HarnessError(f"{self.evaluated.name}: its tokenizer has no EOS id, which lm-eval needs as EOT.")
        self._max_length = int(max_length or self.evaluated.model.cfg.max_position_embeddings)
        self.batch_tokens = bucket_below(max(int(batch_tokens), 1))
        self.batch_size = bucket_below(int(batch_size)) if str(batch_size).isdigit() else 8  # "auto": the default
        self._max_gen_toks = int(max_gen_toks)
        self.graphdef, self.state = nnx.split(self.evaluated.model)
        self.programs: set[tuple] = set()  # (kind, shapes…) of every compiled program this backend ran

    # ---------------------------------------------------------------------------------------- lm-eval's interface

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS where the tokenizer has one, else EOS (as ``HFLM``)."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        """A document start (``encode_document``) unless told otherwise or the text already starts with the
        prefix token's text; ``add_special_tokens=False``: the plain tokens."""
        if add_special_tokens is None:
            add_special_tokens = not has_bos_prefix(string, self.tok_decode([self.prefix_token_id], False))
        return encode_document(self.tokenizer, string) if add_special_tokens else self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        """(Σ log p(continuation), all greedy) of each (key, context ids, continuation ids), in request order."""
        rows = [self._row(context, continuation) for _, context, continuation in requests]
        results = self._score_rows(rows, disable_tqdm)
        for (key, _, _), answer in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of each request, summed over lm-eval's rolling windows of ``max_length`` tokens."""
        windows, owner = [], []
        for index, (text,) in enumerate(r.args for r in requests):
            ids = self.tok_encode(text)
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1),
            ):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[index] += logp
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, batched by generation settings and sorted by prompt length."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(index)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until (hydrahead)")
        for indices in groups.values():
            gen_kwargs = requests[indices[0]].args[1]
            contexts = [requests[i].args[0] for i in indices]
            for index, text in zip(indices, self._generate(contexts, gen_kwargs), strict=True):
                out[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
                bar.update(1)
        bar.close()
        return out

    # ----------------------------------------------------------------------------------------------- scoring

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        """(the tokens fed plus the last one, the number of scored tokens at its end): the row's last
        ``max_length`` + 1 tokens, as ``HFLM`` truncates it."""
        if not context or not continuation:
            raise HarnessError("a loglikelihood request needs at least one context and one continuation token.")
        tokens = (context + continuation)[-(self.max_length + 1) :]
        return tokens, min(len(continuation), len(tokens) - 1)

    def _score_rows(self, rows: list[tuple[list[int], int]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """Score rows grouped by length bucket, longest first, ``batch_tokens`` / bucket rows per call."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        bar = tqdm(total=len(rows), disable=disable_tqdm, desc="loglikelihood (hydrahead)")
        by_bucket: dict[int, list[int]] = defaultdict(list)
        for i in order:
            by_bucket[bucket(len(rows[i][0]) - 1, cap=self.max_length)].append(i)
        for length, members in by_bucket.items():
            per_call = max(1, self.batch_tokens // length)
            for start in range(0, len(members), per_call):
                chunk = members[start : start + per_call]
                logp, greedy = self._score_chunk([rows[i] for i in chunk], per_call, length)
                for j, i in enumerate(chunk):
                    results[i] = (float(logp[j]), bool(greedy[j]))
                bar.update(len(chunk))
        bar.close()
        return results

    def _score_chunk(self, rows, batch: int, length: int):
        """One compiled scoring call on ``rows`` right-padded to [batch, length] (padding: token 0, not scored)."""
        ids = np.zeros((batch, length), np.int32)
        targets = np.zeros((batch, length), np.int32)
        scored = np.zeros((batch, length), bool)
        for j, (tokens, n_scored) in enumerate(rows):
            n = len(tokens) - 1
            ids[j, :n], targets[j, :n] = tokens[:-1], tokens[1:]
            scored[j, n - n_scored : n] = True
        self.programs.add(("score", batch, length))
        logp, greedy = _score(self.graphdef, self.state, ids, targets, scored)
        return np.asarray(logp), np.asarray(greedy)

    # -------------------------------------------------------------------------------------------- generation

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        """The generations of ``contexts`` under one set of lm-eval generation kwargs."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
            raise HarnessError(
                f"HydraHeadLM decodes greedily; this task asks for sampling ({gen_kwargs}). Pass "
                "gen_kwargs='do_sample=False' (or temperature=0) to lm-eval."
            )
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise HarnessError(f"max_gen_toks={max_new} leaves no room for a prompt in max_length={self.max_length}.")
        prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] or [self.prefix_token_id] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts: list[str | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, tokens in zip(chunk, self._continue([prompts[i] for i in chunk], max_new, until), strict=True):
                texts[i] = postprocess_generated_text(self.tok_decode(tokens), until, None)
        return texts

    def _continue(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[list[int]]:
        """Greedy token continuations of one batch; rows padded to a power of two (copies of the last prompt)."""
        rows = 1 << (len(prompts) - 1).bit_length()
        batch = prompts + [prompts[-1]] * (rows - len(prompts))
        prefill = bucket_below(min(len(p) for p in batch))
        cache = bucket(max(len(p) for p in batch) + max_new)
        self.programs.update({("prefill", rows, prefill, cache), ("decode", rows, cache)})
        stops = [s for s in until if s]
        stop: Callable[[int, list[int]], bool] = lambda _, tokens: any(s in self.tok_decode(tokens) for s in stops)  # noqa: E731
        out = greedy_continuations(
            self.evaluated.model,
            batch,
            max_new,
            prefill_length=prefill,
            cache_length=cache,
            eos_id=self.eot_token_id,
            stop=stop,
        )
        return out[: len(prompts)]


# ------------------------------------------------------------------------------------------- eval.py --suite lm-eval


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's TaskManager for ``tasks``: over this package's tasks (``news_tasks.TASKS_DIR``) and
    ``include_path`` alone when they hold every one of them (indexing lm-eval's own ~15k task files takes ~25 s on
    2 cores), else over lm-eval's too. An unknown task is a HarnessError."""
    from lm_eval.tasks import TaskManager

    from hydrahead_jax.evaluation.news_tasks import TASKS_DIR

    paths = [str(TASKS_DIR)] + ([include_path] if include_path is not None else [])
    manager = TaskManager(include_path=paths, include_defaults=False)
    if len(manager.match_tasks(tasks)) < len(tasks):
        manager = TaskManager(include_path=paths)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known and not manager.match_tasks([t])]
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else " (local tasks: --include-path DIR)"
        raise HarnessError(f"lm-eval knows no task {', '.join(unknown)} among its own or ours{where}.")
    return manager


def evaluate(lm: HydraHeadLM, tasks: list[str], *, manager=None, limit: float | None = None, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` of ``lm`` on ``tasks`` (``kwargs`` passed on; no bootstrap by default)."""
    import lm_eval

    kwargs.setdefault("bootstrap_iters", 0)
    kwargs.setdefault("log_samples", False)
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, **kwargs)


def write_results(results: dict, out: Path, name: str) -> Path:
    """lm-eval's results JSON of one model, as lm-eval's CLI serialises it, at ``out/lm_eval/<name>.json``."""
    from lm_eval.utils import handle_non_serializable

    folder = Path(out) / "lm_eval"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('/', '_').replace(':', '_')}.json"
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return path


def run_suite(models: list[EvalModel], tasks: list[str], out, *, include_path=None, limit=None, manager=None) -> dict:
    """eval.py's ``--suite lm-eval``: every model on ``tasks``, each one's results JSON written by
    ``write_results`` (with ``hydrahead_programs``: the programs it compiled) and lm-eval's tables of all of them
    in ``out/lm_eval.md``. Returns {model name: its JSON's path}."""
    from lm_eval.utils import make_table

    manager = manager or task_manager(tasks, include_path)
    written, tables = {}, []
    for evaluated in models:
        lm = HydraHeadLM(evaluated)
        results = evaluate(lm, tasks, manager=manager, limit=limit)
        results["hydrahead_programs"] = sorted(lm.programs)
        written[evaluated.name] = write_results(results, out, evaluated.name)
        tables.append(f"## {evaluated.name}\n\n{make_table(results)}\n{len(lm.programs)} compiled programs\n")
    (Path(out) / "lm_eval.md").write_text("\n".join(tables), encoding="utf-8")
    return written

"""The evaluation suite: a plan of small units over (model, task, length), run under one progress bar.

Suite names: niah, passkey, multikey, multivalue, kv, vt (retrieval by greedy decoding through the decode
cache), ppl (held-out perplexity), agreement (top-1 and KL against the teacher), efficiency (cache bytes, prefill
and decode time, compiled memory); ``all`` = every one of them, ``demo`` = a short preset (see DEMO);
``ruler`` = the RULER tasks (``ruler:niah_single_1`` … ``ruler:fwe``, see ``evaluation.ruler``), at
``ruler_lengths`` with ``ruler_samples`` prompts per task and length.

With a journal (``suite.resume(suite.journal(out))``, as eval.py does) each finished unit is written to
``<out>/progress.jsonl`` (``evaluation.journal``): a rerun of the same command after a kill replays what was done
and runs the rest.

A unit that does not fit in memory (``runner.OutOfMemory``, checked from the compiled executable before
anything is allocated, or an allocation error) or whose prompt cannot be built at that length is recorded in
``skipped`` with the reason; the other units of the same (model, task, length) are skipped with it and the
suite goes on.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from hydrahead_jax.evaluation import ruler, tasks
from hydrahead_jax.evaluation.inputs import DEPTH_GRID_TASKS, RETRIEVAL_TASKS, Inputs, sample_depths, tokenizer_key
from hydrahead_jax.evaluation.journal import Journal, params_digest
from hydrahead_jax.evaluation.models import EvalModel
from hydrahead_jax.evaluation.runner import OutOfMemory, Runner

BASE_SUITES = (*RETRIEVAL_TASKS, "ppl", "agreement", "efficiency")
SUITES = (*BASE_SUITES, *ruler.SUITE_NAMES)
PRESETS = {
    "all": BASE_SUITES,
    "demo": ("niah", "passkey", "ppl", "agreement", "efficiency"),
    "ruler": ruler.SUITE_NAMES,
}


class SuiteError(ValueError):
    """Suite settings that cannot run; the message names the setting and the fix."""


def parse_suite(text: str | list[str]) -> tuple[str, ...]:
    """'niah,ppl' → ('niah', 'ppl'); presets expand; unknown names are an error listing the valid ones."""
    names = [n.strip() for part in ([text] if isinstance(text, str) else text) for n in part.split(",") if n.strip()]
    if not names:
        raise SuiteError("--suite is empty; give e.g. --suite niah,passkey,ppl,efficiency or --suite demo.")
    out: list[str] = []
    for n in names:
        if n in PRESETS:
            out.extend(PRESETS[n])
        elif n in SUITES:
            out.append(n)
        else:
            raise SuiteError(
                f"unknown suite {n!r}; choose from {', '.join(SUITES)} or the presets {', '.join(PRESETS)}."
            )
    return tuple(dict.fromkeys(out))


def parse_lengths(text: str) -> tuple[int, ...]:
    """'1k,2k,512' → (1024, 2048, 512); k = 1024."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise SuiteError(f"cannot read length {part!r}; write lengths like 512,1k,32k.") from None
        if value < 2:
            raise SuiteError(f"length {part!r} must be at least 2 tokens.")
        out.append(value)
    if not out:
        raise SuiteError("no lengths given; write e.g. --lengths 1k,2k,4k.")
    return tuple(out)


@dataclasses.dataclass
class Settings:
    """Everything that defines the suite's inputs; written into results.json."""

    suites: tuple[str, ...]
    retrieval_lengths: tuple[int, ...]
    ppl_lengths: tuple[int, ...]
    efficiency_lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 2  # prompts per retrieval cell (NIAH: per (length, depth))
    ppl_windows: int = 2  # windows per (source, length)
    # > 0: perplexity and agreement also for windows [0, window_split) and [window_split, ppl_windows) apart (the
    # demo's first 8 windows chose the recipe's settings; the rest never did)
    window_split: int = 0
    decode_steps: int = 8  # timed decode steps per efficiency point
    seed: int = 0
    needle_type: str = "number"
    memory_limit: int | None = None
    mesh_sequence: int = 1  # > 1: prefills split each prompt's tokens over this many devices (context parallelism)
    haystack: str | None = None
    ruler_lengths: tuple[int, ...] = ruler.LENGTHS
    ruler_samples: int = ruler.DEFAULT_SAMPLES  # prompts per (RULER task, length)
    texts: dict | None = None
    corpus: dict | None = None  # training corpus settings (source, validation_fraction, …) for the val split

    @classmethod
    def demo(cls, **overrides) -> Settings:
        """The `make demo` preset: NIAH (20 prompts per length) and passkey (10) at 512 and 1K, perplexity and
        agreement on 16 windows of 512 tokens per source, reported also as windows 0-7 and 8-15 apart,
        efficiency at 1–4K. `make demo-eval-full` is the same with 100 NIAH and 50 passkey prompts per length."""
        # NIAH at 2 depths × 10 seeds per length: an accuracy's Wilson 95 % interval is about ±20 points at 16-18
        # of 20 and [0.84, 1] at 20 of 20; on a 2-core CPU a prompt costs 2-6 s per model (on 2026-12-03 the
        # full demo's 300 per model took 1673 s for the streaming student and 1379 s for the teacher), so the
        # demo's share is a fifth of that. Sixteen 512-token windows per held-out source, so KL and top-1 get a
        # bootstrap interval over windows; the recipe comparisons chose their settings on windows 0-7, so windows
        # 8-15 are reported apart as text no choice saw. Three efficiency points.
        base = dict(
            suites=PRESETS["demo"],
            retrieval_lengths=(512, 1024),
            ppl_lengths=(512,),
            efficiency_lengths=(1024, 2048, 4096),
            depths=(0.1, 0.9),
            samples=10,
            ppl_windows=16,
            window_split=8,
            decode_steps=4,
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Unit:
    """One step of the progress bar; units sharing (model, task, source, length) are skipped together. ``index``
    tells the units of a cell apart (sample, depth or window) in the journal."""

    model: EvalModel
    task: str
    length: int
    run: Callable[[], None]
    source: str = ""
    index: tuple = ()

    @property
    def key(self) -> str:
        return "|".join(str(x) for x in (*self.cell, *self.index))

    @property
    def cell(self) -> tuple:
        return (self.model.name, self.task, self.source, self.length)


def eval_mesh(sequence: int):
    """None (one device, today's path) for ``sequence`` = 1; else a mesh of every device with tokens split over
    ``sequence`` of them (context-parallel prefill) and prompt rows over the rest (``data``)."""
    if sequence == 1:
        return None
    from hydrahead_jax.training.sharding import ShardingError, make_mesh

    try:
        return make_mesh(data=-1, sequence=sequence)
    except ShardingError as err:
        raise SuiteError(
            f"--mesh-sequence {sequence}: {err} Fix: a --mesh-sequence that divides the {jax.device_count()} devices."
        ) from None


class Suite:
    """Runs ``settings`` on ``models``; ``teacher`` (an EvalModel, optional) is the agreement reference when no
    model of kind "teacher" is among ``models``."""

    def __init__(self, models: list[EvalModel], settings: Settings, *, teacher: EvalModel | None = None):
        if not models:
            raise SuiteError("no models to evaluate; pass --model at least once.")
        self.models = models
        self.settings = settings
        self.inputs = Inputs(
            seed=settings.seed,
            haystack=settings.haystack,
            texts=settings.texts,
            needle_type=settings.needle_type,
            corpus=settings.corpus,
        )
        self.teacher = teacher or next((m for m in models if m.is_teacher), None)
        mesh = eval_mesh(settings.mesh_sequence)
        self.runners = {m.name: Runner(m.model, memory_limit=settings.memory_limit, mesh=mesh) for m in models}
        if self.teacher is not None and self.teacher.name not in self.runners:
            self.runners[self.teacher.name] = Runner(self.teacher.model, memory_limit=settings.memory_limit, mesh=mesh)
        self.samples: list[dict] = []
        self.ruler_samples: list[dict] = []
        self._ruler_inputs: dict = {}
        self.text_parts: dict = defaultdict(lambda: defaultdict(list))
        self.efficiency: list[dict] = []
        self.skipped: list[dict] = []
        self.notes: list[dict] = []
        self.seconds: dict = defaultdict(float)
        self._skip_keys: set = set()
        self._teacher_hidden: dict = {}
        self._journal: Journal | None = None
        self._done: set = set()  # keys of the units replayed from the journal

    # -- planning --------------------------------------------------------------------------------------

    def plan(self) -> list[Unit]:
        s, units = self.settings, []
        # ppl and agreement share each window's forward pass: one "text" unit per window does both, planned
        # where the first of them appears in the suite order
        first_text = next((t for t in s.suites if t in ("ppl", "agreement")), None)
        for m in self.models:
            for task in s.suites:
                if task in ruler.SUITE_NAMES:
                    for length in s.ruler_lengths:
                        for i in range(s.ruler_samples):
                            units.append(Unit(m, task, length, self._ruler_unit(m, task, length, i), index=(i,)))
                elif task in RETRIEVAL_TASKS:
                    for length in s.retrieval_lengths:
                        cells = (
                            [(d, i) for d in s.depths for i in range(s.samples)]
                            if task in DEPTH_GRID_TASKS
                            else list(zip(sample_depths(s.samples), range(s.samples)))
                        )
                        for depth, i in cells:
                            unit = self._retrieval_unit(m, task, length, i, depth)
                            units.append(Unit(m, task, length, unit, index=(i, depth)))
                elif task == first_text:
                    for source in self.inputs.source_names():
                        for length in s.ppl_lengths:
                            for w in range(s.ppl_windows):
                                unit = self._text_unit(m, source, length, w)
                                units.append(Unit(m, "text", length, unit, source, index=(w,)))
                elif task == "efficiency":
                    for length in s.efficiency_lengths:
                        units.append(Unit(m, task, length, self._efficiency_unit(m, length)))
        return units

    def prepare(self) -> Suite:
        """Build every input that could fail (haystacks, held-out text, the token store) before the suite starts,
        once per tokenizer; raises SuiteError naming the input."""
        s = self.settings
        for m in self.models:
            try:
                if any(t in RETRIEVAL_TASKS or t in ruler.SUITE_NAMES for t in s.suites):
                    self.inputs.haystack(m.tokenizer)
                if "ppl" in s.suites or "agreement" in s.suites:
                    for name in self.inputs.source_names():
                        self.inputs.stream(name, m.tokenizer)
            except (OSError, ValueError, KeyError) as err:
                raise SuiteError(
                    f"cannot prepare the evaluation inputs for {m.name}: {type(err).__name__}: {err}. "
                    "Fix: pass --haystack FILE / --text NAME=FILE, or make the default corpus "
                    "reachable."
                ) from err
        return self

    def journal(self, out: str | Path, *, per_run_folder: bool = False) -> Journal:
        """The journal of this suite's settings and models in ``out`` (their parameters digested once)."""
        models = [*self.models, *([self.teacher] if self.teacher and self.teacher not in self.models else [])]
        header = {
            "settings": self.settings.to_dict(),
            "models": [{"name": m.name, "spec": m.spec, "params": params_digest(m.model)} for m in models],
        }
        return Journal(out, header, per_run_folder=per_run_folder)

    def resume(self, journal: Journal) -> int:
        """Replay the units ``journal`` holds as finished (raises JournalError for another run's journal, before
        any work); they are skipped by ``run``, which journals every unit it finishes. Returns how many."""
        entries = journal.load()
        for e in entries:
            self._replay(e)
        self._journal = journal
        return len(entries)

    def run(self, progress: bool = True) -> Suite:
        self.prepare()
        units = self.plan()
        if self._journal is not None:
            self._journal.start()
        if self._done:
            print(
                f"resuming: {len(self._done)} of {len(units)} units done earlier ({self._journal.path})",
                file=sys.stderr,
            )
        bar = tqdm(units, desc="eval", unit="unit", disable=not progress, dynamic_ncols=True)
        for unit in bar:
            bar.set_postfix_str(f"{unit.model.name} {unit.task} {unit.source} {unit.length}".replace("  ", " "))
            if unit.cell in self._skip_keys or unit.key in self._done:
                continue
            before = self._sizes(unit)
            start = time.perf_counter()
            try:
                unit.run()
            except (OutOfMemory, _Unbuildable) as err:
                self._skip_keys.add(unit.cell)
                self.skipped.append(
                    {
                        "model": unit.model.name,
                        "task": unit.task,
                        "source": unit.source,
                        "length": unit.length,
                        "reason": str(err),
                    }
                )
            finally:
                seconds = time.perf_counter() - start
                self.seconds[(unit.model.name, unit.task)] += seconds
            if self._journal is not None:
                self._journal.append(self._entry(unit, before, seconds))
        return self

    # -- the journal's entries: what one unit added -----------------------------------------------------

    _RECORD_LISTS = ("samples", "ruler_samples", "efficiency", "skipped", "notes")
    _TEXT_DTYPES = {"window": np.int64, "nll": np.float64, "top1": bool, "kl": np.float64}

    def _sizes(self, unit: Unit) -> dict:
        sizes = {name: len(getattr(self, name)) for name in self._RECORD_LISTS}
        if unit.task == "text":
            cell = self.text_parts[(unit.model.name, unit.source, unit.length)]
            sizes["text"] = {k: len(cell[k]) for k in self._TEXT_DTYPES}
        return sizes

    def _entry(self, unit: Unit, before: dict, seconds: float) -> dict:
        entry = {"key": unit.key, "model": unit.model.name, "task": unit.task, "seconds": seconds}
        for name in self._RECORD_LISTS:
            added = getattr(self, name)[before[name] :]
            if added:
                entry[name] = added
        if "text" in before:
            cell = self.text_parts[(unit.model.name, unit.source, unit.length)]
            entry["text"] = {
                "cell": [unit.model.name, unit.source, unit.length],
                **{k: cell[k][before["text"][k] :] for k in self._TEXT_DTYPES},
            }
        if unit.cell in self._skip_keys:
            entry["skip_cell"] = list(unit.cell)
        return entry

    def _replay(self, e: dict) -> None:
        for name in self._RECORD_LISTS:
            getattr(self, name).extend(e.get(name, []))
        if "text" in e:
            model, source, length = e["text"]["cell"]
            cell = self.text_parts[(model, source, length)]
            for k, dtype in self._TEXT_DTYPES.items():
                values = e["text"][k]
                cell[k].extend(values if k == "window" else [np.asarray(v, dtype) for v in values])
        if "skip_cell" in e:
            self._skip_keys.add(tuple(e["skip_cell"]))
        self.seconds[(e["model"], e["task"])] += e["seconds"]
        self._done.add(e["key"])

    # -- units -----------------------------------------------------------------------------------------

    def _retrieval_unit(self, m: EvalModel, task: str, length: int, sample: int, depth: float):
        def run():
            try:
                example = self.inputs.example(task, m.tokenizer, length=length, sample=sample, depth=depth)
            except ValueError as err:  # e.g. the length cannot hold the task's fixed text
                raise _Unbuildable(f"no prompt at this length: {err}") from err
            rec = tasks.retrieval(self.runners[m.name], m.tokenizer, example)
            self.samples.append(
                {
                    "model": m.name,
                    "task": task,
                    "target_depth": depth,
                    "sample": sample,
                    "nominal_length": length,
                    **rec,
                }
            )

        return run

    def _ruler_unit(self, m: EvalModel, task: str, length: int, sample: int):
        """Sample ``sample`` of a RULER task: seed = settings.seed + sample, needle depth (i + ½)/n."""

        def run():
            key = tokenizer_key(m.tokenizer)
            if key not in self._ruler_inputs:
                self._ruler_inputs[key] = ruler.RulerInputs(m.tokenizer, self.inputs.haystack(m.tokenizer))
            name = task.removeprefix(ruler.SUITE_PREFIX)
            depth = sample_depths(self.settings.ruler_samples)[sample]
            try:
                ex = ruler.build(
                    name, self._ruler_inputs[key], length=length, seed=self.settings.seed + sample, depth=depth
                )
            except ValueError as err:
                raise _Unbuildable(f"no prompt at this length: {err}") from err
            gen = self.runners[m.name].generate(ex.prompt_ids[None], ex.max_new_tokens, eos_id=m.tokenizer.eos_id)
            ids = [int(t) for t in gen.tokens[0]]
            if m.tokenizer.eos_id is not None and m.tokenizer.eos_id in ids:
                ids = ids[: ids.index(m.tokenizer.eos_id)]
            prediction = m.tokenizer.decode(ids)
            self.ruler_samples.append(
                {
                    "model": m.name,
                    "task": name,
                    "nominal_length": length,
                    "length": int(len(ex.prompt_ids)),
                    "sample": sample,
                    "seed": ex.seed,
                    "depth": ex.depth,
                    "answers": ex.answers,
                    "prediction": prediction,
                    "score": ruler.score(prediction, ex),
                    "prefill_s": gen.prefill_s,
                }
            )

        return run

    def _teacher_states(self, source: str, length: int, window: int, ids: np.ndarray):
        key = (source, length, window)
        if key not in self._teacher_hidden:
            self._teacher_hidden[key] = self.runners[self.teacher.name].hidden_states(np.asarray(ids)[None])
        return self._teacher_hidden[key]

    def _text_unit(self, m: EvalModel, source: str, length: int, window: int):
        s = self.settings

        def run():
            windows, size = self.inputs.windows(source, m.tokenizer, length, s.ppl_windows)
            if window >= len(windows):
                msg = (
                    f"held-out source {source!r} has {size} tokens: {len(windows)} window(s) of {length} instead "
                    f"of {s.ppl_windows}"
                )
                if not windows:
                    raise _Unbuildable(msg)
                if window == len(windows):  # noted once per cell; the cell reports its real n
                    self.notes.append(
                        {"model": m.name, "task": "text", "source": source, "length": length, "note": msg}
                    )
                return
            ids = windows[window]
            runner = self.runners[m.name]
            agree = (
                "agreement" in s.suites and self.teacher is not None and not m.is_teacher and self._same_tokenizer(m)
            )
            is_reference = self.teacher is not None and m.name == self.teacher.name and "agreement" in s.suites
            hidden = self._teacher_states(source, length, window, ids) if is_reference else None
            out = tasks.text_window(
                runner,
                ids,
                want_nll="ppl" in s.suites,
                hidden=hidden,
                teacher=self.runners[self.teacher.name] if agree else None,
                teacher_hidden=self._teacher_states(source, length, window, ids) if agree else None,
            )
            cell = self.text_parts[(m.name, source, length)]
            cell["window"].append(window)
            for k in ("nll", "top1", "kl"):
                if out[k] is not None:
                    cell[k].append(out[k])

        return run

    def _same_tokenizer(self, m: EvalModel) -> bool:
        return tokenizer_key(m.tokenizer) == tokenizer_key(self.teacher.tokenizer)

    def _efficiency_unit(self, m: EvalModel, length: int):
        vocab = min(int(x.model.cfg.vocab_size) for x in self.models)

        def run():
            sizes = tasks.cache_sizes(m.model, length)
            point = tasks.efficiency(
                self.runners[m.name], self.inputs.random_prompt(length, vocab), decode_steps=self.settings.decode_steps
            )
            self.efficiency.append({"model": m.name, "length": length, **sizes, **point})

        return run


class _Unbuildable(Exception):
    """A unit whose inputs cannot exist at this length (too short a prompt, too little held-out text)."""

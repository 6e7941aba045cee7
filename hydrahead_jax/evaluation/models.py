"""Model specs of the command line → loaded models, all before any evaluation starts.

Spec forms (each may be prefixed with ``LABEL=`` to name the model in tables and plots):

* ``teacher:<source>`` — a plain pretrained decoder: ``smollm2-135m``, a ``.gguf`` file or a Hugging Face
  folder (``models.load_pretrained``). It is the reference for teacher agreement.
* ``<dir>`` — a model exported by training (``hydrahead_jax.load_hydrahead``, e.g. ``runs/x/final``; its
  train_config.json gives the training length), or a Hugging Face folder / ``.gguf`` file of a plain decoder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from hydrahead_jax.run_config import STAGES
from hydrahead_jax.storage import is_object_store, run_path


class ModelSpecError(ValueError):
    """A --model spec that does not name a loadable model; the message says what was expected."""


@dataclasses.dataclass
class EvalModel:
    """A model under evaluation with what the report says about it."""

    name: str
    model: nnx.Module
    tokenizer: Any
    kind: str  # "teacher" | "hydrahead" | "pretrained"
    spec: str = ""
    train_length: int | None = None  # longest training sequence, when the export records it
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def is_teacher(self) -> bool:
        return self.kind == "teacher"


def describe(model: nnx.Module) -> dict:
    """Parameter count (each layer's own parameters: not the zero slots of a HydraHead student's stacked GDN and
    fusion parameters, ``HydraHeadAttention.unused_parameters``) and attention layout: FA groups per layer vs KV
    groups in all."""
    params = nnx.state(model, nnx.Param)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
    unused = getattr(model.layers.self_attn, "unused_parameters", None)
    if unused is not None:
        n_params -= sum(unused(kind) for kind in model.layer_kinds)
    cfg = model.cfg
    fa = model.fa_groups_per_layer
    return {
        "params": n_params,
        "config": cfg.to_dict(),
        "fa_groups": int(sum(fa)),
        "kv_groups": int(cfg.num_layers * cfg.num_kv_heads),
        "fa_groups_per_layer": fa,
    }


def _split_label(spec: str) -> tuple[str | None, str]:
    head, sep, rest = spec.partition("=")
    if sep and head and "/" not in head and ":" not in head:
        return head, rest
    return None, spec


def _default_label(spec: str) -> str:
    if spec.startswith("teacher:"):
        return "teacher:" + Path(spec[len("teacher:") :]).name
    p = Path(spec)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


def _looks_like_pretrained(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".gguf") or (
        path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    )


def _train_length(path: Path) -> int | None:
    """The longest sequence any training stage used, from the export's train_config.json (None if unknown)."""
    try:
        config = json.loads((path / "train_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    sections = [config.get(s.config_key) for s in STAGES]
    lengths = [v["seq_len"] for v in sections if isinstance(v, dict) and isinstance(v.get("seq_len"), int)]
    return max(lengths) if lengths else None


def _corpus_settings(path: Path) -> dict | None:
    """The training corpus and split settings from the export's train_config.json (its ``data`` section)."""
    try:
        data = json.loads((path / "train_config.json").read_text()).get("data")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("source"), str) or data["source"] in ("copy", ""):
        return None
    return {k: data[k] for k in ("source", "validation_fraction", "txt_split", "text_field") if k in data}


def _head_map_summary(path: Path) -> dict:
    try:
        data = json.loads((path / "head_map.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: data.get(k) for k in ("method", "target_ratio", "allocation") if k in data}


def load_model(spec: str) -> EvalModel:
    """Load one ``--model`` spec (see the module docstring); raises ModelSpecError with the fix."""
    label, body = _split_label(spec)
    name = label or _default_label(body)
    if body.startswith("teacher:"):
        source = body[len("teacher:") :]
        if not source:
            raise ModelSpecError(f"--model {spec!r}: 'teacher:' needs a source, e.g. teacher:smollm2-135m.")
        from hydrahead_jax.models import load_pretrained

        try:
            model, tok = load_pretrained(source)
        except (ValueError, OSError) as err:
            raise ModelSpecError(f"--model {spec!r}: cannot load the teacher: {err}") from err
        return EvalModel(name, model, tok, "teacher", spec, info=describe(model))
    path = run_path(body, what="--model") if is_object_store(body) else Path(body).expanduser()
    if not path.exists():
        raise ModelSpecError(
            f"--model {spec!r}: {path} does not exist. Give an exported model folder "
            "(e.g. runs/x/final), a Hugging Face folder or .gguf, or teacher:<source>."
        )
    if _looks_like_pretrained(path):
        from hydrahead_jax.models import load_pretrained

        try:
            model, tok = load_pretrained(str(path))
        except (ValueError, OSError) as err:
            raise ModelSpecError(f"--model {spec!r}: cannot load {path}: {err}") from err
        return EvalModel(name, model, tok, "pretrained", spec, info=describe(model))
    if not (path.is_dir() and (path / "model_config.json").is_file()):
        raise ModelSpecError(
            f"--model {spec!r}: {path} is not a model: expected a folder exported by training "
            "(WORKDIR/final, with model_config.json, head_map.json and params/), a Hugging Face "
            "folder with config.json and *.safetensors, or a .gguf file."
        )
    from hydrahead_jax.export import DamagedExportError, load_hydrahead
    from hydrahead_jax.training.checkpoint import CheckpointReadError

    try:
        model, tok = load_hydrahead(str(path))
    except (DamagedExportError, CheckpointReadError) as err:  # anything else is a bug: it propagates as it is
        raise ModelSpecError(f"--model {spec!r}: {err}") from None
    if tok is None:
        raise ModelSpecError(
            f"--model {spec!r}: {path} records no tokenizer (it was trained from a random "
            "teacher), so text prompts cannot be encoded for it."
        )
    info = {**describe(model), "head_map": _head_map_summary(path), "corpus": _corpus_settings(path)}
    return EvalModel(name, model, tok, "hydrahead", spec, train_length=_train_length(path), info=info)


def load_models(specs: list[str]) -> list[EvalModel]:
    """Load every spec; labels must be unique (two identical defaults get #2, #3 …)."""
    models, seen = [], {}
    for spec in specs:
        m = load_model(spec)
        if m.name in seen:
            seen[m.name] += 1
            m.name = f"{m.name}#{seen[m.name]}"
        else:
            seen[m.name] = 1
        models.append(m)
    return models

"""The finished HydraHead model as one folder, and ``load_hydrahead(folder) -> (model, tokenizer)``.

    final/params/              Orbax checkpoint of every student Variable
    final/head_map.json        the head map the student was built with
    final/model_config.json    ModelConfig of the teacher skeleton
    final/hybrid_config.json   HybridConfig
    final/tokenizer.json       {"source": teacher source or null}: where load_tokenizer finds the tokenizer
    final/train_config.json    the resolved training config (RunConfig.to_dict(): provenance, and where the
                               evaluation reads the training length and the corpus's validation split)

The folder is written under a temporary name and renamed into place, so it is complete or absent. This module
lives outside ``training/`` so that loading a model (evaluation, serving) needs no training code.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model


def export_final(
    out: str | Path,
    graphdef,
    full_state,
    cfg: ModelConfig,
    head_map: HeadMap,
    hybrid_cfg: HybridConfig,
    *,
    teacher_source: str | None,
    resolved_config: dict | None = None,
) -> Path:
    out = Path(out).absolute()
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", full_state)
            ckptr.wait_until_finished()
        head_map.save(tmp / "head_map.json")
        (tmp / "model_config.json").write_text(cfg.to_json())
        (tmp / "hybrid_config.json").write_text(json.dumps(hybrid_cfg.to_dict(), indent=2, sort_keys=True))
        source = None if teacher_source in (None, "random") else str(teacher_source)
        (tmp / "tokenizer.json").write_text(json.dumps({"source": source}))
        if resolved_config is not None:
            (tmp / "train_config.json").write_text(json.dumps(resolved_config, indent=2, sort_keys=True, default=str))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_hydrahead(path: str | Path, *, device=None):
    """(HydraHead Transformer, tokenizer or None) from an exported folder (``workdir/final``)."""
    path = Path(path).absolute()
    needed = ("params", "head_map.json", "model_config.json", "hybrid_config.json")
    missing = [n for n in needed if not (path / n).exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not an exported HydraHead model (missing {missing}); export one with "
            "train.py (it writes WORKDIR/final when stage 3 finishes)."
        )
    cfg = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
    hybrid_cfg = HybridConfig.from_dict(json.loads((path / "hybrid_config.json").read_text()))
    head_map = HeadMap.load(path / "head_map.json", cfg)
    abstract = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid_cfg, nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), nnx.as_pure(abs_state))
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(path / "params", target)
    model = nnx.merge(graphdef, state)
    tokenizer = None
    tok_path = path / "tokenizer.json"
    source = json.loads(tok_path.read_text()).get("source") if tok_path.exists() else None
    if source:
        from hydrahead_jax.models.loaders import resolve_source
        from hydrahead_jax.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_source(source))
    return model, tokenizer

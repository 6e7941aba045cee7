"""A finished HydraHead model (``RUN/final``, ``export.export_final``) as a Hugging Face folder that transformers loads:

    python -m hydrahead_jax.export_hf RUN/final OUT [--max-shard-size 5GB]
    AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)

OUT holds ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and their index past
``--max-shard-size``; float32), ``config.json`` (model_type "hydrahead", ``auto_map`` naming the two code files),
``configuration_hydrahead.py`` and ``modeling_hydrahead.py`` (copied from ``hydrahead_jax/hf_remote``: torch and
transformers only), ``generation_config.json`` and the tokenizer files (tokenizer.json, tokenizer_config.json).

Tensors: the teacher's names (``models.hf_layout``) with each layer's KV groups in the student's stored order (FA
groups first; ``config.json``'s ``kv_group_order`` records the teacher's group of each), plus per hybrid layer
``model.layers.{i}.self_attn.gdn.*`` (its own LA heads only: the zero slots of the JAX stack are dropped) and
``…self_attn.fusion.{gamma,mu}`` (the fused heads only). Linear kernels are transposed to torch's [out, in].
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hydrahead_jax.models.transformer import hf_state_dict

REMOTE_CODE = Path(__file__).parent / "hf_remote"
CODE_FILES = ("configuration_hydrahead.py", "modeling_hydrahead.py")
AUTO_MAP = {
    "AutoConfig": "configuration_hydrahead.HydraHeadConfig",
    "AutoModelForCausalLM": "modeling_hydrahead.HydraHeadForCausalLM",
}
# HybridConfig fields the exported model implements (modeling_hydrahead.HYBRID_DEFAULTS), and those that only shape
# training or the JAX kernels. A field in neither (a new student kind) stops the export until the modeling file
# implements it.
EXPORTED_OPTIONS = {
    "use_conv", "conv_size", "use_output_gate", "la_rope", "fusion", "fusion_granularity", "fusion_bias",
    "gdn_beta", "gdn_beta_bias", "gdn_qk_map", "la_window", "la_sinks",
}  # fmt: skip
TRAINING_ONLY_OPTIONS = {
    "fusion_init", "gdn_dt_min", "gdn_dt_max", "gdn_init", "gdn_chunk_size", "gdn_implementation",
    "attention_implementation", "attention_context_parallel",
}  # fmt: skip
DEFAULT_SHARD = "5GB"


class ExportError(ValueError):
    """A model export_hf cannot write; the message says why and what to do."""


def check_exportable(model) -> None:
    """Refuse, in one line, a student the PyTorch modeling file does not implement."""
    if model.cfg.rope_interleaved:
        raise ExportError(
            "export_hf writes half-split RoPE weights and this model uses interleaved RoPE (a GGUF layout): build "
            "the student from the teacher's Hugging Face folder or its GGUF through load_pretrained (which un-permutes)."
        )
    hybrid = getattr(model.layers.self_attn, "hybrid_cfg", None)
    unknown = sorted(set(hybrid.to_dict()) - EXPORTED_OPTIONS - TRAINING_ONLY_OPTIONS) if hybrid else []
    if unknown:
        raise ExportError(
            f"export_hf does not implement HybridConfig option(s) {unknown} yet: add them to "
            "hydrahead_jax/hf_remote/modeling_hydrahead.py and export_hf.EXPORTED_OPTIONS."
        )


def _layer_slice(state: nnx.State, i: int) -> nnx.State:
    return jax.tree.map(lambda a: a[i], state)


def hybrid_tensors(model) -> dict[str, np.ndarray]:
    """The GDN and fusion tensors of every hybrid layer, each layer's own heads only, in torch layout."""
    from hydrahead_jax.hybrid.gdn import take_la_groups

    attn, cfg, out = model.layers.self_attn, model.cfg, {}
    if getattr(attn, "hybrid_cfg", None) is None:
        return out
    gdn = nnx.state(attn.gdn, nnx.Param)
    for i, kind in enumerate(model.layer_kinds):
        if not attn.is_hybrid(kind):
            continue
        prefix = f"model.layers.{i}.self_attn."
        own = take_la_groups(_layer_slice(gdn, i), cfg, attn.max_la_groups, cfg.num_kv_heads - kind)
        for path, var in nnx.to_flat_state(own):
            names = [str(p) for p in path]
            value = np.asarray(var[...], np.float32)
            if names[-1] == "kernel":  # an nnx.Linear kernel [in, out] → torch weight [out, in]
                names[-1], value = "weight", value.T
            out[prefix + "gdn." + ".".join(names)] = np.ascontiguousarray(value)
        used = attn.fused_heads(kind)
        for name in ("gamma", "mu") if used else ():
            var = getattr(attn.fusion, name)
            if var is not None:
                out[f"{prefix}fusion.{name}"] = np.ascontiguousarray(np.asarray(var[...][i][:used], np.float32))
    return out


def config_json(model, tokenizer) -> dict:
    """config.json of the export (read by hf_remote/configuration_hydrahead.py): the teacher's shapes as
    ``config_to_hf`` writes them, its RoPE as transformers' ``rope_parameters`` (rope_type, rope_theta and the
    scaling's own keys), and the student's layout: FA groups per layer, stored group order, HybridConfig."""
    from hydrahead_jax.models.loaders import config_to_hf

    hf = config_to_hf(model.cfg)
    rope = {"rope_type": "default", **hf.pop("rope_scaling", {}), "rope_theta": float(hf.pop("rope_theta"))}
    hybrid = getattr(model.layers.self_attn, "hybrid_cfg", None)
    hf.update(
        architectures=["HydraHeadForCausalLM"],
        model_type="hydrahead",
        auto_map=AUTO_MAP,
        rope_parameters=rope,
        attention_bias=model.cfg.attention_bias,
        qk_norm=model.cfg.qk_norm,
        layer_fa_groups=list(model.layer_kinds),
        kv_group_order=[list(o) for o in model.group_order],
        hybrid={k: v for k, v in hybrid.to_dict().items() if k in EXPORTED_OPTIONS} if hybrid else {},
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        torch_dtype="float32",
    )
    return hf


def write_safetensors(tensors: dict[str, np.ndarray], out: Path, max_shard_bytes: int) -> list[str]:
    """``tensors`` as one model.safetensors, or as shards of at most ``max_shard_bytes`` (a bigger tensor gets a
    shard of its own) with model.safetensors.index.json, as transformers' save_pretrained lays them out."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
            "weight_map": {tensor: file for file, shard in zip(names, shards) for tensor in shard},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    for file, shard in zip(names, shards):
        save_file(shard, str(out / file), metadata={"format": "pt"})
    return names


def export_hf(final: str | Path, out: str | Path, *, max_shard_size: str | int = DEFAULT_SHARD) -> Path:
    """Write the Hugging Face folder ``out`` of the export ``final`` (module doc); returns ``out``. The folder is
    written under a temporary name and renamed, so it is complete or absent."""
    from hydrahead_jax.evaluation.cli import parse_bytes
    from hydrahead_jax.export import TOKENIZER_DIR, load_hydrahead

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; remove it or name a new folder.")
    try:
        shard_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_bytes(max_shard_size)
    except ValueError as err:
        raise ExportError(f"--max-shard-size: {err}") from None
    model, tokenizer = load_hydrahead(str(final))
    if tokenizer is None:
        raise ExportError(f"{final} records no tokenizer (a random teacher): a Hugging Face folder needs one.")
    check_exportable(model)
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_safetensors({**hf_state_dict(model), **hybrid_tensors(model)}, tmp, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config_json(model, tokenizer), indent=2))
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2))
        for name in CODE_FILES:
            shutil.copyfile(REMOTE_CODE / name, tmp / name)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(final) / TOKENIZER_DIR / name, tmp / name)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    from hydrahead_jax.export import DamagedExportError

    p = argparse.ArgumentParser(prog="python -m hydrahead_jax.export_hf", description=__doc__.splitlines()[0])
    p.add_argument("final", help="an exported model folder (RUN/final)")
    p.add_argument("out", help="the Hugging Face folder to write (new or empty)")
    p.add_argument(
        "--max-shard-size", default=DEFAULT_SHARD, help=f"largest safetensors shard (default {DEFAULT_SHARD})"
    )
    args = p.parse_args(argv)
    try:
        out = export_hf(args.final, args.out, max_shard_size=args.max_shard_size)
    except (ExportError, DamagedExportError, FileNotFoundError) as err:
        print(f"export_hf: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

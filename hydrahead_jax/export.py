"""The finished HydraHead model as one folder, and ``load_hydrahead(folder) -> (model, tokenizer)``.

    final/params/              Orbax checkpoint of every student Variable
    final/head_map.json        the head map the student was built with
    final/model_config.json    ModelConfig of the teacher skeleton
    final/hybrid_config.json   HybridConfig
    final/tokenizer/           the teacher's tokenizer as a Hugging Face tokenizer folder (tokenizer.json,
                               tokenizer_config.json); absent when the teacher had none (a random teacher)
    final/train_config.json    the resolved training config (RunConfig.to_dict(): provenance, and where the
                               evaluation reads the training length and the corpus's validation split)
    final/MANIFEST.json        every other file with its size: a damaged export is named before Orbax reads it

The folder is self-contained (no path to the teacher: it loads after the teacher moves). It is written under a
temporary name and renamed into place, so it is complete or absent; a temporary folder left by a killed export is
removed by the next one. This module lives outside ``training/`` so that loading a model (evaluation, serving)
needs no training code.
"""

from __future__ import annotations

import json
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model
from hydrahead_jax.storage import RunPath, file_size, files_under, move, remove_tree, run_path

MANIFEST = "MANIFEST.json"
TOKENIZER_DIR = "tokenizer"
NEEDED = ("params", "head_map.json", "model_config.json", "hybrid_config.json")


class DamagedExportError(RuntimeError):
    """An export folder with a missing, truncated or unreadable part."""

    def __init__(self, path: RunPath, what: str):
        super().__init__(f"this export is damaged: {what} (in {path}); rerun train.py on its workdir to export again.")


def export_final(
    out: str | RunPath,
    graphdef,
    full_state,
    cfg: ModelConfig,
    head_map: HeadMap,
    hybrid_cfg: HybridConfig,
    *,
    tokenizer=None,
    teacher_source: str | None = None,
    resolved_config: dict | None = None,
) -> RunPath:
    """Write the folder (see the module doc). ``tokenizer``: the teacher's (models.tokenizer.Tokenizer); without
    it, the one of ``teacher_source`` when that names a checkpoint."""
    out = run_path(out)
    if tokenizer is None and teacher_source not in (None, "random"):
        from hydrahead_jax.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(teacher_source)
    from hydrahead_jax.training.checkpoint import is_primary, sync_processes  # local: export loads without training

    # Every process writes its shards of the parameters into the same folder (its name is process 0's choice);
    # process 0 alone writes the other files and renames the folder into place.
    if is_primary():
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by an export that was killed (the caller owns out)
            remove_tree(stale)
    tag = uuid.uuid4().hex[:8]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        tag = f"{int(multihost_utils.broadcast_one_to_all(np.uint32(int(tag, 16)))):08x}"
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    if is_primary():
        tmp.mkdir(parents=True)
    sync_processes("export folder")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / "params", full_state)
            ckptr.wait_until_finished()
        if is_primary():
            _write_metadata(tmp, cfg, head_map, hybrid_cfg, tokenizer, resolved_config)
            remove_tree(out)
            move(tmp, out)
    except BaseException:
        if is_primary():
            remove_tree(tmp)
        raise
    sync_processes("export done")
    return out


def _write_metadata(tmp: RunPath, cfg, head_map, hybrid_cfg, tokenizer, resolved_config) -> None:
    """Everything of the export besides the parameters, and the manifest of all its files."""
    head_map.save(tmp / "head_map.json")
    (tmp / "model_config.json").write_text(cfg.to_json())
    (tmp / "hybrid_config.json").write_text(json.dumps(hybrid_cfg.to_dict(), indent=2, sort_keys=True))
    if tokenizer is not None:
        _save_tokenizer(tokenizer, tmp / TOKENIZER_DIR)
    if resolved_config is not None:
        (tmp / "train_config.json").write_text(json.dumps(resolved_config, indent=2, sort_keys=True, default=str))
    manifest = {os.fspath(p)[len(os.fspath(tmp)) + 1 :]: file_size(p) for p in files_under(tmp)}
    (tmp / MANIFEST).write_text(json.dumps({"files": manifest}, indent=1, sort_keys=True))


def _save_tokenizer(tokenizer, folder: RunPath) -> None:
    """A Hugging Face tokenizer folder that models.tokenizer.tokenizer_from_folder reads back identically."""
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str(pretty=True))
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "_name_or_path": tokenizer.name}
    (folder / "config.json").write_text(json.dumps(ids, indent=2))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for kind, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id)):
        token = None if token_id is None else tokenizer.backend.id_to_token(token_id)
        if token is not None:
            tok_cfg[f"{kind}_token"] = token
    if tokenizer.chat_template:
        tok_cfg["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def check_export(path: RunPath) -> None:
    """Raise DamagedExportError naming the first missing or truncated file (from MANIFEST.json), before any read."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return  # an export written before the manifest existed: Orbax's own errors are caught below instead
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DamagedExportError(path, f"{MANIFEST} does not read ({type(err).__name__}: {err})") from None
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            raise DamagedExportError(path, f"{name} is missing")
        if file_size(file) != size:
            raise DamagedExportError(path, f"{name} has {file_size(file)} bytes, {size} were written")


def _short(err: BaseException) -> str:
    """One line of a (possibly long, multi-line) Orbax/TensorStore error: its first status line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    status = [line for line in lines if any(code in line for code in ("NOT_FOUND", "DATA_LOSS", "INVALID_ARGUMENT"))]
    line = (status or lines or [type(err).__name__])[0]
    return f"{type(err).__name__}: {line[:240]}"


def load_hydrahead(path: str | RunPath, *, device=None):
    """(HydraHead Transformer, tokenizer or None) from an exported folder (``workdir/final``).

    A missing, truncated or unreadable part raises DamagedExportError (one line naming it)."""
    path = run_path(path)
    missing = [n for n in NEEDED if not (path / n).exists()]
    if missing and not any((path / n).exists() for n in NEEDED):
        raise FileNotFoundError(
            f"{path} is not an exported HydraHead model (missing {missing}); export one with "
            "train.py (it writes WORKDIR/final when stage 3 finishes)."
        )
    if missing:
        raise DamagedExportError(path, f"{', '.join(missing)} missing")
    check_export(path)
    try:
        cfg = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
        hybrid_cfg = HybridConfig.from_dict(json.loads((path / "hybrid_config.json").read_text()))
        head_map = HeadMap.load(path / "head_map.json", cfg)
    except Exception as err:  # noqa: BLE001 — any unreadable config file means a damaged export
        raise DamagedExportError(path, f"a config file does not read ({_short(err)})") from None
    abstract = nnx.eval_shape(lambda: build_model(cfg, head_map, hybrid_cfg, nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), nnx.as_pure(abs_state))
    from hydrahead_jax.training.checkpoint import (
        CheckpointMismatchError,
        DamagedCheckpointError,
        check_matches,
        check_step_files,
        restore_step,
        stored_metadata,
    )

    def check_files():
        check_step_files(path, ["params"], pytree_items=("params",))

    def check():  # the arrays of params/ against the model its config files describe, before any is read
        check_files()
        check_matches({"params": stored_metadata(path / "params")}, {"params": target}, where=f"{path}/params")

    try:
        per_layer = restore_step(
            path / "params", lambda: _per_layer(stored_metadata(path / "params")), check=check_files
        )
        with ocp.StandardCheckpointer() as ckptr:
            # Damage or a mismatch is the export's (its files disagree); a read that keeps failing raises
            # CheckpointReadError, anything else propagates: neither says the export is damaged.
            if per_layer:  # written before the layers were one stack: read as stored, then converted
                raw = restore_step(path / "params", lambda: ckptr.restore(path / "params"), check=check_files)
                try:
                    state = stack_per_layer_export(raw, abs_state, cfg, head_map, hybrid_cfg)
                except (KeyError, ValueError) as err:
                    raise CheckpointMismatchError(
                        f"{path}/params (per-layer layout) does not match its config files ({err})"
                    ) from None
                state = jax.device_put(state, sharding)
            else:
                state = restore_step(path / "params", lambda: ckptr.restore(path / "params", target), check=check)
    except (DamagedCheckpointError, CheckpointMismatchError) as err:
        raise DamagedExportError(path, f"params/ does not restore ({err})") from None
    model = nnx.merge(graphdef, state)
    return model, _load_tokenizer(path)


def _per_layer(metadata) -> bool:
    """Whether saved parameters (their Orbax metadata) are in the per-layer layout of exports written before the
    layers were one stack (``layers`` holds one subtree per layer index: arrays named layers.0.…)."""
    from hydrahead_jax.training.checkpoint import _stored_leaves, per_layer_names

    return per_layer_names(_stored_leaves(metadata))


def stack_per_layer_export(raw: dict, abs_state, cfg: ModelConfig, head_map: HeadMap, hybrid_cfg: HybridConfig):
    """The state of ``build_model(cfg, head_map, hybrid_cfg)`` from an export in the per-layer layout (``layers``
    /i/… with each layer's heads in their original order and its GDN heads for its own LA groups only): every
    layer's KV groups stored FA groups first (``permute_groups``), its GDN heads and fusion scales in the first
    slots of the stacked shapes, the rest zero, then stacked. Exact: a permutation and zero padding."""
    from hydrahead_jax.hybrid.attention import group_columns, group_order
    from hydrahead_jax.hybrid.gdn import place_la_array

    layers = {str(k): v for k, v in raw["layers"].items()}
    orders = [group_order(groups, cfg.num_kv_heads) for groups in head_map.fa_groups]
    max_la = cfg.num_kv_heads - min(head_map.fa_counts())
    q_cols = [group_columns(o, cfg.group_size, cfg.head_dim) for o in orders]
    kv_cols = [group_columns(o, 1, cfg.head_dim) for o in orders]
    heads = [group_columns(o, cfg.group_size, 1) for o in orders]
    permuted = {"q_proj": (q_cols, -1), "k_proj": (kv_cols, -1), "v_proj": (kv_cols, -1)}

    def layer_value(i: int, rest: tuple[str, ...], shape, dtype):
        node = layers[str(i)]
        for key in rest:
            node = node.get(key) if isinstance(node, dict) else None
        f = len(head_map.fa_groups[i])
        if node is None:  # a softmax-only layer had no GDN or fusion: its slots are zero
            return np.zeros(shape, dtype)
        a = np.asarray(node)
        module = rest[1] if len(rest) > 1 else ""
        if module in permuted and rest[0] == "self_attn":
            cols, axis = permuted[module]
            return np.take(a, cols[i], axis=axis)
        if rest[:2] == ("self_attn", "o_proj"):
            return np.take(a, q_cols[i], axis=0)
        if rest[:2] == ("self_attn", "gdn"):
            return place_la_array(rest[2:], a, cfg, cfg.num_kv_heads - f, max_la)
        if rest[:2] == ("self_attn", "fusion"):
            if hybrid_cfg.fusion == "both":
                a = a[heads[i]]  # the old fusion covered every head in the original order
            return np.pad(a, [(0, shape[0] - a.shape[0])] + [(0, 0)] * (a.ndim - 1))  # la_only: LA heads, sorted
        return a

    flat = []
    for path, leaf in nnx.to_flat_state(abs_state):
        keys = tuple(str(k) for k in path)
        shape, dtype = leaf.shape, leaf.dtype
        if keys[0] == "layers":
            value = np.stack([layer_value(i, keys[1:], shape[1:], dtype) for i in range(cfg.num_layers)])
        else:
            node = raw
            for key in keys:
                node = node[key]
            value = np.asarray(node)
        if value.shape != tuple(shape):
            raise ValueError(f"parameter {'/'.join(keys)}: {value.shape} in the export, {tuple(shape)} expected.")
        flat.append((path, leaf.replace(jnp.asarray(value, dtype))))
    return nnx.from_flat_state(flat)


def _load_tokenizer(path: RunPath):
    """The export's own tokenizer folder; an older export's tokenizer.json that names the teacher's source."""
    from hydrahead_jax.models.tokenizer import load_tokenizer, tokenizer_from_folder

    folder = path / TOKENIZER_DIR
    try:
        if folder.is_dir():
            return tokenizer_from_folder(folder)
        legacy = path / "tokenizer.json"
        source = json.loads(legacy.read_text()).get("source") if legacy.exists() else None
        return load_tokenizer(source) if source else None
    except Exception as err:  # noqa: BLE001
        raise DamagedExportError(path, f"its tokenizer does not load ({_short(err)})") from None

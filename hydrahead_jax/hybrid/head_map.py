"""The head map: which KV groups of each layer keep full (softmax) attention — a JSON artifact users share.

File format (``format_version`` 1)::

    {"format_version": 1,
     "model": {"name": ..., "num_layers": L, "num_heads": Hq, "num_kv_heads": G, "head_dim": D},
     "granularity": "kv_group",
     "target_ratio": "7:1" | "25%" | "0.25" | null,     # LA:FA, or the FA fraction
     "allocation": "per_layer" | "global" | "whole_layers",
     "method": "retrieval" | "ablation" | "layerwise" | "all_fa" | ...,
     "probe": {...},                                     # settings of the probe that produced the scores
     "scores": {"retrieval": [[...G floats...] × L], ...},
     "budget": {"target_fa_groups": n, "fa_groups": n', "exact": ..., "rule": ...},   # optional: the KV
                                                         # budget the map was sized to, and how it was met
     "fa_groups": [[sorted FA group indices of layer 0], ..., [... of layer L−1]]}

A ratio "a:b" reads LA:FA (the paper's "7:1" keeps 1 head in 8 as FA), so its FA fraction is b / (a + b).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile
from collections.abc import Sequence
from typing import Any

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.storage import is_object_store, run_path

FORMAT_VERSION = 1
ALLOCATIONS = ("per_layer", "global", "whole_layers")
GRANULARITY = "kv_group"
_MODEL_FIELDS = ("name", "num_layers", "num_heads", "num_kv_heads", "head_dim")


class HeadMapError(ValueError):
    """A head map that is malformed or does not fit the model; the message names the file/field and the fix."""


def parse_ratio(ratio: str | float | int) -> float:
    """FA fraction of a ratio: "7:1" (LA:FA) → 1/8, "25%" → 0.25, "0.25" or 0.25 → 0.25. Must lie in [0, 1]."""
    if isinstance(ratio, bool):
        raise HeadMapError(f"ratio {ratio!r} is not a ratio; write e.g. '7:1' (LA:FA), '25%' or 0.25.")
    if isinstance(ratio, (int, float)):
        fraction = float(ratio)
    elif isinstance(ratio, str):
        text = ratio.strip()
        try:
            if ":" in text:
                la, fa = (float(part) for part in text.split(":"))
                if la < 0 or fa < 0 or la + fa <= 0 or not math.isfinite(la + fa):
                    raise HeadMapError(f"ratio {ratio!r}: LA:FA parts must be finite, >= 0 and not both 0.")
                fraction = fa / (la + fa)
            elif text.endswith("%"):
                fraction = float(text[:-1]) / 100.0
            else:
                fraction = float(text)
        except HeadMapError:
            raise
        except ValueError:
            raise HeadMapError(
                f"cannot parse ratio {ratio!r}; write 'LA:FA' like '7:1', a percentage like "
                "'25%', or an FA fraction like '0.25'."
            ) from None
    else:
        raise HeadMapError(f"ratio must be a string or a number, got {type(ratio).__name__}.")
    if not (0.0 <= fraction <= 1.0) or not math.isfinite(fraction):
        raise HeadMapError(f"ratio {ratio!r} gives an FA fraction of {fraction}; it must lie in [0, 1].")
    return fraction


def fa_group_count(ratio: str | float, allocation: str, num_layers: int, num_groups: int) -> int:
    """The one ratio → FA-count rule: FA groups per layer ("per_layer") or in the whole model ("global",
    "whole_layers").

    With FA fraction f, L layers and G KV groups per layer:

        per_layer:    k = f·G in every layer; f·G must be a whole number. Rounding it would silently change the
                      ratio (3:1 on 3 groups is 0.75 → 1, i.e. 2:1), so any other ratio is an error that lists the
                      ratios a layer can meet and points to global allocation.
        global:       n = round(f·L·G), half up (the nearest achievable budget; 7:1 of 90 groups is 11.25 → 11).
        whole_layers: m·G, whole layers of G groups, m = ``whole_layer_count`` (the layer-wise baseline's rule).

    A non-zero ratio that buys no FA group is an error, not a silent all-LA model; f = 0 gives 0.
    """
    if allocation not in ALLOCATIONS:
        raise HeadMapError(f"allocation={allocation!r}; choose one of {ALLOCATIONS}.")
    f = parse_ratio(ratio)
    if allocation == "per_layer":
        k = f * num_groups
        if abs(k - round(k)) > 1e-6 or (f > 0 and round(k) < 1):
            achievable = ", ".join(f"{num_groups - j}:{j}" for j in range(1, num_groups + 1))
            raise HeadMapError(
                f"ratio {ratio!r} (FA fraction {f:.4g}) needs {k:.3g} FA groups per layer, but each layer has "
                f"{num_groups} KV groups; per_layer allocation can only meet LA:FA ratios {achievable}. "
                f"Use allocation='global' (top-k over all {num_layers * num_groups} groups) instead."
            )
        return int(round(k))
    count = int(math.floor(f * num_layers * num_groups + 0.5))
    if f > 0 and count == 0:
        raise HeadMapError(
            f"ratio {ratio!r} (FA fraction {f:.4g}) of {num_layers * num_groups} KV groups rounds to 0 FA "
            "groups; choose a larger FA fraction."
        )
    if allocation == "whole_layers":
        return whole_layer_count(count, num_groups) * num_groups
    return count


def whole_layer_count(target_groups: int, num_groups: int) -> int:
    """Whole layers of ``num_groups`` KV groups nearest a budget of ``target_groups`` FA groups; on a tie the
    fewer (a tie never buys the larger cache); at least one for a non-zero budget."""
    fewer, more = target_groups // num_groups, -(-target_groups // num_groups)
    m = fewer if target_groups - fewer * num_groups <= more * num_groups - target_groups else more
    return max(m, 1) if target_groups > 0 else 0


def fa_budget(cfg: ModelConfig, ratio: str | float, allocation: str) -> int:
    """FA groups a ratio buys for ``cfg``: per layer ("per_layer") or in the whole model ("global"); see
    ``fa_group_count`` for the rule."""
    return fa_group_count(ratio, allocation, cfg.num_layers, cfg.num_kv_heads)


@dataclasses.dataclass
class HeadMap:
    model: dict[str, Any]
    fa_groups: list[list[int]]
    method: str
    target_ratio: str | None = None
    allocation: str = "per_layer"
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)
    scores: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    budget: dict[str, Any] = dataclasses.field(default_factory=dict)
    granularity: str = GRANULARITY
    format_version: int = FORMAT_VERSION

    # ------------------------------------------------------------------------------------------ constructors
    @staticmethod
    def model_identity(cfg: ModelConfig) -> dict[str, Any]:
        return {f: getattr(cfg, f) for f in _MODEL_FIELDS}

    @classmethod
    def from_fa_groups(
        cls,
        cfg: ModelConfig,
        fa_groups: Sequence[Sequence[int]],
        *,
        method: str,
        target_ratio: str | float | None = None,
        allocation: str = "per_layer",
        probe: dict[str, Any] | None = None,
        scores: dict[str, Any] | None = None,
        budget: dict[str, Any] | None = None,
    ) -> HeadMap:
        """A validated map for ``cfg`` with the given FA groups per layer (sorted on the way in)."""
        groups = [sorted(int(g) for g in layer) for layer in fa_groups]
        scores = {name: [[float(s) for s in row] for row in matrix] for name, matrix in (scores or {}).items()}
        ratio = None if target_ratio is None else str(target_ratio)
        head_map = cls(
            model=cls.model_identity(cfg),
            fa_groups=groups,
            method=method,
            target_ratio=ratio,
            allocation=allocation,
            probe=dict(probe or {}),
            scores=scores,
            budget=dict(budget or {}),
        )
        head_map.validate(cfg)
        return head_map

    @classmethod
    def all_fa(cls, cfg: ModelConfig) -> HeadMap:
        """Every group FA: the teacher."""
        return cls.from_fa_groups(cfg, [range(cfg.num_kv_heads)] * cfg.num_layers, method="all_fa", target_ratio="0:1")

    @classmethod
    def all_la(cls, cfg: ModelConfig) -> HeadMap:
        """Every group Gated DeltaNet."""
        return cls.from_fa_groups(cfg, [[]] * cfg.num_layers, method="all_la", target_ratio="1:0")

    @classmethod
    def layerwise(
        cls, cfg: ModelConfig, ratio: str | float | None = None, fa_layers: Sequence[int] | None = None
    ) -> HeadMap:
        """Layer-wise hybrid baseline: whole layers FA (all groups) or LA (none), from a layer list or a ratio.

        From a ratio, the baseline gets HydraHead's KV budget at that ratio: n = round(f·L·G) FA groups
        (``fa_group_count``, global; the per-layer count times L when that is whole), which is also its KV bytes
        per token, 2·n·D·itemsize. Whole layers hold G groups each, so it takes the whole number of layers m
        whose m·G is nearest n, which may hold a little more or less KV cache than HydraHead (SmolLM2-135M, 30
        layers × 3 groups, 7:1: n = 11 → 3.67 layers → 4 layers = 12 groups); on a tie the fewer, so a tie never
        gives the baseline the larger cache (Qwen3-1.7B shape, 28 layers × 8 groups, 7:1: n = 28 → 3.5 layers → 3
        layers = 24 groups); at least one layer for a non-zero ratio. ``budget`` records the target, the result
        and whether it is exact.

        Placement: when 1/f is an integer p (3:1 → 4, 7:1 → 8) and every p-th layer ending at the last one gives
        m layers (L−1, L−1−p, …), that periodic pattern of published layer-wise hybrids; otherwise m layers
        evenly spaced, again ending at the last. Ending at the last layer keeps softmax attention next to the
        logits, where retrieval output is read out.
        """
        if (ratio is None) == (fa_layers is None):
            raise HeadMapError("HeadMap.layerwise needs exactly one of ratio='3:1' or fa_layers=[...].")
        L, G = cfg.num_layers, cfg.num_kv_heads
        budget: dict[str, Any] = {}
        if fa_layers is None:
            f = parse_ratio(ratio)
            target = fa_budget(cfg, ratio, "global")
            m = whole_layer_count(target, G)
            if f > 0 and abs(1 / f - round(1 / f)) < 1e-9 and len(range(L - 1, -1, -round(1 / f))) == m:
                chosen = set(range(L - 1, -1, -round(1 / f)))
            else:
                chosen = {int(round(L - 1 - j * L / m)) for j in range(m)}
            budget = {
                "matches": "hydrahead_fa_kv_groups",
                "ratio": str(ratio),
                "target_fa_groups": target,
                "fa_groups": m * G,
                "exact": m * G == target,
                "rule": (
                    f"whole layers of {G} KV groups: {target} / {G} = {target / G:.4g} layers -> {m} "
                    "(nearest; a tie takes the fewer)"
                ),
            }
        else:
            chosen = set()
            for layer in fa_layers:
                if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
                    raise HeadMapError(f"fa_layers: layer {layer!r} is not an index in [0, {L}).")
                chosen.add(layer)
        all_groups = list(range(G))
        return cls.from_fa_groups(
            cfg,
            [all_groups if i in chosen else [] for i in range(L)],
            method="layerwise",
            target_ratio=None if ratio is None else str(ratio),
            probe={"fa_layers": sorted(chosen)},
            budget=budget,
        )

    # ------------------------------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self.fa_groups)

    def fa_counts(self) -> tuple[int, ...]:
        """Each layer's number of FA groups (a student layer's kind, ``Transformer.layer_kinds``)."""
        return tuple(len(layer) for layer in self.fa_groups)

    def num_fa_groups(self) -> int:
        return sum(self.fa_counts())

    def kv_bytes_ratio(self) -> float:
        """KV-cache bytes per token of the hybrid relative to the teacher: FA groups / all groups."""
        total = self.model["num_kv_heads"] * self.model["num_layers"]
        return self.num_fa_groups() / total

    # ------------------------------------------------------------------------------------------ validation
    def validate(self, cfg: ModelConfig | None = None, *, source: str = "head map") -> HeadMap:
        """Raise HeadMapError naming ``source``, the field and the fix when the map is malformed or misfits cfg."""

        def fail(msg):
            raise HeadMapError(f"{source}: {msg}")

        if self.format_version != FORMAT_VERSION:
            fail(
                f"format_version {self.format_version!r} is not supported (this code reads {FORMAT_VERSION}); "
                "regenerate the map with this version of hydrahead-jax."
            )
        if self.granularity != GRANULARITY:
            fail(f"granularity {self.granularity!r}: only {GRANULARITY!r} is supported.")
        if self.allocation not in ALLOCATIONS:
            fail(f"allocation {self.allocation!r}; choose one of {ALLOCATIONS}.")
        if self.target_ratio is not None:
            try:
                parse_ratio(self.target_ratio)
            except HeadMapError as e:
                fail(f"target_ratio: {e}")
        if not isinstance(self.budget, dict):
            fail(f"budget must be an object (the KV budget the map was sized to), got {self.budget!r}.")
        if not isinstance(self.model, dict) or set(_MODEL_FIELDS) - set(self.model):
            fail(f"model must be an object with fields {list(_MODEL_FIELDS)}, got {self.model!r}.")
        L, G = self.model["num_layers"], self.model["num_kv_heads"]
        if cfg is not None:
            for f in _MODEL_FIELDS[1:]:
                if self.model[f] != getattr(cfg, f):
                    fail(
                        f"model.{f}={self.model[f]} but the model has {f}={getattr(cfg, f)}; this map was made "
                        f"for another model ({self.model.get('name')!r}). Select heads for this model instead."
                    )
        if not isinstance(self.fa_groups, list) or len(self.fa_groups) != L:
            n = len(self.fa_groups) if isinstance(self.fa_groups, list) else type(self.fa_groups).__name__
            fail(f"fa_groups has {n} layers but the model has {L}; give one list of FA KV groups per layer.")
        for i, layer in enumerate(self.fa_groups):
            if not isinstance(layer, list):
                fail(f"fa_groups[{i}] must be a list of KV group indices, got {layer!r}.")
            for g in layer:
                if isinstance(g, bool) or not isinstance(g, int):
                    fail(f"fa_groups[{i}] contains {g!r}; KV group indices are integers 0..{G - 1}.")
                if not 0 <= g < G:
                    fail(f"fa_groups[{i}] contains {g!r}, outside the model's KV groups 0..{G - 1}.")
            if len(set(layer)) != len(layer):
                fail(f"fa_groups[{i}]={layer} lists a group twice; each KV group is FA at most once.")
            if list(layer) != sorted(layer):
                fail(f"fa_groups[{i}]={layer} is not sorted; write the groups in increasing order.")
        for name, matrix in self.scores.items():
            ok = (
                isinstance(matrix, list)
                and len(matrix) == L
                and all(isinstance(row, list) and len(row) == G for row in matrix)
            )
            if not ok:
                fail(f"scores[{name!r}] must be a [{L}][{G}] matrix (layers × KV groups).")
            if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for row in matrix for s in row):
                fail(f"scores[{name!r}] must hold numbers only.")
        return self

    # ------------------------------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "head map") -> HeadMap:
        if not isinstance(data, dict):
            raise HeadMapError(f"{source}: expected a JSON object, got {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        required = {"model", "fa_groups", "method", "format_version"}
        unknown, missing = sorted(set(data) - known), sorted(required - set(data))
        if unknown:
            raise HeadMapError(f"{source}: unknown fields {unknown}; valid fields are {sorted(known)}.")
        if missing:
            raise HeadMapError(f"{source}: missing fields {missing}.")
        return cls(**data).validate(source=source)

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file in the same directory, then rename): never a half-written map."""
        self.validate(source=str(path))
        if is_object_store(path):  # an object's upload is atomic already
            run_path(path).write_text(_dumps(self.to_dict()))
            return
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".headmap-", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a head map is an artifact to share, like any file
        try:
            with os.fdopen(fd, "w") as f:
                f.write(_dumps(self.to_dict()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike, cfg: ModelConfig | None = None) -> HeadMap:
        """Read and validate a map (against ``cfg`` when given)."""
        path = os.fspath(path)
        try:
            data = json.loads(run_path(path).read_text())
        except FileNotFoundError:
            raise HeadMapError(f"head map file {path!r} does not exist; run head selection (stage 0) first.") from None
        except json.JSONDecodeError as e:
            raise HeadMapError(f"head map file {path!r} is not valid JSON ({e}).") from None
        head_map = cls.from_dict(data, source=path)
        return head_map.validate(cfg, source=path) if cfg is not None else head_map


def _dumps(data: dict[str, Any]) -> str:
    """Indented JSON with every innermost list (a layer's groups, a score row) on one line, for readable diffs."""
    text = json.dumps(data, indent=2)
    return re.sub(r"\[\s*([^\[\]{}]*?)\s*\]", lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text) + "\n"

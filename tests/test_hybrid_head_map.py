"""Head-map file, ratios, layer-wise maps, HybridConfig validation and cache sizes worked out by hand."""

import json
import os
import stat

import jax.numpy as jnp
import pytest
from flax import nnx
from model_shapes import QWEN3_1P7B, SMOLLM2_135M

from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.hybrid import HeadMap, HeadMapError, HybridConfig, build_model, cache_bytes, fa_budget, parse_ratio

CFG = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16
)
SMOL, QWEN3 = SMOLLM2_135M, QWEN3_1P7B


@pytest.mark.parametrize(
    "ratio,fraction",
    [
        ("7:1", 1 / 8),
        ("3:1", 1 / 4),
        ("1:1", 0.5),
        ("25%", 0.25),
        ("0.25", 0.25),
        (0.125, 0.125),
        ("1:0", 0.0),
        ("0:1", 1.0),
        (" 100% ", 1.0),
    ],
)
def test_parse_ratio(ratio, fraction):
    assert parse_ratio(ratio) == pytest.approx(fraction, abs=1e-15)


@pytest.mark.parametrize(
    "ratio", ["0:0", "-1:2", "150%", "1.5", "-0.1", "seven to one", "1:2:3", "", True, "nan", "inf:1"]
)
def test_parse_ratio_rejects_impossible(ratio):
    with pytest.raises(HeadMapError):
        parse_ratio(ratio)


def test_fa_budget():
    assert fa_budget(SMOL, "7:1", "global") == 11  # round(90 / 8 = 11.25)
    assert fa_budget(QWEN3, "7:1", "per_layer") == 1 and fa_budget(QWEN3, "7:1", "global") == 28
    with pytest.raises(HeadMapError, match="global"):
        fa_budget(SMOL, "25%", "per_layer")  # 0.75 groups per layer: rounding would make it 2:1, not 3:1
    assert fa_budget(SMOL, "3:1", "global") == 23  # round(22.5) half up
    with pytest.raises(HeadMapError, match="global"):
        fa_budget(SMOL, "7:1", "per_layer")  # 0.375 groups per layer rounds to 0
    with pytest.raises(HeadMapError, match="allocation"):
        fa_budget(SMOL, "7:1", "per_head")


def test_layerwise_every_pth_layer_ending_at_last():
    hm = HeadMap.layerwise(SMOL, ratio="3:1")
    fa_layers = [i for i, g in enumerate(hm.fa_groups) if g]
    assert fa_layers == [1, 5, 9, 13, 17, 21, 25, 29]
    assert all(g in ([], [0, 1, 2]) for g in hm.fa_groups)
    assert [i for i, g in enumerate(HeadMap.layerwise(SMOL, ratio="7:1").fa_groups) if g] == [5, 13, 21, 29]
    # 2:1 → FA fraction 1/3, period 3: 29, 26, ..., 2.
    assert [i for i, g in enumerate(HeadMap.layerwise(SMOL, ratio="2:1").fa_groups) if g] == list(range(2, 30, 3))
    # 3:2 → 2/5 is not 1/integer: round(0.4·30) = 12 layers evenly spaced, ending at the last.
    uneven = [i for i, g in enumerate(HeadMap.layerwise(SMOL, ratio="3:2").fa_groups) if g]
    assert len(uneven) == 12 and uneven[-1] == 29
    explicit = HeadMap.layerwise(CFG, fa_layers=[3, 1])
    assert explicit.fa_groups == [[], [0, 1], [], [0, 1]]
    with pytest.raises(HeadMapError, match="exactly one"):
        HeadMap.layerwise(CFG)
    with pytest.raises(HeadMapError, match="not an index"):
        HeadMap.layerwise(CFG, fa_layers=[4])


@pytest.mark.parametrize(
    "cfg,ratio,target,layers",
    [
        (QWEN3, "7:1", 28, 3),  # 28 / 8 = 3.5 layers: a tie, the fewer (24 groups), never more KV than HydraHead
        (QWEN3, "3:1", 56, 7),  # exact: 7 whole layers
        (QWEN3, "15:1", 14, 2),  # 1.75 → 2 layers (16 groups)
        (SMOL, "7:1", 11, 4),  # 11.25 → 11 groups; 11 / 3 = 3.67 → 4 layers (12 groups)
        (SMOL, "3:1", 23, 8),  # 22.5 → 23 groups; 7.67 → 8 layers (24 groups)
        (SMOL, "2:1", 30, 10),  # exact
        (SMOL, "29:1", 3, 1),  # exact: one layer
    ],
)
def test_layerwise_matches_the_hydrahead_kv_budget(cfg, ratio, target, layers):
    groups = cfg.num_kv_heads
    assert fa_budget(cfg, ratio, "global") == target
    # The nearest whole-layer count found by brute force (ties to the fewer layers).
    assert min(range(cfg.num_layers + 1), key=lambda m: (abs(m * groups - target), m)) == layers
    hm = HeadMap.layerwise(cfg, ratio=ratio)
    assert hm.num_fa_groups() == layers * groups
    assert all(g in ([], list(range(groups))) for g in hm.fa_groups) and hm.fa_groups[-1]
    assert hm.budget["target_fa_groups"] == target and hm.budget["fa_groups"] == layers * groups
    assert hm.budget["exact"] == (layers * groups == target)
    # Equal FA groups is equal KV bytes per token: 2 (k, v) · groups · D · itemsize.
    kv = cache_bytes(cfg, hm, context_len=1, dtype=jnp.bfloat16)["kv_bytes_per_token"]
    assert kv == layers * groups * 2 * cfg.head_dim * 2


def test_layerwise_budget_survives_save_and_load(tmp_path):
    hm = HeadMap.layerwise(QWEN3, ratio="7:1")
    hm.save(tmp_path / "lw.json")
    loaded = HeadMap.load(tmp_path / "lw.json", QWEN3)
    assert loaded.budget == hm.budget and "3.5" in loaded.budget["rule"]
    assert HeadMap.layerwise(CFG, fa_layers=[1]).budget == {}  # explicit layers: no budget was matched
    old = {k: v for k, v in HeadMap.all_fa(CFG).to_dict().items() if k != "budget"}
    assert HeadMap.from_dict(old).budget == {}  # maps written before the field load unchanged


def test_constructors_and_kv_ratio():
    assert HeadMap.all_fa(CFG).fa_groups == [[0, 1]] * 4 and HeadMap.all_fa(CFG).kv_bytes_ratio() == 1.0
    assert HeadMap.all_la(CFG).fa_groups == [[]] * 4 and HeadMap.all_la(CFG).kv_bytes_ratio() == 0.0
    hm = HeadMap.from_fa_groups(CFG, [[1, 0], [], [1], []], method="retrieval", target_ratio="3:1")
    assert hm.fa_groups == [[0, 1], [], [1], []]  # sorted on the way in
    assert hm.kv_bytes_ratio() == 3 / 8


def test_save_load_round_trip(tmp_path):
    scores = {"retrieval": [[0.5, 0.25], [0.0, 1.0], [0.125, 0.75], [0.3, 0.1]]}
    hm = HeadMap.from_fa_groups(
        CFG,
        [[0], [1], [], [0, 1]],
        method="retrieval",
        target_ratio="1:1",
        allocation="global",
        probe={"prompts": 8, "lengths": [256, 512]},
        scores=scores,
    )
    path = tmp_path / "sub" / "head_map.json"
    hm.save(path)
    data = json.loads(path.read_text())
    assert data["format_version"] == 1 and data["granularity"] == "kv_group"
    assert data["model"] == {"name": "custom", "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert [p.name for p in path.parent.iterdir()] == ["head_map.json"]  # no temporary file left behind
    umask = os.umask(0o022)  # the usual umask: a shared artifact is readable by group and others
    try:
        hm.save(path)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    loaded = HeadMap.load(path, CFG)
    assert loaded == hm


def _write(tmp_path, **changes):
    data = HeadMap.from_fa_groups(CFG, [[0], [1], [], [0, 1]], method="test").to_dict()
    for key, value in changes.items():
        data[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(fa_groups=[[0], [1], []]), r"fa_groups has 3 layers but the model has 4"),
        (dict(fa_groups=[[0], [2], [], []]), r"fa_groups\[1\] contains 2, outside the model's KV groups 0..1"),
        (dict(fa_groups=[[0, 0], [1], [], []]), r"fa_groups\[0\].*twice"),
        (dict(fa_groups=[[0.0], [1], [], []]), r"fa_groups\[0\] contains 0.0; KV group indices are integers"),
        (dict(fa_groups=[[1, 0], [], [], []]), r"not sorted"),
        (dict(format_version=2), r"format_version 2 is not supported"),
        (dict(granularity="head"), r"granularity"),
        (dict(allocation="uniform"), r"allocation"),
        (dict(target_ratio="0:0"), r"target_ratio"),
        (dict(scores={"retrieval": [[0.1, 0.2]] * 3}), r"scores\['retrieval'\] must be a \[4\]\[2\] matrix"),
        (dict(color="red"), r"unknown fields \['color'\]"),
    ],
)
def test_load_errors_name_file_and_field(tmp_path, changes, match):
    path = _write(tmp_path, **changes)
    with pytest.raises(HeadMapError, match=match) as info:
        HeadMap.load(path, CFG)
    assert str(path) in str(info.value)


def test_load_shape_mismatch_and_bad_files(tmp_path):
    path = _write(tmp_path)
    with pytest.raises(HeadMapError, match=r"model.num_heads=4 but the model has num_heads=8"):
        HeadMap.load(path, CFG.replace(num_heads=8))
    with pytest.raises(HeadMapError, match=r"model.num_layers=4 but the model has num_layers=5"):
        HeadMap.load(path, CFG.replace(num_layers=5))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(HeadMapError, match="not valid JSON"):
        HeadMap.load(tmp_path / "junk.json")
    with pytest.raises(HeadMapError, match="does not exist"):
        HeadMap.load(tmp_path / "missing.json")


def test_hybrid_config_validation_and_round_trip():
    hc = HybridConfig(fusion="la_only", fusion_granularity="channel", use_conv=False)
    assert HybridConfig.from_dict(hc.to_dict()) == hc
    for bad, match in [
        (dict(fusion="sum"), "fusion"),
        (dict(fusion_granularity="layer"), "fusion_granularity"),
        (dict(conv_size=1), "conv_size"),
        (dict(gdn_chunk_size=48), "power of two"),
        (dict(gdn_implementation="cuda"), "gdn_implementation"),
        (dict(use_conv="yes"), "use_conv"),
    ]:
        with pytest.raises(ConfigError, match=match):
            HybridConfig(**bad)
    with pytest.raises(ConfigError, match=r"Unknown HybridConfig fields \['colour'\]"):
        HybridConfig.from_dict({"colour": 1})


def test_cache_bytes_by_hand():
    # CFG: D=16, G=2 query heads per KV group. Map: layer FA groups 2, 1, 0, 0 → LA groups 0, 1, 2, 2.
    hm = HeadMap.from_fa_groups(CFG, [[0, 1], [1], [], []], method="test")
    got = cache_bytes(CFG, hm, context_len=100, batch=3, dtype=jnp.bfloat16)
    kv = 3 * 2 * (2 + 1) * 16 * 2  # batch · (k,v) · FA groups · D · bytes
    la_heads = 2 + 4 + 4  # LA query heads per layer: 2, 4, 4
    gdn = 3 * la_heads * 16 * 16 * 4  # fp32 state D×D per LA head
    conv = 3 * 3 * ((2 + 2) + (4 + 4) + (4 + 4)) * 16 * 2  # (W−1) · (q heads + 2 kv heads) · D · bytes
    assert got == {"kv_bytes_per_token": kv, "state_bytes": gdn + conv, "total_bytes": kv * 100 + gdn + conv}
    # Teacher: every group FA, no state.
    teacher = cache_bytes(CFG, context_len=10, dtype=jnp.float32)
    assert teacher == {"kv_bytes_per_token": 4 * 2 * 2 * 16 * 4, "state_bytes": 0, "total_bytes": 10 * 4 * 256}
    # A built model reports the same, and equals what init_cache really allocates.
    model = nnx.eval_shape(lambda: build_model(CFG, hm, HybridConfig(), nnx.Rngs(0)))  # shapes suffice
    from_model = cache_bytes(model, context_len=100, batch=3, dtype=jnp.bfloat16)
    assert from_model == got
    cache = model.init_cache(3, 100, jnp.bfloat16)
    allocated = sum(x.nbytes for layer in cache["layers"] for x in layer.values())
    assert allocated == got["total_bytes"]


def test_smollm2_7to1_global_kv_bytes():
    # 11 of 90 groups FA (global allocation), e.g. one group in each of 11 layers.
    groups = [[i % 3] if i >= 19 else [] for i in range(30)]
    hm = HeadMap.from_fa_groups(SMOL, groups, method="test", target_ratio="7:1", allocation="global")
    assert hm.num_fa_groups() == 11
    hybrid = cache_bytes(SMOL, hm, context_len=4096, dtype=jnp.bfloat16)
    teacher = cache_bytes(SMOL, context_len=4096, dtype=jnp.bfloat16)
    assert teacher["kv_bytes_per_token"] == 30 * 3 * 2 * 64 * 2
    assert hybrid["kv_bytes_per_token"] == 11 * 2 * 64 * 2
    assert hybrid["kv_bytes_per_token"] * 7 <= teacher["kv_bytes_per_token"]

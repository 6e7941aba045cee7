"""Issue 19's smoke run as a test: the paper recipe ``configs/qwen3_1p7b_hydrahead.py:7to1`` end to end through
train.py on a random 2-layer Qwen3-1.7B-shaped bf16 teacher written as a Hugging Face folder (vocab 151,936 rows,
byte-level BPE with ``<|im_end|>`` as EOS), two steps per stage. scripts/qwen3_smoke.py writes the inputs and
holds the smoke overrides; this test runs train.py itself and checks the run from its files.

About 7 minutes on 2 CPU cores; train.py needs ~14 GB of RAM (f32 master weights and AdamW moments of the 0.41 B
parameters at these shapes, see the script's docstring)."""

import json
import math
import sys

import pytest
from model_shapes import QWEN3_1P7B
from train_helpers import ROOT, run_train

sys.path.insert(0, str(ROOT / "scripts"))
import qwen3_smoke  # noqa: E402

STEPS = 2
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "qk_norm")


@pytest.mark.slow
def test_paper_recipe_7to1_end_to_end_on_a_qwen3_1p7b_shaped_teacher(tmp_path):
    teacher, corpus = qwen3_smoke.write_inputs(tmp_path / "inputs")
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        *qwen3_smoke.train_overrides(teacher, corpus, steps=STEPS),
        config=qwen3_smoke.RECIPE,
        timeout=3000,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]

    # The teacher the loader read (as the export records it) has Qwen3-1.7B's layer shapes, 2 layers, bf16.
    model = json.loads((run_dir / "final" / "model_config.json").read_text())
    assert {k: model[k] for k in SHAPE_FIELDS} == {k: getattr(QWEN3_1P7B, k) for k in SHAPE_FIELDS}, model
    assert (model["num_layers"], model["architecture"], model["param_dtype"]) == (2, "qwen3", "bfloat16"), model
    assert (model["rope_theta"], model["tie_word_embeddings"]) == (1_000_000.0, True), model  # as Qwen3-1.7B's

    # Selection ran the recipe's own method on the teacher: 7:1 per layer = 1 FA group of 8 in each of 2 layers.
    head_map = json.loads((run_dir / "head_map.json").read_text())
    assert head_map["method"] == "combined" and head_map["allocation"] == "per_layer"
    assert [len(groups) for groups in head_map["fa_groups"]] == [1, 1]
    # The paper preset supplied the probe settings the smoke overrides leave alone.
    assert head_map["probe"]["settings"]["ablation_scope"] == "all"

    # Every stage took its steps with finite losses and printed (and wrote) its compiled memory per device.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for stage in qwen3_smoke.STAGE_DIRS:
        steps = [row for row in rows if row["stage"] == stage]
        assert [row["step"] for row in steps] == list(range(1, STEPS + 1)), stage
        assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in steps), steps
        assert f"[{stage}] compiled step memory per device" in output, stage
        memory = json.loads((run_dir / stage / "memory.json").read_text())
        assert memory["peak"] > memory["arguments"] > 0, memory
    # The script's own pass/fail check agrees.
    qwen3_smoke.verify(run_dir, output, steps=STEPS)

    # The export loads as a user loads it, with bf16 parameters (compute dtype; the f32 master stays in training).
    assert qwen3_smoke.export_param_dtypes(run_dir / "final") == {"bfloat16"}

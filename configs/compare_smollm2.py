"""Issue 17's equal-budget comparison on SmolLM2-135M: 13 variants of the conversion, one command.

    python -m hydrahead_jax.experiments.compare --config configs/compare_smollm2.py --workdir runs/compare
    make compare                                  # the same; COMPARE_ARGS=--config.budget_scale=1.0 for more

Every variant starts from the `make demo` recipe (configs/smollm2_hydrahead.py: HydraHead 7:1, combined probe
scores, global allocation, fusion "both") with every stage's steps scaled by ``budget_scale`` (0.7: stage 1
70 × 4 × 256, stage 2 28 × 2 × 512, stage 3 14 × 1 × 1024 tokens = 71,680 + 28,672 + 14,336 training tokens per
variant), the same data order and seeds; only the overrides below differ. The teacher is probed once (stage 0);
the retrieval / ablation / combined variants get head maps derived from its saved scores.

KV budgets on SmolLM2 (30 layers × 3 KV groups = 90): 7:1 global keeps round(90/8) = 11 groups FA; 25 % (3:1)
keeps 23 (global) and layer-wise 3:1 whole layers; layer-wise 7:1 the nearest whole-layer budget. Per-layer
allocation needs FA fraction × 3 groups to be a whole number, so of the issue's ratios only 2:1 (one FA group per
layer = 30 groups) allows it: per-layer vs global is compared at 2:1, where both keep 30 groups.

Time estimate on the 2-core development box (f32; the demo's 15.4 min = select 1, stage 1 3.4, stage 2 5.7,
stage 3 2.8, eval 2.0 min, with about half a minute of compilation per stage that does not scale with steps):
per variant stage 1 ≈ 2.5, stage 2 ≈ 4.2, stage 3 ≈ 2.1 min, at-init + final evaluation ≈ 1.5 min, so ≈ 10.3 min;
13 variants ≈ 134 min, plus the probe (≈ 1 min) and the teacher's evaluation (≈ 1 min): about 2.3 hours. A killed
comparison continues where it stopped when rerun with the same command.
"""

from ml_collections import ConfigDict

from configs import smollm2_hydrahead

_HYDRAHEAD = {"selection.method": "combined"}


def _random(seed: int) -> dict:
    return {
        "name": f"random_7to1_s{seed}",
        "group": "random_7to1",
        "overrides": {"selection.method": "random", "selection.ratio": "7:1", "selection.seed": seed},
    }


def get_config(arg: str | None = None):
    c = ConfigDict()
    base = smollm2_hydrahead.get_config()
    base.logging.progress = False  # one line per stage and variant from the comparison instead of 15 × 3 bars
    # Held-out points at the scaled budget (30 / 12 / 6 steps): about four per stage, for the loss curves.
    base.stage1.heldout_every = 10
    base.stage2.heldout_every = 4
    base.stage3.heldout_every = 3
    c.base = base
    c.budget_scale = 0.3
    # In order of what the comparison must decide first (a comparison stopped part-way has answered the most):
    # the default, the fitted initialisation, the paper's central claim (7:1 head-level vs 3:1 layer-wise, random
    # heads), then the probe scores, fusion modes, allocation and the 25 % budget.
    c.variants = [
        {"name": "hydrahead_7to1", "overrides": dict(_HYDRAHEAD)},
        # Initialisation (issue 17 item 4): γ and the offset μ fitted by least squares to the teacher's head
        # outputs on the calibration batch (hybrid/fusion.py) instead of γ = the teacher head's RMS.
        {"name": "hydrahead_7to1_fit", "overrides": {"hybrid.fusion_init": "fit", "hybrid.fusion_bias": True}},
        {"name": "layerwise_3to1", "overrides": {"selection.method": "layerwise", "selection.ratio": "3:1"}},
        _random(0),
        {"name": "layerwise_7to1", "overrides": {"selection.method": "layerwise", "selection.ratio": "7:1"}},
        _random(1),
        _random(2),
        {
            "name": "hydrahead_7to1_fit_la_only",
            "overrides": {"hybrid.fusion": "la_only", "hybrid.fusion_init": "fit", "hybrid.fusion_bias": True},
        },
        {"name": "hydrahead_7to1_retrieval", "overrides": {"selection.method": "retrieval"}},
        {"name": "hydrahead_7to1_ablation", "overrides": {"selection.method": "ablation"}},
        {"name": "hydrahead_7to1_fusion_la_only", "overrides": {"hybrid.fusion": "la_only"}},
        {"name": "hydrahead_7to1_fusion_none", "overrides": {"hybrid.fusion": "none"}},
        {"name": "hydrahead_25pct", "overrides": {"selection.ratio": "25%"}},
        {"name": "hydrahead_2to1_global", "overrides": {"selection.ratio": "2:1", "selection.allocation": "global"}},
        {
            "name": "hydrahead_2to1_per_layer",
            "overrides": {"selection.ratio": "2:1", "selection.allocation": "per_layer"},
        },
    ]
    # The same evaluation for every model: NIAH (2 depths) and passkey at 512 and 1K tokens, perplexity and
    # agreement with the teacher on one 512-token window of wiki-val and of news, and the held-out data rows.
    c.eval = ConfigDict(
        dict(
            suite="niah,passkey,ppl,agreement",
            lengths=(512, 1024),
            ppl_length=512,
            ppl_windows=1,
            samples=1,
            depths=(0.1, 0.9),
            data_rows=4,
            data_seq_len=512,
        )
    )
    return c

"""Issue 29's equal-budget comparison of the recipe changes on SmolLM2-135M, each alone and combined, one command:

    python -m hydrahead_jax.experiments.compare --config configs/compare_recipe_smollm2.py --workdir runs/recipe
    ... --only=recipe_base,fusion_la_scale          # a subset (one variant is ~15-20 CPU-minutes alone)
    ... --config.base.seed=1 --only=...             # the winners on a second data order
    ... --config.eval.suite=ppl,agreement --config.eval.ppl_windows=8   # text only, 8 windows per source: report.md
                                                    # gives KL / top-1 intervals and paired differences from the base

Every variant starts from the `make demo` recipe as it was measured before these changes (configs/smollm2_hydrahead.py
with fusion "both", the fitted fusion initialisation with offset μ, GDN dt spread by head index and β = 0.5, warm-up
from lr 0, one learning rate per stage, synthetic rows with loss on their answer tokens only) at 0.3 of its steps
(the budget of configs/compare_smollm2.py), the same data order and seeds; only the overrides below differ:

    fusion_la_scale   the kept FA heads pass through as the teacher's; the LA heads' gated output scaled (+ μ)
                      without a second RMS normalisation (hybrid/attention.py)
    gdn_teacher       each LA head's decay from its teacher head's mean attention distance, β from its attention
                      entropy, the β offset a trainable per-head parameter (hybrid/gdn_init.py)
    qk_map            identity-initialised per-head maps on the LA heads' q and k, trained in stage 1
    la_qkv            stage 1 also trains the LA groups' slices of the copied q/k/v at 0.1 · lr (the FA groups'
                      slices stay the teacher's; train="new+la_qkv")
    head_targets      stage 1 holds each head's output before o_proj to its teacher head's (align_target="heads")
    warmup            warm-up over 10 % of each stage's steps from 0.1 · lr (instead of a fixed count from 0)
    lr_groups         stages 2-3: the copied non-attention weights (MLPs, norms, embeddings) at 0.1 · lr
    retrieval_rows    stage 3's synthetic rows with the KL/CE over the whole row (synthetic_loss="full")
    combined          all of the above (not window64)
    winners           combined without the two changes that lost alone on both data orders (head_targets,
                      lr_groups)
    window64          beyond the paper: fusion_la_scale with each LA head also attending to its first 4 and last 64
                      tokens with its teacher head's softmax, the fused GDN heads added (HybridConfig.la_window)

Retrieval is evaluated with power: NIAH at 2 depths × 50 prompts (100 per length), passkey and key-value 50 per
length, at 512 and 1K tokens; report.md gives each accuracy with its Wilson 95 % interval. The teacher's
evaluation took 1174 s on the 2-core box (2026-12-02), about 2 s per prompt; a student's costs about as much.
"""

from configs import compare_smollm2

_WARMUP = {f"stage{i}.{k}": v for i in (1, 2, 3) for k, v in (("warmup_fraction", 0.1), ("warmup_start_ratio", 0.1))}
_LR_GROUPS = {"stage2.lr_scale_other": 0.1, "stage3.lr_scale_other": 0.1}
CHANGES = {
    "fusion_la_scale": {"hybrid.fusion": "la_scale"},
    "gdn_teacher": {"hybrid.gdn_init": "teacher", "hybrid.gdn_beta_bias": True, "hybrid.gdn_dt_max": 1.0},
    "qk_map": {"hybrid.gdn_qk_map": True},
    "la_qkv": {"stage1.train": "new+la_qkv", "stage1.lr_scale_attention": 0.1},
    "head_targets": {"stage1.align_target": "heads"},
    "warmup": _WARMUP,
    "lr_groups": _LR_GROUPS,
    "retrieval_rows": {"stage3.synthetic_loss": "full"},
}

# Worse than recipe_base alone on held-out news on both data orders (bench/RESULTS.md, "Paired intervals").
_LOST_ALONE = ("head_targets", "lr_groups")


def together(*names: str) -> dict:
    """The overrides of the named CHANGES applied together."""
    out = {}
    for name in names:
        out.update(CHANGES[name])
    return out


def get_config(arg: str | None = None):
    c = compare_smollm2.get_config(arg)
    base = c.base
    # The demo recipe as measured before issue 29 (pinned: the library's defaults have moved since).
    base.hybrid.fusion = "both"
    base.hybrid.fusion_init = "fit"
    base.hybrid.fusion_bias = True
    c.variants = [{"name": "recipe_base", "overrides": {}}]
    c.variants += [{"name": name, "overrides": dict(changes)} for name, changes in CHANGES.items()]
    c.variants.append({"name": "combined", "overrides": together(*CHANGES)})
    c.variants.append({"name": "winners", "overrides": together(*(n for n in CHANGES if n not in _LOST_ALONE))})
    window = {**CHANGES["fusion_la_scale"], "hybrid.la_window": 64, "hybrid.la_sinks": 4}
    c.variants.append({"name": "window64", "overrides": window})
    c.eval.suite = "niah,passkey,kv,ppl,agreement"
    c.eval.samples = 50
    return c

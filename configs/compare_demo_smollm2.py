"""Issue 29's adoption test: the recipe changes that won at the comparison's budget, tried on `make demo`'s own
recipe at its full budget, one command:

    python -m hydrahead_jax.experiments.compare --config configs/compare_demo_smollm2.py --workdir runs/demo_cmp
    ... --config.base.seed=1                 # another data order

The base is what `make demo` trained before the adoption (configs/smollm2_hydrahead.py:streaming64, 25 / 20 / 5
steps, with the recipe's stage-1 and warm-up settings as they were); the comparison's paired windows then say whether
the changes that help the paper's pure Gated DeltaNet student also help the demo's streaming one, which starts 0.05
nats from its teacher instead of 2.2. Variants:

    demo              the recipe as `make demo` ran it until 2026-12-05 (bench/results/demo_streaming64/make_demo)
    demo_winners      the winners of configs/compare_recipe_smollm2.py that the demo does not have yet: stage 1 also
                      learns the LA heads' matching (identity-initialised per-head maps on their q and k,
                      hybrid.gdn_qk_map; the LA groups' slices of the copied q/k/v at 0.1 · lr, train="new+la_qkv")
                      and every stage warms up over 10 % of its steps from 0.1 · lr

Evaluated on text (8 windows of 512 tokens per held-out source, paired by window); retrieval of the adopted recipe
is measured by eval.py's demo suite on its exported model. Measured 2026-12-05 (bench/results/compare_demo_smollm2/):
demo_winners is closer on news by 0.005 [0.003, 0.006] nats/token and on wiki-val by 0.005 [0.004, 0.006], ends
every stage's held-out batch lower, and is what `make demo` trains since (ADOPTED).
"""

from ml_collections import ConfigDict

from configs import smollm2_hydrahead
from configs.compare_recipe_smollm2 import together
from configs.compare_smollm2 import without_issue29_winners

ADOPTED = "demo_winners"  # the variant that is configs/smollm2_hydrahead.py:streaming64 now


def get_config(arg: str | None = None):
    c = ConfigDict()
    base = smollm2_hydrahead.get_config("streaming64")
    without_issue29_winners(base, warmup_steps=(8, 2, 1))
    base.logging.progress = False  # one line per stage and variant from the comparison
    c.base = base
    c.budget_scale = 1.0
    c.keep_checkpoints = False
    c.variants = [
        {"name": "demo", "overrides": {}},
        {"name": "demo_winners", "overrides": together("qk_map", "la_qkv", "warmup")},
    ]
    c.eval = ConfigDict({"suite": "ppl,agreement", "ppl_windows": 8, "lengths": "512,1k"})
    return c

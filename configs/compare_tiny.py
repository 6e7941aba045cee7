"""A three-variant comparison on the random tiny teacher and copy data (tests, smoke runs; about a minute).

The random teacher has no tokenizer, so only the held-out data rows are evaluated (no NIAH/passkey/text suite):
``python -m hydrahead_jax.experiments.compare --config configs/compare_tiny.py --workdir runs/compare_tiny``.
"""

from ml_collections import ConfigDict

from configs import tiny


def get_config(arg: str | None = None):
    c = ConfigDict()
    base = tiny.get_config()
    for key in ("stage1", "stage2", "stage3"):
        base[key].steps = 2
        base[key].checkpoint_every = 2
    base.logging.tensorboard = False
    c.base = base
    c.budget_scale = 1.0
    # layerwise 1:1 keeps one whole layer (2 of 4 KV groups) FA; random 3:1 global keeps 1 of 4, under two seeds
    c.variants = [
        {"name": "layerwise_1to1", "overrides": {}},
        {
            "name": "random_3to1_s0",
            "group": "random_3to1",
            "overrides": {"selection.method": "random", "selection.ratio": "3:1", "selection.allocation": "global"},
        },
        {
            "name": "random_3to1_s1",
            "group": "random_3to1",
            "overrides": {
                "selection.method": "random",
                "selection.ratio": "3:1",
                "selection.allocation": "global",
                "selection.seed": 1,
            },
        },
    ]
    c.eval = ConfigDict(dict(data_rows=2, data_seq_len=32))  # the default suite: skipped (no tokenizer), said so
    return c

"""A random tiny teacher and the seeded 'copy' data source: the whole pipeline in seconds (tests, smoke runs)."""

from configs.common import base, stage


def get_config(arg: str | None = None):
    c = base()
    c.teacher.source = "random"
    c.teacher.model.update(
        dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=8,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            name="tiny-random",
        )
    )
    c.data.source = "copy"
    c.selection.method = "layerwise"
    c.selection.ratio = "1:1"
    c.selection.allocation = "per_layer"
    c.hybrid.gdn_chunk_size = 16
    c.hybrid_calibration_rows = 2
    common = dict(seq_len=32, batch_size=4, warmup_steps=2, checkpoint_every=2, loss_chunk=16)
    c.stage1 = stage("stage1", steps=6, lr=3e-3, train="new", **common)
    c.stage2 = stage("stage2", steps=6, lr=1e-3, **common)
    c.stage3 = stage("stage3", steps=6, lr=1e-3, ce_weight=1.0, **dict(common, seq_len=64))
    c.logging.progress = False
    return c

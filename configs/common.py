"""Shared skeleton of every recipe: one place that lists every config key (unknown keys are refused)."""

from ml_collections import ConfigDict

from hydrahead_jax.selection import SelectionConfig


def stage(
    *,
    steps=0,
    tokens=0,
    seq_len=256,
    batch_size=8,
    lr=1e-3,
    warmup_steps=10,
    end_lr_ratio=0.1,
    weight_decay=0.0,
    clip_norm=1.0,
    train="all",
    loss_chunk=512,
    loss_chunk_rows=0,
    micro_batches=1,
    master_dtype="float32",
    checkpoint_every=50,
    keep_checkpoints=2,
    synthetic_rate=0.0,
    kl_weight=0.0,
    ce_weight=0.0,
    temperature=1.0,
    remat=False,
) -> ConfigDict:
    """One training stage: budget (steps, or tokens when steps == 0), data shape, AdamW + warmup/cosine schedule,
    which parameters train ('new': GDN + fusion only; 'all'), loss weights, checkpoint interval, and ``remat``:
    recompute each student layer in the backward pass (keeps one layer's activations instead of all of them, for
    about one more forward pass of compute). Memory: ``micro_batches`` accumulates the f32 gradient over that many
    row groups per step (same loss and gradient as the whole batch); the logits loss works on tiles of
    ``loss_chunk_rows`` rows (0: all rows of a micro-batch) × ``loss_chunk`` tokens. ``master_dtype``: "float32"
    trains f32 master parameters and AdamW moments while the model computes in its own dtype; "param" keeps them
    in the model's parameter dtype."""
    return ConfigDict(
        dict(
            steps=steps,
            tokens=tokens,
            seq_len=seq_len,
            batch_size=batch_size,
            lr=lr,
            warmup_steps=warmup_steps,
            end_lr_ratio=end_lr_ratio,
            weight_decay=weight_decay,
            clip_norm=clip_norm,
            train=train,
            loss_chunk=loss_chunk,
            loss_chunk_rows=loss_chunk_rows,
            micro_batches=micro_batches,
            master_dtype=master_dtype,
            checkpoint_every=checkpoint_every,
            keep_checkpoints=keep_checkpoints,
            synthetic_rate=synthetic_rate,
            kl_weight=kl_weight,
            ce_weight=ce_weight,
            temperature=temperature,
            remat=remat,
        )
    )


def base() -> ConfigDict:
    c = ConfigDict()
    c.seed = 0
    c.distributed = False  # True: jax.distributed.initialize() (multi-host GPU / TPU pods)
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1))  # -1 = all remaining devices
    # teacher.source: "random" (teacher.model gives the ModelConfig), "smollm2-135m", a .gguf, or an HF folder
    c.teacher = ConfigDict(dict(source="random", dtype="float32", seed=0, model=ConfigDict()))
    c.data = ConfigDict(
        dict(
            source="enwiki",
            validation_fraction=0.02,
            txt_split="file",
            text_field="text",
            num_threads=2,
            prefetch=8,
            copy_repeats=4,
        )
    )
    # Stage 0: every SelectionConfig field (hydrahead_jax.selection), plus "given" + head_map_path for a map
    # file and "all_fa" / "all_la"; preset "paper" = the longer probes.
    c.selection = ConfigDict(dict(SelectionConfig().to_dict(), preset="demo", head_map_path=""))
    c.hybrid = ConfigDict(
        dict(
            use_conv=True,
            conv_size=4,
            use_output_gate=True,
            la_rope=False,
            fusion="both",
            fusion_granularity="head",
            gdn_chunk_size=64,
            gdn_implementation="auto",
            attention_implementation="auto",
        )
    )
    c.hybrid_calibration_rows = 4
    c.stage1 = stage(train="new", lr=1e-3)
    c.stage2 = stage(lr=1e-4)
    c.stage3 = stage(lr=3e-5, ce_weight=1.0)
    c.logging = ConfigDict(dict(tensorboard=True, progress=True, async_save=True))
    return c

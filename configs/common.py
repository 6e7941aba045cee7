"""Shared skeleton of every recipe: every config key with its default, from hydrahead_jax.run_config (the one
place defaults live). train.py converts the finished recipe into a validated RunConfig; unknown keys are refused.

Selection settings start unset (None): an unset one takes the value of ``selection.preset`` ("demo", or "paper"
for the longer probes); a value set here, in a recipe or on the command line always wins. List settings take a
comma-separated value on the command line: ``--config.selection.niah_lengths=1024,2048``.
"""

from ml_collections import ConfigDict, config_dict

from hydrahead_jax.run_config import recipe_defaults, stage_defaults
from hydrahead_jax.selection import SelectionConfig


def stage(config_key: str, **settings) -> ConfigDict:
    """The section of stage ``config_key`` ("stage1" ...): StageConfig's defaults (and the stage table's
    ``train``), then ``settings``. See hydrahead_jax.run_config.StageConfig for what each setting does."""
    return ConfigDict(stage_defaults(config_key, **settings))


def base() -> ConfigDict:
    defaults = recipe_defaults()
    selection = defaults.pop("selection")
    c = ConfigDict(defaults)
    # -1 in mesh.data = all remaining devices. teacher.source: "random" (teacher.model gives the ModelConfig),
    # "smollm2-135m", a .gguf, or a Hugging Face folder. Stage 0: every SelectionConfig field (typed placeholders,
    # so each can be overridden from the command line), plus method "given" + head_map_path, "all_fa", "all_la".
    types = {f: type(v) for f, v in SelectionConfig().to_dict().items()}
    types = {f: tuple if t is list else t for f, t in types.items()}
    c.selection = ConfigDict({k: config_dict.placeholder(types[k]) if v is None else v for k, v in selection.items()})
    return c


def measured_conversion(c: ConfigDict) -> None:
    """The conversion settings that beat HybridConfig's and StageConfig's defaults where they were measured
    (SmolLM2-135M on the Wikipedia extract, equal budgets; bench/RESULTS.md "Initialisation" and "Paired
    intervals"), set on recipe ``c`` after its stages:

    * fusion scales fitted by least squares with a per-channel offset μ (hybrid/fusion.py) instead of the paper's
      γ = the teacher head's output RMS: KL(teacher ‖ student) on held-out news at init 7.3 → 2.45 nats/token, and
      ahead after every stage at the same budget (held-out KL after stages 1 / 2 / 3: 3.33 / 1.92 / 1.87 with the
      paper's init, 2.13 / 1.70 / 1.64 fitted);
    * the kept FA heads pass through as the teacher's (fusion la_scale) and each LA head's decay and β start from
      its teacher head's attention distance and entropy (gdn_init "teacher", the β offset a trained per-head
      parameter, dt up to 1.0 so heads that read the last few tokens get short memories): at init 2.23 nats/token
      and top-1 25.0 % against 2.45 / 21.4 % for fusion "both" with the spread GDN init;
    * stage 1 learns the LA heads' matching: identity-initialised per-head maps on their q and k (gdn_qk_map) and
      the LA groups' slices of the copied q/k/v at 0.1 · lr (train "new+la_qkv"; the FA groups' stay the
      teacher's); every stage warms up over 10 % of its steps from 0.1 · lr; stage 3's synthetic rows carry the
      loss over the whole row. Together, at the comparison's budget on two data orders
      (configs/compare_recipe_smollm2.py "winners"): news KL −0.385 [−0.442, −0.293] and −0.404 [−0.503, −0.291]
      from the recipe before, closer than every single change.
    """
    c.hybrid.update(
        fusion="la_scale",
        fusion_init="fit",
        fusion_bias=True,
        gdn_init="teacher",
        gdn_beta_bias=True,
        gdn_dt_max=1.0,
        gdn_qk_map=True,
    )
    c.stage1.update(train="new+la_qkv", lr_scale_attention=0.1)
    for section in (c.stage1, c.stage2, c.stage3):
        section.update(warmup_fraction=0.1, warmup_start_ratio=0.1)
    c.stage3.synthetic_loss = "full"

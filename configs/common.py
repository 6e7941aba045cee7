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

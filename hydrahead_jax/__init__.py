"""hydrahead-jax: convert a pretrained decoder LLM into a head-level hybrid of softmax and Gated DeltaNet attention."""

from hydrahead_jax.config import ConfigError, ModelConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "load_hydrahead"]


def load_hydrahead(path, *, device=None):
    """(model, tokenizer) from an exported HydraHead folder (``WORKDIR/final``); see hydrahead_jax/export.py."""
    # Imported here so that `import hydrahead_jax` stays light (no Orbax / grain until a model is loaded).
    from hydrahead_jax.export import load_hydrahead as _load

    return _load(path, device=device)

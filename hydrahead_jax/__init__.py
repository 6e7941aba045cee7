"""hydrahead-jax: convert a pretrained decoder LLM into a head-level hybrid of softmax and Gated DeltaNet attention."""
from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.training.export import load_hydrahead

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "load_hydrahead"]

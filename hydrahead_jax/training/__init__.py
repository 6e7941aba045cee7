"""Stages 1-3 of the conversion: losses, sharding, checkpoints, the stage loop, the pipeline and the export."""

from hydrahead_jax.training.export import export_final, load_hydrahead

__all__ = ["export_final", "load_hydrahead"]

"""Stages 1-3 of the conversion: losses, the train step, sharding, checkpoints, the stage loop and the pipeline.

The finished model is written and read by ``hydrahead_jax.export`` (outside this package, so loading a model
needs no training code); the stage table and the typed config are in ``hydrahead_jax.run_config``.
"""

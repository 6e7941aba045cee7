"""The PyTorch side of ``python -m hydrahead_jax.export_hf``: ``configuration_hydrahead.py`` and
``modeling_hydrahead.py`` are copied into every exported folder, where transformers imports them with
``trust_remote_code=True``. They import torch and transformers only, never ``hydrahead_jax``: an exported folder
loads on a machine without this project."""

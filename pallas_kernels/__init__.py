"""Standalone JAX / Pallas kernels used by hydrahead-jax (never imports hydrahead_jax)."""

"""The shapes of the real teachers the recipes target, for tests that need only a ModelConfig (no weights)."""

from hydrahead_jax.config import ModelConfig

SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    name="SmolLM2-135M",
)
QWEN3_1P7B = ModelConfig(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    qk_norm=True,
    name="Qwen3-1.7B",
)

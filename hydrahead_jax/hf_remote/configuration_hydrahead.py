"""Configuration of an exported HydraHead model (written by hydrahead-jax's ``export_hf``; loads without it).

A Llama / Qwen2 / Qwen3-shaped decoder whose layer i keeps ``layer_fa_groups[i]`` of its KV groups as softmax
attention (stored first in its q/k/v/o weights) and runs the others as Gated DeltaNet heads, as set by ``hybrid``
(the ``HybridConfig`` the model was trained with). See modeling_hydrahead.py for the equations.
"""

from transformers import PretrainedConfig


class HydraHeadConfig(PretrainedConfig):
    model_type = "hydrahead"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 9,
        num_key_value_heads: int = 3,
        head_dim: int = 64,
        max_position_embeddings: int = 8192,
        rms_norm_eps: float = 1e-5,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        qk_norm: bool = False,
        tie_word_embeddings: bool = False,
        layer_fa_groups: list | None = None,
        kv_group_order: list | None = None,
        hybrid: dict | None = None,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        # per layer: its number of softmax (FA) KV groups, stored first; all of them = the teacher's layer
        self.layer_fa_groups = list(layer_fa_groups or [num_key_value_heads] * num_hidden_layers)
        # per layer: the teacher's KV group each stored group was (provenance; the weights are already permuted)
        self.kv_group_order = kv_group_order
        self.hybrid = dict(hybrid or {})
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

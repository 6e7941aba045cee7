"""Context parallelism: attention over a row whose tokens are split over the ``sequence`` mesh axis.

The functions here run per device inside ``jax.shard_map`` (``hydrahead_jax.models.kernel_sharding.kernel_call``
with a layout naming "sequence"), with the sequence mesh axes as the axis name of their collectives.

- ``layout``: which tokens each device holds (contiguous or load-balanced zig-zag chunks).
- ``attention``: causal softmax attention of the FA heads (``sequence_parallel_attention``: all-gather or ring).
- ``gated_delta``: the Gated DeltaNet heads' rule (states folded across devices) and causal conv (halo).
"""

from hydrahead_jax.context_parallel.attention import sequence_parallel_attention
from hydrahead_jax.context_parallel.causal_conv import sequence_parallel_causal_conv
from hydrahead_jax.context_parallel.gated_delta import sequence_parallel_gated_delta_rule
from hydrahead_jax.context_parallel.layout import (
    LAYOUTS,
    MODEL_LAYOUT,
    check_length,
    chunk_order,
    chunks_per_shard,
    from_layout,
    shard_chunks,
    to_layout,
)

__all__ = [
    "LAYOUTS",
    "MODEL_LAYOUT",
    "check_length",
    "chunk_order",
    "chunks_per_shard",
    "from_layout",
    "shard_chunks",
    "to_layout",
    "sequence_parallel_attention",
    "sequence_parallel_causal_conv",
    "sequence_parallel_gated_delta_rule",
]

"""Decode-cache sizes of a model variant: KV bytes that grow with context vs constant Gated DeltaNet state.

Per layer l with n_FA(l) FA groups and H_LA(l) = (G_total − n_FA(l))·(Hq/Hkv) LA query heads, head dim D:

    kv_bytes_per_token = batch · Σ_l 2 · n_FA(l) · D · itemsize(dtype)                  (k and v)
    state_bytes        = batch · Σ_l [H_LA(l) · D · D · 4                                (fp32 GDN state)
                                      + (conv_size − 1) · (H_LA(l) + 2 n_LA(l)) · D · itemsize    (conv state)
                                      + 2 · (la_sinks + la_window) · n_LA(l) · D · itemsize]       (window, if on)
    total_bytes        = kv_bytes_per_token · context_len + state_bytes

These are exactly the sizes of the arrays ``model.init_cache(batch, context_len, dtype)`` allocates (less the
int32 position counter).
"""

from __future__ import annotations

import jax.numpy as jnp

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.hybrid.attention import HydraHeadAttention
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.hybrid.head_map import HeadMap


def _layout(model_or_cfg, head_map, hybrid_cfg):
    """(cfg, FA groups per layer, hybrid cfg or None per layer) of a model, or of a cfg + head map."""
    if isinstance(model_or_cfg, ModelConfig):
        cfg = model_or_cfg
        head_map = HeadMap.all_fa(cfg) if head_map is None else head_map.validate(cfg)
        hybrid_cfg = HybridConfig() if hybrid_cfg is None else hybrid_cfg
        groups = [tuple(layer) for layer in head_map.fa_groups]
        return cfg, groups, [hybrid_cfg if len(g) < cfg.num_kv_heads else None for g in groups]
    if head_map is not None or hybrid_cfg is not None:
        raise ValueError(
            "cache_bytes(model): the model already fixes its head map and HybridConfig; pass "
            "head_map/hybrid_cfg only with a ModelConfig."
        )
    cfg = model_or_cfg.cfg
    attn = model_or_cfg.layers.self_attn
    # A layer's kind is its FA-group count (the teacher's attention keeps every group FA).
    if not isinstance(attn, HydraHeadAttention):
        return cfg, [tuple(range(cfg.num_kv_heads))] * cfg.num_layers, [None] * cfg.num_layers
    groups = [order[:f] for order, f in zip(model_or_cfg.group_order, model_or_cfg.layer_kinds)]
    return cfg, groups, [attn.hybrid_cfg if attn.is_hybrid(f) else None for f in model_or_cfg.layer_kinds]


def cache_bytes(
    model_or_cfg,
    head_map: HeadMap | None = None,
    *,
    context_len: int,
    batch: int = 1,
    dtype=None,
    hybrid_cfg: HybridConfig | None = None,
) -> dict[str, int]:
    """Decode-cache bytes of a model (or of ``cfg`` with ``head_map``, default the teacher's all-FA map).

    dtype: KV/conv cache dtype (default the config's compute dtype); the GDN state is always fp32.
    Returns {"kv_bytes_per_token", "state_bytes", "total_bytes"} (kv per token counts the whole batch).
    """
    cfg, fa_groups, hybrids = _layout(model_or_cfg, head_map, hybrid_cfg)
    if context_len < 0 or batch < 1:
        raise ValueError(f"context_len must be >= 0 and batch >= 1, got {context_len}, {batch}.")
    itemsize = jnp.dtype(cfg.jnp_dtype if dtype is None else dtype).itemsize
    d, gsize = cfg.head_dim, cfg.group_size
    kv, state = 0, 0
    for groups, hc in zip(fa_groups, hybrids):
        kv += 2 * len(groups) * d * itemsize
        if hc is None:
            continue
        n_la = cfg.num_kv_heads - len(groups)
        h_la = n_la * gsize
        state += h_la * d * d * 4
        if hc.use_conv:
            state += (hc.conv_size - 1) * (h_la + 2 * n_la) * d * itemsize
        if hc.la_window:  # the window attention's sinks and ring of keys and values
            state += 2 * (hc.la_sinks + hc.la_window) * n_la * d * itemsize
    kv, state = kv * batch, state * batch
    return {"kv_bytes_per_token": kv, "state_bytes": state, "total_bytes": kv * context_len + state}

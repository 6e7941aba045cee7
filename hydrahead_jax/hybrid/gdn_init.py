"""Per-head initialisation of the Gated DeltaNet decay and write strength from the teacher head each LA head
replaces (``HybridConfig.gdn_init="teacher"``), on the calibration batch.

For teacher query head h of layer l, with p_{t,s} its causal softmax attention (s ≤ t) on the calibration rows:

    mean attention distance     d̄_h = mean_{b,t} Σ_{s≤t} p_{t,s} (t − s)
    normalised entropy          Ĥ_h = mean_{b, t≥1} ( −Σ_{s≤t} p_{t,s} log p_{t,s} ) / log(t + 1)     ∈ [0, 1]

Decay. A GDN head with a constant per-token decay α weights what it wrote δ tokens ago by α^δ; normalised, that
is a geometric distribution over δ with mean α / (1 − α). Matching it to the teacher head's mean distance,

    α_h = d̄_h / (1 + d̄_h),   dt_h = −log α_h = log(1 + 1 / d̄_h),   clipped to [gdn_dt_min, gdn_dt_max],

so a head that reads the previous few tokens gets a short memory and one that reads far back a long one. With
A = 1 and W_a = 0 (``hybrid/gdn.py``), dt_bias_h = softplus⁻¹(dt_h).

Write strength. A focused teacher head (low entropy) retrieves individual tokens: its LA head should overwrite a
key's slot (β near 1); a diffuse head (high entropy) averages many tokens: its LA head should write gently and keep
a running mix (β small). Our linear map between the two ends:

    β_h = β_lo + (β_hi − β_lo) · (1 − Ĥ_h),   (β_lo, β_hi) = ``BETA_RANGE`` = (0.1, 0.9),

written as the per-head offset of β_t = sigmoid(x_t W_b + b_h), b_h = logit(β_h) (``gdn_beta_bias``: a trainable
per-head parameter). The formulas are ours (published conversions calibrate the decay from the attention distance
and β from the entropy; their exact maps are not public).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.hybrid.attention import group_columns
from hydrahead_jax.hybrid.gdn import inverse_softplus
from hydrahead_jax.models.attention import dense_attention

BETA_RANGE = (0.1, 0.9)


def attention_statistics(probs: jax.Array, query_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(d̄ [H], Ĥ [H]) of causal attention ``probs`` [B,H,T,S] whose query t sits at ``query_positions`` [T]
    (keys at 0 … S−1), as the module doc defines them; fp32."""
    probs = probs.astype(jnp.float32)
    t = query_positions.astype(jnp.float32)
    s = jnp.arange(probs.shape[-1], dtype=jnp.float32)
    distance = jnp.maximum(t[:, None] - s[None, :], 0.0)  # [T, S]; masked keys carry p = 0
    mean_distance = jnp.mean(jnp.sum(probs * distance, axis=-1), axis=(0, 2))
    entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0), axis=-1)
    later = t >= 1  # one visible key: entropy 0 of a maximum 0, no information
    normalised = entropy / jnp.log(jnp.where(later, t + 1.0, 2.0))
    normalised = jnp.sum(jnp.where(later, normalised, 0.0), axis=2) / jnp.maximum(jnp.sum(later), 1)
    return mean_distance, jnp.clip(jnp.mean(normalised, axis=0), 0.0, 1.0)


def dt_from_distance(mean_distance: np.ndarray, dt_min: float, dt_max: float) -> np.ndarray:
    """dt = log(1 + 1/d̄), clipped to [dt_min, dt_max] (d̄ = 0, a head on its own token: dt_max)."""
    d = np.asarray(mean_distance, np.float64)
    dt = np.log1p(1.0 / np.maximum(d, 1e-12))
    return np.clip(dt, dt_min, dt_max)


def beta_from_entropy(normalised_entropy: np.ndarray) -> np.ndarray:
    """β = β_lo + (β_hi − β_lo)(1 − Ĥ)."""
    lo, hi = BETA_RANGE
    return lo + (hi - lo) * (1.0 - np.clip(np.asarray(normalised_entropy, np.float64), 0.0, 1.0))


@functools.partial(jax.jit, static_argnums=(0,))
def _teacher_statistics(graphdef, state, input_ids):
    """(d̄ [L, Hq], Ĥ [L, Hq]) of every layer of the teacher on ``input_ids`` [B,T]."""
    teacher = nnx.merge(graphdef, state)
    inter: dict = {}
    teacher.hidden_states(input_ids, intermediates=inter)
    b, t = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def statistics(block, kind, carry, x, slot):
        attn = block.self_attn
        q, k, v = attn.project(x, positions)
        _, probs = dense_attention(q, k, v, attn.scale, jnp.arange(t))
        return carry, attention_statistics(probs, jnp.arange(t))

    return teacher.scan_layers(statistics, None, inter["attn_inputs"])[1]


def calibrate_gdn(student: nnx.Module, teacher: nnx.Module, input_ids) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Set each LA head's dt_bias (and, with ``gdn_beta_bias``, its β offset) of ``student`` from the teacher head
    it replaces, on ``input_ids`` [B,T] (module doc). Returns {layer: (dt, β) written, in the layer's GDN slot
    order: its LA heads in stored order, ``hybrid.attention.group_order``}; layers without GDN heads, and the GDN
    slots a layer does not use, are left alone."""
    from hydrahead_jax.hybrid.fusion import _calibration_ids  # the same checks as the fusion's calibration

    cfg = student.cfg
    if cfg.num_layers != teacher.cfg.num_layers:
        raise ValueError(
            f"student has {cfg.num_layers} layers, teacher {teacher.cfg.num_layers}: not the "
            "teacher this student was built from."
        )
    attn = student.layers.self_attn
    hc = getattr(attn, "hybrid_cfg", None)
    hybrid = [i for i, f in enumerate(student.layer_kinds) if hc is not None and f < cfg.num_kv_heads]
    if not hybrid:
        return {}
    graphdef, state = nnx.split(teacher)
    distances, entropies = (
        np.asarray(a, np.float64) for a in _teacher_statistics(graphdef, state, _calibration_ids(teacher, input_ids))
    )
    gdn = attn.gdn  # parameters stacked over layers, [L, slots]: layer l's own LA heads in its first slots
    dt_bias = np.array(gdn.dt_bias[...], np.float32)
    beta_bias = None if gdn.beta_bias is None else np.array(gdn.beta_bias[...], np.float32)
    written = {}
    for i in hybrid:
        f = student.layer_kinds[i]
        heads = group_columns(student.group_order[i], cfg.group_size, 1)[f * cfg.group_size :]  # original indices
        dt = dt_from_distance(distances[i, heads], hc.gdn_dt_min, hc.gdn_dt_max)
        beta = beta_from_entropy(entropies[i, heads])
        dt_bias[i, : len(heads)] = inverse_softplus(dt)
        if beta_bias is not None:
            beta_bias[i, : len(heads)] = np.log(beta / (1.0 - beta))
        written[i] = (dt, beta)
    gdn.dt_bias.set_value(jnp.asarray(dt_bias, gdn.dt_bias.dtype))
    if beta_bias is not None:
        gdn.beta_bias.set_value(jnp.asarray(beta_bias, gdn.beta_bias.dtype))
    return written

"""Gated DeltaNet heads for the linear-attention (LA) KV groups of one layer, reusing the teacher's q/k/v.

For LA query head h (KV head h // G of the layer's LA groups), with x_t the layer input:

    q_t, k_t, v_t = teacher projections (+ q/k norm) → causal depthwise conv (optional) → RoPE (optional)
    q_t ← M^q_h q_t,  k_t ← M^k_g k_t                                    (optional per-head maps, identity at init)
    a_t = x_t W_a,  b_t = x_t W_b                                         (new, one scalar per head)
    g_t = −exp(A_log) · softplus(a_t + dt_bias),   α_t = exp(g_t),   β_t = sigmoid(b_t)
    S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t k̂_t v_tᵀ                 (k̂, q̂ L2-normalised, S fp32)
    o_t = scale · S_tᵀ q̂_t                                               (scale = D^-½)
    o_t ← RMSNorm(o_t) · w · silu(x_t W_z + b_z)                          (optional output gate)

Un-shared heads: every LA query head has its own state and its own α, β; its k and v are those of its KV head,
repeated head-granularly (k for query head h = k of KV head h // G), so the teacher's GQA pairing is kept.

Initialisation (the student should start close to the teacher):
- conv: identity (last tap 1, others 0) and *no* SiLU: flash-linear-attention applies SiLU after the conv, but
  silu(v) would change the teacher's values at init; a linear conv starts as exactly the teacher's q/k/v.
- A_log = 0 (A = 1), W_a = 0 and dt_bias = softplus⁻¹(dt) with dt spread geometrically over
  [gdn_dt_min, gdn_dt_max] = [1e-3, 1e-1] (defaults) across the layer's LA heads: decays α ∈ [0.905, 0.999],
  i.e. memories of ~10 to ~1000 tokens, long like the softmax heads they replace, and a spread so that different
  heads can specialise.
- W_b = 0: β = gdn_beta for every token, 0.5 by default, a moderate write strength (β = 1 would overwrite a
  key's value fully). β_t = sigmoid(x_t W_b + b), b = logit(gdn_beta): a constant of the model by default, or,
  with ``gdn_beta_bias``, a trainable per-head parameter ``beta_bias`` [H] starting there.
- ``gdn_init="teacher"``: dt_bias and beta_bias per head from the teacher head's mean attention distance and
  attention entropy on the calibration batch instead (``hybrid/gdn_init.py``).
- W_z = 0, b_z = silu⁻¹(1) ≈ 1.2785: the gate is exactly 1 at init, so the gated norm is a plain RMSNorm.
- ``gdn_qk_map``: M^q [H_la, D, D] per LA query head and M^k [H_kv_la, D, D] per LA KV head, identity at init, applied
  before the L2 norm: a learnable feature map with which the LA heads can re-aim the teacher's softmax q/k at the
  delta rule's read-out while the teacher's q/k/v projections (shared with nothing else here, but the FA heads'
  slices of the same weights) stay frozen.
Zero kernels still get gradients (∂L/∂W = xᵀ ∂L/∂a), and they make the initial student independent of the seed.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.context_parallel.causal_conv import causal_depthwise_conv, sequence_parallel_causal_conv
from hydrahead_jax.context_parallel.gated_delta import sequence_parallel_gated_delta_rule
from hydrahead_jax.context_parallel.layout import MODEL_LAYOUT
from hydrahead_jax.hybrid.config import HybridConfig
from hydrahead_jax.models.kernel_sharding import (
    BH,
    BHD,
    BHKV,
    BS,
    BSH,
    BSHD,
    BT,
    BTH,
    BTHD,
    kernel_call,
    sequence_axes,
)
from hydrahead_jax.models.layers import apply_rope, param_init
from pallas_kernels.gated_delta import chunk_gated_delta_rule, gated_delta_rule_step

DT_MIN, DT_MAX = 1e-3, 1e-1
SILU_INV_ONE = 1.2784645427610738  # z with silu(z) = z·sigmoid(z) = 1


def inverse_softplus(y: np.ndarray) -> np.ndarray:
    """x with softplus(x) = log(1 + eˣ) = y, for y > 0."""
    return y + np.log(-np.expm1(-y))


def initial_dt(n_heads: int, dt_min: float = DT_MIN, dt_max: float = DT_MAX) -> np.ndarray:
    """dt per head, geometrically spaced in [dt_min, dt_max] (one head: their geometric mean)."""
    if n_heads == 1:
        return np.array([math.sqrt(dt_min * dt_max)])
    return np.geomspace(dt_min, dt_max, n_heads)


def backward_after_cotangent(fn):
    """``fn`` with the same values and gradients, whose backward XLA can neither merge with the forward nor start
    before the cotangent arrives.

    Without it, a backward that recomputes from its inputs (the gated delta rule's prologue, a rematerialised
    region) gets CSE'd with the forward, and XLA's scheduler hoists the parts that need no cotangent into the
    forward: both turn "recompute" back into "keep alive", through the whole layer. The optimization barrier
    ties the saved values (the ``jax.vjp`` residuals of ``fn``) to the cotangent.
    """

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def wrapped_fwd(*args):
        return jax.vjp(fn, *args)

    def wrapped_bwd(vjp, cotangent):
        vjp, cotangent = jax.lax.optimization_barrier((vjp, cotangent))
        return vjp(cotangent)

    wrapped.defvjp(wrapped_fwd, wrapped_bwd)
    return wrapped


GATE_BLOCK_TOKENS = 512  # tokens per block of the output gate's backward (temporaries are [B, block, H·D])


def _gate_z(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype, precision) -> jax.Array:
    """z = x W_z + b_z in the projection's compute dtype, as ``nnx.Linear`` computes it; [..., d] → [..., H·D]."""
    x, kernel, bias = (a.astype(dtype) for a in (x, kernel, bias))
    return jnp.dot(x, kernel, precision=precision) + bias


def _gated_rms_norm_parts(o: jax.Array, z: jax.Array | None, eps: float):
    """(n, silu(z), σ(z), r) in fp32: n = o · r, r = 1 / sqrt(mean_D o² + eps) per row ([..., 1]); without z
    (no gate) silu(z) and σ(z) are None."""
    o32 = o.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(o32), axis=-1, keepdims=True) + eps)
    if z is None:
        return o32 * r, None, None, r
    z32 = z.astype(jnp.float32)
    s = jax.nn.sigmoid(z32)
    return o32 * r, z32 * s, s, r


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = n · w · silu(z) per head, n = o / sqrt(mean_D o² + eps); o, z [..., H, D], w [H, D]; fp32 inside, y in
    o's dtype. Plain autodiff; the layer uses ``output_gate``, whose VJP is written by hand."""
    n, gate, _, _ = _gated_rms_norm_parts(o, z, eps)
    return (n * weight.astype(jnp.float32) * gate).astype(o.dtype)


def gated_rms_norm_grads(o, z, weight, dy, eps):
    """VJP of y = n · w · silu(z), n = o · r, r = 1 / sqrt(mean_D o² + eps) (z None: y = n · w, no gate), with
    g = ∂L/∂y · w and u = g · silu(z) (u = g without a gate):

        ∂L/∂o = r · (u − n · mean_D(u · n)),   ∂L/∂z = g · n · σ(z) · (1 + z · (1 − σ(z))),   ∂L/∂w = Σ ∂L/∂y · n · silu(z)

    → (∂o in o's dtype, ∂z fp32 or None, ∂w fp32 summed over every axis where w broadcasts). Everything is
    recomputed from o and z: the caller's custom VJP keeps only its inputs.
    """
    n, gate, s, r = _gated_rms_norm_parts(o, z, eps)
    dy32 = dy.astype(jnp.float32)
    g = dy32 * weight.astype(jnp.float32)
    u = g if gate is None else g * gate
    do = r * (u - n * jnp.mean(u * n, axis=-1, keepdims=True))
    dz = None if z is None else g * n * (s * (1.0 + z.astype(jnp.float32) * (1.0 - s)))  # silu'(z)
    lead = dy.ndim - weight.ndim
    dweight = jnp.sum(dy32 * n if gate is None else dy32 * n * gate, axis=tuple(range(lead)))
    dweight = jnp.sum(dweight, axis=tuple(i for i, d in enumerate(weight.shape) if d == 1), keepdims=True)
    return do.astype(o.dtype), dz, dweight


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _output_gate(o, x, kernel, bias, weight, eps, dtype, precision, block):
    z = _gate_z(x, kernel, bias, dtype, precision).reshape(o.shape)
    return gated_rms_norm(o, z, weight, eps)


def _output_gate_fwd(o, x, kernel, bias, weight, eps, dtype, precision, block):
    return _output_gate(o, x, kernel, bias, weight, eps, dtype, precision, block), (o, x, kernel, bias, weight)


def _output_gate_bwd(eps, dtype, precision, block, res, dy):
    # The barrier (with dy) keeps XLA from merging z and the fp32 values recomputed here with the forward's, and
    # from computing them before dy exists: either would keep [B, T, H·D] arrays alive from the forward to here.
    (o, x, kernel, bias, weight), dy = jax.lax.optimization_barrier((res, dy))
    B, T, H, D = o.shape
    kernel_c = kernel.astype(dtype)

    def grads_of(t0, length):
        """(∂o, ∂x, ∂W_z, ∂b_z, ∂w) of the tokens [t0, t0 + length); ∂W_z, ∂b_z, ∂w fp32 (summed over the block)."""
        o_b, x_b, dy_b = (jax.lax.dynamic_slice_in_dim(a, t0, length, axis=1) for a in (o, x, dy))
        z_b = _gate_z(x_b, kernel, bias, dtype, precision).reshape(o_b.shape)
        do_b, dz_b, dweight = gated_rms_norm_grads(o_b, z_b, weight, dy_b, eps)
        dz_c = dz_b.reshape(B, length, H * D).astype(dtype)  # z's cotangent in its own dtype, as autodiff has it
        dx_b = jnp.dot(dz_c, kernel_c.T, precision=precision).astype(x.dtype)
        dkernel = jnp.einsum(
            "btd,bte->de", x_b.astype(dtype), dz_c, precision=precision, preferred_element_type=jnp.float32
        )
        return do_b, dx_b, dkernel, jnp.sum(dz_c.astype(jnp.float32), axis=(0, 1)), dweight

    if T <= block:
        grads = grads_of(0, T)
    else:
        # The outputs are built after dy exists (a constant broadcast may be placed at program start and held
        # through the forward); the parameter gradients are summed over the blocks in fp32.
        zero, dy = jax.lax.optimization_barrier((jnp.zeros((), jnp.float32), dy))
        grads = (
            jnp.broadcast_to(zero.astype(o.dtype), o.shape),
            jnp.broadcast_to(zero.astype(x.dtype), x.shape),
            *(jnp.zeros(p.shape, jnp.float32) for p in (kernel, bias, weight)),
        )

        def add_block(t0, length, carry):
            do, dx, *sums = carry
            do_b, dx_b, *sums_b = grads_of(t0, length)
            do = jax.lax.dynamic_update_slice_in_dim(do, do_b, t0, axis=1)
            dx = jax.lax.dynamic_update_slice_in_dim(dx, dx_b, t0, axis=1)
            return (do, dx, *(a + b for a, b in zip(sums, sums_b)))

        full, tail = divmod(T, block)
        grads = jax.lax.fori_loop(0, full, lambda i, c: add_block(i * block, block, c), grads)
        if tail:
            grads = add_block(full * block, tail, grads)
    do, dx, dkernel, dbias, dweight = grads
    return do, dx, dkernel.astype(kernel.dtype), dbias.astype(bias.dtype), dweight.astype(weight.dtype)


_output_gate.defvjp(_output_gate_fwd, _output_gate_bwd)


def map_arrays(f, state: nnx.State) -> nnx.State:
    """``state`` with each Variable's value replaced by ``f(path, value)``."""
    return nnx.map_state(
        lambda path, v: v.replace(f(path, v[...])) if isinstance(v, nnx.Variable) else f(path, v), state
    )


# Where each GDN parameter keeps its heads: (path, axis, segments), a segment ("heads" | "kv", width) being a run of
# width entries per LA query head or per LA KV head, in head order. A model's layers share one parameter shape
# (they are stacked, ``Transformer.layers``): each holds its GDN heads at the largest LA head count of the model,
# the heads of its own first LA KV groups in front (``take_la_groups``) and the slots it does not use zero.
def _head_layout(hd: int) -> dict[tuple[str, ...], tuple[int, tuple[tuple[str, int], ...]]]:
    return {
        ("a_proj", "kernel"): (1, (("heads", 1),)),
        ("b_proj", "kernel"): (1, (("heads", 1),)),
        ("A_log",): (0, (("heads", 1),)),
        ("dt_bias",): (0, (("heads", 1),)),
        ("beta_bias",): (0, (("heads", 1),)),
        ("q_map",): (0, (("heads", 1),)),  # [H_la, D, D]
        ("k_map",): (0, (("kv", 1),)),  # [H_kv_la, D, D]
        ("conv_weight",): (1, (("heads", hd), ("kv", hd), ("kv", hd))),  # q channels, then k, then v
        ("z_proj", "kernel"): (1, (("heads", hd),)),
        ("z_proj", "bias"): (0, (("heads", hd),)),
        ("o_norm_weight",): (0, (("heads", 1),)),
    }


def _segments(path, cfg: ModelConfig):
    """(axis, segments) of GDN parameter ``path`` (``_head_layout``)."""
    layout = _head_layout(cfg.head_dim)
    key = tuple(str(p) for p in path)
    if key not in layout:
        raise ValueError(
            f"GDN parameter {'/'.join(key)} has no entry in hybrid/gdn.py _head_layout: say which axis holds its heads."
        )
    return layout[key]


def take_la_groups(state: nnx.State, cfg: ModelConfig, num_kv_total: int, num_kv: int) -> nnx.State:
    """The state of ``GatedDeltaNetHeads`` for the first ``num_kv`` LA KV groups, out of one laid out for
    ``num_kv_total`` (static slices of each parameter's head axis, ``_head_layout``)."""
    g = cfg.group_size

    def take(path, a):
        axis, segments = _segments(path, cfg)
        parts, start = [], 0
        for unit, width in segments:
            per = width * (g if unit == "heads" else 1)
            parts.append(jax.lax.slice_in_dim(a, start, start + num_kv * per, axis=axis))
            start += num_kv_total * per
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)

    return map_arrays(take, state)


def place_la_array(path, a, cfg: ModelConfig, num_kv: int, num_kv_total: int):
    """Parameter ``path`` of GDN heads for ``num_kv`` LA KV groups, laid out for ``num_kv_total`` (the other
    groups' slots zero): the inverse of ``take_la_groups`` for one array (numpy or jax)."""
    xp = jnp if isinstance(a, jax.Array) else np
    axis, segments = _segments(path, cfg)
    parts, start = [], 0
    for unit, width in segments:
        per = width * (cfg.group_size if unit == "heads" else 1)
        part = xp.take(a, np.arange(start, start + num_kv * per), axis=axis)
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, (num_kv_total - num_kv) * per)
        parts.append(xp.pad(part, pad))
        start += num_kv * per
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=axis)


def place_la_groups(state: nnx.State, cfg: ModelConfig, num_kv: int, num_kv_total: int) -> nnx.State:
    """``place_la_array`` over a ``GatedDeltaNetHeads`` state."""
    return map_arrays(lambda path, a: place_la_array(path, a, cfg, num_kv, num_kv_total), state)


class GatedDeltaNetHeads(nnx.Module):
    """The GDN heads of one layer's LA groups; all its parameters live under this submodule (path ``gdn``)."""

    def __init__(self, cfg: ModelConfig, hybrid_cfg: HybridConfig, la_groups: tuple[int, ...], *, rngs: nnx.Rngs):
        if not la_groups:
            raise ValueError(
                "GatedDeltaNetHeads needs at least one LA group; a layer without LA groups has no GDN heads."
            )
        self.cfg, self.hybrid_cfg = cfg, hybrid_cfg
        self.la_groups = tuple(la_groups)
        self.num_kv = len(la_groups)
        self.num_heads = self.num_kv * cfg.group_size
        d, n, hd = cfg.hidden_size, self.num_heads, cfg.head_dim
        pdt = cfg.jnp_param_dtype
        zeros = nnx.initializers.zeros_init()
        linear = dict(dtype=cfg.jnp_dtype, param_dtype=pdt, rngs=rngs)
        self.a_proj = nnx.Linear(d, n, use_bias=False, kernel_init=param_init(zeros, ("embed", None)), **linear)
        self.b_proj = nnx.Linear(d, n, use_bias=False, kernel_init=param_init(zeros, ("embed", None)), **linear)
        self.A_log = nnx.Param(jnp.zeros((n,), pdt), out_sharding=("norm",), eager_sharding=False)
        self.dt_bias = nnx.Param(
            jnp.asarray(inverse_softplus(initial_dt(n, hybrid_cfg.gdn_dt_min, hybrid_cfg.gdn_dt_max)), pdt),
            out_sharding=("norm",),
            eager_sharding=False,
        )
        self.beta_offset = math.log(hybrid_cfg.gdn_beta / (1.0 - hybrid_cfg.gdn_beta))  # logit; 0 at β = 0.5
        if hybrid_cfg.gdn_beta_bias:
            self.beta_bias = nnx.Param(
                jnp.full((n,), self.beta_offset, pdt), out_sharding=("norm",), eager_sharding=False
            )
        else:
            self.beta_bias = None
        if hybrid_cfg.use_conv:
            channels = (n + 2 * self.num_kv) * hd  # q of the LA query heads, k and v of their KV heads
            weight = jnp.zeros((hybrid_cfg.conv_size, channels), pdt).at[-1].set(1)
            self.conv_weight = nnx.Param(weight, out_sharding=(None, None), eager_sharding=False)
        if hybrid_cfg.gdn_qk_map:
            eye = jnp.eye(hd, dtype=pdt)
            self.q_map = nnx.Param(jnp.tile(eye, (n, 1, 1)), out_sharding=("heads", None, None), eager_sharding=False)
            self.k_map = nnx.Param(
                jnp.tile(eye, (self.num_kv, 1, 1)), out_sharding=("heads", None, None), eager_sharding=False
            )
        if hybrid_cfg.use_output_gate:
            self.z_proj = nnx.Linear(
                d,
                n * hd,
                use_bias=True,
                kernel_init=param_init(zeros, ("embed", "heads")),
                bias_init=param_init(nnx.initializers.constant(SILU_INV_ONE), ("heads",)),
                **linear,
            )
            self.o_norm_weight = nnx.Param(jnp.ones((n, hd), pdt), out_sharding=(None, "norm"), eager_sharding=False)

    # ------------------------------------------------------------------------------------------ pieces
    def decay_and_beta(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """g (log decay ≤ 0) and β, both [B,T,H_la] fp32, from the layer input x [B,T,d]."""
        a = self.a_proj(x).astype(jnp.float32)
        dt = jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * dt
        offset = self.beta_offset if self.beta_bias is None else self.beta_bias[...].astype(jnp.float32)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32) + offset)
        return g, beta

    def conv(self, q, k, v, state, segment_ids=None):
        """Causal conv over the q/k/v channels (weight and state: q, then k, then v channels); returns (q, k, v,
        new conv state). Each tensor is convolved on its own: concatenating them first costs an activation-sized
        copy forward and backward. ``segment_ids`` [B,T]: no tap reads across a document start
        (``causal_depthwise_conv``)."""
        splits = np.cumsum([x.shape[2] * x.shape[3] for x in (q, k)]).tolist()
        weights = jnp.split(self.conv_weight[...], splits, axis=1)
        states = [None] * 3 if state is None else jnp.split(state, splits, axis=2)
        axes = sequence_axes() if q.shape[1] > 1 else ()
        if axes:
            return self._sequence_parallel_conv((q, k, v), weights, states, segment_ids, axes)
        outs, new_states = [], []
        for x, w, st in zip((q, k, v), weights, states):
            y, st = causal_depthwise_conv(x.reshape(x.shape[0], x.shape[1], -1), w, st, segment_ids)
            outs.append(y.reshape(x.shape))
            new_states.append(st)
        return (*outs, jnp.concatenate(new_states, axis=-1))

    def _sequence_parallel_conv(self, qkv, weights, states, segment_ids, axes):
        """``conv`` with the time axis split over the sequence mesh ``axes`` (tokens in ``MODEL_LAYOUT`` order):
        each device convolves its chunks with the halo from the chunks before them
        (``context_parallel.sequence_parallel_causal_conv``). Weights and states are viewed per head
        ([W, H, D], [B, W−1, H, D]) so a head split over ``tensor`` keeps its own channels."""
        b, width = qkv[0].shape[0], weights[0].shape[0]
        heads = [x.shape[2:] for x in qkv]
        weights = [w.reshape(width, *hd) for w, hd in zip(weights, heads)]
        states = [None if st is None else st.reshape(b, width - 1, *hd) for st, hd in zip(states, heads)]
        per_head_state = ("batch", None, "heads", None)

        def per_device(q, k, v, wq, wk, wv, sq, sk, sv, segment_ids):
            outs = []
            for x, w, st in ((q, wq, sq), (k, wk, sk), (v, wv, sv)):
                y, st = sequence_parallel_causal_conv(
                    x.reshape(*x.shape[:2], -1),
                    w.reshape(width, -1),
                    None if st is None else st.reshape(*st.shape[:2], -1),
                    segment_ids,
                    axis_name=axes,
                    layout=MODEL_LAYOUT,
                )
                outs.append((y.reshape(x.shape), st.reshape(st.shape[0], width - 1, *x.shape[2:])))
            return tuple(outs)

        outs = kernel_call(
            per_device,
            *qkv,
            *weights,
            *states,
            segment_ids,
            in_axes=(
                (BSHD,) * 3
                + ((None, "heads", None),) * 3
                + tuple(None if st is None else per_head_state for st in states)
                + (None if segment_ids is None else BS,)
            ),
            out_axes=((BSHD, per_head_state),) * 3,
        )
        new_state = jnp.concatenate([st.reshape(b, width - 1, -1) for _, st in outs], axis=-1)
        return (*(y for y, _ in outs), new_state)

    def output_gate(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """Per-head gated RMSNorm: y = RMSNorm(o) · w · silu(z), z = x W_z + b_z (``gated_rms_norm``; fp32 inside).

        VJP by hand: ∂L/∂o, ∂L/∂z, ∂L/∂w as in ``gated_rms_norm_grads``, then through the projection

            ∂L/∂x = ∂L/∂z W_zᵀ,  ∂L/∂W_z = Σ_{b,t} xᵀ ∂L/∂z,  ∂L/∂b_z = Σ_{b,t} ∂L/∂z

        The backward keeps only o, x (the layer input, alive anyway) and the weights, and walks the sequence in
        blocks of ``GATE_BLOCK_TOKENS`` tokens: per block it recomputes z and r, forms the block's gradients and
        writes ∂o, ∂x in place, summing the parameter gradients in fp32. Its temporaries are block-sized; autodiff
        held z from the forward on and ~7 fp32 [B, T, H·D] products and cotangents at the layer's peak. With the
        time axis split over devices (context parallelism) it runs as one block: a loop over a split axis would
        gather the sequence.
        """
        # z is formed after o exists: otherwise XLA computes it (and keeps it) before the delta rule, at the
        # layer's peak.
        o, x = jax.lax.optimization_barrier((o, x))
        proj = self.z_proj
        dtype = proj.dtype or jnp.result_type(x, proj.kernel[...], proj.bias[...])
        block = o.shape[1] if sequence_axes() else GATE_BLOCK_TOKENS
        return _output_gate(
            o,
            x,
            proj.kernel[...],
            proj.bias[...],
            self.o_norm_weight[...],
            self.cfg.rms_norm_eps,
            jnp.dtype(dtype),
            proj.precision,
            block,
        )

    # ------------------------------------------------------------------------------------------ forward
    def __call__(
        self,
        x: jax.Array,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        positions: jax.Array,
        cache: dict[str, Any] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, Any] | None]:
        """x [B,T,d]; q [B,T,H_la,D] and k, v [B,T,H_kv_la,D] from the teacher's projections, *before* RoPE.

        Without a cache: the chunked rule from a zero state (training). With one (keys ``gdn_state``
        [B,H_la,D,D] fp32 and, with the conv, ``conv_state`` [B,W−1,C]): T == 1 takes the one-token step,
        T > 1 the chunked rule from the cached state; both return the updated cache.
        ``segment_ids`` [B,T] int32 (packed documents, ids as the data pipeline emits them): the conv does not
        reach across a document start and the state restarts from zero at each one; ``positions`` must then be
        the per-document positions.
        """
        hc, cfg = self.hybrid_cfg, self.cfg
        new_cache = None if cache is None else dict(cache)
        if hc.use_conv:
            conv_state = None if cache is None else cache["conv_state"]
            with jax.named_scope("gdn_conv"):
                q, k, v, conv_state = self.conv(q, k, v, conv_state, segment_ids)
            if cache is not None:
                new_cache["conv_state"] = conv_state.astype(cache["conv_state"].dtype)
        if hc.la_rope:
            rope = dict(theta=cfg.rope_theta, interleaved=cfg.rope_interleaved, scaling=cfg.rope_scaling)
            q, k = apply_rope(q, positions, **rope), apply_rope(k, positions, **rope)
        if hc.gdn_qk_map:
            with jax.named_scope("gdn_qk_map"):
                q = jnp.einsum("bthd,hde->bthe", q, self.q_map[...].astype(q.dtype))
                k = jnp.einsum("bthd,hde->bthe", k, self.k_map[...].astype(k.dtype))
        with jax.named_scope("gdn_repeat"):
            k = jnp.repeat(k, cfg.group_size, axis=2)  # query head h reads KV head h // G
            v = jnp.repeat(v, cfg.group_size, axis=2)
        with jax.named_scope("gdn_decay"):
            g, beta = self.decay_and_beta(x)
        # Both rules run per device inside shard_map over the mesh axes of batch and heads (``kernel_call``).
        if cache is not None and q.shape[1] == 1:
            step = functools.partial(gated_delta_rule_step, use_qk_l2norm=True)
            token = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o, state = kernel_call(
                step, *token, cache["gdn_state"], in_axes=(BHD, BHD, BHD, BH, BH, BHKV), out_axes=(BHD, BHKV)
            )
            o = o[:, None]
        else:
            chunked = functools.partial(
                chunk_gated_delta_rule,
                output_final_state=cache is not None,
                use_qk_l2norm=True,
                chunk_size=hc.gdn_chunk_size,
                implementation=hc.gdn_implementation,
            )
            initial_state = None if cache is None else cache["gdn_state"]
            # Context parallelism (the time axis split over the sequence mesh axes, tokens in MODEL_LAYOUT
            # order): each device runs the rule on its chunks and takes its incoming states from the others.
            axes = sequence_axes() if q.shape[1] > 1 else ()
            if axes:
                chunked = functools.partial(
                    sequence_parallel_gated_delta_rule,
                    axis_name=axes,
                    layout=MODEL_LAYOUT,
                    output_final_state=cache is not None,
                    use_qk_l2norm=True,
                    chunk_size=hc.gdn_chunk_size,
                    implementation=hc.gdn_implementation,
                )
            tokens, scalars, ids = (BSHD, BSH, BS) if axes else (BTHD, BTH, BT)

            def rule(q, k, v, g, beta, state, segment_ids):
                return chunked(q, k, v, g, beta, initial_state=state, segment_ids=segment_ids)

            with jax.named_scope("gdn_rule"):
                o, state = kernel_call(
                    backward_after_cotangent(rule),
                    *(q, k, v, g, beta, initial_state, segment_ids),
                    in_axes=(
                        tokens,
                        tokens,
                        tokens,
                        scalars,
                        scalars,
                        None if cache is None else BHKV,
                        None if segment_ids is None else ids,
                    ),
                    out_axes=(tokens, None if cache is None else BHKV),
                )
        if cache is not None:
            new_cache["gdn_state"] = state
        if hc.use_output_gate:
            with jax.named_scope("gdn_gate"):
                o = self.output_gate(o, x)
        return o, new_cache

    def init_cache(self, batch: int, dtype) -> dict[str, Any]:
        """gdn_state [B, H_la, D, D] fp32 (+ conv_state [B, W−1, C] in the compute dtype)."""
        hd = self.cfg.head_dim
        cache = {"gdn_state": jnp.zeros((batch, self.num_heads, hd, hd), jnp.float32)}
        if self.hybrid_cfg.use_conv:
            channels = self.conv_weight.shape[1]
            cache["conv_state"] = jnp.zeros((batch, self.hybrid_cfg.conv_size - 1, channels), dtype)
        return cache

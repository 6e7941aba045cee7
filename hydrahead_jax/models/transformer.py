"""The decoder (Llama / Qwen2 / Qwen3 family) in Flax NNX: teacher, and skeleton of every HydraHead student.

    h_0 = embed(ids)
    h_{l+½} = h_l + Attn_l(RMSNorm(h_l))          (Attn_l: softmax; students plug in their own attention)
    h_{l+1} = h_{l+½} + MLP_l(RMSNorm(h_{l+½}))
    logits = RMSNorm(h_L) · Wᵀ_out                 (W_out = the embedding when tied)

The layers are one stacked module (``Transformer.layers``: every parameter has a leading layer axis, logical name
``layers``) run by one ``jax.lax.scan``, so compile time and HLO size do not grow with depth. Layers may differ in
a static *kind* (``Transformer.layer_kinds``: a HydraHead student's FA-group count, ``hydrahead_jax.hybrid``):
the scan body is a ``lax.switch`` over the distinct kinds, each compiled once; the teacher has one kind. Every
walk over layers goes through ``Transformer.scan_layers``.

Context parallelism (a mesh whose ``sequence`` axes split the tokens of a row over n devices): the layers run on
the row in the load-balanced sharded token order (``hydrahead_jax.context_parallel.layout``, ``MODEL_LAYOUT``);
``Transformer.hidden_states`` permutes the token ids in and the hidden states out (see there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from hydrahead_jax.config import ModelConfig
from hydrahead_jax.context_parallel.layout import MODEL_LAYOUT, chunks_per_shard, from_layout, to_layout
from hydrahead_jax.models.attention import TOKEN_CACHE_KEYS, Attention, HeadProbe, LayerCache
from hydrahead_jax.models.hf_layout import hf_tensors
from hydrahead_jax.models.kernel_sharding import sequence_axes
from hydrahead_jax.models.layers import MLP, RMSNorm, param_init
from hydrahead_jax.sharding_rules import mesh_axes_for

AttentionFactory = Callable[[int, nnx.Rngs], nnx.Module]

# An attention module whose class sets this attribute to True runs on a row in the sharded token order itself
# (context-parallel kernels: ``hydrahead_jax.context_parallel``). Any other module is called on the natural order:
# the block gathers its input back to natural order and its output to the sharded order (correct for every module,
# at the cost of moving the activations).
SHARDED_ORDER_ATTR = "takes_sharded_order"


def sequence_shards(length: int) -> int:
    """n, the number of devices the tokens of a row of ``length`` are split over under the ambient mesh: the
    product of the sizes of ``sequence_axes()`` for a row of more than one token, else 1 (decode steps, T = 1,
    never use context parallelism)."""
    axes = sequence_axes()
    if length == 1 or not axes:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    return int(np.prod([mesh.shape[a] for a in axes]))


def sequence_parts(length: int) -> int:
    """Equal chunks a row of ``length`` is cut into under the ambient mesh (2n in the zig-zag order; 1 without
    context parallelism). Rows the model runs must be a multiple of it (``hidden_states`` end-pads otherwise)."""
    n = sequence_shards(length)
    return 1 if n == 1 else n * chunks_per_shard(MODEL_LAYOUT)


def to_model_order(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """Natural token order → the order the layers run in over n sequence shards (identity for n = 1)."""
    return x if n == 1 else to_layout(x, n, MODEL_LAYOUT, axis)


def from_model_order(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """Inverse of ``to_model_order``."""
    return x if n == 1 else from_layout(x, n, MODEL_LAYOUT, axis)


def constrain_tokens(x: jax.Array) -> jax.Array:
    """x [B, T, ...] with its rows over the batch mesh axes (where B divides) and its tokens over the sequence
    axes: the placement of the model's activations under context parallelism (T is a multiple of the sequence
    axes' size here). A no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    free = {a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual}
    rows: list[str] = []
    for axis in mesh_axes_for("batch"):
        if axis in free and x.shape[0] % int(np.prod([mesh.shape[a] for a in (*rows, axis)])) == 0:
            rows.append(axis)
    tokens = sequence_axes()
    spec = PartitionSpec(tuple(rows) or None, tokens or None, *(None,) * (x.ndim - 2))
    return jax.lax.with_sharding_constraint(x, spec)


def call_attention(
    attention: nnx.Module, x: jax.Array, positions: jax.Array, *args, segment_ids=None, remat: bool = False, **kwargs
):
    """``attention(x, positions, *args, segment_ids=segment_ids, **kwargs)`` on a row in the model's token order
    (``remat``: through ``remat_call``).

    Under context parallelism (x's tokens in the sharded order over n > 1 shards) a module that does not declare
    ``SHARDED_ORDER_ATTR`` gets the natural order: x, positions and segment ids are permuted back, its output
    forward again (its cache, filled in natural order, is returned as it is)."""
    run = functools.partial(remat_call, attention) if remat else attention
    n = sequence_shards(x.shape[1])
    if n == 1 or getattr(attention, SHARDED_ORDER_ATTR, False):
        return run(x, positions, *args, segment_ids=segment_ids, **kwargs)
    natural = lambda a: None if a is None else from_model_order(a, n)  # noqa: E731
    out, cache = run(natural(x), natural(positions), *args, segment_ids=natural(segment_ids), **kwargs)
    return constrain_tokens(to_model_order(out, n)), cache


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, attention: nnx.Module, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.mlp = MLP(
            cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=cfg.jnp_param_dtype, dtype=cfg.jnp_dtype
        )

    def __call__(
        self,
        h,
        positions,
        cache=None,
        cache_index=None,
        intermediates: dict | None = None,
        probe: HeadProbe | None = None,
        segment_ids: jax.Array | None = None,
        kind: int | None = None,
        record_heads: bool = False,
    ):
        """h [B,T,d] → (h after the attention and MLP residuals, the new cache). ``probe``: see ``HeadProbe``;
        ``segment_ids``: see ``Transformer.hidden_states``; ``kind``: the layer's static kind (see
        ``Transformer.layer_kinds``). ``intermediates`` (a dict) receives this layer's "attn_inputs" and
        "attn_outputs" [B,T,d], and with ``record_heads`` "attn_heads" [B,T,Hq,D]: the attention's head outputs
        before o_proj, in its stored head order."""
        attn_in = self.input_layernorm(h)
        heads = {} if record_heads else None
        attn_out, cache = call_attention(
            self.self_attn,
            attn_in,
            positions,
            cache,
            cache_index,
            probe=probe,
            segment_ids=segment_ids,
            kind=kind,
            heads_out=heads,
        )
        if intermediates is not None:
            intermediates.update(attn_inputs=attn_in, attn_outputs=attn_out)
            if record_heads:
                intermediates["attn_heads"] = heads["heads"]
        h = h + attn_out
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache


def remat_call(module: nnx.Module, *args, **kwargs):
    """``module(*args, **kwargs)``, rematerialised in the backward pass: ``jax.checkpoint`` over a pure function of
    the module's state, so only the arguments and the state are kept for the backward, not the module's
    intermediates.

    Functional on purpose: inside a train step the module is merged from differentiated and frozen states that
    live at different trace levels, which ``nnx.remat``'s graph updates refuse (TraceContextError).
    """
    graphdef, state = nnx.split(module)
    run = lambda state, args, kwargs: nnx.merge(graphdef, state)(*args, **kwargs)  # noqa: E731
    return jax.checkpoint(run)(state, args, kwargs)


def stack_modules(modules: list[nnx.Module], axis_name: str = "layers") -> nnx.Module:
    """One module of the structure shared by ``modules`` whose every Variable is the stack of theirs along a new
    leading axis (logical name ``axis_name`` prepended to its ``out_sharding``). The modules must have identical
    graph definitions (same classes, static attributes and shapes)."""
    splits = [nnx.split(m) for m in modules]
    graphdef = splits[0][0]
    for i, (gdef, _) in enumerate(splits):
        if gdef != graphdef:
            raise ValueError(
                f"layer {i} differs in structure (modules, static attributes or shapes) from layer 0; the layers of "
                "one model must share one structure to run as a scanned stack."
            )
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in splits]))
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Variable):
            axes = var.get_metadata().get("out_sharding")
            if axes is not None:
                var.set_metadata(out_sharding=(axis_name, *axes))
    return stacked


def layer_slots(kinds: tuple[int, ...]) -> tuple[int, ...]:
    """For each layer, its index among the layers of its kind (where its cache sits in that kind's stack)."""
    seen: dict[int, int] = {}
    slots = []
    for k in kinds:
        slots.append(seen.get(k, 0))
        seen[k] = slots[-1] + 1
    return tuple(slots)


def cache_writes(new: LayerCache, index: jax.Array, tokens: int) -> LayerCache:
    """What a call of ``tokens`` tokens at cache position ``index`` changed in a layer's cache: the new tokens'
    entries [B, tokens, …] of the token-indexed entries (``TOKEN_CACHE_KEYS``, axis 1), every other entry (the
    linear attention's constant-size state) whole."""
    return {
        name: jax.lax.dynamic_slice_in_dim(a, index, tokens, 1) if name in TOKEN_CACHE_KEYS else a
        for name, a in new.items()
    }


def no_writes(stack: LayerCache, tokens: int) -> LayerCache:
    """Zeros shaped as ``cache_writes`` of one layer of ``stack`` [L_kind, …] (what a branch of another kind
    returns for it: ``write_layer_cache`` keeps the stack's values there)."""
    shape = lambda name, a: (a.shape[1], tokens, *a.shape[3:]) if name in TOKEN_CACHE_KEYS else a.shape[1:]  # noqa: E731
    return {name: jnp.zeros(shape(name, a), a.dtype) for name, a in stack.items()}


def write_layer_cache(
    stack: LayerCache, writes: LayerCache, slot: jax.Array, index: jax.Array, own: jax.Array
) -> LayerCache:
    """``stack`` [L_kind, …] with layer ``slot``'s ``writes`` (``cache_writes``) put in place where ``own`` (a
    traced bool: the layer is of this stack's kind), the stack unchanged where not. Only the written region is
    read and written (dynamic_update_slice in place), never a whole layer's cache."""
    out = {}
    for name, a in stack.items():
        w = writes[name].astype(a.dtype)
        rest = a.ndim - (3 if name in TOKEN_CACHE_KEYS else 1)
        start = (slot, 0, index) if name in TOKEN_CACHE_KEYS else (slot,)
        start = tuple(jnp.asarray(i, jnp.int32) for i in (*start, *(0,) * rest))
        kept = jax.lax.dynamic_slice(a, start, (1, *w.shape))[0]
        out[name] = jax.lax.dynamic_update_slice(a, jnp.where(own, w, kept)[None], start)
    return out


class Transformer(nnx.Module):
    """Decoder LM. ``attention_factory(layer_index, rngs)`` builds each layer's attention (default: teacher FA);
    every layer's attention must have the same structure (they are stacked into ``layers``), and
    ``layer_kinds[l]`` is the static kind layer l runs with (``Block(..., kind=...)``): its number of softmax
    (FA) KV groups, all of them (the default) in the teacher.
    ``group_order[l]`` (default 0 … Hkv−1): the original KV group each stored group of layer l's attention
    parameters is (a HydraHead student stores its FA groups first, ``hybrid.attention.permute_groups``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        attention_factory: AttentionFactory | None = None,
        layer_kinds: tuple[int, ...] | None = None,
        group_order: tuple[tuple[int, ...], ...] | None = None,
        attention_impl: str = "auto",
        context_parallel: str = "allgather",
    ):
        self.cfg = cfg
        if attention_factory is None:
            attention_factory = lambda i, r: Attention(  # noqa: E731
                cfg, rngs=r, attention_impl=attention_impl, context_parallel=context_parallel
            )
        self.layer_kinds = tuple(int(k) for k in (layer_kinds or (cfg.num_kv_heads,) * cfg.num_layers))
        if len(self.layer_kinds) != cfg.num_layers or min(self.layer_kinds) < 0:
            raise ValueError(
                f"layer_kinds={layer_kinds} must give a kind >= 0 for each of the {cfg.num_layers} layers."
            )
        identity = tuple(range(cfg.num_kv_heads))
        self.group_order = tuple(tuple(int(g) for g in o) for o in (group_order or (identity,) * cfg.num_layers))
        if len(self.group_order) != cfg.num_layers or any(sorted(o) != list(identity) for o in self.group_order):
            raise ValueError(f"group_order must give a permutation of the {cfg.num_kv_heads} KV groups per layer.")
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            embedding_init=param_init(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        # Built one by one (each layer draws its own initial values in order), then stacked.
        self.layers = stack_modules([Block(cfg, attention_factory(i, rngs), rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=cfg.jnp_dtype,
                param_dtype=cfg.jnp_param_dtype,
                kernel_init=param_init(nnx.initializers.normal(0.02), ("embed", "vocab")),
                rngs=rngs,
            )

    @property
    def fa_groups_per_layer(self) -> list[int]:
        """Each layer's number of softmax-attention (FA) KV groups."""
        return list(self.layer_kinds)

    @property
    def kinds(self) -> tuple[int, ...]:
        """The distinct layer kinds, sorted (the branches of the scan body)."""
        return tuple(sorted(set(self.layer_kinds)))

    def layer(self, i: int) -> Block:
        """Layer ``i`` as a Block of its own (a copy of its slice of the stack: for inspection, not for updates;
        shapes only for an abstract model)."""
        graphdef, state = nnx.split(self.layers)
        take = lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a[i]  # noqa: E731
        return nnx.merge(graphdef, jax.tree.map(take, state))

    def scan_layers(
        self, fn: Callable, carry, xs=None, *, remat: bool = False, cache=None, cache_index=None, cache_tokens=None
    ):
        """(carry, ys) of ``carry, y_l = fn(block_l, kind_l, carry, xs_l, slot_l)`` over the layers l = 0 … L−1, as
        one ``lax.scan`` whose body switches over the distinct kinds (``kind_l`` is static inside ``fn``: each
        kind is traced and compiled once). ``slot_l``: layer l's index among the layers of its kind (traced).
        xs: a pytree with a leading layer axis, or None. ``remat``: the body is rematerialised in the backward pass
        (``jax.checkpoint``), so only each layer's carry and xs are kept between forward and backward.

        With ``cache`` (the per-kind stacks of ``init_cache``'s "layers"), filled with ``cache_tokens`` tokens at
        ``cache_index`` by every layer, ``fn`` also
        receives layer l's cache and returns its new one: ``carry, y_l, cache_l' = fn(..., slot_l, cache_l)``;
        the result is ((carry, cache'), ys). The stacks are operands of the switch, never its results: only what
        a layer changed (``cache_writes``) leaves its branch and is written into the stacks after it, because a
        switch that returned the stacks would copy every stack at every layer."""
        graphdef, state = nnx.split(self.layers)
        kinds = self.kinds
        branch_of = {k: j for j, k in enumerate(kinds)}

        def branch_fn(kind):
            j = branch_of[kind]

            def run(c, s, xl, ls, stacks):
                block = nnx.merge(graphdef, ls)
                if stacks is None:
                    return fn(block, kind, c, xl, s)
                mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, s, keepdims=False), stacks[j])
                c, y, new = fn(block, kind, c, xl, s, mine)
                writes = tuple(
                    cache_writes(new, cache_index, cache_tokens) if i == j else no_writes(stack, cache_tokens)
                    for i, stack in enumerate(stacks)
                )
                return c, y, writes

            return run

        def body(carry, step):
            layer_state, branch, slot, x = step
            stacks = None
            if cache is not None:
                carry, stacks = carry
            branches = [branch_fn(kind) for kind in kinds]
            if len(branches) == 1:
                out = branches[0](carry, slot, x, layer_state, stacks)
            else:
                out = jax.lax.switch(branch, branches, carry, slot, x, layer_state, stacks)
            if stacks is None:
                return out
            carry, y, writes = out
            stacks = tuple(
                write_layer_cache(stack, w, jnp.where(branch == i, slot, 0), cache_index, branch == i)
                for i, (stack, w) in enumerate(zip(stacks, writes, strict=True))
            )
            return (carry, stacks), y

        if remat:
            body = jax.checkpoint(body)
        branch = jnp.asarray([branch_of[k] for k in self.layer_kinds], jnp.int32)
        slots = jnp.asarray(layer_slots(self.layer_kinds), jnp.int32)
        init = carry if cache is None else (carry, tuple(cache))
        return jax.lax.scan(body, init, (state, branch, slots, xs))

    def hidden_states(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: dict[str, Any] | None = None,
        intermediates: dict | None = None,
        remat: bool = False,
        record_heads: bool = False,
    ):
        """Final normalised hidden states [B,T,d] (and the updated cache when one is given).

        Packed documents: ``segment_ids`` [B,T] int32 marks each token's document (ids of a row differ between
        neighbouring documents; the data pipeline numbers them 1, 2, … and pads with 0) and ``positions`` [B,T]
        restart at 0 in each document. Every layer then runs each document on its own: attention stays inside
        the document, the linear-attention state and conv restart at its first token, and RoPE uses the
        per-document positions, so a document's hidden states equal those of running it alone.

        With a cache (``init_cache``: {"index": int32 scalar, "layers": one dict of layer-stacked arrays per layer
        kind}) the tokens are placed at positions index … index+T−1; prefill (T > 1) must start from an empty
        cache (index 0), decoding feeds T = 1. ``remat`` (training): each layer is rematerialised in the backward
        pass (the scan body under ``jax.checkpoint``), so only the layer inputs [B,T,d] are kept between forward
        and backward instead of every layer's intermediates. ``intermediates`` (a dict) receives "attn_inputs" and
        "attn_outputs", each [L,B,T,d]: every layer's attention input (after its norm) and output; with
        ``record_heads`` also "attn_heads" [L,B,T,Hq,D], every layer's head outputs before o_proj (stored order).

        Context parallelism (T > 1 under a mesh whose sequence axes have n = ∏ sizes > 1, ``sequence_shards``):
        the row is end-padded to T' = ⌈T / 2n⌉·2n tokens, then the int inputs (ids, positions, segment ids) are
        permuted into the sharded order π (``MODEL_LAYOUT``: device i holds natural chunks i and 2n−1−i of
        c = T'/2n tokens), the embedding's token dimension is placed over the sequence axes, and the layers run:

            h_π = Layers(embed(ids_π), positions_π, segment_ids_π),     h = π⁻¹(h_π)[:, :T]

        Every layer is token-wise except attention, which sees each token's true position and document, so
        π⁻¹ ∘ Layers ∘ π = Layers; the padding lies after every real token and a causal layer's output at t reads
        only tokens ≤ t, so it changes nothing before it. The returned hidden states and every ``intermediates``
        entry are in natural order, unpadded. Permuting the [B,T] int arrays instead of activations costs nothing;
        the one [B,T,d] permutation is of the final hidden states. A cache stays in natural order and unsplit (the
        attention modules fill it so); a prefill whose T is not a multiple of 2n is refused (the padding would be
        written into the cache). Without a sequence mesh (or for T = 1) this is exactly the unsharded code path.
        """
        if remat and (cache is not None or intermediates is not None):
            raise ValueError(
                "remat=True is for training forward passes: it cannot be combined with a cache or with intermediates."
            )
        b, t = input_ids.shape
        cache_index = None if cache is None else cache["index"]
        if segment_ids is not None and positions is None:
            raise ValueError(
                "segment_ids (packed documents) need their per-document positions: pass the batch's positions too."
            )
        if positions is None:
            start = 0 if cache is None else cache_index
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        n = sequence_shards(t)
        pad = -t % sequence_parts(t)
        if pad and cache is not None:
            raise ValueError(
                f"a prefill of {t} tokens under context parallelism over {n} sequence devices must be a multiple of "
                f"{sequence_parts(t)} tokens (end-padding would be written into the cache). Fix: prefill the first "
                f"{t - t % sequence_parts(t)} tokens and feed the last {t % sequence_parts(t)} as decode steps "
                "(hydrahead_jax.evaluation.runner does), or run without a sequence mesh."
            )
        if n > 1:
            end_pad = lambda x: jnp.pad(x, ((0, 0), (0, pad)))  # noqa: E731  (any values: nothing real reads them)
            input_ids, positions = to_model_order(end_pad(input_ids), n), to_model_order(end_pad(positions), n)
            segment_ids = None if segment_ids is None else to_model_order(end_pad(segment_ids), n)
        h = constrain_tokens(self.embed_tokens(input_ids)) if n > 1 else self.embed_tokens(input_ids)
        record = intermediates is not None
        if record_heads and not record:
            raise ValueError("record_heads=True records into intermediates: pass an intermediates dict too.")
        names = ("attn_inputs", "attn_outputs", "attn_heads") if record_heads else ("attn_inputs", "attn_outputs")

        def run_layer(block, kind, h, _, slot, mine=None):
            seen: dict | None = {} if record else None
            h, mine = block(
                h, positions, mine, cache_index, seen, segment_ids=segment_ids, kind=kind, record_heads=record_heads
            )
            recorded = tuple(seen[name] for name in names) if record else None
            return (h, recorded) if cache is None else (h, recorded, mine)

        if cache is None:
            h, recorded = self.scan_layers(run_layer, h, remat=remat)
        else:
            (h, layers_cache), recorded = self.scan_layers(
                run_layer, h, cache=cache["layers"], cache_index=cache_index, cache_tokens=t
            )
        h = self.norm(h)
        if n > 1:
            natural = lambda x, axis=1: jax.lax.slice_in_dim(from_model_order(x, n, axis), 0, t, axis=axis)  # noqa: E731
            h = natural(h)
            recorded = None if recorded is None else tuple(natural(x, 2) for x in recorded)
        if record:
            intermediates.update(zip(names, recorded, strict=True))
        new_cache = None if cache is None else {"index": cache_index + t, "layers": layers_cache}
        return h, new_cache

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        """h [..., d] → logits [..., V] in float32."""
        if self.cfg.tie_word_embeddings:
            # h·Eᵀ as a contraction over E's feature axis: ``jnp.dot(h, E.T)`` (nnx.Embed.attend) makes XLA's CPU
            # backend write a transposed copy of the whole [V,d] table at every call.
            dtype = self.cfg.jnp_dtype
            table = self.embed_tokens.embedding[...].astype(dtype)
            return jnp.einsum("...d,vd->...v", h.astype(dtype), table).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(
        self, input_ids: jax.Array, *, positions: jax.Array | None = None, cache: dict[str, Any] | None = None
    ):
        """Logits [B,T,V]; with a cache, returns (logits, new_cache)."""
        h, new_cache = self.hidden_states(input_ids, positions=positions, cache=cache)
        logits = self.logits_from_hidden(h)
        return logits if cache is None else (logits, new_cache)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict[str, Any]:
        """{"index": 0, "layers": (per kind in ``kinds``: the attention's cache of that kind stacked over the
        layers of that kind, leading axis L_kind)}: layers of different kinds keep caches of different sizes
        (a student's KV cache holds only its FA groups), so each kind has its own stack."""
        dtype = self.cfg.jnp_dtype if dtype is None else dtype
        attn = self.layers.self_attn  # its cache depends on the config and the kind only, not on the weights
        stacks = []
        for kind in self.kinds:
            count = self.layer_kinds.count(kind)
            one = attn.init_cache(batch, max_len, dtype, kind=kind)
            stacks.append(jax.tree.map(lambda a: jnp.zeros((count, *a.shape), a.dtype), one))  # noqa: B023
        return {"index": jnp.zeros((), jnp.int32), "layers": tuple(stacks)}


# ------------------------------------------------------------------------------------------------------------
# Weights in Hugging Face naming and layout (torch Linear weights are [out, in]; ours are [in, out]).


def hf_weight_map(model: Transformer) -> dict[str, tuple[nnx.Variable, bool, int | None]]:
    """HF tensor name → (our Variable, whether the HF tensor is transposed relative to ours, the layer index along
    the Variable's leading axis for a layer tensor, else None)."""
    table = {}
    for name, tensor in hf_tensors(model.cfg).items():
        node = model
        for key in tensor.path:
            node = getattr(node, key)
        table[name] = (node, tensor.transposed, tensor.layer)
    return table


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The model's weights as Hugging Face tensors (HF names and layouts, float32; each layer tensor its slice of
    the stacked parameter): the inverse of ``load_hf_weights``."""
    out = {}
    for name, (var, transposed, layer) in hf_weight_map(model).items():
        value = np.asarray(var[...] if layer is None else var[...][layer], np.float32)
        out[name] = np.ascontiguousarray(value.T if transposed else value)
    return out


def load_hf_weights(model: Transformer, tensors: dict[str, np.ndarray], *, source: str = "checkpoint") -> None:
    """Copy HF-named tensors into ``model`` (a teacher) in place; every expected tensor must be present with the
    right shape. Layer tensors fill their slice of the stacked parameters."""
    table = hf_weight_map(model)
    ignorable = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing = sorted(set(table) - set(tensors))
    unexpected = sorted(n for n in set(tensors) - set(table) - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if missing:
        raise ValueError(
            f"{source}: missing tensors {missing[:8]}{' …' if len(missing) > 8 else ''} "
            f"({len(missing)} in all) for a {model.cfg.architecture} model with {model.cfg.num_layers} "
            "layers; is the checkpoint complete and does config.json match it?"
        )
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensors {unexpected[:8]} ({len(unexpected)} in all); the "
            "checkpoint does not match the config (another architecture or layer count?)."
        )
    values: dict[int, tuple[nnx.Variable, np.ndarray]] = {}  # id(var) → (var, its new value, assembled in numpy)
    for name, (var, transposed, layer) in table.items():
        value = np.asarray(tensors[name])
        if transposed:
            value = value.T
        shape = var.shape if layer is None else var.shape[1:]
        if value.shape != shape:
            expected = shape[::-1] if transposed else shape
            raise ValueError(
                f"{source}: tensor {name} has shape {tuple(np.asarray(tensors[name]).shape)}, "
                f"expected {tuple(expected)} from the model config."
            )
        if layer is None:
            values[id(var)] = (var, value)
            continue
        stacked = values.setdefault(id(var), (var, np.zeros(var.shape, value.dtype)))[1]
        stacked[layer] = value
    for var, value in values.values():
        var.set_value(jnp.asarray(value, dtype=var.dtype))

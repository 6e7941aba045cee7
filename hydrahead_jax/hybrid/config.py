"""Options of the HydraHead attention block (everything that is not the teacher's shape or the head map)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hydrahead_jax.config import ConfigError
from hydrahead_jax.context_parallel.attention import MODES as CONTEXT_PARALLEL_MODES
from pallas_kernels.dispatch import implementations

FUSIONS = ("none", "la_scale", "la_only", "both")
FUSION_GRANULARITIES = ("head", "channel")
FUSION_INITS = ("rms", "fit")
GDN_INITS = ("spread", "teacher")
# An option's switch field → the fields left out of ``HybridConfig.to_dict`` while the switch is off (falsy).
OPTIONAL_WHEN_OFF = {"la_window": ("la_window", "la_sinks")}


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """How LA (Gated DeltaNet) groups are built and how head outputs are fused.

    use_conv: depthwise causal conv (``conv_size`` taps) on the LA heads' q/k/v channels, identity-initialised
        and without activation, so it starts as the identity on the teacher's q/k/v.
    use_output_gate: o = RMSNorm(o) · silu(z), z = x·W_z (+ b_z), per LA head; initialised so silu(z) = 1.
    la_rope: rotate LA q/k with the teacher's RoPE before the delta rule. Off by default, by measurement: with
        rotation the LA heads' q̂·k̂ are the teacher's (cosine) logits, but a linear read-out sums every stored key
        without softmax's sharpening, and the fast-rotating RoPE components then add position noise instead of
        content match. SmolLM2-135M, one FA group per layer, 123 tokens of prose, fusion la_only, at init:
        KL(teacher‖student) 2.46 nats/token (ppl 152) without RoPE vs 4.30 (ppl 1503) with it; teacher ppl 15.7,
        LA heads zeroed instead: ppl 44,559. The decay α already gives the LA heads a sense of recency.
    fusion: how head outputs are recombined (``hybrid/attention.py``): "la_scale" (the LA heads scaled and offset,
        γ ⊙ o + μ, without a second normalisation; the FA heads are the teacher's), "la_only" (the LA heads
        RMS-normalised, then scaled), "both" (every head of a mixed layer RMS-normalised and scaled, the kept FA
        heads too), "none" (identity). Default "la_scale", measured at init on the SmolLM2 demo student
        (bench/RESULTS.md "Initialisation").
    fusion_granularity: one learnable γ per head ("head") or per head channel ("channel").
    fusion_bias: the fused heads get a learnable per-channel offset μ_h ∈ R^D after the scale,
        ô = γ_h ⊙ RMSNorm(o_h) + μ_h; zero-initialised (the model is unchanged until μ is fitted or trained).
        Off: no μ parameter (the parameter tree of models built before it existed).
    fusion_init: how γ (and μ) start, from the calibration batch: "rms" (γ scales the fused head to the teacher
        head's output RMS, μ = 0) or "fit" (γ, μ the least-squares fit of the fused head output to the teacher
        head's output, given the student's fusion input at init; ``hybrid/fusion.py``). "fit" without
        ``fusion_bias`` fits γ alone.
    gdn_dt_min, gdn_dt_max: range of the GDN heads' initial step dt (decay α = exp(−dt) per token at A = 1), spread
        geometrically over a layer's LA heads; memories of ~1/dt tokens.
    gdn_beta: the GDN heads' write strength β at init (W_b = 0): β_t = sigmoid(x_t W_b + logit(gdn_beta)), the
        offset a constant of the model (0.5: no offset) unless ``gdn_beta_bias``.
    gdn_beta_bias: the β offset is a trainable per-head parameter (``beta_bias``), starting at logit(gdn_beta) or
        at the teacher-calibrated value. Off: no parameter (the parameter tree of models built before it existed).
    gdn_qk_map: identity-initialised per-head maps on the LA heads' q and k before the L2 norm (new parameters, so
        stage 1 with train="new" trains them): the LA heads can adapt their attention pattern while the teacher's
        q/k/v weights, which the kept FA heads share, stay frozen (``hybrid/gdn.py``).
    gdn_init: "spread" (dt spread over [gdn_dt_min, gdn_dt_max] by head index, β = gdn_beta) or "teacher" (each
        LA head's dt from its teacher head's mean attention distance, clipped to [gdn_dt_min, gdn_dt_max], and β
        from its attention entropy, on the calibration batch; ``hybrid/gdn_init.py``; needs gdn_beta_bias).
    la_window, la_sinks: 0 (the paper, the default): the LA heads are Gated DeltaNet heads alone. > 0: each LA head
        also attends with its teacher head's softmax to its document's first ``la_sinks`` tokens and its last
        ``la_window`` tokens (``hybrid/window.py``, a constant-size cache of la_sinks + la_window keys and values),
        and the fused GDN output is added: o_h = window_h + γ_h ⊙ GDN_h + μ_h, so the GDN heads carry what lies
        beyond the window. Needs fusion "la_scale" with fusion_init "fit" (γ, μ then fit the teacher head minus
        its window part; hybrid/fusion.py). Measured on SmolLM2-135M with the demo's 11 probe-selected FA groups,
        the other 79 groups restricted to 4 sinks + 64 recent tokens and no GDN part, no training: KL(teacher ‖
        student) 0.09 nats/token and top-1 84 % on held-out news (bench/RESULTS.md "Streaming LA heads").
    gdn_chunk_size: chunk length of the chunked gated delta rule (prefill / training).
    gdn_implementation, attention_implementation: backend names passed to the kernels.
    attention_context_parallel: how the FA groups get their keys when the sequence is split over the ``sequence``
        mesh axis: "allgather" (gather the FA groups' K/V; cheap at 7:1) or "ring" (K/V blocks travel around the
        devices, one at a time). Unused without a sequence axis.
    """

    use_conv: bool = True
    conv_size: int = 4
    use_output_gate: bool = True
    la_rope: bool = False
    fusion: str = "la_scale"
    fusion_granularity: str = "head"
    fusion_bias: bool = False
    fusion_init: str = "rms"
    gdn_dt_min: float = 1e-3
    gdn_dt_max: float = 1e-1
    gdn_beta: float = 0.5
    gdn_beta_bias: bool = False
    gdn_init: str = "spread"
    gdn_qk_map: bool = False
    gdn_chunk_size: int = 64
    la_window: int = 0
    la_sinks: int = 4
    gdn_implementation: str = "auto"
    attention_implementation: str = "auto"
    attention_context_parallel: str = "allgather"

    def __post_init__(self):
        for field in ("use_conv", "use_output_gate", "la_rope", "fusion_bias", "gdn_beta_bias", "gdn_qk_map"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"HybridConfig.{field} must be True or False, got {getattr(self, field)!r}.")
        for field in ("conv_size", "gdn_chunk_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"HybridConfig.{field} must be a positive integer, got {value!r}.")
        for field in ("la_window", "la_sinks"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"HybridConfig.{field} must be an integer >= 0, got {value!r}.")
        if self.la_window and (self.fusion != "la_scale" or self.fusion_init != "fit"):
            raise ConfigError(
                f"HybridConfig.la_window={self.la_window} adds the LA heads' fused GDN output to their window "
                f"attention, which needs fusion='la_scale' and fusion_init='fit' (γ, μ fit the teacher head minus its "
                f"window part); got fusion={self.fusion!r}, fusion_init={self.fusion_init!r}. Set both, or "
                "la_window=0."
            )
        if self.gdn_chunk_size < 16 or self.gdn_chunk_size & (self.gdn_chunk_size - 1):
            raise ConfigError(
                f"HybridConfig.gdn_chunk_size={self.gdn_chunk_size} must be a power of two >= 16 "
                "(the chunked kernels' block shapes); 64 is the default."
            )
        if self.use_conv and self.conv_size < 2:
            raise ConfigError(
                f"HybridConfig.conv_size={self.conv_size}: a causal conv needs at least 2 taps; "
                "set use_conv=False to drop the conv instead."
            )
        if self.fusion not in FUSIONS:
            raise ConfigError(f"HybridConfig.fusion={self.fusion!r}; choose one of {FUSIONS}.")
        if self.fusion_granularity not in FUSION_GRANULARITIES:
            raise ConfigError(
                f"HybridConfig.fusion_granularity={self.fusion_granularity!r}; choose one of {FUSION_GRANULARITIES}."
            )
        if self.fusion_init not in FUSION_INITS:
            raise ConfigError(f"HybridConfig.fusion_init={self.fusion_init!r}; choose one of {FUSION_INITS}.")
        if self.fusion == "none" and (self.fusion_bias or self.fusion_init != "rms"):
            raise ConfigError(
                f"HybridConfig.fusion='none' has no fused heads, so fusion_bias={self.fusion_bias} and "
                f"fusion_init={self.fusion_init!r} have nothing to act on; set fusion='la_scale', 'la_only' or "
                "'both', or leave fusion_bias=False and fusion_init='rms'."
            )
        if self.gdn_init not in GDN_INITS:
            raise ConfigError(f"HybridConfig.gdn_init={self.gdn_init!r}; choose one of {GDN_INITS}.")
        if self.gdn_init == "teacher" and not self.gdn_beta_bias:
            raise ConfigError(
                "HybridConfig.gdn_init='teacher' sets a β offset per head, which needs the per-head parameter: "
                "set gdn_beta_bias=True (or gdn_init='spread')."
            )
        for field in ("gdn_dt_min", "gdn_dt_max", "gdn_beta"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"HybridConfig.{field} must be a number, got {value!r}.")
        if not 0 < self.gdn_dt_min <= self.gdn_dt_max:
            raise ConfigError(
                f"HybridConfig.gdn_dt_min={self.gdn_dt_min}, gdn_dt_max={self.gdn_dt_max}: need "
                "0 < gdn_dt_min <= gdn_dt_max (the defaults are 1e-3 and 1e-1)."
            )
        if not 0 < self.gdn_beta < 1:
            raise ConfigError(
                f"HybridConfig.gdn_beta={self.gdn_beta} is a sigmoid output: choose a value strictly between 0 and 1 "
                "(0.5 is the default)."
            )
        for field, op in (
            ("gdn_implementation", "chunk_gated_delta_rule"),
            ("attention_implementation", "flash_attention"),
        ):
            if getattr(self, field) not in implementations(op):
                raise ConfigError(
                    f"HybridConfig.{field}={getattr(self, field)!r}; choose one of {implementations(op)}."
                )
        if self.attention_context_parallel not in CONTEXT_PARALLEL_MODES:
            raise ConfigError(
                f"HybridConfig.attention_context_parallel={self.attention_context_parallel!r}; "
                f"choose one of {CONTEXT_PARALLEL_MODES}."
            )

    def replace(self, **changes) -> HybridConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, except those of an option that is off and that configs written before it existed lack
        (``OPTIONAL_WHEN_OFF``): so the recorded config, the run's fingerprint and the comparison's hashes of a
        run without the option stay what they were, and its workdirs and results resume and merge as before."""
        out = dataclasses.asdict(self)
        for switch, fields in OPTIONAL_WHEN_OFF.items():
            if not out[switch]:
                for name in fields:
                    out.pop(name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HybridConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"Unknown HybridConfig fields {unknown}; valid fields are {sorted(known)}.")
        return cls(**data)

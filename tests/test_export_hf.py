"""``python -m hydrahead_jax.export_hf``: a HydraHead student as a Hugging Face folder, run by transformers
(``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``, the copied modeling_hydrahead.py) against
the JAX model ``load_hydrahead`` reads from the same export.

Each student kind the project trains is built from a tiny random teacher (tests/oracle.py), its new parameters
(GDN heads, fusion) moved off their initial values so that every one of them shows in the logits, exported with
``export_final`` then ``export_hf``: float32 logits on the same tokens within ``LOGITS_ATOL``, greedy decoding of
32 tokens equal token for token (transformers' ``generate`` through the export's own cache), and for one kind
lm-eval's ``hf`` backend on the export equal to HydraHeadLM on the JAX model on the local tasks.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from lm_eval_helpers import MAX_LENGTH, TASKS, lm_eval_run, loglik_values, responses
from oracle import import_oracle, save_tiny_hf_model

# Measured 2026-12-07 (float32 on CPU, 2 rows x 40 tokens, logits of magnitude up to ~4.3): max |Δ logit| 7.3e-6
# (layerwise), 1.0e-5 (yarn), 1.3e-5 (gdn), 1.5e-5 (streaming): torch's token-loop delta rule and SDPA against XLA's
# chunked rule and flash attention. The bound leaves 6x headroom.
LOGITS_ATOL = 1e-4
# Measured with the streaming student: max |Δ log-likelihood| 6.1e-5 over the 31 lm-eval results (sums of up to
# 250 token log-probs); 3x headroom.
LOGLIK_ATOL = 2e-4
STREAMING = dict(
    la_window=8, la_sinks=2, fusion_init="fit", fusion_bias=True, fusion_granularity="channel",
    gdn_beta_bias=True, gdn_qk_map=True, la_rope=True,
)  # fmt: skip
# kind → (teacher architecture, FA groups per layer or "layerwise", HybridConfig options, RoPE extension)
KINDS = {
    "gdn": ("llama", [[1], []], {}, None),  # the paper's student: pure Gated DeltaNet LA heads
    "streaming": ("qwen2", [[0], []], STREAMING, None),  # sinks + window beside each GDN head, every GDN option on
    "yarn": ("qwen3", [[0], [1]], {"fusion": "la_only"}, "yarn:4"),  # context-extended by YaRN, tied embeddings
    "layerwise": ("llama", "layerwise", {"fusion": "both", "use_conv": False, "use_output_gate": False}, None),
}


def _perturb_new_parameters(student, seed: int) -> None:
    """GDN and fusion parameters off their initial values (x ← x + 0.3·N(0,1)), so each one matters."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(student, nnx.Param)):
        if {"gdn", "fusion"} & {str(p) for p in path}:
            var.set_value((var[...] + 0.3 * rng.standard_normal(var.shape)).astype(np.float32))


def export_kind(kind: str, root: Path, *flags: str) -> tuple[Path, Path]:
    """(the export_final folder, the Hugging Face folder ``python -m hydrahead_jax.export_hf FINAL OUT *flags``
    wrote) of a tiny student of ``kind``."""
    from hydrahead_jax.config import with_rope_extension
    from hydrahead_jax.export import export_final
    from hydrahead_jax.export_hf import main
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
    from hydrahead_jax.models import load_pretrained

    arch, groups, options, rope = KINDS[kind]
    teacher_dir = save_tiny_hf_model(root / "teacher", arch)
    teacher, _ = load_pretrained(str(teacher_dir))
    cfg = teacher.cfg
    head_map = (
        HeadMap.layerwise(cfg, fa_layers=[1])
        if groups == "layerwise"
        else HeadMap.from_fa_groups(cfg, groups, method="test")
    )
    hybrid = HybridConfig(**options)
    student = build_student(teacher, head_map, hybrid)
    _perturb_new_parameters(student, seed=1)
    graphdef, state = nnx.split(student)
    final = export_final(
        root / "final",
        graphdef,
        jax.tree.map(lambda x: x.copy(), nnx.as_pure(state)),
        with_rope_extension(cfg, rope) if rope else cfg,
        head_map,
        hybrid,
        teacher_source=str(teacher_dir),
    )
    assert main([str(final), str(root / "hf"), *flags]) == 0
    return final, root / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_export_runs_in_transformers_as_the_jax_model(kind, tmp_path):
    torch = import_oracle("torch")
    from transformers import AutoModelForCausalLM

    from hydrahead_jax.export import load_hydrahead
    from hydrahead_jax.models.generate import generate

    shards = ["--max-shard-size", "20KB"] if kind == "gdn" else []
    final, out = export_kind(kind, tmp_path, *shards)
    if shards:  # sharded past the size, with transformers' index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    model, _ = load_hydrahead(final)
    exported = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(exported).__name__ == "HydraHeadForCausalLM"
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 40)).astype(np.int32)
    with torch.no_grad():
        theirs = exported(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    ours = np.asarray(model(ids))
    print(f"\n{kind}: max |Δ logit| {np.abs(theirs - ours).max():.2e} (max |logit| {np.abs(ours).max():.1f})")
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=LOGITS_ATOL)

    prompt = ids[:1, :10]
    with torch.no_grad():
        torch_tokens = exported.generate(
            torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )[0, 10:].numpy()
    np.testing.assert_array_equal(torch_tokens, generate(model, prompt, 32)[0])
    if kind != "layerwise":  # every hybrid layer keeps a constant-size state beside its (smaller) KV cache
        cache = exported(torch.as_tensor(prompt, dtype=torch.long), use_cache=True)
        cache = getattr(cache, "cache", None) or cache.past_key_values
        assert cache.state_bytes() > 0 and cache.seen == 10


@pytest.mark.slow
def test_lm_evals_hf_backend_on_the_export_equals_hydraheadlm_on_the_jax_model(tmp_path):
    import_oracle("torch")
    import_oracle("lm_eval")
    from lm_eval.models.huggingface import HFLM

    from hydrahead_jax.evaluation.harness import HydraHeadLM

    final, out = export_kind("streaming", tmp_path)
    hf = HFLM(
        pretrained=str(out), trust_remote_code=True, dtype="float32", device="cpu", batch_size=1, max_length=MAX_LENGTH
    )
    hf_results = lm_eval_run(hf)
    our_results = lm_eval_run(HydraHeadLM(model=str(final), max_length=MAX_LENGTH))
    a, b = loglik_values(hf_results), loglik_values(our_results)
    print(f"\nexport vs JAX under lm-eval: max |Δ loglik| {np.abs(a - b).max():.2e} over {a.size} values")
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=LOGLIK_ATOL)
    assert responses(our_results)["hh_generate"] == responses(hf_results)["hh_generate"]
    for task in TASKS:
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in hf_results["results"][task]:
                assert our_results["results"][task][metric] == hf_results["results"][task][metric]


def test_an_unsupported_student_is_a_one_line_error(monkeypatch):
    from hydrahead_jax import export_hf
    from hydrahead_jax.config import ModelConfig
    from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_model

    cfg = ModelConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8
    )
    model = nnx.eval_shape(
        lambda: build_model(cfg, HeadMap.from_fa_groups(cfg, [[0]], method="test"), HybridConfig(), nnx.Rngs(0))
    )
    export_hf.check_exportable(model)  # the default student exports
    monkeypatch.setattr(export_hf, "EXPORTED_OPTIONS", export_hf.EXPORTED_OPTIONS - {"la_rope"})
    with pytest.raises(export_hf.ExportError, match=r"does not implement HybridConfig option\(s\) \['la_rope'\]"):
        export_hf.check_exportable(model)
    interleaved = nnx.eval_shape(
        lambda: build_model(cfg.replace(rope_interleaved=True), HeadMap.all_fa(cfg), None, nnx.Rngs(0))
    )
    with pytest.raises(export_hf.ExportError, match="interleaved RoPE"):
        export_hf.check_exportable(interleaved)


def test_missing_export_files_are_a_one_line_error(tmp_path, capsys):
    from hydrahead_jax.export_hf import main

    (tmp_path / "final").mkdir()
    assert main([str(tmp_path / "final"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not an exported HydraHead model" in err and "train.py" in err
    assert not (tmp_path / "hf").exists()

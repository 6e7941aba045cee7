"""Initialisation of the HydraHead student's new parameters (hybrid/fusion.py, hybrid/gdn.py): the least-squares
fusion fit against numpy's lstsq, the fitted head output γ·n + μ, μ = 0 reproducing the model without μ, the
GDN gate/β initial values, export/load with and without μ, and the distance to the teacher at init."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hybrid_model import CFG, _kl, _np, _rms_norm, _rope, forward, ids_of, naive_teacher_heads, random_teacher

from hydrahead_jax.config import ConfigError
from hydrahead_jax.export import export_final, load_hydrahead
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student, new_param_filter
from hydrahead_jax.hybrid.fusion import fit_scale_and_offset, fused_heads
from hydrahead_jax.hybrid.gdn_init import attention_statistics, beta_from_entropy, dt_from_distance


def lstsq_fit(n, o, granularity, bias):
    """γ, μ of min Σ ‖γ ⊙ n + μ − o‖² by numpy's lstsq on an explicit design matrix (independent of the closed
    form): n, o [N, H, D] → γ [H] or [H, D], μ [H, D]."""
    N, H, D = n.shape
    gamma = np.zeros((H,) if granularity == "head" else (H, D))
    mu = np.zeros((H, D))
    for h in range(H):
        if granularity == "head":
            # unknowns: γ_h and μ_{h,0..D-1}; one equation per (token, channel)
            cols = [n[:, h].reshape(-1, 1)]
            if bias:
                cols.append(np.tile(np.eye(D), (N, 1)))
            sol = np.linalg.lstsq(np.concatenate(cols, 1), o[:, h].reshape(-1), rcond=None)[0]
            gamma[h] = sol[0]
            if bias:
                mu[h] = sol[1:]
        else:
            for c in range(D):
                cols = [n[:, h, c : c + 1]] + ([np.ones((N, 1))] if bias else [])
                sol = np.linalg.lstsq(np.concatenate(cols, 1), o[:, h, c], rcond=None)[0]
                gamma[h, c] = sol[0]
                if bias:
                    mu[h, c] = sol[1]
    return gamma, mu


@pytest.mark.parametrize("granularity", ["head", "channel"])
@pytest.mark.parametrize("bias", [True, False])
def test_fit_matches_numpy_lstsq(granularity, bias):
    rng = np.random.default_rng(0)
    N, H, D = 40, 3, 8
    n = rng.normal(size=(N, H, D)) + rng.normal(size=(1, H, D))
    o = 0.7 * n + rng.normal(size=(1, H, D)) + 0.3 * rng.normal(size=(N, H, D))
    gamma, mu = (
        np.asarray(a, np.float64) for a in fit_scale_and_offset(jnp.asarray(n), jnp.asarray(o), granularity, bias)
    )
    want_gamma, want_mu = lstsq_fit(n, o, granularity, bias)
    np.testing.assert_allclose(gamma, want_gamma, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mu, want_mu, rtol=1e-4, atol=1e-5)


def test_fit_of_a_constant_input_is_mean_ablation():
    rng = np.random.default_rng(1)
    n = np.broadcast_to(rng.normal(size=(1, 2, 4)), (30, 2, 4))
    o = rng.normal(size=(30, 2, 4)) + 3.0
    gamma, mu = fit_scale_and_offset(jnp.asarray(n), jnp.asarray(o), "head", True)
    np.testing.assert_array_equal(np.asarray(gamma), 0.0)  # nothing to scale: no NaN from 0 / 0
    np.testing.assert_allclose(np.asarray(mu), o.mean(0), rtol=1e-5)


@pytest.mark.parametrize(
    "fusion,granularity",
    [
        ("la_scale", "head"),
        pytest.param("la_only", "head", marks=pytest.mark.slow),
        pytest.param("both", "channel", marks=pytest.mark.slow),
    ],
)
def test_fitted_heads_are_gamma_n_plus_mu_and_closer_to_the_teacher(fusion, granularity):
    cfg = CFG.replace(num_layers=1)
    teacher = random_teacher(cfg, seed=4)
    ids = ids_of((2, 24), seed=3)
    head_map = HeadMap.from_fa_groups(cfg, [[1]], method="test")
    x, teacher_heads = naive_teacher_heads(teacher, ids)
    positions = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (2, 24))

    def heads_of(hc):
        student = build_student(teacher, head_map, hc, calibration_ids=ids)
        attn = student.layer(0).self_attn
        run = jax.jit(
            lambda s, x, method: getattr(nnx.merge(nnx.graphdef(attn), s), method)(x, positions, kind=1),
            static_argnums=2,
        )
        state, x32 = nnx.state(attn), jnp.asarray(x, jnp.float32)
        stored = np.array([2, 3, 0, 1])  # the layer stores its FA group 1 (query heads 2, 3) first
        heads = np.asarray(run(state, x32, "head_outputs")[0], np.float64)[:, :, np.argsort(stored)]
        fused_in = np.asarray(run(state, x32, "fusion_inputs"), np.float64)
        return attn.fusion, heads, fused_in, list(fused_heads(student, 0))

    base = HybridConfig(fusion=fusion, fusion_granularity=granularity)
    fit, heads, fused_in, touched = heads_of(base.replace(fusion_init="fit", fusion_bias=True))
    gamma, mu = np.asarray(fit.gamma[...], np.float64), np.asarray(fit.mu[...], np.float64)
    # la_scale scales the gated output as it is; the normalising modes scale its per-token RMS normalisation
    n = (
        fused_in
        if fusion == "la_scale"
        else fused_in / np.sqrt(np.mean(fused_in**2, -1, keepdims=True) + cfg.rms_norm_eps)
    )
    g = gamma[:, None] if granularity == "head" else gamma
    np.testing.assert_allclose(heads[:, :, touched], g * n + mu, atol=1e-5)
    # γ, μ are the least-squares fit of n to the teacher's heads (here computed from the numpy teacher)
    target = teacher_heads[:, :, touched]
    flat = (-1, len(touched), cfg.head_dim)
    want_gamma, want_mu = lstsq_fit(n.reshape(flat), target.reshape(flat), granularity, True)
    np.testing.assert_allclose(gamma, want_gamma, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(mu, want_mu, rtol=1e-3, atol=1e-4)

    def error(h):
        return float(np.sum((h[:, :, touched] - target) ** 2))

    _, rms_heads, _, _ = heads_of(base)
    mean_ablation = float(np.sum((target - target.mean((0, 1))) ** 2))
    _, gamma_only, _, _ = heads_of(base.replace(fusion_init="fit"))
    # on the calibration batch the fit is the optimum over a set holding today's init and mean ablation
    assert error(heads) <= error(gamma_only) <= error(rms_heads)
    assert error(heads) <= mean_ablation
    assert error(heads) < 0.9 * error(rms_heads)


@jax.jit
def _loss(model, ids):
    return jnp.mean(jax.nn.logsumexp(model(ids), -1))


@nnx.jit
def _loss_grads(model, ids):
    return nnx.grad(_loss)(model, ids)


def test_zero_mu_reproduces_the_model_without_mu():
    fusion = "both"  # μ on every head of the hybrid layers, FA ones included
    teacher = random_teacher()
    ids = ids_of((2, 32), seed=5)
    head_map = HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test")
    today = build_student(teacher, head_map, HybridConfig(fusion=fusion), calibration_ids=ids)
    with_mu = build_student(teacher, head_map, HybridConfig(fusion=fusion, fusion_bias=True), calibration_ids=ids)
    mus = [v for p, v in nnx.to_flat_state(nnx.state(with_mu, new_param_filter)) if p[-1] == "mu"]
    # μ is a new (stage-1 trained) parameter, stacked over the 3 layers (each has an LA group)
    assert len(mus) == 1 and mus[0].shape[0] == 3
    np.testing.assert_array_equal(forward(with_mu, ids), forward(today, ids))
    grads_today = dict(nnx.to_flat_state(_loss_grads(today, jnp.asarray(ids))))
    for path, g in nnx.to_flat_state(_loss_grads(with_mu, jnp.asarray(ids))):
        if path[-1] == "mu":
            assert np.abs(np.asarray(g[...])).sum() > 0  # μ learns
        else:
            np.testing.assert_allclose(np.asarray(g[...]), np.asarray(grads_today[path][...]), rtol=1e-5, atol=1e-7)


def test_gdn_decay_and_beta_initial_values():
    teacher = random_teacher()
    head_map = HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test")
    x = jax.random.normal(jax.random.key(0), (1, 5, CFG.hidden_size))
    for hc, dt_range, beta in [
        (HybridConfig(), (1e-3, 1e-1), 0.5),
        (HybridConfig(gdn_dt_min=1e-4, gdn_dt_max=1e-2, gdn_beta=0.9), (1e-4, 1e-2), 0.9),
    ]:
        gdn = build_student(teacher, head_map, hc).layer(1).self_attn.gdn  # layer 1: all LA, 4 heads
        g, b = (np.asarray(a, np.float64) for a in gdn.decay_and_beta(x))
        np.testing.assert_allclose(-g[0, 0], np.geomspace(*dt_range, gdn.num_heads), rtol=1e-5)  # A = 1: g = −dt
        np.testing.assert_allclose(b, beta, rtol=1e-6)


def naive_teacher_probs(teacher, ids):
    """Causal attention probabilities [B,H,T,T] of a one-layer teacher in float64 numpy (as naive_teacher_heads)."""
    cfg = teacher.cfg
    layer = teacher.layer(0)
    attn = layer.self_attn
    B, T = ids.shape
    H, D, G = cfg.num_heads, cfg.head_dim, cfg.group_size
    x = _rms_norm(_np(teacher.embed_tokens.embedding)[ids], _np(layer.input_layernorm.weight), cfg.rms_norm_eps)
    q = _rms_norm(
        (x @ _np(attn.q_proj.kernel) + _np(attn.q_proj.bias)).reshape(B, T, H, D),
        _np(attn.q_norm.weight),
        cfg.rms_norm_eps,
    )
    k = _rms_norm(
        (x @ _np(attn.k_proj.kernel) + _np(attn.k_proj.bias)).reshape(B, T, -1, D),
        _np(attn.k_norm.weight),
        cfg.rms_norm_eps,
    )
    pos = np.broadcast_to(np.arange(T, dtype=np.float64), (B, T))
    q, k = _rope(q, pos, cfg.rope_theta), np.repeat(_rope(k, pos, cfg.rope_theta), G, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * D**-0.5
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_attention_statistics_by_hand():
    # one head, three queries: t=0 sees itself; t=1 splits 1/2, 1/2; t=2 puts 1/4, 1/4, 1/2 on keys 0, 1, 2
    p = np.array([[[[1, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]]]])
    distance, entropy = (float(a[0]) for a in attention_statistics(jnp.asarray(p), jnp.arange(3)))
    # distances: 0, 0.5·1, 0.25·2 + 0.25·1 = 0.75 → mean 1.25 / 3
    np.testing.assert_allclose(distance, 1.25 / 3, rtol=1e-6)
    # entropies over log(t+1), t ≥ 1: log 2 / log 2 = 1 and (2·¼·log 4 + ½·log 2) / log 3 = 1.5·log 2 / log 3
    np.testing.assert_allclose(entropy, (1 + 1.5 * np.log(2) / np.log(3)) / 2, rtol=1e-6)
    # a 1-token memory (d̄ = 1) has α = 1/2, dt = log 2; β runs from 0.9 (focused) to 0.1 (uniform)
    np.testing.assert_allclose(dt_from_distance(np.array([1.0, 1e4]), 1e-3, 1.0), [np.log(2), 1e-3], rtol=1e-6)
    np.testing.assert_allclose(beta_from_entropy(np.array([0.0, 1.0, 0.5])), [0.9, 0.1, 0.5])


@pytest.mark.parametrize(
    "fa_groups, la",
    [([[1]], [0, 1]), ([[0], [0, 1]], [2, 3])],
    ids=["la-group-0", "la-group-1-stored-first-then-an-fa-layer"],
)
def test_teacher_gdn_init_follows_each_teacher_head(fa_groups, la):
    cfg = CFG.replace(num_layers=len(fa_groups))
    teacher = random_teacher(cfg, seed=4)
    ids = ids_of((2, 24), seed=3)
    hc = HybridConfig(gdn_init="teacher", gdn_beta_bias=True, gdn_dt_min=1e-3, gdn_dt_max=2.0)
    student = build_student(teacher, HeadMap.from_fa_groups(cfg, fa_groups, method="test"), hc, calibration_ids=ids)
    gdn = student.layer(0).self_attn.gdn  # layer 0's GDN slots: its LA heads ``la`` (original indices) in order
    p = naive_teacher_probs(teacher, ids)[:, la]  # [B, 2, T, T]
    if len(fa_groups) > 1:  # layer 1 is all FA: its GDN slots stay zero, untouched by the calibration
        other = student.layer(1).self_attn.gdn
        assert not np.any(np.asarray(other.dt_bias[...])) and not np.any(np.asarray(other.beta_bias[...]))
    T = ids.shape[1]
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    d = np.mean(np.sum(p * np.maximum(t - s, 0), -1), axis=(0, 2))
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)[:, :, 1:] / np.log(np.arange(2, T + 1))
    want_dt = np.clip(np.log(1 + 1 / d), 1e-3, 2.0)
    want_beta = 0.1 + 0.8 * (1 - np.mean(h, axis=(0, 2)))
    x = jax.random.normal(jax.random.key(0), (1, 3, cfg.hidden_size))
    g, beta = (np.asarray(a, np.float64) for a in gdn.decay_and_beta(x))  # W_a = W_b = 0: per-head constants
    np.testing.assert_allclose(-g[0, 0], want_dt, rtol=1e-4)
    np.testing.assert_allclose(beta[0, 0], want_beta, rtol=1e-4)
    assert abs(want_beta[0] - want_beta[1]) > 1e-3 or abs(want_dt[0] - want_dt[1]) > 1e-3  # heads differ
    # the β offset is a new, trained parameter
    assert any(p[-1] == "beta_bias" for p, _ in nnx.to_flat_state(nnx.state(student, new_param_filter)))


def test_fit_and_mu_start_the_student_closer_to_the_teacher():
    teacher = random_teacher()
    teacher.lm_head.kernel.set_value(teacher.lm_head.kernel[...] * 10)  # a peaked teacher: informative KL
    calib, held_out = ids_of((4, 48), seed=8), ids_of((2, 48), seed=9)
    head_map = HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test")
    t_logits = forward(teacher, held_out)

    def kl(hc):
        return _kl(t_logits, forward(build_student(teacher, head_map, hc, calibration_ids=calib), held_out))

    today, fitted = kl(HybridConfig()), kl(HybridConfig(fusion_init="fit", fusion_bias=True))
    print(f"\nKL(teacher || student) at init on held-out ids: rms init {today:.4f}, fit with μ {fitted:.4f}")
    assert fitted < today


def test_export_loads_with_and_without_mu(tmp_path):
    teacher = random_teacher()
    ids = ids_of((2, 32), seed=5)
    head_map = HeadMap.from_fa_groups(CFG, [[0], [], [1]], method="test")
    for name, hc, strip in [
        ("fit", HybridConfig(fusion_init="fit", fusion_bias=True), False),
        # an export written before fusion_bias existed: hybrid_config.json without the new keys
        ("older", HybridConfig(), True),
    ]:
        student = build_student(teacher, head_map, hc, calibration_ids=ids)
        graphdef, state = nnx.split(student)
        final = export_final(
            tmp_path / name / "final",
            graphdef,
            jax.tree.map(lambda a: a.copy(), nnx.as_pure(state)),
            CFG,
            head_map,
            hc,
        )
        if strip:
            path = final / "hybrid_config.json"
            data = json.loads(path.read_text())
            new_keys = (
                "fusion_bias",
                "fusion_init",
                "gdn_dt_min",
                "gdn_dt_max",
                "gdn_beta",
                "gdn_beta_bias",
                "gdn_init",
            )
            path.write_text(json.dumps({k: v for k, v in data.items() if k not in new_keys}))
            manifest = json.loads((final / "MANIFEST.json").read_text())
            manifest["files"]["hybrid_config.json"] = path.stat().st_size
            (final / "MANIFEST.json").write_text(json.dumps(manifest))
        model, _ = load_hydrahead(final)
        has_mu = model.layers.self_attn.fusion.mu is not None
        assert has_mu == hc.fusion_bias
        np.testing.assert_array_equal(forward(model, ids), forward(student, ids))


@pytest.mark.parametrize(
    "changes,words",
    [
        (dict(fusion="none", fusion_init="fit"), "fusion='none'"),
        (dict(fusion="none", fusion_bias=True), "fusion='none'"),
        (dict(fusion_init="lstsq"), "fusion_init"),
        (dict(gdn_dt_min=0.1, gdn_dt_max=0.01), "gdn_dt_min <= gdn_dt_max"),
        (dict(gdn_dt_min=0.0), "0 < gdn_dt_min"),
        (dict(gdn_beta=1.0), "strictly between 0 and 1"),
        (dict(gdn_beta="high"), "must be a number"),
        (dict(gdn_init="teacher"), "gdn_beta_bias=True"),
        (dict(gdn_init="entropy"), "gdn_init"),
    ],
)
def test_bad_init_settings_are_refused(changes, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        HybridConfig(**changes)


def test_init_study_variants_and_reuse(tmp_path):
    from hydrahead_jax.experiments import init_study

    assert init_study.parse_variant("fit:fusion_init=fit,fusion_bias=True,gdn_dt_min=1e-4") == (
        "fit",
        {"fusion_init": "fit", "fusion_bias": True, "gdn_dt_min": 1e-4},
    )
    for bad in ("fit", "x:nonsense=1", "x:fusion_init"):
        with pytest.raises(init_study.StudyError, match="FIELD=VALUE"):
            init_study.parse_variant(bad)
    assert init_study.main(["--no-defaults", "--variant", "bad:gdn_beta=2"]) == 2  # refused before any loading
    for changes in init_study.DEFAULT_VARIANTS.values():
        HybridConfig(**changes)  # every built-in variant is a valid config
    settings = dict(config="c", teacher="t", head_map="h", rows=4, length=512, calibration_shape=[4, 256], stage1=None)
    row = {"hybrid": {}, "at_init": {"kl": 1.0}, "after_stage1": {"kl": 0.5}, "stage1_seconds": 3.0}
    path = tmp_path / "init_study.json"
    path.write_text(json.dumps({"settings": settings, "variants": {"default": row}}))
    # a stage-1 run of other settings keeps the at-init numbers only; other windows keep nothing
    assert init_study._reusable(path, {**settings, "stage1": {"steps": 40}}) == {
        "default": {"hybrid": {}, "at_init": {"kl": 1.0}}
    }
    assert init_study._reusable(path, settings) == {"default": row}
    assert init_study._reusable(path, {**settings, "rows": 2}) == {}


@pytest.mark.slow  # trains stage 1 through the trainer
def test_init_study_after_stage1_measures_stage1s_final_student(tmp_path):
    """``Study.after_stage1`` trains stage 1 through the pipeline and measures the student of its final checkpoint
    (it once handed the restore the module instead of its state: the restore failed and the checkpoint was set
    aside as corrupt). Checked against the checkpoint restored independently (tests/test_heldout.py)."""
    from test_heldout import _restore

    from hydrahead_jax.experiments import init_study
    from hydrahead_jax.run_config import STAGES
    from hydrahead_jax.training.pipeline import load_teacher, run_pipeline

    recipe = str(tmp_path / "recipe.py")  # the tiny recipe, a batch row per simulated device
    (tmp_path / "recipe.py").write_text(
        "from configs import tiny\n\n\ndef get_config(arg=None):\n    c = tiny.get_config()\n"
        "    for key in ('stage1', 'stage2', 'stage3'):\n        c[key].batch_size = 8\n    return c\n"
    )
    run_pipeline(init_study.run_config(recipe, {}), tmp_path / "select", until_stage="select")
    study = object.__new__(init_study.Study)  # the parts after_stage1 uses: the tiny teacher has no tokenizer
    study.recipe, study.out = recipe, tmp_path
    study.head_map_path = str(tmp_path / "select" / "head_map.json")
    _, _, study.cfg = load_teacher(init_study.run_config(recipe, {}).teacher)
    study.head_map = HeadMap.load(study.head_map_path, study.cfg)
    measured = {}
    study.measure = lambda name, student: measured.setdefault(name, student) and {"kl": 0.0}
    hybrid = {"fusion_init": "fit", "fusion_bias": True}
    _, seconds = study.after_stage1("fit", hybrid, {"steps": 2, "checkpoint_every": 2, "heldout_rows": 0})
    assert seconds > 0 and not (tmp_path / "runs" / "fit" / STAGES[0].directory / "corrupt").exists()

    c = init_study.load_recipe(recipe)
    c.hybrid.update(hybrid)
    want, _ = _restore(tmp_path / "runs" / "fit", STAGES[0].directory, c)
    got = nnx.to_flat_state(nnx.state(measured["fit"]))
    want = nnx.to_flat_state(nnx.state(want))
    assert [path for path, _ in got] == [path for path, _ in want]
    for (path, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))

"""Sources per stage and weighted mixtures: the recipe's sources lists refused when bad (before any work), the mixture
of two stores whose rows tell their source by their token ids (each source has words of its own) against binomial
intervals, min_doc_tokens, one source read as it was before mixtures, and a train.py run mixing two sources by weight
in stages 1-2 with stage 3 on a third: its logged proportions against an independent count of the rows.

Interval rule: a source of weight share p over n rows gives k rows with |k − n·p| ≤ 3·√(n·p·(1 − p)) (three standard
deviations of a binomial draw per row; the mixture's fixed pattern is tighter, within 1 of n·p plus the pattern's
rounding of the weights, also checked)."""

import importlib.util
import math
import re
import textwrap

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from train_helpers import run_train  # (puts the repository root, and so configs/, on sys.path)

from configs.smollm2_hydrahead import get_config
from configs.tiny import get_config as tiny
from hydrahead_jax.config import ConfigError, ModelConfig
from hydrahead_jax.data.mixture import WeightedStore, source_counts
from hydrahead_jax.data.pipeline import make_dataset
from hydrahead_jax.data.preparation import prepare_corpus
from hydrahead_jax.data.tiny_tokenizer import TokenizersAdapter
from hydrahead_jax.run_config import STAGES, RunConfig

PREFIXES = ("a", "b", "c")  # source a's words a0 … a59, source b's b0 …, source c's c0 …
WORDS = 60


def word_tokenizer() -> TokenizersAdapter:
    """<eos> = 0, then the words of each source: token id t > 0 belongs to source (t − 1) // WORDS."""
    vocab = {"<eos>": 0}
    for p in PREFIXES:
        vocab.update({f"{p}{i}": len(vocab) for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return TokenizersAdapter(tok, name="mixture-words", eos_token="<eos>")


def source_of(ids: np.ndarray) -> set[int]:
    return {int(t - 1) // WORDS for t in np.unique(ids) if t > 0}


def write_source(folder, prefix: str, docs: int, lo: int, hi: int, seed: int):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    lines = [" ".join(f"{prefix}{w}" for w in rng.integers(0, WORDS, rng.integers(lo, hi))) for _ in range(docs)]
    (folder / "docs.txt").write_text("\n\n".join(lines))
    return folder


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    tok = word_tokenizer()
    paths = {
        "a": write_source(root / "a", "a", 60, 10, 60, 1),
        "b": write_source(root / "b", "b", 60, 10, 60, 2),
        "c": write_source(root / "c", "c", 30, 100, 400, 3),
    }
    stores = {
        k: prepare_corpus(tok, p, out_dir=root / f"store_{k}", txt_split="paragraphs", validation_fraction=0.2)
        for k, p in paths.items()
    }
    return tok, paths, stores


def within_binomial(k: int, n: int, p: float) -> bool:
    return abs(k - n * p) <= 3 * math.sqrt(n * p * (1 - p))


def rows_by_source(dataset, batches: int) -> list[int]:
    """How many rows of the first ``batches`` batches come from each source (by their token ids)."""
    counts = [0, 0, 0]
    it = iter(dataset)
    for _ in range(batches):
        for row in next(it)["input_ids"]:
            (only,) = source_of(row)  # a row never mixes sources
            counts[only] += 1
    return counts


# ------------------------------------------------------------------------------------------------ recipes


@pytest.mark.parametrize(
    "value,message",
    [
        (({"path": "/x", "weight": 0.0},), r"config\.data\.sources\[0\]\.weight=0\.0: must be finite and > 0"),
        (({"path": "/x", "weight": float("nan")},), r"weight=nan: must be finite"),
        (({"path": "/x", "wieght": 2.0},), r"sources\[0\]=.*unknown \['wieght'\]"),
        (({"weight": 2.0},), r"sources\[0\]=.*path required"),
        (({"path": "/x", "min_doc_tokens": -5},), r"min_doc_tokens=-5: must be >= 0"),
        (({"path": "copy"},), r"path='copy': 'copy' is no corpus to mix"),
        (({"path": "/x", "weight": "heavy"},), r"weight='heavy': expected a number"),
    ],
)
def test_bad_sources_are_refused_when_the_recipe_is_read(value, message):
    c = get_config()
    c.data.sources = value
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_recipe(c)


def test_stage_sources_resolve_and_copy_refuses_them():
    c = get_config()
    c.data.sources = ("/data/web", {"path": "/data/books", "weight": 0.5})
    c.stage3.sources = ({"path": "/data/books", "min_doc_tokens": 4096},)
    run = RunConfig.from_recipe(c)
    assert [(s.path, s.weight) for s in run.stage_sources(STAGES[0])] == [("/data/web", 1.0), ("/data/books", 0.5)]
    assert [(s.path, s.min_doc_tokens) for s in run.stage_sources(STAGES[2])] == [("/data/books", 4096)]
    t = tiny()
    t.stage2.sources = ("/data/web",)
    with pytest.raises(ConfigError, match=r"config\.stage2\.sources names corpora, and data\.source='copy'"):
        RunConfig.from_recipe(t)


def test_a_missing_source_path_is_refused_naming_its_key(tmp_path):
    from hydrahead_jax.data.corpus import CorpusError
    from hydrahead_jax.training.pipeline import validate_against_teacher

    c = get_config()
    c.stage3.sources = ({"path": str(tmp_path / "gone")},)
    run = RunConfig.from_recipe(c)
    cfg = ModelConfig(
        vocab_size=181, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8
    )
    with pytest.raises(CorpusError, match=r"config\.stage3\.sources\[0\]\.path: corpus source .*gone does not exist"):
        validate_against_teacher(run, cfg, word_tokenizer())


# ------------------------------------------------------------------------------------------------ the mixture


def test_two_sources_by_weight_within_their_binomial_intervals(corpora):
    tok, _, stores = corpora
    sources = [WeightedStore(stores["a"], 3.0, name="a"), WeightedStore(stores["b"], 1.0, name="b")]
    ds = make_dataset(sources, seq_len=16, batch_size=8, seed=5, tokenizer=tok)
    counts = rows_by_source(ds, 50)
    n = sum(counts)
    assert n == 400 and counts[2] == 0
    assert within_binomial(counts[0], n, 0.75) and within_binomial(counts[1], n, 0.25)
    assert abs(counts[0] - 300) <= 1  # the fixed pattern: exact up to rounding
    assert source_counts([3.0, 1.0], 0, 400) == counts[:2]
    # resume at batch 20 on another row split: the same rows as the uninterrupted run's batches 20-29
    whole = iter(make_dataset(sources, seq_len=16, batch_size=8, seed=5, batch_rows=range(8)))
    for _ in range(20):
        next(whole)
    shares = [
        iter(make_dataset(sources, seq_len=16, batch_size=8, seed=5, shard_index=p, shard_count=2, start_batch=20))
        for p in range(2)
    ]
    for _ in range(10):
        want, got = next(whole)["input_ids"], [next(s)["input_ids"] for s in shares]
        np.testing.assert_array_equal(want[0::2], got[0])
        np.testing.assert_array_equal(want[1::2], got[1])


def test_min_doc_tokens_reads_only_long_documents(corpora):
    """Unshuffled, the rows are consecutive pieces of the stream of the documents of at least min_doc_tokens
    tokens, in store order (the others skipped)."""
    from hydrahead_jax.data.store import CorpusStore

    _, _, stores = corpora
    store = CorpusStore(stores["a"])
    cut = int(np.median(store.doc_lengths))
    stream = np.concatenate([store.document(d) for d in range(store.num_docs) if store.doc_lengths[d] >= cut])
    ds = make_dataset([WeightedStore(stores["a"], 1.0, cut)], seq_len=8, batch_size=4, seed=1, shuffle=False)
    it = iter(ds)
    rows = np.concatenate([next(it)["input_ids"].reshape(-1) for _ in range(10)])
    np.testing.assert_array_equal(rows, stream[: len(rows)])
    assert len(stream) < store.num_tokens  # some documents were skipped
    with pytest.raises(ValueError, match=r"no document of min_doc_tokens=100000 tokens or more"):
        make_dataset([WeightedStore(stores["a"], 1.0, 100_000)], seq_len=8, batch_size=4, seed=1)


def test_one_source_reads_as_before_mixtures(corpora):
    """A store path and the same store as the one WeightedStore of a list give the same rows, with synthetic rows
    mixed in or not."""
    tok, _, stores = corpora
    for kw in ({}, {"num_epochs": 1}):
        a = iter(make_dataset(stores["a"], seq_len=16, batch_size=4, seed=3, **kw))
        b = iter(make_dataset([WeightedStore(stores["a"])], seq_len=16, batch_size=4, seed=3, **kw))
        for _ in range(5):
            x, y = next(a), next(b)
            assert all(np.array_equal(x[k], y[k]) for k in x)


# ------------------------------------------------------------------------------------------------ train.py


RECIPE = """
from configs.tiny import get_config as tiny


def get_config(arg=None):
    c = tiny()
    c.teacher.source = {teacher!r}
    c.teacher.model = {{}}
    c.data.source = "enwiki"
    c.data.txt_split = "paragraphs"
    c.data.validation_fraction = 0.2
    c.data.sources = ({{"path": {a!r}, "weight": 3.0}}, {{"path": {b!r}, "weight": 1.0}})
    c.stage3.sources = ({{"path": {c!r}, "min_doc_tokens": 150}},)
    for key in ("stage1", "stage2", "stage3"):
        c[key].steps = 4
        c[key].batch_size = 8
        c[key].checkpoint_every = 4
        c[key].heldout_rows = 2
    return c
"""


@pytest.mark.slow
def test_train_py_mixes_two_sources_by_weight_and_stage_3_reads_its_own(corpora, tmp_path, monkeypatch):
    from flax import nnx

    from hydrahead_jax.models import Transformer
    from hydrahead_jax.models.loaders import save_hf_folder
    from hydrahead_jax.training.data import make_stage_iterator, prepare_stores, stage_stores

    tok, paths, _ = corpora
    cfg = ModelConfig.from_dict(dict(tiny().teacher.model, vocab_size=tok.vocab_size))  # the tiny recipe's shapes
    teacher = save_hf_folder(Transformer(cfg, rngs=nnx.Rngs(0)), tok, tmp_path / "teacher")
    recipe = tmp_path / "recipe.py"
    recipe.write_text(
        textwrap.dedent(RECIPE).format(teacher=str(teacher), a=str(paths["a"]), b=str(paths["b"]), c=str(paths["c"]))
    )
    proc = run_train(tmp_path / "run", config=str(recipe), extra_env={"HYDRAHEAD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = {
        stage: [(name, int(n)) for name, n in re.findall(r"(\S+) [\d.]+ % \((\d+)\)", line)]
        for stage, line in re.findall(r"\[(stage\d_\w+)\] data: (.*)", proc.stdout)
    }
    assert set(logged) == {"stage1_align", "stage2_distil", "stage3_long"}
    assert logged["stage3_long"] == [(str(paths["c"]), 32)]  # stage 3: its own source, every row
    for stage in ("stage1_align", "stage2_distil"):
        (name_a, k_a), (name_b, k_b) = logged[stage]
        assert (name_a, name_b) == (str(paths["a"]), str(paths["b"])) and k_a + k_b == 32
        assert within_binomial(k_a, 32, 0.75) and within_binomial(k_b, 32, 0.25)
    # the rows each stage's iterator reads (the pipeline's seeds), classified by their token ids
    spec = importlib.util.spec_from_file_location("recipe", recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = RunConfig.from_recipe(module.get_config())
    monkeypatch.setenv("HYDRAHEAD_CACHE", str(tmp_path / "cache"))
    stores = prepare_stores(run, tok)
    for index, stage in enumerate(STAGES):
        scfg = run.stage(stage)
        it = make_stage_iterator(
            run.data,
            seq_len=scfg.seq_len,
            batch_size=scfg.batch_size,
            seed=run.seed + 1000 * (index + 1),
            vocab_size=tok.vocab_size,
            synthetic_rate=0.0,
            store_path=stage_stores(run, stage, stores),
            batch_rows=range(scfg.batch_size),
        )
        counts = [0, 0, 0]
        for _ in range(scfg.steps):
            for row in next(it)["input_ids"]:
                (only,) = source_of(row)
                counts[only] += 1
        want = [n for _, n in logged[stage.directory]]
        assert (counts[2] == 32) if index == 2 else (counts[:2] == want)


def test_the_data_digest_is_the_store_name_for_one_source_and_holds_the_weights_of_a_mixture(corpora):
    """A run on data.source alone is identified by its store's content address, as before mixtures (so its workdir
    fingerprint is unchanged); a mixture by every stage's stores, weights and minimum lengths."""
    from hydrahead_jax.data.preparation import default_store_path, resolve_source
    from hydrahead_jax.training.data import data_digest

    tok, paths, stores = corpora
    by_path = {str(paths[k]): stores[k] for k in stores}
    c = get_config()
    c.data.source = str(paths["a"])
    cache_name = default_store_path(resolve_source(paths["a"], txt_split="paragraphs"), tok).name
    assert data_digest(RunConfig.from_recipe(c), {str(paths["a"]): stores["a"]}) == cache_name
    c.data.sources = (str(paths["a"]), {"path": str(paths["b"]), "weight": 0.5})
    mixed = data_digest(RunConfig.from_recipe(c), by_path)
    c.data.sources = (str(paths["a"]), {"path": str(paths["b"]), "weight": 0.25})
    assert mixed.startswith("mixture-") and data_digest(RunConfig.from_recipe(c), by_path) != mixed
    c.stage3.sources = ({"path": str(paths["c"]), "min_doc_tokens": 10},)
    assert data_digest(RunConfig.from_recipe(c), by_path) not in (mixed, cache_name)

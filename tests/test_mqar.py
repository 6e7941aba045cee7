"""MQAR sequences (data/mqar.py): the form of Zoology's task, checked element by element, and the symbols' tokens."""

import numpy as np
import pytest

from hydrahead_jax.data.mqar import MQARSymbols, SymbolIds, check_shape, mqar_batch, mqar_example

SYMBOLS = SymbolIds(keys=np.arange(100, 132), values=np.arange(200, 232), fillers=np.arange(300, 304))


@pytest.mark.parametrize("pairs,length", [(1, 4), (8, 64), (16, 64), (32, 256)])
def test_pairs_then_each_key_queried_once_with_its_value(pairs, length):
    ex = mqar_example(np.random.default_rng(pairs), SYMBOLS, num_pairs=pairs, length=length)
    ids = ex.ids
    assert ids.shape == (length,) and ids.dtype == np.int32
    keys, values = ids[0 : 2 * pairs : 2], ids[1 : 2 * pairs : 2]
    assert len(set(keys)) == pairs and set(keys) <= set(SYMBOLS.keys.tolist())
    assert len(set(values)) == pairs and set(values) <= set(SYMBOLS.values.tolist())
    table = dict(zip(keys.tolist(), values.tolist(), strict=True))
    pos = ex.query_positions
    assert len(pos) == pairs and np.all(np.diff(pos) >= 2) and pos[0] >= 2 * pairs
    assert np.all((pos - 2 * pairs) % 2 == 0)  # queries start two-token slots
    assert sorted(ids[pos].tolist()) == sorted(keys.tolist())  # every key asked exactly once
    assert [table[k] for k in ids[pos].tolist()] == ex.answers.tolist() == ids[pos + 1].tolist()
    rest = np.ones(length, bool)
    rest[: 2 * pairs] = False
    rest[pos] = rest[pos + 1] = False
    assert set(ids[rest].tolist()) <= set(SYMBOLS.fillers.tolist())


def test_deterministic_and_queries_cluster_early_under_the_power_law():
    a = mqar_batch(5, SYMBOLS, rows=4, num_pairs=4, length=256)
    b = mqar_batch(5, SYMBOLS, rows=4, num_pairs=4, length=256)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))

    # slots i = 1 … 124 drawn with weight i^(a-1): with a = 0.01 the median query slot is far below the uniform
    # median (62); with a = 1 (uniform) it is near it.
    def median_slot(power_a):
        _, pos, _ = mqar_batch(0, SYMBOLS, rows=400, num_pairs=4, length=256, power_a=power_a)
        return np.median((pos - 8) // 2)

    assert median_slot(0.01) < 20
    assert 45 < median_slot(1.0) < 80


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="length >= 4 x pairs"):
        check_shape(16, 63)
    with pytest.raises(ValueError, match="distinct keys"):
        mqar_example(np.random.default_rng(0), SYMBOLS, num_pairs=40, length=256)


def test_symbols_are_single_tokens_and_text_tokenises_back(tmp_path):
    from hydrahead_jax.data.mqar import text
    from hydrahead_jax.experiments.small_teacher import TeacherRecipe, train_tokenizer

    recipe = TeacherRecipe(vocab_size=300, symbols=MQARSymbols(num_keys=8, num_values=8, num_fillers=2))
    tok = train_tokenizer(["The quick brown fox jumps over the lazy dog. " * 20], recipe, tmp_path / "tok")
    ids = recipe.symbols.ids(tok)
    assert len(set(ids.keys.tolist() + ids.values.tolist() + ids.fillers.tolist())) == 18
    ex = mqar_example(np.random.default_rng(1), ids, num_pairs=4, length=32)
    assert tok.encode(text(ex.ids, tok)) == ex.ids.tolist()
    assert int(ids.keys[3]) in tok.encode("a <k3> b")  # a symbol is one token inside text too

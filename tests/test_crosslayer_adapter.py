"""Cross-layer methods through the mlx-lm adapter: make_cache builds a model's layers in one
call, the model-level record and the arrays layers share are saved and loaded once, batched one
record per row with a row's layers sharing their copies, the live memory of a decode is what
the caches report, and layers of different shapes in one group are refused."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import velox.methods.minicache as mc
import velox.methods.xquant as xq
from velox.registry import get_method

pytestmark = pytest.mark.unchecked

PROMPT = [i % 90 + 1 for i in range(45)]

# Per method: parameters for the 3-layer tiny llama, each layer's role, and the pair (layer,
# field) -> (layer, field) of an array a layer holds that is another layer's own.
CASES = {
    "xquant": (dict(window=8), ["anchor", "reuse", "anchor"],
               ((1, "shared_key_codes"), (0, "key_codes"))),
    "minicache": (dict(start_frac=0.0, retention_threshold=0.0), ["primary", "merge", "primary"],
                  ((1, "directions_keys"), (0, "directions_keys"))),
}


def _run(model, caches, tokens=PROMPT, steps=3):
    model(mx.array([tokens]), cache=caches)
    for t in range(steps):
        model(mx.array([[t + 5]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _shared(caches, key):
    """The array a layer holds and the other layer's own (which must be one array)."""
    (a, fa), (b, fb) = CASES[key][2]
    return getattr(caches[a].velox_state, fa), getattr(caches[b].velox_state, fb)


def _distinct_bytes(caches) -> int:
    """Bytes of every distinct array the caches and their record hold."""
    seen = {}
    for tree in [c.velox_state for c in caches] + [caches[0]._model.record]:
        for _, a in tree_flatten(tree):
            if isinstance(a, mx.array):
                seen[id(a)] = a.nbytes
    return sum(seen.values())


@pytest.mark.parametrize("key", sorted(CASES))
def test_make_cache_saves_loads_and_batches_what_layers_share(tiny_llama, tmp_path, key):
    from velox.adapters.mlxlm import VeloxCache, cache_nbytes, load_cache, make_cache, save_cache

    params, roles, _ = CASES[key]
    m = get_method(key)
    caches = _run(tiny_llama, make_cache(tiny_llama, key, **params))
    assert [c.velox_state.role for c in caches] == roles
    held, own = _shared(caches, key)
    assert held is own and own.size > 0
    assert cache_nbytes(caches) == _distinct_bytes(caches)  # each array counted once
    path = tmp_path / f"{key}.safetensors"
    save_cache(path, caches)
    loaded, _ = load_cache(path)
    held, own = _shared(loaded, key)
    assert held is own  # one array in the file and in memory
    assert cache_nbytes(loaded) == cache_nbytes(caches) == _distinct_bytes(loaded)
    # batched: one row per request, a row's layers sharing their copies
    rows = [VeloxCache.merge([c]) for c in caches]
    held, own = _shared([r.rows[0] for r in rows], key)
    assert held is own and own is not _shared(caches, key)[1]
    alone = copy.deepcopy(caches)
    for batch, single in ((rows, alone), (loaded, caches)):
        _run(tiny_llama, batch, tokens=[7], steps=1)
        _run(tiny_llama, single, tokens=[7], steps=1)
    for a, b in zip(rows, alone):
        for x, y in zip(m.get_kv(a.rows[0].velox_state), m.get_kv(b.velox_state)):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-5)
    for a, b in zip(loaded, caches):
        for x, y in zip(m.get_kv(a.velox_state), m.get_kv(b.velox_state)):
            assert mx.array_equal(x, y).item()


def test_the_records_say_who_gives_to_whom(tiny_llama):
    from velox.adapters.mlxlm import make_cache

    caches = _run(tiny_llama, make_cache(tiny_llama, "xquant", window=8))
    record, st = caches[0]._model.record, [c.velox_state for c in caches]
    assert record.anchors == (0, 0, 2) and record.source == 2 and record.key_codes is st[2].key_codes
    assert xq.quantized_tokens(st[1]) == xq.quantized_tokens(st[0]) == 32
    caches = _run(tiny_llama, make_cache(tiny_llama, "minicache", **CASES["minicache"][0]))
    record, st = caches[0]._model.record, [c.velox_state for c in caches]
    assert record.primary == (0, 0, -1)
    assert record.rows["1.keys"] is st[1].keys  # its newest rows, for layer 0's next update
    assert record.shared["0.kept_values"] is st[0].kept_values is st[1].kept_values
    assert mc.counts(st[0])["exact"] == mc.counts(st[1])["exact"] == 1  # the last decode token


@pytest.mark.parametrize("key,params", [("xquant", dict(window=8)),
                                        ("minicache", dict(start_frac=0.0))])
def test_layers_of_different_shapes_are_refused_in_one_group(key, params):
    from tests.test_adapter import TwoShapeModel
    from velox.adapters.mlxlm import make_cache

    mx.random.seed(1)
    model = TwoShapeModel()
    mx.eval(model.parameters())
    with pytest.raises(ValueError, match="the layers of a group must have the same shapes"):
        _run(model, make_cache(model, key, **params))
    caches = _run(model, make_cache(model, key, **params, group_size=1))
    assert len(caches) == 2


@pytest.mark.parametrize("key,params", [("xquant", dict(window=0, residual_bits=0)),
                                        ("minicache", dict(start_frac=0.0, retention_threshold=-1.0))])
def test_live_memory_is_what_the_caches_report(key, params):
    """A decode leaves the caches' nbytes live: the second layer's view of the first layer's
    arrays (XQuant's codes, MiniCache's merged directions), uncounted, is no copy."""
    from mlx_lm.models import llama

    from velox.adapters.mlxlm import cache_nbytes, make_cache

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=97, rope_theta=10000.0))
    mx.eval(model.parameters())

    def run():
        return _run(model, make_cache(model, key, **params),
                    tokens=[i % 90 + 1 for i in range(512)], steps=4)

    run()  # warm
    mx.clear_cache()
    mem0 = mx.get_active_memory()
    caches = run()
    mx.clear_cache()
    live, reported = mx.get_active_memory() - mem0, cache_nbytes(caches)
    held, own = CASES[key][2]
    second, first = getattr(caches[1].velox_state, held[1]), getattr(caches[0].velox_state, own[1])
    assert second is first and second.nbytes >= 64 << 10
    assert live <= reported + (32 << 10), (live, reported)

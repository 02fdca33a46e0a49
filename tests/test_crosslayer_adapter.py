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

import velox.methods.xquant as xq
from velox.registry import get_method

pytestmark = pytest.mark.unchecked

M = get_method("xquant")

PROMPT = [i % 90 + 1 for i in range(45)]


def _run(model, caches, tokens=PROMPT, steps=3):
    model(mx.array([tokens]), cache=caches)
    for t in range(steps):
        model(mx.array([[t + 5]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def _shared_once(caches) -> int:
    """Bytes of every distinct array the caches and their record hold."""
    seen = {}
    for c in caches:
        for _, a in tree_flatten(c.velox_state):
            if isinstance(a, mx.array):
                seen[id(a)] = a.nbytes
    for _, a in tree_flatten(caches[0]._model.record):
        if isinstance(a, mx.array):
            seen[id(a)] = a.nbytes
    return sum(seen.values())


def test_make_cache_saves_loads_and_batches_the_shared_codes(tiny_llama, tmp_path):
    from velox.adapters.mlxlm import VeloxCache, cache_nbytes, load_cache, make_cache, save_cache

    caches = _run(tiny_llama, make_cache(tiny_llama, "xquant", window=8))
    st = [c.velox_state for c in caches]
    assert [s.role for s in st] == ["anchor", "reuse", "anchor"]
    assert st[1].shared_key_codes is st[0].key_codes and xq.quantized_tokens(st[1]) == 32
    record = caches[0]._model.record
    assert record.anchors == (0, 0, 2) and record.key_codes is st[2].key_codes
    assert cache_nbytes(caches) == _shared_once(caches)  # each array counted once
    path = tmp_path / "xq.safetensors"
    save_cache(path, caches)
    loaded, _ = load_cache(path)
    ls = [c.velox_state for c in loaded]
    assert ls[1].shared_key_codes is ls[0].key_codes  # one array in the file and in memory
    assert loaded[0]._model.record.key_codes is ls[2].key_codes
    assert cache_nbytes(loaded) == cache_nbytes(caches)
    # batched: one row per request, a row's layers sharing their copies
    rows = [VeloxCache.merge([c]) for c in caches]
    got = [r.rows[0].velox_state for r in rows]
    assert got[1].shared_key_codes is got[0].key_codes and got[0].key_codes is not st[0].key_codes
    alone = copy.deepcopy(caches)
    for batch, single in ((rows, alone), (loaded, caches)):
        _run(tiny_llama, batch, tokens=[7], steps=1)
        _run(tiny_llama, single, tokens=[7], steps=1)
    for a, b in zip(rows, alone):
        for x, y in zip(M.get_kv(a.rows[0].velox_state), M.get_kv(b.velox_state)):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-4, atol=1e-5)
    for a, b in zip(loaded, caches):
        for x, y in zip(M.get_kv(a.velox_state), M.get_kv(b.velox_state)):
            assert mx.array_equal(x, y).item()


def test_layers_of_different_shapes_are_refused_in_one_group():
    from tests.test_adapter import TwoShapeModel
    from velox.adapters.mlxlm import make_cache

    mx.random.seed(1)
    model = TwoShapeModel()
    mx.eval(model.parameters())
    with pytest.raises(ValueError, match="the layers of a group must have the same shapes"):
        _run(model, make_cache(model, "xquant", window=8))
    caches = _run(model, make_cache(model, "xquant", window=8, group_size=1))
    assert [c.velox_state.role for c in caches] == ["anchor", "anchor"]


def test_live_memory_is_what_the_caches_report():
    """A decode leaves the caches' nbytes live: the reusing layer's view of its anchor's codes
    (128 KiB, uncounted) is no copy."""
    from mlx_lm.models import llama

    from velox.adapters.mlxlm import cache_nbytes, make_cache

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=97, rope_theta=10000.0))
    mx.eval(model.parameters())

    def run():
        return _run(model, make_cache(model, "xquant", window=0, residual_bits=0),
                    tokens=[i % 90 + 1 for i in range(512)], steps=4)

    run()  # warm
    mx.clear_cache()
    mem0 = mx.get_active_memory()
    caches = run()
    mx.clear_cache()
    live, reported = mx.get_active_memory() - mem0, cache_nbytes(caches)
    reuse = caches[1].velox_state
    shared = reuse.shared_key_codes.nbytes + reuse.shared_value_codes.nbytes
    assert shared == 128 << 10 and reuse.shared_key_codes is caches[0].velox_state.key_codes
    assert live <= reported + (32 << 10), (live, reported)

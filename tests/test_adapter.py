"""The mlx-lm adapter on tiny random mlx-lm models: every registered method, the protocol
facts (offset, deferred eviction, masks, trimming, no silent quantized swap), real queries,
cross-layer threading, save/load, layers of different shapes, flat memory."""

from __future__ import annotations

import ast
import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests._helpers import every_method, small_params
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

import velox
from velox.adapters import mlxlm
from velox.adapters.mlxlm import VeloxCache, cache_fp16_bytes, cache_nbytes, load_cache, make_cache, save_cache
from velox.registry import get_method, method_keys

PROMPT = mx.array([1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3, 5, 7, 9] * 3)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def greedy(model, cache, n=12, step=7, prompt=PROMPT):
    """``n`` greedy tokens; the caches then hold ``len(prompt) + n`` tokens (generate_step
    computes one step ahead)."""
    return [int(tok) for tok, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n,
                                                 prefill_step_size=step)]


def large_params(key: str, tokens: int) -> dict | None:
    """Parameters whose capacity exceeds ``tokens`` (nothing evicted), or None if unbounded."""
    spec = get_method(key).spec
    expr = spec.contract.get("capacity")
    if expr is None:
        return None
    names = {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
    p = {name: 4 * tokens for name in names if spec.params[name].type == "int"
         and name not in ("n_sink",)}
    return p


@pytest.mark.parametrize("key", every_method())
def test_every_method_prefills_in_chunks_and_decodes(model, key):
    caches = make_cache(model, key, **small_params(key, len(PROMPT)))
    out = greedy(model, caches, n=10, step=7)
    assert len(out) == 10
    seen = len(PROMPT) + 10
    for c in caches:
        assert isinstance(c, VeloxCache)
        assert c.offset == seen
        pos = np.array(velox.positions(c.velox_state))
        assert pos.shape[-1] == c.size() <= seen
        assert (np.diff(pos, axis=-1) > 0).all() and pos.max() < seen
        assert c.nbytes == velox.nbytes(c.velox_state) > 0
    assert cache_nbytes(caches) == sum(c.nbytes for c in caches)


EVICTION = [k for k in method_keys() if get_method(k).spec.family in ("eviction", "merging")
            and get_method(k).spec.contract.get("capacity")]


@pytest.mark.parametrize("key", EVICTION)
def test_budget_above_the_text_matches_kvcache_exactly(model, key):
    params = large_params(key, len(PROMPT) + 16)
    want = greedy(model, make_prompt_cache(model), n=16)
    got = greedy(model, make_cache(model, key, **params), n=16)
    assert got == want


def test_eviction_changes_output_and_real_queries_matter(model):
    want = greedy(model, make_prompt_cache(model), n=12)
    real = make_cache(model, "tova", budget=20, n_sink=2)
    proxy = make_cache(model, "tova", budget=20, n_sink=2, real_queries=False)
    greedy(model, real, n=12)
    greedy(model, proxy, n=12)
    p_real = np.array(velox.positions(real[1].velox_state))
    p_proxy = np.array(velox.positions(proxy[1].velox_state))
    assert p_real.shape == p_proxy.shape == (1, 2, 20)
    assert not np.array_equal(p_real, p_proxy)  # the captured queries changed the choice
    assert greedy(model, make_cache(model, "tova", budget=20, n_sink=2), n=12) != want


def test_real_queries_reach_the_update(model, monkeypatch):
    seen = []
    m = get_method("h2o")
    original = m.update

    def spy(state, keys, values, *, queries=None):
        seen.append(None if queries is None else tuple(queries.shape))
        return original(state, keys, values, queries=queries)

    monkeypatch.setattr(m, "update", spy)
    caches = make_cache(model, "h2o", budget=30, compile=False)
    greedy(model, caches, n=3, step=25)
    # 3 layers x (prefill chunks 25, 25, 9 + decode 1, 1) with the model's 4 query heads
    assert seen[:3] == [(1, 4, 25, 32)] * 3
    assert all(s is not None and s[1] == 4 for s in seen)
    seen.clear()
    greedy(model, make_cache(model, "h2o", budget=30, real_queries=False, compile=False), n=2)
    assert seen and all(s is None for s in seen)


def test_protocol_facts(model):
    caches = make_cache(model, "tova", budget=24)
    c = caches[0]
    assert not hasattr(c, "bits")
    with pytest.raises(ValueError, match="kv_bits does not apply to a velox cache"):
        c.to_quantized  # mlx-lm's maybe_quantize_kv_cache asks hasattr(c, "to_quantized")
    assert c.make_mask(1) is None and c.make_mask(5) == "causal"
    h = mx.zeros((1, 5, 128))
    assert create_attention_mask(h, c) == "causal"
    greedy(model, caches, n=4)
    assert c.offset == len(PROMPT) + 4 and c.size() == 24
    arr = c.make_mask(3, return_array=True)
    assert arr.shape == (3, 27) and bool(arr[0, 24]) and not bool(arr[0, 25])
    assert c.is_trimmable() is False and c.trim(2) == 0 and c.offset == len(PROMPT) + 4
    with pytest.raises(ValueError, match="sliding-window"):
        c.make_mask(3, window_size=4)
    with pytest.raises(AttributeError):
        c.offset = 3


@pytest.mark.parametrize("kw, match", [
    (dict(kv_bits=4), "kv_bits does not apply to a velox cache"),
    (dict(kv_bits=4, quantized_kv_start=0), "kv_bits does not apply to a velox cache"),
    (dict(max_kv_size=16), "max_kv_size=16 has no effect on a velox prompt cache"),
])
def test_mlx_lm_options_a_velox_cache_cannot_honour_are_refused(model, kw, match):
    """Through ``mlx_lm.generate``'s functions (what ``generate``, ``stream_generate`` and the
    server call): refused before any token is absorbed (``velox.adapters.guards``)."""
    gen = importlib.import_module("mlx_lm.generate")
    caches = make_cache(model, "tova", budget=24)
    with pytest.raises(ValueError, match=match):
        list(gen.generate_step(PROMPT, model, prompt_cache=caches, max_tokens=3, **kw))
    assert all(c.empty() for c in caches)  # refused before any token was absorbed
    greedy(model, caches, n=2)  # the cache is still usable without them
    c = caches[0]
    with pytest.raises(ValueError, match=match):  # also on a cache that holds tokens
        list(gen.generate_step(mx.array([3, 1]), model, prompt_cache=caches, max_tokens=1, **kw))
    assert c.offset == len(PROMPT) + 2
    # mlx-lm's own caches keep mlx-lm's behaviour
    own = {k: v for k, v in kw.items() if k != "quantized_kv_start"}  # (head_dim 32 < groups of 64)
    assert len(list(gen.generate_step(PROMPT, model, max_tokens=2, **own))) == 2


def test_kv_bits_is_refused_by_the_cache_itself_without_the_check(model):
    """A reference to mlx-lm's ``generate_step`` taken before velox wrapped it (this module's
    import) skips the argument check; the cache then refuses ``kv_bits`` itself at the first
    step (mlx-lm asks it for ``to_quantized``), before a second token is taken."""
    assert getattr(generate_step, "__velox_original__", None) is None  # the unwrapped one
    caches = make_cache(model, "tova", budget=24)
    gen = generate_step(PROMPT, model, prompt_cache=caches, max_tokens=3, kv_bits=4)
    with pytest.raises(ValueError, match="kv_bits does not apply to a velox cache"):
        next(gen)


def test_mlx_lm_load_prompt_cache_names_load_cache(model, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    caches = make_cache(model, "kivi", residual_length=8)
    greedy(model, caches, n=2)
    save_cache(tmp_path / "c.safetensors", caches)
    with pytest.raises(ValueError, match=r"load it with velox\.adapters\.mlxlm\.load_cache"):
        load_prompt_cache(str(tmp_path / "c.safetensors"))
    save_cache(tmp_path / "empty.safetensors", make_cache(model, "tova", budget=24))
    with pytest.raises(ValueError, match=r"velox\.adapters\.mlxlm\.load_cache"):
        load_prompt_cache(str(tmp_path / "empty.safetensors"))


@pytest.mark.parametrize("mode", ["proxy", "deferred"])
def test_deferred_eviction_returns_stored_plus_new(mode):
    """Proxy mode, or deferred mode without the wrapper (which then runs as proxy mode)."""
    c = VeloxCache("tova", dict(budget=4, n_sink=1), mode=mode)
    assert c.mode == mode
    mlxlm.uninstall_query_capture()
    try:
        k = mx.random.normal((1, 2, 6, 8))
        keys, values = c.update_and_fetch(k, k)
        assert keys.shape[2] == 6  # this step's attention sees all six
        assert c.size() == 4       # eviction applied after
        keys, values = c.update_and_fetch(k[:, :, :1], k[:, :, :1])
        assert keys.shape[2] == 5 and c.size() == 4 and c.offset == 7
        assert c.last_step == "proxy"
    finally:
        mlxlm.install_query_capture()


def test_per_layer_parameter_lists(model):
    caches = make_cache(model, "tova", budget=[16, 24, 32])
    greedy(model, caches, n=2)
    assert [c.size() for c in caches] == [16, 24, 32]
    with pytest.raises(ValueError, match="3 attention layers"):
        make_cache(model, "tova", budget=[16, 24])
    with pytest.raises(ValueError, match="budget"):
        make_cache(model, "tova", budget=2, n_sink=4)
    with pytest.raises(ValueError, match="unknown method"):
        make_cache(model, "nope")


@pytest.mark.parametrize("key", every_method(method_keys()))
def test_save_load_round_trip(model, key, tmp_path):
    caches = make_cache(model, key, **small_params(key, len(PROMPT)))
    greedy(model, caches, n=3)
    path = tmp_path / "cache.safetensors"
    save_cache(path, caches, {"note": "x"})
    loaded, meta = load_cache(path)
    assert meta == {"note": "x"}
    for a, b in zip(caches, loaded):
        sa, sb = a.velox_state, b.velox_state
        assert type(sa) is type(sb) and a.offset == b.offset
        fa, fb = tree_flatten(sa), tree_flatten(sb)
        assert [k for k, _ in fa] == [k for k, _ in fb]
        for (_, x), (_, y) in zip(fa, fb):
            if isinstance(x, mx.array):
                assert x.dtype == y.dtype and mx.array_equal(x, y).item()
            else:
                assert x == y
    nxt = mx.array([3, 1, 4])
    assert greedy(model, caches, n=4, prompt=nxt) == greedy(model, loaded, n=4, prompt=nxt)


class TwoShapeModel(nn.Module):
    """Two llama blocks with different kv-head counts and head dims."""

    def __init__(self):
        super().__init__()
        common = dict(model_type="llama", hidden_size=128, intermediate_size=128,
                      rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0, num_hidden_layers=1)
        a = llama.ModelArgs(**common, num_attention_heads=4, num_key_value_heads=2)
        b = llama.ModelArgs(**common, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
        self.embed = nn.Embedding(97, 128)
        self.layers = [llama.TransformerBlock(a), llama.TransformerBlock(b)]
        self.out = nn.Linear(128, 97)

    def __call__(self, inputs, cache=None, input_embeddings=None):
        h = self.embed(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.out(h)


def test_layers_of_different_shapes():
    mx.random.seed(1)
    model = TwoShapeModel()
    mx.eval(model.parameters())
    caches = make_cache(model, "kivi", residual_length=8)
    greedy(model, caches, n=5)
    k0, _ = velox.get_kv(caches[0].velox_state)
    k1, _ = velox.get_kv(caches[1].velox_state)
    assert k0.shape[1:] == (2, len(PROMPT) + 5, 32) and k1.shape[1:] == (1, len(PROMPT) + 5, 64)
    want = greedy(model, make_prompt_cache(model), n=8)
    assert greedy(model, make_cache(model, "h2o", budget=500), n=8) == want


def test_memory_stays_flat_over_a_long_decode(model):
    caches = make_cache(model, "h2o", budget=32, grace=4)
    gen = generate_step(PROMPT, model, prompt_cache=caches, max_tokens=400)
    readings = []
    for i, _ in enumerate(gen):
        if i in (100, 399):
            mx.eval([c.state for c in caches])
            readings.append(mx.get_active_memory())
    assert readings[1] <= readings[0] * 1.05 + 64 * 1024, readings
    # Every state array is materialised: nothing lazy hangs off the records.
    st = caches[0].velox_state
    assert all(x.shape[2] == 32 for x in (st.keys, st.values, st.positions, st.scores))


def test_fp16_reference_bytes(model):
    caches = make_cache(model, "tova", budget=24)
    greedy(model, caches, n=3)
    # 3 layers x 2 kv heads x head_dim 32 x (k + v) x 2 bytes per token seen
    assert cache_fp16_bytes(caches) == (len(PROMPT) + 3) * 3 * 2 * 32 * 2 * 2


def test_fused_compiled_decode_step_matches_the_plain_path(model, layer_by_layer):
    """At a full cache, decode runs one compiled graph per layer (attention + update); same
    result."""
    fused = make_cache(model, "h2o", budget=24, grace=4)
    plain = make_cache(model, "h2o", budget=24, grace=4, compile=False)
    assert all(c.mode is mlxlm.Mode.DEFERRED for c in fused + plain)
    a = greedy(model, fused, n=10)
    b = greedy(model, plain, n=10)
    assert fused[0].last_step == "fused"  # the last steps took the fused path
    assert plain[0].last_step == "deferred"
    assert a == b
    for x, y in zip(fused, plain):
        assert np.array_equal(np.array(velox.positions(x.velox_state)),
                              np.array(velox.positions(y.velox_state)))
        assert np.allclose(np.array(x.velox_state.scores), np.array(y.velox_state.scores), atol=1e-5)


def test_kvzip_reconstruction_prefill(model):
    """KVzip's probe: the repeated context's queries score the cached context."""
    from velox.adapters.mlxlm import reconstruction_prefill

    prompt = mx.array([90, 91, 92, 93])
    probed = make_cache(model, "kvzip", budget=24)
    reconstruction_prefill(model, PROMPT, probed, prompt_tokens=prompt)
    proxy = make_cache(model, "kvzip", budget=24)
    for c, (k, v) in zip(proxy, _plain_kv(model, PROMPT)):
        c.absorb(k, v)  # no queries: every candidate's key is a probe (the proxy)
    for c in probed:
        assert c.offset == len(PROMPT) and c.size() == 24
    a = [np.array(velox.positions(c.velox_state)) for c in probed]
    b = [np.array(velox.positions(c.velox_state)) for c in proxy]
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))
    # Decoding continues from the compressed context.
    out = greedy(model, probed, n=4, prompt=mx.array([3, 1]))
    assert len(out) == 4 and probed[0].offset == len(PROMPT) + 2 + 4


def _plain_kv(model, tokens):
    cache = make_prompt_cache(model)
    model(tokens[None], cache=cache)
    return [(c.state[0][:, :, :len(tokens)], c.state[1][:, :, :len(tokens)]) for c in cache]

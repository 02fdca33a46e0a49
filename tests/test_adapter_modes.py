"""The mlx-lm adapter's two modes (proxy, deferred): how make_cache and load_cache choose
them, getters that never update (tokens pending included), the query_capture() context
manager, and the one bounded cache of compiled steps."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from typing import Any, Optional

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import velox.layer
from velox import decode
from velox.adapters import mlxlm, routing
from velox.adapters import cache as adapter_cache, cache_files
from velox.adapters.mlxlm import (Mode, VeloxCache, cache_fp16_bytes, cache_nbytes, load_cache,
                                  make_cache, query_capture, save_cache)
from velox.registry import get_method

PROMPT = mx.array([1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3, 5, 7, 9] * 3)


def greedy(model, cache, n=8, prompt=PROMPT, step=7):
    return [int(t) for t, _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=n,
                                             prefill_step_size=step)]


def arrays(record):
    return [x for _, x in tree_flatten(record) if isinstance(x, mx.array)]


def same(a, b):
    xa, xb = arrays(a), arrays(b)
    return len(xa) == len(xb) and all(
        x.dtype == y.dtype and x.shape == y.shape and bool(mx.array_equal(x, y)) for x, y in zip(xa, xb))


# --- a model whose attention never calls mlx-lm's scaled_dot_product_attention ------------

def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """This module's own attention function: the velox wrapper never replaces it."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class PlainAttention(llama.Attention):
    """llama's attention, calling this module's attention function."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                           mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def unrouted(tiny_llama):
    """The tiny llama's weights, with attention that does not go through the wrapper."""
    m = copy.deepcopy(tiny_llama)
    for layer in m.layers:
        layer.self_attn.__class__ = PlainAttention
    mx.eval(m.parameters())
    assert not adapter_cache._routes_attention(m)
    return m


# --- how the mode is chosen ------------------------------------------------------------------

def test_make_cache_chooses_the_mode(model, unrouted):
    assert {c.mode for c in make_cache(model, "tova", budget=24)} == {Mode.DEFERRED}
    assert adapter_cache._routes_attention(model)  # make_cache installed the wrapper
    assert {c.mode for c in make_cache(model, "tova", budget=24, real_queries=False)} == {Mode.PROXY}
    # a method with its own attention needs the wrapper, whatever real_queries says
    assert {c.mode for c in make_cache(model, "kivi", real_queries=False)} == {Mode.DEFERRED}
    assert {c.mode for c in make_cache(unrouted, "tova", budget=24)} == {Mode.PROXY}
    with pytest.raises(ValueError, match="kivi needs a model whose attention calls mlx-lm's "
                                         "scaled_dot_product_attention; Model does not"):
        make_cache(unrouted, "kivi")
    assert Mode.PROXY == "proxy" and Mode("deferred") is Mode.DEFERRED
    with pytest.raises(ValueError, match="mode='eager' must be one of 'proxy', 'deferred'"):
        VeloxCache("tova", dict(budget=8), mode="eager")
    with pytest.raises(ValueError, match="it needs mode='deferred'"):
        VeloxCache("kivi", mode="proxy")


def test_proxy_mode_is_the_same_on_a_model_with_or_without_the_wrapper(model, unrouted):
    """The proxy path gives the same tokens and states whether or not the wrapper is called."""
    a = make_cache(unrouted, "tova", budget=24)
    b = make_cache(model, "tova", budget=24, real_queries=False)
    assert greedy(unrouted, a) == greedy(model, b)
    assert all(c.last_step == "proxy" and same(c.velox_state, d.velox_state) for c, d in zip(a, b))


# --- getters never update ----------------------------------------------------------------------

def _prefill(model, caches, tokens=PROMPT[:-1], step=7):
    for i in range(0, len(tokens), step):
        model(tokens[None, i:i + step], cache=caches)
        mx.eval([c.state for c in caches])


def _getters(c: VeloxCache) -> dict:
    """Every getter of the protocol (and the sums over a prompt cache)."""
    return dict(offset=c.offset, size=c.size(), empty=c.empty(), positions=c.positions(),
                nbytes=c.nbytes, state=c.state, velox_state=c.velox_state, tail=c.tail,
                trimmable=c.is_trimmable(), mask1=c.make_mask(1),
                mask3=c.make_mask(3, return_array=True), total=cache_nbytes([c]),
                fp16=cache_fp16_bytes([c]))


@pytest.mark.parametrize("key, params, kind", [
    ("tova", dict(budget=24, compile=False), "deferred"),
    ("h2o", dict(budget=24, grace=4), "fused"),
    ("tova", dict(budget=24, decode="append", decode_cap=8), "tail"),
    ("kivi", dict(residual_length=8), "deferred"),
    ("kivi", dict(residual_length=8, decode="append"), "tail"),
])
def test_getters_never_update_while_tokens_are_pending(model, key, params, kind):
    caches = make_cache(model, key, **params)
    _prefill(model, caches)
    c = caches[0]
    assert c.mode is Mode.DEFERRED and c.held.pending is None
    stored, held = int(c._m.positions(c.held.state).shape[2]), c.size()
    k = mx.random.normal((1, 2, 1, 32), key=mx.random.key(1))
    keys, values = c.update_and_fetch(k, k)  # no attention yet: the step is pending
    st, step, tail = c.velox_state, c.held.pending, c.tail
    assert step is not None and step.keys is not None
    for _ in range(2):
        got = _getters(c)
        assert c.velox_state is st and c.held.pending is step and c.tail is tail  # nothing ran
    assert got["offset"] == len(PROMPT) and got["size"] == held + 1
    assert got["velox_state"] is st and int(c._m.positions(c.held.state).shape[2]) == stored
    pos = np.array(got["positions"])
    assert pos.shape[-1] == held + 1 and pos[0, 0, -1] == len(PROMPT) - 1
    assert (np.diff(pos, axis=-1) > 0).all()
    assert all(any(x is y for y in got["state"]) for x in arrays(st) + [step.keys, step.values])
    assert got["nbytes"] >= get_method(key).nbytes(st) + sum(x.nbytes for x in [step.keys, step.values])
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(2))
    c.attention(q, keys, values, scale=32 ** -0.5, mask=None)  # the wrapper completes it
    assert c.held.pending is None and c.last_step == kind
    assert (c.velox_state is st) == (kind == "tail")
    assert c.size() == held + 1 if kind == "tail" or key == "kivi" else c.size() == 24


# --- load_cache: the saved mode, checked against the model -----------------------------------

@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("modes")
    for name, key, params in (("tova", "tova", dict(budget=24)),
                              ("tova-proxy", "tova", dict(budget=24, real_queries=False)),
                              ("kivi", "kivi", dict(residual_length=8))):
        caches = make_cache(tiny_llama, key, **params)
        greedy(tiny_llama, caches, n=3)
        save_cache(d / f"{name}.safetensors", caches)
    return d


def _rewrite(src, dst, edit):
    arrays_, raw = mx.load(str(src), return_metadata=True)
    layers = json.loads(raw["0.layers"])
    for e in layers:
        edit(e)
    raw["0.layers"] = json.dumps(layers)
    raw["0.sha256"] = cache_files._digest(arrays_, raw)
    mx.save_safetensors(str(dst), arrays_, metadata=raw)
    return dst


def test_the_mode_is_saved_and_restored(model, unrouted, saved):
    for name, want in (("tova", "deferred"), ("tova-proxy", "proxy"), ("kivi", "deferred")):
        _, raw = mx.load(str(saved / f"{name}.safetensors"), return_metadata=True)
        assert [e["mode"] for e in json.loads(raw["0.layers"])] == [want] * 3
        for m in (model, None):
            assert {c.mode.value for c in load_cache(saved / f"{name}.safetensors", m)[0]} == {want}
    # a deferred cache runs as proxy on a model whose attention does not call the wrapper
    assert {c.mode for c in load_cache(saved / "tova.safetensors", unrouted)[0]} == {Mode.PROXY}
    with pytest.raises(ValueError, match="kivi needs a model whose attention calls .*Model does not"):
        load_cache(saved / "kivi.safetensors", unrouted)


def test_files_without_the_mode_get_it_as_make_cache_would(model, saved, tmp_path):
    def strip(e):
        e.pop("mode")

    for name, want in (("tova", Mode.DEFERRED), ("tova-proxy", Mode.PROXY), ("kivi", Mode.DEFERRED)):
        old = _rewrite(saved / f"{name}.safetensors", tmp_path / f"{name}.safetensors", strip)
        for m in (model, None):
            caches, _ = load_cache(old, m)
            assert {c.mode for c in caches} == {want}
        ref, _ = load_cache(saved / f"{name}.safetensors")
        assert greedy(model, caches, 4, mx.array([3])) == greedy(model, ref, 4, mx.array([3]))


@pytest.mark.parametrize("mode, match", [
    ("eager", "layer 0: mode='eager' must be one of 'proxy', 'deferred'"),
    (1, "layer 0: mode=1 is not a str"),
])
def test_a_bad_saved_mode_is_refused(saved, tmp_path, mode, match):
    p = _rewrite(saved / "tova.safetensors", tmp_path / "x.safetensors", lambda e: e.update(mode=mode))
    with pytest.raises(ValueError, match=match):
        load_cache(p)


def test_a_proxy_mode_for_a_method_with_its_own_attention_is_refused(saved, tmp_path):
    p = _rewrite(saved / "kivi.safetensors", tmp_path / "x.safetensors", lambda e: e.update(mode="proxy"))
    with pytest.raises(ValueError, match="layer 0: kivi attends through its own hook: it needs "
                                         "mode='deferred'"):
        load_cache(p)


def test_loaded_without_the_model_the_first_forward_settles_the_mode(unrouted, saved):
    """On a model whose attention misses the wrapper, a deferred cache loaded alone keeps its
    first step pending (getters report it), then turns to proxy at its next call: the same
    tokens and states as a cache loaded with that model."""
    alone, _ = load_cache(saved / "tova.safetensors")
    known, _ = load_cache(saved / "tova.safetensors", unrouted)
    assert {c.mode for c in alone} == {Mode.DEFERRED} and {c.mode for c in known} == {Mode.PROXY}
    before = [c.velox_state for c in alone]
    unrouted(mx.array([[3, 1]]), cache=alone)  # the wrapper never runs
    assert all(c.mode is Mode.DEFERRED and c.held.pending is not None for c in alone)
    assert all(c.velox_state is st and c.size() == 24 + 2 for c, st in zip(alone, before))
    unrouted(mx.array([[3, 1]]), cache=known)
    nxt = mx.array([4, 1, 5])
    assert greedy(unrouted, alone, 5, nxt) == greedy(unrouted, known, 5, nxt)
    assert all(c.mode is Mode.PROXY and c.held.pending is None for c in alone)
    assert all(same(a.velox_state, b.velox_state) for a, b in zip(alone, known))
    kivi, _ = load_cache(saved / "kivi.safetensors")
    unrouted(mx.array([[3, 1]]), cache=kivi)
    with pytest.raises(ValueError, match="kivi needs a model whose attention calls"):
        unrouted(mx.array([[4]]), cache=kivi)


def test_a_pending_step_is_absorbed_before_saving(unrouted, saved, tmp_path):
    alone, _ = load_cache(saved / "tova.safetensors")
    known, _ = load_cache(saved / "tova.safetensors", unrouted)
    for caches in (alone, known):
        unrouted(mx.array([[3, 1]]), cache=caches)
    assert all(c.held.pending is not None for c in alone)
    save_cache(tmp_path / "a.safetensors", alone)
    assert all(c.held.pending is None and c.mode is Mode.PROXY for c in alone)  # the forward showed it
    assert all(same(a.velox_state, b.velox_state) for a, b in zip(alone, known))


# --- the attention wrapper: global and as a context manager ----------------------------------

def test_query_capture_installs_for_its_body_and_nests(model):
    assert routing.capture_installed()  # make_cache installed it
    mlxlm.uninstall_query_capture()
    try:
        assert not routing.capture_installed() and llama.scaled_dot_product_attention is routing._ORIGINAL_SDPA
        with query_capture() as outer:
            assert routing.capture_installed() and llama.scaled_dot_product_attention is routing._velox_sdpa
            with query_capture() as inner:
                model(PROMPT[None, :5], cache=make_prompt_cache(model))
            assert routing.capture_installed()  # the outer body still holds it
            assert len(inner) == 3 and len(outer) == 3 and inner[0].shape == (1, 4, 5, 32)
            model(PROMPT[None, :5], cache=make_cache(model, "tova", budget=24, real_queries=False))
            assert len(outer) == 3  # velox caches are not recorded
        assert not routing.capture_installed()  # restored
        with query_capture():
            mlxlm.install_query_capture()  # a global install made in the body stays
        assert routing.capture_installed()
        mlxlm.uninstall_query_capture()
        with pytest.raises(KeyError):
            with query_capture():
                raise KeyError("x")
        assert not routing.capture_installed()
        assert mlxlm.tap_queries is query_capture
    finally:
        mlxlm.install_query_capture()


# --- one bounded cache of compiled steps -------------------------------------------------------

def test_compiled_steps_live_in_one_bounded_cache(model, monkeypatch, layer_by_layer):
    monkeypatch.setattr(decode, "_COMPILED", OrderedDict())
    caches = make_cache(model, "h2o", budget=24, grace=4)
    greedy(model, caches, n=6)
    backend = caches[0].velox_state.backend
    # the first decode step, then the later ones (each writes the last one's row first)
    assert list(decode._COMPILED) == [("h2o", "fused", backend), ("h2o", "fused+row", backend)]
    m = get_method("h2o")
    fused = decode.compiled(m, "fused", backend)
    assert decode.compiled(m, "fused", backend) is fused  # built once
    other = copy.copy(m)  # another method object under the same key: its own step
    assert decode.compiled(other, "fused", backend) is not fused
    monkeypatch.setattr(decode, "COMPILED_STEPS_MAX", 2)
    for kind in ("update", "update+queries", "fused"):
        decode.compiled(m, kind, backend)
    assert list(decode._COMPILED) == [("h2o", "update+queries", backend), ("h2o", "fused", backend)]


def test_arrays_of_a_record_in_tree_flatten_order():
    """The adapter's array walk (a decode step's state and row, twice per layer) gives the
    arrays of nested records as ``mlx.utils.tree_flatten`` does, leaves that are not arrays
    left out."""
    st = get_method("h2o").init(1, 2, 4, budget=32)
    a, b, c = mx.zeros((1,)), mx.ones((2,)), mx.full((3,), 2.0)
    record = (st, [a, {"x": b, "y": 3, "z": (c, "s")}], None, 1.5, (a,))
    want = [v for _, v in tree_flatten(record) if isinstance(v, mx.array)]
    got = decode.arrays(record)
    assert len(got) == len(want) == 9 and all(x is y for x, y in zip(got, want))
    assert decode.arrays(a) == [a] and decode.arrays(None) == [] and decode.arrays({"k": b})[0] is b


@pytest.mark.parametrize("method,params", [("tova", dict(budget=24)), ("h2o", dict(budget=24, grace=4)),
                                           ("streaming_llm", dict(window_size=20))])
def test_the_steady_fast_path_changes_nothing(model, monkeypatch, layer_by_layer, method, params):
    """Decode steps after a fused one skip update_and_fetch's checks (``_fast``): the same
    tokens and states as with the fast path off, every later step of a run takes it, and a
    state replaced from outside (here a trim) ends it until the next fused step."""
    fast = make_cache(model, method, **params)
    toks = greedy(model, fast, n=12)
    assert all(c.last_step == "fused" for c in fast)
    assert all(c.held.fast and c.held.state is not None for c in fast)
    monkeypatch.setattr(velox.layer, "fast_after", lambda *a: False)
    slow = make_cache(model, method, **params)
    assert greedy(model, slow, n=12) == toks
    for a, b in zip(fast, slow):
        assert a.offset == b.offset and same(a.velox_state, b.velox_state)
    monkeypatch.undo()
    taken = []
    real = VeloxCache.update_and_fetch

    def spy(self, keys, values):
        before = self.held
        out = real(self, keys, values)
        taken.append(before.fast and self.held.pending is not None and self.held.pending.fused
                     and before.state is self.held.state)
        return out

    monkeypatch.setattr(VeloxCache, "update_and_fetch", spy)
    run = make_cache(model, method, **params)
    greedy(model, run, n=12)
    assert any(taken)
    taken.clear()
    again = make_cache(model, method, **params, rollback=1)  # a journal: never the fast path
    greedy(model, again, n=12)
    assert again[0].last_step == "fused" and not any(taken)
    c = run[0]
    c.state  # reading the state writes the pending row: the same slots, the fast path holds
    assert c.held.row is None and c.held.fast
    c._state = c.held.state._replace()  # another state object: the fast path ends here
    assert not c.held.fast
    c.update_and_fetch(mx.zeros((1, c.velox_state.keys.shape[1], 1, c.velox_state.keys.shape[3])),
                       mx.zeros((1, c.velox_state.keys.shape[1], 1, c.velox_state.keys.shape[3])))
    assert taken[-1] is False

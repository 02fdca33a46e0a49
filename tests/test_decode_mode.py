"""Decode modes of the mlx-lm adapter: ``decode="append"`` keeps decoded tokens in an
uncompressed tail up to ``decode_cap`` (then the method absorbs it as one chunk);
``decode="evict"`` runs the method's update at every call, as a cache that does nothing else."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import _BaseCache

import velox
from velox import wrap
from velox.adapters import cache_files
from velox.adapters.mlxlm import VeloxCache, cache_nbytes, load_cache, make_cache, save_cache
from velox.registry import get_method, method_keys
from velox.testing import test_params

from tests._helpers import small_params

pytestmark = pytest.mark.unchecked

PROMPT = [1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3, 5, 7, 9] * 3


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def prefill(model, caches, tokens=PROMPT, step=7):
    for i in range(0, len(tokens), step):
        model(mx.array([tokens[i:i + step]]), cache=caches)
        mx.eval([c.state for c in caches])


def decode(model, caches, first, n):
    """``n`` greedy single-token steps from input ``first``; the tokens generated."""
    out, x = [], first
    for _ in range(n):
        x = int(mx.argmax(model(mx.array([[x]]), cache=caches)[0, -1]).item())
        out.append(x)
    return out


def small(key):
    """Parameters that compress the 60-token prompt (as in test_adapter): the spec's test
    choices, then the small capacities of ``small_params``."""
    return {**test_params(key), **small_params(key, 60)}


def arrays(record):
    return [x for _, x in tree_flatten(record) if isinstance(x, mx.array)]


def same(a, b):
    xa, xb = arrays(a), arrays(b)
    return len(xa) == len(xb) and all(
        x.dtype == y.dtype and x.shape == y.shape and bool(mx.array_equal(x, y)) for x, y in zip(xa, xb))


def test_arguments_are_checked(model, no_shape_checks):
    with pytest.raises(ValueError, match="decode='keep' must be one of 'evict', 'append'"):
        make_cache(model, "tova", budget=24, decode="keep")
    for cap in (0, True, 2.0):
        with pytest.raises(ValueError, match="decode_cap=.* must be an integer >= 1"):
            make_cache(model, "tova", budget=24, decode="append", decode_cap=cap)
    assert all(c.decode == "evict" for c in make_cache(model, "tova", budget=24))


@pytest.mark.parametrize("key", method_keys())
def test_append_keeps_every_decoded_token_below_the_cap(model, key):
    caches = make_cache(model, key, decode="append", decode_cap=16, **small(key))
    prefill(model, caches, PROMPT[:-1])
    before = [c.velox_state for c in caches]
    mx.eval([arrays(s) for s in before])
    decode(model, caches, PROMPT[-1], 10)
    n = len(PROMPT) - 1 + 10
    for c, st in zip(caches, before):
        assert c.offset == n
        assert same(c.velox_state, st)  # no update ran: the method's state is untouched
        tk, tv = c.tail
        assert tk.shape[2] == tv.shape[2] == 10 and c.size() == c.method.positions(c.velox_state).shape[2] + 10
        pos = np.array(c.positions())
        assert (pos[..., -10:] == np.arange(n - 10, n)).all()  # every decoded token is read
        assert (np.diff(pos, axis=-1) > 0).all() and pos.max() == n - 1
        tail = tk.nbytes + tv.nbytes + (c.tail_queries.nbytes if c.tail_queries is not None else 0)
        assert c.nbytes == velox.nbytes(c.velox_state) + tail
        assert c.tail_queries is None or c.tail_queries.shape == (1, 4, 10, 32)  # real queries kept


def test_evict_drops_what_append_keeps(model):
    """KNorm without a recent window evicts decoded tokens at once; append mode does not."""
    ev = make_cache(model, "knorm", budget=24, n_sink=2, recent=0)
    ap = make_cache(model, "knorm", budget=24, n_sink=2, recent=0, decode="append")
    for caches in (ev, ap):
        prefill(model, caches, PROMPT[:-1])
        decode(model, caches, PROMPT[-1], 12)
    new = set(range(len(PROMPT) - 1, len(PROMPT) + 11))
    kept_ev = [new - set(np.array(c.positions())[0, h].tolist()) for c in ev for h in range(2)]
    kept_ap = [new - set(np.array(c.positions())[0, h].tolist()) for c in ap for h in range(2)]
    assert any(kept_ev)  # some decoded token is gone from some head
    assert not any(kept_ap)


def test_the_cap_absorbs_the_tail_as_one_chunk_with_its_queries(model, monkeypatch):
    seen = []
    m = get_method("tova")
    original = m.update

    def spy(state, keys, values, *, queries=None):
        seen.append((keys.shape[2], None if queries is None else tuple(queries.shape)))
        return original(state, keys, values, queries=queries)

    monkeypatch.setattr(m, "update", spy)
    caches = make_cache(model, "tova", budget=24, decode="append", decode_cap=4, compile=False)
    prefill(model, caches, PROMPT[:-1])
    seen.clear()
    decode(model, caches, PROMPT[-1], 3)
    assert seen == [] and caches[0].tail[0].shape[2] == 3
    decode(model, caches, 3, 1)  # the fourth token fills the tail
    assert seen == [(4, (1, 4, 4, 32))] * 3
    assert all(c.tail is None and c.size() == 24 for c in caches)
    pos = np.array(caches[0].positions())
    assert (np.diff(pos, axis=-1) > 0).all() and pos.max() < caches[0].offset
    seen.clear()
    decode(model, caches, 3, 2)
    model(mx.array([[5, 6, 7]]), cache=caches)  # a chunk takes the tail with it
    mx.eval([c.state for c in caches])
    assert seen == [(5, (1, 4, 5, 32))] * 3 and all(c.tail is None for c in caches)
    assert caches[0].offset == len(PROMPT) - 1 + 4 + 2 + 3


def test_proxy_queries_absorb_the_tail_without_queries(model, monkeypatch):
    seen = []
    m = get_method("h2o")
    original = m.update

    def spy(state, keys, values, *, queries=None):
        seen.append((keys.shape[2], queries))
        return original(state, keys, values, queries=queries)

    monkeypatch.setattr(m, "update", spy)
    caches = make_cache(model, "h2o", budget=24, decode="append", decode_cap=3, real_queries=False)
    prefill(model, caches, PROMPT[:-1])
    seen.clear()
    decode(model, caches, PROMPT[-1], 3)
    assert [(n, q) for n, q in seen] == [(3, None)] * 3
    assert caches[0].tail_queries is None


def test_cap_one_updates_at_every_step(model):
    a = make_cache(model, "tova", budget=24, decode="append", decode_cap=1, compile=False)
    b = make_cache(model, "tova", budget=24, compile=False)
    for caches in (a, b):
        prefill(model, caches, PROMPT[:-1])
    assert decode(model, a, PROMPT[-1], 8) == decode(model, b, PROMPT[-1], 8)
    assert all(x.tail is None and same(x.velox_state, y.velox_state) for x, y in zip(a, b))


def test_a_budget_above_the_text_matches_kvcache(model):
    from mlx_lm.models.cache import make_prompt_cache

    full = make_prompt_cache(model)
    caches = make_cache(model, "tova", budget=200, decode="append", decode_cap=5)
    for c in (full, caches):
        prefill(model, c, PROMPT[:-1])
    assert decode(model, caches, PROMPT[-1], 16) == decode(model, full, PROMPT[-1], 16)


@pytest.mark.parametrize("key", ["tova+affine", "kivi", "rocketkv"])
def test_attend_hooks_read_the_tail(model, key):
    """Methods with their own attention: a step over stored + tail + a new token (the
    method behind its tail, ``velox.wrap.with_tail``) equals plain attention over what
    ``get_kv`` returns followed by the tail and the new token (up to rounding of the codes)."""
    caches = make_cache(model, key, decode="append", decode_cap=16, **small(key))
    prefill(model, caches, PROMPT[:-1])
    decode(model, caches, PROMPT[-1], 4)
    c = caches[1]
    tk, tv = c.tail
    assert tk.shape[2] == 4 and c._m is wrap.with_tail(c.method, 16)
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(3))
    kn = mx.random.normal((1, 2, 1, 32), key=mx.random.key(4))
    got = c._m.attend(c._state, q, kn, kn, scale=32 ** -0.5)
    k, v = velox.get_kv(c.velox_state)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, tk, kn], axis=2),
                                                mx.concatenate([v, tv, kn], axis=2), scale=32 ** -0.5)
    assert got.shape == want.shape
    assert np.allclose(np.array(got), np.array(want), atol=1e-4)


class _EveryCall(_BaseCache):
    """A cache that runs the method's update at every call (no wrapper, no compilation)."""

    def __init__(self, key, params):
        self.m, self.params, self.st, self.offset = get_method(key), params, None, 0

    def update_and_fetch(self, keys, values):
        if self.st is None:
            b, h, _, d = keys.shape
            self.st = self.m.init(b, h, d, dtype=keys.dtype, **self.params)
        k, v, _ = self.m.kv_slots(self.st)  # storage order, as the velox cache reads them
        out = mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)
        self.st = self.m.update(self.st, keys, values)
        self.offset += keys.shape[2]
        return out

    def make_mask(self, N, return_array=False, window_size=None):
        return None if N == 1 else "causal"

    @property
    def state(self):
        return arrays(self.st)


@pytest.mark.parametrize("key", ["tova", "knorm", "h2o", "snapkv", "streaming_llm", "cam", "kvquant"])
def test_evict_is_the_method_update_at_every_call(model, key):
    params = small(key)
    ref = [_EveryCall(key, params) for _ in range(3)]
    caches = make_cache(model, key, decode="evict", real_queries=False, compile=False, **params)
    for c in (ref, caches):
        prefill(model, c, PROMPT[:-1])
    assert decode(model, caches, PROMPT[-1], 12) == decode(model, ref, PROMPT[-1], 12)
    assert all(same(c.velox_state, r.st) for c, r in zip(caches, ref))


# --- save / load ------------------------------------------------------------------------

@pytest.mark.parametrize("key, params", [
    ("tova", dict(budget=24)), ("h2o", dict(budget=24, grace=4)), ("kivi", dict(residual_length=8)),
    ("tova+affine", dict(budget=24, bits=4)), ("rocketkv", dict(budget=24, obs_window=8)),
    ("squeeze", dict(budget=24, grace=4)),
])
def test_save_load_round_trips_the_tail(model, key, params, tmp_path):
    caches = make_cache(model, key, decode="append", decode_cap=6, **params)
    prefill(model, caches, PROMPT[:-1])
    x = decode(model, caches, PROMPT[-1], 4)[-1]
    path = tmp_path / "c.safetensors"
    save_cache(path, caches)
    loaded = [load_cache(path, model)[0], load_cache(path)[0]]
    for other in loaded:
        for a, b in zip(caches, other):
            assert (b.decode, b.decode_cap, b.offset) == ("append", 6, a.offset)
            assert same(a.velox_state, b.velox_state) and same(a.tail, b.tail)
            assert (a.tail_queries is None) == (b.tail_queries is None)
            if a.tail_queries is not None:
                assert bool(mx.array_equal(a.tail_queries, b.tail_queries))
            assert a.nbytes == b.nbytes
    # all go on through the cap (the absorption uses the saved queries) and agree
    want = decode(model, caches, x, 7)
    assert all(c.tail is not None and c.tail[0].shape[2] == 5 for c in caches)
    for other in loaded:
        assert decode(model, other, x, 7) == want


@pytest.fixture(scope="module")
def saved(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("tails")
    caches = make_cache(tiny_llama, "tova", budget=24, decode="append", decode_cap=8)
    prefill(tiny_llama, caches, PROMPT[:-1])
    decode(tiny_llama, caches, PROMPT[-1], 3)
    save_cache(d / "tail.safetensors", caches)
    return d / "tail.safetensors"


def _rewrite(src, dst, edit):
    arrays_, raw = mx.load(str(src), return_metadata=True)
    layers = json.loads(raw["0.layers"])
    edit(layers[0], arrays_)
    raw["0.layers"] = json.dumps(layers)
    raw["0.sha256"] = cache_files._digest(arrays_, raw)
    mx.save_safetensors(str(dst), arrays_, metadata=raw)
    return dst


@pytest.mark.parametrize("change, match", [
    (lambda e, a: e.update(decode="evict"), "decode='evict' but the entry holds an append-mode tail"),
    (lambda e, a: e.update(decode="keep"), "decode='keep' must be one of"),
    (lambda e, a: e.update(decode_cap=3), "the tail holds 3 tokens; decode_cap=3 keeps 1 to 2"),
    (lambda e, a: e.pop("tail"), "decode, decode_cap, tail together"),
    (lambda e, a: e["tail"].pop("queries"), "the tail must have the fields keys, values, queries"),
    (lambda e, a: a.pop("tail.0.values"), "tail values .* names no array"),
    (lambda e, a: a.update({"tail.0.values": a["tail.0.values"][:, :, :2]}), "tail values is float32 \\(1, 2, 2, 32\\)"),
    (lambda e, a: a.update({"tail.0.keys": a["tail.0.keys"].astype(mx.float16)}), "tail keys is float16"),
    (lambda e, a: a.update({"tail.0.queries": a["tail.0.queries"][:, :3]}), "tail queries are float32 \\(1, 3, 3, 32\\)"),
    (lambda e, a: e.update(offset=e["offset"] - 3), "offset=59 less the tail's 3 but the state has seen \\[59\\] tokens"),
    (lambda e, a: e.update(offset=e["offset"] + 1), "offset=63 less the tail's 3 but the state has seen \\[59\\] tokens"),
], ids=["tail-in-evict", "bad-mode", "tail-at-cap", "partial-fields", "tail-fields", "missing-array",
        "tail-shape", "tail-dtype", "query-heads", "offset-without-tail", "offset-off-by-one"])
def test_bad_tails_are_refused(saved, tmp_path, change, match, no_shape_checks):
    with pytest.raises(ValueError, match=match):
        load_cache(_rewrite(saved, tmp_path / "x.safetensors", change))


def test_files_from_before_decode_modes_load_as_evict(saved, tmp_path, model):
    src = make_cache(model, "tova", budget=24)
    prefill(model, src, PROMPT[:-1])
    save_cache(tmp_path / "e.safetensors", src)

    def strip(e, a):
        for k in ("decode", "decode_cap", "tail", "mode"):
            e.pop(k)

    arrays_, raw = mx.load(str(tmp_path / "e.safetensors"), return_metadata=True)
    layers = [dict(e) for e in json.loads(raw["0.layers"])]
    for e in layers:
        strip(e, None)
    raw["0.layers"] = json.dumps(layers)
    raw["0.sha256"] = cache_files._digest(arrays_, raw)
    mx.save_safetensors(str(tmp_path / "old.safetensors"), arrays_, metadata=raw)
    caches, _ = load_cache(tmp_path / "old.safetensors", model)
    assert all(c.decode == "evict" and c.tail is None for c in caches)
    assert decode(model, caches, PROMPT[-1], 4) == decode(model, src, PROMPT[-1], 4)

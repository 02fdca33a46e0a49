"""Rollback of velox caches (``rollback=d``): ``trim(n)`` restores exactly the cache that never
saw the last ``n`` tokens, for every method and both decode modes; a verify call (2 to ``d + 1``
tokens on a cache holding tokens) runs as the one-token steps it stands for; what cannot be
trimmed exactly raises; the journal holds references that later steps never change."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox import decode
from velox import decode as velox_decode
from velox.adapters import mlxlm, routing
from velox.adapters import cache_files
from velox.adapters.mlxlm import VeloxCache, load_cache, make_cache, save_cache
from velox.registry import get_method, method_keys
from velox.spec import validate_params

H, GROUPS, D = 2, 2, 32          # kv heads, query heads per kv head, head dim
PREFILL = (30, 5)                # two prompt chunks (the second on a non-empty cache)
SCALE = D ** -0.5

# Small settings: bounded methods evict, quantizers flush, append tails are absorbed; codebook
# methods calibrated for another model take seeded random codebooks.
SMALL = dict(budget=10, window_size=8, n_sink=2, grace=2, recent=2, obs_window=4, window=4,
             residual_length=4, group_size=8, merge_window=4, threshold_window=8,
             calib_tokens=8, kernel_size=3, page_size=4, codebook="random", basis="prefill")
# Cross-layer methods roll back a model's layers together: tests/test_rollback_crosslayer.py.
CROSS_LAYER = [k for k in method_keys() if get_method(k).layer_update is not None]
METHODS = [k for k in method_keys() if k not in CROSS_LAYER]


def small(key: str) -> dict:
    """The ``SMALL`` settings the method takes, each kept only if its spec accepts it."""
    spec = get_method(key).spec
    p: dict = {}
    for name, value in SMALL.items():
        if name in spec.params:
            try:
                validate_params(spec, {**p, name: value})
            except ValueError:
                continue
            p[name] = value
    return p


@pytest.fixture(scope="module", autouse=True)
def wrapper():
    """Deferred caches run their update in the wrapped attention (installed for the module)."""
    installed = routing._INSTALLED
    mlxlm.install_query_capture()
    yield
    if not installed:
        mlxlm.uninstall_query_capture()


def tokens(seed: int, n: int):
    """``n`` tokens of random keys, values and queries ``[1, heads, n, D]``."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, H, n, D)).astype(np.float32)
    v = rng.standard_normal((1, H, n, D)).astype(np.float32)
    q = rng.standard_normal((1, H * GROUPS, n, D)).astype(np.float32)
    return mx.array(k), mx.array(v), mx.array(q)


def call(c: VeloxCache, k, v, q) -> np.ndarray:
    """One layer's forward step through the cache, as mlx-lm and the wrapper drive it."""
    keys, values = c.update_and_fetch(k, v)
    if c.mode is mlxlm.Mode.DEFERRED:
        out = c.attention(q, keys, values, scale=SCALE, mask=None if k.shape[2] == 1 else "causal")
    else:
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=SCALE,
                                                   mask=None if k.shape[2] == 1 else "causal")
    return np.array(out)


def piece(x, i, j):
    return tuple(a[:, :, i:j] for a in x)


def fields(c: VeloxCache) -> dict:
    """Everything a cache holds, by value: offset, the state's fields (arrays as dtype, shape
    and bytes), positions, the tail and its queries."""
    out = {"offset": c.offset, "positions": np.array(c.positions()).tobytes()}
    st = c.velox_state
    for name, x in tree_flatten(st) if st is not None else []:
        out[f"state.{name}"] = ((str(x.dtype), tuple(x.shape), np.array(x).tobytes())
                                if isinstance(x, mx.array) else x)
    for name, x in (("tail_k", None if c.tail is None else c.tail[0]),
                    ("tail_v", None if c.tail is None else c.tail[1]), ("tail_q", c.tail_queries)):
        out[name] = None if x is None else (tuple(x.shape), np.array(x).tobytes())
    return out


def build(key: str, decode: str, rollback: int, mode: str = "deferred") -> VeloxCache:
    return VeloxCache(key, small(key), mode=mode, decode=decode, decode_cap=3, rollback=rollback)


@pytest.mark.parametrize("decode", ["evict", pytest.param("append", marks=pytest.mark.slow)])
@pytest.mark.parametrize("key", METHODS)
def test_trim_is_the_run_that_never_saw_the_tokens(key, decode):
    """Per depth d in {1, 3}: a cache with rollback=d decodes (singles and a verify call of
    d + 1 tokens) exactly as a rollback=0 cache fed the same tokens one by one; trim(n) for
    every n <= d gives that run's fields n tokens back, and continuing gives its outputs."""
    for d in (1, 3):
        calls = [1, 1, 1, d + 1, 1, 1]
        total = sum(PREFILL) + sum(calls) + 2
        x = tokens(hash((key, decode, d)) % 2**32, total)
        a, r = build(key, decode, d), build(key, decode, 0)
        at = 0
        for s in PREFILL:  # the prompt: the same chunks for both
            assert np.array_equal(call(a, *piece(x, at, at + s)), call(r, *piece(x, at, at + s)))
            at += s
        seen = {r.offset: fields(r)}  # the reference's fields after every token
        forks = {}
        for s in calls:
            out = call(a, *piece(x, at, at + s))
            ref = []
            for i in range(at, at + s):  # the reference takes each token as its own step
                if sum(PREFILL) + sum(calls) - i == d:
                    forks[d] = copy.deepcopy(r)  # the run that never sees the last d tokens
                ref.append(call(r, *piece(x, i, i + 1)))
                seen[r.offset] = fields(r)
            at += s
            assert np.array_equal(out, np.concatenate(ref, axis=2)), (key, decode, d, at)
            assert fields(a) == fields(r), (key, decode, d, at)
            assert len(a.held.state.past) <= d  # the journal (velox.wrap.with_rollback)
        assert a.is_trimmable() and not r.is_trimmable() and r.trim(1) == 0
        assert r.trimmable_tokens() == 0 and not r.can_trim(1)
        assert a.trimmable_tokens() == d
        assert [a.can_trim(n) for n in range(d + 2)] == [True] * (d + 1) + [False]
        before = fields(a)
        with pytest.raises(ValueError, match=f"trim\\({d + 1}\\)"):
            a.trim(d + 1)
        assert fields(a) == before  # never a partial trim
        for n in range(1, d):
            b = copy.deepcopy(a)
            assert b.trim(n) == n
            assert fields(b) == seen[a.offset - n], (key, decode, d, n)
        assert a.trim(d) == d  # the original: its journal held references since those steps
        assert fields(a) == seen[a.offset] and a.offset == at - d
        assert a.trimmable_tokens() == 0 and not a.can_trim(1)
        f = forks[d]
        for i in range(at, at + 2):  # continuing: the outputs of the run that never saw them
            assert np.array_equal(call(a, *piece(x, i, i + 1)), call(f, *piece(x, i, i + 1)))
            assert fields(a) == fields(f), (key, decode, d, i)


def test_trim_back_into_a_prefill_chunk():
    """A prefill chunk is one step: trim removes it whole or not at all."""
    x = tokens(1, 40)
    c, r = build("tova", "evict", 3), build("tova", "evict", 0)
    call(c, *piece(x, 0, 20)), call(r, *piece(x, 0, 20))
    want = fields(r)
    call(c, *piece(x, 20, 32))  # a chunk longer than d + 1 tokens: not split
    call(c, *piece(x, 32, 33))
    assert c.trimmable_tokens() == 33  # three steps: back to the empty cache
    assert [n for n in range(40) if c.can_trim(n)] == [0, 1, 13, 33]
    with pytest.raises(ValueError, match="can remove exactly 1, 13, 33 tokens"):
        c.trim(2)
    assert c.trim(13) == 13 and fields(c) == want


def test_the_journal_keeps_old_states_intact():
    """MLX writes a slot in place only into a buffer nothing else holds: an old journal entry's
    arrays keep their values while the compiled decode steps run on."""
    x = tokens(2, 40)
    c = build("tova", "evict", 3)
    call(c, *piece(x, 0, 20))
    snaps = []
    for i in range(20, 30):
        assert c.held.row is None  # a journal's steady step writes its row at once
        snaps.append([np.array(a) for a in decode.arrays(c.held.state.inner)])
        call(c, *piece(x, i, i + 1))
    assert c.last_step == "fused"  # the steady compiled step ran
    past = c.held.state.past
    assert len(past) == 3
    for e, snap in zip(past, snaps[-3:]):
        now = [np.array(a) for a in decode.arrays(e)]
        assert len(now) == len(snap) and all(np.array_equal(p, q) for p, q in zip(now, snap))


@pytest.mark.parametrize("decode", ["evict", "append"])
def test_journal_bytes(decode):
    """nbytes counts the journal's arrays that the current fields do not hold."""
    x = tokens(3, 30)
    a, r = build("tova", decode, 3), build("tova", decode, 0)
    for c in (a, r):
        call(c, *piece(x, 0, 20))
        for i in range(20, 26):
            call(c, *piece(x, i, i + 1))
    st = a.held.state
    arrays = velox_decode.arrays
    own = {id(x) for x in arrays(st.inner)}
    extra = sum({id(x): x.nbytes for e in st.past for x in arrays(e) if id(x) not in own}.values())
    assert extra > 0 and a.nbytes == r.nbytes + extra
    if decode == "append":  # the journal shares the method's state: only tails of <= 2 tokens
        assert extra <= 3 * 2 * 2 * (1 * H * 2 * D * 4) + 3 * 2 * (1 * H * GROUPS * 2 * D * 4)


def test_proxy_mode_trims_at_step_boundaries_only():
    """Proxy mode runs a multi-token call as one step (its update cannot wait for the
    queries): it trims whole or raises."""
    x = tokens(4, 30)
    c, r = build("tova", "evict", 3, mode="proxy"), build("tova", "evict", 0, mode="proxy")
    for s in (c, r):
        call(s, *piece(x, 0, 20))
    want = fields(r)
    call(c, *piece(x, 20, 23))
    assert not c.can_trim(1) and c.can_trim(3)
    with pytest.raises(ValueError):
        c.trim(1)
    assert c.trim(3) == 3 and fields(c) == want


@pytest.mark.parametrize("key", CROSS_LAYER)
def test_cross_layer_methods_take_rollback(tiny_llama, key):
    """Their journals restore the model-level record too (tests/test_rollback_crosslayer.py)."""
    assert VeloxCache(key, rollback=1, mode="deferred").is_trimmable()
    assert all(c.is_trimmable() for c in make_cache(tiny_llama, key, rollback=2))
    assert not make_cache(tiny_llama, key)[0].is_trimmable()


@pytest.mark.parametrize("bad", [-1, True, 2.0, mlxlm.ROLLBACK_MAX + 1, 10**6])
def test_rollback_must_be_a_count_up_to_its_maximum(tiny_llama, bad, no_shape_checks):
    with pytest.raises(ValueError, match=f"rollback={bad!r} must be an integer from 0 to "
                                         f"ROLLBACK_MAX={mlxlm.ROLLBACK_MAX}"):
        make_cache(tiny_llama, "tova", rollback=bad)
    with pytest.raises(ValueError, match="ROLLBACK_MAX"):
        VeloxCache("tova", rollback=bad)


def test_the_deepest_rollback_is_bounded_in_memory(tiny_llama):
    """At ROLLBACK_MAX the journal keeps that many entries, each at most a state and a
    pending row beyond the cache's own, however long the decode."""
    assert mlxlm.ROLLBACK_MAX == 64
    deep, plain = (make_cache(tiny_llama, "tova", budget=24, rollback=r) for r in (mlxlm.ROLLBACK_MAX, 0))
    sizes = []
    for caches in (deep, plain):
        tiny_llama(mx.array([list(range(1, 41))]), cache=caches)
        for t in range(2 * mlxlm.ROLLBACK_MAX + 16):
            tiny_llama(mx.array([[t % 90 + 1]]), cache=caches)
            if caches is deep and t >= 2 * mlxlm.ROLLBACK_MAX:
                sizes.append(mlxlm.cache_nbytes(deep))
    assert all(len(c.held.state.past) == mlxlm.ROLLBACK_MAX for c in deep)
    assert deep[0].trimmable_tokens() == mlxlm.ROLLBACK_MAX
    row = 2 * (3 * 2 * H * D * 4)  # a pending row's keys and values in 3 layers (and its slots)
    assert max(sizes) <= (mlxlm.ROLLBACK_MAX + 1) * (mlxlm.cache_nbytes(plain) + row)


def test_load_cache_refuses_a_depth_beyond_the_maximum(tmp_path):
    import json

    x = tokens(6, 30)
    c = build("tova", "evict", 2)
    call(c, *piece(x, 0, 20))
    save_cache(tmp_path / "c.safetensors", [c])
    arrays, raw = mx.load(str(tmp_path / "c.safetensors"), return_metadata=True)
    layers = json.loads(raw["0.layers"])
    layers[0]["rollback"] = 10**6
    raw["0.layers"] = json.dumps(layers)
    raw["0.sha256"] = cache_files._digest(arrays, raw)  # a consistent file: the depth is what is refused
    mx.save_safetensors(str(tmp_path / "deep.safetensors"), arrays, metadata=raw)
    with pytest.raises(ValueError, match="layer 0: rollback=1000000 must be an integer from 0 to "
                                         "ROLLBACK_MAX=64"):
        load_cache(tmp_path / "deep.safetensors")


def test_save_and_load_carry_the_depth_not_the_journal(tmp_path):
    x = tokens(5, 30)
    c = build("tova", "append", 2)
    call(c, *piece(x, 0, 20))
    call(c, *piece(x, 20, 21))
    save_cache(tmp_path / "c.safetensors", [c])
    (back,), _ = load_cache(tmp_path / "c.safetensors")
    assert back.rollback == 2 and back.is_trimmable() and back.trimmable_tokens() == 0
    assert fields(back) == fields(c)
    call(back, *piece(x, 21, 22))
    assert back.can_trim(1) and not back.can_trim(2)

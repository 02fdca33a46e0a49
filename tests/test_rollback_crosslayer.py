"""Rollback of the cross-layer methods (a model-level record every layer's ``layer_update``
threads: chunkkv, squeeze, xkv, xquant, minicache) on the tiny llama's three layers.

``trim(n)`` on every layer, in layer order, leaves every layer's state and the model-level
record exactly as they were ``n`` tokens back; decoding on gives the run that never went past
that point. A verify call (2 to ``d + 1`` tokens on a cache holding tokens) runs as one-token
steps inside each layer, each token's record passed from layer to layer, where the method's
spec says that is exact (``contract.record_split``), and is refused before any state changes
where it is not (MiniCache). The journal's bytes are its distinct arrays, counted as the
method counts a state."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import velox.methods.xquant as xq
from velox import layer, wrap
from velox.adapters.mlxlm import load_cache, make_cache, save_cache
from velox.registry import get_method

from tests._helpers import OracleDraft

pytestmark = pytest.mark.unchecked

H, GROUPS, D, LAYERS = 2, 2, 32, 3   # the tiny llama's kv heads, query heads per kv head, head dim
SCALE = D ** -0.5
PREFILL = (30, 5)                    # two prompt chunks (the second on a non-empty cache)

# Small settings: ChunkKV's and Squeeze's budgets evict, ChunkKV's layer 1 follows layer 0,
# XQuant flushes a group of 32 tokens at its 43rd token (inside the trimmed steps), xKV's
# layers 0 and 1 share a basis, MiniCache merges layers 0 and 1.
PARAMS = {
    "chunkkv": dict(budget=16, chunk_size=2, n_sink=2, grace=2, reuse_layers=2),
    "squeeze": dict(budget=16, n_sink=2, grace=2),
    "xkv": dict(group_size=2),
    "xquant": dict(window=11),
    "minicache": dict(start_frac=0.0, retention_threshold=0.5),
}
SPLITS = [k for k in PARAMS if layer.split_refusal(get_method(k)) is None]


def test_every_cross_layer_method_is_here():
    from velox.registry import method_keys
    assert sorted(k for k in method_keys() if get_method(k).layer_update is not None) == sorted(PARAMS)
    assert sorted(SPLITS) == ["chunkkv", "squeeze", "xkv", "xquant"]


def rows(seed: int, n: int):
    """Each layer's ``n`` tokens of random keys, values and queries."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        k = rng.standard_normal((1, H, n, D)).astype(np.float32)
        v = rng.standard_normal((1, H, n, D)).astype(np.float32)
        q = rng.standard_normal((1, H * GROUPS, n, D)).astype(np.float32)
        out.append((mx.array(k), mx.array(v), mx.array(q)))
    return out


def forward(caches, x, i: int, j: int) -> list[np.ndarray]:
    """Tokens ``i:j`` through every layer in order, as mlx-lm and the attention wrapper
    drive the caches: each layer's attention output."""
    out = []
    for c, (k, v, q) in zip(caches, x):
        keys, values = c.update_and_fetch(k[:, :, i:j], v[:, :, i:j])
        out.append(np.array(c.attention(q[:, :, i:j], keys, values, scale=SCALE,
                                        mask=None if j - i == 1 else "causal")))
    return out


def _value(x):
    return (str(x.dtype), tuple(x.shape), np.array(x).tobytes()) if isinstance(x, mx.array) else x


def fields(caches) -> dict:
    """Everything the caches hold, by value: each layer's offset, positions and state, and
    the model-level record."""
    out = {}
    for i, c in enumerate(caches):
        out[f"{i}.offset"] = c.offset
        out[f"{i}.positions"] = np.array(c.positions()).tobytes()
        for name, x in tree_flatten(c.velox_state) if c.velox_state is not None else []:
            out[f"{i}.state.{name}"] = _value(x)
        tail = (None, None) if c.tail is None else c.tail
        for name, x in zip(("tail_k", "tail_v", "tail_q"), (*tail, c.tail_queries)):
            out[f"{i}.{name}"] = None if x is None else _value(x)
    record = caches[0]._model.record
    assert not isinstance(record, layer.TokenRecords)  # a verify call leaves the model's own
    out["record.type"] = type(record).__name__
    for name, x in tree_flatten(record) if record is not None else []:
        out[f"record.{name}"] = _value(x)
    if record is not None:  # static fields (the flattening keeps arrays and scalars only)
        out["record.static"] = repr([x for x in record if not isinstance(x, (mx.array, dict))])
    return out


def build(tiny_llama, key: str, rollback: int, **kw):
    return make_cache(tiny_llama, key, rollback=rollback, **PARAMS[key], **kw)


@pytest.mark.parametrize("decode", ["evict", "append"])
@pytest.mark.parametrize("key", sorted(PARAMS))
def test_trim_restores_every_layer_and_the_record(tiny_llama, key, decode):
    """Per depth d in {1, 3}: the caches with rollback=d step exactly as rollback=0 caches fed
    the same tokens one by one (a verify call of d + 1 tokens among single tokens, where the
    method splits one); trim(n) on every layer gives that run's fields n tokens back, for
    every n <= d; trimming more raises and changes nothing; decoding on gives the outputs and
    fields of the run that never saw the trimmed tokens. In append mode (a tail of 3) the
    method absorbs the tail with its record inside the trimmed steps too."""
    kw = dict(decode=decode, decode_cap=3)
    for d in (1, 3):
        calls = [1, 1, 1, d + 1 if key in SPLITS else 1, 1, 1]
        total = sum(PREFILL) + sum(calls) + 2
        x = rows(hash((key, d, decode)) % 2**32, total)
        a, r = build(tiny_llama, key, d, **kw), build(tiny_llama, key, 0, **kw)
        at = 0
        for s in PREFILL:
            for got, want in zip(forward(a, x, at, at + s), forward(r, x, at, at + s)):
                assert np.array_equal(got, want)
            at += s
        seen = {at: fields(r)}
        fork = None
        for s in calls:
            out = forward(a, x, at, at + s)
            ref = []
            for i in range(at, at + s):
                if sum(PREFILL) + sum(calls) - i == d:
                    fork = copy.deepcopy(r)  # the run that never sees the last d tokens
                ref.append(forward(r, x, i, i + 1))
                seen[i + 1] = fields(r)
            at += s
            for li in range(LAYERS):
                assert np.array_equal(out[li], np.concatenate([o[li] for o in ref], axis=2)), (key, d, at, li)
            assert fields(a) == seen[at], (key, d, at)
        assert all(c.trimmable_tokens() == d for c in a)
        assert [a[0].can_trim(n) for n in range(d + 2)] == [True] * (d + 1) + [False]
        before = fields(a)
        with pytest.raises(ValueError, match=f"trim\\({d + 1}\\)"):
            a[0].trim(d + 1)
        assert fields(a) == before  # never a partial trim, the record untouched
        for n in range(1, d):
            b = copy.deepcopy(a)
            assert [c.trim(n) for c in b] == [n] * LAYERS
            assert fields(b) == seen[at - n], (key, d, n)
        coded = xq.quantized_tokens(a[1].velox_state) if key == "xquant" else None
        assert [c.trim(d) for c in a] == [d] * LAYERS
        assert fields(a) == seen[at - d] and a[0].offset == at - d
        if key == "xquant" and decode == "evict":  # its first flush: the 43rd token
            assert (coded, xq.quantized_tokens(a[1].velox_state)) == ((32, 0) if d == 3 else (0, 0))
        assert not a[0].can_trim(1)
        for i in range(at - d, at - d + 2):  # decoding on: the run that never saw them
            for got, want in zip(forward(a, x, i, i + 1), forward(fork, x, i, i + 1)):
                assert np.array_equal(got, want)
            assert fields(a) == fields(fork), (key, d, i)


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_trim_back_to_the_empty_cache_restores_the_first_record(tiny_llama, key):
    """A trim of every step (the prompt included) leaves the record ``model_init`` makes:
    SqueezeAttention measures and reallocates again, xKV fits its bases again."""
    x = rows(7, 40)
    a, r = build(tiny_llama, key, 2), build(tiny_llama, key, 0)
    forward(a, x, 0, 30)
    forward(a, x, 30, 31)
    assert [c.trim(31) for c in a] == [31] * LAYERS
    assert a[0]._model.record is None and a[0].offset == 0  # made again at the next step
    for i, j in ((0, 30), (30, 31), (31, 32)):
        for got, want in zip(forward(a, x, i, j), forward(r, x, i, j)):
            assert np.array_equal(got, want)
        assert fields(a) == fields(r)


def test_a_verify_call_of_minicache_is_refused_before_any_change(tiny_llama):
    x = rows(3, 40)
    a = build(tiny_llama, "minicache", 3)
    forward(a, x, 0, 30)
    forward(a, x, 30, 31)
    before = fields(a)
    with pytest.raises(ValueError, match="minicache cannot do exactly: a primary layer merges"):
        forward(a, x, 31, 34)
    assert fields(a) == before and a[0].held.pending is None
    forward(a, x, 31, 36)  # more than d + 1 tokens: one step, not split
    assert a[0].trimmable_tokens() == 36 and a[0].can_trim(5) and not a[0].can_trim(4)


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_journal_bytes_are_its_distinct_arrays_as_the_method_counts_them(tiny_llama, key):
    """Each layer's nbytes: the distinct arrays of its current and journaled states, those it
    holds of another layer (a group's shared codes, basis or directions) left out; with an
    empty journal the cache's own bytes."""
    x = rows(4, 60)
    a, r = build(tiny_llama, key, 3), build(tiny_llama, key, 0)
    for c in (a, r):
        forward(c, x, 0, 45)
    for c in (a, r):
        for i in range(45, 50):
            forward(c, x, i, i + 1)
    m = get_method(key)
    for ca, cr in zip(a, r):
        st = ca.held.state
        assert len(st.past) == 3 and len(st.records) == 3
        shared = {id(x) for x in _not_counted(m, st.inner)}
        distinct: dict[int, int] = {}
        for s in (st.inner, *st.past):
            theirs = {id(x) for x in _not_counted(m, s)}
            for y in (y for _, y in tree_flatten(s) if isinstance(y, mx.array)):
                if id(y) not in theirs:
                    distinct.setdefault(id(y), y.nbytes)
        assert ca.nbytes == sum(distinct.values()) >= cr.nbytes == m.nbytes(st.inner)
        assert not (shared & set(distinct))
    empty = build(tiny_llama, key, 3)
    forward(empty, x, 0, 45)
    fresh = [wrap.trim(c.held.state, 45) for c in empty]  # back to the empty states
    assert all(empty[i]._m.nbytes(s) == m.nbytes(s.inner) for i, s in enumerate(fresh))


def _not_counted(m, st) -> list[mx.array]:
    """The arrays a layer's state holds of another layer, which its nbytes leaves out."""
    names = {"xquant": ("shared_key_codes", "shared_value_codes"), "xkv": ("shared_basis",),
             "minicache": ("directions_keys", "directions_values", "kept_keys", "kept_values")}
    if m.key == "minicache" and st.role != "merge":
        return []
    return [getattr(st, f) for f in names.get(m.key, ())]


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_a_loaded_cache_trims_back_to_the_saved_record(tiny_llama, tmp_path, key):
    x = rows(5, 40)
    a = build(tiny_llama, key, 2)
    forward(a, x, 0, 30)
    forward(a, x, 30, 31)
    save_cache(tmp_path / "c.safetensors", a)
    back, _ = load_cache(tmp_path / "c.safetensors", tiny_llama)
    want = fields(back)
    assert want == fields(a)
    forward(back, x, 31, 32)
    assert fields(back) != want
    assert [c.trim(1) for c in back] == [1] * LAYERS
    assert fields(back) == want


def greedy(model, caches, prompt, n: int) -> list[int]:
    """``n`` greedy tokens, the prompt taken as speculative decoding takes it: all but its
    last token as one chunk, then one token per call."""
    model(mx.array([prompt[:-1]]), cache=caches)
    out, y = [], prompt[-1]
    for _ in range(n):
        y = int(mx.argmax(model(mx.array([[y]]), cache=caches)[0, -1]))
        out.append(y)
    return out


PROMPT = [i % 90 + 1 for i in range(45)]


@pytest.mark.parametrize("key", sorted(PARAMS))
def test_decoding_after_a_trim_through_the_model(tiny_llama, key):
    """The model decodes 8 greedy tokens, trims 3 and decodes on: the tokens and fields are
    those of caches that decoded only 5, and the tokens those of caches without rollback
    (whose steady steps may run the whole model's compiled step)."""
    a, r = build(tiny_llama, key, 3), build(tiny_llama, key, 0, compile=False)  # layer by layer
    plain = build(tiny_llama, key, 0)
    want = greedy(tiny_llama, plain, PROMPT, 10)
    got = greedy(tiny_llama, a, PROMPT, 8)
    assert got == want[:8]
    assert [c.trim(3) for c in a] == [3] * LAYERS
    assert greedy(tiny_llama, r, PROMPT, 5) == want[:5]
    # both hold the prompt and want[:4] (the last token fed is want[3]); want[4] is next
    assert fields(a) == fields(r)
    for t in want[4:10]:
        la, lr = tiny_llama(mx.array([[t]]), cache=a), tiny_llama(mx.array([[t]]), cache=r)
        assert np.array_equal(np.array(la), np.array(lr))
        assert fields(a) == fields(r)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("key", sorted(PARAMS))
def test_speculative_decoding(tiny_llama, key, k):
    """mlx-lm's speculative_generate_step with caches of rollback=k gives the greedy tokens of
    caches without rollback, for the methods whose verify call splits; MiniCache is refused
    before its first step, saying why."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import KVCache

    n = 12
    want = greedy(tiny_llama, build(tiny_llama, key, 0), PROMPT, n + 1)
    draft = OracleDraft(want, len(PROMPT), 97, {2, 3, 7, 10})
    caches = build(tiny_llama, key, k) + [KVCache()]

    def run():
        return [(int(t), d) for t, _, d in speculative_generate_step(
            mx.array(PROMPT), tiny_llama, draft, num_draft_tokens=k, prompt_cache=caches,
            max_tokens=n, prefill_step_size=64)]
    if key not in SPLITS:
        with pytest.raises(ValueError, match="minicache cannot do exactly"):
            run()
        assert all(c.offset == 0 for c in caches[:LAYERS])  # refused before its first step
        return
    got = run()
    assert [t for t, _ in got] == want[:n]
    assert any(d for _, d in got) and not all(d for _, d in got)

"""Methods made of methods (velox.wrap): the decode tail equals its method fed the chunks the
tail hands it, and a journal's trim restores the state before the trimmed steps exactly.
(The contract suite checks the wrappers like any method: tests/test_contract.py.)"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox
from velox import decode, wrap
from velox.registry import get_method

from tests._helpers import random_rows, same_arrays

SCALE = 32 ** -0.5
PARAMS = {"tova": dict(budget=6, n_sink=1), "kivi": dict(bits=4, residual_length=4, group_size=32),
          "turboquant_mse": {}, "snapkv": dict(budget=6, obs_window=2, n_sink=1)}


_rows, _same = random_rows, same_arrays


@pytest.mark.parametrize("key", sorted(PARAMS))
@settings(max_examples=8, deadline=None)
@given(chunks=st.lists(st.sampled_from([1, 1, 1, 2, 5]), min_size=1, max_size=14),
       cap=st.integers(2, 5), proxy_at=st.integers(-1, 14), seed=st.integers(0, 3))
def test_the_tail_hands_its_method_the_chunks_it_would_have_been_given(key, chunks, cap, proxy_at, seed):
    m = get_method(key)
    t = wrap.with_tail(m, cap)
    rng = np.random.default_rng(seed)
    a = t.init(1, 2, 32, dtype=mx.float32, **PARAMS[key])
    b = m.init(1, 2, 32, dtype=mx.float32, **PARAMS[key])
    held: list = []  # the tail's steps, as the wrapper should hold them
    for i, s in enumerate(chunks):
        k, v, q = _rows(rng, s)
        q = None if i == proxy_at else q
        a = t.update(a, k, v, queries=q)
        held.append((k, v, q))
        if s > 1 or len(held) == cap:
            qs = [x[2] for x in held]
            b = m.update(b, mx.concatenate([x[0] for x in held], 2),
                         mx.concatenate([x[1] for x in held], 2),
                         queries=None if any(x is None for x in qs) else mx.concatenate(qs, 2))
            held = []
        assert a.tail_len == len(held) and _same(a.inner, b)
        got_k, got_v = t.get_kv(a)
        want_k, want_v = m.get_kv(b)
        if held:
            want_k = mx.concatenate([want_k] + [x[0] for x in held], 2)
            want_v = mx.concatenate([want_v] + [x[1] for x in held], 2)
        assert bool(mx.array_equal(got_k, want_k)) and bool(mx.array_equal(got_v, want_v))
        pos = np.array(t.positions(a))[0, 0]
        assert pos[-len(held):].tolist() == list(range(sum(chunks[:i + 1]) - len(held), sum(chunks[:i + 1]))) or not held
        tail_q = a.queries
        assert (tail_q is None) == (not held or any(x[2] is None for x in held))
        extra = sum(x.nbytes for x in (a.keys, a.values) + (() if tail_q is None else (tail_q,)))
        assert t.nbytes(a) == m.nbytes(b) + extra


def test_a_tail_of_one_is_the_method_and_a_tail_is_made_once():
    m = get_method("tova")
    assert wrap.with_tail(m, 1) is m
    assert wrap.with_tail(m, 8) is wrap.with_tail(m, 8) and wrap.with_tail(m, 8).key == "tova@tail8"
    assert wrap.wrapped(wrap.with_tail(m, 8)) is m and wrap.wrapped(m) is None
    assert "tova@tail8" not in velox.method_keys() and "tova@tail8" in velox.method_keys(wrappers=True)
    assert decode.not_steady_because(wrap.with_tail(m, 8)) == "the tail's length changes from step to step"
    for bad in (0, -1, True, wrap.TAIL_CAP_MAX + 1):
        with pytest.raises(ValueError, match="cap=.* must be an integer from 1 to"):
            wrap.with_tail(m, bad)


def test_a_tail_refuses_another_methods_state():
    t = wrap.with_tail(get_method("tova"), 4)
    other = get_method("tova").init(1, 2, 32, budget=6, dtype=mx.float32)
    with pytest.raises(TypeError, match="tova@tail4"):
        t.get_kv(other)


@pytest.mark.parametrize("key", ["tova", "kivi"])
@settings(max_examples=6, deadline=None)
@given(chunks=st.lists(st.sampled_from([1, 1, 3]), min_size=1, max_size=10),
       depth=st.integers(1, 4), seed=st.integers(0, 3), data=st.data())
def test_trim_restores_the_state_before_the_trimmed_steps(key, chunks, depth, seed, data):
    m = get_method(key)
    r = wrap.with_rollback(m, depth)
    rng = np.random.default_rng(seed)
    state = r.init(1, 2, 32, dtype=mx.float32, **PARAMS[key])
    plain = [m.init(1, 2, 32, dtype=mx.float32, **PARAMS[key])]
    for s in chunks:
        k, v, q = _rows(rng, s)
        state = r.update(state, k, v, queries=q)
        plain.append(m.update(plain[-1], k, v, queries=q))
    assert _same(state.inner, plain[-1])
    steps = chunks[-depth:]
    assert wrap.trimmable_tokens(state) == sum(steps)
    back = data.draw(st.integers(0, len(steps)), label="steps back")
    n = sum(steps[len(steps) - back:])
    assert wrap.can_trim(state, n)
    trimmed = wrap.trim(state, n)
    assert _same(trimmed.inner, plain[len(plain) - 1 - back])
    assert wrap.trimmable_tokens(trimmed) == sum(steps) - n
    bad = [x for x in range(1, sum(steps) + 2) if not any(
        x == sum(steps[len(steps) - j:]) for j in range(1, len(steps) + 1))]
    for x in bad[:3]:
        assert not wrap.can_trim(state, x)
        with pytest.raises(ValueError, match=f"trim\\({x}\\): the journal can remove exactly"):
            wrap.trim(state, x)


def test_a_journal_counts_the_arrays_it_keeps_alive_once():
    m = get_method("tova")
    r = wrap.with_rollback(m, 2)
    rng = np.random.default_rng(0)
    state = r.init(1, 2, 32, dtype=mx.float32, budget=6, n_sink=1)
    for s in (8, 1, 1, 1):
        state = r.update(state, *_rows(rng, s)[:2])
    distinct = {id(x): x.nbytes for st_ in (state.inner, *state.past) for x in decode.arrays(st_)}
    assert r.nbytes(state) == sum(distinct.values()) > m.nbytes(state.inner)
    assert len(state.past) == 2 and state.steps == (1, 1)
    with pytest.raises(ValueError, match="depth=0 must be an integer from 1 to"):
        wrap.with_rollback(m, 0)
    with pytest.raises(TypeError):  # (the message: velox's own, or the test run's type check)
        wrap.trim(state.inner, 1)


def test_which_path_a_single_token_takes():
    """velox.decode's choice of a layer's step: steady at a full bounded state, a fill step
    into an empty slot of amortized eviction, and the record the whole model's compiled step
    takes (none for a state with empty slots, or one its caller did not find steady)."""
    m = get_method("tova")
    rng = np.random.default_rng(0)
    one = _rows(rng, 1)[:2]
    full = m.update(m.init(1, 2, 32, budget=6, n_sink=1, dtype=mx.float32), *_rows(rng, 10)[:2])
    rows = decode.steady_rows(m, {"budget": 6, "n_sink": 1, "per_head": False, "slack": 0})
    assert rows == 6 and decode.steady_token(m, full, one[0], rows)
    assert not decode.steady_token(m, full, _rows(rng, 2)[0], rows)
    assert not decode.steady_token(m, full, one[0], rows, compile=False)
    assert decode.fill_token(m, full, *one) is None  # no empty slot
    assert decode.compiled_form(m, full, 10, steady=True, plain=True) is full
    assert decode.compiled_form(m, full, 10, steady=False, plain=True) is None
    slack = m.update(m.init(1, 2, 32, budget=6, n_sink=1, slack=3, dtype=mx.float32), *_rows(rng, 10)[:2])
    for _ in range(4):  # 6 + 3 slots filled, then a selection back to 6: 3 empty slots
        slack = m.update(slack, *_rows(rng, 1)[:2])
    assert slack.empty == 3
    filled = decode.fill_token(m, slack, *one)
    assert filled is not None and filled.empty == 2
    assert decode.fill_token(m, slack, *one, compile=False) is None
    assert decode.compiled_form(m, slack, 14, steady=True, plain=True) is None  # empty slots
    t = wrap.with_tail(m, 4)
    assert decode.steady_rows(t, {"budget": 6, "n_sink": 1, "per_head": False, "slack": 0}) is None
    r = wrap.with_rollback(m, 2)
    j = r.update(r.init(1, 2, 32, budget=6, n_sink=1, dtype=mx.float32), *_rows(rng, 10)[:2])
    assert decode.steady_token(r, j, one[0], rows)  # a journal is steady where its method is
    q = _rows(rng, 1)[2]
    out, new = decode.step(r, j, q, *one, scale=32 ** -0.5, steady=True)
    want_out, want = decode.step(m, j.inner, q, *one, scale=32 ** -0.5, steady=True)
    assert bool(mx.allclose(out, want_out, atol=1e-5)) and _same(new.inner, want)
    assert new.past[-1] is j.inner and new.steps == (10, 1)


@pytest.mark.parametrize("key", ["turboquant_mse", "turboquant_prod"])
def test_a_tail_of_codes_attends_one_query_from_the_codes(key):
    """A chunked codec's tail attends a single query over the stored codes plus the tail and
    new rows as new rows (scored exactly, the codes never decoded): the same output as the
    causal form with the queries padded in front, to float32 rounding."""
    m = get_method(key)
    t = wrap.with_tail(m, 8)
    rng = np.random.default_rng(7)
    st = t.update(t.init(1, 2, 32, dtype=mx.float32), *_rows(rng, 40)[:2])
    for _ in range(3):
        st = t.update(st, *_rows(rng, 1)[:2])
    assert st.tail_len == 3
    k, v, q = _rows(rng, 1)
    got = t.attend(st, q, k, v, scale=SCALE)
    padded = mx.concatenate([mx.zeros((1, 4, 3, 32)), q], axis=2)
    want = m.attend(st.inner, padded, mx.concatenate([st.keys, k], axis=2),
                    mx.concatenate([st.values, v], axis=2), scale=SCALE, mask="causal")[:, :, 3:]
    assert bool(mx.allclose(got, want, atol=1e-5, rtol=1e-5))

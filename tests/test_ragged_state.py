"""Ragged rows (``velox.ragged``): every method whose spec declares ``contract.ragged`` holds
them in one state of slots, every other method as one batch-of-one state per row
(``RowStates``); either way each batch row evolves exactly as that row alone, whatever its
padding holds."""

import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox import testing as vt
from velox.accounting import state_nbytes
import velox
from velox.ragged import RowStates, compact, token_fields
from velox.registry import get_method, method_keys

RAGGED = [k for k in method_keys() if get_method(k).spec.contract.get("ragged", False)]
PARAMS = {"tova": dict(budget=6, n_sink=1), "h2o": dict(budget=4, n_sink=1, grace=1)}


def test_the_score_and_keep_family_is_ragged():
    """Every method of the eviction skeleton declares ragged rows (and no composition does)."""
    skeleton = {k for k in method_keys() if "mlx" in get_method(k).backends and get_method(k).backends["mlx"].ragged is not None}
    assert skeleton == set(RAGGED)
    assert {"tova", "h2o", "snapkv", "knorm", "streaming_llm", "qfilters"} <= set(RAGGED)
    assert not any("+" in k for k in RAGGED)


@st.composite
def ragged_cases(draw, key: str):
    case = draw(vt.cases(key, max_chunk=6, max_updates=5, contents=("normal",), dtypes=("float32",)))
    batch = draw(st.integers(2, 3))
    case = vt.Case(**{**case.__dict__, "batch": batch})
    valid = [draw(st.lists(st.integers(0, s), min_size=batch, max_size=batch)) for s in case.chunks]
    poison = draw(st.sampled_from([np.nan, 1e30]))
    return case, valid, poison


def _poisoned(steps, valid, poison):
    """The steps with every padded key, value and query set to ``poison``."""
    out = []
    for step, v in zip(steps, valid):
        arrays = []
        for x in (step.keys, step.values, step.queries):
            if x is None:
                arrays.append(None)
                continue
            a = np.array(x)
            for i, n in enumerate(v):
                a[i, :, n:] = poison
            arrays.append(mx.array(a))
        out.append(vt.Step(*arrays))
    return out


def _rows_alone(case, steps, valid, backend):
    """Each row's states alone (batch of one, fed only its real tokens), after every step."""
    m = get_method(case.key)
    out = []
    for i in range(case.batch):
        state = m.init(1, case.heads, case.head_dim, dtype=case.mx_dtype, backend=backend, **case.params)
        states = []
        for step, v in zip(steps, valid):
            n = v[i]
            if n:
                q = None if step.queries is None else step.queries[i:i + 1, :, :n]
                state = m.update(state, step.keys[i:i + 1, :, :n], step.values[i:i + 1, :, :n], queries=q)
                mx.eval(state)
            states.append(state)
        out.append(states)
    return out


def _by_position(state, i: int, name: str) -> np.ndarray:
    """Row ``i``'s field ``name`` over its filled slots in increasing position ``[h, f, ...]``."""
    pos = np.array(state.positions[i])
    order = np.argsort(pos, axis=-1, kind="stable")
    f = (pos >= 0).sum(axis=-1)
    assert (f == f[0]).all(), "the heads of a row hold different counts"
    order = order[:, pos.shape[-1] - f[0]:]
    x = np.array(getattr(state, name)[i].astype(mx.float32) if getattr(state, name).dtype != mx.int32
                 else getattr(state, name)[i])
    return np.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


def _check_row(m, state, i: int, alone) -> None:
    tokens = token_fields(state)
    alone_c = compact(alone)
    for name in tokens:
        got, want = _by_position(state, i, name), _by_position(alone_c, 0, name)
        assert got.shape == want.shape, f"row {i}: {name} holds {got.shape}, alone {want.shape}"
        if name in ("positions", "keys", "values"):
            assert np.array_equal(got, want), f"row {i}: {name} differ from the row alone"
        else:
            assert np.allclose(got, want, rtol=1e-4, atol=1e-6), f"row {i}: carried {name} differ"
    assert np.array_equal(np.array(state.next_pos[i]), np.array(alone.next_pos[0]))
    for name, x in zip(state._fields, state):  # other per-row arrays (filters, bases)
        if isinstance(x, mx.array) and name not in tokens and name != "next_pos":
            assert np.allclose(np.array(x[i]), np.array(getattr(alone, name)[0]), rtol=1e-4, atol=1e-6), name
    # the gathered views: the row's real tokens, after its extra empty slots (left padding)
    pos = np.array(m.positions(state)[i])
    real = pos >= 0
    assert (real == np.sort(real, axis=-1)).all(), "empty slots must come first in positions()"
    keys = np.array(m.get_kv(state)[0][i])
    assert np.array_equal(pos[real].reshape(pos.shape[0], -1), np.array(m.positions(alone)[0]))
    assert np.array_equal(keys[real].reshape(pos.shape[0], -1, keys.shape[-1]), np.array(m.get_kv(alone)[0][0]))


def _check_accounting(m, state, alone_rows) -> None:
    """``nbytes``: the rows' own bytes (their filled slots), plus the static empty slots."""
    per_slot = sum(getattr(state, n).itemsize * int(np.prod(getattr(state, n).shape[3:]))
                   for n in token_fields(state))
    b, h = state.positions.shape[:2]
    want = sum(state_nbytes(compact(a)) for a in alone_rows) + per_slot * b * h * getattr(state, "empty", 0)
    assert m.nbytes(state) == want
    keys, values, mask = m.kv_slots(state)
    if (np.array(state.positions) < 0).any():
        assert mask is not None and np.array_equal(np.array(mask), np.array(state.positions) >= 0)


def _run_ragged(case, valid, poison, backend):
    m = get_method(case.key)
    steps = vt.make_inputs(case)
    alone = _rows_alone(case, steps, valid, backend)
    state = m.init(case.batch, case.heads, case.head_dim, dtype=case.mx_dtype, backend=backend, **case.params)
    for t, (step, v) in enumerate(zip(_poisoned(steps, valid, poison), valid)):
        before = state
        state = m.update(state, step.keys, step.values, queries=step.queries, valid=mx.array(v))
        mx.eval(state)
        for i in range(case.batch):
            if v[i] == 0:  # unchanged bit for bit (its slots as stored; only empty slots added)
                n = before.positions.shape[2]
                for name in token_fields(state):
                    a, b_ = np.array(getattr(before, name)[i]), np.array(getattr(state, name)[i, :, :n])
                    assert np.array_equal(a, b_, equal_nan=a.dtype.kind == "f"), f"row {i}: {name} moved"
                    assert (np.array(state.positions[i, :, n:]) == -1).all()
            _check_row(m, state, i, alone[i][t])
        _check_accounting(m, state, [alone[i][t] for i in range(case.batch)])


@pytest.mark.parametrize("key", RAGGED)
@settings(max_examples=max(3, settings.default.max_examples // 3))
@given(data=st.data())
def test_rows_evolve_as_alone(key, data):
    """mlx: each row of a ragged batch equals that row alone (positions, keys and values
    exactly, carried scores within float tolerance); padding NaN or 1e30 changes nothing; a
    row with valid 0 keeps its slots; get_kv, positions, kv_slots and nbytes agree."""
    case, valid, poison = data.draw(ragged_cases(key), label="case")
    _run_ragged(case, valid, poison, "mlx")


@pytest.mark.parametrize("key", RAGGED)
@settings(max_examples=2)
@given(data=st.data())
def test_reference_rows_evolve_as_alone(key, data):
    """reference: the same property, head by head in NumPy."""
    case, valid, poison = data.draw(ragged_cases(key), label="case")
    _run_ragged(case, valid, poison, "reference")


@pytest.mark.parametrize("key", ["tova", "h2o"])
def test_full_valid_is_none(key):
    """valid = s for every row of an ordinary state is the update without valid."""
    m = get_method(key)
    rng = np.random.default_rng(0)
    a = b = m.init(2, 2, 8, **PARAMS[key])
    for s in (5, 3, 1, 1, 4):
        k = mx.array(rng.standard_normal((2, 2, s, 8)).astype(np.float32))
        a = m.update(a, k, k)
        b = m.update(b, k, k, valid=mx.array([s, s]))
        for x, y in zip(a, b):
            if isinstance(x, mx.array):
                assert np.array_equal(np.array(x), np.array(y))


def test_decode_of_a_ragged_state_without_valid():
    """An update without valid of a ragged state runs as every row's s tokens, row by row."""
    m = get_method("h2o")
    rng = np.random.default_rng(1)
    k = mx.array(rng.standard_normal((2, 2, 5, 8)).astype(np.float32))
    state = m.update(m.init(2, 2, 8, **PARAMS["h2o"]), k, k, valid=mx.array([5, 2]))
    one = mx.array(rng.standard_normal((2, 2, 1, 8)).astype(np.float32))
    a = m.update(state, one, one)
    b = m.update(state, one, one, valid=mx.array([1, 1]))
    for x, y in zip(a, b):
        if isinstance(x, mx.array):
            assert np.array_equal(np.array(x), np.array(y))
    assert np.array(a.next_pos).tolist() == [[6, 6], [3, 3]]
    # the state says it is ragged in a field: a copy (arrays rebuilt, as a saved and loaded
    # state's are) updates the same way
    copied = state._replace(**{f: mx.array(np.array(x)) for f, x in zip(state._fields, state)
                               if isinstance(x, mx.array)})
    assert state.ragged and copied.ragged
    c = m.update(copied, one, one)
    for x, y in zip(a, c):
        if isinstance(x, mx.array):
            assert np.array_equal(np.array(x), np.array(y))


OTHERS = [k for k in method_keys() if k not in RAGGED]


def _check_row_states(m, state, alone_rows) -> None:
    """A ``RowStates`` batch: each row is the row alone (integer and code fields exactly,
    floating ones within float32 rounding of a batched first update); the batch's get_kv,
    positions, kv_slots and nbytes are the rows' own, left-padded."""
    assert isinstance(state, RowStates) and len(state.rows) == len(alone_rows)
    width = max(int(m.positions(a).shape[2]) for a in alone_rows)
    pos, (keys, values), (sk, sv, mask) = m.positions(state), m.get_kv(state), m.kv_slots(state)
    assert pos.shape[2] == keys.shape[2] == width
    for i, (got, want) in enumerate(zip(state.rows, alone_rows)):
        lg, lw = list(vt._leaves(got)), list(vt._leaves(want))
        assert len(lg) == len(lw)
        for x, y in zip(lg, lw):
            assert x.shape == y.shape and x.dtype == y.dtype
            if mx.issubdtype(x.dtype, mx.floating):
                a, b = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
                assert np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True), f"row {i} differs from alone"
            else:
                assert np.array_equal(np.array(x), np.array(y)), f"row {i} differs from alone"
        n = int(m.positions(want).shape[2])
        p = np.array(pos[i])
        assert (p[:, :width - n] == -1).all() and np.array_equal(p[:, width - n:], np.array(m.positions(want)[0]))
        assert np.array_equal(np.array(keys[i, :, width - n:]), np.array(m.get_kv(want)[0][0]))
        wk, wv, wm = m.kv_slots(want)
        ns = int(wk.shape[2])
        assert np.array_equal(np.array(sk[i, :, sk.shape[2] - ns:]), np.array(wk[0]))
        if mask is not None:
            real = np.array(mask[i])
            assert not real[:, :sk.shape[2] - ns].any()
            assert np.array_equal(real[:, sk.shape[2] - ns:], np.ones_like(real[:, sk.shape[2] - ns:]) if wm is None
                                  else np.array(wm[0]))
    assert m.nbytes(state) == sum(m.nbytes(a) for a in alone_rows)


@pytest.mark.parametrize("key", OTHERS)
@settings(max_examples=2)
@given(data=st.data())
def test_other_methods_hold_ragged_rows_one_state_per_row(key, data):
    """Every method without a state of ragged slots: an update with unequal valid counts
    splits the batch into one batch-of-one state per row (``RowStates``), each row then
    equal to that row alone whatever its padding holds; a row with valid 0 is left as it is."""
    case, valid, poison = data.draw(ragged_cases(key), label="case")
    m = get_method(key)
    steps = vt.make_inputs(case)
    alone = _rows_alone(case, steps, valid, "mlx")
    state = m.init(case.batch, case.heads, case.head_dim, dtype=case.mx_dtype, **case.params)
    for t, (step, v) in enumerate(zip(_poisoned(steps, valid, poison), valid)):
        before = state
        state = m.update(state, step.keys, step.values, queries=step.queries, valid=mx.array(v))
        mx.eval(state)
        if isinstance(state, RowStates):
            if isinstance(before, RowStates):
                assert all(state.rows[i] is before.rows[i] for i in range(case.batch) if v[i] == 0)
            _check_row_states(m, state, [alone[i][t] for i in range(case.batch)])
        else:  # every count so far was the whole chunk: an ordinary batch
            assert all(n == step.keys.shape[2] for n in v)


def test_row_states_of_given_rows_and_their_attention():
    """RowStates built from one-row states (requests of different lengths): the update
    without valid gives every row the chunk, KIVI's attend is each row's own."""
    m = get_method("kivi")
    rng = np.random.default_rng(3)
    f = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    rows = []
    for n in (40, 7):
        k = f(1, 2, n, 32)
        rows.append(m.update(m.init(1, 2, 32, residual_length=4), k, k))
    both = RowStates(tuple(rows))
    assert velox.method_of(both) is m and m.dims(both)[:3] == (2, 2, 32)
    k, q = f(2, 2, 1, 32), f(2, 4, 1, 32)
    nxt = velox.update(both, k, k, queries=q)
    assert isinstance(nxt, RowStates) and velox.tokens_seen(nxt) == 41
    for i in range(2):
        alone = m.update(rows[i], k[i:i + 1], k[i:i + 1], queries=q[i:i + 1])
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(vt._leaves(nxt.rows[i]), vt._leaves(alone)))
    out = m.attend(both, q, k, k, scale=32 ** -0.5)
    for i in range(2):
        want = m.attend(rows[i], q[i:i + 1], k[i:i + 1], k[i:i + 1], scale=32 ** -0.5)
        assert np.array_equal(np.array(out[i:i + 1]), np.array(want))


def test_a_state_whose_rows_cannot_be_cut_is_refused():
    """A field without a batch axis that holds data (CacheGen's stream of every row's codes)
    cannot be cut by row: the ragged update says how to build the batch instead."""
    m = get_method("cachegen")
    rng = np.random.default_rng(4)
    k = mx.array(rng.standard_normal((2, 2, 40, 32)).astype(np.float32))
    state = m.update(m.init(2, 2, 32), k, k)
    streams = [name for name, x in zip(state._fields, state) if isinstance(x, mx.array) and x.ndim == 1 and x.size]
    if not streams:
        pytest.skip("this CacheGen state keeps its codes per row")
    with pytest.raises(ValueError, match="cannot be split into rows.*RowStates"):
        m.update(state, k[:, :, :2], k[:, :, :2], valid=mx.array([2, 1]))


def test_bad_valid_is_refused():
    m = get_method("tova")
    k = mx.zeros((2, 1, 3, 8))
    with pytest.raises(ValueError, match="0..3"):
        m.update(m.init(2, 1, 8), k, k, valid=mx.array([4, 1]))
    with pytest.raises(ValueError, match=r"\[batch=2\]"):
        m.update(m.init(2, 1, 8), k, k, valid=mx.array([1, 1, 1]))

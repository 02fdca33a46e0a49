"""Ragged rows in one state (``velox.ragged``): every method whose spec declares
``contract.ragged`` evolves each batch row exactly as that row alone, whatever its padding
holds; every other method refuses unequal ``valid`` counts."""

import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox import testing as vt
from velox.accounting import state_nbytes
from velox.ragged import compact, token_fields
from velox.registry import get_method, method_keys

RAGGED = [k for k in method_keys() if get_method(k).spec.contract.get("ragged", False)]
PARAMS = {"tova": dict(budget=6, n_sink=1), "h2o": dict(budget=4, n_sink=1, grace=1)}


def test_the_score_and_keep_family_is_ragged():
    """Every method of the eviction skeleton declares ragged rows (and no composition does)."""
    skeleton = {k for k in method_keys() if hasattr(get_method(k).backends.get("mlx"), "ragged")}
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


@pytest.mark.parametrize("key", ["kivi", "turboquant_mse", "tova+affine", "adakv"])
def test_other_methods_refuse_unequal_counts(key):
    if key not in method_keys():
        pytest.skip(f"{key} is not registered")
    m = get_method(key)
    state = m.init(2, 2, 32)
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((2, 2, 4, 32)).astype(np.float32))
    with pytest.raises(ValueError, match=rf"{re.escape(key)}.*ragged rows.*not supported by its state"):
        m.update(state, k, k, valid=mx.array([4, 2]))
    same = m.update(state, k, k, valid=mx.array([4, 4]))  # equal counts equal to s: as None
    plain = m.update(state, k, k)
    for x, y in zip(vt._leaves(same), vt._leaves(plain)):
        assert np.array_equal(np.array(x), np.array(y))


def test_bad_valid_is_refused():
    m = get_method("tova")
    k = mx.zeros((2, 1, 3, 8))
    with pytest.raises(ValueError, match="0..3"):
        m.update(m.init(2, 1, 8), k, k, valid=mx.array([4, 1]))
    with pytest.raises(ValueError, match=r"\[batch=2\]"):
        m.update(m.init(2, 1, 8), k, k, valid=mx.array([1, 1, 1]))

"""The method contract, checked on every registered method with spec-driven hypothesis cases."""

import typing

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox
from velox import decode, wrap
from velox import testing as vt
from velox.backend import BackendUnavailable
from velox.registry import get_method, method_keys
from velox.spec import spec_keys, validate_params

from tests._helpers import every_method

# Methods made of methods (velox.wrap) are checked like any other: a tail over a slot evictor
# and over a codec cache of chunked storage with its own attention, a journal over a quantizer
# with its own attention, and over a cross-layer method whose layers share arrays (its
# nbytes counts as the method does; tests/test_wrap.py runs both wrappers over TOVA and KIVI,
# tests/test_rollback_crosslayer.py the journal over every cross-layer method, by layers).
WRAPPED = tuple(w(get_method(k), n).key for w, k, n in (
    (wrap.with_tail, "tova", 4), (wrap.with_tail, "turboquant_mse", 3), (wrap.with_rollback, "kivi", 2),
    (wrap.with_rollback, "xquant", 2)))
KEYS = method_keys() + WRAPPED


def test_every_spec_has_a_method_and_back():
    assert set(spec_keys()) == {k for k in KEYS if get_method(k).spec_override is None}


@pytest.mark.parametrize("key", KEYS)
def test_signature_matches_spec(key):
    vt.check_signature(key)


@pytest.mark.parametrize("key", KEYS)
def test_spec_says_how_decisions_treat_kv_heads(key):
    """``heads``: independent, mixed (reduced through ``velox.distributed``) or unshardable."""
    vt.check_heads_kind(key)


def test_every_spec_file_declares_heads():
    import tomllib
    from importlib import resources
    for key in spec_keys():
        data = tomllib.loads((resources.files("velox.specs") / f"{key}.toml").read_text("utf-8"))
        assert data.get("heads") in ("independent", "mixed", "unshardable"), f"{key}.toml: heads"


@pytest.mark.parametrize("key", KEYS)
def test_public_names(key):
    m = get_method(key)
    if not key.isidentifier():
        assert velox.init.__name__ == "init"  # compositions are reached through velox.init
        return
    assert getattr(velox, f"{key}_init") is m.init
    assert getattr(velox, f"{key}_update") is m.update
    assert getattr(velox, f"{key}_get_kv") is m.get_kv
    assert getattr(velox, f"{key}_bytes") is m.nbytes
    assert m.state_type.__name__ in velox.__all__


def _given_cases(fraction: float = 1.0, minimum: int = 3, families: bool = False, **kw):
    """Parametrise over methods, then draw a case for each with hypothesis.

    ``fraction`` scales the active profile's example count (for slow properties), down to
    ``minimum``; ``families=True`` marks the methods beyond one of each family ``slow``
    (``pytest --run-slow``).
    """
    def deco(fn):
        examples = max(minimum, int(settings.default.max_examples * fraction))

        @pytest.mark.parametrize("key", every_method(KEYS) if families else KEYS)
        @settings(max_examples=examples)
        @given(data=st.data())
        def wrapper(key, data):
            case = data.draw(vt.cases(key, **kw), label="case")
            fn(case)
        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper
    return deco


@_given_cases()
def test_invariants(case):
    """Capacity, sinks, positions (true rows), next position, error bound, real bytes."""
    steps = vt.make_inputs(case)
    states = vt.run(case, "mlx", steps=steps)
    vt.check_capacity(case, states)
    vt.check_sinks(case, states)
    vt.check_positions(case, states, steps)
    vt.check_next_pos(case, states)
    vt.check_error_bound(case, states, steps)
    vt.check_bytes(case, states)
    vt.check_slots(case, states)


SLOTTED = [k for k in KEYS if "mlx" in get_method(k).backends and get_method(k).backends["mlx"].slots
           and get_method(k).backends["mlx"].skeleton is not None]


@pytest.mark.parametrize("key", SLOTTED)
@settings(max_examples=max(3, settings.default.max_examples // 3))
@given(data=st.data())
def test_slots_keep_the_sorted_rule(key, data):
    """Slots change where rows live, not what is kept: after every update a state of slots
    holds the tokens, rows and per-token fields of the same rule on sorted rows (the
    ``reference`` backends; any ``slack``: the sorted rule appends and selects down to the
    budget at the same steps), and its slot invariants hold (``check_slots``)."""
    case = data.draw(vt.cases(key, dtypes=("float32",), contents=vt.CONTINUOUS), label="case")
    steps = vt.make_inputs(case)
    slots = vt.run(case, "reference", steps=steps)
    twin = vt.run(case, "reference", update=vt.sorted_twin(key), steps=steps)
    vt.check_slots(case, slots)
    m = get_method(key)
    hints = typing.get_type_hints(m.state_type)
    carried = [f for f in m.state_type._fields if f not in ("keys", "values", "positions")
               and str(getattr(hints.get(f), "dim_str", "")).split()[:3] == ["b", "h", "n"]]
    for t, (a, b) in enumerate(zip(slots, twin)):
        assert np.array_equal(np.array(m.positions(a)), np.array(b.positions)), f"update {t}: kept tokens"
        for x, y in zip(m.get_kv(a), (b.keys, b.values)):
            assert mx.array_equal(x, y).item(), f"update {t}: kept rows"
        for f in carried:
            np.testing.assert_allclose(np.array(vt.by_position(a, f)), np.array(getattr(b, f)),
                                       rtol=1e-6, atol=1e-7, err_msg=f"update {t}: {f}")


@_given_cases(families=True, contents=vt.CONTINUOUS)
def test_backend_parity(case):
    """Every backend that runs here agrees with the reference within the spec's tolerance."""
    m = get_method(case.key)
    atol, rtol = vt.tolerance(case)
    steps = vt.make_inputs(case)
    want = vt.run(case, "reference", steps=steps)
    vt.check_positions(case, want, steps)
    for backend in m.backends:
        if backend == "reference" or not velox.backend.device_supports(backend):
            continue
        got = vt.run(case, backend, steps=steps)
        for t, (a, b) in enumerate(zip(got, want)):
            vt.assert_states_close(case, a, b, atol=atol, rtol=rtol,
                                   what=f"{backend} vs reference after update {t}")


@_given_cases(dtypes=("float32",))
def test_purity(case):
    """An update leaves its inputs and the previous state untouched."""
    m = get_method(case.key)
    steps = vt.make_inputs(case)
    state = vt.init_state(case)
    for step in steps:
        before = [np.array(x) for x in vt._leaves(state)] + [np.array(x) for x in step if x is not None]
        new = m.update(state, step.keys, step.values, queries=step.queries)
        mx.eval(new)
        after = [np.array(x) for x in vt._leaves(state)] + [np.array(x) for x in step if x is not None]
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        state = new


# One case per method in the default (ci) profile: on a CPU every new compiled graph is a C++
# kernel built by the system compiler (~1 CPU-second each, none cached on a fresh machine), and
# three cases per method cost most of a fresh run's time; the adapter tests run every method's
# compiled decode steps besides. dev draws 2, thorough 30.
@_given_cases(fraction=0.1, minimum=1, families=True, dtypes=("float32",), contents=vt.CONTINUOUS)
def test_compiled_update_equals_plain(case):
    """``mx.compile`` of the update gives the same states as the plain update."""
    m = get_method(case.key)
    if not m.spec.contract.get("compilable", True):
        reason = m.spec.contract.get("not_compilable_because")
        assert reason, f"{case.key}: spec says compilable = false without a reason"
        pytest.skip(f"{case.key} declares its update not compilable: {reason}")
    steps = vt.make_inputs(case)
    plain = vt.run(case, "mlx", steps=steps)
    with_q = mx.compile(lambda s, k, v, q: m.update(s, k, v, queries=q))
    without_q = mx.compile(lambda s, k, v: m.update(s, k, v))
    compiled = vt.run(case, "mlx", steps=steps,
                      update=lambda s, k, v, q: without_q(s, k, v) if q is None else with_q(s, k, v, q))
    atol, rtol = vt.tolerance(case)
    for t, (a, b) in enumerate(zip(compiled, plain)):
        vt.assert_states_close(case, a, b, atol=atol + 1e-6, rtol=rtol + 1e-6,
                               what=f"compiled vs plain after update {t}")


@_given_cases(families=True, dtypes=("float32",), contents=vt.CONTINUOUS)
def test_batch_and_head_independence(case):
    """Updating stacked rows equals updating each row alone (heads too, where the spec says so)."""
    m = get_method(case.key)
    full = vt.run(case, "mlx")[-1]
    per_head = vt.head_independent(m.spec, case.params)
    atol, rtol = vt.tolerance(case)
    for i in range(case.batch):
        for j in (range(case.heads) if per_head else [None]):
            sub_case, sub_steps = vt.row_case(case, i, j)
            alone = vt.run(sub_case, "mlx", steps=sub_steps)[-1]
            hs = slice(None) if j is None else slice(j, j + 1)
            pos_full = np.array(m.positions(full))[i:i + 1, hs]
            assert np.array_equal(pos_full, np.array(m.positions(alone))), f"row {i}, head {j}: positions"
            for x, y in zip(m.get_kv(full), m.get_kv(alone)):
                x = np.array(x[i:i + 1, hs].astype(mx.float32))
                y = np.array(y.astype(mx.float32))
                assert np.allclose(x, y, atol=atol + 1e-6, rtol=rtol + 1e-6)


@_given_cases(fraction=0.5, dtypes=("float32",))
def test_attend_equals_dense_attention(case):
    """Where a method attends itself (``attend``), the result equals attention over ``get_kv``
    plus the new tokens (unless its spec says what attention reads differs by design)."""
    m = get_method(case.key)
    if m.attend is None or not m.spec.contract.get("attend_dense", True):
        return
    steps = vt.make_inputs(case)
    state = vt.run(case, "mlx", steps=steps[:-1])[-1] if len(steps) > 1 else vt.init_state(case)
    new = steps[-1]
    s = new.keys.shape[2]
    q = new.queries if new.queries is not None else mx.repeat(new.keys, 2, axis=1)
    scale = case.head_dim ** -0.5
    mask = "causal" if s > 1 else None
    got = m.attend(state, q, new.keys, new.values, scale=scale, mask=mask)
    k, v = m.get_kv(state)
    k = mx.concatenate([k, new.keys], axis=2)
    v = mx.concatenate([v, new.values], axis=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    tol = 1e-4 if case.mx_dtype == mx.float32 else 3e-2
    assert np.allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                       atol=tol, rtol=tol)


@_given_cases(fraction=0.5, dtypes=("float32",))
def test_attend_update_is_attend_then_update(case):
    """A method with its own attention has ``attend_update``: ``attend``'s output and
    ``update``'s state (with the queries), the same arrays to the bit where no faster way takes
    the step (this machine's path); a method without ``attend`` has none."""
    m = get_method(case.key)
    if m.attend is None:
        assert m.attend_update is None
        return
    steps = vt.make_inputs(case)
    state = vt.run(case, "mlx", steps=steps[:-1])[-1] if len(steps) > 1 else vt.init_state(case)
    new = steps[-1]
    q = new.queries if new.queries is not None else mx.repeat(new.keys, 2, axis=1)
    mask = "causal" if new.keys.shape[2] > 1 else None
    scale = case.head_dim ** -0.5
    out, after = m.attend_update(state, q, new.keys, new.values, scale=scale, mask=mask)
    want = m.attend(state, q, new.keys, new.values, scale=scale, mask=mask)
    assert np.array_equal(np.array(out), np.array(want), equal_nan=True)
    ref = m.update(state, new.keys, new.values, queries=q)
    xs, ys = _record_arrays(after), _record_arrays(ref)
    assert len(xs) == len(ys) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(np.array(x), np.array(y), equal_nan=True)
        for x, y in zip(xs, ys))


def _record_arrays(record) -> list:
    from mlx.utils import tree_flatten
    return [x for _, x in tree_flatten(record) if isinstance(x, mx.array)]


@_given_cases(fraction=0.5, contents=vt.NONFINITE)
def test_nonfinite_input(case):
    """NaN, +-inf and overflowing inputs: protected tokens survive, the position and byte
    invariants hold, and finite tokens' rows are kept as the method's family allows
    (:func:`velox.testing.check_nonfinite` states what is asserted per family)."""
    vt.check_nonfinite(case, "mlx")


@_given_cases(fraction=0.3, dtypes=("float32",), contents=vt.NONFINITE)
def test_nonfinite_input_reference(case):
    """The same rule on the ``reference`` backend."""
    vt.check_nonfinite(case, "reference")


# --- bad input ------------------------------------------------------------------------

def _small_state(key, **over):
    m = get_method(key)
    d = 32 if "head_dim" in " ".join(m.spec.constraints) else 8
    return m, m.init(1, 2, d, **over), d


@pytest.mark.parametrize("key", KEYS)
def test_bad_update_inputs(key, no_shape_checks):
    m, state, d = _small_state(key)
    ok = mx.zeros((1, 2, 3, d))
    cases = [
        (mx.zeros((2, 3, d)), ok, None, "rank 4"),
        (mx.zeros((1, 3, 3, d)), mx.zeros((1, 3, 3, d)), None, "kv heads"),
        (mx.zeros((1, 2, 3, d + 1)), mx.zeros((1, 2, 3, d + 1)), None, "head_dim"),
        (mx.zeros((2, 2, 3, d)), mx.zeros((2, 2, 3, d)), None, "batch"),
        (mx.zeros((1, 2, 0, d)), mx.zeros((1, 2, 0, d)), None, "s=0"),
        (mx.zeros((1, 2, 3, d), mx.int32), mx.zeros((1, 2, 3, d), mx.int32), None, "not floating"),
        (ok, mx.zeros((1, 2, 4, d)), None, "values shape"),
        (ok.astype(mx.float16), ok.astype(mx.float16), None, "dtype"),
        (ok, ok, mx.zeros((1, 3, 3, d)), "multiple"),
        (ok, ok, mx.zeros((1, 2, 2, d)), "queries shape"),
    ]
    for k, v, q, msg in cases:
        with pytest.raises(ValueError, match=msg):
            m.update(state, k, v, queries=q)


@pytest.mark.parametrize("key", KEYS)
def test_bad_init_arguments(key, no_shape_checks):
    m = get_method(key)
    with pytest.raises(ValueError, match="unknown backend"):
        m.init(1, 1, 32, backend="gpu")
    with pytest.raises(BackendUnavailable, match="cuda"):
        if velox.backend.device_supports("cuda"):
            raise BackendUnavailable("cuda runs here; nothing to test")
        m.init(1, 1, 32, backend="cuda")
    with pytest.raises(ValueError, match="head_dim"):
        m.init(1, 1, 0)
    with pytest.raises(ValueError, match="dtype"):
        m.init(1, 1, 32, dtype=mx.int32)
    with pytest.raises((TypeError, ValueError), match="not_a_parameter"):
        m.init(1, 1, 32, not_a_parameter=3)
    with pytest.raises(ValueError, match="unknown parameter.*valid"):
        velox.init(key, 1, 1, 32, not_a_parameter=3)
    for name, p in m.spec.params.items():
        if p.min is not None:
            bad = p.min - (0 if p.min_exclusive else 1)
            with pytest.raises(ValueError, match=name):
                m.init(1, 1, 32, **{name: int(bad) if p.type == "int" else bad})
        if p.max is not None:
            bad = p.max + (0 if p.max_exclusive else 1)
            with pytest.raises(ValueError, match=name):
                m.init(1, 1, 32, **{name: int(bad) if p.type == "int" else bad})
        if p.type == "choice":
            with pytest.raises(ValueError, match=name):
                m.init(1, 1, 32, **{name: "no-such-choice"})


@pytest.mark.parametrize("key", KEYS)
def test_constraint_violations_name_the_parameters(key, no_shape_checks):
    """Each spec constraint, when violated, raises a ValueError naming its parameters."""
    import ast
    import itertools

    m = get_method(key)
    dim_values = dict(batch=[1, 2], kv_heads=[1, 2], head_dim=[8, 16, 24, 32, 40, 48, 96, 6])
    for expr in m.spec.constraints:
        names = sorted({n.id for n in ast.walk(ast.parse(expr, mode="eval"))
                        if isinstance(n, ast.Name) and (n.id in m.spec.params or n.id in dim_values)})
        candidates = [dim_values[n] if n in dim_values else
                      (m.spec.params[n].choices or range(0, 9)) for n in names]
        found = False
        for combo in itertools.product(*candidates):
            chosen = dict(zip(names, combo))
            params = {k: v for k, v in chosen.items() if k in m.spec.params}
            dims = {k: chosen.get(k, 1 if k != "head_dim" else 32) for k in dim_values}
            env = {**m.spec.defaults, **params, **dims}
            try:
                for name in params:
                    m.spec.params[name].check(params[name])
            except ValueError:
                continue
            if vt.evaluate_expr(expr, env):
                continue
            with pytest.raises(ValueError) as err:
                m.init(dims["batch"], dims["kv_heads"], dims["head_dim"], **params)
            for name in names:
                assert name in str(err.value), f"{expr}: message {err.value!s} lacks {name}"
            found = True
            break
        assert found, f"no small violation of {expr} found"


@_given_cases(fraction=0.3, dtypes=("float32",), contents=vt.CONTINUOUS)
def test_step_is_attention_then_update(case):
    """``velox.decode.step`` is the attention of the step's queries over what the state holds
    and the new rows, then ``update`` with those queries: the case's last chunk, then three
    one-token steps, each also by the fused path a decode loop compiles where the state is
    steady (``steady=True``: scores from the attention's own weights, the slot write deferred
    and then made)."""
    m = get_method(case.key)
    steps = vt.make_inputs(case)
    state = vt.run(case, "mlx", steps=steps[:-1])[-1] if len(steps) > 1 else vt.init_state(case)
    rng = np.random.default_rng(case.seed + 7)
    b, h, d, g = case.batch, case.heads, case.head_dim, max(case.groups, 1)
    last = steps[-1]
    calls = [(last.keys, last.values, last.queries)]
    for _ in range(3):
        k, v, q = (mx.array(rng.standard_normal(s).astype(np.float32))
                   for s in ((b, h, 1, d), (b, h, 1, d), (b, h * g, 1, d)))
        calls.append((k, v, q if case.groups else None))
    scale = d ** -0.5
    atol, rtol = vt.tolerance(case)
    dense = m.spec.contract.get("attend_dense", True)
    rows = decode.steady_rows(m, validate_params(m.spec, case.params))
    for i, (k, v, q) in enumerate(calls):
        q = q if q is not None else k
        want_state = m.update(state, k, v, queries=q)
        gk, gv = m.get_kv(state)
        want = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([gk, k], axis=2), mx.concatenate([gv, v], axis=2), scale=scale,
            mask="causal" if k.shape[2] > 1 else None)
        fused = k.shape[2] == 1 and rows is not None and decode.slot_count(m, state) == rows
        for steady in (False, True) if fused else (False,):
            out, got = decode.step(m, state, q, k, v, scale=scale, steady=steady)
            what = f"{case.key} call {i} steady={steady}"
            if dense:
                assert np.allclose(np.array(out), np.array(want), atol=1e-4, rtol=1e-4), (
                    f"{what}: output differs by {np.abs(np.array(out) - np.array(want)).max()}")
            vt.assert_states_close(case, got, want_state, atol=atol, rtol=rtol, what=what)
        state = want_state


@_given_cases(fraction=0.2, dtypes=("float32",), contents=vt.CONTINUOUS)
def test_step_info_says_what_the_step_did(case):
    """``step(..., info=True)``: the same output and state, and an info record whose counts
    follow the positions (held after; dropped = held before + the step's - held after), bytes
    the state's, and the error of the step's rows as the state returns them (0 for an exact
    method, within the spec's error bound for a quantizer)."""
    m = get_method(case.key)
    steps = vt.make_inputs(case)
    state = vt.run(case, "mlx", steps=steps[:-1])[-1] if len(steps) > 1 else vt.init_state(case)
    new = steps[-1]
    q = new.queries if new.queries is not None else new.keys
    scale = case.head_dim ** -0.5
    out, after = decode.step(m, state, q, new.keys, new.values, scale=scale)
    out2, after2, info = decode.step(m, state, q, new.keys, new.values, scale=scale, info=True)
    assert np.array_equal(np.array(out), np.array(out2), equal_nan=True)
    held = lambda st: (np.array(m.positions(st)) >= 0).sum(-1)  # noqa: E731
    assert np.array_equal(np.array(info.stored), held(after2))
    assert np.array_equal(np.array(info.evicted), held(state) + new.keys.shape[2] - held(after2))
    assert info.nbytes == m.nbytes(after2)
    ke, ve = np.array(info.key_error), np.array(info.value_error)
    assert ke.shape == ve.shape == (case.batch, case.heads) and (ke >= 0).all() and (ve >= 0).all()
    c = m.spec.contract
    if not c.get("quantized", False) and c.get("exact_rows", True) and m.error_bound is None:
        assert ke.max() <= 1e-6 and ve.max() <= 1e-6  # an exact method stores what it is given

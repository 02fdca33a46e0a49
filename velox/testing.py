"""Property-test support: hypothesis strategies drawn from each method's spec, and the checks
of the method contract. ``tests/test_contract.py`` runs them over every registered method;
a new method gets the whole suite by registering itself and shipping a spec.

Requires the ``test`` extra (hypothesis).
"""

from __future__ import annotations

import math

import inspect
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
try:
    from hypothesis import assume
    from hypothesis import strategies as st
except ImportError as exc:  # the property tests' one dependency beyond velox's own
    raise ImportError("velox.testing needs hypothesis, the 'test' extra: "
                      "pip install 'velox[test]' (or pip install hypothesis)") from exc

from .accounting import state_nbytes
from .decode import slack as decode_slack
from .registry import Method, get_method
from .spec import Param, Spec, evaluate, validate_params

__all__ = ["Case", "cases", "param_strategy", "make_inputs", "run", "DTYPES",
           "check_capacity", "check_sinks", "check_positions", "check_next_pos",
           "check_error_bound", "check_bytes", "check_signature", "check_heads_kind", "head_independent",
           "row_case", "assert_states_close", "NONFINITE", "nonfinite_tokens", "check_nonfinite",
           "by_position", "check_slots", "test_params"]

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
CONTENTS = ("normal", "peaky", "zeros", "repeat")
CONTINUOUS = ("normal",)
# "normal" data with a few tokens spoiled: one element of their keys, values or queries NaN,
# +inf or -inf, or ("overflow") their key rows scaled to |k| ~ 1e30, finite in float32 and
# bfloat16 (inf in float16) but with overflowing dot products. See check_nonfinite.
NONFINITE = ("nan", "inf", "-inf", "overflow")
_SPOIL = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@dataclass(frozen=True)
class Case:
    """One drawn scenario: dims, parameters, chunk sizes and how the data is generated."""

    key: str
    batch: int
    heads: int
    head_dim: int
    groups: int          # query heads per kv head; 0 = no real queries (key-as-query proxy)
    dtype: str
    params: dict = field(hash=False)
    chunks: tuple[int, ...] = ()
    seed: int = 0
    content: str = "normal"

    @property
    def mx_dtype(self) -> mx.Dtype:
        return DTYPES[self.dtype]

    @property
    def tokens(self) -> int:
        return sum(self.chunks)


def test_params(key: str) -> dict[str, Any]:
    """The parameters a test passes so that ``key`` runs on any dims: each parameter whose
    default the spec keeps out of tests (``test_choices`` without it: a codebook shipped for
    the embedded model only) at its first test choice; ``{}`` for most methods."""
    spec = get_method(key).spec
    return {name: p.test_choices[0] for name, p in spec.params.items()
            if p.test_choices and p.default not in p.test_choices}


test_params.__test__ = False  # not a test for pytest to collect


def _param_values(p: Param) -> st.SearchStrategy:
    if p.type == "bool":
        return st.booleans()
    if p.type == "choice":
        return st.sampled_from(p.test_choices or p.choices)
    lo = p.test_min if p.test_min is not None else p.min
    hi = p.test_max if p.test_max is not None else p.max
    if p.type == "int":
        lo = 0 if lo is None else int(lo) + (1 if p.min_exclusive and lo == p.min else 0)
        hi = lo + 64 if hi is None else int(hi) - (1 if p.max_exclusive and hi == p.max else 0)
        return st.integers(lo, hi)
    lo = -1e3 if lo is None else lo
    hi = 1e3 if hi is None else hi
    return st.floats(lo, hi, exclude_min=p.min_exclusive and lo == p.min,
                     exclude_max=p.max_exclusive and hi == p.max, allow_nan=False)


@st.composite
def param_strategy(draw, spec: Spec, dims: dict[str, int] | None = None) -> dict[str, Any]:
    """Parameters within each parameter's test range that satisfy the spec's constraints."""
    params = {name: draw(_param_values(p)) for name, p in spec.params.items()}
    try:
        return validate_params(spec, params, dims=dims)
    except ValueError:
        assume(False)


@st.composite
def cases(draw, key: str, *, dtypes: tuple[str, ...] = tuple(DTYPES), max_chunk: int = 24,
          max_updates: int = 7, contents: tuple[str, ...] = CONTENTS) -> Case:
    """A scenario for method ``key``: dims, spec-drawn params and a sequence of chunk sizes.

    ``contents`` may also name the :data:`NONFINITE` kinds (see :func:`check_nonfinite`).

    Chunk sizes mix prefill chunks and single-token decode steps, and the total usually
    exceeds the method's capacity so eviction and flushing are exercised. ``contents``
    picks how keys are generated: ``normal`` (std 0.5) or ``peaky`` (std 2) Gaussian, or the
    degenerate ``zeros``/``repeat`` (exact ties). Comparisons of two computations of the same
    scores (backends, compiled, batched) use ``normal`` only: with ties or near ties in the
    data, rounding differences legitimately reorder tied candidates.
    """
    spec = get_method(key).spec
    batch = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 16, 32, 64]))
    dims = dict(batch=batch, kv_heads=heads, head_dim=head_dim)
    params = draw(param_strategy(spec, dims))
    cap = spec.capacity(params) or 48
    first = draw(st.integers(1, max(2, min(3 * cap, 96))))
    rest = draw(st.lists(st.one_of(st.just(1), st.integers(1, max_chunk)), max_size=max_updates - 1))
    return Case(key=key, batch=batch, heads=heads, head_dim=head_dim,
                groups=draw(st.sampled_from([0, 1, 2])), dtype=draw(st.sampled_from(dtypes)),
                params=params, chunks=(first, *rest), seed=draw(st.integers(0, 2 ** 16)),
                content=draw(st.sampled_from(contents)))


class Step(NamedTuple):
    keys: mx.array
    values: mx.array
    queries: mx.array | None


def _content(rng: np.random.Generator, shape: tuple[int, ...], content: str,
             pool: np.ndarray | None) -> np.ndarray:
    if content == "zeros":
        return np.zeros(shape, np.float32)
    if content == "repeat":  # rows drawn from a few distinct vectors: many exact ties
        rows = pool[rng.integers(0, len(pool), size=shape[:-1])]
        return rows.astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    # "normal" keys (std 0.5) keep each token's attention to itself moderate; "peaky" (std 2)
    # makes the key-as-query proxy nearly one-hot, so scores crowd together (near ties).
    return x * 2.0 if content == "peaky" else x * 0.5


def nonfinite_tokens(case: Case) -> np.ndarray:
    """``[T]`` bool: the absolute positions whose inputs a non-finite ``case`` spoils (about
    one token in eight, never positions 0 and 1: sinks survive either way, and a spoiled
    first token would leave nothing finite to compare). All False for other contents."""
    bad = np.zeros(case.tokens, bool)
    if case.content in NONFINITE:
        rng = np.random.default_rng(case.seed + 1)
        bad[2:] = rng.random(max(case.tokens - 2, 0)) < 0.125
    return bad


def _spoil(rng: np.random.Generator, k: np.ndarray, v: np.ndarray, q: np.ndarray | None,
           bad: np.ndarray, content: str) -> None:
    """Spoil tokens ``bad`` (``[s]``) of one chunk in place: keys always (one element, or the
    whole row scaled for ``overflow``), values and queries each with probability 1/2."""
    for t in np.flatnonzero(bad):
        c = rng.integers(0, k.shape[-1])
        if content == "overflow":
            k[:, :, t] *= np.float32(1e30) / np.maximum(np.abs(k[:, :, t]).max(), 1e-3)
        else:
            k[:, :, t, c] = _SPOIL[content]
        if rng.random() < 0.5:
            v[:, :, t, c] = np.float32(1e30) if content == "overflow" else _SPOIL[content]
        if q is not None and rng.random() < 0.5:
            q[:, :, t, c] = np.float32(1e30) if content == "overflow" else _SPOIL[content]


def make_inputs(case: Case) -> list[Step]:
    """The keys, values (and queries) of every update of ``case``, from its seed."""
    rng = np.random.default_rng(case.seed)
    spoil_rng = np.random.default_rng(case.seed + 2)
    pool = rng.standard_normal((3, case.head_dim)).astype(np.float32)
    bad = nonfinite_tokens(case)
    content = "normal" if case.content in NONFINITE else case.content
    steps, start = [], 0
    for s in case.chunks:
        shape = (case.batch, case.heads, s, case.head_dim)
        k = _content(rng, shape, content, pool)
        v = rng.standard_normal(shape).astype(np.float32)
        q = None
        if case.groups:
            q = rng.standard_normal((case.batch, case.heads * case.groups, s, case.head_dim))
        if bad[start:start + s].any():
            q = None if q is None else q.astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                _spoil(spoil_rng, k, v, q, bad[start:start + s], case.content)
        start += s
        cast = lambda x: mx.array(x.astype(np.float32)).astype(case.mx_dtype)  # noqa: E731
        steps.append(Step(cast(k), cast(v), None if q is None else cast(q)))
    return steps


def init_state(case: Case, backend: str = "mlx") -> tuple:
    m = get_method(case.key)
    return m.init(case.batch, case.heads, case.head_dim, dtype=case.mx_dtype, backend=backend,
                  **case.params)


def run(case: Case, backend: str = "mlx", update: Callable | None = None,
        steps: list[Step] | None = None) -> list[tuple]:
    """States after each update of ``case`` (``update`` defaults to the method's)."""
    m = get_method(case.key)
    update = update or (lambda s, k, v, q: m.update(s, k, v, queries=q))
    state = init_state(case, backend)
    out = []
    for step in steps if steps is not None else make_inputs(case):
        state = update(state, step.keys, step.values, step.queries)
        mx.eval(state)
        out.append(state)
    return out


def history(steps: list[Step]) -> tuple[mx.array, mx.array]:
    """All keys and values fed so far, ``[b, h, T, d]``, indexed by absolute position."""
    return (mx.concatenate([s.keys for s in steps], axis=2),
            mx.concatenate([s.values for s in steps], axis=2))


def head_independent(spec: Spec, params: dict[str, Any]) -> bool:
    """Whether the spec says kv heads are updated independently under ``params``."""
    flag = spec.contract.get("head_independent", True)
    return bool(params[flag]) if isinstance(flag, str) else bool(flag)


def row_case(case: Case, i: int, j: int | None) -> tuple[Case, list[Step]]:
    """The sub-case of batch row ``i`` (and kv head ``j``, or every head when ``None``)."""
    steps = make_inputs(case)
    hs = slice(None) if j is None else slice(j, j + 1)
    qs = slice(None) if j is None else slice(j * case.groups, (j + 1) * case.groups)
    sub = [Step(s.keys[i:i + 1, hs], s.values[i:i + 1, hs],
                None if s.queries is None else s.queries[i:i + 1, qs]) for s in steps]
    heads = case.heads if j is None else 1
    return Case(**{**case.__dict__, "batch": 1, "heads": heads}), sub


def by_position(state, name: str) -> mx.array:
    """The per-token field ``name`` (``[b, h, n, ...]``) of a state of slots ordered by
    position, empty slots left out: the field as a sorted state would hold it (a state
    without slots: the field)."""
    from .evict import empty_slots, filled_order, take_rows
    x = getattr(state, name)
    if not hasattr(state, "positions"):
        return x
    return take_rows(x, filled_order(state.positions, empty_slots(state)))


# --- checks -------------------------------------------------------------------------

def slack_of(case: Case) -> int:
    """The rows the case's state may hold beyond its capacity (``contract.slack``: the name
    of the slack parameter, ``velox.evict``); 0 when the spec names none."""
    name = get_method(case.key).spec.contract.get("slack")
    return int(case.params[name]) if name else 0


def _kept(m: Method, state) -> int:
    return int(m.positions(state).shape[2])


def _expected_counts(m: Method, params: dict[str, Any], chunks: tuple[int, ...]) -> list[int]:
    """Stored count after each update of ``chunks`` (see :func:`check_capacity`)."""
    spec = m.spec
    cap_tail = spec.contract.get("tail")
    if cap_tail:  # velox.wrap.with_tail: the wrapped method's count over the chunks it absorbs,
        inner = m.extras["wraps"]  # plus the tail's single-token steps
        out, t, absorbed, prev = [], 0, [], 0
        for s in chunks:
            if s == 1 and t + 1 < cap_tail:
                t += 1
            else:
                absorbed.append(t + s)
                t = 0
                prev = _expected_counts(inner, params, tuple(absorbed))[-1]
            out.append(prev + t)
        return out
    cap = spec.capacity(params)
    slack = decode_slack(m, params)
    out, seen, prev = [], 0, 0
    for s in chunks:
        seen += s
        if slack:  # amortized: up to cap + slack rows, a selection keeps cap
            n = cap if prev + s > cap + slack else prev + s
        elif cap is None:
            n = seen
        elif spec.contract.get("bound_phase", "all") == "prefill" and s == 1:
            n = prev + 1
        elif spec.contract.get("bound_phase", "all") == "prefill":
            n = min(cap, prev + s)
        else:
            n = min(cap, seen)
        out.append(n)
        prev = n
    return out


def check_capacity(case: Case, states: list) -> None:
    """Stored count after each update: ``min(capacity, seen)`` (amortized eviction: up to
    capacity + slack, then capacity; prefill-bounded: decode appends; a decode tail,
    ``velox.wrap.with_tail``: the wrapped method's count plus the tail's tokens)."""
    m = get_method(case.key)
    want = _expected_counts(m, case.params, case.chunks)
    seen = 0
    for s, state, n_want in zip(case.chunks, states, want):
        seen += s
        n = _kept(m, state)
        assert n == n_want, f"kept {n} after {seen} tokens (last chunk {s}), expected {n_want}"


def check_sinks(case: Case, states: list) -> None:
    """The first ``n_sink`` positions are present once seen."""
    m = get_method(case.key)
    name = m.spec.contract.get("sinks")
    if not name:
        return
    seen = 0
    for s, state in zip(case.chunks, states):
        seen += s
        pos = np.array(m.positions(state))
        need = np.arange(min(case.params[name], seen))
        for row in pos.reshape(-1, pos.shape[-1]):
            assert np.isin(need, row).all(), f"sinks {need} missing from {row}"


def _checked_positions(m: Method, state, seen: int) -> np.ndarray:
    """The state's positions, checked: int32, strictly increasing, within ``[0, seen)``."""
    pos = np.array(m.positions(state))
    assert pos.dtype == np.int32
    if pos.shape[-1]:
        assert (np.diff(pos, axis=-1) > 0).all(), "positions not strictly increasing"
        assert pos.min() >= 0 and pos.max() < seen
    return pos


def check_positions(case: Case, states: list, steps: list[Step]) -> None:
    """Positions strictly increase, lie below ``seen``, and index the rows ``get_kv`` returns.

    Pure-eviction methods must return the input rows bit for bit; others within their
    declared error bound (checked by :func:`check_error_bound`).
    """
    m = get_method(case.key)
    for t, state in enumerate(states):
        seen = sum(case.chunks[:t + 1])
        pos = _checked_positions(m, state, seen)
        k, v = m.get_kv(state)
        assert k.shape[2] == pos.shape[-1] and v.shape[2] == pos.shape[-1]
        assert k.dtype == case.mx_dtype and v.dtype == case.mx_dtype
        if m.spec.contract.get("exact_rows", False):
            hk, hv = history(steps[:t + 1])
            idx = mx.array(pos)
            want_k = mx.take_along_axis(hk, idx[..., None], axis=2)
            want_v = mx.take_along_axis(hv, idx[..., None], axis=2)
            assert mx.array_equal(k, want_k).item(), "kept keys differ from the input rows"
            assert mx.array_equal(v, want_v).item(), "kept values differ from the input rows"


def check_slots(case: Case, states: list) -> None:
    """A state of slots (``velox.evict``) after each update: each row holds every kept token
    once, its ``empty`` empty slots at position -1 and the last ones, ``kv_slots`` gives the
    filled slots (no mask), and ``get_kv`` and ``positions`` are ``kv_slots``' rows in
    increasing position."""
    m = get_method(case.key)
    if "mlx" not in m.backends or not m.backends["mlx"].slots:
        return
    for t, state in enumerate(states):
        raw = np.array(state.positions)
        empty = getattr(state, "empty", 0)
        keys, values, mask = m.kv_slots(state)
        n = raw.shape[2] - empty
        assert keys.shape[:3] == values.shape[:3] == raw.shape[:2] + (n,), (
            f"update {t}: kv_slots gives {keys.shape[:3]}, slots {raw.shape}, {empty} empty")
        empties = (raw == -1).sum(axis=-1)
        assert (empties == empty).all() and ((raw >= 0) | (raw == -1)).all(), (
            f"update {t}: {empties.ravel().tolist()} empty slots per row, the state says {empty}")
        assert (raw[..., n:] == -1).all(), f"update {t}: an empty slot before a filled one"
        assert mask is None, f"update {t}: a mask for a state of slots"
        filled = np.sort(raw, axis=-1)[..., empty:]
        assert (np.diff(filled, axis=-1) > 0).all(), f"update {t}: a token in two slots"
        pos = np.array(m.positions(state))
        assert np.array_equal(pos, filled), f"update {t}: positions() is not the sorted slots"
        order = np.argsort(raw[..., :n], axis=-1, kind="stable")
        for got, slot_rows, name in zip(m.get_kv(state), (keys, values), ("keys", "values")):
            want = np.take_along_axis(np.array(slot_rows.astype(mx.float32)), order[..., None], axis=2)
            assert np.array_equal(np.array(got.astype(mx.float32)), want, equal_nan=True), (
                f"update {t}: get_kv's {name} are not kv_slots' in position order")


def sorted_twin(key: str, backend: str = "reference") -> Callable:
    """The update of method ``key`` (a score-and-keep method with slots) built with
    ``contract.slots = "sorted"``: the same rule on rows kept in increasing position at every
    step (:func:`velox.evict.keep_rows`), the executable statement of what slots must
    preserve."""
    import dataclasses
    m = get_method(key)
    build = m.backends["mlx"].skeleton
    spec = dataclasses.replace(m.spec, contract={**m.spec.contract, "slots": "sorted"})
    update = build(spec)[backend]
    return lambda s, k, v, q: update(s, k, v, q)


def check_next_pos(case: Case, states: list) -> None:
    seen = 0
    for s, state in zip(case.chunks, states):
        seen += s
        assert np.array(state.next_pos).tolist() == [[seen] * case.heads] * case.batch


def check_error_bound(case: Case, states: list, steps: list[Step]) -> None:
    """``|x - x_hat| <= bound`` elementwise for methods that declare an error bound."""
    m = get_method(case.key)
    if m.error_bound is None:
        return
    for t, state in enumerate(states):
        hk, hv = history(steps[:t + 1])
        idx = mx.array(np.array(m.positions(state)))
        k, v = m.get_kv(state)
        bk, bv = m.error_bound(state)
        for got, hist, bound, name in ((k, hk, bk, "keys"), (v, hv, bv, "values")):
            want = mx.take_along_axis(hist, idx[..., None], axis=2).astype(mx.float32)
            err = np.array(mx.abs(got.astype(mx.float32) - want))
            lim = np.array(bound)
            worst = float((err - lim).max()) if err.size else 0.0
            assert (err <= lim).all(), f"{name}: error exceeds bound by {worst}"


def check_bytes(case: Case, states: list) -> None:
    """Reported bytes equal the bytes of the state's arrays, counted independently (a
    rollback journal's entries share the arrays a step did not replace: each counted once)."""
    m = get_method(case.key)
    for state in states:
        arrays = [x for x in _leaves(state) if isinstance(x, mx.array)]
        if m.extras.get("rollback"):  # velox.wrap.with_rollback: each distinct array once
            assert m.nbytes(state) == sum({id(x): x.nbytes for x in arrays}.values())
        else:
            assert m.nbytes(state) == sum(x.nbytes for x in arrays) == state_nbytes(state)


def _leaves(x: Any):
    if isinstance(x, mx.array):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)


def check_signature(key: str) -> None:
    """``<key>_init`` takes every spec parameter as a keyword with the spec's default."""
    m = get_method(key)
    sig = inspect.signature(m.init)
    kinds = {p.kind for p in sig.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds and m.spec_override is not None:
        return  # a generated method: its init validates **params against its generated spec
    for name, p in m.spec.params.items():
        assert name in sig.parameters, f"{key}_init lacks parameter {name}"
        assert sig.parameters[name].default == p.default, (
            f"{key}_init default {name}={sig.parameters[name].default!r}, spec says {p.default!r}")
    extra = set(sig.parameters) - set(m.spec.params) - {"batch", "kv_heads", "head_dim", "dtype",
                                                         "backend", "heads"}
    assert not extra, f"{key}_init has parameters missing from its spec: {sorted(extra)}"
    if m.spec.heads == "mixed":
        assert "heads" in sig.parameters, f"{key}: spec says heads = 'mixed', its init takes no heads="
    else:
        assert "heads" not in sig.parameters, f"{key}_init takes heads= but its spec says {m.spec.heads!r}"


def check_heads_kind(key: str) -> None:
    """The spec says how the method's decisions treat a layer's kv heads (``heads``, one of
    ``velox.distributed.HEAD_KINDS``, with a ``heads_note`` unless ``independent``), and a
    method whose contract says its heads are not updated independently (``head_independent``
    false, or a parameter's name) does not call itself ``independent``."""
    from .distributed import HEAD_KINDS
    spec = get_method(key).spec
    assert spec.heads in HEAD_KINDS, f"{key}: heads={spec.heads!r} is not one of {HEAD_KINDS}"
    assert spec.heads == "independent" or spec.heads_note, f"{key}: heads={spec.heads!r} without heads_note"
    flag = spec.contract.get("head_independent", True)
    if flag is not True:
        assert spec.heads != "independent", (
            f"{key}: contract.head_independent={flag!r} but heads = 'independent'")


def assert_states_close(case: Case, a, b, *, atol: float, rtol: float, what: str) -> None:
    """Same positions exactly, ``get_kv`` within tolerance, same byte count."""
    m = get_method(case.key)
    pa, pb = np.array(m.positions(a)), np.array(m.positions(b))
    assert pa.shape == pb.shape and (pa == pb).all(), f"{what}: kept positions differ"
    tol = m.spec.tolerance
    for x, y, name in zip(m.get_kv(a), m.get_kv(b), ("keys", "values")):
        x = np.array(x.astype(mx.float32))
        y = np.array(y.astype(mx.float32))
        flips = float(tol.get("key_row_flips" if name == "keys" else "value_row_flips", 0.0))
        if flips and x.shape == y.shape and x.size:
            # a rotated coordinate within float32 rounding of a cell boundary codes to either
            # side (the backends' matmuls sum in another order): a few rows may differ
            bad = ~np.isclose(x, y, atol=atol, rtol=rtol).all(axis=-1)
            allowed = math.ceil(flips * bad.size)
            assert bad.sum() <= allowed, (
                f"{what}: {int(bad.sum())} of {bad.size} {name[:-1]} rows differ (allowed "
                f"{allowed}), by up to {np.abs(x - y).max()}")
            continue
        assert np.allclose(x, y, atol=atol, rtol=rtol), (
            f"{what}: {name} differ by up to {np.abs(x - y).max()}")
    assert m.nbytes(a) == m.nbytes(b), f"{what}: byte counts differ"
    assert np.array_equal(np.array(a.next_pos), np.array(b.next_pos))


def tolerance(case: Case) -> tuple[float, float]:
    """``(atol, rtol)`` of the spec for the case: ``[tolerance]``, widened by
    ``[tolerance.<dtype>]`` and, on a GPU, ``[tolerance.gpu]``."""
    tol = dict(get_method(case.key).spec.tolerance)
    for override in (case.dtype, "gpu" if mx.default_device() == mx.gpu else None):
        if isinstance(tol.get(override), dict):
            for k, v in tol[override].items():
                tol[k] = max(float(v), float(tol.get(k, 0.0)))
    return float(tol.get("atol", 0.0)), float(tol.get("rtol", 0.0))


def capacity(case: Case) -> int | None:
    return get_method(case.key).spec.capacity(case.params)


def evaluate_expr(expr: str, env: dict[str, Any]) -> Any:
    return evaluate(expr, env)


# --- non-finite input -----------------------------------------------------------------

def recent_count(case: Case) -> int:
    """The newest tokens the spec's ``contract.recent`` (an expression of the parameters)
    says every update keeps; 0 when the spec names none."""
    expr = get_method(case.key).spec.contract.get("recent")
    return int(evaluate(expr, dict(case.params))) if expr else 0


def _finite_twin(steps: list[Step]) -> list[Step]:
    """``steps`` with every non-finite or overflowing (|x| > 1e20) entry set to 0."""
    def fix(x):
        if x is None:
            return None
        y = x.astype(mx.float32)
        return mx.where(mx.isfinite(y) & (mx.abs(y) <= 1e20), y, 0.0).astype(x.dtype)
    return [Step(fix(s.keys), fix(s.values), fix(s.queries)) for s in steps]


def check_nonfinite(case: Case, backend: str = "mlx") -> None:
    """The non-finite rule on a case whose content is one of :data:`NONFINITE`.

    Every method: no exception but a ``ValueError`` saying what is not finite; after every
    update positions strictly increase below the tokens seen, ``next_pos`` counts them, the
    stored count follows :func:`check_capacity`, and the reported bytes are the arrays'
    bytes, equal to those of the same case with the spoiled entries set to 0 (unless two
    finite inputs of the same shapes already store different bytes: range-coded methods).
    Then, by what the method keeps:

    * a spec naming ``sinks`` (and ``recent``): the sinks and the ``recent`` newest tokens
      are present;
    * ``exact_rows``: kept rows are the input rows bit for bit (NaN where the input's is);
    * a declared error bound: each element of a kept finite token's row is within its bound
      wherever that bound is finite (a group holding a spoiled element may lose its bound);
    * neither (merging: CaM): the kept rows of finite tokens stay finite.
    """
    m = get_method(case.key)
    steps = make_inputs(case)
    try:
        states = run(case, backend, steps=steps)
    except ValueError as err:
        assert any(w in str(err).lower() for w in ("finite", "nan", "inf")), (
            f"a ValueError on non-finite input must say so: {err}")
        return
    check_capacity(case, states)
    check_next_pos(case, states)
    check_sinks(case, states)
    check_bytes(case, states)
    twin = run(case, backend, steps=_finite_twin(steps))
    if [m.nbytes(s) for s in states] != [m.nbytes(s) for s in twin]:
        # data-dependent storage (range coding) shows as finite inputs of the same shapes
        # storing different bytes
        counts = {tuple(m.nbytes(s) for s in twin)}
        for extra, content in enumerate(("zeros", "normal", "peaky"), 1):
            other = Case(**{**case.__dict__, "content": content, "seed": case.seed + extra})
            counts.add(tuple(m.nbytes(s) for s in run(other, backend)))
        assert len(counts) > 1, (
            "non-finite input changed the byte count: "
            f"{[m.nbytes(s) for s in states]} vs {[m.nbytes(s) for s in twin]}")
    bad = nonfinite_tokens(case)
    recent = recent_count(case)
    for t, state in enumerate(states):
        seen = sum(case.chunks[:t + 1])
        pos = _checked_positions(m, state, seen)
        need = np.arange(max(seen - recent, 0), seen)
        for row in pos.reshape(-1, pos.shape[-1]):
            assert np.isin(need, row).all(), f"recent {need} missing from {row}"
        k, v = m.get_kv(state)
        assert k.shape[2] == pos.shape[-1] and v.shape[2] == pos.shape[-1]
        assert k.dtype == case.mx_dtype and v.dtype == case.mx_dtype
        hk, hv = history(steps[:t + 1])
        idx = mx.array(pos)
        finite = ~bad[pos][..., None]  # [b, h, n, 1]: the kept token's inputs are finite
        for got, hist, name, i in ((k, hk, "keys", 0), (v, hv, "values", 1)):
            want = np.array(mx.take_along_axis(hist, idx[..., None], axis=2).astype(mx.float32))
            got = np.array(got.astype(mx.float32))
            if m.spec.contract.get("exact_rows", False):
                assert np.array_equal(got, want, equal_nan=True), f"kept {name} differ from the input rows"
            elif m.error_bound is not None:
                lim = np.array(m.error_bound(state)[i].astype(mx.float32))
                lim = np.broadcast_to(lim, got.shape)
                with np.errstate(invalid="ignore"):
                    ok = ~(finite & np.isfinite(lim)) | (np.abs(got - want) <= lim)
                assert ok.all(), f"{name}: a finite token's element exceeds its finite bound"
            else:
                assert np.isfinite(got[np.broadcast_to(finite, got.shape)]).all(), (
                    f"{name}: a finite token's kept row is not finite")

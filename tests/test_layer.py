"""velox.layer: one layer's cache as a value. Each protocol step, run on the record alone, equals
the method's attention-then-update (velox.decode.step), and the record's bookkeeping (offset,
pending step, pending row, fast-path flag, trim) is what the functions say."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox import decode, layer, wrap
from velox.registry import get_method
from velox.spec import validate_params

from tests._helpers import random_rows, same_arrays

SCALE = 32 ** -0.5
PARAMS = {"tova": dict(budget=6, n_sink=1), "h2o": dict(budget=6, n_sink=1, grace=2),
          "kivi": dict(bits=4, residual_length=4, group_size=32),
          "turboquant_mse": {}, "snapkv": dict(budget=6, obs_window=2, n_sink=1)}


def _plan(key: str, **kw) -> layer.Plan:
    m = get_method(key)
    params = PARAMS[key]
    return layer.Plan(m, "mlx", params, rows=decode.steady_rows(m, validate_params(m.spec, params)),
                      **kw)


_rows, _same = random_rows, same_arrays


def _close(a, b, tol=1e-5) -> bool:
    xa, xb = decode.arrays(a), decode.arrays(b)
    return len(xa) == len(xb) and all(
        x.shape == y.shape and bool(mx.allclose(x.astype(mx.float32), y.astype(mx.float32),
                                                atol=tol, rtol=tol)) for x, y in zip(xa, xb))


@pytest.mark.parametrize("key", sorted(PARAMS))
@settings(max_examples=6, deadline=None)
@given(chunks=st.lists(st.sampled_from([1, 1, 1, 3, 7]), min_size=1, max_size=12),
       seed=st.integers(0, 3))
def test_deferred_steps_equal_attention_then_update(key, chunks, seed):
    """take + defer + attend (each step's path as the record decides it: steady fused, fill,
    the method's own attention, or MLX's) give the outputs and states of velox.decode.step,
    with the offset the tokens taken."""
    p = _plan(key)
    rng = np.random.default_rng(seed)
    h, want = layer.Held(), p.m.init(1, 2, 32, dtype=mx.float32, **PARAMS[key])
    for n in chunks:
        k, v, q = _rows(rng, n)
        mask = None if n == 1 else "causal"
        h, step = layer.take(p, h, k, v)
        h = layer.defer(p, h, step, routed=True)
        assert h.pending is not None and h.pending.keys is k
        if h.pending.new_only:
            got_k, got_v = k, v
        else:
            sk, sv = layer.stored_rows(p.m, h.state, wrapped=True)
            got_k, got_v = mx.concatenate([sk, k], axis=2), mx.concatenate([sv, v], axis=2)
        out, h, kind, _ = layer.attend(p, h, q, got_k, got_v, scale=SCALE, mask=mask, sinks=None,
                                       plain=True)
        assert h.pending is None and kind in ("fused", "fill", "deferred")
        want_out, want = decode.step(p.m, want, q, k, v, scale=SCALE, mask=mask)
        assert bool(mx.allclose(out, want_out, atol=1e-4, rtol=1e-4)), kind
        assert _close(layer.written(h).state, want, 1e-4), kind
    assert h.offset == sum(chunks)
    assert int(layer.positions(p.m, h).shape[2]) == int(p.m.positions(want).shape[2])


def test_take_makes_the_state_once_and_absorb_is_the_update():
    p = _plan("tova")
    rng = np.random.default_rng(1)
    k, v, _ = _rows(rng, 9)
    h, step = layer.take(p, layer.Held(), k, v)
    assert h.offset == 9 and h.state is not None and step.keys is k
    made = h.state
    h, _ = layer.take(p, h, *_rows(rng, 2)[:2])
    assert h.state is made and h.offset == 11  # (the step's tokens are not in the state yet)
    h, record = layer.absorb(p, layer.Held(made, offset=9), step, None)
    assert record is None and not h.fast
    assert _same(h.state, p.m.update(made, k, v))


def test_the_steady_step_leaves_its_row_and_the_fast_flag():
    """At a full bounded state a single token takes the fused step: its row is left pending
    (written by the next read, the flag kept), the flag is set where the steps are plain, and
    a new state clears it."""
    p = _plan("tova")
    rng = np.random.default_rng(2)
    h, step = layer.take(p, layer.Held(), *_rows(rng, 12)[:2])
    h, _ = layer.absorb(p, h, step, None)
    k, v, q = _rows(rng, 1)
    h, step = layer.take(p, h, k, v)
    h = layer.defer(p, h, step, routed=True)
    assert h.pending.fused and h.pending.new_only
    _, h, kind, _ = layer.attend(p, h, q, k, v, scale=SCALE, mask=None, sinks=None, plain=True)
    assert kind == "fused" and h.row is not None and h.fast
    w = layer.written(h)
    assert w.row is None and w.fast and w.offset == h.offset
    _, h2, _, _ = layer.attend(p, layer.defer(p, *layer.take(p, h, k, v), routed=True), q, k, v,
                               scale=SCALE, mask=None, sinks=None, plain=False)
    assert h2.fast  # decided for the state it stepped from: kept
    h3, _ = layer.absorb(p, h2, layer.Pending(*_rows(rng, 3)[:2]), None)
    assert not h3.fast and h3.row is None
    _, h4, _, _ = layer.attend(p, layer.defer(p, *layer.take(p, h3, k, v), routed=True), q, k, v,
                               scale=SCALE, mask=None, sinks=None, plain=False)
    assert not h4.fast  # not plain: never the fast path


def test_positions_count_a_pending_step():
    p = _plan("tova")
    rng = np.random.default_rng(3)
    h, step = layer.take(p, layer.Held(), *_rows(rng, 4)[:2])
    h, _ = layer.absorb(p, h, step, None)
    h, step = layer.take(p, h, *_rows(rng, 2)[:2])
    h = h._replace(pending=step)
    pos = np.array(layer.positions(p.m, h))
    assert pos.shape == (1, 2, 6) and (pos[0, 0] == np.arange(6)).all()
    assert layer.positions(p.m, layer.Held()).shape == (1, 1, 0)


def test_trim_restores_a_journaled_state_or_names_the_boundaries():
    m = wrap.with_rollback(get_method("tova"), 2)
    p = layer.Plan(m, "mlx", PARAMS["tova"])
    rng = np.random.default_rng(4)
    h = layer.Held()
    states = []
    for n in (8, 1, 1):
        h, step = layer.take(p, h, *_rows(rng, n)[:2])
        states.append(h.state)
        h, _ = layer.absorb(p, h, step, None)
    assert layer.trimmable_tokens(h.state) == 2 and layer.can_trim(h.state, 1)
    assert not layer.can_trim(h.state, 3) and not layer.can_trim(h.state, -1)
    back = layer.trim(h, 2, 2)
    assert back.offset == 8 and back.pending is None and not back.fast
    assert _same(back.state.inner, states[1].inner)
    assert layer.trim(h, 0, 2) is h
    with pytest.raises(ValueError, match="can remove exactly 1, 2 tokens"):
        layer.trim(h, 3, 2)
    with pytest.raises(ValueError, match="integer >= 0"):
        layer.trim(h, True, 2)


def test_inner_and_tail_states():
    m = wrap.with_rollback(wrap.with_tail(get_method("tova"), 4), 1)
    p = layer.Plan(m, "mlx", PARAMS["tova"])
    rng = np.random.default_rng(5)
    h, step = layer.take(p, layer.Held(), *_rows(rng, 8)[:2])
    h, _ = layer.absorb(p, h, step, None)
    assert layer.tail_state(h.state) is None and layer.kind(h.state, "proxy") == "proxy"
    h, step = layer.take(p, h, *_rows(rng, 1)[:2])
    h, _ = layer.absorb(p, h, step, None)
    tail = layer.tail_state(h.state)
    assert tail is not None and tail.tail_len == 1 and layer.kind(h.state, "deferred") == "tail"
    assert layer.inner_state(h.state) is h.state.inner.inner


def test_plan_wraps_the_method_in_a_tail_then_a_journal():
    m = get_method("tova")
    full = validate_params(m.spec, PARAMS["tova"])
    p = layer.plan(m, PARAMS["tova"], full, backend="mlx")
    assert p.m is m and p.rows == decode.steady_rows(m, full) and p.backend == "mlx"
    both = layer.plan(m, PARAMS["tova"], full, tail=4, rollback=2)
    assert both.m.key == "tova@tail4@rollback2" and wrap.wrapped(wrap.wrapped(both.m)) is m
    assert both.rows == decode.steady_rows(both.m, full)


def test_fetch_hands_out_what_the_attention_reads():
    """Wrapped: the step pending, the new rows alone where the wrapper attends by itself (a
    steady token), stored + new otherwise; not wrapped: the step is the caller's to absorb."""
    p = _plan("tova")
    rng = np.random.default_rng(6)
    k, v, _ = _rows(rng, 3)
    h, step, (gk, gv) = layer.fetch(p, layer.Held(), k, v, wrapped=False, routed=True)
    assert h.pending is None and step.keys is k and gk.shape[2] == 3 and h.offset == 3
    h, _ = layer.absorb(p, h, step, None)
    k1, v1, _ = _rows(rng, 1)
    h2, step, (gk, gv) = layer.fetch(p, h, k1, v1, wrapped=True, routed=True)
    assert h2.pending is not None and not h2.pending.new_only  # room left: stored + new
    sk, _ = layer.stored_rows(p.m, h2.state, wrapped=True)
    assert gk.shape[2] == sk.shape[2] + 1 and bool(mx.array_equal(gk[:, :, -1:], k1))
    full, step = layer.take(p, layer.Held(), *_rows(rng, 12)[:2])
    full, _ = layer.absorb(p, full, step, None)
    h3, _, (gk, gv) = layer.fetch(p, full, k1, v1, wrapped=True, routed=True)
    assert h3.pending.fused and h3.pending.new_only and gk is k1 and gv is v1


def test_waits_and_missed():
    """A single token after a fused step, and a verify call, wait whole for the wrapped
    attention; nothing waits unwrapped or with a step pending. A step whose attention never
    came is handed back, unless the cache handed out its new rows alone."""
    rng = np.random.default_rng(7)
    k, v, _ = _rows(rng, 1)
    fast = layer.Held(state=(), offset=5, fast=True)
    got = layer.waits(fast, k, v, rollback=0, wrapped=True)
    assert got.offset == 6 and got.pending.fused and got.pending.new_only
    assert layer.waits(fast, k, v, rollback=0, wrapped=False) is None
    assert layer.waits(fast._replace(fast=False), k, v, rollback=0, wrapped=True) is None
    k3, v3, _ = _rows(rng, 3)
    split = layer.waits(layer.Held(state=(), offset=5), k3, v3, rollback=2, wrapped=True)
    assert split.pending.split and split.offset == 8
    assert layer.waits(layer.Held(state=(), offset=5), k3, v3, rollback=1, wrapped=True) is None
    assert layer.waits(layer.Held(offset=0), k3, v3, rollback=4, wrapped=True) is None
    m = get_method("tova")
    h, step = layer.missed(m, fast._replace(pending=layer.Pending(k, v)))
    assert h.pending is None and step.keys is k
    assert layer.missed(m, fast) == (fast, None)
    with pytest.raises(RuntimeError, match="did not call it"):
        layer.missed(m, fast._replace(pending=layer.Pending(k, v, new_only=True)))


def test_steady_offers_the_compiled_form_only_when_nothing_waits():
    p = _plan("tova")
    rng = np.random.default_rng(8)
    assert layer.steady(p, layer.Held(), plain=True, alone=True, record=False)[1] is None
    h, step = layer.take(p, layer.Held(), *_rows(rng, 12)[:2])
    h, _ = layer.absorb(p, h, step, None)
    k, v, q = _rows(rng, 1)
    h = layer.defer(p, *layer.take(p, h, k, v), routed=True)
    _, h, kind, _ = layer.attend(p, h, q, k, v, scale=SCALE, mask=None, sinks=None, plain=True)
    kept, form = layer.steady(p, h, plain=True, alone=True, record=False)
    assert kind == "fused" and form is not None and kept is h and kept.row is not None
    assert layer.steady(p, h._replace(pending=layer.Pending(k, v)), plain=True, alone=True,
                        record=False)[1] is None
    assert layer.steady(p, h._replace(fast=False), plain=True, alone=True, record=False)[1] is None
    arrays = layer.held_arrays(layer.written(h)._replace(pending=layer.Pending(k, v)))
    assert arrays[-2] is k and arrays[-1] is v

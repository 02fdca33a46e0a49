"""The shared mechanics: causal-mask rule, selection tie rule, bit packing, spec parsing."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox
from velox import evict, quant
from velox import reference as ref
from velox.attention import causal_mask
from velox.spec import evaluate


@given(st.lists(st.integers(0, 200), min_size=0, max_size=40, unique=True), st.integers(1, 12),
       st.integers(0, 30))
def test_causal_mask_matches_mlx_causal_alignment(stored, s, gap):
    """A chunk of s queries over stored + new keys: the absolute-position mask equals MLX's
    "causal" mask aligned to the last keys (what mlx-lm's make_mask answers)."""
    stored = sorted(stored)
    start = (stored[-1] + 1 if stored else 0) + gap  # evictions may leave gaps before the chunk
    keys_pos = np.array(stored + list(range(start, start + s)), np.int32)
    q_pos = np.arange(start, start + s, dtype=np.int32)
    got = causal_mask(mx.array(keys_pos)[None, None], mx.array(q_pos)[None, None])[0, 0]
    n = len(keys_pos)
    aligned = np.arange(n - s, n)[:, None] >= np.arange(n)[None, :]
    assert np.array_equal(np.array(got), aligned)


@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0, float("inf")]), min_size=2, max_size=30),
       st.data())
def test_top_budget_ties_keep_newer_in_both_backends(scores, data):
    budget = data.draw(st.integers(1, len(scores) - 1))
    x = np.array(scores, np.float32)
    got = np.array(evict.top_budget(mx.array(x)[None, None], budget))[0, 0]
    want = ref.top_budget(x.astype(np.float64), budget)
    assert np.array_equal(got, want)
    rank = np.where(np.isfinite(x), x, -np.inf)  # +inf is non-finite: it ranks lowest
    order = sorted(range(len(x)), key=lambda i: (rank[i], i))
    assert sorted(order[-budget:]) == list(got)


def test_top_budget_protects():
    scores = mx.array([[[5.0, 1.0, 0.0, 3.0]]])
    protect = mx.array([[[False, False, True, False]]])
    assert np.array(evict.top_budget(scores, 2, protect)).tolist() == [[[0, 2]]]


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
@given(st.integers(0, 2 ** 31), st.integers(1, 4))
def test_pack_roundtrip_and_mlx_layout(bits, seed, units):
    rng = np.random.default_rng(seed)
    m = 32 * units
    codes = rng.integers(0, 2 ** bits, size=(2, m), dtype=np.uint32)
    words = quant.pack(mx.array(codes), bits)
    assert words.dtype == mx.uint32 and words.shape == (2, m * bits // 32)
    assert np.array_equal(np.array(quant.unpack(words, bits)), codes)
    # The NumPy reference packs with np.packbits; both layouts must agree.
    from velox.reference import pack_codes
    assert np.array_equal(np.array(words), pack_codes(codes, bits))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_feed_mlx_dequantize(bits):
    x = mx.random.normal((4, 64), key=mx.random.key(bits))
    codes, scales, zeros = quant.quantize(x, bits, 32)
    ours = quant.dequantize(codes, scales, zeros, bits, 32, mx.float32)
    theirs = mx.dequantize(codes, scales.astype(mx.float32), zeros.astype(mx.float32), group_size=32,
                           bits=bits)
    assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@given(seed=st.integers(0, 2 ** 31), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3]),
       offset=st.sampled_from([0.0, 5.0, -200.0]))
def test_quantization_error_bound(dtype, bits, seed, scale, offset):
    rng = np.random.default_rng(seed)
    x = mx.array((rng.standard_normal((3, 64)) * scale + offset).astype(np.float32)).astype(dtype)
    codes, scales, zeros = quant.quantize(x, bits, 32)
    codes_u = np.array(quant.unpack(codes, bits))
    assert codes_u.max() <= 2 ** bits - 1
    xh = quant.dequantize(codes, scales, zeros, bits, 32, dtype)
    err = np.array(mx.abs(xh.astype(mx.float32) - x.astype(mx.float32)))
    bound = np.array(quant.error_bound(scales, zeros, bits, 32))
    assert (err <= bound).all()
    # The rounding terms stay small beside the quantization step itself.
    s = np.repeat(np.array(scales.astype(mx.float32)), 32, -1)
    z = np.repeat(np.abs(np.array(zeros.astype(mx.float32))), 32, -1)
    u = quant.unit_roundoff(scales.dtype)  # side data: float16 (bfloat16 for bfloat16)
    tiny = (2 ** bits + 1) * 2.0 ** -25 if scales.dtype == mx.float16 else 0.0
    assert (bound - 0.5 * s <= 4 * u * (z + (2 ** bits) * s) + 1e-6 * (z + 2 ** bits * s) + tiny).all()


def test_constant_group_reconstructs_exactly():
    x = mx.full((2, 32), 3.25)
    codes, scales, zeros = quant.quantize(x, 2, 32)
    assert mx.array_equal(quant.dequantize(codes, scales, zeros, 2, 32), x).item()
    assert not mx.isnan(quant.dequantize(codes, scales, zeros, 2, 32)).any().item()


def test_requantizing_dequantized_values_keeps_codes():
    x = mx.random.normal((2, 64), key=mx.random.key(3))
    c1, s1, z1 = quant.quantize(x, 4, 32)
    c2, _, _ = quant.quantize(quant.dequantize(c1, s1, z1, 4, 32), 4, 32)
    assert mx.array_equal(c1, c2).item()


def test_expression_evaluator():
    assert evaluate("budget > n_sink + grace", dict(budget=21, n_sink=4, grace=16))
    assert not evaluate("head_dim % group_size == 0", dict(head_dim=48, group_size=32))
    with pytest.raises(ValueError):
        evaluate("__import__('os')", {})


def test_pack_rejects_lengths_that_do_not_fill_words():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.pack(mx.zeros((2, 16), mx.uint32), 6)  # 96 bits, but 6-bit units hold 32 codes
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.pack(mx.zeros((2, 8), mx.uint32), 2)
    with pytest.raises(ValueError, match="bits=9"):
        quant.pack(mx.zeros((2, 32), mx.uint32), 9)


@given(n=st.integers(1, 12), losers=st.integers(0, 4), data=st.data())
def test_keep_rows_decode_step_equals_gather_of_candidates(n, losers, data):
    """One new token: keep_rows (no concatenation; a gather and an in-place slot write for
    wide rows, shifted views for narrow ones) equals gathering rows idx of stored ++ new,
    whether the new row is kept or not and with any number of losers."""
    b, h = 2, 3
    losers = min(losers, n)  # keep at least one of the n + 1 candidates
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    widths = (4, evict._SHIFT_MAX + 1)  # a narrow and a wide row: both paths
    stored = [rng.standard_normal((b, h, n, d)).astype(np.float32) for d in widths]
    new = [rng.standard_normal((b, h, 1, d)).astype(np.float32) for d in widths]
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, h, n)).copy()
    idx = np.stack([np.stack([np.sort(rng.choice(n + 1, n + 1 - losers, replace=False))
                              for _ in range(h)]) for _ in range(b)]).astype(np.int32)
    got = evict.keep_rows(tuple(mx.array(x) for x in stored) + (mx.array(pos),),
                          tuple(mx.array(x) for x in new) + (mx.full((b, h, 1), n, mx.int32),),
                          mx.array(idx))
    for g, a, x in zip(got, stored, new):
        want = np.take_along_axis(np.concatenate([a, x], axis=2), idx[..., None], axis=2)
        np.testing.assert_array_equal(np.array(g), want)
    cand_pos = np.concatenate([pos, np.full((b, h, 1), n, np.int32)], axis=2)
    np.testing.assert_array_equal(np.array(got[-1]), np.take_along_axis(cand_pos, idx, axis=2))


def test_softmax_matches_mlx_and_zeroes_masked_entries():
    from velox.attention import softmax
    rng = np.random.default_rng(3)
    x = mx.array((rng.standard_normal((4, 3, 257)) * 12).astype(np.float32))
    x = mx.where(mx.arange(257) % 7 == 3, -mx.inf, x)
    x = mx.concatenate([x, mx.full((4, 3, 1), 80.0)], axis=-1)  # one dominant logit
    want = np.array(mx.softmax(x, axis=-1, precise=True))
    for fn in (softmax, mx.compile(softmax)):
        got = np.array(fn(x))
        np.testing.assert_allclose(got, want, rtol=5e-7, atol=1e-37)
        assert ((got == 0) == (want == 0)).all()
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)
    # axis other than the last
    np.testing.assert_allclose(np.array(softmax(x[:, :, :50], axis=1)),
                               np.array(mx.softmax(x[:, :, :50], axis=1, precise=True)), rtol=5e-7)


@given(n=st.integers(0, 9), s=st.integers(1, 12), width=st.sampled_from([1, 4, 17, 40]),
       dtype=st.sampled_from(["float32", "float16", "int32"]), data=st.data())
def test_append_rows_equals_concatenation(n, s, width, dtype, data):
    """append_rows (a gather and an in-place write for wide rows and short appends, else a
    concatenation) equals NumPy's concatenation on the token axis."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a = (rng.standard_normal((2, 3, n, width)) * 100).astype(dtype)
    x = (rng.standard_normal((2, 3, s, width)) * 100).astype(dtype)
    got = evict.append_rows(mx.array(a), mx.array(x))
    np.testing.assert_array_equal(np.array(got), np.concatenate([a, x], axis=2))
    assert got.dtype == getattr(mx, dtype)


# --- the non-finite rule -----------------------------------------------------------------

_SPECIAL = [float("nan"), float("inf"), float("-inf")]


@given(st.lists(st.one_of(st.floats(-10, 10), st.sampled_from(_SPECIAL)), min_size=3, max_size=30),
       st.integers(1, 29), st.integers(0, 3))
def test_top_budget_ranks_nonfinite_lowest(scores, budget, n_sink):
    """Both backends: protected slots survive, then finite scores, then the non-finite ones
    (ties: newer wins), and the mlx fast paths (argmin, partition) agree with the reference."""
    n = len(scores)
    budget = min(budget, n - 1)
    n_sink = min(n_sink, budget - 1) if budget > 1 else 0
    x = np.array(scores, np.float32)
    protect = np.arange(n) < n_sink
    want = ref.top_budget(x.astype(np.float64), budget, protect)
    got = np.array(evict.top_budget(mx.array(x)[None, None], budget, evict.protected(n, n_sink)))[0, 0]
    assert np.array_equal(got, want)
    assert np.isin(np.arange(n_sink), got).all()
    lost = np.setdiff1d(np.arange(n), got)
    finite = np.isfinite(x)
    for i in got[~protect[got]]:  # every kept unprotected candidate outranks every loser
        for j in lost:
            if finite[i] and finite[j]:
                assert (x[i], i) > (x[j], j)
            else:
                assert finite[i] or (not finite[j] and i > j)


def test_nonfinite_key_keeps_the_sinks():
    """A NaN in one new key (tova's newest query scores NaN) evicts no sink."""
    for backend in ("mlx", "reference"):
        st_ = velox.init("tova", 1, 1, 8, budget=16, n_sink=2, backend=backend)
        rng = np.random.default_rng(0)
        x = mx.array(rng.standard_normal((1, 1, 20, 8)).astype(np.float32))
        st_ = velox.update(st_, x, x)
        k = rng.standard_normal((1, 1, 3, 8)).astype(np.float32)
        k[0, 0, 1, 3] = np.nan
        st_ = velox.update(st_, mx.array(k), mx.array(k))
        pos = np.array(velox.positions(st_))[0, 0]
        assert {0, 1} <= set(pos.tolist()), backend
        assert (np.diff(pos) > 0).all() and len(pos) == 16


@pytest.mark.parametrize("pooling", ["avgpool", "maxpool"])
def test_pooling_leaves_a_nonfinite_vote_out(pooling):
    """SnapKV's pooling: a NaN vote ranks lowest and leaves its neighbours' pooled votes as
    if it were padding, on both backends."""
    from velox.methods.snapkv import _pool_mlx, _pool_reference
    x = np.array([0.1, 0.4, np.nan, 0.3, 0.2, np.inf, 0.5], np.float32)
    got = np.array(_pool_mlx(mx.array(x)[None, None], 3, pooling))[0, 0]
    want = _pool_reference(x.astype(np.float64), 3, pooling)
    assert np.allclose(got, want, atol=1e-6) and np.isneginf(got[[2, 5]]).all()
    pad = 0.0 if pooling == "avgpool" else -np.inf
    y = np.where(np.isfinite(x), x, pad)
    assert np.isclose(got[1], (y[0] + y[1] + y[2]) / 3 if pooling == "avgpool" else max(y[:3]))


def test_squeeze_nonfinite_concentration_is_least_important():
    from velox.methods.squeeze import squeeze_budgets
    got = squeeze_budgets([float("nan"), 0.2, 0.5], 100, 1.0, floor=5)
    assert sum(got) == 300 and got[0] == min(got)
    assert got == squeeze_budgets([1.0, 0.2, 0.5], 100, 1.0, floor=5)


@pytest.mark.parametrize("merge", ["sim_weighted", "mean", "window"])
def test_cam_never_merges_a_nonfinite_loser(merge):
    """CaM: a NaN token is dropped, not merged; every kept row of a finite token stays finite."""
    for backend in ("mlx", "reference"):
        st_ = velox.init("cam", 1, 2, 8, budget=8, n_sink=2, grace=1, merge=merge,
                         merge_gate=False, backend=backend)
        rng = np.random.default_rng(1)
        bad = set()
        for t in range(24):
            k = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
            v = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
            if t % 5 == 3:
                k[0, 0, 0, 2] = np.nan
                v[0, 1, 0, 4] = np.inf
                bad.add(t)
            st_ = velox.update(st_, mx.array(k), mx.array(v))
            mx.eval(st_)
            pos = np.array(velox.positions(st_))
            keys, values = (np.array(a) for a in velox.get_kv(st_))
            finite = ~np.isin(pos, list(bad))
            assert np.isfinite(keys[finite]).all() and np.isfinite(values[finite]).all(), (backend, t)
            assert (pos[..., :2] == np.arange(min(t + 1, 2))).all()


# --- slots -------------------------------------------------------------------------------

def _slot_state(slack=3, chunks=(9, 1, 1), backend="mlx", seed=0):
    rng = np.random.default_rng(seed)
    st = velox.tova_init(1, 2, 8, budget=6, n_sink=1, slack=slack, backend=backend)
    for s in chunks:
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        st = velox.tova_update(st, k, k)
    return st


@given(st.lists(st.floats(-2, 2, width=32) | st.just(float("nan")) | st.just(float("inf")),
                min_size=3, max_size=20), st.data())
def test_slot_losers_match_the_reference_and_the_sorted_rule(scores, data):
    """The losers of candidates in any slot order: by score then position (the older of equal
    scores goes), as top_budget's on the same candidates sorted; MLX and NumPy agree."""
    n = len(scores)
    drop = data.draw(st.integers(1, n - 2))
    pos = np.array(data.draw(st.permutations(range(n))), np.int64)
    x = np.array(scores, np.float32)
    total = n
    sinks = data.draw(st.integers(0, 1))
    got = evict.slot_losers(mx.array(x)[None, None], mx.array(pos.astype(np.int32))[None, None],
                            mx.array([[[total]]]), drop, sinks, 0)
    got = np.array(got)[0, 0]
    lost = sorted(pos[np.flatnonzero(got)].tolist() if drop > 1 else [int(pos[got[0]])])
    want = sorted(pos[ref.slot_losers(x.astype(np.float64), pos, total, drop, sinks)].tolist())
    order = np.argsort(pos)  # the same candidates sorted by position: the sorted rule
    keep = ref.top_budget(x[order].astype(np.float64), n - drop, ref.protected(pos[order], total, sinks))
    assert lost == want == sorted(set(range(n)) - set(keep.tolist()))


def test_decode_writes_the_new_row_into_the_losers_slot():
    st = _slot_state(slack=0, chunks=(9,))
    k = mx.array(np.random.default_rng(1).standard_normal((1, 2, 1, 8)).astype(np.float32))
    new = velox.tova_update(st, k, k)
    before, after = np.array(st.positions), np.array(new.positions)
    for j in range(2):
        changed = np.flatnonzero(before[0, j] != after[0, j])
        if changed.size:  # one slot: the loser's, now the new token
            assert changed.size == 1 and after[0, j, changed[0]] == 9
            assert mx.array_equal(new.keys[0, j, changed[0]], k[0, j, 0]).item()
            same = np.flatnonzero(before[0, j] == after[0, j])
            assert mx.array_equal(new.keys[0, j][mx.array(same)], st.keys[0, j][mx.array(same)]).item()
        else:  # the new token lost: nothing moved
            assert mx.array_equal(new.keys[0, j], st.keys[0, j]).item()


def test_slack_fills_empty_slots_then_selects():
    st = _slot_state(slack=3, chunks=(9,))
    counts, empties = [], []
    rng = np.random.default_rng(2)
    for _ in range(9):
        k = mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32))
        st = velox.tova_update(st, k, k)
        counts.append(int(velox.positions(st).shape[2]))
        empties.append(st.empty)
        assert st.positions.shape[2] == 9  # the slots never move
    assert counts == [6, 7, 8, 9, 6, 7, 8, 9, 6] and empties == [3, 2, 1, 0, 3, 2, 1, 0, 3]
    # a selection gathers the kept rows to the first slots in increasing position; the empty
    # slots are the last ones, so kv_slots is a view of the filled first slots, no mask
    pos = np.array(st.positions)
    assert (pos[..., 6:] == -1).all() and (np.diff(pos[..., :6], axis=-1) > 0).all()
    k, v, mask = velox.get_method("tova").kv_slots(st)
    assert mask is None and k.shape[2] == v.shape[2] == 6
    gk, gv = velox.get_kv(st)
    assert mx.array_equal(k, gk).item() and mx.array_equal(v, gv).item()


@pytest.mark.parametrize("key, params", [("tova", dict(budget=6, n_sink=1)),
                                         ("knorm", dict(budget=6, n_sink=1, recent=2)),
                                         ("streaming_llm", dict(n_sink=1, window_size=5))])
def test_fill_is_the_update_into_an_empty_slot(key, params):
    """A rule that scores nothing between selections has ``fill``: a step into an empty slot
    written directly, the same state as its update (every array, ``empty``); ``None`` for
    any other step (a selection, a chunk, no empty slot)."""
    m = velox.get_method(key)
    fill = m.backends["mlx"].fill
    assert m.backends["cuda"].fill is fill and velox.get_method("h2o").backends["mlx"].fill is None
    rng = np.random.default_rng(5)
    st = m.init(1, 2, 8, slack=3, backend="mlx", **params)
    st = m.update(st, *(mx.array(rng.standard_normal((1, 2, 9, 8)).astype(np.float32)),) * 2)
    seen = 0
    for _ in range(9):
        k, v = (mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32)) for _ in range(2))
        want = m.update(st, k, v)
        got = fill(st, k, v)
        if st.empty == 0 or st.keys.shape[2] < 9:
            assert got is None
        else:
            seen += 1
            assert got.empty == want.empty == st.empty - 1
            for a, b in zip(_row_fields(got), _row_fields(want)):
                assert mx.array_equal(a, b).item()
        assert fill(st, *(mx.concatenate([k, k], 2),) * 2) is None  # a chunk
        st = want
    assert seen >= 4


@pytest.mark.parametrize("key, params", [("snapkv", dict(obs_window=4)), ("pyramidkv", dict(obs_window=4)),
                                         ("nestedkv", dict(window=4))])
def test_prefill_bounded_decode_fills_grown_slots(key, params):
    """A prefill-bounded method's decode step adds ``grow_by(n)`` empty slots when none is
    left (one copy of the rows) and the next steps fill them in place (``fill``, the same
    state as ``update``); what is kept is the append-only rule's (every decode token, in
    order); a chunk step drops the empty slots first and keeps what it keeps from the
    compacted state."""
    from velox import evict
    m = velox.get_method(key)
    rng = np.random.default_rng(11)

    def rows(s):
        return mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))

    st = m.init(1, 2, 8, budget=10, backend="mlx", **params)
    st = m.update(st, rows(15), rows(15), queries=rows(15))
    assert st.keys.shape[2] == 10 and st.empty == 0
    k0, v0 = velox.get_kv(st)
    p0 = np.array(m.positions(st))
    added_k, added_v, growths, steps = [], [], [], 40
    for _ in range(steps):
        k, v = rows(1), rows(1)
        got = m.backends["mlx"].fill(st, k, v)
        new = m.update(st, k, v)
        n = st.keys.shape[2]
        if st.empty == 0:  # none empty: grown, the token in the first new slot
            growths.append(n)
            assert got is None and new.keys.shape[2] == n + evict.grow_by(n)
            assert new.empty == evict.grow_by(n) - 1
        else:
            assert new.keys.shape[2] == n and new.empty == st.empty - 1
            for a, b in zip(_row_fields(got), _row_fields(new)):
                assert mx.array_equal(a, b).item()
        pos = np.array(new.positions)
        assert (pos[..., new.keys.shape[2] - new.empty:] == -1).all()
        assert m.nbytes(new) == sum(a.nbytes for a in (new.keys, new.values, new.positions, new.next_pos))
        added_k.append(k)
        added_v.append(v)
        st = new
    assert growths == [10, 26, 42], growths  # 16 slots each time (a sixteenth is below GROW_MIN)
    gk, gv = velox.get_kv(st)
    assert mx.array_equal(gk, mx.concatenate([k0, *added_k], axis=2)).item()
    assert mx.array_equal(gv, mx.concatenate([v0, *added_v], axis=2)).item()
    assert np.array_equal(np.array(m.positions(st)),
                          np.concatenate([p0, np.broadcast_to(np.arange(15, 15 + steps), (1, 2, steps))], 2))
    assert evict.grow_by(4096) == 256 and evict.grow_by(100) == evict.GROW_MIN
    chunk = rows(6), rows(6), rows(6)
    after = m.update(st, *chunk[:2], queries=chunk[2])
    want = m.update(evict.compacted(st), *chunk[:2], queries=chunk[2])
    assert after.empty == 0 and after.keys.shape[2] == 10
    for a, b in zip(_row_fields(after), _row_fields(want)):
        assert mx.array_equal(a, b).item()


def _row_fields(state):
    return [getattr(state, f) for f in ("keys", "values", "positions", "next_pos")]


def test_decode_step_is_in_place():
    """The adapter's decode update (``velox.decode.split_update``: the slot write built at the start of the
    next step, before anything reads the rows) writes one row: its time does not grow with
    the cache like a copy would (16x the rows, well under 16x the time); the update in one
    graph with its reads copies."""
    import time

    from velox import decode as A
    m = velox.get_method("streaming_llm")

    def step_time(window, split=True):
        rng = np.random.default_rng(0)
        st = velox.streaming_llm_init(1, 8, 128, window_size=window, n_sink=4)
        k = mx.array(rng.standard_normal((1, 8, window + 8, 128)).astype(np.float32))
        st = velox.streaming_llm_update(st, k, k)
        one = mx.array(rng.standard_normal((1, 8, 1, 128)).astype(np.float32))
        mx.eval(st, one)
        row, times = None, []
        for _ in range(30):
            t0 = time.perf_counter()
            if row is not None:
                st = A.write_row(st, row)
            st, row = A.split_update(m, st, one, one, None)
            mx.eval(st, row)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    small, large = step_time(1024), step_time(16384)
    assert large < 6 * small, (small, large)


def test_attention_over_slots_masks_empty_slots():
    """The adapter's attention over ``kv_slots`` (storage order: with amortized eviction's
    empty slots, a view of the filled first slots) and over every slot with the empty ones
    masked (``_with_empty_slots``, as for ragged rows) equal attention over ``get_kv`` (the
    filled slots in position order), decode and chunk alike, and its fused decode step too."""
    from velox import decode
    m = velox.get_method("tova")
    st = _slot_state(slack=3, chunks=(9, 1, 1))
    k, v, filled = m.kv_slots(st)
    assert filled is None and st.empty == 2 and k.shape[2] == st.keys.shape[2] - 2
    gk, gv = m.get_kv(st)
    rng = np.random.default_rng(3)
    for s, mask in ((1, None), (4, "causal")):
        q = mx.array(rng.standard_normal((1, 4, s, 8)).astype(np.float32))
        nk, nv = (mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32)) for _ in range(2))
        want = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([gk, nk], 2), mx.concatenate([gv, nv], 2), scale=0.3, mask=mask)
        for keys, values, where in ((k, v, None), (st.keys, st.values, st.positions >= 0)):
            got = mx.fast.scaled_dot_product_attention(
                q, mx.concatenate([keys, nk], 2), mx.concatenate([values, nv], 2), scale=0.3,
                mask=decode.with_empty_slots(mask, where, q, keys.shape[2] + s))
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
        if s == 1:
            out, new, row = decode.split_step(m, st, q, nk, nv, 0.3)
            new = decode.write_row(new, row) if row is not None else new
            np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
            assert np.array_equal(np.array(velox.positions(new)),
                                  np.array(velox.positions(m.update(st, nk, nv, queries=q))))


def test_adapter_fills_a_prefill_bounded_methods_grown_slots(tiny_llama):
    """SnapKV through the adapter: a decode step that finds no empty slot grows the state
    (``deferred``), the next ones until the slots are full are fill steps (the row written
    in place, attention over the filled slots); logits and state as the plain path's
    (``compile=False``)."""
    from velox import evict
    from velox.adapters.mlxlm import make_cache
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, 97, 40)]

    def run(**kw):
        caches = make_cache(tiny_llama, "snapkv", budget=16, obs_window=4, **kw)
        tiny_llama(mx.array([prompt]), cache=caches)
        outs, kinds, x = [], [], prompt[-1]
        for _ in range(40):
            logits = tiny_llama(mx.array([[x]]), cache=caches)[0, -1]
            x = int(mx.argmax(logits).item())
            outs.append(np.array(logits))
            kinds.append(caches[0].last_step)
        return outs, kinds, caches

    fast, kinds, a = run()
    want, n = [], 16
    while len(want) < 40:  # a growth, then fills until the slots are full
        want += ["deferred"] + ["fill"] * (evict.grow_by(n) - 1)
        n += evict.grow_by(n)
    assert kinds == want[:40], kinds
    plain, plain_kinds, b = run(compile=False)
    assert set(plain_kinds) == {"deferred"}
    for x, y in zip(fast, plain):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    for c, d in zip(a, b):
        assert c.velox_state.empty == d.velox_state.empty
        assert np.array_equal(np.array(c.positions()), np.array(d.positions()))
        for x, y in zip(velox.get_kv(c.velox_state), velox.get_kv(d.velox_state)):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slack", [0, 5])
def test_adapter_decodes_over_slots(tiny_llama, slack):
    """Deferred mode over slots: the fused compiled decode step (the slot write left for the
    next step, empty slots masked) produces the logits of the plain step, and its state holds
    the plain step's tokens (their rows within rounding); proxy mode runs with empty slots too."""
    from velox.adapters.mlxlm import make_cache
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 97, 40)]

    def run(**kw):
        caches = make_cache(tiny_llama, "tova", budget=16, n_sink=2, slack=slack, **kw)
        tiny_llama(mx.array([prompt]), cache=caches)
        outs, x = [], prompt[-1]
        kinds.clear()
        for _ in range(14):
            logits = tiny_llama(mx.array([[x]]), cache=caches)[0, -1]
            x = int(mx.argmax(logits).item())
            outs.append(np.array(logits))
            kinds.append(caches[0].last_step)
        return outs, caches

    kinds: list = []
    fused, a = run(real_queries=True)
    # with slack the steady steps into empty slots take the unscored fill (slice updates and
    # attention over the filled slots), a selection the fused step: 5 growing steps, then a
    # selection every slack + 1 steps; a selection step after a step that kept the state
    # steady (no empty slot) runs in the whole model's compiled step, as every step after
    # the first without slack
    want = (["deferred"] * 5 + ["fused"] + ["fill"] * 5 + ["compiled"] + ["fill"] * 5 if slack
            else ["fused"] + ["compiled"] * 13)
    assert kinds == want[:14], kinds
    plain, b = run(real_queries=True, compile=False)
    assert b[0].last_step == "deferred"
    for x, y in zip(fused, plain):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    for c, d in zip(a, b):
        assert np.array_equal(np.array(c.positions()), np.array(d.positions()))
        k1, v1 = velox.get_kv(c.velox_state)
        k2, v2 = velox.get_kv(d.velox_state)
        # the fused step's attention output comes from TOVA's score weights (another rounding
        # than scaled_dot_product_attention), so the next layers' keys agree to rounding
        np.testing.assert_allclose(np.array(k1), np.array(k2), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(v1), np.array(v2), rtol=1e-5, atol=1e-5)
    proxy, _ = run(real_queries=False)
    assert all(np.isfinite(x).all() for x in proxy)


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_a_lowered_budget_shrinks_a_state_of_slots_at_its_next_decode_step(backend):
    """SqueezeAttention lowers a layer's budget between forwards: the next decode step keeps
    the new budget in one gather, as the same rule on sorted rows does."""
    from velox.testing import sorted_twin
    twin = sorted_twin("h2o", backend)
    rng = np.random.default_rng(0)
    a = b = velox.h2o_init(1, 2, 8, budget=10, n_sink=1, grace=2, backend=backend)
    for t, s in enumerate((12, 1, 1, 1, 1, 1)):
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        if t == 4:
            a, b = a._replace(budget=6), b._replace(budget=6)
        a, b = velox.h2o_update(a, k, k), twin(b, k, k, None)
        assert np.array_equal(np.array(velox.positions(a)), np.array(b.positions))
    assert velox.positions(a).shape[2] == 6 and a.positions.shape[2] == 6


def test_top_level_kv_slots_dispatches_and_sorts_to_get_kv():
    """``velox.kv_slots`` is the state's method's accessor: storage order, which sorted by
    position is ``get_kv`` (a TOVA state after decode steps holds its rows out of order)."""
    import velox
    s = velox.init("tova", 1, 2, 8, budget=4, n_sink=1)
    k = mx.random.normal((1, 2, 6, 8), key=mx.random.key(0))
    s = velox.update(s, k, k)
    for i in range(3):
        x = mx.random.normal((1, 2, 1, 8), key=mx.random.key(1 + i))
        s = velox.update(s, x, x)
    keys, values, mask = velox.kv_slots(s)
    assert mask is None
    assert not (np.diff(np.array(s.positions), axis=-1) > 0).all()  # out of order: a real check
    order = np.argsort(np.array(s.positions), axis=-1)
    sorted_keys = np.take_along_axis(np.array(keys), order[..., None], axis=2)
    np.testing.assert_array_equal(sorted_keys, np.array(velox.get_kv(s)[0]))


def test_streaming_llm_slack_by_hand():
    """n_sink 2, window 4, slack 3: 9 slots. The 10th token (position 9) is the first with 10
    candidates: the sinks 0, 1 and the newest four (6-9) stay, in the first slots, and the last
    three slots are empty; three tokens fill them, the next selects again."""
    st = velox.streaming_llm_init(1, 1, 4, n_sink=2, window_size=4, slack=3)
    rows = []
    for t in range(14):
        k = mx.full((1, 1, 1, 4), float(t))
        st = velox.streaming_llm_update(st, k, k)
        rows.append((np.array(st.positions)[0, 0].tolist(), st.empty))
    assert rows[8] == (list(range(9)), 0)
    assert rows[9] == ([0, 1, 6, 7, 8, 9, -1, -1, -1], 3)
    assert rows[12] == ([0, 1, 6, 7, 8, 9, 10, 11, 12], 0)
    assert rows[13] == ([0, 1, 10, 11, 12, 13, -1, -1, -1], 3)
    assert np.array(st.keys)[0, 0, :6, 0].tolist() == [0, 1, 10, 11, 12, 13]  # rows follow

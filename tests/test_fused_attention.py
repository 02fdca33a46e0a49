"""The adapter's fused decode step on the CPU: for methods scored by the step's attention
weights (TOVA, the heavy-hitter family) the output comes from those weights
(``_weights_attention``), and must equal attention over stored + new; the state must equal
the plain update's."""

import mlx.core as mx
import numpy as np
import pytest

import velox  # noqa: F401
from velox import decode
from velox.registry import get_method


def _state(key, b=1, h=3, hq=9, d=64, budget=24, **params):
    m = get_method(key)
    st = m.init(b, h, d, backend="mlx", budget=budget, **params)
    k, q = mx.random.normal((b, h, budget + 9, d)), mx.random.normal((b, hq, budget + 9, d))
    return m, m.update(st, k, k * 0.5, queries=q)


@pytest.mark.parametrize("key", ["tova", "h2o", "tova_per_head"])
def test_fused_step_output_is_attention_over_stored_and_new(key):
    mx.random.seed(3)
    m, st = _state("tova", per_head=True) if key == "tova_per_head" else _state(key)
    fused = decode.compiled(m, "fused", "mlx")
    for step in range(6):
        q, k, v = (mx.random.normal(s) for s in ((1, 9, 1, 64), (1, 3, 1, 64), (1, 3, 1, 64)))
        sk, sv, filled = m.kv_slots(st)
        assert filled is None
        assert decode.weights_attention(m, q, sk, sv, filled, k, v, 64 ** -0.5) is not None
        want = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([m.kv_slots(st)[0], k], axis=2),
            mx.concatenate([m.kv_slots(st)[1], v], axis=2), scale=64 ** -0.5)
        out, new, row = fused(st, q, k, v, 64 ** -0.5)
        if row is not None:
            new = decode.write_row(new, row)
        plain = m.update(st, k, v, queries=q)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.array(m.positions(new)), np.array(m.positions(plain)))
        np.testing.assert_array_equal(np.array(m.get_kv(new)[0]), np.array(m.get_kv(plain)[0]))
        st = plain


def test_weights_attention_applies_only_where_the_weights_are_the_score():
    mx.random.seed(4)
    q, k, v = (mx.random.normal(s) for s in ((1, 9, 1, 64), (1, 3, 1, 64), (1, 3, 1, 64)))
    m = get_method("streaming_llm")
    st = m.init(1, 3, 64, backend="mlx", n_sink=4, window_size=20)
    st = m.update(st, mx.random.normal((1, 3, 30, 64)), mx.random.normal((1, 3, 30, 64)))
    sk, sv, filled = m.kv_slots(st)
    assert decode.weights_attention(m, q, sk, sv, filled, k, v, 64 ** -0.5) is None  # no score
    m, st = _state("tova")
    sk, sv, filled = m.kv_slots(st)
    assert decode.weights_attention(m, q, sk, sv, filled, k, v, 0.1) is None  # another scale
    m, st = _state("tova", slack=4)
    for _ in range(8):  # decode until a selection frees slots: empty ones then
        st = m.update(st, k, v, queries=q)
        if st.empty:
            break
    # the empty slots are the last ones: kv_slots is a view of the filled slots (no mask),
    # and the weights' attention over it is attention over the kept rows
    sk, sv, filled = m.kv_slots(st)
    assert st.empty and filled is None and sk.shape[2] == st.keys.shape[2] - st.empty
    got = decode.weights_attention(m, q, sk, sv, filled, k, v, 64 ** -0.5)
    gk, gv = m.get_kv(st)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([gk, k], 2), mx.concatenate([gv, v], 2),
                                                scale=64 ** -0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_candidate_mass_in_blocks_is_the_mass_of_one_block(monkeypatch):
    """H2O's prefill mass in blocks of queries (each block after the sum so far) equals the
    mass of all the queries at once; the default block is set per sequence, so a batch of
    sequences goes as many queries a block as one sequence does."""
    from velox import attention
    mx.random.seed(5)
    q, stored, new = (mx.random.normal(s) for s in ((2, 2, 3, 20, 16), (2, 2, 11, 16), (2, 2, 20, 16)))
    whole = attention.candidate_mass(q, stored, new, block=20)
    np.testing.assert_allclose(np.array(attention.candidate_mass(q, stored, new, block=3)),
                               np.array(whole), rtol=2e-6, atol=1e-6)
    seen = []
    real = attention.candidate_weights
    monkeypatch.setattr(attention, "candidate_weights",
                        lambda qq, *a: seen.append(qq.shape[3]) or real(qq, *a))
    monkeypatch.setattr(attention, "MASS_TILE", 2 * 3 * 31 * 4)  # 4 queries a block a sequence
    for b in (1, 2):
        seen.clear()
        attention.candidate_mass(q[:b], stored[:b], new[:b])
        assert seen == [4] * 5

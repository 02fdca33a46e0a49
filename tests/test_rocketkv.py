"""RocketKV: a hand-computed case on every backend (SnapKV stage, pages, selection, attention,
bytes), the paper's split, pages kept incrementally, the page bound, and attention over the
selected pages."""

import math

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods import rocketkv

from tests._helpers import BACKENDS, pos, rows, softmax


@pytest.mark.parametrize("backend", BACKENDS)
def test_rocketkv_by_hand(backend):
    # Stage 1 as SnapKV: prefill keys (d = 1) 0, 1, 0, 3, 2; the window t4 (key 2) votes:
    # logits 0, 2, 0, 6, 4. Sink t0 and window t4 stay, one slot left -> t3.
    # c = 64: split 64**.56 = 10.3 and c2 = 64**.44 = 6.2.
    st = velox.rocketkv_init(1, 1, 1, budget=3, compression_ratio=64.0, page_size=2,
                             obs_window=1, n_sink=1, kernel_size=1, backend=backend)
    k = rows([0.0], [1.0], [0.0], [3.0], [2.0])
    st = velox.rocketkv_update(st, k, k)
    assert pos(st) == [0, 3, 4]
    # Pages of 2 stored slots: [0, 3] -> max 3, min 0; [2] -> max 2, min 2.
    assert np.array(st.page_max).ravel().tolist() == [3.0, 2.0]
    assert np.array(st.page_min).ravel().tolist() == [0.0, 2.0]
    # Decode key 5 joins the last page ([2, 5]: max 5, min 2); key -1 opens a third page.
    st = velox.rocketkv_update(st, rows([5.0]), rows([5.0]))
    assert np.array(st.page_max).ravel().tolist() == [3.0, 5.0]
    assert np.array(st.page_min).ravel().tolist() == [0.0, 2.0]
    assert pos(st) == [0, 3, 4, 5]
    # Stage 2 over 4 stored tokens: ceil(4 / 6.2) = 1 token -> 1 page of 2. Query +1: bounds
    # use K_max, 3 and 5 -> page 1. Query -1: K_min, -0 and -2 -> page 0.
    assert np.array(rocketkv.rocketkv_select(st, rows([1.0]))).ravel().tolist() == [1]
    assert np.array(rocketkv.rocketkv_select(st, rows([-1.0]))).ravel().tolist() == [0]
    # Attention of q = 1 (scale 1) reads page 1 (keys = values 2, 5) and the new token (0):
    # softmax(2, 5, 0) . (2, 5, 0).
    out = rocketkv.rocketkv_attend(st, rows([1.0]), rows([0.0]), rows([0.0]), scale=1.0)
    assert np.allclose(np.array(out).ravel(), softmax([2, 5, 0]) @ [2, 5, 0], atol=1e-6)
    assert rocketkv.rocketkv_read_size(st, rows([1.0])) == rocketkv.ReadSize(1, 2, 3, 4)
    st = velox.rocketkv_update(st, rows([-1.0]), rows([-1.0]))
    assert np.array(st.page_max).ravel().tolist() == [3.0, 5.0, -1.0]
    # Bytes: 5 rows x (k, v) x 4 B + positions 20 + next_pos 4 + 3 pages x (max, min) x 4 B.
    assert velox.rocketkv_bytes(st) == 40 + 20 + 4 + 24


def test_rocketkv_split_reproduces_the_paper():
    c1, c2 = rocketkv.split_ratio(64.0)
    assert round(c1, 1) == 10.3 and round(c2, 1) == 6.2 and math.isclose(c1 * c2, 64.0)
    assert rocketkv.split_ratio(4096.0)[0] == 4096.0 ** 0.8  # r = 0.2 + 0.72, clipped at 0.8
    st = velox.rocketkv_init(1, 1, 64, compression_ratio=64.0)
    assert (st.page_size, st.head_topk1) == (3, 31)  # ceil(sqrt(6.2)), round(64 * 3 / 6.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rocketkv_pages_incremental_equal_rebuilt(backend):
    rng = np.random.default_rng(7)
    k = mx.array(rng.standard_normal((2, 2, 23, 8)).astype(np.float32))
    st = velox.rocketkv_init(2, 2, 8, budget=64, obs_window=4, n_sink=1, page_size=3,
                             kernel_size=3, backend=backend)
    st = velox.rocketkv_update(st, k[:, :, :5], k[:, :, :5])
    for t in range(5, 23):  # decode steps update the last page or open one
        st = velox.rocketkv_update(st, k[:, :, t:t + 1], k[:, :, t:t + 1])
    hi, lo = rocketkv._pages_mlx(st.keys, 3)
    assert np.array_equal(np.array(st.page_max), np.array(hi))
    assert np.array_equal(np.array(st.page_min), np.array(lo))


def test_rocketkv_page_bound_holds_with_every_channel():
    # With all channels kept, q.K_max on q > 0 and q.K_min on q < 0 bounds q.k in the page.
    rng = np.random.default_rng(8)
    k = mx.array(rng.standard_normal((1, 1, 20, 8)).astype(np.float32))
    st = velox.rocketkv_init(1, 1, 8, budget=64, obs_window=2, n_sink=0, page_size=4,
                             head_topk1=8, kernel_size=1)
    st = velox.rocketkv_update(st, k, k)
    q = rng.standard_normal(8)
    bound = np.where(q > 0, np.array(st.page_max)[0, 0], np.array(st.page_min)[0, 0]) @ q
    dots = (np.array(k)[0, 0] @ q).reshape(5, 4)
    assert (bound[:, None] >= dots - 1e-5).all()


@pytest.mark.parametrize("groups", [1, 3])
def test_rocketkv_attend_reads_the_selected_pages(groups):
    rng = np.random.default_rng(9)
    h, d, P = 2, 8, 3
    k = mx.array(rng.standard_normal((2, h, 40, d)).astype(np.float32))
    v = mx.array(rng.standard_normal((2, h, 40, d)).astype(np.float32))
    st = velox.rocketkv_init(2, h, d, budget=22, compression_ratio=20.0, page_size=P,
                             head_topk1=5, obs_window=4, n_sink=1, kernel_size=3)
    st = velox.rocketkv_update(st, k[:, :, :39], v[:, :, :39])
    q = mx.array(rng.standard_normal((2, h * groups, 1, d)).astype(np.float32))
    new_k, new_v = k[:, :, 39:], v[:, :, 39:]
    pages = np.array(rocketkv.rocketkv_select(st, q))
    size = rocketkv.rocketkv_read_size(st, q)
    assert pages.shape == (2, h, size.pages) and size.pages < size.total_pages == 8
    got = np.array(rocketkv.rocketkv_attend(st, q, new_k, new_v, scale=d ** -0.5))
    keys, vals = np.array(st.keys), np.array(st.values)
    for i in range(2):
        for j in range(h):  # dense attention over the selected pages' tokens + the new token
            slots = [t for p in pages[i, j] for t in range(p * P, min(p * P + P, 22))]
            kk = np.concatenate([keys[i, j, slots], np.array(new_k)[i, j]])
            vv = np.concatenate([vals[i, j, slots], np.array(new_v)[i, j]])
            for g in range(groups):
                qq = np.array(q)[i, j * groups + g, 0]
                want = softmax(kk @ qq * d ** -0.5) @ vv
                assert np.allclose(got[i, j * groups + g, 0], want, atol=1e-5)
    assert size.tokens <= size.pages * P + 1 and size.stored == 22
    # Selection from the bounds: the chosen pages have the top group-summed softmax scores.
    scores = np.array(rocketkv._page_scores(st, mx.array(np.array(q)[:, :, 0].reshape(2, h, groups, d))))
    for i in range(2):
        for j in range(h):
            assert set(pages[i, j]) == set(np.argsort(-scores[i, j], kind="stable")[:size.pages])


def test_rocketkv_attend_is_dense_when_every_page_is_read():
    rng = np.random.default_rng(10)
    k = mx.array(rng.standard_normal((1, 2, 30, 8)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 4, 30, 8)).astype(np.float32))
    st = velox.rocketkv_init(1, 2, 8, budget=16, compression_ratio=1.01, obs_window=4,
                             n_sink=1, kernel_size=3)
    st = velox.rocketkv_update(st, k[:, :, :29], k[:, :, :29], queries=q[:, :, :29])
    assert rocketkv.rocketkv_select(st, q[:, :, 29:]) is None  # c2 ~ 1: every page
    for s, mask in ((1, None), (3, "causal")):
        kk = k[:, :, 30 - s:]
        got = rocketkv.rocketkv_attend(st, q[:, :, 30 - s:], kk, kk, scale=0.3, mask=mask)
        allk = mx.concatenate([st.keys, kk], axis=2)
        want = mx.fast.scaled_dot_product_attention(q[:, :, 30 - s:], allk, allk, scale=0.3, mask=mask)
        assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    # A chunk reads everything: 8 pages of 2 (ceil(sqrt(c2 ~ 1.008))), 16 stored + 3 new.
    assert rocketkv.rocketkv_read_size(st, s=3) == rocketkv.ReadSize(8, 8, 19, 16)

"""Product quantization primitives (velox.codecs.pq): packing, assignment, k-means, scores."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox import quant
from velox.codecs import pq


def rows(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- packing --------------------------------------------------------------------------------

@given(bits=st.integers(1, pq.MAX_BITS), count=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_round_trips_at_any_width(bits, count, seed):
    idx = np.random.default_rng(seed).integers(0, 1 << bits, size=(2, 3, count), dtype=np.uint64)
    idx = idx.astype(np.uint32)
    packed = pq.pack(mx.array(idx), bits)
    assert packed.dtype == mx.uint32 and packed.shape[-1] == -(-count * bits // 32)
    assert np.array_equal(np.array(packed), pq.pack_np(idx, bits))  # the twins agree bit for bit
    assert np.array_equal(np.array(pq.unpack(packed, bits, count)), idx)
    assert np.array_equal(pq.unpack_np(np.array(packed), bits, count), idx)


def test_pack_by_hand_and_quant_layout():
    # 12-bit indices 0xABC, 0x123, 0xFFF: bits 0-11, 12-23, 24-35 of one stream
    # word 0 = 0xABC | 0x123 << 12 | (0xFFF & 0xFF) << 24 = 0xFF123ABC; word 1 = 0xFFF >> 8 = 0xF
    p = pq.pack(mx.array([[0xABC, 0x123, 0xFFF]], dtype=mx.uint32), 12)
    assert np.array(p).tolist() == [[0xFF123ABC, 0xF]]
    # 16 indices of 12 bits take 6 words (192 bits), not 8 (16-bit slots)
    assert pq.pack(mx.zeros((1, 16), mx.uint32), 12).shape == (1, 6)
    # where velox.quant.pack packs, the layout is its own
    c = np.random.default_rng(0).integers(0, 8, size=(2, 32)).astype(np.uint32)
    assert np.array_equal(np.array(pq.pack(mx.array(c), 3)), np.array(quant.pack(mx.array(c), 3)))


def test_bad_width_is_refused():
    with pytest.raises(ValueError, match="bits"):
        pq.pack(mx.zeros((1, 4), mx.uint32), 25)


# --- assignment -----------------------------------------------------------------------------

CODEBOOKS = ["shared", "per_head", "per_head_and_subspace"]


def _codebook(kind, seed, h, j, k, s):
    shape = {"shared": (k, s), "per_head": (h, k, s), "per_head_and_subspace": (h, j, k, s)}[kind]
    return rows(seed, shape)


def _brute_force(sub, cb, metric=None):
    """Nearest centroid of every sub-vector in float64, one at a time, and the distances."""
    b, h, n, j, s = sub.shape
    cb4 = pq._canonical(cb, j).astype(np.float64)
    m = np.eye(s) if metric is None else metric.astype(np.float64)
    dist = np.zeros((b, h, n, j, cb4.shape[2]))
    for a in range(b):
        for i in range(h):
            for t in range(n):
                for u in range(j):
                    c = cb4[i if cb4.shape[0] > 1 else 0, u if cb4.shape[1] > 1 else 0]
                    e = sub[a, i, t, u].astype(np.float64) - c
                    dist[a, i, t, u] = np.einsum("ks,st,kt->k", e, m, e)
    return dist


@given(kind=st.sampled_from(CODEBOOKS), s=st.sampled_from([1, 2, 4, 8]),
       k=st.integers(1, 40), n=st.integers(1, 6), seed=st.integers(0, 2**16),
       with_metric=st.booleans())
def test_assignment_is_the_nearest_centroid(kind, s, k, n, seed, with_metric):
    b, h, d = 2, 3, 16
    x = rows(seed, (b, h, n, d))
    sub = pq.split(x, s)
    cb = _codebook(kind, seed + 1, h, d // s, k, s)
    metric = None
    if with_metric:  # a PSD metric (x - c)^T M (x - c)
        a = rows(seed + 2, (s, s))
        metric = (a @ a.T + 0.1 * np.eye(s)).astype(np.float32)
    got = np.array(pq.assign(mx.array(sub), mx.array(cb), None if metric is None else mx.array(metric)))
    ref = pq.assign_np(sub, cb, metric)
    assert got.dtype == np.uint32 and got.shape == (b, h, n, d // s)
    assert (got < k).all() and (ref < k).all()  # indices in range
    dist = _brute_force(sub, cb, metric)
    best = dist.min(axis=-1)
    for idx in (got, ref):  # the chosen centroid is a nearest one (to float32 rounding)
        chosen = np.take_along_axis(dist, idx[..., None].astype(np.int64), axis=-1)[..., 0]
        assert np.all(chosen <= best + 1e-4 * (1 + best))


def test_assignment_in_blocks_equals_one_block(monkeypatch):
    x, cb = rows(0, (1, 2, 50, 16)), rows(1, (2, 64, 4))
    whole = np.array(pq.assign(mx.array(pq.split(x, 4)), mx.array(cb)))
    monkeypatch.setattr(pq, "BLOCK_ELEMENTS", 2 * 64 * 7)  # blocks of 7 rows
    assert np.array_equal(np.array(pq.assign(mx.array(pq.split(x, 4)), mx.array(cb))), whole)
    assert np.array_equal(pq.assign_np(pq.split(x, 4), cb), whole)


@given(kind=st.sampled_from(CODEBOOKS), seed=st.integers(0, 2**16))
def test_a_codebook_holding_every_subvector_reconstructs_exactly(kind, seed):
    b, h, n, d, s = 1, 2, 3, 8, 4
    x = rows(seed, (b, h, n, d))
    sub = pq.split(x, s)  # [1, 2, 3, 2, 4]
    if kind == "shared":
        cb = sub.reshape(-1, s)
    elif kind == "per_head":
        cb = sub[0].reshape(h, -1, s)
    else:
        cb = sub[0].transpose(0, 2, 1, 3)  # [h, J, n, s]
    idx = pq.assign(mx.array(sub), mx.array(cb))
    assert np.array_equal(np.array(pq.decode(mx.array(cb), idx)), x)
    assert np.array_equal(pq.decode_np(cb, np.array(idx)), x)


# --- scores ---------------------------------------------------------------------------------

@given(kind=st.sampled_from(CODEBOOKS), s=st.sampled_from([2, 4, 8]), m=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_table_scores_equal_the_query_times_the_decoded_rows(kind, s, m, seed):
    b, h, n, d, k = 2, 3, 9, 16, 32
    cb = _codebook(kind, seed, h, d // s, k, s)
    idx = np.random.default_rng(seed).integers(0, k, size=(b, h, n, d // s)).astype(np.uint32)
    q = rows(seed + 1, (b, h, m, d))
    want = q.astype(np.float64) @ np.swapaxes(pq.decode_np(cb, idx), -1, -2).astype(np.float64)
    got = np.array(pq.scores(mx.array(q), mx.array(cb), mx.array(idx)))
    got_np = pq.scores_np(q, cb, idx)
    assert got.shape == got_np.shape == (b, h, m, n)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got_np, want, atol=1e-4, rtol=1e-4)
    table = np.array(pq.lookup_table(mx.array(q), mx.array(cb)))
    assert table.shape == (b, h, m, d // s, k)
    np.testing.assert_allclose(table, pq.lookup_table_np(q, cb), atol=1e-5)


def test_table_scores_by_hand():
    # d = 4, two sub-vectors of 2; codebook c0 = (1, 0), c1 = (0, 2)
    # key idx (1, 0) decodes to (0, 2, 1, 0); query (3, 5, 7, 11):
    # table = [[q0 . c0, q0 . c1], [q1 . c0, q1 . c1]] = [[3, 10], [7, 22]]; score = 10 + 7 = 17
    cb = mx.array([[1.0, 0.0], [0.0, 2.0]])
    q = mx.array([[[[3.0, 5.0, 7.0, 11.0]]]])
    idx = mx.array([[[[1, 0]]]], dtype=mx.uint32)
    assert np.array(pq.lookup_table(q, cb)).tolist() == [[[[[3.0, 10.0], [7.0, 22.0]]]]]
    assert np.array(pq.scores(q, cb, idx)).tolist() == [[[[17.0]]]]


# --- k-means --------------------------------------------------------------------------------

def test_kmeans_finds_separated_clusters_and_is_deterministic():
    rng = np.random.default_rng(3)
    centres = np.array([[-10.0, 0.0], [0.0, 10.0], [10.0, 0.0]], np.float32)
    pts = (centres[rng.integers(0, 3, size=600)] + 0.1 * rng.standard_normal((600, 2))).astype(np.float32)
    for init in ("sample", "kmeans++"):
        a = np.array(pq.kmeans(pts, 3, iters=10, seed=5, init=init))
        b = np.array(pq.kmeans(pts, 3, iters=10, seed=5, init=init))
        assert np.array_equal(a, b)  # deterministic per seed
    # k-means++ draws far-apart starts: Lloyd from them finds the three clusters
    found = sorted(map(tuple, np.round(a).astype(int).tolist()))
    assert found == sorted(map(tuple, centres.astype(int).tolist()))


def test_kmeans_refills_empty_clusters():
    # 4 distinct points, 4 clusters, every draw a duplicate of point 0: three clusters empty
    # after the first assignment take the farthest points, so every point becomes a centroid
    pts = np.array([[0.0, 0.0]] * 6 + [[1.0, 0.0], [0.0, 5.0], [9.0, 9.0]], np.float32)
    init = pq.kmeans_np_init
    try:
        pq.kmeans_np_init = lambda p, k, seed, how="sample": np.zeros((k, 2), np.float32)
        c = np.array(pq.kmeans(pts, 4, iters=3))
    finally:
        pq.kmeans_np_init = init
    assert sorted(map(tuple, c.tolist())) == [(0.0, 0.0), (0.0, 5.0), (1.0, 0.0), (9.0, 9.0)]


def test_kmeans_lowers_the_error_of_its_draw():
    pts = rows(0, (2000, 4))
    draw = pq.kmeans_np_init(pts, 64, 1)
    fit = np.array(pq.kmeans(pts, 64, iters=8, seed=1))

    def err(cb):
        idx = pq.assign_np(pts[None, None, :, None], cb)[0, 0, :, 0]
        return float(((pts - cb[idx]) ** 2).sum())
    assert err(fit) < 0.8 * err(draw)


def test_spherical_kmeans_is_the_normalized_mean_of_the_largest_cosines():
    pts = rows(4, (3000, 4))
    pts /= np.linalg.norm(pts, axis=1, keepdims=True)
    # one round by hand: each drawn point takes the points of largest cosine, its centroid
    # is their mean scaled to unit norm
    init = pq.kmeans_np_init(pts, 16, 2)
    near = np.argmax(pts @ init.T, axis=1)
    want = np.stack([pts[near == c].mean(axis=0) for c in range(16)])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    got = np.array(pq.kmeans(pts, 16, iters=1, seed=2, spherical=True))
    np.testing.assert_allclose(got, want, atol=1e-5)
    fit = np.array(pq.kmeans(pts, 16, iters=8, seed=2, spherical=True))
    assert np.allclose(np.linalg.norm(fit, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(fit, np.array(pq.kmeans(pts, 16, iters=8, seed=2, spherical=True)))
    # more rounds raise the mean cosine of each point to its centroid
    assert (pts @ fit.T).max(axis=1).mean() > (pts @ got.T).max(axis=1).mean()


def test_assign_holds_one_block_of_distances_at_a_time(monkeypatch):
    """A prefill chunk's assignment against a 12-bit codebook (3 kv heads, 512 tokens of 16
    sub-vectors: 384 MiB of float32 distances in all) runs block after block, holding a few
    blocks' worth at most, and gives the indices of one block holding every distance."""
    from velox.codecs import pq

    mx.random.seed(0)
    sub = mx.random.normal((1, 3, 512, 16, 4))
    cb = mx.random.normal((3, 4096, 4))
    mx.eval(sub, cb)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    idx = pq.assign(sub, cb)
    mx.eval(idx)
    peak = mx.get_peak_memory() - base
    whole = 3 * 512 * 16 * 4096 * 4
    assert peak <= 12 * pq.BLOCK_ELEMENTS * 4 < whole / 4
    monkeypatch.setattr(pq, "BLOCK_ELEMENTS", 1 << 30)
    assert np.array_equal(np.array(idx), np.array(pq.assign(sub, cb)))

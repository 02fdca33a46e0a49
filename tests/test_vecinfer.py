"""VecInfer: smoothing, the rotation, product-quantized keys and values, calibration."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox
from velox import codec_cache
from velox.codecs import numpy_tables, pq
from velox.codecs import vecinfer as vc
from velox.registry import get_method

M = get_method("vecinfer")


def rows(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _installed(h, d, ks, kb, vs, vb, smooth, kcb, vcb, backend="mlx"):
    state = M.init(1, h, d, key_sub_dim=ks, key_codebook_bits=kb, value_sub_dim=vs,
                   value_codebook_bits=vb, codebook="random", backend=backend)
    return M.calibrate(state, {"smooth": smooth, "key_codebook": kcb, "value_codebook": vcb})


# --- a hand-worked case -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_by_hand(backend):
    # d = 4, one kv head, smoothing lambda = (1, 2, 1, 2); H = [[1,1,1,1],[1,-1,1,-1],
    # [1,1,-1,-1],[1,-1,-1,1]] / 2; key codebook (sub-vectors of 2, 1 bit) c0 = (2, 0),
    # c1 = (0, 2); value codebook v0 = (1, 0), v1 = (0, 1).
    sm = np.array([[1.0, 2.0, 1.0, 2.0]], np.float32)
    kcb = np.array([[[2.0, 0.0], [0.0, 2.0]]], np.float32)
    vcb = np.array([[[1.0, 0.0], [0.0, 1.0]]], np.float32)
    state = _installed(1, 4, 2, 1, 2, 1, sm, kcb, vcb, backend)
    # k1 = (2, 4, 0, 0): k / lambda = (2, 2, 0, 0), H of it = (2, 0, 2, 0): sub-vectors (2, 0),
    #   (2, 0) -> indices (0, 0), packed 0; decoded exactly.
    # k2 = (0, 0, 2, -4): k / lambda = (0, 0, 2, -2), H of it = (0, 2, 0, -2): (0, 2) -> c1;
    #   (0, -2) is 8 from c0 and 16 from c1 -> c0: indices (1, 0), packed 0b01 = 1; decoded
    #   H (0, 2, 2, 0) * lambda = (2, 0, 0, -2) * lambda = (2, 0, 0, -4).
    keys = mx.array([[[[2.0, 4.0, 0.0, 0.0], [0.0, 0.0, 2.0, -4.0]]]])
    # v1 = (0.9, 0.2, -0.1, 0.8): (0.9, 0.2) -> v0, (-0.1, 0.8) -> v1: indices (0, 1) = 0b10 = 2
    values = mx.array([[[[0.9, 0.2, -0.1, 0.8], [0.0, 1.0, 1.0, 0.0]]]])
    state = M.update(state, keys, values)
    assert np.array(state.key_codes.idx[0, 0, :2, 0]).tolist() == [0, 1]
    assert np.array(state.value_codes.idx[0, 0, :2, 0]).tolist() == [2, 1]
    k, v = M.get_kv(state)
    np.testing.assert_allclose(np.array(k[0, 0]), [[2, 4, 0, 0], [2, 0, 0, -4]], atol=1e-6)
    np.testing.assert_allclose(np.array(v[0, 0]), [[1, 0, 0, 1], [0, 1, 1, 0]], atol=1e-6)
    # q = (1, 1, 1, 1): q . k_hat = 6 and -2, read from the indices through the lookup table
    s = codec_cache.key_scores(state, mx.array([[[[1.0, 1.0, 1.0, 1.0]]]]))
    np.testing.assert_allclose(np.array(s[0, 0, 0]), [6.0, -2.0], atol=1e-5)


# --- properties -------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [2, 4, 8, 64, 128, 48, 6])
def test_rotation_is_orthogonal(d):
    r = vc.rotation(d).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)
    if d & (d - 1) == 0:  # the Hadamard matrix: symmetric, entries +-1/sqrt(d)
        assert np.allclose(r, r.T) and np.allclose(np.abs(r), 1 / math.sqrt(d))


@given(seed=st.integers(0, 2**16), h=st.integers(1, 3))
def test_smoothing_is_exactly_invertible_in_the_scores(seed, h):
    # (lambda q) . (k / lambda) = q . k: the scores read from the codes equal q . decode(codes)
    d, ks, kb = 16, 4, 5
    sm = np.exp(rows(seed, (h, d))).astype(np.float32)
    t = vc.tables_from_arrays(d, ks, kb, rows(seed + 1, (h, 1 << kb, ks)), sm, rotate=True)
    x, q = rows(seed + 2, (2, h, 7, d), 3.0), rows(seed + 3, (2, h, 3, d))
    codes = vc.encode(t, mx.array(x))
    want = q.astype(np.float64) @ np.swapaxes(np.array(vc.decode(t, codes)), -1, -2)
    np.testing.assert_allclose(np.array(vc.scores(t, mx.array(q), codes)), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(vc.scores_np(numpy_tables(t), q, codes), want, rtol=1e-4, atol=1e-4)
    # and the smoothing alone: q * lambda against k / lambda
    k = x[0, :, 0]
    np.testing.assert_allclose(((q[0, :, 0] * sm) * (k / sm)).sum(-1), (q[0, :, 0] * k).sum(-1),
                               rtol=1e-5, atol=1e-5)


@given(seed=st.integers(0, 2**16), ks=st.sampled_from([2, 4, 8]), kb=st.integers(1, 12))
def test_assignment_is_nearest_and_indices_in_range(seed, ks, kb):
    d, h = 16, 2
    sm = np.exp(0.5 * rows(seed, (h, d))).astype(np.float32)
    cb = rows(seed + 1, (h, 1 << kb, ks))
    t = vc.tables_from_arrays(d, ks, kb, cb, sm, rotate=True)
    x = rows(seed + 2, (1, h, 5, d))
    idx = pq.unpack(vc.encode(t, mx.array(x)).idx, kb, d // ks)
    idx = np.array(idx)
    assert (idx < (1 << kb)).all()
    y = pq.split((x / sm[:, None, :]) @ vc.rotation(d).T, ks).astype(np.float64)  # [1, h, 5, J, s]
    cb16 = np.asarray(t.codebook).astype(np.float64)  # as held: float16
    dist = ((y[..., None, :] - cb16[None, :, None, None]) ** 2).sum(-1)  # [1, h, 5, J, K]
    chosen = np.take_along_axis(dist, idx[..., None].astype(np.int64), -1)[..., 0]
    assert np.all(chosen <= dist.min(-1) + 1e-4 * (1 + dist.min(-1)))


@given(seed=st.integers(0, 2**16))
def test_a_codebook_holding_every_subvector_reconstructs(seed):
    d, h, n, ks, vs = 8, 2, 3, 4, 4
    sm = np.exp(0.3 * rows(seed, (h, d))).astype(np.float32)
    keys, values = rows(seed + 1, (1, h, n, d)), rows(seed + 2, (1, h, n, d))
    ky = pq.split((keys / sm[:, None, :]) @ vc.rotation(d).T, ks)[0].reshape(h, -1, ks)  # 6 each
    vy = pq.split(values, vs)[0].reshape(h, -1, vs)
    pad = lambda a: np.concatenate([a, np.full((h, 8 - a.shape[1], a.shape[2]), 99.0)], 1)  # noqa: E731
    state = _installed(h, d, ks, 3, vs, 3, sm, pad(ky).astype(np.float16), pad(vy).astype(np.float16))
    state = M.update(state, mx.array(keys), mx.array(values))
    k, v = M.get_kv(state)
    # the codebook holds the sub-vectors rounded to float16: exact up to that and the rotation
    np.testing.assert_allclose(np.array(k), keys, atol=4e-3 * np.abs(keys).max())
    np.testing.assert_allclose(np.array(v), values, atol=2e-3 * np.abs(values).max())


def test_bits_per_element_at_the_defaults():
    # keys: 16 sub-vectors of 4 at 12 bits = 192 bits = 6 words = 24 bytes (3 bits an element);
    # values: 8 sub-vectors of 8 at 8 bits = 64 bits = 2 words = 8 bytes (1 bit an element)
    state = M.init(1, 3, 64, codebook="random")
    state = M.update(state, mx.zeros((1, 3, 10, 64)), mx.zeros((1, 3, 10, 64)))
    assert state.key_codes.idx.shape[-1] * 32 == 64 * 3
    assert state.value_codes.idx.shape[-1] * 32 == 64 * 1
    for ks, kb in ((2, 5), (8, 10), (4, 6)):
        s = M.init(1, 1, 64, key_sub_dim=ks, key_codebook_bits=kb, codebook="random")
        s = M.update(s, mx.zeros((1, 1, 3, 64)), mx.zeros((1, 1, 3, 64)))
        assert s.key_codes.idx.shape[-1] == -(-(64 // ks) * kb // 32)


@given(seed=st.integers(0, 2**16))
def test_backends_give_the_same_codes(seed):
    x, v = rows(seed, (2, 2, 9, 32)), rows(seed + 1, (2, 2, 9, 32))
    a = M.update(M.init(2, 2, 32, codebook="random", seed=seed), mx.array(x), mx.array(v))
    b = M.update(M.init(2, 2, 32, codebook="random", seed=seed, backend="reference"),
                 mx.array(x), mx.array(v))
    for x1, x2 in ((a.key_codes.idx, b.key_codes.idx), (a.value_codes.idx, b.value_codes.idx)):
        differ = (np.array(x1) != np.array(x2)).any(-1)
        assert differ.mean() <= 0.02


def test_determinism_per_seed_and_artifact():
    a, b = M.init(1, 2, 32, codebook="random", seed=3), M.init(1, 2, 32, codebook="random", seed=3)
    c = M.init(1, 2, 32, codebook="random", seed=4)
    assert mx.array_equal(a.tables.codebook, b.tables.codebook).item()
    assert not mx.array_equal(a.tables.codebook, c.tables.codebook).item()
    arrays = {"smooth": np.ones((2, 32), np.float32), "key_codebook": rows(0, (2, 4096, 4)),
              "value_codebook": rows(1, (2, 256, 8))}
    x = mx.array(rows(2, (1, 2, 5, 32)))
    got = [M.update(M.calibrate(M.init(1, 2, 32, codebook="random", seed=s), arrays), x, x)
           for s in (0, 9)]  # an artifact replaces the seed's codebook
    assert mx.array_equal(got[0].key_codes.idx, got[1].key_codes.idx).item()


def test_uncalibrated_state_refuses_tokens_naming_the_command():
    state = M.init(1, 2, 32)  # the shipped calibration fits SmolLM2's 3 kv heads and head_dim 64
    with pytest.raises(ValueError, match="velox calibrate --method vecinfer"):
        M.update(state, mx.zeros((1, 2, 3, 32)), mx.zeros((1, 2, 3, 32)))
    with pytest.raises(ValueError, match="kv_heads"):
        M.calibrate(state, {"smooth": np.ones((3, 32)), "key_codebook": np.zeros((3, 4096, 4)),
                            "value_codebook": np.zeros((3, 256, 8))})


# --- calibration ------------------------------------------------------------------------------

def test_fit_vecinfer_smoothing_and_codebooks():
    from velox.adapters.artifacts import fit_vecinfer
    keys = rows(0, (64, 2, 8)) * np.array([1, 1, 1, 9, 1, 1, 1, 1], np.float32)  # an outlier channel
    values = rows(1, (64, 2, 8))
    params = dict(key_sub_dim=4, key_codebook_bits=5, value_sub_dim=4, value_codebook_bits=4, iters=4)
    out = fit_vecinfer(keys, params, values)
    np.testing.assert_allclose(out["smooth"], np.sqrt(np.abs(keys).max(0)), rtol=1e-6)
    assert out["key_codebook"].shape == (2, 32, 4) and out["value_codebook"].shape == (2, 16, 4)
    again = fit_vecinfer(keys, params, values)
    assert all(np.array_equal(out[k], again[k]) for k in out)  # deterministic
    # the fit codes its own calibration keys better than a random codebook of the same size
    state = M.calibrate(M.init(1, 2, 8, key_sub_dim=4, key_codebook_bits=5, value_sub_dim=4,
                               value_codebook_bits=4, codebook="random"), out)
    rnd = M.init(1, 2, 8, key_sub_dim=4, key_codebook_bits=5, value_sub_dim=4,
                 value_codebook_bits=4, codebook="random")
    k = mx.array(keys.transpose(1, 0, 2)[None])
    err = [float(((M.get_kv(M.update(s, k, k))[0] - k) ** 2).sum()) for s in (state, rnd)]
    assert err[0] < 0.5 * err[1]


def test_shipped_calibration_fits_smollm2_and_nothing_else():
    arrays, info = vc.shipped_arrays("smollm2-135m-instruct")
    assert info["layers"] == 30 and info["kv_heads"] == 3 and info["head_dim"] == 64
    assert arrays["key_codebook"].shape == (30, 3, 4096, 4)
    assert arrays["value_codebook"].shape == (30, 3, 256, 8)
    layers = M.per_layer_params(30, {})
    assert [p["layer"] for p in layers] == list(range(30))
    state = M.init(1, 3, 64, layer=7)
    assert state.tables.calibrated and state.value_tables.calibrated
    np.testing.assert_array_equal(np.array(state.tables.codebook), arrays["key_codebook"][7])
    # another layer count: no layer, the first tokens ask for an artifact
    assert {p["layer"] for p in M.per_layer_params(4, {})} == {-1}
    assert not M.init(1, 3, 64, layer=-1).tables.calibrated


def test_make_cache_on_another_model_names_the_command():
    from mlx_lm.models import llama
    from velox.adapters.mlxlm import make_cache

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=50)
    model = llama.Model(args)
    caches = make_cache(model, "vecinfer")
    with pytest.raises(ValueError, match="velox calibrate --method vecinfer"):
        model(mx.array([[1, 2, 3]]), cache=caches)
    caches = make_cache(model, "vecinfer", codebook="random")  # explicit, for tests
    out = model(mx.array([[1, 2, 3]]), cache=caches)
    assert np.isfinite(np.array(out)).all()


# --- the data-free tier: codebooks fitted at the prefill -----------------------------------------

def _prefill_state(b, h, d, backend="mlx", seed=5, **kw):
    params = dict(key_sub_dim=4, key_codebook_bits=6, value_sub_dim=8, value_codebook_bits=5)
    params.update(kw)
    return M.init(b, h, d, codebook="prefill", seed=seed, backend=backend, **params)


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_prefill_tables_are_the_calibration_rule_on_the_prompt_rows(backend):
    """Each (batch row, kv head)'s smoothing factors are sqrt(max |k|) over its prompt keys and
    its codebooks are velox.codecs.pq.kmeans run directly on its own sub-vectors (the
    smoothed, rotated keys'; the raw values'), seeded [seed, 0] and [seed, 1]."""
    b, h, d, n = 2, 3, 32, 40
    k, v = rows(0, (b, h, n, d), 3.0), rows(1, (b, h, n, d))
    state = M.update(_prefill_state(b, h, d, backend), mx.array(k), mx.array(v))
    t, vt = state.tables, state.value_tables
    assert t.codebook.shape == (b, h, 64, 4) and vt.codebook.shape == (b, h, 32, 8)
    rot = vc.rotation(d)
    for i in range(b):
        for j in range(h):
            sm = vc.smoothing(k[i, j][:, None, :])[0]
            np.testing.assert_allclose(np.array(t.smooth[i, j]), sm, rtol=1e-6)
            y = (k[i, j] / sm) @ rot.T
            want_k = np.array(pq.kmeans(y.reshape(-1, 4), 64, iters=vc.PREFILL_ITERS, seed=[5, 0]))
            want_v = np.array(pq.kmeans(v[i, j].reshape(-1, 8), 32, iters=vc.PREFILL_ITERS, seed=[5, 1]))
            np.testing.assert_allclose(np.array(t.codebook[i, j]).astype(np.float32),
                                       want_k.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(np.array(vt.codebook[i, j]).astype(np.float32),
                                       want_v.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-4)


def test_prefill_fit_is_frozen_deterministic_and_seeded():
    b, h, d = 1, 2, 32
    k, v = mx.array(rows(0, (b, h, 30, d))), mx.array(rows(1, (b, h, 30, d)))
    a = M.update(_prefill_state(b, h, d), k[:, :, :20], v[:, :, :20])
    later = M.update(a, k[:, :, 20:], v[:, :, 20:])  # frozen after the first update
    for x, y in ((a.tables, later.tables), (a.value_tables, later.value_tables)):
        assert all(mx.array_equal(p, q).item() for p, q in zip(x[:3], y[:3]))
    again = M.update(_prefill_state(b, h, d), k[:, :, :20], v[:, :, :20])
    other = M.update(_prefill_state(b, h, d, seed=6), k[:, :, :20], v[:, :, :20])
    assert mx.array_equal(a.tables.codebook, again.tables.codebook).item()
    assert mx.array_equal(a.key_codes.idx, again.key_codes.idx).item()
    assert not mx.array_equal(a.tables.codebook, other.tables.codebook).item()


@given(seed=st.integers(0, 2**16))
def test_prefill_backends_agree_and_indices_are_in_range(seed):
    b, h, d = 2, 2, 32
    x, v = rows(seed, (b, h, 33, d)), rows(seed + 1, (b, h, 33, d))
    got = {}
    for backend in ("mlx", "reference"):
        s = _prefill_state(b, h, d, backend, seed=seed)
        s = M.update(s, mx.array(x[:, :, :32]), mx.array(v[:, :, :32]))
        got[backend] = M.update(s, mx.array(x[:, :, 32:]), mx.array(v[:, :, 32:]))
    a, r = got["mlx"], got["reference"]
    assert mx.array_equal(a.tables.codebook, r.tables.codebook).item()  # one MLX fit for both
    for x1, x2, t in ((a.key_codes.idx, r.key_codes.idx, a.tables),
                      (a.value_codes.idx, r.value_codes.idx, a.value_tables)):
        assert (np.array(x1) != np.array(x2)).any(-1).mean() <= 0.02
        idx = np.array(pq.unpack(x1, t.bits, d // t.sub_dim))
        assert idx.max() < 1 << t.bits


def test_prefill_bytes_count_the_fitted_tables():
    """The fitted tables (a float16 codebook and float32 smoothing factors a batch row and kv
    head) are held in the state and counted: against a random codebook's state, which shares
    one codebook and no smoothing, exactly those bytes more."""
    b, h, d, n = 2, 3, 32, 20
    x = mx.array(rows(0, (b, h, n, d)))
    fit = M.update(_prefill_state(b, h, d), x, x)
    rnd = M.update(M.init(b, h, d, key_sub_dim=4, key_codebook_bits=6, value_sub_dim=8,
                          value_codebook_bits=5, codebook="random"), x, x)
    extra = (b * h - 1) * (64 * 4 + 32 * 8) * 2 + (b * h - 1) * d * 4
    assert M.nbytes(fit) - M.nbytes(rnd) == extra
    assert M.nbytes(fit) == M.nbytes(_prefill_state(b, h, d)) + M.nbytes(rnd) - M.nbytes(
        M.init(b, h, d, key_sub_dim=4, key_codebook_bits=6, value_sub_dim=8,
               value_codebook_bits=5, codebook="random"))  # the fit keeps the tables' shapes


def test_a_prompt_of_fewer_subvectors_than_centroids_is_held_exactly():
    """With fewer sub-vectors than centroids, every sub-vector of the prompt is a centroid: the
    prompt decodes to itself up to the float16 codebook."""
    b, h, d = 1, 2, 32
    k, v = rows(0, (b, h, 6, d), 2.0), rows(1, (b, h, 6, d))  # 48 key, 24 value sub-vectors
    state = M.update(_prefill_state(b, h, d), mx.array(k), mx.array(v))
    kh, vh = M.get_kv(state)
    np.testing.assert_allclose(np.array(kh), k, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(np.array(vh), v, rtol=2e-3, atol=2e-3)


def test_prefill_skips_non_finite_tokens():
    b, h, d = 1, 2, 32
    k, v = rows(0, (b, h, 40, d)), rows(1, (b, h, 40, d))
    k[0, 0, 3, 5], v[0, 1, 7, 2] = np.nan, np.inf
    state = M.update(_prefill_state(b, h, d), mx.array(k), mx.array(v))
    for t in (state.tables, state.value_tables):
        assert np.isfinite(np.array(t.codebook)).all()
        assert np.isfinite(np.array(t.smooth)).all()
    kh, vh = (np.array(x) for x in M.get_kv(state))
    assert np.isfinite(np.delete(kh[0, 0], 3, axis=0)).all() and np.isfinite(vh[0, 0]).all()


def test_prefill_runs_on_any_model_without_an_artifact(tiny_llama):
    from velox.adapters.mlxlm import make_cache

    assert {p["layer"] for p in M.per_layer_params(30, {"codebook": "prefill"})} == {-1}
    model = tiny_llama  # no shipped fit: any model runs with codebook="prefill"
    caches = make_cache(model, "vecinfer", codebook="prefill", key_codebook_bits=6,
                        value_codebook_bits=5)
    out = model(mx.array([[1, 2, 3, 4, 5]]), cache=caches)
    out = model(mx.array([[6]]), cache=caches)
    assert np.isfinite(np.array(out)).all()

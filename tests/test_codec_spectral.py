"""SpectralQuant codec (velox.codecs.spectral): rotation, participation ratio, QJL on the signal
coordinates only, the plain rotated scalar quantizer without it, twins, bytes."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from velox.codecs import codes_nbytes, get_codec, numpy_tables, spectral, turboquant
from velox.codecs.lloyd import cell, codebook
from velox.codecs.polar import unpack_codes_np


def _rows(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _anisotropic(t, d, seed=0, strong=4):
    """Keys with ``strong`` directions of standard deviation 8 and the rest 0.5, plus a mean."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    sd = np.r_[np.full(strong, 8.0), np.full(d - strong, 0.5)]
    return ((rng.standard_normal((t, d)) * sd) @ basis.T + 0.3).astype(np.float32)


def _rotated(t, codes):
    return np.array(spectral._decode_rotated(t, codes))


def test_registered():
    c = get_codec("spectral")
    assert c.decode is spectral.decode
    assert {"bits", "signal_bits", "d_eff", "apply_qjl", "jl_dim", "seed", "rotation"} <= set(c.params)


@pytest.mark.parametrize("d", [8, 16, 32, 64, 128, 48])
def test_rotations_orthogonal(d):
    r = np.array(spectral.tables(d, dict(seed=3)).rotation, np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-5)
    p, lam = spectral.pca_rotation(_anisotropic(500, d, 1, strong=min(4, d)))
    np.testing.assert_allclose(p.astype(np.float64) @ p.T, np.eye(d), atol=1e-5)
    assert np.all(np.diff(lam) <= 1e-9)
    x = _rows((3, d), 2)
    np.testing.assert_allclose(np.linalg.norm(x @ p.T, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_pca_rotation_is_the_covariance_eigenbasis():
    k = _anisotropic(2000, 16, 4).astype(np.float64)
    rot, lam = spectral.pca_rotation(k)
    c = np.cov(k.T, bias=True)
    np.testing.assert_allclose(rot.astype(np.float64) @ c @ rot.T.astype(np.float64), np.diag(lam),
                               atol=1e-3 * lam[0])


@given(lam=st.lists(st.floats(0, 1e3), min_size=1, max_size=64).filter(lambda v: sum(v) > 1e-3),
       scale=st.floats(1e-3, 1e3))
def test_participation_ratio_range_and_scale_invariance(lam, scale):
    pr = spectral.participation_ratio(lam)
    assert 1 - 1e-9 <= pr <= len(lam) + 1e-9
    assert spectral.participation_ratio(np.asarray(lam) * scale) == pytest.approx(pr, rel=1e-9)


def test_participation_ratio_extremes():
    assert spectral.participation_ratio(np.full(128, 2.5)) == pytest.approx(128)
    assert spectral.participation_ratio(np.r_[3.0, np.zeros(127)]) == pytest.approx(1)
    # from data: isotropic keys are near d, rank-one keys are 1
    _, lam = spectral.pca_rotation(_rows((20000, 16), 5))
    assert spectral.participation_ratio(lam) > 15
    v = _rows((1, 16), 6)
    _, lam = spectral.pca_rotation(_rows((500, 1), 7) * v)
    assert spectral.participation_ratio(lam) == pytest.approx(1, abs=1e-6)
    # the seed's keys: a few strong directions give a small participation ratio
    assert spectral.calibrate(_anisotropic(4000, 128, 8))["d_eff"] in range(3, 7)


@given(seed=st.integers(0, 999), d_eff=st.integers(1, 16), bits=st.integers(1, 4),
       jl=st.sampled_from([0, 3, 16, 40]), sbits=st.integers(0, 6))
def test_qjl_touches_only_signal_coordinates(seed, d_eff, bits, jl, sbits):
    d = 32
    rot = spectral.pca_rotation(_anisotropic(300, d, 9))[0]
    x = mx.array(_anisotropic(40, d, 10).reshape(1, 2, 20, d))
    base = dict(bits=bits, signal_bits=sbits, d_eff=d_eff, jl_dim=jl, rotation=rot)
    plain_t = spectral.tables(d, dict(base, apply_qjl=False, seed=seed))
    plain = _rotated(plain_t, spectral.encode(plain_t, x))
    outs = []
    for s in (seed, seed + 1):
        t = spectral.tables(d, dict(base, seed=s))
        outs.append(_rotated(t, spectral.encode(t, x)))
        np.testing.assert_array_equal(outs[-1][..., d_eff:], plain[..., d_eff:])
    np.testing.assert_array_equal(outs[0][..., d_eff:], outs[1][..., d_eff:])
    assert not np.array_equal(outs[0][..., :d_eff], outs[1][..., :d_eff])


@given(d=st.sampled_from([8, 16, 32, 64, 128]), bits=st.integers(1, 8), seed=st.integers(0, 999))
def test_without_qjl_equals_turboquant_mse(d, bits, seed):
    """The isotropic default without QJL is the plain rotated scalar quantizer, bit for bit."""
    x = mx.array(_rows((1, 2, 9, d), seed))
    t = spectral.tables(d, dict(bits=bits, apply_qjl=False, seed=seed, d_eff=4 if d > 4 else 1))
    tq = turboquant.mse_tables(d, bits, seed)
    c, ct = spectral.encode(t, x), turboquant.mse_encode(tq, x)
    np.testing.assert_array_equal(np.array(spectral.decode(t, c)),
                                  np.array(turboquant.mse_decode(tq, ct)))
    np.testing.assert_array_equal(np.array(c.norms), np.array(ct.norm))
    assert c.signs.shape == (1, 2, 9, 0) and c.rnorms.shape == (1, 2, 9, 0)


def test_without_qjl_calibrated_is_the_scaled_scalar_quantizer():
    d, bits = 32, 3
    cal = spectral.calibrate(_anisotropic(2000, d, 11))
    t = spectral.tables(d, dict(bits=bits, apply_qjl=False, rotation=cal["rotation"],
                                scales=cal["scales"]))
    x = _anisotropic(50, d, 12)
    y = x.astype(np.float64) @ cal["rotation"].T.astype(np.float64)
    n = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    c, b = codebook("gaussian", bits)
    s = cal["scales"].astype(np.float64)
    want = c[cell(y / (n * s), b.astype(np.float64), bits)] * n * s
    got = _rotated(t, spectral.encode(t, mx.array(x.reshape(1, 1, 50, d))))[0, 0]
    assert np.mean(np.isclose(got, want, rtol=1e-3, atol=1e-4)) > 0.995


def test_calibration_beats_the_random_rotation_on_spectral_keys():
    d = 64
    keys = _anisotropic(3000, d, 13)
    cal = spectral.calibrate(keys[:2000])
    x = mx.array(keys[2000:].reshape(1, 4, 250, d))
    err = {}
    for name, p in (("random", {}), ("spectral", dict(rotation=cal["rotation"], scales=cal["scales"]))):
        t = spectral.tables(d, dict(p, bits=2, apply_qjl=False))
        xh = np.array(spectral.decode(t, spectral.encode(t, x)))
        err[name] = np.sum((xh - np.array(x)) ** 2) / np.sum(np.array(x) ** 2)
    assert err["spectral"] < 0.9 * err["random"], err


def test_qjl_unbiased_over_seeds():
    """E over the sketch of the score = q_rot . (exact signal coordinates, scalar rest)."""
    d, d_eff, n_seeds = 32, 6, 400
    cal = spectral.calibrate(_anisotropic(2000, d, 14, strong=6))
    base = dict(bits=2, d_eff=d_eff, rotation=cal["rotation"], scales=cal["scales"])
    x = _anisotropic(6, d, 15, strong=6).reshape(1, 1, 6, d)
    q = _rows((1, 1, 3, d), 16)
    t0 = spectral.tables(d, dict(base, apply_qjl=False))
    y = x @ np.array(t0.rotation).T
    qr = q @ np.array(t0.rotation).T
    yh = _rotated(t0, spectral.encode(t0, mx.array(x)))
    e = y[..., :d_eff] - yh[..., :d_eff]
    want = qr @ np.swapaxes(yh, -1, -2) + qr[..., :d_eff] @ np.swapaxes(e, -1, -2)
    est = np.stack([np.array(spectral.scores(t, mx.array(q), spectral.encode(t, mx.array(x))))
                    for t in (spectral.tables(d, dict(base, seed=s)) for s in range(n_seeds))])
    q2 = np.sum(qr[..., :d_eff] ** 2, -1)[..., None]
    var = (math.pi / 2) * q2 * np.sum(e ** 2, -1)[:, :, None] / d_eff
    assert np.all(est.var(axis=0) <= 1.2 * var + 1e-6)
    assert np.all(np.abs(est.mean(axis=0) - want) <= 5 * np.sqrt(var / n_seeds) + 1e-4)


@pytest.mark.parametrize("sbits", [0, 1, 5])
def test_scores_are_dot_with_decode(sbits):
    d = 64
    t = spectral.tables(d, dict(bits=3, signal_bits=sbits, d_eff=8, seed=1))
    k, q = _rows((2, 2, 10, d), 17), _rows((2, 2, 4, d), 18)
    c = spectral.encode(t, mx.array(k))
    want = q @ np.swapaxes(np.array(spectral.decode(t, c)), -1, -2)
    np.testing.assert_allclose(np.array(spectral.scores(t, mx.array(q), c)), want, rtol=1e-4, atol=1e-4)


def test_determinism_per_seed():
    x = mx.array(_rows((1, 2, 8, 32), 19))
    a = spectral.encode(spectral.tables(32, dict(seed=7)), x)
    b = spectral.encode(spectral.tables(32, dict(seed=7)), x)
    c = spectral.encode(spectral.tables(32, dict(seed=8)), x)
    assert all(np.array_equal(np.array(u), np.array(v)) for u, v in zip(a, b))
    assert not np.array_equal(np.array(a.codes), np.array(c.codes))


@given(d=st.sampled_from([8, 16, 32, 64, 128]), bits=st.integers(1, 8), qjl=st.booleans(),
       calibrated=st.booleans(), seed=st.integers(0, 999), sbits=st.integers(0, 8))
def test_mx_equals_np(d, bits, qjl, calibrated, seed, sbits):
    p = dict(bits=bits, signal_bits=sbits, apply_qjl=qjl, d_eff=min(4, d), seed=seed)
    if calibrated:
        cal = spectral.calibrate(_anisotropic(400, d, seed, strong=min(4, d)))
        p.update(rotation=cal["rotation"], scales=cal["scales"])
    t = spectral.tables(d, p)
    tn = numpy_tables(t)
    x = _anisotropic(12, d, seed + 1, strong=min(4, d)).reshape(2, 2, 3, d)
    # the same rotated rows give the same codes
    y = x @ tn.rotation.T
    r = np.sqrt(np.sum(x * x, axis=-1))
    cm, cn = spectral._encode_rotated(t, mx.array(y), mx.array(r)), spectral._encode_rotated_np(tn, y, r)
    for a, b in zip(cm, cn):
        assert a.dtype == mx.array(b).dtype and np.array_equal(np.array(a), b)
    # whole pipeline: the rotation matmul may round differently; decodes and scores agree
    c, c_np = spectral.encode(t, mx.array(x)), spectral.encode_np(tn, x)
    assert np.mean(np.array(c.codes) == c_np.codes) > 0.95
    np.testing.assert_allclose(np.array(spectral.decode(t, c)), spectral.decode_np(tn, c), atol=1e-4)
    q = _rows((2, 2, 5, d), seed + 2)
    np.testing.assert_allclose(np.array(spectral.scores(t, mx.array(q), c)),
                               spectral.scores_np(tn, q, c), rtol=1e-4, atol=1e-3)


def test_bytes_formula():
    for d in (8, 16, 32, 64, 128):
        for bits, d_eff, qjl, jl in ((2, 4, True, 0), (3, 4, False, 0), (1, 8, True, 20),
                                     (5, 0, True, 0)):
            p = dict(bits=bits, d_eff=min(d_eff, d), apply_qjl=qjl, jl_dim=jl)
            t = spectral.tables(d, p)
            m = (jl or min(d_eff, d)) if qjl and d_eff else 0
            per_row = math.ceil(d * bits / 8) + 2 + ((math.ceil(m / 8) + 2) if m else 0)
            assert per_row == spectral.bytes_per_row(d, p) and t.jl_dim == m
            c = spectral.encode(t, mx.array(_rows((1, 3, 5, d))))
            assert codes_nbytes(c) == 15 * per_row
    # the seed's configuration: 2 bits, d_eff 4, QJL of 4 signs: 2.3125 bits a coordinate
    assert spectral.bytes_per_row(128, dict(bits=2, d_eff=4)) * 8 / 128 == 2.3125


def test_bytes_with_signal_bits_by_hand():
    # SmolLM2's head_dim 64, d_eff 4, QJL of 4 signs: 4 * 4 + 60 * 2 = 136 index bits = 17 bytes,
    # a float16 norm, 1 byte of signs and a float16 residual norm: 22 bytes (20 at signal_bits 0)
    cases = {(64, 2, 4, 4, True): 17 + 2 + 1 + 2, (64, 2, 0, 4, True): 16 + 2 + 1 + 2,
             (64, 3, 5, 4, True): 25 + 2 + 1 + 2,    # 4 * 5 + 60 * 3 = 200 bits
             (128, 2, 8, 4, False): 35 + 2,          # 4 * 8 + 124 * 2 = 280 bits
             (16, 1, 3, 3, False): 3 + 2,            # 3 * 3 + 13 * 1 = 22 bits: 3 bytes
             (32, 4, 1, 8, True): 13 + 2 + 1 + 2}    # 8 * 1 + 24 * 4 = 104 bits
    for (d, bits, sbits, d_eff, qjl), want in cases.items():
        p = dict(bits=bits, signal_bits=sbits, d_eff=d_eff, apply_qjl=qjl)
        assert spectral.bytes_per_row(d, p) == want, (d, bits, sbits, d_eff, qjl)
        t = spectral.tables(d, p)
        c = spectral.encode(t, mx.array(_rows((2, 3, 5, d), 30)))
        assert codes_nbytes(c) == 30 * want
        assert codes_nbytes(spectral.encode_np(numpy_tables(t), _rows((2, 3, 5, d), 30))) == 30 * want


def test_signal_bits_zero_or_equal_is_the_uniform_codec():
    d = 32
    cal = spectral.calibrate(_anisotropic(500, d, 31))
    x = mx.array(_anisotropic(24, d, 32).reshape(1, 2, 12, d))
    for p in (dict(bits=2, d_eff=4, seed=3), dict(bits=3, d_eff=4, rotation=cal["rotation"],
                                                  scales=cal["scales"]),
              dict(bits=2, d_eff=0, apply_qjl=False)):
        plain = spectral.tables(d, p)
        ref = spectral.encode(plain, x)
        for sb in (0, p["bits"]):
            t = spectral.tables(d, dict(p, signal_bits=sb))
            assert t.signal_bits == p["bits"] and t.signal_centroids.shape == (0,)
            for a, b in zip(t, plain):
                if isinstance(a, mx.array):
                    assert np.array_equal(np.array(a), np.array(b))
                else:
                    assert a == b
            for a, b in zip(spectral.encode(t, x), ref):
                assert np.array_equal(np.array(a), np.array(b))
    # no signal coordinate: signal_bits has nothing to apply to, the uniform codec
    assert spectral.tables(d, dict(bits=2, d_eff=0, signal_bits=5)).signal_bits == 2


@given(bits=st.integers(1, 8), sbits=st.integers(1, 8), d_eff=st.integers(1, 16),
       seed=st.integers(0, 999))
def test_signal_bits_codes_by_hand_and_in_range(bits, sbits, d_eff, seed):
    """The packed stream is the signal coordinates' sbits-bit codes then the rest's bits-bit
    codes, each the Gaussian Lloyd-Max cell of its unit coordinate."""
    d = 16
    cal = spectral.calibrate(_anisotropic(400, d, seed, strong=3))
    t = spectral.tables(d, dict(bits=bits, signal_bits=sbits, d_eff=d_eff, apply_qjl=False,
                                rotation=cal["rotation"], scales=cal["scales"]))
    x = _anisotropic(20, d, seed + 1, strong=3).reshape(1, 1, 20, d)
    tn = numpy_tables(t)
    y = x @ tn.rotation.T
    r = np.sqrt(np.sum(x * x, axis=-1))
    c = spectral._encode_rotated(t, mx.array(y), mx.array(r))
    widths = [sbits, bits] if d_eff < d else [sbits]
    counts = [d_eff, d - d_eff] if d_eff < d else [d_eff]
    parts = unpack_codes_np(np.array(c.codes), counts, widths)
    assert np.array(c.codes).shape[-1] == math.ceil((d_eff * sbits + (d - d_eff) * bits) / 8)
    u = (y * (np.float32(math.sqrt(d)) / r)[..., None]) * tn.gains
    for part, w, lo, hi in zip(parts, widths, [0, d_eff], [d_eff, d]):
        assert part.max() < 2 ** w
        cb = codebook("gaussian", w)[1]
        ok = part == cell(u[..., lo:hi], cb, w)   # float32 arithmetic: a boundary may round
        assert ok.mean() > 0.99
    # decode is the centroids of each part times the norm and spread
    want = np.concatenate([codebook("gaussian", w)[0][p] for p, w in zip(parts, widths)], -1)
    want = want * np.float16(r).astype(np.float32)[..., None] * tn.scales
    np.testing.assert_allclose(_rotated(t, c), want, rtol=1e-6, atol=1e-6)


def test_signal_mse_non_increasing_in_signal_bits_rest_untouched():
    d, d_eff = 64, 4
    keys = _anisotropic(3000, d, 33, strong=d_eff)
    cal = spectral.calibrate(keys[:2000])
    x = mx.array(keys[2000:].reshape(1, 4, 250, d))
    y = np.array(x) @ cal["rotation"].T
    mse, rest = [], None
    for sb in range(1, 9):
        t = spectral.tables(d, dict(bits=2, signal_bits=sb, d_eff=d_eff, apply_qjl=False,
                                    rotation=cal["rotation"], scales=cal["scales"]))
        yh = _rotated(t, spectral.encode(t, x))
        mse.append(float(np.mean((yh[..., :d_eff] - y[..., :d_eff]) ** 2)))
        if rest is None:
            rest = yh[..., d_eff:]
        np.testing.assert_array_equal(yh[..., d_eff:], rest)  # the rest: bits=2 whatever sb
    assert all(b <= a for a, b in zip(mse, mse[1:])), mse
    assert mse[-1] < 0.01 * mse[0], mse
    # and the whole key's error falls too: the signal coordinates hold most of its energy here
    t2, t5 = (spectral.tables(d, dict(bits=2, signal_bits=sb, d_eff=d_eff, apply_qjl=False,
                                      rotation=cal["rotation"], scales=cal["scales"]))
              for sb in (0, 5))
    err = [np.sum((np.array(spectral.decode(t, spectral.encode(t, x))) - np.array(x)) ** 2)
           for t in (t2, t5)]
    assert err[1] < 0.5 * err[0], err


def test_zero_rows_and_errors():
    t = spectral.tables(16, dict(seed=0))
    c = spectral.encode(t, mx.zeros((1, 1, 2, 16)))
    assert np.array_equal(np.array(spectral.decode(t, c)), np.zeros((1, 1, 2, 16), np.float32))
    with pytest.raises(ValueError, match="rotation"):
        spectral.tables(16, dict(rotation=np.eye(8)))
    with pytest.raises(ValueError, match="d_eff"):
        spectral.tables(16, dict(d_eff=17))
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="signal_bits"):
            spectral.tables(16, dict(signal_bits=bad))
        with pytest.raises(ValueError, match="signal_bits"):
            spectral.bytes_per_row(16, dict(signal_bits=bad))


def test_method_signal_bits_range_and_constraint():
    import velox

    st_ = velox.init("spectral", 1, 2, 16, bits=2, signal_bits=4)
    assert st_.signal_bits == 4 and st_.tables.signal_bits == 4
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="signal_bits"):
            velox.init("spectral", 1, 2, 16, signal_bits=bad)
    with pytest.raises(ValueError, match="signal_bits.*d_eff|d_eff.*signal_bits"):
        velox.init("spectral", 1, 2, 16, d_eff=0, signal_bits=4)
    velox.init("spectral", 1, 2, 16, d_eff=0, signal_bits=0)


# ---- per-head calibration --------------------------------------------------------------------

def _two_head_keys(t, d, seed=20, strong=3):
    """Keys ``[t, 2, d]``: head 0 strong (sd 8) along the first ``strong`` columns of one random
    orthogonal basis, head 1 along the last ``strong`` of it (two disjoint planted subspaces);
    every other direction sd 0.5. Returns the keys and each head's planted basis ``[strong,
    d]``."""
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    planted = (q[:, :strong].T, q[:, -strong:].T)
    heads = []
    for i, p in enumerate(planted):
        rest = np.linalg.qr(np.c_[p.T, rng.standard_normal((d, d - strong))])[0].T  # p first
        sd = np.r_[np.full(strong, 8.0 - i), np.full(d - strong, 0.5)]
        heads.append((rng.standard_normal((t, d)) * sd) @ rest)
    return np.stack(heads, axis=1).astype(np.float32), planted


def _captured(top, planted):
    """Share of the planted subspace's energy the rows ``top [k, d]`` span (1 = all of it)."""
    return float(np.sum((planted @ top.T) ** 2) / len(planted))


def test_per_head_fit_finds_each_heads_own_directions():
    d, strong = 32, 3
    keys, planted = _two_head_keys(4000, d, strong=strong)
    cal = spectral.calibrate_heads(keys)
    assert cal["rotation"].shape == (2, d, d) and cal["scales"].shape == (2, d)
    assert cal["eigenvalues"].shape == (2, d) and cal["participation_ratio"].shape == (2,)
    for h in range(2):
        top = cal["rotation"][h, :strong].astype(np.float64)
        assert _captured(top, planted[h]) > 0.99          # its own dominant directions
        assert _captured(top, planted[1 - h]) < 0.05      # not the other head's
        np.testing.assert_allclose(cal["scales"][h] @ cal["scales"][h], 1.0, rtol=1e-5)
        # head h's fit is calibrate() of head h's keys alone
        alone = spectral.calibrate(keys[:, h])
        np.testing.assert_array_equal(cal["rotation"][h], alone["rotation"])
        np.testing.assert_array_equal(cal["scales"][h], alone["scales"])
    # one pooled basis cannot hold both: its top `strong` rows miss much of one head's subspace
    pooled = spectral.calibrate(keys.reshape(-1, d))["rotation"][:strong].astype(np.float64)
    assert min(_captured(pooled, p) for p in planted) < 0.5


def test_per_head_tables_code_each_head_in_its_own_basis():
    d = 32
    keys, _ = _two_head_keys(600, d)
    cal = spectral.calibrate_heads(keys[:500])
    x = np.ascontiguousarray(keys[500:].transpose(1, 0, 2))[None]  # [1, 2, 100, d]
    for qjl_on in (False, True):
        p = dict(bits=3, d_eff=3, apply_qjl=qjl_on, seed=5)
        t = spectral.tables(d, dict(p, rotation=cal["rotation"], scales=cal["scales"]))
        assert t.rotation.shape == (2, d, d) and t.scales.shape == (2, d)
        c = spectral.encode(t, mx.array(x))
        q = _rows((1, 2, 4, d), 21)
        dec, sc = np.array(spectral.decode(t, c)), np.array(spectral.scores(t, mx.array(q), c))
        for h in range(2):  # the same as coding head h alone with a shared [d, d] table
            th = spectral.tables(d, dict(p, rotation=cal["rotation"][h], scales=cal["scales"][h]))
            ch = spectral.encode(th, mx.array(x[:, h:h + 1]))
            for a, b in zip(ch, c):
                assert np.array_equal(np.array(a), np.array(b)[:, h:h + 1])
            np.testing.assert_allclose(dec[:, h:h + 1], np.array(spectral.decode(th, ch)),
                                       atol=1e-6)
            np.testing.assert_allclose(
                sc[:, h:h + 1], np.array(spectral.scores(th, mx.array(q[:, h:h + 1]), ch)),
                rtol=1e-5, atol=1e-5)
        # the NumPy twins agree with per-head tables too
        tn = numpy_tables(t)
        cn = spectral.encode_np(tn, x)
        assert np.mean(np.array(c.codes) == cn.codes) > 0.95
        np.testing.assert_allclose(spectral.decode_np(tn, c), dec, atol=1e-4)
        np.testing.assert_allclose(spectral.scores_np(tn, q, c), sc, rtol=1e-4, atol=1e-3)


def test_per_head_fit_beats_a_pooled_fit_on_heads_of_different_spectra():
    d = 32
    keys, _ = _two_head_keys(3000, d)
    fit, held = keys[:2000], np.ascontiguousarray(keys[2000:].transpose(1, 0, 2))[None]
    own = spectral.calibrate_heads(fit)
    pooled = spectral.calibrate(fit.reshape(-1, d))
    err = {}
    for name, rot, sc in (("own", own["rotation"], own["scales"]),
                          ("pooled", pooled["rotation"], pooled["scales"])):
        t = spectral.tables(d, dict(bits=2, apply_qjl=False, rotation=rot, scales=sc))
        xh = np.array(spectral.decode(t, spectral.encode(t, mx.array(held))))
        err[name] = np.sum((xh - held) ** 2) / np.sum(held ** 2)
    assert err["own"] < 0.8 * err["pooled"], err


def test_per_head_mismatches_are_value_errors():
    d = 16
    cal = spectral.calibrate_heads(_two_head_keys(300, d)[0])
    t = spectral.tables(d, dict(rotation=cal["rotation"], scales=cal["scales"]))
    with pytest.raises(ValueError, match="2 kv heads"):
        spectral.encode(t, mx.zeros((1, 3, 2, d)))
    with pytest.raises(ValueError, match="2 kv heads"):
        spectral.encode_np(numpy_tables(t), np.zeros((1, 3, 2, d), np.float32))
    c = spectral.encode(t, mx.zeros((1, 2, 2, d)))
    c3 = type(c)(*(mx.concatenate([x, x[:, :1]], axis=1) for x in c))
    with pytest.raises(ValueError, match="2 kv heads"):
        spectral.decode(t, c3)
    with pytest.raises(ValueError, match="2 kv heads"):
        spectral.scores(t, mx.zeros((1, 3, 1, d)), c3)
    four = np.r_[cal["scales"], cal["scales"]]
    with pytest.raises(ValueError, match="rotation holds 2 heads, scales 4"):
        spectral.tables(d, dict(rotation=cal["rotation"], scales=four))
    with pytest.raises(ValueError, match=r"\[tokens, kv_heads, head_dim\]"):
        spectral.calibrate_heads(np.zeros((10, d)))


def test_the_method_installs_a_per_head_calibration_and_refuses_another_head_count():
    import velox
    from velox.methods import spectral as method

    d = 16
    keys = _two_head_keys(300, d)[0]
    cal = spectral.calibrate_heads(keys)
    st = method.calibrated(velox.init("spectral", 1, 2, d, bits=3), cal)
    assert np.array_equal(np.array(st.tables.rotation), cal["rotation"])
    k = mx.array(np.ascontiguousarray(keys[:8].transpose(1, 0, 2))[None])
    st = velox.update(st, k, k)
    t = spectral.tables(d, dict(bits=3, rotation=cal["rotation"], scales=cal["scales"]))
    np.testing.assert_array_equal(np.array(velox.get_kv(st)[0]),
                                  np.array(spectral.decode(t, spectral.encode(t, k))))
    three = {n: np.concatenate([v, v[:1]]) for n, v in cal.items()}
    with pytest.raises(ValueError, match="kv_heads=2"):
        method.calibrated(velox.init("spectral", 1, 2, d), three)
    with pytest.raises(ValueError, match="one basis a kv head"):  # a pooled [d, d] fit
        method.calibrated(velox.init("spectral", 1, 2, d), spectral.calibrate(keys[:, 0]))


def test_uncalibrated_tables_are_shared_by_every_head():
    t = spectral.tables(32, dict(seed=3))
    assert t.rotation.shape == (32, 32) and t.scales.shape == (32,) and t.gains.shape == (32,)


@pytest.mark.parametrize("d", [2, 6, 10, 30, 66])
def test_head_dim_not_a_multiple_of_4_is_refused_at_init(d):
    import velox

    with pytest.raises(ValueError, match="head_dim % 4"):
        velox.init("spectral", 1, 2, d, d_eff=1)

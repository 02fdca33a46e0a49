"""NSNQuant (velox.methods.nsnquant, velox.codecs.nsn): the NSN transform, the Hadamard
rotation, the universal codebook, the payload's bits, the chunk flush, a hand-worked case."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox
from velox.accounting import state_nbytes
from velox.codecs import nsn
from velox.methods import nsnquant

BACKENDS = ("reference", "mlx")
DIMS = st.sampled_from([8, 16, 32, 64])


def gaussian(seed, shape, scale=1.0, offset=0.0):
    rng = np.random.default_rng(seed)
    return (offset + scale * rng.standard_normal(shape)).astype(np.float32)


def f32(x):
    return np.array(x.astype(mx.float32)) if isinstance(x, mx.array) else np.asarray(x, np.float32)


# --- the NSN transform ----------------------------------------------------------------------

@given(d=DIMS, r=st.integers(1, 40), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.05, 1.0, 30.0]), offset=st.sampled_from([0.0, 3.0]))
def test_nsn_normalizes_and_shifts(d, r, seed, scale, offset):
    # channel offsets, as real keys have: the shift removes the chunk's mean
    x = gaussian(seed, (2, 3, r, d), scale) + offset * gaussian(seed + 1, (2, 3, 1, d)) * scale
    for x3, s1, o, s2 in (nsn.nsn(mx.array(x), mx.float16), nsn.nsn_np(x, mx.float16)):
        x3, s1, o, s2 = f32(x3), f32(s1), f32(o), f32(s2)
        root = math.sqrt(d)
        # each token's norm is sqrt(d), up to the float16 rounding of its s2
        norms = np.linalg.norm(x3, axis=-1)
        assert np.allclose(norms[s2[..., 0] > 0], root, rtol=2.0 ** -10)
        # the shifted rows x2 = s2 * x3 have channel mean 0, up to the float16 rounding of o
        x1 = x / s1
        mean_x2 = (s2 * x3).mean(axis=-2)
        assert np.abs(mean_x2).max() <= 2.0 ** -11 * np.abs(x1.mean(axis=-2)).max() + 1e-5
        assert np.allclose(np.linalg.norm(x1, axis=-1), root, rtol=2.0 ** -10)  # s1 rounded too


@given(d=DIMS, r=st.integers(1, 40), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.05, 1.0, 30.0]), side=st.sampled_from(["float16", "bfloat16"]))
def test_nsn_without_vq_round_trips(d, r, seed, scale, side):
    # s1, o, s2 are rounded to their stored dtype before they are used: the inverse is exact up
    # to float32 arithmetic, whatever that dtype's precision
    x = gaussian(seed, (1, 2, r, d), scale, offset=scale)
    sd = getattr(mx, side)
    back = f32(nsn.denormalize(*nsn.nsn(mx.array(x), sd)))
    back_np = nsn.denormalize_np(*nsn.nsn_np(x, sd))
    for y in (back, back_np):
        assert np.allclose(y, x, rtol=1e-5, atol=2e-5 * scale)
    assert f32(nsn.nsn(mx.array(x), sd)[1]).dtype == np.float32 and nsn.nsn(mx.array(x), sd)[1].dtype == sd


def test_zero_and_constant_rows_code_without_nan():
    # s1 = 0 (a zero row) and s2 = 0 (a chunk of one repeated row) reconstruct exactly
    x = np.zeros((1, 1, 4, 8), np.float32)
    x[0, 0, 2:] = 0.5
    for y in (f32(nsn.denormalize(*nsn.nsn(mx.array(x), mx.float16))),
              nsn.denormalize_np(*nsn.nsn_np(x, mx.float16))):
        assert np.array_equal(y, x)
    state = nsnquant.update(nsnquant.init(1, 1, 8, residual_length=4, codebook_size=16,
                                          subvector_dim=4), mx.array(x), mx.array(x))
    assert np.isfinite(np.array(nsnquant.get_kv(state)[0])).all()


# --- the rotation and the codebook ----------------------------------------------------------

@pytest.mark.parametrize("d", [4, 8, 16, 64, 128, 12, 24])
def test_hadamard_forward_then_inverse_is_identity(d):
    h = nsn.rotation(d).astype(np.float64)
    assert np.allclose(h @ h.T, np.eye(d), atol=1e-6)
    x = gaussian(d, (5, d))
    y = f32(nsn.matmul_per_slice(mx.array(x), mx.array(h.T.astype(np.float32))))
    assert np.allclose(y @ h, x, atol=1e-5)
    if d & (d - 1) == 0:  # Sylvester: symmetric, entries +-1 / sqrt(d)
        assert np.array_equal(h, h.T) and np.allclose(np.abs(h), 1 / math.sqrt(d))


@pytest.mark.parametrize("size,sub_dim", [(16, 4), pytest.param(256, 8, marks=pytest.mark.slow)])
def test_codebook_is_deterministic_and_magnitudes_positive(size, sub_dim):
    for magnitude in (False, True):
        cb = nsn.codebook(size, sub_dim, 1234, magnitude)
        assert cb.shape == (size, sub_dim) and cb.dtype == np.float32
        # a fresh fit (not the cached one) gives the same bits; another seed another codebook
        assert np.array_equal(cb, nsn._codebook.__wrapped__(size, sub_dim, 1234, magnitude))
        assert not np.array_equal(cb, nsn.codebook(size, sub_dim, 7, magnitude))
        assert np.allclose(np.linalg.norm(cb, axis=1), math.sqrt(sub_dim), rtol=1e-6)
        assert len(np.unique(cb, axis=0)) == size
        if magnitude:  # the 2-bit codebook lies in the positive orthant
            assert (cb >= 0).all()
        else:  # the 1-bit one covers every orthant's signs
            assert (cb < 0).any() and (cb > 0).any()


def test_bad_codebook_size_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        nsn.codebook(24, 4, 0, False)
    with pytest.raises(ValueError, match="codebook_size"):
        nsnquant.init(1, 1, 64, codebook_size=24)


# --- bytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("size,sub_dim", [(256, 8), (16, 4), (4, 2), (16, 8)])
def test_payload_bits_per_element(bits, size, sub_dim):
    d, r = 64, 8
    state = nsnquant.init(1, 2, d, bits=bits, residual_length=r, codebook_size=size,
                          subvector_dim=sub_dim)
    state = nsnquant.update(state, mx.array(gaussian(0, (1, 2, 3 * r, d))),
                            mx.array(gaussian(1, (1, 2, 3 * r, d))))
    want = math.log2(size) / sub_dim + (1 if bits == 2 else 0)
    assert nsnquant.payload_bits(state) == want
    # the packed codes hold exactly that (d * want is a whole number of uint32 words here)
    assert state.key_codes.nbytes * 8 == 2 * 3 * r * d * want
    if size == 2 ** sub_dim:
        assert want == bits


def test_bytes_by_hand_at_the_defaults():
    # head_dim 64, bits 2, 256 centroids of 8 coordinates, R = 64, 138 tokens: 128 coded, 10 exact
    b, h, d = 1, 3, 64
    state = nsnquant.init(b, h, d)
    x = mx.array(gaussian(2, (b, h, 138, d)))
    state = nsnquant.update(state, x, x)
    assert nsnquant.coded_tokens(state) == 128 and state.residual_keys.shape[2] == 10
    codes = 8 * (8 + 8) // 8  # 8 sub-vectors of an 8-bit index and an 8-bit sign mask: 16 bytes
    scales = 2 * 2            # s1, s2 float16
    means = 2 * d * 2         # two chunks' channel means, float16
    residual = 10 * d * 2     # float16 rows
    per_tensor = 128 * (codes + scales) + means + residual
    next_pos = b * h * 4      # int32
    assert nsnquant.nbytes(state) == state_nbytes(state) == 2 * b * h * per_tensor + next_pos
    # per coded token and tensor: 20 bytes + 128 / 64 of the mean = 22 bytes, 2.75 bits an element
    assert (codes + scales + 2 * d / 64) * 8 / d == 2.75


# --- the chunk flush ------------------------------------------------------------------------

def _same_state(a, b):
    for f in nsnquant.NSNQuantState._fields:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and np.array_equal(np.array(x), np.array(y)), f
        else:
            assert x == y, f


@given(d=DIMS, r=st.integers(1, 20), t=st.integers(1, 70), bits=st.sampled_from([1, 2]),
       split=st.integers(0, 2**16), seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_prefill_equals_token_by_token(d, r, t, bits, split, seed, backend):
    k, v = gaussian(seed, (2, 2, t, d)), gaussian(seed + 1, (2, 2, t, d))
    kw = dict(bits=bits, residual_length=r, codebook_size=16, subvector_dim=4, backend=backend)
    whole = nsnquant.update(nsnquant.init(2, 2, d, **kw), mx.array(k), mx.array(v))
    steps = nsnquant.init(2, 2, d, **kw)
    for i in range(t):
        steps = nsnquant.update(steps, mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
    _same_state(whole, steps)
    # and any split into two chunks: the chunk boundaries are multiples of r either way
    cut = split % (t + 1)
    parts = nsnquant.init(2, 2, d, **kw)
    for lo, hi in ((0, cut), (cut, t)):
        if hi > lo:
            parts = nsnquant.update(parts, mx.array(k[:, :, lo:hi]), mx.array(v[:, :, lo:hi]))
    _same_state(whole, parts)
    assert nsnquant.coded_tokens(whole) == r * (t // r) and whole.key_means.shape[2] == t // r


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flushed_chunk_never_changes(backend):
    r, d = 8, 32
    state = nsnquant.init(1, 2, d, residual_length=r, backend=backend)
    x = gaussian(3, (1, 2, 60, d))
    first = None
    for i in range(60):
        state = nsnquant.update(state, mx.array(x[:, :, i:i + 1]), mx.array(-x[:, :, i:i + 1]))
        if first is None and nsnquant.coded_tokens(state):
            first = [np.array(getattr(state, f)) for f in ("key_codes", "key_scales", "key_means",
                                                           "value_codes", "value_scales", "value_means")]
            decoded = [np.array(a[:, :, :r]) for a in nsnquant.get_kv(state)]
        if first is not None:
            now = [np.array(getattr(state, f)) for f in ("key_codes", "key_scales", "key_means",
                                                         "value_codes", "value_scales", "value_means")]
            for a, b in zip(first, now):
                n = a.shape[2]
                assert np.array_equal(b[:, :, :n], a)
            assert all(np.array_equal(np.array(a[:, :, :r]), b)
                       for a, b in zip(nsnquant.get_kv(state), decoded))
    assert nsnquant.coded_tokens(state) == 56


@pytest.mark.parametrize("residual_dtype", ["model", "float16"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_residual_rows_are_exact(residual_dtype, dtype):
    r, d, t = 16, 32, 45
    cd = getattr(mx, dtype)
    state = nsnquant.init(2, 2, d, dtype=cd, residual_length=r, residual_dtype=residual_dtype)
    k = mx.array(gaussian(4, (2, 2, t, d), 3.0)).astype(cd)
    v = mx.array(gaussian(5, (2, 2, t, d), 3.0)).astype(cd)
    for backend in BACKENDS:
        s = nsnquant.update(state._replace(backend=backend), k[:, :, :20], v[:, :, :20])
        s = nsnquant.update(s, k[:, :, 20:], v[:, :, 20:])
        held = cd if residual_dtype == "model" else mx.float16
        gk, gv = nsnquant.get_kv(s)
        assert s.residual_keys.dtype == held and s.residual_keys.shape[2] == t - 32
        for got, x in ((s.residual_keys, k), (s.residual_values, v)):
            assert np.array_equal(f32(got), f32(x[:, :, 32:].astype(held)))  # bit for bit
        if residual_dtype == "model":  # get_kv returns them untouched
            assert np.array_equal(f32(gk[:, :, 32:]), f32(k[:, :, 32:]))
            assert np.array_equal(f32(gv[:, :, 32:]), f32(v[:, :, 32:]))


# --- quality --------------------------------------------------------------------------------

def _cosines(bits, x):
    state = nsnquant.init(*x.shape[:2], x.shape[-1], bits=bits)
    k = nsnquant.get_kv(nsnquant.update(state, mx.array(x), mx.array(x)))[0]
    y = np.array(k)
    return (x * y).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)


def test_two_bits_reconstruct_better_than_one():
    # Gaussian rows with a channel offset (the shift's work); every token coded (4 chunks of 64)
    x = gaussian(6, (1, 4, 256, 64)) + gaussian(7, (1, 4, 1, 64), 2.0)
    c2, c1 = _cosines(2, x), _cosines(1, x)
    assert c2.mean() > c1.mean() and np.median(c2) > np.median(c1)
    assert c2.mean() > 0.9 and c1.mean() > 0.75  # measured 0.94 and 0.83 on standard normal rows


# --- a hand-worked case ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [1, 2])
def test_hand_worked_chunk(backend, bits):
    # d = 4, one chunk of R = 2 tokens, sub-vectors of 2 coordinates, 4 centroids.
    #   x_a = [2, 0, 0, 0]: ||x_a|| = 2, s1 = 2 / sqrt(4) = 1, x1_a = [2, 0, 0, 0]
    #   x_b = [2, -2, -2, -2]: ||x_b|| = 4, s1 = 2, x1_b = [1, -1, -1, -1]
    #   o = (x1_a + x1_b) / 2 = [1.5, -0.5, -0.5, -0.5]
    #   x2_a = [0.5, 0.5, 0.5, 0.5], x2_b = -x2_a: ||x2|| = 1, s2 = 1 / 2 = 0.5
    #   x3_a = [1, 1, 1, 1], x3_b = [-1, -1, -1, -1]
    #   y = H x3 with H = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2:
    #   y_a = [2, 0, 0, 0], y_b = [-2, 0, 0, 0]; sub-vectors [+-2, 0] and [0, 0]
    x = mx.array([[[[2.0, 0, 0, 0], [2.0, -2, -2, -2]]]])
    state = nsnquant.init(1, 1, 4, bits=bits, residual_length=2, codebook_size=4,
                          subvector_dim=2, residual_dtype="model", backend=backend)
    state = nsnquant.update(state, x, x)
    cb32 = nsn.codebook(4, 2, 1234, bits == 2)
    cb = cb32.astype(np.float64)
    # [0, 0] is at distance ||c||^2 from every centroid: all are sqrt(2) long, up to float32
    # rounding, so the nearest is the centroid of the smallest float32 ||c||^2 (ties: lower)
    z = int(np.argmin((cb32 * cb32).sum(axis=1)))
    assert np.array(state.key_scales.astype(mx.float32)).tolist() == [[[[1.0, 0.5], [2.0, 0.5]]]]
    assert np.array(state.key_means.astype(mx.float32)).tolist() == [[[[1.5, -0.5, -0.5, -0.5]]]]
    if bits == 2:
        # |[+-2, 0]| = [2, 0]: the magnitude centroid of largest first coordinate; the sign
        # mask is bit 0 for y_b's -2; a code is index | mask << 2, 4 bits a sub-vector
        i = int(np.argmax(cb[:, 0]))
        codes = [i | z << 4, (i | 1 << 2) | z << 4]
        c_a = np.concatenate([cb[i], cb[z]])
        c_b = np.concatenate([cb[i] * [-1, 1], cb[z]])
    else:
        # [2, 0]: the signed centroid of largest first coordinate; [-2, 0]: of the smallest
        i, j = int(np.argmax(cb[:, 0])), int(np.argmin(cb[:, 0]))
        codes = [i | z << 2, j | z << 2]
        c_a, c_b = np.concatenate([cb[i], cb[z]]), np.concatenate([cb[j], cb[z]])
    assert np.array(state.key_codes)[0, 0, :, 0].tolist() == codes
    assert np.array_equal(np.array(state.value_codes), np.array(state.key_codes))
    # decoded: s1 * (s2 * H^T c + o)
    hm = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2
    o = np.array([1.5, -0.5, -0.5, -0.5])
    want = np.stack([1 * (0.5 * hm.T @ c_a + o), 2 * (0.5 * hm.T @ c_b + o)])
    k, v = nsnquant.get_kv(state)
    assert np.allclose(np.array(k)[0, 0], want, atol=1e-6)
    assert np.allclose(np.array(v)[0, 0], want, atol=1e-6)


# --- attention on the codes -----------------------------------------------------------------

@given(d=DIMS, r=st.integers(1, 12), t=st.integers(1, 50), bits=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_decode_attention_from_codes_equals_dense(d, r, t, bits, groups, seed):
    # a decode step reads the codes (rotated query, lookup table or signed centroids, the
    # chunk means once): the same attention as over get_kv's decoded rows
    state = nsnquant.init(1, 2, d, bits=bits, residual_length=r, codebook_size=16,
                          subvector_dim=4, residual_dtype="model")
    state = nsnquant.update(state, mx.array(gaussian(seed, (1, 2, t, d), 2.0, 1.0)),
                            mx.array(gaussian(seed + 1, (1, 2, t, d))))
    q = mx.array(gaussian(seed + 2, (1, 2 * groups, 1, d)))
    k, v = mx.array(gaussian(seed + 3, (1, 2, 1, d))), mx.array(gaussian(seed + 4, (1, 2, 1, d)))
    got = nsnquant.attend(state, q, k, v, scale=d ** -0.5)
    sk, sv = nsnquant.get_kv(state)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([sk, k], axis=2),
                                                mx.concatenate([sv, v], axis=2), scale=d ** -0.5)
    assert np.allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)


def test_registered_and_exported():
    assert "nsnquant" in velox.registry.method_keys()
    assert velox.nsnquant_init is nsnquant.init and velox.NSNQuantState is nsnquant.NSNQuantState

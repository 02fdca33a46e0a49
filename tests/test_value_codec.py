"""The value codec of the codec caches (``velox.codec_cache``: ``value_codec``, ``value_bits``).

TurboQuant (mse, prod, rvq), PolarQuant, QJL and SpectralQuant hold their values apart from
their keys: per-token affine codes at ``value_bits`` (8 by default), TurboQuant_mse's codec
(``"mse"``: a rotation of their own, a Lloyd-Max cell a rotated coordinate, a float16 norm) or
exact rows. Here: the mse values' error falls with their bits; attention read from the value
codes (a decode step, a chunk, the step that writes first, the steady step) equals attention
over ``get_kv``'s decoded values; both backends give the same codes; the bytes are the
arrays'; the CUDA kernels decline values they do not read; compositions refuse the
parameters; a prompt-cache file round-trips mse values.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import velox
from velox import codec_cache, decode
from velox.codecs import turboquant as tq
from velox.kernels import codec as codec_kernel
from velox.registry import get_method

METHODS = ("turboquant_mse", "turboquant_prod", "polar", "qjl", "spectral", "turboquant_rvq")
#: The value settings tried: (value_codec, value_bits).
SETTINGS = (("affine", 8), ("affine", 4), ("affine", 3), ("affine", 2), ("mse", 1), ("mse", 2),
            ("mse", 3), ("mse", 4), ("exact", 8))
#: The Gaussian Lloyd-Max distortion a coordinate at 1-4 bits (velox.codecs.turboquant).
LLOYD_MAX = (0.3634, 0.1175, 0.03454, 0.009497)

pytestmark = pytest.mark.filterwarnings("ignore:.*no calibration artifact")


def _rows(rng, *shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def _state(key, setting, *, b=1, h=2, d=32, n=9, seed=0, backend="mlx"):
    """A state of ``n`` tokens, and those tokens' keys and values."""
    rng = np.random.default_rng(seed)
    k, v = _rows(rng, b, h, n, d), _rows(rng, b, h, n, d)
    s = velox.init(key, b, h, d, dtype=mx.float32, backend=backend, value_codec=setting[0],
                   value_bits=setting[1])
    return velox.update(s, k, v), k, v


def _dense(keys, values, q, k, v, scale, causal=False):
    """Softmax attention of ``q [b, hq, s, d]`` over ``keys``/``values`` then the new ``k``/``v``
    rows (float32, NumPy), the new rows causal among themselves where asked."""
    K = np.concatenate([np.array(keys), np.array(k)], axis=2).astype(np.float64)
    V = np.concatenate([np.array(values), np.array(v)], axis=2).astype(np.float64)
    Q = np.array(q).astype(np.float64)
    b, hq, s, d = Q.shape
    g = hq // K.shape[1]
    K, V = np.repeat(K, g, axis=1), np.repeat(V, g, axis=1)
    logits = Q @ K.swapaxes(-1, -2) * scale
    if causal:
        n = K.shape[2] - s
        seen = np.arange(K.shape[2])[None, :] <= n + np.arange(s)[:, None]
        logits = np.where(seen, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ V


def _value_bytes(state) -> int:
    """Bytes of the value codes' arrays, from their shapes and dtypes."""
    return sum(math.prod(x.shape) * x.dtype.size for x in state.value_codes)


def test_defaults_are_the_recorded_layout():
    """The defaults hold what the goldens and the CUDA kernels know: 8-bit affine values (rvq:
    exact), no value tables."""
    for key in METHODS:
        s = velox.init(key, 1, 2, 64)
        exact = key == "turboquant_rvq"
        assert s.value_codec == ("exact" if exact else "affine") and s.value_bits == 8
        assert type(s.value_codes) is (codec_cache.ExactRows if exact else codec_cache.Int8Rows)
        assert s.value_tables == codec_cache.NoTables()


@settings(max_examples=4)
@given(key=st.sampled_from(METHODS[:5]), seed=st.integers(0, 1000))
def test_mse_values_decode_with_an_error_that_falls_with_their_bits(key, seed):
    """Relative squared error of ``get_kv``'s values at 1-4 bits: decreasing, and near the
    Lloyd-Max distortion of a Gaussian coordinate (within 1.5x, float16 norm included)."""
    errs = []
    for bits in (1, 2, 3, 4):
        s, _, v = _state(key, ("mse", bits), h=2, d=64, n=32, seed=seed)
        got = velox.get_kv(s)[1]
        errs.append(float(mx.sum((got - v) ** 2) / mx.sum(v * v)))
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    for e, want in zip(errs, LLOYD_MAX):
        assert e < 1.5 * want, (errs, LLOYD_MAX)


@settings(max_examples=10)
@given(key=st.sampled_from(METHODS), setting=st.sampled_from(SETTINGS),
       d=st.sampled_from([16, 32, 64]), g=st.sampled_from([1, 2]), seed=st.integers(0, 1000))
def test_attention_over_the_value_codes_equals_attention_over_get_kv(key, setting, d, g, seed):
    """A decode step (``attend``), a chunk (causal), the step that writes first
    (``attend_update``) and the steady step (``velox.decode.split_step``, on the state as it
    is and with its count left to its arrays): each equals softmax attention over
    ``get_kv``'s keys and values plus the new rows, to float32 rounding."""
    m = get_method(key)
    s, _, _ = _state(key, setting, b=1, h=2, d=d, n=11, seed=seed)
    keys, values = m.get_kv(s)
    rng = np.random.default_rng(seed + 1)
    scale = d ** -0.5
    for n_new, causal in ((1, False), (5, True)):
        q = _rows(rng, 1, 2 * g, n_new, d)
        k, v = _rows(rng, 1, 2, n_new, d), _rows(rng, 1, 2, n_new, d)
        want = _dense(keys, values, q, k, v, scale, causal)
        outs = [m.attend(s, q, k, v, scale=scale, mask="causal" if causal else None)]
        if n_new == 1:
            outs.append(m.attend_update(s, q, k, v, scale=scale)[0])
            for form in (s, codec_cache.uncounted(s)):
                outs.append(decode.split_step(m, form, q, k, v, scale)[0])
        for out in outs:
            np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-4)


def test_mse_values_are_summed_in_the_rotated_domain():
    """``mse_weighted`` (what attention over mse value codes runs) is the weights times the
    decoded rows, for MLX and the NumPy twin."""
    rng = np.random.default_rng(5)
    t = tq.mse_tables(48, 3, 7)
    rows = _rows(rng, 2, 3, 10, 48)
    codes = tq.mse_encode(t, rows)
    w = _rows(rng, 2, 3, 4, 10)
    want = np.array(w) @ np.array(tq.mse_decode(t, codes))
    np.testing.assert_allclose(np.array(tq.mse_weighted(t, w, codes)), want, rtol=1e-5, atol=1e-5)
    tn = type(t)(*(np.array(x) if isinstance(x, mx.array) else x for x in t))
    cn = type(codes)(*(np.array(x) for x in codes))
    np.testing.assert_allclose(tq.mse_weighted_np(tn, np.array(w), cn), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=8)
@given(key=st.sampled_from(METHODS), setting=st.sampled_from(SETTINGS[:-1]),
       d=st.sampled_from([16, 32, 64]), seed=st.integers(0, 1000))
def test_the_backends_give_the_same_value_codes(key, setting, d, seed):
    """``reference`` (NumPy twins) and ``mlx`` code the values alike: affine codes equal; mse
    codes equal but for a coordinate within float32 rounding of a cell boundary (at most 2% of
    the rows, as the specs allow keys)."""
    a = _state(key, setting, b=2, h=2, d=d, n=13, seed=seed, backend="mlx")[0]
    r = _state(key, setting, b=2, h=2, d=d, n=13, seed=seed, backend="reference")[0]
    assert type(a.value_codes) is type(r.value_codes)
    for x, y in zip(a.value_codes, r.value_codes):
        assert x.dtype == y.dtype and x.shape == y.shape
    if setting[0] == "affine":
        for x, y in zip(a.value_codes, r.value_codes):
            assert np.array_equal(np.array(x), np.array(y))
    else:
        differ = ~np.all(np.array(a.value_codes.idx) == np.array(r.value_codes.idx), axis=-1)
        differ |= np.array(a.value_codes.norm) != np.array(r.value_codes.norm)
        assert differ.sum() <= math.ceil(0.02 * differ.size)
    assert velox.nbytes(a) == velox.nbytes(r)


@pytest.mark.parametrize("key", METHODS)
def test_value_bytes_are_the_arrays_bytes(key):
    """What the value codes hold at head_dim 64 against 8-bit affine codes: 4-bit affine
    codes 36/68 of their bytes (half the codes, the same float16 scale and zero), mse codes at
    4 bits 34/68 (half the codes, a float16 norm), at 2 bits 18/68; the state's ``nbytes``
    counts them (and the mse codec's rotation and codebook, once a state)."""
    n, d = 300, 64
    base, _, _ = _state(key, ("affine", 8), d=d, n=n)
    got = {}
    for setting in (("affine", 8), ("affine", 4), ("mse", 4), ("mse", 2), ("exact", 8)):
        s, _, _ = _state(key, setting, d=d, n=n)
        held = codec_cache.held_codes(s)[1]
        per_token = sum(math.prod(x.shape) * x.dtype.size for x in held) / (2 * n)
        got[setting] = per_token
        tables = sum(x.nbytes for x in s.value_tables if isinstance(x, mx.array))
        assert velox.nbytes(s) - velox.nbytes(base) == _value_bytes(s) - _value_bytes(base) + tables
    assert got[("affine", 8)] == 68
    assert got[("affine", 4)] / got[("affine", 8)] == 36 / 68
    assert got[("mse", 4)] / got[("affine", 8)] == 34 / 68
    assert got[("mse", 2)] / got[("affine", 8)] == 18 / 68
    assert got[("exact", 8)] == 128


@pytest.mark.parametrize("key", ["turboquant_mse", "turboquant_prod", "qjl", "turboquant_rvq"])
def test_the_cuda_kernels_decline_values_they_do_not_read(key):
    """``velox.kernels.codec`` reads 8-bit affine or exact values: its layout (what
    ``supports`` asks beside the device) is None for mse values and affine codes of another
    width, and ``supports`` is false for them (on any machine)."""
    q = mx.zeros((1, 4, 1, 64), mx.float32)
    for setting, taken in ((("affine", 8), True), (("exact", 8), True), (("affine", 4), False),
                           (("affine", 2), False), (("mse", 4), False), (("mse", 8), False)):
        s, _, _ = _state(key, setting, d=64, n=5)
        assert (codec_kernel._layout(s, q) is not None) == taken, setting
        if not taken:
            assert not codec_kernel.supports(s, q)


def test_the_parameters_are_checked_naming_them():
    with pytest.raises(ValueError, match="value_codec"):
        velox.init("turboquant_mse", 1, 2, 32, value_codec="int4")
    with pytest.raises(ValueError, match="value_bits"):
        velox.init("qjl", 1, 2, 32, value_bits=9)
    with pytest.raises(ValueError, match="value_bits"):
        velox.init("polar", 1, 2, 32, value_bits=0)


def test_compositions_hold_8_bit_values_and_refuse_the_parameters():
    """An evictor's slots with codes (``velox.compose``) keep 8-bit affine values; asking a
    composition for another value codec is a ValueError naming the parameter."""
    s = velox.init("tova+turboquant_mse", 1, 2, 32, budget=8)
    rng = np.random.default_rng(0)
    x = _rows(rng, 1, 2, 12, 32)
    s = velox.update(s, x, x)
    assert codec_cache.value_codec(s) == "affine" and codec_cache.value_bits(s) == 8
    assert velox.get_kv(s)[1].shape == (1, 2, 8, 32)
    for name, value in (("value_codec", "mse"), ("value_bits", 4)):
        with pytest.raises(ValueError, match=name):
            velox.init("tova+turboquant_mse", 1, 2, 32, budget=8, **{name: value})


def test_a_prompt_cache_with_mse_values_round_trips(tiny_llama, tmp_path):
    """``save_cache`` / ``load_cache`` of a cache holding mse value codes: the same state, and
    the loaded cache decodes as the saved one."""
    from mlx_lm.generate import generate_step

    from velox.adapters.mlxlm import load_cache, make_cache, save_cache

    prompt = mx.array([1, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20] * 2)

    def greedy(cache, tokens, n):
        return [int(t) for t, _ in generate_step(tokens, tiny_llama, prompt_cache=cache,
                                                 max_tokens=n, prefill_step_size=7)]

    cache = make_cache(tiny_llama, "turboquant_mse", bits=3, value_codec="mse", value_bits=4)
    greedy(cache, prompt, 2)
    save_cache(tmp_path / "mse.safetensors", cache)
    back, _ = load_cache(tmp_path / "mse.safetensors", tiny_llama)
    for a, b in zip(cache, back):
        sa, sb = a.velox_state, b.velox_state
        assert type(sb.value_codes) is tq.MseCodes and type(sb.value_tables) is tq.TurboQuantTables
        assert sb.value_codec == "mse" and sb.value_bits == 4
        for x, y in zip((*sa.value_codes, *sa.value_tables[:3]), (*sb.value_codes, *sb.value_tables[:3])):
            assert x.dtype == y.dtype and np.array_equal(np.array(x), np.array(y))
        for x, y in zip(velox.get_kv(sa), velox.get_kv(sb)):
            assert np.array_equal(np.array(x), np.array(y))
    nxt = mx.array([3])
    assert greedy(back, nxt, 3) == greedy(cache, nxt, 3)

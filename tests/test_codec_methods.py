"""The codec-key caches (``velox.codec_cache``): attention on the codes, bytes by hand.

For each method built on a key codec: ``attend`` equals softmax over the codec's ``scores`` of
the stored tokens and the exact logits of the new ones, times the dequantized values and the new
values; prefill chunks larger than a query block give what one block gives; the state's bytes
equal the hand count of codes, norms, value codes and tables at the defaults (head_dim 64 and
128) within 1%; ``benchmarks/codec_bytes.py`` runs.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import codec_cache
from velox.registry import get_method, method_keys


def _words(bits: int) -> int:
    """Bytes of ``bits`` bits packed into whole uint32 words."""
    return 4 * math.ceil(bits / 32)


def _value_bytes(d: int) -> int:
    return d + 2 + 2  # 8-bit codes, float16 scale and zero


def _qjl(d: int) -> tuple[int, int]:
    m = d  # jl_dim 0: m = head_dim
    return _words(m) + 2 + _value_bytes(d), _words(m) * 8 * d * 4


def _polar(d: int) -> tuple[int, int]:
    bits, level1, block = 2, 4, 16
    angle_bits = d // 2 * level1 + (d // 2 - d // block) * bits
    return math.ceil(angle_bits / 8) + 2 * (d // block) + _value_bytes(d), d * d * 4


def _turboquant_mse(d: int) -> tuple[int, int]:
    return d * 2 // 8 + 2 + _value_bytes(d), d * d * 4  # bits 2, float16 norm


def _turboquant_rvq(d: int) -> tuple[int, int]:
    return 2 * (d * 2 // 8) + 2 + 2 + 2 * d, d * d * 4  # two streams, norm, gain; exact fp16 values


def _turboquant_prod(d: int) -> tuple[int, int]:
    m = d  # bits 2: one MSE bit, jl_dim 0 -> m = head_dim
    return d // 8 + 2 + _words(m) + 2 + _value_bytes(d), d * d * 4 + _words(m) * 8 * d * 4


def _spectral(d: int) -> tuple[int, int]:
    m = 4  # d_eff 4, jl_dim 0 -> m = d_eff
    return d * 2 // 8 + 2 + math.ceil(m / 8) + 2 + _value_bytes(d), d * d * 4 + 2 * d * 4 + m * 4 * 4


# key -> head_dim -> (bytes a token and head at the defaults, bytes of the tables)
HAND = {"qjl": _qjl, "polar": _polar, "turboquant_mse": _turboquant_mse,
        "turboquant_rvq": _turboquant_rvq, "turboquant_prod": _turboquant_prod,
        "spectral": _spectral}

CODEC_KEYS = [k for k in method_keys() if k in HAND]


def _make(key, d, n, *, b=1, h=2, seed=0, dtype=mx.float32, **params):
    m = get_method(key)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32) * 0.5).astype(dtype)
    v = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32)).astype(dtype)
    st = m.init(b, h, d, dtype=dtype, **params)
    st = m.update(st, k[:, :, : n - 2], v[:, :, : n - 2])
    for t in range(n - 2, n):
        st = m.update(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
    return m, st


def _by_hand(state, queries, keys, values, scale, mask):
    """softmax([scores(q * scale, codes) ; exact new logits]) @ [dequantized values ; new]."""
    codec = codec_cache.codec_of(state)
    b, hq, s, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    q = (queries.astype(mx.float32) * scale).reshape(b, h, g * s, d)
    stored = codec.scores(state.tables, q, codec_cache.held_codes(state)[0])  # the tokens held
    new = q @ keys.astype(mx.float32).swapaxes(-1, -2)
    if mask == "causal":
        row = (np.arange(g * s) % s)[:, None]
        new = mx.where(mx.array(np.arange(s)[None, :] <= row), new, -mx.inf)
    p = mx.softmax(mx.concatenate([stored, new], axis=-1), axis=-1, precise=True)
    _, v = velox.get_kv(state)
    vals = mx.concatenate([v.astype(mx.float32), values.astype(mx.float32)], axis=2)
    return (p @ vals).reshape(b, hq, s, d)


@pytest.mark.parametrize("key", CODEC_KEYS)
@pytest.mark.parametrize("s", [1, 5])
def test_attend_is_softmax_of_scores_times_values(key, s):
    m, st = _make(key, 32, 40, seed=1)
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((1, 4, s, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, s, 32)).astype(np.float32) * 0.5)
    v = mx.array(rng.standard_normal((1, 2, s, 32)).astype(np.float32))
    mask = "causal" if s > 1 else None
    got = m.attend(st, q, k, v, scale=32 ** -0.5, mask=mask)
    want = _by_hand(st, q, k, v, 32 ** -0.5, mask)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("key", CODEC_KEYS)
def test_attend_blocks_equal_one_block(key, monkeypatch):
    """A chunk of more query rows than a block gives what a single block gives."""
    m, st = _make(key, 16, 20, seed=3)
    rng = np.random.default_rng(4)
    s = 9
    q = mx.array(rng.standard_normal((1, 4, s, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, s, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, s, 16)).astype(np.float32))
    whole = m.attend(st, q, k, v, scale=0.25, mask="causal")
    monkeypatch.setattr(codec_cache, "QUERY_BLOCK", 4)
    blocks = m.attend(st, q, k, v, scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(blocks), np.array(whole), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("key", CODEC_KEYS)
def test_attend_on_an_empty_cache(key):
    m = get_method(key)
    st = m.init(1, 2, 16)
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((1, 2, 3, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 3, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 3, 16)).astype(np.float32))
    got = m.attend(st, q, k, v, scale=0.25, mask="causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key", CODEC_KEYS)
@pytest.mark.parametrize("d", [64, 128])
def test_bytes_by_hand(key, d):
    b, h, n = 1, 2, 300
    _, st = _make(key, d, n, b=b, h=h, dtype=mx.float16)
    per_token, tables = HAND[key](d)
    rows = codec_cache.capacity(st)  # the tokens' rows and the empty ones after them (chunks)
    assert rows == 512 and codec_cache.stored_tokens(st) == n
    hand = b * h * rows * per_token + tables + b * h * 4  # + next_pos
    got = velox.nbytes(st)
    assert abs(got - hand) <= 0.01 * hand, (key, d, got, hand)
    assert got == velox.state_nbytes(st)


@pytest.mark.parametrize("key", CODEC_KEYS)
def test_every_token_kept_in_order(key):
    m, st = _make(key, 32, 11, b=2, h=3)
    assert np.array_equal(np.array(m.positions(st)), np.broadcast_to(np.arange(11), (2, 3, 11)))
    k, v = m.get_kv(st)
    assert k.shape == v.shape == (2, 3, 11, 32)


@pytest.mark.parametrize("key", CODEC_KEYS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_model_dtype_in_and_out(key, dtype):
    m, st = _make(key, 32, 6, dtype=dtype)
    k, v = m.get_kv(st)
    assert k.dtype == v.dtype == dtype


def test_codec_bytes_benchmark_short_run(capsys):
    """``benchmarks/codec_bytes.py`` prints a row per method at its defaults, fp16 and KIVI."""
    import runpy
    from pathlib import Path

    mod = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "codec_bytes.py"))
    assert mod["main"](["--tokens", "64", "--dim", "32"]) == 0
    out = capsys.readouterr().out
    for key in CODEC_KEYS:
        assert f"| {key} | defaults |" in out
    assert "| fp16 |" in out and "| kivi |" in out

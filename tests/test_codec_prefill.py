"""A codec cache's chunk attention (a prefill: ``velox.codec_cache._chunk_attend``, the stored
keys decoded once and MLX's fused attention) equals the attention on the codes (each query
block scored against the key codes, the path of a decode step) to float32 rounding, for every
codec cache and a channel split, with and without the causal mask."""

import mlx.core as mx
import numpy as np
import pytest

import velox  # noqa: F401
from velox import codec_cache as cc
from velox.registry import get_method

CODECS = [("turboquant_mse", {}), ("turboquant_prod", {}), ("turboquant_rvq", {}), ("polar", {}),
          ("qjl", {}), ("spectral", {}), ("turboquant_mse", {"n_outlier": 8})]


@pytest.mark.filterwarnings("ignore:.*no calibration artifact")
@pytest.mark.parametrize("key,params", CODECS, ids=[f"{k}{'-split' if p else ''}" for k, p in CODECS])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_chunk_attention_is_the_attention_on_the_codes(key, params, mask):
    mx.random.seed(1)
    b, h, hq, d, s = 2, 2, 4, 64, 24
    m = get_method(key)
    state = m.init(b, h, d, dtype=mx.float32, backend="mlx", **params)
    state = m.update(state, mx.random.normal((b, h, 40, d)), mx.random.normal((b, h, 40, d)))
    q, k, v = (mx.random.normal((b, hq, s, d)), mx.random.normal((b, h, s, d)),
               mx.random.normal((b, h, s, d)))
    got = m.attend(state, q, k, v, scale=d ** -0.5, mask=mask)  # s > 1: the chunk path
    held = mx.full((b, h), cc.stored_tokens(state), mx.int32)  # a count array: the code path
    want = cc._attend(state, held, q, k, v, d ** -0.5, mask)
    assert got.shape == want.shape == (b, hq, s, d)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("key", ["turboquant_mse", "turboquant_prod"])
def test_chunk_attention_of_a_half_precision_model_runs_in_its_dtype(key):
    """A bfloat16 model's chunk: the decoded rows in bfloat16 (as a full cache holds them;
    MLX's fused prefill attention on a GPU takes half precision only), the output within
    bfloat16 rounding of the float32 attention on the codes."""
    mx.random.seed(2)
    b, h, hq, d, s = 1, 2, 4, 64, 16
    m = get_method(key)
    state = m.init(b, h, d, dtype=mx.bfloat16, backend="mlx")
    state = m.update(state, mx.random.normal((b, h, 48, d)).astype(mx.bfloat16),
                     mx.random.normal((b, h, 48, d)).astype(mx.bfloat16))
    q, k, v = (mx.random.normal(shape).astype(mx.bfloat16)
               for shape in ((b, hq, s, d), (b, h, s, d), (b, h, s, d)))
    got = m.attend(state, q, k, v, scale=d ** -0.5, mask="causal")
    assert got.dtype == mx.bfloat16
    held = mx.full((b, h), cc.stored_tokens(state), mx.int32)
    want = cc._attend(state, held, q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                      d ** -0.5, "causal")
    err = np.abs(np.array(got.astype(mx.float32)) - np.array(want))
    assert err.max() < 0.05 and err.mean() < 0.01, (err.max(), err.mean())

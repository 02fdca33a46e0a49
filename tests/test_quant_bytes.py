"""No quantizer holds more bytes than an fp16 cache of the same tokens, at its defaults.

After 2048 tokens (a 2016-token prefill chunk, then 32 decode steps), enough to amortise
every method's fixed exact windows (KIVI's 128 to 159 residual tokens, SKVQ's 5 sinks and
128-token window, groups of 32 waiting exact), in a float32 and in a float16 cache, at head
dims 64 and 128. Side data (scales, zeros) is float16 and exact rows are held in float16 by
default whatever the model's dtype, so a float32 model's cache is no larger than a float16
one's.
"""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.registry import get_method, method_keys
from velox.testing import test_params

QUANTIZERS = ["adakv", "age_tiered", "amc", "cachegen", "gear", "kitty", "kivi", "kivi_sink",
              "kvquant", "skvq", "zipcache", "polar", "qjl", "spectral", "turboquant_mse",
              "turboquant_prod", "turboquant_rvq", "nsnquant", "vecinfer", "kvtc", "xquant"]
# Quantizers that hold more than an fp16 cache by design, and why.
ABOVE_FP16 = {"a2ats": "it keeps every token's exact rows beside their codes (its retrieval "
                       "reads the top fraction exactly)"}
TOKENS, DECODE = 2048, 32


def test_every_quantizer_is_listed():
    family = {k for k in method_keys() if get_method(k).spec.family == "quantization"}
    assert family <= set(QUANTIZERS) | set(ABOVE_FP16)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("key", QUANTIZERS)
def test_bytes_at_most_fp16(key, dtype, head_dim):
    dt = getattr(mx, dtype)
    b, h = 1, 2
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((b, h, TOKENS, head_dim)).astype(np.float32)).astype(dt)
    v = mx.array(rng.standard_normal((b, h, TOKENS, head_dim)).astype(np.float32)).astype(dt)
    st = velox.init(key, b, h, head_dim, dtype=dt, **test_params(key))
    n = TOKENS - DECODE
    st = velox.update(st, k[:, :, :n], v[:, :, :n])
    for t in range(n, TOKENS):
        st = velox.update(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
    held, fp16 = velox.nbytes(st), velox.fp16_bytes(TOKENS, b, h, head_dim)
    assert held <= fp16, f"{key} holds {held} bytes, an fp16 cache {fp16} ({held / fp16:.2f}x)"
    ks, vs = velox.get_kv(st)
    assert ks.dtype == dt and vs.dtype == dt

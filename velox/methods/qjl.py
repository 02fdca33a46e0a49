"""QJL: keys as 1-bit signs of a Gaussian sketch and their norm, values per-token codes
(8-bit affine by default).

A key ``k`` is held as ``sign(S k)`` (``m = jl_dim`` bits, packed 32 to a uint32 word) and
``||k||`` (float16), with ``S [m, d]`` i.i.d. Gaussian drawn from ``seed`` (the codec
``velox.codecs.qjl``). The query is projected but not quantized: attention logits over the
stored tokens are the unbiased asymmetric estimate ``sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>``
read from the packed bits (``attend``). ``get_kv`` returns the estimator's implied keys
``sqrt(pi/2) / m * ||k|| * S^T sign(S k)`` (an unbiased estimate of each key, not a
reconstruction within a bound) and the dequantized values.

Values: per-token 8-bit affine codes by default (about 8.5 bits an element at head_dim 64,
whatever ``bits`` says of the keys); ``value_codec`` and ``value_bits`` set them apart from the
keys (``velox.codec_cache``: affine codes of any width, TurboQuant_mse's codec, or exact rows).
Every token is kept; both backends (``mlx``, ``reference``: the codecs' NumPy twins) give the
same codes. Built by ``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import codec_cache
from ..codecs.qjl import QJLCodes, QJLTables

__all__ = ["QJLState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         jl_dim: int = 0, seed: int = 42, value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "QJLState":
    """Empty QJL state.

    Args:
        jl_dim: sketch size m (sign bits per key); 0 means m = head_dim (the seed's default,
            cheap but noisy: the estimate's variance falls as 1/m).
        seed: seed of the Gaussian sketch S (NumPy's default_rng).
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(QJLState, locals())


QJLState = codec_cache.state_type(
    "QJLState", init, "QJL key signs and norms, values (per-token codes or exact rows), the sketch.",
    codec="qjl", codes=QJLCodes, tables=QJLTables)
State = QJLState
method = codec_cache.register_method("qjl", QJLState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

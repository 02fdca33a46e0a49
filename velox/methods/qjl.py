"""QJL: keys as 1-bit signs of a Gaussian sketch and their norm, values per-token codes
(8-bit affine by default).

A key ``k`` is held as ``sign(S k)`` (``m = jl_dim`` bits, packed 32 to a uint32 word) and
``||k||`` (float16), with ``S [m, d]`` i.i.d. Gaussian drawn from ``seed`` (the codec
``velox.codecs.qjl``). The query is projected but not quantized: attention logits over the
stored tokens are the unbiased asymmetric estimate ``sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>``
read from the packed bits (``attend``). ``get_kv`` returns the estimator's implied keys
``sqrt(pi/2) / m * ||k|| * S^T sign(S k)`` (an unbiased estimate of each key, not a
reconstruction within a bound) and the dequantized values.

Values (``value_codec``, ``value_bits``; ``velox.codec_cache``): by default per-token 8-bit
affine codes (one group a row, float16 scale and zero: about 8.5 bits an element at head_dim
64, whatever ``bits`` says of the keys); ``value_bits`` sets their width (1-8), and
``value_codec="mse"`` holds them with TurboQuant_mse's own codec instead, as the paper quantizes
values (its own rotation, from ``seed + 4``; ``value_bits`` bits a rotated coordinate and a
float16 norm), so that keys and values take separate budgets (``bits=4, value_bits=2``).
Attention over mse values sums the weighted centroids in the rotated domain and rotates the
sum back once; ``"exact"`` holds float16 rows. Every token is kept; both backends (``mlx``,
``reference``: the codecs' NumPy twins) give the same codes. Built by ``velox.codec_cache``.
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
        value_codec: how values are held: "affine" (per-token affine codes, one group a row,
            float16 scale and zero, at value_bits), "mse" (TurboQuant_mse's codec: rotated by
            a random rotation drawn from seed + 4, each rotated coordinate's Gaussian Lloyd-Max
            cell at value_bits, float16 norm; attention sums the weighted codes in the rotated
            domain and rotates back once) or "exact" (float16 rows, bfloat16 for a bfloat16
            cache; value_bits is not read).
        value_bits: bits per value element of the "affine" or "mse" codes, 1 to 8.
    """
    return codec_cache.empty(QJLState, locals())


QJLState = codec_cache.state_type(
    "QJLState", init, "QJL key signs and norms, values (per-token codes or exact rows), the sketch.",
    codec="qjl", codes=QJLCodes, tables=QJLTables)
State = QJLState
method = codec_cache.register_method("qjl", QJLState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

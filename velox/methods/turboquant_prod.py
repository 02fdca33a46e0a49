"""TurboQuant_prod: TurboQuant's unbiased inner-product quantizer of keys (the MSE stage at
``bits - 1`` bits plus a 1-bit QJL sketch of its residual), values per-token codes
(8-bit affine by default).

A key ``k`` is rotated by a random orthogonal matrix from ``seed`` and coded with the Gaussian
Lloyd-Max codebook at ``bits - 1`` bits a coordinate (float16 norm); the residual ``r = k -
x_mse`` is held as ``sign(S r)`` (``m = jl_dim`` bits, packed) and ``||r||`` (float16). The
codec is ``velox.codecs.prod`` (``"turboquant_prod"``). Attention logits over the stored tokens
are the unbiased estimate ``<q, x_mse> + sqrt(pi/2) / m * ||r|| * <S q, sign(S r)>``, the query
rotated and projected once (``attend``); ``get_kv`` returns the estimator's implied keys (an
unbiased estimate of each key, not a reconstruction within a bound).

Outlier channels (``n_outlier > 0``, the paper's fractional bit widths): per (batch row, kv
head) the ``n_outlier`` channels of largest mean squared magnitude over the keys of the first
update that holds tokens (ties: the lower channel index) are chosen then and kept
(``key_channels``); they and the other channels are coded by two instances of the codec, each
its own rotation and sketch of its own dimension, the outliers at ``outlier_bits``
(``velox.codecs.split``; ``velox.codec_cache``). Each part's estimate is unbiased for its share of
``q . k``, so the logits stay unbiased.

Values: per-token 8-bit affine codes by default (about 8.5 bits an element at head_dim 64,
whatever ``bits`` says of the keys); ``value_codec`` and ``value_bits`` set them apart from the
keys (``velox.codec_cache``: affine codes of any width, TurboQuant_mse's codec, or exact rows).
Every token is kept; both backends (``mlx``, ``reference``: the codecs' NumPy twins) give the
same codes. Built by ``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import codec_cache
from ..codecs.prod import TurboQuantProdCodes, TurboQuantProdTables

__all__ = ["TurboQuantProdState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, jl_dim: int = 0, seed: int = 42, n_outlier: int = 0,
         outlier_bits: int = 0, value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "TurboQuantProdState":
    """Empty TurboQuant_prod state.

    Args:
        bits: total bits per key coordinate: bits - 1 for the Lloyd-Max stage, plus the QJL
            sketch of its residual.
        jl_dim: QJL sketch size m; 0 means the seed's rule, m = head_dim at 2 bits, else
            min(head_dim, 64). With outlier channels, each part's sketch size (0: the rule
            for the part's own dimension and bits).
        seed: seed of the random rotation (the residual's sketch uses seed + 1).
        n_outlier: outlier channels per (batch row, kv head): the n_outlier channels of largest
            mean squared magnitude over the keys of the first update that holds tokens (ties:
            lower channel index first), kept from then on and coded by their own instance of
            the codec at outlier_bits (its own rotation, seed + 2, and sketch, seed + 3); the
            rest at bits. 0: no split.
        outlier_bits: bits of the outlier channels; 0 means the same as bits.
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(TurboQuantProdState, locals())


TurboQuantProdState = codec_cache.state_type(
    "TurboQuantProdState", init, "TurboQuant_prod key indices, norms, residual signs and norms, "
    "values (per-token codes or exact rows), the rotation, codebook and sketch.", codec="turboquant_prod",
    codes=TurboQuantProdCodes, tables=TurboQuantProdTables, split=True)
State = TurboQuantProdState
method = codec_cache.register_method("turboquant_prod", TurboQuantProdState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

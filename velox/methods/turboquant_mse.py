"""TurboQuant_mse: randomly rotated keys quantized coordinate by coordinate with the Gaussian
Lloyd-Max codebook; values per-token affine codes (8-bit by default) or mse codes.

A key ``x`` is held as ``||x||`` (float16) and the Lloyd-Max cell (``bits`` bits, packed) of
each coordinate of ``R x * sqrt(d) / ||x||``, ``R`` a random orthogonal matrix from ``seed``
(randomized Walsh-Hadamard for power-of-two ``head_dim``): the codec
``velox.codecs.turboquant`` (``"turboquant_mse"``). Attention logits over the stored tokens
rotate the query once and look up the centroids (``attend``); they are ``q . decode(k)``, which
minimizes the mean squared error and is biased toward 0 at low bits.

Outlier channels (``n_outlier > 0``, the paper's fractional bit widths): per (batch row, kv
head) the ``n_outlier`` channels of largest mean squared magnitude over the keys of the first
update that holds tokens (ties: the lower channel index) are chosen then and kept
(``key_channels``); they and the other channels are coded by two instances of the codec, each
its own rotation of its own dimension, the outliers at ``outlier_bits`` (``velox.codecs.split``;
``velox.codec_cache``).

Values: per-token 8-bit affine codes by default (about 8.5 bits an element at head_dim 64,
whatever ``bits`` says of the keys); ``value_codec`` and ``value_bits`` set them apart from the
keys (``velox.codec_cache``: affine codes of any width, TurboQuant_mse's codec, or exact rows).
Every token is kept; both backends (``mlx``, ``reference``: the codecs' NumPy twins) give the
same codes. Built by ``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import codec_cache
from ..codecs.turboquant import MseCodes, TurboQuantTables

__all__ = ["TurboQuantMseState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, seed: int = 42, n_outlier: int = 0, outlier_bits: int = 0,
         value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "TurboQuantMseState":
    """Empty TurboQuant_mse state.

    Args:
        bits: bits per rotated key coordinate (Gaussian Lloyd-Max codebook).
        seed: seed of the random rotation (NumPy's default_rng).
        n_outlier: outlier channels per (batch row, kv head): the n_outlier channels of largest
            mean squared magnitude over the keys of the first update that holds tokens (ties:
            lower channel index first), kept from then on and coded by their own instance of
            the codec at outlier_bits (its own rotation, seed + 2); the rest at bits. 0: no
            split.
        outlier_bits: bits of the outlier channels; 0 means the same as bits.
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(TurboQuantMseState, locals())


TurboQuantMseState = codec_cache.state_type(
    "TurboQuantMseState", init, "TurboQuant_mse key indices and norms, values (per-token codes or exact rows), "
    "the rotation and codebook.", codec="turboquant_mse", codes=MseCodes, tables=TurboQuantTables, split=True)
State = TurboQuantMseState
method = codec_cache.register_method("turboquant_mse", TurboQuantMseState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

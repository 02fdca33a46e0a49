"""TurboQuant RVQ: rotated keys in two Lloyd-Max stages (Gaussian, then Laplacian on the
residual), values held exact by default.

A key ``x`` is rotated by a random orthogonal matrix from ``seed`` (randomized Walsh-Hadamard
for power-of-two ``head_dim``) and scaled to unit-variance coordinates; stage 1 quantizes each
coordinate with the Gaussian Lloyd-Max codebook at ``bits`` bits, stage 2 the residual with the
Laplacian Lloyd-Max codebook at ``bits`` bits scaled by a per-row least-squares gain (float16),
so stage 2 never increases a key's error. Both index streams are packed; the norm is float16.
The codec is ``velox.codecs.turboquant`` (``"turboquant_rvq"``); attention logits over the
stored tokens rotate the query once and look up both stages' centroids (``attend``).

Outlier channels (``n_outlier > 0``, the paper's fractional bit widths): per (batch row, kv
head) the ``n_outlier`` channels of largest mean squared magnitude over the keys of the first
update that holds tokens (ties: the lower channel index) are chosen then and kept
(``key_channels``); they and the other channels are coded by two instances of the codec, each
its own rotation of its own dimension, the outliers at ``outlier_bits`` (``velox.codecs.split``;
``velox.codec_cache``).

Values are held exact by default, in float16 (bfloat16 for a bfloat16 cache), as the seed
holds them; ``value_codec`` ``"affine"`` or ``"mse"`` (with ``value_bits``, 1-8) codes them
instead, as the other codec caches do (``velox.codec_cache``; mse values: their own rotation,
from ``seed + 4``, summed in the rotated domain by attention). Every token is kept; both
backends (``mlx``, ``reference``: the codecs' NumPy twins) give the same codes. Built by
``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import codec_cache
from ..codecs.turboquant import RvqCodes, RvqTables

__all__ = ["TurboQuantRvqState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, seed: int = 42, n_outlier: int = 0, outlier_bits: int = 0,
         value_codec: str = "exact", value_bits: int = 8,
         backend: str = "auto") -> "TurboQuantRvqState":
    """Empty TurboQuant RVQ state.

    Args:
        bits: bits per rotated key coordinate in each of the two stages (2 * bits a
            coordinate in all).
        seed: seed of the random rotation (NumPy's default_rng).
        n_outlier: outlier channels per (batch row, kv head): the n_outlier channels of largest
            mean squared magnitude over the keys of the first update that holds tokens (ties:
            lower channel index first), kept from then on and coded by their own instance of
            the codec at outlier_bits (its own rotation, seed + 2); the rest at bits. 0: no
            split.
        outlier_bits: bits of the outlier channels; 0 means the same as bits.
        value_codec: how values are held, "exact" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(TurboQuantRvqState, locals())


TurboQuantRvqState = codec_cache.state_type(
    "TurboQuantRvqState", init, "TurboQuant RVQ key indices (two stages), norms and gains, values "
    "(exact rows by default), the rotation and codebooks.", codec="turboquant_rvq", codes=RvqCodes,
    tables=RvqTables, values="exact", split=True)
State = TurboQuantRvqState
method = codec_cache.register_method("turboquant_rvq", TurboQuantRvqState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

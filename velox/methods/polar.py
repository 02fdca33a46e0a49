"""PolarQuant: keys as recursive polar angles of randomly rotated blocks, values per-token codes
(8-bit affine by default).

A key is rotated by a random orthogonal matrix (from ``seed``), split into blocks of ``block``
coordinates, and each block goes through ``log2(block)`` levels of the polar transform: level 1
pairs coordinates into a radius and an angle in ``[0, 2 pi)`` quantized uniformly at
``level1_bits`` bits; higher levels pair radii into angles in ``[0, pi/2]`` quantized at
``bits`` bits with the Lloyd-Max codebook of their known density. Only each block's final
radius is stored (float16): no per-block scale or zero. The codec is ``velox.codecs.polar``
(one packed bit stream of angle codes a key); attention logits over the stored tokens rotate the
query once and read the keys in the rotated basis (``attend``).

Values: per-token 8-bit affine codes by default (about 8.5 bits an element at head_dim 64,
whatever ``bits`` says of the keys); ``value_codec`` and ``value_bits`` set them apart from the
keys (``velox.codec_cache``: affine codes of any width, TurboQuant_mse's codec, or exact rows).
Every token is kept; both backends (``mlx``, ``reference``: the codecs' NumPy twins) give the
same codes. Built by ``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import codec_cache
from ..codecs.polar import PolarCodes, PolarTables

__all__ = ["PolarState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, level1_bits: int = 4, block: int = 16, seed: int = 42,
         value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "PolarState":
    """Empty PolarQuant state.

    Args:
        bits: bits per angle of levels 2 and up (Lloyd-Max codebooks of each level's density).
        level1_bits: bits per level-1 angle (uniform over [0, 2 pi)).
        block: coordinates per polar block (a power of two dividing head_dim); log2(block)
            levels, one float16 radius a block.
        seed: seed of the random rotation (NumPy's default_rng).
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(PolarState, locals())


PolarState = codec_cache.state_type(
    "PolarState", init, "PolarQuant angle codes and block radii, values (per-token codes or exact rows), the "
    "rotation and codebooks.", codec="polar", codes=PolarCodes, tables=PolarTables)
State = PolarState
method = codec_cache.register_method("polar", PolarState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

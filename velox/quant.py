"""Group quantization with real bit packing (MLX), in MLX's affine layout.

Groups run along the last axis: each group of ``group_size`` values gets a ``scale`` and a
``zero`` (the group minimum); codes ``q = round((x - zero) / scale)`` in ``[0, 2**bits - 1]``
are packed as a little-endian bit stream into ``uint32`` words: code ``i`` occupies bits
``[i*bits, (i+1)*bits)``. This is the layout of ``mx.quantize``, so packed keys and values
can feed ``mx.quantized_matmul`` directly. Scales and zeros (side data) are stored in
:func:`side_dtype` of the cache dtype, float16 (bfloat16 for a bfloat16 cache, whose range
float16 lacks), whatever the model's precision, and the codes are computed against the stored
(rounded) scale and zero. :func:`exact_dtype` resolves a method's ``residual_dtype``
parameter, the precision of the rows it keeps exact.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ._typing import Array, Float, Int, UInt

__all__ = ["SUPPORTED_BITS", "every_position", "affine_codes", "RESIDUAL_DTYPES", "pack", "unpack", "quantize", "dequantize",
           "dequantize_f32", "error_bound", "unit_roundoff", "side_dtype", "exact_dtype",
           "rounding_bound", "dtype_name", "dtype_of"]

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)

#: Values of a method's ``residual_dtype`` parameter ("model": the cache dtype itself).
RESIDUAL_DTYPES = ("float16", "bfloat16", "float32", "model")

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def side_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Precision of scales, zeros and other side data for a cache of ``dtype``.

    float16 for float16 and float32 caches (a float32 model's side data costs what an fp16
    cache's does); bfloat16 for a bfloat16 cache (its values may exceed float16's 65504).
    """
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def exact_dtype(residual_dtype: str, dtype: mx.Dtype) -> mx.Dtype:
    """The dtype exact rows are held in: ``residual_dtype`` by name, or ``dtype`` for "model"."""
    if residual_dtype == "model":
        return dtype
    if residual_dtype not in _DTYPES:
        raise ValueError(f"residual_dtype={residual_dtype!r} is not one of {RESIDUAL_DTYPES}")
    return _DTYPES[residual_dtype]


def dtype_name(dtype: mx.Dtype) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"``."""
    return next(k for k, v in _DTYPES.items() if v == dtype)


def dtype_of(name: str) -> mx.Dtype:
    """Inverse of :func:`dtype_name`."""
    return _DTYPES[name]


def rounding_bound(x: Float[Array, "*batch"], dtype: mx.Dtype) -> Float[Array, "*batch"]:
    """Bound on ``|x0 - x|`` for rows ``x`` stored by rounding ``x0`` (of ``dtype``) to
    ``x.dtype``: zero when nothing was rounded; subnormal spacing included."""
    if x.dtype == dtype or x.dtype == mx.float32:
        return mx.zeros(x.shape, mx.float32)
    tiny = {mx.float16: 2.0 ** -25, mx.bfloat16: 2.0 ** -134}[x.dtype]
    return unit_roundoff(x.dtype) * mx.abs(x.astype(mx.float32)) * (1 + 2.0 ** -10) + tiny


def unit_roundoff(dtype: mx.Dtype) -> float:
    """Half the spacing of ``dtype`` at 1: the relative error of one rounding."""
    return {mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8, mx.float32: 2.0 ** -24}[dtype]


def _word_layout(bits: int):
    """For the 32 codes of one packing unit (``bits`` words): word, shift, spill per code."""
    out = []
    for i in range(32):
        start = i * bits
        word, shift = divmod(start, 32)
        out.append((word, shift, shift + bits > 32))
    return out


def pack(codes: UInt[Array, "*batch m"], bits: int) -> UInt[Array, "*batch w"]:
    """Pack ``m`` codes of ``bits`` bits each (``m * bits`` divisible by 32) into uint32 words."""
    m = codes.shape[-1]
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not one of {SUPPORTED_BITS}")
    if (m * bits) % 32 or (32 % bits and m % 32):
        unit = 32 // bits if 32 % bits == 0 else 32
        raise ValueError(f"cannot pack {m} codes of {bits} bits: need a multiple of {unit}")
    lead = codes.shape[:-1]
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (mx.arange(per, dtype=mx.uint32) * bits)
        return (codes.reshape(*lead, m // per, per) << shifts).sum(axis=-1).astype(mx.uint32)
    return pack_units(codes.reshape(*lead, m // 32, 32), bits).reshape(*lead, m * bits // 32)


def pack_units(units: mx.array, bits: int) -> mx.array:
    """Units of 32 codes ``uint32 [..., u, 32]`` of ``bits`` bits each as ``bits`` words a unit,
    ``[..., u, bits]`` (code ``i`` of a unit in bits ``[i*bits, (i+1)*bits)`` of its stream)."""
    words = [None] * bits
    for i, (word, shift, spill) in enumerate(_word_layout(bits)):
        c = units[..., i]
        words[word] = (c << shift) if words[word] is None else words[word] | (c << shift)
        if spill:
            hi = c >> (32 - shift)
            words[word + 1] = hi if words[word + 1] is None else words[word + 1] | hi
    return mx.stack(words, axis=-1)


def unpack(words: UInt[Array, "*batch w"], bits: int) -> UInt[Array, "*batch m"]:
    """Inverse of :func:`pack`."""
    w = words.shape[-1]
    lead = words.shape[:-1]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        shifts = mx.arange(per, dtype=mx.uint32) * bits
        return ((words[..., None] >> shifts) & mask).reshape(*lead, w * per)
    units = words.reshape(*lead, w // bits, bits)
    codes = []
    for word, shift, spill in _word_layout(bits):
        c = units[..., word] >> shift
        if spill:
            c = c | (units[..., word + 1] << (32 - shift))
        codes.append(c & mask)
    return mx.stack(codes, axis=-1).reshape(*lead, w // bits * 32)


def quantize(x: Float[Array, "*batch m"], bits: int, group_size: int,
             dtype: mx.Dtype | None = None):
    """Affine min/max quantization in groups along the last axis.

    Returns ``(codes, scales, zeros)``: packed ``uint32 [..., m*bits/32]`` and
    ``[..., m/group_size]`` scales and zeros in ``side_dtype(dtype or x.dtype)``.
    """
    m = x.shape[-1]
    if m % group_size:
        raise ValueError(f"last axis {m} is not a multiple of group_size={group_size}")
    lead = x.shape[:-1]
    g = x.astype(mx.float32).reshape(*lead, m // group_size, group_size)
    q, scales, zeros = affine_codes(g, bits, side_dtype(x.dtype if dtype is None else dtype))
    return pack(q.reshape(*lead, m), bits), scales, zeros


def affine_codes(g: Float[Array, "*batch n"], bits: int, side: mx.Dtype,
                 alpha: mx.array | None = None):
    """Min/max codes of each last-axis row of ``g`` (one group a row, unpacked): ``(codes
    uint32 [..., n], scales, zeros)``, scales and zeros stored in ``side``. With ``alpha`` the
    range is clipped to ``[alpha * min, alpha * max]`` and values outside saturate.

    A scale of 0 gives codes 0; so does a NaN (a non-finite group), never a stray bit pattern.
    """
    levels = (1 << bits) - 1
    g = g.astype(mx.float32)
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    if alpha is not None:
        lo = lo * alpha
        hi = hi * alpha
    scales = ((hi - lo) / levels).astype(side)
    zeros = lo.astype(side)
    s32 = scales.astype(mx.float32)[..., None]
    z32 = zeros.astype(mx.float32)[..., None]
    safe = mx.where(s32 > 0, s32, 1.0)
    q = mx.clip(mx.round((g - z32) / safe), 0, levels)
    return mx.where((s32 > 0) & ~mx.isnan(q), q, 0).astype(mx.uint32), scales, zeros


def dequantize_f32(codes: UInt[Array, "*batch w"], scales: Float[Array, "*batch g"],
                   zeros: Float[Array, "*batch g"], bits: int, group_size: int,
                   count: int | None = None) -> Float[Array, "*batch m"]:
    """``q * scale + zero`` in float32, unrounded (what :func:`dequantize` rounds to its dtype).

    ``count``: only the first ``count`` codes of each row are values, in ``ceil(count /
    group_size)`` groups, the last possibly shorter (codes beyond them, word padding, are
    dropped); default: every code, ``m / group_size`` whole groups.
    """
    q = unpack(codes, bits).astype(mx.float32)
    lead = q.shape[:-1]
    if count is None:
        m = q.shape[-1]
    else:
        m = -(-count // group_size) * group_size
        if q.shape[-1] > m:
            q = q[..., :m]
        elif q.shape[-1] < m:
            q = mx.concatenate([q, mx.zeros((*lead, m - q.shape[-1]), mx.float32)], axis=-1)
    q = q.reshape(*lead, m // group_size, group_size)
    x = (q * scales.astype(mx.float32)[..., None] + zeros.astype(mx.float32)[..., None]).reshape(*lead, m)
    return x if count is None or count == m else x[..., :count]


def dequantize(codes: UInt[Array, "*batch w"], scales: Float[Array, "*batch g"],
               zeros: Float[Array, "*batch g"], bits: int, group_size: int,
               dtype: mx.Dtype | None = None) -> Float[Array, "*batch m"]:
    """Reconstruct ``q * scale + zero`` (float32 arithmetic, :func:`dequantize_f32`) in
    ``dtype`` (default: the scales' dtype)."""
    x = dequantize_f32(codes, scales, zeros, bits, group_size)
    return x.astype(scales.dtype if dtype is None else dtype)


def error_bound(scales: Float[Array, "*batch g"], zeros: Float[Array, "*batch g"], bits: int,
                group_size: int) -> Float[Array, "*batch m"]:
    """Per-element bound on ``|x - dequantize(quantize(x))|``: ``scale/2`` plus dtype rounding.

    Rounding terms: the stored zero and scale (relative error ``u`` each, the scale's error
    multiplied by up to ``2**bits - 1`` steps, which also bounds clipping at the top), and the
    final rounding of the reconstruction (to the scales' dtype or a finer one). Side data in
    float16 adds the absolute error of subnormal scales and zeros, ``2**-25`` each.
    """
    u = unit_roundoff(scales.dtype)
    tiny = 2.0 ** -25 if scales.dtype == mx.float16 else 0.0
    levels = (1 << bits) - 1
    s = scales.astype(mx.float32)
    z = mx.abs(zeros.astype(mx.float32))
    top = z + levels * s
    bound = (0.5 * s + u * (2 * z + (levels + 1) * s) + u * top + 8 * 2.0 ** -24 * top
             + (levels + 2) * tiny)
    return mx.repeat(bound, group_size, axis=-1)


def every_position(tokens: Callable[[tuple], int]) -> Callable[[tuple], Int[Array, "b h n"]]:
    """The ``positions`` hook of a cache that keeps every token, in order: ``0 .. n - 1`` on
    every head, ``n = tokens(state)`` (counted from the state's shapes)."""
    def positions(state) -> Int[Array, "b h n"]:
        """Absolute positions of the tokens ``get_kv`` returns (all tokens, in order)."""
        b, h = state.next_pos.shape
        n = tokens(state)
        return mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, h, n))
    return positions

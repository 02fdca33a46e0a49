"""Entropy coding of integer symbols: a range coder over quantized Laplace models.

Host-side (NumPy in, ``uint32`` words out) on top of ``constriction``'s range coder, so the
coded size of a stream is the size of real, decodable words. A stream holds, in order, a
block of symbols coded uniformly over ``[0, size)`` and a block of symbols in ``[lo, hi]``,
each coded with its own quantized Laplace model ``(mean, scale)``.

Laplace scales travel as one byte: ``scale = 2 ** ((index - 128) / 16)`` (a 1/16-octave
grid from ``2**-8`` to ``2**7.94``); :func:`fit_laplace` picks the byte from integer symbols
with float64 arithmetic, so an encoder and a decoder that see the same symbols pick the
same model.

References:
    Bamler. Understanding Entropy Coding With Asymmetric Numeral Systems (ANS): a
    Statistician's Perspective. arXiv:2201.01741 (the ``constriction`` library).
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["scale_of", "index_of", "fit_laplace", "encode", "decode", "GEO_THETA", "geo_fit",
           "geo_encode", "geo_decode", "GEO_MAX_BOUND", "FLOAT_LAYOUT", "pack_bits", "unpack_bits", "float_encode",
           "float_decode", "INT_BOUND", "int_encode", "int_decode"]

_LAPLACE_MIN = 2.0 ** -8


def _constriction():
    try:
        import constriction
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("entropy coding needs the constriction package "
                          "(pip install constriction)") from e
    return constriction


def scale_of(index: np.ndarray | int) -> np.ndarray:
    """Laplace scales (float64) of one-byte indices."""
    return np.asarray(np.exp2((np.asarray(index, np.float64) - 128.0) / 16.0))


def index_of(scale: np.ndarray | float) -> np.ndarray:
    """Nearest one-byte index of Laplace scales (clipped to the grid)."""
    scale = np.maximum(np.asarray(scale, np.float64), _LAPLACE_MIN)
    return np.asarray(np.clip(np.round(16.0 * np.log2(scale)) + 128.0, 0, 255), np.uint8)


def fit_laplace(symbols: np.ndarray, axis: int | tuple[int, ...],
                centre: bool) -> tuple[np.ndarray, np.ndarray]:
    """Maximum-likelihood Laplace model of integer ``symbols`` reduced over ``axis``.

    Returns the integer mean (the rounded mean when ``centre``, else 0) and the scale byte
    (the mean absolute deviation from that mean).
    """
    x = np.asarray(symbols, np.float64)
    mean = np.round(x.mean(axis=axis, keepdims=True)) if centre else np.zeros_like(
        x.mean(axis=axis, keepdims=True))
    spread = np.abs(x - mean).mean(axis=axis, keepdims=True)
    return np.asarray(np.squeeze(mean, axis), np.int64), np.asarray(np.squeeze(index_of(spread), axis))


def encode(uniform: np.ndarray, size: int, symbols: np.ndarray, lo: int, hi: int,
           means: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Range-code ``uniform`` (each in ``[0, size)``) then ``symbols`` (each in ``[lo, hi]``,
    with its Laplace ``means``/``scales``); returns the compressed ``uint32`` words."""
    constriction = _constriction()
    enc = constriction.stream.queue.RangeEncoder()
    if uniform.size:
        enc.encode(np.ascontiguousarray(uniform, np.int32).ravel(),
                   constriction.stream.model.Uniform(size))
    if symbols.size:
        enc.encode(np.ascontiguousarray(symbols, np.int32).ravel(),
                   constriction.stream.model.QuantizedLaplace(lo, hi),
                   np.ascontiguousarray(means, np.float64).ravel(),
                   np.ascontiguousarray(scales, np.float64).ravel())
    return np.asarray(enc.get_compressed(), np.uint32)


def decode(words: np.ndarray, n_uniform: int, size: int, lo: int, hi: int, means: np.ndarray,
           scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode`: ``n_uniform`` uniform symbols, then one symbol per model."""
    constriction = _constriction()
    dec = constriction.stream.queue.RangeDecoder(np.ascontiguousarray(words, np.uint32))
    uniform = (dec.decode(constriction.stream.model.Uniform(size), n_uniform) if n_uniform
               else np.zeros(0, np.int32))
    means = np.ascontiguousarray(means, np.float64).ravel()
    symbols = (dec.decode(constriction.stream.model.QuantizedLaplace(lo, hi), means,
                          np.ascontiguousarray(scales, np.float64).ravel())
               if means.size else np.zeros(0, np.int32))
    return uniform.astype(np.int64), symbols.astype(np.int64)


# ---- two-sided geometric models (stored caches) ---------------------------------------------
#
# A block of integer symbols in ``[-bound, bound]`` is coded with the model
# ``p(k) ~ theta ** |k|`` (a discrete Laplace centred at 0), ``theta`` one of 256 levels picked
# by a byte: ``theta_j = 1 / (1 + 2 ** ((128 - j) / 8))`` (odds on an eighth-octave grid, from
# 1.6e-5 to 1 - 1.6e-5), ``j = 0``: every symbol 0. The probabilities are built with IEEE basic
# operations only (square roots, products, quotients, no ``exp``), so that any machine builds
# the same tables from the same byte and bound, and ``constriction``'s categorical model
# quantizes them the same way: the decoder needs the byte and the bound, nothing else. A block
# of bound 0 holds zeros only and takes no bits.

def _geo_levels() -> np.ndarray:
    r = math.sqrt(math.sqrt(math.sqrt(2.0)))  # 2 ** (1/8), correctly rounded
    up, down = [1.0], [1.0]
    for _ in range(128):
        up.append(up[-1] * r)
        down.append(down[-1] / r)
    return np.array([0.0] + [1.0 / (1.0 + (up[128 - j] if j <= 128 else down[j - 128]))
                             for j in range(1, 256)], np.float64)


_Ints = np.ndarray | np.integer | int | list

GEO_THETA = _geo_levels()
_GEO_FLOOR = 1e-30  # below constriction's least probability (it gives every symbol one)
#: The widest bound a geometric model takes (its table spans ``2 * bound + 1`` symbols).
GEO_MAX_BOUND = 1 << 22


def geo_fit(count: _Ints, abs_sum: _Ints, bound: _Ints) -> np.ndarray:
    """The byte (``uint8``, broadcast over the inputs) whose two-sided geometric model codes
    ``count`` symbols of absolute sum ``abs_sum`` within ``[-bound, bound]`` in the fewest bits
    (the ideal code length; the encoder's choice, never recomputed by a decoder)."""
    n = np.asarray(count, np.float64)[..., None]
    s = np.asarray(abs_sum, np.float64)[..., None]
    bound = np.asarray(bound, np.float64)[..., None]
    th = GEO_THETA[1:]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        z = 1.0 + 2.0 * th * (1.0 - th ** bound) / (1.0 - th)
        cost = n * np.log2(z) - s * np.log2(th)
    best = np.argmin(cost, axis=-1) + 1
    return np.where(np.asarray(abs_sum)[...] == 0, 0, best).astype(np.uint8)


@functools.lru_cache(maxsize=4096)
def _geo_model(j: int, bound: int):
    if not (0 <= j < 256 and 0 <= bound <= GEO_MAX_BOUND):
        raise ValueError(f"a geometric model of byte {j} and bound {bound} (0..255, 0..{GEO_MAX_BOUND})")
    constriction = _constriction()
    th = float(GEO_THETA[j])
    side = np.cumprod(np.full(bound, th)) if bound else np.zeros(0)
    p = np.concatenate([side[::-1], [1.0], side])
    return constriction.stream.model.Categorical(np.maximum(p, _GEO_FLOOR), perfect=False)


def _groups(keys: list[tuple[int, int]]) -> list[list[int]]:
    """Indices of the blocks that share a model, grouped, in order of first appearance."""
    out: dict[tuple[int, int], list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(k, []).append(i)
    return list(out.values())


def geo_encode(blocks) -> np.ndarray:
    """Range-code blocks ``(symbols, byte, bound)`` (integer symbols in ``[-bound, bound]``),
    each with its two-sided geometric model; returns the ``uint32`` words. Blocks of one
    model are coded together (in order of the model's first block, then of the blocks)."""
    constriction = _constriction()
    enc = constriction.stream.queue.RangeEncoder()
    blocks = [(np.asarray(sym).ravel(), int(j), int(bound)) for sym, j, bound in blocks]
    for idx in _groups([(j, bound) for _, j, bound in blocks]):
        j, bound = blocks[idx[0]][1:]
        sym = np.concatenate([blocks[i][0] for i in idx])
        if sym.size and (sym.min() < -bound or sym.max() > bound):
            raise ValueError(f"a symbol lies outside [-{bound}, {bound}]")
        if sym.size and bound:
            enc.encode((sym + bound).astype(np.int32), _geo_model(j, bound))
    return np.asarray(enc.get_compressed(), np.uint32)


def geo_decode(words: np.ndarray, blocks) -> list[np.ndarray]:
    """Inverse of :func:`geo_encode`: blocks ``(count, byte, bound)``; the symbols
    (``int64``) of each."""
    constriction = _constriction()
    dec = constriction.stream.queue.RangeDecoder(np.ascontiguousarray(words, np.uint32))
    blocks = [(int(n), int(j), int(bound)) for n, j, bound in blocks]
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * len(blocks)
    for idx in _groups([(j, bound) for _, j, bound in blocks]):
        j, bound = blocks[idx[0]][1:]
        total = sum(blocks[i][0] for i in idx)
        if not (0 <= j < 256 and 0 <= bound <= GEO_MAX_BOUND):
            raise ValueError(f"a geometric model of byte {j} and bound {bound} (0..255, "
                             f"0..{GEO_MAX_BOUND})")
        got = (np.asarray(dec.decode(_geo_model(j, bound), total), np.int64) - bound
               if total and bound else np.zeros(total, np.int64))
        at = 0
        for i in idx:
            out[i] = got[at:at + blocks[i][0]]
            at += blocks[i][0]
    return out


# ---- lossless float rows --------------------------------------------------------------------
#
# A float row array (bfloat16, float16, float32) held to the bit: each value split into its sign
# and exponent (one symbol, 2 * (exponent - lo) + sign, coded with a categorical model of its
# channel) and its mantissa (stored raw, packed). A channel is one column of the rows of a
# stream (a batch row and kv head): its exponents span a few values, and their histogram,
# sent as 5-bit log counts (``_LOG_COUNT``), is the model.

#: (exponent bits, mantissa bits) of each float format.
FLOAT_LAYOUT = {"bfloat16": (8, 7), "float16": (5, 10), "float32": (8, 23)}
# Weights of the 5-bit log counts: code c stands for floor(2 ** (c / 2)) (integer square roots:
# exact on every machine); code 0 for a symbol never seen (the coder's least probability).
_LOG_COUNT = np.array([0.0] + [float(math.isqrt(2 ** c)) for c in range(1, 32)], np.float64)


def _log_count(counts: np.ndarray) -> np.ndarray:
    """5-bit codes of counts: 0 for none, else ``round(2 log2(count + 1))`` clipped to 1..31."""
    c = np.asarray(counts, np.float64)
    return np.where(c > 0, np.clip(np.round(2.0 * np.log2(c + 1.0)), 1, 31), 0).astype(np.uint8)


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``values`` of ``width`` bits (0..32) packed into bytes: the ``width // 8`` whole
    low bytes of every value (byte planes, lowest first), then the remaining ``r`` high bits of
    every value, eight values to ``r`` bytes (little-endian)."""
    v = np.asarray(values).ravel()
    full, rest = divmod(int(width), 8)
    parts = [np.asarray((v >> (8 * i)) & 0xFF, np.uint8) for i in range(full)]
    if rest and v.size:
        hi = np.zeros(-(-v.size // 8) * 8, np.uint64)
        hi[:v.size] = (v >> (8 * full)) & ((1 << rest) - 1)
        hi = hi.reshape(-1, 8)
        word = hi[:, 0].copy()
        for i in range(1, 8):
            word |= hi[:, i] << np.uint64(rest * i)
        packed = word.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :rest].ravel()
        parts.append(packed[:-(-rest * v.size // 8)])
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def unpack_bits(data: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` values (``uint32``)."""
    data = np.asarray(data, np.uint8).ravel()
    full, rest = divmod(int(width), 8)
    need = full * count + -(-rest * count // 8)
    if data.size != need:
        raise ValueError(f"{data.size} packed bytes; {count} values of {width} bits take {need}")
    out = np.zeros(count, np.uint32)
    for i in range(full):
        out |= data[i * count:(i + 1) * count].astype(np.uint32) << (8 * i)
    if rest and count:
        groups = -(-count // 8)
        raw = np.zeros(groups * rest, np.uint8)
        raw[:data.size - full * count] = data[full * count:]
        buf = np.zeros((groups, 8), np.uint8)
        buf[:, :rest] = raw.reshape(groups, rest)
        word = buf.view("<u8")[:, 0].astype(np.uint64)
        mask = np.uint64((1 << rest) - 1)
        hi = np.empty((groups, 8), np.uint32)
        for i in range(8):
            hi[:, i] = (word >> np.uint64(rest * i)) & mask
        out |= hi.ravel()[:count] << (8 * full)
    return out


def float_encode(bits: np.ndarray, dtype: str) -> dict[str, np.ndarray]:
    """Code the raw bits of float rows ``[streams, n, d]`` (``uint16`` for bfloat16 and
    float16, ``uint32`` for float32) losslessly: the arrays :func:`float_decode` reads (every
    one counted in a file's bytes). Each of the ``streams * d`` channels holds its lowest
    exponent (``lo``), its highest less its lowest (``top``), the 5-bit log counts of its symbols
    (``tables``, packed) and its symbols range-coded (``words``); the mantissas are packed raw
    (``mantissa``)."""
    ebits, mbits = FLOAT_LAYOUT[dtype]
    x = np.asarray(bits)
    g, n, d = x.shape
    u = np.ascontiguousarray(np.moveaxis(x, 1, 2)).reshape(g * d, n)
    e = ((u >> mbits) & ((1 << ebits) - 1)).astype(np.int32)
    lo = e.min(axis=1) if n else np.zeros(g * d, np.int32)
    top = (e.max(axis=1) - lo) if n else np.zeros(g * d, np.int32)
    sym = 2 * (e - lo[:, None]) + (u >> (mbits + ebits)).astype(np.int32)
    width = 2 * (top + 1) if n else np.zeros(g * d, np.int64)
    offsets = np.concatenate([[0], np.cumsum(width)])
    counts = np.bincount((offsets[:-1, None] + sym).ravel(), minlength=int(offsets[-1]))
    codes = _log_count(counts)
    constriction = _constriction()
    enc = constriction.stream.queue.RangeEncoder()
    cat = constriction.stream.model.Categorical
    for c in range(g * d if n else 0):
        w = _LOG_COUNT[codes[offsets[c]:offsets[c + 1]]]
        if int(width[c]) > 1:
            enc.encode(sym[c], cat(w, perfect=False))
    ldt = np.uint8 if ebits <= 8 else np.uint16
    return {"words": np.asarray(enc.get_compressed(), np.uint32), "lo": lo.astype(ldt),
            "top": top.astype(ldt), "tables": pack_bits(codes, 5),
            "mantissa": pack_bits(u & ((1 << mbits) - 1), mbits)}


def float_decode(a: dict[str, np.ndarray], shape: tuple[int, int, int], dtype: str) -> np.ndarray:
    """Inverse of :func:`float_encode`: the raw bits ``[streams, n, d]``, to the bit."""
    ebits, mbits = FLOAT_LAYOUT[dtype]
    g, n, d = shape
    lo = np.asarray(a["lo"], np.int64)
    top = np.asarray(a["top"], np.int64)
    if lo.shape != (g * d,) or top.shape != (g * d,):
        raise ValueError(f"lossless float tables of {lo.shape} channels; the rows hold {g * d}")
    if (lo < 0).any() or (top < 0).any() or (lo + top >= 1 << ebits).any():
        raise ValueError("lossless float tables whose exponents pass the format's")
    width = 2 * (top + 1) if n else np.zeros(g * d, np.int64)
    offsets = np.concatenate([[0], np.cumsum(width)])
    codes = unpack_bits(a["tables"], 5, int(offsets[-1])).astype(np.int64)
    constriction = _constriction()
    dec = constriction.stream.queue.RangeDecoder(np.ascontiguousarray(a["words"], np.uint32))
    cat = constriction.stream.model.Categorical
    sym = np.zeros((g * d, n), np.uint32)
    for c in range(g * d if n else 0):
        if int(width[c]) > 1:
            sym[c] = dec.decode(cat(_LOG_COUNT[codes[offsets[c]:offsets[c + 1]]], perfect=False), n)
    u = unpack_bits(a["mantissa"], mbits, g * d * n).reshape(g * d, n)
    u |= (sym & 1) << (mbits + ebits)
    u |= (lo.astype(np.uint32)[:, None] + (sym >> 1)) << mbits
    out = np.moveaxis(u.reshape(g, d, n), 1, 2)
    return np.ascontiguousarray(out).astype(np.uint16 if dtype != "float32" else np.uint32)


# ---- lossless integer arrays ----------------------------------------------------------------

#: Integer arrays whose deltas reach past this are left as they are (the model's table would
#: span every value up to the bound).
INT_BOUND = 1 << 16


def int_encode(x: np.ndarray) -> dict[str, np.ndarray] | None:
    """An integer array coded losslessly: its deltas along the last axis (each row's first
    value as it is) less their most common value, range-coded with one two-sided geometric
    model (positions that count up by one cost next to nothing). ``None`` where that is not
    smaller than the array or a delta lies beyond ``INT_BOUND`` of the common one."""
    a = np.asarray(x)
    if a.ndim == 0 or a.size == 0:
        return None
    rows = a.astype(np.int64).reshape(-1, a.shape[-1])
    dlt = np.diff(rows, axis=1, prepend=0).ravel()
    vals, counts = np.unique(dlt, return_counts=True)
    mode = int(vals[np.argmax(counts)])
    sym = dlt - mode
    bound = int(np.abs(sym).max())
    if bound > INT_BOUND:
        return None
    j = int(geo_fit(sym.size, np.abs(sym).sum(), bound))
    out = {"words": geo_encode([(sym, j, bound)]), "model": np.array([mode, bound, j], np.int64)}
    return out if sum(v.nbytes for v in out.values()) < a.nbytes else None


def int_decode(a: dict[str, np.ndarray], shape: tuple[int, ...], dtype) -> np.ndarray:
    """Inverse of :func:`int_encode`: the array of ``shape`` and ``dtype``, to the bit."""
    model = np.asarray(a["model"], np.int64)
    if model.shape != (3,) or not 0 <= model[1] <= INT_BOUND or not 0 <= model[2] < 256:
        raise ValueError(f"an integer array's model {model.tolist()} is not (mode, bound, byte)")
    n = int(np.prod(shape))
    (sym,) = geo_decode(a["words"], [(n, int(model[2]), int(model[1]))])
    last = shape[-1] if len(shape) else 1
    rows = np.cumsum((sym + int(model[0])).reshape(-1, last), axis=1)
    return rows.reshape(shape).astype(dtype)

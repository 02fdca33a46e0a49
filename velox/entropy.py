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

import numpy as np

__all__ = ["scale_of", "index_of", "fit_laplace", "encode", "decode"]

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

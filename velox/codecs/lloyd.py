"""Lloyd-Max scalar codebooks for the unit-variance Gaussian and Laplacian laws, 1 to 8 bits.

:func:`codebook` ``(law, bits)`` returns ``(centroids [2^bits], boundaries [2^bits - 1])``,
float32, ascending; a value ``y`` belongs to cell ``i`` when ``boundaries[i-1] < y <=
boundaries[i]`` (the first cell is ``(-inf, boundaries[0]]``, the last ``(boundaries[-1],
inf)``): :func:`cell` is that rule, the same for NumPy and MLX arrays.

``law`` is ``"gaussian"`` (N(0, 1)) or ``"laplacian"`` (density ``exp(-|x| / beta) / (2 beta)``
with ``beta = 1 / sqrt(2)``, variance 1). Both laws are symmetric and the number of levels
is even, so the optimal codebook is symmetric with a boundary at 0: it is computed on the
half line ``[0, inf)`` and mirrored.

The computation is NumPy float64 Lloyd iteration with closed-form conditional means (no grid):
boundaries at the midpoints of neighbouring centroids, centroids the conditional means of their
cells, ``E[x | a < x <= b]``:

* Gaussian: ``(phi(a) - phi(b)) / (Q(a) - Q(b))``, ``Q(x) = erfc(x / sqrt 2) / 2``;
* Laplacian, ``0 <= a < b``: ``a + beta - (b - a) / expm1((b - a) / beta)`` (``a + beta`` for
  ``b = inf``).

It starts from the compander quantiles (centroid density ``p^(1/3)``: quantiles of N(0, 3),
or of a Laplacian of scale ``3 beta``), runs a few Lloyd steps, then Newton steps on the
fixed-point equation ``T(c) = c`` of the Lloyd map (its Jacobian is tridiagonal:
``dm/da = p(a) (m - a) / P``, ``dm/db = p(b) (b - m) / P`` for a cell of probability ``P``),
and finishes with Lloyd steps until no centroid moves by more than 1e-12 (plain Lloyd
iteration alone needs ~1e5 steps at 8 bits). Results are cached in-process
(:func:`functools.lru_cache` on ``(law, bits)``). :func:`distortion` is the codebook's
mean squared error ``E[(x - c(x))^2] = 1 - sum_i P_i c_i^2`` (float64).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np

__all__ = ["LAWS", "codebook", "codebook64", "distortion", "cell"]

LAWS = ("gaussian", "laplacian")
_BETA = 1.0 / math.sqrt(2.0)
_TOL = 1e-12
_MAX_ITER = 200_000
_LLOYD_WARMUP = 20
_NEWTON_STEPS = 30

_erfc = np.vectorize(math.erfc, otypes=[float])


def _gauss_tail(x: np.ndarray) -> np.ndarray:
    """``Q(x) = P(X > x)`` for N(0, 1)."""
    return 0.5 * _erfc(x / math.sqrt(2.0))


def _gauss_mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    phi = lambda x: np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)  # noqa: E731
    bb = np.where(np.isinf(b), 0.0, b)
    pb = np.where(np.isinf(b), 0.0, phi(bb))
    qb = np.where(np.isinf(b), 0.0, _gauss_tail(bb))
    return (phi(a) - pb) / (_gauss_tail(a) - qb)


def _laplace_mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    w = np.where(np.isinf(b), 1.0, b - a)
    return np.where(np.isinf(b), a + _BETA, a + _BETA - w / np.expm1(w / _BETA))


def _density(law: str, x: np.ndarray) -> np.ndarray:
    if law == "gaussian":
        return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return np.exp(-np.abs(x) / _BETA) / (2.0 * _BETA)


def _half_prob(law: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``P(a < X <= b)`` for ``0 <= a < b <= inf``."""
    if law == "gaussian":
        qb = np.where(np.isinf(b), 0.0, _gauss_tail(np.where(np.isinf(b), 0.0, b)))
        return _gauss_tail(a) - qb
    eb = np.where(np.isinf(b), 0.0, np.exp(-np.where(np.isinf(b), 0.0, b) / _BETA))
    return 0.5 * (np.exp(-a / _BETA) - eb)


def _check(law: str, bits: int) -> None:
    if law not in LAWS:
        raise ValueError(f"unknown law {law!r}; one of {', '.join(LAWS)}")
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


@functools.lru_cache(maxsize=None)
def _half(law: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Positive-half centroids ``[K]`` and inner boundaries ``[K - 1]``, float64 (K = 2^(bits-1))."""
    k = 1 << (bits - 1)
    p = (k + np.arange(1, k + 1) - 0.5) / (2 * k)  # upper-half quantile levels
    if law == "gaussian":
        inv = NormalDist(0.0, math.sqrt(3.0)).inv_cdf
        c = np.array([inv(float(v)) for v in p])
    else:
        c = -3.0 * _BETA * np.log(2.0 * (1.0 - p))
    mean = _gauss_mean if law == "gaussian" else _laplace_mean

    def step(c):
        t = 0.5 * (c[:-1] + c[1:])
        return np.concatenate([[0.0], t]), np.concatenate([t, [np.inf]])

    for _ in range(_LLOYD_WARMUP):
        c = mean(*step(c))
    for _ in range(_NEWTON_STEPS):  # Newton on T(c) - c = 0, T tridiagonal in c
        lo, hi = step(c)
        m = mean(lo, hi)
        prob = _half_prob(law, lo, hi)
        d_lo = _density(law, lo) * (m - lo) / prob
        d_hi = np.where(np.isinf(hi), 0.0, _density(law, np.where(np.isinf(hi), 0.0, hi))
                        * (np.where(np.isinf(hi), 0.0, hi) - m) / prob)
        jac = np.diag(0.5 * (np.concatenate([[0.0], d_lo[1:]]) + d_hi)) - np.eye(k)
        jac += np.diag(0.5 * d_lo[1:], -1) + np.diag(0.5 * d_hi[:-1], 1)
        new = c - np.linalg.solve(jac, m - c)
        if not (np.all(np.diff(new) > 0) and new[0] > 0):
            break
        moved = np.max(np.abs(new - c))
        c = new
        if moved <= _TOL:
            break
    for _ in range(_MAX_ITER):  # Lloyd to the fixed point (a few steps after Newton)
        new = mean(*step(c))
        done = np.max(np.abs(new - c)) <= _TOL
        c = new
        if done:
            break
    return c, 0.5 * (c[:-1] + c[1:])


def codebook64(law: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Full centroids ``[2^bits]`` and boundaries ``[2^bits - 1]``, float64, ascending."""
    _check(law, bits)
    c, t = _half(law, bits)
    return np.concatenate([-c[::-1], c]), np.concatenate([-t[::-1], [0.0], t])


@functools.lru_cache(maxsize=None)
def _codebook32(law: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    c, t = codebook64(law, bits)
    c, t = c.astype(np.float32), t.astype(np.float32)
    c.setflags(write=False)
    t.setflags(write=False)
    return c, t


def codebook(law: str, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd-Max ``(centroids [2^bits], boundaries [2^bits - 1])`` of ``law``, float32 copies."""
    _check(law, bits)
    c, t = _codebook32(law, bits)
    return c.copy(), t.copy()


@functools.lru_cache(maxsize=None)
def distortion(law: str, bits: int) -> float:
    """Mean squared error of the Lloyd-Max codebook on its unit-variance law."""
    _check(law, bits)
    c, t = _half(law, bits)
    lo = np.concatenate([[0.0], t])
    hi = np.concatenate([t, [np.inf]])
    return float(1.0 - 2.0 * np.sum(_half_prob(law, lo, hi) * c * c))


def cell(y, boundaries, bits: int):
    """Cell index of each ``y`` (``#{boundaries < y}``), by a ``bits``-step binary search.

    ``boundaries`` ascending ``[2^bits - 1]``; works on NumPy arrays and on MLX arrays (the
    MLX result is uint32, the NumPy result uint32 too). Ties go to the lower cell.
    """
    if isinstance(y, np.ndarray) or np.isscalar(y):
        idx = np.zeros(np.shape(y), np.uint32)
        for k in reversed(range(bits)):
            cand = idx + np.uint32(1 << k)
            idx = np.where(y > boundaries[cand - 1], cand, idx).astype(np.uint32)
        return idx
    import mlx.core as mx
    idx = mx.zeros(y.shape, mx.uint32)
    for k in reversed(range(bits)):
        cand = idx + (1 << k)
        idx = mx.where(y > mx.take(boundaries, cand - 1), cand, idx)
    return idx.astype(mx.uint32)

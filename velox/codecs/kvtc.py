"""KVTC: PCA decorrelation, dynamic-programming bit allocation over the principal components,
uniform quantization of the coefficients (Staniszewski and Łańcucki, "KV Cache Transform Coding
for Compact Storage in LLM Inference", ICLR 2026, arXiv:2511.01815).

A row ``x`` is centred and rotated into its principal basis, ``y = (x - mean) @ basis.T``
(``basis``'s rows the covariance's eigenvectors by decreasing eigenvalue, the convention of
``velox.codecs.spectral.pca_rotation``); component ``i`` gets ``bits[i]`` bits from
:func:`allocate` (a component of 0 bits is dropped: it decodes to the mean). The coefficients
are scaled by their component's spread ``sigma[i]`` and by one float16 scale a row,
``s = max_i |y_i / sigma_i|`` over the components that get bits (rounded up to a float16), and each ``u_i = y_i / (sigma_i
s)`` in ``[-1, 1]`` takes the uniform code ``q_i = floor((u_i + 1) 2^(b_i - 1))`` (clipped to
``[0, 2^b_i)``), decoded at the cell's centre. The codes of a row form one little-endian bit
stream, component ``i``'s ``bits[i]`` bits after those of the components before it: every row
holds ``ceil(total / 8)`` bytes and its float16 scale, ``total`` the allocation's sum
(:func:`total_bits`, the same for every basis: the allocation spends it exactly).

Bit allocation (:func:`allocate`, :func:`allocate_np`): minimise ``sum_i v_i beta^(-b_i)``
(the seed's analytic distortion; ``v_i`` the components' variances) over ``b_i`` in the
choices with ``sum_i b_i = total``, the largest sum of ``n`` choices not above the budget. Over
components sorted by decreasing variance an optimal allocation is non-increasing (exchanging
the bits of two components of unequal variance never lowers the distortion), so the dynamic
programme runs over non-increasing allocations only: its optimum is the unrestricted one, a
strictly higher-variance component never gets fewer bits, and equal variances split the bits
evenly with the remainder to the first components.

The tables (``basis``, ``mean``, ``sigma``, ``bits``) have leading axes ``[]``, ``[h]`` or
``[b, h]`` (one fit a batch row and kv head: the seed fits each sequence's own PCA at the
prefill, :func:`fit`, :func:`fit_np`); rows ``[b, h, n, d]`` broadcast against them. The
uncalibrated tables (no ``basis`` in the parameters) are the identity basis, a zero mean, unit
spreads and the allocation of equal variances: a placeholder that a fit replaces.

Error: coefficient ``i`` is within ``sigma_i s / 2^b_i`` of ``y_i`` (plus float32 rounding;
a row whose scale passes float16's largest value saturates); a 0-bit coefficient decodes to 0 (the row to the mean along
it). Scores rotate the query once: ``q . x^ = (q @ basis.T) . y^ + q . mean``.

Float32 arithmetic in the same order in the MLX functions and their NumPy twins: the same codes
from the same rotated rows.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import Codec, register_codec

__all__ = ["KvtcTables", "KvtcCodes", "tables", "encode", "decode", "scores", "encode_np",
           "decode_np", "scores_np", "allocate", "allocate_np", "total_bits", "parse_choices",
           "distortion_table", "fit", "fit_np", "fitted", "bytes_per_row", "table_arrays",
           "quantize_np", "dequantize_np", "entropy_encode_np", "entropy_decode_np", "compress_rows_np",
           "decompress_rows_np", "compress_codes_np", "decompress_codes_np", "DEFAULT_CHOICES", "MAX_BITS", "CODEC",
           "rope_np", "quiet_rows_np", "compress_rows_ecsq_np", "decompress_rows_ecsq_np"]

#: The seed's bit choices (``kvtc_bit_choices``), as the method's ``bit_choices`` string.
DEFAULT_CHOICES = "0,1,2,3,4,6,8"
#: The widest code a component may take.
MAX_BITS = 16


class KvtcTables(NamedTuple):
    """The principal basis, mean, spreads and allocation (leading axes ``[]``, ``[h]`` or
    ``[b, h]``), the static widths."""

    basis: mx.array          # [..., d, d] float32; rows the principal directions
    mean: mx.array           # [..., d] float32
    sigma: mx.array          # [..., d] float32: each component's spread (floored, > 0)
    bits: mx.array           # [..., d] uint8: each component's bits, non-increasing
    head_dim: int
    bit_budget: int
    bit_choices: str
    beta: float
    total: int               # sum of bits of every allocation: total_bits(budget, choices, d)
    calibrated: bool         # from a calibration (never refitted), else fitted at the prefill


class KvtcCodes(NamedTuple):
    """Each row's codes as one bit stream and its float16 scale."""

    codes: mx.array          # uint8 [b, h, n, ceil(total / 8)]
    scale: mx.array          # float16 [b, h, n]


# ---- allocation -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def parse_choices(choices: str) -> tuple[int, ...]:
    """``"0,1,2,4"`` -> ``(0, 1, 2, 4)``: sorted, distinct, each in ``0..MAX_BITS``."""
    try:
        got = tuple(int(c) for c in str(choices).split(","))
    except ValueError:
        raise ValueError(f"bit_choices={choices!r} must be comma-separated integers") from None
    if not got or any(not 0 <= c <= MAX_BITS for c in got) or len(set(got)) != len(got):
        raise ValueError(f"bit_choices={choices!r} must be distinct integers in 0..{MAX_BITS}")
    return tuple(sorted(got))


@functools.lru_cache(maxsize=None)
def total_bits(budget: int, choices: str, n: int) -> int:
    """The largest sum of ``n`` choices (with repetition) not above ``budget``: what every
    allocation spends (``budget`` itself whenever some sum reaches it). A budget below ``n``
    times the smallest choice fits none: every component then takes the smallest choice."""
    ch = parse_choices(choices)
    reach = {0}
    for _ in range(n):
        reach = {r + c for r in reach for c in ch if r + c <= budget}
    return max(reach) if reach else n * ch[0]


def distortion_table(choices: str, beta: float) -> np.ndarray:
    """``beta^(-c)`` of each choice, float32 (both DPs read these exact numbers)."""
    return np.array([float(beta) ** -c for c in parse_choices(choices)], np.float32)


def allocate_np(variances: np.ndarray, budget: int, choices: str, beta: float) -> np.ndarray:
    """Bits of each component, ``uint8 [..., n]``, for ``variances [..., n]`` sorted in
    decreasing order along the last axis: the minimum of ``sum v_i beta^(-b_i)`` over
    non-increasing ``b`` in the choices with ``sum b = total_bits(budget, choices, n)``
    (float32 costs; ties to the first choice index, i.e. fewer bits, at each step of the
    back-tracking from the last component)."""
    v = np.asarray(variances, np.float32)
    lead, n = v.shape[:-1], v.shape[-1]
    ch = np.array(parse_choices(choices))
    c = len(ch)
    total = total_bits(int(budget), choices, n)
    tab = distortion_table(choices, beta)
    t_axis = np.arange(total + 1)
    src = t_axis[:, None] - ch[None, :]                     # [T, C]: the total before choice j
    valid = src >= 0
    src = np.maximum(src, 0)
    above = np.arange(c)[None, :] >= np.arange(c)[:, None]  # [j, j']: j' >= j
    inf = np.float32(np.inf)
    cost = np.where(t_axis[:, None] == ch[None, :], v[..., :1, None] * tab, inf).astype(np.float32)
    cost = np.broadcast_to(cost, (*lead, total + 1, c)).copy()
    back = []
    for i in range(1, n):
        masked = np.where(above, cost[..., :, None, :], inf)      # [..., T, j, j']
        smin, sarg = masked.min(axis=-1), masked.argmin(axis=-1)  # [..., T, j]
        prev = np.take_along_axis(smin, np.broadcast_to(src, (*lead, *src.shape)), axis=-2)
        parg = np.take_along_axis(sarg, np.broadcast_to(src, (*lead, *src.shape)), axis=-2)
        prev = np.where(valid, prev, inf)
        cost = (prev + v[..., i:i + 1, None] * tab).astype(np.float32)
        back.append(parg)
    j = cost[..., total, :].argmin(axis=-1)                   # [...]
    out = np.zeros((*lead, n), np.int64)
    t = np.full(lead, total)
    for i in range(n - 1, -1, -1):
        out[..., i] = ch[j]
        if i:
            jj = np.take_along_axis(back[i - 1], t[..., None, None], axis=-2)[..., 0, :]
            nj = np.take_along_axis(jj, j[..., None], axis=-1)[..., 0]
            t = t - ch[j]
            j = nj
    return out.astype(np.uint8)


def allocate(variances: mx.array, budget: int, choices: str, beta: float) -> mx.array:
    """MLX twin of :func:`allocate_np` (the same float32 costs and ties)."""
    v = variances.astype(mx.float32)
    lead, n = v.shape[:-1], v.shape[-1]
    ch_np = np.array(parse_choices(choices))
    ch = mx.array(ch_np.astype(np.int32))
    c = len(ch_np)
    total = total_bits(int(budget), choices, n)
    tab = mx.array(distortion_table(choices, beta))
    t_np = np.arange(total + 1)
    src_np = t_np[:, None] - ch_np[None, :]
    valid = mx.array(src_np >= 0)
    src = mx.array(np.maximum(src_np, 0).astype(np.int32))
    above = mx.array(np.arange(c)[None, :] >= np.arange(c)[:, None])
    inf = mx.array(np.inf, mx.float32)
    first = mx.array(t_np[:, None] == ch_np[None, :])
    cost = mx.where(first, v[..., :1, None] * tab, inf)
    cost = mx.broadcast_to(cost, (*lead, total + 1, c))
    srcb = mx.broadcast_to(src, (*lead, *src_np.shape))
    back = []
    for i in range(1, n):
        masked = mx.where(above, cost[..., :, None, :], inf)
        smin, sarg = masked.min(axis=-1), masked.argmin(axis=-1)
        prev = mx.where(valid, mx.take_along_axis(smin, srcb, axis=-2), inf)
        back.append(mx.take_along_axis(sarg, srcb, axis=-2))
        cost = prev + v[..., i:i + 1, None] * tab
    j = cost[..., total, :].argmin(axis=-1).astype(mx.int32)
    t = mx.full(lead, total, mx.int32)
    out = [None] * n
    for i in range(n - 1, -1, -1):
        b = mx.take(ch, j)
        out[i] = b
        if i:
            jj = mx.take_along_axis(back[i - 1], t[..., None, None], axis=-2)[..., 0, :]
            nj = mx.take_along_axis(jj, j[..., None], axis=-1)[..., 0].astype(mx.int32)
            t = t - b
            j = nj
    return mx.stack(out, axis=-1).astype(mx.uint8)


# ---- fits -----------------------------------------------------------------------------------

_SIGMA_FLOOR = 1e-6
#: The row scale saturates at float16's largest finite value (codes then clip).
_F16_MAX = 65504.0


def _canonical_np(vec: np.ndarray) -> np.ndarray:
    """Eigenvectors (columns) with the sign that makes each one's largest-magnitude entry
    positive (the first of equal magnitudes)."""
    idx = np.abs(vec).argmax(axis=-2)[..., None, :]
    sign = np.where(np.take_along_axis(vec, idx, axis=-2) < 0, -1.0, 1.0).astype(vec.dtype)
    return vec * sign


def _spreads_np(lam: np.ndarray) -> np.ndarray:
    s = np.sqrt(np.maximum(lam, 0)).astype(np.float32)
    top = s.max(axis=-1, keepdims=True)
    return np.where(top > 0, np.maximum(s, np.float32(_SIGMA_FLOOR) * top), np.float32(1.0))


def fit_np(rows: np.ndarray, budget: int, choices: str, beta: float):
    """NumPy twin of :func:`fit`: ``(basis, mean, sigma, bits, variances)`` of rows
    ``[..., n, d]`` (float32 throughout; rows with a non-finite entry left out)."""
    x = np.asarray(rows, np.float32)
    ok = np.isfinite(x).all(axis=-1, keepdims=True)
    cnt = np.maximum(ok.sum(axis=-2, keepdims=True), 1).astype(np.float32)
    xz = np.where(ok, x, np.float32(0))
    c = np.abs(xz).max(axis=(-2, -1), keepdims=True)
    c = np.where(c > 0, c, np.float32(1)).astype(np.float32)
    xs = xz / c
    mean = xs.sum(axis=-2, keepdims=True) / cnt
    xc = np.where(ok, xs - mean, np.float32(0))
    cov = (np.swapaxes(xc, -1, -2) @ xc) / cnt
    lam, vec = np.linalg.eigh(cov)
    lam, vec = np.maximum(lam[..., ::-1], 0).astype(np.float32), _canonical_np(vec[..., ::-1])
    bits = allocate_np(lam, budget, choices, beta)
    sigma = _spreads_np(lam) * c[..., 0]
    mean = mean * c
    return (np.swapaxes(vec, -1, -2).astype(np.float32), mean[..., 0, :], sigma, bits, lam)


def fit(rows: mx.array, budget: int, choices: str, beta: float):
    """``(basis [..., d, d], mean, sigma, bits, variances [..., d])`` of rows ``[..., n, d]``:
    the mean and covariance of the rows without a non-finite entry (scaled by their largest
    entry, so nothing overflows: ``variances`` are the scaled rows'), its eigenvectors by
    decreasing eigenvalue (each signed so that its largest-magnitude entry is positive), the
    spreads (square roots of the eigenvalues, floored at ``1e-6`` of the largest; all 1 when
    every eigenvalue is 0) and :func:`allocate`'s bits. The eigendecomposition runs on the CPU
    stream (MLX has it there only)."""
    x = rows.astype(mx.float32)
    ok = mx.all(mx.isfinite(x), axis=-1, keepdims=True)
    cnt = mx.maximum(ok.sum(axis=-2, keepdims=True), 1).astype(mx.float32)
    zero, one = mx.array(0.0, mx.float32), mx.array(1.0, mx.float32)
    xz = mx.where(ok, x, zero)
    c = mx.abs(xz).max(axis=(-2, -1), keepdims=True)
    c = mx.where(c > 0, c, one)  # rows scaled by their largest entry: no overflow
    xs = xz / c
    mean = xs.sum(axis=-2, keepdims=True) / cnt
    xc = mx.where(ok, xs - mean, zero)
    cov = (xc.swapaxes(-1, -2) @ xc) / cnt
    lam, vec = mx.linalg.eigh(cov, stream=mx.cpu)
    lam, vec = mx.maximum(lam[..., ::-1], 0), vec[..., ::-1]
    idx = mx.abs(vec).argmax(axis=-2)[..., None, :]
    vec = vec * mx.where(mx.take_along_axis(vec, idx, axis=-2) < 0, -1.0, 1.0)
    s = mx.sqrt(lam)
    top = s.max(axis=-1, keepdims=True)
    sigma = mx.where(top > 0, mx.maximum(s, _SIGMA_FLOOR * top), one) * c[..., 0]
    mean = mean * c
    return vec.swapaxes(-1, -2), mean[..., 0, :], sigma, allocate(lam, budget, choices, beta), lam


def fitted(t: KvtcTables, rows: mx.array) -> KvtcTables:
    """``t`` with the basis, mean, spreads and allocation of :func:`fit` on ``rows [b, h, n,
    d]`` (one fit a batch row and kv head)."""
    basis, mean, sigma, bits, _ = fit(rows, t.bit_budget, t.bit_choices, t.beta)
    return t._replace(basis=basis, mean=mean, sigma=sigma, bits=bits)


def table_arrays(t: KvtcTables) -> dict:
    return {"basis": t.basis, "mean": t.mean, "sigma": t.sigma, "bits": t.bits}


def tables(head_dim: int, params: dict) -> KvtcTables:
    """Tables of ``params``: ``bit_budget``, ``bit_choices``, ``beta`` and, calibrated,
    ``basis [..., d, d]``, ``mean``, ``variances [..., d]`` (the allocation is computed here,
    :func:`allocate_np`); without ``basis`` the placeholder (module doc)."""
    d = int(head_dim)
    budget = int(params.get("bit_budget", 512))
    choices = str(params.get("bit_choices", DEFAULT_CHOICES))
    beta = float(params.get("beta", 3.5))
    parse_choices(choices)
    if budget < 0:
        raise ValueError(f"bit_budget={budget} must be >= 0")
    if not beta > 1:
        raise ValueError(f"beta={beta} must exceed 1 (distortion falls with bits)")
    total = total_bits(budget, choices, d)
    basis = params.get("basis")
    if basis is None:
        basis, mean = np.eye(d, dtype=np.float32), np.zeros(d, np.float32)
        lam = np.ones(d, np.float32)
    else:
        basis = np.asarray(basis, np.float32)
        mean = np.asarray(params["mean"], np.float32)
        lam = np.maximum(np.asarray(params["variances"], np.float32), 0)
        if basis.shape[-2:] != (d, d) or mean.shape != basis.shape[:-1] or lam.shape != mean.shape:
            raise ValueError(f"basis {basis.shape}, mean {mean.shape}, variances {lam.shape} do "
                             f"not fit head_dim={d} ([..., {d}, {d}], [..., {d}], [..., {d}])")
    bits = allocate_np(lam, budget, choices, beta)
    f = lambda a: mx.array(np.ascontiguousarray(a))  # noqa: E731
    return KvtcTables(f(basis), f(mean), f(_spreads_np(lam)), f(bits), d, budget, choices, beta,
                      total, params.get("basis") is not None)


def bytes_per_row(head_dim: int, params: dict) -> int:
    """Bytes :func:`encode` holds a row: the bit stream and the float16 scale."""
    t = total_bits(int(params.get("bit_budget", 512)), str(params.get("bit_choices", DEFAULT_CHOICES)),
                   int(head_dim))
    return -(-t // 8) + 2


# ---- the bit stream -------------------------------------------------------------------------

def _layout_np(bits: np.ndarray, total: int):
    """``(src, shift, gather)`` of allocations ``bits [..., d]``: the component and bit of each
    stream position ``[..., total]``, and the stream position of bit ``k`` of component ``i``
    ``[..., d, MAX_BITS]`` (``total``, a zero bit, past its width)."""
    b = np.asarray(bits, np.int32)
    end = np.cumsum(b, axis=-1)
    start = end - b
    p = np.arange(total)
    src = (end[..., None, :] <= p[:, None]).sum(axis=-1).astype(np.int32)       # [..., T]
    shift = (p - np.take_along_axis(start, np.minimum(src, b.shape[-1] - 1), axis=-1)).astype(np.uint32)
    k = np.arange(MAX_BITS)
    gather = np.where(k < b[..., None], start[..., None] + k, total).astype(np.int32)
    return src, shift, gather


def _layout(bits: mx.array, total: int):
    b = bits.astype(mx.int32)
    end = mx.cumsum(b, axis=-1)
    start = end - b
    p = mx.arange(total, dtype=mx.int32)
    src = (end[..., None, :] <= p[:, None]).astype(mx.int32).sum(axis=-1)
    first = mx.take_along_axis(start, mx.minimum(src, b.shape[-1] - 1), axis=-1)
    shift = (p - first).astype(mx.uint32)
    k = mx.arange(MAX_BITS, dtype=mx.int32)
    gather = mx.where(k < b[..., None], start[..., None] + k, total)
    return src, shift, gather


def _tok(a):
    """A per-component table ``[..., d]`` (``[..., T]``) with a token axis before its last
    (rows ``[b, h, n, d]`` broadcast against it); a shared ``[d]`` as is."""
    return a if a.ndim == 1 else a[..., None, :]


def _pack(q: mx.array, bits: mx.array, total: int) -> mx.array:
    lead = q.shape[:-1]
    if total == 0:
        return mx.zeros((*lead, 0), mx.uint8)
    src, shift, _ = _layout(bits, total)
    idx = mx.broadcast_to(_tok(src), (*lead, total))
    stream = (mx.take_along_axis(q, idx, axis=-1) >> _tok(shift)) & 1
    pad = -total % 8
    if pad:
        stream = mx.concatenate([stream, mx.zeros((*lead, pad), mx.uint32)], axis=-1)
    stream = stream.reshape(*lead, stream.shape[-1] // 8, 8)
    return (stream << mx.arange(8, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint8)


def _unpack(stream: mx.array, bits: mx.array, total: int, d: int) -> mx.array:
    lead = stream.shape[:-1]
    if total == 0:
        return mx.zeros((*lead, d), mx.uint32)
    _, _, gather = _layout(bits, total)
    flat = ((stream.astype(mx.uint32)[..., None] >> mx.arange(8, dtype=mx.uint32)) & 1)
    flat = flat.reshape(*lead, stream.shape[-1] * 8)[..., :total]
    flat = mx.concatenate([flat, mx.zeros((*lead, 1), mx.uint32)], axis=-1)
    g = gather.reshape(*gather.shape[:-2], d * MAX_BITS)
    g = mx.broadcast_to(_tok(g), (*lead, d * MAX_BITS))
    got = mx.take_along_axis(flat, g, axis=-1).reshape(*lead, d, MAX_BITS)
    return (got << mx.arange(MAX_BITS, dtype=mx.uint32)).sum(axis=-1).astype(mx.uint32)


def _pack_np(q: np.ndarray, bits: np.ndarray, total: int) -> np.ndarray:
    lead = q.shape[:-1]
    if total == 0:
        return np.zeros((*lead, 0), np.uint8)
    src, shift, _ = _layout_np(bits, total)
    idx = np.broadcast_to(_tok(src), (*lead, total))
    stream = (np.take_along_axis(q.astype(np.uint32), idx, axis=-1) >> _tok(shift)) & 1
    stream = np.concatenate([stream, np.zeros((*lead, -total % 8), np.uint32)], axis=-1)
    stream = stream.reshape(*lead, stream.shape[-1] // 8, 8)
    return (stream << np.arange(8, dtype=np.uint32)).sum(axis=-1).astype(np.uint8)


def _unpack_np(stream: np.ndarray, bits: np.ndarray, total: int, d: int) -> np.ndarray:
    stream = np.asarray(stream)
    lead = stream.shape[:-1]
    if total == 0:
        return np.zeros((*lead, d), np.uint32)
    _, _, gather = _layout_np(bits, total)
    flat = ((stream.astype(np.uint32)[..., None] >> np.arange(8, dtype=np.uint32)) & 1)
    flat = flat.reshape(*lead, stream.shape[-1] * 8)[..., :total]
    flat = np.concatenate([flat, np.zeros((*lead, 1), np.uint32)], axis=-1)
    g = np.broadcast_to(_tok(gather.reshape(*gather.shape[:-2], d * MAX_BITS)), (*lead, d * MAX_BITS))
    got = np.take_along_axis(flat, g, axis=-1).reshape(*lead, d, MAX_BITS)
    return (got << np.arange(MAX_BITS, dtype=np.uint32)).sum(axis=-1).astype(np.uint32)


# ---- MLX ------------------------------------------------------------------------------------

def _rotate(t: KvtcTables, x: mx.array) -> mx.array:
    """Coefficients ``(x - mean) @ basis.T`` of float32 rows."""
    return (x - _tok(t.mean)) @ t.basis.swapaxes(-1, -2)


def _quantize(t: KvtcTables, y: mx.array):
    """``(codes uint32 [..., d], scale float16 [...])`` of coefficients ``y``."""
    b = _tok(t.bits).astype(mx.uint32)
    on = b > 0
    u = y / _tok(t.sigma)
    zero = mx.array(0.0, mx.float32)
    a = mx.where(on & mx.isfinite(u), mx.abs(u), zero).max(axis=-1)
    a = mx.minimum(a, _F16_MAX)
    s16 = a.astype(mx.float16)  # rounded up: every coded |u| / s <= 1
    s16 = (s16.view(mx.uint16) + (s16.astype(mx.float32) < a).astype(mx.uint16)).view(mx.float16)
    s = s16.astype(mx.float32)
    inv = mx.where(s > 0, 1.0 / s, zero)
    half = mx.power(mx.array(2.0, mx.float32), b.astype(mx.float32) - 1)
    code = mx.floor((u * inv[..., None] + 1) * half)
    code = mx.clip(mx.where(mx.isfinite(code), code, half), 0, 2 * half - 1)
    return mx.where(on, code, zero).astype(mx.uint32), s16


def _dequantize(t: KvtcTables, q: mx.array, s16: mx.array) -> mx.array:
    b = _tok(t.bits).astype(mx.float32)
    half = mx.power(mx.array(2.0, mx.float32), b - 1)
    u = ((q.astype(mx.float32) + 0.5) / half - 1) * s16.astype(mx.float32)[..., None]
    return mx.where(b > 0, u * _tok(t.sigma), mx.array(0.0, mx.float32))


def _coefficients(t: KvtcTables, codes: KvtcCodes) -> mx.array:
    q = _unpack(codes.codes, t.bits, t.total, t.head_dim)
    return _dequantize(t, q, codes.scale)


def encode(t: KvtcTables, rows: mx.array) -> KvtcCodes:
    q, s = _quantize(t, _rotate(t, rows.astype(mx.float32)))
    return KvtcCodes(_pack(q, t.bits, t.total), s)


def decode(t: KvtcTables, codes: KvtcCodes) -> mx.array:
    return _coefficients(t, codes) @ t.basis + _tok(t.mean)


def scores(t: KvtcTables, queries: mx.array, codes: KvtcCodes) -> mx.array:
    """The query rotated once against the coefficients, plus its product with the mean."""
    q = queries.astype(mx.float32)
    qr = q @ t.basis.swapaxes(-1, -2)
    qm = (q * _tok(t.mean)).sum(axis=-1, keepdims=True)
    return qr @ _coefficients(t, codes).swapaxes(-1, -2) + qm


# ---- NumPy twins ----------------------------------------------------------------------------

def _rotate_np(t: KvtcTables, x: np.ndarray) -> np.ndarray:
    return (x - _tok(np.asarray(t.mean))) @ np.swapaxes(np.asarray(t.basis), -1, -2)


def quantize_np(t: KvtcTables, y: np.ndarray):
    """NumPy twin of the coefficients' quantizer: ``(codes uint32, scale float16)``."""
    b = _tok(np.asarray(t.bits)).astype(np.uint32)
    on = b > 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        u = (y / _tok(np.asarray(t.sigma))).astype(np.float32)
        a = np.where(on & np.isfinite(u), np.abs(u), np.float32(0)).max(axis=-1)
        a = np.minimum(a, np.float32(_F16_MAX))
        s16 = a.astype(np.float16)
        s16 = (s16.view(np.uint16) + (s16.astype(np.float32) < a).astype(np.uint16)).view(np.float16)
        s = s16.astype(np.float32)
        inv = np.where(s > 0, np.float32(1.0) / s, np.float32(0)).astype(np.float32)
        half = np.power(np.float32(2.0), b.astype(np.float32) - 1).astype(np.float32)
        code = np.floor((u * inv[..., None] + 1) * half)
        code = np.clip(np.where(np.isfinite(code), code, half), 0, 2 * half - 1)
    return np.where(on, code, 0).astype(np.uint32), s16


def dequantize_np(t: KvtcTables, q: np.ndarray, s16: np.ndarray) -> np.ndarray:
    """NumPy twin of the coefficients' decode (component-wise, float32)."""
    b = _tok(np.asarray(t.bits)).astype(np.float32)
    half = np.power(np.float32(2.0), b - 1).astype(np.float32)
    u = ((q.astype(np.float32) + np.float32(0.5)) / half - 1) * np.asarray(s16).astype(np.float32)[..., None]
    return np.where(b > 0, u * _tok(np.asarray(t.sigma)), np.float32(0)).astype(np.float32)


def _coefficients_np(t: KvtcTables, codes: KvtcCodes) -> np.ndarray:
    q = _unpack_np(np.asarray(codes.codes), np.asarray(t.bits), t.total, t.head_dim)
    return dequantize_np(t, q, np.asarray(codes.scale))


def encode_np(t: KvtcTables, rows: np.ndarray) -> KvtcCodes:
    q, s = quantize_np(t, _rotate_np(t, np.asarray(rows, np.float32)))
    return KvtcCodes(_pack_np(q, np.asarray(t.bits), t.total), s)


def decode_np(t: KvtcTables, codes: KvtcCodes) -> np.ndarray:
    return _coefficients_np(t, codes) @ np.asarray(t.basis) + _tok(np.asarray(t.mean))


def scores_np(t: KvtcTables, queries: np.ndarray, codes: KvtcCodes) -> np.ndarray:
    q = np.asarray(queries, np.float32)
    qr = q @ np.swapaxes(np.asarray(t.basis), -1, -2)
    qm = (q * _tok(np.asarray(t.mean))).sum(axis=-1, keepdims=True)
    return qr @ np.swapaxes(_coefficients_np(t, codes), -1, -2) + qm


def head_tables(t: KvtcTables, i: int, j: int) -> KvtcTables:
    """Batch row ``i``, kv head ``j``'s tables (leading ``[1, 1]``) of tables fitted a row and
    head (``[b, h, ...]``), or a kv head's (``[h, ...]``); shared tables as they are."""
    def one(x, base):  # base: the array's own axes (2 for the basis, 1 for the others)
        x = np.asarray(x)
        lead = x.ndim - base
        return x[i:i + 1, j:j + 1] if lead == 2 else x[None, j:j + 1] if lead == 1 else x
    return t._replace(basis=one(t.basis, 2), mean=one(t.mean, 1), sigma=one(t.sigma, 1),
                      bits=one(t.bits, 1))


CODEC = register_codec(Codec(
    name="kvtc", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("bit_budget", "bit_choices", "beta", "basis", "mean", "variances"),
    error="coefficient i within sigma_i s / 2^bits_i of the row's principal coefficient "
          "(s = the row's float16 scale, max |y_i / sigma_i| over the coded components); a "
          "0-bit component decodes to the mean", head=head_tables))


# ---- entropy coding (stored caches) ---------------------------------------------------------

def entropy_encode_np(q: np.ndarray, bits: np.ndarray, rows: np.ndarray | None = None):
    """Range-code codes ``q [b, h, n, d]`` (uint32, each below ``2^bits``) of allocations
    ``bits [b, h, d]``: ``(words uint32, means int32 [b, h, d], scales uint8 [b, h, d])``.
    Each (batch row, kv head, coded component) has a quantized Laplace model fitted to its
    symbols (``velox.entropy.fit_laplace``: the rounded mean and a one-byte scale); 0-bit
    components hold no symbol. ``rows`` (bool ``[b, h, n]``) picks the rows coded (all by
    default). Lossless: :func:`entropy_decode_np` returns the same codes."""
    from .. import entropy
    q = np.asarray(q, np.int64)
    b = np.asarray(bits, np.int64)
    if rows is None:
        rows = np.ones(q.shape[:3], bool)
    on = np.broadcast_to(b[:, :, None, :] > 0, q.shape) & rows[..., None]
    qz = np.where(on, q, 0)
    cnt = np.maximum(on.sum(axis=2), 1)
    mean = np.round(qz.sum(axis=2) / cnt).astype(np.int64)              # [b, h, d]
    spread = np.where(on, np.abs(q - mean[:, :, None, :]), 0).sum(axis=2) / cnt
    scale = entropy.index_of(spread)
    sym = np.moveaxis(q, 2, 3)[np.moveaxis(on, 2, 3)]                    # [b, h, d, n] order
    per = np.moveaxis(on, 2, 3).sum(axis=-1)                             # symbols a component
    means = np.repeat(mean.ravel(), per.ravel()).astype(np.float64)
    scales = np.repeat(entropy.scale_of(scale).ravel(), per.ravel())
    hi = (1 << MAX_BITS) - 1
    words = entropy.encode(np.zeros(0, np.int64), 1, sym, 0, hi, means, scales)
    return words, mean.astype(np.int32), scale


def entropy_decode_np(words: np.ndarray, bits: np.ndarray, n: int, means: np.ndarray,
                      scales: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`entropy_encode_np`: codes ``uint32 [b, h, n, d]`` (0 where a
    component has no bits or a row was not coded)."""
    from .. import entropy
    b = np.asarray(bits, np.int64)
    bb, h, d = b.shape
    if rows is None:
        rows = np.ones((bb, h, n), bool)
    on = np.broadcast_to(b[:, :, None, :] > 0, (bb, h, n, d)) & rows[..., None]
    on_t = np.moveaxis(on, 2, 3)
    per = on_t.sum(axis=-1)
    m = np.repeat(np.asarray(means, np.int64).ravel(), per.ravel()).astype(np.float64)
    s = np.repeat(entropy.scale_of(scales).ravel(), per.ravel())
    _, sym = entropy.decode(words, 0, 1, 0, (1 << MAX_BITS) - 1, m, s)
    out = np.zeros((bb, h, d, n), np.int64)
    out[on_t] = sym
    return np.moveaxis(out, 3, 2).astype(np.uint32)


# ---- stored rows (prompt-cache files) -------------------------------------------------------

def _np_tables(basis, mean, sigma, bits, budget: int, choices: str, beta: float) -> KvtcTables:
    d = basis.shape[-1]
    return KvtcTables(basis, mean, sigma, bits, d, int(budget), choices, float(beta),
                      total_bits(int(budget), choices, d), False)


def compress_rows_np(rows: np.ndarray, exact: np.ndarray, *, bit_budget: int = 512,
                     bit_choices: str = DEFAULT_CHOICES, beta: float = 3.5) -> dict:
    """Rows ``[b, h, n, d]`` (float32) as KVTC codes, range-coded: the rows where ``exact``
    (bool ``[b, h, n]``) and the rows with a non-finite entry held as they are, the others
    fitted (:func:`fit_np`, one basis a batch row and kv head, on the coded rows only), coded
    and range-coded (:func:`entropy_encode_np`). Returns the arrays :func:`decompress_rows_np`
    reads (every one counted in a file's bytes)."""
    x = np.asarray(rows, np.float32)
    keep = np.asarray(exact, bool) | ~np.isfinite(x).all(axis=-1)
    basis, mean, sigma, bits, _ = fit_np(np.where(keep[..., None], np.nan, x), bit_budget,
                                         bit_choices, beta)
    t = _np_tables(basis, mean, sigma, bits, bit_budget, bit_choices, beta)
    with np.errstate(invalid="ignore"):
        q, s16 = quantize_np(t, _rotate_np(t, np.where(keep[..., None], 0, x)))
    words, lmean, lscale = entropy_encode_np(q, bits, ~keep)
    return {"words": words, "basis": basis, "mean": mean.astype(np.float32),
            "sigma": sigma.astype(np.float32), "bits": bits, "model_mean": lmean,
            "model_scale": lscale, "scale": s16[~keep], "exact": np.packbits(keep.ravel()),
            "exact_rows": x[keep]}


def decompress_rows_np(a: dict, shape: tuple, *, bit_budget: int = 512,
                       bit_choices: str = DEFAULT_CHOICES, beta: float = 3.5) -> np.ndarray:
    """Inverse of :func:`compress_rows_np`: float32 rows ``shape`` (``[b, h, n, d]``), the
    exact ones bit for bit, the others KVTC's reconstruction."""
    b, h, n, d = shape
    keep = np.unpackbits(np.asarray(a["exact"]), count=b * h * n).astype(bool).reshape(b, h, n)
    t = _np_tables(*(np.asarray(a[k]) for k in ("basis", "mean", "sigma", "bits")),
                   bit_budget, bit_choices, beta)
    q = entropy_decode_np(np.asarray(a["words"]), t.bits, n, a["model_mean"], a["model_scale"], ~keep)
    s16 = np.zeros((b, h, n), np.float16)
    s16[~keep] = np.asarray(a["scale"])
    out = dequantize_np(t, q, s16) @ t.basis + _tok(t.mean)
    out = out.astype(np.float32)
    out[keep] = np.asarray(a["exact_rows"], np.float32)
    return out


def compress_codes_np(stream: np.ndarray, bits: np.ndarray, total: int, held: int) -> dict:
    """A KVTC state's packed codes ``uint8 [b, h, n, w]`` range-coded losslessly, the first
    ``held`` rows (the tokens; the rest are empty rows, zeros)."""
    b, h, n, _ = stream.shape
    q = _unpack_np(np.asarray(stream), np.asarray(bits), total, np.shape(bits)[-1])
    rows = np.zeros((b, h, n), bool)
    rows[:, :, :held] = True
    words, lmean, lscale = entropy_encode_np(q, bits, rows)
    return {"words": words, "model_mean": lmean, "model_scale": lscale}


def decompress_codes_np(a: dict, shape: tuple, bits: np.ndarray, total: int, held: int) -> np.ndarray:
    """Inverse of :func:`compress_codes_np`: the packed codes, to the bit."""
    b, h, n, _ = shape
    rows = np.zeros((b, h, n), bool)
    rows[:, :, :held] = True
    q = entropy_decode_np(np.asarray(a["words"]), bits, n, a["model_mean"], a["model_scale"], rows)
    return _pack_np(q, np.asarray(bits), total)


# ---- entropy-coded rows (prompt-cache files) ------------------------------------------------
#
# Rows [b, h, n, d] coded with one step for every principal component, the codes range-coded
# (entropy-constrained scalar quantization: under an entropy coder, the allocation that
# minimises the squared error at a rate gives every component the same step, the reverse
# water-filling of transform coding, so the dynamic programme above is not needed here).
# A batch row's rows are coded jointly over its kv heads (one row of h * d entries a token, one
# basis for the heads together: they are correlated); keys may be coded with their rotary
# position embedding removed (RoPE turns a key by its position: the content PCA sees is the
# unturned key). Quiet rows (a token whose value row is far below its head's median norm: the
# tokens that take the attention a layer does not spend, whose small values an absolute error
# swamps) are coded at a step ECSQ_FINE times finer. The basis is stored in integers of the
# precision each component needs, each vector in the coordinates the vectors before it leave
# (:func:`_basis_walk`); the mean in float16 (float32 where float16 cannot hold it).

#: Quiet rows are coded at the step over this.
ECSQ_FINE = 16
#: A token is quiet where, in some kv head, its value row's norm is below this share of that
#: head's median value-row norm (over the coded rows).
ECSQ_QUIET = 0.3
#: Basis vectors of spread below this many steps are not stored: what the stored ones leave is
#: completed by an orthonormal basis both sides compute. 0 (every vector stored): the small
#: components' own directions keep a rare large coefficient in one code, where a completed basis
#: spreads it below half a step over many (dropping them costs SmolLM2 several percent of
#: perplexity).
ECSQ_KEEP = 0.0
#: Basis vector ``i``'s coordinates (``D - i`` of them) are held in multiples of ``2**-e_i``,
#: ``e_i = ceil(log2(max(sigma_i / step, ECSQ_BASIS_FLOOR) sqrt(D - i))) + ECSQ_BASIS_BITS``:
#: a vector's error along a later one draws ``sigma_i`` times it into that coefficient, so a
#: component of larger spread is held finer (1 bit more than that halves SmolLM2's loss at 5%
#: more bytes; 2 fewer triple it).
ECSQ_BASIS_BITS = 1
ECSQ_BASIS_FLOOR = 1.0


def rope_np(x: np.ndarray, positions: np.ndarray, theta: float, traditional: bool,
            inverse: bool = False) -> np.ndarray:
    """Rows ``x [..., n, d]`` turned by the rotary embedding of integer ``positions [..., n]``
    (mlx's ``nn.RoPE(d, traditional, base=theta)``: pairs ``(i, i + d/2)``, or ``(2i, 2i + 1)``
    when ``traditional``, at frequency ``theta ** (-2i / d)``); ``inverse`` turns them back.
    Float32 (the angles in float64, once a distinct position)."""
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    half = d // 2
    freq = float(theta) ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / d)
    uniq, inv = np.unique(np.asarray(positions, np.int64), return_inverse=True)
    ang = uniq[:, None].astype(np.float64) * freq
    c = np.cos(ang).astype(np.float32)[inv.reshape(np.shape(positions))]
    s = np.sin(ang).astype(np.float32)[inv.reshape(np.shape(positions))]
    if inverse:
        s = -s
    if traditional:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        a, b = x[..., :half], x[..., half:2 * half]
    out = x.copy()
    if traditional:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    else:
        out[..., :half], out[..., half:2 * half] = a * c - b * s, a * s + b * c
    return out


def quiet_rows_np(values: np.ndarray, coded: np.ndarray) -> np.ndarray:
    """Quiet tokens ``[b, n]`` of value rows ``[b, h, n, d]``: where some head's row norm is
    below ``ECSQ_QUIET`` times that head's median over the ``coded [b, h, n]`` rows."""
    v = np.asarray(values, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        norm = np.sqrt(np.einsum("bhnd,bhnd->bhn", v, v, dtype=np.float64))
    coded = np.asarray(coded, bool) & np.isfinite(norm)
    out = np.zeros((norm.shape[0], norm.shape[2]), bool)
    for i in range(norm.shape[0]):
        for j in range(norm.shape[1]):
            if coded[i, j].any():
                med = np.median(norm[i, j][coded[i, j]])
                out[i] |= coded[i, j] & (norm[i, j] < ECSQ_QUIET * med)
    return out


def _join(x: np.ndarray) -> np.ndarray:
    """``[h, n, d]`` -> ``[n, h * d]``: a token's heads side by side."""
    h, n, d = x.shape
    return np.ascontiguousarray(np.swapaxes(x, 0, 1)).reshape(n, h * d)


def _split(z: np.ndarray, h: int) -> np.ndarray:
    n, hd = z.shape
    return np.ascontiguousarray(np.swapaxes(z.reshape(n, h, hd // h), 0, 1))


def _basis_walk(D: int, widths, vectors=None):
    """The orthonormal basis ``[D, D]`` (rows) built from stored vectors, each given by its
    integer coordinates in what the vectors before it leave (Gram-Schmidt: vector ``j`` has
    ``D - j`` coordinates, in multiples of ``2**-widths[j]``): returns ``(basis, coords)``.

    The encoder passes ``vectors [k, D]`` (unit rows, largest spread first) and gets their
    coordinates rounded; the decoder passes the coordinates (a list of integer arrays) and gets
    the same basis. The complement is carried as orthonormal rows, narrowed by one Householder
    reflection a vector; what the ``k`` vectors leave completes the basis. A coarsely stored
    vector is still exactly orthogonal to the ones before it, so it never draws a larger
    component's spread into its coefficient, and an orthonormal ``D x D`` matrix is stored in
    ``D (D + 1) / 2`` numbers, not ``D**2``. Floats only shape the basis: another machine's
    arithmetic moves the decoded rows by rounding, never the decoded codes."""
    comp = np.eye(D)
    rows = np.zeros((len(widths), D))
    coords = []
    encode = vectors is not None and not isinstance(vectors, list)
    for j, w in enumerate(widths):
        scale = 2.0 ** int(w)
        c = (np.rint((comp @ vectors[j]) * scale).astype(np.int64) if encode
             else np.asarray(vectors[j], np.int64))
        coords.append(c)
        u = c / scale
        norm = math.sqrt(float(u @ u))
        if norm == 0.0:
            u = np.zeros(D - j)
            u[0] = 1.0
        else:
            u /= norm
        rows[j] = u @ comp
        u[0] += 1.0 if u[0] >= 0 else -1.0                    # the reflection taking u to -+e_0
        u *= math.sqrt(2.0 / float(u @ u))
        comp = comp[1:] - np.multiply.outer(u[1:], u @ comp)  # its rows 1.. of H comp
    return np.concatenate([rows, comp]), coords


def compress_rows_ecsq_np(rows: np.ndarray, exact: np.ndarray, *, step: float | int,
                          quiet: np.ndarray | None = None, positions: np.ndarray | None = None,
                          rope: tuple[float, bool] | None = None) -> dict:
    """Rows ``[b, h, n, d]`` coded at ``step`` (the quantizer's step over the rows' RMS spread
    about their mean) and range-coded; returns the arrays :func:`decompress_rows_ecsq_np`
    reads (every one counted in a file's bytes).

    A token (batch row, storage slot) is held exact where ``exact [b, h, n]`` marks it in any
    head, a row of it is not finite or a code of it would pass ``velox.entropy.GEO_MAX_BOUND``
    (``exact_rows``: those rows in ``rows``' dtype); the others are coded together over the
    heads (``D = h * d`` entries a token): their mean, their principal basis (every component;
    vector ``j`` stored by its coordinates in what the vectors before it leave, in integers of
    ``2**-shift_j``, :func:`_basis_walk`) and every coefficient's code ``round(y / step)``.
    ``quiet [b, n]`` tokens are coded at ``step / ECSQ_FINE`` (left out of the fit). With
    ``rope = (theta, traditional)`` the rows are coded turned back by ``positions [b, h, n]``
    (keys under a rotary embedding). Each component's codes (its quiet rows apart) and each
    basis vector are range-coded with a two-sided geometric model of their own
    (``velox.entropy.geo_encode``)."""
    from .. import entropy
    x = np.asarray(rows)
    b, h, n, d = x.shape
    D = h * d
    with np.errstate(invalid="ignore", over="ignore"):
        z = x.astype(np.float32)
        finite = np.isfinite(z).all(axis=-1)
    keep = (np.asarray(exact, bool) | ~finite).any(axis=1)                     # [b, n]
    quiet = np.zeros((b, n), bool) if quiet is None else np.asarray(quiet, bool) & ~keep
    z = np.where(finite[..., None], z, np.float32(0))
    if rope is not None:
        z = rope_np(z, positions, rope[0], rope[1], inverse=True)
    z = [_join(z[i]) for i in range(b)]
    fits = []
    for i in range(b):
        fit = ~keep[i] & ~quiet[i]
        fits.append(fit if fit.sum() >= 2 else ~keep[i])
    means = np.stack([z[i][fits[i]].mean(axis=0, dtype=np.float64) if fits[i].any() else np.zeros(D)
                      for i in range(b)]) if b else np.zeros((0, D))
    means = means.astype(np.float16 if (np.abs(means) < 32768).all() else np.float32)
    deltas, ks, shifts, bmodels, models, bounds, blocks = [], [], [], [], [], [], []
    for i in range(b):
        fit = fits[i]
        xc = z[i] - means[i].astype(np.float32)
        delta = 0.0
        if fit.any():
            f = xc[fit]
            lam, vec = np.linalg.eigh((f.T @ f).astype(np.float64) / fit.sum())
            lam, vec = np.maximum(lam[::-1], 0.0), vec[:, ::-1]
            delta = float(np.float32(float(step) * math.sqrt(lam.sum() / D)))
        if not (delta > 0 and math.isfinite(delta)):
            deltas.append(0.0)
            ks.append(0)
            models.append(np.zeros((D, 2), np.uint8))
            bounds.append((0, 0))
            continue
        k = int((np.sqrt(lam) >= ECSQ_KEEP * delta).sum())
        left = np.sqrt(D - np.arange(k))
        e = np.ceil(np.log2(np.maximum(np.sqrt(lam[:k]) / delta, ECSQ_BASIS_FLOOR) * left))
        e = np.clip(e + ECSQ_BASIS_BITS, 1, 24).astype(np.int64)
        basis, bq = _basis_walk(D, e, vec[:, :k].T)
        q = np.rint((xc @ basis.T.astype(np.float32)) / np.where(
            quiet[i], np.float32(delta / ECSQ_FINE), np.float32(delta))[:, None]).astype(np.int64)
        far = ~keep[i] & (np.abs(q).max(axis=1) > entropy.GEO_MAX_BOUND)
        keep[i] |= far
        quiet[i] &= ~far
        coded = ~keep[i]
        qn, qf = q[coded & ~quiet[i]], q[coded & quiet[i]]
        rn = int(np.abs(qn).max()) if qn.size else 0
        rf = int(np.abs(qf).max()) if qf.size else 0
        mb = entropy.geo_fit(D - np.arange(k), np.array([np.abs(c).sum() for c in bq]), 1 << e)
        mn = entropy.geo_fit(len(qn), np.abs(qn).sum(axis=0), rn)
        mf = entropy.geo_fit(len(qf), np.abs(qf).sum(axis=0), rf)
        blocks += [(bq[c], mb[c], 1 << int(e[c])) for c in range(k)]
        blocks += [(col, mn[c], rn) for c, col in enumerate(qn.T)]
        blocks += [(col, mf[c], rf) for c, col in enumerate(qf.T)]
        deltas.append(delta)
        ks.append(k)
        shifts.append(e.astype(np.int8))
        bmodels.append(mb)
        models.append(np.stack([mn, mf], axis=1))
        bounds.append((rn, rf))
    xk = np.swapaxes(x, 1, 2)[keep]                                             # [m, h, d]
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt)  # noqa: E731
    return {"words": entropy.geo_encode(blocks), "exact": np.packbits(keep.ravel()),
            "quiet": np.packbits(quiet.ravel()), "mean": means,
            "step": np.array(deltas, np.float32), "components": np.array(ks, np.int32),
            "shift": cat(shifts, np.int8), "basis_models": cat(bmodels, np.uint8),
            "models": np.stack(models).astype(np.uint8) if b else np.zeros((0, D, 2), np.uint8),
            "bounds": np.array(bounds, np.int32).reshape(b, 2), "exact_rows": xk}


def decompress_rows_ecsq_np(a: dict, shape: tuple, *, positions: np.ndarray | None = None,
                            rope: tuple[float, bool] | None = None) -> np.ndarray:
    """Inverse of :func:`compress_rows_ecsq_np`: float32 rows ``shape`` (``[b, h, n, d]``),
    the exact tokens bit for bit, the others the codes' reconstruction. Raises ``ValueError``
    where the arrays do not fit ``shape`` or each other."""
    from .. import entropy
    b, h, n, d = (int(s) for s in shape)
    D = h * d
    if np.asarray(a["exact"]).shape != (-(-b * n // 8),) or np.asarray(a["quiet"]).shape != (-(-b * n // 8),):
        raise ValueError(f"entropy-coded rows whose row flags do not fit the shape {(b, h, n, d)}")
    keep = np.unpackbits(np.asarray(a["exact"], np.uint8), count=b * n).astype(bool).reshape(b, n)
    quiet = np.unpackbits(np.asarray(a["quiet"], np.uint8), count=b * n).astype(bool).reshape(b, n)
    means = np.asarray(a["mean"]).astype(np.float32)
    deltas = np.asarray(a["step"], np.float32)
    ks = np.asarray(a["components"], np.int64)
    shifts = np.asarray(a["shift"], np.int64)
    bmodels = np.asarray(a["basis_models"], np.int64)
    models = np.asarray(a["models"], np.int64)
    bounds = np.asarray(a["bounds"], np.int64)
    xk = np.asarray(a["exact_rows"])
    total = int(ks.sum()) if ks.size else 0
    if (means.shape != (b, D) or deltas.shape != (b,) or ks.shape != (b,) or bounds.shape != (b, 2)
            or models.shape != (b, D, 2) or (ks < 0).any() or (ks > D).any()
            or shifts.shape != (total,) or bmodels.shape != (total,) or (shifts < 1).any()
            or (shifts > 24).any() or (bounds < 0).any() or (quiet & keep).any()
            or xk.shape != (int(keep.sum()), h, d) or not np.isfinite(deltas).all()
            or (deltas < 0).any() or ((deltas == 0) & (ks > 0)).any()):
        raise ValueError("entropy-coded rows whose arrays do not fit each other or the shape "
                         f"{(b, h, n, d)}")
    specs, at = [], 0
    for i in range(b):
        k, coded = int(ks[i]), ~keep[i]
        if deltas[i] == 0:
            continue
        m, fine = int((coded & ~quiet[i]).sum()), int((coded & quiet[i]).sum())
        specs += [(D - c, bmodels[at + c], 1 << int(shifts[at + c])) for c in range(k)]
        specs += [(m, models[i, c, 0], bounds[i, 0]) for c in range(D)]
        specs += [(fine, models[i, c, 1], bounds[i, 1]) for c in range(D)]
        at += k
    got = entropy.geo_decode(np.asarray(a["words"], np.uint32), specs)
    out = np.zeros((b, n, D), np.float32)
    at = pos = 0
    for i in range(b):
        k, coded = int(ks[i]), ~keep[i]
        out[i] = means[i]
        if deltas[i] > 0:
            basis, _ = _basis_walk(D, shifts[at:at + k], got[pos:pos + k])
            q = np.zeros((n, D), np.float32)
            norm, fine = coded & ~quiet[i], coded & quiet[i]
            if norm.any():
                q[norm] = np.stack(got[pos + k:pos + k + D], axis=1) * deltas[i]
            if fine.any():
                q[fine] = np.stack(got[pos + k + D:pos + k + 2 * D], axis=1) * (deltas[i] / ECSQ_FINE)
            out[i] += q @ basis.astype(np.float32)
            pos += k + 2 * D
            at += k
    out = np.stack([_split(out[i], h) for i in range(b)]) if b else np.zeros((0, h, n, d), np.float32)
    if rope is not None:
        out = rope_np(out, positions, rope[0], rope[1])
    np.swapaxes(out, 1, 2)[keep] = xk.astype(np.float32)
    return out

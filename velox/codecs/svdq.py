"""SVDq's key codec: a row's latent channels in a principal basis, quantized at a fixed bit
schedule over eight contiguous groups of channels (Hong et al., "SVDq: 1.25-bit and 410x Key
Cache Compression for LLM Attention", arXiv:2502.15304).

A row ``x`` of a (batch row, kv head) is centred and projected on the first ``w`` principal
directions of its head (``basis [..., w, d]``, rows by decreasing variance): the latent
channels ``y = (x - mean) @ basis.T``. The head's rank ``r <= w`` (``rank``, an array: one a
batch row and kv head) splits its first ``r`` channels into :data:`GROUPS` contiguous groups,
as equal as possible (the first ``r mod 8`` one channel longer), and group ``g`` takes
``schedule[g]`` bits a channel (:func:`channel_bits`); channels past ``r`` take none. A
channel of 0 bits is dropped: it decodes to 0, the row to the mean along it.

Quantization (per row, as the row comes): each channel is scaled by its spread, ``u_i = y_i
/ sigma_i``; the channels fall in scale groups of ``group_size`` consecutive channels, each with
one float16 scale ``s = max |u_i|`` over its channels that take bits (rounded up to a float16,
so every ``|u_i| / s <= 1``), and channel ``i`` takes the mid-cell uniform code ``q_i =
floor((u_i / s + 1) 2^(b_i - 1))`` (clipped to ``[0, 2^b_i)``), decoded at the cell's centre:
within ``sigma_i s / 2^b_i`` of ``y_i`` (plus float32 rounding). The codes of a row form one
bit stream (KVTC's, ``velox.codecs.kvtc``: channel ``i``'s ``b_i`` bits after those of the
channels before it), ``ceil(total / 8)`` bytes, ``total`` the widest schedule a head of the
state can take (:func:`total_bits`: a head of smaller rank leaves the rest of its stream zero).

Tables: ``basis``, ``mean``, ``sigma``, ``bits`` and ``rank`` with leading axes ``[b, h]`` (one
fit a batch row and kv head, :func:`fit`) or none (the placeholder before a fit: the first
``w`` unit vectors, a zero mean, unit spreads, rank ``w``). The rank is ``rank`` when given
(``fixed_rank``), else the energy rank: the fewest leading components whose eigenvalues hold
``energy_threshold`` of the total. An energy rank below :func:`min_safe_rank` (fewer than four
channels a group) turns the schedule's 0-bit groups into 1-bit ones for that head (a fixed
rank that small is refused by the method instead).

Scores rotate the query once: ``q . x^ = (q @ basis.T) . y^ + q . mean``. Float32 arithmetic
in the same order in the MLX functions and their NumPy twins; the fit is one MLX function for
both backends.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import Codec, register_codec
from .kvtc import MAX_BITS, _pack, _pack_np, _tok, _unpack_np

__all__ = ["SvdqTables", "SvdqCodes", "GROUPS", "DEFAULT_SCHEDULE", "SCHEDULES", "parse_schedule",
           "min_safe_rank", "group_sizes", "channel_bits", "bit_table", "total_bits",
           "bytes_per_row", "unpack_codes", "tables", "principal_axes", "energy_rank", "fit", "fitted", "encode", "decode", "scores",
           "encode_np", "decode_np", "scores_np", "latents_np", "head_tables", "CODEC"]

#: Contiguous groups of latent channels the schedule assigns bits to.
GROUPS = 8
#: The paper's worked schedule (mean 2 bits a channel over the rank), the seed's default.
DEFAULT_SCHEDULE = "8,4,2,1,1,0,0,0"
#: Schedules the method takes: the paper's, gentler and harsher ones, uniform ones, and 16 bits
#: everywhere (near-lossless: the reconstruction within a 2^-16 step of each scale).
SCHEDULES = ("8,4,2,1,1,0,0,0", "8,8,4,4,2,2,1,1", "8,4,4,2,2,1,1,0", "4,2,1,1,0,0,0,0",
             "8,8,8,8,8,8,8,8", "4,4,4,4,4,4,4,4", "2,2,2,2,2,2,2,2", "16,16,16,16,16,16,16,16")
#: Channels a group needs (at the least) before a 0-bit group drops real signal.
MIN_CHANNELS = 4
_SIGMA_FLOOR = 1e-6
_F16_MAX = 65504.0


class SvdqTables(NamedTuple):
    """The principal directions, mean, spreads, bits and rank (leading axes ``[]`` or ``[b,
    h]``), the static widths."""

    basis: mx.array          # [..., w, d] float32; rows the principal directions
    mean: mx.array           # [..., d] float32
    sigma: mx.array          # [..., w] float32: each channel's spread (floored, > 0)
    bits: mx.array           # [..., w] uint8: each channel's bits (0 past the rank)
    rank: mx.array           # [...] int32: the channels the schedule spans
    head_dim: int
    width: int               # w: latent channels held (rank, or head_dim for the energy rank)
    fixed_rank: int          # the method's rank (0: each head's energy rank)
    energy_threshold: float
    bit_schedule: str
    group_size: int          # channels a float16 scale
    total: int               # bits a row's stream holds: total_bits(width, ...)


class SvdqCodes(NamedTuple):
    """Each row's codes as one bit stream and its float16 scale a group of channels."""

    codes: mx.array          # uint8 [b, h, n, ceil(total / 8)]
    scales: mx.array         # float16 [b, h, n, ceil(w / group_size)]


# ---- the schedule ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def parse_schedule(schedule: str) -> tuple[int, ...]:
    """``"8,4,2,1,1,0,0,0"`` -> ``(8, 4, 2, 1, 1, 0, 0, 0)``: :data:`GROUPS` widths in
    ``0..16``."""
    try:
        got = tuple(int(c) for c in str(schedule).split(","))
    except ValueError:
        raise ValueError(f"bit_schedule={schedule!r} must be comma-separated integers") from None
    if len(got) != GROUPS or any(not 0 <= b <= MAX_BITS for b in got):
        raise ValueError(f"bit_schedule={schedule!r} must hold {GROUPS} widths in 0..{MAX_BITS}")
    return got


def min_safe_rank(schedule: str) -> int:
    """The smallest rank at which a schedule with a 0-bit group keeps :data:`MIN_CHANNELS`
    channels a group (32); 1 for a schedule without one."""
    return GROUPS * MIN_CHANNELS if 0 in parse_schedule(schedule) else 1


def group_sizes(r: int) -> list[int]:
    """Channels of each of the :data:`GROUPS` groups of ``r`` channels: as equal as possible,
    the first ``r mod 8`` one longer."""
    q, rem = divmod(int(r), GROUPS)
    return [q + (g < rem) for g in range(GROUPS)]


def channel_bits(r: int, width: int, schedule: str, auto: bool) -> np.ndarray:
    """Bits of each of ``width`` channels ``uint8 [width]`` for rank ``r``: group ``g`` of
    the first ``r`` at ``schedule[g]``, 0 past ``r``. ``auto`` (an energy rank): below
    :func:`min_safe_rank` the 0-bit groups take 1 bit."""
    sched = parse_schedule(schedule)
    if auto and r < min_safe_rank(schedule):
        sched = tuple(max(b, 1) for b in sched)
    bits = np.repeat(np.array(sched, np.uint8), group_sizes(min(r, width)))
    return np.concatenate([bits, np.zeros(width - len(bits), np.uint8)])


@functools.lru_cache(maxsize=64)
def _bit_table(width: int, schedule: str, auto: bool) -> np.ndarray:
    return np.stack([channel_bits(r, width, schedule, auto) for r in range(width + 1)])


def bit_table(width: int, schedule: str, auto: bool) -> np.ndarray:
    """``uint8 [width + 1, width]``: row ``r`` the channels' bits at rank ``r``."""
    return _bit_table(int(width), str(schedule), bool(auto))


def total_bits(width: int, schedule: str, auto: bool) -> int:
    """Bits of a row's stream: the most any rank up to ``width`` spends (``width``'s, unless
    the small-rank rule gives a smaller rank more)."""
    return int(bit_table(width, schedule, auto).astype(np.int64).sum(axis=-1).max())


def bytes_per_row(head_dim: int, params: dict) -> int:
    """Bytes :func:`encode` holds a row: the bit stream and a float16 scale a group."""
    t = tables(head_dim, params)
    return -(-t.total // 8) + 2 * -(-t.width // t.group_size)


# ---- tables ---------------------------------------------------------------------------------

def _check(head_dim: int, rank: int, threshold: float, schedule: str, group_size: int) -> None:
    parse_schedule(schedule)
    if not 0 <= rank <= head_dim:
        raise ValueError(f"rank={rank} must lie in 0..head_dim={head_dim} (0: the energy rank)")
    if not 0 < threshold <= 1:
        raise ValueError(f"energy_threshold={threshold} must lie in (0, 1]")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")


def tables(head_dim: int, params: dict) -> SvdqTables:
    """The placeholder tables of ``params`` (``rank``, ``energy_threshold``, ``bit_schedule``,
    ``group_size``): the first ``w`` unit vectors, zero mean, unit spreads, rank ``w``; a fit
    (:func:`fitted`) replaces them."""
    d = int(head_dim)
    rank = int(params.get("rank", 0))
    threshold = float(params.get("energy_threshold", 0.95))
    schedule = str(params.get("bit_schedule", DEFAULT_SCHEDULE))
    gs = int(params.get("group_size", 32))
    _check(d, rank, threshold, schedule, gs)
    w = rank or d
    auto = rank == 0
    f = lambda a: mx.array(np.ascontiguousarray(a))  # noqa: E731
    return SvdqTables(f(np.eye(d, dtype=np.float32)[:w]), f(np.zeros(d, np.float32)),
                      f(np.ones(w, np.float32)), f(bit_table(w, schedule, auto)[w]),
                      mx.array(w, mx.int32), d, w, rank, threshold, schedule, gs,
                      total_bits(w, schedule, auto))


def principal_axes(rows: mx.array):
    """``(basis [..., d, d], mean [..., d], sigma [..., d], eigenvalues [..., d])`` of rows
    ``[..., n, d]``: the mean and covariance of the rows without a non-finite entry (scaled by
    their largest entry, so nothing overflows; the eigenvalues are the scaled rows'), its
    eigenvectors as rows by decreasing eigenvalue (each signed so that its largest-magnitude
    entry is positive), the spreads (square roots of the eigenvalues, floored at ``1e-6`` of
    the largest, in the rows' scale; all 1 when every eigenvalue is 0). The eigendecomposition
    runs on the CPU stream (MLX has it there only)."""
    x = rows.astype(mx.float32)
    ok = mx.all(mx.isfinite(x), axis=-1, keepdims=True)
    cnt = mx.maximum(ok.sum(axis=-2, keepdims=True), 1).astype(mx.float32)
    zero, one = mx.array(0.0, mx.float32), mx.array(1.0, mx.float32)
    xz = mx.where(ok, x, zero)
    c = mx.abs(xz).max(axis=(-2, -1), keepdims=True)
    c = mx.where(c > 0, c, one)
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
    return vec.swapaxes(-1, -2), (mean * c)[..., 0, :], sigma, lam


def energy_rank(lam: mx.array, threshold: float, most: int) -> mx.array:
    """The fewest leading eigenvalues of ``lam [..., d]`` (decreasing) whose sum holds
    ``threshold`` of the total, int32 ``[...]`` in ``1..most`` (1 where the total is 0)."""
    cum = mx.cumsum(lam, axis=-1)
    short = (cum < threshold * cum[..., -1:]).astype(mx.int32).sum(axis=-1)
    return mx.clip(short + 1, 1, most).astype(mx.int32)


def fit(rows: mx.array, t: SvdqTables):
    """``(basis [..., w, d], mean [..., d], sigma [..., w], bits [..., w], rank [...],
    eigenvalues [..., d])`` of rows ``[..., n, d]``: the first ``w`` of
    :func:`principal_axes`, the rank (``t.fixed_rank``, or :func:`energy_rank` at
    ``energy_threshold``) and its bits."""
    vec, mean, sigma, lam = principal_axes(rows)
    w = t.width
    if t.fixed_rank:
        rank = mx.full(lam.shape[:-1], w, mx.int32)
    else:
        rank = energy_rank(lam, t.energy_threshold, w)
    bits = mx.take(mx.array(bit_table(w, t.bit_schedule, not t.fixed_rank)), rank, axis=0)
    return vec[..., :w, :], mean, sigma[..., :w], bits, rank, lam


def fitted(t: SvdqTables, rows: mx.array) -> SvdqTables:
    """``t`` with the basis, mean, spreads, bits and rank of :func:`fit` on ``rows [b, h, n,
    d]`` (one fit a batch row and kv head)."""
    basis, mean, sigma, bits, rank, _ = fit(rows, t)
    return t._replace(basis=basis, mean=mean, sigma=sigma, bits=bits, rank=rank)


# ---- MLX ------------------------------------------------------------------------------------

def _group_max(a: mx.array, w: int, gs: int) -> mx.array:
    """The largest of each group of ``gs`` channels of ``a [..., w]``: ``[..., ceil(w / gs)]``."""
    n = -(-w // gs)
    if n * gs != w:
        a = mx.concatenate([a, mx.zeros((*a.shape[:-1], n * gs - w), a.dtype)], axis=-1)
    return a.reshape(*a.shape[:-1], n, gs).max(axis=-1)


def _per_channel(s: mx.array, w: int, gs: int) -> mx.array:
    return mx.repeat(s, gs, axis=-1)[..., :w]


def _quantize(t: SvdqTables, y: mx.array):
    """``(codes uint32 [..., w], scales float16 [..., groups])`` of latent channels ``y``."""
    b = _tok(t.bits).astype(mx.uint32)
    on = b > 0
    u = y / _tok(t.sigma)
    zero = mx.array(0.0, mx.float32)
    a = _group_max(mx.where(on & mx.isfinite(u), mx.abs(u), zero), t.width, t.group_size)
    a = mx.minimum(a, _F16_MAX)
    s16 = a.astype(mx.float16)  # rounded up: every coded |u| / s <= 1
    s16 = (s16.view(mx.uint16) + (s16.astype(mx.float32) < a).astype(mx.uint16)).view(mx.float16)
    s = s16.astype(mx.float32)
    inv = _per_channel(mx.where(s > 0, 1.0 / s, zero), t.width, t.group_size)
    half = mx.power(mx.array(2.0, mx.float32), b.astype(mx.float32) - 1)
    code = mx.floor((u * inv + 1) * half)
    code = mx.clip(mx.where(mx.isfinite(code), code, half), 0, 2 * half - 1)
    return mx.where(on, code, zero).astype(mx.uint32), s16


def unpack_codes(stream: mx.array, bits, total: int) -> mx.array:
    """The codes ``uint32 [..., d]`` of bit streams ``uint8 [..., W]`` (KVTC's layout: code
    ``i`` in the ``bits[i]`` stream bits after those of the codes before it) for ``bits [...,
    d]`` (an MLX array, one allocation a batch row and kv head, or a NumPy ``[d]`` shared by
    every row): each code read from the three bytes that hold it (a width up to 16 bits and a
    shift up to 7 span at most three), shifted and masked; the same codes as KVTC's bitwise
    unpacking, with three gathers a code instead of sixteen."""
    static = isinstance(bits, np.ndarray)
    b = bits.astype(np.int64 if static else mx.int32)
    d = b.shape[-1]
    lead = stream.shape[:-1]
    if total == 0:
        return mx.zeros((*lead, d), mx.uint32)
    width = stream.shape[-1]
    start = (np.cumsum(b, axis=-1) if static else mx.cumsum(b, axis=-1)) - b
    s32 = stream.astype(mx.uint32)
    word = None
    for k in range(3):
        if static:
            part = mx.take(s32, mx.array(np.minimum(start // 8 + k, width - 1).astype(np.int32)), axis=-1)
        else:
            idx = mx.minimum(start // 8 + k, width - 1)
            part = mx.take_along_axis(s32, mx.broadcast_to(_tok(idx), (*lead, d)), axis=-1)
        part = part << (8 * k)
        word = part if word is None else word | part
    shift = start % 8
    if static:
        shift = mx.array(shift.astype(np.uint32))
        mask = mx.array(((1 << b) - 1).astype(np.uint32))
    else:
        shift = _tok(shift).astype(mx.uint32)
        mask = (mx.left_shift(mx.array(1, mx.uint32), _tok(b).astype(mx.uint32)) - 1)
    return (word >> shift) & mask


def _latents(t: SvdqTables, codes: SvdqCodes) -> mx.array:
    q = unpack_codes(codes.codes, t.bits, t.total).astype(mx.float32)
    b = _tok(t.bits).astype(mx.float32)
    half = mx.power(mx.array(2.0, mx.float32), b - 1)
    s = _per_channel(codes.scales.astype(mx.float32), t.width, t.group_size)
    u = ((q + 0.5) / half - 1) * s
    return mx.where(b > 0, u * _tok(t.sigma), mx.array(0.0, mx.float32))


def _stream(q: mx.array, bits: mx.array, total: int) -> mx.array:
    """The bit stream of codes ``q [..., w]``: a head whose bits sum below ``total`` (a smaller
    rank) reads the zero channel appended after its last (its stream's rest is zeros)."""
    pad = mx.zeros((*q.shape[:-1], 1), q.dtype)
    return _pack(mx.concatenate([q, pad], axis=-1), bits, total)


def encode(t: SvdqTables, rows: mx.array) -> SvdqCodes:
    y = (rows.astype(mx.float32) - _tok(t.mean)) @ t.basis.swapaxes(-1, -2)
    q, s = _quantize(t, y)
    return SvdqCodes(_stream(q, t.bits, t.total), s)


def decode(t: SvdqTables, codes: SvdqCodes) -> mx.array:
    return _latents(t, codes) @ t.basis + _tok(t.mean)


def scores(t: SvdqTables, queries: mx.array, codes: SvdqCodes) -> mx.array:
    """The query projected once onto the latent channels, plus its product with the mean."""
    q = queries.astype(mx.float32)
    qr = q @ t.basis.swapaxes(-1, -2)
    qm = (q * _tok(t.mean)).sum(axis=-1, keepdims=True)
    return qr @ _latents(t, codes).swapaxes(-1, -2) + qm


# ---- NumPy twins ----------------------------------------------------------------------------

def _group_max_np(a: np.ndarray, w: int, gs: int) -> np.ndarray:
    n = -(-w // gs)
    a = np.concatenate([a, np.zeros((*a.shape[:-1], n * gs - w), a.dtype)], axis=-1)
    return a.reshape(*a.shape[:-1], n, gs).max(axis=-1)


def _quantize_np(t: SvdqTables, y: np.ndarray):
    b = _tok(np.asarray(t.bits)).astype(np.uint32)
    on = b > 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        u = (y / _tok(np.asarray(t.sigma))).astype(np.float32)
        a = _group_max_np(np.where(on & np.isfinite(u), np.abs(u), np.float32(0)), t.width,
                          t.group_size)
        a = np.minimum(a, np.float32(_F16_MAX))
        s16 = a.astype(np.float16)
        s16 = (s16.view(np.uint16) + (s16.astype(np.float32) < a).astype(np.uint16)).view(np.float16)
        s = s16.astype(np.float32)
        inv = np.where(s > 0, np.float32(1.0) / s, np.float32(0)).astype(np.float32)
        inv = np.repeat(inv, t.group_size, axis=-1)[..., :t.width]
        half = np.power(np.float32(2.0), b.astype(np.float32) - 1).astype(np.float32)
        code = np.floor((u * inv + 1) * half)
        code = np.clip(np.where(np.isfinite(code), code, half), 0, 2 * half - 1)
    return np.where(on, code, 0).astype(np.uint32), s16


def latents_np(t: SvdqTables, codes: SvdqCodes) -> np.ndarray:
    """The decoded latent channels ``[b, h, n, w]`` (float32): 0 on a channel of no bits."""
    q = _unpack_np(np.asarray(codes.codes), np.asarray(t.bits), t.total, t.width).astype(np.float32)
    b = _tok(np.asarray(t.bits)).astype(np.float32)
    half = np.power(np.float32(2.0), b - 1).astype(np.float32)
    s = np.repeat(np.asarray(codes.scales).astype(np.float32), t.group_size, axis=-1)[..., :t.width]
    u = ((q + np.float32(0.5)) / half - 1) * s
    return np.where(b > 0, u * _tok(np.asarray(t.sigma)), np.float32(0)).astype(np.float32)


def encode_np(t: SvdqTables, rows: np.ndarray) -> SvdqCodes:
    y = (np.asarray(rows, np.float32) - _tok(np.asarray(t.mean))) @ np.swapaxes(np.asarray(t.basis), -1, -2)
    q, s = _quantize_np(t, y)
    q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), q.dtype)], axis=-1)  # (_stream)
    return SvdqCodes(_pack_np(q, np.asarray(t.bits), t.total), s)


def decode_np(t: SvdqTables, codes: SvdqCodes) -> np.ndarray:
    return latents_np(t, codes) @ np.asarray(t.basis) + _tok(np.asarray(t.mean))


def scores_np(t: SvdqTables, queries: np.ndarray, codes: SvdqCodes) -> np.ndarray:
    q = np.asarray(queries, np.float32)
    qr = q @ np.swapaxes(np.asarray(t.basis), -1, -2)
    qm = (q * _tok(np.asarray(t.mean))).sum(axis=-1, keepdims=True)
    return qr @ np.swapaxes(latents_np(t, codes), -1, -2) + qm


def head_tables(t: SvdqTables, i: int, j: int) -> SvdqTables:
    """Batch row ``i``, kv head ``j``'s tables (leading ``[1, 1]``) of tables fitted a row and
    head; the placeholder (no leading axes) as it is."""
    def one(x, base):
        x = np.asarray(x)
        return x[i:i + 1, j:j + 1] if x.ndim - base == 2 else x
    return t._replace(basis=one(t.basis, 2), mean=one(t.mean, 1), sigma=one(t.sigma, 1),
                      bits=one(t.bits, 1), rank=one(t.rank, 0))


CODEC = register_codec(Codec(
    name="svdq", tables=tables, encode=encode, decode=decode, scores=scores,
    encode_np=encode_np, decode_np=decode_np, scores_np=scores_np,
    params=("rank", "energy_threshold", "bit_schedule", "group_size"),
    error="latent channel i within sigma_i s / 2^bits_i of the row's channel (s = its group's "
          "float16 scale); a channel of 0 bits, or past the rank, decodes to 0 (the row to the "
          "mean along it); the directions past the width are dropped",
    head=head_tables))

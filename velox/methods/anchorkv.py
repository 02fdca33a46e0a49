"""AnchorKV: each prompt token held as a multiple of an exactly stored anchor token, plus a
quantized residual where a byte budget allows it; no token is ever dropped.

The first update of more than one token is the prefill and is compressed in one shot (its
``S`` tokens); every later update (decode steps, later chunks) is appended exact
(``tail_keys``, ``tail_values``), as is a first update of one token. Per batch row and kv head:

1. Anchors: ``k = min(S, max(window, round(anchor_frac * S)))`` positions (round half up):
   the last ``w = min(window, S)``, then the ``round(rho * (k - w))`` earlier positions that
   the chunk's last ``w`` queries attend most (real queries grouped per kv head, else the
   key-as-query proxy; causal weights summed over the queries, averaged over the group),
   then the rest drawn uniformly without replacement (the lowest ranks of
   ``velox.noise.hash_uniform(seed, head, position)``). Held exact, positions in int32.
2. Keys and values apart, over the shared anchors: a token goes to the anchor of largest
   ``|cos|`` (anchors of zero or non-finite norm never), ``gamma = <x, a> / |a|^2`` rounded
   to float16, ``r = x - gamma a``; an anchor is its own anchor (``gamma = 1``, ``r = 0``).
3. Utility of a residual, over the ``w`` scoring queries ``q`` (scaled by ``d^-1/2``), their
   weights ``alpha`` and outputs ``y``, averaged over queries: ``u_K(t) = alpha_t^2 (q .
   r_K,t)^2 |v_t - y|^2``, ``u_V(t) = alpha_t^2 |r_V,t|^2``.
4. A batch row holds ``floor(theta * h * S * d * 4)`` bytes (theta of its float16 keys and
   values): less the anchors, their positions and each token's metadata (anchor index packed
   at ``ceil(log2 k)`` bits, float16 gamma, a 1-bit flag "residual stored", each side), the
   rest buys ``N`` residual slots of ``ceil(d * bits / 32)`` words and a float16 gain, ``N //
   2`` for keys and the rest for values, given to the top utilities across the row's heads
   (ties: the later head and token), never to anchors; ``N = 0`` when theta is too small.
   A slot holds ``R r`` (``R`` the randomized Hadamard rotation of ``seed``,
   ``velox.codecs.rotation``) as Gaussian Lloyd-Max cells at ``residual_bits`` after scaling
   its absmax to the outermost centroid, and the least-squares gain of the chosen centroids,
   so ``|r - r_hat| <= |r|`` (as TurboQuant_rvq's second stage).

``get_kv``: ``gamma a + r_hat`` (``r_hat = 0`` without a slot), anchor rows exact, the tail
exact. The rotation and codebook are constants of ``(head_dim, seed, residual_bits)``, not
held in the state. Shapes: ``anchor_* [b, h, k, d]``, ``*_index [b, h, ceil(S*ib/32)]``,
``*_gamma [b, h, S]``, ``*_stored [b, h, ceil(S/32)]``, ``*_codes [b, n, ceil(d*bits/32)]``
and ``*_gain [b, n]`` (a batch row's slots in (head, token) order), ``tail_* [b, h, t, d]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..attention import candidate_weights, scoring_queries
from ..codecs import pq
from ..codecs.lloyd import cell, codebook
from ..codecs.rotation import matmul_per_slice, random_rotation
from ..consts import cached_const
from ..noise import hash_uniform, hash_uniform_np
from ..ordering import order_key, order_key_np
from ..registry import dims_of, register
from ..quant import every_position

__all__ = ["AnchorKVState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "anchors", "Layout", "layout", "project", "project_np", "encode_residuals",
           "encode_residuals_np", "decode_residuals", "decode_residuals_np", "utilities",
           "compressed_nbytes", "full_nbytes"]

_F16_MAX = 65504.0


class AnchorKVState(NamedTuple):
    """Anchors, per-token anchor index and gamma, residual slots; exact rows after the prefill."""

    anchor_keys: Float[Array, "b h k d"]
    anchor_values: Float[Array, "b h k d"]
    anchor_positions: Int[Array, "b h k"]
    key_index: UInt[Array, "b h iw"]
    value_index: UInt[Array, "b h iw"]
    key_gamma: Float[Array, "b h c"]
    value_gamma: Float[Array, "b h c"]
    key_stored: UInt[Array, "b h mw"]
    value_stored: UInt[Array, "b h mw"]
    key_codes: UInt[Array, "b nk cw"]
    key_gain: Float[Array, "b nk"]
    value_codes: UInt[Array, "b nv cw"]
    value_gain: Float[Array, "b nv"]
    tail_keys: Float[Array, "b h t d"]
    tail_values: Float[Array, "b h t d"]
    next_pos: Int[Array, "b h"]
    theta: float
    window: int
    rho: float
    anchor_frac: float
    residual_bits: int
    seed: int
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         theta: float = 0.05, window: int = 32, rho: float = 0.7, anchor_frac: float = 1 / 128,
         residual_bits: int = 2, seed: int = 42, backend: str = "auto") -> AnchorKVState:
    """Empty AnchorKV state.

    Args:
        theta: fraction of the prompt's float16 key and value bytes the compressed prompt may
            hold (anchors, metadata and residuals; the residuals get what is left).
        window: newest prompt tokens always kept as anchors; their queries score the rest.
        rho: fraction of the other anchors chosen by attention (the rest drawn uniformly).
        anchor_frac: anchors as a fraction of the prompt's tokens (at least ``window``).
        residual_bits: bits per rotated residual coordinate (Gaussian Lloyd-Max cells).
        seed: seed of the uniform anchor draw and of the residual rotation.
    """
    b, h, d = batch, kv_heads, head_dim
    cw = pq.words(d, residual_bits)
    z = mx.zeros
    return AnchorKVState(
        anchor_keys=z((b, h, 0, d), dtype), anchor_values=z((b, h, 0, d), dtype),
        anchor_positions=z((b, h, 0), mx.int32),
        key_index=z((b, h, 0), mx.uint32), value_index=z((b, h, 0), mx.uint32),
        key_gamma=z((b, h, 0), mx.float16), value_gamma=z((b, h, 0), mx.float16),
        key_stored=z((b, h, 0), mx.uint32), value_stored=z((b, h, 0), mx.uint32),
        key_codes=z((b, 0, cw), mx.uint32), key_gain=z((b, 0), mx.float16),
        value_codes=z((b, 0, cw), mx.uint32), value_gain=z((b, 0), mx.float16),
        tail_keys=z((b, h, 0, d), dtype), tail_values=z((b, h, 0, d), dtype),
        next_pos=z((b, h), mx.int32), theta=theta, window=window, rho=rho,
        anchor_frac=anchor_frac, residual_bits=residual_bits, seed=seed, backend=backend)


# --- the layout: a function of the shapes and parameters ------------------------------------

class Layout(NamedTuple):
    """What a prompt of ``tokens`` tokens is held as (per batch row ``slots``, per head the rest)."""

    tokens: int        # S
    window: int        # w: the newest anchors, and the scoring queries
    anchors: int       # k
    scored: int        # anchors chosen by attention
    uniform: int       # anchors drawn uniformly
    index_bits: int    # bits of a token's anchor index
    key_slots: int     # residual slots of a batch row (all its heads), keys
    value_slots: int   # and values


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def full_nbytes(heads: int, tokens: int, head_dim: int) -> int:
    """Float16 keys and values of ``tokens`` tokens over ``heads`` kv heads (one batch row)."""
    return heads * tokens * head_dim * 2 * 2


def _fixed_nbytes(tokens: int, head_dim: int, k: int, index_bits: int, itemsize: int) -> int:
    """One head's anchors (both sides, the cache dtype), their int32 positions, and per side
    the packed indices, float16 gammas and 1-bit stored flags."""
    per_side = 4 * pq.words(tokens, index_bits) + 2 * tokens + 4 * pq.words(tokens, 1)
    return 2 * k * head_dim * itemsize + 4 * k + 2 * per_side


def layout(heads: int, tokens: int, head_dim: int, itemsize: int, *, theta: float, window: int,
           rho: float, anchor_frac: float, residual_bits: int) -> Layout:
    """The static layout of a prompt of ``tokens`` tokens (``itemsize``: the cache dtype's)."""
    S = tokens
    w = min(window, S)
    k = min(S, max(window, _round_half_up(anchor_frac * S)))
    scored = _round_half_up(rho * (k - w))
    ib = max(1, (k - 1).bit_length())
    slot = 4 * pq.words(head_dim, residual_bits) + 2
    left = math.floor(theta * full_nbytes(heads, S, head_dim)) - heads * _fixed_nbytes(
        S, head_dim, k, ib, itemsize)
    n = max(0, left // slot)
    cand = heads * (S - k)
    return Layout(S, w, k, scored, k - w - scored, ib, min(n // 2, cand), min(n - n // 2, cand))


def _layout_of(state: AnchorKVState, h: int, s: int, d: int, dtype: mx.Dtype) -> Layout:
    return layout(h, s, d, dtype.size, theta=state.theta, window=state.window, rho=state.rho,
                  anchor_frac=state.anchor_frac, residual_bits=state.residual_bits)


def _tables(d: int, seed: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """The rotation ``[d, d]``, centroids and boundaries (cached constants)."""
    rot = cached_const(("anchorkv_rotation", d, seed), lambda: random_rotation(d, seed))
    c = cached_const(("lloyd_gaussian_centroids", bits), lambda: codebook("gaussian", bits)[0])
    t = cached_const(("lloyd_gaussian_boundaries", bits), lambda: codebook("gaussian", bits)[1])
    return rot, c, t


# --- MLX -------------------------------------------------------------------------------------

def project(x: Float[Array, "b h S d"], anchor_pos: Int[Array, "b h k"],
            is_anchor: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Each token's anchor (index into ``anchor_pos``), float16 gamma and float32 residual
    ``x - gamma a`` (0 at anchors), ``x`` float32."""
    k = anchor_pos.shape[-1]
    a = mx.take_along_axis(x, anchor_pos[..., None], axis=2)                # [b, h, k, d]
    an2 = (a * a).sum(axis=-1)
    usable = mx.isfinite(an2) & (an2 > 0)
    safe = mx.where(usable[..., None], a, 0.0)
    dots = x @ safe.swapaxes(-1, -2)                                        # [b, h, S, k]
    xn = mx.sqrt((x * x).sum(axis=-1))
    cos = mx.abs(dots) / (xn[..., None] * mx.sqrt(mx.where(usable, an2, 1.0))[:, :, None, :])
    cos = mx.where(usable[:, :, None, :] & mx.isfinite(cos), cos, -1.0)
    rank = mx.cumsum(is_anchor.astype(mx.int32), axis=-1) - 1
    idx = mx.where(is_anchor, rank, mx.argmax(cos, axis=-1).astype(mx.int32))
    idx = mx.clip(idx, 0, max(k - 1, 0))
    dot = mx.take_along_axis(dots, idx[..., None], axis=-1)[..., 0]
    n2 = mx.take_along_axis(mx.where(usable, an2, 1.0), idx, axis=-1)
    ok = mx.take_along_axis(usable, idx, axis=-1)
    gamma = mx.where(is_anchor, 1.0, mx.where(ok, dot / n2, 0.0))
    gamma = mx.clip(gamma, -_F16_MAX, _F16_MAX).astype(mx.float16)
    chosen = mx.take_along_axis(safe, idx[..., None], axis=2)
    r = mx.where(is_anchor[..., None], 0.0, x - gamma.astype(mx.float32)[..., None] * chosen)
    return idx, gamma, r


def encode_residuals(rows: Float[Array, "b n d"], seed: int, bits: int) -> tuple[mx.array, mx.array]:
    """Rows ``[b, n, d]`` float32 -> packed cells ``[b, n, ceil(d*bits/32)]`` and float16 gains."""
    d = rows.shape[-1]
    rot, c, t = _tables(d, seed, bits)
    y = matmul_per_slice(rows, rot.T)
    s = mx.abs(y).max(axis=-1) / c[-1]
    u = mx.where((s > 0)[..., None], y / mx.where(s > 0, s, 1.0)[..., None], 0.0)
    idx = cell(u, t, bits)
    cv = mx.take(c, idx)
    gain = (y * cv).sum(axis=-1) / (cv * cv).sum(axis=-1)
    return pq.pack(idx, bits), mx.clip(gain, 0.0, _F16_MAX).astype(mx.float16)


def decode_residuals(codes: mx.array, gain: mx.array, d: int, seed: int, bits: int) -> mx.array:
    """Inverse of :func:`encode_residuals` up to the codes: ``R^T (gain c[idx])``, float32."""
    rot, c, _ = _tables(d, seed, bits)
    y = mx.take(c, pq.unpack(codes, bits, d)) * gain.astype(mx.float32)[..., None]
    return matmul_per_slice(y, rot)


def utilities(q: Float[Array, "b h g m d"], alpha: mx.array, values: Float[Array, "b h S d"],
              r_keys: mx.array, r_values: mx.array) -> tuple[mx.array, mx.array]:
    """``(u_K, u_V)`` ``[b, h, S]``: first-order output error of leaving a residual out."""
    v_safe = mx.where(mx.isfinite(values), values, 0.0)
    y = alpha @ v_safe[:, :, None]                                          # [b, h, g, m, d]
    dist = ((values * values).sum(axis=-1)[:, :, None, None, :]
            - 2 * (y @ values[:, :, None].swapaxes(-1, -2))
            + (y * y).sum(axis=-1)[..., None])
    delta = q @ r_keys[:, :, None].swapaxes(-1, -2)                         # [b, h, g, m, S]
    a2 = alpha * alpha
    u_k = (a2 * delta * delta * mx.maximum(dist, 0.0)).mean(axis=(2, 3))
    u_v = a2.mean(axis=(2, 3)) * (r_values * r_values).sum(axis=-1)
    return u_k, u_v


def _top(score: mx.array, n: int) -> mx.array:
    """Indices of the ``n`` highest ``score`` along the last axis (ties: the higher index)."""
    return mx.argsort(-order_key(score), axis=-1)[..., :n]


def _flag(shape: tuple, idx: mx.array) -> mx.array:
    out = mx.zeros(shape, mx.bool_)
    return mx.put_along_axis(out, idx, mx.array(True), axis=-1) if idx.shape[-1] else out


def _slot_rank(u: mx.array, is_anchor: mx.array) -> mx.array:
    """Ranking score of a residual: anchors lowest, then non-finite utilities."""
    return mx.where(is_anchor, -2.0, mx.where(mx.isfinite(u), u, -1.0))


def _rows(x: mx.array, idx: mx.array, dtype: mx.Dtype) -> mx.array:
    """The rows ``idx [b, h, k]`` of ``x [b, h, S, d]``, in ``dtype``."""
    return mx.take_along_axis(x, idx[..., None], axis=2).astype(dtype)


def _compress_mlx(state: AnchorKVState, keys, values, queries) -> AnchorKVState:
    b, h, S, d = keys.shape
    L = _layout_of(state, h, S, d, state.anchor_keys.dtype)
    w, k = L.window, L.anchors
    x = {"key": keys.astype(mx.float32), "value": values.astype(mx.float32)}
    k_safe = mx.where(mx.isfinite(x["key"]), x["key"], 0.0)
    q = scoring_queries(k_safe, None if queries is None else
                        mx.where(mx.isfinite(queries), queries, 0.0))[:, :, :, S - w:]
    alpha = candidate_weights(q, k_safe[:, :, :0], k_safe)                  # [b, h, g, w, S]
    alpha = mx.where(mx.isfinite(alpha), alpha, 0.0)
    mass = alpha.sum(axis=3).mean(axis=2)
    pos = mx.arange(S, dtype=mx.int32)
    win = mx.broadcast_to(pos >= S - w, (b, h, S))
    scored = _flag((b, h, S), _top(mx.where(win, -mx.inf, mass), L.scored))
    noise = hash_uniform(state.seed, mx.arange(h, dtype=mx.uint32)[:, None],
                         pos.astype(mx.uint32)[None, :])
    taken = win | scored
    drawn = _flag((b, h, S), _top(mx.where(taken, -mx.inf, -noise), L.uniform))
    is_anchor = taken | drawn
    anchor_pos = mx.argsort(mx.where(is_anchor, pos, pos + S), axis=-1)[..., :k].astype(mx.int32)

    proj = {side: project(x[side], anchor_pos, is_anchor) for side in x}
    u = dict(zip(("key", "value"), utilities(q.astype(mx.float32) * d ** -0.5, alpha, x["value"],
                                              proj["key"][2], proj["value"][2])))
    fields = {"next_pos": state.next_pos + S, "anchor_positions": anchor_pos,
              "anchor_keys": _rows(keys, anchor_pos, state.anchor_keys.dtype),
              "anchor_values": _rows(values, anchor_pos, state.anchor_keys.dtype)}
    for side, n in (("key", L.key_slots), ("value", L.value_slots)):
        idx, gamma, r = proj[side]
        chosen = mx.sort(_top(_slot_rank(u[side], is_anchor).reshape(b, h * S), n), axis=-1)
        stored = _flag((b, h * S), chosen).reshape(b, h, S)
        rows = mx.take_along_axis(r.reshape(b, h * S, d), chosen[..., None], axis=1)
        codes, gain = (encode_residuals(rows, state.seed, state.residual_bits) if n else
                       (getattr(state, f"{side}_codes"), getattr(state, f"{side}_gain")))
        fields.update({f"{side}_index": pq.pack(idx.astype(mx.uint32), L.index_bits),
                       f"{side}_gamma": gamma, f"{side}_codes": codes, f"{side}_gain": gain,
                       f"{side}_stored": pq.pack(stored.astype(mx.uint32), 1)})
    return state._replace(**fields)


def _fresh(state: AnchorKVState) -> bool:
    return state.key_gamma.shape[2] == 0 and state.tail_keys.shape[2] == 0


def _update_mlx(state: AnchorKVState, keys, values, queries) -> AnchorKVState:
    s = keys.shape[2]
    if _fresh(state) and s > 1:
        return _compress_mlx(state, keys, values, queries)
    dt = state.tail_keys.dtype
    return state._replace(tail_keys=mx.concatenate([state.tail_keys, keys.astype(dt)], axis=2),
                          tail_values=mx.concatenate([state.tail_values, values.astype(dt)], axis=2),
                          next_pos=state.next_pos + s)


# --- reference: head by head in NumPy --------------------------------------------------------

def project_np(x: np.ndarray, anchor_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One head of :func:`project`: ``x [S, d]`` float32, ``anchor_pos [k]`` ascending."""
    S = x.shape[0]
    is_anchor = np.zeros(S, bool)
    is_anchor[anchor_pos] = True
    a = x[anchor_pos]
    with np.errstate(all="ignore"):
        an2 = (a * a).sum(axis=-1)
        usable = np.isfinite(an2) & (an2 > 0)
        safe = np.where(usable[:, None], a, np.float32(0))
        idx = np.zeros(S, np.int64)
        gamma = np.zeros(S, np.float32)
        for t in range(S):
            if is_anchor[t]:
                idx[t], gamma[t] = np.searchsorted(anchor_pos, t), 1.0
                continue
            dots = safe @ x[t]
            cos = np.abs(dots) / (np.sqrt((x[t] * x[t]).sum()) * np.sqrt(np.where(usable, an2, 1)))
            cos = np.where(usable & np.isfinite(cos), cos, -1.0)
            idx[t] = int(np.argmax(cos))
            gamma[t] = dots[idx[t]] / an2[idx[t]] if usable[idx[t]] else 0.0
        gamma16 = np.clip(gamma, -_F16_MAX, _F16_MAX).astype(np.float16)
        r = x - gamma16.astype(np.float32)[:, None] * safe[idx]
    r[is_anchor] = 0.0
    return idx, gamma16, r


def encode_residuals_np(rows: np.ndarray, seed: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy twin of :func:`encode_residuals` (rows ``[..., n, d]`` float32)."""
    d = rows.shape[-1]
    rot = random_rotation(d, seed)
    c, t = codebook("gaussian", bits)
    with np.errstate(all="ignore"):
        y = (rows @ rot.T).astype(np.float32)
        s = np.abs(y).max(axis=-1) / c[-1]
        u = np.where((s > 0)[..., None], y / np.where(s > 0, s, 1)[..., None], 0).astype(np.float32)
        idx = cell(u, t, bits)
        cv = c[idx]
        gain = (y * cv).sum(axis=-1) / (cv * cv).sum(axis=-1)
    return pq.pack_np(idx, bits), np.clip(gain, 0.0, _F16_MAX).astype(np.float16)


def decode_residuals_np(codes: np.ndarray, gain: np.ndarray, d: int, seed: int, bits: int) -> np.ndarray:
    """NumPy twin of :func:`decode_residuals`."""
    c, _ = codebook("gaussian", bits)
    y = c[pq.unpack_np(codes, bits, d)] * gain.astype(np.float32)[..., None]
    return (y @ random_rotation(d, seed)).astype(np.float32)


def _top_np(score: np.ndarray, n: int) -> np.ndarray:
    return np.argsort(-order_key_np(score), kind="stable")[:n]


def _compress_reference(state: AnchorKVState, keys, values, queries) -> AnchorKVState:
    b, h, S, d = keys.shape
    L = _layout_of(state, h, S, d, state.anchor_keys.dtype)
    w, k = L.window, L.anchors
    kx, vx = ref.to_np(keys, np.float32), ref.to_np(values, np.float32)
    k_safe = np.where(np.isfinite(kx), kx, 0).astype(np.float64)
    qn = None if queries is None else ref.to_np(queries)
    probes = ref.scoring_queries(k_safe, None if qn is None else np.where(np.isfinite(qn), qn, 0))
    pos = np.arange(S)
    noise = hash_uniform_np(state.seed, np.arange(h)[:, None], pos[None, :])
    out = {n: [] for n in ("ap", "ki", "kg", "kr", "vi", "vg", "vr", "uk", "uv", "anchor")}
    for i in range(b):
        for j in range(h):
            q = probes[i, j, :, S - w:]                                     # [g, w, d]
            with np.errstate(all="ignore"):
                alpha = ref.attention_weights(q, k_safe[i, j], pos, pos[S - w:])
            alpha = np.where(np.isfinite(alpha), alpha, 0)
            mass = alpha.sum(axis=1).mean(axis=0)
            win = pos >= S - w
            scored = _top_np(np.where(win, -np.inf, mass), L.scored)
            taken = win.copy()
            taken[scored] = True
            drawn = _top_np(np.where(taken, -np.inf, -noise[j]), L.uniform)
            anchor = taken.copy()
            anchor[drawn] = True
            ap = np.flatnonzero(anchor)
            ki, kg, kr = project_np(kx[i, j], ap)
            vi, vg, vr = project_np(vx[i, j], ap)
            v = vx[i, j].astype(np.float64)
            with np.errstate(all="ignore"):
                y = alpha @ np.where(np.isfinite(v), v, 0)                  # [g, w, d]
                dist = ((v * v).sum(-1)[None, None] - 2 * (y @ v.T) + (y * y).sum(-1)[..., None])
                delta = (q / np.sqrt(d)) @ kr.astype(np.float64).T
                uk = (alpha ** 2 * delta ** 2 * np.maximum(dist, 0)).mean(axis=(0, 1))
                uv = (alpha ** 2).mean(axis=(0, 1)) * (vr.astype(np.float64) ** 2).sum(-1)
            for n, val in zip(out, (ap, ki, kg, kr, vi, vg, vr, uk, uv, anchor)):
                out[n].append(val)
    stack = lambda n: np.stack(out[n]).reshape(b, h, *np.shape(out[n][0]))  # noqa: E731
    ap, anchor = stack("ap"), stack("anchor")
    apx = mx.array(ap.astype(np.int32))
    fields = {"next_pos": state.next_pos + S, "anchor_positions": apx,
              "anchor_keys": _rows(keys, apx, state.anchor_keys.dtype),
              "anchor_values": _rows(values, apx, state.anchor_keys.dtype)}
    for side, p, n in (("key", "k", L.key_slots), ("value", "v", L.value_slots)):
        r = stack(f"{p}r")
        rank = np.where(anchor, -2.0, np.where(np.isfinite(stack(f"u{p}")), stack(f"u{p}"), -1.0))
        stored = np.zeros((b, h * S), bool)
        codes, gain = [], []
        for i in range(b):
            chosen = np.sort(_top_np(rank[i].reshape(h * S), n))
            stored[i, chosen] = True
            if n:
                c, g = encode_residuals_np(r[i].reshape(h * S, d)[chosen], state.seed,
                                           state.residual_bits)
                codes.append(c)
                gain.append(g)
        codes = (mx.array(np.stack(codes).astype(np.uint32)) if n else getattr(state, f"{side}_codes"))
        gain = mx.array(np.stack(gain)) if n else getattr(state, f"{side}_gain")
        fields.update({
            f"{side}_index": mx.array(pq.pack_np(stack(f"{p}i").astype(np.uint32), L.index_bits)),
            f"{side}_gamma": mx.array(stack(f"{p}g")),
            f"{side}_stored": mx.array(pq.pack_np(stored.reshape(b, h, S).astype(np.uint32), 1)),
            f"{side}_codes": codes, f"{side}_gain": gain})
    return state._replace(**fields)


def _update_reference(state: AnchorKVState, keys, values, queries) -> AnchorKVState:
    s = keys.shape[2]
    if _fresh(state) and s > 1:
        return _compress_reference(state, keys, values, queries)
    dt = state.tail_keys.dtype
    tk = np.concatenate([ref.to_np(state.tail_keys, np.float32), ref.to_np(keys, np.float32)], axis=2)
    tv = np.concatenate([ref.to_np(state.tail_values, np.float32), ref.to_np(values, np.float32)], axis=2)
    return state._replace(tail_keys=ref.to_mx(tk, dt), tail_values=ref.to_mx(tv, dt),
                          next_pos=state.next_pos + s)


# --- public functions ------------------------------------------------------------------------

def _compressed(state: AnchorKVState) -> int:
    return state.key_gamma.shape[2]


def _side(state: AnchorKVState, side: str) -> mx.array:
    tail = getattr(state, f"tail_{side}s")
    b, h, _, d = tail.shape
    S, k = _compressed(state), state.anchor_positions.shape[2]
    if S == 0:
        return tail
    ib = max(1, (k - 1).bit_length())
    idx = pq.unpack(getattr(state, f"{side}_index"), ib, S).astype(mx.int32)
    a = getattr(state, f"anchor_{side}s").astype(mx.float32)
    an2 = (a * a).sum(axis=-1)
    safe = mx.where((mx.isfinite(an2) & (an2 > 0))[..., None], a, 0.0)
    x = (getattr(state, f"{side}_gamma").astype(mx.float32)[..., None]
         * mx.take_along_axis(safe, idx[..., None], axis=2))
    codes = getattr(state, f"{side}_codes")
    if codes.shape[1]:
        stored = pq.unpack(getattr(state, f"{side}_stored"), 1, S).reshape(b, h * S)
        slot = mx.maximum(mx.cumsum(stored.astype(mx.int32), axis=-1) - 1, 0)
        res = decode_residuals(codes, getattr(state, f"{side}_gain"), d, state.seed, state.residual_bits)
        res = mx.take_along_axis(res, slot[..., None], axis=1)
        x = x + mx.where(stored[..., None] > 0, res, 0.0).reshape(b, h, S, d)
    ap = mx.broadcast_to(state.anchor_positions[..., None], a.shape)
    x = mx.put_along_axis(x, ap, a, axis=2)
    return mx.concatenate([x.astype(tail.dtype), tail], axis=2)


def get_kv(state: AnchorKVState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Every token: ``gamma a + r_hat`` for the compressed prompt (anchors exact), then the tail."""
    return _side(state, "key"), _side(state, "value")


positions = every_position(lambda state: _compressed(state) + state.tail_keys.shape[2])


def anchors(state: AnchorKVState) -> Int[Array, "b h k"]:
    """Absolute positions of the anchors, ascending (empty before the prefill)."""
    return state.anchor_positions


def compressed_nbytes(state: AnchorKVState) -> int:
    """Bytes of the compressed prompt: every array but the exact tail and ``next_pos``."""
    skip = {"tail_keys", "tail_values", "next_pos"}
    return sum(getattr(state, f).nbytes for f in AnchorKVState._fields
               if f not in skip and isinstance(getattr(state, f), mx.array))


State = AnchorKVState
method = register("anchorkv", AnchorKVState, init,
                  {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, dims=dims_of("tail_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes

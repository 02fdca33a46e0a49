"""AMC-adapted: per-token saliency tiers of rank and precision (the seed's design; paper unverified).

Every token is kept. Within an update chunk of ``s`` tokens, saliency is the mean ``|k|``
clipped to ``[0, 1]`` (``use_query_saliency``: blended, ``alpha * mag + (1 - alpha) *
(cos + 1) / 2``, with the cosine to the mean of the chunk's real queries of the head's
group, or of its keys). The ``ceil(k_high s)`` most salient tokens are exact (High), the
next ``ceil(k_mid s)`` keep their ``round(43 d / 128)`` leading channels at 8 bits (Mid),
the rest their ``round(8 d / 128)`` leading channels at 4 bits (Low); dropped channels read
as zero. Channels lead in a per-head order calibrated once, on the first chunk (decreasing
mean square, what dropping a channel loses), for keys and values separately. Keys and
values share the token's tier; codes are affine per token in groups of ``group_size`` kept
channels; saliency ties go to the newer token. Tiers are percentiles of each chunk (the
seed's rule), so token-by-token decoding keeps every token exact. ``adaptive_thresholds``
tracks the seed's closed-loop thresholds ``tau = tau_base (1 - gamma ln(var_window /
calib_variance))`` in ``tau_high``/``tau_low`` without changing the tiers.

Scales and zeros are float16 (``velox.quant.side_dtype``); High rows keep the model's dtype.

Shapes: ``high_<keys|values> [b, h, nH, d]``; ``<mid|low>_<keys|values>_codes [b, h, n, w]``
(kept channels, padded to whole words), ``_scales``/``_zeros [b, h, n, ceil(r/G)]``;
``<tier>_positions [b, h, n]``; ``<keys|values>_order [b, h, d]``; ``saliency_window [b, h, m]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..ordering import order_key
from ..registry import dims_of, register

__all__ = ["AMCState", "State", "init", "update", "get_kv", "nbytes", "positions", "tier_ranks",
           "tier_sizes", "token_tiers", "TIER_BITS"]

TIER_BITS = {"mid": 8, "low": 4}
_PAPER_RANKS = {"mid": 43, "low": 8}  # of 128 channels (Algorithm 1's golden model, per the seed)
_QUANT = ("mid", "low")


class AMCState(NamedTuple):
    """Exact High rows, quantized channel prefixes of Mid and Low rows, positions per tier."""

    high_keys: Float[Array, "b h nh d"]
    high_values: Float[Array, "b h nh d"]
    high_positions: Int[Array, "b h nh"]
    mid_keys_codes: UInt[Array, "b h nm wm"]
    mid_keys_scales: Float[Array, "b h nm gm"]
    mid_keys_zeros: Float[Array, "b h nm gm"]
    mid_values_codes: UInt[Array, "b h nm wm"]
    mid_values_scales: Float[Array, "b h nm gm"]
    mid_values_zeros: Float[Array, "b h nm gm"]
    mid_positions: Int[Array, "b h nm"]
    low_keys_codes: UInt[Array, "b h nl wl"]
    low_keys_scales: Float[Array, "b h nl gl"]
    low_keys_zeros: Float[Array, "b h nl gl"]
    low_values_codes: UInt[Array, "b h nl wl"]
    low_values_scales: Float[Array, "b h nl gl"]
    low_values_zeros: Float[Array, "b h nl gl"]
    low_positions: Int[Array, "b h nl"]
    keys_order: UInt[Array, "b h d"]
    values_order: UInt[Array, "b h d"]
    saliency_window: Float[Array, "b h m"]
    tau_high: Float[Array, "b h"]
    tau_low: Float[Array, "b h"]
    next_pos: Int[Array, "b h"]
    k_high: float
    k_mid: float
    use_query_saliency: bool
    query_alpha: float
    adaptive_thresholds: bool
    threshold_window: int
    gamma: float
    calib_variance: float
    group_size: int
    backend: str


def tier_ranks(head_dim: int) -> dict[str, int]:
    """Channels kept per tier: all, ``round(43 d / 128)``, ``round(8 d / 128)`` (at least 1)."""
    out = {"high": head_dim}
    for tier, r in _PAPER_RANKS.items():
        out[tier] = r if head_dim == 128 else max(1, min(head_dim, round(head_dim * r / 128)))
    return out


def tier_sizes(s: int, k_high: float, k_mid: float) -> dict[str, int]:
    """Tokens per tier in a chunk of ``s``: ``ceil(k_high s)``, ``ceil(k_mid s)``, the rest."""
    high = min(s, math.ceil(k_high * s - 1e-9))
    mid = min(s - high, math.ceil(k_mid * s - 1e-9))
    return {"high": high, "mid": mid, "low": s - high - mid}


def _words(rank: int, bits: int) -> int:
    return -(-rank * bits // 32)


def _groups(rank: int, group_size: int) -> int:
    return -(-rank // group_size)


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         k_high: float = 0.2, k_mid: float = 0.3, use_query_saliency: bool = False,
         query_alpha: float = 0.5, adaptive_thresholds: bool = False,
         threshold_window: int = 64, gamma: float = 0.1, calib_variance: float = 0.0,
         group_size: int = 32, backend: str = "auto") -> AMCState:
    """Empty AMC state.

    Args:
        k_high: fraction of each chunk's tokens stored exact (High tier).
        k_mid: fraction of each chunk's tokens in the Mid tier (43/128 of the channels, 8 bits).
        use_query_saliency: blend key magnitude with key-query cosine similarity.
        query_alpha: weight of the magnitude term in the blend.
        adaptive_thresholds: track the closed-loop thresholds (observability; tiers stay
            percentiles).
        threshold_window: saliencies in the trailing window of the closed loop.
        gamma: attenuation of the closed loop.
        calib_variance: calibration saliency variance of the closed loop (0: unset).
        group_size: channels per quantization group of a token's kept prefix (the last may be
            shorter).
    """
    b, h, d = batch, kv_heads, head_dim
    ranks = tier_ranks(d)
    fields = dict(high_keys=mx.zeros((b, h, 0, d), dtype), high_values=mx.zeros((b, h, 0, d), dtype),
                  high_positions=mx.zeros((b, h, 0), mx.int32))
    for tier in _QUANT:
        w, g = _words(ranks[tier], TIER_BITS[tier]), _groups(ranks[tier], group_size)
        for kind in ("keys", "values"):
            fields[f"{tier}_{kind}_codes"] = mx.zeros((b, h, 0, w), mx.uint32)
            fields[f"{tier}_{kind}_scales"] = mx.zeros((b, h, 0, g), quant.side_dtype(dtype))
            fields[f"{tier}_{kind}_zeros"] = mx.zeros((b, h, 0, g), quant.side_dtype(dtype))
        fields[f"{tier}_positions"] = mx.zeros((b, h, 0), mx.int32)
    order = mx.broadcast_to(mx.arange(d).astype(nuq.index_dtype(d)), (b, h, d))
    base_high, base_low = _base_thresholds(k_high, k_mid)
    return AMCState(**fields, keys_order=mx.array(order), values_order=mx.array(order),
                    saliency_window=mx.zeros((b, h, 0), mx.float32),
                    tau_high=mx.full((b, h), base_high, mx.float32),
                    tau_low=mx.full((b, h), base_low, mx.float32),
                    next_pos=mx.zeros((b, h), mx.int32), k_high=k_high, k_mid=k_mid,
                    use_query_saliency=use_query_saliency, query_alpha=query_alpha,
                    adaptive_thresholds=adaptive_thresholds, threshold_window=threshold_window,
                    gamma=gamma, calib_variance=calib_variance, group_size=group_size,
                    backend=backend)


def _base_thresholds(k_high: float, k_mid: float) -> tuple[float, float]:
    return 1.0 - k_high, 1.0 - k_high - k_mid


def stored_tokens(state: AMCState) -> int:
    return sum(getattr(state, f"{t}_positions").shape[2] for t in ("high", "mid", "low"))


# --- mlx -----------------------------------------------------------------------------------

def _saliency(state: AMCState, keys: Float[Array, "b h s d"],
              queries: Float[Array, "b q s d"] | None) -> Float[Array, "b h s"]:
    k = keys.astype(mx.float32)
    mag = mx.clip(mx.abs(k).mean(-1), 0.0, 1.0)
    if not state.use_query_saliency:
        return mag
    b, h, s, d = k.shape
    if queries is None:
        q = k.mean(2)                                                   # [b, h, d]
    else:
        q = queries.astype(mx.float32).reshape(b, h, -1, d).mean(2)     # group and tokens
    dot = (k * q[:, :, None, :]).sum(-1)
    norm = mx.sqrt((k * k).sum(-1)) * mx.sqrt((q * q).sum(-1))[..., None]
    cos = dot / mx.maximum(norm, 1e-8)
    sem = mx.clip((cos + 1.0) * 0.5, 0.0, 1.0)
    a = state.query_alpha
    return mx.clip(a * mag + (1.0 - a) * sem, 0.0, 1.0)


def _tier_order(sal: Float[Array, "b h s"]) -> Int[Array, "b h s"]:
    """Token indices from most to least salient (ties: the newer token first)."""
    return mx.argsort(-order_key(sal), axis=-1).astype(mx.int32)


def _channel_order(x: Float[Array, "b h s d"]) -> Int[Array, "b h d"]:
    """Channels by decreasing mean square over the chunk (ties: the lower channel first)."""
    energy = (x.astype(mx.float32) ** 2).mean(axis=2)
    return mx.argsort(-order_key(energy, ties="older"), axis=-1).astype(mx.int32)


def _quantize_prefix(x: Float[Array, "b h n d"], rank: int, bits: int, group_size: int):
    """Affine codes of the first ``rank`` channels per token, groups of ``group_size`` (the last
    may be shorter; padded with its last value, which leaves its range unchanged)."""
    n_groups = _groups(rank, group_size)
    pre = x[..., :rank]
    pad = n_groups * group_size - rank
    if pad:
        pre = mx.concatenate([pre, mx.repeat(pre[..., rank - 1:rank], pad, axis=-1)], axis=-1)
    codes, scales, zeros = quant.quantize(pre, bits, group_size)
    q = quant.unpack(codes, bits)[..., :rank]
    width = _words(rank, bits) * 32 // bits
    if width > rank:
        q = mx.concatenate([q, mx.zeros((*q.shape[:-1], width - rank), mx.uint32)], axis=-1)
    return quant.pack(q, bits), scales, zeros


def _dequantize_prefix(codes, scales, zeros, rank: int, bits: int, group_size: int,
                       head_dim: int, dtype: mx.Dtype) -> Float[Array, "b h n d"]:
    x = quant.dequantize_f32(codes, scales, zeros, bits, group_size, count=rank)
    if head_dim > rank:
        x = mx.concatenate([x, mx.zeros((*x.shape[:-1], head_dim - rank), mx.float32)], axis=-1)
    return x.astype(dtype)


def _thresholds(state: AMCState, window: Float[Array, "b h m"]):
    base_high, base_low = _base_thresholds(state.k_high, state.k_mid)
    if window.shape[-1] < 2:
        b, h = window.shape[:2]
        return mx.full((b, h), base_high, mx.float32), mx.full((b, h), base_low, mx.float32)
    var = window.var(axis=-1)
    ratio = mx.maximum(var, 1e-8) / max(state.calib_variance, 1e-8)
    adj = 1.0 - state.gamma * mx.log(ratio)
    return base_high * adj, base_low * adj


def _update_mlx(state: AMCState, keys, values, queries) -> AMCState:
    b, h, s, d = keys.shape
    sal = _saliency(state, keys, queries)
    order = _tier_order(sal)
    sizes = tier_sizes(s, state.k_high, state.k_mid)
    ranks = tier_ranks(d)
    fields = {"next_pos": state.next_pos + s}
    first = stored_tokens(state) == 0  # the first chunk calibrates the channel order
    channels = {}
    for kind, x in (("keys", keys), ("values", values)):
        stored = getattr(state, f"{kind}_order")
        channels[kind] = _channel_order(x) if first else stored.astype(mx.int32)
        if first:
            fields[f"{kind}_order"] = channels[kind].astype(stored.dtype)
    start = 0
    for tier in ("high", "mid", "low"):
        n = sizes[tier]
        idx = mx.sort(order[..., start:start + n], axis=-1)            # position order in a tier
        start += n
        tier_pos = state.next_pos[:, :, None] + idx
        fields[f"{tier}_positions"] = mx.concatenate([getattr(state, f"{tier}_positions"), tier_pos], 2)
        take = mx.broadcast_to(idx[..., None], (b, h, n, d))
        for kind, x in (("keys", keys), ("values", values)):
            rows = mx.take_along_axis(x, take, axis=2)
            if tier == "high":
                fields[f"high_{kind}"] = mx.concatenate([getattr(state, f"high_{kind}"), rows], 2)
                continue
            ch = mx.broadcast_to(channels[kind][:, :, None, :], rows.shape)
            rows = mx.take_along_axis(rows, ch, axis=-1)               # calibrated channel order
            new = _quantize_prefix(rows, ranks[tier], TIER_BITS[tier], state.group_size)
            for part, arr in zip(("codes", "scales", "zeros"), new):
                fields[f"{tier}_{kind}_{part}"] = mx.concatenate(
                    [getattr(state, f"{tier}_{kind}_{part}"), arr], 2)
    if state.adaptive_thresholds:
        window = mx.concatenate([state.saliency_window, sal], axis=-1)
        window = window[..., max(0, window.shape[-1] - state.threshold_window):]
        fields["saliency_window"] = window
        fields["tau_high"], fields["tau_low"] = _thresholds(state, window)
    return state._replace(**fields)


# --- reference: token by token within each head, in NumPy --------------------------------------

def _np_saliency(state: AMCState, k: np.ndarray, q: np.ndarray | None) -> np.ndarray:
    """One head's chunk ``k [s, d]`` (float64): saliency per token."""
    mag = np.clip(np.abs(k).mean(-1), 0.0, 1.0)
    if not state.use_query_saliency:
        return mag
    query = k.mean(0) if q is None else q.reshape(-1, k.shape[-1]).mean(0)
    cos = k @ query / np.maximum(np.linalg.norm(k, axis=-1) * np.linalg.norm(query), 1e-8)
    sem = np.clip((cos + 1.0) * 0.5, 0.0, 1.0)
    a = state.query_alpha
    return np.clip(a * mag + (1.0 - a) * sem, 0.0, 1.0)


def _np_quantize_prefix(row: np.ndarray, rank: int, bits: int, group_size: int, dtype: mx.Dtype):
    """One token's first ``rank`` channels: packed codes (whole words), scales, zeros."""
    parts = [ref.quantize_group(row[i:min(i + group_size, rank)], bits, dtype)
             for i in range(0, rank, group_size)]
    codes = np.concatenate([p[0] for p in parts])
    width = _words(rank, bits) * 32 // bits
    codes = np.concatenate([codes, np.zeros(width - rank, np.uint32)])
    return (ref.pack_codes(codes, bits), np.array([p[1] for p in parts], np.float32),
            np.array([p[2] for p in parts], np.float32))


def _update_reference(state: AMCState, keys, values, queries) -> AMCState:
    dtype = state.high_keys.dtype
    sd = quant.side_dtype(dtype)
    b, h, s, d = keys.shape
    sizes, ranks = tier_sizes(s, state.k_high, state.k_mid), tier_ranks(d)
    k64, k32, v32 = ref.to_np(keys), ref.to_np(keys, np.float32), ref.to_np(values, np.float32)
    qs = ref.scoring_queries(k64, None if queries is None else ref.to_np(queries))
    nxt = ref.to_np(state.next_pos, np.int64)
    new = {}  # field -> {(row, head): array}
    sal_all = np.zeros((b, h, s))
    first = stored_tokens(state) == 0
    for i in range(b):
        for j in range(h):
            channels = {}
            for kind, x in (("keys", k64), ("values", ref.to_np(values))):
                if first:  # calibrate: channels by decreasing mean square, ties: lower first
                    energy = (x[i, j] ** 2).mean(0)
                    channels[kind] = np.lexsort((np.arange(d), -energy))
                    new.setdefault(f"{kind}_order", {})[(i, j)] = channels[kind]
                else:
                    channels[kind] = ref.to_np(getattr(state, f"{kind}_order")[i, j], np.int64)
            sal = _np_saliency(state, k64[i, j], None if queries is None else qs[i, j])
            sal_all[i, j] = sal
            order = np.lexsort((-np.arange(s), -sal))  # most salient first; ties: newer first
            start = 0
            for tier in ("high", "mid", "low"):
                idx = np.sort(order[start:start + sizes[tier]])
                start += sizes[tier]
                new.setdefault(f"{tier}_positions", {})[(i, j)] = nxt[i, j] + idx
                for kind, x in (("keys", k32), ("values", v32)):
                    if tier == "high":
                        new.setdefault(f"high_{kind}", {})[(i, j)] = x[i, j, idx]
                        continue
                    toks = [_np_quantize_prefix(x[i, j, t][channels[kind]], ranks[tier],
                                                TIER_BITS[tier], state.group_size, sd) for t in idx]
                    for n, part in enumerate(("codes", "scales", "zeros")):
                        width = (_words(ranks[tier], TIER_BITS[tier]) if part == "codes"
                                 else _groups(ranks[tier], state.group_size))
                        arr = np.stack([tk[n] for tk in toks]) if toks else np.zeros((0, width))
                        new.setdefault(f"{tier}_{kind}_{part}", {})[(i, j)] = arr
    fields = {"next_pos": state.next_pos + s}
    for name, per_head in new.items():
        arr = np.stack([np.stack([per_head[(i, j)] for j in range(h)]) for i in range(b)])
        old = getattr(state, name)
        if name.endswith("order"):
            fields[name] = mx.array(arr).astype(old.dtype)
            continue
        if name.endswith("positions"):
            arr = mx.array(arr.astype(np.int32))
        elif name.endswith("codes"):
            arr = mx.array(arr.astype(np.uint32))
        else:
            arr = ref.to_mx(arr, old.dtype)
        fields[name] = mx.concatenate([old, arr], axis=2)
    if state.adaptive_thresholds:
        window = np.concatenate([ref.to_np(state.saliency_window), sal_all], axis=-1)
        window = window[..., max(0, window.shape[-1] - state.threshold_window):]
        base_high, base_low = _base_thresholds(state.k_high, state.k_mid)
        if window.shape[-1] < 2:
            adj = np.ones((b, h))
        else:
            ratio = np.maximum(window.var(-1), 1e-8) / max(state.calib_variance, 1e-8)
            adj = 1.0 - state.gamma * np.log(ratio)
        fields.update(saliency_window=ref.to_mx(window, mx.float32),
                      tau_high=ref.to_mx(base_high * adj, mx.float32),
                      tau_low=ref.to_mx(base_low * adj, mx.float32))
    return state._replace(**fields)


# --- public functions -----------------------------------------------------------------------------

def get_kv(state: AMCState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Every token in position order: exact, or its dequantized prefix with zeros after it."""
    b, h, _, d = state.high_keys.shape
    n = stored_tokens(state)
    ranks = tier_ranks(d)
    out = []
    for kind in ("keys", "values"):
        x = mx.zeros((b, h, n, d), state.high_keys.dtype)
        for tier in ("high", "mid", "low"):
            pos = getattr(state, f"{tier}_positions")
            if not pos.shape[2]:
                continue
            if tier == "high":
                rows = getattr(state, f"high_{kind}")
            else:
                rows = _dequantize_prefix(*(getattr(state, f"{tier}_{kind}_{p}")
                                            for p in ("codes", "scales", "zeros")),
                                          ranks[tier], TIER_BITS[tier], state.group_size, d,
                                          state.high_keys.dtype)
                ch = getattr(state, f"{kind}_order").astype(mx.int32)[:, :, None, :]
                rows = mx.put_along_axis(mx.zeros(rows.shape, rows.dtype),
                                         mx.broadcast_to(ch, rows.shape), rows, axis=-1)
            x = mx.put_along_axis(x, mx.broadcast_to(pos[..., None], rows.shape), rows, axis=2)
        out.append(x)
    return out[0], out[1]


positions = quant.every_position(stored_tokens)


def token_tiers(state: AMCState) -> Int[Array, "b h n"]:
    """Tier of each stored token, by position: 0 High, 1 Mid, 2 Low."""
    b, h = state.next_pos.shape
    out = mx.zeros((b, h, stored_tokens(state)), mx.int32)
    for t, tier in enumerate(("high", "mid", "low")):
        pos = getattr(state, f"{tier}_positions")
        out = mx.put_along_axis(out, pos, mx.full(pos.shape, t, mx.int32), axis=2)
    return out


State = AMCState
method = register("amc", AMCState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, dims=dims_of("high_keys"))
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes

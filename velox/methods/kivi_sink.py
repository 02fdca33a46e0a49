"""KIVI with KVSink: predicted attention-sink tokens kept exact and out of the group ranges.

A KIVI cache (``velox.methods.kivi``: Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu. KIVI: A
Tuning-Free Asymmetric 2bit Quantization for KV Cache. ICML 2024. arXiv:2402.02750; the state
holds its fields) plus up to
``n_sink_tokens`` sink rows held exact. The sinks are chosen once, by the update that
quantizes the first group: among the tokens it quantizes, the ``n_sink_tokens`` (at most all)
of largest key norm, summed over the kv heads (one set per sequence; ties: the earlier token).
Before that quantization each sink row is replaced, in its group, by the group's first
non-sink row (if any), so a sink never widens its group's (scale, zero); ``get_kv`` writes
the exact sink rows back over their placeholders. Later tokens are never sinks.

Chunk rule: the sink candidates are the tokens of the first quantizing update, so a prompt
absorbed in one chunk chooses among all its quantized tokens, token-by-token decoding among
the first group; everything else follows KIVI, bit for bit. ``n_sink_tokens=0`` is KIVI:
the same codes, scales and zeros, the same bytes (the sink arrays are empty).

Storage: KIVI's arrays, the sink rows ``[b, h, S, d]`` (keys and values) and their positions
``[b, h, S]``. Each sink also leaves a placeholder code row in its group (the static layout).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int
from ..distributed import LOCAL, Heads, head_gather
from ..registry import register
from . import kivi
from .kivi import KiviState, extended_state, flush_count

__all__ = ["KiviSinkState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "error_bound"]

KiviSinkState = extended_state(
    "KiviSinkState", "KIVI's fields (see ``KiviState``) plus the exact sink rows and their positions.",
    arrays=[("sink_keys", Float[Array, "b h ns d"]), ("sink_values", Float[Array, "b h ns d"]),
            ("sink_positions", Int[Array, "b h ns"])],
    params=[("n_sink_tokens", int), ("heads", Heads)], module=__name__)


def _kivi(state: KiviSinkState) -> KiviState:
    """The KIVI state within (the same arrays, no copies)."""
    return KiviState(*(getattr(state, f) for f in KiviState._fields))


def _with(state: KiviSinkState, inner: KiviState, **fields) -> KiviSinkState:
    return state._replace(**inner._asdict(), **fields)


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, group_size: int = 32, residual_length: int = 128, n_sink_tokens: int = 5,
         residual_dtype: str = "float16", heads: Heads = LOCAL, backend: str = "auto") -> KiviSinkState:
    """Empty KIVI-with-sinks state (sink rows held in ``residual_dtype`` too).

    Args:
        bits: bits per quantized element.
        group_size: tokens per key group (per channel) and channels per value group (per
            token).
        residual_length: newest tokens kept exact (between this and this + group_size - 1).
        n_sink_tokens: predicted sink tokens kept exact (0 = KIVI).
        residual_dtype: dtype of the rows held exact ("model": the cache dtype); scales and
            zeros are float16 (bfloat16 for a bfloat16 cache).
        heads: where the state's kv heads sit among the layer's (``velox.distributed``): the
            sink norms sum every shard's heads.
    """
    inner = kivi.init(batch, kv_heads, head_dim, dtype=dtype, bits=bits, group_size=group_size,
                      residual_length=residual_length, residual_dtype=residual_dtype,
                      backend=backend)
    b, h, d = batch, kv_heads, head_dim
    rd = inner.residual_keys.dtype
    return KiviSinkState(**inner._asdict(), sink_keys=mx.zeros((b, h, 0, d), rd),
                         sink_values=mx.zeros((b, h, 0, d), rd),
                         sink_positions=mx.zeros((b, h, 0), mx.int32), n_sink_tokens=n_sink_tokens,
                         heads=heads)


def _first_flush(state: KiviSinkState, s: int) -> int:
    """Tokens this update quantizes if it is the first to quantize (else 0)."""
    if state.n_sink_tokens == 0 or state.key_scales.shape[-1]:
        return 0
    return flush_count(_kivi(state), s)


def _update_mlx(state: KiviSinkState, keys, values, queries) -> KiviSinkState:
    f = _first_flush(state, keys.shape[2])
    if not f:
        return _with(state, kivi.update(_kivi(state), keys, values))
    r, g, n = state.residual_keys.shape[2], state.group_size, min(state.n_sink_tokens, f)
    rd = state.residual_keys.dtype
    ck = mx.concatenate([state.residual_keys, keys.astype(rd)], axis=2)
    cv = mx.concatenate([state.residual_values, values.astype(rd)], axis=2)
    b, h, _, d = ck.shape
    def rows(x, idx):
        return mx.take_along_axis(x, mx.broadcast_to(idx, (b, h, idx.shape[2], d)), axis=2)

    # key norm of each token quantized now, summed over the layer's kv heads: [b, f]
    norms = head_gather(state.heads, nuq.tree_sum(mx.square(ck[:, :, :f].astype(mx.float32))))
    norm = nuq.tree_sum(norms.swapaxes(1, 2))
    is_sink = nuq.top_k_mask(norm, n)
    pos = mx.broadcast_to(nuq.top_k_indices(norm, n, mask=is_sink)[0][:, None, :], (b, h, n))
    # a sink row is replaced by its group's first non-sink row (a group of sinks only: kept)
    is_sink = is_sink.reshape(b, f // g, g)
    i = mx.arange(g, dtype=mx.int32)
    first = mx.where(is_sink, g, i).min(axis=-1, keepdims=True)
    src = mx.where(is_sink & (first < g), first, i) + mx.arange(0, f, g, dtype=mx.int32)[:, None]
    src = src.reshape(b, 1, f, 1)
    mk = mx.concatenate([rows(ck, src), ck[:, :, f:]], axis=2)
    mv = mx.concatenate([rows(cv, src), cv[:, :, f:]], axis=2)
    inner = kivi.update(_kivi(state)._replace(residual_keys=mk[:, :, :r], residual_values=mv[:, :, :r]),
                        mk[:, :, r:].astype(keys.dtype), mv[:, :, r:].astype(keys.dtype))
    return _with(state, inner, sink_keys=rows(ck, pos[..., None]), sink_values=rows(cv, pos[..., None]),
                 sink_positions=pos.astype(mx.int32))


def _update_reference(state: KiviSinkState, keys, values, queries) -> KiviSinkState:
    f = _first_flush(state, keys.shape[2])
    if not f:
        return _with(state, kivi.update(_kivi(state), keys, values))
    dtype = state.residual_keys.dtype
    r, g, n = state.residual_keys.shape[2], state.group_size, min(state.n_sink_tokens, f)
    new = lambda x: ref.round_to(ref.to_np(x, np.float32), dtype)  # noqa: E731  (held in dtype)
    ck = np.concatenate([ref.to_np(state.residual_keys, np.float32), new(keys)], 2)
    cv = np.concatenate([ref.to_np(state.residual_values, np.float32), new(values)], 2)
    b, h, _, d = ck.shape
    sinks = np.zeros((b, n), np.int64)
    mk, mv = ck.copy(), cv.copy()
    # each head's key norms, every shard's heads (velox.distributed)
    norms = head_gather(state.heads, nuq.np_tree_sum(ck[:, :, :f] ** 2))
    for i in range(b):
        # key norm of each token quantized now, summed over the layer's kv heads
        norm = nuq.np_tree_sum(norms[i].T)
        sinks[i] = nuq.np_top_k_indices(norm, n)[0]
        for t in range(0, f, g):  # a sink row is replaced by its group's first non-sink row
            group = np.arange(t, t + g)
            plain = group[~np.isin(group, sinks[i])]
            for row in group[np.isin(group, sinks[i])] if len(plain) else []:  # (all sinks: kept)
                mk[i, :, row], mv[i, :, row] = ck[i, :, plain[0]], cv[i, :, plain[0]]
    pos = np.broadcast_to(sinks[:, None, :], (b, h, n))
    sk = np.take_along_axis(ck, pos[..., None], axis=2)
    sv = np.take_along_axis(cv, pos[..., None], axis=2)
    inner = kivi.update(_kivi(state)._replace(residual_keys=ref.to_mx(mk[:, :, :r], dtype),
                                              residual_values=ref.to_mx(mv[:, :, :r], dtype)),
                        ref.to_mx(mk[:, :, r:], keys.dtype), ref.to_mx(mv[:, :, r:], keys.dtype))
    return _with(state, inner, sink_keys=ref.to_mx(sk, dtype), sink_values=ref.to_mx(sv, dtype),
                 sink_positions=mx.array(pos, mx.int32))


def _put_rows(x, positions, rows):
    """``x [b, h, n, d]`` with rows ``rows [b, h, S, d]`` written at ``positions [b, h, S]``."""
    idx = mx.broadcast_to(positions[..., None], rows.shape)
    return mx.put_along_axis(x, idx, rows, axis=2) if rows.shape[2] else x


def get_kv(state: KiviSinkState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """KIVI's dequantized keys and values with the exact sink rows in place."""
    k, v = kivi.get_kv(_kivi(state))
    return (_put_rows(k, state.sink_positions, state.sink_keys.astype(k.dtype)),
            _put_rows(v, state.sink_positions, state.sink_values.astype(v.dtype)))


def error_bound(state: KiviSinkState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """KIVI's bound; on the exact sink rows, their rounding to ``residual_dtype``."""
    kb, vb = kivi.error_bound(_kivi(state))
    cd = quant.dtype_of(state.cache_dtype)
    return (_put_rows(kb, state.sink_positions, quant.rounding_bound(state.sink_keys, cd)),
            _put_rows(vb, state.sink_positions, quant.rounding_bound(state.sink_values, cd)))


def positions(state: KiviSinkState) -> Int[Array, "b h n"]:
    """Absolute positions of the tokens ``get_kv`` returns (KIVI's: all tokens, in order)."""
    return kivi.positions(_kivi(state))


State = KiviSinkState
method = register("kivi_sink", KiviSinkState, init,
                  {"reference": _update_reference, "mlx": _update_mlx}, get_kv=get_kv,
                  positions=positions, error_bound=error_bound, dims=kivi.dims)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes

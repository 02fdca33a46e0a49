"""KIVI with KVSink: predicted attention-sink tokens kept exact and out of the group ranges.

A KIVI cache (``velox.methods.kivi``; the state holds its fields) plus up to
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

References:
    Su, Yuan. KVSink: Understanding and Enhancing the Preservation of Attention Sinks in KV
    Cache Quantization for LLMs. COLM 2025. arXiv:2508.04257.
    Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu. KIVI: A Tuning-Free Asymmetric 2bit
    Quantization for KV Cache. ICML 2024. arXiv:2402.02750.

Deviations from the paper:
    * Sinks are predicted by key norm (the cache cannot see the hidden-state outliers the
      paper tracks at the layer where they emerge).
    * The prediction runs per layer on the tokens of the first quantizing update, not once
      per model from the prefill's hidden states.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import nuq, quant
from .. import reference as ref
from .._typing import Array, Float, Int
from ..accounting import state_nbytes
from ..registry import dispatch, prepare_init, register
from . import kivi
from .kivi import KiviState, extended_state, flush_count

__all__ = ["KiviSinkState", "kivi_sink_init", "kivi_sink_update", "kivi_sink_get_kv", "kivi_sink_bytes"]

KEY = "kivi_sink"


KiviSinkState = extended_state(
    "KiviSinkState", "KIVI's fields (see ``KiviState``) plus the exact sink rows and their positions.",
    arrays=[("sink_keys", Float[Array, "b h ns d"]), ("sink_values", Float[Array, "b h ns d"]),
            ("sink_positions", Int[Array, "b h ns"])],
    params=[("n_sink_tokens", int)], module=__name__)


def _kivi(state: KiviSinkState) -> KiviState:
    """The KIVI state within (the same arrays, no copies)."""
    return KiviState(*(getattr(state, f) for f in KiviState._fields))


def _with(state: KiviSinkState, inner: KiviState, **fields) -> KiviSinkState:
    return state._replace(**inner._asdict(), **fields)


def kivi_sink_init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
                   bits: int = 2, group_size: int = 32, residual_length: int = 128,
                   n_sink_tokens: int = 5, residual_dtype: str = "float16",
                   backend: str = "auto") -> KiviSinkState:
    """Empty KIVI-with-sinks state (sink rows held in ``residual_dtype`` too)."""
    p, backend = prepare_init(KEY, batch, kv_heads, head_dim, dtype, backend,
                              dict(bits=bits, group_size=group_size, residual_length=residual_length,
                                   n_sink_tokens=n_sink_tokens, residual_dtype=residual_dtype))
    inner = kivi.init(batch, kv_heads, head_dim, dtype=dtype, bits=p["bits"], group_size=p["group_size"],
                      residual_length=p["residual_length"], residual_dtype=p["residual_dtype"],
                      backend=backend)
    b, h, d = batch, kv_heads, head_dim
    rd = inner.residual_keys.dtype
    return KiviSinkState(**inner._asdict(), sink_keys=mx.zeros((b, h, 0, d), rd),
                         sink_values=mx.zeros((b, h, 0, d), rd),
                         sink_positions=mx.zeros((b, h, 0), mx.int32), n_sink_tokens=p["n_sink_tokens"])


def _dims(state: KiviSinkState) -> tuple[int, int, int, mx.Dtype]:
    return kivi.dims(_kivi(state))


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

    # key norm of each token quantized now, summed over the kv heads: [b, f]
    norm = nuq.tree_sum(nuq.tree_sum(mx.square(ck[:, :, :f].astype(mx.float32))).swapaxes(1, 2))
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
    for i in range(b):
        # key norm of each token quantized now, summed over the kv heads
        norm = nuq.np_tree_sum(nuq.np_tree_sum(ck[i, :, :f] ** 2).T)
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


def kivi_sink_update(state: KiviSinkState, keys: Float[Array, "b h s d"], values: Float[Array, "b h s d"],
                     *, queries: Float[Array, "b q s d"] | None = None) -> KiviSinkState:
    """Append ``s`` tokens; the first quantizing update picks the sinks; then KIVI."""
    return dispatch(KEY, state, keys, values, queries, _dims(state))


def _put_rows(x, positions, rows):
    """``x [b, h, n, d]`` with rows ``rows [b, h, S, d]`` written at ``positions [b, h, S]``."""
    idx = mx.broadcast_to(positions[..., None], rows.shape)
    return mx.put_along_axis(x, idx, rows, axis=2) if rows.shape[2] else x


def kivi_sink_get_kv(state: KiviSinkState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """KIVI's dequantized keys and values with the exact sink rows in place."""
    k, v = kivi.get_kv(_kivi(state))
    return (_put_rows(k, state.sink_positions, state.sink_keys.astype(k.dtype)),
            _put_rows(v, state.sink_positions, state.sink_values.astype(v.dtype)))


def kivi_sink_bytes(state: KiviSinkState) -> int:
    """Bytes of every array the state holds: KIVI's, the sink rows and their positions."""
    return state_nbytes(state)


def kivi_sink_positions(state: KiviSinkState) -> Int[Array, "b h n"]:
    """Absolute positions of the tokens ``kivi_sink_get_kv`` returns (all tokens, in order)."""
    return kivi.positions(_kivi(state))


def kivi_sink_error_bound(state: KiviSinkState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """KIVI's bound; on the exact sink rows, their rounding to ``residual_dtype``."""
    kb, vb = kivi.error_bound(_kivi(state))
    cd = quant.dtype_of(state.cache_dtype)
    return (_put_rows(kb, state.sink_positions, quant.rounding_bound(state.sink_keys, cd)),
            _put_rows(vb, state.sink_positions, quant.rounding_bound(state.sink_values, cd)))


register(KEY, state_type=KiviSinkState, init=kivi_sink_init, update=kivi_sink_update,
         get_kv=kivi_sink_get_kv, nbytes=kivi_sink_bytes, positions=kivi_sink_positions,
         error_bound=kivi_sink_error_bound, dims=_dims,
         backends={"reference": _update_reference, "mlx": _update_mlx})

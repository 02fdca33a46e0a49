"""SVDq: keys held as their latent channels in a principal basis fitted at the prefill, quantized
at a fixed bit schedule over eight contiguous groups of channels; values in the model's dtype
(float16 for a float32 cache), as the seed holds them.

A key ``x`` of a (batch row, kv head) is held as the codes of its latent channels ``(x - mean)
@ basis.T`` (``velox.codecs.svdq``): the head's ``r`` leading channels split into eight groups,
group ``g`` at ``bit_schedule[g]`` bits a channel (0: dropped), each channel scaled by its
spread and coded symmetrically with one float16 scale a group of ``group_size`` channels. The
basis (the covariance's eigenvectors), mean, spreads and rank come from the keys of the first
update that holds tokens (the prefill), one fit a batch row and kv head, and are frozen from then
on. ``rank`` fixes ``r`` (and the channels held); ``rank=0`` (the seed's ``None``) takes each
head's energy rank (the fewest components holding ``energy_threshold`` of the variance) within
``head_dim`` channels. Attention logits project the query once (the codec's ``scores``). Every
token is kept; both backends give the same codes. Built by ``velox.codec_cache``.

Guards (the seed's): a fixed ``rank`` below 32 with a 0-bit group in the schedule is refused (a
0-bit group of fewer than four channels drops real signal); an energy rank that small turns the
0-bit groups into 1-bit ones for that head.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import codec_cache
from ..codecs import svdq as codec
from ..codecs.svdq import SvdqCodes, SvdqTables

__all__ = ["SVDqState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend",
           "prefill_fitted", "avg_bits"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         rank: int = 0, energy_threshold: float = 0.95,
         bit_schedule: str = codec.DEFAULT_SCHEDULE, group_size: int = 32,
         value_codec: str = "exact", value_bits: int = 8, backend: str = "auto") -> "SVDqState":
    """Empty SVDq state.

    Args:
        rank: latent channels a key keeps (at most head_dim); 0: each head's energy rank.
        energy_threshold: the share of the keys' variance the energy rank keeps (rank=0).
        bit_schedule: bits a channel of each of the eight groups of the rank's channels,
            comma-separated, most significant group first (0: the group is dropped).
        group_size: latent channels sharing one float16 scale.
        value_codec: how values are held, "exact" by default (the model's dtype, float16 for
            a float32 cache; velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    safe = codec.min_safe_rank(bit_schedule)
    if 0 < rank < safe:
        raise ValueError(
            f"rank={rank} is too small for bit_schedule={bit_schedule!r}: its 0-bit groups "
            f"would each drop {rank / codec.GROUPS:.1f} channels that may carry signal (the "
            f"schedule expects at least {codec.MIN_CHANNELS} a group); use rank >= {safe}, "
            "rank=0 (the energy rank), or a schedule without a 0-bit group")
    state = codec_cache.empty(SVDqState, locals())
    lead = (batch, kv_heads)  # the placeholder tables, one copy a batch row and kv head
    t = state.tables
    rep = lambda a: mx.array(np.broadcast_to(np.array(a), (*lead, *a.shape)).copy())  # noqa: E731
    return state._replace(tables=t._replace(basis=rep(t.basis), mean=rep(t.mean),
                                            sigma=rep(t.sigma), bits=rep(t.bits), rank=rep(t.rank)))


def prefill_fitted(state: SVDqState, keys: mx.array,
                   values: mx.array | None = None) -> SVDqState:
    """``state`` with its tables fitted to ``keys`` if it holds no row yet (the first update
    that holds tokens fits, one fit a batch row and kv head); else ``state``. ``values`` is not read."""
    if codec_cache.capacity(state):
        return state
    return state._replace(tables=codec.fitted(state.tables, keys))


SVDqState = codec_cache.state_type(
    "SVDqState", init, "SVDq key codes (latent channels packed at the schedule's bits, a float16 "
    "scale a group of channels), values (exact rows or per-token codes), each (batch row, kv "
    "head)'s basis, mean, spreads, bits and rank.", codec="svdq", codes=SvdqCodes,
    tables=SvdqTables, prepare=prefill_fitted)
State = SVDqState


def avg_bits(state: SVDqState) -> mx.array:
    """Bits a key element of each (batch row, kv head), ``[b, h]`` float32: the schedule's bits
    over its rank's channels, divided by ``head_dim`` (``(r / d) * mean(schedule)`` where the
    rank is a multiple of 8), the scales and the tables left out."""
    t = state.tables
    return t.bits.astype(mx.float32).sum(axis=-1) / t.head_dim


method = codec_cache.register_method("svdq", SVDqState, init)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

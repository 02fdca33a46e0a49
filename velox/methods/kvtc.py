"""KVTC: keys in a principal basis, bits allocated over the components by dynamic programming
under a budget, coefficients uniformly quantized; values per-token codes (8-bit affine by
default).

A key ``x`` of a (batch row, kv head) is held as the uniform codes of its principal
coefficients ``(x - mean) @ basis.T`` in that head's basis, component ``i`` at ``bits[i]`` bits
(``velox.codecs.kvtc``: the allocation minimises ``sum_i v_i beta^(-b_i)`` over the choices with
``sum_i b_i`` the budget, 0 bits dropping a component), one bit stream and one float16 scale a
row. The basis, mean, spreads and allocation come from a calibration artifact when the cache
has one (``velox calibrate --method kvtc``: one PCA a layer and kv head of the model's keys,
:func:`calibrated`), else from the keys of the first update that holds tokens (the prefill), one
fit a batch row and kv head (``velox.codecs.kvtc.fit``), and are frozen from then on. Attention
logits rotate the query once (the codec's ``scores``). Every token is kept; both backends give
the same codes (the prefill fit is one MLX function for both). Built by ``velox.codec_cache``.

Entropy coding belongs to stored and moved caches: ``save_cache(path, caches, codec="kvtc")``
(``velox.adapters.cache_files``) range-codes these packed coefficients; the cache in memory
holds them packed at their allocated widths, so a decode step never reads back to the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import codec_cache
from ..codecs import kvtc as codec
from ..codecs.kvtc import KvtcCodes, KvtcTables

__all__ = ["KVTCState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend",
           "calibrated", "prefill_fitted"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bit_budget: int = 512, bit_choices: str = codec.DEFAULT_CHOICES, beta: float = 3.5,
         value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "KVTCState":
    """Empty KVTC state.

    Args:
        bit_budget: bits a key row across its principal components (the allocation spends
            exactly this, or the largest sum of head_dim choices below it).
        bit_choices: the bits a component may take, comma-separated (0: dropped).
        beta: base of the allocation's distortion model D(v, b) = v * beta^(-b).
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    state = codec_cache.empty(KVTCState, locals())
    lead = (batch, kv_heads)  # the placeholder tables, one copy a batch row and kv head
    fresh = {k: mx.array(np.broadcast_to(np.array(v), (*lead, *v.shape)).copy())
             for k, v in codec.table_arrays(state.tables).items()}
    return state._replace(tables=state.tables._replace(**fresh))


def prefill_fitted(state: KVTCState, keys: mx.array,
                   values: mx.array | None = None) -> KVTCState:
    """``state`` with its tables fitted to ``keys`` if it holds no row yet and is not
    calibrated (the first update that holds tokens fits, one fit a batch row and kv head);
    else ``state``. ``values`` is not read."""
    if state.tables.calibrated or codec_cache.capacity(state):
        return state
    return state._replace(tables=codec.fitted(state.tables, keys))


KVTCState = codec_cache.state_type(
    "KVTCState", init, "KVTC key codes (principal coefficients packed at their allocated bits, a "
    "float16 scale a row), values (per-token codes or exact rows), each (batch row, kv head)'s "
    "basis, mean, spreads and allocation.", codec="kvtc", codes=KvtcCodes, tables=KvtcTables,
    prepare=prefill_fitted)
State = KVTCState


def calibrated(state: KVTCState, arrays: dict) -> KVTCState:
    """``state`` with one layer's calibration installed (``velox.adapters.artifacts``'s
    ``fit_kvtc``: ``basis [kv_heads, d, d]``, ``mean`` and ``variances [kv_heads, d]``), the
    allocation computed for the state's budget; the state must hold no token yet."""
    if codec_cache.stored_tokens(state):
        raise ValueError("install a calibration into an empty state: this one holds tokens")
    b, h, d, _ = codec_cache.dims(state)
    basis, mean, lam = (np.asarray(arrays[k]) for k in ("basis", "mean", "variances"))
    if basis.shape != (h, d, d) or mean.shape != (h, d) or lam.shape != (h, d):
        raise ValueError(f"calibration of shapes basis {basis.shape}, mean {mean.shape}, variances "
                         f"{lam.shape} does not fit kv_heads={h}, head_dim={d} (expected "
                         f"{(h, d, d)}, {(h, d)}, {(h, d)}: one basis a kv head)")
    rep = lambda a: np.broadcast_to(a, (b, *a.shape))  # noqa: E731
    params = dict(codec_cache.codec_params(state), basis=rep(basis), mean=rep(mean),
                  variances=rep(lam))
    return state._replace(tables=codec.tables(d, params))


method = codec_cache.register_method("kvtc", KVTCState, init, calibrate=calibrated)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

"""SpectralQuant: keys rotated into a spectral basis, every coordinate Lloyd-Max coded, QJL error
correction on the first ``d_eff`` (signal) coordinates only; values per-token codes (8-bit
affine by default).

A key ``x`` is rotated (``y = x @ R.T``), each rotated coordinate, scaled by the key's float16
norm, gets its Gaussian Lloyd-Max code, at ``signal_bits`` for the first ``d_eff`` (signal)
coordinates and at ``bits`` for the others (``signal_bits = 0``: ``bits`` for all); with
``apply_qjl`` the residual of the first ``d_eff`` coordinates is held as ``sign(S r)`` (``m =
jl_dim`` bits, ``S [m, d_eff]`` from ``seed``) and ``||r||`` (float16), and corrects those
coordinates by its unbiased QJL estimate;
the other coordinates are never touched by it. The codec is ``velox.codecs.spectral``; attention
logits over the stored tokens rotate the query once and read the keys in the rotated basis plus
the QJL term from the signs (``attend``). Without calibration ``R`` is the seeded random
rotation and every coordinate has the isotropic spread (the data-oblivious fallback); with a
calibration artifact (``velox calibrate --method spectral``, then ``make_cache(model,
"spectral", artifacts=FILE)``) each kv head of each layer has its own ``R``, the PCA basis of
that head's keys, and each rotated coordinate its measured spread
(``velox.codecs.spectral.calibrate_heads``; the ``calibrate`` hook installs them,
:func:`calibrated`).

Values: per-token 8-bit affine codes by default (about 8.5 bits an element at head_dim 64,
whatever ``bits`` says of the keys); ``value_codec`` and ``value_bits`` set them apart from the
keys (``velox.codec_cache``: affine codes of any width, TurboQuant_mse's codec, or exact rows).
Every token is kept; both backends (``mlx``, ``reference``: the codecs' NumPy twins) give the
same codes. Built by ``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import codec_cache
from ..codecs.spectral import SpectralCodes, SpectralTables

__all__ = ["SpectralState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend",
           "calibrated"]


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, d_eff: int = 4, signal_bits: int = 0, apply_qjl: bool = True,
         jl_dim: int = 0, seed: int = 42, value_codec: str = "affine", value_bits: int = 8,
         backend: str = "auto") -> "SpectralState":
    """Empty SpectralQuant state.

    Args:
        bits: bits per rotated key coordinate (Gaussian Lloyd-Max codebook); with
            signal_bits set, those of the coordinates after the first d_eff.
        d_eff: signal coordinates (the first d_eff of the rotated basis) that the QJL stage
            corrects.
        signal_bits: bits of each signal coordinate (non-uniform allocation: more bits where a
            calibrated basis puts the keys' variance); 0 means the same as bits.
        apply_qjl: QJL error correction of the signal coordinates' residual.
        jl_dim: QJL sketch size m; 0 means m = d_eff (one sign bit a signal coordinate).
        seed: seed of the random rotation and of the sketch (NumPy's default_rng).
        value_codec: how values are held, "affine" by default (velox.codec_cache.VALUE_CODECS).
        value_bits: bits per value element of "affine" or "mse" values, 1 to 8.
    """
    return codec_cache.empty(SpectralState, locals())


SpectralState = codec_cache.state_type(
    "SpectralState", init, "SpectralQuant key codes, norms, signal-residual signs and norms, "
    "values (per-token codes or exact rows), the rotation, spreads, codebook and sketch.", codec="spectral",
    codes=SpectralCodes, tables=SpectralTables)
State = SpectralState


def calibrated(state: SpectralState, arrays: dict) -> SpectralState:
    """``state`` with one layer's calibration installed: the codec's tables rebuilt with the
    fitted per-head ``rotation [kv_heads, d, d]`` and ``scales [kv_heads, d]``
    (``velox.adapters.artifacts``); the state must hold no token yet (codes made with another
    rotation would not decode)."""
    if codec_cache.stored_tokens(state):
        raise ValueError("install a calibration into an empty state: this one holds tokens")
    _, h, d, _ = codec_cache.dims(state)
    rotation, scales = np.asarray(arrays["rotation"]), np.asarray(arrays["scales"])
    if rotation.shape != (h, d, d) or scales.shape != (h, d):
        raise ValueError(f"calibration of shapes rotation {rotation.shape}, scales {scales.shape} "
                         f"does not fit kv_heads={h}, head_dim={d} (expected rotation "
                         f"{(h, d, d)}, scales {(h, d)}: one basis a kv head)")
    params = dict(codec_cache.codec_params(state), rotation=rotation, scales=scales)
    return state._replace(tables=codec_cache.codec_of(state).tables(d, params))


method = codec_cache.register_method("spectral", SpectralState, init, calibrate=calibrated)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

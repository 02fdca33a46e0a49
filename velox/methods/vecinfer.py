"""VecInfer: smoothed, Hadamard-rotated keys and plain values held as product-quantized indices
against calibrated codebooks.

A key ``k`` is divided channel by channel by its smoothing factors ``lambda`` (``sqrt(max |K_i|)``
over calibration keys, one a kv head and channel), rotated by the normalized Hadamard matrix,
cut into ``head_dim / key_sub_dim`` sub-vectors and each held as the index (``key_codebook_bits``
bits, packed) of its nearest centroid of the layer's and kv head's key codebook; a value is cut
into ``head_dim / value_sub_dim`` sub-vectors held the same way against the value codebook
(``velox.codecs.vecinfer``). Attention logits over the stored tokens multiply the query by
``lambda`` and rotate it once (``(lambda q) . (k / lambda) = q . k``), then read the indices
through the query's lookup table against the codebook (``velox.codecs.pq``): no key is rebuilt.

Codebooks: ``codebook="smollm2-135m-instruct"`` (the default) reads layer ``layer`` of the
artifact shipped for the embedded SmolLM2 (``make_cache`` numbers the layers through
``layer_params``); a state it does not fit (another model's kv heads, head_dim or layer count,
or no layer) refuses its first tokens with a ``ValueError`` naming ``velox calibrate --method
vecinfer``, whose artifact ``make_cache(model, "vecinfer", artifacts=FILE)`` installs
(:func:`calibrated`). ``codebook="prefill"`` is the data-free choice: no offline data, the
smoothing factors and both codebooks fitted to the rows of the first update that holds tokens
(the prefill), one fit a batch row and kv head, by the calibration's own rule (Lloyd's k-means
in MLX, its initial centroids drawn from ``seed``), then frozen (:func:`prefill_fitted`); the
fitted tables are held in the state and count in its bytes. ``codebook="random"`` draws
standard normal centroids from ``seed``, for tests. The paper's exact recent window is the adapter's decode tail (``make_cache(...,
decode="append", decode_cap=128)``, ``velox.wrap.with_tail``), not a parameter.
Every token is kept; both backends (``mlx``, ``reference``) give the same codes. Built by
``velox.codec_cache``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import codec_cache
from ..codecs import vecinfer as codec
from ..codecs.vecinfer import SHIPPED, VecInferTables, VQCodes, shipped_arrays, tables_from_arrays

__all__ = ["VecInferState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend", "calibrated", "prefill_fitted", "CALIBRATE"]

#: The command that fits a model's codebooks.
CALIBRATE = "velox calibrate --method vecinfer --out FILE"


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         key_sub_dim: int = 4, value_sub_dim: int = 8, key_codebook_bits: int = 12,
         value_codebook_bits: int = 8,
         codebook: str = "smollm2-135m-instruct", layer: int = -1, seed: int = 0,
         backend: str = "auto") -> "VecInferState":
    """Empty VecInfer state.

    Args:
        key_sub_dim: channels per key sub-vector (one index each).
        value_sub_dim: channels per value sub-vector.
        key_codebook_bits: bits of a key index (2^bits centroids).
        value_codebook_bits: bits of a value index.
        codebook: "smollm2-135m-instruct", the calibration shipped for the embedded SmolLM2
            (layer `layer`), "prefill" (data-free: fitted to the first update's rows, one fit
            a batch row and kv head) or "random" (standard normal centroids from seed: tests
            only).
        layer: the model layer whose shipped calibration the state takes (-1: none; the
            state then needs calibrated() before its first tokens).
        seed: seed of the random codebook, and of the prefill fit's initial centroids.
    """
    state = codec_cache.empty(VecInferState, locals())
    if codebook != "prefill":
        return state
    return state._replace(tables=codec.prefill_placeholder(state.tables, batch, kv_heads),
                          value_tables=codec.prefill_placeholder(state.value_tables, batch, kv_heads))


def prefill_fitted(state, keys, values):
    """``state`` with its smoothing factors and codebooks fitted to ``keys`` and ``values``
    (``velox.codecs.vecinfer.prefill_tables``, seeded from ``seed``: the key codebook's draw
    from ``[seed, 0]``, the values' from ``[seed, 1]``, the streams of the random codebook) if
    it is a ``codebook="prefill"`` state holding no row yet and the update holds tokens; else
    ``state``. A state whose values another codec holds (a composition's) fits its keys only."""
    if state.codebook != "prefill" or codec_cache.capacity(state) or not keys.shape[2]:
        return state
    seed = int(getattr(state, "seed", 0))
    state = state._replace(tables=codec.prefill_tables(state.tables, keys, [seed, 0]))
    vt = getattr(state, "value_tables", None)
    if isinstance(vt, codec.VecInferTables):
        state = state._replace(value_tables=codec.prefill_tables(vt, values, [seed, 1]))
    return state


def _check_calibrated(state, keys, values=None):
    """``state``, fitted first if it fits its codebooks at the prefill (:func:`prefill_fitted`);
    refused (``ValueError``) without calibrated codebooks."""
    state = prefill_fitted(state, keys, values)
    vt = getattr(state, "value_tables", None)
    if not state.tables.calibrated or (vt is not None and not vt.calibrated):
        _, h, d, _ = codec_cache.dims(state)
        raise ValueError(
            f"vecinfer has no calibrated codebooks for this cache (kv_heads={h}, head_dim={d}, "
            f"layer={state.layer}): the shipped calibration fits the embedded SmolLM2 only. "
            f"Fit this model's with `{CALIBRATE}` and pass make_cache(model, 'vecinfer', "
            f"artifacts=FILE), or take codebook='prefill' (fitted to the prompt's rows); "
            "codebook='random' is for tests")
    return state


_RENAME_K = {"sub_dim": "key_sub_dim", "bits": "key_codebook_bits", "codebook": "codebook",
             "seed": "seed", "kv_heads": "kv_heads", "layer": "layer"}
_RENAME_V = {"sub_dim": "value_sub_dim", "bits": "value_codebook_bits", "codebook": "codebook",
             "seed": "seed", "kv_heads": "kv_heads", "layer": "layer"}

VecInferState = codec_cache.state_type(
    "VecInferState", init, "VecInfer key and value indices (packed), the smoothing factors, "
    "the Hadamard rotation and the key and value codebooks.", codec="vecinfer_keys",
    codes=VQCodes, tables=VecInferTables, rename=_RENAME_K, values="vecinfer_values",
    value_types=(VQCodes, VecInferTables), value_rename=_RENAME_V, prepare=_check_calibrated)
State = VecInferState


def calibrated(state: VecInferState, arrays: dict) -> VecInferState:
    """``state`` with one layer's calibration installed (``velox.adapters.artifacts``'s
    ``fit_vecinfer``): ``smooth [kv_heads, d]``, ``key_codebook [kv_heads, K, key_sub_dim]``,
    ``value_codebook [kv_heads, K, value_sub_dim]``; the state must hold no token yet."""
    if codec_cache.stored_tokens(state):
        raise ValueError("install a calibration into an empty state: this one holds tokens")
    _, h, d, _ = codec_cache.dims(state)
    sm = np.asarray(arrays["smooth"])
    kc, vc = np.asarray(arrays["key_codebook"]), np.asarray(arrays["value_codebook"])
    want = {"smooth": (h, d), "key_codebook": (h, 1 << state.key_codebook_bits, state.key_sub_dim),
            "value_codebook": (h, 1 << state.value_codebook_bits, state.value_sub_dim)}
    for name, a in (("smooth", sm), ("key_codebook", kc), ("value_codebook", vc)):
        if a.shape != want[name]:
            raise ValueError(f"calibration {name} of shape {a.shape} does not fit this state "
                             f"(expected {want[name]}: kv_heads={h}, head_dim={d}, the state's "
                             "sub_dim and codebook bits)")
    return state._replace(
        tables=tables_from_arrays(d, state.key_sub_dim, state.key_codebook_bits, kc, sm, rotate=True),
        value_tables=tables_from_arrays(d, state.value_sub_dim, state.value_codebook_bits, vc,
                                        rotate=False))


def _layer_params(n_layers: int, params: dict) -> list[dict]:
    """Layer ``i`` takes layer ``i`` of the shipped calibration when the model has its layer
    count; otherwise no layer (-1: the first tokens ask for an artifact)."""
    shipped = params.get("codebook", "smollm2-135m-instruct")
    fits = shipped in SHIPPED and shipped_arrays(shipped)[1]["layers"] == n_layers
    return [dict(params, layer=i if fits else -1) for i in range(n_layers)]


method = codec_cache.register_method("vecinfer", VecInferState, init, calibrate=calibrated,
                                     layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

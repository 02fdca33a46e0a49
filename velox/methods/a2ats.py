"""A²ATS: every key also held as query-aware VQ codes of its position-free (pre-RoPE) form; a
decode step scores the tokens outside a recent window from the codes, with the query turned
to a constant distance ``b``, and attends exactly over the window and the top
``retrieval_fraction`` of the others.

Update: each new post-RoPE key at position ``p`` is un-rotated by ``p`` (RoPE is an orthogonal
rotation, so this is the pre-RoPE key up to float32 rounding; the frequencies are the model's,
carried by the calibration) and coded by ``velox.codecs.a2ats`` (``sub_dim``-wide sub-vectors,
``codebook_bits`` a sub-vector, nearest centroid under the query second moment ``H``); the
exact keys and values are appended too, in the model's dtype. Every token is kept.

Attention (``attend``) of one query at position ``t`` (a decode step):

* the stored tokens with ``t - p < window`` and the step's new rows: exact logits;
* the others (windowed RoPE): approximate scores ``(R_{b - t} q) . c[idx]``, the query turned
  to position ``b - t`` (its RoPE undone, then ``b`` applied: the score of a key at relative
  distance ``b``) read through its lookup table against the codebook; the top
  ``ceil(retrieval_fraction * far)`` of them per query head (ties: the newer token) are
  gathered from the exact rows and scored exactly; the rest take no weight.

One softmax over the chosen logits. With no token outside the window (``window`` at least the
context) it is ``mx.fast.scaled_dot_product_attention`` over the exact rows, what the full cache
computes. A chunk of several queries (a prefill) attends exactly over every row (causal).

Codebooks: ``codebook="smollm2-135m-instruct"`` (the default) takes layer ``layer`` of the
calibration shipped for the embedded SmolLM2 (``make_cache`` numbers the layers); a state it
does not fit refuses its first tokens with a ``ValueError`` naming :data:`CALIBRATE`, whose
artifact ``make_cache(model, "a2ats", artifacts=FILE)`` installs (:func:`calibrated`).
``codebook="prefill"`` is the data-free choice: the codebooks are fitted to the pre-RoPE keys of
the first update that holds tokens (the prefill), one a batch row, kv head and sub-space, by
Lloyd's k-means in MLX (its initial centroids drawn from ``seed``), then frozen
(:func:`prefill_fitted`), with ``H = I``: no query statistics exist without calibration, so the
assignment is Euclidean (``use_query_aware`` changes nothing); the RoPE is that of ``rope_base``
and ``rope_scaling``, and the fitted codebooks count in the state's bytes.
``codebook="random"`` (tests) draws the centroids from ``seed``, with ``H = I`` and the RoPE of
``rope_base`` and ``rope_scaling``.

Bytes a token and kv head: the packed indices (``ceil(d / sub_dim * codebook_bits / 32)`` uint32
words) plus the exact key and value rows (``2 d`` elements of the model's dtype): 264 at
``d = 64`` in float16, more than the 256 of the full cache, since the paper's CPU copy of the
exact rows is held here in the one memory there is. The tables (float16 codebooks, float32
``H`` and frequencies) count too.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int
from ..attention import softmax
from ..codecs import a2ats as codec
from ..codecs import numpy_tables
from ..codecs.a2ats import A2atsCodes, A2atsTables
from ..evict import append_rows, take_rows
from ..ordering import order_key
from ..registry import register

__all__ = ["A2atsState", "State", "init", "update", "get_kv", "nbytes", "positions", "attend",
           "calibrated", "prefill_fitted", "far_count", "retrieved_count", "approx_scores", "retrieve",
           "window_logits", "CALIBRATE"]

#: The command that fits a model's codebooks and H.
CALIBRATE = "velox calibrate --method a2ats --out FILE"


class A2atsState(NamedTuple):
    """Exact rows (model dtype), the VQ codes of the pre-RoPE keys, the codec's tables."""

    keys: Float[Array, "b h n d"]      # post-RoPE, as given
    values: Float[Array, "b h n d"]
    codes: A2atsCodes                  # idx [b, h, n, w]
    tables: A2atsTables
    next_pos: Int[Array, "b h"]
    codebook_bits: int
    sub_dim: int
    window: int
    b: int
    use_query_aware: bool
    retrieval_fraction: float
    rope_base: float
    rope_scaling: str
    codebook: str
    layer: int
    seed: int
    cache_dtype: str
    backend: str


State = A2atsState


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         codebook_bits: int = 8, sub_dim: int = 8, window: int = 128, b: int = 2048,
         use_query_aware: bool = True, retrieval_fraction: float = 0.2,
         rope_base: float = 10000.0, rope_scaling: str = "none",
         codebook: str = "smollm2-135m-instruct", layer: int = -1, seed: int = 0,
         backend: str = "auto") -> A2atsState:
    """Empty A²ATS state.

    Args:
        codebook_bits: bits of an index (2^bits centroids a sub-space).
        sub_dim: channels a sub-vector (codebook_bits / sub_dim bits an element).
        window: the newest positions scored exactly (t - p < window).
        b: the relative distance every older token is scored at (windowed RoPE).
        use_query_aware: assign by the query-weighted distance (x - c)^T H (x - c); False:
            Euclidean.
        retrieval_fraction: the share of the tokens outside the window read exactly (the
            top of their approximate scores, at least one).
        rope_base: RoPE base of a state without calibration (codebook="prefill" or "random").
        rope_scaling: RoPE scaling of such a state: "none", "llama3.1", "llama3.2".
        codebook: "smollm2-135m-instruct", the calibration shipped for the embedded SmolLM2
            (layer `layer`), "prefill" (data-free: fitted to the first update's pre-RoPE
            keys, one fit a batch row, H = I) or "random" (centroids from seed, H = I: tests
            only).
        layer: the model layer whose shipped calibration the state takes (-1: none; the
            state then needs calibrated() before its first tokens).
        seed: seed of the random codebook, and of the prefill fit's initial centroids.
    """
    t = codec.tables(head_dim, dict(sub_dim=sub_dim, bits=codebook_bits, codebook=codebook,
                                    seed=seed, kv_heads=kv_heads, layer=layer, b=b,
                                    query_aware=use_query_aware, rope_base=rope_base,
                                    rope_scaling=rope_scaling))
    if codebook == "prefill":
        t = codec.prefill_placeholder(t, batch, kv_heads)
    one = codec.encode(t, mx.zeros((batch, kv_heads, 1, head_dim), mx.float32))
    empty = mx.zeros((batch, kv_heads, 0, head_dim), dtype)
    return A2atsState(empty, empty, A2atsCodes(one.idx[:, :, :0]), t,
                      mx.zeros((batch, kv_heads), mx.int32), codebook_bits, sub_dim, window, b,
                      use_query_aware, retrieval_fraction, rope_base, rope_scaling, codebook,
                      layer, seed, quant.dtype_name(dtype), backend)


def _check_calibrated(state: A2atsState) -> None:
    if not state.tables.calibrated:
        _, h, _, d = state.keys.shape
        raise ValueError(
            f"a2ats has no calibrated codebooks for this cache (kv_heads={h}, head_dim={d}, "
            f"layer={state.layer}, b={state.b}): the shipped calibration fits the embedded "
            f"SmolLM2 only, at b=2048. Fit this model's with `{CALIBRATE}` and pass "
            f"make_cache(model, 'a2ats', artifacts=FILE), or take codebook='prefill' (fitted "
            "to the prompt's keys); codebook='random' is for tests")


def calibrated(state: A2atsState, arrays: dict) -> A2atsState:
    """``state`` with one layer's calibration installed (``velox.adapters.artifacts``'s
    ``fit_a2ats``): ``codebook [kv_heads, J, K, sub_dim]``, ``metric [kv_heads, J, sub_dim,
    sub_dim]`` (H, symmetric PSD), ``freqs [kv_heads, d / 2]`` and ``b [kv_heads]``; the state
    must hold no token yet."""
    if state.keys.shape[2]:
        raise ValueError("install a calibration into an empty state: this one holds tokens")
    _, h, _, d = state.keys.shape
    j, k, s = d // state.sub_dim, 1 << state.codebook_bits, state.sub_dim
    want = {"codebook": (h, j, k, s), "metric": (h, j, s, s), "freqs": (h, d // 2), "b": (h,)}
    got = {n: np.asarray(arrays[n]) for n in want}
    for n, shape in want.items():
        if got[n].shape != shape:
            raise ValueError(f"calibration {n} of shape {got[n].shape} does not fit this state "
                             f"(expected {shape}: kv_heads={h}, head_dim={d}, sub_dim={s}, "
                             f"codebook_bits={state.codebook_bits})")
    if not (got["b"] == state.b).all():
        raise ValueError(f"the calibration's H was taken at b={got['b'].flat[0]:g}, this state "
                         f"has b={state.b}: fit it again with `{CALIBRATE}` at this b")
    t = codec.tables_from_arrays(d, s, state.codebook_bits, got["codebook"], got["metric"],
                                 got["freqs"][0], query_aware=state.use_query_aware)
    return state._replace(tables=t)


# --- update -----------------------------------------------------------------------------

def _positions_of_new(state, s: int) -> mx.array:
    return state.next_pos[..., None] + mx.arange(s, dtype=mx.int32)


def _stored(state, keys, values, codes):
    cd = quant.dtype_of(state.cache_dtype)
    return state._replace(keys=append_rows(state.keys, keys.astype(cd)),
                          values=append_rows(state.values, values.astype(cd)),
                          codes=A2atsCodes(append_rows(state.codes.idx, codes.idx)),
                          next_pos=state.next_pos + keys.shape[2])


def prefill_fitted(state: A2atsState, keys: mx.array) -> A2atsState:
    """``state`` with its codebooks fitted to the pre-RoPE form of ``keys`` (each un-rotated
    by its position, :func:`velox.codecs.a2ats.rotate`; ``velox.codecs.a2ats.prefill_tables``,
    the initial centroids drawn from ``[seed, 2]``, the random codebook's stream) if it is a
    ``codebook="prefill"`` state holding no token yet and the update holds tokens; else
    ``state``. One MLX fit for both backends."""
    if state.codebook != "prefill" or state.keys.shape[2] or not keys.shape[2]:
        return state
    pre = codec.rotate(keys, -_positions_of_new(state, keys.shape[2]), state.tables.freqs)
    return state._replace(tables=codec.prefill_tables(state.tables, pre, [int(state.seed), 2]))


def _update_mlx(state, keys, values, queries):
    state = prefill_fitted(state, keys)
    _check_calibrated(state)
    pre = codec.rotate(keys, -_positions_of_new(state, keys.shape[2]), state.tables.freqs)
    return _stored(state, keys, values, codec.encode(state.tables, pre))


def _update_reference(state, keys, values, queries):
    state = prefill_fitted(state, keys)
    _check_calibrated(state)
    s = keys.shape[2]
    pos = np.array(state.next_pos)[..., None] + np.arange(s, dtype=np.int32)
    pre = codec.rotate_np(ref.to_np(keys, np.float32), -pos, np.array(state.tables.freqs))
    c = codec.encode_np(numpy_tables(state.tables), pre)
    return _stored(state, keys, values, A2atsCodes(mx.array(np.ascontiguousarray(c.idx))))


# --- attention --------------------------------------------------------------------------

def far_count(state: A2atsState, new: int = 1) -> int:
    """Stored tokens outside the window of a query at the last of ``new`` new rows'
    position ``t = n + new - 1``: those with ``t - p >= window``."""
    n = state.keys.shape[2]
    return max(0, min(n, n + new - state.window))


def retrieved_count(state: A2atsState, far: int) -> int:
    """Far tokens read exactly: ``ceil(retrieval_fraction * far)`` (at least one)."""
    return 0 if far == 0 else min(far, math.ceil(state.retrieval_fraction * far - 1e-9))


def approx_scores(state: A2atsState, queries: Float[Array, "b q 1 d"], new: int = 1
                  ) -> Float[Array, "b h g f"]:
    """The far tokens' approximate scores ``(R_{b - t} q) . c[idx]`` (unscaled), per query
    head grouped by kv head: ``[b, h, g, far]``."""
    bsz, hq, _, d = queries.shape
    h = state.keys.shape[1]
    f = far_count(state, new)
    t = state.keys.shape[2] + new - 1
    q = queries.astype(mx.float32).reshape(bsz, h, hq // h, d)
    qb = codec.rotate(q, mx.full(q.shape[:3], state.b - t, mx.int32), state.tables.freqs)
    return codec.scores(state.tables, qb, A2atsCodes(state.codes.idx[:, :, :f]))


def retrieve(state: A2atsState, queries: Float[Array, "b q 1 d"], new: int = 1
             ) -> Int[Array, "b h g k"]:
    """Indices (ascending) of the far tokens each query head reads exactly: the top
    :func:`retrieved_count` of :func:`approx_scores` (non-finite lowest; ties: the newer)."""
    approx = approx_scores(state, queries, new)
    k = retrieved_count(state, approx.shape[-1])
    rank = order_key(mx.where(mx.isfinite(approx), approx, -mx.inf))
    idx = mx.argpartition(-rank, kth=k - 1, axis=-1)[..., :k]
    return mx.sort(idx, axis=-1).astype(mx.int32)


def window_logits(state: A2atsState, queries: Float[Array, "b q 1 d"], *, scale: float,
                  new: int = 1) -> Float[Array, "b h g w"]:
    """Exact logits of the stored tokens inside the window: ``(q * scale) . k`` in float32."""
    bsz, hq, _, d = queries.shape
    h = state.keys.shape[1]
    q = queries.astype(mx.float32).reshape(bsz, h, hq // h, d) * scale
    near = state.keys[:, :, far_count(state, new):].astype(mx.float32)
    return q @ near.swapaxes(-1, -2)


def attend(state: A2atsState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h t d"],
           values: Float[Array, "b h t d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention of ``queries`` over the stored tokens and ``t`` new rows (module doc)."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    bsz, hq, sq, d = queries.shape
    new = keys.shape[2]
    far = far_count(state, new) if sq == 1 else 0
    if far == 0:  # everything exact: what the full cache computes
        k = mx.concatenate([state.keys, keys.astype(state.keys.dtype)], axis=2)
        v = mx.concatenate([state.values, values.astype(state.values.dtype)], axis=2)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    h = state.keys.shape[1]
    g = hq // h
    q = queries.astype(mx.float32).reshape(bsz, h, g, 1, d) * scale
    idx = retrieve(state, queries, new)                                   # [b, h, g, k]
    kk = idx.shape[-1]
    flat = idx.reshape(bsz, h, g * kk)
    k_sel = take_rows(state.keys, flat).astype(mx.float32).reshape(bsz, h, g, kk, d)
    v_sel = take_rows(state.values, flat).astype(mx.float32).reshape(bsz, h, g, kk, d)
    near_k = state.keys[:, :, far:].astype(mx.float32)
    near_v = state.values[:, :, far:].astype(mx.float32)
    kn, vn = keys.astype(mx.float32), values.astype(mx.float32)
    logits = mx.concatenate([
        (q @ k_sel.swapaxes(-1, -2))[:, :, :, 0],                        # retrieved
        q[:, :, :, 0] @ near_k.swapaxes(-1, -2),                         # window
        q[:, :, :, 0] @ kn.swapaxes(-1, -2)], axis=-1)                   # new rows
    p = softmax(logits, axis=-1)
    out = (p[..., None, :kk] @ v_sel)[:, :, :, 0] + p[..., kk:] @ mx.concatenate([near_v, vn], axis=2)
    return out.reshape(bsz, hq, 1, d).astype(queries.dtype)


# --- registration -----------------------------------------------------------------------

def _positions(state: A2atsState) -> Int[Array, "b h n"]:
    bsz, h = state.next_pos.shape
    n = state.keys.shape[2]
    return mx.broadcast_to(mx.arange(n, dtype=mx.int32), (bsz, h, n))


def _layer_params(n_layers: int, params: dict) -> list[dict]:
    """Layer ``i`` takes layer ``i`` of the shipped calibration when the model has its layer
    count; otherwise no layer (-1: the first tokens ask for an artifact)."""
    shipped = params.get("codebook", "smollm2-135m-instruct")
    fits = shipped in codec.SHIPPED and codec.shipped_arrays(shipped)[1]["layers"] == n_layers
    return [dict(params, layer=i if fits else -1) for i in range(n_layers)]


method = register("a2ats", A2atsState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  positions=_positions, attend=attend, calibrate=calibrated,
                  layer_params=_layer_params)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes
positions, attend = method.positions, method.attend

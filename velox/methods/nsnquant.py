"""NSNQuant: keys and values in chunks of ``residual_length`` tokens, each chunk
Normalize-Shift-Normalized, Hadamard-rotated and vector-quantized against one universal
codebook built from Gaussian samples (no calibration); the newest tokens exact.

Storage: after ``T`` tokens the oldest ``R * floor(T / R)`` (``R = residual_length``) are
coded and the rest (0 to ``R - 1`` tokens) stay exact in the residual window, held in
``residual_dtype``. A chunk is coded when the window fills (:mod:`velox.codecs.nsn`): per token
its packed sub-vector codes (``bits=2``: a sign mask and a magnitude-codebook index,
``bits=1``: a signed-codebook index; ``log2(codebook_size) / subvector_dim`` bits an element,
plus 1 at 2 bits) and its two scales ``s1``, ``s2``; per chunk its channel mean ``o``, all side
data in float16 (bfloat16 for a bfloat16 cache). Codes are appended chunk by chunk; a coded
chunk never changes. The coded count depends on ``T`` only, so a prompt absorbed at once or
token by token gives the same chunks and the same codes.

``attend``: a decode step scores the coded tokens without rebuilding a key: the query is
rotated once, ``q . k = s1 * s2 * (H q) . c + s1 * (q . o)``, ``(H q) . c`` read through the
query's lookup table (``bits=1``, :func:`velox.codecs.pq.scores`) or from the signed centroids
(``bits=2``: a sign mask times a centroid has no per-index table); the values' weighted sum is
taken in the rotated space and rotated back once. A chunk of queries decodes the coded rows
once and runs MLX's fused attention.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from .._typing import Array, Float, Int, UInt
from ..attention import softmax
from ..codecs import nsn, pq
from ..codecs.nsn import NSNCodes
from ..codecs.rotation import matmul_per_slice
from ..registry import register
from .kivi import dims

__all__ = ["NSNQuantState", "State", "init", "update", "get_kv", "nbytes", "positions",
           "attend", "coded_tokens", "tables", "payload_bits"]


class NSNQuantState(NamedTuple):
    """Coded chunks of keys and values (codes and scales a token, means a chunk) and the
    exact residual window."""

    key_codes: UInt[Array, "b h n kw"]
    key_scales: Float[Array, "b h n 2"]
    key_means: Float[Array, "b h c d"]
    value_codes: UInt[Array, "b h n vw"]
    value_scales: Float[Array, "b h n 2"]
    value_means: Float[Array, "b h c d"]
    residual_keys: Float[Array, "b h r d"]
    residual_values: Float[Array, "b h r d"]
    next_pos: Int[Array, "b h"]
    bits: int
    residual_length: int
    codebook_size: int
    subvector_dim: int
    seed: int
    residual_dtype: str
    cache_dtype: str
    backend: str


def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
         bits: int = 2, residual_length: int = 64, codebook_size: int = 256,
         subvector_dim: int = 8, seed: int = 1234, residual_dtype: str = "float16",
         backend: str = "auto") -> NSNQuantState:
    """Empty NSNQuant state.

    Args:
        bits: 2 (a sign mask and a magnitude-codebook index a sub-vector) or 1 (a
            signed-codebook index).
        residual_length: tokens of a chunk: the residual window is coded as one chunk when it
            holds this many (the window holds 0 to ``residual_length - 1`` tokens after an
            update).
        codebook_size: centroids of the universal codebook (a power of two).
        subvector_dim: coordinates of a sub-vector (each is held as one codebook index).
        seed: seed of the codebook's Gaussian samples and its k-means.
        residual_dtype: dtype of the rows held exact ("model": the cache dtype); side data
            is float16 (bfloat16 for a bfloat16 cache).
    """
    b, h, d = batch, kv_heads, head_dim
    width = pq.words(d // subvector_dim, nsn.code_bits(codebook_size, subvector_dim, bits))
    sd, rd = quant.side_dtype(dtype), quant.exact_dtype(residual_dtype, dtype)
    nsn.tables(codebook_size, subvector_dim, seed, bits, d)  # built once, here, not at a step
    return NSNQuantState(
        key_codes=mx.zeros((b, h, 0, width), mx.uint32), key_scales=mx.zeros((b, h, 0, 2), sd),
        key_means=mx.zeros((b, h, 0, d), sd), value_codes=mx.zeros((b, h, 0, width), mx.uint32),
        value_scales=mx.zeros((b, h, 0, 2), sd), value_means=mx.zeros((b, h, 0, d), sd),
        residual_keys=mx.zeros((b, h, 0, d), rd), residual_values=mx.zeros((b, h, 0, d), rd),
        next_pos=mx.zeros((b, h), mx.int32), bits=bits, residual_length=residual_length,
        codebook_size=codebook_size, subvector_dim=subvector_dim, seed=seed,
        residual_dtype=residual_dtype, cache_dtype=quant.dtype_name(dtype), backend=backend)


def tables(state: NSNQuantState) -> tuple[mx.array, mx.array]:
    """``(codebook [K, s], rotation [d, d])`` of the state (shared constants, not held in it)."""
    return nsn.tables(state.codebook_size, state.subvector_dim, state.seed, state.bits,
                      state.residual_keys.shape[-1])


def coded_tokens(state: NSNQuantState) -> int:
    """Tokens held as codes (a multiple of ``residual_length``)."""
    return state.key_codes.shape[2]


def payload_bits(state: NSNQuantState) -> float:
    """Bits an element of the codes alone: ``log2(codebook_size) / subvector_dim`` (+ 1)."""
    return nsn.code_bits(state.codebook_size, state.subvector_dim, state.bits) / state.subvector_dim


def _side(state: NSNQuantState) -> mx.Dtype:
    return quant.side_dtype(quant.dtype_of(state.cache_dtype))


def _keys(state: NSNQuantState) -> NSNCodes:
    return NSNCodes(state.key_codes, state.key_scales, state.key_means)


def _values(state: NSNQuantState) -> NSNCodes:
    return NSNCodes(state.value_codes, state.value_scales, state.value_means)


def _with(state: NSNQuantState, rk, rv, s: int, kc=None, vc=None) -> NSNQuantState:
    """The state with the window ``rk``, ``rv`` and the coded chunks ``kc``, ``vc`` appended."""
    fields = dict(residual_keys=rk, residual_values=rv, next_pos=state.next_pos + s)
    if kc is not None:
        for name, old, new in (("key", _keys(state), kc), ("value", _values(state), vc)):
            fields.update({f"{name}_{f}": mx.concatenate([a, b], axis=2)
                           for f, a, b in zip(NSNCodes._fields, old, new)})
    return state._replace(**fields)


def _update_mlx(state: NSNQuantState, keys, values, queries) -> NSNQuantState:
    rd = state.residual_keys.dtype
    rk = mx.concatenate([state.residual_keys, keys.astype(rd)], axis=2)
    rv = mx.concatenate([state.residual_values, values.astype(rd)], axis=2)
    r = state.residual_length
    f = rk.shape[2] // r * r
    if not f:
        return _with(state, rk, rv, keys.shape[2])
    cb, rot = tables(state)
    code = lambda x: nsn.encode_chunks(x, r, cb, rot, state.bits, _side(state))  # noqa: E731
    return _with(state, rk[:, :, f:], rv[:, :, f:], keys.shape[2], code(rk[:, :, :f]), code(rv[:, :, :f]))


# --- reference: the NumPy twins (velox.codecs.nsn) ------------------------------------------


def _update_reference(state: NSNQuantState, keys, values, queries) -> NSNQuantState:
    rd = state.residual_keys.dtype
    new = lambda x: ref.round_to(ref.to_np(x, np.float32), rd)  # noqa: E731  (held in rd)
    rk = np.concatenate([ref.to_np(state.residual_keys, np.float32), new(keys)], 2)
    rv = np.concatenate([ref.to_np(state.residual_values, np.float32), new(values)], 2)
    r = state.residual_length
    f = rk.shape[2] // r * r
    mxr = lambda x: ref.to_mx(x, rd)  # noqa: E731
    if not f:
        return _with(state, mxr(rk), mxr(rv), keys.shape[2])
    cb, rot = (np.array(t) for t in tables(state))
    sd = _side(state)

    def code(x):
        c, s, o = nsn.encode_chunks_np(x, r, cb, rot, state.bits, sd)
        return NSNCodes(mx.array(c), ref.to_mx(s, sd), ref.to_mx(o, sd))
    return _with(state, mxr(rk[:, :, f:]), mxr(rv[:, :, f:]), keys.shape[2], code(rk[:, :, :f]),
                 code(rv[:, :, :f]))


def get_kv(state: NSNQuantState) -> tuple[Float[Array, "b h n d"], Float[Array, "b h n d"]]:
    """Decoded coded chunks followed by the exact residual window (model dtype)."""
    cd = quant.dtype_of(state.cache_dtype)
    cb, rot = tables(state)
    k = nsn.decode_chunks(_keys(state), cb, rot, state.bits)
    v = nsn.decode_chunks(_values(state), cb, rot, state.bits)
    return (mx.concatenate([k.astype(cd), state.residual_keys.astype(cd)], axis=2),
            mx.concatenate([v.astype(cd), state.residual_values.astype(cd)], axis=2))


positions = quant.every_position(lambda state: coded_tokens(state) + state.residual_keys.shape[2])


def _per_token(x: mx.array, r: int) -> mx.array:
    """A chunk's ``[..., c]`` values for each of its ``r`` tokens: ``[..., c * r]``."""
    return mx.repeat(x, r, axis=-1)


def _coded_logits(state: NSNQuantState, q: mx.array, qr: mx.array, cb: mx.array) -> mx.array:
    """``q . k`` ``[b, h, m, n]`` of the coded keys, from the codes: ``s1 * (s2 * (H q) . c +
    q . o)`` (``qr = H q``)."""
    d = q.shape[-1]
    if state.bits == 1:
        width = nsn.code_bits(state.codebook_size, state.subvector_dim, 1)
        dot = pq.scores(qr, cb, pq.unpack(state.key_codes, width, d // state.subvector_dim))
    else:
        dot = qr @ nsn.decode_rotated(state.key_codes, cb, 2, d).swapaxes(-1, -2)
    s = state.key_scales.astype(mx.float32)
    qo = _per_token(q @ state.key_means.astype(mx.float32).swapaxes(-1, -2), state.residual_length)
    return s[..., 0][:, :, None] * (s[..., 1][:, :, None] * dot + qo)


def _coded_output(state: NSNQuantState, p: mx.array, cb: mx.array, rot: mx.array) -> mx.array:
    """``p @ v`` ``[b, h, m, d]`` over the coded values, from the codes: ``H^T (sum_t p s1 s2
    c_t) + sum_chunks (sum_{t in chunk} p s1) o``."""
    b, h, m, n = p.shape
    d = rot.shape[0]
    s = state.value_scales.astype(mx.float32)
    c = nsn.decode_rotated(state.value_codes, cb, state.bits, d)
    rotated = (p * (s[..., 0] * s[..., 1])[:, :, None]) @ c
    per_chunk = (p * s[..., 0][:, :, None]).reshape(b, h, m, -1, state.residual_length).sum(axis=-1)
    return matmul_per_slice(rotated, rot) + per_chunk @ state.value_means.astype(mx.float32)


def attend(state: NSNQuantState, queries: Float[Array, "b q s d"], keys: Float[Array, "b h s d"],
           values: Float[Array, "b h s d"], *, scale: float, mask=None) -> Float[Array, "b q s d"]:
    """Attention over the coded chunks, the residual window and ``s`` new tokens. One query a
    row (a decode step) reads the codes (see the module); a chunk of queries decodes the coded
    rows once and runs MLX's fused attention."""
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        raise ValueError("attend takes mask=None or 'causal'")
    b, hq, s, d = queries.shape
    n = coded_tokens(state)
    if s > 1 or n == 0:
        dt = queries.dtype if queries.dtype in (mx.float16, mx.bfloat16) else mx.float32
        k, v = get_kv(state)
        k = mx.concatenate([k.astype(dt), keys.astype(dt)], axis=2)
        v = mx.concatenate([v.astype(dt), values.astype(dt)], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries.astype(dt), k, v, scale=scale,
                                                   mask=None if s == 1 else mask)
        return out.astype(queries.dtype)
    h = keys.shape[1]
    cb, rot = tables(state)
    q = (queries.astype(mx.float32) * scale).reshape(b, h, hq // h, d)
    exact_k = mx.concatenate([state.residual_keys.astype(mx.float32), keys.astype(mx.float32)], axis=2)
    exact_v = mx.concatenate([state.residual_values.astype(mx.float32), values.astype(mx.float32)], axis=2)
    logits = mx.concatenate([_coded_logits(state, q, matmul_per_slice(q, rot.T), cb),
                             q @ exact_k.swapaxes(-1, -2)], axis=-1)
    p = softmax(logits, axis=-1)
    out = _coded_output(state, p[..., :n], cb, rot) + p[..., n:] @ exact_v
    return out.reshape(b, hq, 1, d).astype(queries.dtype)


State = NSNQuantState
method = register("nsnquant", NSNQuantState, init, {"reference": _update_reference, "mlx": _update_mlx},
                  get_kv=get_kv, positions=positions, dims=dims, attend=attend)
init, update, get_kv, nbytes = method.init, method.update, method.get_kv, method.nbytes

"""A CUDA decode step of KIVI's attention over its packed codes (``mx.fast.cuda_kernel``):
flash-decoding over the quantized keys and values, the exact residual window and the new token.

KIVI's state (``velox.methods.kivi``): ``Q`` quantized tokens, keys per channel in groups of
``group_size`` tokens stored transposed (``key_codes [b, h, d, Q * bits / 32]``, scales and
zeros ``[b, h, d, Q / group_size]``), values per token in groups of ``group_size`` channels
(``value_codes [b, h, Q, d * bits / 32]``, scales and zeros ``[b, h, Q, d / group_size]``),
codes packed little-endian in MLX's affine layout (``velox.quant.pack``: code ``i`` of a row at
bit ``i * bits`` of its word stream, spilling into the next word for 3 bits); then the exact
residual window ``residual_keys / residual_values [b, h, r, d]``.

One query token per sequence (``s == 1``), the ``g`` query heads of a kv head in the same block,
so each stored code is read once. A step is two launches:

* ``split``: a block per (batch row, kv head, split) of ``velox.kernels.codec.THREADS``
  threads. The first splits cover the quantized tokens in spans of whole key groups (each
  key group's scale and zero is read for its channels by one block only); the last ones the
  residual window. Phase 1, a thread per token: the ``g`` logits (quantized: each channel's
  code unpacked from its word, times the group's scale plus its zero, float32; residual: the
  row). Phases 2 and 3 are ``velox.kernels.codec``'s split kernel's own (the split's maximum and
  sum of exponentials, then a thread per value coordinate: the weights times the values,
  quantized ones decoded per token the same way). It writes each split's ``(max, sum,
  weighted values)``, float32.
* ``merge``: ``velox.kernels.codec``'s merge kernel: the new token's exact logit, then every
  split and the new token combined into the output, in the queries' dtype.

Arithmetic: the queries are scaled in float32, the codes decoded as ``q * scale + zero`` in
float32 and everything summed in float32: the result is ``attend`` evaluated in float32
(``attend(state, queries.astype(float32), keys.astype(float32), values.astype(float32))`` then
rounded to the queries' dtype), equal to it within :data:`TOLERANCE`. For float32 queries that
is ``attend`` itself. For float16 and bfloat16 queries ``attend``'s MLX path also rounds the
scaled queries, the logits and the weights to the queries' dtype, so the two differ by that
rounding as well (:data:`HALF_TOLERANCE`).

:func:`supports` says which states and queries the kernels take: bits 2, 4 or 8 (the sources
also cover 3, whose codes spill across words, but it is not used on a GPU yet: see
:func:`supports`), group_size 32, 64 or 128 dividing
head_dim 64 or 128, ``g <= 32`` (within the block's static shared memory), float16 / bfloat16 /
float32 queries, float16 / bfloat16 scales and zeros, float16 / bfloat16 / float32 residual
rows, one query token, a CUDA device; anything else goes to the MLX path.
``velox.kernels.nvrtc`` compiles every variant's source without a GPU
(``tests/test_kivi_kernel.py``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from . import codec as ck

__all__ = ["supports", "decode_attend", "split_spec", "TOLERANCE", "HALF_TOLERANCE", "BITS", "DEVICE_BITS",
           "GROUP_SIZES", "HEAD_DIMS", "MAX_GROUPS"]

BITS = (2, 3, 4, 8)
#: The bits :func:`supports` takes on a GPU (see there for 3).
DEVICE_BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)
HEAD_DIMS = ck.HEAD_DIMS
MAX_GROUPS = ck.MAX_GROUPS
THREADS = ck.THREADS
#: ``|decode_attend - attend in float32| <= atol + rtol * |...|`` (float32 rounding of the
#: two summation orders plus one rounding step of the output dtype): the codec kernels' bound.
TOLERANCE = ck.TOLERANCE
#: ``|decode_attend - attend|`` for half queries, whose MLX path rounds the scaled queries,
#: the logits and the weights to the queries' dtype (relative ``u``: 2**-11 float16, 2**-8
#: bfloat16): ``atol + rtol * |attend|`` with atol about 8u (logits of a few units times
#: values of a few units) and rtol 4u. Float32 queries: :data:`TOLERANCE`.
HALF_TOLERANCE = {mx.float32: TOLERANCE[mx.float32], mx.float16: (2.0 ** -8, 2.0 ** -9),
                  mx.bfloat16: (2.0 ** -5, 2.0 ** -6)}

_ROW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_SIDE_DTYPES = (mx.float16, mx.bfloat16)

# Everything up to phase 1: which segment the block's split covers (quantized tokens in spans of
# whole groups, then the residual rows), and the G queries times the scale in q_s. QUANT and
# RESID say whether the step has quantized tokens and residual rows (an absent segment's inputs
# are placeholders of one element, never read).
_PREAMBLE = """
    const unsigned int tid = threadIdx.x;
    const int nb = qry_shape[0], nh = qry_shape[1] / G;
    const int nq = QUANT ? vs_shape[2] : 0, nr = RESID ? rk_shape[2] : 0;
    const int nrs = (nr + SPLIT - 1) / SPLIT;
    const int nsplit = (int)(gridDim.x / (unsigned int)(nb * nh));
    const int nqs = nsplit - nrs;
    const size_t bh = blockIdx.x / nsplit;
    const int split = blockIdx.x % nsplit;
    const bool quant = split < nqs;
    const int n = quant ? nq : nr;
    const int span = quant ? (nq / GS + nqs - 1) / nqs * GS : (nr + nrs - 1) / (nrs > 0 ? nrs : 1);
    const int start = (quant ? split : split - nqs) * span;
    const int len = n - start >= span ? span : (n - start > 0 ? n - start : 0);
    const int kw = nq / 32 * BITS, ng = nq / GS;
    const float inf = __int_as_float(0x7f800000);
    __shared__ float lg[G * SPLIT];
    __shared__ float red[G * NT];
    __shared__ float q_s[G * HEAD_DIM];
    for (int i = (int)tid; i < G * HEAD_DIM; i += NT)
        q_s[i] = __fmul_rn(static_cast<float>(qry[bh * (G * HEAD_DIM) + i]), params[2]);
    __syncthreads();
"""

# A quantized token's key (token tok of the row, channel ch): its code at bit tok * BITS of the
# channel's word stream, times the group's scale plus its zero; a residual token's: the row.
_LOGITS = """if (quant) {
            const int tok = start + t;
            const int bit = tok * BITS, wi = bit >> 5, sh = bit & 31;
            const unsigned int* kr = kc + bh * HEAD_DIM * (size_t)kw + wi;
            const size_t side = bh * HEAD_DIM * (size_t)ng + tok / GS;
            #pragma unroll 8
            for (int ch = 0; ch < HEAD_DIM; ++ch) {
                unsigned int w = kr[(size_t)ch * kw] >> sh;
                if (32 % BITS != 0 && sh + BITS > 32) w |= kr[(size_t)ch * kw + 1] << (32 - sh);
                const float k = __fadd_rn(__fmul_rn((float)(w & ((1u << BITS) - 1u)),
                                                    static_cast<float>(ks[side + (size_t)ch * ng])),
                                          static_cast<float>(kz[side + (size_t)ch * ng]));
                #pragma unroll
                for (int j = 0; j < G; ++j) lgt[j] += q_s[j * HEAD_DIM + ch] * k;
            }
        } else {
            #pragma unroll 8
            for (int ch = 0; ch < HEAD_DIM; ++ch) {
                const float k = static_cast<float>(rk[row * HEAD_DIM + ch]);
                #pragma unroll
                for (int j = 0; j < G; ++j) lgt[j] += q_s[j * HEAD_DIM + ch] * k;
            }
        }"""

# Value coordinate c of the token in ``row``: its code at bit c * BITS of the row's words, times
# the scale plus the zero of its channel group; or the residual row's.
_VALUE = """float v;
        if (quant) {
            constexpr int VW = HEAD_DIM * BITS / 32, VG = HEAD_DIM / GS;
            const int bit = c * BITS, wi = bit >> 5, sh = bit & 31;
            unsigned int w = vc[row * VW + wi] >> sh;
            if (32 % BITS != 0 && sh + BITS > 32) w |= vc[row * VW + wi + 1] << (32 - sh);
            v = __fadd_rn(__fmul_rn((float)(w & ((1u << BITS) - 1u)), static_cast<float>(vs[row * VG + c / GS])),
                          static_cast<float>(vz[row * VG + c / GS]));
        } else {
            v = static_cast<float>(rv[row * HEAD_DIM + c]);
        }"""

_INPUTS = ["qry", "kc", "ks", "kz", "vc", "vs", "vz", "rk", "rv", "params"]
_TEMPLATE = ("HEAD_DIM", "G", "BITS", "GS", "SPLIT", "QUANT", "RESID")


@lru_cache(maxsize=None)
def split_spec() -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of the split kernel. Template values: ``HEAD_DIM``,
    ``G``, ``BITS``, ``GS`` (group_size), ``SPLIT`` (most tokens a block holds, a multiple of
    ``GS``), ``QUANT`` and ``RESID`` (1 where the step has quantized tokens, residual rows).
    Phases 1 to 3 are the text of ``velox.kernels.codec``'s split kernel from its phase 1 on."""
    body = ck._SPLIT_BODY
    at = body.find("    // phase 1")
    if at < 0:
        raise RuntimeError("velox.kernels.codec's split kernel has no '// phase 1' section")
    src = re.sub(r"\bNT\b", str(THREADS), _PREAMBLE + body[at:])
    src = src.replace("LOGITS", _LOGITS).replace("SIDE", "").replace("VALUE", _VALUE)
    return dict(name="velox_kivi_split", input_names=list(_INPUTS), output_names=["pm", "pl", "pa"],
                source=src, header=ck._HEADER)


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(**split_spec())


def _run_kernel(codec, values, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch (``codec`` ``"kivi"``: the split kernel; None: the codec merge kernel); the
    signature of ``velox.kernels.codec._run_kernel``. The tests replace it by an emulation."""
    kernel = ck._kernel(None, None) if codec is None else _kernel()
    return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                  output_dtypes=output_dtypes, template=template)


class _Layout(NamedTuple):
    bits: int
    group_size: int
    groups: int
    head_dim: int
    split: int       # most stored tokens one split block holds (a multiple of group_size)


def split_size(groups: int, group_size: int) -> int:
    """Most tokens one split block holds: ``velox.kernels.codec.split_size``, at least one
    key group."""
    return max(ck.split_size(groups), group_size)


def shared_bytes(lay: _Layout) -> int:
    """Static shared memory of a split block: logits, reduction scratch, scaled queries."""
    return 4 * lay.groups * (lay.split + THREADS + lay.head_dim)


_FIELDS = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros",
           "residual_keys", "residual_values", "next_pos", "bits", "group_size")


def _layout(state, queries) -> _Layout | None:
    """The kernel layout of ``state`` (KIVI's fields) and ``queries``, or None."""
    if not all(hasattr(state, f) for f in _FIELDS):
        return None
    if not isinstance(queries, mx.array) or queries.ndim != 4 or queries.shape[2] != 1 \
            or queries.dtype not in _ROW_DTYPES:
        return None
    bits, gs = state.bits, state.group_size
    if bits not in BITS or gs not in GROUP_SIZES:
        return None
    b, hq, _, d = queries.shape
    if not isinstance(state.next_pos, mx.array) or state.next_pos.ndim != 2:
        return None
    bs, h = state.next_pos.shape
    if d not in HEAD_DIMS or d % gs or bs != b or h == 0 or hq % h or not 1 <= hq // h <= MAX_GROUPS:
        return None
    kc, ks, kz = state.key_codes, state.key_scales, state.key_zeros
    vc, vs, vz = state.value_codes, state.value_scales, state.value_zeros
    rk, rv = state.residual_keys, state.residual_values
    if any(not isinstance(x, mx.array) or x.ndim != 4 for x in (kc, ks, kz, vc, vs, vz, rk, rv)):
        return None
    nq, nr = vc.shape[2], rk.shape[2]
    if nq % gs or kc.shape != (b, h, d, nq * bits // 32) or ks.shape != (b, h, d, nq // gs) \
            or kz.shape != ks.shape or vc.shape != (b, h, nq, d * bits // 32) \
            or vs.shape != (b, h, nq, d // gs) or vz.shape != vs.shape \
            or rk.shape != (b, h, nr, d) or rv.shape != rk.shape:
        return None
    if kc.dtype != mx.uint32 or vc.dtype != mx.uint32 or ks.dtype not in _SIDE_DTYPES \
            or any(x.dtype != ks.dtype for x in (kz, vs, vz)) or rk.dtype not in _ROW_DTYPES \
            or rv.dtype != rk.dtype:
        return None
    lay = _Layout(bits, gs, hq // h, d, split_size(hq // h, gs))
    return lay if shared_bytes(lay) <= ck.SHARED_LIMIT else None


def supports(state, queries) -> bool:
    """Whether :func:`attend` should run the kernels for ``state`` and ``queries`` (else the MLX
    path): a KIVI state at bits 2, 4 or 8 (:data:`DEVICE_BITS`) and group_size 32, 64 or 128,
    one query token, head_dim 64 or 128, at most 32 query heads per kv head, float16, bfloat16
    or float32 queries, on a CUDA device.

    3-bit states (codes spilling across words) are left to the MLX path: the kernel's 3-bit
    variant compiles and matches ``attend`` in the CPU emulation, but its GPU test did not finish
    within 38 s on an H200 (cause not found), so it is not used until it passes there."""
    from velox.backend import device_supports
    return (device_supports("cuda") and mx.default_device() == mx.gpu
            and getattr(state, "bits", None) in DEVICE_BITS and _layout(state, queries) is not None)


def plan_splits(batch: int, kv_heads: int, nq: int, nr: int, split: int, group_size: int) -> tuple[int, int]:
    """``(quantized, residual)`` split blocks per (batch row, kv head): the quantized tokens in
    about ``velox.kernels.codec.plan_splits``'s spans rounded up to whole groups, the residual
    rows in blocks of at most ``split`` (as the kernel counts them)."""
    nqs = 0
    if nq:
        span = -(-nq // ck.plan_splits(batch, kv_heads, nq, split))
        groups = -(-span // group_size)
        nqs = -(-(nq // group_size) // groups)
    return nqs, -(-nr // split)


@lru_cache(maxsize=None)
def _placeholder(dtype) -> mx.array:
    return mx.zeros((1,), dtype)


def decode_attend(state, queries, keys, values, *, scale: float):
    """``velox.methods.kivi.attend(state, queries, keys, values, scale=scale)`` for one query
    token (``queries [b, hq, 1, d]``, the step's ``keys`` / ``values [b, h, 1, d]``), by the
    kernels: ``[b, hq, 1, d]`` in the queries' dtype (see the module docstring for how it
    rounds). Refuses (``ValueError``) what :func:`supports` would not take (the device aside)."""
    lay = _layout(state, queries)
    if lay is None:
        raise ValueError("decode_attend does not take this state and queries (see supports)")
    b, _, _, d = queries.shape
    h, g = state.next_pos.shape[1], lay.groups
    ck.check_step(queries, keys, values, h)
    nq, nr = state.value_codes.shape[2], state.residual_keys.shape[2]
    if nq == 0 and nr == 0:
        return ck.new_token_alone(queries, values)
    params = ck._params(d, 0, float(scale))
    ins = dict(qry=queries, params=params)
    quant = ("kc", "ks", "kz", "vc", "vs", "vz")
    fields = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros")
    for k, f in zip(quant, fields):
        x = getattr(state, f)
        ins[k] = x if nq else _placeholder(x.dtype)
    for k, x in (("rk", state.residual_keys), ("rv", state.residual_values)):
        ins[k] = x if nr else _placeholder(x.dtype)
    nqs, nrs = plan_splits(b, h, nq, nr, lay.split, lay.group_size)
    nsplit = nqs + nrs
    template = [("HEAD_DIM", d), ("G", g), ("BITS", lay.bits), ("GS", lay.group_size),
                ("SPLIT", lay.split), ("QUANT", int(nq > 0)), ("RESID", int(nr > 0))]
    return ck.split_then_merge(_run_kernel, ("kivi", None), [ins[k] for k in _INPUTS], nsplit,
                               template, queries, keys, values, params)

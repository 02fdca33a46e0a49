"""A CUDA decode step of attention on key codes (``mx.fast.cuda_kernel``): flash-decoding over
the codes of TurboQuant (``turboquant_mse``, ``turboquant_rvq``, ``turboquant_prod``) and QJL.

One query token per sequence (``s == 1``), the ``g`` query heads of a kv head together, so each
stored token's codes are read once. A step is two kernel launches and no other GPU op:

* ``split``: a block per (batch row, kv head, token split) of 128 threads. It first scales its
  ``g`` queries, rotates them (``q R^T``) and / or projects them (``S q``) into shared memory
  (``g d^2`` multiply-adds a block, the matrices read through the cache), in place of three or
  four MLX ops (each a launch) before the kernel. Phase 1, a thread
  per stored token: the ``g`` logits from the codes, in the rotated domain (TurboQuant: the
  ``bits``-bit indices unpacked from the little-endian bit stream of ``velox.quant.pack``, the
  centroid looked up in a table in shared memory, dotted with the rotated query, times
  ``norm / sqrt(d)``; RVQ: two index streams, the second scaled by the row's gain; prod: that
  MSE part plus ``sqrt(pi/2) / m * ||r|| * <S q, sign(S r)>`` from the packed sign bits; QJL
  alone: the sign part times the key norm). Phase 2: each head's maximum and sum of
  exponentials over the split (block reductions). Phase 3, a thread per value coordinate
  (two per coordinate at head_dim 64): the weights times the values (``Int8Rows``: the 8-bit
  codes of a ``uint32`` word times the row's scale plus its zero; ``ExactRows``: the rows).
  It writes each split's ``(max, sum, weighted values)``, float32.
* ``merge``: a block per (batch row, query head) of ``MERGE_THREADS`` threads: the new token's
  exact logit (its own key), then every split and the new token combined into the output, in
  the queries' dtype (the splits shared among ``MERGE_THREADS / head_dim`` parts of a thread
  per coordinate, for loads in flight; the parts added in order).

The stored tokens are the first ``held`` rows of each (batch row, kv head)'s arrays, ``held``
an int32 ``[b, h]`` input (a codec cache holds its rows in chunks, ``velox.codec_cache``: the
empty rows after its tokens are never read, and the arrays are read in place, unsliced; the
count is data, so a compiled decode step does not change with it).

Everything is float32; the sums run in another order than ``velox.codec_cache.attend``'s
matmuls, so the two agree within float32 rounding (the tests' tolerance: ``TOLERANCE``).
:func:`supports` says which states and queries the kernels take (the four codecs' own codes
records, values as 8-bit affine codes or exact rows, head_dim 64 or 128, ``g <= 32``, float16 / bfloat16 / float32 queries, one query
token, a CUDA device); anything else goes to the MLX path. ``velox.kernels.nvrtc`` compiles
every variant's source without a GPU (``tests/test_codec_kernel.py``).
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from . import build
from .dialect import CUDA, SHARED_LIMITS, active, make_spec

__all__ = ["supports", "decode_attend", "TOLERANCE", "CODECS", "HEAD_DIMS", "MAX_GROUPS"]

THREADS = 128            # threads per block of the split kernel (a power of two, >= head_dim)
MERGE_THREADS = 512      # threads per block of the merge kernel (a power of two, a multiple of head_dim)
TARGET_BLOCKS = 528      # split blocks aimed at per step: 4 per SM of an H100 / H200 (132 SMs)
MIN_SPAN = 64            # fewest stored tokens a split block takes (unless fewer are stored)
SHARED_LIMIT = 48 * 1024  # static shared memory of one block on CUDA (dialect.SHARED_LIMITS: Metal's)
HEAD_DIMS = (64, 128)
MAX_GROUPS = 32
#: The codecs the kernels read, and the kernel variant of each.
CODECS = {"turboquant_mse": "mse", "turboquant_rvq": "rvq", "turboquant_prod": "prod", "qjl": "qjl"}
#: ``|decode_attend - attend| <= atol + rtol * |attend|`` per element (output in the queries'
#: dtype): float32 rounding of the two summation orders (atol, rtol ~ 1e-5), plus one rounding
#: step of the output dtype (the same float32 result may round to either neighbour).
TOLERANCE = {mx.float32: (3e-5, 3e-5), mx.float16: (3e-5, 2.0 ** -10 + 3e-5),
             mx.bfloat16: (3e-5, 2.0 ** -7 + 3e-5)}

_HEADER = """
template <typename T> VX_FN void velox_put(VX_DEVICE T* p, float x) { *p = static_cast<T>(x); }
"""

# One block per (batch row, kv head, split) of NT threads; see the module docstring. The
# placeholders are filled per codec (SHARED, LOAD, LOGITS) and per value layout (SIDE, VALUE).
_SPLIT_BODY = """
    const unsigned int tid = VX_TID;
    const int nb = knorm_shape[0], nh = knorm_shape[1], cap = knorm_shape[2];
    const int nsplit = (int)(VX_NBLOCKS / (unsigned int)(nb * nh));
    const size_t bh = VX_BID / nsplit;
    const int split = VX_BID % nsplit;
    const int n = held[bh];  // the stored tokens: the first n of the row's cap rows
    const int span = (n + nsplit - 1) / nsplit;
    const int start = split * span;
    const int len = n - start >= span ? span : (n - start > 0 ? n - start : 0);
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    VX_SHARED float lg[G * SPLIT];
    VX_SHARED float red[G * NT];
    SHARED
    // the G queries times the scale (float32, rounded as MLX rounds queries * scale), in red
    for (int i = (int)tid; i < G * HEAD_DIM; i += NT)
        red[i] = VX_FMUL_RN(static_cast<float>(qry[bh * (G * HEAD_DIM) + i]), params[2]);
    VX_BARRIER;
    LOAD
    VX_BARRIER;
    // phase 1: a thread per stored token, the G logits from its codes
    for (int t = (int)tid; t < len; t += NT) {
        const size_t row = bh * cap + start + t;
        float lgt[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) lgt[j] = 0.0f;
        LOGITS
        #pragma unroll
        for (int j = 0; j < G; ++j) lg[j * SPLIT + t] = lgt[j];
        SIDE
    }
    VX_BARRIER;
    // phase 2: each head's maximum, then exponentials and their sum, over the split
    float mh[G], lh[G];
    #pragma unroll
    for (int j = 0; j < G; ++j) {
        float m = -inf;
        for (int t = (int)tid; t < len; t += NT) m = fmaxf(m, lg[j * SPLIT + t]);
        red[j * NT + tid] = m;
    }
    VX_BARRIER;
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w)
            for (int j = 0; j < G; ++j) red[j * NT + tid] = fmaxf(red[j * NT + tid], red[j * NT + tid + w]);
        VX_BARRIER;
    }
    #pragma unroll
    for (int j = 0; j < G; ++j) mh[j] = red[j * NT];
    VX_BARRIER;
    #pragma unroll
    for (int j = 0; j < G; ++j) {
        float s = 0.0f;
        for (int t = (int)tid; t < len; t += NT) {
            const float p = expf(lg[j * SPLIT + t] - mh[j]);
            lg[j * SPLIT + t] = p;
            s += p;
        }
        red[j * NT + tid] = s;
    }
    VX_BARRIER;
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w)
            for (int j = 0; j < G; ++j) red[j * NT + tid] += red[j * NT + tid + w];
        VX_BARRIER;
    }
    #pragma unroll
    for (int j = 0; j < G; ++j) lh[j] = red[j * NT];
    VX_BARRIER;
    // phase 3: a thread per value coordinate (PARTS per coordinate), weights times values
    constexpr int PARTS = NT / HEAD_DIM;
    const int c = (int)tid % HEAD_DIM, part = (int)tid / HEAD_DIM;
    float acc[G];
    #pragma unroll
    for (int j = 0; j < G; ++j) acc[j] = 0.0f;
    #pragma unroll 4
    for (int t = part; t < len; t += PARTS) {
        const size_t row = bh * cap + start + t;
        VALUE
        #pragma unroll
        for (int j = 0; j < G; ++j) acc[j] += lg[j * SPLIT + t] * v;
    }
    if (PARTS > 1) {
        #pragma unroll
        for (int j = 0; j < G; ++j) red[j * NT + tid] = acc[j];
        VX_BARRIER;
        if (part == 0)
            for (int j = 0; j < G; ++j)
                for (int p = 1; p < PARTS; ++p) acc[j] += red[j * NT + p * HEAD_DIM + c];
    }
    const size_t o = bh * nsplit + split;
    if (part == 0)
        for (int j = 0; j < G; ++j) pa[(o * G + j) * HEAD_DIM + c] = acc[j];
    if (tid == 0)
        for (int j = 0; j < G; ++j) {
            pm[o * G + j] = mh[j];
            pl[o * G + j] = lh[j];
        }
"""

# TurboQuant's MSE stage: the rotated query, the centroids (and RVQ's second codebook).
_MSE_SHARED = """VX_SHARED VX_ALIGN16 float q_s[G * HEAD_DIM];
    VX_SHARED float c_s[1 << BITS];"""
_RVQ_SHARED = "VX_SHARED float r_s[1 << BITS];"
_QJL_SHARED = "VX_SHARED VX_ALIGN16 float s_s[G * SIGN_WORDS * 32];"
# The queries rotated (q R^T: coordinate c is row c of R dotted with q) and projected (S q,
# the sketch's zero padding rows giving zeros), once per block, from the scaled queries in red:
# a thread per row of R (of S), which it reads once for the G queries.
_MSE_LOAD = """for (int c = (int)tid; c < HEAD_DIM; c += NT) {
        VX_PTR(const float*) rr = rot + (size_t)c * HEAD_DIM;
        float a[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) a[j] = 0.0f;
        #pragma unroll 4
        for (int k = 0; k < HEAD_DIM; ++k) {
            const float r = rr[k];
            #pragma unroll
            for (int j = 0; j < G; ++j) a[j] += r * red[j * HEAD_DIM + k];
        }
        #pragma unroll
        for (int j = 0; j < G; ++j) q_s[j * HEAD_DIM + c] = a[j];
    }
    for (int i = (int)tid; i < (1 << BITS); i += NT) c_s[i] = cent[i];"""
_RVQ_LOAD = "for (int i = (int)tid; i < (1 << BITS); i += NT) r_s[i] = rcent[i];"
_QJL_LOAD = """for (int p = (int)tid; p < SIGN_WORDS * 32; p += NT) {
        VX_PTR(const float*) sr = sk + (size_t)p * HEAD_DIM;
        float a[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) a[j] = 0.0f;
        #pragma unroll 4
        for (int k = 0; k < HEAD_DIM; ++k) {
            const float r = sr[k];
            #pragma unroll
            for (int j = 0; j < G; ++j) a[j] += r * red[j * HEAD_DIM + k];
        }
        #pragma unroll
        for (int j = 0; j < G; ++j) s_s[j * (SIGN_WORDS * 32) + p] = a[j];
    }"""

# Coordinate c's index sits at bit c * BITS of the row's little-endian word stream (the layout
# of velox.quant.pack for every bits), spilling into the next word where it crosses one.
_UNPACK = """{
            constexpr int WORDS = HEAD_DIM * BITS / 32;
            unsigned int wd[WORDS];
            #pragma unroll
            for (int k = 0; k < WORDS; ++k) wd[k] = SRC[row * WORDS + k];
            #pragma unroll
            for (int c = 0; c < HEAD_DIM; ++c) {
                const int bit = c * BITS, wi = bit >> 5, sh = bit & 31;
                unsigned int v = wd[wi] >> sh;
                if (sh + BITS > 32) v |= wd[wi + 1] << (32 - sh);
                const float cv = TABLE[v & ((1u << BITS) - 1u)];
                #pragma unroll
                for (int j = 0; j < G; ++j) ACC[j] += q_s[j * HEAD_DIM + c] * cv;
            }
        }"""

_MSE_LOGITS = """float a[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) a[j] = 0.0f;
        """ + _UNPACK.replace("SRC", "idx").replace("TABLE", "c_s").replace("ACC", "a") + """
        const float ks = VX_FMUL_RN(static_cast<float>(knorm[row]), params[0]);
        #pragma unroll
        for (int j = 0; j < G; ++j) lgt[j] = VX_FMUL_RN(a[j], ks);"""

_RVQ_LOGITS = """float a[G], a2[G];
        #pragma unroll
        for (int j = 0; j < G; ++j) { a[j] = 0.0f; a2[j] = 0.0f; }
        """ + _UNPACK.replace("SRC", "idx").replace("TABLE", "c_s").replace("ACC", "a") + """
        """ + _UNPACK.replace("SRC", "ridx").replace("TABLE", "r_s").replace("ACC", "a2") + """
        const float ks = VX_FMUL_RN(static_cast<float>(knorm[row]), params[0]);
        const float gn = static_cast<float>(gain[row]);
        #pragma unroll
        for (int j = 0; j < G; ++j) lgt[j] = VX_FMUL_RN(a[j] + gn * a2[j], ks);"""

# QJL's estimate: sum over the sketch rows of +-(S q)_i by sign bit i, times sqrt(pi/2) / m
# (params[1]) and the norm NORM (the key's for qjl, the residual's for prod).
_QJL_LOGITS = """{
            float sg[G];
            #pragma unroll
            for (int j = 0; j < G; ++j) sg[j] = 0.0f;
            #pragma unroll
            for (int k = 0; k < SIGN_WORDS; ++k) {
                const unsigned int sw = signs[row * SIGN_WORDS + k];
                #pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const bool on = (sw >> i) & 1u;
                    #pragma unroll
                    for (int j = 0; j < G; ++j) {
                        const float x = s_s[(j * SIGN_WORDS + k) * 32 + i];
                        sg[j] += on ? x : -x;
                    }
                }
            }
            const float qf = VX_FMUL_RN(params[1], static_cast<float>(NORM[row]));
            #pragma unroll
            for (int j = 0; j < G; ++j) lgt[j] = lgt[j] + VX_FMUL_RN(sg[j], qf);
        }"""

# Values: 8-bit codes (4 to a uint32 word, code c in bits 8 (c % 4)), q * scale + zero with
# each operation rounded as MLX's dequantize rounds it; or the exact rows.
_INT8_SHARED = "VX_SHARED float vsc[SPLIT], vze[SPLIT];"
_INT8_SIDE = """vsc[t] = static_cast<float>(vs[row]);
        vze[t] = static_cast<float>(vz[row]);"""
_INT8_VALUE = """const float v = VX_FADD_RN(VX_FMUL_RN((float)((vq[row * (HEAD_DIM / 4) + (c >> 2)] >> ((c & 3) * 8)) & 255u), vsc[t]), vze[t]);"""
_EXACT_VALUE = "const float v = static_cast<float>(vr[row * HEAD_DIM + c]);"

# One block per (batch row, kv head, query head) of MT threads, MT / HEAD_DIM parts of HEAD_DIM
# (a thread per output coordinate in each): the new token's logit (a block sum), the largest
# logit over it and the splits, then each part merging every (MT / HEAD_DIM)-th split (loads of
# several splits in flight), the parts' sums added in order, and the new token.
_MERGE_BODY = """
    const unsigned int tid = VX_TID;
    constexpr int PARTS = MT / HEAD_DIM;
    const int c = (int)tid % HEAD_DIM, part = (int)tid / HEAD_DIM;
    const size_t bh = VX_BID / G;
    const int j = VX_BID % G;
    const int ns = pm_shape[2];
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    VX_SHARED float red[MT];
    VX_SHARED float tots[PARTS];
    red[tid] = part == 0 ? VX_FMUL_RN(static_cast<float>(qry[(bh * G + j) * HEAD_DIM + c]), params[2])
                           * static_cast<float>(kn[bh * HEAD_DIM + c]) : 0.0f;
    VX_BARRIER;
    for (int w = HEAD_DIM / 2; w > 0; w >>= 1) {
        if ((int)tid < w) red[tid] += red[tid + w];
        VX_BARRIER;
    }
    const float ln = red[0];
    VX_BARRIER;
    float m = tid == 0 ? ln : -inf;
    for (int s = (int)tid; s < ns; s += MT) m = fmaxf(m, pm[(bh * ns + s) * G + j]);
    red[tid] = m;
    VX_BARRIER;
    for (int w = MT / 2; w > 0; w >>= 1) {
        if ((int)tid < w) red[tid] = fmaxf(red[tid], red[tid + w]);
        VX_BARRIER;
    }
    m = red[0];
    VX_BARRIER;
    float tot = 0.0f, acc = 0.0f;
    #pragma unroll 4
    for (int s = part; s < ns; s += PARTS) {
        const size_t o = (bh * ns + s) * G + j;
        const float f = expf(pm[o] - m);
        tot += f * pl[o];
        acc += f * pa[o * HEAD_DIM + c];
    }
    red[tid] = acc;
    if (c == 0) tots[part] = tot;
    VX_BARRIER;
    if (part == 0) {
        const float e = expf(ln - m);
        float t = e, a = e * static_cast<float>(vn[bh * HEAD_DIM + c]);
        for (int p = 0; p < PARTS; ++p) {
            t += tots[p];
            a += red[p * HEAD_DIM + c];
        }
        velox_put(out + (bh * G + j) * HEAD_DIM + c, a / t);
    }
"""

_CODEC_INPUTS = {
    "mse": ["qry", "rot", "cent", "idx", "knorm"],
    "rvq": ["qry", "rot", "cent", "rcent", "idx", "ridx", "knorm", "gain"],
    "prod": ["qry", "rot", "sk", "cent", "idx", "knorm", "signs", "rnorm"],
    "qjl": ["qry", "sk", "knorm", "signs"],
}
_VALUE_INPUTS = {"int8": ["vq", "vs", "vz"], "exact": ["vr"]}


@lru_cache(maxsize=None)
def split_spec(codec: str, values: str, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (or ``metal_kernel``: ``dialect``) arguments of the split kernel for ``codec`` (``mse``,
    ``rvq``, ``prod``, ``qjl``) and ``values`` (``int8``, ``exact``). Template values:
    ``HEAD_DIM``, ``G``, ``SPLIT``, and ``BITS`` (the MSE stage's) and / or ``SIGN_WORDS``."""
    if codec not in _CODEC_INPUTS or values not in _VALUE_INPUTS:
        raise ValueError(f"unknown split kernel variant: codec={codec!r}, values={values!r}")
    mse, qjl = codec != "qjl", codec in ("prod", "qjl")
    shared = ([_MSE_SHARED] if mse else []) + ([_RVQ_SHARED] if codec == "rvq" else []) \
        + ([_QJL_SHARED] if qjl else []) + ([_INT8_SHARED] if values == "int8" else [])
    load = ([_MSE_LOAD] if mse else []) + ([_RVQ_LOAD] if codec == "rvq" else []) \
        + ([_QJL_LOAD] if qjl else [])
    logits = {"mse": _MSE_LOGITS, "rvq": _RVQ_LOGITS, "prod": _MSE_LOGITS, "qjl": ""}[codec]
    if qjl:
        logits += "\n        " + _QJL_LOGITS.replace("NORM", "rnorm" if codec == "prod" else "knorm")
    src = (re.sub(r"\bSHARED\b", "\n    ".join(shared), _SPLIT_BODY).replace("LOAD", "\n    ".join(load))
           .replace("LOGITS", logits)
           .replace("SIDE", _INT8_SIDE if values == "int8" else "")
           .replace("VALUE", _INT8_VALUE if values == "int8" else _EXACT_VALUE))
    src = re.sub(r"\bNT\b", str(THREADS), src)
    return make_spec(name=f"velox_codec_split_{codec}_{values}",
                     input_names=_CODEC_INPUTS[codec] + _VALUE_INPUTS[values] + ["params", "held"],
                     output_names=["pm", "pl", "pa"], source=src, header=_HEADER, dialect=dialect)


@lru_cache(maxsize=None)
def merge_spec(*, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (or ``metal_kernel``: ``dialect``) arguments of the merge
    kernel (template ``HEAD_DIM``, ``G``)."""
    return make_spec(name="velox_codec_merge", input_names=["qry", "kn", "vn", "pm", "pl", "pa", "params"],
                     output_names=["out"], source=re.sub(r"\bMT\b", str(MERGE_THREADS), _MERGE_BODY),
                     header=_HEADER, dialect=dialect)


@lru_cache(maxsize=None)
def _kernel(codec: str | None, values: str | None, dialect: str = CUDA):
    spec = merge_spec(dialect=dialect) if codec is None else split_spec(codec, values, dialect=dialect)
    return build(spec, dialect)


def _run_kernel(codec, values, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch (``codec`` None: the merge kernel), in the dialect of this process's GPU.
    The tests replace it by an emulation."""
    return _kernel(codec, values, active())(inputs=inputs, grid=grid, threadgroup=threadgroup,
                                            output_shapes=output_shapes, output_dtypes=output_dtypes,
                                            template=template)


class _Layout(NamedTuple):
    codec: str       # kernel variant: mse, rvq, prod, qjl
    values: str      # int8, exact
    bits: int        # the MSE stage's bits (0 for qjl)
    sign_words: int  # uint32 words of sign bits per token (0 for mse, rvq)
    groups: int
    head_dim: int
    split: int       # most stored tokens one split block holds


def split_size(groups: int) -> int:
    """Most tokens one split block holds: ``2048 / groups`` rounded down to a power of two,
    at most 512 (its logits take 8 KiB of shared memory)."""
    return max(32, min(512, 1 << (2048 // groups).bit_length() - 1))


def shared_bytes(lay: _Layout) -> int:
    """Static shared memory of a split block."""
    g, d, sp = lay.groups, lay.head_dim, lay.split
    floats = g * sp + g * THREADS
    if lay.codec != "qjl":
        floats += g * d + (2 << lay.bits if lay.codec == "rvq" else 1 << lay.bits)
    if lay.sign_words:
        floats += g * 32 * lay.sign_words
    if lay.values == "int8":
        floats += 2 * sp
    return 4 * floats


_ROW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _layout(state, queries) -> _Layout | None:
    """The kernel layout of ``state`` and ``queries``, or None where the kernels do not apply."""
    from velox import codec_cache
    from velox.codecs import prod, qjl, turboquant as tq
    try:
        name = codec_cache.codec_of(state).name
    except (KeyError, AttributeError, TypeError):
        return None
    codec = CODECS.get(name)
    if codec is None or getattr(state, "n_outlier", 0):
        return None  # another codec, or keys split into outlier channels and the rest
    kinds = {"mse": (tq.TurboQuantTables, tq.MseCodes), "rvq": (tq.RvqTables, tq.RvqCodes),
             "prod": (prod.TurboQuantProdTables, prod.TurboQuantProdCodes),
             "qjl": (qjl.QJLTables, qjl.QJLCodes)}[codec]
    t, kc, vc = state.tables, state.key_codes, state.value_codes
    if type(t) is not kinds[0] or type(kc) is not kinds[1]:
        return None  # another codes layout (e.g. with outlier channels): the MLX path
    if not isinstance(queries, mx.array) or queries.ndim != 4 or queries.shape[2] != 1:
        return None
    if queries.dtype not in _ROW_DTYPES:
        return None
    b, hq, _, d = queries.shape
    bs, h = state.next_pos.shape
    if d not in HEAD_DIMS or bs != b or h == 0 or hq % h or not 1 <= hq // h <= MAX_GROUPS:
        return None
    g = hq // h
    if codec_cache.dims(state)[2] != d:
        return None
    bits = sign_words = 0
    if codec != "qjl":
        bits = t.bits - 1 if codec == "prod" else t.bits
        if t.head_dim != d or t.padded != d or not 1 <= bits <= 8:
            return None
        streams = [kc.idx] + ([kc.res_idx] if codec == "rvq" else [])
        if any(x.dtype != mx.uint32 or x.shape[-1] != d * bits // 32 for x in streams):
            return None
        if t.centroids.shape != (1 << bits,) or t.centroids.dtype != mx.float32:
            return None
        if codec == "rvq" and (t.res_centroids.shape != (1 << bits,) or kc.gain.dtype != mx.float16):
            return None
        if kc.norm.dtype != mx.float16:
            return None
    if codec in ("prod", "qjl"):
        sign_words = kc.signs.shape[-1]
        norm = kc.res_norm if codec == "prod" else kc.norms
        if kc.signs.dtype != mx.uint32 or t.sketch.shape != (32 * sign_words, d) \
                or norm.dtype != mx.float16 or not 0 < t.jl_dim <= 32 * sign_words:
            return None
    kind = codec_cache.value_codec(state)
    if kind == "affine" and isinstance(vc, codec_cache.Int8Rows):
        values = "int8"
        if codec_cache.value_bits(state) != 8 or vc.codes.dtype != mx.uint32 or vc.codes.shape[-1] != d // 4 \
                or vc.scales.shape[-1] != 1 or vc.scales.dtype not in _ROW_DTYPES \
                or vc.zeros.dtype != vc.scales.dtype:
            return None
    elif kind == "exact" and isinstance(vc, codec_cache.ExactRows):
        values = "exact"
        if vc.rows.shape[-1] != d or vc.rows.dtype not in _ROW_DTYPES:
            return None
    else:
        return None  # values of another codec or width (mse codes, affine below 8 bits): MLX
    lay = _Layout(codec, values, bits, sign_words, g, d, split_size(g))
    return lay if shared_bytes(lay) <= SHARED_LIMITS[active()] else None


def supports(state, queries) -> bool:
    """Whether :func:`decode_attend` takes ``state`` and ``queries`` (else use the MLX path):
    a TurboQuant (mse, rvq, prod) or QJL state with its own codes record and 8-bit affine or
    exact values (``value_codec`` ``"affine"`` at ``value_bits = 8``, or ``"exact"``: not the
    mse value codes, nor affine codes of another width), one query token, head_dim 64 or 128, at most 32 query heads per kv head, float16,
    bfloat16 or float32 queries, on a CUDA device or an Apple GPU whose Metal kernels passed the
    self-check (``velox.backend.gpu_kernels``)."""
    from velox.backend import gpu_kernels
    return gpu_kernels() and _layout(state, queries) is not None


@lru_cache(maxsize=None)
def _params(head_dim: int, jl_dim: int, scale: float) -> mx.array:
    """``[1 / sqrt(d), sqrt(pi/2) / m, scale]`` as float32, as the codecs and ``attend`` round
    them (one cached device array per setting)."""
    return mx.array([1.0 / math.sqrt(head_dim), math.sqrt(math.pi / 2) / jl_dim if jl_dim else 0.0,
                     scale], mx.float32)


def plan_splits(batch: int, kv_heads: int, n: int, split: int) -> int:
    """Split blocks per (batch row, kv head) for ``n`` stored tokens: about
    :data:`TARGET_BLOCKS` blocks in all, each of ``MIN_SPAN`` to ``split`` tokens."""
    span = min(split, max(MIN_SPAN, -(-batch * kv_heads * n // TARGET_BLOCKS)))
    return -(-n // span)


def decode_attend(state, queries, keys, values, *, scale: float, held=None):
    """``velox.codec_cache.attend(state, queries, keys, values, scale=scale)`` for one query
    token (``queries [b, hq, 1, d]``, the step's ``keys`` / ``values [b, h, 1, d]``), by the
    kernels: ``[b, hq, 1, d]`` in the queries' dtype, equal to ``attend`` within
    :data:`TOLERANCE`. Refuses (``ValueError``) what :func:`supports` would not take (the
    device aside).

    The kernels read the first ``held`` rows of the state's arrays in place (the rows after
    them, empty rows of chunked storage, are never read): ``held`` an int, or int32 ``[b, h]``
    counts (data: the splits are then planned over every row of the arrays); default the
    state's own (``velox.codec_cache.held_rows``)."""
    from velox import codec_cache
    lay = _layout(state, queries)
    if lay is None:
        raise ValueError("decode_attend does not take this state and queries (see supports)")
    b, _, _, d = queries.shape
    h, g = state.next_pos.shape[1], lay.groups
    check_step(queries, keys, values, h)
    t, kc, vc = state.tables, state.key_codes, state.value_codes
    if held is None:
        held = codec_cache.held_rows(state)
    if isinstance(held, int):
        n = held  # the splits cover the held rows only
        held = mx.full((b, h), n, mx.int32)
    else:
        n = vc[0].shape[2]
    if n == 0:
        return new_token_alone(queries, values)
    jl = t.jl_dim if lay.codec in ("prod", "qjl") else 0
    params = _params(d, jl, float(scale))
    ins = {"params": params, "qry": queries, "held": held.astype(mx.int32)}
    if lay.codec != "qjl":
        ins.update(rot=t.rotation, cent=t.centroids, idx=kc.idx, knorm=kc.norm)
    if lay.codec == "rvq":
        ins.update(rcent=t.res_centroids, ridx=kc.res_idx, gain=kc.gain)
    if lay.codec == "prod":
        ins.update(sk=t.sketch, signs=kc.signs, rnorm=kc.res_norm)
    if lay.codec == "qjl":
        ins.update(sk=t.sketch, signs=kc.signs, knorm=kc.norms)
    if lay.values == "int8":
        ins.update(vq=vc.codes, vs=vc.scales, vz=vc.zeros)
    else:
        ins.update(vr=vc.rows)
    spec = split_spec(lay.codec, lay.values)
    nsplit = plan_splits(b, h, n, lay.split)
    template = [("HEAD_DIM", d), ("G", g), ("SPLIT", lay.split)]
    if lay.bits:
        template.append(("BITS", lay.bits))
    if lay.sign_words:
        template.append(("SIGN_WORDS", lay.sign_words))
    return split_then_merge(_run_kernel, (lay.codec, lay.values), [ins[k] for k in spec["input_names"]],
                            nsplit, template, queries, keys, values, params)


def check_step(queries, keys, values, kv_heads: int) -> None:
    """A decode step's new ``keys`` and ``values`` are ``[b, kv_heads, 1, d]`` for ``queries
    [b, hq, 1, d]``; else ``ValueError``."""
    b, _, _, d = queries.shape
    if keys.shape != (b, kv_heads, 1, d) or values.shape != (b, kv_heads, 1, d):
        raise ValueError(f"keys and values must be [{b}, {kv_heads}, 1, {d}], got {keys.shape}, "
                         f"{values.shape}")


def new_token_alone(queries, values):
    """The output of a step over no stored token: the new token's value, weight 1."""
    b, hq, _, d = queries.shape
    h = values.shape[1]
    out = mx.broadcast_to(values.astype(mx.float32), (b, h, hq // h, d))
    return out.reshape(b, hq, 1, d).astype(queries.dtype)


def split_then_merge(run, variant: tuple, inputs: list, nsplit: int, template: list, queries, keys,
                     values, params):
    """The two launches of a decode step: ``run(*variant, inputs, ...)`` (a split kernel, one
    block per (batch row, kv head, split), writing each split's max, sum and weighted values)
    and the merge kernel with the new token. ``run`` is the caller's launcher (the tests
    replace it by an emulation)."""
    b, hq, _, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    pm, pl, pa = run(*variant, inputs, (b * h * nsplit * THREADS, 1, 1), (THREADS, 1, 1),
                     [(b, h, nsplit, g), (b, h, nsplit, g), (b, h, nsplit, g, d)], [mx.float32] * 3,
                     template)
    return merge(run, queries, keys, values, pm, pl, pa, params)


def merge(run, queries, keys, values, pm, pl, pa, params):
    """The merge kernel's launch (through ``run``, the caller's launcher): the splits' ``(max,
    sum, weighted values)`` and the new token combined into ``[b, hq, 1, d]``."""
    b, hq, _, d = queries.shape
    h = keys.shape[1]
    g = hq // h
    (out,) = run(None, None, [queries, keys, values, pm, pl, pa, params],
                 (b * h * g * MERGE_THREADS, 1, 1), (MERGE_THREADS, 1, 1), [(b, h, g, d)],
                 [queries.dtype], [("HEAD_DIM", d), ("G", g)])
    return out.reshape(b, hq, 1, d)

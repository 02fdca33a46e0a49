"""A CUDA decode step of KIVI over its packed codes (``mx.fast.cuda_kernel``): flash-decoding
over the quantized keys and values, the exact residual window and the new token, and the
step's update of the residual window, in two launches.

KIVI's state (``velox.methods.kivi``): ``Q`` quantized tokens, keys per channel in groups of
``group_size`` tokens stored transposed (``key_codes [b, h, d, Q * bits / 32]``, scales and
zeros ``[b, h, d, Q / group_size]``), values per token in groups of ``group_size`` channels
(``value_codes [b, h, Q, d * bits / 32]``, scales and zeros ``[b, h, Q, d / group_size]``),
codes packed little-endian in MLX's affine layout (``velox.quant.pack``: code ``i`` of a row at
bit ``i * bits`` of its word stream); then the exact residual window ``residual_keys /
residual_values [b, h, r, d]``.

One query token per sequence (``s == 1``), the ``g`` query heads of a kv head in the same block,
so each stored code is read once. A step is two launches:

* ``split``: a block per (batch row, kv head, split) of ``velox.kernels.codec.THREADS`` (128)
  threads. The first splits cover the quantized tokens in spans of whole tiles (the ``32 *
  32 / bits`` tokens of 32 words of a key channel) where shared memory allows; the last
  ones the residual window. Phase 1, the logits: a quantized key tile is read a word per
  lane (lane ``l`` decodes the ``32 / bits`` tokens of word ``l`` of a channel, times the
  group's scale plus its zero), the four warps taking every fourth channel, eight channels'
  words in flight per lane; the warps' partial logits are added in warp order. Residual
  rows: ``head_dim / 8`` lanes a row, 16-byte loads. Phase 2, per head (a warp each): the
  split's maximum, exponentials and their sum. Phase 3, the exponentials times the values:
  a quantized value row is read a word per lane (``head_dim * bits / 32`` lanes a row),
  eight rows in flight per lane, the lanes of a word added by warp shuffles and the warps
  in order. It writes each split's ``(max, sum, weighted values)``, float32. Its appending
  variant (:func:`decode_step`) also writes the residual window with the step's token
  appended, in the residual's dtype (the residual splits copy the rows they read), and
  ``next_pos + 1``: a decode step's whole update but the flush of a group every
  ``group_size`` steps.
* ``merge``: ``velox.kernels.codec``'s merge kernel: the new token's exact logit, then every
  split and the new token combined into the output, in the queries' dtype.

The split arithmetic (spans, template, output shapes) is computed once per shape of the
state and queries (:func:`_plan`; a model's layers share it).

Arithmetic: the queries are scaled in float32, the codes decoded as ``q * scale + zero`` in
float32 and everything summed in float32: the result is ``attend`` evaluated in float32
(``attend(state, queries.astype(float32), keys.astype(float32), values.astype(float32))`` then
rounded to the queries' dtype), equal to it within :data:`TOLERANCE`. For float32 queries that
is ``attend`` itself. For float16 and bfloat16 queries ``attend``'s MLX path also rounds the
scaled queries, the logits and the weights to the queries' dtype, so the two differ by that
rounding as well (:data:`HALF_TOLERANCE`).

:func:`supports` says which states and queries the kernels take: bits 2, 4 or 8 (whole codes
per word; 3-bit states take the MLX path), group_size 32, 64 or 128 dividing head_dim 64 or
128, ``g <= 32``, float16 / bfloat16 / float32 queries, float16 / bfloat16 scales and zeros,
float16 / bfloat16 / float32 residual rows, one query token, a CUDA device; anything else goes
to the MLX path. ``velox.kernels.nvrtc`` compiles every variant's source without a GPU, and
the tests run the sources on the CPU through an emulation (``tests/test_kivi_kernel.py``).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

import mlx.core as mx

from . import build
from .dialect import CUDA, METAL, SHARED_LIMITS, active, make_spec
from . import codec as ck
from . import evict as ev

__all__ = ["supports", "step_plan", "decode_attend", "decode_step", "split_spec", "TOLERANCE", "HALF_TOLERANCE", "BITS",
           "GROUP_SIZES", "HEAD_DIMS", "MAX_GROUPS"]

#: Bits the kernels take (whole codes per 32-bit word; 3-bit states take the MLX path).
BITS = (2, 4, 8)
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

# One block of NT (128) threads per (batch row, kv head, split): the quantized tokens in splits
# of qspan tokens (cfg[0], a multiple of TILE), then the residual rows in splits of rspan rows
# (cfg[1]). The G queries times the scale go to q_s; lg holds the split's G logits (then their
# exponentials); part the warps' partial logits or partial outputs, summed in warp order.
_STEP = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    constexpr int NW = NT / 32;
    constexpr int TPW = 32 / BITS;                       // codes per 32-bit word
    constexpr int TILE = 32 * TPW;                       // tokens in 32 words of a key channel
    constexpr int GP = 32 / TPW < G ? 32 / TPW : G;      // query heads per pass over codes
    constexpr int VW = HEAD_DIM * BITS / 32;             // words of a value row
    constexpr int VG = HEAD_DIM / GS;                    // channel groups of a value row
    constexpr int LR = HEAD_DIM / 8;                     // lanes per residual row, 8 elements each
    constexpr int GR = G < 4 ? G : 4;                    // query heads per pass over residual values
    constexpr unsigned int CODE = (1u << BITS) - 1u;
    constexpr int CU = 8;                                // key channels in flight per lane
    constexpr int RU = 8;                                // value rows in flight per lane
    static_assert(32 % BITS == 0 && VW <= 32 && LR <= 32 && TILE % GS == 0, "layout");
    const int nb = qry_shape[0], nh = qry_shape[1] / G;
    const int nq = QUANT ? vc_shape[2] : 0, nr = RESID ? rk_shape[2] : 0;
    const int qspan = cfg[0], rspan = cfg[1];
    const int nqs = QUANT ? (nq + qspan - 1) / qspan : 0;
    const int nsplit = (int)(VX_NBLOCKS / (unsigned int)(nb * nh));
    const size_t bh = VX_BID / nsplit;
    const int split = VX_BID % nsplit;
    const bool quant = split < nqs;
    const int span = quant ? qspan : rspan;
    const int start = (quant ? split : split - nqs) * span;
    const int n = quant ? nq : nr;
    const int len = n - start >= span ? span : (n - start > 0 ? n - start : 0);
    const size_t o = bh * nsplit + split;
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    VX_SHARED float q_s[G * HEAD_DIM];
    VX_SHARED float lg[G * SPLIT];
    VX_SHARED float part[NW * 1024];
    for (int i = (int)tid; i < G * HEAD_DIM; i += NT)
        q_s[i] = VX_FMUL_RN(static_cast<float>(qry[bh * (G * HEAD_DIM) + i]), params[2]);
    VX_BARRIER;
    // phase 1, the logits. Quantized keys (channel-major words): a tile of TILE tokens at a
    // time, lane l decoding word l of each channel (TPW tokens), the warps taking every NW-th
    // channel; their partial logits summed in warp order.
    if (quant) {
        const int kw = nq / TPW, ng = nq / GS;
        for (int j0 = 0; j0 < G; j0 += GP) {
            for (int t0 = 0; t0 < len; t0 += TILE) {
                const int tl = t0 + (int)lane * TPW;
                float acc[GP][TPW];
                #pragma unroll
                for (int j = 0; j < GP; ++j)
                    #pragma unroll
                    for (int u = 0; u < TPW; ++u) acc[j][u] = 0.0f;
                if (tl < len) {
                    const int tok = start + tl;
                    VX_PTR(const unsigned int*) kr = kc + bh * HEAD_DIM * (size_t)kw + tok / TPW;
                    const size_t side = bh * HEAD_DIM * (size_t)ng + tok / GS;
                    // CU channels' words, scales and zeros loaded before any is used
                    for (int c0 = (int)warp; c0 < HEAD_DIM; c0 += NW * CU) {
                        unsigned int wk[CU];
                        float sk[CU], zk[CU];
                        #pragma unroll
                        for (int i = 0; i < CU; ++i) {
                            const int ch = c0 + i * NW;
                            wk[i] = ch < HEAD_DIM ? kr[(size_t)ch * kw] : 0u;
                            sk[i] = ch < HEAD_DIM ? static_cast<float>(ks[side + (size_t)ch * ng]) : 0.0f;
                            zk[i] = ch < HEAD_DIM ? static_cast<float>(kz[side + (size_t)ch * ng]) : 0.0f;
                        }
                        #pragma unroll
                        for (int i = 0; i < CU; ++i) {
                            const int ch = c0 + i * NW;
                            if (ch < HEAD_DIM) {
                                #pragma unroll
                                for (int u = 0; u < TPW; ++u) {
                                    const float k = VX_FADD_RN(VX_FMUL_RN((float)((wk[i] >> (u * BITS)) & CODE), sk[i]), zk[i]);
                                    #pragma unroll
                                    for (int j = 0; j < GP; ++j)
                                        if (j0 + j < G) acc[j][u] += q_s[(j0 + j) * HEAD_DIM + ch] * k;
                                }
                            }
                        }
                    }
                }
                #pragma unroll
                for (int j = 0; j < GP; ++j)
                    #pragma unroll
                    for (int u = 0; u < TPW; ++u) part[(warp * GP + j) * TILE + lane * TPW + u] = acc[j][u];
                VX_BARRIER;
                for (int i = (int)tid; i < GP * TILE; i += NT) {
                    const int j = i / TILE, t = t0 + i % TILE;
                    if (j0 + j < G && t < len) {
                        float s = 0.0f;
                        for (int w = 0; w < NW; ++w) s += part[(w * GP + j) * TILE + i % TILE];
                        lg[(j0 + j) * SPLIT + t] = s;
                    }
                }
                VX_BARRIER;
            }
        }
    } else {
        // residual rows: LR lanes a row, 8 elements each (16-byte loads)
        const int li = (int)lane % LR, ri = (int)lane / LR;
        for (int t0 = (int)warp * (32 / LR); t0 < len; t0 += NW * (32 / LR)) {
            const int t = t0 + ri;
            float kr[8];
            if (t < len) {
                velox_row8<HEAD_DIM>(rk + (bh * nr + start + t) * HEAD_DIM, li * 8, kr);
                /*COPY_K*/
            } else {
                for (int i = 0; i < 8; ++i) kr[i] = 0.0f;
            }
            for (int j = 0; j < G; ++j) {
                float a = 0.0f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) a += q_s[j * HEAD_DIM + li * 8 + i] * kr[i];
                for (int off = LR / 2; off > 0; off >>= 1) a += VX_SHFL_XOR(a, off);
                if (t < len && li == 0) lg[j * SPLIT + t] = a;
            }
        }
    }
    VX_BARRIER;
    // phase 2: per head (a warp each), the split's maximum, exponentials and their sum
    for (int j = (int)warp; j < G; j += NW) {
        float m = -inf;
        for (int t = (int)lane; t < len; t += 32) m = fmaxf(m, lg[j * SPLIT + t]);
        m = velox_warp_max(m);
        float s = 0.0f;
        for (int t = (int)lane; t < len; t += 32) {
            const float p = expf(lg[j * SPLIT + t] - m);
            lg[j * SPLIT + t] = p;
            s += p;
        }
        s = velox_warp_sum(s);
        if (lane == 0) {
            pm[o * G + j] = m;
            pl[o * G + j] = s;
        }
    }
    VX_BARRIER;
    // phase 3, the exponentials times the values. Quantized values (token-major words): VW
    // lanes a row, lane l decoding word l (TPW coordinates).
    if (quant) {
        const int li = (int)lane % VW, ri = (int)lane / VW;
        for (int j0 = 0; j0 < G; j0 += GP) {
            float acc[GP][TPW];
            #pragma unroll
            for (int j = 0; j < GP; ++j)
                #pragma unroll
                for (int u = 0; u < TPW; ++u) acc[j][u] = 0.0f;
            // RU rows' words, scales and zeros loaded before any is used
            for (int t0 = (int)warp * (32 / VW); t0 < len; t0 += NW * (32 / VW) * RU) {
                unsigned int wv[RU];
                float sv[RU], zv[RU];
                #pragma unroll
                for (int r = 0; r < RU; ++r) {
                    const int t = t0 + r * NW * (32 / VW) + ri;
                    const size_t row = bh * nq + start + (t < len ? t : 0);
                    wv[r] = t < len ? vc[row * VW + li] : 0u;
                    sv[r] = t < len ? static_cast<float>(vs[row * VG + li * TPW / GS]) : 0.0f;
                    zv[r] = t < len ? static_cast<float>(vz[row * VG + li * TPW / GS]) : 0.0f;
                }
                #pragma unroll
                for (int r = 0; r < RU; ++r) {
                    const int t = t0 + r * NW * (32 / VW) + ri;
                    if (t < len) {
                        #pragma unroll
                        for (int u = 0; u < TPW; ++u) {
                            const float v = VX_FADD_RN(VX_FMUL_RN((float)((wv[r] >> (u * BITS)) & CODE), sv[r]), zv[r]);
                            #pragma unroll
                            for (int j = 0; j < GP; ++j)
                                if (j0 + j < G) acc[j][u] += lg[(j0 + j) * SPLIT + t] * v;
                        }
                    }
                }
            }
            velox_kivi_out<GP, TPW, VW, NT, HEAD_DIM>(acc, part, pa + (o * G + j0) * HEAD_DIM, G - j0, li, ri VX_TID_ARG);
        }
    } else {
        const int li = (int)lane % LR, ri = (int)lane / LR;
        for (int j0 = 0; j0 < G; j0 += GR) {
            float acc[GR][8];
            #pragma unroll
            for (int j = 0; j < GR; ++j)
                for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;
            for (int t0 = (int)warp * (32 / LR); t0 < len; t0 += NW * (32 / LR)) {
                const int t = t0 + ri;
                if (t < len) {
                    float vr[8];
                    velox_row8<HEAD_DIM>(rv + (bh * nr + start + t) * HEAD_DIM, li * 8, vr);
                    /*COPY_V*/
                    #pragma unroll
                    for (int j = 0; j < GR; ++j) {
                        const float p = j0 + j < G ? lg[(j0 + j) * SPLIT + t] : 0.0f;
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[j][i] += p * vr[i];
                    }
                }
            }
            velox_kivi_out<GR, 8, LR, NT, HEAD_DIM>(acc, part, pa + (o * G + j0) * HEAD_DIM, G - j0, li, ri VX_TID_ARG);
        }
    }
    /*NEW_ROW*/
"""

# With the residual window appended (``APPEND``): the residual splits copy the rows they read
# to rko / rvo (rows [0, nr)), the last split of a (batch row, kv head) writes the step's key
# and value as row nr, in the residual's dtype, and the first one next_pos + 1 to npo.
_COPY_K = ("if (APPEND) for (int i = 0; i < 8; ++i) "
           "velox_put(rko + (bh * (nr + 1) + start + t) * HEAD_DIM + li * 8 + i, kr[i]);")
_COPY_V = ("if (APPEND && j0 == 0) for (int i = 0; i < 8; ++i) "
           "velox_put(rvo + (bh * (nr + 1) + start + t) * HEAD_DIM + li * 8 + i, vr[i]);")
_NEW_ROW = """if (split == 0 && tid == 0) npo[bh] = next_pos[bh] + 1;
    if (split == nsplit - 1)
        for (int c = (int)tid; c < HEAD_DIM; c += NT) {
            velox_put(rko + (bh * (nr + 1) + nr) * HEAD_DIM + c, static_cast<float>(knew[bh * HEAD_DIM + c]));
            velox_put(rvo + (bh * (nr + 1) + nr) * HEAD_DIM + c, static_cast<float>(vnew[bh * HEAD_DIM + c]));
        }"""

# A pass's partial outputs: each lane's acc[P][E] (coordinates li * E to li * E + E - 1 of P
# query heads) summed over the lanes holding the same coordinates (lanes W apart), then over
# the NW warps in order through part; the first `heads` of the P heads written to out (a
# row of HEAD_DIM floats a head).
_OUT_HEADER = """
template <int P, int E, int W, int NT_, int HD>
VX_FN void velox_kivi_out(VX_THREAD float (&acc)[P][E], VX_GROUP float* part, VX_DEVICE float* out, int heads, int li, int ri VX_TID_PARAM) {
    constexpr int NW_ = NT_ / 32;
    const int tid = (int)VX_TID, warp = tid >> 5;
    for (int off = W; off < 32; off <<= 1) {
        #pragma unroll
        for (int j = 0; j < P; ++j)
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[j][e] += VX_SHFL_XOR(acc[j][e], off);
    }
    if (ri == 0)
        for (int j = 0; j < P; ++j)
            for (int e = 0; e < E; ++e) part[(warp * P + j) * HD + li * E + e] = acc[j][e];
    VX_BARRIER;
    for (int i = tid; i < P * HD; i += NT_) {
        const int j = i / HD;
        if (j < heads) {
            float s = 0.0f;
            for (int w = 0; w < NW_; ++w) s += part[(w * P + j) * HD + i % HD];
            out[j * HD + i % HD] = s;
        }
    }
    VX_BARRIER;
}
"""

_INPUTS = ["qry", "kc", "ks", "kz", "vc", "vs", "vz", "rk", "rv", "params", "cfg"]


@lru_cache(maxsize=None)
def split_spec(append: bool = False, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (or ``metal_kernel``: ``dialect``) arguments of the split kernel. Template values: ``HEAD_DIM``,
    ``G``, ``BITS``, ``GS`` (group_size), ``SPLIT`` (most tokens or rows a block holds, a
    multiple of 32), ``QUANT`` and ``RESID`` (1 where the step has quantized tokens, residual
    rows). ``append``: the variant that also writes the residual window with the step's token
    appended and the advanced positions (inputs ``knew``, ``vnew``, ``next_pos``; outputs
    ``rko``, ``rvo``, ``npo``)."""
    src = _STEP
    inputs, outputs = list(_INPUTS), ["pm", "pl", "pa"]
    if append:
        src = (src.replace("/*COPY_K*/", _COPY_K).replace("/*COPY_V*/", _COPY_V)
               .replace("/*NEW_ROW*/", _NEW_ROW).replace("(APPEND", "(true"))
        inputs += ["knew", "vnew", "next_pos"]
        outputs += ["rko", "rvo", "npo"]
    else:
        for marker in ("/*COPY_K*/", "/*COPY_V*/", "/*NEW_ROW*/"):
            src = src.replace(marker, "")
    name = "velox_kivi_step" if append else "velox_kivi_split"
    return make_spec(name=name, input_names=inputs, output_names=outputs,
                     source=re.sub(r"\bNT\b", str(THREADS), src), header=ev._HEADER + _OUT_HEADER,
                     dialect=dialect)


@lru_cache(maxsize=None)
def _kernel(append: bool, dialect: str = CUDA):
    return build(split_spec(append, dialect=dialect), dialect)


def _run_kernel(codec, values, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch (``codec`` ``"kivi"``: the split kernel, ``"kivi+append"`` its appending
    variant; None: the codec merge kernel), in the dialect of this process's GPU; the signature
    of ``velox.kernels.codec._run_kernel``. The tests replace it by an emulation."""
    dialect = active()
    kernel = ck._kernel(None, None, dialect) if codec is None else _kernel(codec == "kivi+append", dialect)
    return kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                  output_dtypes=output_dtypes, template=template)


class _Layout(NamedTuple):
    bits: int
    group_size: int
    groups: int
    head_dim: int
    split: int       # most stored tokens (or residual rows) one split block holds


def tile(bits: int) -> int:
    """Tokens of 32 words of one key channel (a warp's load): the quantized splits take whole
    tiles where their logits fit shared memory."""
    return 32 * (32 // bits)


def split_size(groups: int, head_dim: int = 128, dialect: str = CUDA) -> int:
    """Most tokens (or residual rows) one split block holds: a multiple of 32 whose
    ``groups * split`` logits fit 16 KiB of shared memory (128 at 32 query heads per kv head,
    4096 at one); on Metal (``dialect``) also within what the block's 32 KiB of threadgroup
    memory leaves beside its queries and partials (``head_dim``)."""
    size = max(32, 4096 // groups // 32 * 32)
    if dialect == METAL:
        room = SHARED_LIMITS[METAL] // 4 - THREADS // 32 * 1024 - groups * head_dim
        size = min(size, max(32, room // groups // 32 * 32))
    return size


def shared_bytes(lay: _Layout) -> int:
    """Static shared memory of a split block: scaled queries, logits, the warps' partials."""
    return 4 * (lay.groups * lay.head_dim + lay.groups * lay.split + THREADS // 32 * 1024)
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
    dialect = active()
    lay = _Layout(bits, gs, hq // h, d, split_size(hq // h, d, dialect))
    return lay if shared_bytes(lay) <= SHARED_LIMITS[dialect] else None


def plan_splits(batch: int, kv_heads: int, nq: int, nr: int, split: int, bits: int) -> tuple[int, int, int, int]:
    """``(quantized splits, residual splits, qspan, rspan)`` per (batch row, kv head): the
    quantized tokens in spans of whole tiles (:func:`tile`) of about ``batch * kv_heads * nq
    / velox.kernels.codec.TARGET_BLOCKS`` tokens, at most ``split`` (a multiple of 32); the
    residual rows in as few spans of at most ``split`` as hold them, as even as can be."""
    t = tile(bits)
    target = -(-batch * kv_heads * nq // ck.TARGET_BLOCKS)
    qspan = min(split, -(-max(target, 1) // t) * t)
    nqs = -(-nq // qspan) if nq else 0
    nrs = -(-nr // split) if nr else 0
    rspan = -(-nr // nrs) if nr else 1
    return nqs, nrs, qspan, rspan


@lru_cache(maxsize=None)
def _placeholder(dtype) -> mx.array:
    return mx.zeros((1,), dtype)


@lru_cache(maxsize=None)
def _cfg(qspan: int, rspan: int) -> mx.array:
    return mx.array([qspan, rspan], mx.int32)


class _Plan(NamedTuple):
    """Everything a step's two launches need but the arrays, for one shape of state and
    queries (:func:`_plan`)."""
    nq: int
    nr: int
    grid: tuple
    template: list
    shapes: list         # the split kernel's outputs (the appending variant's three more after)
    cfg: mx.array


_PLANS: dict = {}
PLANS_MAX = 256  # plans kept (a decode step's shapes change as the residual window grows)


def _plan(state, queries) -> _Plan | None:
    """The launch plan of ``state`` and ``queries`` (None where :func:`_layout` refuses
    them), computed once per shape of every array read and kept (a model's layers share it)."""
    try:
        arrays = (queries, state.key_codes, state.key_scales, state.key_zeros, state.value_codes,
                  state.value_scales, state.value_zeros, state.residual_keys,
                  state.residual_values, state.next_pos)
        key = (type(state), state.bits, state.group_size,
               *[(x.shape, x.dtype) if isinstance(x, mx.array) else None for x in arrays])
    except AttributeError:
        return None
    try:
        return _PLANS[key]
    except (KeyError, TypeError):
        pass
    lay = _layout(state, queries)
    plan = None
    if lay is not None:
        b, _, _, d = queries.shape
        h, g = state.next_pos.shape[1], lay.groups
        nq, nr = state.value_codes.shape[2], state.residual_keys.shape[2]
        nqs, nrs, qspan, rspan = plan_splits(b, h, nq, nr, lay.split, lay.bits)
        nsplit = nqs + nrs
        plan = _Plan(nq, nr, (b * h * nsplit * THREADS, 1, 1),
                     [("HEAD_DIM", d), ("G", g), ("BITS", lay.bits), ("GS", lay.group_size),
                      ("SPLIT", lay.split), ("QUANT", int(nq > 0)), ("RESID", int(nr > 0))],
                     [(b, h, nsplit, g), (b, h, nsplit, g), (b, h, nsplit, g, d),
                      (b, h, nr + 1, d), (b, h, nr + 1, d), (b, h)],
                     _cfg(qspan, rspan))
    if len(_PLANS) >= PLANS_MAX:
        _PLANS.clear()
    try:
        _PLANS[key] = plan
    except TypeError:  # an unhashable field: nothing kept
        pass
    return plan


def _on_device() -> bool:
    from velox.backend import gpu_kernels
    return gpu_kernels()


def step_plan(state, queries) -> _Plan | None:
    """The launch plan of a decode step of ``state`` and ``queries`` on this device (for
    :func:`decode_step`'s ``plan``), or None where :func:`supports` would say no."""
    return _plan(state, queries) if _on_device() else None


def supports(state, queries) -> bool:
    """Whether :func:`decode_attend` and :func:`decode_step` take ``state`` and ``queries``
    (else the MLX path): a KIVI state at bits 2, 4 or 8 and group_size 32, 64 or 128, one query
    token, head_dim 64 or 128, at most 32 query heads per kv head, float16, bfloat16 or
    float32 queries, float16 / bfloat16 scales and zeros, float16 / bfloat16 / float32
    residual rows, on a CUDA device or an Apple GPU whose Metal kernels passed the self-check
    (``velox.backend.gpu_kernels``)."""
    return step_plan(state, queries) is not None


def _launch(state, queries, keys, values, scale: float, append: bool, plan: _Plan | None = None):
    """The split kernel (appending or not), then the merge kernel: the output, and with
    ``append`` the new residual window and positions."""
    plan = plan or _plan(state, queries)
    if plan is None:
        raise ValueError("the KIVI decode kernels do not take this state and queries (see supports)")
    ck.check_step(queries, keys, values, state.next_pos.shape[1])
    if plan.nq == 0 and plan.nr == 0:
        rd = state.residual_keys.dtype
        return ck.new_token_alone(queries, values), keys.astype(rd), values.astype(rd), state.next_pos + 1
    params = ck._params(queries.shape[3], 0, float(scale))
    ins = [queries]
    for x in (state.key_codes, state.key_scales, state.key_zeros, state.value_codes,
              state.value_scales, state.value_zeros):
        ins.append(x if plan.nq else _placeholder(x.dtype))
    for x in (state.residual_keys, state.residual_values):
        ins.append(x if plan.nr else _placeholder(x.dtype))
    ins += [params, plan.cfg]
    shapes, dtypes = plan.shapes[:3], [mx.float32] * 3
    if append:
        rd = state.residual_keys.dtype
        ins += [keys, values, state.next_pos]
        shapes, dtypes = plan.shapes, dtypes + [rd, rd, mx.int32]
    parts = _run_kernel("kivi+append" if append else "kivi", None, ins, plan.grid,
                        (THREADS, 1, 1), shapes, dtypes, plan.template)
    return (ck.merge(_run_kernel, queries, keys, values, *parts[:3], params), *parts[3:])


def decode_attend(state, queries, keys, values, *, scale: float):
    """``velox.methods.kivi.attend(state, queries, keys, values, scale=scale)`` for one query
    token (``queries [b, hq, 1, d]``, the step's ``keys`` / ``values [b, h, 1, d]``), by the
    kernels: ``[b, hq, 1, d]`` in the queries' dtype (see the module docstring for how it
    rounds). Refuses (``ValueError``) what :func:`supports` would not take (the device aside)."""
    return _launch(state, queries, keys, values, scale, False)[0]


def decode_step(state, queries, keys, values, *, scale: float, plan: _Plan | None = None):
    """:func:`decode_attend`, the residual window with the step's token appended in the
    residual's dtype (``concatenate([residual, keys.astype(residual dtype)], axis=2)``, the
    same bits) and ``next_pos + 1``, from the same two launches: ``(output, residual_keys,
    residual_values, next_pos)``. ``plan``: :func:`step_plan`'s, where the caller has it."""
    return _launch(state, queries, keys, values, scale, True, plan)

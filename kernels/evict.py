"""Fused CUDA kernels for a decode step of the per-step evictors (through ``mx.fast.cuda_kernel``).

A decode step at a full cache drops exactly one of the ``n + 1`` candidates per selection.
With vectorised MLX ops that step is a chain of ~20 small primitives, and on a GPU each one
costs launch and bookkeeping time that dwarfs its work at decode sizes. Two kernels do it:

* ``weights``: one block per (batch row, kv head); a warp per candidate computes the scaled
  float32 logits of the kv head's query heads against the stored and new keys (lanes across
  head_dim, warp-reduced), optionally plus Keyformer's Gumbel noise (drawn in the kernel), then the
  softmax per query head and the mean (or max, KVzip's probes) over them. Accumulating
  variants also write each candidate's carried score: H2O's decayed sum ``old * decay + w``,
  KVzip's running maximum, MorphKV's votes over the stored attention profiles.
* ``compact``: a few blocks per (batch row, kv head); each finds the row's loser (a given
  candidate, or the argmin of a score, optionally averaged over its chunk of positions
  (ChunkKV) and over the heads of a batch row when the layer keeps one token set, protected
  slots left out, the older of equal scores going first, a non-finite score ranking lowest as
  ``velox.evict.ranked`` ranks it) and moves its share of the kept rows
  of keys, values, positions and the carried per-token data (scores, or MorphKV's profiles
  shifted by one voter) into place, the new row last; ``next_pos`` advances. The scores may
  come from MLX ops (KNorm's key norms, Q-Filters' projections, CurDKV's leverage of the new
  token, ChunkKV's key norms), as one ``[b, h, n + 1]`` array or stored and new apart.

Which kernels a step runs: the score-and-keep methods (``velox.evict.score_and_keep``) keep
their rows in slots. Their ``update`` takes ``weights`` (or their MLX scores) on the GPU, the
loser and the one-row slot write being MLX ops (``compact``'s outputs are fresh buffers, so it
would copy every kept row at each step). The adapter's fused decode step (``with_attention``)
runs ``attend_weights`` instead: the step's attention output and the scores from one softmax
(no stored + new concatenation, the keys read once), split over the candidates as
flash-decoding splits a cache (a block per chunk of a row's candidates, then a launch that
combines the chunks), so a batch of one fills the GPU; then ``select``, the per-token rule's
loser with the slot's row, the positions and the carried scores; the row is then written in
place by MLX at the next step. A step into an empty slot of amortized eviction (``slack``:
TOVA, KNorm and StreamingLLM score nothing there) needs the attention alone: ``attend`` reads
the filled prefix of the slot buffers in place (a custom kernel would copy a sliced view) and
the new row in one pass, the keys and values of a row together with a running softmax per
lane group (flash-decoding's form: no logits kept, no second pass over the rows), a block per
(batch row, kv head) up to ``FLASH_MIN_CHUNK`` rows, beyond that chunks and a combining
launch. ``compact`` serves the methods whose rows stay sorted (``contract.slots =
"sorted"``: CaM's merge, ChunkKV's chunks), which move the kept rows anyway. MLX compiles each kernel at its first launch and caches it
per template values and dtypes; ``weights`` takes head_dim as one, so each lane's loads of a
key row unroll and issue together. ``velox.kernels.nvrtc`` compiles every variant's source
without a GPU (a test does, for three dtypes).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import build
from .dialect import CUDA, SHARED_LIMITS, active, make_spec

__all__ = ["weights", "attend", "attend_weights", "attend_supports", "attend_select",
           "attend_select_supports", "select", "compact"]

THREADS = 1024  # threads per block of the weights kernel (a power of two)
COMPACT_THREADS = 256  # threads per block of the compact kernel (a power of two)
COMPACT_SPAN = 8 * COMPACT_THREADS  # elements of a row's keys a compact block moves
ATTEND_THREADS = 256  # threads per block of attend_weights' two kernels (a multiple of 32)
CHUNK_MAX = 1024  # the most candidates one block of attend_weights' first kernel takes
ATTEND_GROUPS = 8  # the most query heads one pass of that block takes (more: several passes)
ATTEND_MAX_GROUPS = 128  # the most query heads per kv head (the combine's softmax per head, in shared memory)
# Rows each lane group of attend_weights' first kernel loads before it uses any (loads in
# flight per warp; more take more registers). Host-side: changing it builds a new variant.
ATTEND_UNROLL = 1
SELECT_THREADS = 1024  # threads per block of attend_select's second kernel (a power of two)
# How attend_weights splits a unit's candidates (host-side: changing these needs no new build):
# into chunks of at least MIN_CHUNK rows, enough for about SPLIT_BLOCKS blocks in all, then
# evened out (as many chunks, of equal rows). On the H200 (Llama-3.2-1B's attention, 2049
# candidates: 3 chunks of 683) this was 0.91x the time of the earlier 512-row chunks (whose
# fifth chunk held one row) over batch 1 and 32, as fast as 410- and 513-row chunks within the
# runs' noise (docs/results/speed/select/h200-split-balanced.txt).
SPLIT_BLOCKS = 256
MIN_CHUNK = 1024
# How attend (attention alone, no weights) splits a unit's candidates: chunks of at least
# FLASH_MIN_CHUNK rows, enough for about FLASH_BLOCKS blocks; FLASH_UNROLL rows per lane group
# loaded before any is used (host-side: a new value builds a new variant). On the H200
# (Llama-3.2-1B's attention, 2049 candidates, bfloat16, us per launch in one graph) one block
# per unit, no combine launch, beat every split at batch 1 and 8 (37 and 50-55 against 58-78
# and 52-135) and was within the runs' noise of the best at 32 (92-115; MLX's attention over
# the same prefix 79-93 at batch 1 and 8, 274-284 at 32; docs/results/speed/fill-kernel).
FLASH_BLOCKS = 128
FLASH_MIN_CHUNK = 4096
FLASH_UNROLL = 1

# Block-wide reductions (max, sum, argmin) through shared memory; every lane gets the result.
_HEADER = """
struct VeloxMax { VX_FN float operator()(float a, float b) const { return a > b ? a : b; } };
struct VeloxSum { VX_FN float operator()(float a, float b) const { return a + b; } };
template <int NT, typename Op>
VX_FN float velox_block_reduce(float v, VX_GROUP float* red, Op op VX_TID_PARAM) {
    const unsigned int tid = VX_TID;
    red[tid] = v;
    VX_BARRIER;
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w) red[tid] = op(red[tid], red[tid + w]);
        VX_BARRIER;
    }
    const float r = red[0];
    VX_BARRIER;
    return r;
}
// lowbias32, the integer mixer of Keyformer's and CaM's counter-based draws (as in MLX and NumPy)
VX_FN unsigned int velox_mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}
// a uniform float in (0, 1) from a mixed hash
VX_FN float velox_unit(unsigned int h) { return ((float)(h >> 9) + 0.5f) * 1.1920928955078125e-07f; }
// a score as selections rank it: non-finite (NaN, +-inf) -> -inf, the lowest rank
VX_FN float velox_ranked(float s) { return isfinite(s) ? s : VX_INT_AS_FLOAT(0xff800000); }
// max propagating NaN, as MLX's maximum does (fmaxf drops a NaN)
VX_FN float velox_max_nan(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
template <typename T> VX_FN void velox_put(VX_DEVICE T* p, float x) { *p = static_cast<T>(x); }
// warp-wide max (dropping NaN, as the block reductions do) and sum; every lane gets the result
VX_FN float velox_warp_max(float m) {
    for (int off = 16; off > 0; off >>= 1) {
        const float o = VX_SHFL_XOR(m, off);
        m = o > m ? o : m;
    }
    return m;
}
VX_FN float velox_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += VX_SHFL_XOR(v, off);
    return v;
}
// elements [c, c + 8) of a D-long row as float32 (zeros past its end): 16-byte loads when the
// row's length is a multiple of 8 (the row then starts 16-byte aligned), else one at a time
struct alignas(16) velox_v16 { unsigned int x[4]; };
template <int D, typename T>
VX_FN inline void velox_row8(const VX_IN T* row, int c, VX_THREAD float* out) {
    if (D % 8 == 0 && c + 8 <= D) {
        constexpr int per = 16 / (int)sizeof(T);
        for (int u = 0; u < 8; u += per) {
            velox_v16 raw;
#ifdef VX_GPU_CODE
            raw = *reinterpret_cast<const VX_IN velox_v16*>(row + c + u);
#else
            std::memcpy(&raw, row + c + u, 16);
#endif
            const VX_THREAD T* e = reinterpret_cast<const VX_THREAD T*>(&raw);
            for (int i = 0; i < per; ++i) out[u + i] = static_cast<float>(e[i]);
        }
        return;
    }
    for (int i = 0; i < 8; ++i) out[i] = c + i < D ? static_cast<float>(row[c + i]) : 0.0f;
}
// a query head's softmax over a unit's S chunks (one warp): the largest chunk maximum m of pm
// and 1 / the sum of the chunks' exponential sums ps rescaled to it; every lane gets both
VX_FN void velox_chunk_softmax(const VX_IN float* pm, const VX_IN float* ps, size_t bh, int S, int G, int j,
                                    unsigned int lane, VX_THREAD float& m, VX_THREAD float& inv) {
    m = -VX_INT_AS_FLOAT(0x7f800000);
    for (int u = lane; u < S; u += 32) {
        const float x = pm[(bh * S + u) * G + j];
        m = x > m ? x : m;
    }
    m = velox_warp_max(m);
    float se = 0.0f;
    for (int u = lane; u < S; u += 32) se += ps[(bh * S + u) * G + j] * expf(pm[(bh * S + u) * G + j] - m);
    inv = 1.0f / velox_warp_sum(se);
}
// (value, index) minimum; an index of `none` is empty; ties go to the lower index
template <int NT>
VX_FN int velox_block_argmin(float v, int i, int none, VX_GROUP float* red, VX_GROUP int* red_i VX_TID_PARAM) {
    const unsigned int tid = VX_TID;
    red[tid] = v;
    red_i[tid] = i;
    VX_BARRIER;
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w) {
            const float ov = red[tid + w];
            const int oi = red_i[tid + w];
            if (oi != none && (red_i[tid] == none || ov < red[tid] || (ov == red[tid] && oi < red_i[tid]))) {
                red[tid] = ov;
                red_i[tid] = oi;
            }
        }
        VX_BARRIER;
    }
    const int r = red_i[0];
    VX_BARRIER;
    return r;
}
// The per-token rule's loser among a unit's n stored slots (positions P, any order) and the
// new token at position np, by score(t) of candidate t (the new token is t = n): the lowest
// ranked (non-finite lowest), the first n_sink positions and the `recent` newest protected,
// the older position among equal scores. Its slot, or n when the new token lost (every thread).
template <int NT, typename Score>
VX_FN int velox_slot_loser(const VX_IN int* P, int n, int np, int n_sink, int recent, Score score,
                                VX_GROUP float* red, VX_GROUP int* red_i, VX_GROUP int* loser_t VX_TID_PARAM) {
    const unsigned int tid = VX_TID;
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    float best = inf;
    int best_p = -1;
    for (int t = tid; t <= n; t += NT) {
        const int p = t < n ? P[t] : np;
        const bool prot = p < n_sink || (recent > 0 && p >= np + 1 - recent);
        const float r = prot ? inf : velox_ranked(score(t));
        if (best_p < 0 || r < best || (r == best && p < best_p)) { best = r; best_p = p; }
    }
    const int lp = velox_block_argmin<NT>(best, best_p, -1, red, red_i VX_TID_ARG);
    if (tid == 0) *loser_t = n;
    VX_BARRIER;
    for (int t = tid; t < n; t += NT) if (P[t] == lp) *loser_t = t;
    VX_BARRIER;
    return *loser_t;
}
"""

# One block per (batch row, kv head): the G query heads' float32 logits over the n stored and
# the new key (a warp per candidate, lanes across head_dim), optionally plus Keyformer's noise, softmax per
# query head, and the mean (or max) over the G heads -> w. The accumulating variants also write
# each candidate's carried score from w (ACCUMULATE): H2O's old * decay + w, KVzip's running
# max(old, w), MorphKV's votes (the sum or max of the stored profiles' columns and w).
_WEIGHTS_BODY = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    const size_t bh = VX_BID;
    const int H = K_shape[1];
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const int QH = q_shape[1];
    const int G = QH / H;
    const size_t bi = bh / H, hk = bh % H;
    const float scale = params[0];
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    VX_SHARED float red[THREADS];
    VX_DEVICE float* l = lg + bh * G * N;
    for (int t = warp; t < N; t += THREADS / 32) {
        const size_t ko = t < n ? (bh * n + t) * d : bh * d;
        NOISE
        for (int j = 0; j < G; ++j) {
            const size_t qo = (bi * QH + hk * G + j) * d;
            float acc = 0.0f;
            #pragma unroll
            for (int c = lane; c < HEAD_DIM; c += 32) {
                const float kc = t < n ? static_cast<float>(K[ko + c]) : static_cast<float>(knew[ko + c]);
                acc += (static_cast<float>(q[qo + c]) * scale) * kc;
            }
            for (int off = 16; off > 0; off >>= 1) acc += VX_SHFL_XOR(acc, off);
            if (lane == 0) l[(size_t)j * N + t] = acc BIAS;
        }
    }
    VX_BARRIER;
    VX_DEVICE float* ws = w + bh * N;
    for (int j = 0; j < G; ++j) {
        const VX_DEVICE float* lj = l + (size_t)j * N;
        float m = -inf;
        for (int t = tid; t < N; t += THREADS) m = lj[t] > m ? lj[t] : m;
        m = velox_block_reduce<THREADS>(m, red, VeloxMax() VX_TID_ARG);
        float se = 0.0f;
        for (int t = tid; t < N; t += THREADS) se += expf(lj[t] - m);
        const float inv = 1.0f / velox_block_reduce<THREADS>(se, red, VeloxSum() VX_TID_ARG);
        for (int t = tid; t < N; t += THREADS) {
            const float p = expf(lj[t] - m) * inv;
            ws[t] = j == 0 ? p : GROUP_COMBINE;
        }
    }
    for (int t = tid; t < N; t += THREADS) {
        const float wt = GROUP_FINAL;
        ws[t] = wt;
        ACCUMULATE
    }
"""

# Keyformer's scaled Gumbel noise on candidate t, for the query at next_pos: the counter-based
# uniform of (seed, key position, query position), -log(-log(u)), times the annealed
# temperature (params: tau_init, tau_end - tau_init, anneal_steps; 0 steps: constant). Each
# operation is rounded on its own, as MLX's separate ops round it.
_NOISE = """const unsigned int qp = (unsigned int)next_pos[bh];
        const unsigned int kp = (unsigned int)(t < n ? P[bh * n + t] : next_pos[bh]);
        const float u = velox_unit(velox_mix(velox_mix(seedmix[0] ^ kp) ^ qp));
        const float g = -logf(-logf(u));
        float tau = params[2];
        if (params[4] > 0.0f)
            tau = VX_FADD_RN(params[2], VX_FMUL_RN(params[3], VX_FDIV_RN(fminf((float)qp, params[4]), params[4])));
        const float nz = VX_FMUL_RN(tau, g);"""

_GROUP = {"mean": ("ws[t] + p", "ws[t] / (float)G"), "max": ("velox_max_nan(ws[t], p)", "ws[t]")}

_ACCUMULATE = {
    "decay": "scores[bh * N + t] = wt + (t < n ? old[bh * n + t] * params[1] : 0.0f);",
    "max": "scores[bh * N + t] = t < n ? velox_max_nan(old[bh * n + t], wt) : wt;",
    "vote_sum": """float a = 0.0f;
        if (t < n) for (int j = 0; j < old_shape[3]; ++j) a += old[(bh * n + t) * old_shape[3] + j];
        scores[bh * N + t] = a + wt;""",
    "vote_max": """float a = wt;
        if (t < n) for (int j = 0; j < old_shape[3]; ++j) a = velox_max_nan(a, old[(bh * n + t) * old_shape[3] + j]);
        scores[bh * N + t] = a;""",
}

# The start of attend_weights' first kernel and of attend's: the lane layout (lpr lanes per
# key row, 8 elements each: a power of two, so rows stay in aligned lane groups; rpw rows per
# warp at a time), the block's unit bh (batch row bi, kv head hk) and chunk [c0, c1) of its
# N = n + 1 candidates (STORED: the n stored rows, of buffers of R rows), and the shared array
# of the query heads a pass takes.
_ATTEND_UNIT = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    constexpr int nw = THREADS / 32;
    static_assert(HEAD_DIM <= 256, "head_dim up to 256");
    constexpr int lpr = HEAD_DIM <= 8 ? 1 : HEAD_DIM <= 16 ? 2 : HEAD_DIM <= 32 ? 4 : HEAD_DIM <= 64 ? 8
                      : HEAD_DIM <= 128 ? 16 : 32;
    constexpr int rpw = 32 / lpr;
    const int li = lane % lpr, ri = lane / lpr;
    const int H = K_shape[1];
    const int R = K_shape[2];
    const int n = STORED;
    const int N = n + 1;
    const int QH = q_shape[1];
    const int G = QH / H;
    const int CH = cfg[0];
    const int S = (N + CH - 1) / CH;
    const size_t bh = VX_BID / S;
    const int s = VX_BID % S;
    const size_t bi = bh / H, hk = bh % H;
    const int c0 = s * CH, c1 = c0 + CH < N ? c0 + CH : N;
    const float scale = params[0];
    const float inf = VX_INT_AS_FLOAT(0x7f800000);
    VX_SHARED float qs[GROUPS * HEAD_DIM];
"""

# The two attend kernels' logits of a key row: this lane's 8 elements kr (at li * 8) against
# the first gp of the G query rows in shared memory (D elements each), summed over the row's L
# lanes (every lane of the row's group gets them).
_ATTEND_HEADER = """
template <int D, int G, int L>
VX_FN inline void velox_row_logits(const VX_GROUP float* qs, const VX_THREAD float* kr, int li, int gp, VX_THREAD float* acc) {
    #pragma unroll
    for (int j = 0; j < G; ++j) {
        float a = 0.0f;
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            if (li * 8 + i < D && j < gp) a += qs[j * D + li * 8 + i] * kr[i];
        acc[j] = a;
    }
    for (int off = L / 2; off > 0; off >>= 1) {
        #pragma unroll
        for (int j = 0; j < G; ++j) acc[j] += VX_SHFL_XOR(acc[j], off);
    }
}
"""

# attend_weights, split over the candidates (flash-decoding): the first kernel runs a block
# per chunk of CH candidates of a (batch row, kv head). In passes of up to GROUPS query heads:
# the scaled float32 logits (a group of lanes per candidate, 8 elements of the key row per
# lane in 16-byte loads, so a warp takes several rows at once; the key row loaded once for
# the pass's heads), written to lg; per head the chunk's maximum pm and sum ps of
# exp(logit - pm), and the chunk's unnormalised output po = sum exp(logit - pm) * value (the
# value rows loaded as the keys, each lane summing its 8 elements over its rows, the lane
# groups of a warp added by shuffles, the warps through shared memory).
_ATTEND_PART = _ATTEND_UNIT.replace("STORED", "R") + """
    VX_SHARED float pc[GROUPS * CHUNK_MAX];
    VX_SHARED float red[nw * HEAD_DIM];
    VX_DEVICE float* l = lg + bh * G * N;
    for (int j0 = 0; j0 < G; j0 += GROUPS) {
        const int gp = G - j0 < GROUPS ? G - j0 : GROUPS;
        for (int i = tid; i < gp * HEAD_DIM; i += THREADS)
            qs[i] = static_cast<float>(q[(bi * QH + hk * G + j0) * HEAD_DIM + i]) * scale;
        VX_BARRIER;
        // UNROLL rows per lane group at a time, all loaded before any is used (loads in flight)
        for (int t0 = c0 + warp * rpw; t0 < c1; t0 += UNROLL * nw * rpw) {
            float kr[UNROLL][8];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * nw * rpw + ri;
                if (t < c1) velox_row8<HEAD_DIM>(t < n ? K + (bh * n + t) * HEAD_DIM : knew + bh * HEAD_DIM, li * 8, kr[u]);
                else for (int i = 0; i < 8; ++i) kr[u][i] = 0.0f;
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * nw * rpw + ri;
                float acc[GROUPS];
                velox_row_logits<HEAD_DIM, GROUPS, lpr>(qs, kr[u], li, gp, acc);
                if (t < c1 && li == 0) {
                    for (int j = 0; j < gp; ++j) {
                        l[(size_t)(j0 + j) * N + t] = acc[j];
                        pc[j * CHUNK_MAX + t - c0] = acc[j];
                    }
                }
            }
        }
        VX_BARRIER;
        for (int j = warp; j < gp; j += nw) {
            VX_GROUP float* pj = pc + j * CHUNK_MAX;
            float m = -inf;
            for (int t = lane; t < c1 - c0; t += 32) m = pj[t] > m ? pj[t] : m;
            m = velox_warp_max(m);
            float se = 0.0f;
            for (int t = lane; t < c1 - c0; t += 32) {
                const float e = expf(pj[t] - m);
                pj[t] = e;
                se += e;
            }
            se = velox_warp_sum(se);
            if (lane == 0) {
                pm[(bh * S + s) * G + j0 + j] = m;
                ps[(bh * S + s) * G + j0 + j] = se;
            }
        }
        VX_BARRIER;
        {
            float acc[GROUPS][8];
            #pragma unroll
            for (int j = 0; j < GROUPS; ++j)
                for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;
            for (int t0 = c0 + warp * rpw; t0 < c1; t0 += UNROLL * nw * rpw) {
                float vr[UNROLL][8];
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int t = t0 + u * nw * rpw + ri;
                    if (t < c1) velox_row8<HEAD_DIM>(t < n ? V + (bh * n + t) * HEAD_DIM : vnew + bh * HEAD_DIM, li * 8, vr[u]);
                }
                #pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int t = t0 + u * nw * rpw + ri;
                    if (t < c1) {
                        #pragma unroll
                        for (int j = 0; j < GROUPS; ++j) {
                            if (j < gp) {
                                const float p = pc[j * CHUNK_MAX + t - c0];
                                #pragma unroll
                                for (int i = 0; i < 8; ++i) acc[j][i] += p * vr[u][i];
                            }
                        }
                    }
                }
            }
            for (int off = lpr; off < 32; off <<= 1) {
                #pragma unroll
                for (int j = 0; j < GROUPS; ++j)
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[j][i] += VX_SHFL_XOR(acc[j][i], off);
            }
            #pragma unroll
            for (int j = 0; j < GROUPS; ++j) {
                if (j < gp) {
                    if (ri == 0)
                        for (int i = 0; i < 8; ++i)
                            if (li * 8 + i < HEAD_DIM) red[warp * HEAD_DIM + li * 8 + i] = acc[j][i];
                    VX_BARRIER;
                    for (int c = tid; c < HEAD_DIM; c += THREADS) {
                        float sum = 0.0f;
                        for (int u = 0; u < nw; ++u) sum += red[u * HEAD_DIM + c];
                        po[((bh * S + s) * G + j0 + j) * HEAD_DIM + c] = sum;
                    }
                    VX_BARRIER;
                }
            }
        }
        VX_BARRIER;
    }
"""

# attend_weights' second kernel, a block per chunk again: every block combines its unit's
# chunk maxima and sums into each query head's softmax (M, 1 / sum), then writes the weights
# w (and the carried scores, ACCUMULATE) of its chunk's candidates from lg, and its share of
# the output's G * HEAD_DIM elements, sum over chunks of po * exp(pm - M) / sum.
_ATTEND_COMBINE = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    constexpr int nw = THREADS / 32;
    const int H = lg_shape[1];
    const int G = lg_shape[2];
    const int N = lg_shape[3];
    const int n = N - 1;
    const int S = pm_shape[2];
    const int CH = cfg[0];
    const size_t bh = VX_BID / S;
    const int s = VX_BID % S;
    const size_t bi = bh / H, hk = bh % H;
    const int QH = H * G;
    VX_SHARED float mj[MAX_GROUPS];
    VX_SHARED float ij[MAX_GROUPS];
    for (int j = warp; j < G; j += nw) {
        float m, inv;
        velox_chunk_softmax(pm, ps, bh, S, G, j, lane, m, inv);
        if (lane == 0) {
            mj[j] = m;
            ij[j] = inv;
        }
    }
    VX_BARRIER;
    const int c0 = s * CH, c1 = c0 + CH < N ? c0 + CH : N;
    VX_DEVICE float* ws = w + bh * N;
    for (int t = c0 + tid; t < c1; t += THREADS) {
        float wa = 0.0f;
        for (int j = 0; j < G; ++j) {
            const float p = expf(lg[(bh * G + j) * N + t] - mj[j]) * ij[j];
            wa = j == 0 ? p : GROUP_COMBINE;
        }
        const float wt = GROUP_FINAL;
        ws[t] = wt;
        ACCUMULATE
    }
    const int E = (G * HEAD_DIM + S - 1) / S;
    for (int u = tid; u < E; u += THREADS) {
        const int i = s * E + u;
        if (i < G * HEAD_DIM) {
            const int j = i / HEAD_DIM, c = i % HEAD_DIM;
            float acc = 0.0f;
            for (int v = 0; v < S; ++v)
                acc += po[((bh * S + v) * G + j) * HEAD_DIM + c] * expf(pm[(bh * S + v) * G + j] - mj[j]);
            velox_put(&o[(bi * QH + hk * G + j) * HEAD_DIM + c], acc * ij[j]);
        }
    }
"""

# attend_select's second kernel: attend_weights' combine and select's decision in one launch,
# a block per selection unit (a (batch row, kv head), or a batch row whose UH = H heads share
# one selection: SHARED). Every (head, query head) pair's softmax from its chunks' maxima and
# sums (a warp each); the weights w and carried scores of the unit's candidates (written to
# global memory, read back by the block after the barrier); the attention output; then the
# loser as select decides it (by BY: the weights, the carried scores, a given score or none),
# the slot's row, the positions, next_pos + 1 and the carried scores with the slot taken.
_ATTEND_SELECT = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    constexpr int nw = THREADS / 32;
    const int H = lg_shape[1];
    const int G = lg_shape[2];
    const int N = lg_shape[3];
    const int n = N - 1;
    const int S = pm_shape[2];
    const int QH = H * G;
    const int UH = SHARED ? H : 1;
    const size_t bi = VX_BID / (H / UH);
    const int h0 = SHARED ? 0 : (int)(VX_BID % H);
    const size_t u0 = bi * H + h0;
    VX_SHARED float mj[THREADS];
    VX_SHARED float ij[THREADS];
    VX_SHARED float red[THREADS];
    VX_SHARED int red_i[THREADS];
    VX_SHARED int loser_t;
    for (int e = warp; e < UH * G; e += nw) {
        float m, inv;
        velox_chunk_softmax(pm, ps, u0 + e / G, S, G, e % G, lane, m, inv);
        if (lane == 0) {
            mj[e] = m;
            ij[e] = inv;
        }
    }
    VX_BARRIER;
    for (int e = tid; e < UH * N; e += THREADS) {
        const int hl = e / N, t = e % N;
        const size_t bh = u0 + hl;
        float wa = 0.0f;
        for (int j = 0; j < G; ++j) {
            const float p = expf(lg[(bh * G + j) * N + t] - mj[hl * G + j]) * ij[hl * G + j];
            wa = j == 0 ? p : GROUP_COMBINE;
        }
        const float wt = GROUP_FINAL;
        w[bh * N + t] = wt;
        ACCUMULATE
    }
    for (int e = tid; e < UH * G * HEAD_DIM; e += THREADS) {
        const int hj = e / HEAD_DIM, c = e % HEAD_DIM;
        const int hl = hj / G, j = hj % G;
        const size_t bh = u0 + hl;
        float acc = 0.0f;
        for (int v = 0; v < S; ++v)
            acc += po[((bh * S + v) * G + j) * HEAD_DIM + c] * expf(pm[(bh * S + v) * G + j] - mj[hj]);
        velox_put(&o[(bi * QH + (h0 + hl) * G + j) * HEAD_DIM + c], acc * ij[hj]);
    }
    VX_BARRIER;
    const int lt = velox_slot_loser<THREADS>(P + u0 * n, n, next_pos[u0], N_SINK, RECENT, [&](int t) {
        float sc = 0.0f;
        for (int hl = 0; hl < UH; ++hl) {
            const size_t bh = u0 + hl;
            sc += BY;
        }
        return SHARED ? sc / (float)H : sc;
    }, red, red_i, &loser_t VX_TID_ARG);
    const bool wr = lt < n;
    const int slot = wr ? lt : 0;
    for (int hl = 0; hl < UH; ++hl) {
        const size_t u = u0 + hl;
        const int npu = next_pos[u];
        if (tid == 0) {
            oslot[u] = slot;
            onext[u] = npu + 1;
        }
        for (int c = tid; c < HEAD_DIM; c += THREADS) {
            rowk[u * HEAD_DIM + c] = wr ? knew[u * HEAD_DIM + c] : K[(u * n + slot) * HEAD_DIM + c];
            rowv[u * HEAD_DIM + c] = wr ? vnew[u * HEAD_DIM + c] : V[(u * n + slot) * HEAD_DIM + c];
        }
        for (int i = tid; i < n; i += THREADS) {
            const bool taken = wr && i == slot;
            opos[u * n + i] = taken ? npu : P[u * n + i];
            CARRY_SLOT
        }
    }
"""

# attend's first kernel (attention only, no weights: a step into an empty slot of amortized
# eviction), a block per chunk of a unit's candidates: the first n = cfg[1] slots of buffers
# of R rows (the filled prefix, read in place) and the new row. Each lane group keeps a running
# softmax (maximum m, sum l) and output per query head over the rows it reads, the keys and
# values of UNROLL rows loaded before any is used (one pass over the rows, as flash-decoding);
# the lane groups of a warp then merge by shuffles, the warps through shared memory. OUTPUT: the
# normalised output (one chunk) or the chunk's maximum, sum and unnormalised output (pm, ps, po).
_ATTEND_FLASH = _ATTEND_UNIT.replace("STORED", "cfg[1]") + """
    VX_SHARED float wm[nw * GROUPS];
    VX_SHARED float wl[nw * GROUPS];
    VX_SHARED float red[nw * HEAD_DIM];
    for (int j0 = 0; j0 < G; j0 += GROUPS) {
        const int gp = G - j0 < GROUPS ? G - j0 : GROUPS;
        for (int i = tid; i < gp * HEAD_DIM; i += THREADS)
            qs[i] = static_cast<float>(q[(bi * QH + hk * G + j0) * HEAD_DIM + i]) * scale;
        VX_BARRIER;
        float m[GROUPS], l[GROUPS], acc[GROUPS][8];
        #pragma unroll
        for (int j = 0; j < GROUPS; ++j) {
            m[j] = -inf;
            l[j] = 0.0f;
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[j][i] = 0.0f;
        }
        for (int t0 = c0 + warp * rpw; t0 < c1; t0 += UNROLL * nw * rpw) {
            float kr[UNROLL][8], vr[UNROLL][8];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * nw * rpw + ri;
                if (t < c1) {
                    velox_row8<HEAD_DIM>(t < n ? K + (bh * R + t) * HEAD_DIM : knew + bh * HEAD_DIM, li * 8, kr[u]);
                    velox_row8<HEAD_DIM>(t < n ? V + (bh * R + t) * HEAD_DIM : vnew + bh * HEAD_DIM, li * 8, vr[u]);
                } else {
                    for (int i = 0; i < 8; ++i) kr[u][i] = vr[u][i] = 0.0f;
                }
            }
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int t = t0 + u * nw * rpw + ri;
                float x[GROUPS];
                velox_row_logits<HEAD_DIM, GROUPS, lpr>(qs, kr[u], li, gp, x);
                if (t < c1) {
                    #pragma unroll
                    for (int j = 0; j < GROUPS; ++j) {
                        const float mn = x[j] > m[j] ? x[j] : m[j];
                        const float c = m[j] == mn ? 1.0f : expf(m[j] - mn);
                        const float p = expf(x[j] - mn);
                        l[j] = l[j] * c + p;
                        #pragma unroll
                        for (int i = 0; i < 8; ++i) acc[j][i] = acc[j][i] * c + p * vr[u][i];
                        m[j] = mn;
                    }
                }
            }
        }
        // the warp's lane groups merged (a butterfly: every lane group ends with the warp's)
        for (int off = lpr; off < 32; off <<= 1) {
            #pragma unroll
            for (int j = 0; j < GROUPS; ++j) {
                const float mo = VX_SHFL_XOR(m[j], off);
                const float lo = VX_SHFL_XOR(l[j], off);
                const float mn = mo > m[j] ? mo : m[j];
                const float ca = m[j] == mn ? 1.0f : expf(m[j] - mn);
                const float cb = mo == mn ? 1.0f : expf(mo - mn);
                l[j] = l[j] * ca + lo * cb;
                #pragma unroll
                for (int i = 0; i < 8; ++i)
                    acc[j][i] = acc[j][i] * ca + VX_SHFL_XOR(acc[j][i], off) * cb;
                m[j] = mn;
            }
        }
        if (lane == 0) {
            #pragma unroll
            for (int j = 0; j < GROUPS; ++j) {
                wm[warp * GROUPS + j] = m[j];
                wl[warp * GROUPS + j] = l[j];
            }
        }
        VX_BARRIER;
        #pragma unroll
        for (int j = 0; j < GROUPS; ++j) {
            if (j < gp) {
                float M = -inf;
                for (int u = 0; u < nw; ++u) M = wm[u * GROUPS + j] > M ? wm[u * GROUPS + j] : M;
                const float cw = m[j] == M ? 1.0f : expf(m[j] - M);
                if (ri == 0)
                    for (int i = 0; i < 8; ++i)
                        if (li * 8 + i < HEAD_DIM) red[warp * HEAD_DIM + li * 8 + i] = acc[j][i] * cw;
                VX_BARRIER;
                float L = 0.0f;
                for (int u = 0; u < nw; ++u) {
                    const float mu = wm[u * GROUPS + j];
                    L += wl[u * GROUPS + j] * (mu == M ? 1.0f : expf(mu - M));
                }
                for (int c = tid; c < HEAD_DIM; c += THREADS) {
                    float sum = 0.0f;
                    for (int u = 0; u < nw; ++u) sum += red[u * HEAD_DIM + c];
                    OUTPUT
                }
                VX_BARRIER;
            }
        }
        VX_BARRIER;
    }
"""
_FLASH_OUTPUT = {
    True: "velox_put(&o[(bi * QH + hk * G + j0 + j) * HEAD_DIM + c], sum / L);",
    False: """po[((bh * S + s) * G + j0 + j) * HEAD_DIM + c] = sum;
                    if (c == 0) {
                        pm[(bh * S + s) * G + j0 + j] = M;
                        ps[(bh * S + s) * G + j0 + j] = L;
                    }""",
}

# attend's second kernel (more than one chunk per unit), a block per unit: each query head's
# softmax over the chunks' maxima and sums, then the output, as attend_weights' combine
# computes its output.
_ATTEND_OUT = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    constexpr int nw = THREADS / 32;
    const int H = pm_shape[1];
    const int S = pm_shape[2];
    const int G = pm_shape[3];
    const size_t bh = VX_BID;
    const size_t bi = bh / H, hk = bh % H;
    const int QH = H * G;
    VX_SHARED float mj[MAX_GROUPS];
    VX_SHARED float ij[MAX_GROUPS];
    for (int j = warp; j < G; j += nw) {
        float m, inv;
        velox_chunk_softmax(pm, ps, bh, S, G, j, lane, m, inv);
        if (lane == 0) {
            mj[j] = m;
            ij[j] = inv;
        }
    }
    VX_BARRIER;
    for (int i = tid; i < G * HEAD_DIM; i += THREADS) {
        const int j = i / HEAD_DIM, c = i % HEAD_DIM;
        float acc = 0.0f;
        for (int v = 0; v < S; ++v)
            acc += po[((bh * S + v) * G + j) * HEAD_DIM + c] * expf(pm[(bh * S + v) * G + j] - mj[j]);
        velox_put(&o[(bi * QH + hk * G + j) * HEAD_DIM + c], acc * ij[j]);
    }
"""

# attend_select's selection score of candidate t of head bh, by the kind of its rule
_BY = {"weights": "w[bh * N + t]", "carried": "scores[bh * N + t]", "given": "given[bh * N + t]",
       "none": "0.0f"}


# CHUNKS blocks per (batch row, kv head), each finding the unit's loser (given, or the argmin
# of the unit's selection scores with the first N_SINK and last RECENT candidates protected,
# a candidate's score being its chunk's mean when CHUNK_SIZE > 1; every block of a row finds
# the same one) and moving its share of the kept rows of keys, values, positions and the
# carried per-token data into place, the new row last; next_pos advanced.
_COMPACT_BODY = """
    const unsigned int tid = VX_TID;
    const size_t bh = VX_BID / CHUNKS;
    const int chunk = VX_BID % CHUNKS;
    const int H = K_shape[1];
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const size_t bi = bh / H;
    VX_SHARED float red[THREADS];
    VX_SHARED int red_i[THREADS];
    auto raw = [&](size_t X, int t) -> float { return RAW_SCORE; };
    auto pos = [&](size_t X, int t) -> int { return t < n ? P[X * n + t] : next_pos[X]; };
    auto score = [&](size_t X, int t) -> float {
        if (CHUNK_SIZE <= 1) return raw(X, t);
        const int c = pos(X, t) / CHUNK_SIZE;
        int a = t, z = t;
        while (a > 0 && pos(X, a - 1) / CHUNK_SIZE == c) --a;
        while (z + 1 < N && pos(X, z + 1) / CHUNK_SIZE == c) ++z;
        float sum = 0.0f;
        for (int u = a; u <= z; ++u) sum += raw(X, u);
        return sum / (float)(z - a + 1);
    };
    int drop;
    if (SELECT) {
        float best = 0.0f;
        int best_i = N;
        for (int t = tid; t < N; t += THREADS) {
            if (t < N_SINK || t >= N - RECENT) continue;
            float s;
            if (UNIT_HEADS == 1) {
                s = score(bh, t);
            } else {
                s = 0.0f;
                for (int hh = 0; hh < H; ++hh) s += score(bi * H + hh, t);
                s = s / (float)H;
            }
            s = velox_ranked(s);
            if (best_i == N || s < best) { best = s; best_i = t; }
        }
        drop = velox_block_argmin<THREADS>(best, best_i, N, red, red_i VX_TID_ARG);
    } else {
        drop = FIXED_DROP;
    }
    const size_t rows = bh * n;
    const int span = (n * d + CHUNKS - 1) / CHUNKS, first = chunk * span;
    const int last = first + span < n * d ? first + span : n * d;
    for (int e = first + tid; e < last; e += THREADS) {
        const int i = e / d, c = e % d;
        const int src = i < drop ? i : i + 1;
        if (src == n) {
            ok[rows * d + e] = knew[bh * d + c];
            ov[rows * d + e] = vnew[bh * d + c];
        } else {
            ok[rows * d + e] = K[(rows + src) * d + c];
            ov[rows * d + e] = V[(rows + src) * d + c];
        }
    }
    const int pspan = (n + CHUNKS - 1) / CHUNKS, pfirst = chunk * pspan;
    const int plast = pfirst + pspan < n ? pfirst + pspan : n;
    for (int i = pfirst + tid; i < plast; i += THREADS) {
        const int src = i < drop ? i : i + 1;
        op[rows + i] = src == n ? next_pos[bh] : P[rows + src];
        CARRY
    }
    CARRY_ROWS
    if (tid == 0 && chunk == 0) onext[bh] = next_pos[bh] + 1;
"""

_RAW = {"fixed": "0.0f", "full": "S[X * N + t]", "split": "t < n ? S[X * n + t] : Snew[X]"}

_CARRY = {"none": "", "full": "oc[rows + i] = C[bh * N + src];",
          "split": "oc[rows + i] = src < n ? C[rows + src] : Cnew[bh];", "profiles": ""}

# MorphKV's profiles: row i of the output is its source row's columns shifted left by one
# (the oldest voter leaves) and the candidate's new column PW appended; the new row's stored
# columns are zeros.
_PROFILE_ROWS = """
    const int wp = PR_shape[3];
    const int rspan = (n * wp + CHUNKS - 1) / CHUNKS, rfirst = chunk * rspan;
    const int rlast = rfirst + rspan < n * wp ? rfirst + rspan : n * wp;
    for (int e = rfirst + tid; e < rlast; e += THREADS) {
        const int i = e / wp, c = e % wp;
        const int src = i < drop ? i : i + 1;
        opr[rows * wp + e] = c == wp - 1 ? PW[bh * N + src] : (src < n ? PR[(rows + src) * wp + c + 1] : 0.0f);
    }
"""


# One block per selection unit (a batch row's kv head, or the whole row when its heads share
# one selection: SHARED, the mean of the H heads' scores): the loser among the n stored slots
# (any order) and the new token is the lowest ranked score (non-finite lowest, the first N_SINK
# positions and the RECENT newest protected), the older position among equal scores; then per
# head the slot's row to write (the new token's when it won a slot, else the slot's own row:
# the write changes nothing), the positions and the carried scores with the slot taken.
_SELECT_BODY = """
    const unsigned int tid = VX_TID;
    const int H = P_shape[1];
    const int n = P_shape[2];
    const int N = n + 1;
    const int units = SHARED ? 1 : H;
    const size_t bi = VX_BID / units;
    const int h0 = SHARED ? 0 : (int)(VX_BID % units);
    VX_SHARED float red[THREADS];
    VX_SHARED int red_i[THREADS];
    VX_SHARED int loser_t;
    const size_t u0 = bi * H + h0;
    const int lt = velox_slot_loser<THREADS>(P + u0 * n, n, next_pos[u0], N_SINK, RECENT, [&](int t) {
        if (!SHARED) return S[u0 * N + t];
        float sc = 0.0f;
        for (int hh = 0; hh < H; ++hh) sc += S[(bi * H + hh) * N + t];
        return sc / (float)H;
    }, red, red_i, &loser_t VX_TID_ARG);
    const bool wr = lt < n;
    const int slot = wr ? lt : 0;
    const int d = K_shape[3];
    for (int hh = SHARED ? 0 : h0; hh < (SHARED ? H : h0 + 1); ++hh) {
        const size_t u = bi * H + hh;
        if (tid == 0) { oslot[u] = slot; }
        for (int c = tid; c < d; c += THREADS) {
            rowk[u * d + c] = wr ? knew[u * d + c] : K[(u * n + slot) * d + c];
            rowv[u * d + c] = wr ? vnew[u * d + c] : V[(u * n + slot) * d + c];
        }
        const int npu = next_pos[u];
        for (int i = tid; i < n; i += THREADS) {
            const bool taken = wr && i == slot;
            opos[u * n + i] = taken ? npu : P[u * n + i];
            CARRY_SLOT
        }
    }
"""


def _select_spec(carry: bool = False, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of ``select`` (``carry``: the carried scores
    ``C [b, h, n + 1]`` over the candidates, written with the slot taken)."""
    return make_spec(
        name="velox_select" + ("_carry" if carry else ""),
        input_names=["S", "P", "next_pos", "K", "V", "knew", "vnew"] + (["C"] if carry else []),
        output_names=["oslot", "rowk", "rowv", "opos"] + (["oc"] if carry else []),
        source=_SELECT_BODY.replace("CARRY_SLOT", "oc[u * n + i] = taken ? C[u * N + n] : C[u * N + i];"
                                    if carry else "").replace("THREADS", str(COMPACT_THREADS)),
        header=_HEADER, dialect=dialect)


@lru_cache(maxsize=None)
def _select_kernel(carry: bool, dialect: str = CUDA):
    return build(_select_spec(carry, dialect=dialect), dialect)


def select(scores, positions, next_pos, keys, values, new_keys, new_values, *, n_sink: int,
           recent: int, shared: bool, carried=None):
    """A decode step's selection at a full state of slots in one launch, as
    ``velox.evict``'s slot step decides it (:func:`velox.evict.slot_losers` with one loser,
    every slot filled): ``(slot, rows_k, rows_v, positions, carried)``. ``scores [b, h, n + 1]``
    (float32; ``shared``: the row's heads share one selection on their mean), ``positions
    [b, h, n]``, ``next_pos [b, h]``, stored ``keys``/``values [b, h, n, d]``, the new token's
    ``[b, h, 1, d]``; ``carried [b, h, n + 1]`` (float32, optional) the carried scores over the
    candidates. ``slot [b, h, 1]`` is where the step's row goes and ``rows_*`` what is written
    there (the slot's own row when the new token lost); ``positions`` and ``carried`` come back
    with the slot taken (``[b, h, n]``; ``carried`` None without it)."""
    b, h, n, d = keys.shape
    units = b if shared else b * h
    outs = _run_kernel(
        ("select", carried is not None),
        [scores, positions, next_pos, keys, values, new_keys, new_values]
        + ([carried] if carried is not None else []),
        (units * COMPACT_THREADS, 1, 1), (COMPACT_THREADS, 1, 1),
        [(b, h, 1), (b, h, 1, d), (b, h, 1, d), (b, h, n)] + ([(b, h, n)] if carried is not None else []),
        [mx.int32, keys.dtype, values.dtype, mx.int32] + ([mx.float32] if carried is not None else []),
        [("N_SINK", n_sink), ("RECENT", recent), ("SHARED", int(shared))])
    return outs[0], outs[1], outs[2], outs[3], (outs[4] if carried is not None else None)


def _weights_spec(group: str = "mean", accumulate: str | None = None, noise: bool = False, *,
                  dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of a ``weights`` variant: ``group`` (``mean`` or
    ``max`` over a kv head's query heads), ``accumulate`` (None, ``decay``, ``max``,
    ``vote_sum``, ``vote_max``) and whether Keyformer's Gumbel ``noise`` is added to the
    logits."""
    combine, final = _GROUP[group]
    name = "velox_weights_" + group + (f"_{accumulate}" if accumulate else "") + ("_noise" if noise else "")
    return make_spec(
        name=name,
        input_names=["q", "K", "knew", "params"] + (["old"] if accumulate else [])
        + (["P", "next_pos", "seedmix"] if noise else []),
        output_names=["w", "lg"] + (["scores"] if accumulate else []),
        source=_WEIGHTS_BODY.replace("ACCUMULATE", _ACCUMULATE[accumulate] if accumulate else "")
                            .replace("GROUP_COMBINE", combine).replace("GROUP_FINAL", final)
                            .replace("NOISE", _NOISE if noise else "")
                            .replace("BIAS", "+ nz" if noise else "")
                            .replace("THREADS", str(THREADS)),
        header=_HEADER, dialect=dialect)


def _attend_part_spec(*, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of ``attend_weights``' first launch (one block
    per chunk of a (batch row, kv head)'s candidates; template ``HEAD_DIM`` and ``GROUPS``,
    the query heads a pass takes)."""
    return make_spec(name="velox_attend_part", input_names=["q", "K", "knew", "V", "vnew", "params", "cfg"],
                output_names=["lg", "pm", "ps", "po"],
                source=_ATTEND_PART.replace("THREADS", str(ATTEND_THREADS))
                                   .replace("CHUNK_MAX", str(CHUNK_MAX)),
                header=_HEADER + _ATTEND_HEADER, dialect=dialect)


def _attend_combine_spec(group: str = "mean", accumulate: str | None = None, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of ``attend_weights``' second launch, for
    ``group`` and ``accumulate`` as :func:`_weights_spec` takes them."""
    combine, final = (x.replace("ws[t]", "wa") for x in _GROUP[group])
    return make_spec(name="velox_attend_combine_" + group + (f"_{accumulate}" if accumulate else ""),
                input_names=["lg", "pm", "ps", "po", "cfg"] + (["old"] if accumulate else [])
                + (["params"] if accumulate == "decay" else []),
                output_names=["w"] + (["scores"] if accumulate else []) + ["o"],
                source=_ATTEND_COMBINE.replace("ACCUMULATE", _ACCUMULATE[accumulate] if accumulate else "")
                                      .replace("GROUP_COMBINE", combine).replace("GROUP_FINAL", final)
                                      .replace("THREADS", str(ATTEND_THREADS))
                                      .replace("MAX_GROUPS", str(ATTEND_MAX_GROUPS)),
                header=_HEADER, dialect=dialect)


def _attend_flash_spec(direct: bool = False, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of :func:`attend`'s first launch (a block per chunk
    of a unit's candidates; template ``HEAD_DIM``, ``GROUPS`` and ``UNROLL``): ``direct``
    writes the normalised output (one chunk per unit), else each chunk's maximum, sum and
    unnormalised output for :func:`_attend_out_spec`'s launch."""
    return make_spec(name="velox_attend_flash" + ("_direct" if direct else ""),
                input_names=["q", "K", "knew", "V", "vnew", "params", "cfg"],
                output_names=["o"] if direct else ["pm", "ps", "po"],
                source=_ATTEND_FLASH.replace("OUTPUT", _FLASH_OUTPUT[bool(direct)])
                                    .replace("THREADS", str(ATTEND_THREADS)),
                header=_HEADER + _ATTEND_HEADER, dialect=dialect)


def _attend_out_spec(*, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of :func:`attend`'s second launch (a block per
    unit; template ``HEAD_DIM``)."""
    return make_spec(name="velox_attend_out", input_names=["pm", "ps", "po"], output_names=["o"],
                source=_ATTEND_OUT.replace("THREADS", str(ATTEND_THREADS))
                                  .replace("MAX_GROUPS", str(ATTEND_MAX_GROUPS)),
                header=_HEADER, dialect=dialect)


def _attend_select_spec(group: str = "mean", accumulate: str | None = None, by: str = "weights",
                        carry: bool = False, *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of ``attend_select``'s second launch: ``group``
    and ``accumulate`` as :func:`_weights_spec` takes them (``decay`` or ``max``), ``by``
    (``weights``, ``carried``: the accumulated scores, ``given``: an input ``[b, h, n + 1]``,
    ``none``: every candidate scores 0) and ``carry`` (the accumulated scores come back with
    the slot taken, ``oc [b, h, n]``)."""
    if accumulate not in (None, "decay", "max") or by not in _BY or group not in _GROUP:
        raise ValueError(f"unknown attend_select variant: group={group!r}, accumulate={accumulate!r}, by={by!r}")
    if (by == "carried" or carry) and accumulate is None:
        raise ValueError("attend_select: carried scores need `accumulate`")
    combine, final = (x.replace("ws[t]", "wa") for x in _GROUP[group])
    name = "velox_attend_select_" + group + (f"_{accumulate}" if accumulate else "") + f"_{by}" + ("_carry" if carry else "")
    return make_spec(
        name=name,
        input_names=["lg", "pm", "ps", "po", "P", "next_pos", "K", "V", "knew", "vnew"]
        + (["old"] if accumulate else []) + (["params"] if accumulate == "decay" else [])
        + (["given"] if by == "given" else []),
        output_names=["o", "oslot", "rowk", "rowv", "opos", "onext", "w"]
        + (["scores"] if accumulate else []) + (["oc"] if carry else []),
        source=_ATTEND_SELECT.replace("ACCUMULATE", _ACCUMULATE[accumulate] if accumulate else "")
                             .replace("GROUP_COMBINE", combine).replace("GROUP_FINAL", final)
                             .replace("BY", _BY[by])
                             .replace("CARRY_SLOT", "oc[u * n + i] = taken ? scores[u * N + n] : scores[u * N + i];"
                                      if carry else "")
                             .replace("THREADS", str(SELECT_THREADS)),
        header=_HEADER, dialect=dialect)


def _compact_spec(select: str, carry: str = "none", *, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of a ``compact`` variant. ``select``: ``fixed``
    (the loser is a template value), ``full`` (argmin of ``S [b, h, n + 1]``) or ``split``
    (``S [b, h, n]`` of the stored rows and ``Snew [b, h, 1]``); ``carry``: the per-token data
    compacted beside the rows: ``none``, ``full`` / ``split`` (``C``, as ``S``) or ``profiles``
    (``PR [b, h, n, c]`` shifted, with the column ``PW [b, h, n + 1]`` appended)."""
    select_inputs = {"fixed": [], "full": ["S"], "split": ["S", "Snew"]}[select]
    carry_inputs = {"none": [], "full": ["C"], "split": ["C", "Cnew"], "profiles": ["PR", "PW"]}[carry]
    src = (_COMPACT_BODY.replace("SELECT", "false" if select == "fixed" else "true")
           .replace("RAW_SCORE", _RAW[select]).replace("CARRY_ROWS", _PROFILE_ROWS if carry == "profiles" else "")
           .replace("CARRY", _CARRY[carry])
           .replace("THREADS", str(COMPACT_THREADS)))
    out = {"none": [], "full": ["oc"], "split": ["oc"], "profiles": ["opr"]}[carry]
    return make_spec(
        name=f"velox_compact_{select}_{carry}",
        input_names=["K", "V", "P", "knew", "vnew", "next_pos"] + select_inputs + carry_inputs,
        output_names=["ok", "ov", "op", "onext"] + out,
        source=src, header=_HEADER, dialect=dialect)


@lru_cache(maxsize=None)
def _weights_kernel(group: str, accumulate: str | None, noise: bool, dialect: str = CUDA):
    return build(_weights_spec(group, accumulate, noise, dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _attend_part_kernel(dialect: str = CUDA):
    return build(_attend_part_spec(dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _attend_combine_kernel(group: str, accumulate: str | None, dialect: str = CUDA):
    return build(_attend_combine_spec(group, accumulate, dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _attend_flash_kernel(direct: bool, dialect: str = CUDA):
    return build(_attend_flash_spec(direct, dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _attend_out_kernel(dialect: str = CUDA):
    return build(_attend_out_spec(dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _compact_kernel(select: str, carry: str, dialect: str = CUDA):
    return build(_compact_spec(select, carry, dialect=dialect), dialect)


@lru_cache(maxsize=None)
def _attend_select_kernel(group: str, accumulate: str | None, by: str, carry: bool, dialect: str = CUDA):
    return build(_attend_select_spec(group, accumulate, by, carry, dialect=dialect), dialect)


_SPECS = {"weights": _weights_spec, "select": _select_spec, "compact": _compact_spec,
          "attend_part": _attend_part_spec, "attend_combine": _attend_combine_spec,
          "attend_select": _attend_select_spec, "attend_flash": _attend_flash_spec,
          "attend_out": _attend_out_spec}
_KERNELS = {"weights": _weights_kernel, "select": _select_kernel, "compact": _compact_kernel,
            "attend_part": _attend_part_kernel, "attend_combine": _attend_combine_kernel,
            "attend_select": _attend_select_kernel, "attend_flash": _attend_flash_kernel,
            "attend_out": _attend_out_kernel}


def _spec(variant: tuple, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (``dialect="metal"``: ``mx.fast.metal_kernel``) arguments of
    ``variant``: the kernel's name (``weights``, ``select``, ``compact``) then its spec
    function's arguments, as :func:`_run_kernel` takes it."""
    kind, *args = variant
    return _SPECS[kind](*args, dialect=dialect)


def _run_kernel(variant, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch of ``variant`` (as :func:`_spec` names it); every launch of this module
    goes through here, in the dialect of this process's GPU. The tests replace it by an
    emulation."""
    kind, *args = variant
    return _KERNELS[kind](*args, dialect=active())(
        inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
        output_dtypes=output_dtypes, template=template)


@lru_cache(maxsize=None)
def _params(scale: float, decay: float, tau_init: float = 0.0, tau_end: float = 0.0,
            anneal_steps: int = 0) -> mx.array:
    """The kernels' float constants, one cached device array per setting: the logit scale,
    H2O's decay, and Keyformer's temperature schedule (its difference rounded once, as MLX
    rounds the Python float it multiplies by)."""
    anneal = anneal_steps if anneal_steps and tau_end != tau_init else 0
    return mx.array([scale, decay, tau_init, tau_end - tau_init, anneal], mx.float32)


@lru_cache(maxsize=None)
def _seed_mix(seed: int) -> mx.array:
    """The mixed seed of the counter-based draws, ``mix(seed)`` (uint32, one cached array),
    from the NumPy twin of the mixer that Keyformer's and CaM's ``mlx`` ops use (``velox.noise``)."""
    import numpy as np

    from ..noise import mix_np
    return mx.array(mix_np(np.array([seed], np.int64).astype(np.uint32)))


def weights(queries, keys, new_keys, *, old=None, accumulate: str | None = None,
            decay: float = 1.0, gumbel: dict | None = None, group: str = "mean"):
    """Attention weights of a decode step's scoring queries over the ``n + 1`` candidates.

    ``queries [b, qh, s, d]``: the update's queries (qh a multiple of the kv heads), of which
    the newest scores, or None for the key proxy (the new key is its own query); ``keys
    [b, h, n, d]`` stored, ``new_keys [b, h, 1, d]``. Returns ``(w, scores)``: ``w [b, h, n + 1]``, the softmax per
    query head in float32, averaged (``group="mean"``) or maximised (``"max"``) over each kv
    head's query heads; and, with ``accumulate``, every candidate's carried score
    ``[b, h, n + 1]`` from ``old`` (else None):

    * ``"decay"``: H2O's ``old * decay + w`` (``old [b, h, n]``; the new token's is ``w``);
    * ``"max"``: the running maximum ``max(old, w)``;
    * ``"vote_sum"`` / ``"vote_max"``: the sum / max of the stored profile columns
      ``old [b, h, n, c]`` and ``w`` (MorphKV's votes; the new token has no stored columns).

    ``gumbel`` adds Keyformer's scaled Gumbel noise to every query head's scaled logits before
    the softmax, drawn in the kernel: a dict of ``seed``, ``tau_init``, ``tau_end``,
    ``anneal_steps``, the stored ``positions [b, h, n]`` and ``next_pos [b, h]`` (the query's
    position; the draw of candidate t is a hash of the seed, t's position and the query's).
    """
    if accumulate not in (None, *_ACCUMULATE) or group not in _GROUP:
        raise ValueError(f"unknown weights variant: accumulate={accumulate!r}, group={group!r}")
    if (old is None) != (accumulate is None):
        raise ValueError("`old` and `accumulate` go together")
    b, h, n, d = keys.shape
    queries = (new_keys if queries is None else queries)[:, :, -1]
    g = queries.shape[1] // h
    shapes = [(b, h, n + 1), (b, h, g, n + 1)] + ([(b, h, n + 1)] if accumulate else [])
    params, noise = _params(d ** -0.5, decay), []
    if gumbel is not None:
        params = _params(d ** -0.5, decay, gumbel["tau_init"], gumbel["tau_end"],
                         gumbel["anneal_steps"])
        noise = [gumbel["positions"], gumbel["next_pos"], _seed_mix(gumbel["seed"])]
    out = _run_kernel(
        ("weights", group, accumulate, gumbel is not None),
        [queries, keys, new_keys, params] + ([old] if accumulate else []) + noise,
        (b * h * THREADS, 1, 1), (THREADS, 1, 1), shapes, [mx.float32] * len(shapes),
        [("HEAD_DIM", d)])
    return out[0], (out[2] if accumulate else None)


def attend_weights(queries, keys, values, new_keys, new_values, *, old=None,
                   accumulate: str | None = None, decay: float = 1.0, group: str = "mean"):
    """A decode step's attention output and its weights: ``(out, w, scores)``.

    ``queries [b, qh, 1, d]`` (the step's real queries), stored ``keys``/``values [b, h, n, d]``
    (in any slot order) and the new token's ``new_keys``/``new_values [b, h, 1, d]``. ``w`` and
    ``scores`` are :func:`weights`' (the softmax at scale ``d ** -0.5`` over the ``n + 1``
    candidates); ``out [b, qh, 1, d]`` (the values' dtype) is that softmax times the values,
    the attention over stored + new without a concatenated cache. Every stored row is a
    candidate: a state with empty slots does not come here.

    Two launches, split over the candidates as flash-decoding splits a cache: a block per
    chunk of a (batch row, kv head)'s candidates computes their logits, its chunk's softmax
    maximum and sum and its share of the output; a second launch combines the chunks into
    the weights, the carried scores and the output. The chunks are of ``MIN_CHUNK`` to
    ``CHUNK_MAX`` rows, as many as make about ``SPLIT_BLOCKS`` blocks (:func:`split_chunk`).
    """
    if accumulate not in (None, *_ACCUMULATE) or group not in _GROUP:
        raise ValueError(f"unknown weights variant: accumulate={accumulate!r}, group={group!r}")
    if (old is None) != (accumulate is None):
        raise ValueError("`old` and `accumulate` go together")
    _check_step("attend_weights", queries, keys, values, new_keys, new_values)
    b, h, n, d = keys.shape
    hq = queries.shape[1]
    if not attend_supports(d, hq // h):
        raise ValueError(f"attend_weights needs head_dim dividing {ATTEND_THREADS} and at most {ATTEND_MAX_GROUPS} "
                         f"query heads per kv head, got head_dim {d}, {hq // h} heads")
    g, N = hq // h, n + 1
    lg, pm, ps, po, cfg, params = _attend_part(queries, keys, values, new_keys, new_values, decay)
    s = pm.shape[2]
    shapes = [(b, h, N)] + ([(b, h, N)] if accumulate else []) + [(b, hq, 1, d)]
    out = _run_kernel(
        ("attend_combine", group, accumulate),
        [lg, pm, ps, po, cfg] + ([old] if accumulate else []) + ([params] if accumulate == "decay" else []),
        (b * h * s * ATTEND_THREADS, 1, 1), (ATTEND_THREADS, 1, 1), shapes,
        [mx.float32] * (len(shapes) - 1) + [values.dtype], [("HEAD_DIM", d)])
    return out[-1], out[0], (out[1] if accumulate else None)


def _check_step(name: str, queries, keys, values, new_keys, new_values, **more) -> None:
    """Refuse a decode step's arrays of the wrong shapes: one query token, the values shaped as
    the keys, one new key and value row per (batch row, kv head), query heads a multiple of the
    kv heads, and each of ``more`` (``name=(array, shape)``) of its shape."""
    b, h, n, d = keys.shape
    if (queries.shape[2] != 1 or values.shape != keys.shape or new_keys.shape != (b, h, 1, d)
            or new_values.shape != (b, h, 1, d) or queries.shape[1] % h
            or any(a.shape != shape for a, shape in more.values())):
        raise ValueError(f"{name}: queries {queries.shape}, keys {keys.shape}, values "
                         f"{values.shape}, new {new_keys.shape}/{new_values.shape}"
                         + "".join(f", {k} {a.shape}" for k, (a, _) in more.items()))


def _attend_part(queries, keys, values, new_keys, new_values, decay: float):
    """attend_weights' first launch: ``(lg, pm, ps, po, cfg, params)``, the logits, each
    chunk's softmax maximum, sum and unnormalised output, and the constants the second
    launch reads."""
    b, h, n, d = keys.shape
    g, N = queries.shape[1] // h, n + 1
    ch = split_chunk(N, b * h)
    s = -(-N // ch)
    cfg, params = _cfg(ch), _params(d ** -0.5, decay)
    # the newest query; a decode step's one query as it is (the same elements in the same
    # order: a slice would add two primitives to the step's graph)
    newest = queries if queries.shape[2] == 1 else queries[:, :, -1]
    lg, pm, ps, po = _run_kernel(
        ("attend_part",), [newest, keys, new_keys, values, new_values, params, cfg],
        (b * h * s * ATTEND_THREADS, 1, 1), (ATTEND_THREADS, 1, 1),
        [(b, h, g, N), (b, h, s, g), (b, h, s, g), (b, h, s, g, d)], [mx.float32] * 4,
        [("HEAD_DIM", d), ("GROUPS", attend_groups(d, g)), ("UNROLL", ATTEND_UNROLL)])
    return lg, pm, ps, po, cfg, params


def attend_part_bytes(head_dim: int, groups: int) -> int:
    """The shared memory a block of attend_weights' first kernel declares at ``head_dim``,
    taking ``groups`` query heads a pass (its template ``GROUPS``): the scaled queries, a
    pass's logits of ``CHUNK_MAX`` candidates, the warps' partial outputs."""
    return 4 * (groups * head_dim + groups * CHUNK_MAX + ATTEND_THREADS // 32 * head_dim)


def attend_groups(head_dim: int, groups: int, dialect: str | None = None) -> int:
    """The query heads one pass of attend_weights' first kernel takes (its template ``GROUPS``)
    for ``groups`` query heads per kv head: up to ``ATTEND_GROUPS``, fewer where the block's
    shared memory would pass the ``dialect``'s limit (Metal's 32 KiB; default: this process's
    GPU's). On CUDA every head_dim the kernel takes fits ``min(groups, ATTEND_GROUPS)``."""
    limit = SHARED_LIMITS[dialect or active()]
    p = min(groups, ATTEND_GROUPS)
    while p > 1 and attend_part_bytes(head_dim, p) > limit:
        p -= 1
    return p


def attend_select(queries, keys, values, new_keys, new_values, positions, next_pos, *,
                  n_sink: int, recent: int, shared: bool, by: str = "weights", given=None,
                  old=None, accumulate: str | None = None, decay: float = 1.0,
                  group: str = "mean", carry: bool = False):
    """A whole decode step at a full state of slots in two launches: the step's attention
    output and the per-token rule's selection (``slack = 0``), as :func:`attend_weights`
    followed by :func:`select` decide them, without their weights between two launches.

    ``queries [b, qh, 1, d]``, stored ``keys``/``values [b, h, n, d]`` (every slot filled,
    any order), the new token's ``[b, h, 1, d]``, ``positions [b, h, n]``, ``next_pos [b, h]``
    (int32). The selection ranks every candidate by ``by``: ``"weights"`` (the step's
    attention, :func:`weights`' ``w``), ``"carried"`` (the scores ``accumulate`` carries over
    ``old``: H2O's decayed sum, KVzip's running maximum), ``"given"`` (``given [b, h, n + 1]``
    float32, e.g. key norms from MLX ops) or ``"none"`` (every candidate 0: the protected
    tokens stay, the oldest other goes); with ``shared`` a batch row's heads share one
    selection on their mean score. Returns ``(out, slot, rows_k, rows_v, positions, next_pos,
    carried)``: ``out [b, qh, 1, d]`` (the values' dtype), ``slot [b, h, 1]`` where the step's
    row goes and ``rows_*`` what is written there (the slot's own row when the new token lost),
    the positions with the slot taken, ``next_pos + 1``, and with ``carry`` the carried scores
    with the slot taken (``[b, h, n]``; else None)."""
    if (old is None) != (accumulate is None):
        raise ValueError("`old` and `accumulate` go together")
    if (given is not None) != (by == "given"):
        raise ValueError("`given` goes with by='given'")
    b, h, n, d = keys.shape
    hq = queries.shape[1]
    _check_step("attend_select", queries, keys, values, new_keys, new_values,
                positions=(positions, (b, h, n)), next_pos=(next_pos, (b, h)))
    if not attend_select_supports(h, d, hq // h, shared):
        raise ValueError(f"attend_select takes head_dim dividing {ATTEND_THREADS}, at most "
                         f"{ATTEND_MAX_GROUPS} query heads per kv head and {SELECT_THREADS} query heads "
                         f"per selection; got head_dim {d}, {hq // h} heads, {h} kv heads (shared={shared})")
    g, N = hq // h, n + 1
    spec = (group, accumulate, by, carry)
    _attend_select_spec(*spec)  # refuses an unknown variant before any launch
    lg, pm, ps, po, _, params = _attend_part(queries, keys, values, new_keys, new_values, decay)
    units = b if shared else b * h
    shapes = [(b, hq, 1, d), (b, h, 1), (b, h, 1, d), (b, h, 1, d), (b, h, n), (b, h), (b, h, N)]
    dtypes = [values.dtype, mx.int32, keys.dtype, values.dtype, mx.int32, mx.int32, mx.float32]
    if accumulate:
        shapes.append((b, h, N))
        dtypes.append(mx.float32)
    if carry:
        shapes.append((b, h, n))
        dtypes.append(mx.float32)
    out = _run_kernel(
        ("attend_select", *spec),
        [lg, pm, ps, po, positions, next_pos, keys, values, new_keys, new_values]
        + ([old] if accumulate else []) + ([params] if accumulate == "decay" else [])
        + ([given] if by == "given" else []),
        (units * SELECT_THREADS, 1, 1), (SELECT_THREADS, 1, 1), shapes, dtypes,
        [("HEAD_DIM", d), ("N_SINK", n_sink), ("RECENT", recent), ("SHARED", int(shared))])
    return out[0], out[1], out[2], out[3], out[4], out[5], (out[-1] if carry else None)


def attend_select_supports(kv_heads: int, head_dim: int, groups: int, shared: bool) -> bool:
    """Whether :func:`attend_select` takes these shapes: :func:`attend_supports`', and the
    query heads of one selection (a kv head's, or a batch row's when ``shared``) within its
    block's shared arrays."""
    return attend_supports(head_dim, groups) and (kv_heads if shared else 1) * groups <= SELECT_THREADS


def attend_supports(head_dim: int, groups: int) -> bool:
    """Whether :func:`attend_weights` takes rows of ``head_dim`` with ``groups`` query heads
    per kv head (its blocks hold a row's elements in lane groups, 8 per lane, and the
    combine launch each query head's softmax in shared memory)."""
    return ATTEND_THREADS % head_dim == 0 and 1 <= groups <= ATTEND_MAX_GROUPS


def split_chunk(rows: int, units: int) -> int:
    """The candidates per block of :func:`attend_weights`' first kernel, for ``rows``
    candidates of each of ``units`` (batch row, kv head) pairs: about ``SPLIT_BLOCKS`` blocks
    in all, ``MIN_CHUNK`` to ``CHUNK_MAX`` rows each (fewer only where a unit has fewer), then
    evened out: as many chunks, of equal rows (within one)."""
    return _even_chunk(rows, units, SPLIT_BLOCKS, MIN_CHUNK, CHUNK_MAX)


def _even_chunk(rows: int, units: int, blocks: int, least: int, most: int) -> int:
    """Rows per chunk for about ``blocks`` blocks over ``units`` units of ``rows`` each,
    ``least`` to ``most`` rows a chunk (fewer only where a unit has fewer), then evened out."""
    want = max(1, -(-blocks // max(units, 1)))  # chunks per unit
    chunk = max(1, min(rows, most, max(least, -(-rows // want))))
    return -(-rows // -(-rows // chunk))  # as many chunks, of equal rows (no near-empty last one)


def attend(queries, keys, values, new_keys, new_values, *, rows: int | None = None,
           scale: float | None = None):
    """A decode step's attention output alone: ``queries [b, qh, 1, d]`` over the first
    ``rows`` slots of ``keys``/``values [b, h, n, d]`` (default all ``n``: buffers whose last
    slots are empty are read in place, no copy of a view) and the new token's ``new_keys``/
    ``new_values [b, h, 1, d]``, at ``scale`` (default ``d ** -0.5``); ``[b, qh, 1, d]`` in the
    values' dtype. The step into an empty slot of amortized eviction, which scores nothing.

    One pass over the rows (keys and values of a row read together, a running softmax per
    lane group, as flash-decoding), split over the candidates into chunks of at least
    ``FLASH_MIN_CHUNK`` rows, as many as make about ``FLASH_BLOCKS`` blocks
    (:func:`flash_chunk`); with more than one chunk a second launch combines them."""
    _check_step("attend", queries, keys, values, new_keys, new_values)
    b, h, n, d = keys.shape
    rows = n if rows is None else rows
    if not 0 <= rows <= n:
        raise ValueError(f"attend: rows {rows} of a buffer of {n}")
    hq = queries.shape[1]
    if not attend_supports(d, hq // h):
        raise ValueError(f"attend needs head_dim dividing {ATTEND_THREADS} and at most {ATTEND_MAX_GROUPS} "
                         f"query heads per kv head, got head_dim {d}, {hq // h} heads")
    g, N = hq // h, rows + 1
    ch = flash_chunk(N, b * h)
    s = -(-N // ch)
    inputs = [queries, keys, new_keys, values, new_values, _params(d ** -0.5 if scale is None else scale, 1.0),
              _cfg(ch, rows)]
    template = [("HEAD_DIM", d), ("GROUPS", min(g, ATTEND_GROUPS)), ("UNROLL", FLASH_UNROLL)]
    grid = (b * h * s * ATTEND_THREADS, 1, 1), (ATTEND_THREADS, 1, 1)
    if s == 1:
        return _run_kernel(("attend_flash", True), inputs, *grid, [(b, hq, 1, d)], [values.dtype], template)[0]
    pm, ps, po = _run_kernel(("attend_flash", False), inputs, *grid,
                             [(b, h, s, g), (b, h, s, g), (b, h, s, g, d)], [mx.float32] * 3, template)
    return _run_kernel(("attend_out",), [pm, ps, po], (b * h * ATTEND_THREADS, 1, 1), (ATTEND_THREADS, 1, 1),
                       [(b, hq, 1, d)], [values.dtype], [("HEAD_DIM", d)])[0]


def flash_chunk(rows: int, units: int) -> int:
    """The candidates per block of :func:`attend`'s first kernel, for ``rows`` candidates of
    each of ``units`` (batch row, kv head) pairs: about ``FLASH_BLOCKS`` blocks in all, at
    least ``FLASH_MIN_CHUNK`` rows each (fewer only where a unit has fewer), evened out."""
    return _even_chunk(rows, units, FLASH_BLOCKS, FLASH_MIN_CHUNK, rows)


@lru_cache(maxsize=None)
def _cfg(chunk: int, rows: int = 0) -> mx.array:
    """The split's chunk size (and :func:`attend`'s stored rows) as the kernels read them (one
    cached int32 device array)."""
    return mx.array([chunk, rows], mx.int32)


def _pair(x):
    """``(arrays, mode)`` of a selection or carried argument: one ``[b, h, n + 1]`` array, or
    the stored rows' ``[b, h, n]`` and the new token's ``[b, h, 1]`` apart."""
    if x is None:
        return [], "none"
    if isinstance(x, (tuple, list)):
        return list(x), "split"
    return [x], "full"


def compact(keys, values, positions, new_keys, new_values, next_pos, *, drop: int | None = None,
            by=None, carry=None, profiles=None, chunk_size: int = 1, shared: bool = False,
            n_sink: int = 0, recent: int = 0):
    """Keys, values, positions with one of each row's ``n + 1`` candidates (stored ++ new)
    left out, ``next_pos + 1``, and the compacted ``carry`` or ``profiles`` when given.

    The loser is ``drop`` (the same candidate index in every row), or the argmin of ``by``
    (a candidate's score; with ``chunk_size > 1`` the mean over its chunk, the candidates of
    equal ``position // chunk_size``; averaged over the heads of a batch row when ``shared``),
    the first ``n_sink`` and last ``recent`` candidates protected, the older of equal scores
    going first. ``by`` and ``carry`` (float32) are ``[b, h, n + 1]`` arrays or
    ``(stored [b, h, n], new [b, h, 1])`` pairs; ``profiles`` is ``(stored [b, h, n, c],
    column [b, h, n + 1])``: each kept row's ``c`` stored columns shift left by one and the
    candidate's new column is appended (the new row's stored columns are zeros).
    """
    b, h, n, d = keys.shape
    if (drop is None) == (by is None):
        raise ValueError("give the loser as exactly one of `drop` and `by`")
    if carry is not None and profiles is not None:
        raise ValueError("`carry` and `profiles` do not go together")
    sel, select = _pair(by)
    if drop is not None:
        select = "fixed"
    extra, mode = _pair(carry)
    shapes = [keys.shape, values.shape, positions.shape, next_pos.shape]
    dtypes = [keys.dtype, values.dtype, positions.dtype, next_pos.dtype]
    if profiles is not None:
        extra, mode = list(profiles), "profiles"
        shapes.append(profiles[0].shape)
        dtypes.append(mx.float32)
    elif mode != "none":
        shapes.append(positions.shape)
        dtypes.append(mx.float32)
    chunks = max(1, -(-n * d // COMPACT_SPAN))
    return _run_kernel(
        ("compact", select, mode),
        [keys, values, positions, new_keys, new_values, next_pos] + sel + extra,
        (b * h * chunks * COMPACT_THREADS, 1, 1), (COMPACT_THREADS, 1, 1), shapes, dtypes,
        [("CHUNKS", chunks), ("FIXED_DROP", 0 if drop is None else drop),
         ("UNIT_HEADS", h if shared else 1), ("N_SINK", n_sink), ("RECENT", recent),
         ("CHUNK_SIZE", chunk_size)])

"""Fused CUDA kernels for a decode step of the per-step evictors (through ``mx.fast.cuda_kernel``).

A decode step at a full cache drops exactly one of the ``n + 1`` candidates per selection.
With vectorised MLX ops that step is a chain of ~20 small primitives, and on a GPU each one
costs launch and bookkeeping time that dwarfs its work at decode sizes. Two kernels do it:

* ``weights``: one block per (batch row, kv head); a warp per candidate computes the scaled
  float32 logits of the kv head's query heads against the stored and new keys (lanes across
  head_dim, warp-reduced), optionally plus a per-candidate bias (Keyformer's noise), then the
  softmax per query head and the mean over them; H2O's variant adds the decayed old scores
  (``old * decay + w``).
* ``compact``: a few blocks per (batch row, kv head); each finds the row's loser (a given
  candidate, or the argmin of the weights or scores, averaged over the heads of a batch row
  when the layer keeps one token set, protected slots left out, the older of equal scores
  going first) and moves its share of the kept rows of keys, values, positions (and scores)
  into place, the new row last; ``next_pos`` advances. The scores may come from MLX ops
  (KNorm's key norms, Q-Filters' projections).

StreamingLLM's loser is fixed, so its step is ``compact`` alone, as are KNorm's and
Q-Filters' after their scores. MLX compiles each kernel at its first launch and caches it
per template values and dtypes; ``weights`` takes head_dim as one, so each lane's loads of a
key row unroll and issue together.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

__all__ = ["weights", "compact"]

THREADS = 1024  # threads per block of the weights kernel (a power of two)
COMPACT_THREADS = 256  # threads per block of the compact kernel (a power of two)
COMPACT_SPAN = 8 * COMPACT_THREADS  # elements of a row's keys a compact block moves

# Block-wide reductions (max, sum, argmin) through shared memory; every lane gets the result.
_HEADER = """
struct VeloxMax { __device__ float operator()(float a, float b) const { return a > b ? a : b; } };
struct VeloxSum { __device__ float operator()(float a, float b) const { return a + b; } };
template <int NT, typename Op>
__device__ float velox_block_reduce(float v, float* red, Op op) {
    const unsigned int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w) red[tid] = op(red[tid], red[tid + w]);
        __syncthreads();
    }
    const float r = red[0];
    __syncthreads();
    return r;
}
// (value, index) minimum; an index of `none` is empty; ties go to the lower index
template <int NT>
__device__ int velox_block_argmin(float v, int i, int none, float* red, int* red_i) {
    const unsigned int tid = threadIdx.x;
    red[tid] = v;
    red_i[tid] = i;
    __syncthreads();
    for (int w = NT / 2; w > 0; w >>= 1) {
        if ((int)tid < w) {
            const float ov = red[tid + w];
            const int oi = red_i[tid + w];
            if (oi != none && (red_i[tid] == none || ov < red[tid] || (ov == red[tid] && oi < red_i[tid]))) {
                red[tid] = ov;
                red_i[tid] = oi;
            }
        }
        __syncthreads();
    }
    const int r = red_i[0];
    __syncthreads();
    return r;
}
"""

# One block per (batch row, kv head): the G query heads' float32 logits over the n stored and
# the new key (a warp per candidate, lanes across head_dim), softmax per query head, mean over
# the G heads -> w; H2O's variant writes the accumulated scores old * decay + w instead.
_WEIGHTS_BODY = """
    const unsigned int tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const size_t bh = blockIdx.x;
    const int H = K_shape[1];
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const int QH = q_shape[1];
    const int G = QH / H;
    const size_t bi = bh / H, hk = bh % H;
    const float scale = params[0];
    const float inf = __int_as_float(0x7f800000);
    __shared__ float red[THREADS];
    float* l = lg + bh * G * N;
    for (int t = warp; t < N; t += THREADS / 32) {
        const size_t ko = t < n ? (bh * n + t) * d : bh * d;
        for (int j = 0; j < G; ++j) {
            const size_t qo = (bi * QH + hk * G + j) * d;
            float acc = 0.0f;
            #pragma unroll
            for (int c = lane; c < HEAD_DIM; c += 32) {
                const float kc = t < n ? static_cast<float>(K[ko + c]) : static_cast<float>(knew[ko + c]);
                acc += (static_cast<float>(q[qo + c]) * scale) * kc;
            }
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (lane == 0) l[(size_t)j * N + t] = acc BIAS;
        }
    }
    __syncthreads();
    float* ws = WEIGHTS_OUT + bh * N;
    for (int j = 0; j < G; ++j) {
        const float* lj = l + (size_t)j * N;
        float m = -inf;
        for (int t = tid; t < N; t += THREADS) m = lj[t] > m ? lj[t] : m;
        m = velox_block_reduce<THREADS>(m, red, VeloxMax());
        float se = 0.0f;
        for (int t = tid; t < N; t += THREADS) se += expf(lj[t] - m);
        const float inv = 1.0f / velox_block_reduce<THREADS>(se, red, VeloxSum());
        for (int t = tid; t < N; t += THREADS) {
            const float p = expf(lj[t] - m) * inv;
            ws[t] = j == 0 ? p : ws[t] + p;
        }
    }
    for (int t = tid; t < N; t += THREADS) {
        ws[t] = ws[t] / (float)G;
        ACCUMULATE
    }
"""

_ACCUMULATE = "ws[t] += t < n ? old[bh * n + t] * params[1] : 0.0f;"

# CHUNKS blocks per (batch row, kv head), each finding the unit's loser (given, or the argmin
# of the unit's scores with the first N_SINK and last RECENT candidates protected; every block
# of a row finds the same one) and moving its share of the kept rows of keys, values,
# positions (scores) into place, the new row last; next_pos advanced.
_COMPACT_BODY = """
    const unsigned int tid = threadIdx.x;
    const size_t bh = blockIdx.x / CHUNKS;
    const int chunk = blockIdx.x % CHUNKS;
    const int H = K_shape[1];
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const size_t bi = bh / H;
    __shared__ float red[THREADS];
    __shared__ int red_i[THREADS];
    int drop;
    if (SELECT) {
        float best = 0.0f;
        int best_i = N;
        for (int t = tid; t < N; t += THREADS) {
            if (t < N_SINK || t >= N - RECENT) continue;
            float s;
            if (UNIT_HEADS == 1) {
                s = SCORE_OF(bh);
            } else {
                s = 0.0f;
                for (int hh = 0; hh < H; ++hh) s += SCORE_OF(bi * H + hh);
                s = s / (float)H;
            }
            if (best_i == N || s < best) { best = s; best_i = t; }
        }
        drop = velox_block_argmin<THREADS>(best, best_i, N, red, red_i);
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
        COMPACT_SCORES
    }
    if (tid == 0 && chunk == 0) onext[bh] = next_pos[bh] + 1;
"""

_COMPACT = "os_[rows + i] = S[bh * N + src];"


def _weights_spec(accumulate: bool, biased: bool) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of a ``weights`` variant."""
    return dict(
        name="velox_weights" + ("_acc" if accumulate else "") + ("_bias" if biased else ""),
        input_names=["q", "K", "knew", "params"] + (["old"] if accumulate else [])
        + (["bias"] if biased else []),
        output_names=["scores" if accumulate else "w", "lg"],
        source=_WEIGHTS_BODY.replace("ACCUMULATE", _ACCUMULATE if accumulate else "")
                            .replace("BIAS", "+ bias[bh * N + t]" if biased else "")
                            .replace("WEIGHTS_OUT", "scores" if accumulate else "w")
                            .replace("THREADS", str(THREADS)),
        header=_HEADER)


def _compact_spec(mode: str) -> dict:
    """The ``mx.fast.cuda_kernel`` arguments of a ``compact`` variant. ``mode``: ``fixed``
    (the loser is a template value), ``weights`` (argmin of ``w``) or ``scores`` (argmin of
    H2O's scores, which are compacted too)."""
    score_input = {"fixed": [], "weights": ["w"], "scores": ["S"]}[mode]
    score_of = {"fixed": "0.0f", "weights": "w[(X) * N + t]", "scores": "S[(X) * N + t]"}[mode]
    src = (_COMPACT_BODY.replace("SELECT", "false" if mode == "fixed" else "true")
           .replace("COMPACT_SCORES", _COMPACT if mode == "scores" else "")
           .replace("THREADS", str(COMPACT_THREADS)))
    return dict(
        name=f"velox_compact_{mode}",
        input_names=["K", "V", "P", "knew", "vnew", "next_pos"] + score_input,
        output_names=["ok", "ov", "op", "onext"] + (["os_"] if mode == "scores" else []),
        source=src, header=_HEADER + f"#define SCORE_OF(X) ({score_of})\n")


@lru_cache(maxsize=None)
def _weights_kernel(accumulate: bool, biased: bool):
    return mx.fast.cuda_kernel(**_weights_spec(accumulate, biased))


@lru_cache(maxsize=None)
def _compact_kernel(mode: str):
    return mx.fast.cuda_kernel(**_compact_spec(mode))


@lru_cache(maxsize=None)
def _params(scale: float, decay: float) -> mx.array:
    return mx.array([scale, decay], mx.float32)


def weights(queries, keys, new_keys, *, old_scores=None, decay: float = 1.0, bias=None):
    """Attention weights of a decode step's scoring queries over the ``n + 1`` candidates.

    ``queries [b, qh, d]`` (qh a multiple of the kv heads), ``keys [b, h, n, d]`` stored,
    ``new_keys [b, h, 1, d]``. Returns ``w [b, h, n + 1]`` (softmax per query head in
    float32, averaged over each kv head's query heads) and, with ``old_scores [b, h, n]``,
    H2O's accumulated scores ``old * decay + w`` of every candidate in place of ``w``
    (``(None, scores)``). ``bias [b, h, n + 1]`` (float32) is added to every query head's
    scaled logits before the softmax (Keyformer's scaled Gumbel noise).
    """
    b, h, n, d = keys.shape
    g = queries.shape[1] // h
    accumulate = old_scores is not None
    shapes = [(b, h, n + 1), (b, h, g, n + 1)]
    out = _weights_kernel(accumulate, bias is not None)(
        inputs=[queries, keys, new_keys, _params(d ** -0.5, decay)]
        + ([old_scores] if accumulate else []) + ([bias] if bias is not None else []),
        grid=(b * h * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=shapes, output_dtypes=[mx.float32] * len(shapes),
        template=[("HEAD_DIM", d)])
    return (None, out[0]) if accumulate else (out[0], None)


def compact(keys, values, positions, new_keys, new_values, next_pos, *, drop: int | None = None,
            weights=None, scores=None, shared: bool = False, n_sink: int = 0, recent: int = 0):
    """Keys, values, positions (and scores) with one of each row's ``n + 1`` candidates
    (stored ++ new) left out, and ``next_pos + 1``.

    The loser is ``drop`` (the same candidate index in every row), or the argmin of
    ``weights [b, h, n + 1]`` (averaged over the heads of a batch row when ``shared``), or of
    ``scores [b, h, n + 1]`` (which are compacted as well), the first ``n_sink`` and last
    ``recent`` candidates protected; the older of equal scores goes.
    """
    b, h, n, d = keys.shape
    mode = "fixed" if drop is not None else ("scores" if scores is not None else "weights")
    extra = {"fixed": [], "weights": [weights], "scores": [scores]}[mode]
    shapes = [keys.shape, values.shape, positions.shape, next_pos.shape]
    dtypes = [keys.dtype, values.dtype, positions.dtype, next_pos.dtype]
    if mode == "scores":
        shapes.append(positions.shape)
        dtypes.append(mx.float32)
    chunks = max(1, -(-n * d // COMPACT_SPAN))
    return _compact_kernel(mode)(
        inputs=[keys, values, positions, new_keys, new_values, next_pos] + extra,
        grid=(b * h * chunks * COMPACT_THREADS, 1, 1), threadgroup=(COMPACT_THREADS, 1, 1),
        output_shapes=shapes, output_dtypes=dtypes,
        template=[("CHUNKS", chunks), ("FIXED_DROP", 0 if drop is None else drop),
                  ("UNIT_HEADS", h if shared else 1), ("N_SINK", n_sink), ("RECENT", recent)])

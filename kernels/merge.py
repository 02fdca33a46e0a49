"""Fused CUDA kernels for CaM's decode step: H2O's eviction with the loser merged into kept rows.

After the ``weights`` kernel of :mod:`velox.kernels.evict` has accumulated every candidate's
score (``old * decay + w``), two kernels finish the step:

* ``plan``: one block per (batch row, kv head). It finds the loser (the lightest unprotected
  candidate, the older of equal scores), the new key's norm, and the merge: the target (the
  non-sink survivor whose key is most cosine-similar to the loser's, a warp per survivor, the
  first of equal cosines; or, with ``window``, the ``m <= merge_window`` survivors after the
  loser), the weight (``clip(cos, 0, 1)``, ``1`` or ``1 / m``), the gate (a Bernoulli draw
  with probability ``min(1, A_e / mean A over the targets)`` from the counter-based hash of
  the seed and the loser's position; a loser with a non-finite key, value or score, or with no
  target of finite cosine, is not merged) and, when keys merge, the merged keys' norms. It writes
  a small plan: ``iplan [b, h, 3]`` = (loser, first target slot, targets merged) and
  ``fplan [b, h, 3 + t]`` = (weight, score moved to each target, new key's norm, the ``t``
  merged keys' norms).
* ``compact``: a few blocks per (batch row, kv head) move their share of the kept rows as
  :func:`velox.kernels.evict.compact` does, and write each target row merged in float32
  (``(x + w x_e) / (1 + w)``, or ``x + x_e / m`` for ``window``; keys too with
  ``merge_keys``), each operation rounded on its own as MLX's separate ops round it; scores
  (plus the moved score at the targets) and key norms (the merged ones at the targets) follow.

The arithmetic follows the ``mlx`` backend's dense merge; cosines, norms and the window's mean
score are summed in another order than MLX's reductions, so a merged row may differ from the
``mlx`` backend's in its last bit.
"""

from __future__ import annotations

import re
from functools import lru_cache

import mlx.core as mx

from . import build
from .dialect import CUDA, active, make_spec

from .evict import _HEADER, COMPACT_SPAN, COMPACT_THREADS, THREADS, _seed_mix

__all__ = ["merge_step", "MODES"]

MODES = {"sim_weighted": 0, "mean": 1, "window": 2, "drop": 3}

_MERGE_HEADER = _HEADER + """
template <typename T> VX_FN float velox_round_as(const VX_IN T*, float x) { return static_cast<float>(static_cast<T>(x)); }
template <typename T> VX_FN void velox_store(VX_DEVICE T* p, float x) { *p = static_cast<T>(x); }
// a target row's element merged with the loser's: x + w x_e (window), else (x + w x_e) / (1 + w)
template <int MODE> VX_FN float velox_merged(float x, float xe, float w) {
    const float s = VX_FADD_RN(x, VX_FMUL_RN(w, xe));
    return MODE == 2 ? s : VX_FDIV_RN(s, VX_FADD_RN(1.0f, w));
}
"""

_PLAN_BODY = """
    const unsigned int tid = VX_TID, lane = tid & 31u, warp = tid >> 5;
    const size_t bh = VX_BID;
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const size_t rows = bh * n;
    VX_SHARED float red[NT];
    VX_SHARED int red_i[NT];
    VX_SHARED float lk[HEAD_DIM];
    VX_SHARED float sim_s;
    // the loser: the lightest unprotected candidate, the older of equal scores
    float best = 0.0f;
    int best_i = N;
    for (int t = tid; t < N; t += NT) {
        if (t < N_SINK || t >= N - RECENT) continue;
        const float s = velox_ranked(S[bh * N + t]);
        if (best_i == N || s < best) { best = s; best_i = t; }
    }
    const int e = velox_block_argmin<NT>(best, best_i, N, red, red_i VX_TID_ARG);
    float sq = 0.0f;
    for (int c = tid; c < d; c += NT) {
        const float x = static_cast<float>(knew[bh * d + c]);
        sq += x * x;
    }
    const float nnorm = sqrtf(velox_block_reduce<NT>(sq, red, VeloxSum() VX_TID_ARG));
    const float l_norm = e < n ? NORM[rows + e] : nnorm;
    const float l_acc = S[bh * N + e];
    const int lpos = e < n ? P[rows + e] : next_pos[bh];
    const float lscale = fmaxf(l_norm, 1e-30f);
    // a loser with a non-finite key, value or score is dropped, never merged
    float bad = isfinite(l_acc) ? 0.0f : 1.0f;
    for (int c = tid; c < d; c += NT) {
        lk[c] = e < n ? static_cast<float>(K[(rows + e) * d + c]) : static_cast<float>(knew[bh * d + c]);
        const float lv = e < n ? static_cast<float>(V[(rows + e) * d + c]) : static_cast<float>(vnew[bh * d + c]);
        if (!isfinite(lk[c]) || !isfinite(lv)) bad = 1.0f;
    }
    const bool fine = velox_block_reduce<NT>(bad, red, VeloxMax() VX_TID_ARG) == 0.0f;
    int tfirst = 0, m = 0;
    float den = 0.0f, wgt = 0.0f;
    if (MODE == 2) {  // the survivors after the loser (slot j >= e is candidate j + 1)
        tfirst = e;
        m = WINDOW < n - e ? WINDOW : n - e;
        float tot = 0.0f;
        for (int j = 0; j < m; ++j) tot += S[bh * N + e + j + 1];
        den = tot / fmaxf((float)m, 1.0f);
        wgt = 1.0f / fmaxf((float)m, 1.0f);
    } else if (MODE != 3) {  // the non-sink survivor of the most similar key (a warp each)
        float bc = 0.0f;
        int bj = n;
        for (int j = N_SINK + (int)warp; j < n; j += NT / 32) {
            const int c = j < e ? j : j + 1;
            float acc = 0.0f;
            #pragma unroll
            for (int x = lane; x < HEAD_DIM; x += 32) {
                const float kx = c < n ? static_cast<float>(K[(rows + c) * d + x]) : static_cast<float>(knew[bh * d + x]);
                acc += (lk[x] / lscale) * kx;
            }
            for (int off = 16; off > 0; off >>= 1) acc += VX_SHFL_XOR(acc, off);
            const float cs = velox_ranked(acc / fmaxf(c < n ? NORM[rows + c] : nnorm, 1e-30f));
            if (bj == n || cs > bc) { bc = cs; bj = j; }
        }
        const int jt = velox_block_argmin<NT>(-bc, bj, n, red, red_i VX_TID_ARG);
        if (lane == 0 && bj == jt && jt < n) sim_s = bc;
        VX_BARRIER;
        if (jt < n && sim_s > -VX_INT_AS_FLOAT(0x7f800000)) {  // a target of finite cosine
            tfirst = jt;
            m = 1;
            den = S[bh * N + (jt < e ? jt : jt + 1)];
            wgt = MODE == 0 ? fminf(fmaxf(sim_s, 0.0f), 1.0f) : 1.0f;
        }
    }
    bool on = m > 0 && fine;
    if (MERGE_GATE && on) {
        const float u = velox_unit(velox_mix(seedmix[0] ^ (unsigned int)lpos));
        const float prob = l_acc >= den ? 1.0f : l_acc / fmaxf(den, 1e-30f);
        on = u < prob;
    }
    const float w = on ? wgt : 0.0f;
    const int count = MODE == 2 ? (on ? m : 0) : (w > 0.0f ? 1 : 0);
    if (tid == 0) {
        iplan[bh * 3] = e;
        iplan[bh * 3 + 1] = tfirst;
        iplan[bh * 3 + 2] = count;
        fplan[bh * FW] = w;
        fplan[bh * FW + 1] = MODE == 2 ? w * l_acc : l_acc;
        fplan[bh * FW + 2] = nnorm;
    }
    if (MERGE_KEYS) {  // the merged keys' norms, as the state will hold them (a warp each)
        for (int r = (int)warp; r < count; r += NT / 32) {
            const int j = tfirst + r, c = j < e ? j : j + 1;
            float acc = 0.0f;
            #pragma unroll
            for (int x = lane; x < HEAD_DIM; x += 32) {
                const float kx = c < n ? static_cast<float>(K[(rows + c) * d + x]) : static_cast<float>(knew[bh * d + x]);
                const float mk = velox_round_as(K, velox_merged<MODE>(kx, lk[x], w));
                acc += mk * mk;
            }
            for (int off = 16; off > 0; off >>= 1) acc += VX_SHFL_XOR(acc, off);
            if (lane == 0) fplan[bh * FW + 3 + r] = sqrtf(acc);
        }
    }
"""

_COMPACT_BODY = """
    const unsigned int tid = VX_TID;
    const size_t bh = VX_BID / CHUNKS;
    const int chunk = VX_BID % CHUNKS;
    const int n = K_shape[2];
    const int d = K_shape[3];
    const int N = n + 1;
    const size_t rows = bh * n;
    const int drop = iplan[bh * 3], tfirst = iplan[bh * 3 + 1], count = iplan[bh * 3 + 2];
    const float w = fplan[bh * FW], moved = fplan[bh * FW + 1], nnorm = fplan[bh * FW + 2];
    const int span = (n * d + CHUNKS - 1) / CHUNKS, first = chunk * span;
    const int last = first + span < n * d ? first + span : n * d;
    for (int x = first + tid; x < last; x += NT) {
        const int i = x / d, c = x % d;
        const int src = i < drop ? i : i + 1;
        const bool target = i >= tfirst && i < tfirst + count;
        if (!target) {
            ok[rows * d + x] = src == n ? knew[bh * d + c] : K[(rows + src) * d + c];
            ov[rows * d + x] = src == n ? vnew[bh * d + c] : V[(rows + src) * d + c];
            continue;
        }
        const float xv = static_cast<float>(src == n ? vnew[bh * d + c] : V[(rows + src) * d + c]);
        const float lv = static_cast<float>(drop == n ? vnew[bh * d + c] : V[(rows + drop) * d + c]);
        velox_store(ov + rows * d + x, velox_merged<MODE>(xv, lv, w));
        if (MERGE_KEYS) {
            const float xk = static_cast<float>(src == n ? knew[bh * d + c] : K[(rows + src) * d + c]);
            const float lk = static_cast<float>(drop == n ? knew[bh * d + c] : K[(rows + drop) * d + c]);
            velox_store(ok + rows * d + x, velox_merged<MODE>(xk, lk, w));
        } else {
            ok[rows * d + x] = src == n ? knew[bh * d + c] : K[(rows + src) * d + c];
        }
    }
    const int pspan = (n + CHUNKS - 1) / CHUNKS, pfirst = chunk * pspan;
    const int plast = pfirst + pspan < n ? pfirst + pspan : n;
    for (int i = pfirst + tid; i < plast; i += NT) {
        const int src = i < drop ? i : i + 1;
        const bool target = i >= tfirst && i < tfirst + count;
        op[rows + i] = src == n ? next_pos[bh] : P[rows + src];
        oc[rows + i] = target ? S[bh * N + src] + moved : S[bh * N + src];
        onorm[rows + i] = target && MERGE_KEYS ? fplan[bh * FW + 3 + (i - tfirst)]
                                               : (src < n ? NORM[rows + src] : nnorm);
    }
    if (tid == 0 && chunk == 0) onext[bh] = next_pos[bh] + 1;
"""


def _plan_spec(*, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (or ``metal_kernel``, :mod:`velox.kernels.dialect`)
    arguments of the ``plan`` kernel."""
    return make_spec(name="velox_merge_plan",
                     input_names=["S", "K", "knew", "V", "vnew", "NORM", "P", "next_pos", "seedmix"],
                     output_names=["iplan", "fplan"],
                     source=re.sub(r"\bNT\b", str(THREADS), _PLAN_BODY), header=_MERGE_HEADER,
                     dialect=dialect)


def _compact_spec(*, dialect: str = CUDA) -> dict:
    """The ``mx.fast.cuda_kernel`` (or ``metal_kernel``) arguments of the merging ``compact``
    kernel."""
    return make_spec(name="velox_merge_compact",
                     input_names=["K", "V", "P", "knew", "vnew", "next_pos", "S", "NORM", "iplan", "fplan"],
                     output_names=["ok", "ov", "op", "onext", "oc", "onorm"],
                     source=re.sub(r"\bNT\b", str(COMPACT_THREADS), _COMPACT_BODY),
                     header=_MERGE_HEADER, dialect=dialect)


def _spec(which: str, dialect: str = CUDA) -> dict:
    """The arguments of the ``plan`` or ``compact`` kernel in ``dialect``."""
    return _plan_spec(dialect=dialect) if which == "plan" else _compact_spec(dialect=dialect)


@lru_cache(maxsize=None)
def _kernel(which: str, dialect: str = CUDA):
    return build(_spec(which, dialect), dialect)


def _run_kernel(which, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch of the ``plan`` or ``compact`` kernel (``which``), in the dialect of this
    process's GPU; every launch of this module goes through here."""
    return _kernel(which, active())(inputs=inputs, grid=grid, threadgroup=threadgroup,
                                    output_shapes=output_shapes, output_dtypes=output_dtypes,
                                    template=template)


def merge_step(keys, values, positions, new_keys, new_values, next_pos, scores, key_norms, *,
               merge: str, merge_keys: bool, merge_gate: bool, merge_window: int, seed: int,
               n_sink: int, recent: int):
    """CaM's decode step at a full cache after the scores: ``scores [b, h, n + 1]`` (H2O's
    accumulated scores of the stored ++ new candidates), ``key_norms [b, h, n]`` of the stored
    keys. Returns keys, values, positions, ``next_pos + 1``, scores and key norms of the kept
    (merged) rows; the first ``n_sink`` and the last ``recent`` candidates are protected."""
    if merge not in MODES:
        raise ValueError(f"unknown merge rule {merge!r}; one of {sorted(MODES)}")
    b, h, n, d = keys.shape
    mode = MODES[merge]
    width = 3 + ((merge_window if mode == 2 else 1) if merge_keys and mode != 3 else 0)
    common = [("MODE", mode), ("MERGE_KEYS", int(bool(merge_keys) and mode != 3)), ("FW", width)]
    iplan, fplan = _run_kernel(
        "plan", [scores, keys, new_keys, values, new_values, key_norms, positions, next_pos,
                 _seed_mix(seed)],
        (b * h * THREADS, 1, 1), (THREADS, 1, 1), [(b, h, 3), (b, h, width)], [mx.int32, mx.float32],
        [("HEAD_DIM", d), ("N_SINK", n_sink), ("RECENT", recent), ("WINDOW", merge_window),
         ("MERGE_GATE", int(bool(merge_gate)))] + common)
    chunks = max(1, -(-n * d // COMPACT_SPAN))
    return _run_kernel(
        "compact", [keys, values, positions, new_keys, new_values, next_pos, scores, key_norms,
                    iplan, fplan],
        (b * h * chunks * COMPACT_THREADS, 1, 1), (COMPACT_THREADS, 1, 1),
        [keys.shape, values.shape, positions.shape, next_pos.shape, positions.shape, positions.shape],
        [keys.dtype, values.dtype, positions.dtype, next_pos.dtype, mx.float32, mx.float32],
        [("CHUNKS", chunks)] + common)

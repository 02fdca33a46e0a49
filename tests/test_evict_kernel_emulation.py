"""The eviction decode kernels (``velox.kernels.evict``) emulated on the CPU.

The ``cuda`` backend's attended decode step runs two kernels only an NVIDIA GPU launches:
``attend_weights`` (the step's attention output with the scores, from one softmax) and
``select`` (the loser, the slot's row, the positions and carried scores). Here their very
sources run as C++ on the CPU through the module's one launch function (``_run_kernel``):
``test_codec_kernel``'s emulation prelude, with the threads of a block as fibers of one
thread (a fiber per CUDA thread, switched at ``__syncthreads`` and at the warp shuffles, so a
1024-thread block costs microseconds per barrier, not an OS thread switch per thread), blocks
one after another, shared memory as static storage. Three checks:

* ``attend_weights`` (mean and max over a kv head's query heads, with and without H2O's
  decayed sum): the output equals ``mx.fast.scaled_dot_product_attention`` over stored + new,
  ``w`` and the carried scores the MLX score functions';
* ``select``, given the ``mlx`` scores, decides as the ``mlx`` slot step (``with_move``):
  slot, the slot's row, positions and carried scores, over states whose slots are out of
  position order, with ties, non-finite scores, a losing new token, shared and per-head
  selections, sinks and recent tokens protected;
* end to end: the adapter's fused decode step (``velox.decode.split_step``, compiled: ``velox.decode.compiled``) on states
  of the ``cuda`` backend gives the attention over stored + new and, its deferred row
  written, the ``mlx`` backend's state, step after step;
* ``attend_select`` (the combine and the selection in one launch) decides exactly as
  ``attend_weights`` then ``select`` do, bit for bit, through ties, non-finite scores and a
  losing new token.

Skipped without a C++20 compiler or ``ucontext`` (POSIX fibers), and on a CUDA machine, where
``tests/test_kernels.py`` runs the kernels themselves. Compiled variants are cached on disk
and in the session.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import zlib

import mlx.core as mx
import numpy as np
import pytest

from tests import test_codec_kernel as tck
from velox import evict
from velox import decode
from velox.attention import candidate_weights, scoring_queries
from velox.backend import device_supports
from velox.heavy_hitters import heavy_hitter_scores
from velox.kernels import evict as ev
from velox.kernels import nvrtc
from velox.methods import knorm, tova
from velox.registry import get_method

pytestmark = [
    tck.needs_cxx,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fibers use glibc's ucontext"),
    pytest.mark.skipif(device_supports("cuda"), reason="the GPU tests run the kernels themselves"),
]

# --- the emulation ---------------------------------------------------------------------------

# test_codec_kernel's prelude runs a thread per CUDA thread with a std::barrier; here the
# threads of a block are fibers of one OS thread. A fiber waiting at a barrier yields to the
# scheduler, which resumes every unfinished fiber in turn (threadIdx set to the fiber's).
_THREAD_SYNC = "static inline void __syncthreads() { velox_bar->arrive_and_wait(); }"
_FIBERS = r"""
#include <ucontext.h>
#include <cstdlib>
static ucontext_t velox_main;
static ucontext_t* velox_ctx = nullptr;
static int velox_cur = 0;
static long velox_moves = 0;  // barrier arrivals and finished fibers: the scheduler's progress
static inline void velox_yield() { swapcontext(&velox_ctx[velox_cur], &velox_main); }
struct velox_fbar { int count; unsigned int gen; };
static inline void velox_fbar_wait(velox_fbar& b, int parties) {
    const unsigned int g = b.gen;
    ++velox_moves;
    if (++b.count == parties) { b.count = 0; ++b.gen; return; }
    while (b.gen == g) velox_yield();
}
static velox_fbar velox_block_bar = {0, 0};
static velox_fbar velox_warp_bar[32] = {};
static float velox_lanes[1024];
static inline void __syncthreads() { velox_fbar_wait(velox_block_bar, (int)blockDim.x); }
// a warp's exchange: every lane of the warp writes, waits for the warp, reads its partner's,
// waits again (so no lane overwrites a value before its partner read it)
static inline float __shfl_xor_sync(unsigned int, float v, int off) {
    const unsigned int t = threadIdx.x;
    velox_lanes[t] = v;
    velox_fbar_wait(velox_warp_bar[t >> 5], 32);
    const float r = velox_lanes[t ^ (unsigned int)off];
    velox_fbar_wait(velox_warp_bar[t >> 5], 32);
    return r;
}
static inline float __fdiv_rn(float a, float b) { return a / b; }
"""
_STACK = 1 << 16  # bytes of stack per fiber
_EMU_DIR = os.path.join(tempfile.gettempdir(), "velox_evict_kernel_emu")
_LIBS: dict[str, ctypes.CDLL] = {}


def _prelude() -> str:
    assert _THREAD_SYNC in tck._EMU_PRELUDE
    return tck._EMU_PRELUDE.replace(_THREAD_SYNC, _FIBERS)


def _library(spec, in_dtypes, out_dtypes, template) -> ctypes.CDLL:
    """The kernel of ``spec`` compiled as C++ with a fiber launcher, ``velox_launch(blocks,
    threads, args)`` (0, or 1 if the block deadlocked: a barrier some fibers never reach)."""
    src = nvrtc.kernel_source(spec, in_dtypes, out_dtypes, template)
    assert src.startswith(nvrtc._PRELUDE)
    src = _prelude() + src[len(nvrtc._PRELUDE):]
    args, k = [], 0
    for name in spec["input_names"]:
        args.append(f"(const {nvrtc._CUDA_TYPES[in_dtypes[name]]}*)velox_args[{k}]")
        k += 1
        if f"{name}_shape" in spec["source"]:
            args.append(f"velox_shape((const int*)velox_args[{k}])")
            k += 1
    for dt in out_dtypes:
        args.append(f"({nvrtc._CUDA_TYPES[dt]}*)velox_args[{k}]")
        k += 1
    src += f"""
static void** velox_args = nullptr;
static unsigned char* velox_done = nullptr;
static void velox_entry() {{
    velox_check::{spec["name"]}({", ".join(args)});
    velox_done[velox_cur] = 1;
    ++velox_moves;
}}
extern "C" int velox_launch(int nblocks, int nt, void** a) {{
    static char* stacks = nullptr;
    static int stack_fibers = 0;
    if (nt > stack_fibers) {{
        std::free(stacks);
        stacks = (char*)std::malloc((size_t)nt * {_STACK});
        stack_fibers = nt;
    }}
    std::vector<ucontext_t> ctx(nt);
    std::vector<unsigned char> done(nt);
    velox_ctx = ctx.data();
    velox_done = done.data();
    velox_args = a;
    gridDim = {{(unsigned int)nblocks, 1, 1}};
    blockDim = {{(unsigned int)nt, 1, 1}};
    for (int b = 0; b < nblocks; ++b) {{
        blockIdx = {{(unsigned int)b, 0, 0}};
        for (int i = 0; i < nt; ++i) {{
            getcontext(&ctx[i]);
            ctx[i].uc_stack.ss_sp = stacks + (size_t)i * {_STACK};
            ctx[i].uc_stack.ss_size = {_STACK};
            ctx[i].uc_link = &velox_main;
            makecontext(&ctx[i], velox_entry, 0);
            done[i] = 0;
        }}
        int alive = nt;
        while (alive > 0) {{
            const long before = velox_moves;
            for (int i = 0; i < nt; ++i) {{
                if (done[i]) continue;
                velox_cur = i;
                threadIdx = {{(unsigned int)i, 0, 0}};
                swapcontext(&velox_main, &ctx[i]);
                if (done[i]) --alive;
            }}
            if (alive > 0 && velox_moves == before) return 1;
        }}
    }}
    return 0;
}}
"""
    key = hashlib.sha1(src.encode()).hexdigest()[:20]
    if key in _LIBS:
        return _LIBS[key]
    os.makedirs(_EMU_DIR, exist_ok=True)
    so = os.path.join(_EMU_DIR, f"{key}.so")
    if not os.path.exists(so):
        cpp = os.path.join(_EMU_DIR, f"{key}.cpp")
        with open(cpp, "w") as f:
            f.write(src)
        tmp = so + f".{os.getpid()}"
        subprocess.run([tck._CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", cpp, "-o", tmp],
                       check=True, capture_output=True)
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    lib.velox_launch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    lib.velox_launch.restype = ctypes.c_int
    _LIBS[key] = lib
    return lib


LAUNCHES: list[tuple] = []  # the variants launched, for the tests that check the path taken


def _emulated_kernel(variant, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """``velox.kernels.evict._run_kernel`` on the CPU: the same source, compiled as C++."""
    LAUNCHES.append(variant)
    return emulate(ev._spec(variant), inputs, grid, threadgroup, output_shapes, output_dtypes, template)


def emulate(spec, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """One launch of the kernel of ``spec`` (``mx.fast.cuda_kernel``'s arguments) on the CPU."""
    assert grid[1:] == threadgroup[1:] == (1, 1) and grid[0] % threadgroup[0] == 0
    ins = dict(zip(spec["input_names"], inputs, strict=True))
    lib = _library(spec, {k: tck._NAME_OF[v.dtype] for k, v in ins.items()},
                   [tck._NAME_OF[d] for d in output_dtypes], dict(template))
    keep, ptrs = [], []
    for name in spec["input_names"]:
        a = tck._to_np(ins[name])
        keep.append(a)
        ptrs.append(a.ctypes.data)
        if f"{name}_shape" in spec["source"]:
            s = np.zeros(10, np.int32)
            s[:a.ndim] = a.shape
            keep.append(s)
            ptrs.append(s.ctypes.data)
    outs = []
    for shape, dt in zip(output_shapes, output_dtypes):  # unwritten elements stay NaN (or -1)
        if dt == mx.bfloat16:
            o = np.full(shape, 0x7FC0, np.uint16)
        elif dt == mx.int32:
            o = np.full(shape, -1, np.int32)
        else:
            o = np.full(shape, np.nan, np.float32).astype(tck._NP_OF[dt])
        outs.append(o)
        ptrs.append(o.ctypes.data)
    arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
    assert lib.velox_launch(grid[0] // threadgroup[0], threadgroup[0], arr) == 0, f"{spec['name']}: deadlock"
    res = []
    for o, dt in zip(outs, output_dtypes):
        m = mx.array(o)
        res.append(m.view(mx.bfloat16) if dt == mx.bfloat16 else m)
    return res


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(ev, "_run_kernel", _emulated_kernel)
    monkeypatch.setattr(ev, "MIN_CHUNK", 32)  # small chunks: these small caches still split
    LAUNCHES.clear()
    return LAUNCHES


def _rng(*what):
    return np.random.default_rng(zlib.crc32(repr(what).encode()))


def _arr(rng, *shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# --- attend_weights ----------------------------------------------------------------------------

ATTEND_CASES = [  # b, h, g, d, n, group, accumulate
    (1, 2, 4, 64, 21, "mean", None),
    (2, 2, 2, 32, 19, "mean", "decay"),
    (1, 2, 3, 64, 20, "max", None),
    (2, 1, 2, 32, 23, "max", "decay"),
    (1, 2, 4, 64, 100, "mean", "decay"),  # 101 candidates: chunks of 26, 26, 26 and 23
    (1, 1, 10, 32, 70, "max", "max"),  # 10 query heads: passes of 8 and 2, chunks of 24, 24, 23
]


@pytest.mark.parametrize("case", ATTEND_CASES, ids=str)
def test_attend_weights_match_attention_and_the_scores(case, emulated):
    b, h, g, d, n, group, accumulate = case
    rng = _rng("attend", case)
    q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, n, d), _arr(rng, b, h, n, d)
    kn, vn = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
    old = mx.array(rng.random((b, h, n)).astype(np.float32)) if accumulate else None
    out, w, scores = ev.attend_weights(q, k, v, kn, vn, old=old, accumulate=accumulate, decay=0.9,
                                       group=group)
    assert emulated == [("attend_part",), ("attend_combine", group, accumulate)]
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, kn], axis=2),
                                                mx.concatenate([v, vn], axis=2), scale=d ** -0.5)
    assert out.shape == want.shape and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
    p = candidate_weights(scoring_queries(kn, q)[:, :, :, -1:], k, kn)[:, :, :, 0]  # [b, h, g, n + 1]
    ref_w = p.mean(axis=2) if group == "mean" else p.max(axis=2)
    np.testing.assert_allclose(np.array(w), np.array(ref_w), rtol=1e-5, atol=1e-7)
    if accumulate is None:
        assert scores is None
    elif accumulate == "decay":
        ref_s = mx.concatenate([old * 0.9, mx.zeros((b, h, 1))], axis=2) + ref_w
        np.testing.assert_allclose(np.array(scores), np.array(ref_s), rtol=1e-5, atol=1e-7)
    else:
        ref_s = mx.concatenate([mx.maximum(old, ref_w[..., :n]), ref_w[..., n:]], axis=2)
        np.testing.assert_allclose(np.array(scores), np.array(ref_s), rtol=1e-5, atol=1e-7)


def test_attend_weights_keep_the_values_dtype(emulated):
    """bfloat16 rows: the output in bfloat16, the attention of the rows as they are stored."""
    b, h, g, d, n = 1, 2, 2, 64, 17
    rng = _rng("attend-bf16")
    q, k, v = (_arr(rng, *s, dtype=mx.bfloat16) for s in ((b, h * g, 1, d), (b, h, n, d), (b, h, n, d)))
    kn, vn = _arr(rng, b, h, 1, d, dtype=mx.bfloat16), _arr(rng, b, h, 1, d, dtype=mx.bfloat16)
    out, w, _ = ev.attend_weights(q, k, v, kn, vn)
    assert out.dtype == mx.bfloat16
    up = [x.astype(mx.float32) for x in (q, k, v, kn, vn)]
    want = mx.fast.scaled_dot_product_attention(up[0], mx.concatenate([up[1], up[3]], axis=2),
                                                mx.concatenate([up[2], up[4]], axis=2), scale=d ** -0.5)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want), rtol=1e-2, atol=1e-2)


# --- select ------------------------------------------------------------------------------------

# key, params, b, h, g, d (budget 20 unless given; tova's per_head False shares the selection;
# KNorm's keys are integers, so squared norms tie often; budget 300: more candidates than the
# select block's threads)
SELECT_CASES = [
    ("tova", dict(n_sink=3, per_head=False), 2, 2, 2, 32),
    ("tova", dict(n_sink=2, per_head=True), 1, 4, 1, 64),
    ("h2o", dict(n_sink=3, grace=2, decay=0.95), 2, 2, 2, 32),
    ("streaming_llm", dict(n_sink=3, window_size=17), 1, 2, 2, 32),
    ("knorm", dict(n_sink=3, recent=2, keep="low"), 2, 3, 1, 64),
    ("knorm", dict(n_sink=1, recent=0, keep="low"), 1, 2, 1, 32),
    ("knorm", dict(n_sink=3, recent=0, keep="low", budget=300), 1, 2, 1, 32),
]
BUDGET = 20


def _init(key, params, b, h, d, dtype=mx.float32):
    m = get_method(key)
    budget = {} if key == "streaming_llm" else dict(budget=BUDGET)
    return m, m.init(b, h, d, dtype=dtype, backend="mlx", **{**budget, **params})


def _mlx_scores(key, st, k, v, q):
    """The ``mlx`` score the slot step ranks by, and the carried scores over the candidates."""
    if key == "tova":
        return tova._score(st, k, v, q, True), None
    if key == "knorm":
        return knorm._score(st, k, v, q, True), None
    if key == "h2o":
        s = heavy_hitter_scores(st, k, v, q).scores
        return s, s
    return None, None


def _filled(rng, key, params, b, h, g, d):
    """``(method, state, plan)``: a state of ``key`` (``mlx`` backend) that absorbed a prefill
    of :func:`_prefill` six tokens past its capacity (integer keys for KNorm)."""
    m, st = _init(key, params, b, h, d)
    plan = evict._plan(m.spec)
    k, v, q = _prefill(rng, b, h, g, d, plan.capacity(st) + 6, integer=key == "knorm")
    return m, m.update(st, k, v, queries=q), plan


def _prefill(rng, b, h, g, d, n, integer=False):
    """Keys with equal rows (ties of every score of a key; ``integer``: integer keys) and
    values, queries."""
    k = np.asarray(rng.standard_normal((b, h, n, d)), np.float32)
    if integer:
        k = np.round(k)
    k[:, :, 7] = k[:, :, 11]
    k[:, :, 8] = k[:, :, 12] = k[:, :, 15]
    return (mx.array(k), _arr(rng, b, h, n, d), _arr(rng, b, h * g, n, d))


# the NaN last: a NaN key stays in the state, and every later attention over it is NaN
STEP_KINDS = ["random", "tie", "lose", "random", "tie", "random", "lose", "random", "tie", "nan"]


def _step_inputs(rng, key, st, step, b, h, g, d, integer=False):
    """A step's new key, value, queries: random; a copy of a stored key (a tie); a NaN in the
    new key; a new key the step attends to least or with the largest norm (the new token
    loses where nothing protects it)."""
    k, v, q = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h * g, 1, d)
    if integer:
        k = mx.round(k)
    kind = STEP_KINDS[step]
    if kind == "tie":
        k = st.keys[:, :, 9:10]
    elif kind == "nan":
        k = mx.array(np.where(np.arange(d) == 3, np.nan, np.array(k)).astype(np.float32))
    elif kind == "lose":
        if key == "knorm":
            k = k * 50
        else:  # against the mean of the group's queries: the lowest weight
            k = -10 * q.reshape(b, h, g, 1, d).mean(axis=2)
    return k, v, q


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2:]}")
def test_select_decides_as_the_mlx_slot_step(case, emulated):
    key, params, b, h, g, d = case
    rng = _rng("select", case)
    m, st, plan = _filled(rng, key, params, b, h, g, d)
    n = plan.capacity(st)
    lost_new = 0
    for step in range(len(STEP_KINDS)):
        k, v, q = _step_inputs(rng, key, st, step, b, h, g, d, integer=key == "knorm")
        by, carried = _mlx_scores(key, st, k, v, q)
        if by is None:  # the rule without a score: the protected tokens stay, the oldest other goes
            by = mx.zeros((b, h, n + 1), mx.float32)
        slot, rk, rv, pos, kept = ev.select(
            by, st.positions, st.next_pos, st.keys, st.values, k, v, n_sink=plan.sinks(st),
            recent=plan.recent(st), shared=plan.shared(st), carried=carried)
        new, move = m.backends["mlx"].with_move(st, k, v, q)
        # with recent tokens protected the new token never loses: no write mask (always written)
        assert move.slot is not None and (move.write is None) == (plan.recent(st) > 0), (key, step)
        what = f"{case} step {step}"
        np.testing.assert_array_equal(np.array(slot), np.array(move.slot), err_msg=what)
        written = [np.array(mx.take_along_axis(getattr(new, f), move.slot[..., None], axis=2))
                   for f in ("keys", "values")]
        np.testing.assert_array_equal(np.array(rk), written[0], err_msg=what)
        np.testing.assert_array_equal(np.array(rv), written[1], err_msg=what)
        np.testing.assert_array_equal(np.array(pos), np.array(new.positions), err_msg=what)
        if carried is not None:
            np.testing.assert_array_equal(np.array(kept), np.array(new.scores), err_msg=what)
        else:
            assert kept is None
        if move.write is not None:
            lost_new += int((~np.array(move.write)).sum())
        st = new
    assert emulated == [("select", key == "h2o")] * len(STEP_KINDS)
    pos = np.array(st.positions)
    assert (np.sort(pos, axis=-1)[:, :, :plan.sinks(st)] == np.arange(plan.sinks(st))).all()
    if key in ("tova", "knorm") and plan.recent(st) == 0:
        assert lost_new > 0, "no step where the new token lost"


def test_select_ranks_nonfinite_lowest_and_ties_by_age(emulated):
    """Scores given directly: NaN and -inf go before any finite score, the older of equal
    scores first; protected sinks and recent tokens never go, the new token may."""
    b, h, n, d = 1, 2, 8, 32
    rng = _rng("select-direct")
    k, v = _arr(rng, b, h, n, d), _arr(rng, b, h, n, d)
    kn, vn = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
    pos = mx.array(np.array([[[0, 1, 9, 4, 12, 6, 3, 10], [0, 1, 2, 11, 4, 5, 6, 7]]], np.int32))
    nxt = mx.array(np.array([[13, 12]], np.int32))
    nan, inf = np.nan, np.inf
    scores = mx.array(np.array([[[-inf, 5, 1, 2, 1, 1, 7, 3, 4],     # a sink's -inf stays; ties 9/12/6: 6 goes
                                 [5, 5, 3, 2, nan, -inf, 8, 8, 9]]],  # NaN, -inf: the older (pos 4) goes
                               np.float32))
    slot, rk, rv, p, _ = ev.select(scores, pos, nxt, k, v, kn, vn, n_sink=1, recent=2, shared=False)
    assert np.array(slot)[0, :, 0].tolist() == [5, 4]
    np.testing.assert_array_equal(np.array(rk), np.array(kn))
    np.testing.assert_array_equal(np.array(p)[0, 0], [0, 1, 9, 4, 12, 13, 3, 10])
    # the new token's score the lowest: it loses, the slot (0) keeps its row
    low = mx.array(np.array([[[9, 9, 9, 9, 9, 9, 9, 9, -1], [9, 9, 9, 9, 9, 9, 9, 9, nan]]], np.float32))
    slot, rk, rv, p, _ = ev.select(low, pos, nxt, k, v, kn, vn, n_sink=0, recent=0, shared=False)
    assert np.array(slot)[0, :, 0].tolist() == [0, 0]
    np.testing.assert_array_equal(np.array(rk), np.array(k[:, :, :1]))
    np.testing.assert_array_equal(np.array(rv), np.array(v[:, :, :1]))
    np.testing.assert_array_equal(np.array(p), np.array(pos))
    # shared: the mean over the heads decides for both (each head alone would drop another)
    same = mx.broadcast_to(pos[:, :1], pos.shape)
    split = mx.array(np.array([[[9, 9, 0, 9, 9, 9, 4, 9, 9], [9, 9, 9, 0, 9, 9, 4, 9, 9]]], np.float32))
    slot, rk, _, p, _ = ev.select(split, same, mx.full((1, 2), 13, mx.int32), k, v, kn, vn, n_sink=1,
                                  recent=2, shared=True)
    assert np.array(slot)[0, :, 0].tolist() == [6, 6]
    np.testing.assert_array_equal(np.array(rk), np.array(kn))
    np.testing.assert_array_equal(np.array(p)[0], [[0, 1, 9, 4, 12, 6, 13, 10]] * 2)


def test_select_over_more_candidates_than_threads(emulated):
    """600 slots in shuffled position order (each thread ranks several), scores of a few
    values and NaNs: the loser is the lowest ranked, the oldest among the tied."""
    b, h, n, d, n_sink, recent = 1, 4, 600, 32, 4, 3
    rng = _rng("select-many")
    k, v = _arr(rng, b, h, n, d), _arr(rng, b, h, n, d)
    kn, vn = _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
    pos = np.stack([rng.permutation(n) for _ in range(h)])[None].astype(np.int32)
    scores = rng.integers(0, 3, (b, h, n + 1)).astype(np.float32)
    scores[0, 1, rng.integers(0, n, 40)] = np.nan
    slot, _, _, p, _ = ev.select(mx.array(scores), mx.array(pos), mx.full((b, h), n, mx.int32), k, v, kn, vn,
                                 n_sink=n_sink, recent=recent, shared=False)
    cand = np.concatenate([pos, np.full((b, h, 1), n, np.int32)], axis=2)
    rank = np.where(np.isfinite(scores), scores, -np.inf)
    rank = np.where((cand < n_sink) | (cand >= n + 1 - recent), np.inf, rank)
    for j in range(h):
        loser = min(range(n + 1), key=lambda t: (rank[0, j, t], cand[0, j, t]))
        assert int(np.array(slot)[0, j, 0]) == (loser if loser < n else 0), j
        want = pos[0, j].copy()
        if loser < n:
            want[loser] = n
        np.testing.assert_array_equal(np.array(p)[0, j], want)


# --- end to end: the adapter's fused decode step -------------------------------------------------

# key, params, b, h, g, d, dtype
FUSED_CASES = [  # budget 20, or 40: more candidates than the weights block's warps
    ("tova", dict(n_sink=3, per_head=False, budget=40), 1, 2, 2, 64, mx.float32),
    ("tova", dict(n_sink=3, per_head=True), 2, 2, 1, 32, mx.float32),
    ("h2o", dict(n_sink=3, grace=2, decay=0.95), 1, 2, 2, 64, mx.float32),
    ("streaming_llm", dict(n_sink=3, window_size=17), 1, 2, 2, 32, mx.float32),
    ("knorm", dict(n_sink=3, recent=2, keep="low"), 1, 2, 2, 64, mx.bfloat16),
    ("kvzip", dict(n_sink=3, probe="context"), 1, 2, 2, 32, mx.float32),
]


def _compare(key, got, want, what):
    np.testing.assert_array_equal(np.array(got.positions), np.array(want.positions), err_msg=what)
    np.testing.assert_array_equal(np.array(got.next_pos), np.array(want.next_pos), err_msg=what)
    for f in ("keys", "values"):
        np.testing.assert_array_equal(np.array(getattr(got, f).astype(mx.float32)),
                                      np.array(getattr(want, f).astype(mx.float32)), err_msg=what)
    for f in ("scores", "importance"):
        if f in got._fields:
            np.testing.assert_allclose(np.array(getattr(got, f)), np.array(getattr(want, f)), rtol=2e-5,
                                       atol=1e-6, err_msg=what)


@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2:6]}-{c[6]}")
def test_fused_decode_step_matches_attention_then_update(case, emulated):
    key, params, b, h, g, d, dtype = case
    rng = _rng("fused", case)
    m, st = _init(key, params, b, h, d, dtype)
    n = evict._plan(m.spec).capacity(st) + 6
    st = m.update(st, _arr(rng, b, h, n, d, dtype=dtype), _arr(rng, b, h, n, d, dtype=dtype),
                  queries=_arr(rng, b, h * g, n, d, dtype=dtype))
    fused = decode._STEP_KINDS["fused"](m)
    tol = 2e-5 if dtype == mx.float32 else 2e-2
    for step in range(4):
        q, k, v = (_arr(rng, b, h * g, 1, d, dtype=dtype), _arr(rng, b, h, 1, d, dtype=dtype),
                   _arr(rng, b, h, 1, d, dtype=dtype))
        emulated.clear()
        out, new, row = fused(st._replace(backend="cuda"), q, k, v, d ** -0.5)
        assert [x[0] for x in emulated] == ["attend_part", "attend_select"], emulated
        assert new.backend == "cuda" and row is not None
        new = decode.write_row(new, row)._replace(backend="mlx")
        want = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([st.keys, k], axis=2), mx.concatenate([st.values, v], axis=2), scale=d ** -0.5)
        plain = m.update(st, k, v, queries=q)
        assert out.dtype == dtype
        what = f"{case} step {step}"
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   rtol=tol, atol=tol, err_msg=what)
        _compare(key, new, plain, what)
        st = plain


# --- attend: attention alone over a buffer's filled prefix --------------------------------------

FLASH_CASES = [  # b, h, g, d, buffer rows, rows attended, dtype, chunks of
    (1, 2, 4, 64, 40, 33, mx.float32, 8),  # 34 candidates: 5 chunks (combined by attend_out)
    (2, 2, 2, 32, 30, 30, mx.float32, 0),  # every slot filled, one chunk (normalised directly)
    (1, 1, 10, 32, 50, 47, mx.float32, 16),  # 10 query heads: passes of 8 and 2
    (1, 2, 3, 64, 20, 0, mx.float32, 4),  # no stored row: the new token alone
    (2, 2, 4, 128, 70, 61, mx.bfloat16, 24),
    (1, 3, 3, 64, 300, 299, mx.float32, 0),  # one block over 300 candidates: many rows per lane group
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=str)
def test_attend_is_attention_over_the_filled_prefix(case, emulated, monkeypatch):
    """``attend`` over the first ``rows`` slots of a buffer and the new token equals
    ``scaled_dot_product_attention`` over those rows and the new one (at the scale asked); the
    slots past ``rows`` (here NaN, as garbage) are never read."""
    b, h, g, d, n, rows, dtype, chunk = case
    rng = _rng("flash", case)
    monkeypatch.setattr(ev, "FLASH_MIN_CHUNK", chunk or 10_000)
    monkeypatch.setattr(ev, "FLASH_BLOCKS", 10_000 if chunk else 1)
    q, kn, vn = _arr(rng, b, h * g, 1, d, dtype=dtype), _arr(rng, b, h, 1, d, dtype=dtype), _arr(rng, b, h, 1, d, dtype=dtype)
    k, v = _arr(rng, b, h, n, d, dtype=dtype), _arr(rng, b, h, n, d, dtype=dtype)
    garbage = mx.arange(n)[None, None, :, None] >= rows
    k, v = mx.where(garbage, mx.nan, k).astype(dtype), mx.where(garbage, mx.nan, v).astype(dtype)
    scale = 0.7 * d ** -0.5
    out = ev.attend(q, k, v, kn, vn, rows=rows, scale=scale)
    chunks = -(-(rows + 1) // ev.flash_chunk(rows + 1, b * h))
    assert chunks == (1 if not chunk else -(-(rows + 1) // chunk)), chunks
    assert emulated == ([("attend_flash", True)] if chunks == 1 else [("attend_flash", False), ("attend_out",)])
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32),
                                                mx.concatenate([k[:, :, :rows], kn], axis=2).astype(mx.float32),
                                                mx.concatenate([v[:, :, :rows], vn], axis=2).astype(mx.float32),
                                                scale=scale)
    assert out.shape == (b, h * g, 1, d) and out.dtype == dtype
    tol = (1e-5, 1e-6) if dtype == mx.float32 else (1e-2, 1e-2)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want), rtol=tol[0], atol=tol[1])


def test_attend_refuses_bad_arguments():
    k = mx.zeros((1, 2, 8, 32))
    q, kn = mx.zeros((1, 4, 1, 32)), mx.zeros((1, 2, 1, 32))
    with pytest.raises(ValueError, match="rows 9 of a buffer of 8"):
        ev.attend(q, k, k, kn, kn, rows=9)
    with pytest.raises(ValueError, match="attend"):
        ev.attend(q, k, k, kn, kn[:, :1])
    with pytest.raises(ValueError, match="head_dim"):
        ev.attend(mx.zeros((1, 4, 1, 24)), mx.zeros((1, 2, 8, 24)), mx.zeros((1, 2, 8, 24)),
                  mx.zeros((1, 2, 1, 24)), mx.zeros((1, 2, 1, 24)))


def _declines_off_gpu(m, st) -> bool:
    """Off an NVIDIA GPU ``fill_attention`` declines (the caller attends with MLX)."""
    return all(m.backends[be].fill_attention(st, st, None, None, None, 1.0) is None
               for be in m.backends if m.backends[be].fill_attention is not None)


@pytest.mark.parametrize("key, params", [("tova", dict(budget=20, n_sink=2, slack=5)),
                                         ("streaming_llm", dict(n_sink=2, window_size=18, slack=5)),
                                         ("snapkv", dict(budget=20, n_sink=2, obs_window=4))])
def test_fill_attention_is_attention_over_the_filled_slots(key, params, emulated, monkeypatch):
    """The attention of a step into an empty slot on an NVIDIA GPU (``fill_attention``, the
    adapter's fill step, ``mlx`` and ``cuda`` backends alike): ``attend`` over the state's
    filled slots in place and the new row,
    equal to MLX's attention over ``kv_slots`` after the fill, through two selections' worth
    of steps (amortized eviction) or a growth (SnapKV's decode); ``fill`` is ``None`` for a
    state without an empty slot."""
    b, h, g, d = 2, 2, 3, 32
    rng = _rng("fill-attention", key)
    m = get_method(key)
    st = m.init(b, h, d, backend="mlx", **params)
    st = m.update(st, _arr(rng, b, h, 25, d), _arr(rng, b, h, 25, d), queries=_arr(rng, b, h * g, 25, d))
    assert _declines_off_gpu(m, st)
    monkeypatch.setattr(evict, "_on_cuda", lambda: True)
    backend = m.backends["mlx"]
    assert "cuda" not in m.backends or m.backends["cuda"].fill_attention is backend.fill_attention
    fills = 0
    for _ in range(14):
        q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
        new = backend.fill(st, k, v)
        if new is None:
            st = m.update(st, k, v, queries=q)
            continue
        emulated.clear()
        out = backend.fill_attention(st, new, q, k, v, d ** -0.5)
        assert emulated and emulated[0][0] == "attend_flash", emulated
        ks, vs, mask = m.kv_slots(new)
        assert mask is None
        want = mx.fast.scaled_dot_product_attention(q, ks, vs, scale=d ** -0.5)
        np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-5, atol=1e-6)
        fills += 1
        st = new
    assert fills >= 8
    full = m.update(m.init(b, h, d, backend="mlx", **params), _arr(rng, b, h, 25, d), _arr(rng, b, h, 25, d))
    assert backend.fill(full, k, v) is None


# --- attend_select: the combine and the selection in one launch ------------------------------

# key, params, b, h, g, d (budget 20): select's first five cases, then KVzip's two probes
ATTEND_SELECT_CASES = SELECT_CASES[:5] + [
    ("kvzip", dict(n_sink=3, probe="latest", per_head=False), 1, 2, 2, 32),
    ("kvzip", dict(n_sink=3, probe="context"), 2, 2, 3, 32),
]


@pytest.mark.parametrize("case", ATTEND_SELECT_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2:]}")
def test_attend_select_decides_as_attend_weights_then_select(case, emulated, monkeypatch):
    """The decode step with ``attend_select`` (two launches) and without it (``attend_weights``
    then ``select``, three): the same output, slot, row, positions and carried scores, bit for
    bit, step after step through ties, a NaN key and a new token that loses. (KVzip's carried
    maximum came from the one-block ``weights`` kernel, which sums in another order: equal to
    float32 rounding.)"""
    key, params, b, h, g, d = case
    rng = _rng("attend-select", case)
    m, st, plan = _filled(rng, key, params, b, h, g, d)
    st = st._replace(backend="cuda")
    step_fn = m.backends["cuda"].with_attention
    supports = ev.attend_select_supports
    lost_new = 0
    for step in range(len(STEP_KINDS)):
        k, v, q = _step_inputs(rng, key, st, step, b, h, g, d, integer=key == "knorm")
        emulated.clear()
        out, new, move = step_fn(st, k, v, q)
        assert [x[0] for x in emulated] == ["attend_part", "attend_select"], emulated
        monkeypatch.setattr(ev, "attend_select_supports", lambda *a: False)
        emulated.clear()
        out3, new3, move3 = step_fn(st, k, v, q)
        monkeypatch.setattr(ev, "attend_select_supports", supports)
        # (KVzip's scores come from a weights launch of their own there: four launches)
        assert [x[0] for x in emulated] == (["weights"] if key == "kvzip" else []) + [
            "attend_part", "attend_combine", "select"], emulated
        what = f"{case} step {step}"
        np.testing.assert_array_equal(np.array(out), np.array(out3), err_msg=what)
        np.testing.assert_array_equal(np.array(move.slot), np.array(move3.slot), err_msg=what)
        for a, c in zip(move.rows, move3.rows):
            np.testing.assert_array_equal(np.array(a), np.array(c), err_msg=what)
        for f in new._fields:
            x, y = getattr(new, f), getattr(new3, f)
            if isinstance(x, mx.array):
                assert x.dtype == y.dtype and x.shape == y.shape, (what, f)
                if key == "kvzip" and f == "importance":  # there from the one-block weights kernel
                    np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-6, atol=1e-8,
                                               err_msg=f"{what} {f}")
                else:
                    np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=f"{what} {f}")
            else:
                assert x == y, (what, f)
        lost_new += int((np.array(move.rows[0]) != np.array(k)).any(axis=-1).sum())
        st = decode.write_row(new, (move.slot, *move.rows))
    if key in ("tova", "knorm") and plan.recent(st) == 0:
        assert lost_new > 0, "no step where the new token lost"


def test_fused_step_writes_the_pending_row_first(emulated):
    """The compiled decode step that takes the last step's pending row writes it before its
    attention: the same output and state as the row written by itself, then the step."""
    b, h, g, d = 1, 2, 2, 32
    rng = _rng("fused-row")
    m, st = _init("h2o", dict(n_sink=3, grace=2, decay=0.95), b, h, d)
    n = evict._plan(m.spec).capacity(st) + 6
    st = m.update(st, _arr(rng, b, h, n, d), _arr(rng, b, h, n, d), queries=_arr(rng, b, h * g, n, d))
    st = st._replace(backend="cuda")
    fused, with_row = decode._STEP_KINDS["fused"](m), decode._STEP_KINDS["fused+row"](m)
    q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
    _, st, row = fused(st, q, k, v, d ** -0.5)
    for _ in range(3):
        q, k, v = _arr(rng, b, h * g, 1, d), _arr(rng, b, h, 1, d), _arr(rng, b, h, 1, d)
        out_a, st_a, row_a = with_row(st, row, q, k, v, d ** -0.5)
        out_b, st_b, row_b = fused(decode.write_row(st, row), q, k, v, d ** -0.5)
        np.testing.assert_array_equal(np.array(out_a), np.array(out_b))
        for x, y in zip(decode.arrays((st_a, row_a)), decode.arrays((st_b, row_b))):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        st, row = st_a, row_a

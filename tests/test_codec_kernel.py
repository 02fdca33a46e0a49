"""The CUDA decode step of attention on key codes (``velox.kernels.codec``) against
``velox.codec_cache.attend``.

Three checks, from any machine to the GPU:

* the sources: every variant (codec x value layout x dtype x head_dim x bits class) has its
  placeholders filled and compiles with NVRTC to PTX for compute_90 (no GPU needed; skipped without the
  NVRTC wheel);
* an emulation: the very kernel sources compiled as C++ for the CPU (a thread per CUDA
  thread, a barrier for ``__syncthreads``, shared memory as static storage, blocks one after
  another), run through ``decode_attend``'s own wrapper and compared with ``attend`` (skipped
  without a C++20 compiler, and on a CUDA machine, where the GPU tests run the kernels);
* on an NVIDIA GPU: ``decode_attend`` against ``attend`` over codecs, bits, head_dims, GQA
  groups, dtypes and stored lengths (0, 1, not a multiple of 32 or of a split, several
  thousand), within ``velox.kernels.codec.TOLERANCE``.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import zlib

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import codec_cache
from velox.backend import device_supports
from velox.kernels import codec as ck
from velox.kernels import nvrtc

needs_cuda = pytest.mark.skipif(not device_supports("cuda"), reason="needs an NVIDIA GPU (MLX CUDA)")
needs_nvrtc = pytest.mark.skipif(
    not nvrtc.available(),
    reason="needs NVIDIA's NVRTC wheel: pip install \".[kernels-check]\" (Linux x86-64)")
_CXX = shutil.which("g++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(_CXX is None, reason="needs a C++20 compiler (g++ or clang++)")

KEYS = {"mse": "turboquant_mse", "rvq": "turboquant_rvq", "prod": "turboquant_prod", "qjl": "qjl"}


# --- sources --------------------------------------------------------------------------------

def _template(codec, head_dim=128, groups=4, bits=2, sign_words=2):
    t = dict(HEAD_DIM=head_dim, G=groups, SPLIT=ck.split_size(groups))
    if codec != "qjl":
        t["BITS"] = bits
    if codec in ("prod", "qjl"):
        t["SIGN_WORDS"] = sign_words
    return t


def _split_dtypes(spec, dtype):
    """Input dtypes of a split launch for a cache and queries of ``dtype``: the value side data
    (scales, zeros, exact rows) in ``velox.quant.side_dtype`` of it; key norms and gains
    float16 as the codecs store them; tables float32; the held counts int32."""
    side = "bfloat16" if dtype == "bfloat16" else "float16"

    def of(name):
        if name in ("idx", "ridx", "signs", "vq"):
            return "uint32"
        if name == "held":  # the stored tokens of each (batch row, kv head)
            return "int32"
        if name in ("knorm", "rnorm", "gain"):
            return "float16"
        if name in ("vs", "vz", "vr"):
            return side
        return dtype if name == "qry" else "float32"
    return {k: of(k) for k in spec["input_names"]}


SPLIT_VARIANTS = [(c, v) for c in ("mse", "rvq", "prod", "qjl") for v in ("int8", "exact")]


@pytest.mark.parametrize("codec,values", SPLIT_VARIANTS)
def test_split_sources_are_complete(codec, values):
    """Placeholders filled, every declared input and output used, and no upper-case name but
    the template values the wrapper passes."""
    spec = ck.split_spec(codec, values)
    src = re.sub(r"//[^\n]*", "", spec["source"])  # code, not comments
    for token in ("SHARED", "LOAD", "LOGITS", "SIDE", "VALUE", "NT", "SRC", "TABLE", "ACC", "NORM"):
        assert not re.search(rf"\b{token}\b", src), (codec, values, token)
    for name in spec["input_names"] + spec["output_names"]:
        assert re.search(rf"\b{name}\b", src), (codec, values, name)
    names = set(re.findall(r"\b[A-Z][A-Z_]*\b", src)) - {"WORDS", "PARTS"}
    assert names == set(_template(codec)), (codec, values, names)


def test_merge_source_is_complete():
    spec = ck.merge_spec()
    src = re.sub(r"//[^\n]*", "", spec["source"])
    for name in spec["input_names"] + spec["output_names"]:
        assert re.search(rf"\b{name}\b", src), name
    assert set(re.findall(r"\b[A-Z][A-Z_]*\b", src)) - {"PARTS"} == {"HEAD_DIM", "G"}
    assert ck.MERGE_THREADS % max(ck.HEAD_DIMS) == 0 and ck.MERGE_THREADS & (ck.MERGE_THREADS - 1) == 0


# The MSE stage's bits classes: dividing 32 (no index crosses a word) and not (indices spill
# into the next word); prod's MSE stage runs at bits - 1. QJL: one and four sign words.
BITS_CLASSES = {"mse": (2, 3), "rvq": (4, 5), "prod": (1, 3), "qjl": (1, 4)}
# Each codec with the value layout its method holds (rvq: exact rows, the others 8-bit codes)
# at every dtype x head_dim x bits class; the other layouts at one setting each.
METHOD_VALUES = {"mse": "int8", "rvq": "exact", "prod": "int8", "qjl": "int8"}
COMPILE_CASES = ([(c, v, dt, d, k) for c, v in METHOD_VALUES.items()
                  for dt in ("float32", "float16", "bfloat16") for d in ck.HEAD_DIMS for k in BITS_CLASSES[c]]
                 + [(c, "exact" if v == "int8" else "int8", "float16", 128, BITS_CLASSES[c][1])
                    for c, v in METHOD_VALUES.items()])


def _split_ptx(case):
    codec, values, dtype, head_dim, k = case
    spec = ck.split_spec(codec, values)
    tmpl = _template(codec, head_dim, 4, bits=k, sign_words=k)
    return spec["name"], nvrtc.compile_source(nvrtc.kernel_source(spec, _split_dtypes(spec, dtype),
                                                                  ["float32"] * 3, tmpl))


@pytest.fixture(scope="module")
def split_ptx():
    """The PTX of every case of COMPILE_CASES, compiled two at a time (NVRTC releases the
    interpreter while it compiles); a case that fails to compile raises in its own test."""
    from concurrent.futures import ThreadPoolExecutor

    def attempt(case):
        try:
            return _split_ptx(case)
        except Exception as e:  # reported by the case's test
            return e

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMPILE_CASES, pool.map(attempt, COMPILE_CASES)))


@pytest.mark.slow  # (pytest --run-slow)
@needs_nvrtc
@pytest.mark.parametrize("codec,values,dtype,head_dim,k", COMPILE_CASES, ids=str)
def test_split_sources_compile(split_ptx, codec, values, dtype, head_dim, k):
    """Every split variant compiles to PTX for compute_90 as MLX wraps it at a launch (no GPU needed)."""
    got = split_ptx[(codec, values, dtype, head_dim, k)]
    if isinstance(got, Exception):
        raise got
    name, ptx = got
    assert f".entry {name}" in ptx


@pytest.mark.slow  # (pytest --run-slow)
@needs_nvrtc
def test_split_sources_compile_at_the_group_extremes():
    """One query head per kv head, and the most (32: the smallest split). The three compile
    side by side (NVRTC releases the interpreter while it compiles)."""
    from concurrent.futures import ThreadPoolExecutor

    def compiled(case):
        codec, g = case
        spec = ck.split_spec(codec, "int8")
        src = nvrtc.kernel_source(spec, _split_dtypes(spec, "float16"), ["float32"] * 3,
                                  _template(codec, 128, g, bits=3, sign_words=1))
        return spec["name"], nvrtc.compile_source(src)

    cases = (("rvq", 1), ("prod", ck.MAX_GROUPS), ("qjl", ck.MAX_GROUPS))
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        for name, ptx in pool.map(compiled, cases):
            assert f".entry {name}" in ptx


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", ck.HEAD_DIMS)
def test_merge_source_compiles(dtype, head_dim):
    spec = ck.merge_spec()
    ins = dict(qry=dtype, kn=dtype, vn=dtype, pm="float32", pl="float32", pa="float32", params="float32")
    ptx = nvrtc.compile_source(nvrtc.kernel_source(spec, ins, [dtype], dict(HEAD_DIM=head_dim, G=4)))
    assert f".entry {spec['name']}" in ptx


def test_split_spec_refuses_unknown_variants():
    with pytest.raises(ValueError, match="variant"):
        ck.split_spec("polar", "int8")
    with pytest.raises(ValueError, match="variant"):
        ck.split_spec("mse", "int4")


# --- which states and queries the kernels take (any machine) ----------------------------------

def _state(key, b, h, d, n, dtype, seed=0, **params):
    rng = np.random.default_rng(seed)
    st = velox.init(key, b, h, d, dtype=dtype, **params)
    if n:
        k = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((b, h, n, d)).astype(np.float32)).astype(dtype)
        st = velox.update(st, k, v)
    mx.eval(st)
    return st


def _step(b, h, g, d, dtype, seed=1):
    rng = np.random.default_rng(seed)

    def arr(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)

    return arr(b, h * g, 1, d), arr(b, h, 1, d), arr(b, h, 1, d)


def test_layouts_taken_and_refused():
    """The four codecs at head_dim 64 / 128 and every bits are taken; another codec, head_dim,
    more than one query token, a group count that does not divide, too many groups, or a
    codes record of another type are refused (the MLX path)."""
    q = mx.zeros((1, 8, 1, 128))
    for key, params in (("turboquant_mse", dict(bits=1)), ("turboquant_mse", dict(bits=8)),
                        ("turboquant_rvq", dict(bits=3)), ("turboquant_prod", dict(bits=2)),
                        ("turboquant_prod", dict(bits=9)), ("qjl", dict(jl_dim=40))):
        st = _state(key, 1, 2, 128, 3, mx.float16, **params)
        assert ck._layout(st, q) is not None, (key, params)
        assert ck._layout(st, mx.zeros((1, 8, 2, 128))) is None  # s > 1
        assert ck._layout(st, mx.zeros((1, 7, 1, 128))) is None  # 7 heads over 2 kv heads
        assert ck._layout(st, mx.zeros((1, 8, 1, 128), mx.int32)) is None
        other = st._replace(key_codes=tuple(st.key_codes))  # not the codec's own record
        assert ck._layout(other, q) is None
    assert ck._layout(_state("turboquant_mse", 1, 1, 64, 2, mx.float32), mx.zeros((1, 3, 1, 64))) is not None
    assert ck._layout(_state("turboquant_mse", 1, 1, 32, 2, mx.float32), mx.zeros((1, 1, 1, 32))) is None
    assert ck._layout(_state("turboquant_mse", 1, 1, 64, 2, mx.float32), mx.zeros((1, 33, 1, 64))) is None
    assert ck._layout(_state("polar", 1, 1, 64, 2, mx.float32), mx.zeros((1, 1, 1, 64))) is None
    for key in ("turboquant_mse", "turboquant_prod", "turboquant_rvq"):  # outlier channels
        split = _state(key, 1, 2, 128, 3, mx.float16, bits=3, n_outlier=16, outlier_bits=4)
        assert ck._layout(split, q) is None, key
        assert ck._layout(_state(key, 1, 2, 128, 3, mx.float16, bits=3, n_outlier=0), q) is not None
    assert ck._layout(_state("tova", 1, 1, 64, 2, mx.float32, budget=8), mx.zeros((1, 1, 1, 64))) is None
    if not device_supports("cuda"):
        st = _state("turboquant_mse", 1, 2, 128, 3, mx.float16)
        assert not ck.supports(st, q)
        with pytest.raises(ValueError, match="keys and values"):
            ck.decode_attend(st, q, mx.zeros((1, 2, 2, 128)), mx.zeros((1, 2, 2, 128)), scale=0.1)
    with pytest.raises(ValueError, match="supports"):
        ck.decode_attend(_state("polar", 1, 1, 64, 2, mx.float32), mx.zeros((1, 1, 1, 64)),
                         mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 64)), scale=0.1)


def test_splits_cover_the_tokens():
    """Every stored token is in exactly one split, none is empty, none holds more than the
    block's shared memory holds (the kernel's own split arithmetic)."""
    for b, h, n, g in itertools.product((1, 2), (1, 8), (1, 31, 64, 65, 513, 4099, 32768), (1, 4, 32)):
        sp = ck.split_size(g)
        ns = ck.plan_splits(b, h, n, sp)
        span = -(-n // ns)
        lens = [max(0, min(span, n - s * span)) for s in range(ns)]
        assert sum(lens) == n and min(lens) > 0 and max(lens) <= sp, (b, h, n, g)


# --- the emulation: the CUDA sources as C++ on the CPU ----------------------------------------

_EMU_PRELUDE = r"""
#include <math.h>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <thread>
#include <barrier>
#include <vector>
struct velox_dim3 { unsigned int x, y, z; };
thread_local velox_dim3 threadIdx, blockIdx;
static velox_dim3 gridDim, blockDim;
static std::barrier<>* velox_bar = nullptr;
static inline void __syncthreads() { velox_bar->arrive_and_wait(); }
#define __global__
#define __device__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __grid_constant__
struct Shape {
    int v[10];
    int operator[](int i) const { return v[i]; }
};
static inline Shape velox_shape(const int* p) { Shape s; for (int i = 0; i < 10; ++i) s.v[i] = p[i]; return s; }
struct __half {
    _Float16 x;
    __half() = default;
    __half(float f) : x((_Float16)f) {}
    operator float() const { return (float)x; }
};
struct __nv_bfloat16 {
    uint16_t x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fffu + ((u >> 16) & 1u); x = (uint16_t)(u >> 16); }
    operator float() const { uint32_t u = (uint32_t)x << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
"""

_NP_OF = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16,
          mx.uint32: np.uint32, mx.int32: np.int32}
_NAME_OF = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16",
            mx.uint32: "uint32", mx.int32: "int32"}
_EMU_DIR = os.path.join(tempfile.gettempdir(), "velox_codec_kernel_emu")
_EMU_LIBS: dict[str, ctypes.CDLL] = {}


def _emu_library(spec, in_dtypes, out_dtypes, template):
    src = nvrtc.kernel_source(spec, in_dtypes, out_dtypes, template)
    assert src.startswith(nvrtc._PRELUDE)
    src = _EMU_PRELUDE + src[len(nvrtc._PRELUDE):]
    args, k = [], 0
    for name in spec["input_names"]:
        args.append(f"(const {nvrtc._CUDA_TYPES[in_dtypes[name]]}*)a[{k}]")
        k += 1
        if f"{name}_shape" in spec["source"]:
            args.append(f"velox_shape((const int*)a[{k}])")
            k += 1
    for dt in out_dtypes:
        args.append(f"({nvrtc._CUDA_TYPES[dt]}*)a[{k}]")
        k += 1
    src += f"""
extern "C" void velox_launch(int nblocks, int nt, void** a) {{
    std::barrier<> bar(nt);
    velox_bar = &bar;
    gridDim = {{(unsigned int)nblocks, 1, 1}};
    blockDim = {{(unsigned int)nt, 1, 1}};
    std::vector<std::thread> th;
    for (int i = 0; i < nt; ++i)
        th.emplace_back([&, i] {{
            threadIdx = {{(unsigned int)i, 0, 0}};
            for (int b = 0; b < nblocks; ++b) {{
                blockIdx = {{(unsigned int)b, 0, 0}};
                velox_check::{spec["name"]}({", ".join(args)});
                bar.arrive_and_wait();
            }}
        }});
    for (auto& t : th) t.join();
}}
"""
    key = hashlib.sha1(src.encode()).hexdigest()[:20]
    if key in _EMU_LIBS:
        return _EMU_LIBS[key]
    os.makedirs(_EMU_DIR, exist_ok=True)
    so = os.path.join(_EMU_DIR, f"{key}.so")
    if not os.path.exists(so):
        cpp = os.path.join(_EMU_DIR, f"{key}.cpp")
        with open(cpp, "w") as f:
            f.write(src)
        tmp = so + f".{os.getpid()}"
        subprocess.run([_CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", cpp, "-o", tmp],
                       check=True, capture_output=True)
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    lib.velox_launch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    _EMU_LIBS[key] = lib
    return lib


def _to_np(x: mx.array) -> np.ndarray:
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x))


def _emulated_kernel(codec, values, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """``velox.kernels.codec._run_kernel`` on the CPU: the same source, compiled as C++."""
    spec = ck.merge_spec() if codec is None else ck.split_spec(codec, values)
    ins = dict(zip(spec["input_names"], inputs))
    in_dtypes = {k: _NAME_OF[v.dtype] for k, v in ins.items()}
    lib = _emu_library(spec, in_dtypes, [_NAME_OF[d] for d in output_dtypes], dict(template))
    keep, ptrs = [], []
    for name in spec["input_names"]:
        a = _to_np(ins[name])
        keep.append(a)
        ptrs.append(a.ctypes.data)
        if f"{name}_shape" in spec["source"]:
            s = np.zeros(10, np.int32)
            s[:a.ndim] = a.shape
            keep.append(s)
            ptrs.append(s.ctypes.data)
    outs = []
    for shape, dt in zip(output_shapes, output_dtypes):  # unwritten elements would stay NaN
        o = np.full(shape, np.nan, np.float32).astype(_NP_OF[dt]) if dt != mx.bfloat16 \
            else np.full(shape, 0x7FC0, np.uint16)
        outs.append(o)
        ptrs.append(o.ctypes.data)
    arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
    lib.velox_launch(grid[0] // threadgroup[0], threadgroup[0], arr)
    res = []
    for o, dt in zip(outs, output_dtypes):
        m = mx.array(o)
        res.append(m.view(mx.bfloat16) if dt == mx.bfloat16 else m)
    return res


def _reference(st, q, kn, vn, scale, monkeypatch):
    """``codec_cache.attend`` on its MLX path (the kernels switched off, should ``attend``
    route decode steps to them)."""
    with monkeypatch.context() as mp:
        mp.setattr(ck, "supports", lambda *a, **k: False)
        return codec_cache.attend(st, q, kn, vn, scale=scale)


def _check(out, ref, dtype, what):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape, what
    atol, rtol = ck.TOLERANCE[dtype]
    a, r = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    assert np.isfinite(a).all(), what
    np.testing.assert_allclose(a, r, rtol=rtol, atol=atol, err_msg=what)


EMU_CASES = [  # key, params, b, h, g, d, n, dtype
    ("turboquant_mse", dict(bits=2), 1, 2, 4, 128, 37, mx.float16),
    ("turboquant_mse", dict(bits=3), 2, 1, 3, 64, 150, mx.float32),
    ("turboquant_mse", dict(bits=8), 1, 1, 2, 64, 5, mx.bfloat16),
    ("turboquant_rvq", dict(bits=3), 1, 2, 2, 64, 70, mx.float16),
    ("turboquant_prod", dict(bits=2), 1, 1, 4, 128, 130, mx.float32),
    ("turboquant_prod", dict(bits=4, jl_dim=40), 2, 1, 1, 64, 33, mx.bfloat16),
    ("qjl", dict(), 1, 2, 2, 64, 65, mx.float32),
    ("qjl", dict(jl_dim=100), 1, 1, 5, 128, 1, mx.float16),
    ("turboquant_mse", dict(bits=4), 1, 2, 2, 64, 0, mx.float16),
]


@needs_cxx
@pytest.mark.skipif(device_supports("cuda"), reason="the GPU tests run the kernels themselves")
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2:7]}-{c[7]}")
def test_emulated_kernels_match_attend(case, monkeypatch):
    key, params, b, h, g, d, n, dtype = case
    st = _state(key, b, h, d, n, dtype, seed=zlib.crc32(repr(case).encode()), **params)
    q, kn, vn = _step(b, h, g, d, dtype)
    scale = d ** -0.5
    assert ck._layout(st, q) is not None
    ref = _reference(st, q, kn, vn, scale, monkeypatch)
    monkeypatch.setattr(ck, "_run_kernel", _emulated_kernel)
    out = ck.decode_attend(st, q, kn, vn, scale=scale)
    _check(out, ref, dtype, repr(case))


# --- on the GPU ------------------------------------------------------------------------------

GPU_CODECS = ([("turboquant_mse", dict(bits=b)) for b in (1, 2, 3, 4, 5, 8)]
              + [("turboquant_rvq", dict(bits=b)) for b in (2, 3, 4)]
              + [("turboquant_prod", dict(bits=b)) for b in (2, 3, 4)]
              + [("turboquant_prod", dict(bits=3, jl_dim=40)), ("qjl", dict()), ("qjl", dict(jl_dim=100))])
# b, h, g, d, n: lengths that are not multiples of 32 or of a split (1000 tokens: 8 splits)
GPU_SHAPES = [(1, 2, 4, 128, 1), (2, 2, 4, 128, 1000), (2, 1, 4, 64, 37)]
DTYPES = [mx.float16, mx.bfloat16, mx.float32]
DEFAULTS = [("turboquant_mse", dict()), ("turboquant_rvq", dict()), ("turboquant_prod", dict()),
            ("qjl", dict())]


def _compare_on_gpu(key, params, shape, dtype, monkeypatch):
    b, h, g, d, n = shape
    what = f"{key} {params} {shape} {dtype}"
    st = _state(key, b, h, d, n, dtype, seed=zlib.crc32(what.encode()), **params)
    q, kn, vn = _step(b, h, g, d, dtype, seed=n)
    assert ck.supports(st, q), what
    scale = d ** -0.5
    out = ck.decode_attend(st, q, kn, vn, scale=scale)
    _check(out, _reference(st, q, kn, vn, scale, monkeypatch), dtype, what)


@needs_cuda
@pytest.mark.parametrize("key,params", GPU_CODECS, ids=str)
def test_decode_attend_matches_attend(key, params, monkeypatch):
    """Every codec setting over three shapes (GQA 4, head_dim 128 and 64), the dtype cycling."""
    i = GPU_CODECS.index((key, params))
    for k, shape in enumerate(GPU_SHAPES):
        _compare_on_gpu(key, params, shape, DTYPES[(i + k) % 3], monkeypatch)


@needs_cuda
@pytest.mark.parametrize("key,params", DEFAULTS, ids=str)
def test_decode_attend_at_the_extremes(key, params, monkeypatch):
    """Each codec at its defaults: no stored token and 4099 tokens over two batch rows in every
    dtype, the benchmark's 32768 tokens (66 splits), one and 32 query heads per kv head."""
    for dtype in DTYPES:
        _compare_on_gpu(key, params, (1, 2, 4, 128, 0), dtype, monkeypatch)
        _compare_on_gpu(key, params, (2, 8, 4, 128, 4099), dtype, monkeypatch)
    _compare_on_gpu(key, params, (1, 8, 4, 128, 32768), mx.float16, monkeypatch)
    _compare_on_gpu(key, params, (1, 2, 1, 128, 300), mx.bfloat16, monkeypatch)
    _compare_on_gpu(key, params, (1, 1, 32, 128, 300), mx.float32, monkeypatch)


@needs_cuda
def test_decode_attend_under_compile_and_with_large_logits(monkeypatch):
    """Inside ``mx.compile`` the kernels give the same result; queries scaled up 30x (peaked
    softmax over the splits) still match."""
    st = _state("turboquant_prod", 1, 2, 128, 777, mx.float16, bits=3)
    q, kn, vn = _step(1, 2, 4, 128, mx.float16)
    f = mx.compile(lambda s_, q_, k_, v_: ck.decode_attend(s_, q_, k_, v_, scale=128 ** -0.5))
    np.testing.assert_array_equal(np.array(f(st, q, kn, vn)), np.array(ck.decode_attend(st, q, kn, vn, scale=128 ** -0.5)))
    q = q * 30
    _check(ck.decode_attend(st, q, kn, vn, scale=128 ** -0.5),
           _reference(st, q, kn, vn, 128 ** -0.5, monkeypatch), mx.float16, "large logits")

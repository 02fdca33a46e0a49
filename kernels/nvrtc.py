"""Compile the CUDA kernels' sources with NVRTC on any machine, no GPU needed.

MLX compiles a ``mx.fast.cuda_kernel`` at its first launch, on the GPU machine, so a typo in
a kernel's source would otherwise show up only there. :func:`compile_source` wraps a kernel
spec (the ``mx.fast.cuda_kernel`` arguments built by ``velox.kernels.evict``) the way MLX
does for a launch (a ``__global__`` function whose parameters are the inputs, with a
``<name>_shape`` parameter for each input whose shape the body reads, then the outputs; the
template values as ``constexpr`` constants) and compiles it to PTX for one GPU architecture
with the NVRTC library of NVIDIA's ``nvidia-cuda-nvrtc-cu12`` wheel (headers from
``nvidia-cuda-runtime-cu12``), through ``ctypes``.

MLX's own prelude (its device utilities) is replaced by the few declarations the kernels use:
the half types, and ``Shape``, a small array of ints, as MLX passes shapes.
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache

__all__ = ["available", "compile_source", "kernel_source", "NvrtcError"]

_CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16",
               "int32": "int32_t", "uint32": "uint32_t", "bool": "bool"}

_PRELUDE = """
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
struct Shape {
    int v[10];
    __device__ int operator[](int i) const { return v[i]; }
};
"""


class NvrtcError(RuntimeError):
    """A kernel source that NVRTC refused; the message carries its log."""


def _nvidia_dirs() -> list[str]:
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    return list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []


@lru_cache(maxsize=1)
def _library():
    for root in _nvidia_dirs():
        for path in sorted(glob.glob(os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so*"))):
            if ".alt." in path:
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _include_dir() -> str | None:
    for root in _nvidia_dirs():
        path = os.path.join(root, "cuda_runtime", "include")
        if os.path.exists(os.path.join(path, "cuda_fp16.h")):
            return path
    return None


def available() -> bool:
    """Whether NVRTC and the CUDA headers are installed."""
    return _library() is not None and _include_dir() is not None


def kernel_source(spec: dict, input_dtypes: dict[str, str], output_dtypes: list[str],
                  template: dict[str, int]) -> str:
    """The translation unit MLX would build for ``spec`` (see the module docstring)."""
    body = spec["source"]
    params = []
    for name in spec["input_names"]:
        params.append(f"    const {_CUDA_TYPES[input_dtypes[name]]}* {name}")
        if f"{name}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
    for name, dt in zip(spec["output_names"], output_dtypes):
        params.append(f"    {_CUDA_TYPES[dt]}* {name}")
    consts = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template.items())
    return (_PRELUDE + spec.get("header", "") + "\nnamespace velox_check {\n"
            + f'extern "C" __global__ void {spec["name"]}(\n' + ",\n".join(params) + ") {\n"
            + consts + "\n" + body + "\n}\n}\n")


def compile_source(source: str, arch: str = "compute_90") -> str:
    """PTX of ``source`` for the virtual architecture ``arch`` (default: H100's and H200's,
    ``compute_90``; a real one such as ``sm_90`` also builds machine code, 2.4x the time);
    raises :class:`NvrtcError` with NVRTC's log if it does not compile."""
    lib = _library()
    include = _include_dir()
    if lib is None or include is None:
        raise NvrtcError("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12 "
                         "nvidia-cuda-runtime-cu12)")
    prog = ctypes.c_void_p()
    err = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None)
    if err:
        raise NvrtcError(f"nvrtcCreateProgram failed ({err})")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", f"-I{include}".encode()]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        result = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if result:
            text = log.value.decode(errors="replace")
            numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines()))
            raise NvrtcError(f"{text}\n--- source ---\n{numbered}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


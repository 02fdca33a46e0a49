"""Check the Metal kernels' sources on any machine, no Apple GPU needed.

MLX compiles a ``mx.fast.metal_kernel`` at its first launch, on the Mac, so a typo in a kernel's
Metal rendering (``velox.kernels.dialect``) would otherwise show up only there. This module
reproduces what MLX builds for a launch and checks it three ways:

* :func:`kernel_source` wraps a Metal kernel spec as MLX 0.32's ``mx.fast.metal_kernel`` does
  (``mlx/backend/common/metal_kernel.cpp``): the header, then ``template <int ...>`` for the
  template values, ``[[kernel]] void custom_kernel_<name>_<template>_<dtypes>(...)`` whose
  parameters are the inputs (``const device T*``, or ``const constant T*`` for an input of
  fewer than 8 elements) each followed by ``<name>_shape`` (``const constant int*``) where the
  body names it, the outputs (``device T*``) and the thread attributes the body names
  (``uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]]`` ...), the body,
  and the explicit instantiation ``template [[host_name("...")]] [[kernel]] decltype(...) ...;``
  of the template values. MLX's own header (``metal::utils()``: ``<metal_stdlib>``, its
  ``bfloat16_t``, ``float16_t``) is replaced by :data:`SHIM`.
* :func:`lint`: no dialect token, CUDA name, lambda or double-precision literal is left, and
  every pointer and reference declared says its address space (``device``, ``constant``,
  ``threadgroup``, ``thread``: Metal has no default one).
* :func:`check`: the wrapped sources compiled as C++17 (``g++`` or ``clang++``
  ``-fsyntax-only``) against :data:`SHIM`, a stand-in for what the kernels use of Metal: the
  address-space qualifiers as empty macros (the compiler cannot check them: :func:`lint`
  checks that each pointer names one; a helper written for device and for constant inputs
  is then one function twice, and its second copy is left out), the ``[[...]]`` attributes
  left to the compiler to ignore, ``uint``, ``ushort``, ``uint3``, ``half`` / ``float16_t``,
  ``bfloat`` / ``bfloat16_t``, ``metal::mem_flags``, ``threadgroup_barrier``, the SIMD-group
  shuffles and reductions, ``as_type``, the float math of ``metal::`` and
  ``metal::precise::``, and atomics. Template values and dtypes are
  instantiated, so the body is type-checked as MLX's build would instantiate it: undeclared
  names, misspelt helpers, wrong argument counts or types, an ``as_type`` between types of
  different sizes all fail.

This is a syntax and type check, not Metal's compiler: what only Metal rejects (a threadgroup
pointer passed where a device one is declared, threadgroup memory over 32 KiB, a pipeline over
its thread limit) and what the kernels compute are left to the parity self-check on the Mac
(``velox selftest --backend metal``; ``docs/design/metal.md``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from .dialect import METAL_ATTRIBUTES

__all__ = ["SHIM", "METAL_TYPES", "MAX_CONSTANT_ARRAY_SIZE", "kernel_name", "kernel_source", "lint",
           "threadgroup_bytes", "compiler", "check", "MetalCheckError"]

#: MLX's Metal type of each dtype (``get_type_string``).
METAL_TYPES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t",
               "int32": "int32_t", "uint32": "uint32_t", "bool": "bool"}
#: Inputs of fewer elements than this MLX passes in the ``constant`` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

#: What the kernels use of Metal and of MLX's kernel header, declared for a C++17 compiler.
SHIM = r"""
// velox.kernels.metal's stand-in for Metal (a syntax and type check with a C++ compiler)
#include <cstddef>
#include <cstdint>
#define __METAL_VERSION__ 310
// Address spaces as nothing (velox.kernels.metal.lint checks that every pointer names one; a
// helper's constant-input overload, the same text as its device one here, is left out).
#define device
#define constant
#define threadgroup
#define thread
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct half {
    _Float16 v;
    half() = default;
    half(float f) : v((_Float16)f) {}
    operator float() const { return (float)v; }
};
typedef half float16_t;
struct bfloat {
    uint16_t v;
    bfloat() = default;
    bfloat(float f);
    operator float() const;
};
typedef bfloat bfloat16_t;
namespace metal {
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);
template <typename T> T simd_shuffle_xor(T data, ushort mask);
template <typename T> T simd_shuffle(T data, ushort lane);
template <typename T> T simd_shuffle_down(T data, ushort delta);
template <typename T> T simd_sum(T data);
template <typename T> T simd_max(T data);
template <typename T> T simd_min(T data);
template <typename T, typename U> T as_type(U x) {
    static_assert(sizeof(T) == sizeof(U), "as_type: the two types differ in size");
    T t;
    __builtin_memcpy(&t, &x, sizeof(T));
    return t;
}
float fmax(float a, float b);
float fmin(float a, float b);
float abs(float x);
bool isfinite(float x);
bool isnan(float x);
bool isinf(float x);
float exp(float x);
float log(float x);
float sqrt(float x);
namespace precise {
float exp(float x);
float log(float x);
float sqrt(float x);
}
enum memory_order { memory_order_relaxed };
template <typename T> struct atomic { T v; };
template <typename T> T atomic_fetch_add_explicit(device atomic<T>* object, T operand, memory_order order);
template <typename T> T atomic_load_explicit(const device atomic<T>* object, memory_order order);
template <typename T> void atomic_store_explicit(device atomic<T>* object, T desired, memory_order order);
}  // namespace metal
using namespace metal;
"""


class MetalCheckError(RuntimeError):
    """A Metal kernel source that the check refused; the message carries why."""


def _template_text(template: dict) -> str:
    return "<" + ", ".join(str(int(v)) for v in template.values()) + ">"


def kernel_name(spec: dict, input_dtypes: dict[str, str], output_dtypes: list[str], template: dict,
                input_sizes: dict[str, int] | None = None) -> str:
    """The name MLX gives the kernel of ``spec`` at a launch: ``custom_kernel_<name>``, the
    template values (``__128_8``: MLX's ``make_template_hash`` of ``<128, 8>`` after an
    underscore), each input's type (``c`` after it when the input has fewer than 8 elements)
    and each output's."""
    name = "custom_kernel_" + spec["name"]
    if template:
        name += "__" + "_".join(str(int(v)) for v in template.values())
    for n in spec["input_names"]:
        name += "_" + METAL_TYPES[input_dtypes[n]] + ("c" if _constant(n, input_sizes) else "")
    for dt in output_dtypes:
        name += "_" + METAL_TYPES[dt]
    return name


def _constant(name: str, sizes: dict[str, int] | None) -> bool:
    return sizes is not None and sizes.get(name, MAX_CONSTANT_ARRAY_SIZE) < MAX_CONSTANT_ARRAY_SIZE


def kernel_source(spec: dict, input_dtypes: dict[str, str], output_dtypes: list[str],
                  template: dict, input_sizes: dict[str, int] | None = None) -> str:
    """What MLX builds for a launch of ``spec`` (a Metal kernel spec) after its own header:
    ``spec``'s header, the kernel's signature and body, the instantiation of ``template``
    (``{name: int}``). ``input_sizes``: the inputs' element counts where some are under 8
    (those go to ``constant`` memory; default: every input in ``device`` memory)."""
    body, header = spec["source"], spec.get("header", "")
    name = kernel_name(spec, input_dtypes, output_dtypes, template, input_sizes)
    lines = []
    index = 0
    for n in spec["input_names"]:
        space = "constant" if _constant(n, input_sizes) else "device"
        lines.append(f"  const {space} {METAL_TYPES[input_dtypes[n]]}* {n} [[buffer({index})]]")
        index += 1
        for suffix, ctype in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                              ("_ndim", "const constant int&")):
            if n + suffix in body:
                lines.append(f"  {ctype} {n}{suffix} [[buffer({index})]]")
                index += 1
    for n, dt in zip(spec["output_names"], output_dtypes, strict=True):
        lines.append(f"  device {METAL_TYPES[dt]}* {n} [[buffer({index})]]")
        index += 1
    lines += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES.items() if a in body]
    src = header
    if template:
        src += "template <" + ", ".join(f"int {k}" for k in template) + ">\n"
    src += f"[[kernel]] void {name}(\n" + ",\n".join(lines) + ") {\n" + body + "\n}\n"
    if template:
        inst = name + _template_text(template)
        src += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    return src


# --- lint -----------------------------------------------------------------------------------

_CUDA_NAMES = re.compile(
    r"\b(threadIdx|blockIdx|gridDim|blockDim|warpSize|__syncthreads|__syncwarp|__shared__|__device__|"
    r"__global__|__restrict__|__align__|__shfl\w*|__int_as_float|__float_as_int|__f\w+_rn|__CUDACC__|"
    r"expf|logf|sqrtf|fmaxf|fminf|fabsf|powf|atomicAdd|std)\b")
_SPACES = ("device", "constant", "threadgroup", "thread")
_TYPES = (r"(?:unsigned\s+int|unsigned|float|int|uint|ushort|half|bfloat16_t|float16_t|int32_t|uint32_t|"
          r"size_t|bool|T|velox_v16)")
_DECL = re.compile(rf"(?<![\w.])({_TYPES})\s*(\*|&|\(&)\s*[A-Za-z_(]")
_DOUBLE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")


def _code(source: str) -> str:
    """``source`` without its comments, and without the branches of ``#ifdef
    __METAL_VERSION__`` / ``#ifndef __METAL_VERSION__`` that Metal does not compile (blank
    lines kept, so line numbers stay)."""
    source = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), source, flags=re.S)
    out, keep = [], [True]
    for line in re.sub(r"//[^\n]*", "", source).split("\n"):
        word = line.strip().split()
        if word[:2] in (["#ifdef", "__METAL_VERSION__"], ["#ifndef", "__METAL_VERSION__"]):
            keep.append(keep[-1] and word[0] == "#ifdef")
            line = ""
        elif word[:1] == ["#else"] and len(keep) > 1:
            keep[-1] = keep[-2] and not keep[-1]
            line = ""
        elif word[:1] == ["#endif"] and len(keep) > 1:
            keep.pop()
            line = ""
        out.append(line if keep[-1] else "")
    return "\n".join(out)


def lint(source: str) -> list[str]:
    """What is wrong with a Metal kernel source (a spec's header or body, or
    :func:`kernel_source`'s text) that the compiler check cannot see: a dialect token, a
    CUDA name, a lambda or a ``double`` literal left; a pointer or reference declared without
    an address space. One line per finding (empty: none)."""
    code = _code(source)
    found = []
    for i, line in enumerate(code.splitlines(), 1):
        for m in re.finditer(r"\bVX_\w+", line):
            found.append(f"line {i}: dialect token {m.group(0)} left: {line.strip()}")
        for m in _CUDA_NAMES.finditer(line):
            found.append(f"line {i}: CUDA name {m.group(1)}: {line.strip()}")
        if "[&]" in line or "[=]" in line:
            found.append(f"line {i}: a lambda (Metal has none): {line.strip()}")
        for m in _DOUBLE.finditer(line):
            found.append(f"line {i}: {m.group(1)} is a double literal (Metal has no double; write {m.group(1)}f)")
        for m in _DECL.finditer(line):
            start = max(line.rfind(c, 0, m.start()) for c in "(,;{<") + 1
            words = line[start:m.start()].split()
            if not any(w in _SPACES for w in words):
                found.append(f"line {i}: {m.group(1)}{m.group(2)} without an address space: {line.strip()}")
    return found


_SIZES = {"float": 4, "int": 4, "uint": 4, "unsigned int": 4, "half": 2, "bool": 1}


def threadgroup_bytes(source: str, template: dict) -> int:
    """The bytes of threadgroup memory a Metal kernel body declares (``threadgroup T x[n];``,
    ``threadgroup T x;``) at ``template``'s values, its ``constexpr int`` constants evaluated
    in order (Metal allows 32 KiB a threadgroup)."""
    code = _code(source)
    names = {k: int(v) for k, v in template.items()}
    for m in re.finditer(r"constexpr\s+int\s+(\w+)\s*=\s*([^;]+);", code):
        try:
            names[m.group(1)] = _int_expr(m.group(2), names)
        except (ValueError, SyntaxError, KeyError, TypeError, ZeroDivisionError):
            continue
    total = 0
    for m in re.finditer(r"\bthreadgroup\s+(unsigned int|float|int|uint|half|bool)\s+([^;()]+);", code):
        for declarator in m.group(2).split(","):
            size = re.fullmatch(r"\s*\w+\s*(?:\[([^\]]+)\])?\s*", declarator)
            if size is None:
                raise ValueError(f"a threadgroup declaration not understood: {m.group(0)}")
            total += _SIZES[m.group(1)] * (_int_expr(size.group(1), names) if size.group(1) else 1)
    return total


def _int_expr(expr: str, names: dict) -> int:
    """A C integer expression of ``+ - * / % << ( )``, numbers and ``names``."""
    if not re.fullmatch(r"[\w\s+\-*/%()<]+", expr):
        raise ValueError(expr)
    py = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(names[m.group(0)]), expr).replace("/", "//")
    return int(eval(py, {"__builtins__": {}}))  # digits and operators only, checked above


# --- the compiler check ---------------------------------------------------------------------

def compiler() -> str | None:
    """The C++ compiler the check runs (``g++``, else ``clang++``), or None."""
    return shutil.which("g++") or shutil.which("clang++")


def _without_constant_twins(source: str) -> str:
    """``source`` without each top-level definition that repeats the one before it but for
    ``constant`` in place of ``device`` (a helper's constant-input overload: the same
    function once the shim's address spaces are empty). Line numbers stay."""
    from .dialect import _top_level_items
    out, previous = [], None
    for item in _top_level_items(source):
        if previous is not None and re.sub(r"\bconstant\b", "device", item) == previous:
            out.append("\n" * item.count("\n"))
        else:
            out.append(item)
        previous = item
    return "".join(out)


def _unit(label: str, source: str, k: int) -> str:
    safe = re.sub(r"[^\w.+-]", "_", label)
    return f'\nnamespace velox_unit_{k} {{\n#line 1 "{safe}"\n{_without_constant_twins(source)}\n}}\n'


def _compile(cxx: str, units: list[tuple[str, str]], first: int) -> str | None:
    text = SHIM + "".join(_unit(label, src, first + k) for k, (label, src) in enumerate(units))
    limit = "-ferror-limit=50" if "clang" in cxx else "-fmax-errors=50"
    out = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wno-attributes", limit, "-x", "c++", "-"],
                         input=text, capture_output=True, text=True, timeout=600)
    return None if out.returncode == 0 else out.stderr


def check(units: list[tuple[str, str]], *, parts: int = 2, cxx: str | None = None) -> None:
    """Compile ``units`` (``(label, source)``, each a :func:`kernel_source` text) against
    :data:`SHIM`, each in a namespace of its own, ``parts`` translation units side by side
    (the compiler's messages name a unit by its label as the file); raise
    :class:`MetalCheckError` with the compiler's messages if any does not compile, or if no
    compiler is installed (``apt-get install g++``)."""
    cxx = cxx or compiler()
    if cxx is None:
        raise MetalCheckError("the Metal source check needs a C++ compiler: apt-get install g++ "
                              "(or xcode-select --install on a Mac)")
    parts = max(1, min(parts, len(units)))
    size = -(-len(units) // parts)
    chunks = [(units[i:i + size], i) for i in range(0, len(units), size)]
    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        logs = [log for log in pool.map(lambda c: _compile(cxx, *c), chunks) if log]
    if logs:
        raise MetalCheckError("\n".join(logs))

"""One kernel source, two dialects: the text of every kernel in ``velox.kernels`` is written
once, with a few ``VX_*`` tokens where CUDA and Metal differ, and rendered for
``mx.fast.cuda_kernel`` or for ``mx.fast.metal_kernel``.

The sources are CUDA-flavoured C++ (``static_cast``, templates, ``#pragma unroll``, C's float
math names ``expf`` ...). What the two languages spell differently is a token, expanded here in
Python (the kernel text MLX receives holds no ``VX_`` name: MLX finds the Metal thread
attributes a body uses by their names, and the CUDA text is the very text written before the
dialect existed):

=====================  ==============================  ============================================
token                  CUDA                            Metal
=====================  ==============================  ============================================
``VX_TID``             ``threadIdx.x``                 ``thread_position_in_threadgroup.x`` (in a
                                                       helper of the header: its ``velox_tid``)
``VX_BID``             ``blockIdx.x``                  ``threadgroup_position_in_grid.x``
``VX_NBLOCKS``         ``gridDim.x``                   ``threadgroups_per_grid.x``
``VX_BARRIER``         ``__syncthreads()``             ``velox_barrier()`` (threadgroup and device
                                                       memory, as ``__syncthreads`` orders both)
``VX_SHARED``          ``__shared__``                  ``threadgroup`` (a declaration)
``VX_ALIGN16``         ``__align__(16)``               (nothing: threadgroup memory is aligned)
``VX_FN``              ``__device__``                  (nothing)
``VX_DEVICE``          (nothing)                       ``device`` (a pointer into an output)
``VX_GROUP``           (nothing)                       ``threadgroup`` (a pointer or reference)
``VX_THREAD``          (nothing)                       ``thread`` (a pointer or reference)
``VX_IN``              (nothing)                       ``device`` and ``constant``: a helper taking
                                                       an input pointer is written twice (MLX
                                                       passes inputs of fewer than 8 elements in
                                                       ``constant`` memory)
``VX_PTR(T*)``         ``T*``                          ``auto`` (a local pointer into an input, of
                                                       either address space)
``VX_TID_PARAM``       (nothing)                       ``, uint velox_tid`` (a helper's parameter)
``VX_TID_ARG``         (nothing)                       ``, <the thread index>`` (its argument)
``VX_SHFL_XOR(v, o)``  ``__shfl_xor_sync(0xffffffffu,  ``velox_shfl_xor(v, o)`` (``simd_shuffle_xor``
                       v, o)``                         over the 32 lanes of a SIMD group)
``VX_INT_AS_FLOAT(``   ``__int_as_float(``             ``as_type<float>(``
``VX_FMUL_RN(`` ...    ``__fmul_rn(``, ``__fadd_rn(``, ``velox_fmul_rn(`` ... (one IEEE operation)
                       ``__fdiv_rn(``
``VX_GPU_CODE``        ``__CUDACC__``                  ``__METAL_VERSION__`` (``#ifdef``: device
                                                       code, not the CPU emulation of the tests)
=====================  ==============================  ============================================

Metal's names for C's float math: ``expf``, ``logf``, ``sqrtf`` -> ``metal::precise::exp``,
``log``, ``sqrt``; ``fmaxf``, ``fminf``, ``isfinite`` -> ``metal::fmax``, ``fmin``,
``isfinite``. Metal has no lambdas: a lambda of a kernel body (``[&](...) { ... }``) becomes a
local struct whose members copy what the lambda reads of the body (every such variable is
``const``, a kernel argument, or another such struct: copying equals capturing by reference)
and whose ``operator()`` is the lambda's body. :data:`METAL_PRELUDE` (the Metal header's first
lines) defines the ``velox_*`` functions the tokens name.

Launch geometry and template values are the same in both dialects. Warps and SIMD groups are
both 32 lanes wide (every Apple GPU's SIMD group), so the lane arithmetic (``tid & 31``) is
shared. No kernel uses atomics or half-precision arithmetic (half and bfloat16 values are
loaded and stored through ``static_cast``), so the dialect has no token for them.

``velox.kernels.metal`` wraps a rendered Metal spec as ``mx.fast.metal_kernel`` does and checks
its syntax and types with a C++ compiler and ``metal_shim.h`` (no Apple machine needed); no
Metal kernel has run on Apple hardware in this project's tests (``docs/design/metal.md``).
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["CUDA", "METAL", "DIALECTS", "SHARED_LIMITS", "METAL_PRELUDE", "METAL_ATTRIBUTES", "active",
           "render", "make_spec"]

CUDA, METAL = "cuda", "metal"
DIALECTS = (CUDA, METAL)

#: The static shared (CUDA) or threadgroup (Metal) memory one block may declare: the hosts
#: choose their kernels' layouts within it (Apple GPUs allow 32 KiB a threadgroup).
SHARED_LIMITS = {CUDA: 48 * 1024, METAL: 32 * 1024}

#: The Metal attributes ``mx.fast.metal_kernel`` adds to a kernel's signature when its body
#: names them (MLX's list, ``mlx/backend/common/metal_kernel.cpp``), with their types.
METAL_ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3", "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3",
}

#: The first lines of every Metal kernel's header: what the tokens name.
METAL_PRELUDE = """
// velox's Metal dialect (velox/kernels/dialect.py)
inline void velox_barrier() {
    metal::threadgroup_barrier(metal::mem_flags::mem_device | metal::mem_flags::mem_threadgroup);
}
inline float velox_shfl_xor(float v, int off) { return metal::simd_shuffle_xor(v, (ushort)off); }
inline float velox_fmul_rn(float a, float b) { return a * b; }
inline float velox_fadd_rn(float a, float b) { return a + b; }
inline float velox_fdiv_rn(float a, float b) { return a / b; }
"""

# (pattern, CUDA, Metal in a kernel body, Metal in the header's helpers). A token that
# expands to nothing takes the space beside it along, so the CUDA text is the text as written
# before the tokens.
_TOKENS = (
    (r"\s*\bVX_TID_PARAM\b", "", ", uint velox_tid", ", uint velox_tid"),
    (r"\s*\bVX_TID_ARG\b", "", ", thread_position_in_threadgroup.x", ", velox_tid"),
    (r"\bVX_TID\b", "threadIdx.x", "thread_position_in_threadgroup.x", "velox_tid"),
    (r"\bVX_BID\b", "blockIdx.x", "threadgroup_position_in_grid.x", None),
    (r"\bVX_NBLOCKS\b", "gridDim.x", "threadgroups_per_grid.x", None),
    (r"\bVX_BARRIER\b", "__syncthreads()", "velox_barrier()", "velox_barrier()"),
    (r"\bVX_SHARED\b", "__shared__", "threadgroup", None),
    (r"\bVX_ALIGN16\b ?", "__align__(16) ", "", ""),
    (r"\bVX_FN\b ?", "__device__ ", "", ""),
    (r"\bVX_DEVICE\b ?", "", "device ", "device "),
    (r"\bVX_GROUP\b ?", "", "threadgroup ", "threadgroup "),
    (r"\bVX_THREAD\b ?", "", "thread ", "thread "),
    (r"\bVX_PTR\(([^()]*)\)", r"\1", "auto", "auto"),
    (r"\bVX_SHFL_XOR\(", "__shfl_xor_sync(0xffffffffu, ", "velox_shfl_xor(", "velox_shfl_xor("),
    (r"\bVX_INT_AS_FLOAT\(", "__int_as_float(", "as_type<float>(", "as_type<float>("),
    (r"\bVX_FMUL_RN\(", "__fmul_rn(", "velox_fmul_rn(", "velox_fmul_rn("),
    (r"\bVX_FADD_RN\(", "__fadd_rn(", "velox_fadd_rn(", "velox_fadd_rn("),
    (r"\bVX_FDIV_RN\(", "__fdiv_rn(", "velox_fdiv_rn(", "velox_fdiv_rn("),
    (r"\bVX_GPU_CODE\b", "__CUDACC__", "__METAL_VERSION__", "__METAL_VERSION__"),
)
_COMPILED = tuple((re.compile(p), c, m, h) for p, c, m, h in _TOKENS)
_VX_IN = re.compile(r"\bVX_IN\b ?")
_ANY_TOKEN = re.compile(r"\bVX_\w+")

_METAL_MATH = {"expf": "metal::precise::exp", "logf": "metal::precise::log",
               "sqrtf": "metal::precise::sqrt", "fmaxf": "metal::fmax", "fminf": "metal::fmin",
               "isfinite": "metal::isfinite"}
_MATH = re.compile(r"(?<![\w:.])(" + "|".join(_METAL_MATH) + r")\s*\(")


@lru_cache(maxsize=1)
def active() -> str:
    """The dialect of this process's GPU: ``"metal"`` where MLX has a Metal device, else
    ``"cuda"`` (an MLX build has one GPU backend)."""
    import mlx.core as mx
    return METAL if mx.metal.is_available() else CUDA


def render(text: str, dialect: str, *, header: bool = False) -> str:
    """``text`` (a kernel body, or with ``header`` a kernel header) in ``dialect``, every
    ``VX_*`` token expanded. A Metal header's helpers that take an input pointer
    (``VX_IN``) are written once for ``device`` and once for ``constant`` inputs; a Metal body
    keeps its lambdas (:func:`make_spec` turns them into structs)."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown kernel dialect {dialect!r}; one of {', '.join(DIALECTS)}")
    if dialect == CUDA:
        text = _VX_IN.sub("", text)
        for pattern, cuda, _, _ in _COMPILED:
            text = pattern.sub(cuda, text)
    else:
        if header:
            text = _both_input_spaces(text)
        elif _VX_IN.search(text):
            raise ValueError("VX_IN marks a helper's parameter: a kernel body takes VX_PTR")
        for pattern, _, body, helper in _COMPILED:
            out = helper if header else body
            if out is None:
                if pattern.search(text):
                    raise ValueError(f"{pattern.pattern} is not for a helper of the header")
                continue
            text = pattern.sub(out, text)
        text = _MATH.sub(lambda m: _METAL_MATH[m.group(1)] + "(", text)
    left = _ANY_TOKEN.search(text)
    if left:
        raise ValueError(f"unknown dialect token {left.group(0)!r}")
    return text


def make_spec(name: str, input_names: list, output_names: list, source: str, header: str,
              dialect: str) -> dict:
    """A kernel's ``mx.fast.cuda_kernel`` / ``mx.fast.metal_kernel`` arguments (``name``,
    ``input_names``, ``output_names``, ``source``, ``header``) in ``dialect``: the body and the
    header rendered (:func:`render`); Metal's header after :data:`METAL_PRELUDE`, its body's
    lambdas as structs."""
    source = render(source, dialect)
    if dialect == METAL:
        params = list(input_names) + [f"{n}_shape" for n in input_names if f"{n}_shape" in source] \
            + list(output_names) + [a for a in METAL_ATTRIBUTES if a in source]
        source = _structs_for_lambdas(source, params)
        header = METAL_PRELUDE + render(header, dialect, header=True)
        if "[&]" in header:
            raise ValueError("a lambda in a kernel header: Metal has none")
    else:
        header = render(header, dialect, header=True)
    return dict(name=name, input_names=list(input_names), output_names=list(output_names),
                source=source, header=header)


# --- Metal: helpers of both input address spaces --------------------------------------------

def _top_level_items(text: str) -> list[str]:
    """``text`` cut after each top-level ``}`` (and the ``;`` that ends a struct), comments
    and preprocessor lines skipped when counting braces; the pieces join back to ``text``."""
    items, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if text.startswith("//", i) or (text[i] == "#" and (i == 0 or text[i - 1] == "\n")):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                j = i + 1
                while j < len(text) and text[j] in " \t":
                    j += 1
                if j < len(text) and text[j] == ";":
                    i = j
                items.append(text[start:i + 1])
                start = i + 1
        i += 1
    items.append(text[start:])
    return items


def _both_input_spaces(header: str) -> str:
    """Each top-level item of ``header`` that names ``VX_IN`` twice: for ``device`` inputs,
    then for ``constant`` ones (overloads by address space; a helper taking several input
    pointers takes arrays of one shape, so of one address space)."""
    out = []
    for item in _top_level_items(header):
        if _VX_IN.search(item):
            out.append(_VX_IN.sub("device ", item))
            out.append(_VX_IN.sub("constant ", item))
        else:
            out.append(item)
    return "".join(out)


# --- Metal: lambdas as local structs --------------------------------------------------------

_IDENT = re.compile(r"(?<![\w.])(?<!->)(?<!::)([A-Za-z_]\w*)\b(?!\s*::)")
_ASSIGNED = re.compile(r"\b([A-Za-z_]\w*)\s*=(?!=)")
_ARRAY = re.compile(r"\b(?:float|int|unsigned int|uint|bool|size_t)\s+([A-Za-z_]\w*)\s*\[")
_KEYWORDS = frozenset("""auto bool break case char const constexpr continue default do double else
    float for if int long return short signed size_t sizeof static static_cast struct switch
    template typename unsigned void while true false uint ushort""".split())


def _matching(text: str, i: int, open_: str, close: str) -> int:
    """The index of the bracket closing the one at ``i``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced {open_}{close} in a kernel source")


def _declared_const(before: str, name: str) -> bool:
    """Whether the last assignment of ``name`` in ``before`` is a ``const``/``constexpr``
    declaration (its statement starts so) or an ``auto`` lambda object."""
    last = None
    for m in re.finditer(rf"\b{re.escape(name)}\s*=(?!=)", before):
        last = m
    if last is None:
        return False
    start = max(before.rfind(c, 0, last.start()) for c in ";{}") + 1
    statement = before[start:last.start()].lstrip()
    return statement.startswith(("const ", "constexpr ", "auto "))


def _structs_for_lambdas(source: str, params: list[str]) -> str:
    """``source`` with each lambda ``[&](args) -> R { body }`` replaced by an object of a local
    struct declared before the lambda's line: ``typedef``s of what the body reads of the kernel
    (by ``decltype``: a kernel argument keeps its address space), members of those types and
    ``R operator()(args) const { body }`` (``auto`` without ``-> R``)."""
    k = 0
    while True:
        at = source.find("[&](")
        if at < 0:
            return source
        p_open = at + 3
        p_close = _matching(source, p_open, "(", ")")
        args = source[p_open + 1:p_close]
        b_open = source.index("{", p_close)
        ret = source[p_close + 1:b_open].strip()
        if ret and not ret.startswith("->"):
            raise ValueError(f"a lambda's specifiers are not taken: {ret!r}")
        ret = ret[2:].strip() if ret else "auto"
        b_close = _matching(source, b_open, "{", "}")
        body = source[b_open:b_close + 1]
        before = source[:at]
        own = set(_IDENT.findall(args)) | set(_ASSIGNED.findall(body)) | set(_ARRAY.findall(body))
        arrays = set(_ARRAY.findall(before))
        known = set(params) | set(_ASSIGNED.findall(before)) | arrays
        captured = []
        for name in _IDENT.findall(body):
            if name in own or name in _KEYWORDS or name not in known or name in captured:
                continue
            if name not in params:
                if name in arrays:
                    raise ValueError(f"a lambda reads the array {name!r} (threadgroup memory or "
                                     f"a thread's): pass it")
                if not _declared_const(before, name):
                    raise ValueError(f"a lambda reads {name!r}, which is not const: the Metal "
                                     f"struct would copy what CUDA reads by reference")
            captured.append(name)
        struct = f"velox_fn{k}"
        line = before.rfind("\n") + 1
        indent = re.match(r"[ \t]*", source[line:]).group(0)
        decl = "".join(f"{indent}typedef decltype({c}) {struct}_{c};\n" for c in captured)
        decl += (f"{indent}struct {struct} {{"
                 + "".join(f" {struct}_{c} {c};" for c in captured)
                 + f"\n{indent}    {ret} operator()({args}) const {body}\n{indent}}};\n")
        obj = f"{struct}{{{', '.join(captured)}}}"
        source = source[:line] + decl + source[line:at] + obj + source[b_close + 1:]
        k += 1


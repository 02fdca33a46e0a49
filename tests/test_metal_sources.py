"""The Metal renderings of every kernel (``velox.kernels.dialect``), checked on any machine.

No Apple GPU or Metal compiler is reachable where these run, so what is checked is what can be:
for every kernel variant of ``tests/test_kernels.py``, ``tests/test_codec_kernel.py`` and
``tests/test_kivi_kernel.py`` (the enumerations the NVRTC compile tests use, at their template
values and dtypes), the Metal source has every placeholder filled and every input and output
used, holds no dialect token, CUDA name, lambda, ``double`` literal or pointer without an
address space (``velox.kernels.metal.lint``), and, wrapped as MLX 0.32's ``mx.fast.metal_kernel``
wraps it, compiles as C++17 against ``velox.kernels.metal.SHIM`` (every template value and
dtype instantiated: a syntax and type check). The threadgroup memory each kernel declares at
the launches the host makes on Metal fits Metal's 32 KiB. The checks catch what they are for:
a misspelt helper, a type error, a pointer without its address space.

The C++ compiler is required: without one these tests fail (CI installs g++, ``.ci/run``).
Whether the kernels compute what they should on an Apple GPU is the parity self-check's
question (``velox selftest --backend metal``), asked on the user's Mac.
"""

from __future__ import annotations

import re

import pytest

from tests import test_codec_kernel as tck
from tests import test_kernels as tk
from tests import test_kivi_kernel as tkk
from velox.kernels import codec as ck
from velox.kernels import dialect
from velox.kernels import evict as ev
from velox.kernels import kivi as kk
from velox.kernels import merge as mg
from velox.kernels import metal

# Inputs that MLX passes in constant memory at every launch (fewer than 8 elements), and those
# that are that small at some launches (next_pos, held: [b, h]; the chunks' maxima and sums of
# one chunk of few heads), which the "small" build of each kernel puts there too.
ALWAYS_SMALL = {"params", "cfg", "seedmix"}
SOMETIMES_SMALL = ALWAYS_SMALL | {"next_pos", "held", "pm", "ps", "pl"}


def _sizes(spec, small):
    return {n: 1 for n in spec["input_names"] if n in small}


def _evict_spec(variant, dialect_name):
    kind, *_ = variant
    if kind.startswith("merge"):
        return mg._spec("plan" if kind == "merge_plan" else "compact", dialect_name)
    return ev._spec(variant, dialect_name)


def _cases():
    """``{variant id: (spec, [(label, in_dtypes, out_dtypes, template, sizes)], template
    names)}``: every kernel variant in Metal, with the builds the compile check makes."""
    cases = {}
    for variant in tk.KERNEL_VARIANTS:
        kind, _ = tk._spec(variant)
        spec = _evict_spec(variant, dialect.METAL)
        builds = []
        modes = range(4) if kind.startswith("merge") else [None]
        for dt in ("float32", "float16", "bfloat16"):
            ins, outs = tk._dtypes(kind, spec, dt)
            for mode in modes:
                tmpl = tk.TEMPLATE[kind] if mode is None else {**tk.TEMPLATE[kind], "MODE": mode}
                builds.append((f"{dt}-mode{mode}", ins, outs, tmpl, _sizes(spec, ALWAYS_SMALL)))
        ins, outs = tk._dtypes(kind, spec, "float16")
        builds.append(("float16-small", ins, outs, tk.TEMPLATE[kind], _sizes(spec, SOMETIMES_SMALL)))
        cases[str(variant)] = (spec, builds, set(tk.TEMPLATE[kind]) - {"FW"})
    for codec, values in tck.SPLIT_VARIANTS:
        spec = ck.split_spec(codec, values, dialect=dialect.METAL)
        builds = [(f"{dt}-{d}-{k}", tck._split_dtypes(spec, dt), ["float32"] * 3,
                   tck._template(codec, d, 4, bits=k, sign_words=k), _sizes(spec, ALWAYS_SMALL))
                  for c, v, dt, d, k in tck.COMPILE_CASES if (c, v) == (codec, values)]
        builds.append(("small-g32", tck._split_dtypes(spec, "float16"), ["float32"] * 3,
                       tck._template(codec, 128, ck.MAX_GROUPS, bits=3, sign_words=1),
                       _sizes(spec, SOMETIMES_SMALL)))
        cases[f"codec-{codec}-{values}"] = (spec, builds, set(tck._template(codec)))
    spec = ck.merge_spec(dialect=dialect.METAL)
    builds = []
    for dt in ("float32", "float16", "bfloat16"):
        for d in ck.HEAD_DIMS:
            ins = dict(qry=dt, kn=dt, vn=dt, pm="float32", pl="float32", pa="float32", params="float32")
            builds.append((f"{dt}-{d}", ins, [dt], dict(HEAD_DIM=d, G=4), _sizes(spec, ALWAYS_SMALL)))
            builds.append((f"{dt}-{d}-small", ins, [dt], dict(HEAD_DIM=d, G=1), _sizes(spec, SOMETIMES_SMALL)))
    cases["codec-merge"] = (spec, builds, {"HEAD_DIM", "G"})
    for append in (False, True):
        spec = kk.split_spec(append, dialect=dialect.METAL)
        builds = []
        for bits, gs, d, dts, g, quant, resid in tkk.COMPILE_CASES:
            if ("knew" in dts) != append:
                continue
            outs = ["float32"] * 3 + ([dts["rk"]] * 2 + ["int32"] if append else [])
            tmpl = tkk._template(d, g, bits, gs, quant, resid)
            builds.append((f"{bits}-{gs}-{d}-{g}-{quant}{resid}-{dts['qry']}-{dts['rk']}", dts, outs, tmpl,
                           _sizes(spec, ALWAYS_SMALL)))
        dts = tkk._dtypes(append=append)
        outs = ["float32"] * 3 + (["float16"] * 2 + ["int32"] if append else [])
        # a step with no quantized token (their arrays are one-element placeholders), and one
        # with no residual row
        quant_placeholders = {"kc", "ks", "kz", "vc", "vs", "vz"}
        builds.append(("no-quant", dts, outs, tkk._template(quant=0),
                       _sizes(spec, SOMETIMES_SMALL | quant_placeholders)))
        builds.append(("no-resid", dts, outs, tkk._template(resid=0), _sizes(spec, SOMETIMES_SMALL | {"rk", "rv"})))
        cases[f"kivi-{'step' if append else 'split'}"] = (spec, builds, set(tkk._template()))
    return cases


CASES = _cases()
# the kernels' own constants (upper case) beside the template values
CONSTS = {"WORDS", "PARTS", "NW", "TPW", "TILE", "GP", "VW", "VG", "LR", "GR", "CODE", "CU", "RU"}


@pytest.mark.parametrize("variant", list(CASES))
def test_metal_source_is_complete_and_clean(variant):
    """Placeholders filled, every declared input and output used, no upper-case name but the
    template values the wrapper passes (and the kernel's own constants), and nothing
    :func:`velox.kernels.metal.lint` finds in the body or the header."""
    spec, _, template = CASES[variant]
    src = metal._code(spec["source"])
    ours = template | set(spec["input_names"]) | set(spec["output_names"])
    for token in {"ACCUMULATE", "BIAS", "NOISE", "GROUP_COMBINE", "GROUP_FINAL", "THREADS", "SELECT",
                  "CHUNK_MAX", "MAX_GROUPS", "CARRY_SLOT", "BY", "RAW_SCORE", "CARRY", "CARRY_ROWS", "NT",
                  "MT", "SHARED", "LOAD", "LOGITS", "SIDE", "VALUE", "SRC", "TABLE", "ACC", "NORM", "OUTPUT",
                  "STORED", "APPEND"} - ours:
        assert not re.search(rf"\b{token}\b", src), (variant, token)
    assert "/*" not in spec["source"]
    for name in spec["input_names"] + spec["output_names"]:
        assert re.search(rf"\b{name}\b", src), (variant, name)
    names = set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", src)) - set(spec["input_names"]) - CONSTS
    assert names <= template and names >= {t for t in template if len(t) > 2 and t != "FW"}, (variant, names)
    for part in ("header", "source"):
        assert metal.lint(spec[part]) == [], (variant, part, metal.lint(spec[part]))
    assert spec["header"].startswith(dialect.METAL_PRELUDE)
    used = {a for a in dialect.METAL_ATTRIBUTES if a in spec["source"]}
    assert used <= {"thread_position_in_threadgroup", "threadgroup_position_in_grid", "threadgroups_per_grid"}
    assert "thread_position_in_threadgroup" not in spec["header"]  # a helper takes velox_tid


def test_metal_sources_compile():
    """Every variant's every build (dtypes, template values, inputs in device or constant
    memory), wrapped as MLX wraps it, compiles as C++17 against the shim."""
    units = []
    for variant, (spec, builds, _) in CASES.items():
        for label, ins, outs, tmpl, sizes in builds:
            src = metal.kernel_source(spec, ins, outs, tmpl, sizes)
            assert metal.lint(src) == [], (variant, label)
            units.append((f"{spec['name']}.{label}", src))
    assert len(units) > 300
    metal.check(units)


def test_the_check_needs_a_compiler_and_catches_errors():
    """A compiler is there (CI installs g++); a misspelt helper, a type error (a pointer as a
    float), an ``as_type`` between types of different sizes each fail the compiler check; a
    pointer without its address space, a CUDA name, a lambda and a double literal fail the
    lint."""
    assert metal.compiler() is not None, "the Metal source check needs g++ (apt-get install g++)"
    variant = "('weights', 'mean', 'decay', False)"
    spec, builds, _ = CASES[variant]
    label, ins, outs, tmpl, sizes = builds[1]
    good = metal.kernel_source(spec, ins, outs, tmpl, sizes)
    metal.check([("good", good)])
    broken = {
        "typo": ("velox_block_reduce<1024>(m,", "velox_block_reduse<1024>(m,", "velox_block_reduse"),
        "type": ("const float scale = params[0];", "const float scale = params;", "cannot convert"),
        "as_type": ("as_type<float>(0x7f800000)", "as_type<float>((size_t)0x7f800000)", "as_type"),
    }
    for what, (old, new, message) in broken.items():
        assert good.count(old) >= 1, what
        with pytest.raises(metal.MetalCheckError, match=message):
            metal.check([(what, good.replace(old, new, 1))])
    lints = {"float* l = lg": "without an address space", "__syncthreads()": "CUDA name",
             "auto f = [&](int t) { return t; };": "lambda", "x = 1.5 * y;": "double literal",
             "VX_BARRIER;": "dialect token", "expf(x)": "CUDA name"}
    for text, message in lints.items():
        found = metal.lint(f"    {text}\n")
        assert found and message in found[0], (text, found)
    # what Metal does not compile stays out of the lint: the emulation's branch of velox_row8
    assert metal.lint("#ifdef __METAL_VERSION__\nx;\n#else\nstd::memcpy(a, b, 4);\n#endif\n") == []


def test_kernel_source_is_wrapped_as_mlx_wraps_it():
    """The signature, name and instantiation of ``mx.fast.metal_kernel``'s build
    (``write_signature`` and ``make_template_hash`` of MLX 0.32): inputs then their
    ``_shape`` buffers, outputs, the thread attributes the body names, a constant input
    marked ``c`` in the name."""
    spec = dict(name="k", input_names=["x", "p"], output_names=["y"], header="// h\n",
                source="    y[0] = x[x_shape[0] - 1] * p[0] + threadgroup_position_in_grid.x"
                       " + thread_position_in_threadgroup.x;")
    src = metal.kernel_source(spec, {"x": "float16", "p": "float32"}, ["float32"], {"A": 128, "B": 8},
                              {"p": 5})
    name = "custom_kernel_k__128_8_float16_t_floatc_float"
    assert src == (
        "// h\ntemplate <int A, int B>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* x [[buffer(0)]],\n"
        "  const constant int* x_shape [[buffer(1)]],\n"
        "  const constant float* p [[buffer(2)]],\n"
        "  device float* y [[buffer(3)]],\n"
        "  uint3 thread_position_in_threadgroup [[thread_position_in_threadgroup]],\n"
        "  uint3 threadgroup_position_in_grid [[threadgroup_position_in_grid]]) {\n"
        f"{spec['source']}\n}}\n"
        f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<128, 8>) {name}<128, 8>;\n')
    metal.check([("wrapped", src)])


def test_dialect_tokens_render_in_both_dialects():
    """Each token's CUDA text is the text the kernels held before the dialect; Metal's names
    Metal's built-ins; a helper taking an input pointer is written for both address spaces; a
    lambda becomes a struct of copies of the const values it reads; what cannot be copied as
    it is read (a value the body changes, threadgroup memory) is refused."""
    body = ("    const unsigned int tid = VX_TID;\n    VX_SHARED VX_ALIGN16 float red[8];\n"
            "    VX_DEVICE float* o = out + VX_BID * VX_NBLOCKS;\n    VX_BARRIER;\n"
            "    float v = VX_SHFL_XOR(red[tid], 16) + VX_INT_AS_FLOAT(0x7f800000);\n"
            "    v = VX_FMUL_RN(v, 2.0f) + expf(v) + sqrtf(fmaxf(v, 1.0f));\n"
            "    VX_PTR(const float*) x = in + 1;\n    h(v, red VX_TID_ARG);\n")
    assert dialect.render(body, "cuda") == (
        "    const unsigned int tid = threadIdx.x;\n    __shared__ __align__(16) float red[8];\n"
        "    float* o = out + blockIdx.x * gridDim.x;\n    __syncthreads();\n"
        "    float v = __shfl_xor_sync(0xffffffffu, red[tid], 16) + __int_as_float(0x7f800000);\n"
        "    v = __fmul_rn(v, 2.0f) + expf(v) + sqrtf(fmaxf(v, 1.0f));\n"
        "    const float* x = in + 1;\n    h(v, red);\n")
    assert dialect.render(body, "metal") == (
        "    const unsigned int tid = thread_position_in_threadgroup.x;\n    threadgroup float red[8];\n"
        "    device float* o = out + threadgroup_position_in_grid.x * threadgroups_per_grid.x;\n"
        "    velox_barrier();\n"
        "    float v = velox_shfl_xor(red[tid], 16) + as_type<float>(0x7f800000);\n"
        "    v = velox_fmul_rn(v, 2.0f) + metal::precise::exp(v) + metal::precise::sqrt(metal::fmax(v, 1.0f));\n"
        "    auto x = in + 1;\n    h(v, red, thread_position_in_threadgroup.x);\n")
    header = ("VX_FN float h(float v, VX_GROUP float* r VX_TID_PARAM) { return r[VX_TID]; }\n"
              "VX_FN float g(const VX_IN float* p) { return p[0]; }\n")
    assert dialect.render(header, "cuda", header=True) == (
        "__device__ float h(float v, float* r) { return r[threadIdx.x]; }\n"
        "__device__ float g(const float* p) { return p[0]; }\n")
    assert dialect.render(header, "metal", header=True) == (
        "float h(float v, threadgroup float* r, uint velox_tid) { return r[velox_tid]; }\n"
        "float g(const device float* p) { return p[0]; }\n"
        "float g(const constant float* p) { return p[0]; }\n")
    with pytest.raises(ValueError, match="unknown dialect token"):
        dialect.render("VX_WARP_SUM(x)", "cuda")
    with pytest.raises(ValueError, match="helper"):
        dialect.render("VX_BID", "metal", header=True)
    lam = ("    const int n = S_shape[0];\n"
           "    auto f = [&](int t) -> float { return t < n ? S[t] : 0.0f; };\n    o[0] = f(1);\n")
    spec = dialect.make_spec("k", ["S"], ["o"], lam, "", "metal")
    assert "typedef decltype(n) velox_fn0_n;" in spec["source"]
    assert "struct velox_fn0 { velox_fn0_n n; velox_fn0_S S;" in spec["source"]
    assert "float operator()(int t) const { return t < n ? S[t] : 0.0f; }" in spec["source"]
    assert "auto f = velox_fn0{n, S};" in spec["source"]
    assert dialect.make_spec("k", ["S"], ["o"], lam, "", "cuda")["source"] == lam
    with pytest.raises(ValueError, match="not const"):
        dialect.make_spec("k", ["S"], ["o"], lam.replace("const int n", "int n"), "", "metal")
    with pytest.raises(ValueError, match="array 'red'"):
        dialect.make_spec("k", ["S"], ["o"], "    VX_SHARED float red[4];\n    red[0] = 1.0f;\n"
                          "    auto f = [&](int t) { return red[t]; };\n", "", "metal")


def test_threadgroup_memory_fits_metal_at_the_launches_made_there(monkeypatch):
    """The host's own count of a block's shared memory (codec and KIVI split kernels,
    attend_weights' first kernel) is what the kernel declares; at every layout the host takes
    on Metal the kernels declare at most Metal's 32 KiB (on CUDA the same layouts as before)."""
    limit = dialect.SHARED_LIMITS[dialect.METAL]
    for variant, (spec, builds, _) in CASES.items():
        for label, ins, outs, tmpl, sizes in builds:
            used = metal.threadgroup_bytes(spec["source"], tmpl)
            if spec["name"] in ("velox_attend_part",) or spec["name"].startswith(("velox_codec_split",
                                                                                     "velox_kivi")):
                continue  # their template values are the host's choice, checked below
            assert used <= limit, (variant, label, used)
    part = ev._attend_part_spec(dialect=dialect.METAL)["source"]
    for d in (32, 64, 96, 128, 256):
        for g in (1, 2, 4, 7, 8, 16, 128):
            for name in dialect.DIALECTS:
                groups = ev.attend_groups(d, g, name)
                tmpl = dict(HEAD_DIM=d, GROUPS=groups, UNROLL=1)
                assert metal.threadgroup_bytes(part, tmpl) == ev.attend_part_bytes(d, groups)
                assert ev.attend_part_bytes(d, groups) <= dialect.SHARED_LIMITS[name], (d, g, name)
            assert ev.attend_groups(d, g, "cuda") == min(g, ev.ATTEND_GROUPS)
    for codec in ("mse", "rvq", "prod", "qjl"):
        for values in ("int8", "exact"):
            src = ck.split_spec(codec, values, dialect=dialect.METAL)["source"]
            for g in (1, 4, 8, 32):
                bits = 0 if codec == "qjl" else 3
                words = 2 if codec in ("prod", "qjl") else 0
                lay = ck._Layout(codec, values, bits, words, g, 128, ck.split_size(g))
                tmpl = dict(HEAD_DIM=128, G=g, SPLIT=lay.split, BITS=bits, SIGN_WORDS=words)
                assert metal.threadgroup_bytes(src, tmpl) == ck.shared_bytes(lay)
    src = kk.split_spec(True, dialect=dialect.METAL)["source"]
    for name in dialect.DIALECTS:
        for g in (1, 2, 4, 8, 16, 32):
            for d in kk.HEAD_DIMS:
                lay = kk._Layout(4, 32, g, d, kk.split_size(g, d, name))
                tmpl = dict(HEAD_DIM=d, G=g, BITS=4, GS=32, SPLIT=lay.split, QUANT=1, RESID=1)
                assert metal.threadgroup_bytes(src, tmpl) == kk.shared_bytes(lay)
                if name == "cuda":
                    assert lay.split == kk.split_size(g)
                if kk.shared_bytes(lay) > dialect.SHARED_LIMITS[name]:
                    assert (name, d, g) in {("metal", 128, 32)}, (name, d, g)  # refused: the MLX path


def test_the_metal_names_the_kernels_use_are_ones_mlx_s_metal_kernels_use():
    """Every ``metal::`` name, ``as_type`` and Metal type the generated sources use appears in
    MLX's own Metal kernel headers (compiled by Apple's compiler wherever MLX is built): the
    shim declares nothing the kernels need that Metal lacks."""
    import importlib.util
    from pathlib import Path
    root = importlib.util.find_spec("mlx")
    headers = Path(list(root.submodule_search_locations)[0]) / "include/mlx/backend/metal/kernels"
    if not headers.is_dir():
        pytest.skip("this MLX wheel ships no Metal kernel headers")
    mlx_text = "\n".join(p.read_text(errors="replace") for p in headers.rglob("*.h"))
    used = set()
    for spec, _, _ in CASES.values():
        text = metal._code(spec["header"] + spec["source"])
        used |= {m.split("::")[-1] for m in re.findall(r"\bmetal::(?:\w+::)*\w+", text)}
        used |= set(re.findall(r"\b(as_type|ushort|uint3|uint|float16_t|bfloat16_t)\b", text))
    assert {"threadgroup_barrier", "mem_device", "mem_threadgroup", "simd_shuffle_xor", "exp", "fmax",
            "isfinite", "as_type"} <= used, used
    missing = sorted(n for n in used if not re.search(rf"\b{n}\b", mlx_text))
    assert missing == [], missing

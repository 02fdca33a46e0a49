"""KIVI's CUDA decode step (``velox.kernels.kivi``) against ``velox.methods.kivi.attend``.

The checks of ``tests/test_codec_kernel.py``, with its helpers (the C++ emulation of the
CUDA sources), for KIVI's layout:

* the sources: every variant (bits x group_size x head_dim, the dtypes of queries, scales and
  residual rows, steps without quantized tokens or without residual rows, 1 and 32 query
  heads per kv head) compiles with NVRTC to PTX for compute_90 (no GPU needed);
* the emulation: the kernel sources compiled as C++ for the CPU, run through
  ``decode_attend``'s wrapper and compared with ``attend``'s MLX path: within
  ``TOLERANCE`` of ``attend`` evaluated in float32 (the queries, keys and values upcast) and
  within ``HALF_TOLERANCE`` of ``attend`` itself (skipped without a C++20 compiler, and on a
  CUDA machine, where the GPU tests run the kernels);
* on an NVIDIA GPU: ``decode_attend`` against the same two references over bits, group
  sizes, head_dims, GQA groups, dtypes and stored lengths, up to the benchmark's 32768 tokens.
"""

from __future__ import annotations

import itertools
import re
import sys
import zlib

import mlx.core as mx
import numpy as np
import pytest

import velox
from tests import test_codec_kernel as tck
from velox.backend import device_supports
from velox.kernels import codec as ck
from velox.kernels import kivi as kk
from velox.kernels import nvrtc
from velox.methods import kivi

needs_cuda, needs_nvrtc, needs_cxx = tck.needs_cuda, tck.needs_nvrtc, tck.needs_cxx
DTYPES = [mx.float16, mx.bfloat16, mx.float32]


# --- sources --------------------------------------------------------------------------------

def _template(head_dim=128, groups=4, bits=2, gs=32, quant=1, resid=1):
    return dict(HEAD_DIM=head_dim, G=groups, BITS=bits, GS=gs, SPLIT=kk.split_size(groups),
                QUANT=quant, RESID=resid)


def _dtypes(query="float16", side="float16", resid="float16", append=False):
    d = dict(qry=query, kc="uint32", ks=side, kz=side, vc="uint32", vs=side, vz=side,
             rk=resid, rv=resid, params="float32", cfg="int32")
    return dict(d, knew=query, vnew=query, next_pos="int32") if append else d


@pytest.mark.parametrize("append", [False, True])
def test_split_source_is_complete(append):
    """Markers filled (or dropped), every input and output used, no upper-case name but the
    template values the wrapper passes and the kernel's own constants."""
    spec = kk.split_spec(append)
    src = re.sub(r"//[^\n]*", "", spec["source"])
    assert not re.search(r"\bNT\b", src) and "/*" not in src and "APPEND" not in src
    for name in spec["input_names"] + spec["output_names"]:
        assert re.search(rf"\b{name}\b", src), name
    consts = {"NW", "TPW", "TILE", "GP", "VW", "VG", "LR", "GR", "CODE", "CU", "RU"}
    names = set(re.findall(r"\b[A-Z][A-Z_]*\b", src)) - consts
    assert names == set(_template()), names


COMPILE_CASES = (
    [(bits, gs, d, _dtypes(), 4, 1, 1) for bits in kk.BITS for gs in kk.GROUP_SIZES
     for d in kk.HEAD_DIMS if d % gs == 0]
    + [(2, 32, 128, _dtypes(q, s, r), 4, 1, 1) for q, s, r in
       (("float32", "float16", "float32"), ("bfloat16", "bfloat16", "bfloat16"),
        ("float16", "float16", "bfloat16"), ("float32", "bfloat16", "float16"),
        ("bfloat16", "bfloat16", "float32"))]
    + [(4, 64, 128, _dtypes(), 4, 0, 1), (8, 32, 64, _dtypes("float32"), 2, 1, 0),
       (2, 128, 128, _dtypes(), 32, 1, 1), (8, 32, 128, _dtypes("bfloat16", "bfloat16"), 1, 1, 1)]
    + [(bits, 32, d, _dtypes(q, "float16", r, append=True), g, quant, 1) for bits, d, q, r, g, quant in
       ((4, 64, "bfloat16", "float16", 4, 1), (2, 128, "float16", "float16", 32, 1),
        (8, 128, "float32", "bfloat16", 3, 0), (4, 128, "bfloat16", "float32", 1, 1))])


@needs_nvrtc
@pytest.mark.parametrize("bits,gs,head_dim,dtypes,groups,quant,resid", COMPILE_CASES, ids=str)
def test_split_source_compiles(bits, gs, head_dim, dtypes, groups, quant, resid):
    """Every variant, and the appending one, compiles to PTX for compute_90 as MLX wraps it at a launch
    (no GPU needed)."""
    append = "knew" in dtypes
    spec = kk.split_spec(append)
    tmpl = _template(head_dim, groups, bits, gs, quant, resid)
    outs = ["float32"] * 3 + ([dtypes["rk"]] * 2 + ["int32"] if append else [])
    ptx = nvrtc.compile_source(nvrtc.kernel_source(spec, dtypes, outs, tmpl))
    assert f".entry {spec['name']}" in ptx


@needs_nvrtc
@pytest.mark.parametrize("append", [False, True])
def test_compacted_split_source_compiles_to_the_same_program(append):
    """What a launch builds (``velox.kernels.build``: comments and indentation dropped)
    compiles to the same PTX as the split kernel's source as written; the merge's too."""
    from velox.kernels import codec as ck
    from velox.kernels import compact
    dtypes = _dtypes("bfloat16", "bfloat16", "bfloat16", append)
    outs = ["float32"] * 3 + (["bfloat16"] * 2 + ["int32"] if append else [])
    merge = dict(qry="bfloat16", kn="bfloat16", vn="bfloat16", pm="float32", pl="float32",
                 pa="float32", params="float32")
    for spec, ins, out, tmpl in ((kk.split_spec(append), dtypes, outs, _template(64, 4, 4, 32)),
                                 (ck.merge_spec(), merge, ["bfloat16"], dict(HEAD_DIM=64, G=4))):
        small = {**spec, "source": compact(spec["source"]), "header": compact(spec.get("header", ""))}
        ptx = [nvrtc.compile_source(nvrtc.kernel_source(s, ins, out, tmpl)) for s in (spec, small)]
        assert ptx[0] == ptx[1], spec["name"]


# --- which states and queries the kernels take (any machine) ----------------------------------

def _state(b, h, d, n, dtype, seed=0, **params):
    return tck._state("kivi", b, h, d, n, dtype, seed=seed, **params)


def test_layouts_taken_and_refused():
    """Bits 2, 4, 8 with every group size KIVI's spec allows, at head_dim 64 / 128, are taken;
    3 bits, another head_dim, a group wider than the head, more than one query token, a group
    count that does not divide or exceeds 32, integer queries, or another method's state are
    refused."""
    for bits, gs, d in itertools.product(kk.BITS, kk.GROUP_SIZES, kk.HEAD_DIMS):
        if d % gs:
            continue
        st = _state(1, 2, d, 2 * gs + 5, mx.float16, bits=bits, group_size=gs, residual_length=4)
        assert kivi.quantized_tokens(st) > 0
        assert kk._layout(st, mx.zeros((1, 8, 1, d))) is not None, (bits, gs, d)
    st = _state(1, 2, 128, 40, mx.float16, residual_length=4)
    q = mx.zeros((1, 8, 1, 128))
    assert kk._layout(st, q) is not None and kk._layout(st, q.astype(mx.bfloat16)) is not None
    assert kk._layout(st, mx.zeros((1, 8, 2, 128))) is None  # s > 1
    assert kk._layout(st, mx.zeros((1, 7, 1, 128))) is None  # 7 heads over 2 kv heads
    assert kk._layout(st, mx.zeros((1, 66, 1, 128))) is None  # 33 per kv head
    assert kk._layout(st, mx.zeros((1, 8, 1, 128), mx.int32)) is None
    assert kk._layout(st, mx.zeros((2, 8, 1, 128))) is None  # batch
    assert kk._layout(_state(1, 1, 32, 40, mx.float32, residual_length=4), mx.zeros((1, 1, 1, 32))) is None
    assert kk._layout(_state(1, 1, 64, 40, mx.float32, bits=3, residual_length=4), mx.zeros((1, 4, 1, 64))) is None
    assert kk._layout(_state(1, 1, 128, 40, mx.float16, residual_length=4), mx.zeros((1, 32, 1, 128))) is not None
    # every residual dtype, and no stored token at all
    for rd in ("float16", "bfloat16", "float32", "model"):
        assert kk._layout(_state(1, 1, 64, 3, mx.bfloat16, residual_dtype=rd), mx.zeros((1, 1, 1, 64))) is not None
    assert kk._layout(_state(1, 1, 64, 0, mx.float16), mx.zeros((1, 1, 1, 64))) is not None
    assert kk._layout(_state(1, 1, 64, 2, mx.float32).value_codes, mx.zeros((1, 1, 1, 64))) is None
    assert kk._layout(velox.init("tova", 1, 1, 64, budget=8), mx.zeros((1, 1, 1, 64))) is None
    # the launch plan, kept per shape, is there exactly where the layout is
    for st_, q_ in ((st, q), (st, mx.zeros((1, 7, 1, 128))), (velox.init("tova", 1, 1, 64, budget=8), q),
                    (_state(1, 1, 64, 40, mx.float32, bits=3, residual_length=4), mx.zeros((1, 4, 1, 64)))):
        for _ in range(2):
            assert (kk._plan(st_, q_) is None) == (kk._layout(st_, q_) is None)
    if not device_supports("cuda"):
        assert not kk.supports(st, q)
        with pytest.raises(ValueError, match="keys and values"):
            kk.decode_attend(st, q, mx.zeros((1, 2, 2, 128)), mx.zeros((1, 2, 2, 128)), scale=0.1)
    with pytest.raises(ValueError, match="supports"):
        kk.decode_attend(st, mx.zeros((1, 8, 2, 128)), mx.zeros((1, 2, 1, 128)),
                         mx.zeros((1, 2, 1, 128)), scale=0.1)


def test_splits_cover_the_tokens():
    """The split arithmetic the kernel reads (``plan_splits``, its spans through ``cfg``):
    every quantized token and residual row in exactly one split, quantized spans of whole
    32-token blocks (whole words and groups at every bits), none empty, none over the block's
    ``SPLIT``; quantized spans of whole tiles where ``SPLIT`` allows."""
    for b, h, nq_groups, nr, g, gs, bits in itertools.product(
            (1, 2), (1, 8), (0, 1, 3, 17, 1023), (0, 1, 159, 513), (1, 4, 32), (32, 128), kk.BITS):
        nq, split = nq_groups * gs, kk.split_size(g)
        nqs, nrs, qspan, rspan = kk.plan_splits(b, h, nq, nr, split, bits)
        assert nrs == -(-nr // split) and (nqs > 0) == (nq > 0)
        assert qspan % 32 == 0 and qspan <= split and rspan <= split
        assert qspan % kk.tile(bits) == 0 or qspan == split
        for n, ns, span in ((nq, nqs, qspan), (nr, nrs, rspan)):
            lens = [max(0, min(span, n - s * span)) for s in range(ns)]
            assert sum(lens) == n and (not lens or min(lens) > 0), (b, h, nq, nr, g, gs, bits)


def test_attend_routes_decode_steps_through_the_module(monkeypatch):
    """``kivi.attend`` calls ``velox.kernels.kivi.decode_attend`` for a decode step where
    ``supports`` takes it (looked up through the module, so a test can switch it off), and
    never for a chunk of several tokens."""
    st = _state(1, 2, 64, 50, mx.float32, residual_length=8)
    calls = []
    monkeypatch.setattr(kk, "supports", lambda s, q: True)
    sentinel = mx.full((1, 4, 1, 64), 7.0)
    monkeypatch.setattr(kk, "decode_attend", lambda *a, **k: calls.append(k) or sentinel)
    q1, k1 = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 1, 64))
    assert kivi.attend(st, q1, k1, k1, scale=0.1) is sentinel and calls == [dict(scale=0.1)]
    out = kivi.attend(st, mx.zeros((1, 4, 3, 64)), mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)),
                      scale=0.1, mask="causal")
    assert isinstance(out, mx.array) and len(calls) == 1
    monkeypatch.setattr(kk, "supports", lambda s, q: False)
    assert isinstance(kivi.attend(st, q1, k1, k1, scale=0.1), mx.array) and len(calls) == 1


# --- the emulation, and the comparison both it and the GPU tests make --------------------------

def _emulated_kernel(codec, values, inputs, grid, threadgroup, output_shapes, output_dtypes, template):
    """``velox.kernels.kivi._run_kernel`` on the CPU: ``test_evict_kernel_emulation``'s
    emulation (a fiber per CUDA thread, warp shuffles included) of the split kernel
    (``velox.kernels.kivi``) and the merge kernel (``velox.kernels.codec``)."""
    from tests import test_evict_kernel_emulation as te
    spec = ck.merge_spec() if codec is None else kk.split_spec(codec == "kivi+append")
    return te.emulate(spec, inputs, grid, threadgroup, output_shapes, output_dtypes, template)


def _mlx_path(st, q, kn, vn, scale, monkeypatch):
    """``kivi.attend`` on its MLX path, and the same in float32 (queries, keys, values upcast)."""
    with monkeypatch.context() as mp:
        mp.setattr(kk, "supports", lambda *a, **k: False)
        ref = kivi.attend(st, q, kn, vn, scale=scale)
        f32 = kivi.attend(st, q.astype(mx.float32), kn.astype(mx.float32), vn.astype(mx.float32),
                          scale=scale)
    return ref, f32


def _step(b, h, g, d, dtype, seed=1):
    rng = np.random.default_rng(seed)

    def arr(*s):
        return mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)

    return arr(b, h * g, 1, d), arr(b, h, 1, d), arr(b, h, 1, d)


def _compare(case, monkeypatch, *, check_layout=True):
    b, h, g, d, n, dtype, params = case
    what = repr(case)
    st = _state(b, h, d, n, dtype, seed=zlib.crc32(what.encode()), **params)
    q, kn, vn = _step(b, h, g, d, dtype, seed=n)
    scale = d ** -0.5
    if check_layout:
        assert kk._layout(st, q) is not None, what
    ref, f32 = _mlx_path(st, q, kn, vn, scale, monkeypatch)
    out = kk.decode_attend(st, q, kn, vn, scale=scale)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape == (b, h * g, 1, d), what
    a = np.array(out.astype(mx.float32))
    assert np.isfinite(a).all(), what
    for r, tol in ((f32, kk.TOLERANCE[dtype]), (ref, kk.HALF_TOLERANCE[dtype])):
        np.testing.assert_allclose(a, np.array(r.astype(mx.float32)), atol=tol[0], rtol=tol[1],
                                   err_msg=what)
    return st


# b, h, g, d, n, dtype, params (KIVI's defaults: bits 2, group_size 32, residual_length 128)
EMU_CASES = [
    (1, 2, 4, 128, 700, mx.float16, dict()),                       # 17 groups: uneven splits
    (2, 1, 3, 64, 300, mx.float32, dict(bits=8, residual_length=40)),
    (1, 1, 32, 128, 600, mx.float16, dict(residual_length=16)),    # spans under a tile (2 bits)
    (1, 2, 4, 64, 2500, mx.bfloat16, dict(bits=4)),                 # several whole tiles
    (1, 2, 2, 64, 128, mx.bfloat16, dict(bits=4, group_size=64, residual_length=0)),  # no residual
    (1, 1, 5, 128, 100, mx.float16, dict(bits=8, residual_dtype="float32")),         # no quantized
    (1, 1, 1, 128, 647, mx.float32, dict(group_size=128, residual_length=600)),      # 2 residual splits
    (1, 2, 4, 64, 71, mx.bfloat16, dict(residual_length=8, residual_dtype="bfloat16")),  # full window
    (1, 1, 2, 64, 0, mx.float16, dict()),                          # nothing stored
]


needs_emulation = [
    needs_cxx,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the emulation's fibers use glibc's ucontext"),
    pytest.mark.skipif(device_supports("cuda"), reason="the GPU tests run the kernels themselves"),
]


def _marks(marks):
    def apply(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn
    return apply


@_marks(needs_emulation)
@pytest.mark.parametrize("case", EMU_CASES, ids=lambda c: f"{c[:5]}-{c[5]}-{c[6]}")
def test_emulated_kernels_match_attend(case, monkeypatch):
    monkeypatch.setattr(kk, "_run_kernel", _emulated_kernel)
    st = _compare(case, monkeypatch)
    b, h, g, d, n, dtype, params = case
    r, nq = st.residual_keys.shape[2], kivi.quantized_tokens(st)
    assert r + nq == n


def _arrays(state) -> list:
    return [x for x in state if isinstance(x, mx.array)]


def _steps(case, monkeypatch, steps):
    """``steps`` decode steps of KIVI's ``attend_update`` (the kernels' path) beside ``attend``
    on the MLX path and ``update``: the state equal to the bit, every step, the output within
    ``TOLERANCE`` of ``attend`` in float32; how many steps flushed a group."""
    b, h, g, d, n, dtype, params = case
    st = _state(b, h, d, n, dtype, seed=zlib.crc32(repr(case).encode()), **params)
    ref_st, flushes = st, 0
    for i in range(steps):
        q, kn, vn = _step(b, h, g, d, dtype, seed=1000 + i)
        out, st = kivi.attend_update(st, q, kn, vn, scale=d ** -0.5)
        _, f32 = _mlx_path(ref_st, q, kn, vn, d ** -0.5, monkeypatch)
        flushes += kivi.flush_count(ref_st, 1) > 0
        ref_st = kivi.update(ref_st, kn, vn, queries=q)
        assert all(x.dtype == y.dtype and x.shape == y.shape and bool(mx.array_equal(x, y))
                   for x, y in zip(_arrays(st), _arrays(ref_st))), (case, i)
        atol, rtol = kk.TOLERANCE[dtype]  # (the half MLX path's own rounding is checked above)
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(f32), atol=atol,
                                   rtol=rtol, err_msg=f"{case} step {i}")
    return flushes


STEP_CASES = [  # b, h, g, d, n, dtype, params: 40 steps cross group flushes
    (1, 2, 4, 64, 70, mx.float32, dict(bits=4, residual_length=8)),
    (2, 1, 3, 128, 40, mx.bfloat16, dict(residual_length=8, group_size=32)),
    (1, 1, 2, 64, 0, mx.float16, dict(bits=8, residual_length=4, residual_dtype="float32")),
]


@_marks(needs_emulation)
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: f"{c[:5]}-{c[5]}-{c[6]}")
def test_emulated_attend_update_is_attend_then_update(case, monkeypatch):
    """The decode step's two launches (``decode_step``: attention, and the residual window
    with the token appended) then the flush: ``update``'s state to the bit and ``attend``'s
    output, step after step, from an empty state on, through group flushes."""
    monkeypatch.setattr(kk, "_run_kernel", _emulated_kernel)
    monkeypatch.setattr(kk, "_on_device", lambda: True)
    calls = []
    real = kk.decode_step
    monkeypatch.setattr(kk, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert _steps(case, monkeypatch, 40) >= 1
    assert len(calls) == 40


def test_attend_update_without_the_kernels(monkeypatch):
    """Where the kernels do not take a step (a chunk of tokens, the reference backend, a
    machine without CUDA) ``attend_update`` is ``attend`` then ``update``, exactly; rows of
    the wrong shape or dtype are refused as ``update`` refuses them."""
    st = _state(1, 2, 64, 50, mx.float32, residual_length=8)
    for s in (1, 3):
        q, kn, vn = (mx.random.normal((1, n, s, 64)) for n in (4, 2, 2))
        out, new = kivi.method.attend_update(st, q, kn, vn, scale=0.125, mask="causal")
        assert bool(mx.array_equal(out, kivi.attend(st, q, kn, vn, scale=0.125, mask="causal")))
        assert all(bool(mx.array_equal(x, y)) for x, y in zip(_arrays(new), _arrays(
            kivi.update(st, kn, vn, queries=q))))
    ref = velox.init("kivi", 1, 2, 64, residual_length=8, backend="reference")
    monkeypatch.setattr(kk, "_on_device", lambda: True)
    monkeypatch.setattr(kk, "decode_step", lambda *a, **k: pytest.fail("the reference backend takes no kernel"))
    kivi.method.attend_update(ref, mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)), scale=0.1)
    with pytest.raises(ValueError):
        kivi.method.attend_update(st, mx.zeros((1, 4, 1, 64)), mx.zeros((1, 3, 1, 64)), mx.zeros((1, 3, 1, 64)), scale=0.1)
    with pytest.raises(ValueError):
        kivi.method.attend_update(st, mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 1, 64), mx.float16),
                                  mx.zeros((1, 2, 1, 64), mx.float16), scale=0.1)


@_marks(needs_emulation)
@pytest.mark.slow  # runs with --run-slow
def test_the_adapter_decodes_through_attend_update(monkeypatch):
    """Through mlx-lm's generate_step, KIVI's decode steps take the kernels' path (emulated):
    the same tokens as with the kernels off, and the same first layer's state."""
    from mlx.utils import tree_map
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    from velox.adapters.mlxlm import make_cache
    mx.random.seed(3)
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=97, rope_theta=10000.0)  # head_dim 32
    args.head_dim = 64
    model = llama.Model(args)
    model.update(tree_map(lambda p: p * 4.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    prompt = mx.array([1, 5, 7, 9, 11, 13, 2, 4, 6, 8] * 4)

    def run():
        caches = make_cache(model, "kivi", bits=4, residual_length=8)
        toks = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=caches, max_tokens=36,
                                                 prefill_step_size=16)]
        return toks, caches

    off_toks, off = run()
    monkeypatch.setattr(kk, "_run_kernel", _emulated_kernel)
    monkeypatch.setattr(kk, "_on_device", lambda: True)
    calls = []
    real = kk.decode_step
    monkeypatch.setattr(kk, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    on_toks, on = run()
    assert on_toks == off_toks
    assert len(calls) >= 2 * 35 and len(calls) % 2 == 0  # every single-token step, both layers
    # layer 0's keys and values come from the tokens alone: its state is the same to the bit;
    # later layers' see the kernels' float32 rounding of the attention before them
    assert all(bool(mx.array_equal(x, y)) for x, y in zip(_arrays(on[0].velox_state),
                                                          _arrays(off[0].velox_state)))
    for a, b in zip(on, off):
        assert a.offset == b.offset and [x.shape for x in _arrays(a.velox_state)] == \
            [x.shape for x in _arrays(b.velox_state)]


# --- on the GPU ------------------------------------------------------------------------------

GPU_EXTREMES = [  # b, h, g, d, n, dtype, params
    (1, 2, 4, 128, 0, mx.float16, dict()),                                   # nothing stored
    (2, 2, 4, 128, 100, mx.bfloat16, dict()),                                # no quantized token
    (1, 2, 4, 128, 4096, mx.float32, dict(residual_length=0)),               # no residual row
    (1, 2, 1, 128, 300, mx.bfloat16, dict()),                                # one query head
    (1, 1, 32, 128, 300, mx.float16, dict(group_size=128)),                  # 32 query heads
    (1, 2, 4, 64, 1500, mx.float32, dict(residual_length=1100)),             # 3 residual splits
    (1, 8, 4, 128, 32768, mx.float16, dict()),                               # the benchmark's
]


@needs_cuda
@pytest.mark.parametrize("case", GPU_EXTREMES, ids=lambda c: f"{c[:5]}-{c[5]}-{c[6]}")
def test_decode_attend_at_the_extremes(case, monkeypatch):
    """No stored token, no quantized token, an empty residual window, one and 32 query heads
    per kv head, several residual splits, and the benchmark's 32768 tokens."""
    _compare(case, monkeypatch)


GPU_SETTINGS = [dict(bits=b, group_size=gs) for b in (2, 4, 8) for gs in kk.GROUP_SIZES]
# b, h, g, d, n: lengths not multiples of a group or of a split, the residual window full. MLX
# compiles its CUDA kernels per dtype and shape at their first run, so each setting takes one
# shape and one dtype and residual dtype, in turn.
GPU_SHAPES = [(2, 2, 4, 128, 1000), (1, 2, 4, 64, 415), (1, 8, 4, 128, 4099)]


@needs_cuda
@pytest.mark.parametrize("params", GPU_SETTINGS, ids=str)
def test_decode_attend_matches_attend(params, monkeypatch):
    """Every bits x group size (GQA 4, head_dim 128 and 64), the shape, the dtype and the
    residual dtype cycling."""
    i = GPU_SETTINGS.index(params)
    b, h, g, d, n = GPU_SHAPES[i % 3] if 64 % params["group_size"] == 0 else GPU_SHAPES[2 * (i % 2)]
    rd = ("float16", "bfloat16", "float32", "model")[i % 4]
    _compare((b, h, g, d, n, DTYPES[i % 3], dict(params, residual_dtype=rd)), monkeypatch)


@needs_cuda
def test_decode_attend_under_compile_and_with_large_logits(monkeypatch):
    """Inside ``mx.compile`` the kernels give the same result; queries scaled up 30x (a peaked
    softmax over the splits) still match."""
    st = _state(1, 2, 128, 777, mx.float16, bits=4)
    q, kn, vn = _step(1, 2, 4, 128, mx.float16)
    f = mx.compile(lambda s_, q_, k_, v_: kk.decode_attend(s_, q_, k_, v_, scale=128 ** -0.5))
    np.testing.assert_array_equal(np.array(f(st, q, kn, vn)),
                                  np.array(kk.decode_attend(st, q, kn, vn, scale=128 ** -0.5)))
    q = q * 30
    _, f32 = _mlx_path(st, q, kn, vn, 128 ** -0.5, monkeypatch)
    atol, rtol = kk.TOLERANCE[mx.float16]
    np.testing.assert_allclose(np.array(kk.decode_attend(st, q, kn, vn, scale=128 ** -0.5).astype(mx.float32)),
                               np.array(f32), atol=atol, rtol=rtol)


@needs_cuda
def test_attend_runs_the_kernels_on_a_decode_step():
    st = _state(1, 2, 128, 300, mx.float16)
    q, kn, vn = _step(1, 2, 4, 128, mx.float16)
    assert kk.supports(st, q)
    np.testing.assert_array_equal(np.array(kivi.attend(st, q, kn, vn, scale=0.1)),
                                  np.array(kk.decode_attend(st, q, kn, vn, scale=0.1)))


@needs_cuda
@pytest.mark.parametrize("case", [(1, 8, 4, 64, 8000, mx.bfloat16, dict(bits=4)),
                                  (2, 2, 7, 128, 300, mx.float16, dict(bits=2, residual_length=16)),
                                  (1, 2, 1, 128, 5, mx.float32, dict(bits=8, residual_length=8))],
                         ids=lambda c: f"{c[:5]}-{c[5]}-{c[6]}")
def test_attend_update_is_attend_then_update(case, monkeypatch):
    """On the GPU: ``attend_update``'s state is ``update``'s to the bit and its output
    ``attend``'s, over 40 decode steps through group flushes."""
    assert _steps(case, monkeypatch, 40) >= 1

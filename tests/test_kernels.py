"""The fused kernel backend (``cuda``) of the per-step evictors against the ``mlx`` backend.

At a decode step of a full cache the kernel backend runs its fused kernels; these tests
drive many such steps (GQA queries and the key proxy, several shapes and dtypes, per-head and
per-layer selection) and compare every state with the ``mlx`` backend's: positions exactly,
kept rows bit for bit (eviction copies rows), scores within float32 rounding. They need an
NVIDIA GPU; the contract suite (``test_contract.py``) covers the same backend against the
reference wherever it runs.
"""

from __future__ import annotations

import re
import zlib

import mlx.core as mx
import numpy as np
import pytest

from velox.backend import BackendUnavailable, device_supports
from velox.registry import get_method, method_keys
from velox.spec import load_spec, spec_keys

# The methods with fused kernels: those whose spec declares a ``cuda`` backend. A composed
# method (``tova+affine``) has no spec file of its own; it runs its policy's kernels.
KERNEL_METHODS = tuple(k for k in method_keys() if k in spec_keys() and "cuda" in load_spec(k).backends)


def test_kernel_backends_are_registered_and_refused_without_a_gpu():
    for key in KERNEL_METHODS:
        m = get_method(key)
        assert "cuda" in m.backends
        if not device_supports("cuda"):
            with pytest.raises(BackendUnavailable, match="NVIDIA GPU"):
                m.init(1, 1, 32, backend="cuda")


@pytest.mark.parametrize("key", method_keys())
def test_spec_declares_the_registered_backends(key):
    m = get_method(key)
    assert set(m.spec.backends) == set(m.backends), key


needs_cuda = pytest.mark.skipif(not device_supports("cuda"), reason="needs an NVIDIA GPU (MLX CUDA)")


def _normal(rng, dtype):
    """``draw(*shape)``: standard normal arrays from ``rng`` (float32 draws), as ``dtype``."""
    return lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


needs_nvrtc = pytest.mark.skipif(
    not __import__("velox.kernels.nvrtc", fromlist=["available"]).available(),
    reason="needs NVIDIA's NVRTC wheel: pip install \".[kernels-check]\" (Linux x86-64)")

SHAPES = [(1, 8, 0, 128), (2, 4, 3, 64), (3, 2, 2, 96), (1, 1, 1, 32)]  # b, h, groups (0 = proxy), d

# Each kernel method runs at its defaults ("") and at the second settings of its kernel path
# named here (per-head or per-layer selection, another scoring or merge rule: see _params).
VARIANTS = {"tova": ("per_head",), "knorm": ("high",), "kvzip": ("latest",), "morphkv": ("max", "window1"),
            "chunkkv": ("per_layer", "key_norm"), "cam": ("mean", "window", "drop")}
DECODE_CASES = [(key, variant) for key in KERNEL_METHODS for variant in ("", *VARIANTS.get(key, ()))]
# The non-finite rule: each kernel method at its defaults, and CaM's window merge.
NONFINITE_CASES = [(key, "") for key in KERNEL_METHODS] + [("cam", "window")]


def _params(key: str, budget: int, variant: str) -> dict:
    """The method's parameters; ``variant`` names a second setting of the method's kernel path
    (per-head or per-layer selection, another scoring rule)."""
    if key == "streaming_llm":
        return dict(n_sink=3, window_size=budget - 3)
    if key == "tova":
        return dict(budget=budget, n_sink=3, per_head=variant == "per_head")
    if key == "knorm":
        return dict(budget=budget, n_sink=3, recent=2, keep=variant or "low")
    if key == "kvzip":  # per-layer running-max importance, or TOVA's rule with the importance carried
        return dict(budget=budget, n_sink=3, probe=variant or "context", per_head=variant == "latest")
    if key == "morphkv":
        return dict(budget=budget, n_sink=3, **{"": dict(window=4),
                                                "max": dict(window=3, aggregate="max", per_head=False),
                                                "window1": dict(window=1)}[variant])
    if key == "curdkv":
        return dict(budget=budget, n_sink=3, rank_cap=8)
    if key == "cam":  # each merge rule; the gate on in two of them
        return dict(budget=budget, n_sink=3, grace=5, decay=0.95, seed=5, **{
            "": dict(merge="sim_weighted", merge_keys=True),
            "mean": dict(merge="mean", merge_gate=False),
            "window": dict(merge="window", merge_window=6, merge_keys=True),
            "drop": dict(merge="drop")}[variant])
    if key == "chunkkv":
        return dict(budget=budget, chunk_size=4, n_sink=3, grace=5, decay=0.95,
                    **{"": {}, "per_layer": dict(per_head=False), "key_norm": dict(score="key_norm")}[variant])
    if key == "qfilters":  # online filters: still calibrating over the first decode steps
        return dict(budget=budget, n_sink=3, recent=2, calib_tokens=budget + 20)
    if key == "keyformer":  # the temperature still annealing over the decode steps
        return dict(budget=budget, n_sink=3, recent=5, tau_init=1.0, tau_end=0.25,
                    anneal_steps=budget + 20, decay=0.95, seed=3)
    return dict(budget=budget, n_sink=3, grace=5, decay=0.95)


# CaM's merged rows may differ in their last bit (of the cache's dtype): the kernels sum cosines
# and norms in another order than MLX's reductions, and MLX's own scatter-add of several
# losers into one row (prefill) adds in no fixed order, so two runs of the mlx ops differ too.
# The scores and key norms computed from such rows differ at the same relative scale.
MERGED_RTOL = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}


def _compare(key, a, b, step):
    what = f"{key} step {step}"
    np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions), err_msg=what)
    np.testing.assert_array_equal(np.array(a.next_pos), np.array(b.next_pos), err_msg=what)
    for f in ("keys", "values"):
        x, y = (np.array(getattr(s_, f).astype(mx.float32)) for s_ in (a, b))
        if key == "cam":
            rtol = MERGED_RTOL[a.keys.dtype]
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol, err_msg=what)
        else:
            np.testing.assert_array_equal(x, y, err_msg=what)
    if key == "cam":
        rtol = MERGED_RTOL[a.keys.dtype]
        np.testing.assert_allclose(np.array(a.key_norms), np.array(b.key_norms), rtol=rtol,
                                   atol=rtol, err_msg=what)
        np.testing.assert_allclose(np.array(a.scores), np.array(b.scores), rtol=rtol, atol=rtol,
                                   err_msg=what)
        return
    if key == "qfilters":  # the online filters, from the same mlx ops on both
        np.testing.assert_array_equal(np.array(a.filters), np.array(b.filters), err_msg=what)
    carried = {"kvzip": "importance", "morphkv": "profiles"}.get(key, "scores")
    if carried in a._fields:  # the per-token data the kernels carry beside the rows
        np.testing.assert_allclose(np.array(getattr(a, carried)), np.array(getattr(b, carried)),
                                   rtol=2e-5, atol=1e-6, err_msg=what)


@needs_cuda
@pytest.mark.parametrize("key,variant", DECODE_CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kernel_decode_steps_match_mlx(key, variant, shape, dtype):
    b, h, g, d = shape
    budget, steps = 40, 30
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr((key, variant, shape, dtype)).encode()))

    arr = _normal(rng, dt)

    m = get_method(key)
    params = _params(key, budget, variant)
    states = {be: m.init(b, h, d, dtype=dt, backend=be, **params) for be in ("mlx", "cuda")}
    assert states["cuda"].backend == "cuda"
    compiled = mx.compile(m.update)
    compiled_q = mx.compile(lambda s_, k_, v_, q_: m.update(s_, k_, v_, queries=q_))
    prefill = (arr(b, h, budget + 7, d), arr(b, h, budget + 7, d),
               arr(b, h * g, budget + 7, d) if g else None)
    for step in range(steps + 1):
        k, v, q = prefill if step == 0 else (arr(b, h, 1, d), arr(b, h, 1, d),
                                             arr(b, h * g, 1, d) if g else None)
        states = {be: m.update(st, k, v, queries=q) for be, st in states.items()}
        mx.eval(states)
        _compare(key, states["cuda"], states["mlx"], step)
        if step > 0:  # the compiled kernel update equals the plain one
            again = compiled(prev, k, v) if q is None else compiled_q(prev, k, v, q)
            _compare(key, again, states["cuda"], step)
        prev = states["cuda"]


ATTENDED = ["tova", "h2o", "streaming_llm", "knorm", "keyformer", "kvzip"]  # own kernel output, or the extra launch


@needs_cuda
@pytest.mark.parametrize("key", ATTENDED)
@pytest.mark.parametrize("shape", [(1, 8, 4, 64), (3, 2, 2, 128), (2, 4, 1, 32)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_attended_decode_step_matches_attention_then_update(key, shape, dtype):
    """The adapter's fused decode step on the ``cuda`` backend computes the attention output
    in the scores' kernel (``with_attention``): the output equals MLX's attention over the
    stored rows and the new token, and the state (with its deferred row written) equals the
    plain update's, step after step."""
    from velox import decode
    from velox.decode import write_row
    b, h, g, d = shape
    budget, steps = 40, 12
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr((key, shape, dtype)).encode()))

    arr = _normal(rng, dt)

    m = get_method(key)
    st = m.init(b, h, d, dtype=dt, backend="cuda", **_params(key, budget, ""))
    st = m.update(st, arr(b, h, budget + 5, d), arr(b, h, budget + 5, d), queries=arr(b, h * g, budget + 5, d))
    fused = mx.compile(decode._STEP_KINDS["fused"](m))
    tol = 2e-5 if dt == mx.float32 else 2e-2
    for step in range(steps):
        q, k, v = arr(b, h * g, 1, d), arr(b, h, 1, d), arr(b, h, 1, d)
        assert m.backends["cuda"].with_attention(st, k, v, q) is not None
        want = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([st.keys, k], axis=2), mx.concatenate([st.values, v], axis=2), scale=d ** -0.5)
        plain = m.update(st, k, v, queries=q)
        out, new, row = fused(st, q, k, v, d ** -0.5)
        if row is not None:
            new = write_row(new, row)
        mx.eval(out, new, plain, want)
        np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   rtol=tol, atol=tol, err_msg=f"{key} step {step}")
        _compare(key, new, plain, step)
        st = plain


@needs_cuda
@pytest.mark.parametrize("case", [(1, 8, 4, 64, 2112, 2080, "bfloat16"), (32, 8, 4, 64, 2112, 2048, "bfloat16"),
                                  (2, 2, 10, 128, 700, 650, "float32"), (3, 3, 3, 64, 300, 0, "float16"),
                                  (4, 2, 2, 256, 513, 513, "float32")], ids=str)
def test_attend_is_attention_over_the_filled_prefix(case):
    """``attend`` over the first ``rows`` slots of a buffer (the rest NaN: never read) and the
    new row equals MLX's attention over those rows and the new one, split into chunks or not."""
    from velox.kernels import evict as ev
    b, h, g, d, n, rows, dtype = case
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    arr = _normal(rng, dt)
    q, kn, vn = arr(b, h * g, 1, d), arr(b, h, 1, d), arr(b, h, 1, d)
    garbage = mx.arange(n)[None, None, :, None] >= rows
    k, v = (mx.where(garbage, mx.nan, arr(b, h, n, d)).astype(dt) for _ in range(2))
    out = ev.attend(q, k, v, kn, vn, rows=rows)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k[:, :, :rows], kn], axis=2),
                                                mx.concatenate([v[:, :, :rows], vn], axis=2), scale=d ** -0.5)
    tol = 2e-5 if dt == mx.float32 else 2e-2
    assert out.dtype == dt and out.shape == want.shape
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.parametrize("case", [(1, 8, 4, 64, 2047, "float32", "mean", None),
                                  (1, 8, 4, 64, 2047, "bfloat16", "mean", "decay"),
                                  (2, 2, 10, 128, 700, "float32", "max", "max"),
                                  (32, 8, 4, 64, 1000, "float16", "mean", None)], ids=str)
def test_attend_weights_split_matches_attention_and_the_weights_kernel(case, monkeypatch):
    """``attend_weights`` over several chunks (chunks of at least 128 rows here, so every case
    splits; ten query heads in two passes): the output equals MLX's attention over stored +
    new, ``w`` and the carried scores equal the one-block ``weights`` kernel's."""
    from velox.kernels import evict as ev
    monkeypatch.setattr(ev, "MIN_CHUNK", 128)
    monkeypatch.setattr(ev, "SPLIT_BLOCKS", 1024)
    b, h, g, d, n, dtype, group, accumulate = case
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))

    arr = _normal(rng, dt)

    q, k, v, kn, vn = arr(b, h * g, 1, d), arr(b, h, n, d), arr(b, h, n, d), arr(b, h, 1, d), arr(b, h, 1, d)
    old = mx.array(rng.random((b, h, n)).astype(np.float32)) if accumulate else None
    assert -(-(n + 1) // ev.split_chunk(n + 1, b * h)) > 1
    out, w, scores = ev.attend_weights(q, k, v, kn, vn, old=old, accumulate=accumulate, decay=0.9, group=group)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, kn], axis=2),
                                                mx.concatenate([v, vn], axis=2), scale=d ** -0.5)
    ref_w, ref_s = ev.weights(q, k, kn, old=old, accumulate=accumulate, decay=0.9, group=group)
    tol = 2e-5 if dt == mx.float32 else 2e-2
    assert out.dtype == dt
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(np.array(w), np.array(ref_w), rtol=1e-5, atol=1e-8)
    if accumulate:
        np.testing.assert_allclose(np.array(scores), np.array(ref_s), rtol=1e-5, atol=1e-8)


@needs_cuda
@pytest.mark.parametrize("case", [(1, 8, 4, 64, 2047, "bfloat16", "tova", True),
                                  (32, 8, 4, 64, 2047, "bfloat16", "h2o", False),
                                  (2, 2, 10, 128, 700, "float32", "streaming_llm", False),
                                  (3, 4, 2, 64, 1500, "float16", "tova", False)], ids=str)
def test_attend_select_equals_attend_weights_then_select(case):
    """``attend_select`` (the combine and the selection in one launch) over many chunks gives
    the output, slot, row, positions, next position and carried scores of ``attend_weights``
    followed by ``select``, bit for bit, on shuffled slots with tied scores."""
    from velox.kernels import evict as ev
    b, h, g, d, n, dtype, key, shared = case
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))

    arr = _normal(rng, dt)

    q, k, v, kn, vn = arr(b, h * g, 1, d), arr(b, h, n, d), arr(b, h, n, d), arr(b, h, 1, d), arr(b, h, 1, d)
    k = mx.concatenate([k[:, :, :n // 2], k[:, :, :n - n // 2]], axis=2)  # equal keys: tied scores
    order = np.stack([rng.permutation(n) for _ in range(1 if shared else h)])
    pos = mx.array(np.broadcast_to(order, (b, h, n)).astype(np.int32))
    nxt = mx.full((b, h), n + 7, mx.int32)
    old = mx.array(rng.random((b, h, n)).astype(np.float32)) if key == "h2o" else None
    acc = "decay" if key == "h2o" else None
    by = {"tova": "weights", "h2o": "carried", "streaming_llm": "none"}[key]
    sel = dict(n_sink=4, recent=3, shared=shared)
    got = ev.attend_select(q, k, v, kn, vn, pos, nxt, by=by, old=old, accumulate=acc, decay=0.9,
                           carry=key == "h2o", **sel)
    out, w, scores = ev.attend_weights(q, k, v, kn, vn, old=old, accumulate=acc, decay=0.9)
    score = {"weights": w, "carried": scores, "none": mx.zeros((b, h, n + 1), mx.float32)}[by]
    slot, rk, rv, p, kept = ev.select(score, pos, nxt, k, v, kn, vn, carried=scores, **sel)
    want = (out, slot, rk, rv, p, nxt + 1, kept)
    mx.eval(got, want)
    for i, (x, y) in enumerate(zip(got, want)):
        if y is None:
            assert x is None, i
            continue
        assert x.dtype == y.dtype and x.shape == y.shape, i
        np.testing.assert_array_equal(np.array(x.astype(mx.float32) if x.dtype != mx.int32 else x),
                                      np.array(y.astype(mx.float32) if y.dtype != mx.int32 else y), err_msg=str(i))


def test_kernel_update_routes_only_full_cache_decode_steps_to_the_kernels():
    """``evict.cuda_update``: a single token at a full cache goes to the kernels; prefill,
    chunks and a filling cache go to the mlx ops (checked with stand-ins, on any machine)."""
    from velox import evict
    calls = []
    mlx_path = lambda st, k, v, q: calls.append("mlx") or st  # noqa: E731
    kernel_path = lambda st, k, v, q: calls.append("kernel") or st  # noqa: E731
    update = evict.cuda_update(mlx_path, lambda st: st.budget, kernel_path)
    m = get_method("tova")
    full = m.update(m.init(1, 2, 8, budget=6, n_sink=1, backend="mlx"), mx.ones((1, 2, 9, 8)),
                    mx.ones((1, 2, 9, 8)))
    filling = m.update(m.init(1, 2, 8, budget=6, n_sink=1, backend="mlx"), mx.ones((1, 2, 3, 8)),
                       mx.ones((1, 2, 3, 8)))
    one, chunk = mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 4, 8))
    for st, k in ((full, one), (full, chunk), (filling, one), (filling, chunk)):
        update(st, k, k, None)
    assert calls == ["kernel", "mlx", "mlx", "mlx"]


@needs_cuda
def test_squeeze_kernel_follows_a_reallocated_budget():
    """A layer whose budget the reallocation changed shrinks (mlx ops) or grows, then its full
    decode steps run the kernels again; every state equals the mlx backend's."""
    b, h, d = 1, 4, 64
    rng = np.random.default_rng(7)

    arr = _normal(rng, mx.float16)

    m = get_method("squeeze")
    params = dict(budget=40, n_sink=3, grace=5, decay=0.95)
    states = {be: m.init(b, h, d, dtype=mx.float16, backend=be, **params) for be in ("mlx", "cuda")}
    k, v = arr(b, h, 47, d), arr(b, h, 47, d)
    states = {be: m.update(st, k, v) for be, st in states.items()}
    for step, budget in enumerate([40] * 5 + [30] * 8 + [36] * 12):
        kept = states["cuda"].keys.shape[2]
        states = {be: st._replace(budget=budget) for be, st in states.items()}
        k, v = arr(b, h, 1, d), arr(b, h, 1, d)
        states = {be: m.update(st, k, v) for be, st in states.items()}
        mx.eval(states)
        _compare("squeeze", states["cuda"], states["mlx"], step)
        assert states["cuda"].keys.shape[2] == min(budget, kept + 1), step


WEIGHTS_VARIANTS = [("weights", group, acc, noise) for group in ("mean", "max")
                    for acc in (None, "decay", "max", "vote_sum", "vote_max") for noise in (False, True)]
ATTEND_VARIANTS = [("attend_part",), ("attend_flash", True), ("attend_flash", False), ("attend_out",)] + [("attend_combine", group, acc) for group in ("mean", "max")
                                         for acc in (None, "decay", "max", "vote_sum", "vote_max")]
COMPACT_VARIANTS = [("compact", select, carry) for select in ("fixed", "full", "split")
                    for carry in ("none", "full", "split", "profiles")]
MERGE_VARIANTS = [("merge_plan",), ("merge_compact",)]
SELECT_VARIANTS = [("select", False), ("select", True)]
ATTEND_SELECT_VARIANTS = [("attend_select", group, acc, by, carry) for group in ("mean", "max")
                          for acc, by, carry in ((None, "weights", False), (None, "given", False),
                                                 (None, "none", False), ("decay", "carried", True),
                                                 ("max", "weights", True), ("max", "carried", True))]
KERNEL_VARIANTS = (WEIGHTS_VARIANTS + ATTEND_VARIANTS + COMPACT_VARIANTS + MERGE_VARIANTS + SELECT_VARIANTS
                   + ATTEND_SELECT_VARIANTS)
TEMPLATE = {"weights": {"HEAD_DIM": 128}, "attend_part": {"HEAD_DIM": 128, "GROUPS": 8, "UNROLL": 2},
            "attend_combine": {"HEAD_DIM": 128}, "attend_out": {"HEAD_DIM": 128},
            "attend_flash": {"HEAD_DIM": 128, "GROUPS": 8, "UNROLL": 2},
            "attend_select": dict(HEAD_DIM=128, N_SINK=3, RECENT=2, SHARED=1),
            "compact": dict(CHUNKS=2, FIXED_DROP=0, UNIT_HEADS=1, N_SINK=3, RECENT=2, CHUNK_SIZE=4),
            "merge_plan": dict(HEAD_DIM=128, N_SINK=3, RECENT=5, WINDOW=6, MERGE_GATE=1, MODE=0,
                               MERGE_KEYS=1, FW=9),
            "merge_compact": dict(CHUNKS=2, MODE=0, MERGE_KEYS=1, FW=9),
            "select": dict(N_SINK=3, RECENT=2, SHARED=1)}


def _spec(variant):
    from velox.kernels import evict as kernels
    from velox.kernels import merge
    kind, *args = variant
    if kind.startswith("merge"):
        return kind, merge._plan_spec() if kind == "merge_plan" else merge._compact_spec()
    if kind == "select":
        return kind, kernels._select_spec(*args)
    return kind, kernels._spec(variant)


@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=str)
def test_kernel_sources_are_complete(variant):
    """Every variant's CUDA source (assembled on any machine, compiled by MLX on a GPU) has its
    placeholders filled, uses each input and output it declares, and names no template value
    but those its wrapper passes."""
    kind, spec = _spec(variant)
    src = spec["source"]
    for token in ("ACCUMULATE", "BIAS", "NOISE", "GROUP_COMBINE", "GROUP_FINAL", "THREADS", "SELECT",
                  "CHUNK_MAX", "MAX_GROUPS", "CARRY_SLOT", "BY",
                  "RAW_SCORE", "CARRY", "CARRY_ROWS", "NT"):
        assert not re.search(rf"\b{token}\b", src), (variant, token)
    for name in spec["input_names"] + spec["output_names"]:
        assert re.search(rf"\b{name}\b", src), (variant, name)
    names = set(re.findall(r"\b[A-Z][A-Z_]{2,}\b", src)) - set(spec["input_names"])
    assert names == set(TEMPLATE[kind]) - {"FW"}, (variant, names)
    assert bool(re.search(r"\bFW\b", src)) == ("FW" in TEMPLATE[kind]), variant


def _dtypes(kind, spec, dtype):
    """Input and output dtypes of a launch whose keys and values are ``dtype``."""
    rows = {"q", "K", "knew", "V", "vnew", "ok", "ov", "o", "rowk", "rowv"}
    ints = {"P", "next_pos", "op", "onext", "iplan", "oslot", "opos", "cfg"}
    def of(name):
        return (dtype if name in rows else "int32" if name in ints
                else "uint32" if name == "seedmix" else "float32")
    return {n: of(n) for n in spec["input_names"]}, [of(n) for n in spec["output_names"]]


def _variant_ptx(variant) -> list:
    """``[(dtype, mode, ptx or the exception)]`` of every build of ``variant``."""
    from velox.kernels import nvrtc
    kind, spec = _spec(variant)
    modes = range(4) if kind.startswith("merge") else [None]  # CaM's merge rules
    out = []
    for dtype in ("float32", "float16", "bfloat16"):
        ins, outs = _dtypes(kind, spec, dtype)
        for mode in modes:
            template = TEMPLATE[kind] if mode is None else {**TEMPLATE[kind], "MODE": mode}
            try:
                out.append((dtype, mode, nvrtc.compile_source(nvrtc.kernel_source(spec, ins, outs, template))))
            except Exception as e:  # reported by the variant's test
                out.append((dtype, mode, e))
    return out


@pytest.fixture(scope="module")
def variant_ptx():
    """Every variant's builds, compiled two variants at a time (NVRTC releases the
    interpreter while it compiles)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(KERNEL_VARIANTS, pool.map(_variant_ptx, KERNEL_VARIANTS)))


@needs_nvrtc
@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=str)
def test_kernel_sources_compile(variant_ptx, variant):
    """Every variant compiles with NVRTC to PTX for an H100/H200 (``compute_90``), for float32,
    float16 and bfloat16 rows, wrapped as MLX wraps it at a launch (no GPU needed)."""
    _, spec = _spec(variant)
    for dtype, mode, ptx in variant_ptx[variant]:
        if isinstance(ptx, Exception):
            raise ptx
        assert f".entry {spec['name']}" in ptx, (variant, dtype, mode)


@needs_nvrtc
def test_kernel_source_check_catches_an_error():
    """The compile check fails on a source that does not compile, with NVRTC's message."""
    from velox.kernels import nvrtc
    with pytest.raises(nvrtc.NvrtcError, match="undefined"):
        nvrtc.compile_source('extern "C" __global__ void f(float* x) { x[0] = y; }')


def test_compact_drops_comments_and_layout_only():
    """The compacted source keeps every token, each preprocessor line on its own line and a
    ``//`` inside a string literal, and drops comments, indentation and blank lines."""
    from velox.kernels import compact
    src = ('  // a comment line\n'
           '#pragma unroll\n'
           '    x = 1; /* a block\n   comment */ y = 2;  // trailing\n'
           '\n'
           '    static_assert(N > 0, "a // b");  // kept: the string\n')
    assert compact(src) == '#pragma unroll\nx = 1;   y = 2;\nstatic_assert(N > 0, "a // b");\n'


@pytest.mark.slow  # (pytest --run-slow)
@needs_nvrtc
@pytest.mark.parametrize("variant", KERNEL_VARIANTS, ids=str)
def test_compacted_sources_compile_to_the_same_program(variant):
    """What a launch builds (``velox.kernels.build``: comments and indentation dropped)
    compiles to the same PTX as the source as written, for every variant (bfloat16 rows)."""
    from velox.kernels import compact, nvrtc
    kind, spec = _spec(variant)
    ins, outs = _dtypes(kind, spec, "bfloat16")
    small = {**spec, "source": compact(spec["source"]), "header": compact(spec.get("header", ""))}
    assert len(small["source"]) + len(small["header"]) < 0.8 * (len(spec["source"]) + len(spec["header"]))
    ptx = [nvrtc.compile_source(nvrtc.kernel_source(s, ins, outs, TEMPLATE[kind])) for s in (spec, small)]
    assert ptx[0] == ptx[1], variant


def test_kernel_wrappers_refuse_bad_arguments():
    """Arguments that name no kernel variant are refused before any launch (any machine)."""
    from velox.kernels import evict as kernels
    k = mx.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="variant"):
        kernels.weights(None, k, k[:, :, :1], group="median")
    with pytest.raises(ValueError, match="go together"):
        kernels.weights(None, k, k[:, :, :1], accumulate="max")
    with pytest.raises(ValueError, match="exactly one"):
        kernels.compact(k, k, mx.zeros((1, 2, 4), mx.int32), k[:, :, :1], k[:, :, :1],
                        mx.zeros((1, 2), mx.int32))
    with pytest.raises(ValueError, match="do not go together"):
        kernels.compact(k, k, mx.zeros((1, 2, 4), mx.int32), k[:, :, :1], k[:, :, :1],
                        mx.zeros((1, 2), mx.int32), drop=0, carry=mx.zeros((1, 2, 5)),
                        profiles=(mx.zeros((1, 2, 4, 3)), mx.zeros((1, 2, 5))))
    q = mx.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="go together"):
        kernels.attend_weights(q, k, k, k[:, :, :1], k[:, :, :1], accumulate="decay")
    with pytest.raises(ValueError, match="attend_weights: queries"):
        kernels.attend_weights(q, k, k[:, :, :3], k[:, :, :1], k[:, :, :1])
    big = mx.zeros((1, 1, 4, 512))
    with pytest.raises(ValueError, match="head_dim dividing"):
        kernels.attend_weights(mx.zeros((1, 1, 1, 512)), big, big, big[:, :, :1], big[:, :, :1])
    pos, nxt = mx.zeros((1, 2, 4), mx.int32), mx.zeros((1, 2), mx.int32)
    sel = dict(n_sink=0, recent=0, shared=False)
    with pytest.raises(ValueError, match="attend_select: queries .* positions \\(1, 2, 3\\)"):
        kernels.attend_select(q, k, k, k[:, :, :1], k[:, :, :1], pos[:, :, :3], nxt, **sel)
    with pytest.raises(ValueError, match="given"):
        kernels.attend_select(q, k, k, k[:, :, :1], k[:, :, :1], pos, nxt, by="given", **sel)
    with pytest.raises(ValueError, match="need `accumulate`"):
        kernels.attend_select(q, k, k, k[:, :, :1], k[:, :, :1], pos, nxt, by="carried", **sel)
    assert kernels.attend_supports(64, 4) and kernels.attend_supports(256, 128)
    assert not kernels.attend_supports(512, 1) and not kernels.attend_supports(96, 4)
    assert not kernels.attend_supports(64, 129)


def test_the_attended_step_leaves_shapes_the_split_kernel_refuses_to_the_caller():
    """A decode step the split attention kernel cannot take (head_dim 512 divides the
    weights kernel's block but not the attention's) is not attended by the ``cuda``
    backend: ``with_attention`` says so (None) before any launch, on any machine."""
    m = get_method("tova")
    st = m.init(1, 1, 512, budget=4, n_sink=1)
    st = m.update(st, mx.zeros((1, 1, 6, 512)), mx.zeros((1, 1, 6, 512)))
    st = st._replace(backend="cuda")
    z = mx.zeros((1, 1, 1, 512))
    assert m.backends["cuda"].with_attention(st, z, z, z) is None


@needs_cuda
@pytest.mark.parametrize("key,variant", NONFINITE_CASES)
@pytest.mark.parametrize("spoil", ["nan", "inf", "-inf", "overflow"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_kernel_decode_steps_follow_the_nonfinite_rule(key, variant, spoil, dtype):
    """Spoiled tokens (a NaN, +-inf element or keys of |k| ~ 1e30) in the prefill and in every
    third decode step: the kernels keep the sinks and choose what the mlx ops choose."""
    b, h, g, d = 2, 4, 2, 64
    budget, steps, n_sink = 40, 24, 3
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(zlib.crc32(repr((key, variant, spoil, dtype)).encode()))

    def arr(*s, spoilt=False):
        x = rng.standard_normal(s).astype(np.float32)
        if spoilt:
            t = rng.integers(0, s[2])
            if spoil == "overflow":
                x[:, :, t] *= 1e30
            else:
                x[:, :, t, rng.integers(0, d)] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[spoil]
        return mx.array(x).astype(dt)

    m = get_method(key)
    params = _params(key, budget, variant)
    states = {be: m.init(b, h, d, dtype=dt, backend=be, **params) for be in ("mlx", "cuda")}
    n = budget + 7
    prefill = (arr(b, h, n, d, spoilt=True), arr(b, h, n, d), arr(b, h * g, n, d, spoilt=True))
    for step in range(steps + 1):
        bad = step % 3 == 0
        k, v, q = prefill if step == 0 else (arr(b, h, 1, d, spoilt=bad), arr(b, h, 1, d, spoilt=bad),
                                             arr(b, h * g, 1, d, spoilt=bad))
        states = {be: m.update(st, k, v, queries=q) for be, st in states.items()}
        mx.eval(states)
        pos = np.array(states["cuda"].positions)
        np.testing.assert_array_equal(pos, np.array(states["mlx"].positions), err_msg=f"{key} step {step}")
        assert (pos[:, :, :n_sink] == np.arange(n_sink)).all(), f"{key} lost a sink at step {step}"
        assert (np.diff(pos, axis=-1) > 0).all()

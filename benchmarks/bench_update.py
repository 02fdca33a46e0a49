"""Decode-step cost of each method's update, beside one attention over the same cache.

For every registered method: fill a state to its steady size (budget 512 by default), then
time single-token updates with the ``mlx`` backend (plain and ``mx.compile``d), with the
method's fused-kernel backend (``cuda``, compiled) where it has one and the machine runs it,
and with the ``reference`` backend, one ``mx.fast.scaled_dot_product_attention`` of a
single query over the kept cache, mlx-lm's ``RotatingKVCache`` step at the same size (a ring
buffer: one slot written), and the adapter's decode update (``split``: compiled, the new
row's slot write built at the start of the next step, as ``VeloxCache`` runs it). Prints times, the ratios the targets are stated in, and whether the compiled
update retraced between steps. Also prints KIVI's measured bytes beside a hand count.

    python benchmarks/bench_update.py [--steps 50] [--dtype float32] [--budget 512] [--rounds 1]
        [--heads 8] [--dim 128] [--methods tova h2o] [--param slack=16]

Times are per step, median of the measured steps, on whatever device MLX uses by default. The
mlx updates and the attention are timed in turn within each step and the ratios are medians
of the per-step ratios, so that a shared machine's noise touches both sides alike. With
``--rounds R`` every method is measured R times (fresh states each time, the methods taken in
turn); a row then gives the median of the rounds and the range of its ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import velox  # first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core (velox._blas)
import mlx.core as mx
import numpy as np

from velox.registry import get_method, method_keys

B, H, D = 1, 8, 128


def _params(key: str, budget: int) -> dict:
    spec = get_method(key).spec
    p = {}
    if "budget" in spec.params:
        p["budget"] = budget
    if key == "streaming_llm":
        p["window_size"] = budget - spec.defaults["n_sink"]
    p.update({k: v for k, v in EXTRA.items() if k in spec.params})
    return p


EXTRA: dict = {}  # --param name=value, given to every method that has the parameter


def _timed(fn, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_method(key: str, budget: int, steps: int, ref_steps: int, dtype: mx.Dtype,
                 compile_update: bool = True) -> dict:
    m = get_method(key)
    params = _params(key, budget)
    rng = np.random.default_rng(0)
    prefill = budget + 64

    def tokens(s):
        return [mx.array(rng.standard_normal((B, H, s, D)).astype(np.float32)).astype(dtype)
                for _ in range(2)]

    k0, v0 = tokens(prefill)
    decode = [tokens(1) for _ in range(steps + 2)]
    mx.eval(k0, v0, decode)
    row = {"method": key}
    compilable = compile_update and m.spec.contract.get("compilable", True)
    traces = 0

    def traced(state, k, v):
        nonlocal traces
        traces += 1
        return m.update(state, k, v)

    compiled = mx.compile(traced)

    def fresh(backend):
        st = m.update(m.init(B, H, D, dtype=dtype, backend=backend, **params), k0, v0)
        mx.eval(st)
        return st

    # Reference backend: slow, timed on its own for a few steps.
    state = fresh("reference")
    it = iter(decode)

    def ref_step():
        nonlocal state
        k, v = next(it)
        state = m.update(state, k, v)
        mx.eval(state)

    ref_step()  # warm-up
    row["reference_us"] = statistics.median(_timed(ref_step, ref_steps)) * 1e6

    # Plain mlx, compiled mlx and one attention over the kept cache, interleaved step by step
    # so that a noisy machine slows all three alike; ratios are medians of per-step ratios.
    plain, comp = fresh("mlx"), fresh("mlx")
    kernel = _kernel_backend(m) if compile_update else None
    kern = fresh(kernel) if kernel else None
    compiled_kernel = mx.compile(m.update)
    t_kern = []
    # the adapter's decode update: the slot write left for the next step
    try:
        from velox.decode import split_update as _split_step, write_row as _write_row
    except ImportError:  # a version before slots (a comparison run): no split step
        _split_step = None
    split_fn = _split_step and mx.compile(lambda s, k, v: _split_step(m, s, k, v, None))
    split, pend = (fresh("mlx"), None) if compilable and _split_step else (None, None)
    t_split, t_ring = [], []
    from mlx_lm.models.cache import RotatingKVCache
    ring = RotatingKVCache(max_size=budget, keep=4)
    ring.update_and_fetch(k0[:, :, :budget], v0[:, :, :budget])
    mx.eval(ring.keys, ring.values)
    q = mx.array(rng.standard_normal((B, H, 1, D)).astype(np.float32)).astype(dtype)
    mx.eval(q)
    t_plain, t_comp, t_sdpa = [], [], []

    def clock(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def attend(st):
        if getattr(m, "kv_slots", None) is None:  # a version before slots
            kk, vv, filled = (*m.get_kv(st), None)
        else:
            kk, vv, filled = m.kv_slots(st)  # what the adapter's attention reads
        mask = None if filled is None else filled[:, :, None, :]
        mx.eval(kk, vv)
        _, dt = clock(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, kk, vv, scale=D ** -0.5,
                                                                           mask=mask)))
        return int(m.positions(st).shape[2]), dt

    def split_step(k, v):
        # the state is replaced before anything evaluates, as VeloxCache replaces its own:
        # a caller still holding the old state would make MLX copy it rather than write
        nonlocal split, pend
        if pend is not None:
            split = _write_row(split, pend)
        split, pend = split_fn(split, k, v)
        mx.eval(split, pend)

    warm = 3 + params.get("slack", 0)  # a slack state grows to budget + slack first
    first = None
    for i, (k, v) in enumerate(decode[:steps + warm]):
        plain, dt = clock(lambda: _evaluated(m.update(plain, k, v)))
        if i >= warm:
            t_plain.append(dt)
        if compilable:
            comp, dt = clock(lambda: _evaluated(compiled(comp, k, v)))
            if i >= warm:
                t_comp.append(dt)
            if i == warm - 1:
                first = traces
        if kern is not None:
            kern, dt = clock(lambda: _evaluated(compiled_kernel(kern, k, v)))
            if i >= warm:
                t_kern.append(dt)
        if split is not None:
            _, dt = clock(lambda: split_step(k, v))
            if i >= warm:
                t_split.append(dt)
        _, dt = clock(lambda: mx.eval(*ring.update_and_fetch(k, v)))
        if i >= warm:
            t_ring.append(dt)
        kept, dt = attend(plain)
        if i >= warm:
            t_sdpa.append(dt)
    row["kept"] = kept
    row["ring_us"] = statistics.median(t_ring) * 1e6
    row["mlx/ring"] = statistics.median(a / b for a, b in zip(t_plain, t_ring))
    row["split_us"] = statistics.median(t_split) * 1e6 if t_split else float("nan")
    # means: a slack state selects once every slack + 1 steps, which a median leaves out
    row["ring_mean_us"] = statistics.fmean(t_ring) * 1e6
    row["split_mean_us"] = statistics.fmean(t_split) * 1e6 if t_split else float("nan")
    row["split/ring mean"] = row["split_mean_us"] / row["ring_mean_us"]
    row["split/ring"] = (statistics.median(a / b for a, b in zip(t_split, t_ring)) if t_split
                         else float("nan"))
    row["sdpa_us"] = statistics.median(t_sdpa) * 1e6
    row["mlx_us"] = statistics.median(t_plain) * 1e6
    row["mlx/sdpa"] = statistics.median(a / b for a, b in zip(t_plain, t_sdpa))
    row["reference/mlx"] = row["reference_us"] / row["mlx_us"]
    row["kernel"] = kernel or "-"
    row["kernel_us"] = statistics.median(t_kern) * 1e6 if t_kern else float("nan")
    row["kernel/sdpa"] = (statistics.median(a / b for a, b in zip(t_kern, t_sdpa)) if t_kern
                          else float("nan"))
    row["reference/kernel"] = row["reference_us"] / row["kernel_us"]
    if not compilable:
        row["compiled_us"] = row["compiled/sdpa"] = row["reference/compiled"] = float("nan")
        row["compiled/ring"] = row["compiled_mean_us"] = row["compiled/ring mean"] = float("nan")
        row["retraces_after_warmup"] = "n/a"
        return row
    row["compiled_us"] = statistics.median(t_comp) * 1e6
    row["compiled/ring"] = statistics.median(a / b for a, b in zip(t_comp, t_ring))
    row["compiled_mean_us"] = statistics.fmean(t_comp) * 1e6
    row["compiled/ring mean"] = row["compiled_mean_us"] / row["ring_mean_us"]
    row["compiled/sdpa"] = statistics.median(a / b for a, b in zip(t_comp, t_sdpa))
    row["reference/compiled"] = row["reference_us"] / row["compiled_us"]
    row["retraces_after_warmup"] = traces - first
    return row


RATIOS = ("mlx/sdpa", "compiled/sdpa", "kernel/sdpa", "mlx/ring", "compiled/ring", "split/ring")


def combine_rounds(rounds: list[dict]) -> dict:
    """One row from the rows of several rounds of one method: the median of every number,
    the ``min-max`` range of each ratio (``<ratio> range``), and the rounds themselves."""
    row = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        values = [r[key] for r in rounds]
        row[key] = statistics.median_low(values) if isinstance(value, int) else statistics.median(values)
    for key in RATIOS:
        vals = [r[key] for r in rounds if math.isfinite(r[key])]
        row[f"{key} range"] = f"{min(vals):.1f}-{max(vals):.1f}" if vals else "n/a"
    row["rounds"] = rounds
    return row


def _kernel_backend(m) -> str | None:
    """The method's fused-kernel backend that runs on this machine, if any."""
    for name in ("cuda", "metal"):
        if name in m.backends and velox.backend.device_supports(name):
            return name
    return None


def _evaluated(state):
    mx.eval(state)
    return state


def kivi_bytes_check(tokens: int = 4096) -> dict:
    """KIVI 2-bit, group 32, residual 128, fp16: measured bytes vs a hand count."""
    bits, g, r = 2, 32, 128
    st = velox.kivi_init(1, 1, D, dtype=mx.float16, bits=bits, group_size=g, residual_length=r)
    x = mx.random.normal((1, 1, tokens, D)).astype(mx.float16)
    st = velox.kivi_update(st, x, x)
    q = g * ((tokens - r) // g)
    res = tokens - q
    codes = 2 * q * D * bits // 8                       # keys and values
    key_scales = (q // g) * D * 2 * 2                    # per channel per group: scale + zero
    value_scales = q * (D // g) * 2 * 2                  # per token per group: scale + zero
    residual = res * D * 2 * 2
    hand = codes + key_scales + value_scales + residual
    measured = velox.kivi_bytes(st)
    fp16 = velox.fp16_bytes(tokens, 1, 1, D)
    return {"tokens": tokens, "measured_bytes": measured, "hand_count_bytes": hand,
            "measured/hand": measured / hand, "fp16_bytes": fp16, "fp16/measured": fp16 / measured}


def main(argv=None) -> int:
    global B, H, D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ref-steps", type=int, default=5)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every method this many times and report medians and ranges")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--no-compile", action="store_true",
                    help="skip the compiled update (for backends where compiling a method fails)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8, help="kv heads (SmolLM2: 3)")
    ap.add_argument("--dim", type=int, default=128, help="head_dim (SmolLM2: 64)")
    ap.add_argument("--param", action="append", default=[],
                    help="name=value (an int) for every method with that parameter, e.g. slack=16")
    ap.add_argument("--no-kivi", action="store_true", help="skip KIVI's byte check")
    args = ap.parse_args(argv)
    B, H, D = args.batch, args.heads, args.dim
    EXTRA.clear()
    EXTRA.update({k: int(v) for k, v in (p.split("=", 1) for p in args.param)})
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    dtype = getattr(mx, args.dtype)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, b={B} h={H} d={D}, "
          f"budget {args.budget}, {args.dtype}, params {EXTRA}")
    keys = args.methods or method_keys()
    runs = {k: [] for k in keys}
    for i in range(args.rounds):
        for k in keys:
            runs[k].append(bench_method(k, args.budget, args.steps, args.ref_steps, dtype,
                                        not args.no_compile))
            print(f"  {k}: round {i + 1} done", file=sys.stderr, flush=True)
    rows = [combine_rounds(runs[k]) if args.rounds > 1 else runs[k][0] for k in keys]
    cols = ["method", "kept", "sdpa_us", "ring_us", "mlx_us", "compiled_us", "split_us",
            "reference_us", "mlx/sdpa", "compiled/sdpa", "mlx/ring", "compiled/ring", "split/ring",
            "compiled/ring mean", "split/ring mean",
            "reference/mlx", "reference/compiled", "retraces_after_warmup",
            "kernel", "kernel_us", "kernel/sdpa", "reference/kernel"]
    if args.rounds > 1:
        cols += [f"{key} range" for key in RATIOS]
    print(" | ".join(f"{c:>14s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>14.1f}" if isinstance(r[c], float) else f"{r[c]!s:>14s}" for c in cols))
    kb = None if args.no_kivi else kivi_bytes_check()
    if kb is not None:
        print("kivi 2-bit g32 r128 fp16, 4096 tokens, d=128:", json.dumps(kb))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "kivi_bytes": kb, "device": str(mx.default_device())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

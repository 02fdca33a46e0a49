"""Decode attention on codes vs dequantize + SDPA, for every method with an ``attend`` hook.

For each method and stored length, one query token (``--groups`` query heads per kv head)
attends to a state holding that many tokens plus one new token, two ways, interleaved:

* ``attend``: the method's own attention (scores read from the codes);
* ``dequantize + SDPA``: ``get_kv`` (decode every stored key and value) then
  ``mx.fast.scaled_dot_product_attention`` over stored + new;
* ``cuda kernel``: ``velox.kernels.codec.decode_attend`` (the flash-decoding kernels over the
  codes; ``velox.kernels.kivi.decode_attend`` for kivi), where the module's ``supports`` takes
  the state on a CUDA device (else ``-``, ``null`` in JSON);
* and, beside them, a full-precision cache of the same length (SDPA on float rows).

Prints median microseconds and the ratios; ``--json FILE`` writes them.

    python benchmarks/codec_attention.py --methods turboquant_prod,qjl --lengths 4096 32768
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import velox  # first: loads OpenBLAS before mlx.core
import mlx.core as mx

from velox.kernels import codec as codec_kernel
from velox.kernels import kivi as kivi_kernel
from velox.registry import get_method, method_keys


#: The kernel module of a method (default: ``velox.kernels.codec``).
KERNELS = {"kivi": kivi_kernel}


def _timed(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each function, the calls interleaved (round robin)."""
    for fn in fns.values():
        for _ in range(2):
            mx.eval(fn())
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def _filled(key: str, n: int, b: int, h: int, d: int, dtype, chunk: int = 4096, **params):
    st = velox.init(key, b, h, d, dtype=dtype, **params)
    for start in range(0, n, chunk):
        s = min(chunk, n - start)
        k = mx.random.normal((b, h, s, d)).astype(dtype)
        v = mx.random.normal((b, h, s, d)).astype(dtype)
        st = velox.update(st, k, v)
        mx.eval(st)
    return st


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="", help="comma-separated keys (default: every method "
                                                   "with an attend hook)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    keys = [k for k in (args.methods.split(",") if args.methods else method_keys())
            if k and get_method(k).attend is not None]
    dtype = getattr(mx, args.dtype)
    b, h, g, d = 1, args.heads, args.groups, args.dim
    scale = d ** -0.5
    rows = []
    print(f"device {mx.default_device()}, b={b} kv_heads={h} q_heads={h * g} d={d} {args.dtype}")
    print(f"{'method':16} {'stored':>7} {'attend us':>10} {'deq+sdpa us':>12} {'kernel us':>10} "
          f"{'full us':>9} {'attend/deq':>10} {'attend/full':>11} {'kernel/full':>11}")
    for n in args.lengths:
        fk = mx.random.normal((b, h, n, d)).astype(dtype)
        fv = mx.random.normal((b, h, n, d)).astype(dtype)
        q = mx.random.normal((b, h * g, 1, d)).astype(dtype)
        kn = mx.random.normal((b, h, 1, d)).astype(dtype)
        vn = mx.random.normal((b, h, 1, d)).astype(dtype)
        mx.eval(fk, fv, q, kn, vn)

        def full():
            k2, v2 = mx.concatenate([fk, kn], axis=2), mx.concatenate([fv, vn], axis=2)
            return mx.fast.scaled_dot_product_attention(q, k2, v2, scale=scale)

        for key in keys:
            m = get_method(key)
            st = _filled(key, n, b, h, d, dtype)

            def attend(st=st, m=m):
                return m.attend(st, q, kn, vn, scale=scale, mask=None)

            def deq(st=st, m=m):
                k, v = m.get_kv(st)
                k2 = mx.concatenate([k.astype(dtype), kn], axis=2)
                v2 = mx.concatenate([v.astype(dtype), vn], axis=2)
                return mx.fast.scaled_dot_product_attention(q, k2, v2, scale=scale)

            km = KERNELS.get(key, codec_kernel)

            def kernel(st=st, km=km):
                return km.decode_attend(st, q, kn, vn, scale=scale)

            fns = {"attend": attend, "deq": deq, "full": full}
            if km.supports(st, q):
                fns = {"attend": attend, "deq": deq, "kernel": kernel, "full": full}
            t = _timed(fns, args.reps)
            kt = t.get("kernel")
            row = dict(method=key, stored=n, attend_us=t["attend"] * 1e6, deq_us=t["deq"] * 1e6,
                       kernel_us=None if kt is None else kt * 1e6, full_us=t["full"] * 1e6,
                       bytes=velox.nbytes(st))
            rows.append(row)
            ks = ("-", "-") if kt is None else (f"{kt * 1e6:.0f}", f"{kt / t['full']:.2f}")
            print(f"{key:16} {n:7d} {row['attend_us']:10.0f} {row['deq_us']:12.0f} {ks[0]:>10} "
                  f"{row['full_us']:9.0f} {t['attend'] / t['deq']:10.2f} {t['attend'] / t['full']:11.2f} "
                  f"{ks[1]:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(mx.default_device()), dtype=args.dtype, heads=h, groups=g,
                           dim=d, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

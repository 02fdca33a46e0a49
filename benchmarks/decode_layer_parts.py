"""Where one decode layer's time goes on a GPU: microseconds per layer of the pieces of a
decode step, each timed alone (``16`` layers' worth of launches per evaluation, as a model
step issues them; median of 5 rounds of ``--reps`` evaluations).

    python benchmarks/decode_layer_parts.py --batch 1 32 [--split 256:1024 256:512 128:2048:16]

Shapes: Llama-3.2-1B's attention (8 kv heads, 4 query heads each, head_dim 64), ``2048``
stored tokens, bfloat16; a cache (or state) per layer, as a model holds them. Rows: a trivial MLX op and a trivial ``mx.fast.cuda_kernel`` launch
(the floor of one primitive), mlx-lm's full-cache step (a slice update of the new key and value,
then ``scaled_dot_product_attention`` over ``n + 1`` rows) and SDPA alone, velox's fused decode
step on the ``cuda`` backend (``velox.decode.split_step``, compiled, with the next
step's deferred row write) for TOVA, H2O and StreamingLLM, and the ``attend_weights`` kernel
alone. ``--split`` also times ``attend_weights`` (plain and with H2O's decayed sum) at other
splits of the candidates (block size, blocks in all, smallest chunk), against SDPA over the
same rows, with the output's largest difference from SDPA. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import velox  # noqa: F401  (first, as every script here: velox._blas)
import mlx.core as mx

LAYERS = 16
H, G, D, N = 8, 4, 64, 2048


def timeit(fn, reps: int) -> float:
    """Microseconds per layer: ``fn(i)`` builds layer ``i``'s outputs, evaluated LAYERS at a
    time (a function of no argument: the same for every layer)."""
    import inspect

    layer = fn if inspect.signature(fn).parameters else (lambda i: fn())
    for _ in range(3):
        mx.eval([layer(i) for i in range(LAYERS)])
    rounds = []
    for _ in range(5):
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            mx.eval([layer(i) for i in range(LAYERS)])
        mx.synchronize()
        rounds.append((time.perf_counter() - t) / reps / LAYERS * 1e6)
    return statistics.median(rounds)


def parts(b: int, reps: int) -> dict[str, float]:
    from velox import decode
    from velox.kernels import evict as ev
    from velox.registry import get_method

    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)  # noqa: E731
    q, k, v = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D)
    x = mx.zeros((4,), dt)
    Ks = [rnd(b, H, N + 256, D) for _ in range(LAYERS)]  # one full cache per layer
    Vs = [rnd(b, H, N + 256, D) for _ in range(LAYERS)]
    mx.eval(q, k, v, x, Ks, Vs)
    out: dict[str, float] = {}
    out["trivial MLX op"] = timeit(lambda: x + 1, reps)
    probe = mx.fast.cuda_kernel(name="velox_probe", input_names=["x"], output_names=["y"],
                                source="unsigned int i = threadIdx.x; if (i < 4) y[i] = x[i];")
    out["trivial cuda_kernel"] = timeit(lambda: probe(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                                      output_shapes=[(4,)], output_dtypes=[dt])[0], reps)

    def full(i):
        Ks[i][..., N:N + 1, :] = k
        Vs[i][..., N:N + 1, :] = v
        return mx.fast.scaled_dot_product_attention(q, Ks[i][..., :N + 1, :], Vs[i][..., :N + 1, :],
                                                    scale=D ** -0.5)

    out["full: slice update + sdpa"] = timeit(full, reps)
    out["sdpa alone"] = timeit(lambda i: mx.fast.scaled_dot_product_attention(
        q, Ks[i][..., :N + 1, :], Vs[i][..., :N + 1, :], scale=D ** -0.5), reps)
    for key in ("tova", "h2o", "streaming_llm"):
        m = get_method(key)
        p = dict(window_size=N - 4) if key == "streaming_llm" else dict(budget=N)
        states = []
        for _ in range(LAYERS):  # one state per layer, as a model holds them
            st = m.init(b, H, D, dtype=dt, backend="cuda", **p)
            states.append(m.update(st, rnd(b, H, N + 3, D), rnd(b, H, N + 3, D),
                                   queries=rnd(b, H * G, N + 3, D)))
        mx.eval(states)
        fused = mx.compile(decode._STEP_KINDS["fused"](m))
        rows = [None] * LAYERS

        def step(i):
            s = states[i] if rows[i] is None else decode.write_row(states[i], rows[i])
            o, states[i], rows[i] = fused(s, q, k, v, D ** -0.5)
            return [o] + decode.arrays(states[i]) + decode.arrays(rows[i])

        out[f"{key}: fused step + row write"] = timeit(step, reps)
        if key == "tova":
            st = states[0]
            out["attend_weights alone"] = timeit(lambda: ev.attend_weights(q, st.keys, st.values, k, v)[0], reps)
    return out


def splits(b: int, settings: list[str], reps: int) -> list[str]:
    """``attend_weights`` (plain and with H2O's decayed sum) at other splits: each setting is
    ``THREADS:BLOCKS[:MIN_CHUNK]`` (``velox.kernels.evict.ATTEND_THREADS``, ``SPLIT_BLOCKS``,
    ``MIN_CHUNK``), against SDPA over the same rows, with the output's largest difference."""
    from velox.kernels import evict as ev

    dt = mx.bfloat16
    rnd = lambda *s: mx.random.normal(s).astype(dt)  # noqa: E731
    q, k, v, K, V = rnd(b, H * G, 1, D), rnd(b, H, 1, D), rnd(b, H, 1, D), rnd(b, H, N, D), rnd(b, H, N, D)
    old = mx.random.uniform(shape=(b, H, N))
    KK, VV = mx.concatenate([K, k], 2), mx.concatenate([V, v], 2)
    mx.eval(q, k, v, K, V, old, KK, VV)
    want = mx.fast.scaled_dot_product_attention(q, KK, VV, scale=D ** -0.5)
    lines = [f"batch {b}: sdpa over a contiguous copy {timeit(lambda: mx.fast.scaled_dot_product_attention(q, KK, VV, scale=D ** -0.5), reps):.1f} us"]
    names = ("ATTEND_THREADS", "SPLIT_BLOCKS", "MIN_CHUNK")
    default = {x: getattr(ev, x) for x in names}
    try:
        for setting in settings:
            for name, value in zip(names, setting.split(":")):
                setattr(ev, name, int(value))
            ev._attend_part_kernel.cache_clear()
            ev._attend_combine_kernel.cache_clear()
            err = float(mx.max(mx.abs(ev.attend_weights(q, K, V, k, v)[0].astype(mx.float32)
                                      - want.astype(mx.float32))))
            a = timeit(lambda: ev.attend_weights(q, K, V, k, v)[0], reps)
            h2o = timeit(lambda: ev.attend_weights(q, K, V, k, v, old=old, accumulate="decay", decay=0.98)[0], reps)
            chunk = ev.split_chunk(N + 1, b * H)
            lines.append(f"  {setting} (chunks of {chunk}, {b * H * -(-(N + 1) // chunk)} blocks): attend_weights "
                         f"{a:.1f} us (max |out - sdpa| {err:.3g}), with decay {h2o:.1f} us")
    finally:
        for name, value in default.items():
            setattr(ev, name, value)
        ev._attend_part_kernel.cache_clear()
        ev._attend_combine_kernel.cache_clear()
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--split", nargs="*", default=[],
                    help="attend_weights settings THREADS:BLOCKS[:MIN_CHUNK] to time against SDPA")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if mx.default_device() != mx.gpu:
        print("decode_layer_parts needs a GPU (the cuda backend's kernels)", file=sys.stderr)
        return 2
    for b in args.batch:
        print(f"batch {b}: us per layer")
        for name, us in parts(b, args.reps).items():
            print(f"  {name:34s} {us:8.1f}")
        if args.split:
            print("\n".join(splits(b, args.split, args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

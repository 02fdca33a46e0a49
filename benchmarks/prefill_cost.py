"""Prefill time and peak memory of velox caches beside the full cache (by default the low-rank
and cross-layer methods), and the share of the prefill their decompositions (SVD,
eigendecomposition) take.

    python benchmarks/prefill_cost.py [--prefill 2048] [--chunk 512] [--rounds 3] \
        [--rows full svdq palu palu:basis=prefill xkv minicache xquant kvtc]

The embedded SmolLM2-135M-Instruct (float32, CPU) prefills the first ``--prefill`` tokens of a
shipped text (``--text``, default ``pride``) in forwards of ``--chunk`` tokens, the caches'
arrays evaluated after each forward, as mlx-lm's ``generate`` prefills. Every row is prefilled
``--rounds`` times, the rows interleaved round by round, after one untimed prefill of the full
cache (a row's first prefill also pays its compilation and one-time set-up: the table gives
the median of the rounds).

``prefill s`` is the wall time of the whole prefill; ``peak MiB`` is MLX's peak memory during
it less the live memory before it (the caches and the forwards' transients; the model's weights
are live before and not counted). ``x full``: the ratios to the full cache's medians.

Decomposition time, measured apart in one more prefill per row: every call of
``mx.linalg.eigh``, ``mx.linalg.svd``, ``numpy.linalg.eigh`` and ``numpy.linalg.svd`` is timed
with its input evaluated before the clock starts and its output evaluated before it stops
(which serialises what MLX would otherwise overlap, so the instrumented prefill is a little
slower than the plain one); ``decomp s`` is their sum and ``of prefill`` its share of the plain
prefill's median time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_decode_quality as ldq  # noqa: E402  (its rows: name[:key=value,...])

FULL = ldq.FULL
DEFAULT_ROWS = ["full", "svdq", "palu", "palu:basis=prefill", "xkv", "minicache", "xquant", "kvtc"]


def make_caches(model, row: str) -> list:
    """The caches of a row as the long-decode benchmark makes them (``full``, ``mlxlm-q``, or
    a velox method with its parameters)."""
    return ldq.make_caches(model, *ldq.parse_row(row))


def prefill(model, tokens: mx.array, caches: list, chunk: int) -> None:
    from velox.decode import arrays

    for i in range(0, tokens.shape[0], chunk):
        model(tokens[None, i:i + chunk], cache=caches)
        mx.eval([arrays(c.state) for c in caches])


def measured(model, tokens: mx.array, row: str, chunk: int) -> tuple[float, float]:
    """``(seconds, peak MiB above the live memory before)`` of one prefill into fresh caches."""
    import gc

    gc.collect()
    mx.clear_cache()
    caches = make_caches(model, row)
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    prefill(model, tokens, caches, chunk)
    mx.synchronize()
    dt = time.perf_counter() - t
    peak = (mx.get_peak_memory() - base) / 2 ** 20
    del caches
    return dt, peak


@contextmanager
def timed_decompositions(total: list[float]):
    """Times every decomposition call (inputs evaluated first, outputs before the clock stops)
    into ``total[0]`` while the block runs."""
    saved = {(mx.linalg, "eigh"): mx.linalg.eigh, (mx.linalg, "svd"): mx.linalg.svd,
             (np.linalg, "eigh"): np.linalg.eigh, (np.linalg, "svd"): np.linalg.svd}

    def wrap(mod, name, fn):
        def timed(a, *args, **kwargs):
            if isinstance(a, mx.array):
                mx.eval(a)
            t = time.perf_counter()
            out = fn(a, *args, **kwargs)
            if mod is mx.linalg:
                mx.eval(out)
            total[0] += time.perf_counter() - t
            return out
        return timed

    for (mod, name), fn in saved.items():
        setattr(mod, name, wrap(mod, name, fn))
    try:
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--text", default="pride")
    ap.add_argument("--rows", nargs="+", default=DEFAULT_ROWS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if FULL not in args.rows:
        args.rows.insert(0, FULL)

    from velox.adapters.harness import _encode, load_text
    from velox.adapters.smollm2 import load_default_model

    model, tokenizer = load_default_model()
    tokens = mx.array(_encode(tokenizer, load_text(args.text))[:args.prefill])
    print(f"SmolLM2-135M-Instruct (float32, {mx.default_device()}), {tokens.shape[0]} tokens of "
          f"{args.text} in forwards of {args.chunk}, {args.rounds} rounds", flush=True)
    measured(model, tokens, FULL, args.chunk)  # untimed: the model's first forwards
    times: dict[str, list[float]] = {r: [] for r in args.rows}
    peaks: dict[str, list[float]] = {r: [] for r in args.rows}
    for k in range(args.rounds):
        order = args.rows[k % len(args.rows):] + args.rows[:k % len(args.rows)]
        for row in order:
            dt, peak = measured(model, tokens, row, args.chunk)
            times[row].append(dt)
            peaks[row].append(peak)
        print(f"round {k + 1}: " + ", ".join(f"{r} {times[r][-1]:.2f} s" for r in args.rows),
              flush=True)
    decomp: dict[str, float] = {}
    for row in args.rows:
        total = [0.0]
        with timed_decompositions(total):
            measured(model, tokens, row, args.chunk)
        decomp[row] = total[0]
    t_full, p_full = statistics.median(times[FULL]), statistics.median(peaks[FULL])
    lines = ["| cache | prefill s | x full | peak MiB | x full | decomp s | of prefill |",
             "|---|---|---|---|---|---|---|"]
    out = {"command": " ".join(["python", "benchmarks/prefill_cost.py",
                                *(sys.argv[1:] if argv is None else argv)]),
           "prefill": int(tokens.shape[0]), "chunk": args.chunk, "text": args.text,
           "device": str(mx.default_device()), "rows": {}}
    for row in args.rows:
        t, p = statistics.median(times[row]), statistics.median(peaks[row])
        share = decomp[row] / t if t else 0.0
        lines.append(f"| {row} | {t:.2f} | {t / t_full:.2f} | {p:.1f} | {p / p_full:.2f} | "
                     f"{decomp[row]:.3f} | {100 * share:.1f}% |")
        out["rows"][row] = {"seconds": times[row], "peak_mib": peaks[row],
                            "decomposition_s": decomp[row]}
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

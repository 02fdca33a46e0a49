"""Decode tokens/s on SmolLM2 at a 2k-token context: a velox cache against mlx-lm's KVCache.

Both caches are prefilled with the same text (``--context`` tokens, default 2048); then blocks
of ``--steps`` greedy single-token decode steps alternate between them in this process
(``--reps`` blocks each, one untimed warm-up step per block). Prints the median tokens/s of
each, their ratio (target: the velox cache at least 1.2x the KVCache), and a per-layer profile
of one decode step: the cache update (as ``velox.update`` runs it, and as the adapter runs it:
the slot write left for the next step), the attention and the concatenation of stored and new
tokens, timed in isolation on the prefilled states.

    python benchmarks/bench_decode.py [--method tova] [--budget 256] [--context 2048]
        [--param slack=16] [--real-queries]

CPU fp32; preload OpenBLAS on Linux (see README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import velox  # first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core (velox._blas)
import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from velox.adapters import harness
from velox.evict import append_rows
from velox.adapters.mlxlm import VeloxCache, make_cache
from velox.adapters.smollm2 import load_default_model


def decode_block(model, caches, token: int, steps: int) -> tuple[float, int]:
    """One warm-up step, then ``steps`` timed greedy steps; returns (tok/s, last token)."""
    y = mx.array([[token]])
    logits = model(y, cache=caches)
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(y)
    return steps / (time.perf_counter() - t0), int(y.item())


def _median_time(fn, reps: int = 200) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(model, velox_caches, kv_caches) -> dict[str, float]:
    """Per-layer microseconds of one decode step's parts, on the prefilled layer-0 states."""
    args = model.args
    h, q_heads, d = args.num_key_value_heads, args.num_attention_heads, args.head_dim
    layers = len(velox_caches)
    c = velox_caches[0]
    state = c.velox_state
    m = c.method
    k1, v1 = (mx.random.normal((1, h, 1, d)) for _ in range(2))
    q1 = mx.random.normal((1, q_heads, 1, d))
    mx.eval(k1, v1, q1)
    update = mx.compile(lambda s, k, v, q: m.update(s, k, v, queries=q))
    try:
        from velox.decode import split_update as _split_step, write_row as _write_row
    except ImportError:  # a version before slots (a comparison run)
        _split_step = _write_row = None
    split_update = _split_step and mx.compile(lambda s, k, v, q: _split_step(m, s, k, v, q))
    out = {}
    held = {"state": m.update(state, k1, v1, queries=q1), "row": None}  # a copy of its own
    mx.eval(held["state"])

    def velox_update():
        mx.eval(update(state, k1, v1, q1))

    def velox_split():  # the adapter's: the previous step's row written first, in place
        if held["row"] is not None:
            held["state"] = _write_row(held["state"], held["row"])
        held["state"], held["row"] = split_update(held["state"], k1, v1, q1)
        mx.eval(held["state"], held["row"])

    def stored(st):  # what the adapter's attention reads: kv_slots (get_kv before slots)
        return m.kv_slots(st)[:2] if getattr(m, "kv_slots", None) else m.get_kv(st)

    def velox_concat():  # what the adapter hands the attention: stored (slot order) ++ new
        k, v = stored(state)
        mx.eval(append_rows(k, k1), append_rows(v, v1))

    kk, vv = stored(state)
    keys, values = append_rows(kk, k1), append_rows(vv, v1)
    mx.eval(keys, values)
    scale = d ** -0.5

    def velox_attention():
        mx.eval(mx.fast.scaled_dot_product_attention(q1, keys, values, scale=scale))

    n = kv_caches[0].offset
    fk, fv = kv_caches[0].keys[..., :n, :], kv_caches[0].values[..., :n, :]
    mx.eval(fk, fv)
    grow = KVCache()
    grow.update_and_fetch(fk, fv)

    def kv_update():  # KVCache.update_and_fetch: slice assignment into its growing buffer
        mx.eval(*grow.update_and_fetch(k1, v1))

    def kv_attention():
        mx.eval(mx.fast.scaled_dot_product_attention(q1, fk, fv, scale=scale))

    parts = (("velox update (compiled)", velox_update),
             ("velox update (adapter, split)", velox_split if _split_step else None),
             ("velox kv_slots + append", velox_concat),
             ("velox attention", velox_attention),
             ("KVCache update_and_fetch", kv_update),
             ("KVCache attention", kv_attention))
    for name, fn in parts:
        if fn is not None:
            out[name] = _median_time(fn) * 1e6
    out["layers"] = layers
    out["velox stored tokens"] = int(keys.shape[2]) - 1
    out["KVCache stored tokens"] = n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="tova")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per block")
    ap.add_argument("--reps", type=int, default=7, help="blocks per cache")
    ap.add_argument("--text", default="alice")
    ap.add_argument("--param", action="append", default=[],
                    help="name=value (an int) for the velox cache, e.g. slack=16")
    ap.add_argument("--real-queries", action="store_true",
                    help="deferred mode: the update scores with the step's real queries")
    args = ap.parse_args()
    extra = {k: int(v) for k, v in (p.split("=", 1) for p in args.param)}

    model, tokenizer = load_default_model()
    tokens = harness.text_tokens(tokenizer, harness.load_text(args.text), args.context)
    kv = make_prompt_cache(model)
    vx = make_cache(model, args.method, budget=args.budget, real_queries=args.real_queries, **extra)
    assert all(type(c) is KVCache for c in kv) and all(isinstance(c, VeloxCache) for c in vx)
    t0 = time.perf_counter()
    for caches in (kv, vx):
        harness.prefill(model, tokens[:-1], caches, chunk=512)
    print(f"SmolLM2-135M fp32 on {mx.default_device()}, context {args.context} tokens "
          f"(prefill of both caches {time.perf_counter() - t0:.1f} s)")
    print(f"{args.method} budget={args.budget} {extra}, mode {vx[0].mode.value}: "
          f"{vx[0].size()} stored tokens per layer; "
          f"KVCache: {kv[0].size()}")

    rates = {"KVCache": [], args.method: []}
    last = {"KVCache": tokens[-1], args.method: tokens[-1]}
    for rep in range(args.reps):
        order = (("KVCache", kv), (args.method, vx)) if rep % 2 == 0 else \
            ((args.method, vx), ("KVCache", kv))
        for name, caches in order:
            rate, last[name] = decode_block(model, caches, last[name], args.steps)
            rates[name].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    for name, r in rates.items():
        print(f"  {name:>12}: median {med[name]:6.2f} tok/s   blocks: "
              + " ".join(f"{x:.2f}" for x in r))
    ratio = med[args.method] / med["KVCache"]
    print(f"decode ratio {args.method}/KVCache = {ratio:.3f}x  (target >= 1.2x: "
          f"{'met' if ratio >= 1.2 else 'missed'})")
    mem_vx = harness.memory(vx)
    mem_kv = harness.memory(kv)
    print(f"KV bytes: {args.method} {mem_vx.kv_bytes / 2**20:.2f} MiB, "
          f"KVCache {mem_kv.kv_bytes / 2**20:.2f} MiB")

    prof = profile(model, vx, kv)
    layers = prof.pop("layers")
    print(f"per-layer decode parts (median us; x{layers} layers per step), stored tokens: "
          f"velox {prof.pop('velox stored tokens')}, KVCache {prof.pop('KVCache stored tokens')}")
    for name, us in prof.items():
        print(f"  {name:<28} {us:8.1f} us   ({us * layers / 1e3:6.2f} ms per step)")
    step_ms = {k: 1e3 / v for k, v in med.items()}
    print("  whole step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in step_ms.items()))


if __name__ == "__main__":
    main()

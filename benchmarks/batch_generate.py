"""Throughput of mlx-lm's ``batch_generate`` with velox caches against mlx-lm's own caches.

For every batch size of ``--batch``: ``B`` prompts of ``--context`` random token ids (fixed
seed, a different prompt per row) generate ``--max-tokens`` greedy tokens each through
``mlx_lm.batch_generate(..., prefill_step_size=--prefill-step)``, once with mlx-lm's own caches
(``prompt_caches=None``: a ``KVCache`` per request, batched as ``BatchKVCache``; the row
``mlx-lm``) and once per velox configuration of ``--methods`` (``prompt_caches=[make_cache(model,
method, ...) for each prompt]``: velox's batch cache, ``velox.adapters.batch``, whose rows run
as one batched state once they hold the same slot layout, else one batch-of-one state per row;
``--per-row`` adds each configuration that can join (``contract.ragged``) again with the rows never joined, ``(per row)``).
Budgeted methods keep ``--budget`` tokens (sinks included), ``kivi`` runs at ``bits=4``;
``--param key=value`` or ``--param method.key=value`` override, ``--methods tova:slack=16``
gives one configuration its own parameters.

Each configuration first runs once untimed with 2 tokens (compilation, allocation), then
``--reps`` timed rounds, each running every configuration once (interleaved, the starting
configuration rotating); the table gives each configuration's median run. Columns (from mlx-lm's ``BatchStats``
and the wall clock): ``prompt tok/s`` (prompt tokens over prompt time), ``decode tok/s``
(generated tokens over the time after the prompts), ``total tok/s`` (generated tokens over
the whole run, prompts included), ``wall s``, ``peak MiB`` (``mx.get_peak_memory()`` over the
run, reset before it: weights, caches and activations) and ``KV MiB/row`` (``nbytes`` of the
first request's returned cache: velox caches their real state bytes, mlx-lm's the bytes its
arrays hold). ``x mlx-lm`` is the configuration's total tok/s over mlx-lm's at that batch,
``x mlx-lm decode`` the same for decode tok/s.

    python benchmarks/batch_generate.py --model smollm2 --batch 1 8 --context 1024 --budget 256
    python benchmarks/batch_generate.py --model llama-1b-random --batch 1 8 32 --context 8192 --budget 2048

Models (``benchmarks/decode_speed.py``'s ``build_model``): ``smollm2`` (the embedded
SmolLM2-135M-Instruct, float32), ``llama-1b-random`` (Llama-3.2-1B's shape, random weights,
bfloat16 on a GPU), ``tiny-random`` (for tests). ``--json`` is rewritten after every run.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import velox  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
from mlx_lm import batch_generate

from velox.adapters.cli import budget_params
from velox.adapters.mlxlm import make_cache
from velox.registry import get_method


def _decode_speed():
    """``benchmarks/decode_speed.py`` (its models and its parsing of ``--methods`` and
    ``--param``), loaded by path."""
    name = "velox_bench_decode_speed"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("decode_speed.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


PLAIN = "mlx-lm"
# Throughput only: no token ends a sequence early (every row generates --max-tokens).
TOKENIZER = SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")


def configs(methods: list[str], budget: int, params: list[str]) -> list[tuple[str, str, dict]]:
    """``(label, method, parameters)``: mlx-lm's caches, then each velox configuration."""
    out = [(PLAIN, PLAIN, {})]
    for entry, given in _decode_speed().method_params(methods, params).items():
        m = entry.partition(":")[0]
        if m == "kivi":
            given.setdefault("bits", 4)
        p = dict(given)
        if "budget" not in given:
            p.update(budget_params(m, budget, given) or {})
        out.append((m + "".join(f" {k}={v}" for k, v in given.items())
                    + ("" if "budget" in given or "budget" not in p else f" budget={p['budget']}"), m, p))
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods measures one configuration twice: {labels}")
    return out


def prompts_for(batch: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    rng = mx.random.key(seed)
    ids = mx.random.randint(0, vocab, (batch, context), key=rng)
    return ids.tolist()


def run_once(model, prompts, method: str, params: dict, max_tokens: int, step: int,
             join: bool = True, prefill_batch: int | None = None) -> dict:
    from velox.adapters.batch import VeloxBatchCache
    caches = None if method == PLAIN else [make_cache(model, method, **params) for _ in prompts]
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    VeloxBatchCache.join_rows = join
    try:
        t0 = time.perf_counter()
        r = batch_generate(model, TOKENIZER, prompts, prompt_caches=caches, max_tokens=max_tokens,
                           prefill_step_size=step, return_prompt_caches=True,
                           prefill_batch_size=prefill_batch or len(prompts),
                           completion_batch_size=len(prompts))
        wall = time.perf_counter() - t0
    finally:  # a failed run (out of memory) leaves the class as it was
        VeloxBatchCache.join_rows = True
    peak = mx.get_peak_memory()
    s = r.stats
    kv = sum(int(c.nbytes) for c in r.caches[0])
    return dict(wall_s=wall, prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
                prompt_tok_s=s.prompt_tokens / s.prompt_time if s.prompt_time else 0.0,
                decode_tok_s=s.generation_tps, total_tok_s=s.generation_tokens / wall,
                peak_bytes=int(peak), kv_bytes_per_row=kv)


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    head = ("| batch | cache | prompt tok/s | decode tok/s | x mlx-lm decode | total tok/s | x mlx-lm "
            "| wall s | peak MiB | KV MiB/row |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['batch']} | {r['cache']} | failed: {r['failed']} |" + " |" * 7)
            continue
        ratio = "-" if r.get("x_plain") is None else f"{r['x_plain']:.2f}"
        dratio = "-" if r.get("x_plain_decode") is None else f"{r['x_plain_decode']:.2f}"
        lines.append(f"| {r['batch']} | {r['cache']} | {r['prompt_tok_s']:.0f} | {r['decode_tok_s']:.1f} "
                     f"| {dratio} | {r['total_tok_s']:.1f} | {ratio} | {r['wall_s']:.2f} | {mib(r['peak_bytes'])} "
                     f"| {mib(r['kv_bytes_per_row'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "llama-1b-random", "tiny-random"))
    ap.add_argument("--dtype", default=None, choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--methods", nargs="+", default=["tova", "kivi"])
    ap.add_argument("--param", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prefill-batch", type=int, default=None,
                    help="prompts prefilled at once (mlx-lm's prefill_batch_size; default: the batch)")
    ap.add_argument("--per-row", action="store_true",
                    help="also run each velox configuration with one state per row (never joined)")
    args = ap.parse_args(argv)

    ds = _decode_speed()
    model, label = ds.build_model(args.model, args.dtype, args.seed)
    cfgs = [(name, method, params, True) for name, method, params in
            configs(args.methods, args.budget, args.param)]
    if args.per_row:
        cfgs += [(name + " (per row)", method, params, False) for name, method, params, _ in cfgs
                 if method != PLAIN and get_method(method).spec.contract.get("ragged", False)]
    vocab = model.args.vocab_size
    meta = dict(model=label, device=str(mx.default_device()), machine=platform.machine(),
                processor=platform.processor(), mlx=mx.__version__,
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                argv=sys.argv[1:] if argv is None else argv,
                context=args.context, max_tokens=args.max_tokens, budget=args.budget,
                prefill_step=args.prefill_step, reps=args.reps)
    print(f"# {label}, {meta['device']}; prompts of {args.context} tokens, {args.max_tokens} new "
          f"tokens per row, prefill_step_size={args.prefill_step}", flush=True)
    rows: list[dict] = []
    for batch in args.batch:
        prompts = prompts_for(batch, args.context, vocab, args.seed + batch)
        failed: dict[str, str] = {}

        def attempt(name, method, params, join, max_tokens):
            """One run; a configuration that fails (e.g. out of device memory) is reported
            and left out of the later rounds."""
            if name in failed:
                return None
            try:
                return run_once(model, prompts, method, params, max_tokens, args.prefill_step,
                                join, args.prefill_batch)
            except RuntimeError as e:
                failed[name] = str(e).splitlines()[0][:160]
                print(f"batch {batch} {name}: failed: {failed[name]}", flush=True)
                gc.collect()
                mx.clear_cache()
                return None

        for name, method, params, join in cfgs:  # warm-up: compilation, allocation
            attempt(name, method, params, join, 2)
        runs: dict[str, list[dict]] = {name: [] for name, *_ in cfgs}
        for rep in range(args.reps):  # interleaved: each round runs every configuration
            order = cfgs[rep % len(cfgs):] + cfgs[:rep % len(cfgs)]
            for name, method, params, join in order:
                r = attempt(name, method, params, join, args.max_tokens)
                if r is not None:
                    runs[name].append(r)
        plain = None
        for name, method, params, join in cfgs:
            if not runs[name]:
                rows.append(dict(batch=batch, cache=name, method=method, params=params, joined=join,
                                 failed=failed.get(name, "no run")))
                continue
            mine = sorted(runs[name], key=lambda r: r["total_tok_s"])
            row = dict(batch=batch, cache=name, method=method, params=params, joined=join,
                       **mine[len(mine) // 2],
                       total_tok_s_runs=[r["total_tok_s"] for r in runs[name]],
                       decode_tok_s_runs=[r["decode_tok_s"] for r in runs[name]])
            if method == PLAIN:
                plain = row
            row["x_plain"] = None if plain is None or method == PLAIN else row["total_tok_s"] / plain["total_tok_s"]
            row["x_plain_decode"] = (None if plain is None or method == PLAIN
                                     else row["decode_tok_s"] / plain["decode_tok_s"])
            rows.append(row)
            print(f"batch {batch} {name}: {row['total_tok_s']:.1f} tok/s total, "
                  f"{row['decode_tok_s']:.1f} decode, peak {mib(row['peak_bytes'])} MiB", flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print()
    print(table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

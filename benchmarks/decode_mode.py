"""Decode modes on SmolLM2-135M-Instruct: passkey accuracy and token-by-token perplexity of
evicting methods with ``decode="evict"`` (every decode step runs the method's update) against
``decode="append"`` (decoded tokens join an uncompressed tail of ``--cap`` tokens).

Budgets are a fraction of the compressed length: ``--fractions 0.5 0.25`` (50% and 75%
removal) of the passkey prompt (the whole prompt is compressed, the question included) and
of the perplexity prefix. Passkey uses ``harness.passkey`` (``--trials`` prompts per depth;
accuracy with its 95% Wilson interval); perplexity uses ``harness.perplexity`` with
``chunk=1`` (every scored token is a single-token decode step, so append mode absorbs its
tail every ``--cap`` tokens). The prompt minus its last token is one prefill chunk (every
method compresses it once, then decodes), so its forward is the same for every cache: it is
computed once per prompt with a plain cache (keys, values and the queries the attention
saw) and each cache absorbs it (``VeloxCache.absorb``), which is the update the forward
would have run; ``--check`` compares that with real forwards, state array by state array.
Prompts run one after another, every configuration on each; results.json in ``--out`` is
rewritten after every prompt.

    python benchmarks/decode_mode.py --out docs/results/decode-mode

CPU fp32; OpenBLAS is loaded in-process by ``import velox``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import velox  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from velox.adapters import harness
from velox.adapters.mlxlm import VeloxCache, make_cache, tap_queries
from velox.adapters.smollm2 import load_default_model

N_SINK = 4  # every method's default


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """95% Wilson score interval of ``k / n``."""
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


# (label, method, parameters given the budget, decode modes to run)
CONFIGS = [
    ("knorm", "knorm", lambda b: dict(budget=b), ("evict", "append")),
    ("knorm recent=16", "knorm", lambda b: dict(budget=b, recent=16), ("evict",)),
    ("knorm recent=32", "knorm", lambda b: dict(budget=b, recent=32), ("evict",)),
    ("h2o", "h2o", lambda b: dict(budget=b), ("evict", "append")),
    ("h2o decay=1 grace=0", "h2o", lambda b: dict(budget=b, decay=1.0, grace=0), ("evict", "append")),
    ("tova", "tova", lambda b: dict(budget=b), ("evict", "append")),
    ("snapkv", "snapkv", lambda b: dict(budget=b), ("evict", "append")),
    ("streaming_llm", "streaming_llm", lambda b: dict(window_size=b - N_SINK), ("evict", "append")),
]


def factory(model, method, params, decode, cap):
    if method is None:
        return lambda: make_prompt_cache(model)
    return lambda: make_cache(model, method, decode=decode, decode_cap=cap, **params)


class SharedPrefill:
    """The model, except for a multi-token call on empty caches: its forward is computed once
    per token sequence with a plain cache, and each configuration's caches absorb it once
    (the configuration is the method and its parameters; decode modes share it, since a
    prefill chunk is compressed the same way in both); later caches of the configuration get
    a copy, in their own decode mode. Returns None there (the harness's prefill reads no
    logits). Every other call runs the model."""

    def __init__(self, model):
        self.model = model
        self.memo: tuple | None = None  # (tokens, [(keys, values, queries)] per layer)
        self.states: dict = {}  # (tokens, configuration) -> caches after the prefill
        self.shared = 0

    def __call__(self, inputs, cache=None):
        tokens = tuple(np.array(inputs).reshape(-1).tolist())
        if len(tokens) < 2 or any(not c.empty() if isinstance(c, VeloxCache) else c.offset
                                  for c in cache):
            return self.model(inputs, cache=cache)
        if self.memo is None or self.memo[0] != tokens:
            self.memo, self.states = None, {}
            plain = make_prompt_cache(self.model)
            with tap_queries() as taps:
                self.model(inputs, cache=plain)
                n = len(tokens)
                layers = [(c.state[0][:, :, :n], c.state[1][:, :, :n], q) for c, q in zip(plain, taps)]
                mx.eval(layers)
            self.memo = (tokens, layers)
        config = tuple((type(c).__name__, getattr(c, "method", None) and c.method.key,
                        json.dumps(getattr(c, "params", None), sort_keys=True)) for c in cache)
        done = self.states.get(config)
        if done is not None:
            for i, c in enumerate(cache):
                new = copy.deepcopy(done[i])
                if isinstance(c, VeloxCache):
                    new.decode, new.decode_cap = c.decode, c.decode_cap
                cache[i] = new
            self.shared += 1
            return None
        for c, (k, v, q) in zip(cache, self.memo[1]):
            if isinstance(c, VeloxCache):
                c.absorb(k, v, queries=q)
            elif type(c) is KVCache:
                c.update_and_fetch(k, v)
            else:
                raise ValueError(f"SharedPrefill cannot fill a {type(c).__name__}")
        mx.eval([c.state for c in cache])
        self.states[config] = copy.deepcopy(cache)
        self.shared += 1
        return None


def _same_states(a: list, b: list) -> bool:
    for x, y in zip(a, b):
        fx = [v for _, v in tree_flatten(x.velox_state if isinstance(x, VeloxCache) else x.state)]
        fy = [v for _, v in tree_flatten(y.velox_state if isinstance(y, VeloxCache) else y.state)]
        if len(fx) != len(fy):
            return False
        for u, w in zip(fx, fy):
            if isinstance(u, mx.array) and not (u.shape == w.shape and bool(mx.array_equal(u, w))):
                return False
    return True


def check(model, shared, tokenizer, length, cells) -> dict[str, bool]:
    """A real chunked forward and the shared prefill leave the same states (one prompt)."""
    filler = harness._encode(tokenizer, harness.load_text("pride"))
    prompt, _ = harness.passkey_prompt(tokenizer, length=length, depth=0.5, key="12345",
                                       filler=filler, offset=100)
    out = {}
    for label, fac in cells:
        real, memo, again = fac(), fac(), fac()
        harness.prefill(model, prompt[:-1], real, chunk=length)
        harness.prefill(shared, prompt[:-1], memo, chunk=length)
        harness.prefill(shared, prompt[:-1], again, chunk=length)  # the copied states
        out[label] = _same_states(real, memo) and _same_states(real, again) and all(
            getattr(a, "decode", None) == getattr(b, "decode", None) for a, b in zip(real, again))
    return out


def table(results: dict) -> str:
    """Markdown table of a results.json: one row per configuration, evict beside append."""
    rows: dict = {}
    for c in results["cells"]:
        rows.setdefault((c["fraction"], c["label"]), {})[c["decode"]] = c

    def pk(c):
        if c is None:
            return "-"
        lo, hi = c["passkey_wilson"]
        return f"{c['passkey_correct']}/{c['passkey_n']} = {c['passkey_acc']:.2f} [{lo:.2f}, {hi:.2f}]"

    def ppl(c):
        return "-" if c is None or "ppl" not in c else f"{c['ppl']:.2f}"

    def kib(c):
        return "-" if c is None or "ppl_kv_bytes" not in c else f"{c['ppl_kv_bytes'] / 2**20:.1f}"

    out = ["| removal | configuration | passkey, evict | passkey, append | ppl, evict | ppl, append "
           "| MiB after ppl, evict | MiB, append |", "|---|---|---|---|---|---|---|---|"]
    for (frac, label), m in rows.items():
        removal = "none" if frac is None else f"{1 - frac:.0%}"
        e, a = m.get("evict", m.get("-")), m.get("append")
        out.append(f"| {removal} | {label} | {pk(e)} | {pk(a)} | {ppl(e)} | {ppl(a)} | {kib(e)} | {kib(a)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=1024, help="passkey prompt tokens")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--trials", type=int, default=6, help="passkey prompts per depth")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25],
                    help="budget as a fraction of the compressed length")
    ap.add_argument("--cap", type=int, default=64, help="append mode's decode_cap")
    ap.add_argument("--ppl-text", default="holmes", help="shipped text for perplexity")
    ap.add_argument("--ppl-prefix", type=int, default=1024, help="tokens before the first scored one")
    ap.add_argument("--ppl-tokens", type=int, default=256, help="tokens scored one at a time")
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="first compare the shared prefill with real forwards")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown table of --out/results.json and exit")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "results.json"
    if args.table:
        print(table(json.loads(out_json.read_text())))
        return

    model, tokenizer = load_default_model()
    shared = SharedPrefill(model)
    cells = [("full", None, None, "-", None)]
    for frac in args.fractions:
        for label, method, params, modes in CONFIGS:
            if args.only is not None and label not in args.only:
                continue
            for mode in modes:
                cells.append((label, method, params, mode, frac))

    def fac(cell, budget):
        label, method, params, mode, _ = cell
        return factory(model, method, params and params(budget), mode, args.cap)

    results = {"command": "python benchmarks/decode_mode.py " + " ".join(
                   f"--{k.replace('_', '-')}" + ("" if v is True else " " + (" ".join(map(str, v)) if isinstance(v, list) else str(v)))
                   for k, v in vars(args).items() if v not in (None, False)),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), "
                          f"load {os.getloadavg()[0]:.1f} at start, mlx {mx.__version__}",
               "model": "SmolLM2-135M-Instruct (embedded, fp32)",
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    start = time.perf_counter()
    if args.check:
        picks = [c for c in cells if c[1] is None or c[4] == args.fractions[0]]
        results["prefill_check"] = check(
            model, shared, tokenizer, args.length,
            [(f"{c[0]} {c[3]} {c[4]}", fac(c, None if c[4] is None else round(c[4] * args.length)))
             for c in picks])
        print("prefill check:", results["prefill_check"], flush=True)
        if not all(results["prefill_check"].values()):
            raise SystemExit("the shared prefill differs from real forwards")
        shared.memo, shared.states = None, {}
    records = [{"label": c[0], "method": c[1], "decode": c[3], "fraction": c[4],
                "passkey_budget": None if c[4] is None else round(c[4] * args.length),
                "trials": [], "passkey_seconds": 0.0} for c in cells]
    prompts = [(d, args.trials * j + i) for i in range(args.trials) for j, d in enumerate(args.depths)]
    for p, (depth, seed) in enumerate(prompts):
        for cell, rec in zip(cells, records):
            t0 = time.perf_counter()
            keys = harness.passkey(shared, tokenizer, fac(cell, rec["passkey_budget"]),
                                   lengths=(args.length,), depths=(depth,), trials=1, seed=seed,
                                   prefill_chunk=args.length)
            rec["passkey_seconds"] += time.perf_counter() - t0
            t = keys.trials[0]
            rec["trials"].append(dict(depth=depth, seed=seed, key=t.key, answer=t.answer,
                                      correct=t.correct, needle_at=t.needle_at))
        for rec in records:
            k, n = sum(t["correct"] for t in rec["trials"]), len(rec["trials"])
            rec.update(passkey_correct=k, passkey_n=n, passkey_acc=k / n,
                       passkey_wilson=list(wilson(k, n)))
        results["cells"] = records
        results["wall_seconds"] = time.perf_counter() - start
        out_json.write_text(json.dumps(results, indent=1))
        print(f"prompt {p + 1}/{len(prompts)} (depth {depth}): "
              + " ".join(str(int(r["trials"][-1]["correct"])) for r in records)
              + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
    for rec in records:
        lo, hi = rec["passkey_wilson"]
        print(f"{rec['label']:22s} {rec['decode']:6s} {rec['fraction']}: passkey "
              f"{rec['passkey_correct']}/{rec['passkey_n']} [{lo:.2f}, {hi:.2f}]", flush=True)
    if not args.skip_ppl:
        ppl_tokens = harness.text_tokens(tokenizer, harness.load_text(args.ppl_text),
                                         args.ppl_prefix + args.ppl_tokens)
        for cell, rec in zip(cells, records):
            budget = None if cell[4] is None else round(cell[4] * args.ppl_prefix)
            p = harness.perplexity(shared, ppl_tokens, fac(cell, budget), prefix=args.ppl_prefix,
                                   chunk=1, prefill_chunk=args.ppl_prefix)
            rec.update(ppl_budget=budget, ppl=p.ppl, nll=p.nll, ppl_scored=p.tokens,
                       ppl_kv_bytes=p.memory.kv_bytes, ppl_stored=p.memory.stored,
                       ppl_seen=p.memory.tokens, ppl_seconds=p.seconds)
            results["wall_seconds"] = time.perf_counter() - start
            out_json.write_text(json.dumps(results, indent=1))
            print(f"{rec['label']:22s} {rec['decode']:6s} {rec['fraction']}: ppl {p.ppl:.3f} "
                  f"({p.seconds:.0f} s)", flush=True)
    results["shared_prefills"] = shared.shared
    results["wall_seconds"] = time.perf_counter() - start
    out_json.write_text(json.dumps(results, indent=1))
    print(f"wall {results['wall_seconds']:.0f} s -> {out_json}")


if __name__ == "__main__":
    main()

"""What a rollback journal costs a decode: tokens/s through mlx-lm's own ``generate_step`` on
the embedded SmolLM2, the same method with ``rollback=0`` and ``rollback=d``, interleaved
(``--reps`` rounds of each), with the ratio per round.

    python benchmarks/rollback_cost.py --method tova --budget 128 --depth 3
"""

from __future__ import annotations

import argparse
import time

import velox  # noqa: F401  (before mlx: OpenBLAS)
import mlx.core as mx
from mlx_lm.generate import generate_step

from velox.adapters.mlxlm import make_cache
from velox.adapters.smollm2 import load_default_model


def tokens_per_second(model, prompt, method: str, params: dict, rollback: int, warm: int, n: int) -> float:
    caches = make_cache(model, method, rollback=rollback, **params)
    gen = generate_step(prompt, model, prompt_cache=caches, max_tokens=warm + n)
    for _, _ in zip(range(warm), gen):  # the prompt and the first steps (compilation)
        pass
    t = time.perf_counter()
    got = sum(1 for _ in gen)
    return got / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="tova")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_default_model()
    prompt = mx.array(tok.encode("The history of the city " * (args.prompt_tokens // 4 + 1))[:args.prompt_tokens])
    params = {"budget": args.budget} if "budget" in velox.get_method(args.method).spec.params else {}
    rates: dict[int, list[float]] = {0: [], args.depth: []}
    for _ in range(args.reps):
        for d in rates:
            rates[d].append(tokens_per_second(model, prompt, args.method, params, d, 20, args.steps))
    print(f"{args.method} {params} prompt {args.prompt_tokens}, {args.steps} decode steps timed, "
          f"{args.reps} interleaved rounds ({mx.default_device()})")
    for d, r in rates.items():
        print(f"  rollback={d}: tok/s {', '.join(f'{x:.1f}' for x in r)}")
    print(f"  rollback={args.depth} / rollback=0 per round: "
          f"{', '.join(f'{a / b:.3f}' for a, b in zip(rates[args.depth], rates[0]))}")


if __name__ == "__main__":
    main()

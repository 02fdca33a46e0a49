"""What a velox cache's reductions over kv heads cost a tensor-parallel decode step.

    python benchmarks/distributed_step.py [--procs 2,4] [--out docs/results/distributed]

Builds a random llama (4 layers, hidden 256, 16 query and 8 kv heads of 64, float32, fixed
seed) into a temporary folder, then runs it in one process and, through ``mlx.launch``
(ring backend on localhost), sharded tensor-parallel over 2 and 4 processes (mlx-lm's
``model.shard``). In each run, for each cache: prefill 512 random tokens (chunks of 128),
then time 72 greedy decode steps (the model's whole step, evaluated), the caches' steps
alternated one by one, the median a step (and its interquartile range). Caches:

* ``full``: mlx-lm's ``KVCache`` (the model's own collectives only: two ``all_sum`` a layer);
* ``tova``: one selection for a layer's heads (``per_head=False``, the paper): each layer
  gathers every process's scores over its ``budget + 1`` candidates
  (``velox.distributed.head_gather``) at every step;
* ``tova per-head``: the same cache with ``per_head=True``: no gather (the A/B pair: the
  difference is what the gather costs a step);
* ``h2o``: head-independent, no collective of velox's.

Budget 256. It reports each step's time, its ratio to the same cache in one process, the
gather's cost (each ``tova`` step less the ``tova per-head`` step right after it: the median
of those differences), a ring ``all_gather`` of one layer's scores
(``[1, h, 257]`` float32) and an ``all_sum`` of one layer's hidden state (the model's), each
timed alone and alternated, with the ratio of velox's collectives a step (one gather a layer)
to the model's (two all_sums a layer), the bytes one step's velox collectives move (every
layer's gathered scores) beside the model's own ``all_sum`` bytes, and each process's cache
bytes with their ratio to the one process's. Results go to ``OUT/README.md`` (with the
command and the machine) and ``OUT/results.json``.

A process's worker (``--worker``) is this script under ``mlx.launch``; its results go to
``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import velox  # noqa: F401  (first: OpenBLAS loads before mlx.core)

import mlx.core as mx
import numpy as np

CONFIG = dict(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
              num_attention_heads=16, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
              vocab_size=1024, rope_theta=10000.0, tie_word_embeddings=True)
PROMPT, CHUNK, STEPS, ROUNDS, BUDGET = 512, 128, 24, 3, 256
CACHES = {"full": None, "tova": dict(per_head=False), "tova per-head": dict(per_head=True),
          "h2o": {}}


def _save_model(folder: Path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**CONFIG))
    mx.eval(model.parameters())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(CONFIG))


def _caches(model, name: str):
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.mlxlm import make_cache

    if CACHES[name] is None:
        return make_prompt_cache(model)
    method = name.split()[0]
    return make_cache(model, method, budget=BUDGET, **CACHES[name])


def _collectives_alone(group, h: int) -> dict:
    """Seconds of one ring ``all_gather`` of ``[1, h, BUDGET + 1]`` float32 (a layer's scores,
    velox's) and of one ``all_sum`` of ``[1, 1, hidden]`` float32 (the model's, twice a layer),
    each evaluated alone, alternated: median and interquartile range of 60 each."""
    x = mx.random.normal((h, 1, BUDGET + 1))
    y = mx.random.normal((1, 1, CONFIG["hidden_size"]))
    times = {"all_gather": [], "all_sum": []}
    for i in range(70):
        for name, fn in (("all_gather", lambda: mx.distributed.all_gather(x, group=group)),
                         ("all_sum", lambda: mx.distributed.all_sum(y, group=group))):
            t0 = time.perf_counter()
            mx.eval(fn())
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    return {k: _spread(v) for k, v in times.items()}


def _spread(times: list[float]) -> dict:
    q = np.percentile(times, [25, 50, 75])
    return {"median": float(q[1]), "iqr": float(q[2] - q[0])}


def worker(folder: Path, out: Path) -> None:
    from mlx_lm.models import llama

    from velox.adapters.sharding import launched_group, model_heads
    from velox.adapters.mlxlm import cache_nbytes

    group = launched_group()
    model = llama.Model(llama.ModelArgs(**CONFIG))
    model.load_weights(str(folder / "model.safetensors"))
    if group is not None:
        model.shard(group)
    mx.eval(model.parameters())
    heads = model_heads(model)
    toks = mx.array(np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (1, PROMPT)))
    runs = {}
    for name in CACHES:
        c = _caches(model, name)
        for i in range(0, PROMPT, CHUNK):
            model(toks[:, i:i + CHUNK], cache=c)
            mx.eval([x.state for x in c])
        runs[name] = [c, toks[:, -1:], []]
    for run in runs.values():  # a step outside the clock (the compiled step traced)
        run[1] = mx.argmax(model(run[1], cache=run[0])[:, -1:], axis=-1)
        mx.eval(run[1])
    for _ in range(ROUNDS * STEPS):  # the caches' steps alternated: a load that drifts
        for run in runs.values():    # weighs on each alike
            c, y, times = run
            t0 = time.perf_counter()
            y = mx.argmax(model(y, cache=c)[:, -1:], axis=-1)
            mx.eval(y)
            times.append(time.perf_counter() - t0)
            run[1] = y
    h = CONFIG["num_key_value_heads"] // heads.shards
    result = {"shards": heads.shards, "shard": heads.shard,
              "steps": {n: statistics.median(r[2]) for n, r in runs.items()},
              "steps_iqr": {n: _spread(r[2])["iqr"] for n, r in runs.items()},
              # paired: each tova step less the per-head step taken right after it
              "ab": _spread([a - b for a, b in zip(runs["tova"][2], runs["tova per-head"][2])]),
              "tokens": {n: int(r[1].item()) for n, r in runs.items()},
              "bytes": {n: int(cache_nbytes(r[0])) for n, r in runs.items()},
              "alone": None if group is None else _collectives_alone(group, h)}
    out.write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(n: int, folder: Path, tmp: Path, timeout: float) -> list[dict]:
    """The workers' results of one process (``n == 1``) or ``n`` under mlx.launch."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", str(folder)]
    if n == 1:
        out = tmp / "one.json"
        subprocess.run([*me, "--json", str(out)], check=True, timeout=timeout)
        return [json.loads(out.read_text())]
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    pattern = tmp / f"n{n}"
    cmd = [launcher, "--hosts", "127.0.0.1", "-n", str(n), "--backend", "ring",
           "--starting-port", str(_free_port()), "--", *me, "--json", f"{pattern}-RANK.json"]
    subprocess.run(cmd, check=True, timeout=timeout)
    return [json.loads(Path(f"{pattern}-{r}.json").read_text()) for r in range(n)]


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def report(results: dict[int, list[dict]], command: str) -> tuple[str, dict]:
    one = results[1][0]
    layers, hidden = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
    lines = ["| processes | cache | collectives a step | step (ms) | IQR (ms) | vs one process | "
             "processes agree | last token as one process's |", "|---|---|---|---|---|---|---|---|"]
    for n, ranks in sorted(results.items()):
        r0 = ranks[0]
        for name in CACHES:
            t = r0["steps"][name]
            agree = all(r["tokens"][name] == r0["tokens"][name] for r in ranks)
            same = r0["tokens"][name] == one["tokens"][name]
            calls = 0 if n == 1 else layers * (2 + (name == "tova"))
            lines.append(f"| {n} | {name} | {calls} | {1e3 * t:.2f} | {1e3 * r0['steps_iqr'][name]:.2f} "
                         f"| {t / one['steps'][name]:.2f}x "
                         f"| {'yes' if agree else 'NO'} | {'yes' if same else 'no'} |")
    lines += ["", "| processes | tova - tova per-head, paired steps (ms, IQR) | share of tova's step "
              "| one all_gather alone (ms, IQR) | one all_sum alone (ms, IQR) | all_gather / all_sum "
              "| velox's collectives a step / the model's (time) |", "|---|---|---|---|---|---|---|"]
    summary = {}
    for n, ranks in sorted(results.items()):
        s = ranks[0]["steps"]
        ab = ranks[0]["ab"]
        cost = ab["median"]
        alone = ranks[0]["alone"]
        summary[n] = dict(ab=ab, alone=alone)
        paired = f"{1e3 * cost:+.2f} ({1e3 * ab['iqr']:.2f})"
        if alone is None:
            lines.append(f"| {n} | {paired} | {cost / s['tova']:+.1%} | - | - | - | - |")
            continue
        g, a = alone["all_gather"], alone["all_sum"]
        velox, model = layers * g["median"], 2 * layers * a["median"]
        summary[n].update(velox_collectives_s=velox, model_collectives_s=model)
        lines.append(f"| {n} | {paired} | {cost / s['tova']:+.1%} | {1e3 * g['median']:.3f} "
                     f"({1e3 * g['iqr']:.3f}) | {1e3 * a['median']:.3f} ({1e3 * a['iqr']:.3f}) | "
                     f"{g['median'] / a['median']:.2f} | {velox / model:.2f} |")
    gathered = layers * CONFIG["num_key_value_heads"] * (BUDGET + 1) * 4
    model_sums = layers * 2 * hidden * 4
    lines += ["", f"Bytes a decode step's collectives carry (batch 1): velox's gathers (tova, one "
              f"selection a layer) {gathered:,} B (every layer: 8 kv heads x {BUDGET + 1} "
              f"candidates x 4 B, assembled on every process); the model's own all_sums "
              f"{model_sums:,} B (every layer: 2 x hidden {hidden} x 4 B); h2o and "
              "tova per-head carry none of velox's.", "",
              "| processes | cache | bytes on each process | sum over processes | one process | "
              "each process / one process |", "|---|---|---|---|---|---|"]
    for n, ranks in sorted(results.items()):
        for name in CACHES:
            each = [r["bytes"][name] for r in ranks]
            base = one["bytes"][name]
            lines.append(f"| {n} | {name} | {', '.join(_mib(b) for b in each)} | {_mib(sum(each))} "
                         f"| {_mib(base)} | {max(each) / base:.3f} |")
    text = "\n".join(lines) + "\n"
    doc = {"config": CONFIG, "prompt": PROMPT, "steps": STEPS, "rounds": ROUNDS, "budget": BUDGET,
           "command": command, "machine": _machine(), "results": {str(k): v for k, v in results.items()},
           "summary": {str(k): v for k, v in summary.items()}}
    return text, doc


def _machine() -> dict:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_1min": load,
            "device": str(mx.default_device()), "mlx": mx.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default="2,4", help="process counts, comma-separated")
    p.add_argument("--out", default="docs/results/distributed", help="where the results go")
    p.add_argument("--timeout", type=float, default=1200, help="seconds a run may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        rank = os.environ.get("MLX_RANK", "0")
        worker(Path(args.model), Path(args.json.replace("RANK", rank)))
        return 0
    command = "python benchmarks/distributed_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _save_model(tmp)
        results = {1: _run(1, tmp, tmp, args.timeout)}
        for n in (int(x) for x in args.procs.split(",")):
            results[n] = _run(n, tmp, tmp, args.timeout)
    text, doc = report(results, command.strip())
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = doc["machine"]
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "README.md").write_text(
        "# Tensor-parallel decode steps: what velox's reductions over kv heads cost\n\n"
        f"Command: `{doc['command']}`\n\n"
        f"Machine: {m['platform']}, {m['cpus']} CPUs (shared; 1-minute load average "
        f"{m['loadavg_1min']} at the end), MLX {m['mlx']} on {m['device']}; the ring backend over "
        "TCP on localhost (every process on the same CPU cores).\n\n"
        f"Model: random llama, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
        f"{CONFIG['num_attention_heads']} query and {CONFIG['num_key_value_heads']} kv heads of "
        f"{CONFIG['head_dim']}, float32; prompt {PROMPT} tokens, budget {BUDGET}, median of "
        f"{STEPS * ROUNDS} decode steps (batch 1) a cache, the caches' steps alternated.\n\n"
        "How to read it: every process runs on the same shared cores, so a collective waits for "
        "the other processes to be scheduled; with 4 processes on 2 cores a step is bound by "
        "that, not by bytes or arithmetic, and the spread (IQR) says how much the other work on "
        "the machine moved it. Compare the caches within one process count: `tova` and `tova "
        "per-head` do the same work but the gather (one `all_gather` a layer, beside the model's "
        "two `all_sum`s), so their paired difference is what velox's reduction over kv heads "
        "costs a step here; `h2o` calls no collective of velox's. Each process holds its heads' "
        "share of the cache bytes. The tokens of a sharded model may part from one process's "
        "after many steps (the model's `all_sum` rounds differently; docs/design/distributed.md, "
        "section 6).\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``velox serve`` under load: a velox method against mlx-lm's own caches, same server flags.

For each configuration (default: ``tova`` at ``--budget`` and ``full``, mlx-lm's default
caches served through the same wrapper) this starts ``velox serve`` on the embedded SmolLM2
in a subprocess on a free localhost port, sends one warm-up request, then ``--requests``
chat requests at once (default 16; prompts of different lengths cut from a shipped text,
greedy, ``--max-tokens`` each, so every request decodes that many tokens unless the model
stops), and reports requests per second over the whole burst, the p50/p95 latency of a
request (send to last byte), the tokens generated per second, and the memory the server
held (``GET /velox/stats``: the process's peak RSS and MLX's peak and active bytes, read
after the burst).

    python benchmarks/serve.py [--methods tova,full] [--budget 128] [--requests 16]
        [--max-tokens 32] [--words 150,600] [--server-flags "--decode-concurrency 16"]
        [--json out.json]

CPU, fp32. The numbers depend on the machine's load; each configuration runs in a fresh
process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _chat(url: str, text: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    return {"seconds": time.perf_counter() - t0, "usage": out["usage"],
            "text": out["choices"][0]["message"]["content"]}


def prompts(n: int, lo: int, hi: int) -> list[str]:
    """``n`` requests of ``lo`` to ``hi`` words of a shipped text, each from its own offset,
    followed by a question."""
    from velox.adapters.harness import load_text

    words = load_text("pride").split()
    out = []
    for i in range(n):
        length = lo + (hi - lo) * i // max(1, n - 1)
        start = (i * 997) % max(1, len(words) - length)
        out.append(" ".join(words[start:start + length]) + "\n\nSummarize the passage above.")
    return out


def run_one(method: str, budget: int, requests: list[str], max_tokens: int,
            server_flags: list[str]) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "velox.adapters.cli", "serve", "--model", "smollm2",
           "--method", method, "--port", str(port), "--log-level", "WARNING", *server_flags]
    if method != "full":
        cmd[cmd.index("--method") + 2:cmd.index("--method") + 2] = ["--budget", str(budget)]
    log = tempfile.TemporaryFile()
    # outside the checkout: ``-m`` puts the working directory first on sys.path, where the
    # source tree's ``velox`` lacks an installed package's ``velox.kernels``
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if _get(url + "/velox/stats")["model_loaded"]:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"server did not start: {log.read().decode()}")
            time.sleep(0.3)
        _chat(url, "Hello.", 4)  # warm-up: first-call compilation
        results: list[dict | None] = [None] * len(requests)

        def ask(i: int) -> None:
            results[i] = _chat(url, requests[i], max_tokens)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stats = _get(url + "/velox/stats")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    lat = sorted(r["seconds"] for r in results)
    gen = sum(r["usage"]["completion_tokens"] for r in results)
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    stored = stats.get("stored", [])
    return {
        "method": method, "budget": None if method == "full" else budget,
        "requests": len(requests), "wall_s": wall, "req_per_s": len(requests) / wall,
        "p50_s": statistics.median(lat), "p95_s": lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))],
        "prompt_tokens": prompt, "generated_tokens": gen, "gen_tok_per_s": gen / wall,
        "batchable": stats["batchable"], "memory": stats["memory"],
        "stored_nbytes_max": max((s["nbytes"] for s in stored), default=None),
        "stored_tokens_max": max((s["tokens"] for s in stored), default=None),
        "stored_per_layer_max": max((s["stored_max"] for s in stored), default=None),
        "answers": [r["text"] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="tova,full")
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--words", default="150,600", help="shortest,longest prompt in words")
    p.add_argument("--server-flags", default="", help="extra flags for every server")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.words.split(","))
    reqs = prompts(args.requests, lo, hi)
    rows = []
    for m in [x.strip() for x in args.methods.split(",") if x.strip()]:
        rows.append(run_one(m, args.budget, reqs, args.max_tokens, shlex.split(args.server_flags)))
        r = rows[-1]
        print(f"{m}: {r['req_per_s']:.3f} req/s, p50 {r['p50_s']:.1f} s, p95 {r['p95_s']:.1f} s, "
              f"{r['gen_tok_per_s']:.1f} generated tok/s, batched={r['batchable']}", flush=True)
    mib = 2 ** 20
    print("\n| method | budget | req/s | p50 latency (s) | p95 latency (s) | generated tok/s | "
          "peak RSS (MiB) | MLX peak (MiB) | largest stored cache (MiB, tokens) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = r["memory"]
        stored = ("-" if r["stored_nbytes_max"] is None else
                  f"{r['stored_nbytes_max'] / mib:.2f} ({r['stored_tokens_max']} tokens, "
                  f"{r['stored_per_layer_max']} per layer)")
        print(f"| {r['method']} | {r['budget'] or '-'} | {r['req_per_s']:.3f} | {r['p50_s']:.1f} | "
              f"{r['p95_s']:.1f} | {r['gen_tok_per_s']:.1f} | {mem['peak_rss_bytes'] / mib:.0f} | "
              f"{mem['mlx_peak_bytes'] / mib:.0f} | {stored} |")
    same = sum(a == b for a, b in zip(rows[0]["answers"], rows[-1]["answers"])) if len(rows) > 1 else None
    if same is not None:
        print(f"\nanswers equal between {rows[0]['method']} and {rows[-1]['method']}: "
              f"{same}/{len(reqs)}")
    print(f"prompts: {args.requests} of {lo}-{hi} words ({min(r['prompt_tokens'] for r in rows)} "
          f"prompt tokens in all), {args.max_tokens} max tokens; {platform.machine()}, "
          f"{os.cpu_count()} cpus, load {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

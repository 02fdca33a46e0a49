"""Coded prompt-cache files on SmolLM2: size, continuation loss, encode and decode speed.

SmolLM2-135M-Instruct (the embedded model; float32, or ``--dtype bfloat16`` cast) prefills the
first ``--prefill`` tokens (2,048) of a shipped text (``--text``, default ``pride``) into a
StreamingLLM cache whose window (4,096) holds every token, in forwards of ``--chunk`` tokens
(512). The caches are saved as they are (the reference file) and once a row with
``save_cache(path, caches, codec=..., codec_params=...)``; each file is loaded back with
``load_cache`` and continues the text.

Per row:

* the file's size on disk (every byte: arrays, side data, metadata, checksum), against the
  rows it holds (the keys and values of every layer) in float16 and in float32, and against
  the rows in their own dtype (the lossless figure);
* the continuation loss: the loaded caches read the next ``--score`` tokens (512) in one
  forward (teacher forcing); the perplexity of tokens ``prefill + 1`` to ``prefill + score``
  against the same forward on the reference file's caches, with a 95% block-bootstrap interval
  of the per-token NLL difference (blocks of ``--block`` tokens), top-1 agreement with the
  reference and the mean KL(reference || row);
* encode and decode speed: the rows' bytes (in their dtype) over the seconds ``save_cache``
  and ``load_cache`` take, wall-clock and CPU (process time: every thread), best of
  ``--repeat``.

``--windows K`` runs K prompts, the text's consecutive windows of ``prefill + score`` tokens,
and pools their bytes and scored tokens.

Rows are ``codec[:key=value,...]`` (``kvtc``, ``lossless``); ``rope_theta=model`` reads the
model's rotary base::

    python benchmarks/cache_file_codec.py --json docs/results/codecs/cache-files-smollm2.json \\
        --md docs/results/codecs/cache-files-smollm2.md
    python benchmarks/cache_file_codec.py --dtype bfloat16 --rows lossless
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

DEFAULT_ROWS = (
    "lossless",
    "kvtc:bit_budget=512", "kvtc:bit_budget=256", "kvtc:bit_budget=128",
    "kvtc:rope_theta=model",
    "kvtc:key_step=1.5,value_step=2.5,rope_theta=model",
    "kvtc:key_step=2.5,value_step=4,rope_theta=model",
    "kvtc:key_step=2,value_step=3.5",
)
MB = 1e6


def parse_row(text: str) -> tuple[str, dict[str, Any]]:
    """``"kvtc:key_step=2,rope_theta=model"`` -> ``("kvtc", {...})``."""
    from velox.adapters.cli import parse_param

    name, _, rest = text.strip().partition(":")
    params: dict[str, Any] = {}
    for item in rest.split(","):
        if item.strip():
            k, v = parse_param(item)
            params[k] = v
    return name.strip(), params


def continuation(model, caches: list, tokens: list[int], prefill: int, score: int) -> np.ndarray:
    """Log-probabilities ``[score, vocab]`` (float32) of the forward over tokens
    ``prefill .. prefill + score - 1`` on ``caches``."""
    logits = model(mx.array(tokens[prefill:prefill + score])[None], cache=caches)[0]
    logits = logits.astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return np.array(out)


def scores(logprobs: np.ndarray, targets: np.ndarray, ref: np.ndarray | None):
    nll = -logprobs[np.arange(len(targets)), targets].astype(np.float64)
    top = logprobs.argmax(axis=-1)
    if ref is None:
        return nll, top, np.zeros(len(targets))
    kl = (np.exp(ref.astype(np.float64)) * (ref.astype(np.float64) - logprobs)).sum(axis=-1)
    return nll, top, np.maximum(kl, 0.0)


def row_bytes(caches: list) -> tuple[int, int]:
    """(bytes of the keys and values in their dtype, their element count)."""
    size = count = 0
    for c in caches:
        st = c.velox_state
        for x in (st.keys, st.values):
            size += x.nbytes
            count += x.size
    return size, count


def timed(fn, repeat: int):
    best = None
    for _ in range(repeat):
        w, t = time.perf_counter(), time.process_time()
        out = fn()
        got = (time.perf_counter() - w, time.process_time() - t)
        best = got if best is None or got[0] < best[0] else best
    return out, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS))
    ap.add_argument("--text", default="pride")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--windows", type=int, default=1,
                    help="prompts: the text's first windows of prefill + score tokens, one after "
                         "another; the figures pool their tokens and bytes")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=1, help="timings: best of this many")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)

    from long_decode_quality import figures  # benchmarks/: the same intervals
    from velox.adapters.harness import _encode, load_text
    from velox.adapters.mlxlm import load_cache, make_cache, save_cache
    from velox.adapters.smollm2 import load_model

    model, tokenizer = load_model(None)
    if args.dtype != "float32":
        model.set_dtype(getattr(mx, args.dtype))
    text = _encode(tokenizer, load_text(args.text))
    span = args.prefill + args.score
    if len(text) < args.windows * span + 1:
        raise SystemExit(f"the text has {len(text)} tokens; {args.windows * span + 1} are needed")
    theta = float(model.args.rope_theta)
    traditional = bool(getattr(model.args, "rope_traditional", False))
    specs = [parse_row(r) for r in args.rows]
    for _, params in specs:
        if params.get("rope_theta") == "model":
            params["rope_theta"] = theta
            params.setdefault("rope_traditional", traditional)
    meta = {
        "command": " ".join(["python", "benchmarks/cache_file_codec.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "model": "SmolLM2-135M-Instruct (embedded)", "dtype": args.dtype,
        "cache": "streaming_llm window_size=4096 (every token held)",
        "text": args.text, "prefill": args.prefill, "score": args.score, "windows": args.windows,
        "block": args.block, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "threads": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")},
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    acc = [{"file_bytes": 0, "enc": [0.0, 0.0], "dec": [0.0, 0.0], "nll": [], "top": [], "kl": [],
            "same": True} for _ in specs]
    ref_nll, ref_top = [], []
    size = count = plain_bytes = 0
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(args.windows):
            tokens = text[w * span:(w + 1) * span + 1]
            targets = np.array(tokens[args.prefill + 1:])
            caches = make_cache(model, "streaming_llm", window_size=4096)
            t = time.perf_counter()
            for s in range(0, args.prefill, args.chunk):
                model(mx.array(tokens[s:min(s + args.chunk, args.prefill)])[None], cache=caches)
                mx.eval([c.state for c in caches])
            bytes_w, count_w = row_bytes(caches)
            size, count = size + bytes_w, count + count_w
            plain = Path(tmp) / "plain.safetensors"
            save_cache(plain, caches)
            plain_bytes += plain.stat().st_size
            loaded, _ = load_cache(plain, model)
            ref = continuation(model, loaded, tokens, args.prefill, args.score)
            nll, top, _ = scores(ref, targets, None)
            ref_nll.append(nll)
            ref_top.append(top)
            del loaded
            print(f"window {w}: tokens {w * span}-{(w + 1) * span}, prefilled in "
                  f"{time.perf_counter() - t:.0f} s, rows {bytes_w / MB:.1f} MB, reference ppl "
                  f"{math.exp(nll.mean()):.3f}", flush=True)
            for (name, params), a in zip(specs, acc):
                path = Path(tmp) / "coded.safetensors"
                _, enc = timed(lambda: save_cache(path, caches, codec=name, codec_params=params),
                               args.repeat)
                a["file_bytes"] += path.stat().st_size
                (loaded, _), dec = timed(lambda: load_cache(path, model), args.repeat)
                lp = continuation(model, loaded, tokens, args.prefill, args.score)
                nll, top, kl = scores(lp, targets, ref)
                a["same"] &= bool(np.array_equal(lp, ref))
                for k, v in (("nll", nll), ("top", top), ("kl", kl)):
                    a[k].append(v)
                a["enc"] = [a["enc"][0] + enc[0], a["enc"][1] + enc[1]]
                a["dec"] = [a["dec"][0] + dec[0], a["dec"][1] + dec[1]]
                del loaded
    meta.update({"rows_bytes": size, "rows_elements": count, "rows_float16_bytes": 2 * count,
                 "rows_float32_bytes": 4 * count, "reference_file_bytes": plain_bytes})
    ref_nll, ref_top = np.concatenate(ref_nll), np.concatenate(ref_top)
    out = []
    for spec, (name, params), a in zip(args.rows, specs, acc):
        fig = figures(np.concatenate(a["nll"]), np.concatenate(a["top"]), np.concatenate(a["kl"]),
                      ref_nll=ref_nll, ref_argmax=ref_top, block=args.block, reps=args.bootstrap)
        fb = a["file_bytes"]
        out.append({"row": spec, "codec": name, "params": params, "file_bytes": fb,
                    "x_float16": 2 * count / fb, "x_float32": 4 * count / fb, "x_own_dtype": size / fb,
                    "same_logits": a["same"], "figures": fig,
                    "encode_s": a["enc"][0], "encode_cpu_s": a["enc"][1],
                    "decode_s": a["dec"][0], "decode_cpu_s": a["dec"][1],
                    "encode_mb_s": size / MB / a["enc"][0], "encode_cpu_mb_s": size / MB / a["enc"][1],
                    "decode_mb_s": size / MB / a["dec"][0], "decode_cpu_mb_s": size / MB / a["dec"][1]})
    _write(args, meta, math.exp(ref_nll.mean()), out)
    print(_table(meta, math.exp(ref_nll.mean()), out), flush=True)
    return 0


def _table(meta: dict[str, Any], ref_ppl: float, rows: list[dict[str, Any]]) -> str:
    lines = [f"{meta['windows']} window(s) of {meta['prefill']} tokens of `{meta['text']}` in a "
             f"{meta['cache']}: rows {meta['rows_bytes'] / MB:.2f} MB in {meta['dtype']} "
             f"({meta['rows_float16_bytes'] / MB:.2f} MB in float16; the uncompressed files "
             f"{meta['reference_file_bytes'] / MB:.2f} MB). Continuation: the next {meta['score']} "
             f"tokens of each window read in one forward after loading; perplexity change against "
             f"the uncompressed file's caches (reference perplexity {ref_ppl:.3f}), 95% block "
             f"bootstrap (blocks of {meta['block']} tokens). Speeds: the rows' bytes over "
             f"save_cache / load_cache seconds, wall (CPU). {meta['machine']}, threads "
             f"{meta['threads']}, {meta['started']}.", "",
             "| row | file MB | x float16 | x float32 | x own dtype | ppl change [95%] | top-1 | KL "
             "| encode MB/s (cpu) | decode MB/s (cpu) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["figures"]
        lines.append(
            f"| `{r['row']}` | {r['file_bytes'] / MB:.3f} | {r['x_float16']:.2f} | {r['x_float32']:.2f} "
            f"| {r['x_own_dtype']:.2f} | {f['ppl_change_pct']:+.2f}% [{f['ppl_change_pct_lo']:+.2f}, "
            f"{f['ppl_change_pct_hi']:+.2f}]{' (same logits)' if r['same_logits'] else ''} "
            f"| {f['top1']:.3f} | {f['kl']:.4f} | {r['encode_mb_s']:.1f} ({r['encode_cpu_mb_s']:.1f}) "
            f"| {r['decode_mb_s']:.1f} ({r['decode_cpu_mb_s']:.1f}) |")
    return "\n".join(lines)


def _write(args, meta: dict[str, Any], ref_ppl: float, rows: list[dict[str, Any]]) -> None:
    meta = {**meta, "reference_ppl": ref_ppl}
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(f"# Coded prompt-cache files: {meta['model']}, {meta['dtype']}\n\n"
                                 f"`{meta['command']}`\n\n" + _table(meta, ref_ppl, rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())

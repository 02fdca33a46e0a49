"""How well each codebook tier holds SmolLM2's own rows: VecInfer and A²ATS on the long decode's
tokens, calibrated (the shipped fit), data-free (``codebook="prefill"``, fitted to the first
prefill chunk) and random.

SmolLM2-135M-Instruct (float32, CPU) reads the first ``--prefill + --score`` tokens (1,536 +
512) of ``--text`` (``pride``) in one forward; every layer's post-RoPE keys and values are
captured (``velox.adapters.calibration.capture_qkv``). Each tier's tables code them as its
cache would (the prefill tier fitted to the first ``--chunk`` tokens, 512: what the long decode's
first forward hands the cache), and the relative squared error ``sum |x - x_hat|^2 / sum |x|^2``
(all layers and kv heads pooled) is printed for three ranges of tokens: the fitted chunk, the
rest of the prompt, the decoded tokens. VecInfer: keys and values; A²ATS: the pre-RoPE keys
(Euclidean), and the calibrated ``H``-weighted error ``sum (x - x_hat)^T H (x - x_hat) /
sum x^T H x``, the score error its calibration minimises::

    python benchmarks/codebook_distortion.py --md docs/results/codecs/codebooks/distortion.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

from velox.codecs import a2ats as ac
from velox.codecs import vecinfer as vc

SMOLLM2_ROPE_BASE = 100000.0


def _ranges(prefill: int, chunk: int, total: int) -> list[tuple[str, slice]]:
    return [(f"fitted chunk 0-{chunk - 1}", slice(0, chunk)),
            (f"rest of the prompt {chunk}-{prefill - 1}", slice(chunk, prefill)),
            (f"decoded {prefill}-{total - 1}", slice(prefill, total))]


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    return float(err.sum() / ref.sum())


def vecinfer_rows(keys, values, layer_count, chunk, ranges, seed=0):
    """``{tier: {side: [relative error a range]}}`` for VecInfer's defaults."""
    out = {}
    for tier in ("smollm2-135m-instruct", "prefill", "random"):
        acc = {s: [[0.0, 0.0] for _ in ranges] for s in ("keys", "values")}
        for li in range(layer_count):
            for side, rows, fn in (("keys", keys[li], vc.key_tables), ("values", values[li], vc.value_tables)):
                h, d = rows.shape[1], rows.shape[2]
                sub, bits = (4, 12) if side == "keys" else (8, 8)
                t = fn(d, dict(sub_dim=sub, bits=bits, codebook=tier, seed=seed, kv_heads=h, layer=li))
                x = mx.array(np.ascontiguousarray(rows.transpose(1, 0, 2))[None])  # [1, h, t, d]
                if tier == "prefill":
                    t = vc.prefill_tables(t, x[:, :, :chunk], [seed, 0 if side == "keys" else 1])
                y = np.array(vc.decode(t, vc.encode(t, x)))[0]
                xx = np.array(x)[0]
                for i, (_, sl) in enumerate(ranges):
                    acc[side][i][0] += float(((y[:, sl] - xx[:, sl]) ** 2).sum())
                    acc[side][i][1] += float((xx[:, sl] ** 2).sum())
        out[tier] = {s: [e / r for e, r in v] for s, v in acc.items()}
    return out


def a2ats_rows(keys, layer_count, chunk, ranges, seed=0):
    """``{tier: {"euclidean" | "H": [relative error a range]}}`` for A²ATS's defaults."""
    cal, _ = ac.shipped_arrays("smollm2-135m-instruct")
    out = {}
    for tier in ("smollm2-135m-instruct", "prefill", "random"):
        acc = {s: [[0.0, 0.0] for _ in ranges] for s in ("euclidean", "H")}
        for li in range(layer_count):
            rows = keys[li]
            n, h, d = rows.shape
            t = ac.tables(d, dict(sub_dim=8, bits=8, codebook=tier, seed=seed, kv_heads=h, layer=li,
                                  b=2048, rope_base=SMOLLM2_ROPE_BASE))
            x = mx.array(np.ascontiguousarray(rows.transpose(1, 0, 2))[None])
            freqs = np.array(cal["freqs"][li][0])
            pre = mx.array(ac.rotate_np(np.array(x), -np.arange(n)[None, None], freqs))
            if tier == "prefill":
                t = ac.prefill_placeholder(t, 1, h)
                t = ac.prefill_tables(t, pre[:, :, :chunk], [seed, 2])
            y = np.array(ac.decode(t, ac.encode(t, pre)))[0]
            xx = np.array(pre)[0]
            hm = cal["metric"][li].astype(np.float64)             # [h, J, s, s]
            e = (y - xx).reshape(h, n, -1, 8).astype(np.float64)
            r = xx.reshape(h, n, -1, 8).astype(np.float64)
            eh = np.einsum("hnjs,hjsr,hnjr->hn", e, hm, e)
            rh = np.einsum("hnjs,hjsr,hnjr->hn", r, hm, r)
            for i, (_, sl) in enumerate(ranges):
                acc["euclidean"][i][0] += float((e[:, sl] ** 2).sum())
                acc["euclidean"][i][1] += float((r[:, sl] ** 2).sum())
                acc["H"][i][0] += float(eh[:, sl].sum())
                acc["H"][i][1] += float(rh[:, sl].sum())
        out[tier] = {s: [e / r for e, r in v] for s, v in acc.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="pride")
    ap.add_argument("--prefill", type=int, default=1536)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)

    from velox.adapters.calibration import capture_qkv
    from velox.adapters.harness import load_text
    from velox.adapters.smollm2 import load_default_model

    model, tokenizer = load_default_model()
    total = args.prefill + args.score
    tokens = tokenizer.encode(load_text(args.text))[:total]
    _, keys, values = capture_qkv(model, tokens)
    ranges = _ranges(args.prefill, args.chunk, total)
    layers = len(keys)
    vec = vecinfer_rows(keys, values, layers, args.chunk, ranges)
    a2 = a2ats_rows(keys, layers, args.chunk, ranges)
    names = {"smollm2-135m-instruct": "calibrated (shipped)", "prefill": "data-free (prefill)",
             "random": "random"}
    lines = ["# Codebook distortion on SmolLM2's own rows", "",
             "`python benchmarks/codebook_distortion.py" + "".join(" " + a for a in (argv or [])) + "`", "",
             f"Text `{args.text}`, tokens 0-{total - 1} in one forward, every layer's keys and "
             f"values; the data-free tier fitted to tokens 0-{args.chunk - 1}. Relative squared "
             "error (all layers and kv heads pooled): lower is better.", "",
             "| method | tier | rows | " + " | ".join(n for n, _ in ranges) + " |",
             "|---|---|---|" + "---|" * len(ranges)]
    for tier, sides in vec.items():
        for side, errs in sides.items():
            lines.append(f"| vecinfer | {names[tier]} | {side} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    for tier, sides in a2.items():
        for side, errs in sides.items():
            what = "pre-RoPE keys" if side == "euclidean" else "pre-RoPE keys, H-weighted"
            lines.append(f"| a2ats | {names[tier]} | {what} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

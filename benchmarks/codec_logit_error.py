"""Attention-logit error of TurboQuant's key codecs on SmolLM2's real keys and queries.

SmolLM2-135M-Instruct (float32, CPU) prefills ``--context`` tokens of a shipped text with
mlx-lm's plain ``KVCache``; each layer's post-RoPE keys and values are read from the caches and
its post-RoPE queries are recorded by ``velox.adapters.routing.query_capture``. For the layers
``--layers`` and key bits ``--bits``, the layer's keys are encoded with

* ``turboquant_mse`` at ``b`` bits (rotation + Gaussian Lloyd-Max per coordinate, a float16
  norm), scores read from the codes by the codec's ``scores``;
* ``turboquant_prod`` at ``b`` bits total (``turboquant_mse`` at ``b - 1`` bits plus a 1-bit QJL
  sketch of the residual with ``--jl-dim`` rows and a float16 residual norm), the codec's
  unbiased ``scores``;
* and, as a reference, mlx-lm-style per-token affine codes (``mx.quantize`` /
  ``mx.dequantize``, ``--group-size``, the keys cast to ``--affine-dtype`` first, so scales and
  biases are held in that dtype) at ``--affine-bits``, scored as ``q . dequantized key``.

Bytes per key are the code arrays' ``nbytes`` divided by the number of keys (the tables are
per layer, not per key). The last ``--queries`` queries attend causally to every key before
them; with ``s = 1/sqrt(head_dim)`` the exact logits are ``s q.k`` (float32) and the estimates
``s * scores``. Query head ``i`` reads kv head ``i // (n_heads / n_kv_heads)`` (mlx-lm's GQA).

Printed per codec and bits: the logit error ``est - exact`` pooled over heads, queries and keys
(mean = bias, std, max abs), the least-squares slope of ``est`` on ``exact`` (1 = no
shrinkage), then the softmax: total-variation distance and KL(exact || est) between the
attention weights, and the relative error ``||o_hat - o|| / ||o||`` of the attention output
``o = weights @ V`` (exact V), each averaged over heads and queries. For ``turboquant_prod`` the
predicted std ``s * sqrt(mean(((pi/2)|q|^2|r|^2 - <q,r>^2) / m))`` (its variance formula over
the sketch, ``r`` the residual of the MSE stage) is printed beside the measured one. Rows are
per layer, then averaged over the layers (max abs: the largest).

    python benchmarks/codec_logit_error.py [--context 2048] [--layers 0 7 15 22 29] [--bits 2 3 4]
        [--json docs/results/codecs/logit-error-smollm2.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np


def _capture(model, tokens: list[int]):
    """Per layer: (queries [1, H, n, d], keys [1, h, n, d], values [1, h, n, d]), post-RoPE."""
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.routing import query_capture

    caches = make_prompt_cache(model)
    x = mx.array(tokens)[None]
    body = getattr(model, "model", model)  # the hidden states suffice: no lm_head
    with query_capture() as taps:
        mx.eval(body(x, cache=caches))
    if len(taps) != len(caches):
        raise RuntimeError(f"captured {len(taps)} query sets for {len(caches)} layers")
    out = []
    for q, c in zip(taps, caches):
        k, v = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
        out.append((q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)))
    mx.eval(out)
    return out


def _grouped(q: mx.array, n_kv: int) -> mx.array:
    """Queries [1, H, m, d] -> [1, h, (H/h) m, d]: each kv head's query heads stacked."""
    _, H, m, d = q.shape
    return q.reshape(1, n_kv, (H // n_kv) * m, d)


def _ungrouped(s: mx.array, H: int) -> mx.array:
    """Scores [1, h, (H/h) m, n] -> [H, m, n]."""
    _, h, gm, n = s.shape
    return s.reshape(H, gm // (H // h), n)


def _softmax(logits: np.ndarray, valid: np.ndarray) -> np.ndarray:
    x = np.where(valid, logits, -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(axis=-1, keepdims=True)


def _metrics(exact: np.ndarray, est: np.ndarray, valid: np.ndarray, v: np.ndarray,
             kv_of: np.ndarray) -> dict:
    """exact, est: logits [H, m, n] (float64); valid [m, n]; v [h, n, d]; kv_of [H]."""
    e = (est - exact)[:, valid]
    x = exact[:, valid]
    y = est[:, valid]
    xc = x - x.mean()
    slope = float(np.sum(xc * (y - y.mean())) / np.sum(xc * xc))
    p, ph = _softmax(exact, valid), _softmax(est, valid)
    tv = 0.5 * np.abs(p - ph).sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = np.where(p > 0, p * (np.log(p) - np.log(ph)), 0.0).sum(axis=-1)
    vv = v[kv_of]                                  # [H, n, d]
    o = p @ vv
    oh = ph @ vv
    rel = np.linalg.norm(oh - o, axis=-1) / np.linalg.norm(o, axis=-1)
    return dict(err_mean=float(e.mean()), err_std=float(e.std()), err_maxabs=float(np.abs(e).max()),
                slope=slope, tv=float(tv.mean()), kl=float(kl.mean()), out_rel=float(rel.mean()))


def _codes_bytes(codes, n_keys: int) -> float:
    return sum(a.nbytes for a in codes) / n_keys


def _prod_predicted_std(codec_mod, tq, t, q: mx.array, k: mx.array, codes, valid: np.ndarray,
                        scale: float, H: int) -> float:
    """``s * sqrt(mean over valid pairs of ((pi/2)|q|^2|r|^2 - <q,r>^2) / m)``."""
    x_mse = tq.mse_decode(codec_mod._mse(t), tq.MseCodes(codes.idx, codes.norm))
    r = k - x_mse                                            # [1, h, n, d]
    qg = _grouped(q, k.shape[1])                             # [1, h, g m, d]
    qr = np.asarray(_ungrouped(qg @ r.swapaxes(-1, -2), H), np.float64)   # [H, m, n]
    q2 = np.asarray(_ungrouped(mx.sum(qg * qg, axis=-1, keepdims=True), H), np.float64)  # [H, m, 1]
    r2 = np.asarray(mx.sum(r * r, axis=-1), np.float64)[0]   # [h, n]
    kv_of = np.arange(H) // (H // k.shape[1])
    var = ((math.pi / 2) * q2 * r2[kv_of][:, None, :] - qr * qr) / t.jl_dim
    return float(scale * math.sqrt(var[:, valid].mean()))


def run_layer(q_all: mx.array, k: mx.array, v: mx.array, n_queries: int, bits: list[int],
              affine_bits: list[int], group_size: int, affine_dtype, jl_dim: int,
              seed: int) -> list[dict]:
    from velox.codecs import get_codec
    from velox.codecs import prod as prod_mod
    from velox.codecs import turboquant as tq

    _, H, n, d = q_all.shape
    h = k.shape[1]
    scale = d ** -0.5
    q = q_all[:, :, n - n_queries:, :]
    qg = _grouped(q, h)
    kv_of = np.arange(H) // (H // h)
    pos_q = np.arange(n - n_queries, n)
    valid = np.arange(n)[None, :] <= pos_q[:, None]          # causal [m, n]
    exact = np.asarray(_ungrouped(qg @ k.swapaxes(-1, -2), H), np.float64) * scale
    v_np = np.asarray(v[0], np.float64)
    rows = []

    def add(codec: str, b: int, est_scores: mx.array, nbytes: float, **extra):
        est = np.asarray(_ungrouped(est_scores, H), np.float64) * scale
        row = dict(codec=codec, bits=b, bytes_per_key=nbytes, **_metrics(exact, est, valid, v_np, kv_of))
        row.update(extra)
        rows.append(row)

    for b in bits:
        c = get_codec("turboquant_mse")
        t = c.tables(d, {"bits": b, "seed": seed})
        codes = c.encode(t, k)
        add("turboquant_mse", b, c.scores(t, qg, codes), _codes_bytes(codes, h * n))
        c = get_codec("turboquant_prod")
        t = c.tables(d, {"bits": b, "jl_dim": jl_dim, "seed": seed})
        codes = c.encode(t, k)
        pred = _prod_predicted_std(prod_mod, tq, t, q, k, codes, valid, scale, H)
        add("turboquant_prod", b, c.scores(t, qg, codes), _codes_bytes(codes, h * n),
            pred_std=pred, jl_dim=t.jl_dim)
    for b in affine_bits:
        w, s, z = mx.quantize(k.astype(affine_dtype), group_size=group_size, bits=b)
        kd = mx.dequantize(w, s, z, group_size=group_size, bits=b).astype(mx.float32)
        add(f"affine g{group_size}", b, qg @ kd.swapaxes(-1, -2), _codes_bytes((w, s, z), h * n))
    return rows


def _fmt_row(r: dict, lead: str) -> str:
    pred = f"{r['pred_std']:8.4f}" if r.get("pred_std") is not None else f"{'-':>8}"
    return (f"{lead}{r['codec']:16} {r['bits']:4d} {r['bytes_per_key']:6.1f} {r['err_mean']:+8.4f} "
            f"{r['err_std']:8.4f} {pred} {r['err_maxabs']:8.3f} {r['slope']:6.3f} {r['tv']:7.4f} "
            f"{r['kl']:8.5f} {r['out_rel']:8.4f}")


HEADER = (f"{'codec':16} {'bits':>4} {'B/key':>6} {'err mean':>8} {'err std':>8} {'pred std':>8} "
          f"{'max|err|':>8} {'slope':>6} {'TV':>7} {'KL':>8} {'out rel':>8}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="alice", help="shipped text (adapters/data): alice, holmes, pride")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--queries", type=int, default=64, help="last queries scored (causal)")
    ap.add_argument("--layers", type=int, nargs="*", default=[0, 7, 15, 22, 29],
                    help="layer indices (negative counts from the end); none: every layer")
    ap.add_argument("--bits", type=int, nargs="*", default=[2, 3, 4], help="key bits b (>= 2)")
    ap.add_argument("--jl-dim", type=int, default=0, help="turboquant_prod's sketch rows (0: codec default)")
    ap.add_argument("--seed", type=int, default=42, help="codec seed (rotation; sketch from seed + 1)")
    ap.add_argument("--affine-bits", type=int, nargs="*", default=[2, 3, 4, 8])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--affine-dtype", default="float16", choices=["float16", "float32"])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)

    from velox.adapters import harness
    from velox.adapters.smollm2 import load_default_model

    mx.set_default_device(mx.cpu)
    t0 = time.perf_counter()
    model, tokenizer = load_default_model()
    tokens = harness.text_tokens(tokenizer, harness.load_text(args.text), args.context)
    per_layer = _capture(model, tokens)
    n_layers = len(per_layer)
    layers = [ly % n_layers for ly in args.layers] if args.layers else list(range(n_layers))
    q0, k0, _ = per_layer[0]
    H, h, d = q0.shape[1], k0.shape[1], k0.shape[-1]
    print(f"SmolLM2-135M-Instruct float32 on {mx.default_device()}: text {args.text!r}, "
          f"{args.context} tokens, last {args.queries} queries, layers {layers} of {n_layers}, "
          f"{H} query heads / {h} kv heads, head_dim {d}, codec seed {args.seed}; "
          f"prefill + capture {time.perf_counter() - t0:.1f} s")
    print("logit = q.k/sqrt(d); err = est - exact pooled over heads, queries, keys; TV, KL(exact||est), "
          "out rel = ||o_hat - o||/||o|| averaged over heads and queries; B/key = code nbytes per key")
    affine_dtype = getattr(mx, args.affine_dtype)
    results = []
    print(f"\nper layer\n{'layer':>5} {'logit std':>9} " + HEADER)
    for ly in layers:
        q, k, v = per_layer[ly]
        rows = run_layer(q, k, v, args.queries, args.bits, args.affine_bits, args.group_size,
                         affine_dtype, args.jl_dim, args.seed)
        n = k.shape[2]
        qq = q[:, :, n - args.queries:, :]
        ex = np.asarray(_ungrouped(_grouped(qq, h) @ k.swapaxes(-1, -2), H), np.float64) * d ** -0.5
        valid = np.arange(n)[None, :] <= np.arange(n - args.queries, n)[:, None]
        lstd = float(ex[:, valid].std())
        for r in rows:
            r.update(layer=ly, logit_std=lstd)
            print(_fmt_row(r, f"{ly:5d} {lstd:9.3f} "))
        results.extend(rows)

    keys = []
    for r in results:
        if (r["codec"], r["bits"]) not in keys:
            keys.append((r["codec"], r["bits"]))
    overall = []
    for codec, b in keys:
        rs = [r for r in results if r["codec"] == codec and r["bits"] == b]
        o = dict(codec=codec, bits=b)
        for f in ("bytes_per_key", "err_mean", "err_std", "slope", "tv", "kl", "out_rel"):
            o[f] = float(np.mean([r[f] for r in rs]))
        o["err_maxabs"] = max(r["err_maxabs"] for r in rs)
        o["pred_std"] = float(np.mean([r["pred_std"] for r in rs])) if "pred_std" in rs[0] else None
        overall.append(o)
    print(f"\noverall (mean over layers {layers}; max|err| the largest)\n" + HEADER)
    for o in overall:
        print(_fmt_row(o, ""))
    print("\nprod / mse at equal bits (overall)")
    print(f"{'bits':>4} {'B/key prod/mse':>15} {'err std':>8} {'TV':>7} {'KL':>7} {'out rel':>8}")
    by = {(o["codec"], o["bits"]): o for o in overall}
    ratios = []
    for b in args.bits:
        p, m = by[("turboquant_prod", b)], by[("turboquant_mse", b)]
        rr = dict(bits=b, **{f: p[f] / m[f] for f in ("bytes_per_key", "err_std", "tv", "kl", "out_rel")})
        ratios.append(rr)
        print(f"{b:4d} {p['bytes_per_key']:6.1f}/{m['bytes_per_key']:<6.1f}  {rr['err_std']:8.2f} "
              f"{rr['tv']:7.2f} {rr['kl']:7.2f} {rr['out_rel']:8.2f}")
    print(f"\ntotal {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model="SmolLM2-135M-Instruct", dtype="float32", device=str(mx.default_device()),
                           text=args.text, context=args.context, queries=args.queries, layers=layers,
                           bits=args.bits, jl_dim=args.jl_dim, seed=args.seed,
                           affine_bits=args.affine_bits, group_size=args.group_size,
                           affine_dtype=args.affine_dtype, q_heads=H, kv_heads=h, head_dim=d,
                           per_layer=results, overall=overall, prod_over_mse=ratios), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

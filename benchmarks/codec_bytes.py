"""Bytes per token of the codec-key caches, beside fp16 and KIVI at the same bits.

Each method absorbs ``--tokens`` tokens (one prefill chunk) at each ``head_dim`` of ``--dim``
(default 128) in float16; the state's bytes (``velox.nbytes``) less its fixed bytes (the static
tables and, with outlier channels, each kv head's channel order ``key_channels``: per layer, not
per token; shown apart) give bits per token and head, keys and values together, and the key bits
per coordinate (codes and norms only). Rows: every method at its defaults, then the setting of
its parameters whose key bits per coordinate come closest to 2.5 and to 3.5 from below (integer
bit widths, sketch sizes in multiples of 32, no outlier channels), then for the methods with
outlier channels (``n_outlier``) the paper's fractional settings, then fp16 and KIVI at 2, 3 and
4 bits.

The paper's settings (TurboQuant, arXiv 2504.19874, its KV-cache experiments) split each key's
channels into outlier channels at one bit more and the rest: "2.5" is ``n_outlier`` channels at
3 bits and the rest at 2, "3.5" the outliers at 4 bits and the rest at 3; 32 outlier channels at
head_dim 128 (index bits (32 * 3 + 96 * 2) / 128 = 2.25 a channel, and 3.25; TurboQuant_mse's
two float16 norms add 0.25) and at head_dim 64 (SmolLM2: (32 * 3 + 32 * 2) / 64 = 2.5, and 3.5;
the norms add 0.5), a quarter of the channels at other head_dims. ``bits`` is each method's own:
TurboQuant_prod's total (the MSE stage at bits - 1 plus the sketch, ``jl_dim`` 0: each part's
default sketch), TurboQuant RVQ's bits per stage.

    python benchmarks/codec_bytes.py [--tokens 4096] [--dim 128 [64 ...]]
"""

from __future__ import annotations

import argparse
import itertools

import velox  # first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core (velox._blas)
import mlx.core as mx
import numpy as np

from velox import codec_cache
from velox.registry import get_method, method_keys

TARGETS = (2.5, 3.5)
#: The paper's fractional settings: label -> (bits, outlier_bits).
PAPER = {"2.5": (2, 3), "3.5": (3, 4)}
#: Outlier channels at each head_dim (the paper's 32 at 128; 32 at SmolLM2's 64).
OUTLIERS = {128: 32, 64: 32}


def n_outliers(dim: int) -> int:
    return OUTLIERS.get(dim, dim // 4)


def codec_methods() -> list[str]:
    return [k for k in method_keys() if get_method(k).state_type.__module__.startswith("velox.methods")
            and "key_codes" in get_method(k).state_type._fields
            and "tables" in get_method(k).state_type._fields]


def _grid(key: str, d: int) -> list[dict]:
    """Settings tried for the 2.5 / 3.5 rows."""
    spec = get_method(key).spec
    axes = {}
    for name, p in spec.params.items():
        if name in ("bits", "level1_bits"):
            axes[name] = range(int(p.min or 1), min(int(p.max or 8), 6) + 1)
        elif name == "jl_dim":
            axes[name] = [0] + [32 * i for i in range(1, 4 * d // 32 + 1)]
    names = sorted(axes)
    return [dict(zip(names, combo)) for combo in itertools.product(*(axes[n] for n in names))]


def measure(key: str, params: dict, k: mx.array, v: mx.array) -> dict:
    m = get_method(key)
    b, h, n, d = k.shape
    st = m.update(m.init(b, h, d, dtype=k.dtype, **params), k, v)
    mx.eval(st)
    total = velox.nbytes(st)
    tables = velox.state_nbytes(st.tables) if "tables" in st._fields else 0
    if "key_channels" in st._fields:  # the outlier channel order: per kv head, not per token
        tables += st.key_channels.nbytes
    key_bytes = velox.state_nbytes(st.key_codes) if "tables" in st._fields else None
    # a codec cache holds its rows in chunks (velox.codec_cache): its bytes a row, empty rows too
    rows = codec_cache.capacity(st) if codec_cache.is_chunked(st) else n
    per_token = (total - tables) * 8 / (b * h * rows)
    out = {"method": key, "params": params, "bits_per_token": per_token, "tables_bytes": tables}
    out["key_bits_per_coord"] = None if key_bytes is None else key_bytes * 8 / (b * h * rows * d)
    return out


def rows(tokens: int, dim: int) -> list[dict]:
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 2, tokens, dim)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((1, 2, tokens, dim)).astype(np.float32)).astype(mx.float16)
    out = []
    for key in codec_methods():
        spec = get_method(key).spec
        # a default kept out of tests (a codebook shipped for the embedded model only) takes its
        # test choice: the same arrays, so the same bytes
        stand_in = {n: p.test_choices[0] for n, p in spec.params.items()
                    if p.test_choices and p.default not in p.test_choices}
        out.append({**measure(key, stand_in, k, v), "params": {}, "setting": "defaults"})
        tried = []
        for params in _grid(key, dim):
            try:
                tried.append(measure(key, params, k[:, :, :64], v[:, :, :64]))
            except ValueError:
                continue
        for target in TARGETS:
            fit = [r for r in tried if r["key_bits_per_coord"] <= target + 1e-9]
            if fit:
                best = max(fit, key=lambda r: r["key_bits_per_coord"])
                out.append({**measure(key, best["params"], k, v), "setting": f"<= {target}"})
        if "n_outlier" in get_method(key).spec.params and n_outliers(dim) >= 1:
            n_out = n_outliers(dim)
            for label, (bits, outlier_bits) in PAPER.items():
                params = {"bits": bits, "n_outlier": n_out, "outlier_bits": outlier_bits}
                setting = (f"paper {label}: {n_out} at {outlier_bits} bits, "
                           f"{dim - n_out} at {bits}")
                out.append({**measure(key, params, k, v), "setting": setting})
    out.append({"method": "fp16", "params": {}, "setting": "", "bits_per_token": 2 * 16 * dim,
                "key_bits_per_coord": 16.0, "tables_bytes": 0})
    for bits in (2, 3, 4):
        r = measure("kivi", {"bits": bits, "residual_length": 0}, k, v)
        out.append({**r, "setting": f"bits={bits}, no residual window"})
    return out


def table(rs: list[dict], dim: int) -> str:
    lines = [f"| method | setting | params | key bits/coord | bits/token (K+V) | vs fp16 | fixed (bytes) |",
             "|---|---|---|---|---|---|---|"]
    fp16 = 2 * 16 * dim
    for r in rs:
        kb = "-" if r["key_bits_per_coord"] is None else f"{r['key_bits_per_coord']:.3f}"
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items()) or "-"
        lines.append(f"| {r['method']} | {r['setting'] or '-'} | {params} | {kb} | "
                     f"{r['bits_per_token']:.1f} | {fp16 / r['bits_per_token']:.2f}x | {r['tables_bytes']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, nargs="+", default=[128])
    args = ap.parse_args(argv)
    for i, dim in enumerate(args.dim):
        if len(args.dim) > 1:
            print(("\n" if i else "") + f"## head_dim {dim}\n")
        print(table(rows(args.tokens, dim), dim))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

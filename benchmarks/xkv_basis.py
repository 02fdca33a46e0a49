"""What one key basis shared by a group of layers costs each layer: xKV's fit on SmolLM2.

The embedded SmolLM2-135M-Instruct (float32, CPU) prefills the opening ``--tokens`` tokens of a
shipped text (``--text``, default ``pride``) into mlx-lm's plain caches, in forwards of
``--chunk`` tokens. Each layer's keys of the first ``--fit`` tokens are what xKV fits on (its
first prefill chunk); the tokens after them are held out. For each group size (``--groups``),
per layer and kv head, with ``velox.methods.xkv``'s own fit (``key_stats`` and ``fit``: the
scatter of each layer's keys centred on its own mean, summed over the group):

* ``rank``: the energy rank at ``--threshold`` of the keys the basis is fitted on (the group's
  stacked keys), before xKV rounds it up to whole latent groups;
* ``held@r``: the share of the held-out keys' energy (centred on the layer's own fitted mean)
  that the basis's first ``r`` columns hold, for each ``r`` of ``--ranks``; group size 1 is
  the layer's own basis, the best ``r`` columns there are for its fitted keys.

Output: the means (and minima) over layers and kv heads (``--md``), every figure as JSON
(``--json``)::

    python benchmarks/xkv_basis.py --json docs/results/crosslayer/xkv-basis.json \\
        --md docs/results/crosslayer/xkv-basis.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

from velox.methods import xkv


def group_bases(keys: list[np.ndarray], group_size: int, rank: int, threshold: float,
                quant_group: int = 1) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """xKV's fit of every layer of ``keys`` (``[h, n, d]`` float32 each) in groups of
    ``group_size`` layers: ``(bases [h, d, w], means [h, d], ranks [h])`` per layer, the
    layers of a group holding the same basis; ``ranks`` the energy ranks of the group's
    stacked keys at ``threshold`` (``rank=0``, ``quant_group=1``: the width is the rank)."""
    bases, means, ranks = [], [], []
    for start in range(0, len(keys), group_size):
        members = keys[start:start + group_size]
        stats = [xkv.key_stats(mx.array(k[None])) for k in members]
        scatter = sum(s[1] for s in stats)
        count = sum(s[2] for s in stats)
        basis = xkv.fit(scatter, count, rank=rank, energy_threshold=threshold,
                        group_quant_size=quant_group)
        energy = xkv.fit(scatter, count, rank=0, energy_threshold=threshold, group_quant_size=1)
        widths = (np.abs(np.array(energy)[0]).max(axis=-2) > 0).sum(axis=-1)
        for mean, _, _ in stats:
            bases.append(np.array(basis)[0])
            means.append(np.array(mean)[0])
            ranks.append(widths)
    return bases, means, ranks


def held_energy(rows: np.ndarray, mean: np.ndarray, basis: np.ndarray, r: int) -> np.ndarray:
    """Per head, the share of the energy of ``rows [h, n, d]`` centred on ``mean [h, d]`` that
    the first ``r`` columns of ``basis [h, d, w]`` hold."""
    xc = rows.astype(np.float64) - mean[:, None, :]
    proj = xc @ basis[:, :, :r].astype(np.float64)
    return (proj ** 2).sum(axis=(1, 2)) / np.maximum((xc ** 2).sum(axis=(1, 2)), 1e-300)


def figures(keys: list[np.ndarray], fit: int, group_sizes: list[int], ranks: list[int],
            threshold: float) -> dict:
    """Every figure of the module docstring: ``{str(group_size): {"rank": [L, h],
    "held@r": [L, h], ...}}``, the basis fitted on each layer's first ``fit`` tokens and the
    held-out energy measured on the rest."""
    d = keys[0].shape[-1]
    fitted = [k[:, :fit] for k in keys]
    held = [k[:, fit:] for k in keys]
    out = {}
    for g in group_sizes:
        bases, means, energy_ranks = group_bases(fitted, g, d, threshold)
        row = {"rank": np.stack(energy_ranks).tolist()}
        for r in ranks:
            row[f"held@{r}"] = np.stack([held_energy(h, m, b, r)
                                         for h, m, b in zip(held, means, bases)]).tolist()
        out[str(g)] = row
    return out


def table(figs: dict, ranks: list[int]) -> list[str]:
    head = "| group size | energy rank, mean (max) | " + " | ".join(
        f"held-out energy at r={r}, mean (min)" for r in ranks) + " |"
    lines = [head, "|" + "---|" * (2 + len(ranks))]
    for g, row in figs.items():
        rk = np.array(row["rank"])
        cells = [f"{rk.mean():.1f} ({rk.max()})"]
        for r in ranks:
            e = np.array(row[f"held@{r}"])
            cells.append(f"{e.mean():.3f} ({e.min():.3f})")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default="pride", help="a shipped text (default pride)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward")
    ap.add_argument("--fit", type=int, default=512, help="tokens the basis is fitted on")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 48])
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    if not 0 < args.fit < args.tokens:
        raise SystemExit(f"--fit must be between 1 and --tokens - 1, got {args.fit}")

    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters.harness import _encode, load_text
    from velox.adapters.smollm2 import load_model

    model, tokenizer = load_model(None)
    tokens = _encode(tokenizer, load_text(args.text))[:args.tokens]
    if len(tokens) < args.tokens:
        raise SystemExit(f"the text {args.text!r} has {len(tokens)} tokens; {args.tokens} are needed")
    caches = make_prompt_cache(model)
    t = time.perf_counter()
    for i in range(0, args.tokens, args.chunk):
        model(mx.array(tokens[i:i + args.chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    keys = [np.array(c.state[0][0, :, :args.tokens].astype(mx.float32)) for c in caches]
    figs = figures(keys, args.fit, args.groups, args.ranks, args.threshold)
    command = " ".join(["python", "benchmarks/xkv_basis.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"command": command, "model": "SmolLM2-135M-Instruct (embedded)", "text": args.text,
            "tokens": args.tokens, "chunk": args.chunk, "fit": args.fit, "threshold": args.threshold,
            "layers": len(keys), "kv_heads": int(keys[0].shape[0]), "head_dim": int(keys[0].shape[-1]),
            "versions": {"mlx": mx.__version__, "python": platform.python_version()},
            "seconds": round(time.perf_counter() - t, 1)}
    lines = table(figs, args.ranks)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "figures": figs}, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text("\n".join([
            "# xKV's shared key basis on SmolLM2-135M-Instruct (embedded)", "",
            f"`{command}`", "",
            f"Text `{args.text}`: tokens 0-{args.tokens - 1} prefilled in forwards of {args.chunk} "
            f"into mlx-lm's plain caches ({len(keys)} layers, {meta['kv_heads']} kv heads of "
            f"{meta['head_dim']}); each layer's basis fitted on its keys of tokens 0-{args.fit - 1} "
            f"by `velox.methods.xkv` (each layer centred on its own mean, the scatter summed over "
            f"the group), the held-out energy measured on tokens {args.fit}-{args.tokens - 1} "
            f"(keys after RoPE). Energy rank at {args.threshold} of the keys fitted on; means and "
            "extremes over layers and kv heads. Float32, CPU; MLX "
            f"{mx.__version__}.", "", *lines, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How alike are the KV caches of adjacent layers? The premise of the cross-layer methods.

The embedded SmolLM2-135M-Instruct (float32, CPU; ``--model``: another mlx-lm model folder)
prefills the opening ``--tokens`` tokens of a shipped text (``--text``, default ``holmes``) into
mlx-lm's plain caches, in forwards of ``--chunk`` tokens; then, for every pair of adjacent
layers ``(l, l + 1)``, it reads the keys and values each layer cached and reports:

* ``cos``: the mean over tokens and kv heads of the cosine between the two layers' vectors of
  the same token and head (keys after RoPE: both layers rotate a position alike, so the cosine
  is that of the unrotated vectors); ``>= 0.9``: the share of (token, head) pairs at or above
  MiniCache's default retention threshold, which MiniCache would merge (the rest it keeps).
* ``codes``: the share of equal 2-bit codes when both layers are quantized KIVI's way (keys
  per channel in groups of 32 tokens, values per token in groups of 32 channels, min/max):
  XQuant's premise, that a layer can dequantize its neighbour's codes with its own scales;
  ``chance``: the share two independent codes of the layers' own code frequencies would agree
  (``sum_c p_l(c) p_{l+1}(c)``; uniform codes: 1/4).
* ``cka`` and ``subspace``: xKV's premise, that the dominant singular vectors align across
  layers even where per-token cosines are low. Per layer, the ``[tokens, kv_heads * head_dim]``
  matrix (keys, or values): linear CKA of the two layers' centred matrices, and the alignment
  ``||U_l^T U_{l+1}||_F^2 / r`` of their top-``--rank`` left singular vectors (the token-space
  subspaces xKV's shared basis spans; 1 = the same subspace, a random pair of ``r``-dimensional
  subspaces of ``tokens`` dimensions scores about ``r / tokens``) and of their right singular
  vectors (channel space; random: about ``r / channels``).

Output: a table per pair (``--md``), the same figures as JSON (``--json``)::

    python benchmarks/adjacent_layers.py --json docs/results/crosslayer/adjacent-layers.json \\
        --md docs/results/crosslayer/adjacent-layers.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import velox  # noqa: F401  first: it loads OpenBLAS for MLX's CPU matmuls, before mlx.core
import mlx.core as mx
import numpy as np

BITS, GROUP = 2, 32  # XQuant's anchor quantization (KIVI's 2-bit grouping)
MERGE_COS = 0.9      # MiniCache's default retention threshold


# --- pure figures (NumPy, one layer pair at a time) ------------------------------------

def token_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of ``a[..., i, :]`` and ``b[..., i, :]`` for every leading index (0 where a vector
    is zero)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    dot = (a * b).sum(axis=-1)
    return np.where((na > 0) & (nb > 0), dot / np.maximum(na * nb, 1e-300), 0.0)


def group_codes(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Min/max codes of ``x`` in groups of ``group`` along its last axis (a group of equal
    values codes as 0)."""
    lead, m = x.shape[:-1], x.shape[-1]
    g = x.astype(np.float64).reshape(*lead, m // group, group)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    scale = (hi - lo) / ((1 << bits) - 1)
    q = np.round((g - lo) / np.where(scale > 0, scale, 1.0))
    return np.where(scale > 0, q, 0).astype(np.int64).reshape(*lead, m)


def kivi_codes(keys: np.ndarray, values: np.ndarray, bits: int = BITS,
               group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """KIVI's codes of ``[h, n, d]`` keys (per channel, groups of tokens) and values (per token,
    groups of channels), over the first whole groups of tokens."""
    n = keys.shape[1] // group * group
    k = group_codes(np.swapaxes(keys[:, :n], 1, 2), bits, group)
    v = group_codes(values[:, :n], bits, group)
    return k, v


def chance_agreement(a: np.ndarray, b: np.ndarray, levels: int) -> float:
    """The share of equal codes two independent draws from ``a``'s and ``b``'s code
    frequencies would give: ``sum_c p_a(c) p_b(c)``."""
    pa = np.bincount(a.ravel(), minlength=levels) / a.size
    pb = np.bincount(b.ravel(), minlength=levels) / b.size
    return float(pa @ pb)


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA of two ``[n, features]`` matrices (columns centred)."""
    x = x.astype(np.float64) - x.mean(axis=0)
    y = y.astype(np.float64) - y.mean(axis=0)
    cross = np.linalg.norm(y.T @ x) ** 2
    return float(cross / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def subspace_alignment(u: np.ndarray, w: np.ndarray) -> float:
    """``||u^T w||_F^2 / r`` for two orthonormal bases ``[dim, r]``: the mean squared cosine of
    their principal angles (1: the same subspace)."""
    return float(np.linalg.norm(u.T @ w) ** 2 / u.shape[1])


def top_vectors(x: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-``r`` left (``[n, r]``) and right (``[features, r]``) singular vectors of ``x``."""
    u, _, vt = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    return u[:, :r], vt[:r].T


def pair_figures(ka: np.ndarray, va: np.ndarray, kb: np.ndarray, vb: np.ndarray,
                 rank: int) -> dict[str, float]:
    """Every figure of one adjacent pair from the two layers' ``[h, n, d]`` keys and values."""
    out: dict[str, float] = {}
    codes_a, codes_b = kivi_codes(ka, va), kivi_codes(kb, vb)
    for name, a, b, ca, cb in (("keys", ka, kb, codes_a[0], codes_b[0]),
                               ("values", va, vb, codes_a[1], codes_b[1])):
        cos = token_cosines(a, b)
        out[f"{name}_cos"] = float(cos.mean())
        out[f"{name}_merged"] = float((cos >= MERGE_COS).mean())
        out[f"{name}_codes"] = float((ca == cb).mean())
        out[f"{name}_chance"] = chance_agreement(ca, cb, 1 << BITS)
        fa = np.swapaxes(a, 0, 1).reshape(a.shape[1], -1)  # [n, h * d]
        fb = np.swapaxes(b, 0, 1).reshape(b.shape[1], -1)
        out[f"{name}_cka"] = linear_cka(fa, fb)
        (ua, ra), (ub, rb) = top_vectors(fa, rank), top_vectors(fb, rank)
        out[f"{name}_tokens"] = subspace_alignment(ua, ub)
        out[f"{name}_channels"] = subspace_alignment(ra, rb)
    return out


# --- the model run ---------------------------------------------------------------------

def layer_caches(model, tokens: list[int], chunk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's cached ``(keys, values)`` ``[kv_heads, n, head_dim]`` after a prefill of
    ``tokens`` in forwards of ``chunk``."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    ids = mx.array(tokens)
    for i in range(0, len(tokens), chunk):
        model.model(ids[None, i:i + chunk], cache=caches)  # the layers only: no LM head
        mx.eval([c.state for c in caches])
    n = len(tokens)
    out = []
    for c in caches:
        k, v = c.state[0][0, :, :n], c.state[1][0, :, :n]
        out.append((np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))))
    return out


def summary(rows: list[dict[str, Any]], layers: int) -> dict[str, dict[str, float]]:
    """Each figure's mean over all pairs and over the pairs MiniCache merges by default (both
    layers at or above half the depth)."""
    deep = [r for r in rows if r["layer"] >= layers // 2]
    keys = [k for k in rows[0] if k != "layer"]
    return {"all pairs": {k: float(np.mean([r[k] for r in rows])) for k in keys},
            "pairs from half depth": {k: float(np.mean([r[k] for r in deep])) for k in keys}}


COLUMNS = (("keys_cos", "K cos"), ("keys_merged", "K >= 0.9"), ("values_cos", "V cos"),
           ("values_merged", "V >= 0.9"), ("keys_codes", "K codes"), ("keys_chance", "K chance"),
           ("values_codes", "V codes"), ("values_chance", "V chance"),
           ("keys_cka", "K CKA"), ("values_cka", "V CKA"), ("keys_tokens", "K tok sub"),
           ("values_tokens", "V tok sub"), ("keys_channels", "K ch sub"),
           ("values_channels", "V ch sub"))


def table(rows: list[dict[str, Any]], means: dict[str, dict[str, float]]) -> list[str]:
    head = "| layers | " + " | ".join(t for _, t in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for r in rows:
        lines.append(f"| {r['layer']}-{r['layer'] + 1} | "
                     + " | ".join(f"{r[k]:.3f}" for k, _ in COLUMNS) + " |")
    for name, m in means.items():
        lines.append(f"| **{name}** | " + " | ".join(f"{m[k]:.3f}" for k, _ in COLUMNS) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default="holmes", help="a shipped text (alice, holmes, pride)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward")
    ap.add_argument("--rank", type=int, default=16, help="singular vectors compared per layer")
    ap.add_argument("--model", help="an mlx-lm model folder (default: the embedded SmolLM2)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)

    from velox.adapters.harness import load_text, text_tokens
    from velox.adapters.smollm2 import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    tokens = text_tokens(tokenizer, load_text(args.text), args.tokens)
    kv = layer_caches(model, tokens, args.chunk)
    rows = [{"layer": i, **pair_figures(*kv[i], *kv[i + 1], args.rank)} for i in range(len(kv) - 1)]
    means = summary(rows, len(kv))
    h, n, d = kv[0][0].shape
    name = args.model or "SmolLM2-135M-Instruct (embedded, float32)"
    setup = {"model": name, "text": args.text,
             "tokens": n, "chunk": args.chunk, "layers": len(kv), "kv_heads": h, "head_dim": d,
             "rank": args.rank, "random_token_subspace": args.rank / n,
             "random_channel_subspace": args.rank / (h * d), "bits": BITS, "group": GROUP,
             "merge_cos": MERGE_COS, "mlx": mx.__version__, "machine": platform.machine(),
             "seconds": round(time.perf_counter() - t0, 1)}
    lines = [
        f"# Adjacent layers of {name}: {n} tokens of `{args.text}`", "",
        f"`python benchmarks/adjacent_layers.py --text {args.text} --tokens {args.tokens} "
        f"--chunk {args.chunk} --rank {args.rank}`", "",
        f"{len(kv)} layers, {h} kv heads of {d}; mlx-lm's plain caches after a prefill in forwards "
        f"of {args.chunk}. K/V cos: mean per-token cosine of the pair's vectors (token, head); "
        f">= {MERGE_COS}: share of (token, head) pairs MiniCache merges at its default threshold; "
        f"codes: share of equal {BITS}-bit KIVI codes (groups of {GROUP}); chance: the share "
        f"independent codes of the same frequencies would give; CKA: linear CKA of the "
        f"`[tokens, heads x dim]` matrices; tok sub / ch sub: "
        f"alignment of the top-{args.rank} left (token) / right (channel) singular subspaces "
        f"(random: {args.rank / n:.3f} / {args.rank / (h * d):.3f}).", "",
        *table(rows, means), ""]
    text = "\n".join(lines)
    print(text)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"setup": setup, "pairs": rows, "means": means}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bytes a token of the codec caches holds, keys and values apart, for a few key and value
settings (``bits``, ``value_codec``, ``value_bits``): measured from the arrays of a state that
holds ``--tokens`` tokens (a multiple of the 256-row chunk, so no empty row is counted), and
what a state holds once besides (its tables: rotations, codebooks, sketches; its counters).
A method without ``bits`` (QJL) runs every row at its own key setting.

    python scripts/value_bytes.py [--head-dim 64] [--tokens 1024] [--method turboquant_mse]

Prints a Markdown table (docs/codecs.md, "Value codecs", quotes it at head_dim 64).
"""

from __future__ import annotations

import argparse

import velox  # noqa: F401  (first: the BLAS it loads)
import mlx.core as mx

from velox import codec_cache

#: (bits, value_codec, value_bits): the keys' bits, then the values' codec and bits.
SETTINGS = [(2, "affine", 8), (4, "affine", 8), (4, "affine", 4), (4, "mse", 4), (4, "mse", 2),
            (3, "mse", 3), (2, "mse", 2), (8, "mse", 4), (4, "exact", 8)]


def measure(method: str, bits: int, value_codec: str, value_bits: int, head_dim: int,
            tokens: int) -> dict:
    key_bits = {"bits": bits} if "bits" in velox.get_method(method).spec.params else {}
    s = velox.init(method, 1, 1, head_dim, dtype=mx.float16, value_codec=value_codec,
                   value_bits=value_bits, **key_bits)
    x = mx.random.normal((1, 1, tokens, head_dim)).astype(mx.float16)
    s = velox.update(s, x, x)
    assert codec_cache.capacity(s) == tokens, "tokens must fill whole chunks"
    keys = sum(a.nbytes for a in s.key_codes) / tokens
    values = sum(a.nbytes for a in s.value_codes) / tokens
    rest = velox.nbytes(s) - (keys + values) * tokens
    return dict(keys=keys, values=values, other=int(rest),
                bits_per_element=8 * (keys + values) / (2 * head_dim))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--method", default="turboquant_mse")
    a = ap.parse_args()
    print(f"{a.method}, head_dim {a.head_dim}, {a.tokens} tokens (float16 cache)\n")
    print("| bits | value_codec | value_bits | key B/token | value B/token | bits/element (k+v) "
          "| other B/state |")
    print("|---|---|---|---|---|---|---|")
    for bits, codec, vbits in SETTINGS:
        m = measure(a.method, bits, codec, vbits, a.head_dim, a.tokens)
        shown = "-" if codec == "exact" else vbits
        print(f"| {bits} | {codec} | {shown} | {m['keys']:g} | {m['values']:g} "
              f"| {m['bits_per_element']:.3g} | {m['other']} |")


if __name__ == "__main__":
    main()

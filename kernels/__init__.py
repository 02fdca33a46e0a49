"""The GPU kernels of the ``cuda`` and ``metal`` backends (one source each, rendered for
``mx.fast.cuda_kernel`` or ``mx.fast.metal_kernel`` by ``velox.kernels.dialect``) and what
builds them."""

from __future__ import annotations

import re

_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def compact(source: str) -> str:
    """``source`` (CUDA C++) without its comments, indentation and blank lines: the same
    program in fewer characters. MLX copies and hashes a kernel's whole source at every
    launch (about 0.3 us per kilobyte on an H200's host), so a launch of a compacted source
    costs the host less. Preprocessor lines stay lines of their own; string literals are
    kept as they are (a ``//`` inside one does not start a comment)."""
    source = _BLOCK_COMMENT.sub(" ", source)
    out = []
    for line in source.splitlines():
        cut, quoted = len(line), False
        for i, ch in enumerate(line):
            if ch == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif not quoted and line.startswith("//", i):
                cut = i
                break
        line = line[:cut].strip()
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


def build(spec: dict, dialect: str = "cuda"):
    """``mx.fast.cuda_kernel`` (``dialect="metal"``: ``mx.fast.metal_kernel``) of ``spec``
    (its keyword arguments, rendered in that dialect), source and header compacted
    (:func:`compact`)."""
    import mlx.core as mx
    make = {"cuda": lambda: mx.fast.cuda_kernel, "metal": lambda: mx.fast.metal_kernel}[dialect]()
    return make(**{**spec, "source": compact(spec["source"]), "header": compact(spec.get("header", ""))})

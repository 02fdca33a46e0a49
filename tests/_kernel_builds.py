"""Faster MLX CPU kernel builds for the test run: a precompiled header of MLX's kernel preamble.

On the CPU, every new graph that ``mx.compile`` fuses becomes a C++ source that MLX builds with
``g++ -std=c++17 -O3 -Wall -fPIC -shared`` into its kernel cache (``$TMPDIR/mlx``). Each source
includes MLX's ``compiled_preamble.h``, and parsing that header is most of a build's second
(1.1 s a kernel on a 2-core machine; a fresh machine builds a few hundred during the suite).
This module copies MLX's installed headers into a folder of the temporary directory, keyed by
the MLX version, the headers' contents and the compiler, precompiles the preamble there with
MLX's own flags, and puts a ``g++`` first on ``PATH`` for this process and its children (test
workers, ``velox serve`` and CLI subprocesses) that adds that folder to the include path. g++
then reads the precompiled header instead of parsing the preamble (0.3 s a kernel). The
headers are byte-for-byte MLX's, so the kernels are the same; a precompiled header that g++
cannot use is ignored and the build parses the header as before. Nothing of the installed
MLX is touched. ``VELOX_TEST_PCH=0`` turns it off; anything that fails turns it off too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PREAMBLE = Path("mlx/backend/cpu/compiled_preamble.h")
FLAGS = ["-std=c++17", "-O3", "-Wall", "-fPIC"]  # MLX's (without -shared)


def _mlx_include() -> Path | None:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "include"
    return inc if (inc / PREAMBLE).is_file() else None


def _key(include: Path, gxx: str) -> str:
    h = hashlib.sha256()
    h.update(subprocess.run([gxx, "--version"], capture_output=True, check=True, timeout=30).stdout)
    for path in sorted(include.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(include)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _build(base: Path, include: Path, gxx: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=base.name + ".", dir=base.parent))
    try:
        shutil.copytree(include, tmp / "include")
        header = tmp / "include" / PREAMBLE
        subprocess.run([gxx, *FLAGS, f"-I{tmp / 'include'}", "-x", "c++-header", str(header),
                        "-o", f"{header}.gch"], capture_output=True, check=True, timeout=300)
        (tmp / "bin").mkdir()
        wrapper = tmp / "bin" / "g++"
        wrapper.write_text(f'#!/bin/sh\nexec "{gxx}" "-I{base / "include"}" "$@"\n')
        wrapper.chmod(0o755)
        try:
            tmp.rename(base)  # atomic; another process may have won the race
        except OSError:
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def install() -> Path | None:
    """Build (once per MLX version and compiler) and put on ``PATH`` the precompiled preamble's
    ``g++``; the folder, or ``None`` where it does not apply (not Linux, no g++, no MLX
    headers, ``VELOX_TEST_PCH=0``) or could not be built."""
    if os.environ.get("VELOX_TEST_PCH", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    include = _mlx_include()
    path = os.environ.get("PATH", "")
    gxx = shutil.which("g++", path=os.pathsep.join(
        p for p in path.split(os.pathsep) if "velox-mlx-pch-" not in p))  # the real one
    if include is None or gxx is None:
        return None
    try:
        base = Path(tempfile.gettempdir()) / f"velox-mlx-pch-{_key(include, gxx)}"
        if not (base / "bin" / "g++").is_file():
            _build(base, include, gxx)
        if not (base / "bin" / "g++").is_file():
            return None
    except (OSError, subprocess.SubprocessError):
        return None
    bin_dir = str(base / "bin")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path
    return base

"""Build an OpenBLAS that ``velox`` can load where no system package can be installed.

The ``scipy-openblas32`` wheel (PyPI) carries OpenBLAS with every symbol prefixed ``scipy_``
(``scipy_cblas_sgemm``), so loading it does not replace the reference BLAS bundled with MLX's
Linux wheel. This script writes a small shared library whose every exported function is the
unprefixed name jumping to the prefixed one (``cblas_sgemm: jmp scipy_cblas_sgemm``: one
instruction, no prototypes needed), links it against the wheel's library with gcc, and prints
its path. Point ``VELOX_OPENBLAS`` at it::

    pip install scipy-openblas32
    export VELOX_OPENBLAS=$(python scripts/openblas_shim.py --out .venv/velox-openblas)

Linux x86_64 and aarch64, gcc on ``PATH``.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

PREFIX = "scipy_"
_JUMP = {"x86_64": "jmp {0}@PLT", "aarch64": "b {0}"}


def wheel_library() -> Path:
    """The ``scipy-openblas32`` wheel's shared library."""
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scipy-openblas32 is not installed (pip install scipy-openblas32)")
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("lib/libscipy_openblas*.so*"))
    if not libs:
        raise SystemExit("scipy-openblas32 holds no libscipy_openblas*.so")
    return libs[0]


def exported(lib: Path) -> list[str]:
    """The functions ``lib`` exports under :data:`PREFIX`, without it."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True,
                         capture_output=True, text=True).stdout
    names = [p[2][len(PREFIX):] for p in (line.split() for line in out.splitlines())
             if len(p) == 3 and p[1] in ("T", "W") and p[2].startswith(PREFIX)]
    if not names:
        raise SystemExit(f"{lib} exports no {PREFIX}* functions")
    return names


def assembly(names: list[str], machine: str) -> str:
    jump = _JUMP[machine]
    lines = [".text"]
    for n in names:
        lines += [f".globl {n}", f".type {n}, @function", f"{n}:", "\t" + jump.format(PREFIX + n)]
    lines.append('.section .note.GNU-stack,"",@progbits')
    return "\n".join(lines) + "\n"


def build(out: Path) -> Path:
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in _JUMP:
        raise SystemExit(f"the shim is built for Linux x86_64 and aarch64, not {sys.platform} {machine}")
    lib = wheel_library()
    out.mkdir(parents=True, exist_ok=True)
    src, target = out / "shim.s", out / "libblas.so.3"
    src.write_text(assembly(exported(lib), machine))
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(target), str(src), str(lib),
                    f"-Wl,-rpath,{lib.parent}"], check=True)
    return target.resolve()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".venv/velox-openblas", help="folder for the library")
    print(build(Path(ap.parse_args(argv).out)))


if __name__ == "__main__":
    main()

"""Load OpenBLAS for MLX's CPU matmuls, in-process, before ``mlx.core`` is imported.

MLX's Linux wheel links a bundled reference BLAS. A library loaded with ``RTLD_GLOBAL``
before ``mlx.core`` comes first in the symbol lookup of MLX's library, so its ``cblas_*``
functions replace the bundled ones (results differ in rounding only). Loaded after
``mlx.core``, it has no effect; ``velox/__init__.py`` imports this module first.

Opt out with ``VELOX_NO_OPENBLAS=1``. Install the library with
``apt-get install libopenblas0-pthread`` (Debian, Ubuntu). ``VELOX_OPENBLAS=PATH`` names
another library exporting the unprefixed CBLAS and LAPACK symbols, loaded instead: where no
system package can be installed, ``python scripts/openblas_shim.py`` builds one from the
``scipy-openblas32`` wheel (whose symbols carry a ``scipy_`` prefix) and prints its path.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__ = ["OPENBLAS", "loaded", "reason"]

#: Where Debian's and Ubuntu's ``libopenblas0-pthread`` install the BLAS interface.
OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3"

#: The path loaded, or ``None``; ``reason`` says why not.
loaded: str | None = None
reason = ""


def _load() -> tuple[str | None, str]:
    if not sys.platform.startswith("linux"):
        return None, "not Linux"
    if os.environ.get("VELOX_NO_OPENBLAS", "0") not in ("", "0"):
        return None, "VELOX_NO_OPENBLAS is set"
    path = os.environ.get("VELOX_OPENBLAS") or OPENBLAS
    if not os.path.exists(path):
        if path != OPENBLAS:
            return None, f"VELOX_OPENBLAS={path} does not exist"
        return None, f"{OPENBLAS} is not installed (apt-get install libopenblas0-pthread)"
    if path in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        return path, "preloaded (LD_PRELOAD)"
    if "mlx.core" in sys.modules:
        return None, "mlx.core was imported before velox (import velox first, or set LD_PRELOAD)"
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return None, f"{path} failed to load: {exc}"
    return path, "loaded before mlx.core" + (" (VELOX_OPENBLAS)" if path != OPENBLAS else "")


loaded, reason = _load()

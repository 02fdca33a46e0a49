"""Write the static exports of ``velox/__init__.py``: ``python scripts/update_exports.py``.

Every module in ``velox/methods`` is imported by name, so ``velox.<key>`` is the method's
namespace (``velox.tova.init``, ``velox.tova.update``, ...), and its functions keep their flat
aliases (``velox.tova_init``, ``velox.tova_update``, ``velox.tova_get_kv``,
``velox.tova_bytes``) and its state type its name (``velox.TovaState``). The block between the
markers is generated from the modules and the registry; ``tests/test_exports.py`` fails when it
drifts (``--check`` prints the difference and exits 1). It reads the installed package (install
the checkout first, e.g. ``pip install -e .``) and writes the checkout's file.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INIT = ROOT / "velox" / "__init__.py"
BEGIN = "# --- begin generated exports (scripts/update_exports.py) ---"
END = "# --- end generated exports ---"
ALIASES = (("init", "init"), ("update", "update"), ("get_kv", "get_kv"), ("bytes", "nbytes"))


def modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "velox" / "methods").glob("*.py") if not p.name.startswith("_"))


def block() -> str:
    import velox  # noqa: F401  (the installed package: kernels/, adapters/, specs/ live under it)
    from velox.registry import get_method, method_keys

    names = modules()
    lines = [BEGIN, "from .methods import (  # noqa: E402  (each registers its method)"]
    lines += [f"    {n}," for n in names]
    lines.append(")")
    exported: list[str] = []
    for n in names:
        mod = importlib.import_module(f"velox.methods.{n}")
        keys = [k for k in method_keys() if getattr(get_method(k).init, "__module__", "") == mod.__name__
                or get_method(k).state_type.__module__ == mod.__name__]
        if n not in keys or not hasattr(mod, "State"):
            continue  # a module registering a composition: velox.init(key) reaches it
        state = get_method(n).state_type.__name__
        aliases = ", ".join(f"{n}_{a}" for a, _ in ALIASES)
        targets = ", ".join(f"{n}.{b}" for _, b in ALIASES)
        lines.append(f"{state} = {n}.State")
        lines.append(f"{aliases} = (\n    {targets})")
        exported += [n, state] + [f"{n}_{a}" for a, _ in ALIASES]
    lines.append("__all__ += [")
    row = "   "
    for name in exported:
        item = f' "{name}",'
        if len(row) + len(item) > 99:
            lines.append(row)
            row = "   "
        row += item
    lines.append(row)
    lines.append("]")
    lines.append(END)
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    start, stop = text.index(BEGIN), text.index(END) + len(END) + 1
    return text[:start] + block() + text[stop:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="report drift instead of writing")
    args = ap.parse_args()
    old = INIT.read_text()
    new = render(old)
    if args.check:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       "velox/__init__.py", "generated"))
            return 1
        return 0
    INIT.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

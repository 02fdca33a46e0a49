"""Compositions: an eviction policy decides which tokens live, a codec holds them.

Registers ``"<policy>+<codec>"`` (``velox.compose.evict_then_store``) for every codec a policy's
spec lists in its ``compose`` key (``specs/tova.toml``: ``compose = ["affine", ...]``); reach
one with ``velox.init("tova+affine", ...)``. The contract suite runs on each, like any method.
"""

from __future__ import annotations

import importlib
import tomllib
from importlib import resources

from ..compose import evict_then_store
from ..spec import spec_keys

__all__ = ["PAIRS"]


def _declared(key: str) -> tuple[str, ...]:
    """The ``compose`` list of ``key``'s spec file (read before the method registers)."""
    data = tomllib.loads((resources.files("velox.specs") / f"{key}.toml").read_text(encoding="utf-8"))
    return tuple(data.get("compose", ()))


#: (policy, codec) pairs the specs declare composable, in key order.
PAIRS = tuple((key, codec) for key in spec_keys() for codec in _declared(key))

for _policy, _codec in PAIRS:
    importlib.import_module(f"{__package__}.{_policy}")  # the policy registers first
    if _codec != "affine":
        importlib.import_module(f"{__package__}.{_codec}")  # and the codec's own method
    evict_then_store(_policy, _codec)

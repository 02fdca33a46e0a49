"""Compositions: an eviction policy decides which tokens live, a codec holds them.

Registers ``"<policy>+<codec>"`` (``velox.compose.evict_then_store``) for every codec a policy's
spec lists in its ``compose`` key (``specs/tova.toml``: ``compose = ["affine", ...]``); reach
one with ``velox.init("tova+affine", ...)``. The contract suite runs on each, like any method.
"""

from __future__ import annotations

import importlib

from ..compose import evict_then_store
from ..registry import get_method
from ..spec import spec_keys

__all__ = ["PAIRS"]

# Every method registers first (velox/__init__ imports them all anyway): its spec, read once at
# registration, says which codecs it composes with (``Spec.compose``).
for _key in spec_keys():
    importlib.import_module(f"{__package__}.{_key}")

#: (policy, codec) pairs the specs declare composable, in key order.
PAIRS = tuple((key, codec) for key in spec_keys() for codec in get_method(key).spec.compose)

for _policy, _codec in PAIRS:
    evict_then_store(_policy, _codec)

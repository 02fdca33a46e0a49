"""TOVA + per-token affine codes: TOVA decides which tokens live, affine codes hold them.

Registers the composition ``"tova+affine"`` (``velox.compose.evict_then_store``); reach it
with ``velox.init("tova+affine", ...)``.
"""

from __future__ import annotations

from ..compose import evict_then_store
from . import tova  # noqa: F401  (the policy registers first)

method = evict_then_store("tova")

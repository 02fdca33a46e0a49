"""The table of registered methods: key -> method (``velox.registry.Method``) and state type
-> method. ``velox.registry.register`` fills it and ``velox.registry.get_method`` reads it;
it sits below ``velox.spec``, whose ``load_spec`` takes a registered method's spec from it.
"""

from __future__ import annotations

from typing import Any

_REGISTRY: dict[str, Any] = {}  # key -> velox.registry.Method
_BY_STATE: dict[type, Any] = {}  # state type -> velox.registry.Method

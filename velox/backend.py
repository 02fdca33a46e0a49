"""Backend names, availability and resolution (done once, at ``init``)."""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx

__all__ = ["BACKENDS", "BackendUnavailable", "device_supports", "resolve_backend"]

#: Every backend name; ``auto`` picks the fastest available one at init.
BACKENDS = ("reference", "mlx", "metal", "cuda")

# Preference of ``auto``: a hand-written kernel where the device has one, else vectorised MLX.
_AUTO_ORDER = ("cuda", "metal", "mlx")


class BackendUnavailable(ValueError):
    """A backend was asked for that this method or this machine cannot run."""


def device_supports(backend: str) -> bool:
    """Whether this machine can run ``backend`` at all (ignoring which methods implement it)."""
    if backend in ("reference", "mlx"):
        return True
    if backend == "metal":
        return bool(mx.metal.is_available())
    if backend == "cuda":
        return bool(getattr(mx, "cuda", None) is not None and mx.cuda.is_available())
    return False


def _why_not(backend: str) -> str:
    if backend == "metal":
        return "it needs an Apple GPU and MLX reports no Metal device here"
    return "it needs an NVIDIA GPU and MLX reports no CUDA device here"


def resolve_backend(requested: str, key: str, implemented: Iterable[str]) -> str:
    """Return the concrete backend for ``requested`` or raise; never falls back silently."""
    implemented = tuple(implemented)
    if requested == "auto":
        for name in _AUTO_ORDER:
            if name in implemented and device_supports(name):
                return name
        raise BackendUnavailable(f"{key}: no backend runs here (implemented: {', '.join(implemented)})")
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of auto, {', '.join(BACKENDS)}")
    if requested not in implemented:
        raise BackendUnavailable(
            f"{key} has no {requested!r} backend (it has: {', '.join(implemented)})")
    if not device_supports(requested):
        raise BackendUnavailable(f"backend {requested!r} is not available: {_why_not(requested)}")
    return requested

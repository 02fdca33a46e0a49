"""Backend names, availability and resolution (done once, at ``init``), and :class:`Backend`,
the record of what one backend of a method offers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterable

import mlx.core as mx

__all__ = ["BACKENDS", "Backend", "BackendUnavailable", "MetalProof", "device_supports",
           "install_metal_proof", "resolve_backend", "gpu_kernels"]

#: Every backend name; ``auto`` picks the fastest available one at init.
BACKENDS = ("reference", "mlx", "metal", "cuda")

# Preference of ``auto``: a hand-written kernel where the device has one, else vectorised MLX.
# ``metal`` only where its kernels passed the parity self-check (velox.selfcheck).
_AUTO_ORDER = ("cuda", "metal", "mlx")


class BackendUnavailable(ValueError):
    """A backend was asked for that this method or this machine cannot run."""


@dataclass(frozen=True)
class MetalProof:
    """What the ``metal`` backend is proven by (``velox.selfcheck`` installs its functions at
    ``import velox``, :func:`install_metal_proof`): ``verified()``, whether its kernels passed
    the parity self-check for this MLX, device and kernel sources; ``reference_only()``,
    whether a self-check is computing its ``mlx`` references now (kernels off); ``ensure()``,
    the self-check of a first use (raises :class:`BackendUnavailable` unless it passes).
    Until one is installed, ``metal`` is never proven."""

    verified: Callable[[], bool]
    reference_only: Callable[[], bool]
    ensure: Callable[[], Any]


def _unproven() -> Any:
    raise BackendUnavailable("backend 'metal' has no self-check installed (import velox)")


_METAL = MetalProof(verified=lambda: False, reference_only=lambda: False, ensure=_unproven)


def install_metal_proof(proof: MetalProof) -> None:
    """Make ``proof`` what the ``metal`` backend is proven by (``velox/__init__`` installs
    ``velox.selfcheck``'s)."""
    global _METAL
    if not isinstance(proof, MetalProof):
        raise TypeError(f"install_metal_proof takes a MetalProof, not {type(proof).__name__}")
    _METAL = proof


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


def gpu_kernels() -> bool:
    """Whether the decode kernels the ``mlx`` backends take where they can (codec and KIVI
    attention, the fill step's attention) run here: MLX computes on an NVIDIA GPU, or on an
    Apple GPU whose Metal kernels passed the parity self-check (``velox.selfcheck``); never
    while a self-check computes its references (``velox.selfcheck.mlx_only``)."""
    if mx.default_device() != mx.gpu:
        return False
    if _METAL.reference_only():
        return False
    if device_supports("cuda"):
        return True
    return device_supports("metal") and _METAL.verified()


def _proven(name: str) -> bool:
    """Whether ``auto`` may pick ``name``: ``metal`` once its kernels passed the self-check
    for this MLX, device and velox (in this process or recorded), every other one as it is."""
    return name != "metal" or _METAL.verified()


def resolve_backend(requested: str, key: str, implemented: Iterable[str]) -> str:
    """Return the concrete backend for ``requested`` or raise; never falls back silently.
    ``metal`` runs its parity self-check at its first use in a process (``velox.selfcheck``:
    ``BackendUnavailable`` where its kernels disagree with the ``mlx`` ops); ``auto`` takes
    it only where that check has passed."""
    implemented = tuple(implemented)
    if requested == "auto":
        for name in _AUTO_ORDER:
            if name in implemented and device_supports(name) and _proven(name):
                return name
        raise BackendUnavailable(f"{key}: no backend runs here (implemented: {', '.join(implemented)})")
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of auto, {', '.join(BACKENDS)}")
    if requested not in implemented:
        raise BackendUnavailable(
            f"{key} has no {requested!r} backend (it has: {', '.join(implemented)})")
    if not device_supports(requested):
        raise BackendUnavailable(f"backend {requested!r} is not available: {_why_not(requested)}")
    if requested == "metal":
        _METAL.ensure()
    return requested


@dataclass(frozen=True, eq=False)
class Backend:
    """One backend of a method: its update, and the decode-step parts it offers besides.

    A method's ``backends`` map names to these records (``velox.registry.register`` wraps a
    plain update function into one with nothing else). Every field but ``update`` is
    optional; the decode step (``velox.decode``), the registry and the adapter read them
    by name, and a field left ``None`` (``False``) means the backend does not offer it.

    Attributes:
        update: ``update(state, keys, values, queries) -> state`` (the record is also
            callable that way).
        with_move: ``(state, keys, values, queries) -> (state, velox.slots.Move)``: the
            update and how the rows moved (a state of slots: compositions follow the move,
            the decode step defers the slot write).
        with_attention: ``(state, keys, values, queries) -> (out, state, Move) | None``: a
            decode step whose attention output comes from the kernel that scores
            (``None`` where the step is not one it takes).
        fill: ``(state, keys, values) -> state | None``: a single token written into an
            empty row or slot, in place (``None`` where the step is another).
        fill_attention: ``(state, filled, queries, keys, values, scale) -> out | None``: the
            attention of a ``fill`` step over the written arrays.
        steady_step: ``(state, queries, keys, values, scale) -> (out, state)``: a single
            token written in place into chunked storage, then attended over.
        ragged: ``(state, keys, values, queries, valid) -> state``: the update of rows
            taking ``valid[i]`` new tokens each (``velox.ragged``).
        slots: the state keeps rows in slots (``velox.evict``): ``get_kv`` and
            ``positions`` gather them by position.
        logits_only: the method's score reads stored keys only as attention logits
            (``velox.evict.scores_by_logits``).
        skeleton: ``spec -> {name: Backend}``: the backends built for another spec (the
            contract suite builds a method's ``"sorted"`` twin with it).
    """

    update: Callable[..., Any]
    with_move: Callable[..., Any] | None = None
    with_attention: Callable[..., Any] | None = None
    fill: Callable[..., Any] | None = None
    fill_attention: Callable[..., Any] | None = None
    steady_step: Callable[..., Any] | None = None
    ragged: Callable[..., Any] | None = None
    slots: bool = False
    logits_only: bool = False
    skeleton: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.update is None:
            raise TypeError("Backend.update is required")
        for name in ("update", "with_move", "with_attention", "fill", "fill_attention",
                     "steady_step", "ragged", "skeleton"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise TypeError(f"Backend.{name} must be callable or None, got {type(fn).__name__}")

    def __call__(self, state, keys, values, queries=None):
        return self.update(state, keys, values, queries)

    @classmethod
    def of(cls, backend: Any) -> "Backend":
        """``backend`` as a record: a :class:`Backend` as it is, a plain update function
        wrapped (it offers nothing else); anything else is a ``TypeError``."""
        if isinstance(backend, Backend):
            return backend
        if not callable(backend):
            raise TypeError(f"a backend is a velox.backend.Backend or an update function, "
                            f"got {type(backend).__name__}")
        return cls(update=backend)

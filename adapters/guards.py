"""mlx-lm's generation options that velox caches cannot honour, refused when a generation starts.

mlx-lm's ``generate_step`` and ``speculative_generate_step`` take options that act on the
prompt cache behind the cache protocol's back:

* ``kv_bits`` swaps each cache for mlx-lm's quantized one (``to_quantized``), which would
  throw the velox state away;
* ``max_kv_size`` only sizes a cache ``generate_step`` makes itself, so with a velox
  ``prompt_cache`` it would silently do nothing;
* speculative decoding trims up to ``num_draft_tokens`` tokens of the model's caches and
  ``num_draft_tokens - 1`` of the draft's; a velox cache trims exactly only within its
  ``rollback`` depth and only in deferred mode (the verify call run as one-token steps), and
  a cross-layer method only where that split is exact (``velox.layer.check_verify``).

:func:`install` (``make_cache`` and ``load_cache`` call it) wraps both functions in
``mlx_lm.generate``, so that ``mlx_lm.generate``/``stream_generate``, the server and any
caller reaching them through that module check their arguments once, before any token is
absorbed; calls with no velox cache are passed on untouched. A reference to the original
function taken before the wrapper was installed skips this check; the cache protocol then
refuses the same options itself, later: ``kv_bits`` at the first step (velox caches answer
``to_quantized`` with the error), a too-shallow or proxy-mode cache at the first rejected
draft (``trim`` refuses what it cannot undo exactly); only ``max_kv_size`` then goes unseen,
as it does for mlx-lm's own caches.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

from velox import layer

from .model_step import Attends
from .routing import KV_BITS, Mode, capture_installed

__all__ = ["install", "uninstall", "check_generate", "check_speculative"]

_ORIGINALS: dict[str, Callable] = {}


def _velox(caches: Any) -> list:
    return [c for c in (caches or ()) if isinstance(c, Attends)]


def check_generate(prompt_cache, *, kv_bits=None, max_kv_size=None) -> None:
    """Raise if ``generate_step``'s options would act on velox caches behind their back."""
    if not _velox(prompt_cache):
        return
    if kv_bits is not None:
        raise ValueError(KV_BITS)
    if max_kv_size is not None:
        raise ValueError(
            f"max_kv_size={max_kv_size} has no effect on a velox prompt cache (mlx-lm ignores it "
            "when prompt_cache is given); drop it and bound the cache with the method's own "
            "parameters, e.g. make_cache(model, 'streaming_llm', window_size=...)")


def check_speculative(model, prompt_cache, *, num_draft_tokens: int, kv_bits=None) -> None:
    """Raise if speculative decoding would trim velox caches where they cannot trim exactly:
    a model cache needs ``rollback >= num_draft_tokens`` (the verify call's rejected tokens)
    and deferred mode; a velox draft cache needs ``rollback >= num_draft_tokens - 1``
    (mlx-lm leaves a draft cache it cannot trim untrimmed, silently)."""
    if not _velox(prompt_cache):
        return
    check_generate(prompt_cache, kv_bits=kv_bits)
    k = num_draft_tokens
    if not isinstance(k, int):
        return
    n = len(model.layers)
    for i, c in enumerate(prompt_cache):  # a cross-layer record a verify call cannot split
        depth = getattr(c, "rollback", 0)
        if isinstance(c, Attends) and getattr(c, "_model", None) is not None and depth:
            layer.check_verify(c._m, k + 1 if i < n else 2, depth)
    for c in _velox(prompt_cache[:n]):
        depth = getattr(c, "rollback", 0)  # (a batch cache has none: it never trims)
        if depth < k:
            raise ValueError(
                f"speculative decoding with num_draft_tokens={k} trims up to {k} tokens of the "
                f"model's cache; these velox caches keep rollback={depth} steps: make them "
                f"with make_cache(..., rollback={k}) (or more)")
        if getattr(c, "mode", None) is not Mode.DEFERRED or not capture_installed():
            raise ValueError(
                "speculative decoding with velox caches needs deferred mode (real queries "
                "through mlx-lm's scaled_dot_product_attention), which runs the verify call as "
                "one-token steps; these caches are in proxy mode")
    for c in _velox(prompt_cache[n:]):
        depth = getattr(c, "rollback", 0)
        if depth < k - 1:
            raise ValueError(
                f"speculative decoding with num_draft_tokens={k} trims up to {k - 1} tokens of "
                f"the draft's cache; this velox draft cache keeps rollback={depth} steps: "
                f"make it with rollback={k - 1} (or use mlx-lm's own caches for the draft, "
                "make_prompt_cache(draft_model))")


def _checked(original: Callable, check: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        check(bound.arguments)
        return original(*args, **kwargs)
    wrapper.__velox_original__ = original
    return wrapper


def _generate_args(a: dict) -> None:
    check_generate(a.get("prompt_cache"), kv_bits=a.get("kv_bits"), max_kv_size=a.get("max_kv_size"))


def _speculative_args(a: dict) -> None:
    check_speculative(a.get("model"), a.get("prompt_cache"),
                      num_draft_tokens=a.get("num_draft_tokens"), kv_bits=a.get("kv_bits"))


_CHECKS = {"generate_step": _generate_args, "speculative_generate_step": _speculative_args}


def install() -> None:
    """Wrap ``generate_step`` and ``speculative_generate_step`` in ``mlx_lm.generate`` with
    the checks above (idempotent)."""
    gen = importlib.import_module("mlx_lm.generate")  # (``mlx_lm.generate`` is also a function)
    for name, check in _CHECKS.items():
        if name not in _ORIGINALS and hasattr(gen, name):
            _ORIGINALS[name] = getattr(gen, name)
            setattr(gen, name, _checked(_ORIGINALS[name], check))


def uninstall() -> None:
    """Restore mlx-lm's original functions."""
    gen = importlib.import_module("mlx_lm.generate")
    for name, original in list(_ORIGINALS.items()):
        setattr(gen, name, original)
        del _ORIGINALS[name]

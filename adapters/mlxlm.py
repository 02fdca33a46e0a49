"""mlx-lm adapter: velox caches for ``mlx_lm.generate``, ``stream_generate``, ``generate_step``,
``batch_generate`` and speculative decoding.

``make_cache(model, "tova", budget=256)`` returns one :class:`VeloxCache` per layer; the cache
maps mlx-lm's cache protocol onto the method's pure functions (:mod:`velox.adapters.cache`
says how); ``save_cache`` / ``load_cache`` write and read prompt-cache files
(:mod:`velox.adapters.cache_files`). This module gathers the public names of both.
"""

from __future__ import annotations

from velox.adapters.cache import (ROLLBACK_MAX, Mode, VeloxCache, cache_fp16_bytes, cache_nbytes,
                                  default_layout, install_query_capture, make_cache, query_capture,
                                  reconstruction_prefill, tap_queries, uninstall_query_capture)
from velox.adapters.cache_files import load_cache, save_cache

__all__ = ["VeloxCache", "Mode", "make_cache", "save_cache", "load_cache", "cache_nbytes",
           "cache_fp16_bytes", "default_layout", "install_query_capture", "uninstall_query_capture",
           "query_capture", "tap_queries", "reconstruction_prefill", "ROLLBACK_MAX"]

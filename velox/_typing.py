"""Array type aliases with one axis vocabulary for the whole library.

Axes: ``b`` batch, ``h`` kv heads, ``q`` query heads, ``s`` new tokens, ``n`` stored tokens,
``d`` head dim. Shapes are checked at runtime when the test suite enables jaxtyping.
"""

from __future__ import annotations

import mlx.core as mx
from jaxtyping import Bool, Float, Int, Shaped, UInt

Array = mx.array

__all__ = ["Array", "Bool", "Float", "Int", "Shaped", "UInt"]

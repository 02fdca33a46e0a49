"""Reductions to TOVA as exact equalities: MorphKV with window=1 and KVzip with
probe="latest" keep exactly TOVA's tokens."""

import mlx.core as mx
import numpy as np
import pytest

import velox

from tests._helpers import BACKENDS


CHUNKS = (21, 1, 1, 6, 1, 1, 13, 1, 2, 1)


def _stream(seed, heads, groups, d=16):
    rng = np.random.default_rng(seed)
    out = []
    for s in CHUNKS:
        k = rng.standard_normal((2, heads, s, d)).astype(np.float32) * 0.7
        v = rng.standard_normal((2, heads, s, d)).astype(np.float32)
        q = rng.standard_normal((2, heads * groups, s, d)).astype(np.float32) if groups else None
        out.append((mx.array(k), mx.array(v), None if q is None else mx.array(q)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [0, 1, 3])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("other", ["morphkv", "kvzip"])
def test_reduces_to_tova(other, per_head, groups, backend):
    """morphkv window=1 and kvzip probe='latest' keep exactly TOVA's tokens."""
    extra = dict(window=1) if other == "morphkv" else dict(probe="latest")
    for seed in range(2 if backend == "mlx" else 1):
        a = velox.tova_init(2, 3, 16, budget=12, n_sink=2, per_head=per_head, backend=backend)
        b = velox.init(other, 2, 3, 16, budget=12, n_sink=2, per_head=per_head, backend=backend, **extra)
        for t, (k, v, q) in enumerate(_stream(seed, 3, groups)):
            a = velox.tova_update(a, k, v, queries=q)
            b = velox.update(b, k, v, queries=q)
            assert np.array_equal(np.array(a.positions), np.array(b.positions)), f"update {t}"

"""benchmarks/xkv_basis.py: the figures on layers whose answer is known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("xkv_basis", ROOT / "benchmarks" / "xkv_basis.py")
xb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(xb)


def _layer(rng, directions: np.ndarray, n: int = 96) -> np.ndarray:
    """``[1, n, d]`` keys spanning ``directions [d, k]`` (decaying weights) plus a mean."""
    k = directions.shape[1]
    return ((rng.standard_normal((1, n, k)) * np.geomspace(3, 1, k)) @ directions.T + 0.5).astype(np.float32)


def test_a_layer_shared_with_its_copy_loses_nothing_and_one_with_an_orthogonal_layer_does():
    rng = np.random.default_rng(0)
    eye = np.eye(16)
    a, b = _layer(rng, eye[:, :4]), _layer(rng, eye[:, 4:8])
    same = xb.figures([a, a], 48, [1, 2], [4, 16], 0.95)
    for r in (4, 16):
        assert np.allclose(same["1"][f"held@{r}"], same["2"][f"held@{r}"], atol=1e-6)
    assert np.allclose(same["1"]["held@4"], 1, atol=1e-5)   # the four directions, all of it
    apart = xb.figures([a, b], 48, [1, 2], [4, 16], 0.95)
    own, shared = np.array(apart["1"]["held@4"]), np.array(apart["2"]["held@4"])
    assert (own > 0.99).all() and (shared < 0.9).all()      # the shared top 4 mix both layers'
    assert np.allclose(apart["2"]["held@16"], 1, atol=1e-5)  # a full basis holds everything
    assert np.array(apart["1"]["rank"]).max() <= 4 < np.array(apart["2"]["rank"]).min()


def test_held_energy_of_a_basis():
    rows = np.array([[[1.0, 2.0], [3.0, -2.0]]], np.float32)
    basis = np.eye(2, dtype=np.float32)[None]
    mean = np.zeros((1, 2), np.float32)
    assert np.allclose(xb.held_energy(rows, mean, basis, 1), [10 / 18])
    assert np.allclose(xb.held_energy(rows, mean, basis, 2), [1.0])

"""benchmarks/adjacent_layers.py: the figures of one layer pair, on inputs whose answer is known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("adjacent_layers", ROOT / "benchmarks" / "adjacent_layers.py")
adj = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(adj)


def test_token_cosines():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    b = np.array([[2.0, 0.0], [-1.0, -1.0], [1.0, 0.0]])
    assert np.allclose(adj.token_cosines(a, b), [1.0, -1.0, 0.0])  # a zero vector: 0


def test_codes_of_a_layer_and_itself_agree_and_chance_follows_the_frequencies():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 64, 32)), rng.standard_normal((2, 64, 32))
    ck, cv = adj.kivi_codes(k, v)
    assert ck.shape == (2, 32, 64) and cv.shape == (2, 64, 32)
    assert ck.min() == 0 and ck.max() == 3 and (ck == adj.kivi_codes(k, v)[0]).all()
    # keys: channel 0 over tokens 0..31 is 0, 1, ..., 31: codes 0 (0-5), 1 (6-15), 2, 3 (26-31)
    ramp = np.broadcast_to(np.arange(32.0)[None, :, None], (1, 32, 32))
    codes = adj.kivi_codes(ramp, ramp)[0][0, 0]
    assert np.bincount(codes).tolist() == [6, 10, 10, 6]
    uniform = np.arange(4).repeat(8)
    assert adj.chance_agreement(uniform, uniform[::-1], 4) == 0.25
    assert adj.chance_agreement(np.zeros(8, int), np.zeros(8, int), 4) == 1.0


def test_cka_and_subspaces():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((200, 12))
    q, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    assert abs(adj.linear_cka(x, x @ q) - 1) < 1e-9  # invariant to a rotation of the features
    assert adj.linear_cka(x, rng.standard_normal((200, 12))) < 0.2
    u, w = adj.top_vectors(x, 3)
    assert u.shape == (200, 3) and w.shape == (12, 3)
    assert abs(adj.subspace_alignment(u, adj.top_vectors(3 * x, 3)[0]) - 1) < 1e-9
    e = np.eye(4)
    assert adj.subspace_alignment(e[:, :2], e[:, 2:]) == 0.0


def test_pair_figures_of_a_layer_and_itself():
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 64, 32)), rng.standard_normal((2, 64, 32))
    f = adj.pair_figures(k, v, k, v, rank=4)
    for name in ("cos", "merged", "codes", "cka", "tokens", "channels"):
        assert abs(f[f"keys_{name}"] - 1) < 1e-9 and abs(f[f"values_{name}"] - 1) < 1e-9, name
    g = adj.pair_figures(k, v, -k, v, rank=4)
    assert abs(g["keys_cos"] + 1) < 1e-9 and g["keys_merged"] == 0.0

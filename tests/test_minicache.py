"""MiniCache: SLERP's endpoints, unit norm and collinear fallback; a hand-worked pair of layers
(merged and retained tokens, bytes); the restored norm is each layer's own magnitude; retained
tokens bit-exact, retention iff the cosine is below the threshold, merged + retained + exact =
every token; identical layers merge losslessly; layers below start_frac untouched; groups of
three; a layer alone is a passthrough; the backends agree through layer_update. Through the
adapter: tests/test_crosslayer_adapter.py."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import velox.methods.minicache as mc
from velox.accounting import state_nbytes
from velox.registry import get_method

from tests._helpers import BACKENDS

M = get_method("minicache")


def _layers(n: int, *, b: int = 1, h: int = 2, d: int = 16, backend: str = "mlx", **params):
    per = [M.spec.defaults | p for p in M.per_layer_params(n, params)]
    return M.model_init(per), [M.init(b, h, d, backend=backend, **p) for p in per]


def _run(record, states, chunks, *, same=False, seed=0, b=1, h=2, d=16):
    """Forwards of ``chunks`` tokens; every layer's keys and values (values = -keys / 2) are
    random, or (``same``) one set for all. Returns the record, states and each layer's inputs."""
    rng = np.random.default_rng(seed)
    seen = [[] for _ in states]
    for s in chunks:
        xs = [mx.array(rng.standard_normal((b, h, s, d)).astype(np.float32)) for _ in states]
        if same:
            xs = [xs[0]] * len(states)
        for i, x in enumerate(xs):
            record, states[i] = M.layer_update(record, i, states[i], x, -x / 2)
            seen[i].append(x)
    return record, states, [mx.concatenate(x, axis=2) for x in seen]


def test_slerp_endpoints_unit_norm_and_collinear_fallback():
    rng = np.random.default_rng(0)
    a, _ = mc._unit(mx.array(rng.standard_normal((64, 8)).astype(np.float32)))
    b, _ = mc._unit(mx.array(rng.standard_normal((64, 8)).astype(np.float32)))
    np.testing.assert_allclose(np.array(mc.slerp(a, b, 0.0)), np.array(a), atol=1e-6)
    np.testing.assert_allclose(np.array(mc.slerp(a, b, 1.0)), np.array(b), atol=1e-6)
    for t in (0.25, 0.5, 0.9):
        out = mc.slerp(a, b, t)
        np.testing.assert_allclose(np.linalg.norm(np.array(out), axis=-1), 1.0, atol=1e-6)
        # on the great circle: the angle to a is t times the angle between a and b
        ab = np.arccos(np.clip((np.array(a) * np.array(b)).sum(-1), -1, 1))
        ao = np.arccos(np.clip((np.array(a) * np.array(out)).sum(-1), -1, 1))
        np.testing.assert_allclose(ao, t * ab, atol=1e-3)
    same = mc.slerp(a, a, 0.5)  # collinear: the normalized linear interpolation, a itself
    np.testing.assert_allclose(np.array(same), np.array(a), atol=1e-6)
    c, _ = mc._unit(a + 1e-8)
    near = np.array(mc.slerp(a, c, 0.5))
    assert np.isfinite(near).all()
    np.testing.assert_allclose(np.linalg.norm(near, axis=-1), 1.0, atol=1e-6)
    e = mx.array([[1.0, 0.0]])
    assert np.array(mc.slerp(e, -e, 0.5)).tolist() == [[0.0, 0.0]]  # antipodal halfway: none


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_pair(backend):
    """Two layers, one group (start_frac 0), one kv head of dim 2, retention_threshold 0.

    Forward 1: layer 0's keys (3, 0) and (1, 1), layer 1's (0, 2) and (2, 2) (values the
    same): both wait exact. Forward 2 (one more token each): layer 0 merges them with layer
    1's rows from the record. Token 0: cos((1, 0), (0, 1)) = 0, not below 0, merged: the angle
    is pi/2, slerp at 1/2 gives (sin(pi/4), sin(pi/4)) = (0.7071, 0.7071), layer 0 restores
    3 e = (2.1213, 2.1213), layer 1 2 e = (1.4142, 1.4142). Token 1: both along (1, 1), cos 1:
    merged, collinear, restored exactly. With threshold 0.5, token 0 (cos 0) is retained:
    each layer restores its own vector."""
    r2 = math.sqrt(0.5)
    for threshold, want0, want1 in ((0.0, [3 * r2] * 2, [2 * r2] * 2), (0.5, [3, 0], [0, 2])):
        record, st = _layers(2, h=1, d=2, backend=backend, start_frac=0.0,
                             retention_threshold=threshold)
        x0 = mx.array([[[[3.0, 0.0], [1.0, 1.0]]]])
        x1 = mx.array([[[[0.0, 2.0], [2.0, 2.0]]]])
        for i, x in enumerate((x0, x1)):
            record, st[i] = M.layer_update(record, i, st[i], x, x)
        assert [mc.counts(s)["exact"] for s in st] == [2, 2]
        nxt = mx.array([[[[5.0, 5.0]]]])
        for i in range(2):
            record, st[i] = M.layer_update(record, i, st[i], nxt, nxt)
        k0, v0 = (np.array(a)[0, 0] for a in M.get_kv(st[0]))
        k1, _ = (np.array(a)[0, 0] for a in M.get_kv(st[1]))
        np.testing.assert_allclose(k0, [want0, [1, 1], [5, 5]], atol=1e-6)
        np.testing.assert_allclose(k1, [want1, [2, 2], [5, 5]], atol=1e-6)
        assert np.array_equal(k0, v0)
        retained = threshold == 0.5
        assert mc.counts(st[0]) == {"merged": 2 - retained, "retained": int(retained), "exact": 1}
        np.testing.assert_allclose(np.array(st[1].norm_keys)[0, 0], [2, math.sqrt(8)], rtol=1e-6)
        # What each layer holds: layer 0 its exact token (2 x 4 B a side), the merged
        # directions (2 tokens x 8 B a side), flags (2 x 1 B a side), its magnitudes (2 x 4 B
        # a side) and next_pos (4 B): 16 + 32 + 4 + 16 + 4 = 72 B.
        assert M.nbytes(st[0]) == 72 == state_nbytes(st[0])
        # Layer 1: its exact token, its magnitudes, next_pos (8 + 8 + 8 + 8 + 4 = 36 B), a
        # retained token's row and index a side (8 + 4 B, twice); its primary's directions and
        # flags are held, not counted.
        assert M.nbytes(st[1]) == 36 + retained * 2 * (8 + 4)
        assert st[1].directions_keys is st[0].directions_keys and st[1].kept_values is st[0].kept_values
        shared = ("directions_keys", "directions_values", "kept_keys", "kept_values")
        assert M.nbytes(st[1]) == state_nbytes(st[1]) - sum(getattr(st[0], f).nbytes for f in shared)


@pytest.mark.parametrize("threshold", [-1.0, 0.0, 0.2])
def test_merged_and_retained_tokens(threshold):
    """Retention iff cos < threshold (keys and values apart); retained rows bit-exact in both
    layers; a merged row restored to the layer's own magnitude along the shared direction;
    merged + retained + exact = every token."""
    record, st = _layers(2, start_frac=0.0, retention_threshold=threshold)
    record, st, seen = _run(record, st, (20, 1, 7, 1, 1))
    for side, scale in (("keys", 1.0), ("values", -0.5)):
        m = st[0].norm_keys.shape[2]
        x0, x1 = (np.array(s[:, :, :m]) * scale for s in seen)
        u0 = x0 / np.linalg.norm(x0, axis=-1, keepdims=True)
        u1 = x1 / np.linalg.norm(x1, axis=-1, keepdims=True)
        kept = np.array(getattr(st[0], f"kept_{side}"))
        assert np.array_equal(kept, (u0 * u1).sum(-1) < threshold)
        for layer, x in ((0, x0), (1, x1)):
            got = np.array(M.get_kv(st[layer])[0 if side == "keys" else 1])
            assert np.array_equal(got[:, :, :m][kept], x[kept])  # retained: bit-exact
            merged = ~kept
            np.testing.assert_allclose(np.linalg.norm(got[:, :, :m][merged], axis=-1),
                                       np.linalg.norm(x[merged], axis=-1), rtol=1e-5)
            assert np.array_equal(got[:, :, m:], np.array(seen[layer][:, :, m:]) * scale)  # exact
        n = mc.counts(st[0])
        assert n["merged"] + n["retained"] + n["exact"] == 30 and n["exact"] == 1
    if threshold == -1.0:  # every token merged: the merge layer holds no row of its own
        assert st[1].own_keys.shape[2] == 0 and mc.counts(st[0])["retained"] == 0


def test_identical_layers_merge_losslessly():
    record, st = _layers(3, group_size=3, start_frac=0.0, retention_threshold=0.99)
    record, st, seen = _run(record, st, (12, 1, 5, 1), same=True)
    assert mc.counts(st[0]) == {"merged": 18, "retained": 0, "exact": 1}
    for s in st:
        for got, want in zip(M.get_kv(s), (seen[0], -seen[0] / 2)):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)


def test_groups_roles_and_layers_below_start_untouched():
    assert mc.groups(30, 0.5, 2) == [(15, 16), (17, 18), (19, 20), (21, 22), (23, 24), (25, 26), (27, 28)]
    assert mc.groups(5, 0.0, 3) == [(0, 1, 2), (3, 4)]
    assert mc.groups(4, 0.5, 1) == []
    record, st = _layers(5, start_frac=0.5, retention_threshold=-1.0)
    assert record.primary == (-1, -1, 2, 2, -1)  # layer 4: a last group of one, untouched
    assert [s.role for s in st] == ["primary", "primary", "primary", "merge", "primary"]
    record, st, seen = _run(record, st, (9, 1, 1))
    for i in (0, 1, 4):
        assert st[i].norm_keys.shape[2] == 0
        assert mx.array_equal(M.get_kv(st[i])[0], seen[i]).item()
    assert mc.counts(st[2]) == {"merged": 10, "retained": 0, "exact": 1}
    with pytest.raises(ValueError, match="layer 3 has role='primary'"):
        M.model_init([M.spec.defaults] * 5)
    with pytest.raises(ValueError, match="layers disagree on group_size"):
        per = [M.spec.defaults | p for p in M.per_layer_params(2, {})]
        M.model_init([per[0], per[1] | {"group_size": 3}])


def test_a_group_of_three_folds_its_directions():
    """e = slerp(slerp(u_0, u_1, t), u_2, t); retained iff u_1 or u_2 is below the threshold
    against u_0."""
    record, st = _layers(3, h=1, group_size=3, start_frac=0.0, retention_threshold=0.1)
    record, st, seen = _run(record, st, (16, 1), h=1)
    x = [np.array(s[0, 0, :16]) for s in seen]
    u = [v / np.linalg.norm(v, axis=-1, keepdims=True) for v in x]
    kept = ((u[0] * u[1]).sum(-1) < 0.1) | ((u[0] * u[2]).sum(-1) < 0.1)
    assert np.array_equal(np.array(st[0].kept_keys)[0, 0], kept) and 0 < kept.sum() < 16
    e = mc.slerp(mc.slerp(mx.array(u[0]), mx.array(u[1]), 0.5), mx.array(u[2]), 0.5)
    got = np.array(M.get_kv(st[2])[0])[0, 0, :16]
    want = np.linalg.norm(x[2], axis=-1, keepdims=True) * np.array(e)
    np.testing.assert_allclose(got[~kept], want[~kept], rtol=1e-5, atol=1e-6)
    assert np.array_equal(got[kept], x[2][kept])


@pytest.mark.parametrize("role", ["primary", "merge"])
def test_a_layer_alone_passes_through(role):
    x = mx.array(np.random.default_rng(3).standard_normal((2, 2, 9, 16)).astype(np.float32))
    st = M.update(M.update(M.init(2, 2, 16, role=role), x, x), x[:, :, :1], x[:, :, :1])
    assert mc.counts(st) == {"merged": 0, "retained": 0, "exact": 10}
    assert mx.array_equal(M.get_kv(st)[0], mx.concatenate([x, x[:, :, :1]], axis=2)).item()


def test_backends_agree_through_layer_update():
    record, st = _layers(4, backend="reference", start_frac=0.0, retention_threshold=0.0)
    twin_record, twin = _layers(4, backend="mlx", start_frac=0.0, retention_threshold=0.0)
    record, st, _ = _run(record, st, (10, 1, 4, 1), seed=5)
    twin_record, twin, _ = _run(twin_record, twin, (10, 1, 4, 1), seed=5)
    for a, b in zip(st, twin):
        for f in ("kept_keys", "kept_values", "own_key_index", "own_value_index"):
            assert np.array_equal(np.array(getattr(a, f)), np.array(getattr(b, f))), f
        for x, y in zip(M.get_kv(a), M.get_kv(b)):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-5)
        assert M.nbytes(a) == M.nbytes(b)

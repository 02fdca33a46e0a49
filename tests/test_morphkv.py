"""MorphKV: a hand-computed case on every backend, the protected voters and their attention
profiles, and profiles carried across proxy and real-query updates."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.testing import by_position

from tests._helpers import BACKENDS, pos, rows, softmax


@pytest.mark.parametrize("backend", BACKENDS)
def test_morphkv_by_hand(backend):
    # d = 1, keys t0..t3 = 1, 0, -1, 1 (values = keys); window 2: voters t2 and t3 (their keys
    # as queries). t2 over t0..t2: softmax(-1, 0, 1) = .0900, .2447, .6652.
    # t3 over t0..t3: softmax(1, 0, -1, 1) = .3995, .1470, .0541, .3995.
    # Sums: t0 .4895, t1 .3917, t2 .7193; t3 (newest, window - 1 = 1) is protected.
    # Budget 3, no sinks: t3, t2, t0 stay; t1 goes.
    k = rows([1.0], [0.0], [-1.0], [1.0])
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, backend=backend)
    st = velox.morphkv_update(st, k[:, :, :3], k[:, :, :3])
    st = velox.morphkv_update(st, k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    # Max instead of sum: t0 .3995, t1 .2447, t2 .6652: the same choice.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, aggregate="max", backend=backend)
    st = velox.morphkv_update(velox.morphkv_update(st, k[:, :, :3], k[:, :, :3]), k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    # TOVA's rule (window 1): t3 alone votes .3995, .1470, .0541, .3995: t2 goes.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=1, backend=backend)
    st = velox.morphkv_update(velox.morphkv_update(st, k[:, :, :3], k[:, :, :3]), k[:, :, 3:], k[:, :, 3:])
    assert pos(st) == [0, 1, 3]
    # Real queries equal to the keys: t2's profile is stored by the first update and votes with
    # t3's, so the result is the proxy's; afterwards the state holds t3's profile over the
    # kept rows t0, t2, t3.
    st = velox.morphkv_init(1, 1, 1, budget=3, n_sink=0, window=2, backend=backend)
    st = velox.morphkv_update(st, k[:, :, :3], k[:, :, :3], queries=k[:, :, :3])
    assert np.allclose(np.array(by_position(st, "profiles")).ravel(), softmax([-1, 0, 1]), atol=1e-6)
    st = velox.morphkv_update(st, k[:, :, 3:], k[:, :, 3:], queries=k[:, :, 3:])
    assert pos(st) == [0, 2, 3]
    assert np.allclose(np.array(by_position(st, "profiles")).ravel(), softmax([1, 0, -1, 1])[[0, 2, 3]], atol=1e-6)
    # Bytes: 3 kept rows x (key, value) x 4 B + positions 12 + next_pos 4 + one profile 3 x 4 B.
    assert velox.morphkv_bytes(st) == 24 + 12 + 4 + 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_morphkv_protects_the_next_voters(backend):
    rng = np.random.default_rng(3)
    st = velox.morphkv_init(1, 2, 8, budget=10, n_sink=2, window=4, backend=backend)
    for s in (15, 1, 1, 5, 1):
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        q = mx.array(rng.standard_normal((1, 4, s, 8)).astype(np.float32))
        cand = np.concatenate([np.array(st.keys), np.array(k)], axis=2)  # [1, 2, N, 8]
        cand_pos = np.concatenate([np.array(st.positions)[0], np.array(st.next_pos)[0, :, None]
                                   + np.arange(s)], axis=-1)  # [2, N]
        st = velox.morphkv_update(st, k, k, queries=q)
        seen = int(np.array(st.next_pos)[0, 0])
        p = np.array(by_position(st, "positions"))
        assert (p[..., -3:] == np.arange(seen - 3, seen)).all()  # window - 1 newest stay
        prof = np.array(by_position(st, "profiles"))
        assert prof.shape == (1, 2, 10, 3)  # profiles of the 3 newest tokens over the kept rows
        for j in range(2):  # the newest token's profile: its 2 query heads' mean attention over
            # the candidates at this update, read at the rows that stayed
            logits = np.array(q)[0, 2 * j:2 * j + 2, -1] @ cand[0, j].T / np.sqrt(8)
            want = np.mean([softmax(row) for row in logits], axis=0)
            at = [int(np.flatnonzero(cand_pos[j] == x)[0]) for x in p[0, j]]  # slots: any order
            assert np.allclose(prof[0, j, :, -1], want[at], atol=1e-6)
        assert np.all(prof[0, :, -1, :2] == 0)  # older voters give the newest token nothing


def test_morphkv_profiles_carry_across_proxy_and_real_query_updates():
    """Profiles are per kv head, so updates may switch between real queries (of any group
    size) and the key proxy; both backends agree on every state."""
    rng = np.random.default_rng(6)
    states = {b: velox.morphkv_init(1, 2, 8, budget=12, n_sink=1, window=4, backend=b)
              for b in ("reference", "mlx")}
    for s, groups in ((16, 2), (1, None), (1, 3), (3, None), (1, 2), (1, 1)):
        k = mx.array(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
        q = None if groups is None else mx.array(rng.standard_normal((1, 2 * groups, s, 8)).astype(np.float32))
        states = {b: velox.morphkv_update(st, k, k, queries=q) for b, st in states.items()}
        ref, got = states["reference"], states["mlx"]
        assert np.array_equal(np.array(ref.positions), np.array(got.positions))  # same slots
        assert np.allclose(np.array(ref.profiles), np.array(got.profiles), atol=1e-6)
        assert got.profiles.shape == (1, 2, 12, 3)

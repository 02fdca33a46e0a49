"""SqueezeAttention: the concentration and budgets by hand, the reallocation driven layer by
layer, strength 0 as exactly H2O in every layer, and budgets that sum to the total."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.methods.squeeze import concentration, squeeze_budgets
from velox.registry import get_method

from tests._helpers import BACKENDS, MATCHED, assert_same_rows, pos, rows, stream


def test_squeeze_concentration_and_budgets_by_hand():
    same = mx.broadcast_to(mx.array([1.0, 2.0]), (1, 1, 3, 2))
    assert np.allclose(np.array(concentration(same)), 1.0)                    # identical: 1
    assert np.allclose(np.array(concentration(rows([1, 0], [0, 3]))), 0.0)   # orthogonal: 0
    assert np.allclose(np.array(concentration(rows([1, 1], [3, 0]))),        # scale-invariant
                       np.array(concentration(rows([2, 2], [1, 0]))))
    assert np.array(concentration(rows([1, 1]))).tolist() == [[0.0]]          # one key: 0
    # c = .5, 0, 1 -> importance 1 - c = .5, 1, 0, mean .5 -> w = 1, 2, 0. Average 10,
    # strength 1: shares 10, 20, 0; floor 3 lifts the last to 3 and takes its 3 from the
    # excess over the floor (7, 17) pro rata: 3 + 21 * 7/24 = 9.125, 3 + 21 * 17/24 = 17.875
    # -> 9, 17, 3 (29); the unit left goes to the larger fraction: 9, 18, 3.
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 1.0, floor=3) == [9, 18, 3]
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 0.5, floor=3) == [10, 15, 5]   # 10 (.5 + .5 w)
    assert squeeze_budgets([0.5, 0.0, 1.0], 10, 0.0, floor=3) == [10, 10, 10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_reallocation_by_hand(backend):
    # Two layers, average budget 10, floor n_sink + grace + 1 = 2. The first forward's keys are
    # identical in layer 0 (c = 1) and the basis vectors e1..e4 three times in layer 1:
    # |sum u|^2 = 36, c = (36 - 12) / (12 * 11) = 2/11. Importance 0, 9/11 -> w = 0, 2,
    # shares 0, 20; the floor lifts layer 0 to 2, layer 1 keeps 20 - 2 = 18.
    m = get_method("squeeze")
    params = dict(budget=10, n_sink=1, grace=0, decay=1.0, strength=1.0)
    record = m.model_init([params, params])
    states = [velox.squeeze_init(1, 1, 4, backend=backend, **params) for _ in range(2)]
    prompt = [mx.broadcast_to(mx.array([1.0, 0, 0, 0]), (1, 1, 12, 4)),
              mx.array(np.tile(np.eye(4, dtype=np.float32), (3, 1))[None, None])]
    for layer in range(2):
        x = prompt[layer]
        record, states[layer] = m.layer_update(record, layer, states[layer], x, x)
    assert np.allclose(np.array(record.concentration), [1, 2 / 11], atol=1e-6)
    assert record.resolved and tuple(record.budgets) == (2, 18)
    assert [len(pos(s)) for s in states] == [10, 10]        # the first forward used the average
    for layer in range(2):                                  # the next forward adopts them
        record, states[layer] = m.layer_update(record, layer, states[layer], prompt[layer][:, :, :3],
                                               prompt[layer][:, :, :3])
    assert [s.budget for s in states] == [2, 18] and [len(pos(s)) for s in states] == [2, 13]


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_strength_zero_is_h2o_in_every_layer(backend):
    m = get_method("squeeze")
    params = dict(MATCHED, grace=5, decay=0.9, strength=0.0)
    n_layers = 3
    record = m.model_init([params] * n_layers)
    sq = [velox.squeeze_init(2, 2, 16, backend=backend, **params) for _ in range(n_layers)]
    h2o = [velox.h2o_init(2, 2, 16, grace=5, decay=0.9, backend=backend, **MATCHED)
           for _ in range(n_layers)]
    for k, v, q in stream(4, groups=2):
        for layer in range(n_layers):
            lk, lv = k * (layer + 1), v - layer   # a different geometry per layer
            record, sq[layer] = m.layer_update(record, layer, sq[layer], lk, lv, queries=q)
            h2o[layer] = velox.h2o_update(h2o[layer], lk, lv, queries=q)
            assert_same_rows(sq[layer], h2o[layer])
    assert record.resolved and tuple(record.budgets) == (24, 24, 24)


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeeze_budgets_sum_to_the_total(backend):
    m = get_method("squeeze")
    params = dict(budget=20, n_sink=2, grace=3, decay=0.95, strength=1.0)
    n_layers = 4
    record = m.model_init([params] * n_layers)
    states = [velox.squeeze_init(1, 2, 8, backend=backend, **params) for _ in range(n_layers)]
    rng = np.random.default_rng(8)
    direction = rng.standard_normal(8).astype(np.float32)
    held = [0] * n_layers
    for s in (30, 10, 1, 1, 1):
        budgets = record.budgets  # in force for this forward
        for layer in range(n_layers):  # layer l's keys share a direction with weight l
            x = rng.standard_normal((1, 2, s, 8)).astype(np.float32) + layer * direction
            x = mx.array(x)
            record, states[layer] = m.layer_update(record, layer, states[layer], x, x)
        held = [min(b, n + s) for b, n in zip(budgets, held)]
        assert [len(pos(st)) for st in states] == held
        assert record.resolved and sum(record.budgets) == n_layers * 20
    # Concentrated layers (the shared direction dominates) give budget to diffuse ones.
    assert list(record.budgets) == sorted(record.budgets, reverse=True)
    assert record.budgets[0] > 20 > record.budgets[-1] >= 2 + 3 + 1

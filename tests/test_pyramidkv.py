"""PyramidKV: the layer budget schedule by hand, a layer's rule (SnapKV's) by hand and as an
exact equality, and the per-layer budgets driven layer by layer."""

import pytest

import velox
from velox.crosslayer import round_to_total
from velox.methods.pyramidkv import pyramid_budgets
from velox.registry import get_method

from tests._helpers import BACKENDS, assert_same_rows, pos, rows, stream


def test_pyramid_budgets_by_hand():
    # 4 layers, average 10, 2 reserved (sinks + window): free 8, top 8/2 = 4, bottom 16 - 4 = 12,
    # step 8/3: shares 12, 9.33, 6.67, 4 (sum 32). Floors 12, 9, 6, 4 (31); the one unit left
    # goes to the largest fraction (.67, layer 2): 12, 9, 7, 4; plus 2 reserved each.
    assert pyramid_budgets(4, 10, 2.0, reserved=2) == [14, 11, 9, 6]
    assert pyramid_budgets(4, 10, 1.0, reserved=2) == [10, 10, 10, 10]   # beta 1: flat
    assert pyramid_budgets(1, 10, 5.0) == [10]
    assert round_to_total([2.5, 2.5, 1.0], 6) == [3, 2, 1]               # ties: earlier entry


@pytest.mark.parametrize("backend", BACKENDS)
def test_pyramidkv_by_hand(backend):
    # Within a layer the rule is SnapKV's: prompt keys (d=1) 0, 1, 0, 3, 2, window = t4 (its
    # key 2 is the proxy query): logits 0, 2, 0, 6, 4; sink t0 and window t4 kept, t3 wins the
    # last slot. A decode token is appended.
    st = velox.pyramidkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=1, kernel_size=1, backend=backend)
    k = rows([0.0], [1.0], [0.0], [3.0], [2.0])
    st = velox.pyramidkv_update(st, k, k)
    assert pos(st) == [0, 3, 4]
    assert pos(velox.pyramidkv_update(st, rows([5.0]), rows([5.0]))) == [0, 3, 4, 5]


def test_pyramidkv_layer_is_snapkv():
    for k, v, q in [stream(6, chunks=(40, 1, 25, 1), groups=g)[0] for g in (0, 2)]:
        kw = dict(budget=30, obs_window=6, n_sink=2, kernel_size=3, pooling="maxpool")
        a = velox.pyramidkv_update(velox.pyramidkv_init(2, 2, 16, beta=7.0, **kw), k, v, queries=q)
        b = velox.snapkv_update(velox.snapkv_init(2, 2, 16, **kw), k, v, queries=q)
        assert_same_rows(a, b)


@pytest.mark.parametrize("n_layers,budget,beta",
                         [(30, 512, 2.0), (7, 40, 20.0), (5, 13, 1.5), (2, 50, 1.0)])
def test_pyramidkv_schedule(n_layers, budget, beta):
    params = dict(budget=budget, obs_window=8, n_sink=4, beta=beta)
    per_layer = get_method("pyramidkv").per_layer_params(n_layers, params)
    budgets = [p["budget"] for p in per_layer]
    assert sum(budgets) == n_layers * budget                            # exact
    assert all(x >= y for x, y in zip(budgets, budgets[1:]))            # non-increasing
    assert all(x > 4 + 8 for x in budgets)                               # each layer valid
    assert all(p["beta"] == beta and p["obs_window"] == 8 for p in per_layer)
    steeper = pyramid_budgets(n_layers, budget, beta + 1.0, reserved=12)
    assert steeper[0] - steeper[-1] >= budgets[0] - budgets[-1]          # larger beta, wider spread


def test_pyramidkv_layers_keep_their_budgets():
    m = get_method("pyramidkv")
    per_layer = m.per_layer_params(4, dict(budget=20, obs_window=4, n_sink=2, beta=3.0))
    states = [velox.pyramidkv_init(2, 2, 16, **p) for p in per_layer]
    for k, v, q in stream(7, chunks=(30, 12, 1, 1)):
        states = [velox.pyramidkv_update(s, k, v, queries=q) for s in states]
    kept = [len(pos(s)) for s in states]
    budgets = [p["budget"] for p in per_layer]
    assert kept == [b + 2 for b in budgets]                  # cut after the chunks, then 2 decodes
    assert sum(budgets) == 4 * 20

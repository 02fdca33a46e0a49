"""mlx-lm's batch protocol on velox caches (``velox.adapters.batch.VeloxBatchCache``, Stage A):
merge / extract / filter / extend / deepcopy keep every row equal to its single cache, the
getters sum or stack the rows, prepare/finalize leave a row without valid tokens untouched,
and merge refuses what one batch cannot run."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from velox.adapters import mlxlm
from velox.adapters.batch import VeloxBatchCache
from velox.adapters.mlxlm import VeloxCache, make_cache

BUDGET = 6


def _leaves(c: VeloxCache) -> list:
    st = c.velox_state
    return [] if st is None else [(k, v) for k, v in tree_flatten(st)]


def assert_same(a: VeloxCache, b: VeloxCache, *, close: bool = False) -> None:
    """Two single caches hold the same thing: offset, size, positions, every state field and
    the tail, bit for bit (``close``: floating arrays within a relative 1e-4 of the field's
    largest magnitude, for a row computed in a batch, whose projections the BLAS may round
    differently in the last bits)."""
    assert isinstance(a, VeloxCache) and isinstance(b, VeloxCache)
    assert (a.offset, a.size(), a.empty()) == (b.offset, b.size(), b.empty())
    assert a.nbytes == b.nbytes
    assert bool(mx.array_equal(a.positions(), b.positions()))
    la, lb = _leaves(a), _leaves(b)
    assert [k for k, _ in la] == [k for k, _ in lb]
    for (name, x), (_, y) in zip(la, lb):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and _equal(x, y, close), name
        else:
            assert x == y, name
    assert (a.tail is None) == (b.tail is None)
    if a.tail is not None:
        assert all(_equal(x, y, close) for x, y in zip(a.tail, b.tail))


def _equal(x: mx.array, y: mx.array, close: bool) -> bool:
    if not close or not mx.issubdtype(x.dtype, mx.floating):
        return bool(mx.array_equal(x, y))
    x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
    return x.shape == y.shape and bool(np.allclose(x, y, rtol=0, atol=1e-4 * (np.abs(y).max() + 1e-30)))


def feed(model, caches, tokens, step=4):
    """Run ``tokens`` through ``model`` alone (batch of one) in chunks of ``step``, then one
    token at a time for the last three."""
    tokens = list(tokens)
    body, tail = tokens[:-3], tokens[-3:]
    for i in range(0, len(body), step):
        model(mx.array(body[i:i + step])[None], cache=caches)
    for t in tail:
        model(mx.array([[t]]), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def rows_for(model, method="tova", lengths=(11, 0, 7), **params):
    """One prompt cache per length (a length 0 row is an empty cache)."""
    params = params or dict(budget=BUDGET)
    out = []
    for i, n in enumerate(lengths):
        caches = make_cache(model, method, **params)
        if n:
            feed(model, caches, [(7 * i + 3 * j) % 97 for j in range(n)])
        out.append(caches)
    return out


def batch_of(rows, layer=0):
    return VeloxCache.merge([r[layer] for r in rows])


@pytest.mark.parametrize("method,params", [("tova", dict(budget=BUDGET)),
                                           ("tova", dict(budget=BUDGET, decode="append", decode_cap=4)),
                                           ("kivi", dict(residual_length=2)),
                                           ("squeeze", dict(budget=BUDGET, grace=2, n_sink=2))])
def test_extract_of_merge_equals_each_row(tiny_llama, method, params):
    rows = rows_for(tiny_llama, method, **params)
    for layer in range(len(rows[0])):
        batch = batch_of(rows, layer)
        assert isinstance(batch, VeloxBatchCache) and len(batch.rows) == 3
        for i, r in enumerate(rows):
            assert_same(batch.extract(i), r[layer])
            assert batch.rows[i] is not r[layer]  # merge copies: the given caches stay as they are


def test_filter_extend_deepcopy_and_merge_again(tiny_llama):
    rows = rows_for(tiny_llama, lengths=(11, 0, 7, 5))
    batch = VeloxCache.merge([r[0] for r in rows[:3]])
    batch.filter([2, 0])
    assert_same(batch.extract(0), rows[2][0])
    assert_same(batch.extract(1), rows[0][0])
    batch.extend(VeloxCache.merge([rows[3][0], rows[1][0]]))
    for i, r in enumerate([2, 0, 3, 1]):
        assert_same(batch.extract(i), rows[r][0])
    twin = copy.deepcopy(batch)
    for i, r in enumerate([2, 0, 3, 1]):
        assert_same(twin.extract(i), rows[r][0])
    # An extracted cache merges again, with a cache that never was in a batch.
    again = VeloxCache.merge([batch.extract(2), rows[0][0]])
    assert_same(again.extract(0), rows[3][0])
    assert_same(again.extract(1), rows[0][0])
    # filter with an mx.array of indices (as a batch's own arithmetic may give)
    batch.filter(mx.array([3]))
    assert len(batch.rows) == 1
    assert_same(batch.extract(0), rows[1][0])


def test_a_copy_and_an_extracted_row_are_independent_of_the_batch(tiny_llama):
    rows = rows_for(tiny_llama, lengths=(9, 6))
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    alone = copy.deepcopy(rows[0])
    kept = [b.extract(0) for b in batch]
    snapshot = copy.deepcopy(batch)
    tiny_llama(mx.array([[5], [6]]), cache=batch)  # one decode step of the batch
    tiny_llama(mx.array([[5]]), cache=alone)       # row 0 alone
    mx.eval([c.state for c in batch] + [c.state for c in alone])
    for layer in range(len(batch)):
        assert_same(kept[layer], rows[0][layer])          # extracted before: unchanged
        assert_same(snapshot[layer].extract(0), rows[0][layer])
        assert_same(batch[layer].extract(0), alone[layer], close=True)  # advanced as alone
        assert batch[layer].extract(1).offset == rows[1][layer].offset + 1


def test_getters(tiny_llama):
    rows = rows_for(tiny_llama, lengths=(11, 0, 7))
    batch = batch_of(rows)
    singles = [r[0] for r in rows]
    assert batch.nbytes == sum(c.nbytes for c in singles) > 0
    assert batch.size() == max(c.size() for c in singles) == BUDGET
    assert not batch.empty() and batch_of(rows_for(tiny_llama, lengths=(0, 0))).empty()
    assert len(batch.state) == sum(len(c.state) for c in singles)
    off = batch.offset
    assert off.dtype == mx.int32 and off.tolist() == [11, 0, 7]
    assert not batch.is_trimmable() and batch.trim(0) == 0
    with pytest.raises(ValueError, match="cannot be trimmed"):
        batch.trim(1)
    with pytest.raises(AttributeError):
        batch.state = []
    with pytest.raises(ValueError, match="kv_bits"):
        batch.to_quantized
    assert batch.make_mask(1) is None and batch.make_mask(5) == "causal"
    with pytest.raises(ValueError, match="sliding-window"):
        batch.make_mask(5, window_size=4)


def test_a_row_without_valid_tokens_is_left_bit_identical(tiny_llama):
    """A right-padded chunk where row 1 has no real token: its state does not change at all,
    and row 0 gets what it gets alone."""
    rows = rows_for(tiny_llama, lengths=(9, 6))
    before = [copy.deepcopy(r) for r in rows]
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    for c in batch:
        c.prepare(lengths=[3, 0], right_padding=[0, 3])
    chunk = mx.array([[4, 8, 15], [0, 0, 0]])
    tiny_llama(chunk, cache=batch)
    for c in batch:
        c.finalize()
    mx.eval([c.state for c in batch])
    tiny_llama(chunk[:1], cache=before[0])
    mx.eval([c.state for c in before[0]])
    for layer, c in enumerate(batch):
        assert_same(c.extract(1), rows[1][layer])  # bit for bit
        assert_same(c.extract(0), before[0][layer], close=True)
    assert batch[0].offset.tolist() == [12, 6]


def test_ragged_chunk_gives_each_row_its_own_tokens(tiny_llama):
    """Rows of 2 and 4 valid tokens in one right-padded chunk of 4, then a left-padded chunk
    on an empty batch: every row as alone."""
    rows = rows_for(tiny_llama, lengths=(9, 6))
    alone = [copy.deepcopy(r) for r in rows]
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    for c in batch:
        c.prepare(lengths=[2, 4], right_padding=[2, 0])
    tiny_llama(mx.array([[1, 2, 0, 0], [3, 4, 5, 6]]), cache=batch)
    for c in batch:
        c.finalize()
    tiny_llama(mx.array([[1, 2]]), cache=alone[0])
    tiny_llama(mx.array([[3, 4, 5, 6]]), cache=alone[1])
    for layer, c in enumerate(batch):
        for i in range(2):
            assert_same(c.extract(i), alone[i][layer], close=True)
    empty = rows_for(tiny_llama, lengths=(0, 0))
    alone = [copy.deepcopy(r) for r in empty]
    batch = [VeloxCache.merge([r[i] for r in empty]) for i in range(len(empty[0]))]
    for c in batch:
        c.prepare(left_padding=[1, 0])
    tiny_llama(mx.array([[0, 7, 8], [9, 10, 11]]), cache=batch)
    for c in batch:
        c.finalize()
    tiny_llama(mx.array([[7, 8]]), cache=alone[0])
    tiny_llama(mx.array([[9, 10, 11]]), cache=alone[1])
    for layer, c in enumerate(batch):
        for i in range(2):
            assert_same(c.extract(i), alone[i][layer], close=True)


def test_merge_refuses_what_one_batch_cannot_run(tiny_llama):
    tova = rows_for(tiny_llama, lengths=(5,))[0]
    other_budget = rows_for(tiny_llama, lengths=(5,), budget=BUDGET + 2)[0]
    h2o = rows_for(tiny_llama, "h2o", lengths=(5,), budget=BUDGET, grace=1, n_sink=1)[0]
    appended = rows_for(tiny_llama, lengths=(5,), budget=BUDGET, decode="append")[0]
    with pytest.raises(ValueError, match="different method"):
        VeloxCache.merge([tova[0], h2o[0]])
    with pytest.raises(ValueError, match="different params"):
        VeloxCache.merge([tova[0], other_budget[0]])
    with pytest.raises(ValueError, match="different decode"):
        VeloxCache.merge([tova[0], appended[0]])
    with pytest.raises(ValueError, match="different layer"):
        VeloxCache.merge([tova[0], tova[1]])
    with pytest.raises(ValueError, match="velox caches"):
        VeloxCache.merge([tova[0], KVCache()])
    with pytest.raises(ValueError, match="different method"):
        VeloxCache.merge([tova[0], tova[0]]).extend(VeloxCache.merge([h2o[0]]))


def test_merge_refuses_several_rows_without_the_attention_wrapper(tiny_llama):
    mlxlm.uninstall_query_capture()
    try:
        a = make_cache(tiny_llama, "tova", budget=BUDGET, real_queries=False)
        b = make_cache(tiny_llama, "tova", budget=BUDGET, real_queries=False)
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            VeloxCache.merge([a[0], b[0]])
        # mlx-lm decides batching from hasattr(cache, "merge") (its server's is_batchable):
        # caches of an unrouted model have none, so such a model is served one request at a time
        assert not any(hasattr(c, "merge") for c in a)
        # One row runs anyway: the batch of one hands the row's own result to the model.
        one = [VeloxCache.merge([c]) for c in a]
        alone = make_cache(tiny_llama, "tova", budget=BUDGET, real_queries=False)
        x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
        out, want = tiny_llama(x, cache=one), tiny_llama(x, cache=alone)
        assert bool(mx.array_equal(out, want))
        for c, w in zip(one, alone):
            assert_same(c.extract(0), w)
    finally:
        mlxlm.install_query_capture()


def test_caches_of_a_routed_model_offer_merge(tiny_llama):
    assert all(hasattr(c, "merge") for c in make_cache(tiny_llama, "tova", budget=BUDGET))


def test_cross_layer_rows_keep_one_record_per_row(tiny_llama):
    """A cross-layer method: the layers of one extracted (or copied) row share one record,
    which is not the batch's and not the source's."""
    rows = rows_for(tiny_llama, "squeeze", lengths=(9, 6), budget=BUDGET, grace=2, n_sink=2)
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    for i in range(2):
        records = {id(c.rows[i]._model) for c in batch}
        assert len(records) == 1 and rows[i][0]._model is not batch[0].rows[i]._model
    assert batch[0].rows[0]._model is not batch[0].rows[1]._model
    extracted = [c.extract(1) for c in batch]
    assert len({id(c._model) for c in extracted}) == 1
    assert extracted[0]._model is not batch[0].rows[1]._model
    copied = copy.deepcopy(batch)
    assert len({id(c.rows[0]._model) for c in copied}) == 1
    assert copied[0].rows[0]._model is not batch[0].rows[0]._model
    assert not any("_velox_twin" in r[0]._model.__dict__ for r in rows)
    # The batch continues as each row alone would.
    alone = [copy.deepcopy(r) for r in rows]
    tiny_llama(mx.array([[5], [6]]), cache=batch)
    for i, t in enumerate((5, 6)):
        tiny_llama(mx.array([[t]]), cache=alone[i])
    for layer, c in enumerate(batch):
        for i in range(2):
            assert_same(c.extract(i), alone[i][layer], close=True)
    rec = [np.array(x) for _, x in tree_flatten(batch[0].rows[0]._model.record) if isinstance(x, mx.array)]
    want = [np.array(x) for _, x in tree_flatten(alone[0][0]._model.record) if isinstance(x, mx.array)]
    assert len(rec) == len(want)
    assert all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(rec, want))


def _decode(model, batch_layers, alone_rows, tokens):
    """One decode step: ``tokens[i]`` for row ``i`` of the batch and of each row alone."""
    model(mx.array([[t] for t in tokens]), cache=batch_layers)
    for caches, t in zip(alone_rows, tokens):
        model(mx.array([[t]]), cache=caches)
    mx.eval([c.state for c in batch_layers] + [c.state for r in alone_rows for c in r])


@pytest.mark.parametrize("method,params", [("tova", dict(budget=BUDGET)),
                                           ("h2o", dict(budget=BUDGET, n_sink=1, grace=2))])
def test_rows_of_one_slot_layout_run_joined_as_one_state(tiny_llama, method, params):
    """Rows whose caches are full at the budget run as one batched state (joined mode): a
    decode step vectorised over the rows, each row still evolving as alone, through filter,
    extend (which splits the batch until the next decode step), extract and deepcopy."""
    rows = rows_for(tiny_llama, method, lengths=(11, 9, 7), **params)
    alone = copy.deepcopy(rows)
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    assert not any(b.joined for b in batch)
    for step in range(2):
        _decode(tiny_llama, batch, alone, [5 + step, 6, 7])
        assert all(b.joined for b in batch)
    for layer, b in enumerate(batch):
        assert b.nbytes == sum(r[layer].nbytes for r in alone)
        assert b.offset.tolist() == [r[layer].offset for r in alone]
        for i, r in enumerate(alone):
            assert_same(b.extract(i), r[layer], close=True)
    for b in batch:
        b.filter([2, 0])  # still joined: the kept rows' states taken out of the one state
        assert b.joined
    alone = [alone[2], alone[0]]
    _decode(tiny_llama, batch, alone, [8, 9])
    twin = copy.deepcopy(batch)
    extra = rows_for(tiny_llama, method, lengths=(8,), **params)
    for layer, b in enumerate(batch):
        b.extend(VeloxCache.merge([extra[0][layer]]))
        assert not b.joined and len(b.rows) == 3
    alone.append(copy.deepcopy(extra[0]))
    _decode(tiny_llama, batch, alone, [10, 11, 12])
    assert all(b.joined for b in batch)
    for layer, b in enumerate(batch):
        for i, r in enumerate(alone):
            assert_same(b.extract(i), r[layer], close=True)
        assert twin[layer].joined and twin[layer].offset.tolist() == [o - 1 for o in b.offset.tolist()[:2]]


def test_rows_of_different_slot_counts_stay_apart(tiny_llama):
    """A row whose cache is not yet full holds fewer slots: the batch keeps one state per row
    until every row's state has the same shape."""
    rows = rows_for(tiny_llama, lengths=(11, 5))  # 5 tokens: one slot short of the budget
    batch = [VeloxCache.merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    alone = copy.deepcopy(rows)
    _decode(tiny_llama, batch, alone, [5, 6])  # row 1 fills its last slot in this step
    assert not any(b.joined for b in batch)
    _decode(tiny_llama, batch, alone, [7, 8])
    assert all(b.joined for b in batch)
    for layer, b in enumerate(batch):
        for i, r in enumerate(alone):
            assert_same(b.extract(i), r[layer], close=True)

"""XQuant: a hand-worked pair of layers, the roles, reusing layers that hold no codes (their
bytes), reuse of identical data, the group's effective bits, anchor and reusers in step through
decode on both backends, a reusing layer alone. Through the adapter (saved, loaded, batched,
live memory): tests/test_crosslayer_adapter.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import velox.methods.xquant as xq
from velox.accounting import state_nbytes
from velox.registry import get_method

from tests._helpers import BACKENDS

M = get_method("xquant")


def _layers(n: int, *, b: int = 1, h: int = 2, d: int = 32, backend: str = "mlx", **params):
    """A record and ``n`` empty layer states, roles as make_cache gives them."""
    per = [M.spec.defaults | p for p in M.per_layer_params(n, params)]
    return M.model_init(per), [M.init(b, h, d, backend=backend, **p) for p in per]


def _forward(record, states, xs):
    """One forward: layer ``i`` absorbs ``xs[i] = (keys, values)``, layers in order."""
    for i, (k, v) in enumerate(xs):
        record, states[i] = M.layer_update(record, i, states[i], k, v)
    return record, states


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_pair(backend):
    """Group of two, 32 tokens, head_dim 32, window 0: the 32 tokens are coded at once.

    Anchor keys ``k0[t, c] = t``: each channel's group is 0..31, scale 31/3 = 10.333 (float16
    10.3359375), zero 0, codes ``round(t / 10.336)``: 0 for t = 0..5, 1 for 6..15, 2 for 16..25,
    3 for 26..31. The reusing layer's keys ``k1[t, c] = 2t + 1`` (1..63): its own scale 62/3 =
    20.667 (float16 20.671875), zero 1, on the anchor's codes: 1 (t = 0..5), 21.671875 (6..15),
    42.34375 (16..25), 63.015625 (26..31). Its residual ``k1 - that`` runs from -10.015625 (t =
    26) to 10 (t = 5); one bit: scale 20.015625, zero -10.015625, code 1 iff the residual is
    above zero + scale / 2 = -0.0078125 (no residual is that exactly), adding 10 or -10.015625.
    Values are the same numbers along the channels (``v0[t, c] = c``, ``v1[t, c] = 2c + 1``):
    per-token groups of 32 channels."""
    t = np.arange(32, dtype=np.float32)
    k0 = np.broadcast_to(t[:, None], (32, 32))
    v0 = np.broadcast_to(t[None, :], (32, 32))
    x = lambda a: mx.array(np.ascontiguousarray(a)[None, None])  # noqa: E731  [1, 1, 32, 32]
    record, st = _layers(2, h=1, backend=backend, window=0, residual_bits=1)
    record, st = _forward(record, st, [(x(k0), x(v0)), (x(2 * k0 + 1), x(2 * v0 + 1))])
    anchor, reuse = st
    codes = np.repeat([0, 1, 2, 3], [6, 10, 10, 6]).astype(np.float32)
    scale0, scale1 = np.float32(10.3359375), np.float32(20.671875)
    assert np.array_equal(np.array(anchor.key_scales)[0, 0, :, 0], np.full(32, scale0))
    assert np.array_equal(np.array(reuse.key_scales)[0, 0, :, 0], np.full(32, scale1))
    assert np.array_equal(np.array(reuse.key_zeros)[0, 0, :, 0], np.ones(32))
    k_anchor, v_anchor = (np.array(a)[0, 0] for a in M.get_kv(anchor))
    assert np.array_equal(k_anchor[:, 0], codes * scale0)
    approx = codes * scale1 + 1
    assert approx[[0, 6, 16, 26]].tolist() == [1, 21.671875, 42.34375, 63.015625]
    resid = 2 * t + 1 - approx
    assert resid.min() == -10.015625 and resid.max() == 10
    want = approx + np.where(resid > -0.0078125, 10.0, -10.015625)
    k_reuse, v_reuse = (np.array(a)[0, 0] for a in M.get_kv(reuse))
    assert np.array_equal(k_reuse, np.broadcast_to(want[:, None], (32, 32)))
    assert np.array_equal(v_reuse, np.broadcast_to(want[None, :], (32, 32)))
    # What each layer holds (bytes): the anchor its codes, the reusing layer none.
    # anchor: key and value codes 32 x 2 words x 4 B each, float16 scale and zero per group
    # (32 groups each side) = 256 + 128 + 256 + 128, next_pos 4 B.
    assert M.nbytes(anchor) == 256 + 128 + 256 + 128 + 4 == state_nbytes(anchor)
    # reusing: its scales and zeros (128 + 128), 1-bit residual codes (32 x 1 word x 4 B a
    # side) with their scales and zeros (128 a side), next_pos; its anchor's arrays uncounted.
    assert M.nbytes(reuse) == 128 + 128 + 2 * (128 + 128) + 4
    assert reuse.shared_key_codes is anchor.key_codes and reuse.shared_value_codes is anchor.value_codes
    assert reuse.key_codes.size == reuse.value_codes.size == 0


def test_roles_and_the_record():
    assert xq.roles(5, 2) == ["anchor", "reuse", "anchor", "reuse", "anchor"]
    assert xq.roles(4, 3) == ["anchor", "reuse", "reuse", "anchor"]
    assert xq.roles(3, 1) == ["anchor"] * 3
    record, states = _layers(5, group_size=3)
    assert record.anchors == (0, 0, 0, 3, 3) and record.source == -1
    assert [s.role for s in states] == ["anchor", "reuse", "reuse", "anchor", "reuse"]
    with pytest.raises(ValueError, match="layer 1 has role='anchor'; with group_size=2 it is 'reuse'"):
        M.model_init([M.spec.defaults] * 2)
    per = [M.spec.defaults | p for p in M.per_layer_params(2, {})]
    with pytest.raises(ValueError, match="layers disagree on base_bits"):
        M.model_init([per[0], per[1] | {"base_bits": 4}])
    with pytest.raises(ValueError, match="layers disagree on window"):
        M.model_init([per[0], per[1] | {"window": 0}])
    x = mx.zeros((1, 2, 3, 32))
    with pytest.raises(ValueError, match="reads the codes of layer 0, but the record holds layer -1"):
        M.layer_update(record, 1, states[1], x, x)
    with pytest.raises(ValueError, match="is 'anchor' in the record"):
        M.layer_update(record, 0, states[1], x, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_data_without_residual_reconstructs_as_coding_in_place(backend):
    """A reusing layer given its anchor's very rows and no residual bits has the anchor's
    scales and zeros (min/max of the same groups), hence its reconstruction, at every step."""
    rng = np.random.default_rng(0)
    record, st = _layers(2, b=2, h=1, backend=backend, window=4, residual_bits=0)
    alone = M.init(2, 1, 32, backend=backend, window=4, residual_bits=0)  # an anchor alone
    for s in (37, 1, 30, 1):
        k = mx.array(rng.standard_normal((2, 1, s, 32)).astype(np.float32))
        v = mx.array(rng.standard_normal((2, 1, s, 32)).astype(np.float32))
        record, st = _forward(record, st, [(k, v), (k, v)])
        alone = M.update(alone, k, v)
        for a, b, c in zip(M.get_kv(st[0]), M.get_kv(st[1]), M.get_kv(alone)):
            assert mx.array_equal(a, b).item() and mx.array_equal(a, c).item()
    assert xq.quantized_tokens(st[1]) == 64


@pytest.mark.parametrize("residual_bits", [0, 4])
@pytest.mark.parametrize("group_size", [2, 3])
def test_group_effective_bits(group_size, residual_bits):
    """Measured from nbytes with every token coded: (anchor + (g - 1) * reuse) / g bits an
    element, side data included, as ``effective_bits`` says."""
    rng = np.random.default_rng(1)
    record, st = _layers(group_size, h=2, d=64, window=0, residual_bits=residual_bits,
                         group_size=group_size)
    x = [(mx.array(rng.standard_normal((1, 2, 64, 64)).astype(np.float32)),) * 2
         for _ in range(group_size)]
    record, st = _forward(record, st, x)
    elements = 2 * 2 * 64 * 64  # keys and values, 2 heads, 64 tokens, 64 dims
    bits = [8 * (M.nbytes(s) - 4 * s.next_pos.size) / elements for s in st]  # next_pos aside
    assert bits[0] == 2 + 1  # 2-bit codes, a 16-bit scale and zero per 32
    assert all(b == (1 + residual_bits + (1 if residual_bits else 0)) for b in bits[1:])
    assert np.mean(bits) == xq.effective_bits(2, residual_bits, group_size)
    assert xq.effective_bits(2, 0, 2) == 2.0 and xq.effective_bits(2, 4, 2) == 4.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_anchor_and_reusers_stay_in_step_and_backends_agree(backend):
    rng = np.random.default_rng(2)
    record, st = _layers(4, group_size=2, h=1, backend=backend, window=6)
    twin_record, twin = _layers(4, group_size=2, h=1, backend="mlx", window=6)
    for s in (40, 1, 29, 2):
        xs = [(mx.array(rng.standard_normal((1, 1, s, 32)).astype(np.float32)),
               mx.array(rng.standard_normal((1, 1, s, 32)).astype(np.float32))) for _ in range(4)]
        record, st = _forward(record, st, xs)
        twin_record, twin = _forward(twin_record, twin, xs)
        counts = {(xq.quantized_tokens(x), x.exact_keys.shape[2]) for x in st}
        assert len(counts) == 1  # every layer codes the same tokens at the same step
        assert {int(x.next_pos.max()) for x in st} == {int(st[0].next_pos.min())}
        assert st[1].shared_key_codes is st[0].key_codes and st[3].shared_value_codes is st[2].value_codes
        assert record.source == 2 and record.key_codes is st[2].key_codes
        for a, b in zip(st, twin):  # the reference backend's states are the mlx backend's
            for x, y in zip(M.get_kv(a), M.get_kv(b)):
                np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-6, atol=1e-6)
    assert xq.quantized_tokens(st[0]) == 64


def test_a_reusing_layer_alone_keeps_its_tokens_exact():
    x = mx.array(np.random.default_rng(3).standard_normal((1, 2, 70, 32)).astype(np.float32))
    st = M.update(M.init(1, 2, 32, role="reuse", window=0), x, x)
    assert xq.quantized_tokens(st) == 0 and st.exact_keys.shape[2] == 70
    k, _ = M.get_kv(st)
    assert mx.array_equal(k, x.astype(mx.float16).astype(mx.float32)).item()


def test_group_size_one_is_kivi():
    """Every layer an anchor: each is KIVI at bits=base_bits, residual_length=window (codes,
    scales, zeros and exact window to the bit)."""
    from velox.methods import kivi

    rng = np.random.default_rng(4)
    record, st = _layers(2, group_size=1, window=5, base_bits=3)
    ref = [kivi.init(1, 2, 32, bits=3, residual_length=5) for _ in st]
    for s in (40, 1, 1, 30, 2):
        xs = [(mx.array(rng.standard_normal((1, 2, s, 32)).astype(np.float32)),) * 2 for _ in st]
        record, st = _forward(record, st, xs)
        ref = [kivi.update(r, *x) for r, x in zip(ref, xs)]
        for a, b in zip(st, ref):
            assert all(mx.array_equal(x, y).item() for x, y in zip(M.get_kv(a), kivi.get_kv(b)))
            assert mx.array_equal(a.key_codes, b.key_codes).item()
            assert mx.array_equal(a.value_scales, b.value_scales).item()
            assert M.nbytes(a) == kivi.nbytes(b) == state_nbytes(a)

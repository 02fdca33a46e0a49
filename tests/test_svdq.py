"""SVDq (velox.codecs.svdq, velox.methods.svdq): a hand-worked row on both twins, the schedule's
groups and bits, the rank guards, the fitted basis (orthonormal, frozen after the prefill), the
energy rank, reconstruction against the discarded energy, 0-bit channels at the mean, the bytes."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox import codec_cache
from velox.codecs import codes_nbytes, get_codec, numpy_tables, svdq
from velox.methods import svdq as method

FULL16 = "16,16,16,16,16,16,16,16"


def _keys(shape, seed=0, top=5.0, low=0.01):
    """Rows of decaying variance along a random orthonormal basis, plus an offset."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return ((rng.standard_normal(shape) * np.geomspace(top, low, d)) @ basis.T + 0.3).astype(np.float32)


def test_hand_worked_row():
    """d = 8, identity basis, zero mean, unit spreads, rank 8 at schedule 4,2,1,1,0,0,0,0
    (channels 0-3 at 4, 2, 1, 1 bits, 4-7 dropped), scale groups of 4 channels.
    Row (3, -1, 0.5, -0.25, 7, 7, 7, 7): group 0's scale is max |u| over its coded channels = 3
    (group 1 codes none: 0). Codes floor((u / 3 + 1) 2^(b-1)): channel 0 floor(2 * 8) = 16,
    clipped to 15, decoded ((15 + .5) / 8 - 1) 3 = 2.8125; channel 1 floor(4/3) = 1 ->
    (1.5 / 2 - 1) 3 = -0.75; channel 2 floor(7/6) = 1 -> (1.5 - 1) 3 = 1.5; channel 3
    floor(11/12) = 0 -> (0.5 - 1) 3 = -1.5; channels 4-7 decode to 0. Stream (LSB first):
    1111 | 10 | 1 | 0 = 15 + 16 + 64 = 95, one byte."""
    t = svdq.tables(8, {"rank": 8, "bit_schedule": "4,2,1,1,0,0,0,0", "group_size": 4})
    assert np.array(t.bits).tolist() == [4, 2, 1, 1, 0, 0, 0, 0] and t.total == 8
    row = np.array([[[[3.0, -1.0, 0.5, -0.25, 7.0, 7.0, 7.0, 7.0]]]], np.float32)
    want = [2.8125, -0.75, 1.5, -1.5, 0.0, 0.0, 0.0, 0.0]
    c = svdq.encode(t, mx.array(row))
    assert np.array(c.codes).ravel().tolist() == [95]
    assert np.array(c.scales).ravel().tolist() == [3.0, 0.0]
    np.testing.assert_array_equal(np.array(svdq.decode(t, c)).ravel(), want)
    tn = numpy_tables(t)
    cn = svdq.encode_np(tn, row)
    assert np.array_equal(cn.codes, np.array(c.codes)) and np.array_equal(cn.scales, np.array(c.scales))
    np.testing.assert_array_equal(svdq.decode_np(tn, cn).ravel(), want)
    q = np.zeros((1, 1, 1, 8), np.float32)
    q[..., 0], q[..., 4] = 2.0, 5.0  # scores read the codes: 2 * 2.8125 (channel 4 dropped)
    np.testing.assert_allclose(np.array(svdq.scores(t, mx.array(q), c)).ravel(), [5.625])
    np.testing.assert_allclose(svdq.scores_np(tn, q, cn).ravel(), [5.625])


@pytest.mark.parametrize("r,sizes", [(64, [8] * 8), (20, [3, 3, 3, 3, 2, 2, 2, 2]), (5, [1] * 5 + [0] * 3)])
def test_groups_split_the_rank_evenly(r, sizes):
    assert svdq.group_sizes(r) == sizes
    bits = svdq.channel_bits(r, 64, "8,4,2,1,1,0,0,0", auto=False)
    assert bits.tolist() == np.repeat([8, 4, 2, 1, 1, 0, 0, 0], sizes).tolist() + [0] * (64 - r)


@pytest.mark.parametrize("schedule", ["8,4,2,1,1,0,0,0", "8,8,4,4,2,2,1,1", "4,4,4,4,4,4,4,4"])
@pytest.mark.parametrize("r", [32, 48, 64])
def test_effective_bits_match_the_formula(schedule, r):
    """Each group of r / 8 channels holds r / 8 * schedule[g] bits; a key element
    (r / d) * mean(schedule); the stream is that many bits, whole bytes."""
    sched = svdq.parse_schedule(schedule)
    s = method.init(1, 1, 64, rank=r, bit_schedule=schedule)
    s = method.update(s, mx.array(_keys((1, 1, 80, 64))), mx.array(_keys((1, 1, 80, 64), 1)))
    bits = np.array(s.tables.bits)[0, 0].astype(int)
    per_group = bits.reshape(8, r // 8).sum(axis=1)
    assert per_group.tolist() == [r // 8 * b for b in sched]
    assert s.tables.total == r // 8 * sum(sched)
    assert float(np.array(method.avg_bits(s))[0, 0]) == pytest.approx(r / 64 * np.mean(sched))
    assert s.key_codes.codes.shape[-1] == -(-s.tables.total // 8)


def test_the_rank_guards():
    """A fixed rank below 32 with a 0-bit group is refused; a schedule without one takes it;
    an energy rank that small turns the 0-bit groups into 1-bit ones (that head only)."""
    with pytest.raises(ValueError, match="rank=16 is too small"):
        method.init(1, 1, 64, rank=16)
    method.init(1, 1, 64, rank=16, bit_schedule="8,8,4,4,2,2,1,1")
    assert svdq.channel_bits(16, 64, "8,4,2,1,1,0,0,0", auto=True)[:16].tolist() == \
        [8, 8, 4, 4, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    x = np.concatenate([_keys((1, 1, 200, 64), 2, top=5.0, low=0.001),   # a low energy rank
                        _keys((1, 1, 200, 64), 3, top=1.0, low=0.9)], axis=1)  # nearly flat
    s = method.update(method.init(1, 2, 64), mx.array(x), mx.array(x))
    rank, bits = np.array(s.tables.rank)[0], np.array(s.tables.bits)[0]
    assert rank[0] < 32 <= rank[1]
    assert (bits[0, :rank[0]] >= 1).all() and (bits[0, rank[0]:] == 0).all()
    assert (bits[1] == svdq.channel_bits(int(rank[1]), 64, "8,4,2,1,1,0,0,0", auto=True)).all()
    assert (bits[1, :rank[1]] == 0).any()


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_fitted_basis_is_orthonormal_and_frozen(backend):
    """The first update fits each (batch row, kv head)'s basis (orthonormal rows), mean and
    rank; decode steps keep every table to the bit."""
    x = _keys((2, 2, 60, 32))
    s1 = method.update(method.init(2, 2, 32, backend=backend), mx.array(x[:, :, :50]), mx.array(x[:, :, :50]))
    basis = np.array(s1.tables.basis)
    assert basis.shape == (2, 2, 32, 32)
    np.testing.assert_allclose(basis @ np.swapaxes(basis, -1, -2), np.broadcast_to(np.eye(32), basis.shape),
                               atol=2e-5)
    np.testing.assert_allclose(np.array(s1.tables.mean), x[:, :, :50].mean(axis=2), atol=1e-5)
    s = s1
    for i in range(50, 60):
        s = method.update(s, mx.array(x[:, :, i:i + 1]), mx.array(x[:, :, i:i + 1]))
    for f in ("basis", "mean", "sigma", "bits", "rank"):
        assert np.array_equal(np.array(getattr(s.tables, f)), np.array(getattr(s1.tables, f)))
    assert codec_cache.stored_tokens(s) == 60


@pytest.mark.parametrize("threshold", [0.5, 0.9, 0.95, 0.99])
def test_energy_rank_is_the_fewest_components_holding_the_threshold(threshold):
    x = _keys((1, 2, 120, 32), 4)
    s = method.update(method.init(1, 2, 32, energy_threshold=threshold), mx.array(x), mx.array(x))
    rank = np.array(s.tables.rank)[0]
    for j in range(2):
        xc = x[0, j].astype(np.float64) - x[0, j].mean(axis=0)
        lam = np.sort(np.linalg.eigvalsh(xc.T @ xc))[::-1]
        share = np.cumsum(lam) / lam.sum()
        r = int(rank[j])
        assert share[r - 1] >= threshold - 1e-5
        assert r == 1 or share[r - 2] < threshold + 1e-5


def test_reconstruction_error_is_the_discarded_energy_and_falls_with_rank():
    """At 16 bits a channel the squared error over the prefill rows is the variance of the
    dropped components (the eigenvalues past the rank, times the rows), falling as the rank
    grows; at full rank the keys come back to float32 rounding."""
    n, d = 200, 32
    x = _keys((1, 1, n, d), 5)
    xc = x[0, 0].astype(np.float64) - x[0, 0].mean(axis=0)
    lam = np.sort(np.linalg.eigvalsh(xc.T @ xc / n))[::-1]
    errs = []
    for r in (4, 8, 16, 24, 32):
        s = method.init(1, 1, d, rank=r, bit_schedule=FULL16)
        s = method.update(s, mx.array(x), mx.array(x))
        k, _ = method.get_kv(s)
        err = float(((np.array(k, np.float64) - x) ** 2).sum())
        errs.append(err)
        want = n * lam[r:].sum()
        assert err == pytest.approx(want, rel=2e-3, abs=1e-6 * n * lam.sum())
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] <= 1e-8 * n * lam.sum()


def test_dropped_channels_decode_to_zero():
    """A 0-bit channel (a 0-bit group, or past the rank) decodes to exactly 0: the row sits at
    the mean along that direction."""
    x = _keys((1, 2, 100, 64), 6)
    s = method.update(method.init(1, 2, 64, rank=64), mx.array(x), mx.array(x))
    t = numpy_tables(s.tables)
    lat = svdq.latents_np(t, codec_cache.held_codes(s)[0])
    off = np.broadcast_to(t.bits[:, :, None, :] == 0, lat.shape)
    assert off.any() and (lat[off] == 0).all()
    k, _ = method.get_kv(s)
    proj = (np.array(k) - t.mean[:, :, None, :]) @ np.swapaxes(t.basis, -1, -2)
    assert np.abs(proj[off]).max() < 1e-4


def test_backends_give_the_same_codes():
    x = _keys((1, 2, 70, 32), 7)
    a = method.update(method.init(1, 2, 32, backend="mlx"), mx.array(x), mx.array(x))
    b = method.update(method.init(1, 2, 32, backend="reference"), mx.array(x), mx.array(x))
    for f in ("basis", "mean", "sigma", "bits", "rank"):
        assert np.array_equal(np.array(getattr(a.tables, f)), np.array(getattr(b.tables, f)))
    same = np.all(np.array(a.key_codes.codes) == np.array(b.key_codes.codes), axis=-1)
    assert same.mean() >= 0.98
    assert np.mean(np.array(a.key_codes.scales) == np.array(b.key_codes.scales)) >= 0.98


def test_bytes_are_the_codes_scales_tables_and_values():
    """A row: its stream (ceil(total / 8) bytes) and a float16 scale a group of channels; the
    tables (float32 basis, mean and spreads, uint8 bits, int32 rank) one set a batch row and
    kv head; values exact in float16 for a float32 cache."""
    b, h, d, n = 1, 3, 64, 256
    x = _keys((b, h, n, d), 8)
    s = method.update(method.init(b, h, d), mx.array(x), mx.array(x))
    w, groups = d, d // 32
    per_row = -(-s.tables.total // 8) + 2 * groups
    assert svdq.bytes_per_row(d, {}) == per_row
    assert codes_nbytes(s.key_codes) == b * h * n * per_row
    tables = b * h * (w * d * 4 + d * 4 + w * 4 + w + 4)
    assert codes_nbytes(s.tables[:5]) == tables
    assert codes_nbytes(s.value_codes) == b * h * n * d * 2
    assert method.nbytes(s) == b * h * n * (per_row + 2 * d) + tables + s.next_pos.nbytes
    assert method.nbytes(s) == sum(v.nbytes for _, v in tree_flatten(s) if isinstance(v, mx.array))


def test_attention_on_codes_equals_dense():
    x = _keys((1, 2, 40, 16), 9)
    s = method.update(method.init(1, 2, 16), mx.array(x), mx.array(x))
    q = mx.array(_keys((1, 4, 1, 16), 10))
    k1 = mx.array(_keys((1, 2, 1, 16), 11))
    got = method.attend(s, q, k1, k1, scale=0.25)
    k, v = method.get_kv(s)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, k1], 2),
                                                mx.concatenate([v, k1], 2), scale=0.25)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


def test_registered_codec():
    assert get_codec("svdq") is svdq.CODEC


def test_byte_unpacking_equals_kvtcs_bitwise_unpacking():
    """unpack_codes (three bytes a code) reads the codes KVTC's bitwise unpacking reads, for
    allocations a row and head (MLX arrays) and shared ones (NumPy), widths 0 to 16."""
    from velox.codecs import kvtc
    rng = np.random.default_rng(0)
    for _ in range(10):
        d = int(rng.integers(1, 40))
        bits = np.sort(rng.choice([0, 1, 2, 3, 4, 5, 8, 16], (2, 3, d)), axis=-1)[..., ::-1].astype(np.uint8)
        total = int(bits.astype(int).sum(-1).max())
        stream = rng.integers(0, 256, (2, 3, 5, -(-total // 8))).astype(np.uint8)
        got = svdq.unpack_codes(mx.array(stream), mx.array(bits), total)
        assert np.array_equal(np.array(got), kvtc._unpack_np(stream, bits, total, d))
        one = bits[0, 0]
        t1 = int(one.astype(int).sum())
        s1 = rng.integers(0, 256, (4, -(-t1 // 8))).astype(np.uint8)
        assert np.array_equal(np.array(svdq.unpack_codes(mx.array(s1), one, t1)),
                              kvtc._unpack_np(s1, one, t1, d))

"""velox.entropy's coders for stored caches: two-sided geometric models (round trips, the
fitted byte, refusals), bit packing, lossless float rows (every bit pattern of bfloat16,
float16 and float32 back to the bit, the size from the arrays written) and integer arrays."""

import numpy as np
import pytest

from velox import entropy


def _nbytes(a: dict) -> int:
    return sum(np.asarray(v).nbytes for v in a.values())


def test_geometric_blocks_round_trip():
    rng = np.random.default_rng(0)
    blocks = []
    for i in range(40):
        n = int(rng.integers(0, 50))
        scale = float(rng.choice([0.0, 0.3, 2.0, 40.0]))
        sym = np.rint(rng.laplace(0, scale, n)).astype(np.int64) if scale else np.zeros(n, np.int64)
        bound = int(np.abs(sym).max()) if n else int(rng.integers(0, 5))
        j = int(entropy.geo_fit(n, np.abs(sym).sum(), bound))
        blocks.append((sym, j, bound))
    blocks.append((np.array([3, -3]), 5, 3))  # a byte that fits badly still codes
    words = entropy.geo_encode(blocks)
    got = entropy.geo_decode(words, [(len(s), j, b) for s, j, b in blocks])
    assert all(np.array_equal(a, s) for a, (s, _, _) in zip(got, blocks))


def test_geometric_fit_and_size():
    # all zeros: byte 0 (every symbol 0), next to no words
    assert entropy.geo_fit(1000, 0, 7) == 0
    assert entropy.geo_encode([(np.zeros(1000, np.int64), 0, 7)]).nbytes <= 8
    # wider symbols, a larger theta; the code near the Laplace entropy
    rng = np.random.default_rng(1)
    narrow, wide = (np.rint(rng.laplace(0, s, 4000)).astype(np.int64) for s in (0.5, 8.0))
    jn, jw = (int(entropy.geo_fit(x.size, np.abs(x).sum(), np.abs(x).max())) for x in (narrow, wide))
    assert 0 < jn < jw
    _, counts = np.unique(wide, return_counts=True)
    ideal = -(counts * np.log2(counts / wide.size)).sum() / 8
    assert entropy.geo_encode([(wide, jw, np.abs(wide).max())]).nbytes < 1.05 * ideal + 16
    assert entropy.GEO_THETA[0] == 0 and np.all(np.diff(entropy.GEO_THETA) > 0)


def test_geometric_refusals():
    with pytest.raises(ValueError, match="outside"):
        entropy.geo_encode([(np.array([4]), 10, 3)])
    with pytest.raises(ValueError, match="bound"):
        entropy.geo_decode(np.zeros(2, np.uint32), [(1, 10, entropy.GEO_MAX_BOUND + 1)])


@pytest.mark.parametrize("width", [0, 1, 5, 7, 8, 10, 13, 23, 32])
def test_pack_bits_round_trip(width):
    rng = np.random.default_rng(width)
    for n in (0, 1, 7, 9, 1001):
        v = rng.integers(0, 2 ** width, n, dtype=np.uint64) if width else np.zeros(n, np.uint64)
        p = entropy.pack_bits(v, width)
        assert p.size == (width // 8) * n + -(-(width % 8) * n // 8)
        assert np.array_equal(entropy.unpack_bits(p, width, n), v)
    with pytest.raises(ValueError, match="packed bytes"):
        entropy.unpack_bits(np.zeros(3, np.uint8), 8, 4)


def _bits(dtype, rows):
    if dtype == "bfloat16":
        u = rows.astype(np.float32).view(np.uint32)
        return ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    return rows.astype(dtype).view(np.uint16 if dtype == "float16" else np.uint32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_float_rows_round_trip_to_the_bit(dtype):
    rng = np.random.default_rng(2)
    scale = np.exp(rng.normal(0, 1.5, 32))  # channels of their own size, as keys and values
    rows = rng.normal(0, 1, (3, 200, 32)) * scale
    bits = _bits(dtype, rows)
    # every special bit pattern: zeros of both signs, infinities, NaNs, subnormals, extremes
    wide = bits.dtype == np.uint32
    special = ([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 1, 0x807FFFFF, 0x7F7FFFFF]
               if wide else [0, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 1, 0x807F, 0x7F7F, 0xFFFF])
    bits[1, :len(special), 3] = special
    bits[2, :, 5] = bits[2, 0, 5]  # a constant channel
    a = entropy.float_encode(bits, dtype)
    assert np.array_equal(entropy.float_decode(a, bits.shape, dtype), bits)
    empty = bits[:, :0]
    assert entropy.float_decode(entropy.float_encode(empty, dtype), empty.shape, dtype).shape == empty.shape


def test_float_rows_ratio_from_the_arrays():
    """Row-like data (channels of their own scale): bfloat16 near 1.5x, every byte counted."""
    rng = np.random.default_rng(3)
    rows = rng.laplace(0, 1, (6, 512, 64)) * np.exp(rng.normal(0, 1, 64))
    bits = _bits("bfloat16", rows)
    a = entropy.float_encode(bits, "bfloat16")
    assert bits.nbytes / _nbytes(a) > 1.4
    with pytest.raises(ValueError, match="channels"):
        entropy.float_decode(a, (5, 512, 64), "bfloat16")


def test_integer_arrays():
    pos = np.broadcast_to(np.arange(2048, dtype=np.int32), (1, 3, 2048)).copy()
    a = entropy.int_encode(pos)
    assert _nbytes(a) < 100
    assert np.array_equal(got := entropy.int_decode(a, pos.shape, pos.dtype), pos) and got.dtype == np.int32
    pos[0, 1, -7:] = -1  # empty slots
    pos[0, 2] = np.sort(np.random.default_rng(4).choice(10_000, 2048, replace=False))
    a = entropy.int_encode(pos)
    assert np.array_equal(entropy.int_decode(a, pos.shape, pos.dtype), pos)
    assert entropy.int_encode(np.random.default_rng(5).integers(0, 2 ** 31, 100)) is None
    with pytest.raises(ValueError, match="model"):
        entropy.int_decode({"words": a["words"], "model": np.array([1, -1, 3])}, pos.shape, np.int32)

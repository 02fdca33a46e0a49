"""KVTC (velox.codecs.kvtc, velox.methods.kvtc): the bit allocation's budget, choices, order,
even split and optimality against brute force, its MLX twin, the codes (a hand-worked case, the
coefficient bound, 0-bit components at the mean, near-lossless at full bits), the range coder's
round trip, the frozen basis and allocation, the bytes, the calibration hook."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import velox
from velox import codec_cache
from velox.codecs import codes_nbytes, get_codec, kvtc
from velox.methods import kvtc as method

CHOICES = ["0,1,2,3,4,6,8", "0,1,2,3,4,5,6,7,8", "0,2,4,8", "1,2,3,4", "0,4,8,12,16"]


def _reachable(n, choices, budget):
    ch = kvtc.parse_choices(choices)
    sums = {sum(c) for c in itertools.combinations_with_replacement(ch, n)}
    fit = [s for s in sums if s <= budget]
    return max(fit) if fit else None


def _cost(v, bits, beta):
    return float(np.sum(np.asarray(v, np.float64) * float(beta) ** -np.asarray(bits, np.float64)))


@st.composite
def _allocation_case(draw, max_n=12):
    n = draw(st.integers(1, max_n))
    choices = draw(st.sampled_from(CHOICES))
    budget = draw(st.integers(0, 16 * n + 4))
    beta = draw(st.floats(1.5, 8.0))
    v = np.sort(np.array(draw(st.lists(st.floats(0.0, 100.0, width=32), min_size=n, max_size=n)),
                         np.float32))[::-1].copy()
    return v, budget, choices, beta


@given(_allocation_case())
def test_allocation_spends_the_budget_in_the_choices(case):
    """sum bits <= budget, = the largest reachable sum (the budget whenever it is reachable);
    every bits_i one of the choices."""
    v, budget, choices, beta = case
    bits = kvtc.allocate_np(v, budget, choices, beta).astype(int)
    want = _reachable(len(v), choices, budget)
    assert set(bits.tolist()) <= set(kvtc.parse_choices(choices))
    if want is None:  # no sum fits: every component at the smallest choice
        assert (bits == kvtc.parse_choices(choices)[0]).all()
    else:
        assert bits.sum() == want <= budget
        if budget in {sum(c) for c in itertools.combinations_with_replacement(
                kvtc.parse_choices(choices), len(v))}:
            assert bits.sum() == budget


@given(_allocation_case())
def test_higher_variance_never_gets_fewer_bits(case):
    v, budget, choices, beta = case
    bits = kvtc.allocate_np(v, budget, choices, beta).astype(int)
    for i in range(len(v)):
        for j in range(len(v)):
            if v[i] > v[j]:
                assert bits[i] >= bits[j], (v, bits)


@given(st.integers(1, 64), st.integers(0, 8 * 64), st.floats(1.5, 8.0))
def test_uniform_variance_splits_evenly_remainder_first(n, budget, beta):
    """Equal variances, every width 0-8 a choice: floor(budget / n) each, the remainder one
    more bit to the first components."""
    budget = min(budget, 8 * n)
    bits = kvtc.allocate_np(np.full(n, 2.5, np.float32), budget, "0,1,2,3,4,5,6,7,8", beta)
    q, r = divmod(budget, n)
    assert bits.astype(int).tolist() == [q + 1] * r + [q] * (n - r)


@given(_allocation_case(max_n=4))
def test_dp_equals_brute_force(case):
    """The DP's distortion is the minimum over every allocation (any order) of the same sum."""
    v, budget, choices, beta = case
    bits = kvtc.allocate_np(v, budget, choices, beta)
    total = int(bits.astype(int).sum())
    ch = kvtc.parse_choices(choices)
    best = min(_cost(v, b, beta) for b in itertools.product(ch, repeat=len(v)) if sum(b) == total)
    assert _cost(v, bits, beta) <= best * (1 + 1e-5) + 1e-12


@given(_allocation_case(max_n=16))
def test_allocation_mlx_equals_numpy(case):
    v, budget, choices, beta = case
    want = kvtc.allocate_np(v, budget, choices, beta)
    got = np.array(kvtc.allocate(mx.array(v), budget, choices, beta))
    assert np.array_equal(got, want)
    # batched: each row as alone
    vv = np.stack([v, v[::-1].copy()[::-1]])
    assert np.array_equal(np.array(kvtc.allocate(mx.array(vv), budget, choices, beta))[0], want)


def test_hand_worked_case():
    """d = 2, identity basis, zero mean, variances (16, 1), budget 2, choices 0,1,2, beta 2.
    Allocations of sum 2: (2, 0) costs 16/4 + 1 = 5, (1, 1) 16/2 + 1/2 = 8.5: (2, 0).
    Row (3, 0.5): spreads (4, 1), u = (0.75, 0.5); the scale is the largest coded |u| = 0.75;
    u0 / s = 1 -> floor((1 + 1) * 2) = 4, clipped to 3; decoded ((3 + .5) / 2 - 1) * .75 * 4 =
    2.25; component 1 (0 bits) at the mean: (2.25, 0). Stream: 2 bits '11' = byte 3.
    Row (-1, 2): u = (-0.25, 2), s = 0.25, code floor(0) = 0, decoded (0.5/2 - 1) * .25 * 4 = -0.75."""
    params = {"bit_budget": 2, "bit_choices": "0,1,2", "beta": 2.0, "basis": np.eye(2),
              "mean": np.zeros(2), "variances": np.array([16.0, 1.0])}
    t = kvtc.tables(2, params)
    assert np.array(t.bits).tolist() == [2, 0] and t.total == 2
    rows = np.array([[[[3.0, 0.5], [-1.0, 2.0]]]], np.float32)
    c = kvtc.encode(t, mx.array(rows))
    assert np.array(c.codes).ravel().tolist() == [3, 0]
    assert np.array(c.scale).ravel().tolist() == [0.75, 0.25]
    np.testing.assert_array_equal(np.array(kvtc.decode(t, c))[0, 0], [[2.25, 0.0], [-0.75, 0.0]])
    tn = kvtc.KvtcTables(*(np.array(x) if isinstance(x, mx.array) else x for x in t))
    cn = kvtc.encode_np(tn, rows)
    assert np.array_equal(cn.codes, np.array(c.codes)) and np.array_equal(cn.scale, np.array(c.scale))
    np.testing.assert_array_equal(kvtc.decode_np(tn, cn)[0, 0], [[2.25, 0.0], [-0.75, 0.0]])
    # scores: q . x^ read from the codes
    q = np.array([[[[1.0, 3.0]]]], np.float32)
    np.testing.assert_allclose(np.array(kvtc.scores(t, mx.array(q), c))[0, 0, 0], [2.25, -0.75])


def _anisotropic(shape, seed=0):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    sd = np.geomspace(6.0, 0.05, d)
    return ((rng.standard_normal(shape) * sd) @ basis.T + 0.4).astype(np.float32)


@pytest.mark.parametrize("budget,choices", [(512, "0,1,2,3,4,6,8"), (96, "0,1,2,3,4,6,8"),
                                            (40, "0,2,4,8")])
def test_coefficient_bound_and_dropped_components(budget, choices):
    """Each coded coefficient within sigma_i s / 2^bits_i; a 0-bit component decodes to 0 (the
    row at the mean along it); MLX and NumPy give the same codes."""
    x = _anisotropic((2, 3, 80, 32))
    t = kvtc.fitted(kvtc.tables(32, {"bit_budget": budget, "bit_choices": choices}), mx.array(x))
    c = kvtc.encode(t, mx.array(x))
    tn = kvtc.KvtcTables(*(np.array(v) if isinstance(v, mx.array) else v for v in t))
    y = kvtc._rotate_np(tn, x)
    yh = kvtc._coefficients_np(tn, c)
    bits = tn.bits[:, :, None, :].astype(np.float64)
    s = np.asarray(c.scale).astype(np.float64)[..., None]
    bound = tn.sigma[:, :, None, :] * s / 2 ** bits
    on = np.broadcast_to(bits > 0, y.shape)
    assert (np.abs(y - yh)[on] <= bound[on] * (1 + 1e-4) + 1e-5).all()
    assert (yh[~on] == 0).all()
    if (~on).any():  # a dropped component: the decoded row's coefficient along it is the mean's
        xh = np.array(kvtc.decode(t, c))
        proj = kvtc._rotate_np(tn, xh)
        assert np.abs(proj[~on]).max() < 1e-4
    cn = kvtc.encode_np(tn, x)
    assert np.mean(np.all(cn.codes == np.array(c.codes), axis=-1)) >= 0.98


def test_lossless_at_full_rank_and_bits():
    """16 bits on every component of a full-rank basis: the reconstruction within the
    quantizer's step (2^-16 of the row's scale) and float32 rounding."""
    x = _anisotropic((1, 2, 50, 16), seed=3)
    t = kvtc.fitted(kvtc.tables(16, {"bit_budget": 16 * 16, "bit_choices": "0,4,8,12,16"}), mx.array(x))
    assert (np.array(t.bits) == 16).all()
    xh = np.array(kvtc.decode(t, kvtc.encode(t, mx.array(x))))
    assert np.abs(xh - x).max() <= 1e-3 * np.abs(x).max()


@given(st.integers(1, 40), st.integers(0, 2 ** 31 - 1))
def test_entropy_coding_round_trips(n, seed):
    rng = np.random.default_rng(seed)
    bits = np.sort(rng.choice([0, 1, 2, 3, 4, 6, 8, 16], (2, 2, 8)), axis=-1)[..., ::-1].copy()
    q = (rng.integers(0, 1 << 16, (2, 2, n, 8)) % (1 << bits[:, :, None, :].astype(np.int64))).astype(np.uint32)
    words, mean, scale = kvtc.entropy_encode_np(q, bits)
    assert words.dtype == np.uint32
    assert np.array_equal(kvtc.entropy_decode_np(words, bits, n, mean, scale), q)


def test_entropy_coding_shrinks_peaked_codes():
    x = _anisotropic((1, 2, 400, 32))
    t = kvtc.fitted(kvtc.tables(32, {"bit_budget": 128}), mx.array(x))
    c = kvtc.encode(t, mx.array(x))
    got = kvtc.compress_codes_np(np.array(c.codes), np.array(t.bits), t.total, 400)
    assert got["words"].nbytes < np.array(c.codes).nbytes
    back = kvtc.decompress_codes_np(got, c.codes.shape, np.array(t.bits), t.total, 400)
    assert np.array_equal(back, np.array(c.codes))


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_basis_and_allocation_frozen_after_prefill(backend):
    """The first update fits the tables (one a batch row and kv head); decode steps keep them
    to the bit; a calibrated state is never refitted."""
    x = _anisotropic((2, 2, 40, 16))
    s0 = method.init(2, 2, 16, bit_budget=48, backend=backend)
    s1 = method.update(s0, mx.array(x[:, :, :30]), mx.array(x[:, :, :30]))
    assert not np.array_equal(np.array(s1.tables.basis), np.array(s0.tables.basis))
    want = kvtc.fit_np(x[:, :, :30], 48, kvtc.DEFAULT_CHOICES, 3.5)
    np.testing.assert_array_equal(np.array(s1.tables.bits), want[3])
    np.testing.assert_allclose(np.abs(np.array(s1.tables.basis)), np.abs(want[0]), atol=2e-3)  # float32 eigh
    s = s1
    for i in range(30, 40):
        s = method.update(s, mx.array(x[:, :, i:i + 1]), mx.array(x[:, :, i:i + 1]))
        for f in ("basis", "mean", "sigma", "bits"):
            assert np.array_equal(np.array(getattr(s.tables, f)), np.array(getattr(s1.tables, f)))
    assert int(np.array(s.next_pos)[0, 0]) == 40
    # calibrated: the installed basis survives the prefill
    arrays = {"basis": np.stack([np.eye(16, dtype=np.float32)] * 2), "mean": np.zeros((2, 16), np.float32),
              "variances": np.stack([np.geomspace(4, 0.1, 16).astype(np.float32)] * 2)}
    c0 = method.calibrated(method.init(2, 2, 16, bit_budget=48, backend=backend), arrays)
    c1 = method.update(c0, mx.array(x[:, :, :30]), mx.array(x[:, :, :30]))
    assert c1.tables.calibrated
    assert np.array_equal(np.array(c1.tables.basis), np.array(c0.tables.basis))


def test_backends_give_the_same_codes():
    x = _anisotropic((1, 2, 64, 32), seed=5)
    a = method.update(method.init(1, 2, 32, backend="mlx"), mx.array(x), mx.array(x))
    b = method.update(method.init(1, 2, 32, backend="reference"), mx.array(x), mx.array(x))
    for f in ("basis", "mean", "sigma", "bits"):
        assert np.array_equal(np.array(getattr(a.tables, f)), np.array(getattr(b.tables, f)))
    same = np.all(np.array(a.key_codes.codes) == np.array(b.key_codes.codes), axis=-1)
    assert same.mean() >= 0.98


def test_bytes_count_codes_tables_and_values():
    """nbytes: the packed codes (ceil(total / 8) bytes and a float16 scale a row), the value
    codes, and the tables: basis, mean, spreads (float32) and the allocation (uint8), one set a
    batch row and kv head."""
    b, h, d, n = 1, 3, 64, 256
    x = _anisotropic((b, h, n, d))
    s = method.update(method.init(b, h, d), mx.array(x), mx.array(x))
    assert kvtc.bytes_per_row(d, {}) == 512 // 8 + 2
    assert codes_nbytes(s.key_codes) == b * h * n * (512 // 8 + 2)
    tables = b * h * (d * d * 4 + d * 4 + d * 4 + d)
    assert codes_nbytes(s.tables[:4]) == tables
    values = codes_nbytes(s.value_codes)
    assert method.nbytes(s) == b * h * n * 66 + values + tables + s.next_pos.nbytes
    assert method.nbytes(s) == sum(v.nbytes for _, v in
                                   __import__("mlx.utils").utils.tree_flatten(s) if isinstance(v, mx.array))


def test_registered_codec():
    assert get_codec("kvtc") is kvtc.CODEC
    assert velox.kvtc.init is method.init


def test_attention_on_codes_equals_dense():
    x = _anisotropic((1, 2, 40, 16), seed=7)
    s = method.update(method.init(1, 2, 16, bit_budget=40), mx.array(x), mx.array(x))
    q = mx.array(_anisotropic((1, 4, 1, 16), seed=8))
    k1 = mx.array(_anisotropic((1, 2, 1, 16), seed=9))
    got = method.attend(s, q, k1, k1, scale=0.25)
    k, v = method.get_kv(s)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, k1], 2),
                                                mx.concatenate([v, k1], 2), scale=0.25)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
    assert codec_cache.stored_tokens(s) == 40


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_an_evictor_composed_with_kvtc_fits_at_its_first_keys(backend):
    """``tova+kvtc``: the composition runs KVTC's prepare step, so a budget above the prompt
    holds the keys exactly as ``kvtc`` alone codes them (the same prefill basis and codes),
    and eviction keeps the basis fitted on the first keys."""
    rng = np.random.default_rng(3)
    keys = mx.array((rng.standard_normal((1, 2, 40, 16)) * np.linspace(4, 0.2, 16)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 2, 40, 16)).astype(np.float32))
    alone = velox.update(velox.init("kvtc", 1, 2, 16, bit_budget=48, backend=backend), keys, values)
    both = velox.update(velox.init("tova+kvtc", 1, 2, 16, budget=64, bit_budget=48,
                                   backend=backend), keys, values)
    assert np.array_equal(np.array(both.tables.basis), np.array(alone.tables.basis))
    for a, b in zip(alone.key_codes, both.key_codes):
        assert np.array_equal(np.array(a)[:, :, :40], np.array(b)[:, :, :40])
    small = velox.init("tova+kvtc", 1, 2, 16, budget=24, bit_budget=48, backend=backend)
    small = velox.update(small, keys, values)
    assert np.array_equal(np.array(small.tables.basis), np.array(alone.tables.basis))
    step = velox.update(small, keys[:, :, :1] * 0.5, values[:, :, :1])
    assert np.array_equal(np.array(step.tables.basis), np.array(alone.tables.basis))
    k_hat, _ = velox.get_kv(small)
    assert k_hat.shape[2] == 24


# ---- entropy-coded rows (prompt-cache files) ------------------------------------------------

@pytest.mark.parametrize("traditional", [False, True])
def test_rope_np_is_mlx_rope_and_turns_back(traditional):
    x = np.random.default_rng(0).normal(size=(2, 50, 16)).astype(np.float32)
    want = np.array(mx.fast.rope(mx.array(x), 16, traditional=traditional, base=500.0, scale=1.0,
                                 offset=7))
    got = kvtc.rope_np(x, np.broadcast_to(np.arange(7, 57), (2, 50)), 500.0, traditional)
    np.testing.assert_allclose(got, want, atol=2e-5)
    back = kvtc.rope_np(got, np.broadcast_to(np.arange(7, 57), (2, 50)), 500.0, traditional, inverse=True)
    np.testing.assert_allclose(back, x, atol=2e-5)


def test_basis_walk_decodes_the_encoders_orthonormal_basis():
    rng = np.random.default_rng(1)
    vec = np.linalg.qr(rng.normal(size=(12, 12)))[0].T                # unit rows
    widths = np.array([12, 10, 8, 6, 4, 3, 3, 2, 2, 1])
    basis, coords = kvtc._basis_walk(12, widths, vec[:10])
    assert [len(c) for c in coords] == list(range(12, 2, -1))        # D (D + 1) / 2 numbers
    again, _ = kvtc._basis_walk(12, widths, [np.array(c) for c in coords])
    assert np.array_equal(basis, again)
    np.testing.assert_allclose(basis @ basis.T, np.eye(12), atol=1e-12)
    assert abs(basis[0] @ vec[0]) > 1 - 1e-6                         # a fine vector kept
    assert abs(basis[9] @ vec[9]) > 0.5                              # a coarse one roughly


def _rows(rng, b=1, h=2, n=120, d=8):
    spread = np.exp(-np.arange(h * d) / 4.0)
    z = rng.normal(size=(b, n, h * d)) * spread @ np.linalg.qr(rng.normal(size=(h * d, h * d)))[0]
    return np.ascontiguousarray((z + 0.3).reshape(b, n, h, d).transpose(0, 2, 1, 3)).astype(np.float32)


@pytest.mark.parametrize("b", [1, 2])
def test_entropy_coded_rows_bound_and_exact_rows(b):
    """Half a step a principal coefficient (orthonormal basis): |x - x^| <= step sqrt(D) / 2;
    quiet rows at a 16th; exact and non-finite rows to the bit; the step over the RMS spread."""
    rng = np.random.default_rng(2)
    x = _rows(rng, b=b)
    x[0, 1, 5, 3] = np.nan
    exact = np.zeros(x.shape[:3], bool)
    exact[:, 0, -3:] = True                            # one head marks a token: every head exact
    quiet = np.zeros((b, x.shape[2]), bool)
    quiet[:, 10:14] = True
    a = kvtc.compress_rows_ecsq_np(x, exact, step=0.5, quiet=quiet)
    y = kvtc.decompress_rows_ecsq_np(a, x.shape)
    keep = np.unpackbits(a["exact"], count=b * x.shape[2]).astype(bool).reshape(b, -1)
    assert keep[0, 5] and keep[:, -3:].all() and keep.sum() == 3 * b + 1
    sw_x, sw_y = np.swapaxes(x, 1, 2), np.swapaxes(y, 1, 2)
    assert np.array_equal(sw_x[keep], sw_y[keep], equal_nan=True)
    D = x.shape[1] * x.shape[3]
    for i in range(b):
        err = np.sqrt(((sw_x[i] - sw_y[i]) ** 2).sum(axis=(1, 2)))
        bound = float(a["step"][i]) * np.sqrt(D) / 2 + 1e-5
        assert (err[~keep[i]] <= bound).all() and (err[quiet[i]] <= bound / 16).all()
        fit = ~keep[i] & ~quiet[i]
        z = sw_x[i][fit].reshape(fit.sum(), D)
        rms = np.sqrt(((z - z.mean(0)) ** 2).mean())
        assert abs(float(a["step"][i]) / (0.5 * rms) - 1) < 1e-3


def test_entropy_coded_rows_degenerate_and_refused():
    rng = np.random.default_rng(3)
    x = _rows(rng)
    const = np.broadcast_to(x[:, :, :1], x.shape).copy()            # no spread but the float16 mean's
    a = kvtc.compress_rows_ecsq_np(const, np.zeros(x.shape[:3], bool), step=1.0)
    assert a["words"].nbytes < 1024
    np.testing.assert_allclose(kvtc.decompress_rows_ecsq_np(a, x.shape), const, atol=1e-3)
    zero = kvtc.compress_rows_ecsq_np(np.zeros_like(x), np.zeros(x.shape[:3], bool), step=1.0)
    assert zero["step"][0] == 0 and zero["components"][0] == 0       # no basis at all
    assert np.array_equal(kvtc.decompress_rows_ecsq_np(zero, x.shape), np.zeros_like(x))
    every = kvtc.compress_rows_ecsq_np(x, np.ones(x.shape[:3], bool), step=1.0)
    assert np.array_equal(kvtc.decompress_rows_ecsq_np(every, x.shape), x)
    f16 = x.astype(np.float16)                                      # exact rows in their dtype
    ex = np.zeros(x.shape[:3], bool)
    ex[:, :, :4] = True
    a = kvtc.compress_rows_ecsq_np(f16, ex, step=1.0)
    assert a["exact_rows"].dtype == np.float16
    assert np.array_equal(kvtc.decompress_rows_ecsq_np(a, x.shape)[:, :, :4], f16[:, :, :4].astype(np.float32))
    with pytest.raises(ValueError, match="fit"):
        kvtc.decompress_rows_ecsq_np(a, (1, 2, 121, 8))
    with pytest.raises(ValueError, match="fit"):
        kvtc.decompress_rows_ecsq_np({**a, "components": a["components"] + 1}, x.shape)


def test_entropy_coded_rows_shrink_with_the_step():
    x = _rows(np.random.default_rng(4), n=400)
    size = [sum(v.nbytes for v in kvtc.compress_rows_ecsq_np(x, np.zeros(x.shape[:3], bool),
                                                            step=s).values()) for s in (0.25, 1.0, 4.0)]
    assert size[0] > size[1] > size[2] and size[1] < x.astype(np.float16).nbytes / 2

"""Palu (velox.codecs.palu, velox.methods.palu): a hand-worked token through grouping,
projection and mixed-precision codes on both backends, the layout's bits, the groups of heads,
orthonormal bases (fitted and from the weights), reconstruction against the discarded energy,
full rank, attention in the latent space, the shipped SmolLM2 bases, the refusal without one,
a calibration of a tiny model end to end."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import velox
from velox.codecs import palu as codec
from velox.methods import palu as method

FREE = dict(basis="prefill")


def _arrays(h, d, basis, spread, mean=None):
    """One layer's calibration arrays of a group basis ``[G, e, e]`` (freqs 0: RoPE off)."""
    groups, e, _ = basis.shape
    g = e // d
    per_head = np.concatenate([basis[c].reshape(g, d, e) for c in range(groups)])
    sp = np.repeat(np.asarray(spread, np.float32).reshape(groups, e), g, axis=0)
    mean = np.zeros((h, d), np.float32) if mean is None else mean
    return {"key_basis": per_head, "value_basis": per_head, "key_spread": sp, "value_spread": sp,
            "key_mean": mean, "value_mean": mean, "freqs": np.zeros((h, d // 2), np.float32)}


def test_hand_worked_token():
    """Two kv heads of head_dim 2 in one group (e = 4), the identity basis, spreads (2, 1, 1, 1),
    rank 4, hi_fraction 0.5: channels 0-1 at 4 bits (one group), 2-3 at 2 bits.
    Key rows head 0 (2, -1), head 1 (3, 0.5) -> the group row (2, -1, 3, 0.5) -> u = (1, -1, 3,
    0.5). Group 0: scale 2/15 -> float16 0.13330078, zero -1; codes round(2 / 0.1333) = 15 and
    0; decoded 15 * 0.13330078 - 1 = 0.99951172, times 2 = 1.99902344, and -1. Group 1: scale
    2.5/3 -> float16 0.83349609, zero 0.5; codes round(2.5 / 0.8335) = 3 and 0; decoded
    3.00048828 and 0.5. Stream: 1111 0000 | 11 00 = bytes (15, 3)."""
    arrays = _arrays(2, 2, np.eye(4, dtype=np.float32)[None], [2, 1, 1, 1])
    row = mx.array(np.array([[[[2.0, -1.0]], [[3.0, 0.5]]]], np.float32))  # [1, 2, 1, 2]
    want = [[1.99902344, -1.0], [3.00048828, 0.5]]
    for backend in ("mlx", "reference"):
        s = method.init(1, 2, 2, rank=4, n_head_groups=1, hi_fraction=0.5, hi_bit=4, lo_bit=2,
                        backend=backend, **FREE)
        s = method.calibrated(s, arrays)
        assert s.tables.groups == 1 and s.tables.key_rank == 4 and s.tables.prerope
        s = method.update(s, row, row)
        assert np.array(s.key_codes.codes).ravel().tolist() == [15, 3]
        np.testing.assert_array_equal(np.array(s.key_codes.scales).ravel(),
                                      np.array([2 / 15, 2.5 / 3], np.float16))
        np.testing.assert_array_equal(np.array(s.key_codes.zeros).ravel(), [-1.0, 0.5])
        k, v = method.get_kv(s)
        np.testing.assert_allclose(np.array(k)[0, :, 0], want, rtol=0, atol=1e-7)
        np.testing.assert_allclose(np.array(v)[0, :, 0], want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("r,frac,hi,lo,gs,groups,total", [
    (32, 0.25, 4, 2, 32, ((0, 8, 4), (8, 32, 2)), 8 * 4 + 24 * 2),
    (32, 0.25, 3, 3, 32, ((0, 32, 3),), 96),
    (40, 0.25, 4, 2, 16, ((0, 10, 4), (10, 26, 2), (26, 40, 2)), 10 * 4 + 30 * 2),
    (8, 0.0, 4, 2, 32, ((0, 8, 2),), 16),
    (8, 1.0, 4, 2, 32, ((0, 8, 4),), 32),
])
def test_layout_bits_and_groups(r, frac, hi, lo, gs, groups, total):
    """The first floor(hi_fraction r + 1/2) channels at hi_bit, the rest at lo_bit, each
    segment in groups of group_size; the stream spends exactly the channels' bits."""
    lay = codec.layout(r, frac, hi, lo, gs)
    assert lay.groups == groups and lay.total == total
    assert int(lay.bits.astype(int).sum()) == total


@pytest.mark.parametrize("h,asked,groups", [(3, 4, 3), (8, 4, 4), (6, 4, 3), (4, 1, 1), (5, 4, 1)])
def test_head_groups_are_equal(h, asked, groups):
    assert codec.head_groups(h, asked) == groups


def test_bytes_per_token_match_the_layout():
    """A token of a group: ceil(total / 8) code bytes and a float16 scale and zero a group of
    channels, keys and values; the tables (float32) one set a batch row and group."""
    b, h, d, n = 1, 4, 16, 30
    x = np.random.default_rng(0).standard_normal((b, h, n, d)).astype(np.float32)
    s = method.init(b, h, d, rank=12, n_head_groups=2, group_size=8, **FREE)
    s = method.update(s, mx.array(x), mx.array(x))
    lay = method.key_layout(s)
    assert lay.groups == ((0, 3, 4), (3, 11, 2), (11, 12, 2))
    per_token = -(-lay.total // 8) + 2 * 2 * len(lay.groups)
    c, e, r = 2, 32, 12
    tables = b * c * (r * e + e + r) * 4 * 2 + (d // 2) * 4
    assert method.nbytes(s) == b * c * n * per_token * 2 + tables + s.next_pos.nbytes
    assert method.nbytes(s) == sum(v.nbytes for _, v in tree_flatten(s) if isinstance(v, mx.array))


def _low_rank(shape, seed=0):
    rng = np.random.default_rng(seed)
    e = shape[-1]
    basis = np.linalg.qr(rng.standard_normal((e, e)))[0]
    return ((rng.standard_normal(shape) * np.geomspace(4, 0.02, e)) @ basis.T + 0.5).astype(np.float32)


def test_prefill_bases_are_orthonormal_and_error_is_the_discarded_energy():
    """A prefill basis: orthonormal rows; at 16 bits the squared error of the rows is the
    variance of the dropped directions (the eigenvalues past the rank, times the rows),
    falling as the rank grows, and full rank gives the rows back."""
    n, h, d = 120, 2, 8
    rows = _low_rank((1, 1, n, h * d), 1)               # one group's rows, e = 16
    x = codec.from_groups_np(rows, d)                   # [1, 2, n, 8]
    xc = rows[0, 0].astype(np.float64) - rows[0, 0].mean(axis=0)
    lam = np.sort(np.linalg.eigvalsh(xc.T @ xc / n))[::-1]
    errs = []
    for r in (2, 4, 8, 12, 16):
        s = method.init(1, h, d, rank=r, n_head_groups=1, hi_bit=16, lo_bit=16, **FREE)
        s = method.update(s, mx.array(x), mx.array(x))
        kb = np.array(s.tables.key_basis)[0, 0]
        np.testing.assert_allclose(kb @ kb.T, np.eye(r), atol=2e-5)
        k, v = method.get_kv(s)
        err = float(((np.array(k, np.float64) - x) ** 2).sum())
        assert err == pytest.approx(n * lam[r:].sum(), rel=5e-3, abs=1e-6 * n * lam.sum())
        assert np.allclose(np.array(k), np.array(v))
        errs.append(err)
    assert all(a > b for a, b in zip(errs, errs[1:]))
    assert errs[-1] <= 1e-7 * n * lam.sum()


def test_weight_bases_keep_the_most_output_variance():
    """Keys that are a linear map of inputs, ``k = x W^T + bias`` (RoPE off): the whitened
    bases are orthonormal, their spreads the latent channels' standard deviations, and at 16
    bits the error is the output variance of the dropped directions, within rounding."""
    rng = np.random.default_rng(2)
    t, hidden, h, d = 400, 24, 2, 8
    x = (rng.standard_normal((t, hidden)) * np.geomspace(3, 0.1, hidden)).astype(np.float32)
    w = rng.standard_normal((h * d, hidden)).astype(np.float32) / 4
    bias = rng.standard_normal(h * d).astype(np.float32)
    basis, spread, mean = codec.weight_bases(w, bias, codec.input_moments(x), h, 1)
    u = np.concatenate(list(basis), axis=0)              # the group's [e, e], e = 16
    np.testing.assert_allclose(u.T @ u, np.eye(h * d), atol=1e-5)
    out = x.astype(np.float64) @ w.T + bias
    np.testing.assert_allclose(mean.ravel(), out.mean(axis=0), rtol=1e-5, atol=1e-5)
    lam = np.var(out @ u, axis=0)
    np.testing.assert_allclose(spread[0] ** 2, lam, rtol=1e-4, atol=1e-6)
    keys = mx.array(codec.from_groups_np(out[None, None].astype(np.float32), d))
    arrays = {"key_basis": basis, "value_basis": basis, "key_spread": spread,
              "value_spread": spread, "key_mean": mean, "value_mean": mean,
              "freqs": np.zeros((h, d // 2), np.float32)}
    for r in (4, 16):
        s = method.init(1, h, d, rank=r, n_head_groups=1, hi_bit=16, lo_bit=16, **FREE)
        s = method.update(method.calibrated(s, arrays), keys, keys)
        err = float(((np.array(method.get_kv(s)[0], np.float64) - np.array(keys)) ** 2).sum())
        assert err == pytest.approx(t * lam[r:].sum(), rel=5e-3, abs=1e-6 * t * lam.sum())


def test_keys_are_projected_before_rope_and_turned_back():
    """With RoPE frequencies the keys are un-rotated by their positions before the projection:
    a basis of the pre-RoPE keys' span (rank 3 of 8) gives the post-RoPE keys back at 16 bits,
    decode steps included (rotated keys span all 8 dimensions)."""
    from velox.codecs.a2ats import inverse_frequencies, rotate_np
    rng = np.random.default_rng(3)
    h, d, n = 1, 8, 40
    span = np.linalg.qr(rng.standard_normal((d, d)))[0]
    pre = (rng.standard_normal((n, 3)) @ span[:, :3].T).astype(np.float32)     # rank 3
    f = inverse_frequencies(d, 10000.0)
    post = rotate_np(pre[None, None], np.arange(n)[None, None], f)
    spread = np.array([3, 2, 1, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3], np.float32)
    arrays = _arrays(h, d, span[None].astype(np.float32), spread)
    arrays["freqs"] = f[None]
    s = method.init(1, h, d, rank=3, n_head_groups=1, hi_bit=16, lo_bit=16, **FREE)
    s = method.calibrated(s, arrays)
    s = method.update(s, mx.array(post[:, :, :30]), mx.array(post[:, :, :30]))
    for i in range(30, n):
        s = method.update(s, mx.array(post[:, :, i:i + 1]), mx.array(post[:, :, i:i + 1]))
    k, _ = method.get_kv(s)
    # 16-bit codes with float16 scales: the scale's rounding (2^-11) times the code bounds it
    np.testing.assert_allclose(np.array(k), post, atol=2e-3 * np.abs(post).max())


@pytest.mark.parametrize("basis", ["prefill", "weights"])
def test_latent_attention_equals_dense(basis):
    """A decode step reads values in the latent space (and, with a prefill basis, keys too):
    the same output as dense attention over get_kv and the new row."""
    rng = np.random.default_rng(4)
    b, h, d = 1, 4, 8
    x = mx.array(_low_rank((b, h, 20, d), 5))
    s = method.init(b, h, d, rank=6, n_head_groups=2, **FREE)
    if basis == "weights":
        u = np.stack([np.linalg.qr(rng.standard_normal((16, 16)))[0] for _ in range(2)]).astype(np.float32)
        arrays = _arrays(h, d, u, np.geomspace(2, 0.1, 16).reshape(1, 16).repeat(2, 0))
        arrays["freqs"] = np.full((h, d // 2), 0.3, np.float32)
        s = method.calibrated(s, arrays)
    s = method.update(s, x, x)
    q = mx.array(rng.standard_normal((b, 8, 1, d)).astype(np.float32))
    k1 = mx.array(rng.standard_normal((b, h, 1, d)).astype(np.float32))
    got = method.attend(s, q, k1, k1, scale=0.3)
    k, v = method.get_kv(s)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, k1], 2),
                                                mx.concatenate([v, k1], 2), scale=0.3)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_backends_give_the_same_codes():
    x = mx.array(_low_rank((1, 3, 50, 16), 6))
    a = method.update(method.init(1, 3, 16, backend="mlx", **FREE), x, x)
    r = method.update(method.init(1, 3, 16, backend="reference", **FREE), x, x)
    for f in ("codes", "scales", "zeros"):
        for ca, cr in ((a.key_codes, r.key_codes), (a.value_codes, r.value_codes)):
            same = np.all(np.array(getattr(ca, f)) == np.array(getattr(cr, f)), axis=-1)
            assert same.mean() >= 0.98, f


def test_a_model_without_bases_is_refused_by_name(tiny_llama):
    """The shipped bases fit the embedded SmolLM2 only: another model's first tokens raise,
    naming the calibration command (and basis='prefill')."""
    from velox.adapters.mlxlm import make_cache
    caches = make_cache(tiny_llama, "palu", compile=False)
    with pytest.raises(ValueError, match="velox calibrate --method palu"):
        tiny_llama(mx.array([[1, 2, 3]]), cache=caches)
    out = tiny_llama(mx.array([[1, 2, 3]]), cache=make_cache(tiny_llama, "palu", basis="prefill",
                                                                 compile=False))
    assert np.isfinite(np.array(out)).all()


def test_calibrated_tiny_model_end_to_end(tiny_llama, tmp_path):
    """velox calibrate's fit of a tiny model, installed with artifacts=FILE: at full rank and
    16 bits (float16 scales: 2^-11 of a group's range) the logits of a prompt and two decode
    steps match the full cache's."""
    from mlx_lm.models.cache import make_prompt_cache

    from velox.adapters import artifacts
    from velox.adapters.mlxlm import make_cache

    class Tok:
        def encode(self, text):
            return [ord(c) % 97 for c in text]

    from velox.adapters.calibration import CALIBRATION_TEXT
    arrays, info = artifacts.calibrate("palu", tiny_llama, Tok(), CALIBRATION_TEXT[:400],
                                       model_name="tiny", source="test", progress=False)
    assert arrays["key_basis"].shape == (3, 2, 32, 32) and arrays["freqs"].shape == (3, 2, 16)
    path = tmp_path / "palu.safetensors"
    artifacts.save_artifact(path, arrays, info)
    caches = make_cache(tiny_llama, "palu", artifacts=path, rank=32, hi_bit=16, lo_bit=16,
                        compile=False)
    plain = make_prompt_cache(tiny_llama)
    prompt = mx.array([[5, 9, 17, 33, 2, 71, 40, 8]])
    got, want = tiny_llama(prompt, cache=caches), tiny_llama(prompt, cache=plain)
    for tok in (3, 44):
        step = mx.array([[tok]])
        got = mx.concatenate([got, tiny_llama(step, cache=caches)], axis=1)
        want = mx.concatenate([want, tiny_llama(step, cache=plain)], axis=1)
    assert caches[0].velox_state.tables.prerope
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-2, rtol=1e-2)


@pytest.mark.unchecked
def test_smollm2_takes_the_shipped_bases(smollm2):
    """make_cache(model, "palu") on the embedded SmolLM2 is calibrated with no argument: each
    layer holds its layer's shipped bases (position-free keys), the default ranks by energy."""
    from velox.adapters.mlxlm import make_cache
    model, _ = smollm2
    caches = make_cache(model, "palu", compile=False)
    model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=caches)
    arrays, info = codec.shipped_arrays("smollm2-135m-instruct")
    for i in (0, 29):
        st = caches[i].velox_state
        assert st.layer == i and st.tables.ready and st.tables.prerope and st.tables.groups == 3
        kb = np.array(st.tables.key_basis)[0, 0]
        want = np.swapaxes(arrays["key_basis"][i, 0], 0, 1)[:st.tables.key_rank]
        np.testing.assert_array_equal(kb, want)
        assert st.tables.key_rank == codec.calibrated_rank(arrays["key_spread"][i], 0.9, 0)
    assert info["method"] == "palu" and info["layers"] == 30
    assert velox.get_method("palu").spec.contract["uncalibrated"] == "shipped"

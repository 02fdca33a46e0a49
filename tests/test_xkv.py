"""xKV (velox.methods.xkv): a hand-worked case on both backends, the fitted basis (orthonormal,
each head's energy rank rounded up to whole latent groups, the single-layer fit for a group of
one), a group's layers ending with one basis (the record's array, counted once) after the
settle round, a trailing shorter group, decode never refitting, the projection lossless at
full rank, 8-bit latents within their quantization error, bytes below fp16 keys, values
passed through, and the mlx-lm adapter (prefill in chunks, save and load, batching)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from velox.accounting import state_nbytes
from velox.methods import xkv

FP16 = mx.float16


def _keys(shape, seed=0, top=4.0, low=0.02, offset=0.3):
    """Rows of decaying variance along a random orthonormal basis, plus an offset."""
    rng = np.random.default_rng(seed)
    d = shape[-1]
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return ((rng.standard_normal(shape) * np.geomspace(top, low, d)) @ basis.T + offset).astype(np.float32)


def _values(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _model(n_layers, **params):
    """The record and one empty state a layer, as make_cache gives them."""
    per_layer = [dict(params) for _ in range(n_layers)]
    record = xkv.method.model_init(per_layer)
    return record, per_layer


def _forward(record, states, keys, values):
    """One forward: every layer's layer_update in order, layer i's rows keys[i], values[i]."""
    out = []
    for i, (st, k, v) in enumerate(zip(states, keys, values)):
        record, st = xkv.method.layer_update(record, i, st, mx.array(k), mx.array(v))
        out.append(st)
    return record, out


def _top_subspace(rows, r):
    """The projector onto the top-``r`` right singular vectors of ``rows [n, d]``."""
    v = np.linalg.svd(rows, full_matrices=False)[2][:r].T
    return v @ v.T


# --- a hand-worked case -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_hand_worked(backend):
    """d = 16, groups of 8 latent channels, 4 bits. The 32 rows are +a_i e_i and -a_i e_i with
    a_i = 15 * 2^(3 - i) (120, 60, ..., 15 * 2^-12): mean 0, covariance diag(a_i^2 / 16), whose
    eigenvectors are e_0, e_1, ... by decreasing a_i. Energies fall by 4 a component: the
    first two hold 0.75 and 0.9375 of the sum, three hold 0.984 >= 0.95, so the energy rank is
    3, rounded up to one group of 8: basis = e_0..e_7. Row +a_i e_i (i < 8) has latent a_i at
    channel i and 0 elsewhere: min 0, max a_i, scale a_i / 15 = 2^(3 - i), zero 0, code 15 at
    channel i (word 15 << 4i); row -a_i e_i: min -a_i, scale 2^(3 - i), zero -a_i, code 0 at
    channel i and (0 + a_i) / scale = 15 elsewhere. Both reconstruct exactly; rows along
    e_8..e_15 have latents all 0 (scale 0, codes 0) and come back as the mean, 0.
    Bytes: 32 tokens x (one 4-byte word + a float16 scale and zero + 16 float16 values) +
    the basis 16 x 8 float32 + the mean 16 float32 + next_pos 4 = 1280 + 512 + 64 + 4."""
    a = 15.0 * 2.0 ** (3 - np.arange(16))
    rows = np.concatenate([np.diag(a), -np.diag(a)])[None, None].astype(np.float32)
    vals = (np.arange(32 * 16, dtype=np.float32).reshape(1, 1, 32, 16) - 200) / 8
    s = xkv.init(1, 1, 16, group_quant_size=8, backend=backend)
    s = xkv.update(s, mx.array(rows), mx.array(vals))
    np.testing.assert_array_equal(np.array(s.basis)[0, 0], np.eye(16, dtype=np.float32)[:, :8])
    assert np.array(xkv.widths(s)).tolist() == [[8]]
    words = np.array(s.codes).ravel().tolist()
    assert words[:8] == [15 << (4 * i) for i in range(8)]
    assert words[16:24] == [0xFFFFFFFF ^ (15 << (4 * i)) for i in range(8)]
    assert words[8:16] == words[24:] == [0] * 8
    scales = np.array(s.scales).ravel()
    np.testing.assert_array_equal(scales[:8], 2.0 ** (3 - np.arange(8)))
    np.testing.assert_array_equal(np.array(s.zeros).ravel()[16:24], -a[:8])
    keys, values = xkv.get_kv(s)
    want = np.where((np.arange(32) % 16 < 8)[:, None], rows[0, 0], 0)
    np.testing.assert_array_equal(np.array(keys)[0, 0], want)
    np.testing.assert_array_equal(np.array(values), vals)
    assert xkv.nbytes(s) == 1860 == state_nbytes(s)
    # A decode step projects onto the frozen basis: 7.5 e_0 + 2 e_9 -> latent 7.5 at channel 0
    # (scale 0.5, code 15); e_9 is outside the basis and dropped.
    k = np.zeros((1, 1, 1, 16), np.float32)
    k[..., 0], k[..., 9] = 7.5, 2.0
    s2 = xkv.update(s, mx.array(k), mx.array(k))
    assert s2.basis is s.basis
    assert np.array(s2.codes).ravel()[-1] == 15
    np.testing.assert_array_equal(np.array(xkv.get_kv(s2)[0])[0, 0, -1], np.eye(16)[0] * 7.5)


# --- the fitted basis -------------------------------------------------------------------------

def test_energy_rank_rounded_to_whole_groups_and_orthonormal():
    """Head 0's keys hold 95% of their energy in few components, head 1's in many: each head
    keeps its own energy rank (from NumPy's SVD of its centred keys) rounded up to whole groups
    of 8; the batch holds the widest, head 0's extra columns zero; its columns orthonormal."""
    d, n = 32, 200
    k0 = _keys((n, d), seed=1, top=8.0, low=0.001)
    k1 = _keys((n, d), seed=2, top=1.0, low=0.5)
    keys = np.stack([k0, k1])[None]
    s = xkv.update(xkv.init(1, 2, d, group_quant_size=8), mx.array(keys), mx.array(keys))
    basis = np.array(s.basis)[0]
    for j, k in enumerate((k0, k1)):
        sv = np.linalg.svd(k - k.mean(axis=0), compute_uv=False) ** 2
        r = int(np.searchsorted(np.cumsum(sv) / sv.sum(), 0.95) + 1)
        w = min(-(-r // 8) * 8, d)
        assert int(np.array(xkv.widths(s))[0, j]) == w
        b = basis[j][:, :w]
        np.testing.assert_allclose(b.T @ b, np.eye(w), atol=1e-5)
        assert not basis[j][:, w:].any()
    assert basis.shape[-1] == max(np.array(xkv.widths(s))[0])


def test_a_group_of_one_is_the_single_layer_fit():
    """group_size=1 through the record: each layer's state equals its plain update's, array
    for array, and its basis spans the top components of its own centred keys (NumPy SVD)."""
    d, r = 16, 8
    keys = [_keys((1, 2, 40, d), seed=i) for i in range(2)]
    vals = [_values((1, 2, 40, d), seed=i) for i in range(2)]
    record, _ = _model(2, group_size=1, rank=r, group_quant_size=8)
    record, states = _forward(record, [xkv.init(1, 2, d, group_size=1, rank=r, group_quant_size=8)] * 2,
                              keys, vals)
    for i, st in enumerate(states):
        alone = xkv.update(xkv.init(1, 2, d, group_size=1, rank=r, group_quant_size=8),
                           mx.array(keys[i]), mx.array(vals[i]))
        for (name, x), (_, y) in zip(tree_flatten(st), tree_flatten(alone)):
            assert (mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y), name
        assert record.bases[str(i)] is st.basis
        for j in range(2):
            b = np.array(st.basis)[0, j]
            k = keys[i][0, j]
            np.testing.assert_allclose(b @ b.T, _top_subspace(k - k.mean(axis=0), r), atol=1e-4)


# --- a group of layers ------------------------------------------------------------------------

def test_the_group_shares_one_basis_after_the_settle_round():
    """Three layers, group_size=2: groups (0, 1) and (2,). Forward 1 (a prefill): layer 0 holds
    its keys exact and publishes its scatter; layer 1 fits the basis on both layers' keys, each
    centred on its own mean (NumPy: the top subspace of the stacked centred rows), codes its
    own and publishes it; layer 2 fits alone. Forward 2 (a decode token): layer 0 adopts the
    record's array and codes its pending keys with it. Only the layer that fitted a basis
    counts it: the layers' bytes sum to every distinct array once."""
    d, n, r = 16, 48, 8
    keys = [_keys((1, 1, n, d), seed=i, offset=0.3 * i) for i in range(3)]
    vals = [_values((1, 1, n, d), seed=10 + i) for i in range(3)]
    params = dict(group_size=2, rank=r, group_quant_size=8)
    record, _ = _model(3, **params)
    fresh = [xkv.init(1, 1, d, **params) for _ in range(3)]
    record, states = _forward(record, fresh, keys, vals)
    l0, l1, l2 = states
    assert not xkv.fitted(l0) and l0.codes.shape[2] == 0
    np.testing.assert_array_equal(np.array(xkv.get_kv(l0)[0]), keys[0])  # exact while pending
    assert record.bases["0"] is l1.basis and record.bases["1"] is l2.basis
    assert l1.shared_basis.shape[-1] == 0 and l2.shared_basis.shape[-1] == 0
    stacked = np.concatenate([k[0, 0] - k[0, 0].mean(axis=0) for k in keys[:2]])
    b = np.array(l1.basis)[0, 0]
    np.testing.assert_allclose(b @ b.T, _top_subspace(stacked, r), atol=1e-4)
    np.testing.assert_allclose(np.array(l0.mean)[0, 0], keys[0][0, 0].mean(axis=0), atol=1e-6)

    step = [_keys((1, 1, 1, d), seed=20 + i) for i in range(3)]
    record, states = _forward(record, states, step, [_values((1, 1, 1, d), 30 + i) for i in range(3)])
    l0, l1, l2 = states
    assert l0.shared_basis is l1.basis is record.bases["0"] and l0.basis.shape[-1] == 0
    assert l0.pending.shape[2] == 0 and l0.codes.shape[2] == n + 1
    # layer 0's codes are its own keys' in the shared basis, on its own mean
    want = xkv.update(xkv.init(1, 1, d, **params)._replace(basis=l1.basis, mean=l0.mean),
                      mx.array(np.concatenate([keys[0], step[0]], axis=2)),
                      mx.array(np.zeros((1, 1, n + 1, d), np.float32)))
    assert mx.array_equal(want.codes, l0.codes).item() and mx.array_equal(want.scales, l0.scales).item()
    assert xkv.nbytes(l0) == state_nbytes(l0) - l1.basis.nbytes
    distinct = {id(x): x.nbytes for st in states for _, x in tree_flatten(st) if isinstance(x, mx.array)}
    assert sum(xkv.nbytes(st) for st in states) == sum(distinct.values())


def test_a_trailing_shorter_group_fits_on_its_layers():
    """Three layers, group_size=4: one group (0, 1, 2) whose last layer is 2; the fan-in
    carries layers 0 and 1, and all three end with layer 2's basis."""
    d = 16
    keys = [_keys((1, 1, 30, d), seed=i) for i in range(3)]
    params = dict(group_size=4, rank=8, group_quant_size=8)
    record, _ = _model(3, **params)
    record, states = _forward(record, [xkv.init(1, 1, d, **params) for _ in range(3)], keys, keys)
    assert list(record.bases) == ["0"] and record.bases["0"] is states[2].basis
    assert not xkv.fitted(states[0]) and not xkv.fitted(states[1])
    stacked = np.concatenate([k[0, 0] - k[0, 0].mean(axis=0) for k in keys])
    b = np.array(states[2].basis)[0, 0]
    np.testing.assert_allclose(b @ b.T, _top_subspace(stacked, 8), atol=1e-4)
    one = [k[:, :, :1] for k in keys]
    record, states = _forward(record, states, one, one)
    assert all(st.shared_basis is states[2].basis for st in states[:2])


def test_decode_never_refits():
    """After the settle round, decode steps (and a later chunk) leave every basis, mean and the
    record's arrays as they were (the same arrays)."""
    d = 16
    params = dict(group_size=2, group_quant_size=8)
    record, _ = _model(2, **params)
    record, states = _forward(record, [xkv.init(1, 2, d, **params)] * 2,
                              [_keys((1, 2, 40, d), seed=i) for i in range(2)],
                              [_values((1, 2, 40, d), seed=i) for i in range(2)])
    record, states = _forward(record, states, *[[_keys((1, 2, 1, d), seed=5)] * 2] * 2)
    held = [(xkv.basis_of(st), st.mean) for st in states]
    bases = dict(record.bases)
    for t, s in enumerate((1, 1, 5, 1)):
        k = [_keys((1, 2, s, d), seed=40 + t + 10 * i, top=50.0) for i in range(2)]
        record, states = _forward(record, states, k, k)
    for (b, m), st in zip(held, states):
        assert xkv.basis_of(st) is b and st.mean is m
    assert all(record.bases[g] is bases[g] for g in bases)
    assert states[0].codes.shape[2] == 40 + 1 + 8


# --- reconstruction -----------------------------------------------------------------------------

def test_full_rank_projection_is_lossless():
    """At full rank the basis is orthonormal and square: (k - mean) B B^T + mean = k up to
    float32 rounding (the codes add their own error: 8-bit latents are not lossless)."""
    d = 32
    keys = _keys((2, 2, 64, d), seed=3)
    s = xkv.update(xkv.init(2, 2, d, rank=d), mx.array(keys), mx.array(keys))
    b, m = np.array(s.basis), np.array(s.mean)
    assert b.shape == (2, 2, d, d)
    back = (keys - m[:, :, None]) @ b @ np.swapaxes(b, -1, -2) + m[:, :, None]
    np.testing.assert_allclose(back, keys, atol=2e-5, rtol=0)


def test_eight_bit_latents_are_within_their_quantization_error():
    """Full rank, 8-bit latents: a key's error is its latent error (the basis is orthonormal),
    which is at most half a step a channel: |k_hat - k|_2 <= sqrt(sum_g g (scale_g / 2)^2)
    plus float32 rounding."""
    d, g = 32, 8
    keys = _keys((1, 2, 64, d), seed=4)
    s = xkv.update(xkv.init(1, 2, d, rank=d, latent_bits=8, group_quant_size=g),
                   mx.array(keys), mx.array(keys))
    err = np.linalg.norm(np.array(xkv.get_kv(s)[0]) - keys, axis=-1)
    step = np.array(s.scales.astype(mx.float32))
    bound = np.sqrt((g * (step / 2) ** 2).sum(axis=-1)) + 1e-5 * np.linalg.norm(keys, axis=-1)
    assert (err <= bound).all()
    assert err.max() < 0.01 * np.linalg.norm(keys, axis=-1).mean()


def test_bytes_below_fp16_keys_for_a_long_context():
    """head_dim 64 at the defaults (4-bit latents, groups of 32) over 1,024 tokens: the key
    side (codes, scales, zeros, basis, mean) holds less than the fp16 keys, and the total is
    the arrays' bytes by the layout's formula."""
    d, n = 64, 1024
    keys = _keys((1, 2, n, d), seed=5, top=6.0, low=0.01)
    s = xkv.update(xkv.init(1, 2, d), mx.array(keys), mx.array(keys))
    w = s.basis.shape[-1]
    assert w in (32, 64)
    per_token = w * 4 // 8 + 2 * (w // 32) * 2          # codes, float16 scale and zero
    key_bytes = 2 * (n * per_token + d * w * 4 + d * 4)  # two heads, their bases and means
    assert s.codes.nbytes + s.scales.nbytes + s.zeros.nbytes + s.basis.nbytes + s.mean.nbytes == key_bytes
    assert key_bytes < 2 * n * d * 2
    assert xkv.nbytes(s) == key_bytes + 2 * n * d * 2 + s.next_pos.nbytes


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_values_pass_through(dtype):
    """Values are held exact in the model's dtype (float16 for a float32 cache), pending or
    coded, and handed back in the model's dtype."""
    d = 16
    vals = mx.array(_values((1, 2, 20, d))).astype(dtype)
    keys = mx.array(_keys((1, 2, 20, d))).astype(dtype)
    want = np.array(vals.astype(FP16 if dtype == mx.float32 else dtype).astype(mx.float32))
    s = xkv.update(xkv.init(1, 2, d, dtype=dtype, group_quant_size=8), keys, vals)
    got = xkv.get_kv(s)[1]
    assert got.dtype == dtype and np.array_equal(np.array(got.astype(mx.float32)), want)
    record, _ = _model(2, group_size=2, group_quant_size=8)
    _, (pending, _) = _forward(record, [xkv.init(1, 2, d, dtype=dtype, group_quant_size=8)] * 2,
                               [keys] * 2, [vals] * 2)
    assert np.array_equal(np.array(xkv.get_kv(pending)[1].astype(mx.float32)), want)


def test_attention_on_the_latents_equals_dense_attention():
    """A decode token's attention projects the query once and reads the latents; it equals
    attention over get_kv's rebuilt keys (GQA: two query heads a kv head), pending keys
    included (a layer before its settle round)."""
    d = 32
    keys = mx.array(_keys((1, 2, 50, d)))
    s = xkv.update(xkv.init(1, 2, d), keys, keys)
    q, k1 = mx.array(_keys((1, 4, 1, d), seed=9)), mx.array(_keys((1, 2, 1, d), seed=8))
    got = xkv.attend(s, q, k1, k1, scale=d ** -0.5)
    k, v = xkv.get_kv(s)
    want = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k, k1], 2), mx.concatenate([v, k1], 2),
                                                scale=d ** -0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_layers_of_a_group_must_agree():
    with pytest.raises(ValueError, match="group_size"):
        xkv.method.model_init([dict(group_size=2), dict(group_size=3)])
    with pytest.raises(ValueError, match="rank"):
        xkv.method.model_init([dict(rank=8), dict(rank=16)])
    with pytest.raises(ValueError, match="rank=80 .*head_dim"):
        xkv.init(1, 1, 64, rank=80)


def test_directions_the_rows_leave_empty_get_a_canonical_basis():
    """Six rows in 16 dims leave a 10-dim empty space (after centring, 11), whose eigenvectors
    eigh may turn at will; the fit makes them canonical, so rows that differ in their last
    bits give the same basis (to their rounding), and all-zero keys the identity."""
    d = 16
    rows = _keys((1, 1, 6, d), seed=6)
    nudged = rows * (1 + 1e-6 * np.random.default_rng(7).standard_normal(rows.shape)).astype(np.float32)
    fits = [xkv.update(xkv.init(1, 1, d, rank=d), mx.array(x), mx.array(x)) for x in (rows, nudged)]
    a, b = (np.array(s.basis)[0, 0] for s in fits)
    np.testing.assert_allclose(a, b, atol=1e-3)
    np.testing.assert_allclose(a.T @ a, np.eye(d), atol=1e-5)
    zero = xkv.update(xkv.init(1, 1, d, rank=d), mx.zeros((1, 1, 4, d)), mx.zeros((1, 1, 4, d)))
    np.testing.assert_array_equal(np.array(zero.basis)[0, 0], np.eye(d))


# --- through the mlx-lm adapter ------------------------------------------------------------

PROMPT = [(5 * i + 3) % 97 for i in range(20)]


def _greedy(model, caches, n, prompt=PROMPT):
    from mlx_lm.generate import generate_step
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                             max_tokens=n, prefill_step_size=8)]


def test_through_the_adapter_saved_and_loaded(tiny_llama, tmp_path, no_shape_checks):
    """make_cache on a 3-layer model (groups (0, 1) and (2,)), a prompt prefilled in chunks:
    layer 0 holds layer 1's basis, the record's; a saved and loaded cache holds the arrays
    once, shares them again, and decodes the same tokens as the original."""
    from velox.adapters.mlxlm import cache_nbytes, load_cache, make_cache, save_cache
    caches = make_cache(tiny_llama, "xkv")
    _greedy(tiny_llama, caches, 2)
    st = [c.velox_state for c in caches]
    record = caches[0]._model.record
    assert st[0].shared_basis is st[1].basis is record.bases["0"] and record.bases["1"] is st[2].basis
    assert cache_nbytes(caches) == sum(xkv.nbytes(s) for s in st)
    path = tmp_path / "xkv.safetensors"
    save_cache(path, caches)
    loaded, _ = load_cache(path, tiny_llama)
    ls = [c.velox_state for c in loaded]
    assert ls[0].shared_basis is ls[1].basis is loaded[0]._model.record.bases["0"]
    more = [3, 1, 4]
    assert _greedy(tiny_llama, caches, 3, more) == _greedy(tiny_llama, loaded, 3, more)


def test_batched_generation_equals_one_request_at_a_time(tiny_llama, no_shape_checks):
    """batch_generate over prompts of different lengths (right-padded prompt chunks, rows
    finishing at different steps) gives each its batch-of-one greedy tokens."""
    from types import SimpleNamespace

    from mlx_lm import batch_generate

    from velox.adapters.mlxlm import make_cache
    prompts = [PROMPT, [(7 * i + 1) % 97 for i in range(6)]]
    tok = SimpleNamespace(eos_token_ids=[], decode=lambda ids: " ".join(map(str, ids)))
    r = batch_generate(tiny_llama, tok, prompts, prompt_caches=[make_cache(tiny_llama, "xkv") for _ in prompts],
                       max_tokens=[6, 4], prefill_step_size=8, return_token_ids=True)
    assert r.token_ids == [_greedy(tiny_llama, make_cache(tiny_llama, "xkv"), n, p)
                           for p, n in zip(prompts, (6, 4))]

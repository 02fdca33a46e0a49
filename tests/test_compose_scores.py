"""A composed policy that scores by attention logits reads the stored keys through the codec's
``scores`` (its estimates from the key codes), not through decoded keys.

The hand computations below take the stored tokens' logits from the codec's NumPy ``scores_np``
on the state's own codes and the new tokens' from the exact keys, in float64. The caches are
bfloat16: decoded keys are then rounded to bfloat16, so logits of decoded keys differ from the
codec's float32 estimates by a few parts in a thousand, enough for a test that tells the two
apart (in float32 the codecs' decodes are linear in the same codes, and the two agree to
rounding).
"""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.codecs import affine, get_codec, numpy_tables
from velox.reference import softmax

D = 32


def _codes_np(codes):
    return type(codes)(*(np.array(x) for x in codes))


def _tables_and_codes(state, codec_name: str):
    """The codec's NumPy tables and the state's key codes (the affine composition holds its
    codes and their scales and zeros as fields of its own)."""
    if codec_name == "affine":
        t = affine.tables(D, dict(bits=state.bits, group_size=state.group_size, dtype=state.cache_dtype))
        codes = affine.AffineCodes(state.key_codes, state.key_scales, state.key_zeros)
        return t, type(codes)(*(_as_np(x) if x.dtype == mx.bfloat16 else np.array(x) for x in codes))
    return numpy_tables(state.tables), _codes_np(state.key_codes)


def _stored_logits(state, codec_name: str, q: np.ndarray) -> np.ndarray:
    """Logits ``[h, m, n]`` of float64 queries ``q [h, m, d]`` (batch row 0) over the stored
    tokens: the codec's ``scores_np`` of the scaled queries (float32) on the state's codes."""
    t, codes = _tables_and_codes(state, codec_name)
    scaled = (q / np.sqrt(D)).astype(np.float32)[None]
    return get_codec(codec_name).scores_np(t, scaled, codes)[0].astype(np.float64)


def _decoded_logits(state, q: np.ndarray) -> np.ndarray:
    k, _ = velox.get_kv(state)  # decoded keys, in the cache's dtype
    k = np.array(k.astype(mx.float32), np.float64)[0]
    return q @ k.swapaxes(-1, -2) / np.sqrt(D)


def _as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32), np.float64)


def _bf16(x: np.ndarray) -> mx.array:
    return mx.array(np.asarray(x, np.float32)).astype(mx.bfloat16)


def _prefilled(key: str, seed: int, n: int, **params):
    """A bfloat16 state holding ``n`` random tokens (no eviction yet), on the ``reference``
    backend."""
    rng = np.random.default_rng(seed)
    k = _bf16(rng.standard_normal((1, 1, n, D)))
    st = velox.init(key, 1, 1, D, dtype=mx.bfloat16, backend="reference", **params)
    return velox.update(st, k, k)


def _lowest(logits: np.ndarray) -> tuple[np.ndarray, float]:
    """Candidates by increasing weight (softmax of ``logits``; ties: the older first) and the
    relative gap between the two lowest weights."""
    w = softmax(logits)
    order = np.argsort(w, kind="stable")
    return order, float((w[order[1]] - w[order[0]]) / w[order[1]])


@pytest.mark.parametrize("codec", ["qjl", "turboquant_prod"])
def test_tova_keeps_what_the_codec_scores_choose(codec):
    """A decode step at a full cache evicts the token of lowest attention under the codec's
    estimates for the stored tokens (exact for the new one), on both backends.

    The query is built so that the choice differs from the one over decoded keys: two stored
    keys ``a``, ``b`` point away from it (the others are orthogonal to their direction), their estimates differ by ``+eta`` (``b`` lower) and
    their decoded (bfloat16) keys' logits by ``-eta`` (``a`` lower), every other token well
    above; a solve for the query given the state's decoded keys and their rounding.
    """
    key, n, a, b, eta = f"tova+{codec}", 24, 5, 11, 0.05
    rng = np.random.default_rng(0)
    u = rng.standard_normal(D)
    u *= 1.25 / np.linalg.norm(u) * np.sqrt(D)
    keys = rng.standard_normal((n + 1, D))
    keys -= np.outer(keys @ u, u) / (u @ u)  # the others orthogonal to u
    keys[[a, b]] = -u + 0.5 * rng.standard_normal((2, D))
    st = velox.init(key, 1, 1, D, dtype=mx.bfloat16, backend="reference", budget=n, n_sink=0,
                    per_head=True)
    k = _bf16(keys[None, None])
    st = velox.update(st, k[:, :, :n], k[:, :, :n])

    dec = get_codec(codec).decode_np(numpy_tables(st.tables), _codes_np(st.key_codes))[0, 0].astype(np.float64)
    rows = _as_np(velox.get_kv(st)[0])[0, 0]  # decoded, rounded to bfloat16
    err = rows - dec
    lhs = np.stack([dec[a] - dec[b], err[a] - err[b], (dec[a] + dec[b]) / 2])
    q = np.linalg.lstsq(lhs, np.array([eta, -2 * eta, -15.0]) * np.sqrt(D), rcond=None)[0]
    q = _bf16(q[None, None, None])  # [1, 1, 1, d]: one query head
    qn = _as_np(q)[0]

    new_logit = float(_as_np(k[:, :, n:])[0, 0, 0] @ qn[0, 0] / np.sqrt(D))
    by_codes, gap = _lowest(np.append(_stored_logits(st, codec, qn)[0, 0], new_logit))
    by_rows, gap_rows = _lowest(np.append(_decoded_logits(st, qn)[0, 0], new_logit))
    assert sorted(by_codes[:2]) == [a, b] and by_codes[0] == b and by_rows[0] == a
    assert gap > 1e-2 and gap_rows > 1e-2  # far above float32 rounding of either backend

    want = np.delete(np.arange(n + 1), b)
    for backend in ("reference", "mlx"):
        out = velox.update(st._replace(backend=backend), k[:, :, n:], k[:, :, n:], queries=q)
        got = np.array(velox.positions(out))[0, 0]
        assert got.tolist() == want.tolist(), f"{backend}: kept {got}, the codec's scores keep {want}"


def _h2o_hand(st, codec: str, k_new: mx.array, decay: float, acc: np.ndarray, logits=None) -> np.ndarray:
    """H2O's accumulators after the new tokens ``k_new [1, 1, s, d]`` (their own queries):
    per query, decay, then add its causal attention over stored (codec estimates, or
    ``logits(state, q)``) + new (exact) keys."""
    q = _as_np(k_new)[0]  # [1, s, d]
    s = q.shape[1]
    stored = _stored_logits(st, codec, q) if logits is None else logits(st, q)  # [1, s, n]
    new = q @ q.swapaxes(-1, -2) / np.sqrt(D)
    new = np.where(np.tril(np.ones((s, s), bool)), new, -np.inf)
    acc = np.concatenate([acc, np.zeros(s)])
    w = softmax(np.concatenate([stored, new], axis=-1))[0]  # [s, n + s]
    for t in range(s):
        acc = acc * decay + w[t]
    return acc


@pytest.mark.parametrize("codec", ["turboquant_mse", "affine"])
def test_h2o_accumulates_the_mass_of_the_codec_scores(codec):
    """After a decode step and a chunk of 3 (no eviction), H2O's accumulated attention equals the
    mass computed from the codec's estimates, on both backends, and differs from the mass of
    decoded keys by far more than the tolerance."""
    key, n, decay = f"h2o+{codec}", 20, 0.9
    st = _prefilled(key, 0, n, budget=64, n_sink=0, grace=0, decay=decay)
    rng = np.random.default_rng(1)
    chunks = [_bf16(rng.standard_normal((1, 1, s, D))) for s in (1, 3)]
    for backend in ("reference", "mlx"):
        cur = st._replace(backend=backend)
        for k in chunks:
            acc = np.array(cur.policy.scores, np.float64)[0, 0]
            want = _h2o_hand(cur, codec, k, decay, acc)
            rows = _h2o_hand(cur, codec, k, decay, acc, logits=_decoded_logits)
            cur = velox.update(cur, k, k)
            got = np.array(cur.policy.scores, np.float64)[0, 0]
            tol = 1e-6 + 1e-6 * np.abs(want)
            assert (np.abs(got - want) <= tol).all(), f"{backend}: {np.abs(got - want).max():.3g}"
            assert (np.abs(rows - want) > 10 * tol).any(), "decoded keys would give the same mass"


def test_policy_keys_in_the_composed_specs():
    """Each composed spec says how its policy reads the stored keys; the deviation on decoded
    keys appears only where it holds."""
    from velox import compose, evict
    from velox.codecs import qjl

    decoded = "The policy scores candidates with the decoded stored keys"
    for key in ("tova+qjl", "tova+turboquant_prod", "tova+turboquant_mse", "tova+affine",
                "h2o+affine", "h2o+turboquant_mse", "tova+vecinfer", "h2o+vecinfer"):
        spec = velox.get_method(key).spec
        assert spec.contract["policy_keys"] == "codes"
        assert not any(d.startswith(decoded) for d in spec.deviations)
        assert any("the codec's estimates" in d for d in spec.deviations)
    knorm = velox.get_method("knorm")  # scores key norms: keeps decoded keys
    assert not evict.scores_by_logits(knorm) and evict.scores_by_logits(velox.get_method("tova"))
    spec = compose._code_spec(knorm.spec, velox.get_method("qjl").spec, "knorm+qjl", qjl.CODEC.params,
                              evict.scores_by_logits(knorm))
    assert spec.contract["policy_keys"] == "decoded"
    assert any(d.startswith(decoded) for d in spec.deviations)

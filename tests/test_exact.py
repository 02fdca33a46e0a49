"""One tiny case per method, computed by hand, on every backend that runs here."""

import mlx.core as mx
import numpy as np
import pytest

import velox

BACKENDS = ["reference", "mlx"]


def rows(*vals):
    """[1, 1, s, d] from a list of per-token vectors."""
    return mx.array(np.array(vals, np.float32)[None, None])


def pos(state):
    return np.array(velox.positions(state))[0, 0].tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_llm_by_hand(backend):
    # 2 sinks + window 3 over 7 tokens: keep 0, 1 and the last three, 4, 5, 6.
    x = rows(*[[float(t)] for t in range(7)])
    st = velox.streaming_llm_init(1, 1, 1, n_sink=2, window_size=3, backend=backend)
    st = velox.streaming_llm_update(st, x, -x)
    assert pos(st) == [0, 1, 4, 5, 6]
    k, v = velox.streaming_llm_get_kv(st)
    assert np.array(k).ravel().tolist() == [0, 1, 4, 5, 6]
    assert np.array(v).ravel().tolist() == [0, -1, -4, -5, -6]
    # Token by token ends in the same state (path independence).
    st2 = velox.streaming_llm_init(1, 1, 1, n_sink=2, window_size=3, backend=backend)
    for t in range(7):
        st2 = velox.streaming_llm_update(st2, x[:, :, t:t + 1], -x[:, :, t:t + 1])
    assert pos(st2) == [0, 1, 4, 5, 6]
    assert velox.streaming_llm_bytes(st) == 5 * 4 * 2 + 5 * 4 + 4  # keys, values, positions, next_pos


@pytest.mark.parametrize("backend", BACKENDS)
def test_tova_by_hand(backend):
    # Stored: k0=[0,0] (sink), k1=[1,0], k2=[0,1]. New k3=[0,2] is its own (proxy) query:
    # logits q.k/sqrt(2) = 0, 0, 1.41, 2.83. Non-sink minimum: k1 -> evicted.
    st = velox.tova_init(1, 1, 2, budget=3, n_sink=1, backend=backend)
    st = velox.tova_update(st, rows([0, 0], [1, 0], [0, 1]), rows([0, 0], [1, 1], [2, 2]))
    assert pos(st) == [0, 1, 2]
    st = velox.tova_update(st, rows([0, 2]), rows([3, 3]))
    assert pos(st) == [0, 2, 3]
    k, v = velox.tova_get_kv(st)
    assert np.array(v)[0, 0].tolist() == [[0, 0], [2, 2], [3, 3]]
    # With a real query [1, 0] instead: logits 0, 0.71, 0, 0 -> k1 wins; among the tied
    # zeros k2 and k3 the newer (k3) is kept, so k2 goes.
    st = velox.tova_init(1, 1, 2, budget=3, n_sink=1, backend=backend)
    st = velox.tova_update(st, rows([0, 0], [1, 0], [0, 1]), rows([0, 0], [1, 1], [2, 2]))
    st = velox.tova_update(st, rows([0, 2]), rows([3, 3]), queries=rows([1, 0]))
    assert pos(st) == [0, 1, 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tova_layerwise_averages_heads(backend):
    # Two heads disagree; the paper's rule averages their attention and keeps one set.
    k = mx.array(np.array([[[1, 0], [0, 1], [0, 0]], [[0, 3], [0, 0], [0, 0]]], np.float32)[None])
    st = velox.tova_init(1, 2, 2, budget=2, n_sink=0, backend=backend)
    st = velox.tova_update(st, k[:, :, :2], k[:, :, :2])
    q = mx.array(np.array([[[1, 0]], [[0, 1]]], np.float32)[None])  # head0 likes t0, head1 t0 too
    st = velox.tova_update(st, k[:, :, 2:], k[:, :, 2:], queries=q)
    p = np.array(st.positions)[0]
    assert (p[0] == p[1]).all()
    # head0 weights over (t0, t1, t2) ~ softmax(0.71, 0, 0); head1 ~ softmax(2.12, 0, 0):
    # the mean favours t0; t1 and t2 tie, the newer t2 stays.
    assert p[0].tolist() == [0, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_h2o_by_hand(backend):
    # All keys zero: each query spreads 1/n over the n tokens it sees.
    # After t0: [1]. t1: [1*.5 + .5, .5] = [1, .5]. t2: [.5 + 1/3, .25 + 1/3, 1/3];
    # budget 2, no sinks, no grace: the newest token t2 has the least and is evicted.
    st = velox.h2o_init(1, 1, 1, budget=2, n_sink=0, grace=0, decay=0.5, backend=backend)
    z = rows([0.0])
    for _ in range(3):
        st = velox.h2o_update(st, z, z)
    assert pos(st) == [0, 1]
    assert np.allclose(np.array(st.scores)[0, 0], [0.5 + 1 / 3, 0.25 + 1 / 3], atol=1e-6)
    # The same three tokens as one chunk give the same accumulated scores.
    st2 = velox.h2o_init(1, 1, 1, budget=2, n_sink=0, grace=0, decay=0.5, backend=backend)
    st2 = velox.h2o_update(st2, rows([0.0], [0.0], [0.0]), rows([0.0], [0.0], [0.0]))
    assert pos(st2) == [0, 1]
    assert np.allclose(np.array(st2.scores), np.array(st.scores), atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h2o_grace_protects_newest(backend):
    st = velox.h2o_init(1, 1, 1, budget=2, n_sink=0, grace=1, decay=0.5, backend=backend)
    z = rows([0.0])
    for _ in range(3):
        st = velox.h2o_update(st, z, z)
    assert pos(st) == [0, 2]  # t2 is protected; t1 (.25 + 1/3) loses to t0 (.5 + 1/3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_snapkv_by_hand(backend):
    # Prefill keys (d=1) 0, 1, 0, 3, 2; window = the last token (key 2, its own query):
    # logits 0, 2, 0, 6, 4. Sink t0 and window t4 are kept; one slot left -> t3.
    st = velox.snapkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=1, kernel_size=1, backend=backend)
    k = rows([0.0], [1.0], [0.0], [3.0], [2.0])
    st = velox.snapkv_update(st, k, k)
    assert pos(st) == [0, 3, 4]
    st = velox.snapkv_update(st, rows([5.0]), rows([5.0]))  # decode: appended
    assert pos(st) == [0, 3, 4, 5]
    # Prompt 0, 1, 0, 3; window t3 (key 3): logits 0, 3, 0, 9. The prefix t0..t2 is
    # average-pooled with kernel 3 (zero padding): t1 = (w0+w1+w2)/3 > t2 = (w1+w2)/3,
    # so with t0 (sink) and t3 (window) protected, t1 takes the last slot.
    st = velox.snapkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=1, kernel_size=3, backend=backend)
    st = velox.snapkv_update(st, k[:, :, :4], k[:, :, :4])
    assert pos(st) == [0, 1, 3]
    # Pooling changes the choice: keys 1, -2, 3, 0 | window 0, query 1 (d=1): votes
    # w = softmax(1, -2, 3, 0, 0) = .109, .005, .805, .040 (| .040). Raw: t2, t0 win.
    # Average pooling (kernel 3, zero padding) over the prefix: t0 .038, t1 .307,
    # t2 .284, t3 .282 -> t1, t2 win.
    k2 = rows([1.0], [-2.0], [3.0], [0.0], [0.0])
    q = rows([0.0], [0.0], [0.0], [0.0], [1.0])
    plain = velox.snapkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=0, kernel_size=1, backend=backend)
    pooled = velox.snapkv_init(1, 1, 1, budget=3, obs_window=1, n_sink=0, kernel_size=3, backend=backend)
    assert pos(velox.snapkv_update(plain, k2, k2, queries=q)) == [0, 2, 4]
    assert pos(velox.snapkv_update(pooled, k2, k2, queries=q)) == [1, 2, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_kivi_by_hand(backend):
    # 32 tokens, every channel of token t equals t; 2 bits, no residual window.
    # Keys per channel: min 0, max 31, scale 31/3; code(t) = round(3t/31):
    # t 0..5 -> 0, 6..15 -> 1, 16..25 -> 2, 26..31 -> 3.
    t = np.arange(32, dtype=np.float32)
    x = mx.array(np.broadcast_to(t[:, None], (32, 32)).copy()[None, None])
    st = velox.kivi_init(1, 1, 32, bits=2, group_size=32, residual_length=0, backend=backend)
    st = velox.kivi_update(st, x, x)
    codes = np.array([0] * 6 + [1] * 10 + [2] * 10 + [3] * 6)
    words = [sum(int(c) << (2 * i) for i, c in enumerate(codes[16 * w:16 * w + 16])) for w in range(2)]
    assert np.array(st.key_codes)[0, 0, 0].tolist() == words
    assert np.allclose(np.array(st.key_scales)[0, 0, :, 0], 31 / 3, rtol=2 ** -11)  # float16
    k, v = velox.kivi_get_kv(st)
    assert np.allclose(np.array(k)[0, 0, :, 0], codes * 31 / 3, rtol=2 ** -11, atol=1e-5)
    # Values per token: each token's 32 channels are equal, so scale 0: exact.
    assert np.array_equal(np.array(v)[0, 0], np.array(x)[0, 0])
    # Bytes: key codes 32*32*2/8 + key scale/zero 32 channels x 1 group x 2 x 2 B (float16)
    # + value codes 256 + value scale/zero 32 tokens x 1 group x 2 x 2 B + next_pos 4 B.
    assert velox.kivi_bytes(st) == 256 + 128 + 256 + 128 + 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_kivi_one_chunk_equals_token_by_token(backend):
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((1, 2, 90, 32)).astype(np.float32))
    a = velox.kivi_init(1, 2, 32, residual_length=20, residual_dtype="model", backend=backend)
    a = velox.kivi_update(a, x, -x)
    b = velox.kivi_init(1, 2, 32, residual_length=20, residual_dtype="model", backend=backend)
    for t in range(90):
        b = velox.kivi_update(b, x[:, :, t:t + 1], -x[:, :, t:t + 1])
    assert all(mx.array_equal(p, q).item() for p, q in zip(a[:9], b[:9]))
    # 90 tokens, window 20, groups of 32: 64 quantized, 26 exact.
    assert a.key_scales.shape[-1] * 32 == 64 and a.residual_keys.shape[2] == 26
    assert mx.array_equal(velox.kivi_get_kv(a)[0][:, :, 64:], x[:, :, 64:]).item()

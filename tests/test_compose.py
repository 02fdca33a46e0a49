"""Composition: an eviction policy over survivors held as per-token affine codes."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox import compose


def _run(key, chunks, **params):
    rng = np.random.default_rng(0)
    st = velox.init(key, 1, 2, 32, **params)
    states, fed = [], []
    for s in chunks:
        k = mx.array(rng.standard_normal((1, 2, s, 32)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, 2, s, 32)).astype(np.float32))
        st = velox.update(st, k, v)
        states.append(st)
        fed.append((k, v))
    return states, fed


def test_one_line_composition_and_real_bytes():
    m = compose.evict_then_store("tova")
    assert m.key == "tova+affine" and velox.get_method("tova+affine") is m
    states, _ = _run("tova+affine", [40, 1, 1], budget=16, n_sink=2, bits=2)
    st = states[-1]
    assert velox.positions(st).shape == (1, 2, 16)
    # Per kept token and head: keys and values 32 ch x 2 bits = 8 B each, one group each with
    # a float16 scale and zero (4 B each), plus the policy's int32 position (4 B);
    # next_pos 4 B per head.
    assert velox.nbytes(st) == 2 * 16 * (8 + 8 + 4 + 4 + 4) + 2 * 4
    plain, _ = _run("tova", [40, 1, 1], budget=16, n_sink=2)
    assert velox.nbytes(plain[-1]) == 2 * 16 * (32 * 4 * 2 + 4) + 2 * 4
    assert velox.nbytes(st) < velox.nbytes(plain[-1]) / 9  # 8328 / 904 = 9.2x at d=32


def test_survivor_codes_are_never_reencoded():
    states, _ = _run("tova+affine", [30, 1, 1, 1, 1], budget=20, n_sink=2, bits=4)
    first, last = states[0], states[-1]
    # the codes' storage order: each slot's token (the policy's slot positions)
    p0 = np.array(first.policy.positions)[0, 0].tolist()
    p1 = np.array(last.policy.positions)[0, 0].tolist()
    assert sorted(p1) == np.array(velox.positions(last))[0, 0].tolist()
    for j, p in enumerate(p1):
        if p in p0:
            i = p0.index(p)
            assert mx.array_equal(last.key_codes[0, 0, j], first.key_codes[0, 0, i]).item()
            assert mx.array_equal(last.value_scales[0, 0, j], first.value_scales[0, 0, i]).item()


def test_survivors_are_within_the_codec_bound_of_their_inputs():
    states, fed = _run("tova+affine", [30, 1, 1, 1], budget=20, n_sink=2, bits=3)
    hk = mx.concatenate([k for k, _ in fed], axis=2)
    st = states[-1]
    pos = velox.positions(st)
    k, _ = velox.get_kv(st)
    want = mx.take_along_axis(hk, pos[..., None], axis=2)
    bound, _ = velox.get_method("tova+affine").error_bound(st)
    assert bool((mx.abs(k - want) <= bound).all())


def test_policies_that_cannot_be_composed_are_refused():
    with pytest.raises(ValueError, match="cannot be composed"):
        compose.evict_then_store("kivi")
    with pytest.raises(ValueError, match="unknown method"):
        compose.evict_then_store("nope")


def test_a_policy_composes_with_another_codec():
    import velox.methods.compositions as comps

    assert ("tova", "qjl") in comps.PAIRS
    m = velox.get_method("tova+qjl")
    assert set(m.spec.params) == {"budget", "n_sink", "per_head", "slack", "jl_dim", "seed"}
    st = velox.init("tova+qjl", 1, 2, 64, budget=16, n_sink=2)
    plain = velox.init("tova", 1, 2, 64, budget=16, n_sink=2)
    for s in (30, 1, 1):
        k, v = mx.random.normal((2, 1, 2, s, 64), key=mx.random.key(s))
        st, plain = velox.update(st, k, v), velox.update(plain, k, v)
    pos = np.array(velox.positions(st))
    assert pos.shape[2] == 16 and (np.diff(pos, axis=2) > 0).all() and (pos[..., :2] == [0, 1]).all()
    # a token: keys as 64 sign bits (8 B) + a float16 norm, values 64 B + float16 scale and
    # zero, its position 4 B (82 B against 2 x 256 B + 4 B of float32 rows); the sketch
    # [64, 64] float32 (16 KiB) once per layer
    assert velox.nbytes(st) - st.tables.sketch.nbytes == 1 * 2 * 16 * 82 + 8
    assert velox.nbytes(plain) == 1 * 2 * 16 * (2 * 256 + 4) + 8
    with pytest.raises(ValueError, match="unknown codec"):
        compose.evict_then_store("tova", "nope")


def test_keyword_parameters_become_the_init_defaults():
    import inspect

    m = compose.evict_then_store("tova", codec="turboquant_prod", bits=3)
    registered = velox.get_method("tova+turboquant_prod")
    assert compose.evict_then_store("tova", codec="turboquant_prod") is registered
    assert m is not registered and m.key == registered.key
    assert m.spec.defaults["bits"] == 3 and registered.spec.defaults["bits"] == 2
    assert inspect.signature(m.init).parameters["bits"].default == 3
    st = m.init(1, 2, 32, budget=16)
    assert st.bits == 3 and st.tables.bits == 3 and st.policy.budget == 16
    assert m.init(1, 2, 32, bits=4).bits == 4  # an argument still wins
    assert velox.init("tova+turboquant_prod", 1, 2, 32).bits == 2
    k = mx.random.normal((1, 2, 20, 32), key=mx.random.key(0))
    st = velox.update(m.init(1, 2, 32, budget=8, n_sink=1), k, k)  # a state of the registered method
    assert velox.positions(st).shape == (1, 2, 8)
    assert compose.evict_then_store("tova", bits=2, group_size=64).init(1, 1, 64).group_size == 64
    with pytest.raises(ValueError, match="unknown parameter.*bitz.*valid"):
        compose.evict_then_store("tova", codec="turboquant_prod", bitz=3)
    with pytest.raises(ValueError, match="bits"):
        compose.evict_then_store("tova", codec="turboquant_prod", bits=99)
    with pytest.raises(ValueError, match="budget"):
        compose.evict_then_store("h2o", codec="turboquant_mse", budget=0)
    with pytest.raises(ValueError, match="n_sink"):  # the policy's constraint budget > n_sink
        compose.evict_then_store("tova", codec="qjl", budget=4, n_sink=4)


def test_composed_deviations_name_only_parameters_it_has():
    """A codec method's deviation that speaks of a method-level parameter the composition does
    not take (the outlier channels' n_outlier) is not inherited; one line says which are absent."""
    from velox.registry import get_method
    m = get_method("tova+turboquant_mse")
    assert "n_outlier" not in m.spec.params
    lines = [d for d in m.spec.deviations if "n_outlier" in d]
    assert len(lines) == 1 and "not parameters of the composition" in lines[0]


@pytest.mark.parametrize("backend", ["mlx", "reference"])
def test_an_evictor_composed_with_vecinfer_holds_its_key_and_value_codes(backend):
    """``tova+vecinfer``: survivors held as VecInfer's key and value indices, against the
    shipped calibration (SmolLM2's layer 0: 3 kv heads, head_dim 64, a codebook and smoothing
    factors a kv head). With room for the prompt the codes are vecinfer's alone; under
    eviction every survivor keeps the codes it was given, and a decode step keeps the same
    tokens on both backends (a ``reference`` score reads one kv head's tables)."""
    from velox.codecs import vecinfer

    rng = np.random.default_rng(5)
    keys = mx.array(rng.standard_normal((1, 3, 40, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((1, 3, 40, 64)).astype(np.float32))
    m = velox.get_method("tova+vecinfer")
    assert m.spec.contract["policy_keys"] == "codes" and "values held as VecInfer codes" in m.spec.summary
    assert m.per_layer_params(30, {"budget": 24})[3]["layer"] == 3  # the shipped fit's layers
    alone = velox.update(velox.init("vecinfer", 1, 3, 64, layer=0, backend=backend), keys, values)
    both = velox.update(velox.init("tova+vecinfer", 1, 3, 64, budget=64, layer=0, backend=backend),
                        keys, values)
    assert both.tables.codebook.shape == (3, 4096, 4) and both.value_tables.codebook.shape == (3, 256, 8)
    for a, b in ((alone.key_codes.idx, both.key_codes.idx), (alone.value_codes.idx, both.value_codes.idx)):
        assert np.array_equal(np.array(a)[:, :, :40], np.array(b))
    small = velox.update(velox.init("tova+vecinfer", 1, 3, 64, budget=24, n_sink=2, layer=0,
                                    backend=backend), keys, values)
    pos = np.array(velox.positions(small))
    assert pos.shape == (1, 3, 24)
    slots = np.array(small.policy.positions)  # storage order
    for h in range(3):
        for name in ("key_codes", "value_codes"):
            got = np.array(getattr(small, name).idx)[0, h]
            want = np.array(getattr(alone, name).idx)[0, h, slots[0, h]]
            assert np.array_equal(got, want)
    step = [velox.update(small._replace(backend=b), keys[:, :, :1] * 0.5, values[:, :, :1])
            for b in ("mlx", "reference")]
    assert np.array_equal(np.array(velox.positions(step[0])), np.array(velox.positions(step[1])))
    k_hat, v_hat = velox.get_kv(step[0])
    assert k_hat.shape == v_hat.shape == (1, 3, 24, 64)
    # bytes: the policy's, the packed indices (12-bit keys of 4 channels, 8-bit values of 8:
    # 6 + 2 words a token), the tables
    from mlx.utils import tree_flatten

    held = lambda x: sum(a.nbytes for _, a in tree_flatten(x) if isinstance(a, mx.array))  # noqa: E731
    tables = held(small.tables) + held(small.value_tables)
    assert velox.nbytes(small) == held(small.policy) + 3 * 24 * (6 + 2) * 4 + 3 * 4 + tables
    assert vecinfer.KEYS.head is not None


@pytest.mark.parametrize("codec", ["a2ats", "nsnquant", "anchorkv"])
def test_methods_that_hold_no_survivors_say_why(codec):
    """Methods that are not a codec cache refuse composition with the reason their spec gives."""
    note = velox.get_method(codec).spec.compose_note
    assert note
    with pytest.raises(ValueError, match="cannot hold an eviction policy's survivors") as err:
        compose.evict_then_store("tova", codec=codec)
    assert note in str(err.value)
    with pytest.raises(ValueError, match="codec='vecinfer'"):
        compose.evict_then_store("tova", codec="vecinfer_keys")


def test_vecinfer_composed_with_prefill_tables_scores_each_row_and_heads_own():
    """``tova+vecinfer`` with ``codebook='prefill'`` (tables fitted a batch row and kv head):
    a decode step keeps the same tokens on both backends, the ``reference`` score reading
    each (row, head)'s own tables (``vecinfer.head_tables``), a non-finite token too."""
    from velox.codecs import vecinfer

    rng = np.random.default_rng(6)
    keys = mx.array(rng.standard_normal((2, 2, 40, 16)).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 2, 40, 16)).astype(np.float32))
    kw = dict(budget=24, n_sink=2, codebook="prefill", key_sub_dim=4, key_codebook_bits=4,
              value_sub_dim=4, value_codebook_bits=4)
    small = velox.update(velox.init("tova+vecinfer", 2, 2, 16, backend="mlx", **kw), keys, values)
    assert small.tables.codebook.shape == (2, 2, 16, 4)
    t = vecinfer.head_tables(small.tables, 1, 0)
    assert t.codebook.shape == (1, 1, 16, 4)
    assert np.array_equal(t.codebook[0, 0], np.array(small.tables.codebook)[1, 0])
    step = [velox.update(small._replace(backend=b), keys[:, :, :1] * 0.5, values[:, :, :1])
            for b in ("mlx", "reference")]
    assert np.array_equal(np.array(velox.positions(step[0])), np.array(velox.positions(step[1])))
    bad = [velox.update(small._replace(backend=b), keys[:, :, :1] * float("nan"), values[:, :, :1])
           for b in ("mlx", "reference")]
    assert np.array_equal(np.array(velox.positions(bad[0])), np.array(velox.positions(bad[1])))

"""benchmarks/long_decode_quality.py: its row syntax and its figures, on tiny made-up logits."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "long_decode_quality", ROOT / "benchmarks" / "long_decode_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_parse_and_pass_any_parameter():
    b = _bench()
    assert b.parse_row("full") == ("full", {})
    assert b.parse_row("polar:") == ("polar", {})
    assert b.parse_row("mlxlm-q:bits=4") == ("mlxlm-q", {"bits": 4})
    assert b.parse_row("tova+turboquant_prod:budget=256,bits=3") == (
        "tova+turboquant_prod", {"budget": 256, "bits": 3})
    name, params = b.parse_row("turboquant_mse:bits=3,value_codec=mse,value_bits=3")
    assert name == "turboquant_mse"
    assert params == {"bits": 3, "value_codec": "mse", "value_bits": 3}
    assert b.parse_row("spectral:apply_qjl=false,scale=0.5") == (
        "spectral", {"apply_qjl": False, "scale": 0.5})
    assert b.parse_row("svdq:bit_schedule=8,4,2,1,1,0,0,0,group_size=8") == (
        "svdq", {"bit_schedule": "8,4,2,1,1,0,0,0", "group_size": 8})
    assert b.row_label("kivi", {"bits": 2}) == "kivi bits=2"
    assert b.row_label("full", {}) == "mlx-lm KVCache (full)"
    for bad in (":bits=3", "kivi:bits", "kivi:bits=2,bits=3"):
        with pytest.raises(ValueError):
            b.parse_row(bad)
    for text in b.DEFAULT_ROWS:  # every default row parses
        b.parse_row(text)


def test_mlxlm_quantized_defaults_are_mlx_lm_s():
    b = _bench()
    assert b.quantized_defaults() == {"group_size": 64, "bits": 8}


def test_figures_on_made_up_logits():
    b = _bench()
    rng = np.random.default_rng(0)
    n, vocab = 64, 11
    ref_logits = rng.normal(size=(n, vocab)) * 3
    noisy = ref_logits + rng.normal(size=(n, vocab)) * 0.5
    targets = rng.integers(0, vocab, size=n)
    ref_lp, lp = b.log_softmax(ref_logits), b.log_softmax(noisy)
    assert np.allclose(np.exp(lp).sum(axis=-1), 1.0)

    ref_scores = [b.step_scores(ref_lp[i], int(targets[i]), None) for i in range(n)]
    scores = [b.step_scores(lp[i], int(targets[i]), ref_lp[i]) for i in range(n)]
    ref_nll, ref_top, ref_kl = map(np.array, zip(*ref_scores))
    nll, top, kl = map(np.array, zip(*scores))
    assert np.all(ref_kl == 0) and np.all(kl > 0)
    assert np.allclose(nll, -lp[np.arange(n), targets])
    assert np.array_equal(top, lp.argmax(axis=1))
    want_kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=1)
    assert np.allclose(kl, want_kl)

    f = b.figures(nll, top, kl, ref_nll=ref_nll, ref_argmax=ref_top, block=8, reps=200)
    assert f["tokens"] == n
    assert f["ppl"] == pytest.approx(math.exp(nll.mean()))
    assert f["ppl_lo"] <= f["ppl"] <= f["ppl_hi"]
    change = 100 * (math.exp(nll.mean()) / math.exp(ref_nll.mean()) - 1)
    assert f["ppl_change_pct"] == pytest.approx(change)
    assert f["ppl_change_pct_lo"] <= f["ppl_change_pct"] <= f["ppl_change_pct_hi"]
    agree = int((top == ref_top).sum())
    assert f["top1_agree"] == agree and f["top1"] == agree / n
    assert f["top1_lo"] <= f["top1"] <= f["top1_hi"]
    assert f["kl"] == pytest.approx(want_kl.mean()) and f["kl_lo"] <= f["kl"] <= f["kl_hi"]

    same = b.figures(ref_nll, ref_top, ref_kl, ref_nll=ref_nll, ref_argmax=ref_top, block=8,
                     reps=200)
    assert same["ppl_change_pct"] == 0 and same["ppl_change_pct_lo"] == 0
    assert same["top1"] == 1 and same["kl"] == 0
    row = {"label": "x", "kv_bytes": 3 << 20, "figures": f, "seconds": 1.0}
    assert b.table_row(row).startswith("| x | 3.00 |")
    with pytest.raises(ValueError):
        b.figures(nll[:-1], top, kl, ref_nll=ref_nll, ref_argmax=ref_top)


def test_array_bytes_counts_an_array_several_layers_hold_once():
    import mlx.core as mx

    b = _bench()

    class Layer:
        def __init__(self, *arrays):
            self.state = list(arrays)

    own, shared = mx.zeros((4, 8)), mx.zeros((16,), mx.uint32)
    assert b.array_bytes([Layer(own, shared), Layer(shared)]) == own.nbytes + shared.nbytes

"""Small helpers shared by the per-method test files (``from tests._helpers import ...``).

Pytest imports the test files with ``--import-mode=importlib``, which makes ``tests`` a
namespace package rooted at this directory, so this module imports the same way from any
working directory. Names keep the spelling the tests use.
"""

import mlx.core as mx
import numpy as np

import velox
from velox import quant

BACKENDS = ["reference", "mlx"]


# --- eviction: hand-built rows, kept positions, random streams --------------------------------

def rows(*vals):
    """[1, 1, s, d] from a list of per-token vectors."""
    return mx.array(np.array(vals, np.float32)[None, None])


def pos(state, i=0, j=0):
    """Kept positions of batch row ``i``, kv head ``j``, as a list."""
    return np.array(velox.positions(state))[i, j].tolist()


def stream(seed, *, chunks=(37, 1, 1, 9, 1, 1, 20, 1, 1), b=2, h=2, d=16, groups=0):
    """Random keys (std 0.5), values and optional GQA queries for a prefill + decode sequence."""
    rng = np.random.default_rng(seed)
    out = []
    for s in chunks:
        k = mx.array(0.5 * rng.standard_normal((b, h, s, d)).astype(np.float32))
        v = mx.array(rng.standard_normal((b, h, s, d)).astype(np.float32))
        q = mx.array(rng.standard_normal((b, h * groups, s, d)).astype(np.float32)) if groups else None
        out.append((k, v, q))
    return out


def assert_same_rows(a, b):
    """The two states keep the same positions and the same rows, bit for bit."""
    assert np.array_equal(np.array(velox.positions(a)), np.array(velox.positions(b)))
    for x, y in zip(velox.get_kv(a), velox.get_kv(b)):
        assert mx.array_equal(x, y).item()


# The settings two methods share in the exact reductions to H2O.
MATCHED = dict(budget=24, n_sink=3)


def run_pair(a_init, a_update, b_init, b_update, seed, groups):
    """Feed both methods the same ``stream``; their rows must agree after every update."""
    for k, v, q in stream(seed, groups=groups):
        a_init, b_init = a_update(a_init, k, v, queries=q), b_update(b_init, k, v, queries=q)
        assert_same_rows(a_init, b_init)
    return a_init, b_init


def softmax(x):
    """Softmax of a vector, in float64."""
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


# --- quantization: inputs, chunked feeding, state comparison -----------------------------------

def token_rows(x):
    """[1, 1, s, d] float32 from per-token vectors."""
    return mx.array(np.asarray(x, np.float32)[None, None])


def same_state(a, b):
    """Whether the array fields of two states are equal (shapes and values)."""
    la, lb = [x for x in a if isinstance(x, mx.array)], [x for x in b if isinstance(x, mx.array)]
    return len(la) == len(lb) and all(x.shape == y.shape and mx.array_equal(x, y).item()
                                      for x, y in zip(la, lb))


def random_rows(rng, s, heads=2, q=4, d=32):
    """Keys, values ``[1, heads, s, d]`` and queries ``[1, q, s, d]``: standard normal, float32."""
    f = lambda h: mx.array(rng.normal(size=(1, h, s, d)).astype(np.float32))  # noqa: E731
    return f(heads), f(heads), f(q)


def same_arrays(a, b) -> bool:
    """Whether two records (nested: a wrapper's state) hold equal arrays, in order."""
    from velox.decode import arrays
    xa, xb = arrays(a), arrays(b)
    return len(xa) == len(xb) and all(x.shape == y.shape and bool(mx.array_equal(x, y))
                                      for x, y in zip(xa, xb))


def feed_in_chunks(update, state, k, v, chunks, q=None):
    """Absorb ``k``/``v`` (and ``q``) in the given chunk sizes."""
    t = 0
    for s in chunks:
        qs = None if q is None else q[:, :, t:t + s]
        state = update(state, k[:, :, t:t + s], v[:, :, t:t + s], queries=qs)
        t += s
    return state


def _data(b, h, n, d, seed=0, dtype=mx.float32):
    """Standard normal keys and values ``[b, h, n, d]``."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h, n, d)).astype(np.float32)
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def _uniform_keys(k, bits, g):
    """Per channel over groups of ``g`` tokens (KIVI's key layout), dequantized."""
    c, s, z = quant.quantize(k.swapaxes(2, 3), bits, g)
    return quant.dequantize(c, s, z, bits, g, k.dtype).swapaxes(2, 3)


def _planted(n=256, d=64, h=2, seed=0, heavy=False):
    """Keys with 4 outlier channels (x10), values with 4 outlier tokens (x10); Student-t(3)
    entries instead of Gaussian ones when ``heavy``."""
    rng = np.random.default_rng(seed)
    draw = (lambda *s: rng.standard_t(3, s)) if heavy else (lambda *s: rng.standard_normal(s))
    k = draw(1, h, n, d).astype(np.float32)
    v = draw(1, h, n, d).astype(np.float32)
    k[..., rng.choice(d, 4, replace=False)] *= 10
    v[:, :, rng.choice(n, 4, replace=False)] *= 10
    return mx.array(k), mx.array(v)


def _errors(key, k, v, **params):
    """Absolute reconstruction errors of keys and values after one update (mlx backend)."""
    m = velox.get_method(key)
    st = m.update(m.init(1, k.shape[1], k.shape[3], backend="mlx", **params), k, v)
    kk, vv = m.get_kv(st)
    ek, ev = np.abs(np.array(kk) - np.array(k)), np.abs(np.array(vv) - np.array(v))
    return ek, ev


# The bit-widths each method supports (its ``bits`` choices).
SUPPORTED = {"kivi_sink": (2, 3, 4, 8), "kvquant": (2, 3, 4), "skvq": tuple(range(1, 9)),
             "zipcache": tuple(range(1, 9)), "kitty": tuple(range(1, 9))}

BITS = quant.SUPPORTED_BITS  # 1 to 8


def arr(x, dtype=mx.float32):
    """An mlx array of ``dtype`` from a NumPy array or nested lists."""
    return mx.array(np.asarray(x, np.float32)).astype(dtype)


def gaussian(shape, seed, std=1.0):
    """Normal float32 samples of ``shape``."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * std


def feed(state, update, k, v, chunks=None):
    """Absorb ``k``/``v`` in one chunk, or in the given chunk sizes."""
    chunks = chunks or [k.shape[2]]
    t = 0
    for c in chunks:
        state = update(state, k[:, :, t:t + c], v[:, :, t:t + c])
        t += c
    return state


def states_equal(a, b):
    """Assert that two states are equal field by field (dtypes, shapes, values)."""
    for name, x in a._asdict().items():
        y = getattr(b, name)
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x),
                                  np.array(y.astype(mx.float32) if y.dtype == mx.bfloat16 else y)), name
        else:
            assert x == y, name


def per_channel(x: np.ndarray, bits: int, g: int):
    """Plain quantization of ``[b, h, n, d]`` per channel in groups of ``g`` tokens (KIVI keys):
    the dequantized values and the per-element step, for the complete groups."""
    n = (x.shape[2] // g) * g
    q, s, z = quant.quantize(arr(x[:, :, :n]).swapaxes(2, 3), bits, g)
    deq = quant.dequantize(q, s, z, bits, g, mx.float32).swapaxes(2, 3)
    step = mx.repeat(s, g, axis=-1).swapaxes(2, 3)
    return np.array(deq), np.array(step)


def rms_ratio(x, xhat, step):
    """Mean squared error over the uniform-noise prediction ``step**2 / 12``."""
    return float(((x - xhat) ** 2).mean() / (step.astype(np.float64) ** 2 / 12).mean())


def free_port() -> int:
    """A localhost port free at the time of the call (for a server the test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc) -> None:
    """Terminate a server process the test started, killing it after 20 s."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# One method of each family (eviction by score, by position, with merging, prefill-bounded,
# cross-layer, paged, quantized per channel, entropy-coded, rotated, sketched, composed): the
# every-method tests run these by default and the rest with ``pytest --run-slow``.
FAMILIES = ("tova", "h2o", "streaming_llm", "cam", "snapkv", "squeeze", "rocketkv", "kivi",
            "cachegen", "turboquant_prod", "qjl", "tova+affine")


def every_method(keys=None) -> list:
    """``keys`` (default: every registered method) as pytest parameters, those outside
    :data:`FAMILIES` marked ``slow``."""
    import pytest

    from velox.registry import method_keys
    return [pytest.param(k, marks=() if k in FAMILIES else pytest.mark.slow)
            for k in (method_keys() if keys is None else keys)]


def small_params(key: str, tokens: int) -> dict:
    """Parameters whose capacity is well below ``tokens`` (compression really happens)."""
    from velox.registry import get_method

    spec = get_method(key).spec
    p = {}
    for name, param in spec.params.items():
        if param.test_max is not None and param.type == "int" and name in ("budget", "window_size"):
            p[name] = min(param.default, max(24, tokens // 3))
    if "obs_window" in spec.params:
        p["obs_window"] = min(8, spec.defaults["obs_window"])
    if "residual_length" in spec.params:
        p["residual_length"] = 8
    if "recent" in spec.params:  # a recent window that fits the small budget
        p["recent"] = min(4, spec.defaults["recent"])
    return p


class OracleDraft:
    """A draft model for speculative decoding that knows the answer but for a few tokens: it
    proposes the reference greedy tokens (``reference``, the tokens generated after a
    ``prompt``-token prompt), except a wrong one for the generated tokens in ``wrong``, so
    rounds accept all, some or none of their drafts. It keeps its position in a plain
    ``KVCache`` of width one (mlx-lm trims it as a draft cache) and runs no forward."""

    def __init__(self, reference: list[int], prompt: int, vocab: int, wrong: set[int]):
        self.reference, self.prompt, self.vocab, self.wrong = reference, prompt, vocab, wrong

    def __call__(self, inputs, cache):
        s = inputs.shape[1]
        start = cache[0].offset
        cache[0].update_and_fetch(mx.zeros((1, 1, s, 1)), mx.zeros((1, 1, s, 1)))
        logits = np.zeros((1, s, self.vocab), np.float32)
        for i in range(s):
            j = start + i + 1 - self.prompt  # the generated token this position predicts
            tok = self.reference[j] if 0 <= j < len(self.reference) else 0
            logits[0, i, (tok + 1) % self.vocab if j in self.wrong else tok] = 1.0
        return mx.array(logits)

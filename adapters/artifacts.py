"""Calibration artifacts: arrays a method fits once on a real model, with their provenance.

A method that calibrates registers a ``calibrate(state, arrays) -> state`` hook
(``velox.registry.register``) that installs one layer's arrays into a fresh state, and a fitter
here (:data:`FITTERS`): ``fit(keys, params) -> {name: array}`` for one layer, from its post-RoPE
keys ``[tokens, kv_heads, head_dim]`` (``velox.adapters.calibration.capture_qk``), every array
with a leading kv-head axis (``[kv_heads, ...]``: one fit a kv head, heads never pooled); the
artifact stacks the layers (``[layers, kv_heads, ...]``).

* :func:`calibrate` runs the model over a text and fits (``velox calibrate --method spectral
  --out FILE`` on the embedded SmolLM2);
* :func:`save_artifact` writes a safetensors file: the arrays, and a ``velox`` metadata entry
  (JSON) with the format, the method, the model, the text's source and token count, the velox
  version, the parameters and the dims (layers, kv heads, head dim);
* :func:`load_artifact` reads one back and checks it: its format (an artifact of an older
  format, e.g. ``velox-artifact-1`` with one SpectralQuant basis a layer, is refused: re-run
  ``velox calibrate``), its method, its arrays' layer and kv-head axes against its provenance,
  and (given the model) the layer count, kv heads and head dim; any mismatch is a
  ``ValueError`` that names it;
* ``make_cache(model, key, artifacts=FILE)`` (``velox.adapters.mlxlm``) loads, checks and
  installs layer ``i``'s arrays into layer ``i``'s state.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["FORMAT", "FITTERS", "WANTS_VALUES", "WANTS_QUERIES", "WANTS_INPUTS", "SHIPPED_FITS",
           "fit_spectral", "fit_vecinfer", "fit_a2ats", "fit_kvtc", "fit_palu", "calibrate",
           "build_shipped", "save_artifact", "load_artifact", "model_dims", "layer_arrays"]

#: The artifact format: 2 holds one fit a (layer, kv head); 1 held one a layer (heads pooled).
FORMAT = "velox-artifact-2"


def fit_spectral(keys: np.ndarray, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """SpectralQuant's calibration of one layer, one fit a kv head
    (``velox.codecs.spectral.calibrate_heads``): each head's PCA rotation ``[kv_heads, d, d]``
    (rows by decreasing eigenvalue), each rotated coordinate's spread ``[kv_heads, d]``, the
    eigenvalues ``[kv_heads, d]`` and the participation ratio ``[kv_heads]`` (the measured
    number of signal dimensions). ``keys`` is ``[tokens, kv_heads, head_dim]``."""
    from velox.codecs.spectral import calibrate_heads

    out = calibrate_heads(np.asarray(keys, np.float64))
    return {k: np.asarray(out[k], np.float32)
            for k in ("rotation", "scales", "eigenvalues", "participation_ratio")}


def fit_vecinfer(keys: np.ndarray, params: dict[str, Any], values: np.ndarray,
                 ) -> dict[str, np.ndarray]:
    """VecInfer's calibration of one layer, one fit a kv head: the smoothing factors
    ``smooth [kv_heads, d]`` (``sqrt(max |K_i|)``), and k-means codebooks (Lloyd in MLX,
    ``velox.codecs.pq.kmeans``, seeded) of the smoothed, Hadamard-rotated keys' sub-vectors,
    ``key_codebook [kv_heads, 2^key_codebook_bits, key_sub_dim]``, and of the values',
    ``value_codebook [kv_heads, 2^value_codebook_bits, value_sub_dim]``. ``keys`` and
    ``values`` are ``[tokens, kv_heads, head_dim]``; ``params`` may set the four sub-dims and
    bits (the method's defaults otherwise), ``iters`` (20) and ``seed`` (0)."""
    from velox.codecs import pq
    from velox.codecs.vecinfer import smoothing, tables_from_arrays

    ks, vs = int(params.get("key_sub_dim", 4)), int(params.get("value_sub_dim", 8))
    kb, vb = int(params.get("key_codebook_bits", 12)), int(params.get("value_codebook_bits", 8))
    iters, seed = int(params.get("iters", 20)), int(params.get("seed", 0))
    k, v = np.asarray(keys, np.float32), np.asarray(values, np.float32)
    t, h, d = k.shape
    sm = smoothing(k)
    kc, vc = [], []
    for i in range(h):  # one fit a kv head: heads never pooled
        rot = tables_from_arrays(d, ks, kb, np.zeros((1 << kb, ks)), sm[i], rotate=True)
        y = (k[:, i] / sm[i]) @ np.asarray(rot.rotation).T
        kc.append(np.array(pq.kmeans(y.reshape(-1, ks), 1 << kb, iters=iters, seed=seed)))
        vc.append(np.array(pq.kmeans(v[:, i].reshape(-1, vs), 1 << vb, iters=iters, seed=seed)))
    return {"smooth": sm, "key_codebook": np.stack(kc).astype(np.float16),
            "value_codebook": np.stack(vc).astype(np.float16)}


def fit_kvtc(keys: np.ndarray, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """KVTC's calibration of one layer, one PCA a kv head (``velox.codecs.kvtc.fit_np``): the
    basis ``[kv_heads, d, d]`` (rows by decreasing variance), the mean and the components'
    variances ``[kv_heads, d]`` (their floored spreads squared); the method computes the bit
    allocation from them for its budget when it installs them. ``keys`` is ``[tokens, kv_heads,
    head_dim]``."""
    from velox.codecs.kvtc import DEFAULT_CHOICES, fit_np

    k = np.swapaxes(np.asarray(keys, np.float32), 0, 1)  # [kv_heads, tokens, d]
    basis, mean, sigma, _, _ = fit_np(k, int(params.get("bit_budget", 512)),
                                      str(params.get("bit_choices", DEFAULT_CHOICES)),
                                      float(params.get("beta", 3.5)))
    return {"basis": basis, "mean": mean.astype(np.float32),
            "variances": (sigma.astype(np.float64) ** 2).astype(np.float32)}


def fit_a2ats(keys: np.ndarray, params: dict[str, Any], *, queries: np.ndarray, rope,
              ) -> dict[str, np.ndarray]:
    """A²ATS's calibration of one layer, one fit a kv head: the model's RoPE frequencies
    ``freqs [kv_heads, d / 2]`` (measured from the layer's ``rope``,
    ``velox.codecs.a2ats.rope_frequencies``), the queries' second moment at distance ``b``,
    ``metric [kv_heads, J, s, s]`` (``H_j = E[q_j q_j^T]`` over the kv head's query heads, each
    post-RoPE query at position ``t`` turned by ``b - t``), and a codebook a sub-space of the
    pre-RoPE keys (each un-rotated by its position), ``codebook [kv_heads, J, 2^bits, s]``
    (float16), fitted by Lloyd's k-means under ``H_j`` (``velox.codecs.pq.kmeans``, seeded; a
    cluster's mean minimises its H-weighted error) or, with ``use_query_aware`` false, plain
    k-means; ``b [kv_heads]``. ``keys`` ``[tokens, kv_heads, d]`` and ``queries`` ``[tokens,
    q_heads, d]`` are one forward's from position 0; ``params`` may set ``sub_dim`` (8),
    ``codebook_bits`` (8), ``b`` (2048), ``use_query_aware`` (True), ``iters`` (10), ``seed``
    (0)."""
    from velox.codecs import pq
    from velox.codecs.a2ats import rope_frequencies, rotate_np

    s, bits = int(params.get("sub_dim", 8)), int(params.get("codebook_bits", 8))
    b, aware = int(params.get("b", 2048)), bool(params.get("use_query_aware", True))
    iters, seed = int(params.get("iters", 10)), int(params.get("seed", 0))
    k, q = np.asarray(keys, np.float32), np.asarray(queries, np.float32)
    t, h, d = k.shape
    g, j = q.shape[1] // h, d // s
    freqs = rope_frequencies(rope, d)
    pos = np.arange(t, dtype=np.int32)[:, None]
    pre = rotate_np(k, -np.broadcast_to(pos, (t, h)), freqs)            # [t, h, d]
    qb = rotate_np(q, np.broadcast_to(b - pos, q.shape[:2]), freqs)      # [t, hq, d]
    cbs, hs = [], []
    for i in range(h):  # one fit a kv head: heads never pooled
        qi = qb[:, i * g:(i + 1) * g].reshape(-1, j, s).astype(np.float64)
        hi = np.einsum("njs,njr->jsr", qi, qi) / len(qi)                  # [J, s, s]
        hs.append(hi.astype(np.float32))
        cbs.append(np.stack([np.array(pq.kmeans(
            pre[:, i, jj * s:(jj + 1) * s], 1 << bits, iters=iters, seed=seed,
            metric=mx.array(hs[-1][jj]) if aware else None)) for jj in range(j)]))
    return {"codebook": np.stack(cbs).astype(np.float16), "metric": np.stack(hs),
            "freqs": np.broadcast_to(freqs, (h, d // 2)).copy(),
            "b": np.full((h,), b, np.float32)}


def _dense_weight(proj) -> tuple[np.ndarray, np.ndarray | None]:
    """``(weight [out, in], bias or None)`` of a linear layer (a quantized one dequantized)."""
    w = proj.weight
    if hasattr(proj, "scales"):  # mlx.nn.QuantizedLinear
        w = mx.dequantize(w, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits)
    bias = proj.get("bias") if isinstance(proj, dict) else getattr(proj, "bias", None)
    return (np.array(w.astype(mx.float32)),
            None if bias is None else np.array(bias.astype(mx.float32)))


def fit_palu(keys, params: dict[str, Any], *, attn, inputs: np.ndarray) -> dict[str, np.ndarray]:
    """Palu's calibration of one layer (``velox.codecs.palu.weight_bases``): each group's
    ``k_proj`` and ``v_proj`` weights decomposed, whitened by the covariance of the layer's
    attention inputs ``inputs [tokens, hidden]`` (the SVD of ``W S``, ``S S^T = cov(x)``):
    ``key_basis``, ``value_basis [kv_heads, d, g d]`` (each head's rows of its group's left
    singular vectors), ``key_spread``, ``value_spread [kv_heads, g d]`` (each latent channel's
    standard deviation on the inputs), ``key_mean``, ``value_mean [kv_heads, d]`` (the mean
    outputs, the bias included), and the
    model's RoPE frequencies ``freqs [kv_heads, d / 2]`` (``velox.codecs.a2ats.rope_frequencies``:
    keys are projected before RoPE). ``params`` may set ``n_head_groups`` (4; the groups are
    the largest divisor of kv_heads not above it, as the method takes them) and ``whiten``
    (True). A layer whose keys are not a linear map of its inputs (a norm after ``k_proj``)
    is refused. ``keys`` is not read."""
    from velox.codecs.a2ats import rope_frequencies
    from velox.codecs.palu import head_groups, input_moments, weight_bases

    for norm in ("k_norm", "q_norm"):
        if getattr(attn, norm, None) is not None:
            raise ValueError(f"palu decomposes k_proj and v_proj: this model's attention has a "
                             f"{norm} after the projection, so its keys are not a linear map")
    h = int(attn.n_kv_heads)
    wk, bk = _dense_weight(attn.k_proj)
    wv, bv = _dense_weight(attn.v_proj)
    d = wk.shape[0] // h
    groups = head_groups(h, int(params.get("n_head_groups", 4)))
    whiten = bool(params.get("whiten", True))
    moments = input_moments(inputs)
    kb, ks, km = weight_bases(wk, bk, moments, h, groups, whiten)
    vb, vs, vm = weight_bases(wv, bv, moments, h, groups, whiten)
    freqs = rope_frequencies(attn.rope, d)
    return {"key_basis": kb, "key_spread": ks, "key_mean": km, "value_basis": vb,
            "value_spread": vs, "value_mean": vm, "freqs": np.broadcast_to(freqs, (h, d // 2)).copy()}


#: The shipped A²ATS calibration of the embedded SmolLM2 (``velox.codecs.a2ats.SHIPPED``):
#: the text and token count it is fitted on (the opening of the shipped ``holmes`` text), the
#: Lloyd rounds and seed, at the method's default bits, sub_dim and b.
A2ATS_SHIPPED = {"text": "holmes", "tokens": 1024, "iters": 10, "seed": 0}


#: method key -> fitter of its artifact from every layer's keys (and values: WANTS_VALUES).
FITTERS: dict[str, Callable[..., dict[str, np.ndarray]]] = {
    "spectral": fit_spectral,
    "kvtc": fit_kvtc,
    "vecinfer": fit_vecinfer,
    "a2ats": fit_a2ats,
    "palu": fit_palu,
}
#: Methods whose fitter takes the layer's queries and its ``rope`` module too
#: (``fit(keys, params, queries=..., rope=...)``).
WANTS_QUERIES = frozenset({"a2ats"})
#: Methods whose fitter takes the layer's values too (``fit(keys, params, values)``).
WANTS_VALUES = frozenset({"vecinfer"})
#: Methods whose fitter takes the layer's attention module and its inputs instead of keys
#: (``fit(None, params, attn=..., inputs=...)``: a decomposition of the projection weights).
WANTS_INPUTS = frozenset({"palu"})


def model_dims(model) -> dict[str, int]:
    """``layers``, ``kv_heads`` and ``head_dim`` of an mlx-lm model's attention layers (a
    tensor-parallel model's: every process's kv heads of a layer)."""
    from velox.adapters.sharding import model_heads

    attn = [layer.self_attn for layer in model.layers]
    a = attn[0]
    head_dim = getattr(a, "head_dim", None) or a.k_proj.weight.shape[0] // a.n_kv_heads
    kv = int(a.n_kv_heads) * model_heads(model).shards
    return {"layers": len(attn), "kv_heads": kv, "head_dim": int(head_dim)}


def calibrate(method: str, model, tokenizer, text: str, *, model_name: str, source: str,
              params: dict[str, Any] | None = None, progress: bool = True) -> tuple[dict, dict]:
    """Fit ``method``'s artifact on ``model`` over ``text``: ``(arrays, provenance)``."""
    from velox import __version__
    from velox.adapters.calibration import capture_inputs, capture_qk, capture_qkv

    from velox.adapters.sharding import model_heads

    if method not in FITTERS:
        raise ValueError(f"{method} has no calibration (calibrated methods: {', '.join(sorted(FITTERS))})")
    if model_heads(model).shards > 1:
        raise ValueError("calibrate the unsharded model (one process): its artifact holds every "
                         "kv head, and make_cache gives each shard of a tensor-parallel model its own")
    tokens = tokenizer.encode(text)
    _say(progress, f"calibrating {method}: capturing keys over {len(tokens)} tokens")
    if method in WANTS_INPUTS:
        inputs = capture_inputs(model, tokens)
        keys, values, queries = [None] * len(inputs), None, None
    elif method in WANTS_VALUES:
        queries, keys, values = capture_qkv(model, tokens)
    else:
        (queries, keys), values = capture_qk(model, tokens), None
    per_layer = []
    for i, k in enumerate(keys):
        extra = () if values is None else (values[i],)
        kw = {"queries": queries[i], "rope": model.layers[i].self_attn.rope} \
            if method in WANTS_QUERIES else {}
        if method in WANTS_INPUTS:
            kw = {"attn": model.layers[i].self_attn, "inputs": inputs[i]}
        per_layer.append(FITTERS[method](k, dict(params or {}), *extra, **kw))
        _bar(progress, i + 1, len(keys))
    arrays = {name: np.stack([p[name] for p in per_layer]) for name in per_layer[0]}
    _say(progress, f"fitted {', '.join(f'{k} {tuple(v.shape)}' for k, v in arrays.items())}")
    info = {"format": FORMAT, "method": method, "model": model_name, "source": source,
            "tokens": len(tokens), "velox": __version__, "params": dict(params or {}),
            **model_dims(model)}
    return arrays, info


def save_artifact(path: str | Path, arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """Write ``arrays`` (each ``[layers, ...]``) and the provenance ``info`` as safetensors."""
    mx.save_safetensors(str(path), {k: mx.array(np.ascontiguousarray(v)) for k, v in arrays.items()},
                        metadata={"velox": json.dumps(info, sort_keys=True)})


def load_artifact(path: str | Path, *, method: str, model=None) -> tuple[dict, dict]:
    """``(arrays, info)`` of the artifact at ``path``, checked against ``method`` and, given,
    ``model``'s dims."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no artifact at {path}")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # not a safetensors file
        raise ValueError(f"{path} is not a velox artifact ({e})") from None
    try:
        info = json.loads(meta["velox"])
    except (KeyError, ValueError):
        raise ValueError(f"{path} has no velox provenance: not a velox artifact") from None
    if info.get("format") != FORMAT:
        raise ValueError(f"{path}: format {info.get('format')!r}, expected {FORMAT!r} (one fit a "
                         f"layer and kv head); re-run `velox calibrate --method "
                         f"{info.get('method', method)} --out FILE` to fit it again")
    if info.get("method") != method:
        raise ValueError(f"{path} is an artifact of {info.get('method')!r}, not {method!r}")
    if model is not None:
        dims = model_dims(model)
        for k, v in dims.items():
            if info.get(k) != v:
                raise ValueError(f"{path} was fitted on {info.get('model')!r} with {k}="
                                 f"{info.get(k)}; this model has {k}={v}")
    out = {k: np.array(v) for k, v in arrays.items()}
    for k, v in out.items():
        if v.ndim < 2 or v.shape[0] != info.get("layers"):
            raise ValueError(f"{path}: {k} of shape {v.shape} does not hold {info.get('layers')} "
                             f"layers, as its provenance says")
        if v.shape[1] != info.get("kv_heads"):
            raise ValueError(f"{path}: {k} holds {v.shape[1]} kv heads a layer, its provenance "
                             f"says kv_heads={info.get('kv_heads')}")
    return out, info


def layer_arrays(arrays: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s slice of every array."""
    return {k: v[layer] for k, v in arrays.items()}


def _bar(progress: bool, done: int, total: int, width: int = 30) -> None:
    if progress:
        filled = width * done // total
        end = "\n" if done == total else ""
        print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers", end=end,
              file=sys.stderr, flush=True)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, file=sys.stderr, flush=True)


#: The shipped VecInfer calibration of the embedded SmolLM2: the text and token count it is
#: fitted on (the opening of the shipped ``holmes`` text), and the Lloyd rounds.
VECINFER_SHIPPED = {"text": "holmes", "tokens": 1024, "iters": 6, "seed": 0}


#: Calibrations shipped for the embedded SmolLM2 (``velox.adapters/data``): method -> (its
#: fit's settings, the file the method's codec names in its ``SHIPPED``).
#: The shipped Palu bases of the embedded SmolLM2 (``velox.codecs.palu.SHIPPED``): the opening
#: of the shipped ``holmes`` text, the seed's head groups, whitened.
PALU_SHIPPED = {"text": "holmes", "tokens": 2048, "n_head_groups": 4, "whiten": True}

SHIPPED_FITS = {"vecinfer": (VECINFER_SHIPPED, "vecinfer_smollm2.npz"),
                "a2ats": (A2ATS_SHIPPED, "a2ats_smollm2.npz"),
                "palu": (PALU_SHIPPED, "palu_smollm2.npz")}


def build_shipped(method: str, out: str | Path | None = None, progress: bool = True) -> Path:
    """Fit ``method`` on the embedded SmolLM2 over its :data:`SHIPPED_FITS` settings (the
    text and tokens; the rest are the fitter's parameters) and write
    the ``.npz`` shipped in ``velox.adapters/data``: the fitter's arrays stacked over layers
    and the provenance (with the fit's seconds) as JSON (``python -m velox.adapters.artifacts
    METHOD``)."""
    import time

    from velox.adapters.harness import load_text
    from velox.adapters.smollm2 import MODEL_DIRNAME, load_default_model

    cfg, name = SHIPPED_FITS[method]
    model, tokenizer = load_default_model()
    tokens = tokenizer.encode(load_text(cfg["text"]))[: cfg["tokens"]]
    t0 = time.perf_counter()
    arrays, info = calibrate(method, model, tokenizer, tokenizer.decode(tokens),
                             model_name=MODEL_DIRNAME, source=f"shipped text {cfg['text']!r}",
                             params={k: v for k, v in cfg.items() if k not in ("text", "tokens")},
                             progress=progress)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    path = Path(out) if out else Path(__file__).parent / "data" / name
    np.savez_compressed(path, metadata=np.array(json.dumps(info, sort_keys=True)), **arrays)
    _say(progress, f"wrote {path} ({path.stat().st_size} bytes) in {info['seconds']} s")
    return path


if __name__ == "__main__":
    for _method in sys.argv[1:] or SHIPPED_FITS:
        build_shipped(_method)

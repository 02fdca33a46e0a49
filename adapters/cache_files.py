"""Prompt-cache files of velox caches: :func:`save_cache` and :func:`load_cache`.

One ``.safetensors`` file holds every layer's state (its arrays under named entries, its static
fields, parameters, backend, offset, decode mode and tail, rollback depth and calibration
artifact in the metadata) and a SHA-256 over all of it. ``load_cache`` refuses a file whose
digest does not match, a newer format, a state its method's ``init`` could not have made, and
(given the model) caches made for another model's layers, heads, head dim or dtype; a loaded
cache decodes as the saved one would have. Both are re-exported by
:mod:`velox.adapters.mlxlm`.
"""

from __future__ import annotations

import hashlib
import json
import typing
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from velox.adapters import guards, model_step
from velox.adapters.cache import DECODE_CAP, VeloxCache, _dims, _Model, default_layout
from velox.adapters.sharding import model_heads
from velox.adapters.routing import (Mode, _choose_mode, install_query_capture,
                                    routes_attention as _routes_attention, untapped)
from velox.backend import BackendUnavailable, resolve_backend
from velox.decode import slack as decode_slack
from velox.distributed import LOCAL, Heads
from velox import layer, wrap
from velox.registry import Method, get_method
from velox.spec import validate_params
from velox.state_dims import method_dims

__all__ = ["save_cache", "load_cache", "CODECS"]

#: What ``save_cache(..., codec=)`` takes: ``None`` (the arrays as they are), ``"kvtc"``
#: (transform-coded rows, lossy) or ``"lossless"`` (the rows' floats entropy-coded, to the bit).
CODECS = ("kvtc", "lossless")
#: Fixed-rate KVTC in files: the first positions and the newest ones of every row array stay exact.
KVTC_SINKS, KVTC_RECENT = 4, 128

# File formats (``0.format``; ``format`` in version 1). Version 3's ``0.sha256`` covers the
# whole file: every metadata entry (layers, layer_params, record, user, format, and the names
# the layers give their arrays) and every array under its name. Version 2's covered the array
# data only, version 1 had none: both still load, with a UserWarning, after every other check.
_VERSION = 3
_FORMAT = f"velox-prompt-cache-{_VERSION}"
_FORMAT_V2 = "velox-prompt-cache-2"  # a checksum of the array data only; loads with a warning
_FORMAT_V1 = "velox-prompt-cache-1"  # written before the checksum; loads with a warning
_DIGEST = "0.sha256"
_MARKER = "__velox__"
_LOAD_WITH = "a velox prompt cache: load it with velox.adapters.mlxlm.load_cache(path)"


def _split(value: Any, name: str, arrays: dict[str, mx.array]) -> Any:
    """JSON-able description of a state field; arrays go to ``arrays`` under ``name``. An
    array already saved (the same ``mx.array``: a cross-layer method's layer holding its
    anchor's array, the model-level record holding a layer's) is named where it was saved
    first, so the file holds it once and :func:`load_cache` gives every holder one array."""
    if isinstance(value, mx.array):
        for saved, x in arrays.items():
            if x is value:
                return {"__array__": saved}
        arrays[name] = value
        return {"__array__": name}
    if isinstance(value, dict):
        return {"__dict__": {k: _split(v, f"{name}.{k}", arrays) for k, v in value.items()}}
    if hasattr(value, "_fields"):  # a nested record (a composed method's policy state)
        return _save_record(value, name, arrays, nested=True)
    return value


def _save_record(record: tuple, prefix: str, arrays: dict[str, mx.array], *,
                 nested: bool = False) -> dict[str, Any]:
    # a state's kv heads (velox.distributed) are every head of the layer here (save_cache
    # refuses a shard's): not written, a loaded state holds every head (_build)
    d = {k: _split(v, f"{prefix}.{k}", arrays) for k, v in record._asdict().items()
         if not isinstance(v, Heads)}
    return {"__record__": d} if nested else d


def _array_bytes(x: mx.array) -> bytes:
    if x.dtype == mx.bfloat16:  # NumPy has no bfloat16: hash the same bits as uint16
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x)).tobytes()


def _digest(arrays: dict[str, mx.array], meta: dict[str, str]) -> str:
    """The SHA-256 of a version-3 file: every metadata entry but the digest itself (key and
    text, in sorted key order), then every array (name, dtype, shape, bytes, in sorted name
    order), each part preceded by its length so that no two files share an encoding."""
    h = hashlib.sha256()

    def put(b: bytes) -> None:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)

    for key in sorted(meta):
        if key != _DIGEST:
            put(key.encode())
            put(str(meta[key]).encode())
    for name in sorted(arrays):
        x = arrays[name]
        put(name.encode())
        put(f"{x.dtype}|{tuple(x.shape)}".encode())
        put(_array_bytes(x))
    return h.hexdigest()


def _checksum(arrays: dict[str, mx.array]) -> str:
    """The SHA-256 of a version-2 file: every array (name, dtype, shape, bytes), in sorted
    name order; its metadata is not covered."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        x = arrays[name]
        h.update(f"{name}|{x.dtype}|{tuple(x.shape)}|".encode())
        h.update(_array_bytes(x))
    return h.hexdigest()


def _save_tail(c: VeloxCache, i: int, arrays: dict[str, mx.array]) -> dict[str, Any] | None:
    if c.tail is None:
        return None
    parts = {"keys": c.tail[0], "values": c.tail[1], "queries": c.tail_queries}
    return {k: None if x is None else _split(x, f"tail.{i}.{k}", arrays) for k, x in parts.items()}


def _save_dims(c: VeloxCache) -> dict[str, Any] | None:
    """What a layer's state says of the model it ran in (``None`` before its first token):
    checked by :func:`load_cache` against the state and against a given model."""
    if c.velox_state is None:
        return None
    b, h, d, dtype = _dims(c)
    return {"batch": int(b), "kv_heads": int(h), "head_dim": int(d), "dtype": _dtype_name(dtype)}


def _save_artifact(c: VeloxCache, i: int, arrays: dict[str, mx.array]) -> dict[str, Any] | None:
    """The cache's calibration artifact (its layer's arrays): a loaded cache installs it at
    its first token as this one would, and a state calibrated with it is checked against a
    fresh state calibrated the same way."""
    if c.artifact is None:
        return None
    return {k: _split(mx.array(np.asarray(v)), f"artifact.{i}.{k}", arrays)
            for k, v in c.artifact.items()}


def save_cache(path: str | Path, caches: list, metadata: dict[str, str] | None = None, *,
               codec: str | None = None, codec_params: dict[str, Any] | None = None,
               model=None) -> None:
    """Save velox caches (every array and static field) to one ``.safetensors`` file.

    ``codec="kvtc"`` stores the caches transform-coded (``velox.codecs.kvtc``, lossy). By
    default every float row array of a state (``[b, h, n, head_dim]``: an evictor's kept keys
    and values, exact value rows, ...) is entropy-coded
    (``velox.codecs.kvtc.compress_rows_ecsq_np``): one PCA basis a batch row over its kv heads,
    every principal coefficient at one step (``key_step`` for ``keys``, ``value_step`` for the
    others, over the rows' RMS spread), range-coded a component at a time; the first ``sinks``
    positions (4) and the quiet tokens (a value row far below its head's median norm: the tokens
    that take the attention a layer does not spend) at a 16th of the step; the newest ``recent``
    (0) and empty slots exact; keys coded with their rotary embedding removed when
    ``rope_theta`` (and ``rope_traditional``) give the model's: pass ``model`` (the mlx-lm
    model the caches belong to) and they are read from its ``args`` unless ``codec_params``
    names them (on SmolLM2, 2,048-token prompts: 22x smaller than float16 at +3.2% continuation
    perplexity with them, 20x at +6.8% without). With any of ``bit_budget``,
    ``bit_choices``, ``beta``, the rows are held as the kvtc method's fixed-rate codes instead
    (range-coded; the first ``KVTC_SINKS`` and newest ``KVTC_RECENT`` positions exact). A
    ``kvtc`` state's packed key codes are range-coded losslessly either way.

    ``codec="lossless"`` stores every float row array to the bit: each value's sign and
    exponent range-coded with a model of its channel, its mantissa packed
    (``velox.entropy.float_encode``; bfloat16 rows of SmolLM2 take about 1.5x fewer bytes).

    With either codec, integer arrays whose deltas code smaller (positions) are range-coded
    losslessly, and every other array is stored as it is. :func:`load_cache` returns the
    method's own state: positions, offsets, codes, exact rows and every other array to the
    bit, the rows coded by KVTC as its reconstruction.

    The file carries a SHA-256 of everything :func:`load_cache` reads (the metadata, and the
    array data under their names), checked at load, and is laid out so that mlx-lm's
    ``load_prompt_cache`` refuses it with a message naming :func:`load_cache`. Each layer's
    entry records its mode (``"proxy"``, ``"deferred"``), its rollback depth, the dims of its
    state (batch, kv heads, head dim, dtype: what ``load_cache(path, model)`` compares with
    the model) and its layer's calibration artifact (``make_cache(..., artifacts=)``); append
    mode's tail (keys, values, queries) is saved with its layer. A step still pending because
    its forward never reached the attention wrapper is absorbed first, with the key-as-query
    proxy, as the cache's next call would.
    """
    arrays: dict[str, mx.array] = {}
    layers = []
    shared = None
    for i, c in enumerate(caches):
        if not isinstance(c, VeloxCache):
            raise ValueError(f"layer {i} holds a {type(c).__name__}; save_cache stores velox caches only")
        if c.heads.shards > 1:
            raise ValueError(f"layer {i} holds one shard of a tensor-parallel model's kv heads "
                             f"({c.heads.shards} processes): save_cache stores caches of a model "
                             "held by one process")
        c._settle()  # a step whose forward never reached the wrapper, as the next call would
        st = c.velox_state
        entry = {"method": c.method.key, "params": c.params, "backend": c.backend,
                 "layer": c.layer, "offset": c.offset, "compile": c.compile,
                 "real_queries": c.real_queries, "mode": c.mode.value,
                 "state": None if st is None else _save_record(st, str(i), arrays),
                 "decode": c.decode, "decode_cap": c.decode_cap, "tail": _save_tail(c, i, arrays),
                 "rollback": c.rollback, "dims": _save_dims(c),
                 "artifact": _save_artifact(c, i, arrays)}
        layers.append(entry)
        if c._model is not None and shared is None:
            shared = c._model
    record = None
    if shared is not None and shared.record is not None:
        record = _save_record(shared.record, "record", arrays)
    coded = None
    if codec is not None or codec_params is not None:
        coded = _encode_rows(caches, arrays, codec, _model_rope(model, codec, dict(codec_params or {})))
    arrays[_MARKER] = mx.array([_VERSION], dtype=mx.uint8)
    mx.eval(arrays)
    fields = {"format": _FORMAT, "layers": json.dumps(layers),
              "layer_params": json.dumps(shared.layer_params if shared else None),
              "record": json.dumps(record), "user": json.dumps(metadata or {})}
    if coded is not None:
        fields["codec"] = json.dumps(coded)
    # mlx-lm's load_prompt_cache reads [metadata, class names, scalars]; its scalar loop
    # raises "Unknown type <_LOAD_WITH>" on the marker before it looks up any class.
    meta = {f"0.{k}": v for k, v in fields.items()}
    meta.update({f"1.{i}": "VeloxCache" for i in range(max(len(caches), 1))})
    meta.update({"2.0": "", "2.1.0": _MARKER, "2.1.1": _LOAD_WITH})
    meta[_DIGEST] = _digest(arrays, meta)
    mx.save_safetensors(str(path), arrays, metadata=meta)


def load_cache(path: str | Path, model=None, *,
               backend: str | None = None) -> tuple[list, dict[str, str]]:
    """Load caches saved by :func:`save_cache`: ``(caches, user_metadata)``.

    The file is checked before any cache is built, and every problem raises ``ValueError``
    naming it: the checksum (of the whole file: any change to its metadata, to an array, or
    to which array a layer names is refused), the method, its parameters (types, ranges,
    constraints), the offset, the backend, the rollback depth, each array's presence, dtype
    and shape against a fresh state of those parameters, and the arrays against each other
    (positions, stored count, ``get_kv``, one dry update). A file of a newer format is
    refused as such. Files of older formats load after the other checks, with a
    ``UserWarning``: ``velox-prompt-cache-2``, whose checksum covers the array data only,
    and ``velox-prompt-cache-1``, written before the checksum existed.

    Args:
        path: a file written by :func:`save_cache`.
        model: the mlx-lm model the caches will run in. Its layers are checked against the
            file's: their count, and each saved state's kv heads, head dim and dtype against
            the keys the model's own cache of that layer receives (a cache saved for another
            model is refused here, naming what differs). A saved deferred mode is kept only
            if its attention goes through velox's wrapper, as in :func:`make_cache`. Without
            it, each deferred cache confirms its mode at its first forward (proxy if that
            forward never calls the wrapper). A file written before modes were saved gets the
            mode make_cache would choose.
        backend: run the states on this backend (``"auto"``, ``"mlx"``, ...) rather than
            the one they were saved with. Without it, a state saved on a backend this
            machine lacks (``cuda`` on a CPU) raises ``velox.backend.BackendUnavailable``.
    Returns:
        The caches, which decode exactly as the saved ones would have (real queries, fused
        compiled decode step, backend), and the user metadata.
    """
    where = str(path)
    if model is not None and model_heads(model).shards > 1:
        raise ValueError(f"{where}: load_cache takes a model held by one process, not a "
                         f"tensor-parallel shard ({model_heads(model).shards} processes)")
    try:
        arrays, raw = mx.load(where, return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{where} is not a velox prompt cache: {e}") from None
    meta = _read_meta(where, raw, arrays)
    if "0.codec" in raw:
        _decode_rows(where, raw["0.codec"], arrays)
    layers, layer_params, record_meta = meta["layers"], meta["layer_params"], meta["record"]
    used: set[str] = set()
    shared = None
    caches = []
    for i, entry in enumerate(layers):
        c = _load_layer(f"{where}: layer {i}", i, entry, arrays, used, backend)
        if c.method.layer_update is not None:
            if shared is None:
                shared = _Model(method=c.method, layer_params=layer_params, n_layers=len(layers))
            c._model = shared
        caches.append(c)
    if shared is not None:
        _check_layer_params(where, shared, caches)
        if record_meta is not None:
            fresh = shared.method.model_init(layer_params)
            rec = _build(f"{where}: cross-layer record", type(fresh), record_meta, arrays, used)
            # What the record learnt (e.g. reallocated budgets) differs from a fresh one, and
            # the rows it carries are in the model's dtype, which a fresh one cannot know.
            _compare(f"{where}: cross-layer record", rec, fresh, static_values=False)
            shared.record = rec
            for c in caches:  # a journal's layers left this record (velox.layer.left_record)
                c.held = layer.leaving(c.held, rec)
    elif record_meta is not None or layer_params is not None:
        raise ValueError(f"{where}: holds a cross-layer record but no layer's method uses one")
    extra = sorted(set(arrays) - used)
    if extra:
        raise ValueError(f"{where}: arrays {', '.join(extra)} belong to no layer")
    _route(where, caches, model)
    guards.install()
    if model is not None and any(c.compile and c.mode is Mode.DEFERRED for c in caches
                                 if isinstance(c, VeloxCache)):
        model_step.install(model)
    return caches, meta["user"]


#: Fixed-rate KVTC codes (the kvtc method's: a bit budget a row, allocated by dynamic
#: programming, one float16 scale a row), range-coded: given any of these, files code rows so.
_KVTC_FIXED = ("bit_budget", "bit_choices", "beta")
#: Entropy-coded KVTC (``velox.codecs.kvtc.compress_rows_ecsq_np``), the default: the steps of
#: keys and of every other row array (over their RMS spread), the first positions coded at the
#: fine step (attention sinks), the newest held exact, keys coded without their rotary
#: embedding when its base is given.
_KVTC_EC = {"key_step": 2.0, "value_step": 3.5, "sinks": 4, "recent": 0, "rope_theta": None,
            "rope_traditional": False}
#: Version of the codec description a file holds (``0.codec``'s ``version``; 1 when absent).
_CODEC_VERSION = 2


def _model_rope(model, codec: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the rotary base and layout of ``model`` (``model.args.rope_theta``,
    ``rope_traditional``) where entropy-coded KVTC codes the rows and ``params`` names
    neither; ``params`` as they are otherwise (no model, another codec, fixed-rate codes, a
    model without a rotary base)."""
    if (model is None or codec != "kvtc" or set(params) & set(_KVTC_FIXED)
            or "rope_theta" in params or "rope_traditional" in params):
        return params
    args = getattr(model, "args", None)
    theta = getattr(args, "rope_theta", None)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        return params
    return {**params, "rope_theta": float(theta),
            "rope_traditional": bool(getattr(args, "rope_traditional", False))}


def _codec_params(codec: str, params: dict[str, Any]) -> dict[str, Any]:
    """``codec_params`` checked and completed: fixed-rate KVTC's, entropy-coded KVTC's, or
    none for ``"lossless"``."""
    from velox.codecs import kvtc
    if codec == "lossless":
        if params:
            raise ValueError(f"codec_params {sorted(params)}: the lossless codec takes none")
        return {}
    if set(params) & set(_KVTC_FIXED):
        extra = sorted(set(params) - set(_KVTC_FIXED))
        if extra:
            raise ValueError(f"codec_params {extra} are not fixed-rate KVTC's ({', '.join(_KVTC_FIXED)}); "
                             f"entropy-coded KVTC takes {', '.join(_KVTC_EC)}")
        out = {"bit_budget": int(params.get("bit_budget", 512)),
               "bit_choices": str(params.get("bit_choices", kvtc.DEFAULT_CHOICES)),
               "beta": float(params.get("beta", 3.5))}
        kvtc.tables(1, out)  # checks them
        return out
    extra = sorted(set(params) - set(_KVTC_EC))
    if extra:
        raise ValueError(f"codec_params {extra} are not KVTC's ({', '.join(_KVTC_EC)}, or the "
                         f"fixed-rate {', '.join(_KVTC_FIXED)})")
    out = {**_KVTC_EC, **params}
    for k in ("key_step", "value_step"):
        if isinstance(out[k], bool) or not isinstance(out[k], (int, float)) or not 0 < out[k] < 1e6:
            raise ValueError(f"codec_params {k}={out[k]!r} must be a number in (0, 1e6)")
        out[k] = float(out[k])
    for k in ("sinks", "recent"):
        if isinstance(out[k], bool) or not isinstance(out[k], int) or out[k] < 0:
            raise ValueError(f"codec_params {k}={out[k]!r} must be an integer >= 0")
    theta = out["rope_theta"]
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not 1.0 < theta < 1e12):
        raise ValueError(f"codec_params rope_theta={theta!r} must be None or a base in (1, 1e12)")
    out["rope_theta"] = None if theta is None else float(theta)
    if not isinstance(out["rope_traditional"], bool):
        raise ValueError(f"codec_params rope_traditional={out['rope_traditional']!r} must be a bool")
    return out


def _row_arrays(i: int, m: Method, st: tuple, arrays: dict[str, mx.array]) -> list[str]:
    """Names of layer ``i``'s float row arrays ``[b, h, n, head_dim]`` (not its tables)."""
    b, h, d, _ = method_dims(m, st)
    out = []
    for name, x in arrays.items():
        parts = name.split(".")
        if parts[0] != str(i) or "tables" in parts[1] or "value_tables" in parts[1]:
            continue
        if (x.ndim == 4 and mx.issubdtype(x.dtype, mx.floating) and x.shape[2]
                and tuple(x.shape[:2]) == (b, h) and x.shape[3] == d):
            out.append(name)
    return out


def _row_positions(st: tuple, x: mx.array) -> np.ndarray | None:
    """The positions of ``x``'s rows (the record's ``positions`` where it has one of the
    array's ``[b, h, n]``), else ``None``."""
    pos = getattr(st, "positions", None)
    b, h, n, _ = x.shape
    if isinstance(pos, mx.array) and tuple(pos.shape) == (b, h, n):
        return np.array(pos)
    return None


def _exact_rows(st: tuple, name: str, x: mx.array, offset: int, sinks: int = KVTC_SINKS,
                recent: int = KVTC_RECENT) -> np.ndarray:
    """Rows of ``x`` (layer state ``st``'s array ``name``) below position ``sinks``, among
    the newest ``recent`` or in empty slots. Positions from the record's ``positions`` where
    it has one of the array's ``[b, h, n]``, else the storage order (less its trailing
    ``empty`` rows)."""
    b, h, n, _ = x.shape
    p = _row_positions(st, x)
    if p is not None:
        return (p < sinks) | (p >= offset - recent)
    empty = getattr(st, "empty", 0)
    held = n - empty if isinstance(empty, int) and 0 <= empty <= n else n
    i = np.broadcast_to(np.arange(n), (b, h, n))
    return (i < sinks) | (i >= held - recent)


def _host(x: mx.array) -> np.ndarray:
    """A float array on the host as float32 (NumPy has no bfloat16; every value is exact)."""
    return np.array(x.astype(mx.float32))


def _encode_rows(caches: list, arrays: dict[str, mx.array], codec: Any,
                 params: dict[str, Any]) -> dict[str, Any]:
    """Replace the caches' arrays in ``arrays`` by their codes (``save_cache``'s ``codec``);
    the description :func:`_decode_rows` reads."""
    from velox import entropy
    from velox.codecs import kvtc
    from velox.codec_cache import stored_tokens
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r} is not one of {', '.join(map(repr, CODECS))} (or "
                         "None: the arrays as they are)")
    params = _codec_params(codec, params)
    fixed = "bit_budget" in params
    sep = f"@{codec}."
    info: dict[str, Any] = {}

    def put(name: str, got: dict[str, Any], d: dict[str, Any]) -> None:
        info[name] = d
        arrays.update({f"{name}{sep}{k}": v if isinstance(v, mx.array) else mx.array(v)
                       for k, v in got.items()})

    for i, c in enumerate(caches):
        st = c.velox_state
        if st is None:
            continue
        if c.method.key == "kvtc" and f"{i}.key_codes.codes" in arrays:
            name, t = f"{i}.key_codes.codes", st.tables
            held = stored_tokens(st)
            got = kvtc.compress_codes_np(np.array(arrays.pop(name)), np.array(t.bits), t.total, held)
            put(name, got, {"kind": "codes", "shape": list(st.key_codes.codes.shape), "held": held,
                            "total": t.total, "bits": f"{i}.tables.bits"})
        offset = c.offset - (0 if c.tail is None else c.tail[0].shape[2])
        names = _row_arrays(i, c.method, st, arrays)
        if codec == "lossless":
            for name in names:
                x = arrays.pop(name)
                dt = _dtype_name(x.dtype)
                bits = x.view(mx.uint32 if x.dtype == mx.float32 else mx.uint16)
                b, h, n, d = x.shape
                got = entropy.float_encode(np.array(bits).reshape(b * h, n, d), dt)
                put(name, got, {"kind": "float", "shape": list(x.shape), "dtype": dt})
            continue
        if fixed:
            for name in names:
                x = arrays.pop(name)
                exact = _exact_rows(st, name, x, offset)
                got = kvtc.compress_rows_np(_host(x), exact, **params)
                put(name, got, {"kind": "rows", "shape": list(x.shape), "dtype": _dtype_name(x.dtype)})
            continue
        values = f"{i}.values" if f"{i}.values" in names else None
        quiet = None
        for name in sorted(names, key=lambda k: k != values):  # the values first: their quiet rows
            x = arrays.pop(name)
            rows = _host(x)
            exact = _exact_rows(st, name, x, offset, sinks=0, recent=params["recent"])
            pos = _row_positions(st, x)
            sink = (pos if pos is not None else np.broadcast_to(np.arange(x.shape[2]), exact.shape)) < params["sinks"]
            if name == values:
                quiet = kvtc.quiet_rows_np(rows, ~exact)
            q = sink.any(axis=1)
            if quiet is not None and quiet.shape == q.shape:
                q = q | quiet
            key = name.rsplit(".", 1)[-1] == "keys"
            rope = (params["rope_theta"], params["rope_traditional"]) if (
                key and params["rope_theta"] is not None and pos is not None) else None
            got = kvtc.compress_rows_ecsq_np(rows, exact, step=params["key_step" if key else "value_step"],
                                             quiet=q, positions=pos, rope=rope)
            got["exact_rows"] = mx.array(got["exact_rows"]).astype(x.dtype)
            put(name, got, {"kind": "ecsq", "shape": list(x.shape), "dtype": _dtype_name(x.dtype),
                            "rope": None if rope is None else list(rope),
                            "positions": f"{i}.positions" if rope is not None else None})
    for name in list(arrays):  # integer arrays (positions), where coding them saves bytes
        x = arrays[name]
        if "@" not in name and x.dtype in (mx.int16, mx.int32, mx.int64) and x.size >= 64:
            got = entropy.int_encode(np.array(x))
            if got is not None:
                del arrays[name]
                put(name, got, {"kind": "ints", "shape": list(x.shape), "dtype": _dtype_name(x.dtype)})
    return {"name": codec, "version": _CODEC_VERSION, "params": params, "arrays": info}


_KINDS = ("ints", "codes", "rows", "ecsq", "float")  # decoded in this order (positions first)


def _decode_rows(where: str, text: str, arrays: dict[str, mx.array]) -> None:
    """Undo :func:`_encode_rows` in ``arrays`` (a file's, its checksum checked)."""
    from velox import entropy
    from velox.codecs import kvtc
    try:
        desc = json.loads(text)
        name, params, info = desc["name"], desc["params"], desc["arrays"]
        version = desc.get("version", 1)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{where}: the metadata 'codec' is not a codec description") from None
    if name not in CODECS:
        raise ValueError(f"{where}: coded with {name!r}; this velox reads {', '.join(CODECS)}")
    if not isinstance(version, int) or version > _CODEC_VERSION:
        raise ValueError(f"{where}: coded by a newer velox (codec description {version!r}; this "
                         f"velox reads up to {_CODEC_VERSION}): load it with a newer velox")
    if not isinstance(params, dict) or not isinstance(info, dict):
        raise ValueError(f"{where}: the metadata 'codec' is not a codec description")
    params = _codec_params(name, params)
    sep = f"@{name}."
    bad = [k for k, d in info.items() if not isinstance(d, dict) or d.get("kind") not in _KINDS]
    if bad:
        raise ValueError(f"{where}: arrays {', '.join(map(str, bad))} are coded in a way this "
                         "velox does not know")
    for kind in _KINDS:
        for key, d in info.items():
            if d["kind"] != kind:
                continue
            parts = {k.split(sep, 1)[1]: k for k in arrays if k.startswith(f"{key}{sep}")}
            try:
                got = {k: (_host(arrays[v]) if arrays[v].dtype == mx.bfloat16 else np.array(arrays[v]))
                       for k, v in parts.items()}
                shape = tuple(int(s) for s in d["shape"])
                if kind == "ints":
                    out = mx.array(entropy.int_decode(got, shape, np.dtype(d["dtype"])))
                elif kind == "codes":
                    out = mx.array(kvtc.decompress_codes_np(got, shape, np.array(arrays[d["bits"]]),
                                                            d["total"], d["held"]))
                elif kind == "rows":
                    rows = kvtc.decompress_rows_np(got, shape, **params)
                    out = mx.array(rows).astype(getattr(mx, d["dtype"]))
                elif kind == "ecsq":
                    rope, pos = d["rope"], None
                    if rope is not None:
                        rope = (float(rope[0]), bool(rope[1]))
                        pos = np.array(arrays[d["positions"]])
                    rows = kvtc.decompress_rows_ecsq_np(got, shape, positions=pos, rope=rope)
                    out = mx.array(rows).astype(getattr(mx, d["dtype"]))
                else:
                    b, h, n, dd = shape
                    bits = entropy.float_decode(got, (b * h, n, dd), d["dtype"]).reshape(shape)
                    out = mx.array(bits).view(getattr(mx, d["dtype"]))
            except (KeyError, ValueError, TypeError, IndexError, AttributeError, RuntimeError) as e:
                raise ValueError(f"{where}: the codes of {key} do not decode "
                                 f"({type(e).__name__}: {e})") from None
            for v in parts.values():
                del arrays[v]
            arrays[key] = out


def _format_version(name: Any) -> int | None:
    """N of a format name ``velox-prompt-cache-N``, else ``None``."""
    prefix = "velox-prompt-cache-"
    if isinstance(name, str) and name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return None


def _read_meta(where: str, raw: dict[str, str], arrays: dict[str, mx.array]) -> dict[str, Any]:
    """The file's velox metadata, parsed; the checksum checked (and the marker dropped)."""
    version = _format_version(raw.get("0.format", raw.get("format")))
    if version is not None and version > _VERSION:
        raise ValueError(f"{where} was saved by a newer velox format {version}; this velox "
                         f"reads up to {_VERSION} (velox-prompt-cache-{_VERSION}): load it with a "
                         "newer velox")
    if version in (2, 3) and "0.format" in raw:
        fields = {k[2:]: v for k, v in raw.items() if k.startswith("0.")}
        if "sha256" not in fields:
            raise ValueError(f"{where}: velox-prompt-cache-{version} file without its sha256 "
                             "checksum")
        if version == 3:
            digest, covers = _digest(arrays, raw), "metadata or array data"
        else:
            digest, covers = _checksum(arrays), "array data"
        if digest != fields["sha256"]:
            raise ValueError(f"{where}: the {covers} do not match the sha256 checksum written at "
                             f"save ({fields['sha256'][:16]}... recorded, {digest[:16]}... read): "
                             "the file was changed or is corrupted")
        if _MARKER not in arrays:
            raise ValueError(f"{where}: the {_MARKER} array is missing")
        del arrays[_MARKER]
        if version == 2:
            warnings.warn(f"{where} was saved by velox format 2 (velox-prompt-cache-2), whose "
                          "checksum covers the array data only: its metadata (methods, "
                          "parameters, modes, which arrays each layer holds) cannot be "
                          "verified; save it again to cover them", UserWarning, stacklevel=3)
    elif version == 1 and raw.get("format") == _FORMAT_V1:
        fields = dict(raw)
        warnings.warn(f"{where} was written before velox prompt caches carried a checksum: its "
                      "array data cannot be verified (save it again to add one)", UserWarning,
                      stacklevel=3)
    else:
        hint = (" (it looks like mlx-lm's own prompt cache: load it with "
                "mlx_lm.models.cache.load_prompt_cache)" if any(k.startswith("1.") for k in raw) else "")
        raise ValueError(f"{where} is not a velox prompt cache{hint}")
    out: dict[str, Any] = {}
    for name, kind in (("layers", list), ("layer_params", (list, type(None))),
                       ("record", (dict, type(None))), ("user", dict)):
        try:
            out[name] = json.loads(fields[name])
        except KeyError:
            raise ValueError(f"{where}: the metadata lacks {name!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: the metadata {name!r} is not valid JSON ({e})") from None
        if not isinstance(out[name], kind):
            raise ValueError(f"{where}: the metadata {name!r} is a {type(out[name]).__name__}")
    return out


_ENTRY = {"method": str, "params": dict, "backend": str, "layer": int, "offset": int,
          "compile": bool, "real_queries": bool, "state": (dict, type(None))}
# Written since decode modes exist; files without all three load as decode="evict".
_DECODE_ENTRY = {"decode": str, "decode_cap": int, "tail": (dict, type(None))}
# Written since modes are explicit; a file without it gets the mode make_cache would choose
# (deferred for a method that wants queries), checked against the model as any mode is.
_MODE_ENTRY = {"mode": str}
# Written since rollback exists (the depth, not the journal); a file without it loads with 0.
_ROLLBACK_ENTRY = {"rollback": int}
# Written since format 3: the state's dims (compared with a given model) and the layer's
# calibration artifact; a file without them loads as before (the dims are read off the state).
_V3_ENTRY = {"dims": (dict, type(None)), "artifact": (dict, type(None))}


def _load_layer(where: str, i: int, entry: Any, arrays: dict[str, mx.array], used: set[str],
                backend: str | None) -> VeloxCache:
    fields = dict(_ENTRY)
    if isinstance(entry, dict) and set(_DECODE_ENTRY) & set(entry):
        fields.update(_DECODE_ENTRY)
    if isinstance(entry, dict) and "mode" in entry:
        fields.update(_MODE_ENTRY)
    if isinstance(entry, dict) and "rollback" in entry:
        fields.update(_ROLLBACK_ENTRY)
    if isinstance(entry, dict):
        fields.update({k: v for k, v in _V3_ENTRY.items() if k in entry})
    if not isinstance(entry, dict) or set(entry) != set(fields):
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{where}: the entry must have the fields {', '.join(_ENTRY)} (and "
                         f"{', '.join(_DECODE_ENTRY)} together; mode, rollback, dims and "
                         f"artifact optional); got {got}")
    for name, kind in fields.items():
        value = entry[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: {name}={value!r} is not a {getattr(kind, '__name__', kind)}")
    if entry["layer"] != i:
        raise ValueError(f"{where}: the entry says layer {entry['layer']}")
    offset = entry["offset"]
    if offset < 0:
        raise ValueError(f"{where}: offset={offset} is negative")
    decode = dict(decode=entry.get("decode", "evict"), decode_cap=entry.get("decode_cap", DECODE_CAP))
    desc, tail = entry["state"], entry.get("tail")
    artifact = _load_artifact(where, entry.get("artifact"), arrays, used)
    try:
        m = get_method(entry["method"])
        mode = (entry["mode"] if "mode" in entry  # else as make_cache would, checked later
                else _choose_mode(m, real_queries=entry["real_queries"], routed=True))
        c = VeloxCache(entry["method"], entry["params"], backend=backend or entry["backend"],
                       layer=i, compile=entry["compile"], real_queries=entry["real_queries"],
                       mode=mode, rollback=entry.get("rollback", 0), artifact=artifact, **decode)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if tail is not None and c.decode != "append":
        raise ValueError(f"{where}: decode={c.decode!r} but the entry holds an append-mode tail")
    if desc is None:
        if offset != 0:
            raise ValueError(f"{where}: offset={offset} but the cache holds no state")
        if tail is not None:
            raise ValueError(f"{where}: a tail but no state")
        if entry.get("dims") is not None:
            raise ValueError(f"{where}: dims {entry['dims']} but the cache holds no state")
        if c.backend != "auto":
            _resolve(where, c.backend, m, saved=backend is None)
        return c
    saved = desc.get("backend")
    if not isinstance(saved, str):
        raise ValueError(f"{where}: the state records no backend")
    run_on = _resolve(where, backend or saved, m, saved=backend is None)
    desc = _with_backend(desc, run_on)
    if (isinstance(desc, dict) and "empty" not in desc and "empty" in getattr(m.state_type, "_fields", ())
            and "slack" not in m.spec.params):
        # saved before the method's state held empty slots (the grown decode slots of SnapKV,
        # PyramidKV and NestedKV): every slot filled, which _check_state checks against the
        # positions
        desc = {**desc, "empty": 0}
    st = _build(where, m.state_type, desc, arrays, used)
    tk = tv = tq = None
    if tail is not None:
        tk, tv, tq = _load_tail(where, tail, arrays, used, st, m, c.decode_cap, offset)
    t = 0 if tk is None else tk.shape[2]
    _check_state(where, m, st, entry["params"], offset, t, artifact)
    c.held = c.held._replace(state=_wrapped_state(c._m, m, st, tk, tv, tq), offset=offset)
    if "dims" in entry and entry["dims"] != _save_dims(c):
        raise ValueError(f"{where}: dims {entry['dims']}, but the state holds {_save_dims(c)}")
    return c


def _load_artifact(where: str, desc: dict | None, arrays: dict[str, mx.array],
                   used: set[str]) -> dict[str, np.ndarray] | None:
    """A saved calibration artifact: its arrays by name."""
    if desc is None:
        return None
    out = {}
    for name, d in desc.items():
        if not (isinstance(d, dict) and set(d) == {"__array__"} and d["__array__"] in arrays):
            raise ValueError(f"{where}: artifact {name} {d!r} names no array of the file")
        used.add(d["__array__"])
        out[name] = np.array(arrays[d["__array__"]])
    return out


def _wrapped_state(run: Method, m: Method, st: tuple, tk, tv, tq) -> tuple:
    """The state the cache steps (``run``: ``m`` behind its tail and journal, ``velox.wrap``)
    around ``m``'s loaded state ``st``: the tail loaded (or empty), the journal empty."""
    inner = wrap.wrapped(run)
    if inner is None:
        return st
    st = _wrapped_state(inner, m, st, tk, tv, tq)
    if run.extras.get("tail_cap"):
        if tk is None:
            b, h, d, dtype = method_dims(m, st)
            tk = tv = mx.zeros((b, h, 0, d), dtype)
        return run.state_type(st, tk, tv, tq)
    return run.state_type(st, (), ())


def _load_tail(where: str, tail: dict, arrays: dict[str, mx.array], used: set[str], st: tuple,
               m: Method, cap: int, offset: int) -> tuple[mx.array, mx.array, mx.array | None]:
    """The tail's arrays, checked against the state's dims, the cap and the offset."""
    if set(tail) != {"keys", "values", "queries"}:
        raise ValueError(f"{where}: the tail must have the fields keys, values, queries; "
                         f"got {sorted(tail)}")
    got = {}
    for name, d in tail.items():
        if d is None and name == "queries":
            got[name] = None
            continue
        if not (isinstance(d, dict) and set(d) == {"__array__"} and d["__array__"] in arrays):
            raise ValueError(f"{where}: tail {name} {d!r} names no array of the file")
        used.add(d["__array__"])
        got[name] = arrays[d["__array__"]]
    try:
        b, h, d, dtype = method_dims(m, st)
    except Exception as e:
        raise ValueError(f"{where}: cannot read the state's dims ({type(e).__name__}: {e})") from None
    k, v, q = got["keys"], got["values"], got["queries"]
    t = k.shape[2] if k.ndim == 4 else -1
    for name, x in (("keys", k), ("values", v)):
        if tuple(x.shape) != (b, h, t, d) or x.dtype != dtype:
            raise ValueError(f"{where}: tail {name} is {_dtype_name(x.dtype)} {tuple(x.shape)}; "
                             f"the state holds {_dtype_name(dtype)} ({b}, {h}, t, {d})")
    if not 1 <= t < cap:
        raise ValueError(f"{where}: the tail holds {t} tokens; decode_cap={cap} keeps 1 to {cap - 1}")
    if t > offset:
        raise ValueError(f"{where}: the tail holds {t} tokens, more than offset={offset}")
    if q is not None and (q.ndim != 4 or q.shape[0] != b or q.shape[1] % h or q.shape[2:] != (t, d)
                          or q.dtype != dtype):
        raise ValueError(f"{where}: tail queries are {_dtype_name(q.dtype)} {tuple(q.shape)}; "
                         f"expected {_dtype_name(dtype)} ({b}, a multiple of {h}, {t}, {d})")
    return k, v, q


def _resolve(where: str, name: str, m: Method, *, saved: bool) -> str:
    try:
        return resolve_backend(name, m.key, m.backends)
    except BackendUnavailable as e:
        hint = "; load_cache(path, backend='mlx') runs it on MLX instead" if saved else ""
        raise BackendUnavailable(f"{where}: {e}{hint}") from None


def _with_backend(desc: Any, backend: str) -> Any:
    """``desc`` with every static ``backend`` field (nested records included) set to ``backend``."""
    if isinstance(desc, dict) and "__dict__" in desc:
        return {"__dict__": _with_backend(desc["__dict__"], backend)}
    if isinstance(desc, dict) and "__array__" not in desc:
        return {k: (backend if k == "backend" and isinstance(v, str) else _with_backend(v, backend))
                for k, v in desc.items()}
    return desc


def _build(where: str, record_type: type, desc: dict, arrays: dict[str, mx.array],
           used: set[str]) -> tuple:
    fields = set(record_type._fields)
    if "heads" in fields and "heads" not in desc and _holds_heads(record_type):
        desc = {**desc, "heads": LOCAL}  # every kv head of the layer (not written)
    missing, extra = sorted(fields - set(desc)), sorted(set(desc) - fields)
    if missing or extra:
        raise ValueError(f"{where}: {record_type.__name__} fields missing: {', '.join(missing) or '-'}; "
                         f"unknown: {', '.join(extra) or '-'}")

    def join(d: Any, name: str, kind: Any = None) -> Any:
        if isinstance(d, dict) and "__array__" in d:
            key = d["__array__"]
            if key not in arrays:
                raise ValueError(f"{where}: array {key!r} ({name}) is missing from the file")
            used.add(key)
            return arrays[key]
        kind = _member(kind, d)
        nested = hasattr(kind, "_fields")  # the field holds a record
        if isinstance(d, dict) and ("__record__" in d or "__dict__" in d) and nested:
            # (files saved before nested records were: the record's fields as a dict)
            return _build(f"{where}: {name}", kind, d.get("__record__", d.get("__dict__")), arrays, used)
        if isinstance(d, dict) and "__dict__" in d:
            return {k: join(v, f"{name}.{k}") for k, v in d["__dict__"].items()}
        if isinstance(d, dict):
            raise ValueError(f"{where}: {name} is an unknown description {d!r}")
        return tuple(d) if isinstance(d, list) else d

    kinds = getattr(record_type, "__annotations__", {})
    return record_type(**{k: join(v, k, kinds.get(k)) for k, v in desc.items()})


def _holds_heads(record_type: type) -> bool:
    """Whether a record's ``heads`` field is a ``velox.distributed.Heads`` (not written)."""
    try:
        return typing.get_type_hints(record_type).get("heads") is Heads
    except Exception:  # an annotation that does not resolve: not one of velox's records
        return False


def _member(kind: Any, d: Any) -> Any:
    """The record a field annotated with a union of records holds (a codec cache's value codes
    and tables, ``velox.codec_cache.ValueCodes`` and ``ValueTables``, one record per value
    codec): the member whose fields the saved description names; any other ``kind`` as is."""
    if typing.get_origin(kind) is not typing.Union or not (isinstance(d, dict) and "__record__" in d):
        return kind
    names = set(d["__record__"])
    for t in typing.get_args(kind):
        if hasattr(t, "_fields") and set(t._fields) == names:
            return t
    return kind


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def _leaves(record: tuple) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(name: str, v: Any) -> None:
        if hasattr(v, "_fields"):
            v = v._asdict()
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{name}.{k}", x)
        else:
            out[name] = v

    for k, v in record._asdict().items():
        walk(k, v)
    return out


def _compare(where: str, stored: tuple, fresh: tuple, *, static_values: bool = True) -> None:
    """Same fields, same static values (or, ``static_values=False``: types only, and floating
    arrays of any floating dtype), arrays of the same dtype and rank whose shapes match on
    every axis a fresh (empty) record already fixes."""
    a, b = _leaves(stored), _leaves(fresh)
    if set(a) != set(b):
        raise ValueError(f"{where}: fields {sorted(set(a) ^ set(b))} do not match the method's record")
    for name, f in b.items():
        s = a[name]
        if isinstance(f, mx.array) or isinstance(s, mx.array):
            if not (isinstance(f, mx.array) and isinstance(s, mx.array)):
                raise ValueError(f"{where}: {name} must be an array")
            want = "(" + ", ".join(str(n) if n else "*" for n in f.shape) + ")"
            floats = mx.issubdtype(s.dtype, mx.floating) and mx.issubdtype(f.dtype, mx.floating)
            if s.dtype != f.dtype and (static_values or not floats):
                raise ValueError(f"{where}: array {name} is {_dtype_name(s.dtype)}, the method "
                                 f"holds {_dtype_name(f.dtype)}")
            if s.ndim != f.ndim or any(n and n != m for n, m in zip(f.shape, s.shape)):
                raise ValueError(f"{where}: array {name} has shape {tuple(s.shape)}, expected {want}")
        elif type(s) is not type(f) or (static_values and s != f and name.rsplit(".", 1)[-1] != "empty"):
            # (``empty`` counts a state's empty slots, not a parameter: _check_slots checks it)
            raise ValueError(f"{where}: {name}={s!r} in the state, but its parameters give {f!r}")


def _check_slots(where: str, m: Method, st: tuple, b: int, h: int, d: int) -> None:
    """A state of slots (``velox.evict``): its stored arrays agree with its slot positions,
    which hold each token once and exactly ``empty`` empty slots (-1) per row, the last ones."""
    keys, values = st.keys, st.values
    raw = st.positions
    n = raw.shape[-1]
    if tuple(raw.shape) != (b, h, n) or {tuple(keys.shape), tuple(values.shape)} != {(b, h, n, d)}:
        raise ValueError(f"{where}: the state's arrays disagree with each other: slot positions "
                         f"{tuple(raw.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    p = np.sort(np.array(raw), axis=-1)
    empty = getattr(st, "empty", 0)
    if not isinstance(empty, int) or not 0 <= empty <= n:
        raise ValueError(f"{where}: empty={empty!r} must count the state's empty slots (0 to {n})")
    if (p[..., :empty] != -1).any() or (p[..., empty:] < 0).any():
        raise ValueError(f"{where}: each row must hold empty={empty} empty slots (position -1)")
    if empty and (np.array(raw[..., n - empty:]) != -1).any():
        raise ValueError(f"{where}: the empty slots must be the last {empty} of each row "
                         "(velox.evict: amortized eviction keeps them last)")
    if (np.diff(p[..., empty:], axis=-1) == 0).any():
        raise ValueError(f"{where}: stored positions must be unique (a token in two slots)")


def _check_state(where: str, m: Method, st: tuple, params: dict[str, Any], offset: int,
                 tail: int = 0, artifact: dict[str, np.ndarray] | None = None) -> None:
    """Parameters, dims, arrays and offset of a loaded state, against each other (the state
    has seen ``offset - tail`` tokens: the append-mode tail holds the rest), and against a
    fresh state of its parameters (calibrated with ``artifact`` when the cache has one)."""
    said = f"offset={offset}" + (f" less the tail's {tail}" if tail else "")
    offset -= tail
    try:
        b, h, d, dtype = method_dims(m, st)
    except Exception as e:
        raise ValueError(f"{where}: cannot read the state's dims ({type(e).__name__}: {e})") from None
    if m.layer_update is not None:  # the cross-layer record may reset a layer's parameters
        params = {**params, **{k: getattr(st, k) for k in m.spec.params if k in st._fields}}
    try:
        full = validate_params(m.spec, params, dims=dict(batch=b, kv_heads=h, head_dim=d))
        fresh = m.init(b, h, d, dtype=dtype, backend=st.backend, **params)
        if artifact is not None:
            fresh = m.calibrate(fresh, artifact)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    _compare(where, st, fresh)
    if "next_pos" in st._fields and not bool(mx.all(st.next_pos == offset)):
        raise ValueError(f"{where}: {said} but the state has seen "
                         f"{sorted(set(np.array(st.next_pos).ravel().tolist()))} tokens")
    try:
        pos = m.positions(st)
        keys, values = m.get_kv(st)
        one = mx.zeros((b, h, 1, d), dtype)
        later = m.update(st, one, one)  # lazy: shapes only, nothing is computed
        m.get_kv(later), m.positions(later)
    except Exception as e:
        raise ValueError(f"{where}: the state's arrays disagree with each other "
                         f"({type(e).__name__}: {e})") from None
    n = pos.shape[-1] if pos.ndim == 3 else -1
    if tuple(pos.shape) != (b, h, n) or not {tuple(keys.shape), tuple(values.shape)} == {(b, h, n, d)}:
        raise ValueError(f"{where}: the state's arrays disagree with each other: positions "
                         f"{tuple(pos.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if "mlx" in m.backends and m.backends["mlx"].slots:
        _check_slots(where, m, st, b, h, d)
    p = np.array(pos)
    if p.size and (p.min() < 0 or p.max() >= offset or (np.diff(p, axis=-1) <= 0).any()):
        bound = f"{offset}) ({said})" if tail else f"offset={offset})"
        raise ValueError(f"{where}: stored positions must increase within [0, {bound}")
    cap = m.spec.capacity(full)
    phase = m.spec.contract.get("bound_phase", "all")
    slack = decode_slack(m, full)
    low, high = (offset, offset) if cap is None else (
        (min(cap, offset), offset) if phase == "prefill" else (min(cap, offset), min(cap + slack, offset)))
    if not low <= n <= high:
        want = f"{low}" if low == high else f"{low} to {high}"
        raise ValueError(f"{where}: the state holds {n} tokens; after {offset} its parameters keep "
                         f"{want}" + (f" ({said})" if tail else ""))


def _check_layer_params(where: str, shared: _Model, caches: list) -> None:
    lp = shared.layer_params
    mine = [c for c in caches if c._model is shared]
    if not isinstance(lp, list) or len(lp) != len(mine) or len(mine) != len(caches):
        raise ValueError(f"{where}: the cross-layer parameters do not cover the {len(caches)} layers")
    for c in mine:
        if lp[c.layer] != c.params:
            raise ValueError(f"{where}: layer {c.layer}'s parameters {c.params} differ from the "
                             f"cross-layer record's {lp[c.layer]}")


def _model_dims(model) -> list[tuple[int, int, str] | None] | None:
    """``(kv_heads, head_dim, dtype)`` of the keys each layer's own cache receives from
    ``model`` (``None`` for a layer without a plain ``KVCache``), read from one token's forward
    over the model's default caches. MLX is lazy: the forward is only built, never computed
    (shapes and dtypes are known without it). ``None`` when the model does not run on one
    token."""
    base = default_layout(model)
    try:
        with untapped():  # an open query_capture() body records none of the probe's queries
            model(mx.zeros((1, 1), mx.int32), cache=base)
    except Exception:
        return None
    out = []
    for c in base:
        k = getattr(c, "keys", None) if type(c) is KVCache else None
        out.append(None if not isinstance(k, mx.array) or k.ndim != 4
                   else (int(k.shape[1]), int(k.shape[3]), _dtype_name(k.dtype)))
    return out


def _check_model_dims(where: str, caches: list, model) -> None:
    """Refuse caches whose states were made for another model: each layer's kv heads, head dim
    and dtype against the keys ``model`` gives that layer's cache."""
    probe = _model_dims(model)
    if probe is None:
        return
    for c, want in zip(caches, probe):
        if want is None or c.velox_state is None:
            continue
        _, h, d, dtype = _dims(c)
        got = (int(h), int(d), _dtype_name(dtype))
        diff = [f"{name} {g} (the model's: {w})"
                for name, g, w in zip(("kv_heads", "head_dim", "dtype"), got, want) if g != w]
        if diff:
            raise ValueError(f"{where}: layer {c.layer} was saved for another model: it holds "
                             f"{', '.join(diff)}; {type(model).__name__} gives its layer "
                             f"{c.layer} keys of kv_heads={want[0]}, head_dim={want[1]}, "
                             f"dtype={want[2]}")


def _route(where: str, caches: list, model) -> None:
    """Confirm the loaded caches' modes: a deferred cache stays deferred where the model's
    attention calls the wrapper (which is installed), and runs as proxy where it does not
    (a method with ``attend`` refuses such a model); without the model, each deferred cache
    confirms its mode at its first forward (``VeloxCache._settle``)."""
    if any(c.mode is Mode.DEFERRED for c in caches):
        install_query_capture()
    if model is None:
        for c in caches:
            c._route_unknown = c.mode is Mode.DEFERRED
        return
    base = default_layout(model)
    slots = [c for c in base if type(c) is KVCache]
    if len(slots) != len(base) or len(base) != len(caches):
        raise ValueError(f"{where} holds {len(caches)} velox layers; {type(model).__name__} has "
                         f"{len(slots)} plain KV layers of {len(base)}")
    _check_model_dims(where, caches, model)
    routed = _routes_attention(model)
    for c in caches:
        c._routed = routed
        if c.mode is Mode.DEFERRED:
            c.mode = _choose_mode(c.method, real_queries=c.real_queries, routed=routed,
                                  model=type(model).__name__)

"""Composition: an eviction policy decides which tokens live, a codec how they are held.

    tova_q = velox.compose.evict_then_store("tova")          # a registered method, key "tova+affine"
    state = tova_q.init(1, 8, 128, budget=256, n_sink=4, bits=2)
    tq = velox.compose.evict_then_store("tova", codec="turboquant_mse", bits=4)
    state = tq.init(1, 8, 128, budget=256)                   # bits=4 unless given

The composed state keeps the policy's own bookkeeping (positions, scores, ...) and holds the
survivors only as codes: per-token affine codes of keys and values (``codec="affine"``, groups
along channels, packed in MLX's layout), or keys as another codec's codes and values as
per-token 8-bit codes (``velox.codec_cache``), or, for a codec method that codes its values
with a codec of its own (VecInfer's product-quantized values), keys and values as that
method's codes; its bytes are those arrays. At each update the
policy scores the candidates, then the codec keeps the survivors' codes as they are (pure
eviction) or codes what the policy keeps afresh (merging policies change kept values). Rows
are coded independently, so dropping a token never touches another's codes.

How the policy sees the stored keys: a policy whose scores read them only as attention logits
(``velox.evict.score_and_keep``'s ``logits_only``: TOVA, H2O, SnapKV) gets them as
:class:`velox.attention.CodedKeys`, so its logits over the stored tokens are the codec's
estimates ``codec.scores`` of the queries against the key codes (``scores_np`` on the
``reference`` backend), the new tokens' exact, as the composition's attention reads them. Any
other policy (KNorm's key norms, ...) scores the decoded stored keys. The composed spec says
which (``contract.policy_keys``: ``"codes"`` or ``"decoded"``, and a deviation line).

Keyword parameters of :func:`evict_then_store` (``bits=3``) become the defaults of the returned
method's ``init``, checked against the composed spec; the registered method (``velox.init(key,
...)``) keeps the spec's defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from . import evict, quant
from . import reference as ref
from .attention import CodedKeys
from .codecs import affine
from .qattention import AffineRows, attend_segments
from .registry import Method, get_method, method_keys, register
from .spec import Param, Spec, validate_params

__all__ = ["evict_then_store", "composable"]

_CODEC_FIELDS = ("key_codes", "key_scales", "key_zeros", "value_codes", "value_scales", "value_zeros")
_PARAMS = {
    "bits": Param("bits", "choice", 4, doc="bits per stored element (per-token affine codes)",
                  choices=(2, 3, 4, 8)),
    "group_size": Param("group_size", "choice", 32, doc="channels per quantization group",
                        choices=(32, 64, 128), test_choices=(32,)),
}


def _encode(keys: mx.array, values: mx.array, bits: int, group_size: int, backend: str):
    """Per-token affine codes of keys and values (the ``affine`` codec, ``velox.codecs``:
    groups along channels; float16 scales and zeros, ``velox.quant.side_dtype``)."""
    t = affine.tables(keys.shape[-1], dict(bits=bits, group_size=group_size,
                                           dtype=quant.dtype_name(keys.dtype)))
    if backend == "reference":
        side = quant.dtype_of(t.side)
        out = []
        for x in (keys, values):
            c, s, z = affine.encode_np(t, ref.to_np(x, np.float32))
            out += [mx.array(c), ref.to_mx(s, side), ref.to_mx(z, side)]
        return tuple(out)
    return tuple(affine.encode(t, keys)) + tuple(affine.encode(t, values))


def _decode(state) -> tuple[mx.array, mx.array]:
    dtype = quant.dtype_of(state.cache_dtype)
    t = affine.AffineTables(state.bits, state.group_size)
    k = affine.decode(t, affine.AffineCodes(state.key_codes, state.key_scales, state.key_zeros))
    v = affine.decode(t, affine.AffineCodes(state.value_codes, state.value_scales, state.value_zeros))
    return k.astype(dtype), v.astype(dtype)


def _kept_index(cand: mx.array, kept: mx.array) -> mx.array:
    """Index in ``cand`` of every position of ``kept`` (both strictly increasing, kept a subset).

    With one candidate gone (a decode step) the lists agree up to the loser and are shifted by
    one after it, which is linear to find; otherwise each kept position counts the candidates
    below it.
    """
    N, k = cand.shape[2], kept.shape[2]
    if k == N - 1:
        differ = kept != cand[:, :, :k]
        drop = mx.where(differ.any(axis=2, keepdims=True),
                        mx.argmax(differ, axis=2, keepdims=True).astype(mx.int32), k)
        return evict.all_but(drop, k)
    return (cand[:, :, None, :] < kept[:, :, :, None]).sum(-1).astype(mx.int32)


def _slot_policy(P: Method) -> bool:
    """Whether the policy keeps its rows in slots (``velox.evict``): its update writes a
    decode step's row into the loser's slot and reports how it moved the rows."""
    return "mlx" in P.backends and P.backends["mlx"].slots


def _per_token(record, n_axes: tuple) -> list[str]:
    """Fields of ``record`` that are per-token arrays ``[b, h, n, ...]`` (``n_axes``: the
    positions' shape), by their jaxtyping annotation where it has one."""
    hints = typing.get_type_hints(type(record))
    out = []
    for f in record._fields:
        x = getattr(record, f)
        if not isinstance(x, mx.array) or x.ndim < 3 or tuple(x.shape[:3]) != n_axes:
            continue
        dims = getattr(hints.get(f), "dim_str", None)
        if dims is None or dims.split()[:3] == ["b", "h", "n"]:
            out.append(f)
    return out


def _slot_order(policy) -> mx.array:
    """The filled slots of a composed state's policy, in increasing position."""
    return evict.filled_order(policy.positions, evict.empty_slots(policy))


def _compact_policy(policy, order: mx.array):
    """The policy's per-token fields gathered by ``order`` and no empty slot."""
    fields = {f: evict.take_rows(getattr(policy, f), order)
              for f in _per_token(policy, tuple(policy.positions.shape))}
    if hasattr(policy, "empty"):
        fields["empty"] = 0
    return policy._replace(**fields)


def _composed_positions(state) -> mx.array:
    """Positions of the tokens a composed state holds, increasing."""
    return mx.sort(state.policy.positions, axis=-1)[..., evict.empty_slots(state.policy):]


def _scoring(codec: str, by_logits: bool) -> tuple[dict, str]:
    """The composed spec's ``contract.policy_keys`` and deviation line on how the policy reads
    the stored keys."""
    if by_logits:
        return {"policy_keys": "codes"}, (
            f"The policy scores candidates through the codec's estimates: its attention logits "
            f"over the stored tokens are the {codec} codec's scores of the queries against the "
            "key codes (the new tokens' are exact), not logits of decoded keys.")
    return {"policy_keys": "decoded"}, (
        "The policy scores candidates with the decoded stored keys (the codec's decode), "
        "not with the codec's score estimates.")


def _spec(policy: Spec, key: str, by_logits: bool) -> Spec:
    keys_contract, keys_line = _scoring("affine", by_logits)
    contract = dict(policy.contract, exact_rows=False, **keys_contract)
    return Spec(
        key=key, name=f"{policy.name} + per-token affine codes", title=policy.title,
        arxiv=policy.arxiv, venue=policy.venue, family="composed", phases=policy.phases,
        queries=policy.queries,
        summary=f"{policy.summary}; survivors stored as per-token affine codes",
        params={**policy.params, **_PARAMS},
        constraints=policy.constraints + ("head_dim % group_size == 0",),
        contract=contract, tolerance=dict(policy.tolerance, atol=1e-6, rtol=1e-6),
        deviations=policy.deviations + (
            "Survivors are stored as per-token affine codes (keys and values).", keys_line),
        backends=policy.backends, heads=policy.heads, heads_note=policy.heads_note)


def composable(policy: str) -> Method:
    """The registered method ``policy`` if it can be composed (it stores key and value rows
    and threads no cross-layer state), else a ``ValueError`` saying why."""
    P = get_method(policy)
    if P.layer_update is not None or P.attend is not None:
        raise ValueError(f"{policy} threads cross-layer state or attends itself; it cannot be composed")
    if not {"keys", "values", "next_pos"} <= set(P.state_type._fields):
        raise ValueError(f"{policy} does not store keys and values rows; it cannot be composed")
    return P


def evict_then_store(policy: str, codec: str = "affine", **defaults: Any) -> Method:
    """The method ``"<policy>+<codec>"``: ``policy`` decides which tokens live, ``codec``
    (``velox.codecs``) holds their keys.

    Registered on first use (so ``velox.init("<policy>+<codec>", ...)``, the adapter and the
    contract suite all accept it). With ``codec="affine"`` keys and values are per-token
    affine codes and the parameters are the policy's plus ``bits`` and ``group_size``. With
    another codec method (``"turboquant_prod"``, ``"qjl"``, ``"vecinfer"``, ...: a method
    built by ``velox.codec_cache``, named by its key) keys are its key codec's codes, values
    per-token 8-bit affine codes, or the method's own value codes where it has a value codec
    (VecInfer), and the parameters are the policy's plus those of the codec method that its
    codecs read (under the method's names: VecInfer's ``key_sub_dim``, ...); the attention
    reads the key codes (the codec's ``scores``), and so does a policy whose scores read the
    keys only as attention logits (see the module docstring). A codec method's per-layer
    schedule (``layer_params``: the layer of VecInfer's shipped calibration) is the
    composition's. A method that is not a codec cache (A2ATS, NSNQuant, AnchorKV, ...) is a
    ``ValueError`` giving its spec's ``compose_note``.

    ``defaults`` (``bits=3``) become the defaults of the returned method's ``init`` (its
    signature shows them, its ``spec`` holds them; arguments given to ``init`` still win). They
    are checked against the composed spec: an unknown name, a value out of range or a broken
    constraint raises ``ValueError``. Without them the registered method itself is returned.
    """
    m = _evict_then_code(policy, codec) if codec != "affine" else _evict_then_affine(policy)
    return _with_defaults(m, defaults) if defaults else m


def _with_defaults(m: Method, given: dict[str, Any]) -> Method:
    """``m`` with ``given`` as the defaults of its ``init`` and its spec (not registered:
    states it makes are ``m``'s, updated by ``m``)."""
    checked = validate_params(m.spec, given)  # unknown names, types, ranges, constraints
    defaults = {name: checked[name] for name in given}
    spec = dataclasses.replace(m.spec, params={
        name: dataclasses.replace(p, default=defaults[name]) if name in defaults else p
        for name, p in m.spec.params.items()})
    registered = m.init

    def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
             backend: str = "auto", **params: Any):
        return registered(batch, kv_heads, head_dim, dtype=dtype, backend=backend,
                          **{**defaults, **params})

    sig = inspect.signature(init)
    kw = inspect.Parameter.KEYWORD_ONLY
    init.__signature__ = sig.replace(parameters=[
        *(q for q in sig.parameters.values() if q.kind is not q.VAR_KEYWORD and q.name != "backend"),
        *(inspect.Parameter(name, kw, default=p.default) for name, p in spec.params.items()),
        sig.parameters["backend"]])
    init.__doc__ = (f"Empty {m.key} state; parameters as ``velox.init({m.key!r}, ...)``, with "
                    f"the defaults {', '.join(f'{k}={v!r}' for k, v in defaults.items())}.")
    return dataclasses.replace(m, init=init, spec_override=spec, _spec=None)


def _evict_then_affine(policy: str) -> Method:
    """``policy`` + keys and values as per-token affine codes (see :func:`evict_then_store`)."""
    key = f"{policy}+affine"
    if key in method_keys():
        return get_method(key)
    P = composable(policy)
    by_logits = evict.scores_by_logits(P)
    spec = _spec(P.spec, key, by_logits)
    pure = bool(P.spec.contract.get("exact_rows", False))
    hints = typing.get_type_hints(P.state_type)
    # The policy's own bookkeeping: its state's fields but the rows the codec holds.
    Policy = NamedTuple(f"{P.state_type.__name__}Policy",
                        [(f, hints[f]) for f in P.state_type._fields if f not in ("keys", "values", "next_pos")])
    State = NamedTuple(f"{P.state_type.__name__}Affine",
                       [("policy", Policy)] + [(f, mx.array) for f in _CODEC_FIELDS]
                       + [("next_pos", mx.array), ("bits", int), ("group_size", int),
                          ("cache_dtype", str), ("backend", str)])

    def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
             backend: str = "auto", **params: Any):
        """Empty composed state; ``params`` are the policy's plus ``bits`` and ``group_size``
        (checked by the registry's wrapper before this runs)."""
        bits, group = params.pop("bits"), params.pop("group_size")
        pstate = P.init(batch, kv_heads, head_dim, dtype=dtype, backend=backend, **params)
        empty = mx.zeros((batch, kv_heads, 0, head_dim), dtype)
        codec = _encode(empty, empty, bits, group, "mlx")
        return State(Policy(*(getattr(pstate, f) for f in Policy._fields)), *codec, pstate.next_pos,
                     bits, group, quant.dtype_name(dtype), pstate.backend)

    def _policy_state(state, k_hat, v_hat):
        stored = k_hat
        if by_logits:  # the policy's logits over stored keys: the affine codec's scores
            codes = affine.AffineCodes(state.key_codes, state.key_scales, state.key_zeros)
            t = affine.tables(k_hat.shape[3], dict(bits=state.bits, group_size=state.group_size,
                                                   dtype=state.cache_dtype))
            stored = CodedKeys(k_hat, codes, t, affine.CODEC)
        return P.state_type(**state.policy._asdict(), keys=stored, values=v_hat, next_pos=state.next_pos)

    slotted = _slot_policy(P)

    def _compact(state):
        """A multi-token step of a slot policy gathers its filled slots in increasing
        position first (its codes with them), as the policy's own update would."""
        order = _slot_order(state.policy)
        codes = {f: evict.take_rows(getattr(state, f), order) for f in _CODEC_FIELDS}
        return state._replace(policy=_compact_policy(state.policy, order), **codes)

    def _update(state, keys, values, queries):
        n, s = state.policy.positions.shape[2], keys.shape[2]
        if slotted and s > 1 and n:
            state = _compact(state)
        k_hat, v_hat = _decode(state)
        pstate = _policy_state(state, k_hat, v_hat)
        backend = P.backends[state.backend]
        if pure and slotted:  # the policy says how it moved the rows: the codes follow
            new, move = backend.with_move(pstate, keys, values, queries)
            fresh = _encode(keys, values, state.bits, state.group_size, state.backend)
            codec = evict.apply_move(move, tuple(getattr(state, f) for f in _CODEC_FIELDS), fresh)
        elif pure:
            new = backend(pstate, keys, values, queries)
            n = k_hat.shape[2]
            kept = new.positions
            if kept.shape[2] == n + s:
                idx = None
            else:  # candidate index of each kept position (both sorted)
                cand = mx.concatenate([pstate.positions, evict.new_positions(state.next_pos, s)], 2)
                idx = _kept_index(cand, kept)
            fresh = _encode(keys, values, state.bits, state.group_size, state.backend)
            old = tuple(getattr(state, f) for f in _CODEC_FIELDS)
            codec = evict.keep_rows(old, fresh, idx)
        else:
            new = backend(pstate, keys, values, queries)
            codec = _encode(new.keys, new.values, state.bits, state.group_size, state.backend)
        return State(Policy(*(getattr(new, f) for f in Policy._fields)), *codec, new.next_pos,
                     state.bits, state.group_size, state.cache_dtype, state.backend)

    def _sorted(state):
        """The state with its codes (and policy) in increasing position: ``get_kv``'s order."""
        return _compact(state) if slotted else state

    def get_kv(state):
        """Dequantized survivors, in increasing absolute position."""
        return _decode(_sorted(state))

    def kv_slots(state):
        """Dequantized stored rows in storage order (empty slots, which are the last ones,
        left out)."""
        return (*evict.filled_rows(*_decode(state), evict.empty_slots(state.policy)), None)

    def dims(state):
        b, h, _, groups = state.key_scales.shape
        return b, h, groups * state.group_size, quant.dtype_of(state.cache_dtype)

    def error_bound(state):
        state = _sorted(state)
        bk = quant.error_bound(state.key_scales, state.key_zeros, state.bits, state.group_size)
        bv = quant.error_bound(state.value_scales, state.value_zeros, state.bits, state.group_size)
        return bk, bv

    def attend(state, queries, keys, values, *, scale, mask=None):
        """Attention on the packed codes (``mx.quantized_matmul``) plus ``s`` new tokens."""
        if evict.empty_slots(state.policy):  # empty slots (slack): the filled ones only
            state = _compact(state)
        seg = AffineRows(*(getattr(state, f) for f in _CODEC_FIELDS), state.bits, state.group_size)
        return attend_segments(queries, [seg], keys, values, scale=scale, mask=mask)

    m = register(key, State, init, {b: _update for b in P.backends}, get_kv=get_kv,
                 positions=_composed_positions if slotted else (lambda st: st.policy.positions),
                 kv_slots=kv_slots, error_bound=error_bound, dims=dims, attend=attend, spec=spec)
    return m


def _code_spec(policy: Spec, codec_spec: Spec, key: str, codec_params: tuple[str, ...],
               by_logits: bool, *, own_values: bool = False) -> Spec:
    """The composed spec. ``own_values``: the codec method codes its values itself (VecInfer's
    product-quantized values), so the composition's values are its codes, not 8-bit ones."""
    keys_contract, keys_line = _scoring(codec_spec.key, by_logits)
    taken = sorted(set(policy.params) & set(codec_params))
    if taken:
        raise ValueError(f"{policy.key} and {codec_spec.key} both name parameter(s) {', '.join(taken)}")
    held = (f"keys and values held as {codec_spec.name} codes" if own_values else
            f"keys held as {codec_spec.name} codes, values as per-token 8-bit codes")
    return Spec(
        key=key, name=f"{policy.name} + {codec_spec.name} keys" + (" and values" if own_values else ""),
        title=policy.title,
        arxiv=policy.arxiv, venue=policy.venue, family="composed", phases=policy.phases,
        queries=policy.queries,
        summary=f"{policy.summary}; survivors' {held}",
        params={**policy.params, **{n: codec_spec.params[n] for n in codec_params}},
        constraints=policy.constraints + tuple(
            c for c in codec_spec.constraints
            if {t for t in c.replace("(", " ").replace(")", " ").split() if t.isidentifier()}
            <= set(codec_params) | {"head_dim", "batch", "kv_heads", "min", "max"}),
        contract=dict(policy.contract, exact_rows=False, quantized=True, **keys_contract,
                      **{k: v for k, v in codec_spec.contract.items()
                         if k in ("estimator", "blas_codes")}),
        tolerance=dict(codec_spec.tolerance),
        deviations=policy.deviations + _codec_deviations(codec_spec, codec_params) + (keys_line,),
        backends=tuple(b for b in policy.backends if b in ("reference", "mlx")),
        **_composed_heads(policy, codec_spec))


def _composed_heads(policy: Spec, codec_spec: Spec) -> dict[str, str]:
    """The composition's ``heads`` (``velox.distributed``): the policy's, its codec coding
    each kv head alone (a codec whose coding crosses heads is refused)."""
    if codec_spec.heads != "independent":
        raise ValueError(f"{codec_spec.key} codes across kv heads ({codec_spec.heads_note}): it "
                         f"holds no policy's survivors")
    return dict(heads=policy.heads, heads_note=policy.heads_note)


def _codec_deviations(codec_spec: Spec, codec_params: tuple[str, ...]) -> tuple[str, ...]:
    """The codec method's deviation lines that hold for the composition: a line naming a
    parameter of the codec's method that the codec does not read (a method-level option such
    as the outlier channels' ``n_outlier``) is left out, and one line says which are absent."""
    absent = sorted(set(codec_spec.params) - set(codec_params))
    words = lambda line: set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", line))  # noqa: E731
    kept = tuple(d for d in codec_spec.deviations if not words(d) & set(absent))
    if not absent:
        return kept
    return kept + (f"{codec_spec.key}'s method parameters {', '.join(absent)} are not parameters "
                   "of the composition: the codec runs at their neutral values.",)


def _evict_then_code(policy: str, codec_name: str) -> Method:
    """``policy`` + keys held by the codec ``codec_name`` (see :func:`evict_then_store`)."""
    from . import codec_cache
    from .codecs import get_codec, take

    key = f"{policy}+{codec_name}"
    if key in method_keys():
        return get_method(key)
    P = composable(policy)
    C, lay = _codec_method(codec_name)  # the codec's own method: its parameters' spec
    codec = get_codec(lay.codec)
    # values: 8-bit affine codes (value_codec and value_bits are not parameters of a
    # composition), unless the codec method codes its values with a codec of its own (VecInfer)
    own_values = lay.values not in codec_cache.VALUE_CODECS
    # the codec's parameters that are its method's (not arrays a calibration installs), under
    # the method's names (VecInfer's key_sub_dim for its key codec's sub_dim), the keys' first
    named = [lay.rename.get(n, n) for n in codec.params]
    if own_values:
        named += [lay.value_rename[n] for n in get_codec(lay.values).params if n in lay.value_rename]
    cnames = tuple(n for n in dict.fromkeys(named) if n in C.spec.params)
    by_logits = evict.scores_by_logits(P)
    spec = _code_spec(P.spec, C.spec, key, cnames, by_logits, own_values=own_values)
    pure = bool(P.spec.contract.get("exact_rows", False))
    hints = typing.get_type_hints(P.state_type)
    Policy = NamedTuple(f"{P.state_type.__name__}Policy",
                        [(f, hints[f]) for f in P.state_type._fields if f not in ("keys", "values", "next_pos")])
    Ctype = C.state_type
    chints = typing.get_type_hints(Ctype)
    State = NamedTuple(
        f"{P.state_type.__name__}{C.state_type.__name__.replace('State', '')}",
        [("policy", Policy), ("key_codes", chints["key_codes"]),
         ("value_codes", chints["value_codes"] if own_values else codec_cache.Int8Rows),
         ("tables", chints["tables"])]
        + ([("value_tables", chints["value_tables"])] if own_values else [])
        + [("next_pos", mx.array)] + [(n, type(C.spec.params[n].default)) for n in cnames]
        + [("cache_dtype", str), ("backend", str)])
    # the codec method's prepare step (a fit at the first keys, a refusal) runs before encoding
    codec_cache._LAYOUT[State] = codec_cache._Layout(
        lay.codec, lay.values if own_values else "affine", dict(lay.rename),
        value_rename=dict(lay.value_rename) if own_values else {}, prepare=lay.prepare)

    def init(batch: int, kv_heads: int, head_dim: int, *, dtype: mx.Dtype = mx.float32,
             backend: str = "auto", **params: Any):
        """Empty composed state; ``params`` are the policy's plus the codec's (checked by the
        registry's wrapper before this runs)."""
        cparams = {n: params.pop(n) for n in cnames}
        pstate = P.init(batch, kv_heads, head_dim, dtype=dtype, backend=backend, **params)
        args = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, **cparams)
        empty = codec_cache.empty(State, dict(args, policy=None, backend=pstate.backend))
        return empty._replace(policy=Policy(*(getattr(pstate, f) for f in Policy._fields)))

    def _with_rows(state, keys, values):
        """The state's key and value codes with ``keys``, ``values`` appended, coded by the
        state's backend (MLX functions, or the NumPy twins), and the tables they were coded
        with (the codec method's prepare step may fit them at the first keys)."""
        step = codec_cache._update_reference if state.backend == "reference" else codec_cache._update_mlx
        out = step(state, keys, values, None)
        return out.key_codes, out.value_codes, out.tables

    slotted = _slot_policy(P)

    def _compact(state):
        """The state with its filled slots gathered in increasing position (codes and policy)."""
        order = _slot_order(state.policy)
        return state._replace(policy=_compact_policy(state.policy, order),
                              key_codes=take(state.key_codes, order),
                              value_codes=take(state.value_codes, order))

    def _fresh(state, keys, values):
        """The codes of ``keys``, ``values`` alone, coded as the state codes them (a state
        holding tokens: one stored row goes along, so choices made at the first tokens hold)."""
        one = state._replace(key_codes=type(state.key_codes)(*(x[:, :, :1] for x in state.key_codes)),
                             value_codes=type(state.value_codes)(*(x[:, :, :1] for x in state.value_codes)))
        kc, vc, _ = _with_rows(one, keys, values)  # a row held: the tables stand
        return (type(kc)(*(x[:, :, 1:] for x in kc)), type(vc)(*(x[:, :, 1:] for x in vc)))

    def _update(state, keys, values, queries):
        n, s = state.policy.positions.shape[2], keys.shape[2]
        if slotted and s > 1 and n:
            state = _compact(state)
        k_hat, v_hat = codec_cache.get_kv(state)
        # a policy scoring by logits reads the stored keys' through the codec's scores
        stored = CodedKeys(k_hat, state.key_codes, state.tables, codec) if by_logits else k_hat
        pstate = P.state_type(**state.policy._asdict(), keys=stored, values=v_hat,
                              next_pos=state.next_pos)
        backend = P.backends[state.backend]
        n = k_hat.shape[2]
        tables = state.tables
        if pure and slotted:  # the policy says how it moved the rows: the codes follow
            new, move = backend.with_move(pstate, keys, values, queries)
            if move.slot is not None:
                fk, fv = _fresh(state, keys, values)
                kc = type(fk)(*evict.apply_move(move, tuple(state.key_codes), tuple(fk)))
                vc = type(fv)(*evict.apply_move(move, tuple(state.value_codes), tuple(fv)))
            else:
                kc, vc, tables = _with_rows(state, keys, values)
                if move.idx is not None:
                    kc, vc = take(kc, move.idx), take(vc, move.idx)
        elif pure:
            new = backend(pstate, keys, values, queries)
            kc, vc, tables = _with_rows(state, keys, values)
            if new.positions.shape[2] != n + s:  # candidate index of each kept position
                cand = mx.concatenate([pstate.positions, evict.new_positions(state.next_pos, s)], 2)
                idx = _kept_index(cand, new.positions)
                kc, vc = take(kc, idx), take(vc, idx)
        else:  # a merging policy changes kept rows: code what it keeps afresh
            new = backend(pstate, keys, values, queries)
            none = state._replace(key_codes=type(state.key_codes)(*(x[:, :, :0] for x in state.key_codes)),
                                  value_codes=type(state.value_codes)(*(x[:, :, :0] for x in state.value_codes)))
            kc, vc, tables = _with_rows(none, new.keys, new.values)
        return state._replace(policy=Policy(*(getattr(new, f) for f in Policy._fields)),
                              key_codes=kc, value_codes=vc, tables=tables, next_pos=new.next_pos)

    def get_kv(state):
        """Decoded keys and dequantized values, in increasing absolute position."""
        return codec_cache.get_kv(_compact(state) if slotted else state)

    def kv_slots(state):
        """Decoded stored rows in storage order (empty slots, which are the last ones, left
        out)."""
        return (*evict.filled_rows(*codec_cache.get_kv(state), evict.empty_slots(state.policy)), None)

    def attend(state, queries, keys, values, *, scale, mask=None):
        """``velox.codec_cache.attend`` over the filled slots."""
        if evict.empty_slots(state.policy):  # empty slots (slack): the filled ones only
            state = _compact(state)
        return codec_cache.attend(state, queries, keys, values, scale=scale, mask=mask)

    return register(key, State, init, {b: _update for b in spec.backends},
                    get_kv=get_kv if slotted else codec_cache.get_kv,
                    positions=_composed_positions if slotted else (lambda st: st.policy.positions),
                    kv_slots=kv_slots, dims=codec_cache.dims,
                    attend=attend if slotted else codec_cache.attend, spec=spec,
                    # a codec method's per-layer schedule (VecInfer's layer of its shipped fit)
                    layer_params=C.layer_params)


def _codec_method(name: str):
    """``(method, layout)`` of the codec method ``name``: a registered method built by
    ``velox.codec_cache`` (its codes a token's own, in a layout the composition shares).
    Anything else is a ``ValueError`` saying why: an unknown name, a codec whose method has
    another name, or a method whose storage is not that layout (its spec's ``compose_note``
    says what it does instead)."""
    from . import codec_cache
    from .codecs import get_codec

    if name not in method_keys():
        get_codec(name)  # an unknown codec: ValueError naming the registered ones
        lays = {k: codec_cache._LAYOUT.get(get_method(k).state_type) for k in method_keys()}
        owners = sorted(k for k, lay in lays.items()
                        if lay is not None and lay.chunked and name in (lay.codec, lay.values))
        if not owners:
            raise ValueError(f"{name} is a codec but no method's key; compose with a codec "
                             "method's key (a method built by velox.codec_cache)")
        raise ValueError(f"{name} is a codec of the method(s) {', '.join(owners)}; compose with the "
                         f"method's key (codec={owners[0]!r}), whose parameters the composition takes")
    C = get_method(name)
    lay = codec_cache._LAYOUT.get(C.state_type)
    if lay is None or not lay.chunked:
        why = C.spec.compose_note or (
            f"{name} does not hold its tokens as a codec's codes, one token's alone "
            "(velox.codec_cache)")
        raise ValueError(f"{name} cannot hold an eviction policy's survivors: {why}")
    return C, lay

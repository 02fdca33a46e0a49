"""The method registry: key -> the method's functions, backends and spec.

Generic code (adapter, CLI, tests, benchmarks) goes through this table and needs no
per-method branches. Kernel modules add backends to a registered method with
:func:`register_backend`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import textwrap
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from . import ragged as rg
from .accounting import state_nbytes
from .backend import Backend
from .ragged import RowStates, check_valid, filled_nbytes, is_ragged, rows_update, split_rows
from .registered import _BY_STATE, _REGISTRY
from .slots import filled_rows
from .spec import Spec, read_spec, spec_keys
from .state_dims import State, _keys_dims, dims_of

__all__ = ["Method", "register", "register_backend", "get_method", "method_keys", "method_of",
           "dims_of", "slot_order", "take_slots"]


@dataclass
class Method:
    """One registered method: its state type, its functions and its spec."""

    key: str
    state_type: type
    init: Callable[..., State]
    update: Callable[..., State] | None
    get_kv: Callable[[State], tuple[mx.array, mx.array]]
    nbytes: Callable[[State], int]
    positions: Callable[[State], mx.array]
    kv_slots: Callable[[State], tuple[mx.array, mx.array, mx.array | None]] | None = None
    backends: dict[str, Backend] = field(default_factory=dict)
    error_bound: Callable[[State], tuple[mx.array, mx.array]] | None = None
    dims: Callable[[State], tuple[int, int, int, mx.Dtype]] | None = None
    # Cross-layer hooks (see docs/adding-a-method.md):
    layer_params: Callable[[int, dict[str, Any]], list[dict[str, Any]]] | None = None
    model_init: Callable[[list[dict[str, Any]]], tuple] | None = None
    layer_update: Callable[..., tuple[tuple, State]] | None = None
    attend: Callable[..., mx.array] | None = None
    attend_update: Callable[..., tuple[mx.array, State]] | None = None
    calibrate: Callable[[State, dict], State] | None = None
    spec_override: Spec | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    _spec: Spec | None = field(default=None, repr=False)

    def per_layer_params(self, n_layers: int, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Parameters of each of ``n_layers`` layers (a schedule where the method has one)."""
        if self.layer_params is None:
            return [dict(params) for _ in range(n_layers)]
        return self.layer_params(n_layers, dict(params))

    @property
    def spec(self) -> Spec:
        """The method's spec: its file in ``velox/specs`` with the parameters of its ``init``
        signature (or a generated one, for compositions)."""
        if self.spec_override is not None:
            return self.spec_override
        if self._spec is None:
            self._spec = read_spec(self.key, getattr(self.init, "__wrapped__", self.init))
        return self._spec


def _stored_positions(state: State) -> mx.array:
    """Absolute positions of what ``get_kv`` returns: the state's ``positions`` field."""
    return state.positions


def _stored_kv(state: State) -> tuple[mx.array, mx.array]:
    """Kept keys and values, in increasing absolute position: the state's ``keys``/``values``."""
    return state.keys, state.values


def slot_order(positions: mx.array, empty: int = 0) -> mx.array:
    """The filled slots ``[b, h, n - empty]`` of slot positions ``[b, h, n]`` (``-1``: empty),
    in increasing position."""
    return mx.argsort(positions, axis=-1)[..., empty:]


def take_slots(x: mx.array, order: mx.array) -> mx.array:
    """Rows ``order [b, h, k]`` of ``x [b, h, n, ...]`` (the token axis)."""
    return mx.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 3)), axis=2)


def _slot_positions(state: State) -> mx.array:
    """Positions of the tokens a state of slots holds, increasing (empty slots left out)."""
    empty = getattr(state, "empty", 0)
    return mx.sort(state.positions, axis=-1)[..., empty:]


def _slot_kv(state: State) -> tuple[mx.array, mx.array]:
    """Kept keys and values of a state of slots, in increasing absolute position: its rows
    gathered by position (empty slots left out)."""
    order = slot_order(state.positions, getattr(state, "empty", 0))
    return take_slots(state.keys, order), take_slots(state.values, order)


def _slot_kv_slots(state: State) -> tuple[mx.array, mx.array, mx.array | None]:
    """Stored keys and values in storage order, and the mask of filled slots (``None`` when
    every slot given holds a token; always given for a state of ragged rows,
    ``velox.ragged``). A state with empty slots (amortized eviction) keeps them last: its
    filled slots are given as a view of the first ones, no mask."""
    if is_ragged(state):
        return state.keys, state.values, state.positions >= 0
    return (*filled_rows(state.keys, state.values, getattr(state, "empty", 0)), None)


def _slot_nbytes(state: State) -> int:
    """Bytes of every array a state of slots holds; for a state of ragged rows
    (``velox.ragged``) its filled slots' and per-row arrays' bytes, the sum of its rows'."""
    return filled_nbytes(state) if is_ragged(state) else state_nbytes(state)


def _default_kv_slots(get_kv: Callable) -> Callable:
    def kv_slots(state: State) -> tuple[mx.array, mx.array, None]:
        """The stored rows in storage order (``get_kv``'s, increasing position); no empty slot."""
        keys, values = get_kv(state)
        return keys, values, None
    return kv_slots


def register(key: str, state_type: type, init: Callable, backends: Any = None, *,
             update: Callable | None = None, get_kv: Callable | None = None,
             nbytes: Callable | None = None, positions: Callable | None = None,
             kv_slots: Callable | None = None, error_bound: Callable | None = None, dims: Callable | None = None,
             layer_params: Callable | None = None, model_init: Callable | None = None,
             layer_update: Callable | None = None, attend: Callable | None = None,
             attend_update: Callable | None = None, calibrate: Callable | None = None, spec: Spec | None = None,
             **extras: Any) -> Method:
    """Add a method to the registry (called once, at the end of each method module).

    The method writes its state record, its ``init`` and its backends; everything else has a
    default here:

    * ``init``: the module's function is wrapped. The wrapper binds the call to the function's
      signature (its keyword parameters, with their defaults, are the method's parameters),
      checks the dims, validates the parameters against the spec (types, ranges,
      constraints), resolves ``backend`` (``"auto"`` -> a concrete name) and calls the
      function with the checked values. ``help(<key>.init)`` shows the signature and its
      ``Args:``.
    * ``update(state, keys, values, *, queries=None, valid=None)``: checks the new rows against
      the state's dims and runs ``backends[state.backend]``. ``valid`` (int ``[b]``) counts
      each row's real new tokens: a method whose spec declares ``contract.ragged`` runs its
      backend's ``ragged`` update (``velox.ragged``; the ``cuda`` backend its ``mlx`` one),
      as it does for a state of ragged rows given no ``valid``; any other method, given
      unequal counts, holds the rows as one batch-of-one state each
      (``velox.ragged.RowStates``, which every function of the method then takes).
    * ``get_kv``: the state's ``keys`` and ``values``; ``nbytes``: the bytes of every array
      the state holds; ``positions``: the state's ``positions``; ``dims``: from ``keys``.
      For a method whose ``mlx`` backend keeps rows in slots (``velox.evict``'s
      ``score_and_keep``; its record's ``slots``), ``get_kv`` and ``positions``
      gather the filled slots in increasing position.
    * ``kv_slots(state) -> (keys, values, mask)``: the stored rows in storage order, every
      one older than the next update's tokens (what attention reads: it is invariant to the
      order of the stored rows), and ``mask`` ``None`` when every slot holds a token, else
      a bool ``[b, h, n]`` (True: a token). Slot states: their arrays (with empty slots,
      amortized eviction's, which are the last ones: a view of the filled first slots);
      others: ``get_kv`` and ``None``. A state of slots holding ragged rows
      (``velox.ragged``) always has the mask of ``positions >= 0``, and ``nbytes`` counts
      its filled slots.
    * Every function that takes a state (``update``, ``get_kv``, ``nbytes``, ``positions``,
      ``kv_slots``, ``dims``, ``error_bound``, ``attend``, ``attend_update``, ``calibrate``,
      ``layer_update``) refuses one that is not ``state_type`` (another method's, a
      composition's, a bare tuple) with a ``TypeError`` naming the function and the type it
      takes; those that take ragged rows held per row also take ``RowStates`` of
      ``state_type``. ``attend`` refuses queries whose head count is not a positive multiple
      of the kv heads.

    Args:
        key: the method key (``velox/specs/<key>.toml`` is its spec, unless ``spec`` is given).
        state_type: the method's state record (a ``typing.NamedTuple``).
        init: ``init(batch, kv_heads, head_dim, *, dtype, <params>, backend)``.
        backends: ``{name: backend}``, each a :class:`velox.backend.Backend` record or an
            update function ``update(state, keys, values, queries)`` (a record offering
            nothing else), or a function of the method's spec returning that dict
            (``velox.evict.score_and_keep`` builds one).
        update: replaces the generated update (compositions do).
        get_kv, nbytes, positions, kv_slots, dims: replace the defaults above.
        error_bound: per-element bound ``(keys, values)`` on ``|get_kv - input|`` (lossy methods).
        layer_params: ``(n_layers, params) -> [params per layer]``: a static per-layer schedule.
        model_init, layer_update: cross-layer methods. ``model_init(per_layer_params)`` returns
            a model-level record; ``layer_update(record, layer, state, keys, values, *,
            queries=None) -> (record, state)`` is called for layers 0..L-1 in order within
            one forward, threading the record.
        attend: ``attend(state, queries, keys, values, *, scale, mask) -> out``: attention of
            ``queries [b, q, s, d]`` over the stored tokens plus ``s`` new ones, for methods
            whose attention is not plain attention over ``get_kv`` (sparse page selection,
            attention on packed quantized codes). ``mask`` is ``None`` or ``"causal"``.
            The method then also has ``attend_update(state, queries, keys, values, *, scale,
            mask=None) -> (out, state)``: ``attend``'s output and ``update``'s state (with
            ``queries``) of one step, checked as ``update`` checks its rows; what decoding
            loops and the mlx-lm adapter call.
        attend_update: a faster way to that pair for the steps it takes (a decode step's
            kernels that attend and update at once), returning None for the others; it
            gives ``update``'s state and ``attend``'s output (within the kernels' tolerance).
        calibrate: ``calibrate(state, arrays) -> state``: a fresh state with one layer's
            calibration arrays installed (``{name: np.ndarray}``, from an artifact fitted on a
            real model: ``velox.adapters.artifacts``).
        spec: a generated spec (compositions); default: the spec file of ``key``.
    """
    if key in _REGISTRY:
        raise ValueError(f"method {key!r} is already registered")
    if (model_init is None) != (layer_update is None):
        raise ValueError(f"{key}: model_init and layer_update come together")
    m = Method(key=key, state_type=state_type, init=_checked_init(key, init), update=update,
               get_kv=get_kv or _stored_kv, nbytes=nbytes or state_nbytes,
               positions=positions or _stored_positions, kv_slots=kv_slots,
               backends={}, error_bound=error_bound,
               dims=dims, layer_params=layer_params, model_init=model_init,
               layer_update=layer_update, attend=attend, calibrate=calibrate,
               spec_override=spec, extras=extras)
    _REGISTRY[key] = m
    _BY_STATE[state_type] = m
    try:
        _takes_heads(key, init, m.spec)  # the spec's heads and the init's signature agree
        given = backends(m.spec) if callable(backends) else dict(backends or {})
        m.backends.update({name: Backend.of(b) for name, b in given.items()})
        if "cuda" in m.backends and "metal" in m.spec.backends and "metal" not in m.backends:
            # the same kernel path; the kernels are built in the dialect of the process's GPU
            m.backends["metal"] = m.backends["cuda"]
        if "mlx" in m.backends and m.backends["mlx"].slots:  # rows in slots (velox.evict)
            m.get_kv = get_kv or _slot_kv
            m.positions = positions or _slot_positions
            m.kv_slots = kv_slots or _slot_kv_slots
            m.nbytes = nbytes or _slot_nbytes
        if m.spec.contract.get("ragged", False) and (update is not None or not all(
                b.ragged is not None for name, b in m.backends.items() if name not in ("cuda", "metal"))):
            if spec is None:
                raise ValueError(f"{key}: contract.ragged needs every backend to take valid counts "
                                 f"(its Backend record's ``ragged``: velox.evict.score_and_keep builds them)")
            # a generated spec (a composition's) inherits its policy's contract: its own
            # updates take no valid counts
            m.spec_override = dataclasses.replace(
                spec, contract={k: v for k, v in spec.contract.items() if k != "ragged"})
        if m.kv_slots is None:
            m.kv_slots = _default_kv_slots(m.get_kv)
        if update is None:
            m.update = _dispatching_update(m, init.__module__)
        if attend is not None:
            m.attend_update = _attend_update(m, attend_update)
        elif attend_update is not None:
            raise ValueError(f"{key}: attend_update needs attend")
        if m.attend is not None:
            m.attend = _heads_checked(m.attend)
        if not m.spec.contract.get("ragged", False):
            _take_row_states(m)
        _own_states_only(m)
        if spec is None and key in spec_keys():
            _document(m, init.__module__)
    except Exception:
        del _REGISTRY[key], _BY_STATE[state_type]
        raise
    return m


def _take_row_states(m: Method) -> None:
    """Let ``m``'s functions take ragged rows held as one state per row
    (``velox.ragged.RowStates``): ``get_kv``, ``positions``, ``kv_slots``, ``nbytes``, ``dims``
    and ``attend`` (the update handles them itself, :func:`_dispatching_update`)."""
    own = m.state_type

    def either(name: str, plain: Callable, rows: Callable) -> Callable:
        @functools.wraps(plain)
        def fn(state, *args, **kwargs):
            if type(state) is not own and _foreign(m, name, state, rows=True):
                return rows(plain, state, *args, **kwargs)
            return plain(state, *args, **kwargs)
        _CHECKS_STATE.add(fn)
        return fn

    m.get_kv = either("get_kv", m.get_kv, rg.rows_kv)
    m.positions = either("positions", m.positions, rg.rows_positions)
    m.kv_slots = either("kv_slots", m.kv_slots, rg.rows_kv_slots)
    m.nbytes = either("nbytes", m.nbytes, lambda f, rs: sum(f(r) for r in rs.rows))
    m.dims = either("dims", m.dims or _keys_dims, lambda f, rs: (len(rs.rows), *f(rs.rows[0])[1:]))
    if m.attend is not None:
        m.attend = either("attend", m.attend, rg.rows_attend)


def _foreign(m: Method, name: str, state: Any, rows: bool = False) -> bool:
    """Called where ``type(state)`` is not ``m``'s state type: True for ragged rows of ``m``
    (``velox.ragged.RowStates`` of ``m``'s states, where ``rows``: the caller takes them),
    False for an instance of a subclass of ``m``'s state type; anything else (another
    method's state, a composition's, a plain tuple) raises ``TypeError`` naming the function
    and the state type it takes."""
    own = m.state_type
    if isinstance(state, own):
        return False
    if rows and isinstance(state, RowStates) and state.rows and all(isinstance(r, own) for r in state.rows):
        return True
    what = type(state).__name__
    if isinstance(state, RowStates):
        inner = sorted({type(r).__name__ for r in state.rows}) or ["none"]
        what = f"RowStates of {', '.join(inner)}"
    owner = _BY_STATE.get(type(state))
    if owner is None and isinstance(state, RowStates) and state.rows:
        owner = _BY_STATE.get(type(state.rows[0]))
    if owner is not None and owner is not m:
        hint = (f"; it is the state of {owner.key!r}: use that method's functions, or velox.{name} "
                f"which dispatches on the state")
    elif owner is m:  # RowStates of a method that holds ragged rows in one state
        hint = f"; {m.key} holds ragged rows in one state (update's valid=, velox.ragged)"
    else:
        hint = ""
    rows_ok = " or velox.ragged.RowStates of them" if rows else ""
    raise TypeError(f"{m.key}.{name}: state must be a {own.__name__} (made by {m.key}'s init)"
                    f"{rows_ok}, got {what}{hint}")


# The functions that refuse another method's state themselves (built here): not wrapped again.
_CHECKS_STATE: weakref.WeakSet = weakref.WeakSet()

_STATE_FIRST = ("update", "get_kv", "nbytes", "positions", "kv_slots", "dims", "error_bound",
                "attend", "attend_update", "calibrate")
_STATE_ONLY = ("get_kv", "nbytes", "positions", "kv_slots", "dims", "error_bound")  # fn(state)


def _checked(m: Method, name: str, fn: Callable, at: int = 0) -> Callable:
    """``fn`` refusing (:func:`_foreign`) a state, its argument ``at``, that is not ``m``'s."""
    own = m.state_type

    if name in _STATE_ONLY:  # the common readers: no argument packing on the way
        @functools.wraps(fn)
        def checked(state):
            if type(state) is not own:
                _foreign(m, name, state)
            return fn(state)
    elif at == 0:
        @functools.wraps(fn)
        def checked(state, *args, **kwargs):
            if type(state) is not own:
                _foreign(m, name, state)
            return fn(state, *args, **kwargs)
    else:
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            state = args[at] if len(args) > at else kwargs.get("state")
            if type(state) is not own:
                _foreign(m, name, state)
            return fn(*args, **kwargs)
    _CHECKS_STATE.add(checked)
    return checked


def _heads_checked(attend: Callable) -> Callable:
    """``attend`` refusing queries whose head count is not a positive multiple of the kv
    heads (``velox.validate.check_query_heads``) before it runs."""
    from .validate import check_query_heads

    @functools.wraps(attend)
    def checked(state, queries, keys, values, **kwargs):
        check_query_heads(queries, keys)
        return attend(state, queries, keys, values, **kwargs)
    return checked


def _own_states_only(m: Method) -> None:
    """Make every function of ``m`` that takes a state refuse another method's: a
    ``TypeError`` at the call, before anything runs (one type comparison on the way in; the
    type of a state traced by ``mx.compile`` is its record's). Functions that check already
    (the generated update, those taking ragged rows) are left as they are."""
    for name in _STATE_FIRST:
        fn = getattr(m, name)
        if fn is not None and fn not in _CHECKS_STATE:
            setattr(m, name, _checked(m, name, fn))
    if m.layer_update is not None and m.layer_update not in _CHECKS_STATE:
        m.layer_update = _checked(m, "layer_update", m.layer_update, at=2)


def _takes_heads(key: str, body: Callable, spec: Spec) -> bool:
    """Whether ``body`` (an ``init``) takes the :class:`velox.distributed.Heads` record: its
    spec says ``heads = "mixed"`` and it has a ``heads`` parameter (or ``**params``, a
    composition's, which hands it on); a ``ValueError`` where the two disagree."""
    sig = inspect.signature(body).parameters
    named = "heads" in sig
    forwards = any(q.kind is q.VAR_KEYWORD for q in sig.values())
    mixed = spec.heads == "mixed"
    if mixed and not (named or forwards):
        raise ValueError(f"{key}: its spec says heads = 'mixed' but its init takes no heads= "
                         "(the velox.distributed.Heads record its reductions over kv heads use)")
    if named and not mixed:
        raise ValueError(f"{key}: its init takes heads= but its spec says heads = {spec.heads!r}")
    return mixed


def _checked_init(key: str, body: Callable) -> Callable:
    """``body`` behind the validation every ``init`` shares (see :func:`register`)."""
    from .backend import resolve_backend
    from .distributed import LOCAL, check_heads
    from .spec import validate_params
    from .validate import check_dims

    sig = inspect.signature(body)
    named = {"batch", "kv_heads", "head_dim", "dtype", "backend", "heads"}

    @functools.wraps(body)
    def init(*args: Any, heads: Any = LOCAL, **kwargs: Any) -> State:
        check_heads(heads)
        method = get_method(key)
        spec = method.spec
        extra = {}
        if _takes_heads(key, body, spec):
            extra["heads"] = heads
        elif heads.shards > 1 and spec.heads == "unshardable":
            raise ValueError(f"{key} cannot hold one shard of a layer's kv heads ({heads.shards} "
                             f"processes hold a tensor-parallel model's heads): {spec.heads_note}")
        given = dict(sig.bind(*args, **kwargs).arguments)
        for name in [n for n, q in sig.parameters.items() if q.kind is q.VAR_KEYWORD]:
            given.update(given.pop(name, {}))
        batch, kv_heads, head_dim = given["batch"], given["kv_heads"], given["head_dim"]
        dtype = given.get("dtype", sig.parameters["dtype"].default)
        check_dims(batch, kv_heads, head_dim, dtype)
        params = validate_params(spec, {k: v for k, v in given.items() if k not in named},
                                 dims=dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim))
        backend = resolve_backend(given.get("backend", "auto"), key, method.backends)
        return body(batch, kv_heads, head_dim, dtype=dtype, backend=backend, **extra, **params)

    return init


def _dispatching_update(m: Method, module: str) -> Callable:
    """The update every method shares: check the new rows, run the state's backend."""
    from .validate import check_update

    backends = m.backends
    ragged = bool(m.spec.contract.get("ragged", False))

    def dims(state):  # read at the call: _take_row_states wraps m.dims for RowStates
        return (m.dims or _keys_dims)(state)

    own = m.state_type

    def update(state: State, keys: mx.array, values: mx.array, *,
               queries: mx.array | None = None, valid: Any = None) -> State:
        if type(state) is not own:
            _foreign(m, "update", state, rows=not ragged)
        b, h, d, dtype = dims(state)
        check_update(keys, values, queries, batch=b, heads=h, head_dim=d, dtype=dtype)
        s = keys.shape[2]
        if ragged and (valid is not None or is_ragged(state)):
            v = _full(b, s) if valid is None else check_valid(valid, b, s, m.key)
            step = backends[state.backend].ragged or backends["mlx"].ragged  # cuda, metal: mlx ops
            return step(state, keys, values, queries, v)
        v = None if valid is None else check_valid(valid, b, s, m.key)
        if isinstance(state, RowStates) or (v is not None and (v != s).any()):
            rows = state if isinstance(state, RowStates) else split_rows(m, state)
            return rows_update(update, rows, keys, values, queries, _full(b, s) if v is None else v)
        return backends[state.backend].update(state, keys, values, queries)

    update.__module__, update.__qualname__ = module, "update"
    _CHECKS_STATE.add(update)
    rows = ("a state of ragged rows (``velox.ragged``): row ``i`` takes its first ``valid[i]`` "
            "tokens and evolves as that row alone" if ragged else
            "unequal counts make ragged rows, one batch-of-one state per row "
            "(``velox.ragged.RowStates``), row ``i`` taking its first ``valid[i]`` tokens "
            "and evolving as that row alone")
    update.__doc__ = (f"Absorb ``s`` new tokens ``keys, values [b, h, s, d]`` (``queries [b, q, "
                      f"s, d]``: their real queries, optional): {m.spec.summary}.\n\n"
                      f"``valid`` (optional, int ``[b]``): the real new tokens of each row, the "
                      f"real ones first; {rows}.\n\n"
                      f"Returns the new state; the state given is left as it was.")
    return update


def _attend_update(m: Method, fast: Callable | None) -> Callable:
    """``attend`` then ``update`` of one step, through ``fast`` where it takes the step."""
    from .validate import check_update

    own = m.state_type

    def attend_update(state: State, queries: mx.array, keys: mx.array, values: mx.array, *,
                      scale: float, mask: Any = None) -> tuple[mx.array, State]:
        if type(state) is not own:
            _foreign(m, "attend_update", state, rows=not m.spec.contract.get("ragged", False))
        if fast is not None and not isinstance(state, RowStates):
            b, h, d, dtype = (m.dims or _keys_dims)(state)
            check_update(keys, values, queries, batch=b, heads=h, head_dim=d, dtype=dtype)
            got = fast(state, queries, keys, values, scale=scale, mask=mask)
            if got is not None:
                return got
        return (m.attend(state, queries, keys, values, scale=scale, mask=mask),
                m.update(state, keys, values, queries=queries))

    attend_update.__qualname__ = "attend_update"
    _CHECKS_STATE.add(attend_update)
    attend_update.__doc__ = (f"{m.key}'s attention over its state plus ``s`` new tokens and the "
                             f"state that absorbs them: ``(attend(state, queries, keys, values, "
                             f"scale=scale, mask=mask), update(state, keys, values, queries="
                             f"queries))``, in one step where the method has a faster way.")
    return attend_update


def _full(b: int, s: int):
    import numpy as np
    return np.full(b, s, np.int64)


def _document(m: Method, module: str) -> None:
    """Append the spec's paper and deviations to the method module's docstring (they are
    written once, in the spec)."""
    mod = sys.modules.get(module)
    if mod is None or m.spec_override is not None:
        return
    spec, parts = m.spec, []
    if spec.title:
        where = ", ".join(x for x in (spec.venue, f"arXiv:{spec.arxiv}" if spec.arxiv else "") if x)
        who = f"{spec.authors}. " if spec.authors else ""
        parts.append("Reference:\n" + textwrap.fill(f"{who}{spec.title}. {where}.", 96,
                                                     initial_indent="    ", subsequent_indent="    ",
                                                     break_on_hyphens=False))
    if spec.deviations:
        parts.append("Deviations from the paper (the spec's ``deviations``):\n" + "\n".join(
            textwrap.fill(d, 96, initial_indent="    * ", subsequent_indent="      ",
                          break_on_hyphens=False, break_long_words=False)
            for d in spec.deviations))
    if parts:
        mod.__doc__ = (mod.__doc__ or "").rstrip() + "\n\n" + "\n\n".join(parts) + "\n"


def register_backend(key: str, backend: str, update: Backend | Callable) -> None:
    """Attach a backend of ``key`` (used by kernel modules): a :class:`velox.backend.Backend`
    record, or an update function (a record offering nothing else)."""
    get_method(key).backends[backend] = Backend.of(update)


def get_method(key: str) -> Method:
    """Return the registered method ``key``; unknown keys raise ``ValueError``."""
    try:
        return _REGISTRY[key]
    except KeyError:
        raise ValueError(f"unknown method {key!r}; registered: {', '.join(sorted(_REGISTRY))}") from None


def method_keys(*, wrappers: bool = False) -> tuple[str, ...]:
    """Keys of every registered method, sorted; methods made by ``velox.wrap`` (keys with
    ``@``: ``"tova@tail64"``) only with ``wrappers=True``."""
    return tuple(sorted(k for k in _REGISTRY if wrappers or "@" not in k))


def method_of(state: State) -> Method:
    """The method a state record belongs to."""
    try:
        if isinstance(state, RowStates):
            return method_of(state.rows[0])
        return _BY_STATE[type(state)]
    except (KeyError, IndexError):
        raise ValueError(f"{type(state).__name__} is not the state of a registered method") from None

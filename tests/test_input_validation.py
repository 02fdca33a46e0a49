"""Input the API must refuse at the call that receives it, with a message naming the argument:
another method's state, queries without heads, ``valid`` counts that are not integers,
parameters beyond their natural range, a budget given twice on the command line."""

import mlx.core as mx
import numpy as np
import pytest

import velox
from velox.ragged import RowStates
from velox.registry import get_method, method_keys
from velox.testing import test_params

KEYS = method_keys()
D = 32  # every method takes head_dim 32 at its defaults


def _state(key):
    return get_method(key).init(1, 2, D, **test_params(key))


def _rows(n=3):
    return mx.zeros((1, 2, n, D))


# --- a state belongs to one method ------------------------------------------------------

def _calls(m, state):
    """Every function of ``m`` that takes a state, called on ``state``."""
    k = _rows()
    q = mx.zeros((1, 2, 3, D))
    out = [("update", lambda: m.update(state, k, k)), ("get_kv", lambda: m.get_kv(state)),
           ("nbytes", lambda: m.nbytes(state)), ("positions", lambda: m.positions(state)),
           ("kv_slots", lambda: m.kv_slots(state))]
    if m.error_bound is not None:
        out.append(("error_bound", lambda: m.error_bound(state)))
    if m.attend is not None:
        out.append(("attend", lambda: m.attend(state, q, k, k, scale=0.1)))
        out.append(("attend_update", lambda: m.attend_update(state, q, k, k, scale=0.1)))
    return out


def test_every_method_refuses_every_other_methods_state():
    states = {key: _state(key) for key in KEYS}
    accepted = []
    for key in KEYS:
        m = get_method(key)
        for other in KEYS:
            if other == key:
                continue
            for name, call in _calls(m, states[other]):
                try:
                    call()
                except TypeError as e:
                    msg = str(e)
                    assert f"{key}.{name}" in msg and m.state_type.__name__ in msg, msg
                    assert type(states[other]).__name__ in msg and repr(other) in msg, msg
                else:
                    accepted.append((key, name, other))
    assert not accepted, f"{len(accepted)} calls took another method's state: {accepted[:10]}"


@pytest.mark.parametrize("key", KEYS)
def test_own_state_still_taken(key):
    m = get_method(key)
    state = _state(key)
    for name, call in _calls(m, state):
        if name == "update":
            state = call()
            assert type(state) is m.state_type
        else:
            call()
    assert velox.nbytes(state) == m.nbytes(state)


def test_module_functions_and_plain_tuples_refused():
    tova, kivi = velox.tova.init(1, 2, D, budget=8), velox.kivi.init(1, 2, D)
    k = _rows(1)
    with pytest.raises(TypeError, match=r"tova\.update: state must be a TovaState.*KiviState"):
        velox.tova.update(kivi, k, k)
    with pytest.raises(TypeError, match=r"kivi\.get_kv: state must be a KiviState.*TovaState"):
        velox.kivi.get_kv(tova)
    with pytest.raises(TypeError, match=r"tova\.nbytes.*got tuple"):
        velox.tova.nbytes(tuple(tova))
    with pytest.raises(TypeError, match=r"tova\+affine\.get_kv.*TovaState"):
        get_method("tova+affine").get_kv(tova)
    # the generic functions dispatch on the state and take either
    velox.update(kivi, k, k), velox.update(tova, k, k)


def test_ragged_rows_of_the_method_only():
    kivi, tova = velox.kivi.init(1, 2, D), velox.tova.init(1, 2, D, budget=8)
    rows = RowStates((kivi, kivi))
    assert velox.kivi.nbytes(rows) == 2 * velox.kivi.nbytes(kivi)
    with pytest.raises(TypeError, match=r"kivi\.nbytes.*RowStates of TovaState"):
        velox.kivi.nbytes(RowStates((tova,)))
    with pytest.raises(TypeError, match="holds ragged rows in one state"):
        velox.tova.get_kv(RowStates((tova,)))  # TOVA holds ragged rows in one state of slots


def test_compiled_update_checks_the_state_too():
    k = _rows(1)
    step = mx.compile(lambda s, k, v: velox.tova.update(s, k, v))
    state = step(velox.tova.init(1, 2, D, budget=8), k, k)
    assert type(state) is velox.tova.State
    with pytest.raises(TypeError, match="TovaState"):
        step(velox.h2o.init(1, 2, D, budget=32), k, k)


# --- queries have heads ------------------------------------------------------------------

@pytest.mark.parametrize("key", KEYS)
def test_queries_need_a_positive_multiple_of_the_kv_heads(key, no_shape_checks):
    m = get_method(key)
    state = _state(key)
    k = _rows()
    for hq in (0, 3):
        q = mx.zeros((1, hq, 3, D))
        with pytest.raises(ValueError, match=f"queries have {hq} heads, not a positive multiple of the 2 kv heads"):
            m.update(state, k, k, queries=q)
        if m.attend is not None:
            with pytest.raises(ValueError, match=f"queries have {hq} heads"):
                m.attend(state, q, k, k, scale=0.1)
            with pytest.raises(ValueError, match=f"queries have {hq} heads"):
                m.attend_update(state, q, k, k, scale=0.1)
    if m.attend is not None:
        with pytest.raises(ValueError, match=r"queries must be an mx.array of rank 4"):
            m.attend(state, mx.zeros((2, 3, D)), k, k, scale=0.1)


# --- valid counts are integers ------------------------------------------------------------

BAD_VALID = [
    (mx.array([2.7, 3.0]), "an array of dtype float32"),
    (mx.array([True, True]), "an array of dtype bool"),
    (mx.array([3, 1], mx.float16), "an array of dtype float16"),
    (np.array([2.0, 3.0]), "dtype float64"),
    (np.array([True, False]), "dtype bool"),
    ([1, True], "a list of bool, int"),
    ([2.0, 3], "a list of float, int"),
    ((3, 1.5), "a tuple of float, int"),
]


@pytest.mark.parametrize("key", ["tova", "kivi", "streaming_llm", "turboquant_mse"])
@pytest.mark.parametrize("valid,got", BAD_VALID, ids=[repr(g) for _, g in BAD_VALID])
def test_valid_must_hold_integers(key, valid, got):
    """A ragged method (slots) and one held as one state per row refuse the same way."""
    state = velox.init(key, 2, 2, D)
    k = mx.zeros((2, 2, 3, D))
    with pytest.raises(ValueError, match=rf"{key}: valid must be an integer array \[batch=2\].*got {got}"):
        velox.update(state, k, k, valid=valid)


@pytest.mark.parametrize("valid", [mx.array([3, 1]), mx.array([3, 1], mx.uint8), np.array([3, 1], np.int16),
                                   [3, 1], (3, np.int64(1))])
def test_integer_valid_taken(valid):
    k = mx.zeros((2, 2, 3, D))
    for key in ("tova", "kivi"):
        state = velox.update(velox.init(key, 2, 2, D), k, k, valid=valid)
        assert velox.positions(state).shape[2] == 3


# --- a budget is given once on the command line ---------------------------------------------

TWICE = [
    ["generate", "--method", "tova", "--param", "budget=64", "--budget", "128", "hi"],
    ["generate", "--method", "tova", "--param", "budget=128", "--budget", "128", "hi"],
    ["generate", "--method", "streaming_llm", "--param", "window_size=60", "--budget", "64", "hi"],
    ["serve", "--method", "tova", "--param", "budget=64", "--budget", "128"],
    ["serve", "--method", "streaming_llm", "--budget", "64", "--param", "window_size=60"],
    ["compare", "--methods", "tova,kivi", "--budgets", "128", "--param", "budget=64"],
    ["compare", "--methods", "tova,streaming_llm", "--budgets", "64,128", "--param", "tova.budget=64"],
    ["compare", "--methods", "streaming_llm", "--budgets", "64", "--param", "window_size=60"],
]


@pytest.mark.parametrize("argv", TWICE, ids=[" ".join(a[:1] + a[2:-1]) for a in TWICE])
def test_budget_given_twice_is_refused(capsys, argv):
    from velox.adapters import cli, serve

    if argv[0] == "serve":  # its flags alone (cli.main would start the server)
        with pytest.raises(ValueError) as e:
            serve.parse_args(argv[1:])
        line = str(e.value)
    else:
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        line = " ".join(err.split())
        assert out == "" and "Traceback" not in err
    assert "the budget is given twice" in line and "give one of them" in line, err
    flag = argv.index("--budget" if "--budget" in argv else "--budgets")
    param = argv[argv.index("--param") + 1].split(".")[-1]
    assert argv[flag + 1] in line and param in line, line  # both values, named


def test_budget_params_refuses_the_parameter_it_would_set():
    from velox.adapters import cli

    with pytest.raises(ValueError, match=r"tova: the budget is given twice, as a budget of 128 tokens and as budget=64"):
        cli.budget_params("tova", 128, {"budget": 64})
    with pytest.raises(ValueError, match=r"window_size=60"):
        cli.budget_params("streaming_llm", 64, {"window_size": 60})
    assert cli.budget_params("tova", 128, {"n_sink": 2}) == {"budget": 128}
    assert cli.budget_params("streaming_llm", 64, {"n_sink": 2}) == {"window_size": 62}
    assert cli.budget_params("kivi", 64, {"bits": 4}) is None


def test_compare_without_budgets_takes_a_methods_own_budget():
    from velox.adapters import cli

    args = cli._parser().parse_args(["compare", "--methods", "tova,streaming_llm", "--param", "tova.budget=100"])
    assert args.budgets is None  # the default budgets apply to the methods without their own
    assert cli.method_configs(["tova", "streaming_llm"], list(cli.DEFAULT_BUDGETS), ["tova.budget=100"]) == [
        ("tova", {"budget": 100}), ("streaming_llm", {"window_size": 60}), ("streaming_llm", {"window_size": 252})]


# --- every count has a range ---------------------------------------------------------------

INT32_MAX = 2**31 - 1
# floats with no natural upper bound (finite is required of every float parameter)
UNBOUNDED_FLOATS = {("amc", "gamma"), ("amc", "calib_variance"), ("keyformer", "tau_init"),
                    ("keyformer", "tau_end"), ("nestedkv", "beta"), ("nestedkv", "kappa"),
                    ("pyramidkv", "beta")}


@pytest.mark.parametrize("key", KEYS)
def test_every_number_parameter_has_an_upper_bound(key):
    spec = get_method(key).spec
    policy = key.split("+")[0]
    for name, p in spec.params.items():
        if p.type == "int":
            limit = 2**32 - 1 if name == "seed" else INT32_MAX
            assert p.max is not None and p.max <= limit, f"{key}.{name}: max {p.max}"
            drawn = p.test_max if p.test_max is not None else max(p.test_choices, default=None)
            assert drawn is not None and drawn <= p.max, f"{key}.{name}: draws up to its max"
        elif p.type == "float" and (policy, name) not in UNBOUNDED_FLOATS:
            assert p.max is not None, f"{key}.{name} has no max"


@pytest.mark.parametrize("key,name,value,message", [
    ("kvquant", "lloyd_iters", 10**6, "lloyd_iters=1000000 is out of range: must be <= 100"),
    ("qjl", "jl_dim", 10**9, "jl_dim=1000000000 is out of range: must be <= 65536"),
    ("turboquant_prod", "jl_dim", 2**31, "jl_dim=2147483648 is out of range: must be <= 65536"),
    ("spectral", "jl_dim", 2**40, "jl_dim=1099511627776 is out of range: must be <= 65536"),
    ("chunkkv", "chunk_size", 2**64, "chunk_size=18446744073709551616 is out of range: must be <= 2147483647"),
    ("rocketkv", "page_size", 2**63, "page_size=9223372036854775808 is out of range: must be <= 2147483647"),
    ("qfilters", "calib_tokens", 2**64, "calib_tokens=18446744073709551616 is out of range: must be <= 2147483647"),
    ("rocketkv", "compression_ratio", 1e300, "compression_ratio=1e+300 is out of range: must be <= 2147483647"),
    ("tova", "budget", 2**31, "budget=2147483648 is out of range: must be <= 2147483647"),
    ("polar", "seed", 2**32, "seed=4294967296 is out of range: must be <= 4294967295"),
])
def test_huge_parameters_fail_at_init(key, name, value, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        velox.init(key, 1, 2, D, **{name: value})


def test_bounds_at_their_max_still_run():
    k = mx.zeros((1, 2, 5, D))
    for key, params in [("kvquant", dict(lloyd_iters=100)), ("qjl", dict(jl_dim=64)),
                        ("tova", dict(budget=INT32_MAX, n_sink=INT32_MAX - 1)),
                        ("rocketkv", dict(page_size=INT32_MAX, compression_ratio=float(INT32_MAX)))]:
        state = velox.update(velox.init(key, 1, 2, D, **params), k, k)
        mx.eval(velox.get_kv(state))


def test_eval_refuses_a_budget_parameter_it_sets_itself():
    """``velox eval`` sets each method's budget from its levels: a ``--param budget=...`` is
    refused naming that, not as a budget "given twice" with a value nobody gave."""
    from velox.adapters import suite
    with pytest.raises(ValueError, match=r"tova: --param budget=64 sets the budget, which this run sets itself"):
        suite.configs(["tova"], budgets=[128], params=["budget=64"])
    with pytest.raises(ValueError, match=r"streaming_llm: --param window_size=60 sets the budget"):
        suite.configs(["streaming_llm"], ratios=[0.5], params=["window_size=60"])
    assert suite.configs(["tova"], budgets=[128], params=["n_sink=2"])[0]["given"] == {"n_sink": 2}

"""`f.explain(*args)`: the route it names is the route the call then takes, and it runs nothing."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall

from .conftest import FAST_PATH, assert_trees_equal, served


class ListNet(eqx.Module):
    layers: list

    def __init__(self, key):
        self.layers = [eqx.nn.Linear(4, 4, key=key)]

    def __call__(self, x):
        return self.layers[0](x)


class WithConfig(nnx.Module):
    def __init__(self, tags=True):
        # a mutable static attribute: watched by a guard, but a set inside: re-read every call
        self.config = {"scale": 2, "tags": {"a"}} if tags else {"scale": 2}
        self.w = nnx.Param(jnp.ones(4))

    def __call__(self, x):
        return self.w[...] * x * self.config["scale"]


X = jnp.ones(4)


def _scenarios():
    yield "eqx list model", lambda: ListNet(jax.random.PRNGKey(0)), (X,), {}
    yield "new eqx model each call", lambda: ListNet(jax.random.PRNGKey(0)), (X,), {"new": True}
    yield "new params dict each call", lambda: {"w": jnp.ones(4)}, (X,), {"new": True}
    yield "params dict", lambda: {"w": jnp.ones(4)}, (X,), {}
    yield "nnx module", lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)), (X,), {}
    yield "nnx mutable static", WithConfig, (X,), {}
    yield "nnx config dict", lambda: WithConfig(tags=False), (X,), {}  # (guarded: the fast path)
    yield "keyword argument", lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)), (), {"x": X}
    yield "scalar second argument", lambda: {"w": jnp.ones(4)}, (2.0,), {}  # (traced: passed as is)
    yield "numpy second argument", lambda: {"w": jnp.ones(4)}, (np.ones(4, np.float32),), {}


def _call(m, x):
    return m["w"] * x if isinstance(m, dict) else m(x)


@pytest.mark.parametrize("name, make, rest, kwargs", list(_scenarios()), ids=[s[0] for s in _scenarios()])
def test_explain_names_the_route_the_call_takes(name, make, rest, kwargs, hot_path):
    new = kwargs.pop("new", False)
    obj = make()
    f = fastcall.jit(_call)
    for _ in range(4):
        if new:
            obj = make()
        report = f.explain(obj, *rest, **kwargs)
        before = f.stats()
        assert f.stats() == before  # explaining ran nothing
        _, route = served(f, obj, *rest, **kwargs)
        assert ROUTE[route] == report.route, (name, str(report))
        assert bool(report.reasons) == (report.route == "general")
        assert [a.name for a in report.arguments] == ["m", *(["x"] if rest else []), *kwargs]
    if name == "nnx mutable static":
        assert report.route == "general"
    elif name == "keyword argument":  # (the structure path: its keyword names as the record's)
        assert report.route == "structure"
    elif new:
        assert report.route == "structure"
        assert report.arguments[0].kind == "a new object of a structure this function has run"
    else:
        assert report.route == "fast"


ROUTE = {
    "c_fast": "fast", "python_fast": "fast", "c_structure": "structure", "python_structure": "structure",
    "general": "general",
}


def test_explain_says_why():
    f = fastcall.jit(_call)
    m = WithConfig()
    f(m, X)
    text = str(f.explain(m, X))
    assert "mutable static attribute" in text and "route: general" in text
    assert "config holds a set" in text and "keep hashable values there" in text  # (where, and what to do)


def test_explain_names_the_static_attribute_no_guard_can_watch_at_any_depth():
    """The attribute that keeps a model off the fast path is named by its path in the graph,
    with the part no guard can watch (a set inside a dict of a submodule, a set in a list
    in a tuple); hashable parts and watchable containers are not named."""

    class Outer(nnx.Module):
        def __init__(self):
            self.inner = WithConfig()
            self.fine = {"sizes": [1, 2], "name": ("a", "b")}
            self.hooks = ("a", [{"b"}])

        def __call__(self, x):
            return self.inner(x)

    f = fastcall.jit(_call)
    m = Outer()
    assert_trees_equal(f(m, X), nnx.jit(_call)(Outer(), X))
    text = str(f.explain(m, X))
    assert "inner.config holds a set" in text and "hooks holds a set" in text, text
    assert "fine" not in text, text
    text = str(f.explain(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), x=X))
    assert "keyword arguments (x)" in text


def test_explain_says_a_model_nnx_rebuilt_is_checked_not_read_again(hot_path):
    """After nnx.jit ran on the same model (rebuilding its nodes in place), explain says the
    model is compared with its last read and that the fast path serves the call, changing
    nothing (the call that follows is still served after the check)."""
    m = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    f, on_m = fastcall.jit(_call), nnx.jit(_call)
    for _ in range(2):
        f(m, X), on_m(m, X)
    report = f.explain(m, X)
    assert report.route == "fast"
    assert report.arguments[0].kind.startswith("NNX object rebuilt in place by NNX")
    assert "compared with the last read" in report.arguments[0].per_call
    _, route = served(f, m, X)
    assert route == FAST_PATH[hot_path]


def test_explain_promises_no_plan_a_call_of_this_form_cannot_make():
    """`f(model, v, v, x)`, a module and one Variable passed twice, takes the general path
    every call (the second is a reference to the first, which has no cache entry to pin);
    the model is cached, but a plan in the fast index is only filed by a call
    `f(model, *arrays)`, and explain says that rather than "filed after a call"."""
    m = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    v = nnx.Param(jnp.ones(4))
    f = fastcall.jit(lambda m, v, w, x: m(x) * v[...] * w[...])
    for _ in range(3):
        _, route = served(f, m, v, v, X)
    report = f.explain(m, v, v, X)
    assert route == "general" and report.route == "general"
    text = str(report)
    assert "filed after a call" not in text
    assert "one is filed only by a call f(m, *arrays)" in text


def test_explain_says_a_new_state_of_a_known_structure_is_read_as_a_pytree():
    """A new nnx.State each call (the functional training loop): explain says it is read by
    its pytree flatten once its structure has been read, and that the first is not yet."""
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(model)
    f = fastcall.jit(lambda graphdef, state, x: nnx.merge(graphdef, state)(x))
    assert f.explain(graphdef, nnx.state(model), X).arguments[1].kind == "NNX object, not read yet"
    f(graphdef, nnx.state(model), X)
    state = f.explain(graphdef, nnx.state(model), X).arguments[1]
    assert state.kind == "nnx.State of Variables only, new, of a structure read before"
    assert "pytree flatten" in state.per_call


def test_explain_says_why_the_structure_path_declines_a_call(monkeypatch):
    """Where the record of a call's shape does not serve it, explain names the argument and
    why (the structure path's own reading, asked why), and does not describe that argument
    by the record's read: a Variable of its own passed where the recorded call passed the
    module's, and the module's where the record reads a Variable of its own. (One record
    kept per key, so that the second form's record replaces the first's; with several kept,
    explain gives the reasons of the newest.)"""
    from fastcall import _plan

    monkeypatch.setattr(_plan, "PLANS_PER_KEY", 1)
    m = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    offset = nnx.Param(jnp.ones(4))
    f = fastcall.jit(lambda m, v, x: m(x) + v[...])
    assert f.explain(m, offset, X).reasons[-1].startswith("not structure: no plan for calls whose first argument")
    for _ in range(3):
        _, route = served(f, m, offset, X)
    assert route.endswith("structure")
    report = f.explain(m, m.bias, X)  # (the record reads v on its own: m holds this one)
    assert report.route == "general"
    assert report.reasons[-1].startswith("not structure: the call: its NNX arguments share Variables")
    for _ in range(3):
        _, route = served(f, m, m.bias, X)  # (now recorded: read jointly)
    assert route.endswith("structure")
    report = f.explain(m, offset, X)
    assert report.route == "general", str(report)
    assert report.reasons[-1] == (
        "not structure: v: the recorded call passed the Variable that argument 0 holds at one place; this is another"
    )
    assert "held by an earlier argument" not in report.arguments[1].kind
    _, route = served(f, m, offset, X)
    assert route == "general"  # (which records this form again)
    assert f.explain(m, offset, X).route == "structure"


def test_explain_names_every_path_to_what_no_guard_can_watch():
    """A set shared by two attributes is named at both (fixing one leaves the other); one in
    a data list is named by its index; a Variable whose metadata cannot be hashed is named
    as such, not as a static attribute."""

    class Shared(nnx.Module):
        def __init__(self):
            tags = {"a"}
            self.first, self.second = tags, tags
            self.items = nnx.data([{"b"}, jnp.ones(4)])
            self.w = nnx.Param(jnp.ones(4), labels=["x"])

        def __call__(self, x):
            return self.w[...] * x + self.items[1]

    f = fastcall.jit(_call)
    m, twin = Shared(), Shared()
    for _ in range(2):  # (an object holding plain lists is watched from its second call)
        assert_trees_equal(f(m, X), nnx.jit(_call)(twin, X))
    text = str(f.explain(m, X))
    for named in ("first holds a set", "second holds a set", "items.0 holds a set", "w has metadata that cannot be hashed"):
        assert named in text, (named, text)


def test_explain_says_a_pytree_of_variables_beside_arrays_is_read_by_its_flatten(hot_path):
    """A pytree holding Variables beside an array (flax's TrainState with `nnx.split`'s
    States): explain names how the general path reads it, then how the structure path does,
    counting its Variables; and, once a Variable's metadata changed, that the record
    declines, as the call then shows."""
    from .test_nnx_containers import X as X2
    from .test_nnx_containers import _holder, scaled

    f = fastcall.jit(scaled)
    h = _holder()
    first = f.explain(h, X2)
    assert first.arguments[0].kind == "Holder holding NNX objects beside other leaves"
    assert "each NNX object read as if passed on its own" in first.arguments[0].per_call
    f(h, X2)
    report = f.explain(h, X2)
    _, route = served(f, h, X2)
    assert report.route == "structure" == ROUTE[route]
    assert report.arguments[0].kind.endswith("of a tree structure this function has run")
    assert "2 Variables' types, metadata and values read" in report.arguments[0].per_call
    h.w.set_metadata("tag", "changed")
    report = f.explain(h, X2)
    _, route = served(f, h, X2)
    assert report.route == "general" == route
    assert report.reasons[-1] == (
        "not structure: h: not a pytree of the structure, static values and NNX objects the recorded call passed"
    )


def test_explain_names_the_first_argument_with_its_article():
    f = fastcall.jit(lambda x, m: m(x))
    text = str(f.explain(X, nnx.Linear(4, 4, rngs=nnx.Rngs(0))))
    assert "whose first argument is an ArrayImpl" in text and "a ArrayImpl" not in text


def test_explain_says_a_static_argument_is_static():
    def fwd(x, scale):
        return x * scale

    g = fastcall.jit(fwd, static_argnames="scale")
    for call in (lambda: g.explain(X, scale=4.0), lambda: g.explain(X, 4.0)):
        scale = next(a for a in call().arguments if a.name == "scale")
        assert "static (static_argnums/static_argnames)" in scale.kind, scale
    g(X, scale=4.0)
    assert g(X, scale=5.0).tolist() == [5.0] * 4 and g.stats().compiles == 2  # (as explain says: static)
    h = fastcall.jit(fwd)  # (not marked: traced, as the call does)
    assert "traced" in next(a for a in h.explain(X, 4.0).arguments if a.name == "scale").kind


def test_partial_lower_and_explain_take_what_a_call_takes(hot_path):
    m = ListNet(jax.random.PRNGKey(0))
    p = fastcall.partial(_call, m)
    for _ in range(3):
        p(X)
    report = p.explain(X)
    assert [a.name for a in report.arguments] == ["m", "x"]
    _, route = served(p, X)
    assert ROUTE[route] == report.route == "fast"
    compiled = p.lower(X).compile()
    assert_trees_equal(compiled(X), m(X))
    assert_trees_equal(compiled(X), p(X))


def test_lowered_and_compiled_list_what_they_forward():
    f = fastcall.jit(lambda x: x * 2)
    lowered = f.lower(X)
    compiled = lowered.compile()
    for name in ("as_text", "compile", "cost_analysis", "in_avals", "compiler_ir"):
        assert name in dir(lowered) and (name == "compile" or getattr(lowered, name) is not None)
    for name in ("as_text", "cost_analysis", "memory_analysis"):
        assert name in dir(compiled)
        getattr(compiled, name)


def test_a_partial_of_a_partial_binds_both():
    def f(a, b, x):
        return a * 100 + b * 10 + x

    a, b, x = jnp.ones(()), jnp.full((), 2.0), jnp.full((), 3.0)
    pp = fastcall.partial(fastcall.partial(f, a), b)
    assert float(pp(x)) == 123.0
    assert float(pp.lower(x).compile()(x)) == 123.0
    assert [arg.name for arg in pp.explain(x).arguments] == ["a", "b", "x"]


def test_explain_says_which_containers_are_read_every_call_and_why():
    """A list passed after the first argument is not held (flattened every call, and why); a
    tuple cannot be weakly referenced; a list passed first is held once passed again."""
    f = fastcall.jit(lambda x, p: jax.tree_util.tree_map(lambda v: v * x, p))
    x = jnp.ones(2)
    listed = f.explain(x, [x, x]).arguments[1]
    assert listed.kind == "list (not held)"
    assert "flattened every call" in listed.per_call and "held only when passed first" in listed.per_call
    tupled = f.explain(x, (x, x)).arguments[1]
    assert tupled.kind == "tuple (cannot be weakly referenced)" and tupled.per_call == "flattened every call"
    g = fastcall.jit(lambda p, x: jax.tree_util.tree_map(lambda v: v * x, p))
    first = g.explain([x, x], x).arguments[0]
    assert first.kind == "top-level list, not yet held"
    assert first.per_call == "held for the fast path once passed first in two consecutive calls"
    assert f.stats().calls == 0 and g.stats().calls == 0  # (explaining calls nothing)

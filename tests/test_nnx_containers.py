"""NNX objects anywhere inside argument pytrees, against nnx.jit (the oracle) and eager code.

Modules, Variables, nnx.Optimizer and nnx.Rngs inside tuples, lists, dicts, nnx.State,
registered dataclasses, nested, positional or keyword: one shared reference index across
all arguments (an object at two positions is one object inside), values read at call
time, changed Variables written back to the caller's objects, graph updates applied to the
caller's objects wherever they sit, NNX objects returned as the caller's own objects, and
no more traces than nnx.jit.

Each check runs the same function under fastcall.jit, nnx.jit and (where meaningful)
eagerly, on twin argument structures built identically, and compares after every call:
the outputs (an NNX object in an output is named by where it sits among the caller's
objects, so `out is model` under nnx.jit must hold under fastcall too), the structure
of all the caller's objects (nnx.graphdef: types, static attributes, sharing) and their
state (every Variable value).

Property tests use the profiles of test_properties.py (FASTCALL_HYPOTHESIS=ci, the
default, or thorough).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastcall
from fastcall import _plan

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, reads_in, served, state_of
from .models import TinyDecoder

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("FASTCALL_HYPOTHESIS", "ci"))

pytestmark = pytest.mark.usefixtures("hot_path")

NODES = (nnx.Pytree, nnx.Variable)  # Modules, Optimizer, Rngs, ...; Variables

# (older flax: nnx.jit has no graph_updates argument, and there is no nnx.with_vars)
HAS_GRAPH_UPDATES = "graph_updates" in inspect.signature(nnx.jit).parameters


def _needs_options(options: dict) -> None:
    if "graph_updates" in options and not HAS_GRAPH_UPDATES:
        pytest.skip("this flax's nnx.jit has no graph_updates argument")


# ---- comparison machinery ----


@dataclasses.dataclass
class World:
    """One twin: the arguments of a call and any more of the caller's objects to compare
    (e.g. the model behind an nnx.split state)."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    keep: tuple = ()

    def roots(self) -> Any:
        return (self.args, self.kwargs, self.keep)


def canon(out: Any, world: World) -> Any:
    """`out` with each NNX object replaced by where it sits among the caller's objects
    (its path in nnx.iter_graph over the world), or, for an object created inside, by
    its type and state."""
    where = {id(node): path for path, node in nnx.iter_graph(world.roots()) if isinstance(node, NODES)}

    def name(x: Any) -> Any:
        if not isinstance(x, NODES):
            return x
        if id(x) in where:
            return ("caller's", where[id(x)])
        if isinstance(x, nnx.Variable):
            return ("new", type(x).__name__, x.get_raw_value())
        return ("new", type(x).__name__, state_of(x))

    return jax.tree_util.tree_map(name, out, is_leaf=lambda x: isinstance(x, NODES))


def assert_close(a: Any, b: Any, tol: float = 1e-5) -> None:
    """Like assert_trees_equal, with a tolerance for eager against compiled code."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"structure differs:\n{ta}\n{tb}"
    for x, y in zip(la, lb):
        if isinstance(x, (jax.Array, np.ndarray)) or isinstance(y, (jax.Array, np.ndarray)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)
        else:
            assert type(x) is type(y) and x == y, (x, y)


def assert_same_world(a: World, b: World, *, tol: float | None = None) -> None:
    """Same structure (types, static attributes, which objects are shared) and state."""
    assert nnx.graphdef(a.roots()) == nnx.graphdef(b.roots()), "the caller's objects differ in structure"
    if tol is None:
        assert_trees_equal(state_of(a.roots()), state_of(b.roots()))
    else:
        assert_close(state_of(a.roots()), state_of(b.roots()), tol)


def compare(
    fn: Callable,
    make: Callable[[], World],
    data: list[tuple],
    *,
    eager: bool = True,
    mutate: Callable[[World, int], None] | None = None,
    check: Callable[[dict[str, World], int], None] | None = None,
    **jit_kwargs: Any,
) -> tuple[dict[str, World], dict[str, int]]:
    """Call fn(*world.args, *data[i], **world.kwargs) for each i under fastcall.jit and
    nnx.jit (and eagerly), each on its own twin world from make(); mutate(world, i) runs on
    every twin before call i, check(worlds, i) after it. Returns the worlds and the number
    of traces of each compiled runner; fastcall may not trace more often than nnx.jit."""
    traces = {"fastcall": 0, "nnx.jit": 0}

    def counted(who: str) -> Callable:
        def traced(*args, **kwargs):
            traces[who] += 1
            return fn(*args, **kwargs)

        return traced

    runners = {
        "fastcall": fastcall.jit(counted("fastcall"), **jit_kwargs),
        "nnx.jit": nnx.jit(counted("nnx.jit"), **jit_kwargs),
    }
    if eager:
        runners["eager"] = fn
    worlds = {who: make() for who in runners}
    for i, extra in enumerate(data):
        outs = {}
        for who, run in runners.items():
            w = worlds[who]
            if mutate is not None:
                mutate(w, i)
            outs[who] = canon(run(*w.args, *extra, **w.kwargs), w)
        assert_trees_equal(outs["fastcall"], outs["nnx.jit"])
        assert_same_world(worlds["fastcall"], worlds["nnx.jit"])
        if eager:
            assert_close(outs["eager"], outs["nnx.jit"])
            assert_same_world(worlds["eager"], worlds["nnx.jit"], tol=1e-5)
        if check is not None:
            check(worlds, i)
    assert traces["fastcall"] <= traces["nnx.jit"], traces
    return worlds, traces


# ---- models ----


class Counted(nnx.Module):
    """A Linear that counts its calls (BatchStat) and accumulates its outputs (Cache)."""

    def __init__(self, din: int, dout: int, seed: int):
        self.linear = nnx.Linear(din, dout, rngs=nnx.Rngs(seed))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.cache = nnx.Cache(jnp.zeros(dout))

    def __call__(self, x):
        self.count[...] += 1
        y = self.linear(x) + 0.1 * self.count[...]
        self.cache[...] = self.cache[...] + jnp.sum(y, axis=0)
        return y


class Norm(nnx.Module):
    """Linear, BatchNorm, Dropout: statistics and an RNG count written back; eval()/train()."""

    def __init__(self, din: int, dout: int, seed: int):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.linear(x)))


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
XS = [(X,), (X * 2.0,), (X - 0.5,)]


def encode_decode(pair, x):
    encoder, decoder = pair
    return decoder(encoder(x))


# ---- regression tests: one container shape each ----


def test_tuple_of_modules():
    worlds, _ = compare(encode_decode, lambda: World(((Counted(4, 3, 0), Counted(3, 4, 1)),)), XS)
    encoder, decoder = worlds["fastcall"].args[0]
    assert int(encoder.count[...]) == int(decoder.count[...]) == 3


def test_tuple_of_modules_with_values_changed_outside_between_calls():
    def mutate(w: World, i: int) -> None:
        encoder, decoder = w.args[0]
        encoder.linear.bias[...] = jnp.full(3, 0.5 * i)  # read at call time
        decoder.bn.mean[...] += 1.0

    compare(encode_decode, lambda: World(((Counted(4, 3, 0), Norm(3, 4, 1)),)), XS, mutate=mutate)


def test_same_module_twice_in_a_list_is_one_module_inside():
    seen = []

    def fn(ms, x):
        seen.append(ms[0] is ms[1])
        ms[0].count[...] += 10  # applies once, seen through ms[1]
        return ms[0](x) + ms[1](x), ms[1].count[...]

    def check(worlds: dict[str, World], i: int) -> None:
        (ms,) = worlds["fastcall"].args
        assert ms[0] is ms[1]
        assert int(ms[0].count[...]) == 12 * (i + 1)

    def make() -> World:
        m = Counted(4, 4, 0)
        return World(([m, m],))

    compare(fn, make, XS, check=check)
    assert seen and all(seen)


def test_dict_of_modules():
    def fn(d, x):
        return d["dec"](d["enc"](x))

    def mutate(w: World, i: int) -> None:
        if i == 1:  # replace a submodule outside: a new object of the same structure
            w.args[0]["enc"].linear = nnx.Linear(4, 3, rngs=nnx.Rngs(9))

    compare(fn, lambda: World(({"enc": Counted(4, 3, 0), "dec": Norm(3, 4, 1)},)), XS, mutate=mutate)


def test_modules_shared_between_arguments():
    seen = []

    def fn(pair, more, x):
        a, b = pair
        seen.append((more["again"] is a, more["again"] is not b))
        more["again"].count[...] += 5
        return b(a(x)) + more["again"](x)

    def make() -> World:
        a, b = Counted(4, 4, 0), Counted(4, 4, 1)
        return World(((a, b), {"again": a}))

    worlds, _ = compare(fn, make, XS)
    (a, _), more = worlds["fastcall"].args
    assert more["again"] is a and int(a.count[...]) == 3 * 7
    assert seen and all(all(s) for s in seen)


def test_train_step_on_model_and_optimizer_in_a_tuple():
    tx = optax.adam(1e-3)  # one for all twins: a static attribute of the optimizer, compared as such

    def make() -> World:
        model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
        return World(((model, nnx.Optimizer(model, tx, wrt=nnx.Param)),))

    def step(state, x, y):
        model, optimizer = state
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    y = jnp.ones((2, 2))
    worlds, traces = compare(step, make, [(X, y)] * 5)
    model, optimizer = worlds["fastcall"].args[0]
    assert int(optimizer.step[...]) == 5
    assert traces == {"fastcall": 1, "nnx.jit": 1}
    first = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    with pytest.raises(AssertionError):  # the steps did move the parameters
        assert_trees_equal(state_of(model), state_of(first))


def test_functional_api_split_then_merge():
    def fn(graphdef, state, x):
        model = nnx.merge(graphdef, state)
        return model(x)

    def make() -> World:
        model = Counted(4, 3, 0)
        graphdef, state = nnx.split(model)
        return World((graphdef, state), keep=(model,))

    worlds, _ = compare(fn, make, XS)
    (model,) = worlds["fastcall"].keep
    _, state = worlds["fastcall"].args
    assert int(model.count[...]) == 3  # written back through the state's Variables
    assert state["count"] is model.count  # nnx.split's state holds the model's own Variables


@pytest.mark.parametrize("returns", ["split", "state"])
def test_functional_api_state_updated_and_returned(returns):
    """graphdef, state = nnx.split(model); then a loop of graphdef, state = f(graphdef, state, x)."""

    traces = {"fastcall": 0, "nnx.jit": 0, "eager": 0}

    def step(who: str) -> Callable:
        def fn(graphdef, state, x):
            traces[who] += 1
            model = nnx.merge(graphdef, state)
            y = model(x)
            model.linear.bias[...] += 1.0
            return (nnx.split(model) if returns == "split" else nnx.state(model)), y

        return fn

    runners = {"fastcall": fastcall.jit(step("fastcall")), "nnx.jit": nnx.jit(step("nnx.jit")), "eager": step("eager")}
    models = {who: Counted(4, 3, 0) for who in runners}
    carry = {who: nnx.split(m) for who, m in models.items()}
    for x in [X, X * 2.0, X - 0.5]:
        outs = {}
        for who, run in runners.items():
            graphdef, state = carry[who]
            world = World((graphdef, state), keep=(models[who],))
            out = run(graphdef, state, x)
            outs[who] = canon(out, world)
            new, _ = out
            carry[who] = new if returns == "split" else (graphdef, new)
        assert_trees_equal(outs["fastcall"], outs["nnx.jit"])
        assert_close(outs["eager"], outs["nnx.jit"])
        worlds = {who: World(carry[who], keep=(models[who],)) for who in runners}
        assert_same_world(worlds["fastcall"], worlds["nnx.jit"])
        assert_same_world(worlds["eager"], worlds["nnx.jit"], tol=1e-5)
    model = models["fastcall"]
    _, state = carry["fastcall"]
    assert int(model.count[...]) == 3 and float(model.linear.bias[...][0]) == 3.0
    assert state["count"] is model.count and state["linear"]["bias"] is model.linear.bias
    assert traces["nnx.jit"] == 1 and traces["fastcall"] <= 1, traces


class WithFeatures(nnx.Module):
    def __init__(self) -> None:
        self.features = [1, 2]  # a mutable static attribute: nnx.split's GraphDef holds this very list
        self.w = nnx.Param(jnp.arange(2.0))

    def __call__(self, x):
        return self.w[...] * x * len(self.features)


def test_functional_api_graphdef_changed_in_place_is_never_stale():
    """`model.features.append(...)` after nnx.split changes the GraphDef in place (nnx.jit
    and jax.jit(static_argnums=0) keep the old program); fastcall compiles for the new
    value and reuses the old program when the value comes back."""

    def fn(graphdef, state, x):
        return nnx.merge(graphdef, state)(x)

    model = WithFeatures()
    graphdef, state = nnx.split(model)
    f = fastcall.jit(fn)
    for features, compiles in (([1, 2], 1), ([1, 2, 3], 2), ([1, 2], 2), ([1, 2, 3, 4], 3)):
        model.features[:] = features
        assert_trees_equal(f(graphdef, state, X[0, :2]), fn(graphdef, state, X[0, :2]))
        assert f.stats().compiles == compiles
    assert "keyed by value" in f.explain(graphdef, state, X[0, :2]).arguments[0].kind
    # a GraphDef of hashable statics only is keyed by itself: equal ones share a program
    plain = nnx.split(Counted(4, 3, 0))
    g = fastcall.jit(lambda graphdef, state, x: fn(graphdef, state, x))  # (its own compile count)
    for _ in range(2):
        graphdef, state = nnx.split(nnx.merge(*plain))
        g(graphdef, state, X)
    assert g.stats().compiles == 1


# ---- nnx.State arguments: cached as a graph of their Variables, nnx.jit's semantics ----


def forward_state(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def _change_state_outside(w: World, i: int) -> None:
    """Between calls, every kind of change to the State argument (and so to the model)."""
    graphdef, state = w.args
    if i == 1:
        state["linear"]["kernel"][...] = state["linear"]["kernel"][...] * 2.0  # a value
    elif i == 2:
        state["linear"]["bias"] = nnx.Param(jnp.full((3,), 0.5))  # a Variable replaced in its dict
    elif i == 3:
        state["linear"] = dict(state["linear"])  # a nested dict replaced by an equal one
    elif i == 4:
        state["count"].set_metadata(tag="x")  # metadata (a hooked change)


def test_functional_api_state_changed_outside_between_calls_is_never_stale(hot_path):
    def make() -> World:
        model = Counted(4, 3, 0)
        return World(nnx.split(model), keep=(model,))

    data = [(X,), (X * 2.0,), (X - 0.5,), (X,), (X * 3.0,), (X,)]
    worlds, _ = compare(forward_state, make, data, mutate=_change_state_outside)
    # and the same calls again, on the structure path once the State is cached
    f, w = fastcall.jit(forward_state), make()
    routes = []
    for i, (x,) in enumerate(data):
        _change_state_outside(w, i)
        want = forward_state(*nnx.split(nnx.clone(nnx.merge(*w.args))), x)  # (eagerly, on a copy)
        y, route = served(f, *w.args, x)
        routes.append(route)
        assert_close(y, want)
    assert routes[-1] == STRUCTURE_PATH[hot_path] and routes[2:5] == ["general"] * 3, routes


def test_a_state_passed_first_takes_the_fast_path(hot_path):
    model = Counted(4, 3, 0)
    graphdef, state = nnx.split(model)

    def fn(state, x):
        m = nnx.merge(graphdef, state)
        return m(x)  # (count and cache written back through the state's Variables)

    f, peer, twin = fastcall.jit(fn), nnx.jit(fn), nnx.split(Counted(4, 3, 0))[1]
    routes = [served(f, state, X)[1] for _ in range(3)]
    for _ in range(3):
        peer(twin, X)
    assert routes[-1] == FAST_PATH[hot_path], routes
    assert_trees_equal(state_of(state), state_of(twin))
    assert int(model.count[...]) == 3


# ---- a new nnx.State every call: flax's functional training loop ----


def _variables(state: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _loop_step(graphdef, state, x):
    """The functional training loop of flax's performance guide: merge, update, and return
    the new state (a new nnx.State every call)."""
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))


def _spy(monkeypatch: Any, module: Any, name: str) -> list[int]:
    """Count the calls of `module.name` (called through the module's globals). `module` may
    be a tuple of modules, each importing the function and calling it: counted together."""
    calls: list[int] = []
    for each in module if isinstance(module, tuple) else (module,):
        real = getattr(each, name)
        monkeypatch.setattr(each, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


def _split_loop_state():
    model = Counted(4, 3, 0)
    return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)))


def _loop_three_ways(
    xs: list[Any], change: Callable[[int, list[Any]], None] = lambda i, states: None
) -> tuple[list[str], Any]:
    """Run the functional loop `_loop_step` under fastcall.jit, nnx.jit and eagerly on twin
    States, for each `x` in `xs`, checking after each call that losses and states agree and
    that both jits give back a new State of the Variables they were given. `change(i,
    [fastcall's, nnx.jit's, eager's State])` runs before call `i`. Returns each call's route,
    and the fastcall function."""
    f, peer = fastcall.jit(_loop_step), nnx.jit(_loop_step)
    (graphdef, state), (peer_graphdef, peer_state), (eager_graphdef, eager_state) = (
        _split_loop_state(), _split_loop_state(), _split_loop_state()
    )
    routes = []
    for i, x in enumerate(xs):
        change(i, [state, peer_state, eager_state])
        given, peer_given = state, peer_state
        (loss, state), route = served(f, graphdef, state, x)
        routes.append(route)
        peer_loss, peer_state = peer(peer_graphdef, peer_state, x)
        eager_loss, eager_state = _loop_step(eager_graphdef, eager_state, x)
        assert_trees_equal(loss, peer_loss)
        assert_trees_equal(state_of(state), state_of(peer_state))
        assert_close(loss, eager_loss)
        assert_close(state_of(state), state_of(eager_state))
        # (nnx.jit gives back a new State of the Variables it was given, updated in place)
        assert state is not given and peer_state is not peer_given
        assert all(a is b for a, b in zip(_variables(peer_state), _variables(peer_given)))
        if given.raw_mapping is not state.raw_mapping:  # (not swapped by `change`)
            assert all(a is b for a, b in zip(_variables(state), _variables(given)))
    return routes, f


def test_the_state_a_call_returns_is_read_from_its_own_entry(monkeypatch, hot_path):
    """`loss, state = step(graphdef, state, x)`: the first State is read by one graph walk;
    each State a call returns holding the argument's Variables gets a cache entry of its own
    (`_adapter.twin_states`), so the next call reads it as a known object, on the structure
    path: no graph walk, no pytree flatten. Losses, state, and the returned State holding the
    caller's own Variables, as nnx.jit."""
    from fastcall._nnx import _entries, _reads

    pytree_reads = _spy(monkeypatch, _reads, "_read_plain_state")
    graph_reads = _spy(monkeypatch, (_entries, _reads), "_flatten_node")
    routes, f = _loop_three_ways([X, X * 2.0, X - 0.5, X])
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3, routes
    assert len(pytree_reads) == 0 and len(graph_reads) == 1
    assert f.stats().compiles == 1


class _GuideModel(nnx.Module):
    """The model of flax's performance guide: BatchNorm statistics and Dropout's RNG stream
    (a key array, not a plain jax array) in the state."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(2, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, deterministic=False, rngs=rngs)
        self.linear_out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear_out(nnx.relu(self.dropout(self.bn(self.linear(x)))))


def _guide_step(graphdef, state, x):
    model, optimizer, metrics = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)
    return loss, nnx.state((model, optimizer, metrics))


def test_the_performance_guides_loop_reads_its_returned_state_from_its_entry(hot_path):
    """flax's performance guide's functional loop (its state holds RNG keys and a metric):
    after the first call, each returned State is read on the structure path; losses and
    state as nnx.jit's."""

    def split():
        model = _GuideModel(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        return nnx.split((model, optimizer, nnx.MultiMetric(loss=nnx.metrics.Average("loss"))))

    f, peer = fastcall.jit(_guide_step), nnx.jit(_guide_step)
    (graphdef, state), (peer_graphdef, peer_state) = split(), split()
    routes = []
    for x in [X[:, :2], X[:, 2:], X[:, :2] * 2.0, X[:, 2:]]:
        (loss, state), route = served(f, graphdef, state, x)
        routes.append(route)
        peer_loss, peer_state = peer(peer_graphdef, peer_state, x)
        assert_trees_equal(loss, peer_loss)
        assert_trees_equal(state_of(state), state_of(peer_state))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3, routes


def test_a_new_state_the_caller_builds_is_read_as_a_pytree(monkeypatch):
    """A new State the caller built (not one a call returned) is read by its pytree flatten
    under the spec its structure was given (no graph walk)."""
    from fastcall._nnx import _entries, _reads

    f = fastcall.jit(_loop_step)
    (graphdef, state), (eager_graphdef, eager_state) = _split_loop_state(), _split_loop_state()
    pytree_reads = _spy(monkeypatch, _reads, "_read_plain_state")
    graph_reads = _spy(monkeypatch, (_entries, _reads), "_flatten_node")
    for x in [X, X * 2.0, X - 0.5, X]:
        loss, state = f(graphdef, nnx.State(dict(state.raw_mapping)), x)  # (a copy: unknown)
        eager_loss, eager_state = _loop_step(eager_graphdef, eager_state, x)
        assert_close(loss, eager_loss)
        assert_close(state_of(state), state_of(eager_state))
    assert len(pytree_reads) == 3 and len(graph_reads) == 1
    assert f.stats().compiles == 1


def _first_variable_slot(state: Any) -> tuple[dict, Any]:
    """The dict and key holding the first Variable of `state` (sorted keys, depth first)."""
    mapping = state.raw_mapping
    while True:
        key = sorted(mapping, key=str)[0]
        if isinstance(mapping[key], nnx.Variable):
            return mapping, key
        mapping = mapping[key]


def _replace_variable(state):
    d, k = _first_variable_slot(state)
    d[k] = d[k].replace(d[k].get_value() * 2.0)


def _set_metadata(state):
    d, k = _first_variable_slot(state)
    d[k].set_metadata("note", 1)


def _set_value(state):
    d, k = _first_variable_slot(state)
    d[k].set_value(d[k].get_value() + 1.0)


def _copy_nested_dict(state):
    key = sorted(state.raw_mapping, key=str)[0]
    state.raw_mapping[key] = dict(state.raw_mapping[key])


def _swap_mapping(state):
    object.__setattr__(state, "_mapping", dict(state.raw_mapping))


_STATE_CHANGES = {
    # name: (change, whether the structure path may still serve the next call)
    "Variable replaced": (_replace_variable, False),
    "metadata set": (_set_metadata, False),
    "value set": (_set_value, True),
    "nested dict replaced by a copy": (_copy_nested_dict, False),
    "mapping swapped": (_swap_mapping, False),
}


@pytest.mark.parametrize("change", list(_STATE_CHANGES))
def test_a_returned_state_changed_before_it_is_passed_back(change, hot_path):
    """Each change the caller can make to a returned State between calls is seen: the next
    call matches nnx.jit and the eager loop, and a change of structure (a Variable, a dict,
    metadata) takes the general path."""
    mutate, may_stay = _STATE_CHANGES[change]

    def before(i: int, states: list[Any]) -> None:
        if i == 2:
            for state in states:
                mutate(state)

    routes, _ = _loop_three_ways([X, X * 2.0, X - 0.5, X + 1.0, X], before)
    assert routes[1] == STRUCTURE_PATH[hot_path], routes
    assert (routes[2] == STRUCTURE_PATH[hot_path]) == may_stay, routes
    assert routes[4] == STRUCTURE_PATH[hot_path], routes  # (the chain takes up again)


@pytest.mark.parametrize("when", [0, 2])
def test_metadata_changed_while_a_call_runs_is_seen_by_the_state_it_returns(monkeypatch, hot_path, when):
    """A Variable's metadata set after the call read its State and before the returned
    State's entry is made (another thread, in a real program: here, where the call writes
    values back) leaves that entry stale: the next call reads the State again, and matches
    nnx.jit given the same change. In the first call (`when` 0) the State read is new to
    fastcall (its entry unwatched: the returned State's key is read again); in the third,
    it is one a call returned (watched)."""
    from fastcall._nnx import _adapter, _entries

    f, peer = fastcall.jit(_loop_step), nnx.jit(_loop_step)
    (graphdef, state), (peer_graphdef, peer_state) = _split_loop_state(), _split_loop_state()
    real = _adapter.write_back
    armed = []

    def write_back(nnx_out, values, nnx_args):
        link = real(nnx_out, values, nnx_args)
        if armed:
            _set_metadata(armed.pop())
        return link

    monkeypatch.setattr(_adapter, "write_back", write_back)
    routes = []
    for i, x in enumerate([X, X * 2.0, X - 0.5, X + 1.0, X]):
        if i == when:
            armed.append(state)
            _set_metadata(peer_state)
        (loss, state), route = served(f, graphdef, state, x)
        routes.append(route)
        peer_loss, peer_state = peer(peer_graphdef, peer_state, x)
        assert_trees_equal(loss, peer_loss)
        assert_trees_equal(state_of(state), state_of(peer_state))
        if i == when:
            assert _entries.by_id[id(state)].stale
    assert routes[when + 1] == "general" and routes[-1] == STRUCTURE_PATH[hot_path], routes


def test_an_older_returned_state_passed_again(hot_path):
    """A State returned two calls ago holds the same Variables (updated in place since): it
    is read as they are now, as nnx.jit and the eager loop read it."""
    f, peer = fastcall.jit(_loop_step), nnx.jit(_loop_step)
    (graphdef, state), (peer_graphdef, peer_state), (eager_graphdef, eager_state) = (
        _split_loop_state(), _split_loop_state(), _split_loop_state()
    )
    kept = []
    for x in [X, X * 2.0, X - 0.5]:
        loss, state = f(graphdef, state, x)
        peer_loss, peer_state = peer(peer_graphdef, peer_state, x)
        eager_loss, eager_state = _loop_step(eager_graphdef, eager_state, x)
        kept.append((state, peer_state, eager_state))
    old, peer_old, eager_old = kept[0]
    loss, _ = f(graphdef, old, X)
    assert_trees_equal(loss, peer(peer_graphdef, peer_old, X)[0])
    assert_close(loss, _loop_step(eager_graphdef, eager_old, X)[0])


def _returns_the_params_only(graphdef, state, x):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss, nnx.state(model, nnx.Param)  # (not the argument's structure)


def test_a_returned_state_of_another_structure_gets_no_entry():
    from fastcall._nnx import _entries

    f = fastcall.jit(_returns_the_params_only)
    graphdef, state = _split_loop_state()
    for x in [X, X * 2.0]:
        loss, params = f(graphdef, state, x)
        assert isinstance(params, nnx.State)
    assert f.stats().compiles == 1
    given = {id(v) for v in _variables(state)}
    assert len(_variables(params)) < len(given) and all(id(v) in given for v in _variables(params))
    assert _entries.by_id.get(id(params)) is None


def _passes_a_model_through(state, aux, other, x):
    model, total = aux
    state["w"][...] += x
    return state, (model, total + other(jnp.ones(2)).sum())  # (`model` only passed through)


def test_the_callers_objects_put_in_the_output_are_not_taken_back_as_statics():
    """(Review finding.) An output holding a State and a tuple of the caller's model and an
    array is built once, with the caller's objects in place; that tuple, passed back next
    call, is the caller's model again (not what the output's record took it for)."""
    runs = {}
    for name, jit in [("fastcall", fastcall.jit), ("nnx.jit", nnx.jit)]:
        f = jit(_passes_a_model_through)
        model, other = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(1))
        state, aux = nnx.State({"w": nnx.Param(jnp.zeros(2))}), (model, jnp.zeros(()))
        totals = []
        for _ in range(3):
            state, aux = f(state, aux, other, jnp.float32(1.0))
            assert aux[0] is model
            totals.append(aux[1])
        runs[name] = (totals, state_of(state))
    assert_trees_equal(runs["fastcall"], runs["nnx.jit"])


def _tagged_forward(graphdef, state, x):
    """Output that depends on the Variables' types and metadata (static: in the graphdef)."""
    model = nnx.merge(graphdef, state)
    scale = 2.0 if model.linear.bias.get_metadata().get("tag") == "x" else 1.0
    params = sum(jnp.sum(p) for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    return model(x) * scale + params


def test_a_new_state_of_other_variable_types_or_metadata_is_read_by_its_graph(monkeypatch):
    """A new State of the same keys whose Variables differ in type or metadata is not read
    under the spec of another: a graph read, the program for its structure."""
    from fastcall._nnx import _reads

    def new_state_each_call(w: World, i: int) -> None:
        (model,) = w.keep
        if i == 2:
            model.linear.bias.set_metadata(tag="x")
        elif i == 4:
            model.linear.bias = nnx.BatchStat(model.linear.bias[...])
        w.args = nnx.split(model)

    def make() -> World:
        model = Counted(4, 3, 0)
        return World(nnx.split(model), keep=(model,))

    pytree_reads = _spy(monkeypatch, _reads, "_read_plain_state")
    data = [(X,), (X * 2.0,), (X,), (X - 0.5,), (X,), (X * 3.0,)]
    worlds, traces = compare(_tagged_forward, make, data, mutate=new_state_each_call)
    assert traces["fastcall"] == 3 and len(pytree_reads) == 3  # (calls 1, 3 and 5)


def test_a_state_holding_a_variable_twice_is_read_by_its_graph(monkeypatch):
    """A State with one Variable under two keys (a shared reference in NNX's graph) is
    never read as a pytree, which would see two Variables: not even after a State of the
    same keys, types and metadata with two Variables there."""
    from fastcall._nnx import _reads

    def fn(state, x):
        state["alias"][...] += 1.0  # (seen through the other key too, where it is one Variable)
        return jnp.sum(state["linear"]["kernel"][...]) * x

    def new_state_each_call(w: World, i: int) -> None:
        (model,) = w.keep
        state = nnx.state(model)
        kernel = state["linear"]["kernel"]
        state["alias"] = kernel.replace(kernel[...]) if i == 0 else kernel  # (a twin, then itself)
        w.args = (state,)

    def make() -> World:
        return World((), keep=(Counted(4, 3, 0),))

    pytree_reads = _spy(monkeypatch, _reads, "_read_plain_state")
    data = [(X,), (X * 2.0,), (X - 0.5,), (X,)]
    worlds, _ = compare(fn, make, data, eager=False, mutate=new_state_each_call)
    (model,) = worlds["fastcall"].keep
    np.testing.assert_allclose(model.linear.kernel[...], Counted(4, 3, 0).linear.kernel[...] + 3.0, rtol=1e-6)
    assert not pytree_reads


def test_changes_to_a_state_inside_are_values_only_as_under_nnx_jit():
    """nnx.jit treats an nnx.State as a pytree: new values of its Variables come back; a
    Variable replaced in it, a key added or deleted, a raw leaf rebound stay inside."""

    def fn(state, x):
        state["linear"]["kernel"] = nnx.Param(state["linear"]["kernel"][...] * 2.0)
        state["added"] = nnx.Param(jnp.ones(1))
        del state["cache"]
        state["count"][...] += 1
        state["raw"] = state["raw"] + 1.0
        return state, jnp.sum(x)

    def make() -> World:
        model = Counted(4, 3, 0)
        state = nnx.state(model)
        state["raw"] = jnp.zeros(2)  # a raw array leaf of the State
        return World((state,), keep=(model,))

    # (not eagerly: an eager call changes the caller's State itself)
    worlds, _ = compare(fn, make, XS, eager=False)
    (state,) = worlds["fastcall"].args
    assert "added" not in state and "cache" in state and float(state["raw"][0]) == 0.0
    assert int(state["count"][...]) == 3


class _WithRaw(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones(2))
        self.scale = nnx.data(jnp.ones(2))  # a raw array: a raw leaf of nnx.split's State


def test_a_state_with_raw_leaves_is_read_as_a_container_and_never_held():
    """(Review finding.) A State holding raw leaves (or modules) is not cached as one object:
    it is read as a container each call, and nothing keeps it alive."""
    import gc
    import weakref

    f = fastcall.jit(lambda g, st, x: nnx.merge(g, st).w[...] * nnx.merge(g, st).scale * x)
    model, refs = _WithRaw(), []
    for i in range(5):
        graphdef, state = nnx.split(model)  # a new State every step, as a training loop makes
        assert_trees_equal(f(graphdef, state, float(i)), jnp.ones(2) * i)
        refs.append(weakref.ref(state))
    del state
    gc.collect()
    assert all(r() is None for r in refs)


def _state_holding_module_step(s, x):
    s["m"].w = nnx.Param(s["m"].w[...] * 4.0)  # graph updates on a module held by the State
    s["m"].steps = s["m"].steps + 1.0  # a raw leaf of that module
    return x


def _changed_then_replaced(s, x):
    s["w"][...] += 1.0
    s["w"] = nnx.Param(jnp.zeros(2))  # no longer in the State after the call: nothing back
    return x


@pytest.mark.parametrize("fn, options", [
    (_state_holding_module_step, {}),
    (_changed_then_replaced, {}),
    (_changed_then_replaced, {"graph_updates": False}),
])
def test_states_holding_modules_and_variables_dropped_inside(fn, options):
    """(Review findings.) A module inside a State keeps its graph updates (only the State's
    own mapping is a pytree to nnx.jit); a Variable changed and then dropped from the State
    gives nothing back with graph updates, and its value without."""

    class Sub(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(2))
            self.steps = nnx.data(jnp.zeros(()))

    def make():
        sub = Sub()
        if fn is _changed_then_replaced:  # (a State of Variables only: read as one object)
            return nnx.State({"w": nnx.Param(jnp.ones(2))}), sub
        return nnx.State({"m": sub, "w": nnx.Param(jnp.ones(2))}), sub

    _needs_options(options)
    results = {}
    for name, jit in (("nnx.jit", nnx.jit), ("fastcall", fastcall.jit)):
        state, sub = make()
        w = state["w"]
        f = jit(fn, **options)
        for _ in range(3):
            f(state, 1.0)
        results[name] = (state_of(sub), w[...], sorted(state.keys()))
    assert_trees_equal(results["fastcall"], results["nnx.jit"])


def test_a_state_and_its_model_in_one_call_stay_shared():
    seen = []

    def fn(model, state, x):
        seen.append(model.count is state["count"])
        state["count"][...] += 10
        return model(x)

    def make() -> World:
        model = Counted(4, 3, 0)
        return World((model, nnx.state(model)))

    worlds, _ = compare(fn, make, XS)
    model, state = worlds["fastcall"].args
    assert state["count"] is model.count and int(model.count[...]) == 33
    assert seen and all(seen)


def test_list_of_variables_shared():
    """flax's test_jit_pytree_of_variables: [v1, v1, v2]."""
    seen = []

    def fn(vs):
        seen.append((vs[0] is vs[1], vs[0] is not vs[2]))
        vs[0][...] += 10
        return vs[2]

    def make() -> World:
        v1, v2 = nnx.Param(jnp.array(1)), nnx.Param(jnp.array(2))
        return World(([v1, v1, v2],))

    def check(worlds: dict[str, World], i: int) -> None:
        (vs,) = worlds["fastcall"].args
        assert vs[0] is vs[1] and vs[0] is not vs[2]
        assert int(vs[0][...]) == 1 + 10 * (i + 1) and int(vs[2][...]) == 2

    worlds, _ = compare(fn, make, [()] * 2, check=check)
    assert seen and all(all(s) for s in seen)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: nnx.Param
    b: nnx.Param
    step: nnx.Variable


def affine(p, x):
    p.step[...] += 1
    p.b[...] = p.b[...] + 0.5
    return x @ p.w[...] + p.b[...], p.w


def test_registered_dataclass_holding_variables():
    def make() -> World:
        return World((Params(nnx.Param(jnp.eye(4) * 2.0), nnx.Param(jnp.zeros(4)), nnx.Variable(jnp.array(0))),))

    def check(worlds: dict[str, World], i: int) -> None:
        (p,) = worlds["fastcall"].args
        assert int(p.step[...]) == i + 1 and float(p.b[...][0]) == 0.5 * (i + 1)

    compare(affine, make, XS, check=check)


def test_nnx_state_holding_variables():
    def fn(s, x):
        s["step"][...] += 1
        s["b"][...] = s["b"][...] + 0.5
        return x @ s["w"][...] + s["b"][...], s["w"]

    def make() -> World:
        return World((nnx.State({"w": nnx.Param(jnp.eye(4) * 2.0), "b": nnx.Param(jnp.zeros(4)),
                                 "step": nnx.Variable(jnp.array(0))}),))

    def check(worlds: dict[str, World], i: int) -> None:
        (s,) = worlds["fastcall"].args
        assert int(s["step"][...]) == i + 1

    compare(fn, make, XS, check=check)



# ---- a pytree holding Variables beside arrays and static values (MixedRead) ----


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Holder:
    """A mutable registered dataclass: Variables beside an array and a static value."""

    w: Any
    count: Any
    scale: Any
    name: str = dataclasses.field(default="run", metadata={"static": True})


def _holder() -> Holder:
    return Holder(nnx.Param(jnp.eye(4) * 2.0), nnx.Variable(jnp.array(0)), jnp.asarray(1.5))


def scaled(h, x):
    h.count[...] += 1
    return x @ h.w[...] * h.scale + h.count[...]


def _variable_order(h: Holder) -> list[Any]:
    return [h.w[...], h.count[...], h.w.get_metadata(), h.count.get_metadata()]


def _mutations() -> dict[str, Callable[[Holder], None]]:
    return {
        "value set outside": lambda h: h.w.set_value(h.w[...] + 1.0),
        "Variable replaced": lambda h: setattr(h, "w", nnx.Param(jnp.eye(4) * 3.0)),
        "metadata changed": lambda h: h.w.set_metadata("tag", "changed"),
        "Variable type changed": lambda h: setattr(h, "w", nnx.BatchStat(h.w[...])),
        "Variable replaced by an array": lambda h: setattr(h, "w", jnp.eye(4)),
        "Variable shared": lambda h: setattr(h, "scale", h.count),
        "array replaced by a scalar": lambda h: setattr(h, "scale", 2.5),
        "array replaced by a Variable": lambda h: setattr(h, "scale", nnx.Variable(jnp.asarray(0.5))),
        "static changed": lambda h: setattr(h, "name", "other"),
        "nothing": lambda h: None,
    }


def test_variables_beside_arrays_in_a_pytree_take_the_structure_path(hot_path):
    """A pytree holding Variables beside arrays (no other NNX object): from the second call
    on, read by the structure path (jax's flatten down to its Variables, each checked as a
    Variable passed on its own is), with the change made inside written back, as nnx.jit."""
    f, g = fastcall.jit(scaled), nnx.jit(scaled)
    mine, theirs = _holder(), _holder()
    routes = []
    for x in (X, X * 2.0, X - 0.5, X):
        got, route = served(f, mine, x)
        routes.append(route)
        assert_trees_equal(got, g(theirs, x))
        assert_trees_equal(_variable_order(mine), _variable_order(theirs))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    assert int(mine.count[...]) == 4


@pytest.mark.parametrize("change", list(_mutations()))
def test_a_pytree_of_variables_changed_between_calls_is_never_stale(change, hot_path):
    """Every kind of change to a pytree the structure path reads, made between calls: the
    same outputs, state written back and compiles as nnx.jit. A change of values, a Variable
    replaced by one of its type and metadata, and an array replaced by a Python scalar
    (passed as an array is) keep the structure path; a Variable shared is read jointly by
    the general path every call; any other change is read once by the general path, which
    records the new structure."""
    traces = {"fastcall": 0, "nnx": 0}

    def counted(who):
        def fn(h, x):
            traces[who] += 1
            return scaled(h, x)

        return fn

    f, g = fastcall.jit(counted("fastcall")), nnx.jit(counted("nnx"))
    mine, theirs = _holder(), _holder()
    for _ in range(2):
        assert_trees_equal(f(mine, X), g(theirs, X))
    _mutations()[change](mine)
    _mutations()[change](theirs)
    routes = []
    for _ in range(2):
        got, route = served(f, mine, X)
        routes.append(route)
        assert_trees_equal(got, g(theirs, X))
        assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(theirs)
        assert_trees_equal(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(theirs))
    structure = STRUCTURE_PATH[hot_path]
    if change in ("value set outside", "Variable replaced", "nothing", "array replaced by a scalar"):
        assert routes == [structure, structure]  # (a scalar is passed as an array is: jax.jit retraces)
    elif change == "Variable shared":
        assert routes == ["general", "general"]  # (read jointly, as nnx.jit reads it)
    else:  # read once by the general path, which records the new structure
        assert routes == ["general", structure]
    assert traces["fastcall"] <= traces["nnx"], traces


def test_a_functional_train_state_of_split_states_loops_on_the_structure_path(hot_path):
    """flax's toy example 03: `nnx.split` States and the graphdef kept in a TrainState (a
    flax.struct dataclass), `state = train_step(state, batch)`. The same losses, parameters
    and counts as nnx.jit (whose rule for the Variables it is given fastcall keeps) and as
    jax.jit; the returned States' Variables of the types and metadata nnx.jit gives; every
    call after the first served by the structure path, and its output built by jax (no NNX
    object rebuilt by graph: `unmark_nodes` never runs)."""
    from flax.training import train_state

    class Count(nnx.Variable):
        pass

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.count = Count(jnp.array(0))
            self.linear = nnx.Linear(1, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            self.count[...] += 1
            return self.out(jax.nn.relu(self.linear(x)))

    class TrainState(train_state.TrainState):
        counts: Any
        graphdef: Any

    tx = optax.sgd(0.1)  # (one for all: the state's treedef holds its functions)

    def start():
        graphdef, params, counts = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, Count)
        return TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=tx, counts=counts)

    x = jnp.linspace(0.0, 1.0, 16)[:, None]
    y = 0.8 * x**2 + 0.1

    def train_step(state, batch):
        x, y = batch

        def loss_fn(params):
            model = nnx.merge(state.graphdef, params, state.counts, copy=True)
            loss = jnp.mean((y - model(x)) ** 2)
            return loss, nnx.state(model, Count)

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, counts=counts), loss

    from fastcall._nnx import _adapter

    rebuilt = []
    real = _adapter.unmark_nodes
    f = fastcall.jit(train_step)
    states = {"fastcall": start(), "nnx.jit": start(), "jax.jit": start()}
    runners = {"nnx.jit": nnx.jit(train_step), "jax.jit": jax.jit(train_step)}
    routes = []
    try:
        _adapter.unmark_nodes = lambda *a: rebuilt.append(a) or real(*a)
        for _ in range(4):
            (states["fastcall"], loss), route = served(f, states["fastcall"], (x, y))
            routes.append(route)
            for who, run in runners.items():
                states[who], want = run(states[who], (x, y))
                assert_trees_equal(loss, want)
                assert_trees_equal(states["fastcall"], states[who])  # (Variable metadata too)
    finally:
        _adapter.unmark_nodes = real
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    assert not rebuilt
    for got, want in zip(
        jax.tree_util.tree_leaves(states["fastcall"], is_leaf=lambda v: isinstance(v, nnx.Variable)),
        jax.tree_util.tree_leaves(states["nnx.jit"], is_leaf=lambda v: isinstance(v, nnx.Variable)),
    ):
        assert type(got) is type(want)
        if isinstance(got, nnx.Variable):
            assert list(got.get_metadata().items()) == list(want.get_metadata().items())
    assert int(states["fastcall"].counts["count"][...]) == 4


class _Count(nnx.Variable):
    pass


def _split_train_state():
    """A flax TrainState holding `nnx.split` States (a params State of dicts of Params, a
    counts State) and the graphdef (toy example 03's), and a step that reads every param,
    counts its calls in place and returns a new state."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        counts: Any
        graphdef: Any

    class Model(nnx.Module):
        def __init__(self):
            self.count = _Count(jnp.array(0))
            self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

        def __call__(self, x):
            self.count[...] += 1
            return self.linear(x)

    def start():
        graphdef, params, counts = nnx.split(Model(), nnx.Param, _Count)
        return TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=_SGD, counts=counts)

    def step(state, x):
        # (any params the state holds; the count written in place: nnx.jit writes it back)
        params = jax.tree_util.tree_leaves(state.params, is_leaf=lambda v: isinstance(v, nnx.Variable))
        state.counts["count"][...] += 1
        return state.replace(step=state.step + 1), x * sum(jnp.sum(v[...]) for v in params)

    return start, step


_SGD = optax.sgd(0.1)  # (one for all: a TrainState's treedef holds its functions)


def _train_state_changes():
    """Changes a user makes to a train state's States between calls (name -> change)."""

    def extra(s):
        s.params["linear"]["extra"] = nnx.Param(jnp.ones(1))

    def swapped(s):
        del s.params["linear"]["bias"]
        s.params["linear"]["bias2"] = nnx.Param(jnp.ones(3))

    def retyped(s):
        s.params["linear"]["bias"] = nnx.BatchStat(jnp.full((3,), 0.5))

    def valued(s):
        s.params["linear"]["bias"][...] = jnp.full((3,), 2.0)

    def replaced(s):
        s.params["linear"]["kernel"] = nnx.Param(jnp.full((2, 3), 0.25))

    def counted(s):
        s.counts["count"] = _Count(jnp.array(7))

    return {
        "value set": valued, "Variable replaced": replaced, "count replaced": counted, "key added": extra,
        "key swapped": swapped, "Variable of another type": retyped,
    }


@pytest.mark.parametrize("change", list(_train_state_changes()))
def test_the_states_in_a_train_state_are_read_by_their_mappings_and_never_stale(change, hot_path):
    """A TrainState of `nnx.split` States: the structure path reads each State by its dict
    (`_plan.MappingRead`), not by flax's Python flatten; every change a user makes to the
    States between calls gives what nnx.jit gives: a new value or a Variable replaced by
    one of its type keeps the structure path, a key added or swapped, or a Variable of
    another type, is read once by the general path, which records the new structure."""
    start, step = _split_train_state()
    f, g = fastcall.jit(step), nnx.jit(step)
    mine, theirs = start(), start()
    for _ in range(2):
        (mine, got), route = served(f, mine, X[:, :2])
        theirs, want = g(theirs, X[:, :2])
        assert_trees_equal((mine, got), (theirs, want))
    assert route == STRUCTURE_PATH[hot_path]
    (mixed,) = reads_in(f, _plan.MixedRead)
    assert [type(e).__name__ for e in mixed.expand] == ["NoneType", "MappingRead", "MappingRead"]
    _train_state_changes()[change](mine)
    _train_state_changes()[change](theirs)
    routes = []
    for _ in range(2):
        (mine, got), route = served(f, mine, X[:, :2])
        theirs, want = g(theirs, X[:, :2])
        routes.append(route)
        assert_trees_equal((mine, got), (theirs, want))
        assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(theirs)
    structure = STRUCTURE_PATH[hot_path]
    if change in ("value set", "Variable replaced", "count replaced"):
        assert routes == [structure, structure]
    else:
        assert routes == ["general", structure]


def test_a_state_the_mapping_read_does_not_cover_is_flattened_by_jax():
    """A State holding a tuple (which jax's flatten walks into, and the mapping read would
    take as one leaf) is read by jax's flatten: no MappingRead; the same as nnx.jit."""

    def step(states, x):
        params, pair = states
        return x * params["w"][...] + pair["p"][0][...] + pair["p"][1][...]

    def start():
        return (nnx.State({"w": nnx.Param(jnp.ones(3))}), nnx.State({"p": (nnx.Param(jnp.ones(3)), nnx.Param(jnp.ones(3)))}))

    f, g = fastcall.jit(step), nnx.jit(step)
    mine, theirs = start(), start()
    for _ in range(3):
        assert_trees_equal(f(mine, X[0, :3]), g(theirs, X[0, :3]))
    assert all(read.expand is None for read in reads_in(f, _plan.MixedRead))


def test_new_variables_returned_keep_their_identity_as_under_nnx_jit():
    """New Variables returned are built by jax from their values only where that cannot
    differ from nnx.jit's rebuild: each once, no NNX object beside them that might hold one,
    none put into an argument. Otherwise, one object where the function returned one."""

    def twice(m, x):
        v = nnx.Param(m.linear(x))
        return v, v

    def beside_a_module(m, x):
        v = nnx.Param(m.linear(x))
        holder = nnx.Module()
        holder.v = v
        return v, holder

    def put_in_the_argument(m, x):
        v = nnx.Param(m.linear(x))
        m.extra = v
        return {"v": v, "w": nnx.Param(x)}

    for fn, same in [
        (twice, lambda out, m: out[0] is out[1]),
        (beside_a_module, lambda out, m: out[0] is out[1].v),
        (put_in_the_argument, lambda out, m: out["v"] is m.extra and out["w"] is not m.extra),
    ]:
        compare(fn, lambda: World((Counted(4, 4, 0),)), XS)
        for jit in (nnx.jit, fastcall.jit):  # the oracle, then fastcall
            f, m = jit(fn), Counted(4, 4, 0)
            for _ in range(3):
                assert same(f(m, X), m), (fn.__name__, jit)


def test_new_variables_returned_on_their_own_are_as_nnx_jit_builds_them(hot_path, monkeypatch):
    """A new Variable returned on its own is built from the entry's own output tree (no
    graph rebuild: `unmark_nodes` never runs), of its type, with its metadata in the order
    it had (as nnx.jit and eager code give it; jax's output tree would sort it), on every
    call, whichever path serves it. A new Variable holding another is left to the graph
    rebuild, as nnx.jit rebuilds it (its value an array)."""
    from fastcall._nnx import _adapter

    rebuilt = []
    real = _adapter.unmark_nodes
    monkeypatch.setattr(_adapter, "unmark_nodes", lambda *a: rebuilt.append(a) or real(*a))

    def made(x):
        return {"p": nnx.Param(x * 2.0, zeta=1, alpha=2), "s": nnx.BatchStat(jnp.sum(x))}

    f, g = fastcall.jit(made), nnx.jit(made)
    routes = []
    for i in range(3):
        got, route = served(f, X + i)
        routes.append(route)
        want, eager = g(X + i), made(X + i)
        for k in ("p", "s"):
            assert type(got[k]) is type(want[k])
            assert list(got[k].get_metadata().items()) == list(want[k].get_metadata().items())
            assert list(got[k].get_metadata().items()) == list(eager[k].get_metadata().items())
            assert_trees_equal(got[k][...], want[k][...])
    assert routes[1:] == [STRUCTURE_PATH[hot_path]] * 2
    assert not rebuilt

    def nested(x):
        return nnx.Variable(nnx.Param(x))

    f, g = fastcall.jit(nested), nnx.jit(nested)
    for _ in range(2):
        got, want = f(X), g(X)
        assert type(got.get_raw_value()) is type(want.get_raw_value())
        assert_trees_equal(got.get_raw_value(), want.get_raw_value())
    assert rebuilt  # (the graph rebuild, as before)
    rebuilt.clear()

    class Tagged(nnx.Variable):  # (makes itself its own way: left to the graph rebuild, which calls it)
        @classmethod
        def from_metadata(cls, value, attributes):
            return super().from_metadata(value, {**attributes, "rebuilt": True})

    def tagged(x):
        return Tagged(x * 3.0)

    f, g = fastcall.jit(tagged), nnx.jit(tagged)
    for _ in range(2):
        got, want = f(X), g(X)
        assert list(got.get_metadata().items()) == list(want.get_metadata().items())
        assert_trees_equal(got[...], want[...])
    assert rebuilt


def test_plain_list_of_kv_cache_decoders():
    def fn(decoders, tokens):
        return jnp.stack([d(tokens[i]) for i, d in enumerate(decoders)])

    def make() -> World:
        return World(([TinyDecoder(11, 8, 16, nnx.Rngs(s)) for s in (3, 4)],))

    tokens = [(jnp.asarray([t % 11, (3 * t) % 11], jnp.int32),) for t in range(6)]
    worlds, traces = compare(fn, make, tokens, eager=False)  # (eagerly: slow, and nnx.jit is the oracle)
    assert [int(d.index[...]) for d in worlds["fastcall"].args[0]] == [6, 6]
    assert traces == {"fastcall": 1, "nnx.jit": 1}


class Foo(nnx.Module):
    def __init__(self, seed: int):
        self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(seed))
        self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(seed + 1))


@pytest.mark.parametrize("graph_updates", [True, False])
def test_graph_updates_on_a_module_in_a_container(graph_updates):
    """flax's test_objects_in_pytree: a swap inside, on tree[0]['foo']. With graph_updates
    it is applied to the caller's module (and undone by the second call); without, nnx.jit
    leaves the caller's module as it was, and does not raise; fastcall must do the same
    here. (For a module passed directly, fastcall.jit(graph_updates=False) makes such a
    change a FastcallError instead: tests/test_nnx.py.)"""

    def swap(tree):
        m = tree[0]["foo"]
        m.a, m.b = m.b, m.a

    def make() -> World:
        m = Foo(0)
        return World((({"foo": m},),), keep=(m.a, m.b))

    def check(worlds: dict[str, World], i: int) -> None:
        for who in ("fastcall", "nnx.jit"):
            w = worlds[who]
            m = w.args[0][0]["foo"]
            a, b = w.keep
            swapped = graph_updates and i % 2 == 0
            assert m.a is (b if swapped else a) and m.b is (a if swapped else b), (who, i)

    if graph_updates:
        jit_kwargs = {}  # (the default; older flax has no graph_updates argument)
    elif "graph_updates" in inspect.signature(nnx.jit).parameters:
        jit_kwargs = {"graph_updates": False}
    else:
        pytest.skip("this flax's nnx.jit has no graph_updates argument")
    _, traces = compare(swap, make, [()] * 3, eager=graph_updates, check=check, **jit_kwargs)
    assert traces == {"fastcall": 1, "nnx.jit": 1}


def test_graph_update_adding_a_variable_to_a_module_in_a_container():
    def grow(tree, x):
        m = tree["deep"][1]
        if not hasattr(m, "extra"):
            m.extra = nnx.Param(jnp.full(4, 3.0))
        return m(x) + m.extra[...]

    def check(worlds: dict[str, World], i: int) -> None:
        m = worlds["fastcall"].args[0]["deep"][1]
        assert isinstance(m.extra, nnx.Param) and float(m.extra[...][0]) == 3.0

    compare(grow, lambda: World(({"deep": [jnp.ones(4), Counted(4, 4, 0)]},)), XS, check=check)


def test_nnx_objects_in_keyword_arguments():
    def fn(x, *, models):
        m = models["m"]
        y = m(x) + models["more"][0](x)
        return y, m

    def make() -> World:
        m = Counted(4, 4, 0)
        return World((), kwargs={"models": {"m": m, "more": [m, Counted(4, 4, 1)]}})

    def fn_positional_too(pair, x, *, again):
        again[0].count[...] += 100
        return pair[0](x), pair[0]

    worlds, _ = compare(fn, make, XS)
    models = worlds["fastcall"].kwargs["models"]
    assert models["more"][0] is models["m"] and int(models["m"].count[...]) == 6

    def make_mixed() -> World:
        m = Counted(4, 4, 0)
        return World(((m, Norm(4, 4, 1)),), kwargs={"again": [m]})

    worlds, _ = compare(fn_positional_too, make_mixed, XS)
    (pair,), again = worlds["fastcall"].args, worlds["fastcall"].kwargs["again"]
    assert again[0] is pair[0] and int(pair[0].count[...]) == 303


def test_returned_objects_from_a_container_are_the_callers_own():
    def fn(tree, x):
        y = tree[0](x)
        return tree[0], tree, tree[1]["opt"], tree[0].linear.kernel, y

    tx = optax.sgd(0.1)

    def make() -> World:
        model = Counted(4, 4, 0)
        return World(([model, {"opt": nnx.Optimizer(model, tx, wrt=nnx.Param)}],))

    worlds, _ = compare(fn, make, XS)
    w = worlds["fastcall"]
    (tree,) = w.args
    out = fastcall.jit(fn)(tree, X)
    assert out[0] is tree[0]
    assert out[1][0] is tree[0] and out[1][1]["opt"] is tree[1]["opt"]
    assert out[2] is tree[1]["opt"]
    assert out[3] is tree[0].linear.kernel


# ---- structural changes through shared objects; new objects holding the caller's ----


class Wrap(nnx.Module):
    def __init__(self, inner: Any) -> None:
        self.inner = inner


def test_structural_change_on_a_module_passed_twice():
    """[a, a]: both places are one module; a Variable added through one is the caller's."""

    def fn(ms, x):
        ms[0].extra = nnx.Param(jnp.sum(x) * jnp.ones(3))
        return ms[1](x) + ms[1].extra[...].sum()

    def check(worlds: dict[str, World], i: int) -> None:
        (ms,) = worlds["fastcall"].args
        assert ms[0] is ms[1] and type(ms[0].extra) is nnx.Param

    def make() -> World:
        m = Counted(4, 4, 0)
        return World(([m, m],))

    compare(fn, make, XS, check=check)


def test_structural_changes_through_a_submodule_shared_between_arguments():
    def fn(a, b, x):
        b.inner.bias = nnx.Param(jnp.full((4,), jnp.sum(x)))  # seen through a.inner too
        a.added = nnx.Param(jnp.ones(1))
        return a.inner(x)

    def check(worlds: dict[str, World], i: int) -> None:
        a, b, shared = worlds["fastcall"].args + worlds["fastcall"].keep
        assert a.inner is b.inner is shared and type(a.added) is nnx.Param

    def make() -> World:
        shared = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        return World((Wrap(shared), Wrap(shared)), keep=(shared,))

    compare(fn, make, XS, check=check)


def test_submodules_swapped_between_arguments_that_share_one():
    def fn(a, b, x):
        a.inner, b.inner = b.inner, a.inner
        return a.inner(x) + b.other(x)

    def check(worlds: dict[str, World], i: int) -> None:
        a, b, p, q = worlds["fastcall"].args + worlds["fastcall"].keep
        assert (a.inner, b.inner) == ((q, p) if i % 2 == 0 else (p, q)) and b.other is p

    def make() -> World:
        p, q = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(1))
        b = Wrap(q)
        b.other = p
        return World((Wrap(p), b), keep=(p, q))

    compare(fn, make, XS, check=check)


@pytest.mark.parametrize("what", ["submodule", "variable", "argument", "in a list"])
def test_a_new_object_returned_holds_the_callers_objects(what):
    """nnx.jit links a new returned object to the caller's objects it holds."""

    def fn(m, x):
        inner = {"submodule": m.linear, "variable": m.linear.kernel, "argument": m, "in a list": nnx.List([m.linear])}[what]
        m.count[...] += 1
        return Wrap(inner), m.linear(x)

    compare(fn, lambda: World((Counted(4, 4, 0),)), XS)
    for jit in (nnx.jit, fastcall.jit):  # the oracle, then fastcall: the same links
        f, m = jit(fn), Counted(4, 4, 0)
        for _ in range(3):
            wrapped, _ = f(m, X)
            want = {"submodule": m.linear, "variable": m.linear.kernel, "argument": m, "in a list": m.linear}[what]
            assert (wrapped.inner[0] if what == "in a list" else wrapped.inner) is want, jit


def test_an_object_put_in_an_argument_and_returned_is_one_object():
    def fn(m, x):
        m.extra = nnx.Linear(4, 2, rngs=nnx.Rngs(3))
        m.kl = nnx.Param(jnp.sum(m.linear(x)))
        return m.extra, m.kl, m.extra(x)

    compare(fn, lambda: World((Counted(4, 4, 0),)), XS)
    for jit in (nnx.jit, fastcall.jit):  # the oracle, then fastcall
        f, m = jit(fn), Counted(4, 4, 0)
        for _ in range(3):
            extra, kl, _ = f(m, X)
            assert extra is m.extra and kl is m.kl, jit


@pytest.mark.skipif(not hasattr(nnx, "with_vars"), reason="this flax has no nnx.with_vars")
def test_a_ref_mode_module_created_inside_is_returned_with_values():
    """flax's TestVariableRefMode::test_simple_jit: jax cannot return a mutable array
    reference, so (as nnx.jit) its value comes out and a new reference is made outside."""
    m1 = nnx.with_vars(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), ref=True)

    def fn(m, x):
        out = nnx.with_vars(nnx.Linear(1, 1, rngs=nnx.Rngs(1)), ref=True)
        out.kernel[...] = out.kernel[...] + m.kernel[...] * x
        return out

    got, want = fastcall.jit(fn)(m1, 2.0), nnx.jit(fn)(m1, 2.0)
    for out in (got, want):
        assert type(out.kernel) is nnx.Param and out.kernel.get_metadata().get("ref")
    assert_trees_equal(got.kernel[...], want.kernel[...])
    got.kernel[...] = got.kernel[...] + 1  # a reference of its own
    assert float(got.kernel[...][0, 0]) == float(want.kernel[...][0, 0]) + 1


class _Sub(nnx.Module):
    def __init__(self, v: float) -> None:
        self.w = nnx.Param(jnp.full((2,), float(v)))


class _Holds(nnx.Module):
    def __init__(self, sub: nnx.Module) -> None:
        self.sub = sub
        self.b = nnx.Param(jnp.zeros(2))


def _replace_sub(m):  # a new submodule of the same structure (same graphdef, new Variables)
    m.sub = _Sub(3.0)
    return m.b[...]


def _detach_change_return(m):
    old = m.sub
    m.sub = _Sub(2.0)
    old.w[...] += 7.0
    return old


def _detach_change(m):
    old = m.sub
    m.sub = _Sub(11.0)
    old.w[...] += 3.0
    return m.b[...]


@pytest.mark.parametrize(
    "fn, options",
    [(_replace_sub, {}), (_detach_change_return, {}), (_detach_change, {"graph_updates": False})],
    ids=["submodule replaced by an equal new one", "detached, changed, returned", "detached, changed, no graph updates"],
)
def test_submodules_replaced_or_detached_inside(fn, options):
    """(Review findings.) A submodule replaced by a new one of the same structure is not
    taken for Variables replaced in the old one (that corrupted the old submodule, shared
    with a model not passed in); a detached submodule changed and returned comes back with
    its new state; without graph updates a changed Variable of a detached submodule is
    written back."""
    _needs_options(options)
    results = {}
    for name, jit in (("nnx.jit", nnx.jit), ("fastcall", fastcall.jit)):
        enc = _Sub(1.0)
        m, other = _Holds(enc), _Holds(enc)  # (other shares the submodule, and is not passed)
        f = jit(fn, **options)
        outs = [f(m) for _ in range(2)]
        results[name] = (
            [canon(o, World((m, other))) for o in outs],
            m.sub is enc,
            state_of((m, other)),
        )
    assert_trees_equal(results["fastcall"][0], results["nnx.jit"][0])
    assert results["fastcall"][1] == results["nnx.jit"][1]
    assert_trees_equal(results["fastcall"][2], results["nnx.jit"][2])


# ---- jax mutable array references (jax.new_ref), graph nodes to nnx.jit ----


def test_a_reference_argument_is_traced_changed_in_place_and_returned_as_itself():
    """As nnx.jit (flax's test_mutable_array_input_output): one compile for any reference
    of the same type; the caller's reference changed in place and returned as itself; a
    reference made inside comes back as a new reference holding its value."""

    def fn(r, d, x):
        r[...] += x
        d["r"][...] *= 2.0
        return r, [d["r"]], jax.new_ref(x * 10.0)

    outs = {}
    for name, jit in (("nnx.jit", nnx.jit), ("fastcall", fastcall.jit)):
        f = jit(fn)
        for i in range(3):
            r, q = jax.new_ref(jnp.array(1.0)), jax.new_ref(jnp.array(3.0))
            back, in_list, made = f(r, {"r": q}, jnp.array(float(i)))
            assert back is r and in_list[0] is q and float(r[...]) == 1.0 + i and float(q[...]) == 6.0
            assert isinstance(made, jax.Ref) and float(made[...]) == 10.0 * i
            outs.setdefault(name, []).append(float(made[...]))
        if name == "fastcall":
            assert f.stats().compiles == 1
    assert outs["fastcall"] == outs["nnx.jit"]


@pytest.mark.parametrize("jit, options", [
    (fastcall.filter_jit, {"donate": "all"}),
    (fastcall.jit, {"donate": "all-except-first"}),
    (fastcall.jit, {"in_shardings": "one"}),
])
def test_a_reference_argument_with_donation_or_shardings(jit, options):
    """(Review finding.) Every leaf written back (donation, in_shardings) never includes a
    reference, which jax cannot return; a reference gets its one sharding."""
    if options.get("in_shardings") == "one":
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        options = {"in_shardings": (one, one)}

    def fn(r, x):
        r[...] += x
        return r[...] * 2

    f, r = jit(fn, **options), jax.new_ref(jnp.ones(2))
    outs = [f(r, jnp.ones(2)) for _ in range(2)]
    assert [o.tolist() for o in outs] == [[4.0, 4.0], [6.0, 6.0]] and r[...].tolist() == [3.0, 3.0]


def test_a_reference_made_inside_without_nnx_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fastcall._nnx_gate, "flax_imported", lambda: False)  # (as if flax were not loaded)
    f = fastcall.jit(lambda x: jax.new_ref(x))
    # (ours; an older jax, whose traced reference passes for an array, raises its own)
    with pytest.raises(ValueError, match="not an array|mutable array references cannot be returned"):
        f(jnp.ones(2))


def test_rngs_in_a_dict():
    def fn(d, x):
        return d["m"](x) + jax.random.normal(d["rngs"].noise(), x.shape)

    def make() -> World:
        return World(({"rngs": nnx.Rngs(0, noise=1), "m": Norm(4, 4, 2)},))

    def check(worlds: dict[str, World], i: int) -> None:
        assert int(worlds["fastcall"].args[0]["rngs"].noise.count[...]) == i + 1

    compare(fn, make, XS, check=check)


def test_traces_no_more_often_than_nnx_jit():
    """The same objects again, values changed in place, a list element replaced by a module
    of the same structure: no new trace under nnx.jit. A module appended: one."""

    def fn(ms, x):
        total = x
        for m in ms:
            total = m(total)
        return total

    def mutate(w: World, i: int) -> None:
        (ms,) = w.args
        if i == 2:
            ms[0].linear.kernel[...] = ms[0].linear.kernel[...] * 2.0
            ms[1].count[...] += 3
        elif i == 3:
            ms[1] = Counted(4, 4, 7)
        elif i == 5:
            ms.append(Counted(4, 4, 8))

    make = lambda: World(([Counted(4, 4, 0), Counted(4, 4, 1)],))  # noqa: E731
    _, traces = compare(fn, make, [(X,)] * 7, mutate=mutate)
    assert traces["nnx.jit"] == 2 and traces["fastcall"] >= 1


# ---- properties: random nested containers, random mutations between calls ----


class Acc(nnx.Module):
    """The property tests' small module: Linear with a call counter and an accumulator."""

    def __init__(self, seed: int):
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(seed))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.cache = nnx.Cache(jnp.zeros(3))

    def __call__(self, x):
        self.count[...] += 1
        y = self.linear(x) + 0.1 * self.count[...]
        self.cache[...] = self.cache[...] + jnp.sum(y, axis=0)
        return y


class Drop(nnx.Module):
    """Linear, BatchNorm, Dropout: for eval()/train()."""

    def __init__(self, seed: int):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.linear(x)))


def new_module(key: int) -> nnx.Module:
    return Drop(key) if key % 4 == 3 else Acc(key)


# A spec says how to build a twin: ("module", key) (one object per key: a key at two
# positions is a shared module), ("array", v), ("int", v), ("float", v), ("tuple" | "list",
# (spec, ...)), ("dict", ((name, spec), ...)).
LEAF = st.one_of(
    st.tuples(st.just("module"), st.integers(0, 3)),
    st.tuples(st.just("array"), st.integers(-2, 2)),
    st.tuples(st.just("int"), st.integers(-2, 2)),
    st.tuples(st.just("float"), st.sampled_from([0.5, -1.5])),
)


def container(depth: int) -> st.SearchStrategy:
    sub = LEAF if depth <= 1 else st.one_of(LEAF, container(depth - 1))
    return st.one_of(
        st.tuples(st.just("tuple"), st.lists(sub, min_size=1, max_size=3).map(tuple)),
        st.tuples(st.just("list"), st.lists(sub, min_size=1, max_size=3).map(tuple)),
        st.tuples(st.just("dict"), st.dictionaries(st.sampled_from("abc"), sub, min_size=1, max_size=3)
                  .map(lambda d: tuple(sorted(d.items())))),
    )


def has_module(spec: tuple) -> bool:
    kind, v = spec
    if kind == "module":
        return True
    if kind in ("tuple", "list"):
        return any(has_module(s) for s in v)
    if kind == "dict":
        return any(has_module(s) for _, s in v)
    return False


def build(spec: tuple, pool: dict[int, nnx.Module]) -> Any:
    kind, v = spec
    if kind == "module":
        if v not in pool:
            pool[v] = new_module(v)
        return pool[v]
    if kind == "array":
        return jnp.full(3, float(v))
    if kind in ("int", "float"):
        return v
    if kind == "tuple":
        return tuple(build(s, pool) for s in v)
    if kind == "list":
        return [build(s, pool) for s in v]
    return {k: build(s, pool) for k, s in v}


def walk(tree: Any):
    """Leaves and lists of a nested container, in a fixed order."""
    if isinstance(tree, (tuple, list)):
        if isinstance(tree, list):
            yield ("list", tree)
        for item in tree:
            yield from walk(item)
    elif isinstance(tree, dict):
        for k in sorted(tree):
            yield from walk(tree[k])
    else:
        yield ("leaf", tree)


def modules_in(tree: Any) -> list[nnx.Module]:
    return [leaf for kind, leaf in walk(tree) if kind == "leaf" and isinstance(leaf, nnx.Module)]


def lists_in(tree: Any) -> list[list]:
    return [lst for kind, lst in walk(tree) if kind == "list"]


def apply_all(tree, x):
    """Calls every module (a shared one once per position) and adds every array and scalar;
    returns the first module too."""
    total = jnp.zeros((2, 3))
    for kind, leaf in walk(tree):
        if kind == "leaf":
            total = total + (leaf(x) if isinstance(leaf, nnx.Module) else leaf)
    found = modules_in(tree)
    return total, (found[0] if found else None)


def _pick(items: list, k: int) -> Any:
    return items[k % len(items)] if items else None


def _mutate(tree: Any, pool: dict[int, nnx.Module], op: str, k: int, i: int) -> None:
    """One mutation outside the compiled function, the same on each twin."""
    m = _pick(modules_in(tree), k)
    lst = _pick(lists_in(tree), k)
    if op == "value" and m is not None:
        m.linear.bias[...] = jnp.full(3, 0.1 * (k % 7))
    elif op == "bump" and m is not None:
        if isinstance(m, Acc):
            m.count[...] += 1
        else:
            m.bn.mean[...] += 1.0
    elif op == "replace_submodule" and m is not None:
        m.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(100 + i))
    elif op == "eval" and m is not None:
        m.eval()
    elif op == "train" and m is not None:
        m.train()
    elif op in ("replace_element", "append") and lst is not None:
        if k % 3 == 0:  # a new module
            key = 1000 + 4 * i + k % 4
            pool[key] = new = new_module(key)
        elif k % 3 == 1:  # a module already there: now shared
            new = _pick(list(pool.values()), k)
        else:
            new = jnp.full(3, float(k % 5))
        if op == "append" or not lst:
            lst.append(new)
        else:
            lst[k % len(lst)] = new


OPS = ["call", "call", "value", "bump", "replace_submodule", "eval", "train", "replace_element", "append"]


# Half the profile's examples: the test runs once per hot path (c, python).
@settings(
    max_examples=max(1, settings.default.max_examples // 2),
    suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.function_scoped_fixture],
)
@given(
    container(3).filter(has_module),
    st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 100)), min_size=1, max_size=6),
    st.booleans(),
)
def test_nnx_in_random_containers_never_stale(spec, ops, by_keyword):
    fastcall.clear_caches()
    traces = {"fastcall": 0, "nnx.jit": 0}

    def counted(who: str) -> Callable:
        def traced(tree, x):
            traces[who] += 1
            return apply_all(tree, x)

        return traced

    runners = {"fastcall": fastcall.jit(counted("fastcall")), "nnx.jit": nnx.jit(counted("nnx.jit"))}
    pools: dict[str, dict[int, nnx.Module]] = {who: {} for who in runners}
    trees = {who: build(spec, pools[who]) for who in runners}
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    for i, (op, k) in enumerate(ops):
        outs = {}
        for who, run in runners.items():
            tree = trees[who]
            if op != "call":
                _mutate(tree, pools[who], op, k, i)
            before = [leaf for kind, leaf in walk(tree) if kind == "leaf"]
            out = run(tree=tree, x=x) if by_keyword else run(tree, x)
            after = [leaf for kind, leaf in walk(tree) if kind == "leaf"]
            assert len(before) == len(after) and all(a is b for a, b in zip(before, after))
            outs[who] = canon(out, World((tree,)))
        np.testing.assert_allclose(outs["fastcall"][0], outs["nnx.jit"][0], rtol=1e-5, atol=1e-6)
        assert_trees_equal(outs["fastcall"][1], outs["nnx.jit"][1])  # the caller's own first module
        assert_same_world(World((trees["fastcall"],)), World((trees["nnx.jit"],)))
    assert traces["fastcall"] <= traces["nnx.jit"], traces


@pytest.mark.parametrize("prefix", ["per_entry", "array_entry", "one"])
def test_in_shardings_for_a_dict_holding_an_nnx_object_as_nnx_jit_places_it(prefix):
    """in_shardings as a pytree prefix of a container that holds an NNX object beside an
    array: each entry for the leaves under it (the object's too), as nnx.jit places them."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = {
        "per_entry": ({"enc": sharding, "b": None}, None),
        "array_entry": ({"enc": None, "b": sharding}, sharding),
        "one": (sharding, None),
    }[prefix]

    def f(c, x):
        return c["enc"](x) + c["b"] * 2

    def make():
        return {"enc": nnx.Linear(3, 3, rngs=nnx.Rngs(0)), "b": jnp.ones(3)}

    x = jnp.ones((1, 3))
    wrapped, peer = fastcall.jit(f, in_shardings=shardings), nnx.jit(f, in_shardings=shardings)
    c = make()
    for _ in range(2):
        ours, theirs = wrapped(c, x), peer(make(), x)
        assert jnp.array_equal(ours, theirs) and ours.sharding == theirs.sharding
    assert jnp.array_equal(ours, f(make(), x))
    assert wrapped.stats().compiles == 1


def test_a_static_leaf_beside_an_nnx_object_in_a_new_container_is_compared_by_value(hot_path):
    """filter_jit's rule makes a Python int static: a new dict holding the model, an array and
    such an int each call is served by the structure route while the int equals the recorded
    one, and compiles anew for another (as the general path keys it)."""
    model = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    b, x = jnp.ones(3), jnp.ones((1, 3))

    def f(c, x):
        return c["m"](x) * c["k"] + c["b"]

    wrapped = fastcall.filter_jit(f)
    routes = []
    for k in (2, 2, 3, 3):
        out, route = served(wrapped, {"m": model, "k": k, "b": b}, x)
        assert jnp.array_equal(out, f({"m": model, "k": k, "b": b}, x))
        routes.append(route)
    assert routes == ["general", STRUCTURE_PATH[hot_path], "general", STRUCTURE_PATH[hot_path]]
    assert wrapped.stats().compiles == 2


class _Extras(nnx.Module):
    """A model that may gain a dict of Params after its first call."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones(3))

    def __call__(self, x):
        out = self.w[...] * x
        for k in sorted(getattr(self, "extra", {})):
            out = out + self.extra[k][...]
        return out


def _gain_extras(jit, hot_path=None):
    """Call `jit(...)` on a model, give it a dict of Params, then add one in place: the
    outputs, and the route of each call (if `hot_path`)."""
    model, x = _Extras(), jnp.ones(3)
    f = jit(lambda m, x: m(x))
    steps = [
        lambda: None,
        lambda: setattr(model, "extra", nnx.data({"a": nnx.Param(jnp.ones(3))}) if hasattr(nnx, "data") else {"a": nnx.Param(jnp.ones(3))}),
        lambda: None,
        lambda: model.extra.__setitem__("b", nnx.Param(jnp.full(3, 5.0))),
        lambda: None,
    ]
    outs, routes = [], []
    for change in steps:
        change()
        out, route = served(f, model, x) if hot_path else (f(model, x), None)
        outs.append(out)
        routes.append(route)
    return outs, routes


def test_a_dict_new_in_the_graph_of_a_model_seen_before_is_watched_from_then_on(hot_path):
    """A model that gains a plain dict of Variables (which changes in place without a hook)
    is read again and guarded from then on: an item added in place is seen, as nnx.jit sees it."""
    ours, routes = _gain_extras(fastcall.jit, hot_path)
    theirs, _ = _gain_extras(nnx.jit)
    assert [float(o[0]) for o in ours] == [float(o[0]) for o in theirs] == [1.0, 2.0, 2.0, 7.0, 7.0]
    assert routes[2] == FAST_PATH[hot_path] and routes[4] == FAST_PATH[hot_path]
    assert routes[1] == routes[3] == "general"

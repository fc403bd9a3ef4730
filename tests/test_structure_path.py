"""The structure path: a new object of a structure the function has run (the model a
training step returned, a new params dict each call) is read by that structure's
generated code instead of the general path's resolution, in C and in Python.

Each test checks the result against the eager call and the peer, and the route that
served the call; anything that differs from the structure the record was made for
(another static value, another list length, a Python scalar where an array was, a tracer)
must decline to the general path and still give the right answer."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastcall

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, served
from .models import HashRunsCode, OddArray

pytestmark = pytest.mark.usefixtures("hot_path")

X = jnp.arange(4.0)


class ListNet(eqx.Module):
    layers: list
    scale: float = eqx.field(static=True)

    def __init__(self, key, n=2, scale=1.0):
        self.layers = [eqx.nn.Linear(4, 4, key=k) for k in jax.random.split(key, n)]
        self.scale = scale

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x * self.scale


def _call(m, x):
    return m(x)


def _models(n, **kw):
    return [ListNet(jax.random.PRNGKey(i), **kw) for i in range(n)]


def test_new_objects_of_a_known_structure_take_the_structure_path(hot_path):
    f, peer = fastcall.jit(_call), eqx.filter_jit(_call)
    models = _models(5)
    routes = []
    for m in models:
        y, route = served(f, m, X)
        routes.append(route)
        assert_trees_equal(y, m(X))
        assert_trees_equal(y, peer(m, X))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 4
    assert f.stats().compiles == 1


@pytest.mark.parametrize(
    "other",
    [
        lambda: ListNet(jax.random.PRNGKey(9), n=3),  # another list length
        lambda: ListNet(jax.random.PRNGKey(9), scale=2.0),  # another static value
        lambda: eqx.tree_at(lambda m: m.layers[0].bias, ListNet(jax.random.PRNGKey(9)), 1.0),  # (static in a module)
    ],
    ids=["list length", "static value", "python scalar leaf"],
)
def test_anything_else_declines_to_the_general_path(other, hot_path):
    f, peer = fastcall.jit(_call), eqx.filter_jit(_call)
    for m in _models(2):
        f(m, X)
    m = other()
    y, route = served(f, m, X)
    assert route == "general"
    assert_trees_equal(y, m(X))
    assert_trees_equal(y, peer(m, X))
    # and the record's own structure is served again afterwards
    f(_models(3)[2], X)
    y, route = served(f, _models(4)[3], X)
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, _models(4)[3](X))


def test_another_leaf_shape_compiles_for_it(hot_path):
    f = fastcall.jit(_call)
    for m in _models(2):
        f(m, X)
    m = eqx.tree_at(lambda m: m.layers[0].bias, _models(3)[2], jnp.ones(1))  # broadcasts
    y, route = served(f, m, X)
    assert route == STRUCTURE_PATH[hot_path]  # the same structure: jax.jit keys the shape
    assert_trees_equal(y, m(X))
    assert f.stats().compiles == 2


def test_a_list_changed_in_place_is_read_afresh(hot_path):
    f = fastcall.jit(_call)
    a, b, c = _models(3)
    f(a, X), f(b, X)
    c.layers.append(eqx.nn.Linear(4, 4, key=jax.random.PRNGKey(7)))
    y, route = served(f, c, X)
    assert route == "general"
    assert_trees_equal(y, c(X))
    c.layers.pop()
    y, route = served(f, c, X)
    assert_trees_equal(y, c(X))


def test_training_loop_returning_new_models(hot_path):
    """`model = step(model, x)`: each step's model is the previous step's output."""

    def step(m, x):
        grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))(m, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, m, grads)

    f, peer = fastcall.jit(step), eqx.filter_jit(step)
    m_fc = m_peer = _models(1)[0]
    routes = []
    for _ in range(5):
        before = m_fc
        m_fc, route = served(f, m_fc, X)
        routes.append(route)
        m_peer = peer(m_peer, X)
        assert_trees_equal(m_fc, m_peer)
        assert type(m_fc) is ListNet and m_fc is not before
    assert routes[-3:] == [STRUCTURE_PATH[hot_path]] * 3
    assert f.stats().compiles == 1


def test_new_params_dict_each_call(hot_path):
    def step(params, x):
        return {k: v + x for k, v in params.items()}

    f = fastcall.jit(step)
    params = {"a": jnp.zeros(4), "b": jnp.ones(4)}
    routes = []
    for _ in range(4):
        want = {k: v + X for k, v in params.items()}
        params, route = served(f, params, X)
        routes.append(route)
        assert_trees_equal(params, want)
    assert routes[-2:] == [STRUCTURE_PATH[hot_path]] * 2
    # the same dict passed again is held and served fast (`_hold.hold`)
    routes = [served(f, params, X)[1] for _ in range(4)]
    assert routes[-1] == FAST_PATH[hot_path], routes


def test_a_new_object_that_reuses_a_dead_ones_id_is_not_passed_again(hot_path):
    """A new batch dict (or a new Equinox model) each call: Python often gives it the id of
    the one the previous call read, now dead. It must not be taken for that object passed
    again (which the general path would cache by identity): every call after the first
    takes the structure path."""
    import gc

    def step(model, batch):
        return model(batch["x"]) * batch["y"]

    f = fastcall.jit(step)
    (model,) = _models(1)
    routes = []
    for i in range(5):
        batch = {"x": X + i, "y": X}
        out, route = served(f, model, batch)
        assert_trees_equal(out, step(model, batch))
        routes.append(route)
        del batch
    # (the second call also passes the model again: the general path caches it by identity)
    assert routes == ["general", "general"] + [STRUCTURE_PATH[hot_path]] * 3

    def two(m, x):
        return m(x)

    g = fastcall.jit(two)
    ids, routes = set(), []
    for i in range(5):
        (m,) = _models(1, scale=1.0)
        ids.add(id(m))
        out, route = served(g, m, X)
        assert_trees_equal(out, m(X))
        routes.append(route)
        del m
        gc.collect()
    assert routes[1:] == [STRUCTURE_PATH[hot_path]] * 4, (routes, len(ids))


def test_the_same_object_again_goes_on_to_the_fast_path(hot_path):
    f = fastcall.jit(_call)
    a, b = _models(2)
    f(a, X)
    routes = [served(f, b, X)[1] for _ in range(4)]
    assert routes == [STRUCTURE_PATH[hot_path], "general", "general", FAST_PATH[hot_path]]


def test_errors_and_checks_on_the_structure_path(hot_path):
    def checked(m, x):
        y = m(x)
        return eqx.error_if(y, x[0] > 0, "x[0] must not be positive")

    f = fastcall.jit(checked)
    for m in _models(2):
        f(m, -X)
    m = _models(3)[2]
    with pytest.raises(eqx.EquinoxRuntimeError, match="must not be positive"):
        f(m, X + 1)
    y, route = served(f, _models(4)[3], -X)  # the wrapper keeps working
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, _models(4)[3](-X))


def test_a_checked_output_is_finished_without_the_general_post(hot_path, monkeypatch):
    """An output that waits on `eqx.error_if` checks (no output plan: `OutInfo.fast_post`
    calls `OutInfo.result`) is finished by the hit routes directly; the error still reaches
    the caller, and the wrapper keeps working."""
    from fastcall._outputs import OutInfo

    def checked(m, x):
        return eqx.error_if(m(x), x[0] > 0, "x[0] must not be positive")

    f, peer = fastcall.jit(checked), eqx.filter_jit(checked)
    models = _models(4)
    for m in models[:2]:
        f(m, -X)
    for _ in range(2):
        f(models[0], -X)  # (its fast record)

    def refuse(*args):
        raise AssertionError("the general post ran")

    monkeypatch.setattr(OutInfo, "finish", refuse)
    for m, route in ((models[0], FAST_PATH[hot_path]), (models[3], STRUCTURE_PATH[hot_path])):
        y, served_by = served(f, m, -X)
        assert served_by == route
        assert_trees_equal(y, peer(m, -X))
        with pytest.raises(eqx.EquinoxRuntimeError, match="must not be positive"):
            f(m, X + 1)


def test_tracers_decline(hot_path):
    f = fastcall.jit(_call)
    for m in _models(2):
        f(m, X)
    m = _models(3)[2]
    y = jax.jit(lambda m, x: f(m, x))(m, X)  # the new object holds tracers inside jax.jit
    assert_trees_equal(y, m(X))
    assert jax.grad(lambda m: jnp.sum(f(m, X)))(m) is not None


def test_clear_caches_drops_structure_records(hot_path):
    f = fastcall.jit(_call)
    for m in _models(2):
        f(m, X)
    fastcall.clear_caches()
    y, route = served(f, _models(3)[2], X)
    assert route == "general"
    assert_trees_equal(y, _models(3)[2](X))


def test_explain_names_the_structure_path(hot_path):
    f = fastcall.jit(_call)
    for m in _models(2):
        f(m, X)
    report = f.explain(_models(3)[2], X)
    assert report.route == "structure" and not report.reasons
    assert "structure this function has run" in report.arguments[0].kind


# --------------------------------------------------------------------------
# NNX arguments on the structure path: `step(model, optimizer, x, y)`, each NNX argument
# read from its cache entry (the general path's reading, without resolving the call)

from flax import nnx  # noqa: E402
import optax  # noqa: E402

from .conftest import state_of  # noqa: E402


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def _train_step(model, optimizer, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _pair(model=None):
    model = Net(nnx.Rngs(0)) if model is None else model
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _steps_against_the_peer(build, n):
    """`n` training steps under fastcall.jit and nnx.jit, on twin (model, optimizer) pairs
    from `build`, each loss and all state equal; the routes that served them, the wrapper
    and its model."""
    (m, opt), (ref_m, ref_opt) = build(), build()
    f, peer = fastcall.jit(_train_step), nnx.jit(_train_step)
    routes = []
    for _ in range(n):
        loss, route = served(f, m, opt, XB, YB)
        routes.append(route)
        assert_trees_equal(loss, peer(ref_m, ref_opt, XB, YB))
        assert_trees_equal(state_of(m), state_of(ref_m))
        assert_trees_equal(state_of(opt), state_of(ref_opt))
    return routes, f, m


XB, YB = jnp.ones((2, 4)), jnp.zeros((2, 4))

# An NNX object holding plain lists or dicts (an optimizer's optax state, an nnx.State) is
# read once on its first call and walked for them on its second (`_entries._build`): two calls
# on the general path before a structure record serves it.
_READ_TWICE = ["general"] * 2


def test_nnx_training_step_takes_the_structure_path(hot_path):
    routes, f, _ = _steps_against_the_peer(_pair, 4)
    assert routes == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2
    assert f.stats().compiles == 1


def test_nnx_changes_between_steps_go_to_the_general_path(hot_path):
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(_train_step), nnx.jit(_train_step)

    def step():
        loss, route = served(f, m, opt, XB, YB)
        assert_trees_equal(loss, peer(ref_m, ref_opt, XB, YB))
        assert_trees_equal(state_of(m), state_of(ref_m))
        return route

    step(), step()
    for obj in (m, ref_m):
        obj.eval()  # a flip: switched to by the general path
    assert step() == "general"
    assert step() == STRUCTURE_PATH[hot_path]
    new = nnx.Linear(4, 4, rngs=nnx.Rngs(3))
    m.l2, ref_m.l2 = new, nnx.clone(new)  # a structure change: re-read by the general path
    assert step() == "general"
    assert step() == STRUCTURE_PATH[hot_path]


_PACKS = {
    "tuple": lambda m, opt: (m, opt),
    "list": lambda m, opt: [m, opt],
    # (keys inserted out of jax's sorted order: the objects are read in the general path's)
    "dict": lambda m, opt: {"optimizer": opt, "model": m},
}


@pytest.mark.parametrize("kind", list(_PACKS))
def test_nnx_objects_in_a_tuple_take_the_structure_path(kind, hot_path):
    """`step((model, optimizer), x, y)`, a new tuple (list, dict) each call: each object
    read from its cache entry; anything changed goes to the general path first."""

    def step(mo, x, y):
        if isinstance(mo, dict):
            return _train_step(mo["model"], mo["optimizer"], x, y)
        return _train_step(*mo, x, y)

    pack = _PACKS[kind]

    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(step), nnx.jit(step)

    def call():
        loss, route = served(f, pack(m, opt), XB, YB)
        assert_trees_equal(loss, peer(pack(ref_m, ref_opt), XB, YB))
        assert_trees_equal(state_of(m), state_of(ref_m))
        assert_trees_equal(state_of(opt), state_of(ref_opt))
        return route

    assert [call() for _ in range(4)] == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2
    report = f.explain(pack(m, opt), XB, YB)
    assert report.route == "structure" and "no flatten" in report.arguments[0].per_call
    new = nnx.Linear(4, 4, rngs=nnx.Rngs(3))
    m.l2, ref_m.l2 = new, nnx.clone(new)  # a structure change: re-read by the general path
    assert call() == "general"
    assert call() == STRUCTURE_PATH[hot_path]
    # another object in the tuple (a fresh optimizer, same transformation): the general path
    opt, ref_opt = nnx.Optimizer(m, opt.tx, wrt=nnx.Param), nnx.Optimizer(ref_m, ref_opt.tx, wrt=nnx.Param)
    assert [call() for _ in range(3)] == _READ_TWICE + [STRUCTURE_PATH[hot_path]]
    assert f.stats().compiles == 1


class _Deep(nnx.Module):
    def __init__(self, depth, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def _forward_split(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


def test_more_leaves_than_the_c_path_holds_on_its_stack(hot_path):
    """The C path collects an NNX call's values on the C stack up to 64, then on the heap:
    a 40-layer model (80 Params, an optimizer's 160 moments besides) read there, with its
    state written back, and the functional API on its split state."""
    routes, f, m = _steps_against_the_peer(lambda: _pair(_Deep(40, nnx.Rngs(0))), 4)
    assert routes == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2

    graphdef, state = nnx.split(m)
    g, peer_g = fastcall.jit(_forward_split), nnx.jit(_forward_split)
    want = _forward_split(graphdef, state, XB)
    routes = []
    for _ in range(4):
        y, route = served(g, graphdef, state, XB)
        routes.append(route)
        assert_trees_equal(y, want)
        assert_trees_equal(y, peer_g(graphdef, state, XB))
    assert routes == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2
    assert f.stats().compiles == g.stats().compiles == 1


@pytest.mark.parametrize("kind", ["tuple", "list"])
def test_a_batch_container_beside_nnx_arguments(kind, hot_path):
    """`step(model, optimizer, (x, y))`: a container of arrays next to NNX arguments is read
    as any other pytree argument (not as a container of NNX objects)."""

    def step(model, optimizer, batch):
        return _train_step(model, optimizer, *batch)

    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(step), nnx.jit(step)
    make = tuple if kind == "tuple" else list
    routes = []
    for _ in range(4):
        loss, route = served(f, m, opt, make((XB, YB)))
        routes.append(route)
        assert_trees_equal(loss, peer(ref_m, ref_opt, make((XB, YB))))
        assert_trees_equal(state_of(m), state_of(ref_m))
        assert_trees_equal(state_of(opt), state_of(ref_opt))
    assert routes == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2


def test_nnx_objects_in_a_dict_are_read_by_key(hot_path):
    """A dict of NNX objects on the structure path: its values are read under the keys
    recorded, so objects of one structure swapped between keys are read where they now
    are; another key set, a key more or less, or another value goes to the general path.
    Values, outputs and written-back state as nnx.jit on every call."""

    def step(d, x):
        enc = d["enc"]
        enc.l1.kernel[...] = enc.l1.kernel[...] * 0.5  # (written back to whichever is "enc")
        y = enc(x)
        for key in sorted(d):
            if key != "enc":
                y = d[key](y)
        return y, enc.l2.bias[...]

    ours = [Net(nnx.Rngs(i)) for i in range(3)]
    theirs = [Net(nnx.Rngs(i)) for i in range(3)]
    for net in ours + theirs:
        net.eval()
    f, peer = fastcall.jit(step), nnx.jit(step)

    def call(make):
        out, route = served(f, make(ours), XB)
        assert_trees_equal(out, peer(make(theirs), XB))
        for a, b in zip(ours, theirs):
            assert_trees_equal(state_of(a), state_of(b))
        return route

    plain = lambda n: {"enc": n[0], "dec": n[1]}  # noqa: E731
    assert [call(plain) for _ in range(3)] == ["general"] + [STRUCTURE_PATH[hot_path]] * 2
    assert call(lambda n: {"dec": n[1], "enc": n[0]}) == STRUCTURE_PATH[hot_path]  # (insertion order)
    assert call(lambda n: {"enc": n[1], "dec": n[0]}) == STRUCTURE_PATH[hot_path]  # swapped
    other = lambda n: {"enc": n[2], "dec": n[0]}  # noqa: E731
    assert call(other) == "general"  # an object not seen before: its structure read first
    assert call(other) == STRUCTURE_PATH[hot_path]
    assert call(lambda n: {"enc": n[0], "dec": n[1], "aux": n[2]}) == "general"  # a key more
    assert call(lambda n: {"enc": n[0], "decoder": n[1]}) == "general"  # another key
    assert call(lambda n: {"enc": n[0]}) == "general"  # a key less (one object fewer)
    # (a few structure records per type of first argument: `plain`'s is still kept)
    assert [call(plain) for _ in range(2)] == [STRUCTURE_PATH[hot_path]] * 2
    assert f.stats().compiles == 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    model: Any
    optimizer: Any
    name: str = dataclasses.field(default="run", metadata=dict(static=True))


class TrainPair(NamedTuple):
    model: Any
    optimizer: Any


_OTHER_PACKS = {
    "dataclass": lambda m, opt, name="run": TrainState(m, opt, name),
    "namedtuple": lambda m, opt, name="run": TrainPair(m, opt),
    "nested tuple": lambda m, opt, name="run": (m, (opt,)),
}


@pytest.mark.parametrize("kind", list(_OTHER_PACKS))
def test_nnx_objects_in_another_pytree_take_the_structure_path(kind, hot_path):
    """A dataclass, a namedtuple or a nested tuple of NNX objects, new each call: flattened
    down to its NNX objects, its tree structure compared with the one recorded (static
    fields included; for the dataclass and namedtuple, whose objects are its own children,
    by jax's one-level flatten and its node data), each object read from its cache entry.
    Another static field, an array in an object's place or another object goes to the
    general path first."""

    def step(ts, x, y):
        model, optimizer = (ts[0], ts[1][0]) if type(ts) is tuple else (ts.model, ts.optimizer)
        return _train_step(model, optimizer, x, y)

    pack = _OTHER_PACKS[kind]
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(step), nnx.jit(step)

    def call(**kw):
        loss, route = served(f, pack(m, opt, **kw), XB, YB)
        assert_trees_equal(loss, peer(pack(ref_m, ref_opt, **kw), XB, YB))
        assert_trees_equal(state_of(m), state_of(ref_m))
        assert_trees_equal(state_of(opt), state_of(ref_opt))
        return route

    assert [call() for _ in range(4)] == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2
    report = f.explain(pack(m, opt), XB, YB)
    one_level = kind != "nested tuple"
    assert report.route == "structure"
    assert ("one level" if one_level else "tree structure compared") in report.arguments[0].per_call
    assert (f._fastcall_state.structures[type(pack(m, opt))].reads[0].keys.level is not None) == one_level
    if kind == "dataclass":  # another static field: another compile key
        assert call(name="other") == "general"
        assert call(name="other") == STRUCTURE_PATH[hot_path]
        assert f.stats().compiles == 2
    # another optimizer object: read by the general path first
    opt, ref_opt = nnx.Optimizer(m, opt.tx, wrt=nnx.Param), nnx.Optimizer(ref_m, ref_opt.tx, wrt=nnx.Param)
    assert [call() for _ in range(3)] == _READ_TWICE + [STRUCTURE_PATH[hot_path]]
    # an array where an NNX object was: not this structure (the function raises, as under nnx.jit)
    with pytest.raises(Exception) as theirs:
        peer(pack(ref_m, jnp.ones(3)), XB, YB)
    with pytest.raises(theirs.type, match=re.escape(str(theirs.value).splitlines()[0])):
        f(pack(m, jnp.ones(3)), XB, YB)
    assert call() == STRUCTURE_PATH[hot_path]


def test_nnx_arguments_sharing_variables_are_read_jointly(hot_path):
    def f(a, b, x):
        a.l1.kernel[...] = a.l1.kernel[...] + 1.0
        return b(x)

    shared = Net(nnx.Rngs(0))
    ref = nnx.clone(shared)
    g, peer = fastcall.jit(f), nnx.jit(f)
    other, ref_other = Net(nnx.Rngs(1)), Net(nnx.Rngs(1))
    for _ in range(2):
        g(other, shared, XB), peer(ref_other, ref, XB)  # disjoint: a structure record
    for i in range(3):  # now the same module twice: read jointly, as nnx.jit reads it
        y, route = served(g, shared, shared, XB)
        # (the general path first; then its record pins the entry: see test_joint_arguments)
        assert route == ("general" if i == 0 else STRUCTURE_PATH[hot_path])
        assert_trees_equal(y, peer(ref, ref, XB))
        assert_trees_equal(state_of(shared), state_of(ref))


def test_nnx_structure_path_inside_an_outer_jit(hot_path):
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f = fastcall.jit(_train_step)
    f(m, opt, XB, YB), f(m, opt, XB, YB)
    _train_step(ref_m, ref_opt, XB, YB), _train_step(ref_m, ref_opt, XB, YB)
    # Every argument concrete, but the call inside an outer jax.jit: it runs inline in that
    # trace, as nnx.jit's would (NNX then refuses to change objects from outside it); no
    # tracer may be written into the model.
    with pytest.raises(ValueError, match="different trace level"):  # (NNX's own error)
        jax.jit(lambda: f(m, opt, XB, YB))()
    assert all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
               for leaf in jax.tree_util.tree_leaves(nnx.state(m)))
    assert_trees_equal(f(m, opt, XB, YB), _train_step(ref_m, ref_opt, XB, YB))


class _Counting(nnx.Module):
    """A layer that counts its calls in a Variable, and (`raw`) in a raw array attribute."""

    def __init__(self, raw: bool):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.raw = nnx.data(jnp.zeros(())) if raw else None

    def __call__(self, x):
        self.calls[...] += 1
        if self.raw is not None:
            self.raw = self.raw + 1.0
        return self.linear(x), {"calls": self.calls[...]}


@pytest.mark.parametrize("raw", [False, True], ids=["variables", "raw leaf"])
@pytest.mark.parametrize("alone", [True, False], ids=["fast", "structure"])
def test_write_back_of_new_values_skips_the_general_write_back(raw, alone, hot_path, monkeypatch):
    """A call that changes NNX objects only by new values of Variables (and raw array
    leaves): both hit routes, C and Python, set them by `LeafWrites` (no general write-back;
    tests/test_leaf_writes.py). Either way: values, returned structure and state as nnx.jit,
    every call."""
    from fastcall._nnx import _adapter

    python_writes = []
    real = _adapter.write_back
    monkeypatch.setattr(_adapter, "write_back", lambda *a: python_writes.append(1) or real(*a))
    step = (lambda m, x: m(x)) if alone else (lambda pair, x: pair[0](x)[0] + pair[1](x)[0])
    ours, theirs = [_Counting(raw), _Counting(raw)], [_Counting(raw), _Counting(raw)]
    f, peer = fastcall.jit(step), nnx.jit(step)
    args = (lambda ms: (ms[0], XB)) if alone else (lambda ms: ((ms[0], ms[1]), XB))
    for i in range(4):
        out, route = served(f, *args(ours))
        assert_trees_equal(out, peer(*args(theirs)))
        assert_trees_equal(state_of(ours[0]), state_of(theirs[0]))
        assert_trees_equal(state_of(ours[1]), state_of(theirs[1]))
        if i > 0:
            assert route == (FAST_PATH if alone else STRUCTURE_PATH)[hot_path]
    assert int(ours[0].calls[...]) == 4
    assert len(python_writes) == 1  # (the first call: the general path)
    if raw:
        assert float(ours[0].raw) == 4.0 and type(ours[0].raw) is type(theirs[0].raw)


def test_a_variable_on_its_own_takes_the_structure_path(hot_path):
    """`f(model.kernel, x)`: a Variable has no cache entry (it cannot be weakly referenced),
    so the structure path reads it by type and metadata, compared with the last call's, and
    its value; a Variable of another type or metadata goes to the general path (and
    compiles, as under nnx.jit)."""

    def scale(v, x):
        v[...] = v[...] * 2.0  # (written back, as nnx.jit does)
        return x * v[...]

    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    f, peer = fastcall.jit(scale), nnx.jit(scale)

    def call(pick, x=XB):
        out, route = served(f, pick(ours), x)
        assert_trees_equal(out, peer(pick(theirs), x))
        assert_trees_equal(state_of(ours), state_of(theirs))
        return route

    bias = lambda n: n.l1.bias  # noqa: E731
    assert [call(bias) for _ in range(3)] == ["general"] + [STRUCTURE_PATH[hot_path]] * 2
    assert call(lambda n: n.l2.bias) == STRUCTURE_PATH[hot_path]  # another Variable, same type and metadata
    assert f.explain(ours.l1.bias, XB).route == "structure"
    for n in (ours, theirs):
        n.l1.bias.set_metadata("note", "changed")  # (metadata selects the program)
    assert [call(bias) for _ in range(2)] == ["general", STRUCTURE_PATH[hot_path]]
    for n in (ours, theirs):
        n.extra = nnx.BatchStat(jnp.ones(4))
    assert [call(lambda n: n.extra) for _ in range(2)] == ["general", STRUCTURE_PATH[hot_path]]  # another type
    assert f.stats().compiles == 3
    odd = nnx.Param(jnp.ones(4), note=["unhashable"])  # (never on the structure path: a graph walk)
    assert_trees_equal(f(odd, XB), XB * 2.0)
    assert "graph walk" in f.explain(odd, XB).arguments[0].per_call
    # before an NNX object that holds it: read jointly (the general path, then the structure
    # path's SharedVariableRead: see tests/test_nnx.py)
    g, gpeer = fastcall.jit(lambda v, m, x: scale(v, m(x))), nnx.jit(lambda v, m, x: scale(v, m(x)))
    for expected in ("general", STRUCTURE_PATH[hot_path]):
        out, route = served(g, ours.l1.bias, ours, XB)
        assert route == expected
        assert_trees_equal(out, gpeer(theirs.l1.bias, theirs, XB))
        assert_trees_equal(state_of(ours), state_of(theirs))
    # inside an outer jax.jit: run inline in that trace, as nnx.jit's call (NNX then refuses
    # the write from inside it); no tracer is written into the Variable
    from flax import errors

    for fn, n in ((f, ours), (peer, theirs)):
        with pytest.raises(errors.TraceContextError, match="different trace level"):  # (NNX's own error)
            jax.jit(lambda: fn(n.l1.bias, XB))()
    assert not isinstance(ours.l1.bias[...], jax.core.Tracer)


@dataclasses.dataclass(unsafe_hash=True)
class _Scale:
    k: float


def test_a_lone_variables_metadata_is_remembered_equal_only_while_it_holds_the_records_objects(hot_path):
    """The structure path remembers a lone Variable's metadata dict as equal to its record's
    copy (by the dict's version tag) only while the dict holds the copy's very objects.
    Metadata equal to the copy but made of other objects is compared on every call, so a
    change inside one of them is seen: here it selects another program, as under nnx.jit."""

    def g(v, x):
        return x * v[...] * v.scale.k

    f, peer = fastcall.jit(g), nnx.jit(g)
    x = jnp.ones(3)
    v1, v2 = (nnx.Param(jnp.ones(3), scale=_Scale(1.0)) for _ in range(2))  # equal, distinct objects
    routes = [served(f, v, x)[1] for v in (v1, v1, v2, v2)]
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    v2.scale.k = 3.0
    out, route = served(f, v2, x)
    assert route == "general"
    assert_trees_equal(out, g(v2, x))
    assert_trees_equal(out, peer(v2, x))
    assert float(out[0]) == 3.0


def test_metadata_changed_while_it_is_compared_is_not_remembered(hot_path, unchecked):
    """A metadata value whose `==` changes the dict it is compared from (user code runs in
    the comparison): what the structure path remembers is the dict as it was compared, so
    the next call sees the change and takes the program it selects."""
    armed: list[Any] = []

    class Odd:
        def __hash__(self):
            return 7

        def __eq__(self, other):
            if armed:
                armed.pop()._var_metadata["b"] = 2.0  # (a key compared before this one)
            return isinstance(other, Odd)

    def g(v, x):
        return x * v[...] * v.b

    f = fastcall.jit(g)
    x = jnp.ones(3)
    v1, v2 = (nnx.Param(jnp.ones(3), b=1.0, a=Odd()) for _ in range(2))
    f(v1, x), f(v1, x)
    armed.append(v2)
    f(v2, x)  # (compared equal: `b` was 1.0 when compared, and is 2.0 after)
    out, _ = served(f, v2, x)
    assert_trees_equal(out, g(v2, x))
    assert float(out[0]) == 2.0


# --------------------------------------------------------------------------
# Plain leaves: what jax.jit takes as it is (a NumPy array, a typed PRNG key, under
# fastcall.jit's rule a Python scalar) is read as is by the fast and structure paths,
# wherever a call passed an array, as jax.jit's own call reads it


def _scaled(m, x, s):
    return m(x) * s


def test_numpy_arrays_keys_and_scalars_beside_a_model_take_the_fast_path(hot_path):
    f, peer = fastcall.jit(_scaled), eqx.filter_jit(_scaled)
    m = _models(1)[0]
    calls = [
        (X, jnp.float32(2.0)),
        (np.arange(4.0, dtype=np.float32), jnp.float32(3.0)),  # a NumPy array where an array was
        (X, 4.0),  # a Python float where an array was: traced (weakly typed), as jax.jit does
        (np.arange(4.0, dtype=np.float32) - 1, 5.0),
        (X + 1, 6),
        (X, np.float32(7.0)),  # a NumPy scalar
    ]
    for _ in range(3):  # (a fast record is made for an object's second use)
        f(m, X, jnp.float32(1.0))
    routes = []
    for x, s in calls:
        for _ in range(2):  # (the first call of a new leaf kind lets jax trace for it)
            y, route = served(f, m, x, s)
            assert_trees_equal(y, m(jnp.asarray(x)) * s)
            assert_trees_equal(y, peer(m, x, jnp.asarray(s)))
        routes.append(route)
    assert routes == [FAST_PATH[hot_path]] * len(calls)
    with pytest.raises(TypeError):  # (a NumPy array of objects: refused as jax.jit refuses it)
        f(m, np.array([object()] * 4), 1.0)
    y, route = served(f, m, X, 1.0)  # the wrapper keeps working
    assert route == FAST_PATH[hot_path]


def test_a_typed_key_takes_the_fast_path(hot_path):
    def noisy(m, x, key):
        return m(x + jax.random.normal(key, x.shape))

    f = fastcall.jit(noisy)
    m = _models(1)[0]
    for i in range(3):
        key = jax.random.key(i)
        y, route = served(f, m, X, key)
        assert_trees_equal(y, noisy(m, X, key))
    assert route == FAST_PATH[hot_path]
    assert f.stats().compiles == 1


def test_python_scalars_stay_static_under_filter_jit(hot_path):
    """eqx.filter_jit's rule: a Python scalar is part of the compile key, never read as a
    plain leaf, so each value compiles for it and none is served from another's record."""
    f, peer = fastcall.filter_jit(_scaled), eqx.filter_jit(_scaled)
    m = _models(1)[0]
    for s in (2.0, 3.0, 2.0, 3.0):
        y = f(m, X, s)
        assert_trees_equal(y, peer(m, X, s))
        assert_trees_equal(y, m(X) * s)
    assert f.stats().compiles == 2


def test_a_numpy_leaf_in_a_new_object_takes_the_structure_path(hot_path):
    f, peer = fastcall.jit(_call), eqx.filter_jit(_call)
    for m in _models(2):
        f(m, X)
    m = eqx.tree_at(lambda m: m.layers[0].bias, _models(3)[2], np.ones(4, np.float32))
    y, route = served(f, m, X)
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, m(X))
    assert_trees_equal(y, peer(m, X))
    assert f.stats().compiles == 1


@pytest.mark.parametrize("kind", ["tuple", "list"])
def test_a_new_numpy_batch_each_step_beside_nnx_arguments(kind, hot_path):
    """flax's toy example 07: `train_step(model, optimizer, (x, y))` with a new batch of
    NumPy arrays each step (NumPy indexing of a NumPy dataset)."""

    def step(model, optimizer, batch):
        return _train_step(model, optimizer, *batch)

    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(step), nnx.jit(step)
    make = tuple if kind == "tuple" else list
    data = np.random.default_rng(0).normal(size=(10, 2, 4)).astype(np.float32)
    routes = []
    for i in range(4):
        batch = make((data[i], data[i + 1]))
        loss, route = served(f, m, opt, batch)
        routes.append(route)
        assert_trees_equal(loss, peer(ref_m, ref_opt, make((data[i], data[i + 1]))))
        assert_trees_equal(state_of(m), state_of(ref_m))
        assert_trees_equal(state_of(opt), state_of(ref_opt))
    assert routes == _READ_TWICE + [STRUCTURE_PATH[hot_path]] * 2
    assert f.stats().compiles == 1


class _Batch(NamedTuple):
    x: Any
    y: Any


def _batch_step(m, batch):
    return m(batch[0]) * sum(jax.tree_util.tree_leaves(batch[1:]), 1.0)


def _count_extractions(f, key, position):
    """Replace the extractor that `f`'s structure record (for first arguments of type `key`)
    reads argument `position` with, by one that counts its calls: the list of what it read."""
    record = f.stats.__self__.structures[key]
    read = record.reads[position]
    extracted = []

    def counted(a):
        extracted.append(a)
        return read.extract(a)

    reads = list(record.reads)
    reads[position] = read._replace(extract=counted)
    f.stats.__self__.structures[key] = record._replace(reads=tuple(reads))
    return extracted


def _serve_batches(f, m, batches, *references):
    """Call `f(m, batch)` for each batch, checking each result against every reference
    (a function of the batch); the routes that served the calls."""
    routes = []
    for batch in batches:
        y, route = served(f, m, batch)
        routes.append(route)
        for reference in references:
            assert_trees_equal(y, reference(batch))
    return routes


@pytest.mark.parametrize("kind", [tuple, list])
def test_a_new_batch_of_arrays_is_read_without_its_extractor(kind, hot_path):
    """A tuple or list of plain arrays only (a batch) is read by `_tree_reads.sequence_leaves`
    (compiled, through its C entry, with no Python call), not by calling the extractor."""
    from fastcall import _plan

    f, peer = fastcall.jit(_batch_step), eqx.filter_jit(_batch_step)
    m = _models(1)[0]
    rng = np.random.default_rng(0)
    draw = lambda: kind((rng.normal(size=4).astype(np.float32), rng.normal(size=4).astype(np.float32)))  # noqa: E731
    for _ in range(2):  # (the model passed again: the second call caches it by identity)
        f(m, draw())
    read = f.stats.__self__.structures[type(m)].reads[1]
    assert read.sequence == _plan.SequenceRead(kind, 2, read.sequence.leaf_types, n_leaves=2)
    extracted = _count_extractions(f, type(m), 1)
    routes = _serve_batches(
        f, m, [draw() for _ in range(3)], lambda b: _batch_step(m, tuple(map(jnp.asarray, b))), lambda b: peer(m, b)
    )
    assert routes == [STRUCTURE_PATH[hot_path]] * 3
    assert len(extracted) == 0
    assert f.stats().compiles == 1


_TUPLE_OTHERS = {
    "shorter": lambda x, y: (x,),  # another length
    "longer": lambda x, y: (x, y, y),
    "list": lambda x, y: [x, y],  # a list where a tuple was
    "namedtuple": lambda x, y: _Batch(x, y),  # a tuple subclass
    "scalar": lambda x, y: (x, 2.0),  # a Python scalar among the arrays
    "nested": lambda x, y: (x, (y,)),
    "none": lambda x, y: (x, None),
}
_DICT_OTHERS = {
    "shorter": lambda x, y: {"image": x},
    "longer": lambda x, y: {"image": x, "label": y, "mask": y},
    "key": lambda x, y: {"image": x, "labels": y},  # another key, same length
    "nested": lambda x, y: {"image": x, "label": (y,)},
    "none": lambda x, y: {"image": x, "label": None},
    "scalar": lambda x, y: {"image": x, "label": 2.0},  # a Python scalar where an array was
    "list": lambda x, y: [x, y],
}
_NESTED_OTHERS = {  # (the known structure: {"image": x, "targets": {"label": y, "mask": [x]}})
    "inner key": lambda x, y: {"image": x, "targets": {"labels": y, "mask": [x]}},
    "inner longer": lambda x, y: {"image": x, "targets": {"label": y, "mask": [x, y]}},
    "inner shorter": lambda x, y: {"image": x, "targets": {"label": y, "mask": []}},
    "inner tuple": lambda x, y: {"image": x, "targets": {"label": y, "mask": (x,)}},
    "inner none": lambda x, y: {"image": x, "targets": {"label": y, "mask": [None]}},
    "inner scalar": lambda x, y: {"image": x, "targets": {"label": 2.0, "mask": [x]}},
    "deeper": lambda x, y: {"image": x, "targets": {"label": y, "mask": [[x]]}},
    "flat": lambda x, y: {"image": x, "targets": y},
}
_BATCH_CASES = {
    **{f"tuple-{k}": (lambda x, y: (x, y), v) for k, v in _TUPLE_OTHERS.items()},
    **{f"dict-{k}": (lambda x, y: {"image": x, "label": y}, v) for k, v in _DICT_OTHERS.items()},
    **{
        f"nested-{k}": (lambda x, y: {"image": x, "targets": {"label": y, "mask": [x]}}, v)
        for k, v in _NESTED_OTHERS.items()
    },
}


@pytest.mark.parametrize("known, other", list(_BATCH_CASES.values()), ids=list(_BATCH_CASES))
def test_a_batch_of_another_structure_is_not_read_as_the_known_one(known, other, hot_path):
    f, peer = fastcall.jit(_any_batch), eqx.filter_jit(_any_batch)
    m = _models(1)[0]
    x, y = np.arange(4.0, dtype=np.float32), np.full(4, 3.0, np.float32)
    for _ in range(2):
        f(m, known(x, y))
    batch = other(x, y)
    out, route = served(f, m, batch)
    assert route == "general"
    assert_trees_equal(out, peer(m, batch))
    # and the known structure is read on the structure path again (once the general path
    # has recorded it again: one record per type of first argument)
    f(m, known(x + 2, y))
    out, route = served(f, m, known(x + 1, y))
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(out, peer(m, known(x + 1, y)))


def _any_batch(m, batch):
    leaves = jax.tree_util.tree_leaves(batch)
    return m(leaves[0]) * sum(leaves[1:], 1.0)


_NESTED = {
    "params dict": lambda x, y: {"layer_0": {"w": x, "b": y}, "layer_1": {"w": y, "b": x}},
    "list of tuples": lambda x, y: [(x, y), (y,)],
    "dict of a list of a dict": lambda x, y: {"a": [x, {"b": y}], "c": x},
    "empty containers inside": lambda x, y: {"a": (), "b": x, "c": {}, "d": [y]},
}


@pytest.mark.parametrize("nested", list(_NESTED))
def test_nested_containers_of_leaves_are_read_without_their_extractor(nested, hot_path):
    """Tuples, lists and dicts of leaves nested in one another (a params dict of dicts) are
    read by `_tree_reads.sequence_leaves` as their extractor reads them, depth first, without
    calling the extractor."""
    f, peer = fastcall.jit(_any_batch), eqx.filter_jit(_any_batch)
    m = _models(1)[0]
    rng = np.random.default_rng(0)
    draw = lambda: _NESTED[nested](*rng.normal(size=(2, 4)).astype(np.float32))  # noqa: E731
    for _ in range(2):
        f(m, draw())
    read = f.stats.__self__.structures[type(m)].reads[1]
    assert read.sequence is not None and read.sequence.items is not None
    assert read.sequence.n_leaves == len(jax.tree_util.tree_leaves(draw()))
    extracted = _count_extractions(f, type(m), 1)
    routes = _serve_batches(f, m, [draw() for _ in range(3)], lambda b: peer(m, b), lambda b: _any_batch(m, b))
    assert routes == [STRUCTURE_PATH[hot_path]] * 3
    assert len(extracted) == 0
    assert f.stats().compiles == 1


@pytest.mark.parametrize("change", ["replace", "clear"])
def test_a_batch_list_changed_while_it_is_read_gives_the_items_read(change, hot_path, unchecked):
    """The batch is read as it was when the call began: a list changed by code its type
    test runs neither passes an item that was not checked nor reads freed memory."""
    f, peer = fastcall.jit(_batch_step), eqx.filter_jit(_batch_step)
    m = _models(1)[0]
    x, y = np.arange(4.0, dtype=np.float32), np.full(4, 3.0, np.float32)
    for i in range(2):
        f(m, [x + i, y, y])
    odd = np.full(4, 2.0, np.float32).view(OddArray)
    batch = [x, odd, y]
    expected = peer(m, list(batch))
    HashRunsCode.armed = {"replace": lambda: batch.__setitem__(1, y * 100), "clear": batch.clear}[change]
    try:
        out, route = served(f, m, batch)
    finally:
        HashRunsCode.armed = None
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(out, expected)


class _Unhashable(type):
    def __eq__(cls, other):  # (no __hash__: the classes of this metaclass cannot be hashed)
        return cls is other


class _Tag(metaclass=_Unhashable):
    pass


def test_a_batch_item_whose_type_cannot_be_hashed_is_declined_as_the_extractor_declines(hot_path):
    """An item whose type test raises (its type unhashable) means "not this structure", as
    the extractor says: the general path reads it, and names the leaf it cannot use (it
    hashes each static leaf with its type; eqx.filter_jit hashes the value alone and
    accepts it)."""
    f = fastcall.jit(_batch_step)
    m = _models(1)[0]
    x = np.arange(4.0, dtype=np.float32)
    for i in range(2):
        f(m, (x + i, x))
    before = f.stats().paths
    with pytest.raises(fastcall.FastcallError, match=r"argument 'batch' at leaf \[1\].*_Tag"):
        f(m, (x, _Tag()))
    assert f.stats().paths == before  # (declined by the structure path; refused by the general one)
    out, route = served(f, m, (x + 1, x))
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(out, _batch_step(m, (x + 1, x)))


def test_a_numpy_array_changed_in_place_is_read_afresh(hot_path):
    """A NumPy array is never cached as a value: the same batch tuple passed again after
    its array was written in place gives the new result (jax reads the array each call)."""
    f = fastcall.jit(_call)
    m = _models(1)[0]
    x = np.arange(4.0, dtype=np.float32)
    batch_call = fastcall.jit(lambda m, b: m(b[0]) + b[1])
    batch = (x, np.ones(4, np.float32))
    for _ in range(3):
        assert_trees_equal(f(m, x), m(jnp.asarray(x)))
        assert_trees_equal(batch_call(m, batch), m(jnp.asarray(x)) + 1)
        x[:] = x * 2 - 1  # in place


# ---- containers holding Python scalars, and dicts read in C ----


def _scaled_by(x, cfg):
    return x * cfg["k"] + cfg["b"]


_CONFIGS = {
    "dict": lambda k: {"k": k, "b": 0.5},
    "dict with an array": lambda k: {"k": k, "b": jnp.float32(0.5)},
    "tuple": lambda k: (k, 0.5),
    "list": lambda k: [k, 0.5],
    "nested": lambda k: {"k": k, "b": (0.25, {"c": 0.25})},
    "namedtuple": lambda k: _Batch(k, 0.5),
}


def _use_config(x, cfg):
    k, b = (cfg["k"], cfg["b"]) if type(cfg) is dict else (cfg[0], cfg[1])
    return x * k + sum(jax.tree_util.tree_leaves(b), 0.0)


@pytest.mark.parametrize("kind", list(_CONFIGS))
def test_python_scalars_in_a_container_are_traced_on_the_structure_path(kind, hot_path):
    """fastcall.jit traces a Python scalar in a container, as jax.jit does: a new config
    each call (`f(x, {"lr": 0.1})`) takes the structure path, its scalars read as leaves,
    and a new value compiles nothing (it took the general path every call)."""
    f, peer = fastcall.jit(_use_config), jax.jit(_use_config)
    routes = []
    for k in (2, 3, 4, 5):
        cfg = _CONFIGS[kind](k)
        y, route = served(f, X, cfg)
        routes.append(route)
        assert_trees_equal(y, peer(X, _CONFIGS[kind](k)))
        assert_trees_equal(y, _use_config(X, cfg))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    assert f.stats().compiles == 1
    # an array where a scalar was is the same leaf to jax.jit (it compiles for its type)
    y, route = served(f, X, _CONFIGS[kind](jnp.float32(6)))
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, peer(X, _CONFIGS[kind](jnp.float32(6))))


@pytest.mark.parametrize(
    "other",
    [
        lambda: {"k": 2, "b": "half"},  # a string: static
        lambda: {"k": 2, "b": None},
        lambda: {"k": 2, "c": 0.5},  # another key
        lambda: {"k": 2, "b": 0.5, "c": 1.0},
        lambda: {"k": 2, "b": (0.5,)},
    ],
    ids=["str", "none", "key", "longer", "nested"],
)
def test_a_config_of_another_structure_is_not_read_as_the_known_one(other, hot_path):
    f = fastcall.jit(_sum_config)
    for k in (2, 3):
        f(X, {"k": k, "b": 0.5})
    cfg = other()
    y, route = served(f, X, cfg)
    assert route == "general"
    assert_trees_equal(y, _sum_config(X, cfg))
    f(X, {"k": 4, "b": 0.25})  # (the general path records the known structure again)
    y, route = served(f, X, {"k": 5, "b": 0.25})
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, X * 5 + 0.25)


def _sum_config(x, cfg):
    others = [v for name, v in sorted(cfg.items()) if name != "k"]
    return x * cfg["k"] + sum((v for v in jax.tree_util.tree_leaves(others) if not isinstance(v, str)), 0.0)


def _branchy(x, cfg):
    # (a Python branch on the scalar: only a static scalar allows it)
    return x * 10 if cfg["k"] > 3 else x + cfg["w"]


def _traced(x, cfg):
    return x * cfg["k"] + cfg["w"]


@pytest.mark.parametrize("order", ["jit first", "filter_jit first"])
def test_each_scalar_rule_keeps_to_its_own_reading_of_a_config(order, hot_path):
    """A structure read under fastcall.jit's rule (scalars traced) is never served to a
    fastcall.filter_jit function (scalars static: a Python branch on one works), nor the
    other way round, whichever of the two read it first; the same object passed to both."""
    w = jnp.float32(1.0)
    traced, static = fastcall.jit(_traced), fastcall.filter_jit(_branchy)
    peer_traced, peer_static = jax.jit(_traced), eqx.filter_jit(_branchy)
    calls = [(traced, peer_traced), (static, peer_static)]
    if order == "filter_jit first":
        calls.reverse()
    for k in (2, 5, 2, 5, 2):
        cfg = {"k": k, "w": w}
        for f, peer in calls:
            y, route = served(f, X, cfg)
            assert_trees_equal(y, peer(X, cfg))
            y, route = served(f, X, cfg)  # (the very same object again)
            assert_trees_equal(y, peer(X, cfg))
    assert traced.stats().compiles == 1
    assert static.stats().compiles == 2  # (one per value, as eqx.filter_jit)
    assert traced.stats().paths[STRUCTURE_PATH[hot_path]] >= 8
    assert static.stats().paths[STRUCTURE_PATH[hot_path]] >= 5


def test_the_same_config_passed_first_again_stays_on_the_structure_path(hot_path):
    """Passed first again, a list or dict the identity cache can hold comes back to the
    general path, which holds it for the fast path; not one holding a traced Python scalar,
    which it does not hold (the cache is shared by both scalar rules): it stays on the
    structure path, read every call, so a change in place is seen."""

    def scaled(cfg, x):
        return x * cfg["lr"] + cfg["w"]

    f, peer = fastcall.jit(scaled), jax.jit(scaled)
    cfg = {"lr": 0.5, "w": jnp.ones(4)}
    routes = []
    for _ in range(4):
        y, route = served(f, cfg, X)
        routes.append(route)
        assert_trees_equal(y, peer(cfg, X))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    cfg["lr"] = 2.0  # (changed in place: read afresh, as every call reads it)
    y, route = served(f, cfg, X)
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, X * 2.0 + 1.0)
    assert f.stats().compiles == 1


def _dict_step(m, batch):
    return m(batch["image"]) * batch["label"]


@pytest.mark.parametrize("leaf", ["numpy", "python scalar"])
def test_a_new_batch_dict_is_read_without_its_extractor(leaf, hot_path):
    """A dict of leaves only (a batch, `train_step(model, {"image": x, "label": y})`) is read
    by `_tree_reads.sequence_leaves`, by its sorted keys, without calling the extractor. Its keys
    in another insertion order are the same structure."""
    from fastcall import _plan

    f, peer = fastcall.jit(_dict_step), jax.jit(_dict_step)
    m = _models(1)[0]
    rng = np.random.default_rng(0)

    def draw(flip=False):
        image = rng.normal(size=4).astype(np.float32)
        label = float(rng.normal()) if leaf == "python scalar" else rng.normal(size=4).astype(np.float32)
        return {"label": label, "image": image} if flip else {"image": image, "label": label}

    for _ in range(2):
        f(m, draw())
    read = f.stats.__self__.structures[type(m)].reads[1]
    assert read.sequence is not None
    assert (read.sequence.kind, read.sequence.length, read.sequence.keys) == (dict, 2, ("image", "label"))
    extracted = _count_extractions(f, type(m), 1)
    routes = _serve_batches(
        f, m, [draw(flip=i % 2 == 1) for i in range(4)], lambda b: peer(m, b), lambda b: _dict_step(m, b)
    )
    assert routes == [STRUCTURE_PATH[hot_path]] * 4
    assert len(extracted) == 0
    assert f.stats().compiles == 1


class _EqRunsCode(str):
    """A dict key equal to "label" whose comparison runs code (once armed): looking "label"
    up in a dict holding it can change the dict while it is being read."""

    armed: Any = None

    def __hash__(self):
        return hash("label")

    def __eq__(self, other):
        action, _EqRunsCode.armed = _EqRunsCode.armed, None
        if action is not None:
            action()
        return str.__eq__(self, other)


def test_a_batch_dict_changed_while_it_is_read_gives_the_items_read(hot_path, unchecked):
    """A dict changed by code that a key's comparison runs while the dict is read neither
    passes a value that was not read nor reads freed memory: the call gives what the dict
    held as each value was read ("image" first: keys are read sorted)."""
    f = fastcall.jit(_dict_step)
    m = _models(1)[0]
    x, y = np.arange(4.0, dtype=np.float32), np.full(4, 3.0, np.float32)
    for i in range(2):
        f(m, {"image": x + i, "label": y})
    batch = {"image": x, _EqRunsCode("label"): y}
    _EqRunsCode.armed = lambda: batch.__setitem__("image", y * 100)
    try:
        out, route = served(f, m, batch)
    finally:
        _EqRunsCode.armed = None
    assert route == STRUCTURE_PATH[hot_path]
    assert batch["image"] is not x  # (the comparison ran, and changed the dict)
    assert_trees_equal(out, m(jnp.asarray(x)) * y)


def _linen_train_state(tx=None):
    from flax import linen
    from flax.training import train_state

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(3)(jnp.tanh(linen.Dense(4)(x)))

    net, x = Net(), jnp.ones((2, 4))
    params = net.init(jax.random.PRNGKey(0), x)["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx or optax.adam(1e-2)), x


def _linen_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_linen_train_state_takes_the_structure_path(hot_path):
    """Linen's training loop, `state, loss = train_step(state, batch)` with a
    `flax.training.train_state.TrainState` (a flax.struct.dataclass: a pytree node of its
    own, with `apply_fn` and `tx` as node data), took the general path every call, 1.47x
    jax.jit's time. Its structure is read by generated code now, as jax.jit flattens it
    (its data fields, in order; its meta fields compared); the same losses and states as
    jax.jit's, compiling as often."""
    traces = {"fastcall": 0, "jax": 0}

    def counted(name):
        def step(state, batch):
            traces[name] += 1
            return _linen_step(state, batch)

        return step

    f, peer = fastcall.jit(counted("fastcall")), jax.jit(counted("jax"))
    state, x = _linen_train_state()
    mine, theirs = state, state
    routes = []
    for i in range(6):
        batch = {"x": x * i, "y": jnp.ones((2, 3))}
        (mine, loss), route = served(f, mine, batch)
        theirs, expected = peer(theirs, batch)
        routes.append(route)
        assert_trees_equal((mine, loss), (theirs, expected))
    assert routes[2:] == [STRUCTURE_PATH[hot_path]] * 4
    assert traces["fastcall"] == traces["jax"]
    # (its params changed in place, and a meta field replaced: read afresh, as jax.jit reads them)
    mine.params["Dense_0"]["bias"] = mine.params["Dense_0"]["bias"] + 1.0
    theirs.params["Dense_0"]["bias"] = theirs.params["Dense_0"]["bias"] + 1.0
    batch = {"x": x, "y": jnp.ones((2, 3))}
    (mine, loss), route = served(f, mine, batch)
    theirs, expected = peer(theirs, batch)
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal((mine, loss), (theirs, expected))
    sgd = optax.sgd(0.1)
    mine = mine.replace(tx=sgd, opt_state=sgd.init(mine.params))
    theirs = theirs.replace(tx=sgd, opt_state=sgd.init(theirs.params))
    (mine, loss), route = served(f, mine, batch)
    theirs, expected = peer(theirs, batch)
    assert route == "general"
    assert_trees_equal((mine, loss), (theirs, expected))
    assert traces["fastcall"] == traces["jax"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Params:
    """A pytree node type of its own (no Template is generated for it), holding a list:
    it can change in place unseen, so the identity cache does not hold it."""

    w: list
    scale: Any
    name: str = dataclasses.field(default="p", metadata=dict(static=True))


class _Pair:
    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag


jax.tree_util.register_pytree_node(_Pair, lambda p: ((p.a, p.b), p.tag), lambda tag, ch: _Pair(*ch, tag))


def _params_step(p, x):
    return x @ p.w[0] + sum(jax.tree_util.tree_leaves((p.w[1:], p.scale)), 1.0)


def _pair_step(p, x):
    return x * p.a + p.b


_OWN_NODE_OTHERS = {
    "node data": lambda x: _Params([x, x[0]], jnp.float32(2.0), "q"),
    "list length": lambda x: _Params([x, x[0], x[0]], jnp.float32(2.0)),
    "tuple for list": lambda x: _Params((x, x[0]), jnp.float32(2.0)),
    "nested deeper": lambda x: _Params([x, [x[0]]], jnp.float32(2.0)),
    "python scalar": lambda x: _Params([x, x[0]], 2.0),
}


def test_a_pytree_node_type_of_its_own_takes_the_structure_path(hot_path):
    """A structure no Template is generated for (`register_dataclass`, `register_pytree_node`),
    every leaf an array: read as jax.jit reads it (`_codegen.FlattenTemplate`: tree_flatten,
    the treedef compared), where every call took the general path (2x jax.jit's time). Passed
    again, an object the identity cache cannot hold is not sent to the general path to be
    cached (`ArgRead.by_identity`), where it was, every call. Another structure (node data,
    a list's length or type, a deeper leaf, a Python scalar) is read by the general path, as
    jax.jit reads it."""
    x = jnp.arange(4.0).reshape(2, 2)
    f, peer = fastcall.jit(_params_step), jax.jit(_params_step)
    same = _Params([x, x[0]], jnp.float32(2.0))
    routes = []
    for i in range(5):
        p = same if i % 2 else _Params([x + i, x[0]], jnp.float32(2.0))
        y, route = served(f, p, x)
        routes.append(route)
        assert_trees_equal(y, peer(p, x))
    assert routes[1:] == [STRUCTURE_PATH[hot_path]] * 4
    assert "identity cache does not hold it" in str(f.explain(same, x))
    assert "as jax.jit reads them (tree_flatten" in str(f.explain(same, x))
    for name, make in _OWN_NODE_OTHERS.items():
        p = make(x)
        y, route = served(f, p, x)
        assert route == "general", name
        assert_trees_equal(y, peer(p, x))
    g, pair_peer = fastcall.jit(_pair_step), jax.jit(_pair_step)
    for tag in ("a", "a", "a", "b", "b", "b"):
        p = _Pair(x, x + 1, tag)
        y, route = served(g, p, x)
        assert_trees_equal(y, pair_peer(p, x))
    assert route == STRUCTURE_PATH[hot_path]
    assert served(g, _Pair(x, x, "c"), x)[1] == "general"
    # (read by `_tree_reads.tree_leaves`, the C route through its C entry: jax's flatten, the
    # treedef compared, each leaf's type checked, with no Python frame of fastcall's)
    from fastcall import _plan

    reads = [r for rec in _records(f) for r in rec.reads if type(r) is _plan.ArgRead]
    assert reads and all(type(r.sequence) is _plan.TreeRead for r in reads)


def _records(f):
    """The structure records of `f`'s function (each key's, and the others kept with it)."""
    from fastcall import _plan

    return [r for head in f._fastcall_state.structures.values() for r in _plan.plans_of(head)]


class _Picky:
    """A pytree node whose flatten raises for one tag (`ValueError`, as a node type's own
    checks do): jax.jit raises it; so must fastcall, from the structure path too."""

    def __init__(self, a, tag):
        self.a, self.tag = a, tag


def _flatten_picky(p):
    if p.tag == "bad":
        raise ValueError("this _Picky cannot be flattened")
    return (p.a,), p.tag


jax.tree_util.register_pytree_node(_Picky, _flatten_picky, lambda tag, ch: _Picky(ch[0], tag))


def test_a_pytree_node_whose_flatten_raises_reaches_the_user_as_from_jax_jit(hot_path):
    """A read by jax's flatten (`_plan.TreeRead`) that raises declines the call; the general
    path flattens the argument again, and the user gets the node type's own error, as from
    jax.jit; the function keeps serving the structure it knew."""
    x = jnp.arange(3.0)
    f, peer = fastcall.jit(lambda p, y: p.a * y), jax.jit(lambda p, y: p.a * y)
    for _ in range(2):
        served(f, _Picky(x, "ok"), x)
    with pytest.raises(ValueError, match="cannot be flattened"):
        peer(_Picky(x, "bad"), x)
    with pytest.raises(ValueError, match="cannot be flattened"):
        f(_Picky(x, "bad"), x)
    y, route = served(f, _Picky(x + 1, "ok"), x)
    assert route == STRUCTURE_PATH[hot_path]
    assert_trees_equal(y, peer(_Picky(x + 1, "ok"), x))


def _sum_step(d, x):
    return x * 2.0 + sum(jax.tree_util.tree_leaves(d))


def test_a_few_structures_in_turn_each_keep_the_structure_path(hot_path):
    """One function called with a few structures in turn under one key (dicts of other keys,
    tuples of other lengths, passed first, built anew each call): each keeps a structure
    record (`CallPlan.others`), so each call after its structure's first is served by
    the structure path, where each call renewed the one record on the general path (5x
    jax.jit's time). Values equal the eager call's and jax.jit's, with as many compiles."""
    from fastcall import _plan, _hold

    x = jnp.arange(4.0)
    makers = [
        lambda i: {"a": x + i},
        lambda i: {"a": x, "b": x * i},
        lambda i: {"c": (x, x + i), "d": x},
    ]
    assert len(makers) < _plan.PLANS_PER_KEY
    f, peer = fastcall.jit(_sum_step), jax.jit(_sum_step)
    routes, last_round = [], []
    for i in range(8):
        for make in makers:
            d = make(i)
            y, route = served(f, d, x)
            routes.append(route)
            if i == 7:
                last_round.append(d)
            assert_trees_equal(y, _sum_step(d, x))
            assert_trees_equal(y, peer(d, x))
    # (a few may go to the general path to be held: a new dict that Python places where the
    # one last marked was is taken for it passed again, until the function stops holding,
    # after `_hold.HOLD_ATTEMPTS_LIMIT` + 1 such calls (`may_hold`). With one record per
    # key, all 21 went there.)
    later = routes[len(makers):]
    assert later.count("general") <= _hold.HOLD_ATTEMPTS_LIMIT + 1, routes
    assert later.count(STRUCTURE_PATH[hot_path]) == len(later) - later.count("general"), routes
    assert later[-len(makers):] == [STRUCTURE_PATH[hot_path]] * len(makers), routes
    assert f.stats().compiles == len(makers) == peer._cache_size()
    # (the dicts each record saw last are kept alive (`last_round`): a new dict placed at
    # one's id would be taken for it passed again, by explain as by a call)
    for make in makers:
        assert f.explain(make(0), x).route == "structure"
    del last_round
    t = fastcall.jit(lambda d, x: _sum_step(d, x))  # (a function of its own: stats of its own)
    for i in range(4):
        for n in (1, 2, 3):
            pair = tuple(x + j for j in range(n))
            y, route = served(t, pair, x)
            assert_trees_equal(y, _sum_step(pair, x))
    assert route == STRUCTURE_PATH[hot_path]
    assert t.stats().paths["general_read"] == 3 and t.stats().paths["general_cached"] == 0  # (each read once)


def test_more_structures_in_turn_than_records_kept_stay_correct(hot_path):
    """More structures in turn than a key keeps records for (`_plan.PLANS_PER_KEY`):
    every call gives the right value, a structure not kept is read by the general path
    (which keeps its record, the oldest dropped), and nothing compiles twice."""
    from fastcall import _plan

    x = jnp.arange(4.0)
    n = _plan.PLANS_PER_KEY + 2
    f, peer = fastcall.jit(_sum_step), jax.jit(_sum_step)
    for i in range(4):
        for k in range(n):
            d = {f"k{j}": x * (i + j) for j in range(k + 1)}
            assert_trees_equal(f(d, x), peer(d, x))
    assert f.stats().compiles == n
    head = next(iter(f._fastcall_state.structures.values()))
    assert len(_plan.plans_of(head)) == _plan.PLANS_PER_KEY


def test_a_dict_changed_in_place_between_structures_in_turn(hot_path):
    """A dict passed first again after a key was added or removed in place is read as its
    structure is now (by the record of that structure, or the general path), never as it
    was: the records tried in turn each check the whole structure."""
    x = jnp.arange(4.0)
    f, peer = fastcall.jit(_sum_step), jax.jit(_sum_step)
    one, two = {"a": x}, {"a": x, "b": x + 1}
    for _ in range(3):
        assert_trees_equal(f(dict(one), x), peer(one, x))
        assert_trees_equal(f(dict(two), x), peer(two, x))
    d = dict(one)
    for step in range(6):
        if step % 2:
            del d["b"]
        else:
            d["b"] = x * step
        assert_trees_equal(f(d, x), peer(d, x))
        d2 = dict(d)
        d2["a"] = x + step
        assert_trees_equal(f(d2, x), peer(d2, x))
    assert f.stats().compiles == 2


class _Counted:
    """A pytree node whose flatten counts its calls: each structure record that tries to
    read one (`_codegen.FlattenTemplate`) flattens it once."""

    flattens = 0

    def __init__(self, a, tag):
        self.a, self.tag = a, tag


def _flatten_counted(c):
    _Counted.flattens += 1
    return (c.a,), c.tag


jax.tree_util.register_pytree_node(_Counted, _flatten_counted, lambda tag, ch: _Counted(ch[0], tag))


def test_the_record_that_served_last_is_tried_first(hot_path, unchecked):
    """After calls of other structures, a loop over one structure is served by its record
    without the newer records reading each call first (`FastWrapper.last_served`,
    `StructureRoute`): one read per call, where each newer record read the
    argument and declined first (a full model's values, read before a batch that declined,
    on every call: 2.5 us a record in C, 33 us in Python, for 100 Linear layers)."""
    x = jnp.arange(3.0)
    f, peer = fastcall.jit(lambda c, y: c.a * y), jax.jit(lambda c, y: c.a * y)
    tags = ("a", "b", "c")
    for tag in tags:
        for _ in range(2):
            served(f, _Counted(x, tag), x)
    for tag in (*tags, *tags):  # (in turn: each record tried until one serves)
        c = _Counted(x + 1, tag)
        y, route = served(f, c, x)
        assert route == STRUCTURE_PATH[hot_path]
        assert_trees_equal(y, peer(c, x))
    served(f, _Counted(x, "a"), x)  # (its record, behind the newer ones, now first)
    before = _Counted.flattens
    for i in range(10):
        c = _Counted(x + i, "a")
        y, route = served(f, c, x)
        assert route == STRUCTURE_PATH[hot_path]
        assert_trees_equal(y, peer(c, x))
    assert _Counted.flattens - before == 10 + 10  # (each call's read, and the peer's flatten)

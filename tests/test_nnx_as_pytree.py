"""`fastcall.jit(nnx_as_pytree=True)`: jax.jit's semantics for Flax NNX objects, where
they differ from nnx.jit's (no write-back, an object reached twice is two objects inside,
returned objects new), checked against jax.jit on the patterns of flax's own programs that
use jax.jit over NNX objects; the default stays nnx.jit's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fastcall

from .models import Sized


def as_pytree(f, **options):
    return fastcall.jit(f, nnx_as_pytree=True, **options)


def _values(tree):
    return [jnp.asarray(x).tolist() for x in jax.tree.leaves(tree)]


def _served_fast(f) -> int:
    paths = f.stats().paths
    return sum(paths[k] for k in ("c_fast", "python_fast", "c_structure", "python_structure"))


class Count(nnx.Variable):
    pass


class Counted(nnx.Module):
    """A model that counts its calls in a Variable (as flax's toy example 03's test step
    does through the States it merges)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.calls = Count(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


def _split_states_step(graphdef):
    """A step over `nnx.split` States, merged inside without a copy (toy example 03)."""

    def step(params, counts, x):
        model = nnx.merge(graphdef, params, counts, copy=False)
        return model(x), nnx.state(model, Count)

    return step


def test_split_states_mutated_inside_are_not_written_back_as_under_jax_jit():
    results = {}
    for name, wrap in (("jax.jit", jax.jit), ("pytree", as_pytree), ("default", fastcall.jit)):
        model = Counted(nnx.Rngs(0))
        graphdef, params, counts = nnx.split(model, nnx.Param, Count)
        f = wrap(_split_states_step(graphdef))
        for _ in range(4):
            y, returned = f(params, counts, jnp.ones(3))
        results[name] = (int(model.calls[...]), int(returned["calls"][...]), _values(y))
        if name == "pytree":
            assert _served_fast(f) >= 2  # the calls after the first two took the structure path
    assert results["pytree"] == results["jax.jit"] == (0, 1, results["jax.jit"][2])
    assert results["default"][:2] == (4, 4)  # nnx.jit's rule: written back into the live model


def test_the_performance_guides_jax_jit_loop_updates_the_model_only_at_nnx_update():
    def run(wrap):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        kernel_before = model.kernel[...]

        def train_step(graphdef, state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        f = wrap(train_step)
        x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
        losses = []
        for _ in range(3):
            loss, state = f(graphdef, state, x, y)
            losses.append(float(loss))
        untouched = bool(jnp.all(model.kernel[...] == kernel_before))
        nnx.update((model, optimizer), state)
        return losses, untouched, _values(nnx.state(model))

    ours, theirs = run(as_pytree), run(jax.jit)
    assert ours == theirs
    assert ours[1] is True  # the live model changed only at nnx.update
    assert run(fastcall.jit)[1] is False  # (the default writes back, as nnx.jit would)


class Pair(nnx.Pytree):
    def __init__(self, item):
        self.left = item
        self.right = item


def test_an_object_reached_twice_is_two_objects_inside_as_under_jax_jit():
    def same(pair):
        return jnp.array(pair.left is pair.right)

    pair = Pair(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    assert bool(as_pytree(same)(pair)) is bool(jax.jit(same)(pair)) is False
    assert bool(fastcall.jit(same)(pair)) is True


def test_returned_nnx_objects_are_new_and_arguments_unchanged():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def bump(m):
        m.bias[...] = m.bias[...] + 1.0
        return m

    for wrap in (as_pytree, jax.jit):
        out = wrap(bump)(model)
        assert out is not model and out.bias is not model.bias
        assert out.bias[...].tolist() == [1.0, 1.0] and model.bias[...].tolist() == [0.0, 0.0]


def test_values_changed_outside_and_structure_changes_are_seen():
    model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
    f = as_pytree(lambda m, x: m(x))
    x = jnp.ones((3, 2))
    model.eval()
    for _ in range(3):
        f(model, x)
    model.layers[0].bias[...] = jnp.full(2, 5.0)  # an in-place write between calls
    assert _values(f(model, x)) == _values(jax.jit(lambda m, x: m(x))(model, x))
    model.layers[0] = nnx.Linear(2, 2, rngs=nnx.Rngs(7))  # a submodule replaced
    assert _values(f(model, x)) == _values(model(x))
    compiles = f.stats().compiles
    model.train()  # a static attribute flipped: jax.jit's treedef differs, so does ours
    f(model, x)
    assert f.stats().compiles == compiles + 1


def test_the_default_and_pytree_wrappers_of_one_function_keep_their_own_rules():
    """Structures and templates are shared between functions; those that read NNX objects
    as pytrees serve only functions asking for it, whichever ran first."""
    model = Counted(nnx.Rngs(0))

    def call(m, x):
        return (m[0] if isinstance(m, tuple) else m)(x)

    pytree, default = as_pytree(call), fastcall.jit(call)
    for _ in range(3):
        pytree((model,), jnp.ones(3))
        pytree(model, jnp.ones(3))
    assert int(model.calls[...]) == 0
    for _ in range(3):
        default((model,), jnp.ones(3))
        default(model, jnp.ones(3))
    assert int(model.calls[...]) == 6


def test_the_option_is_refused_nowhere_and_static_nnx_objects_stay_refused():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(fastcall.FastcallError, match="static"):
        as_pytree(lambda m, x: m(x), static_argnums=0)(model, jnp.ones(2))
    f = as_pytree(lambda m, *, x: m(x))
    assert _values(f(model, x=jnp.ones(2))) == _values(model(jnp.ones(2)))


def test_explain_tells_the_pytree_reading():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = as_pytree(lambda m, x: m(x))
    for _ in range(3):
        f(model, jnp.ones(2))
    report = f.explain(model, jnp.ones(2))
    assert report.route == "structure"
    assert "read as a plain pytree" in report.arguments[0].kind
    # a container holding NNX objects: read as jax.jit reads it, not object by object
    g = as_pytree(lambda pair, x: pair[0](x) + pair[1](x))
    for _ in range(3):
        g((model, model), jnp.ones(2))
    report = g.explain((model, model), jnp.ones(2))
    assert report.route == "structure"
    assert "as jax.jit reads them" in report.arguments[0].per_call
    assert "NNX object" not in report.arguments[0].kind + report.arguments[0].per_call


def test_a_pytree_functions_read_of_a_graphdef_leaves_the_default_functions_check_in_place():
    """Templates are shared per type: one made while a pytree function read a GraphDef must
    not serve a default function, which compares a GraphDef holding a list by value."""

    def run(graphdef, state, x):
        return nnx.merge(graphdef, state)(x)

    model = Sized()
    graphdef, state = nnx.split(model)
    x = jnp.ones(3)
    as_pytree(run)(graphdef, state, x)
    default = fastcall.jit(run)
    default(graphdef, state, x)
    model.features.append(4)  # (the GraphDef holds this very list)
    assert default(graphdef, state, x).tolist() == run(graphdef, state, x).tolist() == [3.0, 4.0, 5.0]


def test_an_nnx_object_jax_sees_as_a_leaf_is_refused_and_poisons_no_cache():
    class Opaque(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(3.0))

        def __call__(self, x):
            return x + self.w[...]

    model, x = Opaque(), jnp.ones(3)
    with pytest.raises(fastcall.FastcallError, match="not a pytree"):
        as_pytree(lambda m, x: m(x))(model, x)
    default = fastcall.jit(lambda m, x: m(x))
    default(model, x)
    model.w[...] = jnp.full(3, 10.0)
    assert default(model, x).tolist() == [11.0, 11.0, 11.0]


def _made(x):
    """New Variables returned: metadata out of name order, a subclass, one in an nnx.State."""
    return {"p": nnx.Param(x * 2.0, zeta=1, alpha=2), "state": nnx.State({"c": Count(jnp.sum(x))})}


def _variables(tree):
    return jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def test_returned_variables_are_made_as_jax_jit_makes_them_on_every_route(hot_path):
    """Variables returned are rebuilt by fastcall's markers (`pytree_outputs`), not by jax's
    output tree: each as flax's pytree node makes it (its type, its metadata sorted by name,
    a TraceState of the call's trace), on the general path and on the structure path."""
    from .conftest import STRUCTURE_PATH, served

    f, g = as_pytree(_made), jax.jit(_made)
    x = jnp.arange(3.0)
    routes = []
    for i in range(3):
        got, route = served(f, x + i)
        routes.append(route)
        want = g(x + i)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(_variables(got), _variables(want), strict=True):
            assert type(a) is type(b)
            assert list(a.get_metadata().items()) == list(b.get_metadata().items())
            assert a._trace_state == b._trace_state and a._trace_state.is_valid()
            assert a[...].tolist() == b[...].tolist()
    assert routes == ["general", STRUCTURE_PATH[hot_path], STRUCTURE_PATH[hot_path]]
    # made for less: one TraceState shared by the Variables made at the top level
    assert got["p"]._trace_state is got["state"]["c"]._trace_state


@pytest.mark.parametrize("wrap", [as_pytree, fastcall.jit], ids=["pytree", "default"])
def test_variables_returned_inside_an_outer_trace_belong_to_that_trace(wrap):
    """A Variable made by a call inside an outer trace has that trace's TraceState (flax
    refuses to change it elsewhere), and one made at the top level after it the top
    level's, whichever was made first."""
    f = wrap(_made)
    x = jnp.arange(3.0)
    top = f(x)

    @jax.jit
    def outer(x):
        inner = f(x)
        for v in _variables(inner):
            assert v._trace_state.is_valid()
        inner["p"][...] = inner["p"][...] + 1.0  # (allowed only to a Variable of this trace)
        assert not top["p"]._trace_state.is_valid()
        return inner["p"][...]

    assert outer(x).tolist() == (x * 2.0 + 1.0).tolist()
    after = f(x)
    for v in _variables(top) + _variables(after):
        assert v._trace_state.is_valid()
    after["p"][...] = jnp.zeros(3)  # (a top-level Variable: writable here)
    assert after["p"][...].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("change", ["nothing", "value set", "metadata set", "Variable of another type", "key added"])
def test_the_states_and_variables_of_a_train_state_are_read_as_jax_flattens_them(change):
    """A flax TrainState of `nnx.split` States under jax.jit's rule: the structure path
    reads each State by its dict and each Variable by its raw value and metadata
    (`_plan.TreeRead.expand`), not by flax's Python flatten, to what jax.jit reads: the same
    outputs, and no more compiles than jax.jit, after each change a user makes between
    calls (new metadata is a new structure to jax.jit, which traces again)."""
    from flax.training import train_state

    from fastcall import _plan

    from .conftest import reads_in

    class TrainState(train_state.TrainState):
        counts: object
        graphdef: object

    tx = optax.sgd(0.1)

    def start():
        graphdef, params, counts = nnx.split(Counted(nnx.Rngs(0)), nnx.Param, Count)
        state = TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=tx, counts=counts)
        return state.replace(step=jnp.asarray(state.step))  # (as a first step leaves it)

    traces = {"fastcall": 0, "jax": 0}

    def counted(who):
        def step(state, x):
            traces[who] += 1
            params = jax.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, nnx.Variable))
            total = sum(jnp.sum(v[...]) for v in params) + state.counts["calls"][...]
            return state.replace(step=state.step + 1), x * total

        return step

    def changed(s):
        linear = s.params["linear"]
        if change == "value set":
            linear["bias"][...] = jnp.full((2,), 3.0)
        elif change == "metadata set":
            linear["bias"].set_metadata("tag", "new")
        elif change == "Variable of another type":
            linear["bias"] = nnx.BatchStat(jnp.zeros(2))
        elif change == "key added":
            linear["extra"] = nnx.Param(jnp.ones(1))

    f, g = as_pytree(counted("fastcall")), jax.jit(counted("jax"))
    mine, theirs = start(), start()
    x = jnp.ones(2)
    for i in range(4):
        if i == 2:
            changed(mine)
            changed(theirs)
        mine, got = f(mine, x)
        theirs, want = g(theirs, x)
        assert _values((mine, got)) == _values((theirs, want))
        assert jax.tree.structure(mine) == jax.tree.structure(theirs)
    assert [r for r in reads_in(f, _plan.TreeRead) if r.expand is not None and r.is_leaf is not None]
    assert traces["fastcall"] <= traces["jax"], traces
    assert _served_fast(f) >= 2


def test_a_train_state_created_with_a_python_int_step_is_served_once_its_step_is_an_array():
    """`TrainState.create` gives `step=0`, a Python int, which no FlattenTemplate reads; the
    first step makes it an array, and the state of that structure is then read by one (the
    structure path serves it), with jax.jit's outputs and no more compiles."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        counts: object
        graphdef: object

    def step(state, x):
        params = jax.tree.leaves(state.params, is_leaf=lambda v: isinstance(v, nnx.Variable))
        total = sum(jnp.sum(v[...]) for v in params) + state.counts["calls"][...]
        return state.replace(step=state.step + 1), x * total

    def start():
        graphdef, params, counts = nnx.split(Counted(nnx.Rngs(0)), nnx.Param, Count)
        return TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=optax.sgd(0.1), counts=counts)

    f, g = as_pytree(step), jax.jit(step)
    mine, theirs = start(), start()
    assert type(mine.step) is int
    x = jnp.ones(2)
    for _ in range(6):
        mine, got = f(mine, x)
        theirs, want = g(theirs, x)
        assert _values((mine, got)) == _values((theirs, want))
    assert f.stats().compiles <= g._cache_size()
    assert _served_fast(f) >= 3

"""fastcall.jit and fastcall.partial against nnx.jit: values, returned structure, state written back."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fastcall
from fastcall._nnx import _entries, _variables

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, run_threads, served, state_of
from .models import TinyDecoder  # a copy of the decoder the benchmark times

pytestmark = pytest.mark.usefixtures("hot_path")

# nnx.jit's graph_updates= (and tree mode's semantics with it) exist from flax 0.12.6 on.
needs_graph_updates = pytest.mark.skipif(
    "graph_updates" not in inspect.signature(nnx.jit).parameters,
    reason="this flax's nnx.jit has no graph_updates argument (flax < 0.12.6)",
)


def assert_same_state(a: Any, b: Any) -> None:
    assert_trees_equal(state_of(a), state_of(b))


# The two fastcall entry points under test, each given (fn, *bound) -> callable(rest).
def via_jit(fn: Callable, *bound: Any) -> Callable:
    f = fastcall.jit(fn)
    return lambda *rest: f(*bound, *rest)


def via_partial(fn: Callable, *bound: Any) -> Callable:
    return fastcall.partial(fn, *bound)


def via_nnx_jit(fn: Callable, *bound: Any) -> Callable:
    f = nnx.jit(fn)
    return lambda *rest: f(*bound, *rest)


FASTCALL = [pytest.param(via_jit, id="fastcall.jit"), pytest.param(via_partial, id="fastcall.partial")]


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, depth: int = 3):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return x


class BNDrop(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def forward(m, x):
    return m(x)


def run_both(make_model: Callable[[], Any], wrap: Callable, fn: Callable, inputs: list[Any]):
    """The same calls under fastcall (wrap) and nnx.jit on two identical models."""
    ours, theirs = make_model(), make_model()
    f, g = wrap(fn, ours), via_nnx_jit(fn, theirs)
    for x in inputs:
        assert_trees_equal(f(x), g(x))
        assert_same_state(ours, theirs)
    return ours, theirs, f, g


@pytest.mark.parametrize("wrap", FASTCALL)
def test_forward(wrap):
    run_both(lambda: MLP(nnx.Rngs(0)), wrap, forward, [jnp.ones((2, 4)), jnp.arange(8.0).reshape(2, 4)])


@pytest.mark.parametrize("wrap", FASTCALL)
def test_batchnorm_dropout_train_then_eval(wrap):
    xs = [jax.random.normal(jax.random.PRNGKey(i), (5, 4)) for i in range(3)]
    ours, theirs, f, g = run_both(lambda: BNDrop(nnx.Rngs(0)), wrap, forward, xs)
    ours.eval()
    theirs.eval()
    for x in xs:
        assert_trees_equal(f(x), g(x))
        assert_same_state(ours, theirs)
    ours.train()
    theirs.train()
    for x in xs:
        assert_trees_equal(f(x), g(x))
        assert_same_state(ours, theirs)


def test_pure_forward_writes_nothing_back():
    m = MLP(nnx.Rngs(0))
    f = fastcall.jit(forward)
    f(m, jnp.ones((1, 4)))
    (entry,) = [e for e in f._fastcall_state.table.values()]
    assert entry.out.nnx is None  # no NNX outputs at all: nothing written back
    assert entry.passthrough
    kernel = m.layers[0].kernel.get_raw_value()
    f(m, jnp.ones((1, 4)))
    assert m.layers[0].kernel.get_raw_value() is kernel


def test_batchnorm_writes_back_only_statistics():
    m = BNDrop(nnx.Rngs(0))
    f = fastcall.jit(forward)
    f(m, jnp.ones((2, 4)))
    (entry,) = [e for e in f._fastcall_state.table.values()]
    _, flat = nnx.graph.flatten(m, with_paths=True)
    written = {"/".join(map(str, flat.paths[i])) for _, i in entry.out.nnx.writes}
    assert written == {"bn/mean", "bn/var", "drop/rngs/count"} or written == {
        "bn/mean",
        "bn/var",
        "rngs/dropout/count",
    } or all(("bn" in w or "count" in w) for w in written)


def optimizer_step(model, optimizer, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("wrap", FASTCALL)
def test_optimizer_ten_steps(wrap):
    def make():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    (m1, o1), (m2, o2) = make(), make()
    f = wrap(optimizer_step, m1, o1)
    g = via_nnx_jit(optimizer_step, m2, o2)
    x, y = jnp.ones((3, 4)), jnp.zeros((3, 4))
    for _ in range(10):
        assert_trees_equal(f(x, y), g(x, y))
    assert_same_state(m1, m2)
    assert_same_state(o1, o2)
    assert int(o1.step[...]) == 10


@pytest.mark.parametrize("wrap", FASTCALL)
def test_kv_cache_decode_twenty_steps(wrap):
    def make():
        return TinyDecoder(11, 8, 24, nnx.Rngs(3))

    ours, theirs = make(), make()
    f, g = wrap(forward, ours), via_nnx_jit(forward, theirs)
    a = b = jnp.asarray(1, jnp.int32)
    tokens_a, tokens_b = [], []
    for _ in range(20):
        a, b = f(a), g(b)
        tokens_a.append(int(a))
        tokens_b.append(int(b))
    assert tokens_a == tokens_b
    assert_same_state(ours, theirs)
    assert int(ours.index[...]) == 20


class Tied(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.encoder = nnx.Linear(4, 4, rngs=rngs)
        self.decoder = nnx.Linear(4, 4, rngs=rngs)
        self.decoder.kernel = self.encoder.kernel  # tied weights: one Variable, two owners

    def __call__(self, x):
        self.encoder.kernel[...] = self.encoder.kernel[...] * 0.5  # update through one owner
        return self.decoder(self.encoder(x))  # read through both


@pytest.mark.parametrize("wrap", FASTCALL)
def test_tied_weights_stay_shared(wrap):
    ours, theirs, f, g = run_both(lambda: Tied(nnx.Rngs(0)), wrap, forward, [jnp.ones(4), jnp.ones(4)])
    assert ours.decoder.kernel is ours.encoder.kernel
    assert_trees_equal(ours.decoder.kernel[...], theirs.decoder.kernel[...])


class VarCounter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.array(0.0))


class Lazy(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.array(5.0))


def _count_and_grow(counter, lazy):
    counter.count[...] = counter.count[...] + 1.0  # a value write on one argument
    if not hasattr(lazy, "b"):  # a structure change on another
        lazy.b = nnx.Param(jnp.array(7.0))


def test_value_writes_and_structure_changes_in_one_call():
    results = []
    for wrap in (nnx.jit, fastcall.jit):
        c, lazy = VarCounter(), Lazy()
        wrap(_count_and_grow)(c, lazy)
        results.append((float(c.count[...]), float(lazy.a[...]), float(lazy.b[...])))
    assert results[0] == results[1] == (1.0, 5.0, 7.0)


def test_variables_shared_between_arguments_stay_shared():
    import optax

    def step(model, opt, x):
        loss, g = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        opt.update(g)
        return loss, (model(x) ** 2).mean()  # reads the parameters the update just wrote

    results = []
    for wrap in (nnx.jit, fastcall.jit):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        opt = nnx.ModelAndOptimizer(model, optax.sgd(0.1), wrt=nnx.Param)  # holds the model
        f = wrap(step)
        results.append([tuple(float(v) for v in f(model, opt, jnp.ones(3))) for _ in range(2)])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)

    class W(nnx.Module):
        def __init__(self):
            self.w = nnx.Variable(jnp.array(0.0))

    def both(a, b):
        a.w[...] = a.w[...] + 1.0
        b.w[...] = b.w[...] + 10.0
        return a.w[...]

    m = W()
    assert float(fastcall.jit(both)(m, m)) == 11.0 and float(m.w[...]) == 11.0


def test_variable_holding_a_dict_mutated_in_place_is_written_back():
    class S(nnx.Module):
        def __init__(self):
            self.s = nnx.Variable({"a": jnp.array(0.0), "b": jnp.array(0.0)})

    def bump(m, x):
        state = m.s.get_raw_value()
        state["a"] = state["a"] + x
        return state["a"]

    m = S()
    f = fastcall.jit(bump)
    outs = [float(f(m, jnp.array(1.0))) for _ in range(3)]
    assert outs == [1.0, 2.0, 3.0] and float(m.s.get_raw_value()["a"]) == 3.0


# ---- never stale: every structural change, compared with eager code and nnx.jit ----

def _add_extra(m):
    m.extra = nnx.Linear(4, 4, rngs=nnx.Rngs(7))


CHANGES: dict[str, Callable[[Any], None]] = {
    "replace Variable": lambda m: setattr(m.layers[0], "kernel", nnx.Param(jnp.full((4, 4), 0.3))),
    "swap submodule": lambda m: m.layers.__setitem__(1, nnx.Linear(4, 4, rngs=nnx.Rngs(9))),
    "append submodule": lambda m: m.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(8))),
    "delete submodule": lambda m: m.layers.__delitem__(2),
    "add attribute submodule": lambda m: setattr(m, "extra", nnx.Linear(4, 4, rngs=nnx.Rngs(7))),
    "value update": lambda m: m.layers[0].bias.__setitem__(..., jnp.full(4, 2.0)),
    "nnx.update": lambda m: nnx.update(m, jax.tree_util.tree_map(lambda x: x * 2, nnx.state(m))),
    "change Variable metadata": lambda m: m.layers[0].kernel.set_metadata(note="x"),
    # NNX's own graph updates rebuild nodes in place without __setattr__:
    "structure change made by nnx.jit": lambda m: nnx.jit(_add_extra)(m),
}


class WithExtra(MLP):
    def __call__(self, x):
        x = super().__call__(x)
        extra = getattr(self, "extra", None)
        return x if extra is None else extra(x)


@pytest.mark.parametrize("wrap", FASTCALL)
@pytest.mark.parametrize("change", list(CHANGES))
def test_structure_changes_are_never_stale(wrap, change):
    ours, theirs = WithExtra(nnx.Rngs(0)), WithExtra(nnx.Rngs(0))
    f, g = wrap(forward, ours), via_nnx_jit(forward, theirs)
    x = jnp.arange(4.0)
    assert_trees_equal(f(x), g(x))
    CHANGES[change](ours)
    CHANGES[change](theirs)
    eager = ours(x)
    assert_trees_equal(f(x), g(x))
    assert_trees_equal(f(x), eager)
    assert_same_state(ours, theirs)


class Switchable(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.scale = 2.0  # a static attribute

    def __call__(self, x):
        return self.linear(x) * self.scale


def test_static_attribute_change_recompiles_only_when_needed():
    traces = []

    def fn(m, x):
        traces.append(1)
        return m(x)

    m = Switchable(nnx.Rngs(0))
    f = fastcall.jit(fn)
    x = jnp.ones(4)
    assert_trees_equal(f(m, x), m.linear(x) * 2.0)
    m.scale = 3.0
    assert_trees_equal(f(m, x), m.linear(x) * 3.0)
    m.scale = 2.0  # back to a program compiled before
    assert_trees_equal(f(m, x), m.linear(x) * 2.0)
    m.linear.kernel[...] = jnp.eye(4)  # values only: no recompile
    assert_trees_equal(f(m, x), m.linear(x) * 2.0)
    assert len(traces) == 2


def test_recompile_explanation_names_the_changed_static_attribute():
    m = Switchable(nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    f(m, x)
    m.scale = 3.0
    f(m, x)
    (change,) = f.stats().recompiles[-1].changes
    assert change.path == "(structure)"
    assert "2.0" in change.old and "3.0" in change.new and "2.0" not in change.new
    m.linear.kernel[...] = jnp.eye(4)  # values only: the same structure, no recompile
    f(m, x)
    assert len(f.stats().recompiles) == 1


def test_partial_sees_swapped_layer_where_nnx_partials_go_stale():
    m = MLP(nnx.Rngs(0))
    serve = fastcall.partial(forward, m)
    x = jnp.ones(4)
    serve(x)
    m.layers[1] = nnx.Linear(4, 4, rngs=nnx.Rngs(42))
    assert_trees_equal(serve(x), m(x))


def test_nnx_own_graph_updates_on_builtin_layers_are_seen():
    lin = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(1)
    f(lin, x)

    def replace(m):
        m.kernel = nnx.Param(jnp.full((1, 1), 4.0))
        m.bias = nnx.Param(jnp.zeros(1))

    nnx.jit(replace)(lin)  # rebuilds nnx.Linear in place through NNX's registry
    assert_trees_equal(f(lin, x), jnp.full(1, 4.0))
    fastcall.jit(replace)(lin)  # and through fastcall's own graph updates
    assert_trees_equal(f(lin, x), lin(x))


class WithData(nnx.Module):
    def __init__(self):
        self.scales = nnx.data([jnp.array(1.0), jnp.array(2.0)])
        self.blocks = nnx.data([nnx.Linear(1, 1, rngs=nnx.Rngs(0))])

    def __call__(self, x):
        return self.blocks[0](x) * (self.scales[0] + self.scales[1])


def test_mutable_containers_inside_nnx_modules_are_reread():
    ours, twin = WithData(), WithData()
    f, g = fastcall.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
    x = jnp.ones(1)
    assert_trees_equal(f(ours, x), g(twin, x))
    for m in (ours, twin):
        m.scales[0] = jnp.array(100.0)  # in place, no __setattr__ on an NNX object
    assert_trees_equal(f(ours, x), g(twin, x))
    for m in (ours, twin):
        m.blocks[0] = nnx.Linear(1, 1, rngs=nnx.Rngs(5))
    assert_trees_equal(f(ours, x), g(twin, x))
    assert_trees_equal(f(ours, x), ours(x))


def test_containers_holding_none_or_nothing_are_reread():
    class Cached(nnx.Module):
        def __init__(self):
            self.slot = nnx.data([None])
            self.hist = nnx.data([])

        def __call__(self, x):
            total = x
            if self.slot[0] is not None:
                total = total + self.slot[0]
            for h in self.hist:
                total = total + h
            return total

    ours, twin = Cached(), Cached()
    f, g = fastcall.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    assert_trees_equal(f(ours, x), g(twin, x))
    for m in (ours, twin):
        m.slot[0] = jnp.full(3, 10.0)
    assert_trees_equal(f(ours, x), g(twin, x))
    for m in (ours, twin):
        m.hist.append(jnp.full(3, 100.0))
    assert_trees_equal(f(ours, x), g(twin, x))


def test_variable_metadata_removal_and_copy_are_seen():
    class Scaled(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array(2.0), scale=3.0)

        def __call__(self):
            return self.w[...] * getattr(self.w, "scale", 1.0)

    m = Scaled()
    f = fastcall.jit(lambda m: m())
    assert float(f(m)) == 6.0
    m.w.del_metadata("scale")
    assert float(f(m)) == float(m())
    m.w.copy_from(nnx.Param(jnp.array(5.0), scale=10.0))
    assert float(f(m)) == float(m())


def test_optimizer_state_is_read_through_its_variables_not_rewalked():
    """Plain containers in the graph (optax state, nnx.data lists) are not re-walked every
    call: a guard checks them item by item (tests/test_change_checks.py changes them)."""
    import optax

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def step(m, o, x):
        o.update(m, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m))

    f = fastcall.jit(step)
    f(model, opt, jnp.ones(2))
    # (seen once: read with one flatten, not walked for its containers yet)
    assert _entries.by_id[id(opt)].provisional and _entries.by_id[id(opt)].guard is None
    f(model, opt, jnp.ones(2))
    entry = _entries.by_id[id(opt)]
    assert not entry.volatile and not entry.provisional and entry.guard is not None and entry.direct
    with_data = WithData()
    g = fastcall.jit(lambda m, x: m(x))
    g(with_data, jnp.ones(1))
    g(with_data, jnp.ones(1))
    entry = _entries.by_id[id(with_data)]
    assert not entry.volatile and entry.guard is not None  # arrays and modules held in lists


# ---- methods, mixed arguments, composition ----


class Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.total = nnx.BatchStat(jnp.zeros(()))

    @fastcall.jit
    def add(self, x):
        self.count[...] += 1
        self.total[...] += jnp.sum(x)
        return self.total[...]


def test_decorated_method_mutates_self():
    c = Counter()
    for i in range(3):
        c.add(jnp.ones(2))
    assert int(c.count[...]) == 3
    assert float(c.total[...]) == 6.0


def test_nnx_equinox_and_arrays_in_one_call():
    nm = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    em = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))

    def fn(n, e, x, label):
        return e(n(x)), label

    out = fastcall.jit(fn)(nm, em, jnp.ones(3), "tag")
    assert_trees_equal(out[0], em(nm(jnp.ones(3))))
    assert out[1] == "tag"


def test_returns_input_module_and_new_module():
    def fn(m, x):
        return m, nnx.Linear(2, 2, rngs=nnx.Rngs(1)), m(x)

    m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    same, new, y = fastcall.jit(fn)(m, jnp.ones(2))
    assert same is m
    assert isinstance(new, nnx.Linear)
    assert_trees_equal(state_of(new), state_of(nnx.Linear(2, 2, rngs=nnx.Rngs(1))))
    assert_trees_equal(y, m(jnp.ones(2)))


def test_returned_submodule_and_variable_are_the_callers_own():
    class M(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    m = M()
    sub, var = fastcall.jit(lambda m: (m.lin, m.lin.kernel))(m)
    assert sub is m.lin and var is m.lin.kernel


def test_returned_submodule_is_found_before_the_graph_changes():
    class M(nnx.Module):
        def __init__(self):
            self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.c = nnx.Linear(2, 3, rngs=nnx.Rngs(1))

    def grow_and_return(m):
        m.a = nnx.Linear(2, 4, rngs=nnx.Rngs(2))
        return m.b

    m = M()
    assert fastcall.jit(grow_and_return)(m) is m.b


def test_inside_nnx_transforms():
    m = MLP(nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: jnp.sum(m(x)))
    g = lambda m, x: jnp.sum(m(x))  # noqa: E731
    x = jnp.ones(4)
    assert_trees_equal(state_of(nnx.grad(f)(m, x)), state_of(nnx.grad(g)(m, x)))
    xs = jnp.arange(12.0).reshape(3, 4)
    vf = nnx.vmap(f, in_axes=(None, 0))
    vg = nnx.vmap(g, in_axes=(None, 0))
    assert_trees_equal(vf(m, xs), vg(m, xs))
    assert_trees_equal(nnx.jit(f)(m, x), g(m, x))


def test_closed_over_mutation_under_outer_jit_is_an_error(hot_path):
    c = BNDrop(nnx.Rngs(0))
    f = fastcall.jit(forward)
    x = jnp.ones((2, 4))  # concrete: no argument of f is a tracer
    # Under an outer trace an NNX call runs inline (as inside nnx.jit), and NNX itself
    # refuses to mutate an object created outside that trace.
    with pytest.raises(Exception, match="trace level"):
        jax.jit(lambda: f(c, x))()
    f(c, x)
    before = f.stats().paths[FAST_PATH[hot_path]]
    with pytest.raises(Exception, match="trace level"):  # (the fast path steps aside too)
        jax.jit(lambda: f(c, x))()
    assert f.stats().paths[FAST_PATH[hot_path]] == before
    with pytest.raises(Exception, match="trace level") as info:
        jax.jit(lambda x: f(c, x))(jnp.ones((2, 4)))
    chained, e = [], info.value
    while e is not None:
        chained.append(type(e).__name__)
        e = e.__cause__ or e.__context__
    assert "_StepAside" not in chained  # no internal exception in the user's traceback


@pytest.mark.filterwarnings("ignore:backend and device argument on jit is deprecated:DeprecationWarning")
@pytest.mark.parametrize("probe", [True, False], ids=["probe", "no_probe"])
@pytest.mark.parametrize("transform", ["jit", "vmap", "grad"])
def test_nnx_calls_under_an_outer_trace(transform, probe, hot_path):
    # Every argument concrete, yet a trace is running: a call that may change state, or
    # that jax treats otherwise when nested (compiler_options, donation), must notice
    # (`_trace.at_top_level`: by reading jax's trace state directly, TOP_LEVEL_PROBE, or by
    # calling currently_jitting where no probe was found) and leave the call to the general path,
    # which runs it inline in the outer trace; a read-only call may be served, its
    # compiled function nested in the trace (which gives what running it inline gives).
    from fastcall import _trace

    if probe:
        return calls_under(transform, hot_path)
    try:
        _trace.use_probe(None)
        calls_under(transform, hot_path)
    finally:
        _trace.use_probe(_trace.TOP_LEVEL_PROBE)


def bump_first(p, x):
    p[0].bias[...] = p[0].bias[...] + 1.0
    return p[1](x)


def calls_under(transform: str, hot_path: str) -> None:
    v = nnx.Param(jnp.arange(3.0))
    pair = (nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(1)))
    f = fastcall.jit(lambda v, x: v[...] * x)
    g = fastcall.jit(lambda p, x: p[1](p[0](x)))
    h = fastcall.jit(lambda m, x: m(x))
    w = fastcall.jit(bump_first)  # changes state: steps aside (see test_closed_over_mutation_under_outer_jit_is_an_error)
    # read only, but nested jax would refuse the option, place the call apart, or consume the
    # donated input
    options = fastcall.jit(lambda m, x: m(x), compiler_options={"xla_cpu_enable_fast_math": False})
    donating = fastcall.jit(lambda p, x: p[1](p[0](x)), donate_argnums=1)
    device = jax.devices()[0]
    placed = [
        fastcall.jit(lambda m, x: m(x), device=device),
        fastcall.jit(lambda m, x: m(x), backend=device.platform),
        fastcall.jit(lambda m, x: m(x), out_shardings=jax.sharding.SingleDeviceSharding(device)),
        fastcall.jit(lambda m, x: m(x), in_shardings=(None, jax.sharding.SingleDeviceSharding(device))),
    ]
    x = jnp.ones(3)
    for _ in range(2):
        f(v, x), g(pair, x), h(pair[0], x), w(pair, x), options(pair[0], x), donating(pair, jnp.ones(3))
        for p in placed:
            p(pair[0], x)
    assert all(served(p, pair[0], x)[1] == FAST_PATH[hot_path] for p in placed)
    assert served(f, v, x)[1] == STRUCTURE_PATH[hot_path]
    assert served(g, pair, x)[1] == STRUCTURE_PATH[hot_path]
    assert served(h, pair[0], x)[1] == FAST_PATH[hot_path]
    assert served(w, pair, x)[1] == STRUCTURE_PATH[hot_path]
    assert served(options, pair[0], x)[1] == FAST_PATH[hot_path]
    assert served(donating, pair, jnp.ones(3))[1] == STRUCTURE_PATH[hot_path]
    expected = (v[...] * x).sum() + pair[1](pair[0](x)).sum() + pair[0](x).sum()
    counts = lambda: (f.stats().paths, g.stats().paths, h.stats().paths)  # noqa: E731
    before = counts()

    def inner(s):
        return s * (f(v, x).sum() + g(pair, x).sum() + h(pair[0], x).sum())

    def run(fn):
        if transform == "jit":
            return jax.jit(fn)(1.0)
        if transform == "vmap":
            return jax.vmap(fn)(jnp.ones(2))[1]
        return jax.grad(fn)(1.0)

    np.testing.assert_allclose(run(inner), expected, rtol=1e-6)
    after = counts()
    for got, was, path in zip(after, before, [STRUCTURE_PATH, STRUCTURE_PATH, FAST_PATH]):
        assert got[path[hot_path]] == was[path[hot_path]] + 1
        assert (got["general_cached"], got["general_read"]) == (was["general_cached"], was["general_read"])
    bias, paths = pair[0].bias[...], w.stats().paths
    with pytest.raises(Exception, match="trace level"):
        run(lambda s: s * w(pair, x).sum())
    assert w.stats().paths == paths
    np.testing.assert_array_equal(pair[0].bias[...], bias)
    # run inline (what the general path does), neither refused nor consuming the input
    paths, kept = (options.stats().paths, donating.stats().paths), jnp.ones(3)
    np.testing.assert_allclose(run(lambda s: s * options(pair[0], x).sum()), pair[0](x).sum(), rtol=1e-6)
    np.testing.assert_allclose(run(lambda s: s * donating(pair, kept).sum()), pair[1](pair[0](x)).sum(), rtol=1e-6)
    assert not kept.is_deleted()
    assert (options.stats().paths, donating.stats().paths) == paths
    for p in placed:
        paths = p.stats().paths
        np.testing.assert_allclose(run(lambda s, p=p: s * p(pair[0], x).sum()), pair[0](x).sum(), rtol=1e-6)
        assert p.stats().paths == paths


def test_the_trace_check_reads_jax_state_directly_on_supported_jax():
    # Without the probe the C path still checks, by calling currently_jitting (slower).
    from fastcall import _trace

    assert _trace.TOP_LEVEL_PROBE is not None


def grow(m, x):
    m.extra = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    m.layers[0].kernel = nnx.Param(m.layers[0].kernel[...] * 2)
    return m.extra(x)


def test_structure_change_inside_is_propagated_like_nnx_jit():
    ours, theirs = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    first_layer = ours.layers[1]
    assert_trees_equal(fastcall.jit(grow)(ours, jnp.ones(4)), nnx.jit(grow)(theirs, jnp.ones(4)))
    assert_same_state(ours, theirs)
    assert ours.layers[1] is first_layer  # existing objects are updated in place
    assert isinstance(ours.extra, nnx.Linear)
    assert_trees_equal(ours(jnp.ones(4)), theirs(jnp.ones(4)))


@needs_graph_updates
def test_structure_change_inside_with_graph_updates_false_changes_values_only_like_nnx_jit():
    def grow_and_count(m, x):
        m.layers[1].kernel[...] = m.layers[1].kernel[...] + 1.0  # a value: written back
        return grow(m, x)  # structure: not propagated

    ours, theirs = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    kernel = ours.layers[0].kernel
    out = fastcall.jit(grow_and_count, graph_updates=False)(ours, jnp.ones(4))
    assert_trees_equal(out, nnx.jit(grow_and_count, graph_updates=False)(theirs, jnp.ones(4)))
    assert_same_state(ours, theirs)
    assert not hasattr(ours, "extra") and ours.layers[0].kernel is kernel


def test_nnx_objects_nested_in_containers_are_read_and_written_back():
    def bump(pair, x):
        c, _ = pair
        c.count[...] = c.count[...] + 1.0
        return x * c.count[...]

    ours, theirs = VarCounter(), VarCounter()
    f, g = fastcall.jit(bump), nnx.jit(bump)
    for _ in range(3):
        assert_trees_equal(f((ours, 0), jnp.ones(1)), g((theirs, 0), jnp.ones(1)))
        assert_same_state(ours, theirs)
    assert f.stats().compiles == 1


def test_non_pytree_nnx_object_nested_in_a_container():
    class O(nnx.Object):
        def __init__(self):
            self.w = nnx.Variable(jnp.array(2.0))

    assert_trees_equal(fastcall.jit(lambda c, x: c[0].w[...] * x)([O()], jnp.ones(1)), 2.0 * jnp.ones(1))


class Built(nnx.Module):
    @fastcall.jit(static_argnums=(1, 2))  # (Python ints are traced, as under nnx.jit)
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)
        self.rngs = rngs

    @fastcall.jit
    def __call__(self, x):
        return self.bn(self.linear(x))


class BuiltRef(nnx.Module):
    @nnx.jit(static_argnums=(1, 2))
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.bn = nnx.BatchNorm(dout, rngs=rngs)
        self.rngs = rngs

    @nnx.jit
    def __call__(self, x):
        return self.bn(self.linear(x))


def test_decorated_init_and_call():
    rngs_a, rngs_b = nnx.Rngs(0), nnx.Rngs(0)
    ours, theirs = Built(3, 2, rngs_a), BuiltRef(3, 2, rngs_b)
    assert_same_state(ours, theirs)
    assert ours.rngs is rngs_a  # the caller's Rngs, not a copy
    assert_same_state(rngs_a, rngs_b)
    for _ in range(3):
        assert_trees_equal(ours(jnp.ones((4, 3))), theirs(jnp.ones((4, 3))))
    assert_same_state(ours, theirs)


def test_donated_module_stays_usable():
    def step(m, x):
        m.layers[0].bias[...] += 1.0
        return m(x)

    ours, theirs = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    f = fastcall.jit(step, donate_argnums=0)
    g = nnx.jit(step, donate_argnums=0)
    for _ in range(3):
        assert_trees_equal(f(ours, jnp.ones(4)), g(theirs, jnp.ones(4)))
    assert_same_state(ours, theirs)
    assert_trees_equal(ours(jnp.ones(4)), theirs(jnp.ones(4)))  # no deleted buffers


def test_lower_compile_writes_state_back():
    ours, theirs = BNDrop(nnx.Rngs(0)), BNDrop(nnx.Rngs(0))
    x = jnp.ones((3, 4))
    compiled = fastcall.jit(forward).lower(ours, x).compile()
    for _ in range(2):
        assert_trees_equal(compiled(ours, x), nnx.jit(forward)(theirs, x))
    assert_same_state(ours, theirs)


def test_traces_as_often_as_nnx_jit():
    counts = []
    for wrap in (fastcall.jit, nnx.jit):
        traces = []

        def fn(m, x):
            traces.append(1)
            return m(x)

        f = wrap(fn)
        m = BNDrop(nnx.Rngs(0))
        for x in (jnp.ones((2, 4)), jnp.ones((2, 4)), jnp.ones((3, 4)), jnp.ones((2, 4))):
            f(m, x)
        m.eval()
        f(m, jnp.ones((2, 4)))
        f(m, jnp.ones((2, 4)))
        counts.append(len(traces))
    assert counts[0] == counts[1] == 3


def test_inside_nnx_remat_and_scan():
    m = MLP(nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    assert_trees_equal(nnx.remat(f)(m, x), m(x))

    @nnx.scan(in_axes=(nnx.Carry, None), out_axes=nnx.Carry, length=3)
    def loop(c, m):
        return f(m, c)

    assert_trees_equal(loop(x, m), m(m(m(x))))


def test_next_to_nnx_cached_partial():
    m = BNDrop(nnx.Rngs(0))
    ref = BNDrop(nnx.Rngs(0))
    ours = fastcall.partial(forward, m)
    x = jnp.ones((2, 4))
    cached = nnx.cached_partial(nnx.jit(forward), m)
    refjit = nnx.jit(forward)
    for _ in range(2):
        assert_trees_equal(ours(x), refjit(ref, x))
        assert_trees_equal(cached(x), refjit(ref, x))
    assert_same_state(m, ref)


# ---- threads ----


@pytest.mark.parametrize("wrap", FASTCALL)
def test_eight_threads_one_module(wrap):
    m = MLP(nnx.Rngs(0), depth=2)
    f = wrap(forward, m)
    xs = [jnp.full((4,), float(i)) for i in range(8)]
    expected = [m(x) for x in xs]
    def worker(i):
        for _ in range(100):
            np.testing.assert_allclose(f(xs[i]), expected[i], rtol=1e-6)

    errors = run_threads(8, worker)
    assert not errors, errors[:1]


def test_python_scalars_are_traced_as_nnx_jit_traces_them():
    """flax's minigpt calls generate_step(tokens, sample_index) with a growing Python int:
    nnx.jit compiles once (weakly typed scalars); so must fastcall.jit."""
    traces = {"ours": 0, "theirs": 0}

    def make_step(who):
        def step(m, tokens, index, scale):
            traces[who] += 1
            return m(tokens[index]) * scale, (index + 1, scale / 2)

        return step

    ours, theirs = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    f, g = fastcall.jit(make_step("ours")), nnx.jit(make_step("theirs"))
    tokens = jnp.arange(32.0).reshape(8, 4)
    for i in range(6):
        a, b = f(ours, tokens, i, 0.5), g(theirs, tokens, i, 0.5)
        assert_trees_equal(a, b)
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            assert x.weak_type == y.weak_type and x.dtype == y.dtype
    assert traces == {"ours": 1, "theirs": 1}
    assert f.stats().compiles == 1
    # Inside containers too (a tuple of scalars), as jax.jit and nnx.jit do.
    h = fastcall.jit(lambda m, x, cfg: m(x) * cfg[0] + cfg[1])
    for k in range(3):
        assert_trees_equal(h(ours, tokens[0], (k, 0.5)), nnx.jit(lambda m, x, cfg: m(x) * cfg[0] + cfg[1])(theirs, tokens[0], (k, 0.5)))
    assert h.stats().compiles == 1


def test_variable_as_an_argument():
    """A Variable passed on its own (it cannot be weakly referenced, so it is read afresh
    each call), alone and shared with a module argument: as nnx.jit."""

    def scale(v, x):
        v[...] = v[...] * 2
        return v[...] * x

    def shared(m, v, x):
        v[...] = v[...] + 1
        return m(x)

    x = jnp.ones((2, 2))
    ours, theirs = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f, g = fastcall.jit(scale), nnx.jit(scale)
    for _ in range(3):
        assert_trees_equal(f(ours.kernel, x), g(theirs.kernel, x))
        assert_same_state(ours, theirs)
    f, g = fastcall.jit(shared), nnx.jit(shared)
    for _ in range(3):
        assert_trees_equal(f(ours, ours.bias, x[0]), g(theirs, theirs.bias, x[0]))
        assert_same_state(ours, theirs)


def test_variable_beside_other_nnx_arguments(hot_path):
    """`f(model, v, w, x)` with Variables of their own beside a module (a counter, a
    scale): the structure path reads the module from its cache entry and each Variable
    afresh, once it has checked they share nothing, and writes both back. Passing the
    module's own Variable, one Variable twice, or a Variable the module has since taken as
    an attribute is a shared reference, read jointly by the general path (with `w`, a
    Variable the joint read reaches first, beside it: see
    test_variable_held_by_another_argument for the structure path's joint reading). All as
    nnx.jit does, and as the eager call does."""

    def f(m, v, w, x):
        v[...] = v[...] + 1
        return m(x) * v[...].sum() + w[...].sum()

    def world():
        return nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Param(jnp.ones(3)), nnx.Param(jnp.arange(2.0))

    ours, theirs, eager = world(), world(), world()
    x = jnp.ones((2, 4))
    ours_f, theirs_f = fastcall.jit(f), nnx.jit(f)

    def check(pick: Callable, route: str | None) -> None:
        out, path = served(ours_f, *pick(ours), x)
        assert_trees_equal(out, theirs_f(*pick(theirs), x))
        assert_trees_equal(out, f(*pick(eager), x))
        assert_same_state(ours[0], theirs[0])
        for a, b in zip(pick(ours)[1:], pick(theirs)[1:]):
            assert_trees_equal(a[...], b[...])
        if route is not None:
            assert path == route, path

    apart = lambda w: (w[0], w[1], w[2])  # noqa: E731
    for _ in range(2):
        check(apart, None)
    for _ in range(2):
        check(apart, STRUCTURE_PATH[hot_path])
    for _ in range(2):
        check(lambda w: (w[0], w[0].bias, w[2]), "general")  # the module's own Variable
        check(lambda w: (w[0], w[1], w[1]), "general")  # one Variable twice
    check(apart, STRUCTURE_PATH[hot_path])
    for w in (ours, theirs, eager):
        w[0].scale = w[1]  # the module takes the Variable: shared from now on
    for _ in range(3):
        check(apart, "general")
    for w in (ours, theirs, eager):
        del w[0].scale
    for _ in range(2):
        check(apart, None)
    check(apart, STRUCTURE_PATH[hot_path])


def _checked_against_nnx_jit(f: Callable, ours_f: Any, ours: Any, theirs: Any, eager: Any, x: Any) -> Callable:
    """`check(pick, route)`: call `ours_f` (fastcall), nnx.jit and the eager `f` on the
    arguments `pick` takes from each world's module, then x; the same values and state
    from all three, and the route fastcall's call took."""
    theirs_f = nnx.jit(f)

    def check(pick: Callable, route: str) -> None:
        out, path = served(ours_f, *pick(ours), x)
        assert_trees_equal(out, theirs_f(*pick(theirs), x))
        assert_trees_equal(out, f(*pick(eager), x))
        assert_same_state(ours, theirs)
        assert_same_state(ours, eager)
        assert path == route, path

    return check


def test_variable_held_by_another_argument(hot_path):
    """`f(model, model.bias, x)`: the Variable is the module's own, so the call is read
    jointly (the Variable passed once, by the module, as nnx.jit shares it); from the second
    call on by the structure path, in C and in Python (`SharedVariableRead`), which checks
    the Variable is still the one at its place in the module's pinned cache entry. A
    Variable replaced in the module, or one the module no longer holds, is read again by
    the general path. Values and state as nnx.jit's and the eager call's, writes through
    either argument included."""

    def f(m, v, x):
        v[...] = v[...] + 1
        m.kernel[...] = m.kernel[...] * 0.5
        return m(x) * v[...].sum()

    ours, theirs, eager = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(3))
    ours_f = fastcall.jit(f)
    check = _checked_against_nnx_jit(f, ours_f, ours, theirs, eager, jnp.ones((2, 4)))

    own = lambda m: (m, m.bias)  # noqa: E731
    check(own, "general")
    for _ in range(2):
        check(own, STRUCTURE_PATH[hot_path])
    old = {id(m): m.bias for m in (ours, theirs, eager)}
    for m in (ours, theirs, eager):
        m.bias = nnx.Param(jnp.full((4,), 3.0))  # replaced: the entry re-read
    check(own, "general")
    check(own, STRUCTURE_PATH[hot_path])
    check(lambda m: (m, old[id(m)]), "general")  # a Variable it no longer holds
    # (the joint form's record is kept beside the one that call made: `CallPlan.others`)
    report = ours_f.explain(*own(ours), jnp.ones((2, 4)))
    assert report.route == "structure"
    assert "held by an earlier argument" in report.arguments[1].kind
    check(own, STRUCTURE_PATH[hot_path])


def test_variable_passed_before_the_module_that_holds_it(hot_path):
    """`f(model.bias, model, x)`: the joint read meets the Variable first, so it passes the
    value and the module leaves that leaf out, as nnx.jit shares it; from the second call on
    by the structure path, in C and in Python (`SharedVariableRead` with `first`), which
    checks it is still the Variable at its place in the module's pinned entry. A Variable
    replaced in the module, or one the module no longer holds, is read by the general path
    (then one of its own in its place, as the latter). Values and state as nnx.jit's and
    the eager call's."""

    def f(v, m, x):
        v[...] = v[...] + 1
        m.kernel[...] = m.kernel[...] * 0.5
        return m(x) * v[...].sum() + m.bias[...]

    ours, theirs, eager = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(3))
    ours_f = fastcall.jit(f)
    check = _checked_against_nnx_jit(f, ours_f, ours, theirs, eager, jnp.ones((2, 4)))

    own = lambda m: (m.bias, m)  # noqa: E731
    check(own, "general")
    for _ in range(2):
        check(own, STRUCTURE_PATH[hot_path])
    report = ours_f.explain(*own(ours), jnp.ones((2, 4)))
    assert report.route == "structure" and "held by a later argument" in report.arguments[0].kind
    old = {id(m): m.bias for m in (ours, theirs, eager)}
    for m in (ours, theirs, eager):
        m.bias = nnx.Param(jnp.full((4,), 3.0))  # replaced: the entry re-read
    check(own, "general")
    check(own, STRUCTURE_PATH[hot_path])
    check(lambda m: (old[id(m)], m), "general")  # a Variable it no longer holds
    check(own, STRUCTURE_PATH[hot_path])  # (its record kept beside that call's)
    apart = {id(m): nnx.Param(jnp.full((4,), 2.0)) for m in (ours, theirs, eager)}
    # one of its own, in the shared one's place: read as the call with `old` was (a Variable
    # apart from the module, its record kept)
    check(lambda m: (apart[id(m)], m), STRUCTURE_PATH[hot_path])
    for m in (ours, theirs, eager):
        assert_trees_equal(apart[id(m)][...], apart[id(ours)][...])


def test_variable_beside_a_container_of_modules(hot_path):
    """`step((model, optimizer), v, x)`: a Variable beside a tuple of NNX objects is read
    on the structure path too; the model's own Variable in its place is read jointly."""

    def step(mo, v, x):
        model, optimizer = mo
        v[...] = v[...] + 1
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss * v[...].sum()

    def world():
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        return (model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)), nnx.Param(jnp.ones(4))

    ours, theirs = world(), world()
    x = jnp.ones((2, 4))
    ours_f, theirs_f = fastcall.jit(step), nnx.jit(step)
    paths = []
    for _ in range(4):
        out, path = served(ours_f, *ours, x)
        assert_trees_equal(out, theirs_f(*theirs, x))
        assert_same_state(ours[0], theirs[0])
        assert_trees_equal(ours[1][...], theirs[1][...])
        paths.append(path)
    assert paths[-1] == STRUCTURE_PATH[hot_path], paths
    out, path = served(ours_f, ours[0], ours[0][0].bias, x)  # the model's own (updated twice)
    assert path == "general"
    assert_trees_equal(out, theirs_f(theirs[0], theirs[0][0].bias, x))
    assert_same_state(ours[0], theirs[0])


def test_nnx_cached_partial_over_a_fastcall_function():
    """nnx.cached_partial(fastcall.jit(f), model): same results and state as over nnx.jit."""

    def step(m, x):
        m.bias[...] += 1
        return m(x)

    ours, theirs = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = nnx.cached_partial(fastcall.jit(step), ours)
    g = nnx.cached_partial(nnx.jit(step), theirs)
    for i in range(3):
        assert_trees_equal(f(jnp.ones(2) * i), g(jnp.ones(2) * i))
        assert_same_state(ours, theirs)


@pytest.mark.parametrize("model_first", [True, False])
def test_cached_partial_of_a_function_the_fast_paths_already_serve(model_first, hot_path):
    """nnx.cached_partial hands its static cache to the next NNX transform; a call served by
    the fast or structure path must leave it to the general path, which consumes it (flax
    raises after the call otherwise), and the model keeps its fast route afterwards."""

    def step(a, b):
        m, x = (a, b) if model_first else (b, a)
        m.bias[...] += 1
        return m(x)

    ours, theirs = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones(2)
    f, g = fastcall.jit(step), nnx.jit(step)
    args = (lambda m: (m, x)) if model_first else (lambda m: (x, m))
    for _ in range(3):
        assert_trees_equal(f(*args(ours)), g(*args(theirs)))
    route = FAST_PATH[hot_path] if model_first else STRUCTURE_PATH[hot_path]
    out, path = served(f, *args(ours))
    assert path == route
    assert_trees_equal(out, g(*args(theirs)))
    for _ in range(2):  # (nothing cached by the partial: the model is passed at the call)
        out, path = served(nnx.cached_partial(f), *args(ours))
        assert path == "general"
        assert_trees_equal(out, nnx.cached_partial(g)(*args(theirs)))
        assert_same_state(ours, theirs)
    out, path = served(f, *args(ours))
    assert path == route
    assert_trees_equal(out, g(*args(theirs)))
    assert_same_state(ours, theirs)


def test_cached_partial_is_consumed_whatever_the_arguments(hot_path):
    """The general path consumes nnx.cached_partial's cache on every call it serves, as
    nnx.jit does: a module with no leaves (served fast otherwise), a lone Variable, no NNX
    argument at all."""

    class Scale(nnx.Module):
        def __init__(self):
            self.k = 2.0

        def __call__(self, x):
            return x * self.k

    x, m = jnp.ones(2), Scale()
    f = fastcall.jit(lambda m, x: m(x))
    f(m, x), f(m, x)
    assert served(f, m, x)[1] == FAST_PATH[hot_path]
    out, path = served(nnx.cached_partial(f), m, x)
    assert path == "general"
    assert_trees_equal(out, nnx.cached_partial(nnx.jit(lambda m, x: m(x)))(m, x))
    bias = nnx.Linear(2, 2, rngs=nnx.Rngs(0)).bias
    for g in (lambda v, x: v[...] + x, lambda a, b: a + b):
        args = (bias, x) if g.__code__.co_varnames[0] == "v" else (x, x)
        assert_trees_equal(nnx.cached_partial(fastcall.jit(g))(*args), nnx.cached_partial(nnx.jit(g))(*args))
    assert nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache is None


def test_cached_partial_pending_in_one_thread_is_seen_there_only(hot_path):
    """NNX's graph context is thread-local, and the C check reads the calling thread's own
    dict of it (kept for the thread last seen): a cache pending in one thread leaves that
    thread's call to the general path, while the other thread's calls stay fast."""
    import threading

    m, x = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(2)
    f = fastcall.jit(lambda m, x: m(x))
    expected = m(x)
    f(m, x), f(m, x)
    results = []

    def in_thread(partial_first: bool):
        try:
            for use_partial in (partial_first, not partial_first, partial_first):
                g = nnx.cached_partial(f) if use_partial else f
                out, path = served(g, m, x)
                results.append((use_partial, path, out))
        except Exception as err:  # (flax raises if the pending cache was not consumed)
            results.append(err)

    for partial_first in (True, False):
        # this thread's calls seen last, then the other's; then the other's seen last
        assert served(f, m, x)[1] == FAST_PATH[hot_path]
        t = threading.Thread(target=in_thread, args=(partial_first,))
        t.start()
        t.join()
        out, path = served(nnx.cached_partial(f), m, x)
        results.append((True, path, out))
    assert len(results) == 8, results
    for use_partial, path, out in results:
        assert path == ("general" if use_partial else FAST_PATH[hot_path])
        assert_trees_equal(out, expected)
    assert nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache is None


def test_cached_partial_pending_seen_after_a_refresh_that_ran_another_thread(hot_path):
    """Keeping a new thread's dict of the graph context releases the one kept before, which
    may run code (here a finalizer that lets another thread call meanwhile): what is kept
    afterwards must still be the calling thread's own dict."""
    import threading

    m, x = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(2)
    f = fastcall.jit(lambda m, x: m(x))
    f(m, x), f(m, x)
    expected, errors = m(x), []

    def call_fast():
        try:
            assert_trees_equal(f(m, x), expected)
        except Exception as err:
            errors.append(err)

    class CallsFromAnotherThread:
        def __del__(self):
            t = threading.Thread(target=call_fast)
            t.start()
            t.join()

    def leave_a_finalizer():  # (this thread's dict dies with it, but for the one kept)
        nnx.graphlib.GRAPH_CONTEXT.finalized_later = CallsFromAnotherThread()
        call_fast()

    t = threading.Thread(target=leave_a_finalizer)
    t.start()
    t.join()
    assert_trees_equal(f(m, x), expected)  # (the kept dict released here: another thread calls)
    out, path = served(nnx.cached_partial(f), m, x)
    assert path == "general" and not errors
    assert_trees_equal(out, expected)
    assert nnx.graphlib.GRAPH_CONTEXT.tmp_static_cache is None


def test_a_graph_context_of_another_local_type_is_read_by_getattr(hot_path):
    """Only `_thread._local`'s dict is one per thread: another implementation (gevent's
    local: one dict per greenlet, all on one thread) is read by getattr every call."""
    from fastcall import _plan

    class PerTask:  # (a context whose `__dict__` and attributes follow the current task)
        task = "a"
        dicts = {"a": {"tmp_static_cache": None}, "b": {"tmp_static_cache": None}}

        @property
        def __dict__(self):
            return PerTask.dicts[PerTask.task]

        def __getattr__(self, name):
            return PerTask.dicts[PerTask.task][name]

        def __setattr__(self, name, value):
            PerTask.dicts[PerTask.task][name] = value

    m, x = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), jnp.ones(2)
    f = fastcall.jit(lambda m, x: m(x))
    f(m, x), f(m, x)
    saved, _plan.GRAPH_CONTEXT[0] = _plan.GRAPH_CONTEXT[0], PerTask()
    try:
        assert served(f, m, x)[1] == FAST_PATH[hot_path]  # (task a's nothing pending)
        PerTask.task = "b"
        PerTask.dicts["b"]["tmp_static_cache"] = {}  # (task b's cache pending)
        out, path = served(f, m, x)
        assert path == "general" and PerTask.dicts["b"]["tmp_static_cache"] is None  # consumed
        assert_trees_equal(out, m(x))
    finally:
        _plan.GRAPH_CONTEXT[0] = saved


def test_bound_method_of_an_nnx_object_is_refused_as_nnx_jit_refuses_it():
    class M(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

        def apply(self, x):
            return self.linear(x)

        @fastcall.jit
        def decorated(self, x):
            return self.linear(x)

    m = M()
    with pytest.raises(ValueError, match="bound methods"):
        nnx.jit(m.apply)
    with pytest.raises(ValueError, match="bound methods"):
        fastcall.jit(m.apply)
    x = jnp.ones(2)
    assert_trees_equal(fastcall.jit(M.apply)(m, x), m.linear(x))  # the unbound method
    assert_trees_equal(m.decorated(x), m.linear(x))  # the decorated method


def _is_node(x):
    return isinstance(x, (nnx.Module, nnx.Variable))


def test_new_nnx_objects_returned_are_real_objects():
    """Created inside and returned: alone, in a tuple, as a bare Variable, from a function
    without arguments; the same types, values and state as under nnx.jit."""
    x = jnp.arange(3.0)
    cases = [
        (lambda: nnx.Linear(1, 2, rngs=nnx.Rngs(0)), ()),
        (lambda x: nnx.Param(x * 2), (x,)),
        (lambda x: (nnx.Linear(3, 2, rngs=nnx.Rngs(1)), x + 1), (x,)),
        (lambda x: [nnx.BatchNorm(3, rngs=nnx.Rngs(2)), {"v": nnx.Variable(x)}], (x,)),
    ]
    for make, args in cases:
        ours, theirs = fastcall.jit(make)(*args), nnx.jit(make)(*args)
        for a, b in zip(jax.tree_util.tree_leaves(ours, is_leaf=_is_node),
                        jax.tree_util.tree_leaves(theirs, is_leaf=_is_node)):
            assert type(a) is type(b)
            if isinstance(a, nnx.Variable):
                assert_trees_equal(a.get_raw_value(), b.get_raw_value())
            elif isinstance(a, nnx.Module):
                assert_same_state(a, b)
            else:
                assert_trees_equal(a, b)


# ---- Mutable static attributes (issue 11, item 11): keyed by value, never stale ----
# nnx.jit, nnx.jit(graph=False) and jax.jit all keep computing with the old value after an
# in-place change, so the oracle here is eager execution.


@dataclasses.dataclass(frozen=True)
class FrozenConfig:
    layer_types: list


@dataclasses.dataclass
class PlainConfig:
    n: int
    extra: dict


class Configured(nnx.Module):
    def __init__(self):
        self.features = [2, 3]
        self.config = {"scale": 2.0, "nested": [1, [2]]}
        self.frozen = FrozenConfig(["a", "b"])
        self.plain = PlainConfig(1, {"k": [FrozenConfig([1])]})
        self.w = nnx.Param(jnp.arange(3.0))

    def __call__(self, x):
        scale = len(self.features) * self.config["scale"] * len(self.frozen.layer_types)
        scale = scale * self.plain.n * len(self.plain.extra["k"][0].layer_types)
        return x * scale + self.w[...] * len(self.config["nested"][1])


_MUTATIONS = {
    "append": lambda m: m.features.append(4),
    "del": lambda m: m.features.__delitem__(0),
    "setitem": lambda m: m.features.__setitem__(0, 7),
    "dict-key": lambda m: m.config.__setitem__("scale", 3.0),
    "nested-list": lambda m: m.config["nested"][1].append(5),
    "frozen-dataclass-list": lambda m: m.frozen.layer_types.append("c"),
    "dataclass-field": lambda m: setattr(m.plain, "n", 2),
    "frozen-dataclass-field": lambda m: object.__setattr__(m.frozen, "layer_types", ["x", "y", "z"]),
    "deep": lambda m: m.plain.extra["k"][0].layer_types.append(2),
    "dict-in-dataclass": lambda m: m.plain.extra.__setitem__("k", [FrozenConfig([1, 2, 3])]),
}


@pytest.mark.parametrize("mutate", list(_MUTATIONS))
def test_mutable_static_attributes_are_keyed_by_value_and_never_stale(mutate, hot_path):
    """Lists, dicts and dataclasses in static attributes (`self.config = config`) are
    watched by a guard: the model stays on the fast path, and any change in place is
    seen (the peers return the old result here: the oracle is the eager call)."""
    m = Configured()
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    routes = []
    for _ in range(3):
        y, route = served(f, m, x)
        routes.append(route)
        assert_trees_equal(y, m(x))
    assert routes[-1] == FAST_PATH[hot_path]
    _MUTATIONS[mutate](m)
    y, route = served(f, m, x)
    assert route == "general"
    assert_trees_equal(y, m(x))
    assert f.stats().compiles == 2
    for _ in range(2):  # (watched again, as changed)
        y, route = served(f, m, x)
        assert_trees_equal(y, m(x))
    assert route == FAST_PATH[hot_path]
    # inside a container too, and the first value again reuses its program
    g = fastcall.jit(lambda ms, x: ms[0](x))
    assert_trees_equal(g([m], x), m(x))


@dataclasses.dataclass
class _BaseConfig:
    scale: int


@dataclasses.dataclass(slots=True)
class _SlotConfig(_BaseConfig):  # (an attribute dict from its base, its own field in a slot)
    n: int = 1


@pytest.mark.parametrize("where", ["variable metadata", "slot field"])
def test_what_a_guard_cannot_watch_is_read_every_call(where, hot_path):
    """A list in a Variable's metadata (not a static attribute), a dataclass field kept in a
    slot: nothing watches them, so the model is read every call and a change is seen."""

    class M(nnx.Module):
        def __init__(self):
            if where == "variable metadata":
                self.w = nnx.Param(jnp.arange(3.0), tags=["a"])
            else:
                self.w = nnx.Param(jnp.arange(3.0))
                self.cfg = _SlotConfig(2, 1)

        def __call__(self, x):
            n = len(self.w.tags) if where == "variable metadata" else self.cfg.n * self.cfg.scale
            return x * n + self.w[...]

    m = M()
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    for _ in range(3):
        assert_trees_equal(f(m, x), m(x))
    if where == "variable metadata":
        m.w.tags.append("b")
    else:
        m.cfg.n = 5
    y, route = served(f, m, x)
    assert route == "general"
    assert_trees_equal(y, m(x))


def test_a_static_no_guard_can_watch_is_read_every_call(hot_path):
    """A set in a static attribute (mutable, and no guard watches one): the graph is walked
    and compared by value on every call, and a change in place is seen."""

    class M(nnx.Module):
        def __init__(self):
            self.config = {"tags": {"a"}}
            self.w = nnx.Param(jnp.arange(3.0))

        def __call__(self, x):
            return x * len(self.config["tags"]) + self.w[...]

    m = M()
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    for _ in range(2):
        y, route = served(f, m, x)
        assert route == "general"
        assert_trees_equal(y, m(x))
    m.config["tags"].add("b")
    y, route = served(f, m, x)
    assert route == "general"
    assert_trees_equal(y, m(x))


def test_mutable_static_attribute_restored_reuses_the_first_program():
    m = Configured()
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    first = f(m, x)
    m.features.append(4)
    f(m, x)
    m.features.pop()
    assert_trees_equal(f(m, x), first)
    assert f.stats().compiles == 2
    assert m.features == [2, 3]  # the caller's list is untouched


def test_mutable_static_changed_inside_the_function_never_leaks_into_other_calls():
    class M(nnx.Module):
        def __init__(self):
            self.cfg = [1]
            self.w = nnx.Param(jnp.array(1.0))

    def grow(m, x):
        m.cfg.append(7)  # (a trace-time side effect; eager appends on every call)
        return m.w[...] * len(m.cfg) + x

    m = M()
    fastcall.jit(grow)(m, 0.0)
    assert m.cfg == [1, 7]  # the change inside is the caller's, as under nnx.jit
    # An unrelated function on a fresh module sees the module as built, not the change.
    assert float(fastcall.jit(lambda m: m.w[...] * len(m.cfg))(M())) == 1.0


def test_dataclass_static_with_init_false_field_is_compared_whole():
    @dataclasses.dataclass
    class Cfg:
        n: int
        sizes: list = dataclasses.field(init=False, default_factory=list)

    class M(nnx.Module):
        def __init__(self):
            self.cfg = Cfg(2)
            self.cfg.sizes.append(5)
            self.w = nnx.Param(jnp.ones(3))

    m = M()
    f = fastcall.jit(lambda m: m.w[...] * len(m.cfg.sizes) + m.cfg.n)
    assert_trees_equal(f(m), 3.0 * jnp.ones(3))
    m.cfg.sizes.append(6)
    assert_trees_equal(f(m), 4.0 * jnp.ones(3))


@needs_graph_updates
@pytest.mark.parametrize("graph_updates", [True, False])
def test_tree_mode_propagates_no_structural_change_like_nnx_jit(graph_updates):
    def add(m):
        m.extra = nnx.Param(jnp.ones(1))
        m.layers[0].kernel[...] = m.layers[0].kernel[...] + 1.0

    ours, theirs = MLP(nnx.Rngs(0)), MLP(nnx.Rngs(0))
    fastcall.jit(add, graph=False, graph_updates=graph_updates)(ours)
    nnx.jit(add, graph=False, graph_updates=graph_updates)(theirs)
    assert not hasattr(ours, "extra") and not hasattr(theirs, "extra")
    assert_same_state(ours, theirs)


def _tag_bias(m, x):
    m.bias.set_metadata(tag=1)  # (in place: the Variable is the given one)
    m.bias[...] = m.bias[...] + 1.0
    return m(x)


@needs_graph_updates
@pytest.mark.parametrize("options", [{"graph_updates": False}, {"graph": False}], ids=["no graph updates", "tree mode"])
def test_metadata_changed_inside_is_written_back_without_graph_updates_like_nnx_jit(options, hot_path):
    """Without graph updates, nnx.jit writes each changed Variable back whole
    (`update_from_state`), so metadata set inside reaches the caller's Variable, as in the
    eager call; so does fastcall's (it wrote the value only). Later calls, which change no
    metadata, take the fast path again."""
    ours, theirs, eager = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(3))
    f, g, x = fastcall.jit(_tag_bias, **options), nnx.jit(_tag_bias, **options), jnp.ones((2, 4))
    routes = []
    for _ in range(3):
        out, route = served(f, ours, x)
        routes.append(route)
        assert_trees_equal(out, g(theirs, x))
        assert_trees_equal(out, _tag_bias(eager, x))
        assert_same_state(ours, theirs)
        assert ours.bias.get_metadata() == theirs.bias.get_metadata() == eager.bias.get_metadata()
        assert ours.bias.get_metadata()["tag"] == 1
    assert routes[-1] == FAST_PATH[hot_path], routes


def test_metadata_changed_inside_is_written_back_with_graph_updates_as_the_eager_call_keeps_it():
    """With graph updates the metadata set inside reaches the caller's Variable too, as in
    the eager call (flax 0.12.8's nnx.jit drops it there, and keeps it without graph
    updates: see docs/migrating-from-nnx.md); values as nnx.jit's."""
    ours, theirs, eager = (nnx.Linear(4, 4, rngs=nnx.Rngs(0)) for _ in range(3))
    f, g, x = fastcall.jit(_tag_bias), nnx.jit(_tag_bias), jnp.ones((2, 4))
    for _ in range(3):
        out = f(ours, x)
        assert_trees_equal(out, g(theirs, x))
        assert_trees_equal(out, _tag_bias(eager, x))
        assert_trees_equal(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(theirs)))  # (values)
        assert_same_state(ours, eager)
        assert ours.bias.get_metadata()["tag"] == 1


class _Holder(nnx.Module):
    def __init__(self, inner):
        self.inner = inner


@pytest.mark.parametrize(
    "case",
    ["returned", "module returned", "in a new module", "in a list", "put into the argument",
     "replacing one of its type", "put into a State"],
)
def test_a_variable_made_outside_the_trace_is_refused_like_nnx_jit(case):
    """A Variable the function closes over, returned (on its own, inside a module it closes
    over, a new module or a list) or put into an argument: nnx.jit refuses it ("different
    trace level"); so does fastcall, naming where it is, where it once returned a copy
    made after the call. The wrapper keeps working after."""
    closed = nnx.Param(jnp.ones(2))
    outer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def f(m, x):
        if case == "returned":
            return closed
        if case == "module returned":
            return outer
        if case == "in a new module":
            return _Holder(closed)
        if case == "in a list":
            return [x, closed]
        if case == "put into the argument" and x.shape[0] == 2:
            m.extra = closed
        if case == "replacing one of its type" and x.shape[0] == 2:
            m.bias = closed
        return m(x)

    def g(s, x):  # ("put into a State": an nnx.State argument)
        s["bias"] = closed
        return x

    fn = g if case == "put into a State" else f
    where = {"returned": "the output itself", "module returned": "the output at ['bias']",
             "in a new module": "the output at ['inner']", "in a list": "the output at [1]",
             "put into the argument": "argument m at ['extra']",
             "replacing one of its type": "argument m at ['bias']", "put into a State": "argument s at ['bias']"}[case]
    in_argument = where.startswith("argument")

    def arg():
        m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        return nnx.state(m) if case == "put into a State" else m

    with pytest.raises(ValueError, match="different trace level"):
        nnx.jit(fn)(arg(), jnp.ones(2))
    ours = fastcall.jit(fn)
    m = arg()
    with pytest.raises(ValueError, match=re.escape(where) + ".*made outside this function's trace"):
        ours(m, jnp.ones(2))
    assert not hasattr(m, "extra")
    if case in ("put into the argument", "replacing one of its type"):  # (another shape: m left as it is)
        assert_trees_equal(ours(m, jnp.ones((3, 2))), nnx.jit(f)(m, jnp.ones((3, 2))))
    if in_argument and "graph_updates" in inspect.signature(nnx.jit).parameters:
        # Where nnx.jit propagates no graph change (without graph updates, or in tree mode),
        # it accepts the call and leaves the argument as it was: so does fastcall.
        for kwargs in ({"graph_updates": False}, {"graph": False}):
            theirs, mine = arg(), arg()
            assert_trees_equal(fastcall.jit(fn, **kwargs)(mine, jnp.ones(2)), nnx.jit(fn, **kwargs)(theirs, jnp.ones(2)))
            assert_trees_equal(nnx.state(mine), nnx.state(theirs))
            assert not hasattr(mine, "extra") and mine is not closed


@needs_graph_updates
def test_new_object_holding_an_input_is_aliasing_without_graph_updates_like_nnx_jit():
    def wrap(m):
        return nnx.Dict(a=m.layers[0].kernel)

    for kwargs in ({"graph_updates": False}, {"graph": False}):
        with pytest.raises(ValueError):
            nnx.jit(wrap, **kwargs)(MLP(nnx.Rngs(0)))
        with pytest.raises(fastcall.FastcallError, match="Variable aliasing"):
            fastcall.jit(wrap, **kwargs)(MLP(nnx.Rngs(0)))


@pytest.mark.skipif(_variables._HIJAX_TYPE is None or not hasattr(nnx, "var_defaults"), reason="a flax without hijax")
def test_a_hijax_variable_is_refused_with_an_error_naming_it():
    """A model made under `nnx.var_defaults(hijax=True)` is refused by a FastcallError that
    names the argument and the Variable (nnx.jit fails on it too); the wrapper keeps working."""
    try:
        with nnx.var_defaults(hijax=True):
            hijax = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    except Exception as err:  # (flax 0.12.5 on jax 0.8: its hijax needs a newer jax)
        pytest.skip(f"this flax and jax cannot make a hijax Variable: {err}")
    plain = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 2))
    f = fastcall.jit(lambda m, x: m(x))
    with pytest.raises(fastcall.FastcallError, match=r"argument 'm' holds a hijax Variable \(at bias\)"):
        f(hijax, x)
    assert_trees_equal(f(plain, x), plain(x))
    with pytest.raises(fastcall.FastcallError, match="hijax"):
        f(hijax, x)

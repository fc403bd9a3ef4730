"""Regressions found by review: each was a wrong result or wrong state before its fix."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall
from fastcall import _nnx

from .conftest import assert_trees_equal

pytestmark = pytest.mark.usefixtures("hot_path")


def test_wrappers_of_equal_functions_do_not_share_function_arrays():
    """eqx.Partial(loss, y) wrappers share compiled programs, never each other's y."""

    def mse(y, m, x):
        return jnp.mean((m(x) - y) ** 2)

    model = eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0))
    x = jnp.ones(2)
    for y in (jnp.array([0.0]), jnp.array([10.0]), jnp.array([100.0])):
        ours = fastcall.jit(eqx.Partial(mse, y))(model, x)
        ours = fastcall.jit(eqx.Partial(mse, y))(model, x)  # second call: the bound path
        assert_trees_equal(ours, eqx.filter_jit(eqx.Partial(mse, y))(model, x))


class Counter(nnx.Module):
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
        c, lazy = Counter(), Lazy()
        wrap(_count_and_grow)(c, lazy)
        results.append((float(c.count[...]), float(lazy.a[...]), float(lazy.b[...])))
    assert results[0] == results[1] == (1.0, 5.0, 7.0)


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


def test_change_made_while_the_cache_entry_is_built_is_not_lost(monkeypatch):
    class Model(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.array(0.0))
            self.flag = 0

    f = fastcall.jit(lambda m: m.p[...] + m.flag)
    m = Model()
    f(m)
    original = _nnx._graph_nodes

    def interleaved(node):  # another thread's assignment lands mid-build
        monkeypatch.setattr(_nnx, "_graph_nodes", original)
        m.flag = 1
        return original(node)

    m.flag = 0  # marks the entry stale: the next call rebuilds it
    monkeypatch.setattr(_nnx, "_graph_nodes", interleaved)  # (returns nodes, volatile)
    f(m)
    assert float(f(m)) == 1.0


def test_nnx_objects_nested_in_containers_are_a_clear_error():
    def bump(pair, x):
        c, _ = pair
        c.count[...] = c.count[...] + 1.0
        return x

    with pytest.raises(fastcall.FastcallError, match="argument 'pair' holds NNX objects inside a container"):
        fastcall.jit(bump)((Counter(), 0), jnp.ones(1))


def test_returned_submodule_and_variable_are_the_callers_own():
    class M(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    m = M()
    sub, var = fastcall.jit(lambda m: (m.lin, m.lin.kernel))(m)
    assert sub is m.lin and var is m.lin.kernel


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


def test_output_structure_depending_on_shape_traces_a_bounded_number_of_times():
    traces = []

    def fn(x):
        traces.append(1)
        return x if x.shape[0] % 2 else (x, "even")

    f = fastcall.jit(fn)
    for n in (1, 2, 3, 2, 1):
        out = f(jnp.ones(n))
        assert (type(out) is tuple) == (n % 2 == 0)
    # eqx.filter_jit traces 3 times here; fastcall at most once more at the first
    # changed structure and once per earlier shape (README, "Guarantees and limits").
    assert len(traces) <= 5
    np.testing.assert_allclose(f(jnp.ones(3)), np.ones(3))


def test_optimizer_state_is_read_through_its_variables_not_rewalked():
    """Containers holding only Variables (optax state) are not re-walked every call."""
    import optax

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def step(m, o, x):
        o.update(m, nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m))

    fastcall.jit(step)(model, opt, jnp.ones(2))
    assert not _nnx.by_id[id(opt)].volatile
    with_data = WithData()
    fastcall.jit(lambda m, x: m(x))(with_data, jnp.ones(1))
    assert _nnx.by_id[id(with_data)].volatile  # arrays and modules held directly in lists


# ---- second review ----


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


def test_non_pytree_nnx_object_nested_in_a_container_is_an_error():
    class O(nnx.Object):
        def __init__(self):
            self.w = nnx.Variable(jnp.array(1.0))

    with pytest.raises(fastcall.FastcallError, match="NNX objects inside a container"):
        fastcall.jit(lambda c, x: c[0].w[...] * x)([O()], jnp.ones(1))


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


def test_submodule_replaced_while_the_entry_is_built_is_watched(monkeypatch):
    class M(nnx.Module):
        def __init__(self):
            self.sub = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))

    m = M()
    g = fastcall.jit(lambda m, x: m.sub(x))
    x = jnp.ones((1, 2))
    original = _nnx._graph_nodes
    raced = []

    def racing(node):
        result = original(node)
        if node is m and not raced:
            raced.append(1)
            m.sub = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(1))  # "another thread"
        return result

    monkeypatch.setattr(_nnx, "_graph_nodes", racing)
    g(m, x)
    monkeypatch.setattr(_nnx, "_graph_nodes", original)
    m.sub.kernel = nnx.Param(jnp.zeros((2, 2)))
    assert_trees_equal(g(m, x), m.sub(x))

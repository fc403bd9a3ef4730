"""Recompiles exactly when the compiled program must change; never stale."""

from __future__ import annotations

import dataclasses
import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastcall

from .conftest import assert_trees_equal
from .models import WithStatics

pytestmark = pytest.mark.usefixtures("hot_path")


def counting(fn):
    traces = []

    def inner(*args, **kwargs):
        traces.append(1)
        return fn(*args, **kwargs)

    return inner, traces


def test_traces_once_per_signature_like_filter_jit(mlp):
    """Count the traces of the same call sequence under both wrappers."""
    seq = [
        (mlp, jnp.ones(4)),
        (mlp, jnp.ones(4)),
        (mlp, jnp.zeros(4)),  # new values, same shape: no retrace
        (mlp, jnp.ones((2, 4))),  # new shape: retrace
        (mlp, jnp.ones(4, jnp.float16)),  # new dtype: retrace
        (mlp, jnp.ones(4)),  # seen before: no retrace
    ]
    call = lambda m, x: jax.vmap(m)(x) if x.ndim == 2 else m(x)  # noqa: E731
    counts = []
    for wrap in (fastcall.jit, eqx.filter_jit):
        inner, traces = counting(call)
        f = wrap(inner)
        for m, x in seq:
            f(m, x)
        counts.append(len(traces))
    assert counts[0] == counts[1] == 3


def test_same_structure_new_object_does_not_recompile(mlp, key):
    inner, traces = counting(lambda m, x: m(x))
    f = fastcall.jit(inner)
    other = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(1))
    a = f(mlp, jnp.ones(4))
    b = f(other, jnp.ones(4))
    assert len(traces) == 1
    assert_trees_equal(a, mlp(jnp.ones(4)))
    assert_trees_equal(b, other(jnp.ones(4)))
    assert not np.allclose(a, b)


def test_static_change_recompiles(with_statics):
    inner, traces = counting(lambda m, x: m(x))
    f = fastcall.jit(inner)
    f(with_statics, jnp.ones(4))
    changed = dataclasses.replace(with_statics, n=2)  # static field
    out = f(changed, jnp.ones(4))
    assert out.shape == (6,)
    assert_trees_equal(out, changed(jnp.ones(4)))
    changed2 = eqx.tree_at(lambda m: m.activation, with_statics, jax.nn.tanh)  # callable leaf
    assert_trees_equal(f(changed2, jnp.ones(4)), changed2(jnp.ones(4)))
    assert len(traces) == 3
    f(with_statics, jnp.ones(4))
    assert len(traces) == 3


def test_new_object_every_call_is_never_stale():
    f = fastcall.jit(lambda m, x: m(x))
    for i in range(30):
        m = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(i))
        assert_trees_equal(f(m, jnp.ones(3)), m(jnp.ones(3)))
        del m


def test_id_reuse_after_object_dies():
    """Objects created and dropped in a loop reuse ids; results must follow the object."""
    f = fastcall.jit(lambda m, x: m(x))
    seen_ids = set()
    reused = False
    for i in range(200):
        m = WithStatics(jnp.full((2, 2), float(i)), jnp.zeros(2), jax.nn.relu, 1.0, "m", 1)
        reused |= id(m) in seen_ids
        seen_ids.add(id(m))
        assert_trees_equal(f(m, jnp.ones(2)), m(jnp.ones(2)))
        del m
        gc.collect() if i % 50 == 0 else None
    assert reused, "the test did not exercise id reuse"


def test_dead_objects_are_evicted():
    from fastcall import _flatten

    f = fastcall.jit(lambda m, x: m(x))
    m = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    f(m, jnp.ones(3))
    assert id(m) in _flatten.by_id
    oid = id(m)
    del m
    gc.collect()
    assert oid not in _flatten.by_id or _flatten.by_id[oid][0]() is not None


def test_mutable_containers_are_reread():
    """A list or dict argument can change in place: never served from a stale cache."""
    f = fastcall.jit(lambda d: d["a"] * 2)
    d = {"a": jnp.ones(2)}
    np.testing.assert_allclose(f(d), 2 * np.ones(2))
    d["a"] = jnp.full(2, 5.0)
    np.testing.assert_allclose(f(d), 10 * np.ones(2))

    class Holder(eqx.Module):
        items: list

    h = Holder([jnp.ones(2)])
    g = fastcall.jit(lambda h: h.items[0] + 1)
    np.testing.assert_allclose(g(h), 2 * np.ones(2))
    h.items[0] = jnp.full(2, 7.0)  # mutating a list inside a module
    np.testing.assert_allclose(g(h), 8 * np.ones(2))


def test_donated_inputs():
    f = fastcall.jit(lambda m, x: (m.weight * 2, x + 1), donate="all")
    m = eqx.nn.Linear(3, 3, use_bias=False, key=jax.random.PRNGKey(0))
    expected = m.weight * 2
    out = f(m, jnp.ones(3))
    assert_trees_equal(out[0], expected)
    assert m.weight.is_deleted()
    with pytest.raises(Exception, match="deleted|donated"):
        f(m, jnp.ones(3))
    m2 = eqx.nn.Linear(3, 3, use_bias=False, key=jax.random.PRNGKey(1))
    expected2 = m2.weight * 2
    assert_trees_equal(f(m2, jnp.ones(3))[0], expected2)


def test_training_loop_registers_returned_model(mlp):
    from fastcall import _flatten

    @fastcall.jit
    def step(m, x):
        return eqx.tree_at(lambda m: m.layers[-1].bias, m, m.layers[-1].bias + 1.0), m(x)

    m = mlp
    ref = mlp
    for _ in range(3):
        m, y = step(m, jnp.ones(4))
        ref, yref = eqx.filter_jit(step.__wrapped__)(ref, jnp.ones(4))
        assert_trees_equal(y, yref)
        assert _flatten.latest(m) is not None  # the next call reads it from the step's memo
    assert_trees_equal(m, ref)
    assert step.stats().compiles == 1


def test_positional_and_keyword_binding_share_a_program(mlp):
    inner, traces = counting(lambda m, x: m(x))

    def f(m, x):
        return inner(m, x)

    g = fastcall.jit(f)
    a = g(mlp, jnp.ones(4))
    b = g(mlp, x=jnp.ones(4))
    c = g(m=mlp, x=jnp.ones(4))
    assert_trees_equal(a, b)
    assert_trees_equal(a, c)
    assert len(traces) == 1


def test_shape_dependent_output_structure():
    """The output pytree may depend on input shapes: each shape keeps its own."""

    @fastcall.jit
    def f(x):
        return x if x.ndim == 1 else (x, "two", {"n": x.shape[0]})

    a = f(jnp.ones(2))
    b = f(jnp.ones((2, 2)))
    c = f(jnp.ones(3))
    d = f(jnp.ones((3, 3)))
    assert a.shape == (2,) and c.shape == (3,)
    assert b[1] == "two" and b[2]["n"] == 2
    assert d[2]["n"] == 3
    assert_trees_equal(f(jnp.ones(2)), a)
    assert_trees_equal(f(jnp.ones((2, 2))), b)


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


def test_recompile_explanations(with_statics):
    f = fastcall.jit(lambda m, x: m(x))
    f(with_statics, jnp.ones(4))
    f(with_statics, jnp.ones(4, jnp.float16))
    f(eqx.tree_at(lambda m: m.scale, with_statics, 3.0), jnp.ones(4, jnp.float16))
    stats = f.stats()
    assert stats.compiles == 3 and stats.calls == 3 and stats.hits == 0
    first, second = stats.recompiles
    assert any(c.argument == "x" and "float16" in c.new and "float32" in c.old for c in first.changes)
    assert any(c.argument == "m" and c.path == ".scale" and "3.0" in c.new for c in second.changes)
    f(with_statics, jnp.ones(4))
    assert f.stats().hits == 1
    assert "x" in str(first)


def test_clear_caches_keeps_wrappers_working(mlp):
    inner, traces = counting(lambda m, x: m(x))
    f = fastcall.jit(inner)
    f(mlp, jnp.ones(4))
    fastcall.clear_caches()
    assert_trees_equal(f(mlp, jnp.ones(4)), mlp(jnp.ones(4)))
    assert len(traces) == 2


def test_rebuilt_wrapper_around_equal_function_does_not_recompile(mlp):
    traces = []

    def loss(m, x):
        traces.append(1)
        return jnp.sum(m(x))

    for _ in range(4):
        grads = fastcall.jit(eqx.filter_grad(loss))(mlp, jnp.ones(4))
    assert len(traces) == 1
    assert_trees_equal(grads, eqx.filter_jit(eqx.filter_grad(loss))(mlp, jnp.ones(4)))


def test_wrappers_of_equal_functions_share_stats_and_clear_cache_and_others_share_nothing():
    """As README says: wrappers of one function with equal options share one table, so its
    stats and clear_cache; with other options, nothing."""

    def g(x, n):
        return x * n

    a, b, other = fastcall.jit(g), fastcall.jit(g), fastcall.jit(g, static_argnums=1)
    x = jnp.ones(2)
    a(x, 2)
    b(x, 2)
    other(x, 2)
    assert (a.stats().calls, a.stats().compiles) == (b.stats().calls, b.stats().compiles) == (2, 1)
    assert (other.stats().calls, other.stats().compiles) == (1, 1)
    b.clear_cache()
    a(x, 2)
    other(x, 2)
    assert a.stats().compiles == 2 and other.stats().compiles == 1


def test_wrappers_of_equal_functions_do_not_share_function_arrays():
    """eqx.Partial(loss, y) wrappers share compiled programs, never each other's y.

    Wrappers of equal functions share one compiled program; each passes its own
    function arrays (y) to it. Every round makes two fresh wrappers: the second
    one's call is a cache hit on the program the earlier wrappers compiled, with
    `model` found in the identity cache, and must still use its own y. (A wrapper
    whose function carries arrays of its own never installs a bound fast record:
    those are keyed by the state equal functions share, so one would leak y.)
    """

    def mse(y, m, x):
        return jnp.mean((m(x) - y) ** 2)

    model = eqx.nn.Linear(2, 1, key=jax.random.PRNGKey(0))
    x = jnp.ones(2)
    for y in (jnp.array([0.0]), jnp.array([10.0]), jnp.array([100.0])):
        ours = fastcall.jit(eqx.Partial(mse, y))(model, x)
        ours = fastcall.jit(eqx.Partial(mse, y))(model, x)  # a fresh wrapper: shared program
        assert_trees_equal(ours, eqx.filter_jit(eqx.Partial(mse, y))(model, x))

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
from fastcall import _memo

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
    with pytest.raises(fastcall.FastcallError, match=r"argument 'm' at leaf .weight is a deleted array: it was donated"):
        f(m, jnp.ones(3))
    m2 = eqx.nn.Linear(3, 3, use_bias=False, key=jax.random.PRNGKey(1))
    expected2 = m2.weight * 2
    assert_trees_equal(f(m2, jnp.ones(3))[0], expected2)


def test_a_donated_array_passed_again_is_named(hot_path):
    """XLA reports a donated buffer passed again by its position among the program's inputs
    (jax.jit too: "Invalid buffer passed to Execute() as argument 0"); fastcall names it."""
    f = fastcall.jit(lambda x, y: x + y, donate_argnums=0)
    x, y = jnp.ones(3), jnp.ones(3)
    for _ in range(2):  # (a fresh x each call, then the donated one again)
        f(jnp.ones(3), y)
    f(x, y)
    with pytest.raises(fastcall.FastcallError, match=r"argument 'x' is a deleted array: it was donated"):
        f(x, y)
    assert_trees_equal(f(jnp.ones(3), y), jnp.full(3, 2.0))  # (the wrapper keeps working)


def test_training_loop_registers_returned_model(mlp):

    @fastcall.jit
    def step(m, x):
        return eqx.tree_at(lambda m: m.layers[-1].bias, m, m.layers[-1].bias + 1.0), m(x)

    m = mlp
    ref = mlp
    for _ in range(3):
        m, y = step(m, jnp.ones(4))
        ref, yref = eqx.filter_jit(step.__wrapped__)(ref, jnp.ones(4))
        assert_trees_equal(y, yref)
        assert _memo.latest(m) is not None  # the next call reads it from the step's memo
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


def test_output_structure_depending_on_shape_traces_as_often_as_jax_jit():
    """A function whose output structure depends on input shapes is traced once per shape,
    as jax.jit and eqx.filter_jit trace it: the trace that meets another structure carries
    on, its output carrying its structure, and a call the fast or structure path had under
    way is finished by the general path (which counts it)."""

    def make(tag):
        traces = []

        def fn(x):
            traces.append(1)
            return x if x.shape[0] % 2 else (x, tag(x))

        return fn, traces

    shapes = (1, 1, 2, 3, 2, 1, 4, 3, 4)
    ours_fn, ours = make(lambda x: x * 2)
    peer_fn, peer = make(lambda x: x * 2)
    mixed_fn, mixed = make(lambda x: "even")  # (a non-array output: eqx.filter_jit's rule)
    eqx_fn, eqx_traces = make(lambda x: "even")
    f, g = fastcall.jit(ours_fn), jax.jit(peer_fn)
    h, k = fastcall.filter_jit(mixed_fn), eqx.filter_jit(eqx_fn)
    routes = []
    for n in shapes:
        x = jnp.arange(n, dtype=jnp.float32)
        before = f.stats().paths
        out = f(x)
        after = f.stats().paths
        routes.append(next(p for p in after if after[p] != before[p]))
        assert_trees_equal(out, g(x))
        assert_trees_equal(h(x), k(x))
    assert len(ours) == len(peer) == 4
    assert len(mixed) == len(eqx_traces) == 4
    assert f.stats().compiles == 4
    # the second call took the structure path; the third, traced there, came back to the
    # general path, which finished it
    assert routes[1] in ("c_structure", "python_structure")
    assert routes[2] in ("general_cached", "general_read")


def test_output_structure_varying_on_the_fast_path_writes_nnx_state_back():
    """An NNX call served by the fast path (the same model, an array) whose trace meets
    another output structure: run once (its donated input is not asked for again), then
    finished by the general path, state written back as nnx.jit writes it."""
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros(()))
            self.w = nnx.Param(jnp.ones(()))

    def make():
        traces = []

        def step(m, x):
            traces.append(1)
            m.count[...] += 1
            y = x * m.w
            return y if x.shape[0] % 2 else (y, m.count[...])

        return step, traces

    ours_fn, ours = make()
    peer_fn, peer = make()
    f = fastcall.jit(ours_fn, donate_argnums=1)
    g = nnx.jit(peer_fn, donate_argnums=1)
    a, b = Counter(), Counter()
    routes = []
    for n in (1, 1, 2, 2, 3, 4, 1):
        before = f.stats().paths
        out = f(a, jnp.arange(n, dtype=jnp.float32))
        after = f.stats().paths
        routes.append(next(p for p in after if after[p] != before[p]))
        assert_trees_equal(out, g(b, jnp.arange(n, dtype=jnp.float32)))
        assert a.count[...] == b.count[...]
    assert a.count[...] == 7
    assert len(ours) == len(peer) == 4
    assert routes[1] in ("c_fast", "python_fast")
    assert routes[2] in ("general_cached", "general_read")


def test_output_structure_varying_inside_an_outer_jit_runs_the_function_once():
    """A read-only NNX call the fast path serves inside an outer jax.jit (it may: nothing is
    written back), whose trace meets another output structure there: finished from what it
    ran, not run inline a second time (the function traced once, as jax.jit traces it)."""
    nnx = pytest.importorskip("flax.nnx")
    traces = []

    def fn(m, x):
        traces.append(x.shape)
        y = m(x)
        return y if x.shape[0] == 2 else (y, y.sum())

    f = fastcall.jit(fn)
    m = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    f(m, jnp.ones((2, 3))), f(m, jnp.ones((2, 3)))
    x3 = jnp.ones((3, 3))
    traces.clear()
    out = jax.jit(lambda z: f(m, x3)[0] + z)(1.0)
    assert traces == [(3, 3)]
    assert_trees_equal(out, m(x3) + 1.0)


def test_ahead_of_time_lowering_of_a_varying_output_structure():
    f = fastcall.jit(lambda x: x if x.shape[0] % 2 else (x, x + 1))
    f(jnp.ones(1))
    compiled = f.lower(jnp.ones(2)).compile()
    assert_trees_equal(compiled(jnp.ones(2)), (jnp.ones(2), jnp.full(2, 2.0)))
    assert_trees_equal(f(jnp.ones(2)), (jnp.ones(2), jnp.full(2, 2.0)))
    assert_trees_equal(f(jnp.ones(3)), jnp.ones(3))


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

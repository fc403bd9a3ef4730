"""The wrapper's API: composition, methods, AOT, introspection, errors, async."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall

from .conftest import assert_trees_equal, general_calls, run_threads

pytestmark = pytest.mark.usefixtures("hot_path")


# ---- composition under outer transformations ----


def _model_and_f(key):
    m = eqx.nn.MLP(3, 2, 4, 1, key=key)
    f = fastcall.jit(lambda m, x: jnp.sum(m(x) ** 2))
    g = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    return m, f, g


def test_under_grad(key):
    m, f, g = _model_and_f(key)
    assert_trees_equal(eqx.filter_grad(f)(m, jnp.ones(3)), eqx.filter_grad(g)(m, jnp.ones(3)))
    x_grad = jax.grad(lambda x: f(m, x))(jnp.ones(3))
    assert_trees_equal(x_grad, jax.grad(lambda x: g(m, x))(jnp.ones(3)))


def test_under_vmap(key):
    m, f, g = _model_and_f(key)
    xs = jnp.arange(12.0).reshape(4, 3)
    assert_trees_equal(jax.vmap(lambda x: f(m, x))(xs), jax.vmap(lambda x: g(m, x))(xs))


def test_under_jit_and_filter_jit(key):
    m, f, g = _model_and_f(key)
    x = jnp.ones(3)
    assert_trees_equal(jax.jit(lambda x: f(m, x))(x), g(m, x))
    assert_trees_equal(eqx.filter_jit(f)(m, x), g(m, x))
    # No argument is a tracer here, yet we are inside a trace: still correct.
    assert_trees_equal(jax.jit(lambda: f(m, jnp.ones(3)))(), g(m, x))
    # A module returned inside an outer trace must not be cached with tracers.
    step = fastcall.jit(lambda m: eqx.tree_at(lambda m: m.layers[0].bias, m, m.layers[0].bias + 1))
    out = eqx.filter_jit(lambda: step(m))()
    assert_trees_equal(step(out), eqx.filter_jit(step.__wrapped__)(out))


def test_under_scan(key):
    m, f, g = _model_and_f(key)

    def body(c, x):
        return c + f(m, x), None

    def body_ref(c, x):
        return c + g(m, x), None

    xs = jnp.ones((5, 3))
    assert_trees_equal(jax.lax.scan(body, 0.0, xs)[0], jax.lax.scan(body_ref, 0.0, xs)[0])


def test_currently_jitting():
    assert not fastcall.currently_jitting()
    seen = []
    jax.jit(lambda x: seen.append(fastcall.currently_jitting()) or x)(1.0)
    jax.vmap(lambda x: seen.append(fastcall.currently_jitting()) or x)(jnp.ones(2))
    assert seen == [True, True]


# ---- methods ----


class Model(eqx.Module):
    linear: eqx.nn.Linear

    @fastcall.jit
    def __call__(self, x):
        return self.linear(x)

    @fastcall.jit
    def scaled(self, x, factor):
        return self.linear(x) * factor


def test_methods(key):
    m = Model(eqx.nn.Linear(3, 2, key=key))
    assert_trees_equal(m(jnp.ones(3)), m.linear(jnp.ones(3)))
    assert_trees_equal(m(jnp.ones(3)), m.linear(jnp.ones(3)))
    assert_trees_equal(m.scaled(jnp.ones(3), 2.0), m.linear(jnp.ones(3)) * 2.0)
    m2 = Model(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(5)))
    assert_trees_equal(m2(jnp.ones(3)), m2.linear(jnp.ones(3)))


def test_method_on_plain_class():
    class Scaler:
        def __init__(self, k):
            self.k = k

        @fastcall.jit
        def apply(self, x):
            return x * self.k

    assert_trees_equal(Scaler(3.0).apply(jnp.ones(2)), jnp.full(2, 3.0))
    assert_trees_equal(Scaler(4.0).apply(jnp.ones(2)), jnp.full(2, 4.0))


# ---- wrapper identity ----


def test_wrapper_metadata_and_hashable():
    def my_function(x: jax.Array) -> jax.Array:
        """Docs."""
        return x

    f = fastcall.jit(my_function)
    assert f.__name__ == "my_function"
    assert f.__doc__ == "Docs."
    assert f.__annotations__ == my_function.__annotations__
    assert f.__wrapped__ is my_function
    hash(f)
    g = jax.jit(lambda fn, x: fn(x), static_argnums=0)
    assert_trees_equal(g(f, jnp.ones(2)), jnp.ones(2))
    assert_trees_equal(fastcall.jit(lambda fn, x: fn(x))(f, jnp.ones(2)), jnp.ones(2))


def test_decorator_with_options():
    @fastcall.jit(static_argnames="n", donate="none")
    def f(x, n):
        return x * n

    assert_trees_equal(f(jnp.ones(2), n=3), jnp.full(2, 3.0))


# ---- AOT ----


def test_lower_compile(mlp):
    f = fastcall.jit(lambda m, x, n: m(x) * n, static_argnums=2)
    lowered = f.lower(mlp, jnp.ones(4), 2)
    assert "func" in lowered.as_text()
    compiled = lowered.compile()
    assert_trees_equal(compiled(mlp, jnp.ones(4), 2), mlp(jnp.ones(4)) * 2)
    with pytest.raises(fastcall.FastcallError, match="static"):
        compiled(mlp, jnp.ones(4), 3)


def test_lower_compile_with_static_output(mlp):
    f = fastcall.jit(lambda m, x: (m(x), "tag"))
    out = f.lower(mlp, jnp.ones(4)).compile()(mlp, jnp.ones(4))
    assert out[1] == "tag"
    assert_trees_equal(out[0], mlp(jnp.ones(4)))


# ---- Python scalars returned ----


def _kinds(tree):
    """Each leaf's type, and an array's dtype and weak type: what a drop-in must match."""
    return [
        (type(x), x.dtype, x.weak_type) if isinstance(x, jax.Array) else (type(x), x)
        for x in jax.tree_util.tree_leaves(tree)
    ]


def _returns_scalars(x):
    return x * 2, 1, 2.5, True, 1j, {"n": 3}, [0.5, None]


def test_python_scalars_returned_come_back_as_jax_jit_returns_them():
    """`jax.jit` and `nnx.jit` return a Python scalar the function returns as an array
    (weakly typed, a bool not); `fastcall.jit` is their drop-in: the same, from every route
    that serves the call (the first call, the structure path, the fast path)."""
    x = jnp.arange(3.0)
    assert all(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(jax.jit(_returns_scalars)(x)))
    f = fastcall.jit(_returns_scalars)
    for i in range(3):
        out = f(x + i)  # (a new array each call: the structure path after the first)
        assert_trees_equal(out, jax.jit(_returns_scalars)(x + i))
        assert _kinds(out) == _kinds(jax.jit(_returns_scalars)(x + i))
    assert f.stats().compiles == 1 and f.stats().paths["general_cached"] == 1  # (an array: nothing to read)

    def apply(m, x):
        return _returns_scalars(m(x))

    # (one model each: nnx.jit rebuilds the model it is passed in place, which fastcall
    # would take for a change and read again)
    model, twin = nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    ours, theirs = fastcall.jit(apply), nnx.jit(apply)
    for _ in range(3):  # (the same module each call: the fast path after the first)
        out, expected = ours(model, x), theirs(twin, x)
        assert_trees_equal(out, expected)
        assert _kinds(out) == _kinds(expected)
    assert ours.stats().compiles == 1 and ours.stats().paths["general_read"] == 1 == general_calls(ours)


def test_python_scalars_returned_by_filter_jit_and_inside_modules_stay_static(key):
    """`eqx.filter_jit` returns a Python scalar as it is, and so does `fastcall.filter_jit`;
    inside an Equinox module a Python scalar is static under either rule (Equinox's own
    rule, as for arguments), so a module returned by `fastcall.jit` keeps its int fields."""
    x = jnp.arange(3.0)
    ours, theirs = fastcall.filter_jit(_returns_scalars), eqx.filter_jit(_returns_scalars)
    for _ in range(2):
        assert _kinds(ours(x)) == _kinds(theirs(x))
    assert ours(x)[1] == 1 and type(ours(x)[1]) is int
    assert fastcall.filter_jit(lambda x: (x, "tag"))(x)[1] == "tag"  # (jax.jit would refuse it)

    class Counter(eqx.Module):
        weight: jax.Array
        steps: int

    def bump(c, n):
        return Counter(c.weight * 2, c.steps + 1), n

    c = Counter(jnp.ones(2), 0)
    out, n = fastcall.jit(bump)(c, 3)
    assert type(out.steps) is int and out.steps == 1
    assert isinstance(n, jax.Array) and n.weak_type  # (outside the module: jax.jit's rule)
    assert_trees_equal(out, eqx.filter_jit(bump)(c, 3)[0])


def test_a_model_returned_after_a_python_scalar_is_read_back_right(key):
    """`scale, model = step(model, x)`: the scalar is the first dynamic output, the module's
    leaves come after it. The returned module is noted with its leaves for the next step
    (read back without a flatten), which must start after the scalar's: the next steps
    give what the eager loop gives, compiling once, and the scalar comes back an array."""

    def step(m, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)
        return 0.5, eqx.apply_updates(m, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

    f = fastcall.jit(step)
    ours = theirs = eqx.nn.MLP(3, 3, 4, 1, key=key)
    x = jnp.arange(3.0)
    for _ in range(4):
        (scale, ours), (_, theirs) = f(ours, x), step(theirs, x)
        assert_trees_equal(ours, theirs)
        assert isinstance(scale, jax.Array) and scale.weak_type
    assert f.stats().compiles == 1 and f.stats().paths["general_read"] == 1 == general_calls(f)


# ---- asynchronous dispatch and eqx.error_if ----


def test_does_not_block():
    """The call returns while the computation is still running."""
    f = fastcall.jit(lambda x: jnp.linalg.matrix_power(x, 64))
    x = jnp.eye(600) * 0.999
    f(x).block_until_ready()
    out = f(x)
    was_ready = out.is_ready()
    out.block_until_ready()
    assert not was_ready


def test_error_if_reaches_user():
    def f(x):
        return eqx.error_if(x, x < 0, "negative input")

    g = fastcall.jit(f)
    assert_trees_equal(g(jnp.ones(())), jnp.ones(()))
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative input"):
        g(-jnp.ones(()))
    assert_trees_equal(g(jnp.full((), 2.0)), jnp.full((), 2.0))  # still works afterwards


# ---- errors ----


def test_user_exception_passes_through_unchanged_and_wrapper_recovers():
    class MyError(Exception):
        pass

    def f(x, fail):
        if fail:
            raise MyError("boom")
        return x + 1

    g = fastcall.jit(f, static_argnames="fail")
    with pytest.raises(MyError, match="boom"):
        g(jnp.ones(1), True)
    assert_trees_equal(g(jnp.ones(1), False), jnp.full(1, 2.0))
    with pytest.raises(MyError, match="boom"):
        g(jnp.ones(1), True)


def test_wrong_arity_is_the_functions_own_type_error():
    def f(x, y):
        return x + y

    g = fastcall.jit(f)
    with pytest.raises(TypeError) as ours:
        g(jnp.ones(1))
    with pytest.raises(TypeError) as bare:
        f(jnp.ones(1))
    assert str(ours.value) == str(bare.value)
    with pytest.raises(TypeError) as ours_kw:
        g(jnp.ones(1), z=1)
    with pytest.raises(TypeError) as bare_kw:
        f(jnp.ones(1), z=1)
    assert str(ours_kw.value) == str(bare_kw.value)


def test_unhashable_static_leaf_names_argument_and_path():
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

    f = fastcall.jit(lambda cfg, x: x)
    with pytest.raises(fastcall.FastcallError, match=r"argument 'cfg' at leaf \['opts'\]\[1\]"):
        f({"opts": (1, Unhashable())}, jnp.ones(1))


def test_static_argnum_array_is_an_error():
    f = fastcall.jit(lambda x, n: x * n, static_argnums=1)
    with pytest.raises(fastcall.FastcallError, match="argument 'n'.*array"):
        f(jnp.ones(1), jnp.ones(1))


def test_bad_donate_option():
    with pytest.raises(ValueError, match="donate"):
        fastcall.jit(lambda x: x, donate="some")  # type: ignore[arg-type]


def test_no_warnings_on_normal_path(mlp):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = fastcall.jit(lambda m, x: m(x))
        for _ in range(3):
            f(mlp, jnp.ones(4))
        g = fastcall.jit(lambda m, x: (m, x + 1), donate="all")
        g(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0)), jnp.ones(2))


# ---- threads (basic; see tests for issue 5 for more) ----


def test_threads_share_one_wrapper(mlp):
    f = fastcall.jit(lambda m, x: m(x))
    xs = [jnp.full(4, float(i)) for i in range(8)]
    expected = [mlp(x) for x in xs]
    def worker(i):
        for _ in range(50):
            np.testing.assert_allclose(f(mlp, xs[i]), expected[i], rtol=1e-6)

    assert not run_threads(8, worker)
    assert f.stats().compiles == 1



# ---- jax.jit options ----


def test_shardings_and_jit_options(mlp):
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    x = jnp.ones(4)
    f = fastcall.jit(lambda m, x: (m(x), x * 2), in_shardings=s, out_shardings=s)
    out = f(mlp, x)
    assert_trees_equal(out, (mlp(x), x * 2))
    assert out[0].sharding == s
    g = fastcall.jit(lambda m, x: m(x), in_shardings=(s, None), keep_unused=True, inline=True)
    assert_trees_equal(g(mlp, x), mlp(x))


def test_device_option_passes_through_with_jax_own_deprecation():
    f = fastcall.jit(lambda x: x + 1, device=jax.devices()[0])
    with pytest.warns(DeprecationWarning, match="device"):
        with pytest.warns(DeprecationWarning):
            jax.jit(lambda x: x + 1, device=jax.devices()[0])(jnp.ones(1))
        out = f(jnp.ones(1))
    assert_trees_equal(out, jnp.full(1, 2.0))


def test_lowered_and_compiled_offer_what_jax_offers(mlp):
    """Profiling tools work on them: everything but the call is jax's own object."""
    f = fastcall.jit(lambda m, x: m(x))
    lowered = f.lower(mlp, jnp.ones(4))
    reference = jax.jit(lambda x: x).lower(jnp.ones(4))
    assert "func" in lowered.as_text() and lowered.compiler_ir() is not None
    assert type(lowered.cost_analysis()) is type(reference.cost_analysis())
    compiled = lowered.compile()
    assert type(compiled.cost_analysis()) is type(reference.compile().cost_analysis())
    assert compiled.memory_analysis() is not None or reference.compile().memory_analysis() is None
    assert "HloModule" in compiled.as_text() or "module" in compiled.as_text()
    assert_trees_equal(compiled(mlp, jnp.ones(4)), mlp(jnp.ones(4)))
    with pytest.raises(AttributeError):
        compiled.no_such_attribute


def test_filter_jit_with_options_only_returns_a_decorator_as_equinox_does():
    """`fastcall.filter_jit(donate=...)` without a function is a decorator, as
    `eqx.filter_jit(donate=...)` is; its wrapper keeps Equinox's rule (an int static)."""

    def scale(x, n):
        """Scale."""
        return x * n

    ours, theirs = fastcall.filter_jit(donate="none")(scale), eqx.filter_jit(donate="none")(scale)
    x = jnp.arange(3.0)
    for n in (2, 2, 3):
        assert jnp.array_equal(ours(x, n), theirs(x, n))
    assert ours.stats().compiles == 2  # (n static: one program per value)
    assert ours.__name__ == "scale" and ours.__doc__ == "Scale."

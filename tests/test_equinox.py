"""fastcall.filter_jit gives the same results as eqx.filter_jit and as eager code (and
fastcall.jit keeps Equinox's rule for Equinox modules)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastcall
from fastcall import _memo

from .conftest import assert_trees_equal, check_against_peers, general_calls

pytestmark = pytest.mark.usefixtures("hot_path")


def test_mlp(mlp):
    check_against_peers(lambda m, x: m(x), mlp, jnp.arange(4.0))


def test_conv(key):
    conv = eqx.nn.Conv2d(2, 3, kernel_size=3, padding=1, key=key)
    x = jax.random.normal(key, (2, 5, 5))
    check_against_peers(lambda m, x: m(x), conv, x)


def test_static_fields_and_callables(with_statics):
    check_against_peers(lambda m, x: m(x), with_statics, jnp.ones(4))


def test_nested_containers_and_none(mlp):
    def f(tree, x):
        a, (b, c) = tree["pair"]
        return {"out": (a(x) * b, None, c), "n": tree["n"], "none": None}

    tree = {"pair": (mlp, (jnp.float32(3.0), "label")), "n": 7}
    out = check_against_peers(f, tree, jnp.ones(4))
    assert out["n"] == 7 and out["out"][2] == "label" and out["none"] is None


def test_kwargs(mlp):
    def f(m, x, *, scale=1.0, shift=None):
        y = m(x) * scale
        return y if shift is None else y + shift

    check_against_peers(f, mlp, jnp.ones(4), scale=3.0, shift=jnp.ones(3))
    check_against_peers(f, x=jnp.ones(4), m=mlp)


def test_python_scalars_are_static():
    traces = []

    @fastcall.filter_jit
    def f(x, n, flag):
        traces.append(1)
        assert isinstance(n, int) and isinstance(flag, bool)
        return x * n if flag else x

    np.testing.assert_allclose(f(jnp.ones(2), 3, True), 3 * np.ones(2))
    np.testing.assert_allclose(f(jnp.ones(2), 3, False), np.ones(2))
    np.testing.assert_allclose(f(jnp.ones(2), 3, True), 3 * np.ones(2))
    assert len(traces) == 2


def test_numpy_arrays_are_traced():
    traces = []

    @fastcall.filter_jit
    def f(x):
        traces.append(1)
        assert isinstance(x, jax.core.Tracer)
        return x * 2

    a = np.arange(3.0, dtype=np.float32)
    np.testing.assert_allclose(f(a), 2 * a)
    a[0] = 10.0  # mutated in place: the next call must see it
    np.testing.assert_allclose(f(a), 2 * a)
    assert len(traces) == 1
    assert_trees_equal(f(np.float32(2.0)), eqx.filter_jit(lambda x: x * 2)(np.float32(2.0)))


@pytest.mark.parametrize(
    "x",
    [
        jnp.ones(3, jnp.float32),
        jnp.ones(3, jnp.int32),
        jnp.ones(3, jnp.bfloat16),
        jnp.ones(3, bool),
        jnp.asarray(1.0),  # weak type
        jnp.asarray(1),  # weak int
    ],
)
def test_dtypes_and_weak_types(x):
    out = check_against_peers(lambda x, y: (x + 1, y * x), x, jnp.float32(2.0))
    expected = eqx.filter_jit(lambda x, y: (x + 1, y * x))(x, jnp.float32(2.0))
    assert out[0].dtype == expected[0].dtype
    assert out[0].weak_type == expected[0].weak_type


def test_mixed_dtypes_in_one_tree():
    tree = (jnp.ones(2, jnp.int8), jnp.ones(2, jnp.float16), {"b": jnp.zeros((), bool)})
    check_against_peers(lambda t: jax.tree_util.tree_map(lambda a: a + a, t), tree)


def test_modules_returned_from_function(mlp):
    def f(m, x):
        new = eqx.tree_at(lambda m: m.layers[0].bias, m, m.layers[0].bias + x[:8])
        return new, "tag", 3

    out = check_against_peers(f, mlp, jnp.ones(8))
    assert isinstance(out[0], eqx.nn.MLP) and out[1] == "tag" and out[2] == 3


def test_single_array_output_is_the_array(mlp):
    out = fastcall.filter_jit(lambda m, x: m(x))(mlp, jnp.ones(4))
    assert type(out) is type(jnp.ones(1))


def test_no_output():
    assert fastcall.filter_jit(lambda x: None)(jnp.ones(2)) is None


def test_static_output_values_returned_as_is():
    marker = object()
    out = fastcall.filter_jit(lambda x: (x, marker, "s", 1.5))(jnp.ones(1))
    assert out[1] is marker and out[2] == "s" and out[3] == 1.5


def test_function_that_is_a_module(mlp):
    # The model itself as the function: its arrays are traced, like eqx.filter_jit(model).
    out = fastcall.filter_jit(mlp)(jnp.ones(4))
    assert_trees_equal(out, eqx.filter_jit(mlp)(jnp.ones(4)))


def test_static_argnums_and_argnames():
    traces = []

    def f(x, mode, scale):
        traces.append(1)
        return x * scale if mode == "mul" else x + scale

    g = fastcall.jit(f, static_argnums=1, static_argnames="scale")
    assert_trees_equal(g(jnp.ones(2), "mul", 3.0), f(jnp.ones(2), "mul", 3.0))
    assert_trees_equal(g(jnp.ones(2), "add", scale=3.0), f(jnp.ones(2), "add", 3.0))
    assert_trees_equal(g(jnp.ones(2), "add", scale=3.0), f(jnp.ones(2), "add", 3.0))
    assert len(traces) == 3 + 2  # the 3 direct calls + 2 traces ("mul", "add")


def test_int_float_bool_are_different_keys():
    @fastcall.filter_jit
    def f(x, s):
        return x * s

    assert f(jnp.ones((), jnp.int32), 1).dtype == jnp.int32
    assert f(jnp.ones((), jnp.int32), 1.0).dtype == eqx.filter_jit(lambda x, s: x * s)(
        jnp.ones((), jnp.int32), 1.0
    ).dtype
    assert f(jnp.ones((), jnp.int32), True).dtype == jnp.int32


def test_signed_zero_is_a_different_key():
    f = fastcall.filter_jit(lambda x, s: x / s)
    assert float(f(jnp.ones(()), 0.0)) == np.inf
    assert float(f(jnp.ones(()), -0.0)) == -np.inf


def test_output_dict_key_order_matches_filter_jit():
    def f(x):
        return {"b": x, "a": x + 1, "c": "s"}

    ours = fastcall.filter_jit(f)(jnp.ones(1))
    theirs = eqx.filter_jit(f)(jnp.ones(1))
    assert list(ours) == list(theirs)
    assert_trees_equal(ours, theirs)


def test_returned_optimizer_state_tuple_is_reused_next_step(mlp):
    import optax


    opt = optax.adam(1e-2)

    @fastcall.filter_jit
    def step(m, s, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(m)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), s

    m, s = mlp, opt.init(eqx.filter(mlp, eqx.is_array))
    rm, rs = m, s
    for _ in range(4):
        m, s = step(m, s, jnp.ones(4))
        rm, rs = eqx.filter_jit(step.__wrapped__)(rm, rs, jnp.ones(4))
        leaves, _, _ = _memo.latest(s)  # noted for the next step, with its leaves
        assert all(a is b for a, b in zip(leaves, jax.tree_util.tree_leaves(s), strict=True))
    assert_trees_equal(m, rm)
    assert_trees_equal(s, rs)
    assert step.stats().compiles == 1
    assert step.stats().paths["general_read"] == 1 == general_calls(step)  # (every later step read them back)


def test_filter_jit_keeps_scalars_static_and_jit_traces_them(mlp):
    traces = []

    def f(m, x, n):
        traces.append(n)
        return m(x) * n

    x = jnp.ones(4)
    static = fastcall.filter_jit(f)
    for n in (1, 2, 2):
        assert_trees_equal(static(mlp, x, n), eqx.filter_jit(f)(mlp, x, n))
    assert static.stats().compiles == 2  # one program per value, as eqx.filter_jit
    traced = fastcall.jit(f)
    for n in (1, 2, 3):
        assert_trees_equal(traced(mlp, x, n), mlp(x) * n)
    assert traced.stats().compiles == 1


def test_jit_keeps_equinox_rule_inside_equinox_modules(with_statics):
    """fastcall.jit traces Python scalars passed as arguments, but an Equinox module's
    non-array fields stay static (Equinox's rule): a new `scale` is a new program."""
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    assert_trees_equal(f(with_statics, x), eqx.filter_jit(lambda m, x: m(x))(with_statics, x))
    other = eqx.tree_at(lambda m: m.scale, with_statics, 3.0)
    assert_trees_equal(f(other, x), other(x))
    assert f.stats().compiles == 2
    f(other, x)
    assert f.stats().compiles == 2

"""jax's errors inside a fastcall function name the user's function, its source line, and
each leaf by the user's argument and path, as jax.jit's do (not fastcall's function of
flat leaves and `dyn[i]`)."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fastcall


def _origin(fn, args, kwargs=None):
    """(function and source line, argument path) of the TracerBoolConversionError that
    `fn(*args)` raises."""
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        fn(*args, **(kwargs or {}))
    message = str(info.value)
    where = re.search(r"while tracing the function (\S+ at \S+) for jit", message)
    argument = re.search(r"depends on the value of the argument (\S+)\.", message)
    assert where and argument, message
    return where.group(1), argument.group(1)


def _branch_on_leaf(i):
    def branch_on(*args, **kwargs):
        if jax.tree.leaves((args, kwargs))[i].sum() > 0:  # bool() of a tracer: jax names it
            return 1.0
        return 0.0

    return branch_on


class Block(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.items = nnx.List([nnx.Param(jnp.ones(1)), nnx.Linear(1, 1, rngs=nnx.Rngs(1))])
        self.count = nnx.data(jnp.zeros(()))


CASES = {
    "arrays and a params dict": lambda: (
        (jnp.ones(2), {"w": [jnp.ones(2), jnp.ones(3)], "b": jnp.ones(())}),
        {"scale": jnp.ones(())},
    ),
    "an NNX module": lambda: ((Block(), jnp.ones(2)), {}),
    "NNX modules in a tuple": lambda: (((Block(), Block()), jnp.ones(2)), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_leaf_is_named_as_jax_jit_names_it(case):
    args, kwargs = CASES[case]()
    n = len(jax.tree.leaves((args, kwargs)))
    for i in range(n):
        fn = _branch_on_leaf(i)
        assert _origin(fastcall.jit(fn), args, kwargs) == _origin(jax.jit(fn), args, kwargs), i


def test_the_flax_guide_message_names_the_variable():
    """flax's key-concepts guide shows jax.jit's `model.traced_dim.value`; fastcall.jit and the
    user's file and line, where it printed `dyn[2]` and fastcall's own source."""

    class Model(nnx.Module):
        def __init__(self):
            self.traced_dim = nnx.Param(jnp.array(True))

    def forward(model, x):
        if model.traced_dim[...]:
            return x
        return -x

    where, argument = _origin(fastcall.jit(forward), (Model(), jnp.ones(2)))
    assert argument == "model.traced_dim.value"
    assert where.startswith("forward at ") and where.endswith(f"{__file__}:{forward.__code__.co_firstlineno}")


def test_equinox_module_leaves_are_named_by_field():
    model = eqx.nn.MLP(2, 2, 4, depth=1, key=jax.random.key(0))

    def forward(model, x):
        if model.layers[1].bias.sum() > 0:
            return x
        return x

    for wrap in (fastcall.jit, fastcall.filter_jit):
        assert _origin(wrap(forward), (model, jnp.ones(2)))[1] == "model.layers[1].bias"


def test_static_arguments_take_no_name_and_the_rest_keep_theirs():
    def forward(x, n, train):
        if train:
            return x * n
        return x

    assert _origin(fastcall.jit(forward, static_argnums=1), (jnp.ones(2), 3, jnp.array(True)))[1] == "train"
    assert _origin(fastcall.jit(forward, static_argnames="n"), (jnp.ones(2),), {"n": 3, "train": jnp.array(True)})[
        1
    ] == "train"


def test_a_structure_whose_leaves_cannot_be_told_is_named_by_its_argument():
    """A pytree node whose unflatten refuses stand-ins: its leaves are named by the
    argument (still the user's name), and the call works."""

    @jax.tree_util.register_pytree_node_class
    class Checked:
        def __init__(self, a):
            if not isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
                raise TypeError("Checked holds an array")
            self.a = a

        def tree_flatten(self):
            return (self.a,), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    def forward(c):
        if c.a.sum() > 0:
            return c.a
        return -c.a

    assert _origin(fastcall.jit(forward), (Checked(jnp.ones(2)),))[1] == "c"
    assert jnp.allclose(fastcall.jit(lambda c: c.a * 2)(Checked(jnp.ones(2))), 2.0)


def test_a_leaf_holding_a_pytree_is_named_down_to_its_arrays():
    """A Variable holding a dict passes the dict as one leaf, which jax flattens further:
    the names follow jax's count (a fixed list of names did not: jax refused the call)."""

    class Holder(nnx.Module):
        def __init__(self):
            self.s = nnx.Variable({"a": jnp.array(0.0), "b": jnp.array(1.0)})

    def forward(m):
        if m.s.get_raw_value()["b"] > 0:
            return 1.0
        return 0.0

    assert _origin(fastcall.jit(forward), (Holder(),))[1] == "m.s.value['b']"


def test_a_function_with_out_shardings_is_named_as_written():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def forward(x, train):
        if train:
            return x
        return -x

    where, argument = _origin(fastcall.jit(forward, out_shardings=sharding), (jnp.ones(2), jnp.array(True)))
    assert where.startswith("forward at ") and argument == "train"

"""Property-based: random sequences of calls and mutations never give a stale result.

Every call's output, and every piece of written-back state, must equal eager
execution and the peer (eqx.filter_jit / nnx.jit) given the same history.

Profiles: FASTCALL_HYPOTHESIS=ci (default; CI) or FASTCALL_HYPOTHESIS=thorough
(local, many more examples).
"""

from __future__ import annotations

import dataclasses
import gc
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastcall

from .conftest import assert_trees_equal, state_of
from .models import make_with_statics

settings.register_profile(
    "ci", max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("FASTCALL_HYPOTHESIS", "ci"))
# Each property runs through the C hot path and the pure-Python one (the `hot_path` fixture,
# constant across a test's examples; each example clears the caches and makes new wrappers).
through_both = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---- Equinox ----

EQX_OPS = ["call", "call", "new", "tree_at", "static", "drop", "donate", "callable"]


@through_both
@given(st.lists(st.sampled_from(EQX_OPS), min_size=1, max_size=10), st.integers(0, 1000))
def test_equinox_never_stale(hot_path, ops, seed):
    fastcall.clear_caches()
    f = fastcall.jit(lambda m, x: m(x))
    donating = fastcall.jit(lambda m, x: (m(x), m.weight + 0), donate="all")
    peer = eqx.filter_jit(lambda m, x: m(x))
    model = make_with_statics(seed)
    x = jnp.arange(4.0)
    for i, op in enumerate(ops):
        if op == "new":
            model = make_with_statics(seed + i + 1, model.n, model.activation)
        elif op == "tree_at":
            model = eqx.tree_at(lambda m: m.bias, model, model.bias + i + 1.0)
        elif op == "static":
            model = dataclasses.replace(model, n=3 - model.n)  # 1 <-> 2: another program
        elif op == "callable":
            act = jax.nn.tanh if model.activation is jax.nn.relu else jax.nn.relu
            model = eqx.tree_at(lambda m: m.activation, model, act)
        elif op == "drop":  # the old object dies; its id may be reused by the new one
            n, act = model.n, model.activation
            del model
            gc.collect()
            model = make_with_statics(seed + 100 + i, n, act)
        elif op == "donate":  # donate a copy, keep using the original
            copy = jax.tree_util.tree_map(lambda a: a + 0 if eqx.is_array(a) else a, model)
            y, w = donating(copy, x)
            assert_trees_equal(y, model(x))
            assert_trees_equal(w, model.weight)
        out = f(model, x)
        assert_trees_equal(out, model(x))
        assert_trees_equal(out, peer(model, x))


# ---- NNX ----


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.scale = 1.0

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.drop(self.bn(x)) * self.scale


def _param(i: int, shape: tuple[int, ...]) -> nnx.Param:
    return nnx.Param(jnp.full(shape, 0.1 * (i % 5) - 0.2))


NNX_MUTATIONS = {
    "value": lambda m, i: m.layers[0].bias.__setitem__(..., jnp.full(4, 0.01 * i)),
    "replace_variable": lambda m, i: setattr(m.layers[0], "kernel", _param(i, (4, 4))),
    "swap_submodule": lambda m, i: m.layers.__setitem__(min(1, len(m.layers) - 1), nnx.Linear(4, 4, rngs=nnx.Rngs(i))),
    "add_submodule": lambda m, i: m.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(i))),
    "delete_submodule": lambda m, i: (m.layers.__delitem__(len(m.layers) - 1) if len(m.layers) > 1 else None),
    "static": lambda m, i: setattr(m, "scale", float(1 + i % 3)),
    "eval": lambda m, i: m.eval(),
    "train": lambda m, i: m.train(),
    "update": lambda m, i: nnx.update(m, jax.tree_util.tree_map(lambda a: a * 0.5, nnx.state(m, nnx.Param))),
    "share": lambda m, i: setattr(m.layers[-1], "bias", m.layers[0].bias),
}
NNX_OPS = ["call", "call", "call"] + list(NNX_MUTATIONS)


@through_both
@given(st.lists(st.sampled_from(NNX_OPS), min_size=1, max_size=10), st.booleans())
def test_nnx_never_stale(hot_path, ops, use_partial):
    fastcall.clear_caches()
    ours, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))

    def fwd(m, x):
        return m(x)

    f = fastcall.partial(fwd, ours) if use_partial else (lambda x, g=fastcall.jit(fwd): g(ours, x))
    g = nnx.jit(fwd)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    for i, op in enumerate(ops):
        if op != "call":
            NNX_MUTATIONS[op](ours, i)
            NNX_MUTATIONS[op](twin, i)
        a, b = f(x), g(twin, x)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert_trees_equal(state_of(ours), state_of(twin))
        assert (ours.layers[-1].bias is ours.layers[0].bias) == (twin.layers[-1].bias is twin.layers[0].bias)


# ---- plain containers (lists and dicts passed as they are, changed in place) ----

CONTAINER_MUTATIONS = {
    "set_item": lambda p, i: p.__setitem__("b", jnp.full(4, 0.1 * i)),
    "add_key": lambda p, i: p.__setitem__(f"extra{i % 2}", jnp.full(4, 1.0 + i)),
    "del_key": lambda p, i: p.pop("extra0", None),
    "append": lambda p, i: p["layers"].append(jnp.full(4, -0.5 * i)),
    "pop": lambda p, i: (p["layers"].pop() if len(p["layers"]) > 1 else None),
    "list_item": lambda p, i: p["layers"].__setitem__(0, jnp.full(4, 0.2 * i)),
    "static": lambda p, i: p.__setitem__("name", "abc"[i % 3]),
    "copy": lambda p, i: None,  # (a new dict of the same items: below)
}
CONTAINER_OPS = ["call", "call", "call"] + list(CONTAINER_MUTATIONS)


@through_both
@given(st.lists(st.sampled_from(CONTAINER_OPS), min_size=1, max_size=12), st.booleans())
def test_containers_never_stale(hot_path, ops, as_second):
    fastcall.clear_caches()

    def fwd(p, x):
        total = x * p["b"] + sum(p["layers"]) + sum(v for k, v in p.items() if k.startswith("extra"))
        return total * len(p["name"]) if isinstance(p["name"], str) else total

    f = fastcall.jit(fwd)
    g = fastcall.jit(lambda x, p: fwd(p, x))
    params = {"b": jnp.arange(4.0), "layers": [jnp.ones(4), jnp.full(4, 2.0)], "name": "ab"}
    x = jnp.linspace(-1.0, 1.0, 4)
    for i, op in enumerate(ops):
        if op == "copy":
            params = {k: (list(v) if type(v) is list else v) for k, v in params.items()}
        elif op != "call":
            CONTAINER_MUTATIONS[op](params, i)
        out = g(x, params) if as_second else f(params, x)
        eager = fwd(params, x)
        np.testing.assert_allclose(out, eager, rtol=1e-6)
        np.testing.assert_allclose(out, _peer_call(fwd, params, x), rtol=1e-6)


def _peer_call(fwd, params, x):
    """jax.jit on the same call (it cannot take a str leaf: closed over, as its user would)."""
    name = params["name"]
    arrays = {k: v for k, v in params.items() if k != "name"}
    return jax.jit(lambda a, x: fwd({**a, "name": name}, x))(arrays, x)

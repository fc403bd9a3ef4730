"""The same layer in Equinox and in Flax, with configurations proven equal.

A published "Flax is 4x faster than Equinox" result on a 3D transposed
convolution compared a 1D convolution (Flax's `kernel_size` needs one entry
per spatial dimension) against a 3D one. Here both frameworks get the same
configuration and the same weights (Equinox's `(out, in, kd, kh, kw)` kernel
converted to Flax's `(kd, kh, kw, in, out)`), and the outputs are checked
equal (shape and values, after moving the channel axis) before timing.
"""

from __future__ import annotations

import functools

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import linen as linen_nn
from flax import nnx

import fastcall

from ._eqx_workloads import _compare as compare_arrays
from ._harness import Variant, Workload, allclose_tree
from ._nnx_workloads import LinenMLP


def _channels_first(y: Any) -> Any:
    """Flax's (1, D, H, W, C) output as Equinox's (C, D, H, W)."""
    return jnp.moveaxis(y[0], -1, 0) if y.ndim == 5 else y


def _compare(ref: list[Any], outs: list[Any]) -> None:
    for a, b in zip(ref, outs):
        allclose_tree(_channels_first(a), _channels_first(b), rtol=1e-4, atol=1e-4)


def conv_transpose_3d(name: str, description: str, channels: int, size: int) -> Workload:
    k, stride = 3, 2
    model = eqx.nn.ConvTranspose3d(channels, channels, kernel_size=k, stride=stride, padding=0, key=jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (channels, size, size, size))
    x_flax = jnp.moveaxis(x, 0, -1)[None]
    kernel = model.weight.transpose(2, 3, 4, 1, 0)  # (out, in, k,k,k) -> (k,k,k, in, out)
    bias = model.bias.reshape(-1)

    def build_nnx():
        m = nnx.ConvTranspose(
            channels, channels, kernel_size=(k, k, k), strides=(stride,) * 3, padding="VALID", rngs=nnx.Rngs(0)
        )
        m.kernel[...] = kernel
        m.bias[...] = bias
        return m

    linen_module = linen_nn.ConvTranspose(channels, kernel_size=(k, k, k), strides=(stride,) * 3, padding="VALID")
    linen_params = {"params": {"kernel": kernel, "bias": bias}}

    def call(m, x):
        return m(x)

    def make_eqx_floor():
        dynamic, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        f = jax.jit(lambda *a: eqx.combine(treedef.unflatten(a[:-1]), static)(a[-1]))
        args = (*leaves, x)
        return lambda: f(*args)

    def eqx_variant(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(call)
            return lambda: f(model, x)

        return make

    def nnx_variant(wrap: Callable[[Any], Any]):
        def make():
            m = build_nnx()
            f = wrap(call)
            return lambda: f(m, x_flax)

        return make

    def make_linen():
        f = jax.jit(linen_module.apply)
        return lambda: f(linen_params, x_flax)

    return Workload(
        name,
        description,
        [
            Variant("eager (eqx)", lambda: (lambda: model(x)), timed=False),
            Variant("floor", make_eqx_floor, note="jax.jit on the eqx leaves"),
            Variant("fastcall.jit", eqx_variant(fastcall.jit), note="Equinox model"),
            Variant("eqx.filter_jit", eqx_variant(eqx.filter_jit)),
            Variant("fastcall.jit (nnx)", nnx_variant(fastcall.jit), note="NNX model, same weights"),
            Variant("nnx.jit", nnx_variant(nnx.jit)),
            Variant("linen jax.jit(apply)", make_linen, note="Linen, same weights"),
        ],
        _compare,
        peers={"fastcall.jit": ("eqx.filter_jit",), "fastcall.jit (nnx)": ("nnx.jit", "linen jax.jit(apply)")},
    )


def first_call(name: str, description: str, width: int, depth: int) -> Workload:
    """The first call of a freshly wrapped function: tracing, compiling and running it
    (what a user waits for at start-up, and after every change of static input). Each
    timed call wraps a new function object, so no variant finds it compiled; the Equinox
    and NNX models are built once, from the same weights."""
    model = eqx.nn.MLP(width, width, width, depth, key=jax.random.PRNGKey(0))
    x = jnp.ones((width,))

    def build_nnx():
        m = nnx.Sequential(
            *[
                layer
                for i, lin in enumerate(model.layers)
                for layer in ([nnx.Linear(width, width, rngs=nnx.Rngs(0))] + ([nnx.relu] if i < depth else []))
            ]
        )
        for lin, eqx_lin in zip([l for l in m.layers if isinstance(l, nnx.Linear)], model.layers):
            lin.kernel[...] = eqx_lin.weight.T
            lin.bias[...] = eqx_lin.bias
        return m

    nnx_model = build_nnx()

    def new_call():
        def call(m, x):  # a new function object each time: nothing cached under it
            return m(x)

        return call

    def variant(wrap: Callable[[Any], Any], m: Any):
        def make():
            def run():
                return wrap(new_call())(m, x)

            return run

        return make

    dynamic, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)

    def make_floor():
        def run():
            call = new_call()
            flat = jax.jit(lambda *a: call(eqx.combine(treedef.unflatten(a[:-1]), static), a[-1]))
            return flat(*leaves, x)

        return run

    def make_partitioned():
        def run():
            call = new_call()
            return jax.jit(lambda d, x: call(eqx.combine(d, static), x))(dynamic, x)

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager (eqx)", lambda: (lambda: model(x)), timed=False),
            Variant("floor", make_floor, note="jax.jit on the pre-flattened eqx leaves, first call"),
            Variant("fastcall.jit", variant(fastcall.jit, model), note="Equinox model"),
            Variant("fastcall.filter_jit", variant(fastcall.filter_jit, model), note="Equinox model"),
            Variant("eqx.filter_jit", variant(eqx.filter_jit, model)),
            Variant("jax.jit(partitioned)", make_partitioned),
            Variant("fastcall.jit (nnx)", variant(fastcall.jit, nnx_model), note="NNX model, same weights"),
            Variant("nnx.jit", variant(nnx.jit, nnx_model)),
        ],
        lambda ref, outs: [allclose_tree(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(ref, outs)] and None,
        # (each call traces and compiles: medians move by up to ~10% between runs here)
        min_tolerance=0.10,
        peers={
            "fastcall.jit": ("eqx.filter_jit", "jax.jit(partitioned)"),
            "fastcall.filter_jit": ("eqx.filter_jit",),
            "fastcall.jit (nnx)": ("nnx.jit",),
        },
    )


def linen_train_state(name: str, description: str, width: int, depth: int, batch: int) -> Workload:
    """Linen's training loop: `state, loss = train_step(state, batch)` with a
    `flax.training.train_state.TrainState` (a flax.struct.dataclass holding the params
    dict, the optax state and, as node data, `apply_fn` and `tx`), the batch a new dict each
    step, as flax's examples write it. Peer: `jax.jit`, what those examples use. Floor:
    jax.jit on the state's flat leaves, the new leaves rebound by hand."""
    import optax
    from flax.training import train_state

    net = LinenMLP(width, depth)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    y = jnp.zeros((batch, width))
    params = net.init(jax.random.PRNGKey(0), x)["params"]
    start = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))
    # (the first step turns `step`, a Python int, into an array: every variant starts after it)
    start = jax.jit(lambda s: s.replace(step=jnp.asarray(s.step)))(start)

    def step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def stateful(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(step)
            current = [start]

            def run():
                current[0], loss = f(current[0], {"x": x, "y": y})
                return loss, current[0].params

            return run

        return make

    def make_floor():
        leaves, treedef = jax.tree_util.tree_flatten(start)
        n = len(leaves)

        def flat(*a):
            new, loss = step(treedef.unflatten(a[:n]), {"x": a[n], "y": a[n + 1]})
            return loss, *jax.tree_util.tree_leaves(new)

        f = jax.jit(flat)
        current = [tuple(leaves)]

        def run():
            loss, *new = f(*current[0], x, y)  # every leaf changes: all rebound
            current[0] = tuple(new)
            return loss, treedef.unflatten(new).params

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager", stateful(lambda f: f), timed=False),
            Variant("floor", make_floor, note="flat leaves in and out, rebound by hand"),
            Variant("fastcall.jit", stateful(fastcall.jit)),
            Variant("jax.jit", stateful(jax.jit), note="as flax's examples jit the step"),
        ],
        compare_arrays,
        peers={"fastcall.jit": ("jax.jit",)},
    )


def nnx_train_state(name: str, description: str, width: int, batch: int) -> Workload:
    """Flax's toy example 03 (`examples/nnx_toy_examples/03_train_state.py`): an NNX model
    kept as `nnx.split` States inside a `flax.training.train_state.TrainState` subclass (the
    params State, a counts State and the graphdef as fields), `state = train_step(state,
    batch)` merging them inside (a copy: the call counter is returned in the new state), as
    the example writes it, under `jax.jit`. Peer: `jax.jit`, what the example uses. Floor:
    jax.jit on the state's flat leaves, the new leaves rebound by hand."""
    import optax
    from flax.training import train_state

    class Count(nnx.Variable):
        pass

    class Linear(nnx.Module):
        def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
            self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
            self.b = nnx.Param(jnp.zeros((dout,)))

        def __call__(self, x: Any) -> Any:
            return x @ self.w[...] + self.b[...]

    class MLP(nnx.Module):
        def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
            self.count = Count(jnp.array(0))
            self.linear1 = Linear(din, dhidden, rngs=rngs)
            self.linear2 = Linear(dhidden, dout, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            self.count[...] += 1
            return self.linear2(jax.nn.relu(self.linear1(x)))

    class TrainState(train_state.TrainState):  # (as the example declares it)
        counts: Any
        graphdef: Any

    graphdef, params, counts = nnx.split(MLP(1, width, 1, rngs=nnx.Rngs(0)), nnx.Param, Count)
    start = TrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=optax.sgd(0.1), counts=counts)
    start = jax.jit(lambda s: s.replace(step=jnp.asarray(s.step)))(start)  # (as the first step leaves it)
    x = jnp.linspace(0.0, 1.0, batch)[:, None]
    y = 0.8 * x**2 + 0.1

    def train_step(state: Any, batch: Any) -> Any:
        x, y = batch

        def loss_fn(params: Any) -> Any:
            model = nnx.merge(state.graphdef, params, state.counts, copy=True)
            loss = jnp.mean((y - model(x)) ** 2)
            return loss, nnx.state(model, Count)

        grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, counts=counts)

    def stateful(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(train_step)
            current = [start]

            def run():
                current[0] = f(current[0], (x, y))
                return current[0].params, current[0].counts

            return run

        return make

    def make_floor():
        leaves, treedef = jax.tree_util.tree_flatten(start)
        n = len(leaves)
        f = jax.jit(lambda *a: jax.tree_util.tree_leaves(train_step(treedef.unflatten(a[:n]), (a[n], a[n + 1]))))
        current = [tuple(leaves)]

        def run():
            current[0] = tuple(f(*current[0], x, y))  # every leaf changes: all rebound
            new = treedef.unflatten(current[0])
            return new.params, new.counts

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager", stateful(lambda f: f), timed=False),
            Variant("floor", make_floor, note="flat leaves in and out, rebound by hand"),
            Variant("fastcall.jit", stateful(fastcall.jit)),
            Variant(
                "fastcall.jit(nnx_as_pytree)",
                stateful(functools.partial(fastcall.jit, nnx_as_pytree=True)),
                note="jax.jit's semantics for NNX objects",
            ),
            Variant("jax.jit", stateful(jax.jit), note="as the example jits the step"),
            Variant("nnx.jit", stateful(nnx.jit), note="whose rule for NNX objects fastcall.jit keeps"),
        ],
        compare_arrays,
        peers={"fastcall.jit": ("jax.jit", "nnx.jit"), "fastcall.jit(nnx_as_pytree)": ("jax.jit",)},
    )


def build(quick: bool) -> dict[str, Callable[[], Workload]]:
    out = {
        "first_call": lambda: first_call(
            "first_call", "first call of a newly wrapped function (trace + compile + run): MLP w32 d3", 32, 3
        ),
        "conv3d_transpose": lambda: conv_transpose_3d(
            "conv3d_transpose", "3D transposed conv, 2 channels, 3^3 input, stride 2: eqx vs Flax", 2, 3
        ),
        "linen_train_state": lambda: linen_train_state(
            "linen_train_state",
            "Linen train step, state, loss = step(state, batch): TrainState (adam), MLP w32 d3, batch dict of 8",
            32,
            3,
            8,
        ),
        "nnx_train_state": lambda: nnx_train_state(
            "nnx_train_state",
            "flax's toy example 03: nnx.split States and graphdef in a Linen TrainState, state = step(state, batch)",
            32,
            32,
        ),
    }
    if not quick:
        out["conv3d_transpose_compute"] = lambda: conv_transpose_3d(
            "conv3d_transpose_compute",
            "3D transposed conv, 16 channels, 16^3 input, stride 2 (compute-bound): eqx vs Flax",
            16,
            16,
        )
    return out

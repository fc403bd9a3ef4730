"""Flax NNX workloads.

Each variant builds its own model from the same seed (NNX modules are mutable,
so variants cannot share one object when state is written back); verification
proves the weights, outputs and written-back state equal before timing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as linen_nn
from flax import nnx

import fastcall

from ._harness import Variant, Workload, allclose_tree


class MLP(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class BNDrop(nnx.Module):
    """Linear -> BatchNorm -> Dropout -> Linear: state changes every call in train mode."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(width, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


class TinyDecoder(nnx.Module):
    """One attention layer over a KV cache in nnx.Cache variables: a decode step per call."""

    def __init__(self, vocab: int, dim: int, max_len: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.q = nnx.Linear(dim, dim, rngs=rngs)
        self.k = nnx.Linear(dim, dim, rngs=rngs)
        self.v = nnx.Linear(dim, dim, rngs=rngs)
        self.out = nnx.Linear(dim, vocab, rngs=rngs)
        self.k_cache = nnx.Cache(jnp.zeros((max_len, dim)))
        self.v_cache = nnx.Cache(jnp.zeros((max_len, dim)))
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))
        self.max_len = max_len

    def __call__(self, token):
        h = self.embed(token)
        i = self.index[...] % self.max_len  # wraps around: timing runs many steps
        self.k_cache[...] = jax.lax.dynamic_update_slice(self.k_cache[...], self.k(h)[None], (i, 0))
        self.v_cache[...] = jax.lax.dynamic_update_slice(self.v_cache[...], self.v(h)[None], (i, 0))
        scores = jnp.where(jnp.arange(self.max_len) <= i, self.k_cache[...] @ self.q(h), -jnp.inf)
        ctx = jax.nn.softmax(scores) @ self.v_cache[...]
        self.index[...] = self.index[...] + 1
        return jnp.argmax(self.out(ctx + h)).astype(jnp.int32)


class LayerCache(nnx.Module):
    """One layer's KV cache, held outside the model (as bonsai publishes `list[LayerCache]`)."""

    def __init__(self, max_len: int, dim: int):
        self.k = nnx.Cache(jnp.zeros((max_len, dim)))
        self.v = nnx.Cache(jnp.zeros((max_len, dim)))
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))
        self.max_len = max_len

    def write(self, k, v):
        """Store one token's k, v at the counter, advance it; return the slot written."""
        i = self.index[...] % self.max_len  # wraps around: timing runs many steps
        self.k[...] = jax.lax.dynamic_update_slice(self.k[...], k[None], (i, 0))
        self.v[...] = jax.lax.dynamic_update_slice(self.v[...], v[None], (i, 0))
        self.index[...] = self.index[...] + 1
        return i


class CachedAttention(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.q = nnx.Linear(dim, dim, rngs=rngs)
        self.k = nnx.Linear(dim, dim, rngs=rngs)
        self.v = nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, h, cache: LayerCache):
        i = cache.write(self.k(h), self.v(h))
        scores = jnp.where(jnp.arange(cache.max_len) <= i, cache.k[...] @ self.q(h), -jnp.inf)
        return jax.nn.softmax(scores) @ cache.v[...]


class ListCacheDecoder(nnx.Module):
    """A decoder of `layers` attention layers whose caches are passed in, one per layer."""

    def __init__(self, vocab: int, dim: int, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([CachedAttention(dim, rngs) for _ in range(layers)])
        self.out = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, token, caches: list[LayerCache]):
        h = self.embed(token)
        for layer, cache in zip(self.layers, caches):
            h = h + layer(h, cache)
        return jnp.argmax(self.out(h)).astype(jnp.int32)


def _state_leaves(model: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(nnx.state(model))


def _compare(ref: list[Any], outs: list[Any]) -> None:
    """Outputs step by step; written-back state after the last step."""
    assert len(ref) == len(outs)
    for (y_ref, _), (y, _) in zip(ref, outs):
        allclose_tree(y_ref, y)
    allclose_tree(ref[-1][1](), outs[-1][1]())


def _forward_variants(
    build: Callable[[], Any],
    x: Any,
    writes_state: bool,
    linen: Callable[[Any], Any] | None = None,
    before: Callable[[Any], None] | None = None,
) -> list[Variant]:
    """`before(model)`, when given, runs before every call in every variant (the floor's
    included, on its own model object), e.g. `model.eval()`: the same Python work in each."""

    def call(m, x):
        return m(x)

    def with_model(make_f: Callable[[Any], Callable[[], Any]]):
        def make():
            model = build()
            f = make_f(model)
            getter = lambda: _state_leaves(model)  # noqa: E731 - only called when verifying
            if before is None:
                return lambda: (f(), getter)

            def run():
                before(model)
                return f(), getter

            return run

        return make

    def make_floor():
        model = build()
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        n = len(leaves)

        changed: list[int] = []  # state leaves the function replaces (found at trace time)

        def flat(*a):
            m = nnx.merge(graphdef, treedef.unflatten(a[:n]))
            y = m(a[n])
            if not writes_state:
                return y
            new = jax.tree_util.tree_leaves(nnx.state(m))
            changed[:] = [i for i in range(n) if new[i] is not a[i]]
            return (y, *[new[i] for i in changed])  # only what changed, as fastcall does

        f = jax.jit(flat)
        current = [list(leaves)]
        getter = lambda: list(current[0])  # noqa: E731

        def run():
            if before is not None:
                before(model)  # the same Python work as the other variants; its result is in graphdef
            out = f(*current[0], x)
            if writes_state:
                for i, v in zip(changed, out[1:]):  # rebind the updated state by hand
                    current[0][i] = v
                return out[0], getter
            return out, getter

        return run

    def split_merge(model):
        graphdef, state = nnx.split(model)

        @jax.jit
        def f(state, x):
            m = nnx.merge(graphdef, state)
            return m(x), nnx.state(m)

        current = [state]

        def run():
            if before is not None:
                before(model)
            y, current[0] = f(current[0], x)
            return y

        return run, lambda: jax.tree_util.tree_leaves(current[0])

    def make_split_merge():
        model = build()
        run, getter = split_merge(model)
        return lambda: (run(), getter)

    variants = [
        Variant("eager", with_model(lambda m: (lambda: call(m, x))), timed=False),
        Variant(
            "floor",
            make_floor,
            note="jax.jit on the flat state leaves" + (", changed state returned and rebound" if writes_state else ""),
        ),
        Variant("fastcall.jit", with_model(lambda m: (lambda f=fastcall.jit(call): f(m, x)))),
        Variant("fastcall.partial", with_model(lambda m: (lambda f=fastcall.partial(call, m): f(x)))),
        Variant("nnx.jit", with_model(lambda m: (lambda f=nnx.jit(call): f(m, x)))),
        Variant("nnx.jit(graph=False)", with_model(lambda m: (lambda f=nnx.jit(call, graph=False): f(m, x)))),
        Variant("nnx.cached_partial", with_model(lambda m: (lambda f=nnx.cached_partial(nnx.jit(call), m): f(x)))),
        Variant(
            "nnx.jit_partial(graph=False)",
            with_model(lambda m: (lambda f=nnx.jit_partial(call, m, graph=False): f(x))),
        ),
        Variant("split/merge + jax.jit", make_split_merge, note="state threaded by hand"),
    ]
    if not writes_state:  # NNX modules are pytrees (flax 0.12): plain jax.jit takes one, but writes nothing back
        variants.append(
            Variant("jax.jit", with_model(lambda m: (lambda f=jax.jit(call): f(m, x))), note="the module as a pytree")
        )
    if linen is not None:

        def make_linen():
            model = build()
            module, params = linen(model)  # the NNX model's weights, in Linen's layout
            f = jax.jit(module.apply)
            getter = lambda: _state_leaves(model)  # noqa: E731 - same weights as the others
            return lambda: (f(params, x), getter)

        variants.append(Variant("linen jax.jit(apply)", make_linen, note="Linen twin, same weights"))
    return variants


def _forward_peers(variants: list[Variant]) -> dict[str, tuple[str, ...]]:
    """fastcall.jit replaces nnx.jit (either mode) and, where it is used, plain jax.jit on
    the module or a Linen twin's jax.jit(apply) (the same network without NNX);
    fastcall.partial replaces the NNX binding APIs. Not peers: the floor and the
    hand-written split/merge + jax.jit."""
    names = {v.name for v in variants}
    jit_peers = ("nnx.jit", "nnx.jit(graph=False)", "jax.jit", "linen jax.jit(apply)")
    partial_peers = ("nnx.cached_partial", "nnx.jit_partial(graph=False)")
    return {
        "fastcall.jit": tuple(p for p in jit_peers if p in names),
        "fastcall.partial": tuple(p for p in partial_peers if p in names),
    }


def forward(
    name: str,
    description: str,
    build: Callable[[], Any],
    x: Any,
    writes_state: bool,
    linen: Callable[[Any], Any] | None = None,
    before: Callable[[Any], None] | None = None,
    skip: tuple[str, ...] = (),
) -> Workload:
    """`skip`: variants that cannot run this model (say why where it is used)."""
    variants = _forward_variants(build, x, writes_state, linen, before)
    unknown = set(skip) - {v.name for v in variants}
    assert not unknown, f"{name}: skip names no variant: {unknown}"
    variants = [v for v in variants if v.name not in skip]
    return Workload(name, description, variants, _compare, peers=_forward_peers(variants))


# ---- Linen twins (same weights, converted to Linen's parameter tree) ----


class LinenMLP(linen_nn.Module):
    width: int
    depth: int

    @linen_nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = linen_nn.Dense(self.width)(x)
            if i < self.depth - 1:
                x = linen_nn.relu(x)
        return x


def linen_mlp(model: MLP) -> tuple[Any, Any]:
    layers = list(model.layers)
    params = {
        f"Dense_{i}": {"kernel": layer.kernel[...], "bias": layer.bias[...]} for i, layer in enumerate(layers)
    }
    return LinenMLP(layers[0].out_features, len(layers)), {"params": params}


class CNN(nnx.Module):
    """A small image classifier: two 3x3 convolutions, global average pool, dense."""

    def __init__(self, channels: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(3, channels, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(channels, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.head(x.mean(axis=(1, 2)))


class LinenCNN(linen_nn.Module):
    channels: int

    @linen_nn.compact
    def __call__(self, x):
        x = linen_nn.relu(linen_nn.Conv(self.channels, (3, 3))(x))
        x = linen_nn.relu(linen_nn.Conv(self.channels, (3, 3))(x))
        return linen_nn.Dense(10)(x.mean(axis=(1, 2)))


def linen_cnn(model: CNN) -> tuple[Any, Any]:
    def p(layer):
        return {"kernel": layer.kernel[...], "bias": layer.bias[...]}

    params = {"Conv_0": p(model.conv1), "Conv_1": p(model.conv2), "Dense_0": p(model.head)}
    return LinenCNN(model.conv1.out_features), {"params": params}



def _step_workload(
    name: str,
    description: str,
    variant: Callable[[Any], Any],
    make_floor: Callable[[], Any],
    floor_note: str,
    more_peers: dict[str, Callable[[Any], Any]] | None = None,
    jit_options: dict[str, Any] | None = None,
    **options: Any,
) -> Workload:
    """A workload of one step function: eager (the reference), the floor, fastcall.jit, and
    the peers it replaces (nnx.jit and `more_peers`), each made by `variant(wrap)`.
    `jit_options` (static_argnames, ...) are given to fastcall.jit and nnx.jit alike."""
    jit_options = jit_options or {}
    peers = {"nnx.jit": lambda f: nnx.jit(f, **jit_options), **(more_peers or {})}
    variants = [
        Variant("eager", variant(lambda f: f), timed=False),
        Variant("floor", make_floor, note=floor_note),
        Variant("fastcall.jit", variant(lambda f: fastcall.jit(f, **jit_options))),
        *(Variant(peer, variant(wrap)) for peer, wrap in peers.items()),
    ]
    return Workload(name, description, variants, _compare, peers={"fastcall.jit": tuple(peers)}, **options)

def optimizer_step(
    name: str, description: str, width: int, depth: int, batch: int, shared: bool = False, batch_dict: bool = False
) -> Workload:
    """A train step with nnx.Optimizer: parameters and optimizer state written back.
    `shared`: with nnx.ModelAndOptimizer, which holds the model (as flax's machine
    translation and diffusion examples write it), so the two arguments share every
    parameter (nnx.jit(graph=False) refuses such arguments). `batch_dict`: the batch passed
    as a new dict each step, `step(model, optimizer, {"x": x, "y": y})`, as flax's MNIST
    tutorial passes what its data loader gives."""
    x = jnp.ones((batch, width))
    y = jnp.zeros((batch, width))

    def build():
        model = MLP(width, depth, nnx.Rngs(0))
        if shared:
            return model, nnx.ModelAndOptimizer(model, optax.adam(1e-3))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def step(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        if shared:
            optimizer.update(grads)
        else:
            optimizer.update(model, grads)
        return loss

    def dict_step(model, optimizer, batch):
        return step(model, optimizer, batch["x"], batch["y"])

    def variant(wrap):
        def make():
            model, opt = build()
            getter = lambda: _state_leaves((model, opt))  # noqa: E731  (shared Variables once)
            if batch_dict:
                g = wrap(dict_step)
                return lambda: (g(model, opt, {"x": x, "y": y}), getter)
            f = wrap(step)
            return lambda: (f(model, opt, x, y), getter)

        return make

    def make_floor():
        model, opt = build()
        graphdef, state = nnx.split((model, opt))
        leaves, treedef = jax.tree_util.tree_flatten(state)
        n = len(leaves)
        changed: list[int] = []

        def flat(*a):
            m, o = nnx.merge(graphdef, treedef.unflatten(a[:n]))
            loss = step(m, o, a[n], a[n + 1])
            new = jax.tree_util.tree_leaves(nnx.state((m, o)))
            changed[:] = [i for i in range(n) if new[i] is not a[i]]
            return (loss, *[new[i] for i in changed])

        f = jax.jit(flat)
        current = list(leaves)

        def run():
            out = f(*current, x, y)
            for i, v in zip(changed, out[1:]):
                current[i] = v
            return out[0], lambda: list(current)

        return run

    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on flat state leaves, changed state returned and rebound",
        more_peers={} if shared else {"nnx.jit(graph=False)": lambda s: nnx.jit(s, graph=False)},
    )


# ---- NNX objects in other argument shapes: a lone Variable, containers ----


def variable_arg(name: str, description: str, width: int) -> Workload:
    """A Variable passed on its own (a Linear's kernel): `f(model.kernel, x)`."""
    x = jnp.ones((1, width))

    def f(v, x):
        return x @ v[...]

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model = nnx.Linear(width, width, rngs=nnx.Rngs(0))
            g = wrap(f)
            getter = lambda: _state_leaves(model)  # noqa: E731 - only called when verifying
            kernel = model.kernel  # (read once, as the floor reads its leaf once)
            return lambda: (g(kernel, x), getter)

        return make

    def make_floor():
        model = nnx.Linear(width, width, rngs=nnx.Rngs(0))
        kernel = model.kernel[...]  # the Variable's one leaf, taken out once
        g = jax.jit(lambda k, x: x @ k)
        getter = lambda: _state_leaves(model)  # noqa: E731
        return lambda: (g(kernel, x), getter)

    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on the kernel array",
    )


def variable_beside(
    name: str, description: str, width: int, depth: int, shared: bool = False, first: bool = False
) -> Workload:
    """A module and a Variable passed beside it: `f(model, v, x)`, `v` a Variable of its own
    (an offset), or with `shared` the module's own (its last layer's bias: passed once, as
    nnx.jit shares it, by the module, or with `first`, `f(v, model, x)`, by the Variable)."""
    x = jnp.ones((1, width))

    def after(model, v, x):
        return model(x) + v[...]

    def before(v, model, x):
        return model(x) + v[...]

    f = before if first else after

    def build():
        return MLP(width, depth, nnx.Rngs(0)), nnx.Variable(jnp.full((width,), 0.5))

    def pick(model, own):
        return model.layers[-1].bias if shared else own

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model, own = build()
            g = wrap(f)
            getter = lambda: [*_state_leaves(model), own[...]]  # noqa: E731
            v = pick(model, own)  # (read once, as the floor reads its leaves once)
            if first:
                return lambda: (g(v, model, x), getter)
            return lambda: (g(model, v, x), getter)

        return make

    def make_floor():
        model, own = build()
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        n = len(leaves)
        getter = lambda: [*_state_leaves(model), own[...]]  # noqa: E731
        if shared:  # (the bias is one of the model's leaves)
            g = jax.jit(lambda *a: (lambda m: m(a[n]) + m.layers[-1].bias[...])(nnx.merge(graphdef, treedef.unflatten(a[:n]))))
            return lambda: (g(*leaves, x), getter)
        g = jax.jit(lambda *a: nnx.merge(graphdef, treedef.unflatten(a[:n]))(a[n + 1]) + a[n])
        offset = own[...]
        return lambda: (g(*leaves, offset, x), getter)

    note = "jax.jit on the flat state leaves" + ("" if shared else " and the Variable's value")
    return _step_workload(name, description, variant, make_floor, note)


class FlagMLP(nnx.Module):
    """An MLP whose call takes its mode as a keyword (`model(x, train=False)`), with a
    Dropout before its last layer."""

    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, *, train: bool):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](self.drop(x, deterministic=not train))


def call_options(name: str, description: str, width: int, depth: int, batch: int) -> Workload:
    """`f(model, x, train=False)`, the mode a keyword argument named in static_argnames."""
    x = jnp.ones((batch, width))

    def f(m, x, *, train):
        return m(x, train=train)

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model = FlagMLP(width, depth, nnx.Rngs(0))
            g = wrap(f)
            getter = lambda: _state_leaves(model)  # noqa: E731 - only called when verifying
            return lambda: (g(model, x, train=False), getter)

        return make

    def make_floor():
        return _write_back_floor(FlagMLP(width, depth, nnx.Rngs(0)), lambda m, x: f(m, x, train=False), x)

    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on the flat state leaves, train=False fixed",
        more_peers={"nnx.jit(graph=False)": lambda g: nnx.jit(g, graph=False, static_argnames="train")},
        jit_options={"static_argnames": "train"},
    )


def functional(name: str, description: str, width: int, depth: int) -> Workload:
    """Flax's recommended functional API: split once, `f(graphdef, state, x)` merges
    inside the jitted function (the State is a container of Variables)."""
    x = jnp.ones((1, width))

    def f(graphdef, state, x):
        model = nnx.merge(graphdef, state)
        return model(x)

    def variant(wrap: Callable[[Any], Any]):
        def make():
            graphdef, state = nnx.split(MLP(width, depth, nnx.Rngs(0)))
            g = wrap(f)
            getter = lambda: jax.tree_util.tree_leaves(state)  # noqa: E731 - only called when verifying
            return lambda: (g(graphdef, state, x), getter)

        return make

    def make_floor():
        graphdef, state = nnx.split(MLP(width, depth, nnx.Rngs(0)))
        leaves, treedef = jax.tree_util.tree_flatten(state)
        n = len(leaves)
        g = jax.jit(lambda *a: f(graphdef, treedef.unflatten(a[:n]), a[n]))
        getter = lambda: list(leaves)  # noqa: E731
        return lambda: (g(*leaves, x), getter)

    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on the flat state leaves",
        more_peers={"jax.jit(static_argnums=0)": lambda s: jax.jit(s, static_argnums=0)},
    )


class BNModel(nnx.Module):
    """The model of flax's performance guide (docs_nnx/guides/performance.md), less the
    first layer's bias: BatchNorm cancels it, so its gradient is rounding noise, which adam
    scales up differently in eager and compiled runs."""

    def __init__(self, width: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(2, width, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(width, use_running_average=False, rngs=rngs)
        self.linear_out = nnx.Linear(width, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear_out(nnx.relu(self.bn(self.linear(x))))


def functional_loop(name: str, description: str, width: int, batch: int) -> Workload:
    """The functional training loop of flax's performance guide: `loss, state =
    step(graphdef, state, x, y)`, where `step` merges (model, optimizer), updates them and
    returns `nnx.state((model, optimizer))`: a new nnx.State passed in every call."""
    # (varied data: on a constant batch BatchNorm's output and the gradients are ~0)
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, 2))
    y = jax.random.normal(jax.random.PRNGKey(1), (batch, 3))

    def step(graphdef, state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    def split():
        model = BNModel(width, nnx.Rngs(0))
        return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))

    def variant(wrap: Callable[[Any], Any]):
        def make():
            graphdef, state = split()
            f = wrap(step)
            current = [state]

            def run():
                loss, current[0] = f(graphdef, current[0], x, y)
                return loss, lambda: jax.tree_util.tree_leaves(current[0])

            return run

        return make

    def make_floor():
        graphdef, state = split()
        leaves, treedef = jax.tree_util.tree_flatten(state)
        n = len(leaves)

        def flat(*a):
            loss, new = step(graphdef, treedef.unflatten(a[:n]), a[n], a[n + 1])
            return loss, jax.tree_util.tree_leaves(new)

        f = jax.jit(flat)
        current = [leaves]

        def run():
            loss, current[0] = f(*current[0], x, y)
            return loss, lambda: list(current[0])

        return run

    workload = _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on the flat state leaves, all returned and rebound",
    )
    # The guide's own jax.jit, shown beside the peer. Not a peer of fastcall.jit here: for
    # NNX arguments fastcall follows nnx.jit (the State passed in is updated in place);
    # jax.jit flattens the State as a pytree and leaves it as it was.
    workload.variants.append(Variant("jax.jit", variant(jax.jit), note="the guide's loop; not nnx.jit's semantics"))
    return workload


def _write_back_jit(graphdef: Any, treedef: Any, fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """jax.jit of `fn(objects, *args)` taking the flat state leaves of `objects` (merged
    from `graphdef` inside) and returning `(out, *changed leaves)`; `changed` (filled at
    trace time) lists the indices of the leaves the step replaced."""
    n = treedef.num_leaves
    changed: list[int] = []

    def flat(*a):
        objs = nnx.merge(graphdef, treedef.unflatten(a[:n]))
        out = fn(objs, *a[n:])
        new = jax.tree_util.tree_leaves(nnx.state(objs))
        assert len(new) == n, "the step changed the state's structure: the floor cannot rebind it"
        changed[:] = [i for i in range(n) if new[i] is not a[i]]
        return (out, *[new[i] for i in changed])

    return jax.jit(flat), changed


def _write_back_floor(
    objects: Any, fn: Callable[..., Any], *args: Any, fresh: Callable[[], tuple[Any, ...]] | None = None
) -> Callable[[], Any]:
    """The floor for a step that writes NNX state back: jax.jit on the flat state leaves of
    `objects` (split together, so shared Variables stay shared), only the changed leaves
    returned and rebound by hand, as `optimizer_step`'s floor does. `fn(objects, *args)`;
    with `fresh`, `fn(objects, *fresh())`, its arrays made anew for each call."""
    graphdef, state = nnx.split(objects)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    f, changed = _write_back_jit(graphdef, treedef, fn)
    current = list(leaves)

    def run():
        out = f(*current, *(args if fresh is None else fresh()))
        for i, v in zip(changed, out[1:]):
            current[i] = v
        return out[0], lambda: list(current)

    return run


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """A dataclass of NNX objects passed as one argument (`step(TrainState(model, optimizer), ...)`)."""

    model: Any
    optimizer: Any


def optimizer_tuple_step(name: str, description: str, width: int, depth: int, batch: int, container: str = "tuple") -> Workload:
    """`optimizer_step` with `(model, optimizer)` passed as one argument: a tuple, a dict
    `{"model": model, "optimizer": optimizer}` or a dataclass `TrainState(model, optimizer)`
    (`container`)."""
    x = jnp.ones((batch, width))
    y = jnp.zeros((batch, width))

    def build():
        model = MLP(width, depth, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def pack(model, optimizer):
        if container == "dict":
            return {"model": model, "optimizer": optimizer}
        return TrainState(model, optimizer) if container == "dataclass" else (model, optimizer)

    def step(mo, x, y):
        if container == "dict":
            model, optimizer = mo["model"], mo["optimizer"]
        else:
            model, optimizer = (mo.model, mo.optimizer) if container == "dataclass" else mo
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model, opt = build()
            f = wrap(step)
            getter = lambda: _state_leaves(model) + _state_leaves(opt)  # noqa: E731
            return lambda: (f(pack(model, opt), x, y), getter)

        return make

    return _step_workload(
        name,
        description,
        variant,
        lambda: _write_back_floor(pack(*build()), step, x, y),
        "jax.jit on flat state leaves, changed state returned and rebound",
    )


def kv_list_step(name: str, description: str, vocab: int, dim: int, layers: int, max_len: int) -> Workload:
    """A decode step `step(model, caches, token)` with `caches` a plain list of LayerCache
    modules, each written back every call."""
    token = jnp.asarray(3, jnp.int32)

    def build():
        model = ListCacheDecoder(vocab, dim, layers, nnx.Rngs(0))
        return model, [LayerCache(max_len, dim) for _ in range(layers)]

    def step(model, caches, token):
        return model(token, caches)

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model, caches = build()
            f = wrap(step)
            getter = lambda: _state_leaves(model) + _state_leaves(caches)  # noqa: E731
            return lambda: (f(model, caches, token), getter)

        return make

    return _step_workload(
        name,
        description,
        variant,
        lambda: _write_back_floor(build(), lambda mc, t: step(*mc, t), token),
        "jax.jit on the flat state leaves, changed cache arrays returned and rebound",
        check_steps=5,  # the cache fills a slot per step: compare it after several
    )


# ---- Patterns from published programs (flax toy examples, bonsai) ----


class RawArrayMLP(nnx.Module):
    """An MLP that also holds a raw array attribute used in the forward, as bonsai Gemma3's
    vision embeddings hold their position ids (`self.position_ids = nnx.data(...)`)."""

    def __init__(self, width: int, depth: int, positions: int, rngs: nnx.Rngs):
        self.position_ids = nnx.data(jnp.arange(positions))
        self.position_embedding = nnx.Embed(positions, width, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        x = x + self.position_embedding(self.position_ids)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A model config as bonsai's Gemma3 writes one (`TextConfig`): a frozen dataclass
    holding a list, so it cannot be hashed, and every block keeps it (`self.config`)."""

    width: int
    layer_types: list


class ConfigBlock(nnx.Module):
    def __init__(self, config: BlockConfig, index: int, rngs: nnx.Rngs):
        self.config = config
        self.index = index
        self.linear = nnx.Linear(config.width, config.width, rngs=rngs)

    def __call__(self, x):
        y = self.linear(x)
        return nnx.relu(y) if self.config.layer_types[self.index] == "relu" else jnp.tanh(y)


class ConfigMLP(nnx.Module):
    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.config = BlockConfig(width, ["relu" if i % 2 == 0 else "tanh" for i in range(depth)])
        self.blocks = nnx.List([ConfigBlock(self.config, i, rngs) for i in range(depth)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class DropoutMLP(nnx.Module):
    """An MLP with a Dropout before its last layer: `model.eval()` / `model.train()` change
    the compiled program, and in train mode every call consumes (writes back) its RNG."""

    def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](self.drop(x))


# An nnx.jit function another part of a program runs on the same model (an evaluation step,
# say): after each call nnx.jit rebuilds every node of the model in place (NNX's clear, then
# init) with the structure it had.
_nnx_jit_forward = nnx.jit(lambda m, x: m(x))


def _nnx_jit_call(model: Any) -> None:
    _nnx_jit_forward(model, jnp.ones((4, 16)))


def _eval_mode(width: int, depth: int) -> DropoutMLP:
    model = DropoutMLP(width, depth, nnx.Rngs(0))
    model.eval()
    return model


def train_eval(name: str, description: str, width: int, depth: int, batch: int) -> Workload:
    """Each step: `model.train()`, a train-mode call (a loss; Dropout active, its RNG count
    written back), then `model.eval()` and an eval-mode call: the structure changes
    between every two calls, back and forth."""
    x = jnp.ones((batch, width))
    y = jnp.zeros((batch, width))

    def train_fn(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    def eval_fn(m, x):
        return m(x)

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model = DropoutMLP(width, depth, nnx.Rngs(0))
            train, evaluate = wrap(train_fn), wrap(eval_fn)
            getter = lambda: _state_leaves(model)  # noqa: E731 - only called when verifying

            def run():
                model.train()
                loss = train(model, x, y)
                model.eval()
                return (loss, evaluate(model, x)), getter

            return run

        return make

    def make_floor():
        model = DropoutMLP(width, depth, nnx.Rngs(0))
        model.train()
        graphdef_train, state = nnx.split(model)
        model.eval()
        graphdef_eval, state_eval = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        assert jax.tree_util.tree_structure(state_eval) == treedef  # the modes differ in the graphdef only
        train, changed = _write_back_jit(graphdef_train, treedef, lambda m, x, y: train_fn(m, x, y))
        evaluate, _ = _write_back_jit(graphdef_eval, treedef, lambda m, x: eval_fn(m, x))
        current = list(leaves)

        def run():
            model.train()  # the same Python work as the other variants; its result is in the graphdefs
            out = train(*current, x, y)
            for i, v in zip(changed, out[1:]):  # the dropout RNG count, rebound by hand
                current[i] = v
            model.eval()
            return (out[0], evaluate(*current, x)[0]), lambda: list(current)

        return run

    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "two jax.jit programs (train, eval graphdefs) on the flat state leaves",
        more_peers={"nnx.jit(graph=False)": lambda f: nnx.jit(f, graph=False)},
    )


class Loss(nnx.Variable):
    pass


class VAEEncoder(nnx.Module):
    """flax's toy example 05: the forward stores its KL loss in a new Variable every call."""

    def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        x = jax.nn.relu(self.linear1(x))
        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))
        kl = 0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1)
        self.kl_loss = Loss(jnp.mean(kl))  # a new Variable object on every call
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class VAE(nnx.Module):
    def __init__(self, din: int, hidden: int, latent: int, rngs: nnx.Rngs):
        self.encoder = VAEEncoder(din, hidden, latent, rngs)
        self.decoder1 = nnx.Linear(latent, hidden, rngs=rngs)
        self.decoder2 = nnx.Linear(hidden, din, rngs=rngs)

    def __call__(self, x):
        return self.decoder2(jax.nn.relu(self.decoder1(self.encoder(x))))


def new_variable(name: str, description: str, din: int, hidden: int, latent: int, batch: int) -> Workload:
    """`forward(model, x)` on toy example 05's VAE: every call assigns a new `Loss`
    Variable to `model.encoder.kl_loss` (created by the first call) and draws noise
    (the RNG count written back)."""
    x = jax.random.uniform(jax.random.PRNGKey(1), (batch, din))

    def build():
        return VAE(din, hidden, latent, nnx.Rngs(0, noise=1))

    def fwd(model, x):
        return jax.nn.sigmoid(model(x))

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model = build()
            f = wrap(fwd)
            getter = lambda: _state_leaves(model)  # noqa: E731 - only called when verifying
            return lambda: (f(model, x), getter)

        return make

    def make_floor():
        model = build()
        # the attribute exists before the split (a placeholder the first call replaces), so
        # that the floor's state has a fixed structure; outputs do not depend on it
        model.encoder.kl_loss = Loss(jnp.zeros((), jnp.float32))
        return _write_back_floor(model, fwd, x)

    # nnx.jit(graph=False) is no peer: tree mode propagates no new attribute (kl_loss)
    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on the flat state leaves, kl_loss and RNG count rebound",
    )


class RawLinear(nnx.Module):
    """flax's toy example 07: parameters as plain jax arrays on the module."""

    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.w = jax.random.normal(rngs.params(), (din, dout))
        self.b = jnp.zeros((dout,))

    def __call__(self, x):
        return x @ self.w + self.b


class RawCounterMLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, rngs: nnx.Rngs):
        self.count = jnp.array(0)  # a raw array, incremented by every call
        self.linear1 = RawLinear(din, dhidden, rngs)
        self.linear2 = RawLinear(dhidden, dout, rngs)

    def __call__(self, x):
        self.count += 1
        return self.linear2(nnx.relu(self.linear1(x)))


def _is_raw_param(path: tuple, value: Any) -> bool:
    return path[-1] in ("w", "b")


def raw_counter_step(name: str, description: str, hidden: int, batch: int, numpy_batch: bool = False) -> Workload:
    """toy example 07's `train_step(model, optimizer, x, y)`: raw-array parameters updated
    by `nnx.Optimizer(..., wrt=<path filter>)` (sgd), the raw `count` incremented. With
    `numpy_batch`, as the example is written: `train_step(model, optimizer, batch)`, the
    batch a new tuple of NumPy arrays drawn from a NumPy dataset by indexing on every step
    (the same rows each step, so every variant sees the same data)."""
    x = jnp.linspace(0.0, 1.0, batch)[:, None]
    y = 0.8 * x**2 + 0.1
    data_x, data_y = np.asarray(x), np.asarray(y)
    rows = np.arange(batch)

    def draw() -> tuple[Any, Any]:
        return data_x[rows], data_y[rows]  # (new arrays, as the example's dataset draws)

    def build():
        model = RawCounterMLP(1, hidden, 1, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=_is_raw_param)

    def step(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((y - m(x)) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, _is_raw_param))(model)
        optimizer.update(model, grads)
        return loss

    def batch_step(model, optimizer, batch):
        return step(model, optimizer, *batch)

    def variant(wrap: Callable[[Any], Any]):
        def make():
            model, opt = build()
            getter = lambda: _state_leaves(model) + _state_leaves(opt)  # noqa: E731
            if numpy_batch:
                g = wrap(batch_step)
                return lambda: (g(model, opt, draw()), getter)
            f = wrap(step)
            return lambda: (f(model, opt, x, y), getter)

        return make

    def make_floor():
        if numpy_batch:  # (the batch's arrays passed as two flat arguments)
            return _write_back_floor(build(), lambda mo, x, y: step(*mo, x, y), fresh=draw)
        return _write_back_floor(build(), lambda mo, x, y: step(*mo, x, y), x, y)

    # nnx.jit(graph=False) is no peer: tree mode writes back Variables only, so the
    # rebound raw arrays (parameters, count) keep their old values
    return _step_workload(
        name,
        description,
        variant,
        make_floor,
        "jax.jit on flat state leaves (and the batch's arrays), changed leaves (raw arrays included) returned and"
        " rebound",
    )


def build(quick: bool) -> dict[str, Callable[[], Workload]]:
    x32 = jnp.ones((1, 32))
    out = {
        "nnx_mlp3": lambda: forward(
            "nnx_mlp3", "NNX MLP width 32 depth 3, same model", lambda: MLP(32, 3, nnx.Rngs(0)), x32, False, linen_mlp
        ),
        "nnx_mlp24": lambda: forward(
            "nnx_mlp24", "NNX MLP width 32 depth 24, same model", lambda: MLP(32, 24, nnx.Rngs(0)), x32, False, linen_mlp
        ),
        "nnx_bn_dropout": lambda: forward(
            "nnx_bn_dropout",
            "NNX Linear+BatchNorm+Dropout, train mode (state written back every call)",
            lambda: BNDrop(32, nnx.Rngs(0)),
            jnp.ones((8, 32)),
            True,
        ),
        "nnx_decode": lambda: forward(
            "nnx_decode",
            "KV-cache decode step of a tiny NNX attention model (us/token; cache written back)",
            lambda: TinyDecoder(64, 32, 64, nnx.Rngs(0)),
            jnp.asarray(3, jnp.int32),
            True,
        ),
        "nnx_kv_list": lambda: kv_list_step(
            "nnx_kv_list",
            "decode step over a plain list of 4 per-layer KV-cache modules (us/token; caches written back)",
            64,
            32,
            4,
            64,
        ),
        "nnx_train": lambda: optimizer_step("nnx_train", "NNX MLP w32 d3 + nnx.Optimizer(adam) step", 32, 3, 8),
        "nnx_train_shared": lambda: optimizer_step(
            "nnx_train_shared",
            "nnx_train with nnx.ModelAndOptimizer, which holds the model: step(model, optimizer, ...) shares Variables",
            32, 3, 8, shared=True,
        ),
        "nnx_train_batch_dict": lambda: optimizer_step(
            "nnx_train_batch_dict",
            "nnx_train with the batch a new dict each step: step(model, optimizer, {'x': x, 'y': y})",
            32, 3, 8, batch_dict=True,
        ),
        "nnx_train_tuple": lambda: optimizer_tuple_step(
            "nnx_train_tuple", "nnx_train with (model, optimizer) passed as one tuple argument", 32, 3, 8
        ),
        "nnx_train_dict": lambda: optimizer_tuple_step(
            "nnx_train_dict", "nnx_train with {'model': model, 'optimizer': optimizer} as one dict argument", 32, 3, 8,
            container="dict",
        ),
        "nnx_train_dataclass": lambda: optimizer_tuple_step(
            "nnx_train_dataclass", "nnx_train with a dataclass TrainState(model, optimizer) as one argument", 32, 3, 8,
            container="dataclass",
        ),
        "cnn": lambda: forward(
            "cnn",
            "small CNN (2 conv 3x3, 16 channels) on one 16x16 image: NNX vs Linen, same weights",
            lambda: CNN(16, nnx.Rngs(0)),
            jnp.ones((1, 16, 16, 3)),
            False,
            linen_cnn,
        ),
        "nnx_variable_beside": lambda: variable_beside(
            "nnx_variable_beside", "a module and a Variable of its own beside it: f(model, offset, x)", 32, 3
        ),
        "nnx_variable_shared": lambda: variable_beside(
            "nnx_variable_shared",
            "a module and its own Variable beside it: f(model, model.layers[-1].bias, x), read jointly",
            32,
            3,
            shared=True,
        ),
        "nnx_variable_first": lambda: variable_beside(
            "nnx_variable_first",
            "a module's own Variable passed before it: f(model.layers[-1].bias, model, x), read jointly",
            32,
            3,
            shared=True,
            first=True,
        ),
        "nnx_variable_arg": lambda: variable_arg(
            "nnx_variable_arg", "an nnx.Variable (a Linear's 32x32 kernel) passed on its own: x @ v[...]", 32
        ),
        "nnx_call_options": lambda: call_options(
            "nnx_call_options", "f(model, x, train=False), train in static_argnames: NNX MLP w32 d3 + Dropout", 32, 3, 8
        ),
        "nnx_functional": lambda: functional(
            "nnx_functional", "functional API: f(graphdef, state, x) merges inside jit, NNX MLP w32 d3", 32, 3
        ),
        "nnx_functional_loop": lambda: functional_loop(
            "nnx_functional_loop",
            "flax guide's functional train loop: loss, state = step(graphdef, state, x, y), a new nnx.State each call",
            64,
            32,
        ),
        "nnx_raw_array": lambda: forward(
            "nnx_raw_array",
            "NNX MLP w16 d24 holding a raw array (position_ids = nnx.data(arange(8))) used in the forward",
            lambda: RawArrayMLP(16, 24, 8, nnx.Rngs(0)),
            jnp.ones((8, 16)),
            False,
            # flax 0.12.8's cached_partial fails on any raw array attribute: AttributeError:
            # 'ArrayImpl' object has no attribute 'get_raw_value' (graphlib.flatten)
            skip=("nnx.cached_partial",),
        ),
        "nnx_config": lambda: forward(
            "nnx_config",
            "NNX MLP w32 d3 whose blocks hold a config dataclass with a list (as bonsai's Gemma3 does), same model",
            lambda: ConfigMLP(32, 3, nnx.Rngs(0)),
            x32,
            False,
        ),
        "nnx_eval_noop": lambda: forward(
            "nnx_eval_noop",
            "NNX MLP w16 d24 + Dropout already in eval mode; every step calls model.eval() then the call",
            lambda: _eval_mode(16, 24),
            jnp.ones((4, 16)),
            False,
            before=lambda m: m.eval(),
        ),
        "nnx_jit_shared": lambda: forward(
            "nnx_jit_shared",
            "NNX MLP w16 d24 + Dropout in eval mode; every step an nnx.jit call on the same model (whose graph"
            " updates rebuild each node in place), then the call",
            lambda: _eval_mode(16, 24),
            jnp.ones((4, 16)),
            False,
            before=_nnx_jit_call,
        ),
        "nnx_train_eval": lambda: train_eval(
            "nnx_train_eval",
            "us per step of model.train() + train-mode loss, model.eval() + eval call (NNX MLP w16 d24 + Dropout)",
            16,
            24,
            4,
        ),
        "nnx_new_variable": lambda: new_variable(
            "nnx_new_variable",
            "toy 05 VAE forward: a new Variable (self.kl_loss = Loss(...)) assigned every call, noise drawn",
            16,
            32,
            4,
            4,
        ),
        "nnx_raw_counter": lambda: raw_counter_step(
            "nnx_raw_counter",
            "toy 07 train step: raw-array params (sgd via nnx.Optimizer, path filter), self.count += 1",
            32,
            32,
        ),
        "nnx_raw_counter_np": lambda: raw_counter_step(
            "nnx_raw_counter_np",
            "nnx_raw_counter as toy 07 calls it: train_step(model, optimizer, batch), a new tuple of NumPy arrays",
            32,
            32,
            numpy_batch=True,
        ),
    }
    if not quick:  # compute-bound sizes: what share of a step the overhead is
        out |= {
            "nnx_mlp3_compute": lambda: forward(
                "nnx_mlp3_compute",
                "NNX MLP width 512 depth 3, batch 256 (compute-bound)",
                lambda: MLP(512, 3, nnx.Rngs(0)),
                jnp.ones((256, 512)),
                False,
                linen_mlp,
            ),
            "nnx_mlp24_compute": lambda: forward(
                "nnx_mlp24_compute",
                "NNX MLP width 512 depth 24, batch 256 (compute-bound)",
                lambda: MLP(512, 24, nnx.Rngs(0)),
                jnp.ones((256, 512)),
                False,
                linen_mlp,
            ),
            "cnn_compute": lambda: forward(
                "cnn_compute",
                "CNN 64 channels on 32 images of 32x32 (compute-bound): NNX vs Linen",
                lambda: CNN(64, nnx.Rngs(0)),
                jnp.ones((32, 32, 32, 3)),
                False,
                linen_cnn,
            ),
            "nnx_bn_dropout_compute": lambda: forward(
                "nnx_bn_dropout_compute",
                "NNX Linear+BatchNorm+Dropout width 1024, batch 512, train mode (compute-bound)",
                lambda: BNDrop(1024, nnx.Rngs(0)),
                jnp.ones((512, 1024)),
                True,
            ),
            "nnx_decode_compute": lambda: forward(
                "nnx_decode_compute",
                "KV-cache decode step, dim 512, cache 2048 (compute-bound)",
                lambda: TinyDecoder(4096, 512, 2048, nnx.Rngs(0)),
                jnp.asarray(3, jnp.int32),
                True,
            ),
            "nnx_train_compute": lambda: optimizer_step(
                "nnx_train_compute", "NNX MLP w512 d3 + nnx.Optimizer(adam), batch 256 (compute-bound)", 512, 3, 256
            ),
        }
    return out


__all__ = ["build", "np"]

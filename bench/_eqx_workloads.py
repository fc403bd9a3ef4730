"""Equinox and plain-pytree workloads.

Every variant of a workload uses the very same model object (or the same
leaves, for the flat floor), so weights and layout cannot differ.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import fastcall

from ._harness import Variant, Workload, allclose_tree


def _compare(ref: list[Any], outs: list[Any]) -> None:
    assert len(ref) == len(outs)
    for a, b in zip(ref, outs):
        allclose_tree(_arrays(a), _arrays(b))


def _arrays(tree: Any) -> list[Any]:
    return [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]


# What each fastcall entry point replaces for an Equinox model or a plain pytree:
# fastcall.jit a user's eqx.filter_jit or plain jax.jit (on the eqx.partition'ed
# pytree, the same structure); fastcall.filter_jit, eqx.filter_jit.
EQX_PEERS = {"fastcall.jit": ("eqx.filter_jit", "jax.jit(partitioned)"), "fastcall.filter_jit": ("eqx.filter_jit",)}
UNPACKED = "fastcall.filter_jit(pack=False)"  # (a model's small leaves passed as they are: `pack`)


def _flat_floor(model: Any, call: Callable[[Any, Any], Any]):
    """jax.jit over the pre-flattened array leaves of `model` plus the input."""
    dynamic, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    n = len(leaves)

    def flat(*a):
        return call(eqx.combine(treedef.unflatten(a[:n]), static), a[n])

    return jax.jit(flat), tuple(leaves)


def forward(name: str, description: str, model: Any, x: Any) -> Workload:
    """Same model every call: fastcall vs the floor and the Equinox/JAX peers."""

    def call(m, x):
        return m(x)

    # The jax.jit-wrapped programs are built once, here, so that verification and timing
    # share each compiled program (a 1000-leaf one takes ~1 s to compile); the peers'
    # and fastcall's wrappers, built per make(), cache their programs by function.
    floor, floor_leaves = _flat_floor(model, call)
    closure = eqx.filter_jit(lambda x: model(x))
    dynamic, static = eqx.partition(model, eqx.is_array)
    partitioned = jax.jit(lambda d, x: call(eqx.combine(d, static), x))

    def make_eager():
        return lambda: call(model, x)

    def make_floor():
        args = (*floor_leaves, x)
        return lambda: floor(*args)

    def make_fastcall():
        f = fastcall.jit(call)
        return lambda: f(model, x)

    def make_partial():
        f = fastcall.partial(call, model)
        return lambda: f(x)

    def make_filter_jit():
        f = eqx.filter_jit(call)
        return lambda: f(model, x)

    def make_fastcall_filter_jit():
        f = fastcall.filter_jit(call)
        return lambda: f(model, x)

    def make_filter_jit_closure():
        return lambda: closure(x)

    def make_partitioned():
        return lambda: partitioned(dynamic, x)

    return Workload(
        name,
        description,
        [
            Variant("eager", make_eager, timed=False),
            Variant("floor", make_floor, note="jax.jit on the pre-flattened leaf list"),
            Variant("fastcall.jit", make_fastcall),
            Variant("fastcall.partial", make_partial, note="model bound once"),
            Variant("fastcall.filter_jit", make_fastcall_filter_jit, note="model as argument"),
            Variant("eqx.filter_jit", make_filter_jit, note="model as argument"),
            Variant("eqx.filter_jit (closure)", make_filter_jit_closure, note="model closed over"),
            Variant("jax.jit(partitioned)", make_partitioned, note="eqx.partition'ed pytree as argument"),
        ],
        _compare,
        # fastcall.partial binds the model and still passes its leaves as arguments, as
        # every peer here but the closure, whose weights are compile-time constants (a
        # different measurement, reported but not a peer)
        peers=EQX_PEERS | {"fastcall.partial": ("eqx.filter_jit", "jax.jit(partitioned)")},
    )


def new_model(name: str, description: str, model: Any, x: Any) -> Workload:
    """A new model object (same structure, same weights) every call."""
    leaves, treedef = jax.tree_util.tree_flatten(model)

    def call(m, x):
        return m(x)

    def pooled(make_fn: Callable[[], Callable[[Any], Any]], build: Callable[[], Any]) -> Variant:
        """A variant whose step takes one never-seen-before object from a pool
        refilled (untimed) before each timed batch."""
        pool: list[Any] = []

        def make():
            f = make_fn()
            pool[:] = [build() for _ in range(8)]

            def step():
                return f(pool.pop() if pool else build())

            return step

        def prepare(step, n):
            pool[:] = [build() for _ in range(n)]

        return make, prepare

    def fresh():
        return treedef.unflatten(leaves)

    def fc():
        f = fastcall.jit(call)
        return lambda m: f(m, x)

    def fj():
        f = eqx.filter_jit(call)
        return lambda m: f(m, x)

    def ffj():
        f = fastcall.filter_jit(call)
        return lambda m: f(m, x)

    _, static = eqx.partition(model, eqx.is_array)

    def part():
        f = jax.jit(lambda d, x: call(eqx.combine(d, static), x))
        return lambda d: f(d, x)

    def fresh_partitioned():  # partitioned untimed: favours this peer
        return eqx.partition(fresh(), eqx.is_array)[0]

    def make_floor():
        f, flat = _flat_floor(model, call)
        args = (*flat, x)
        return lambda: f(*args)

    variants = [Variant("eager", lambda: (lambda: call(model, x)), timed=False)]
    variants.append(Variant("floor", make_floor, note="jax.jit on pre-flattened leaves (same object)"))
    for vname, mk, build, note in [
        ("fastcall.jit", fc, fresh, "new object each call"),
        ("fastcall.filter_jit", ffj, fresh, "new object each call"),
        ("eqx.filter_jit", fj, fresh, "new object each call"),
        ("jax.jit(partitioned)", part, fresh_partitioned, "new partitioned pytree each call (partition untimed)"),
    ]:
        make, prepare = pooled(mk, build)
        variants.append(Variant(vname, make, prepare, note=note))
    # jax.jit(partitioned) is a peer although its partition is untimed: a loop written with
    # plain jax.jit carries the partitioned pytree, which the previous step returned new
    return Workload(name, description, variants, _compare, peers=EQX_PEERS)


class DropoutNet(eqx.Module):
    """An MLP then Dropout, called as Equinox layers are: `net(x, key=key, inference=...)`."""

    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout

    def __call__(self, x, *, key, inference):
        return self.drop(self.mlp(x), key=key, inference=inference)


def call_options(name: str, description: str, model: Any, x: Any) -> Workload:
    """`f(model, x, key=key, inference=False)`: an array and a static flag as keyword
    arguments (under fastcall.jit and jax.jit, `inference` is in static_argnames)."""
    key = jax.random.PRNGKey(1)

    def call(m, x, *, key, inference):
        return m(x, key=key, inference=inference)

    dynamic, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    n = len(leaves)
    floor = jax.jit(lambda *a: call(eqx.combine(treedef.unflatten(a[:n]), static), a[n], key=a[n + 1], inference=False))
    partitioned = jax.jit(lambda d, x, *, key, inference: call(eqx.combine(d, static), x, key=key, inference=inference),
                          static_argnames="inference")

    def with_keywords(f, m=model):
        return lambda: f(m, x, key=key, inference=False)

    return Workload(
        name,
        description,
        [
            Variant("eager", lambda: with_keywords(call), timed=False),
            Variant("floor", lambda: (lambda: floor(*leaves, x, key)), note="jax.jit on the leaves, inference=False fixed"),
            Variant("fastcall.jit", lambda: with_keywords(fastcall.jit(call, static_argnames="inference")),
                    note="static_argnames='inference'"),
            Variant("fastcall.filter_jit", lambda: with_keywords(fastcall.filter_jit(call))),
            Variant("eqx.filter_jit", lambda: with_keywords(eqx.filter_jit(call))),
            Variant("jax.jit(partitioned)", lambda: with_keywords(partitioned, dynamic),
                    note="static_argnames='inference'"),
        ],
        _compare,
        peers=EQX_PEERS,
    )


def train_step(name: str, description: str, model: Any, x: Any, y: Any) -> Workload:
    """`model, opt_state, loss = step(model, opt_state, x, y)` with optax adam."""
    opt = optax.adam(1e-3)

    def loss_fn(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    def step(m, s, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(m, x, y)
        updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), s, loss

    def init():
        return model, opt.init(eqx.filter(model, eqx.is_array))

    def stateful(f):
        def make():
            state = list(init())

            def run():
                m, s, loss = f(state[0], state[1], x, y)
                state[0], state[1] = m, s
                return loss, m

            return run

        return make

    def make_floor():
        m0, s0 = init()
        dynamic, static = eqx.partition(m0, eqx.is_array)
        p_leaves, p_def = jax.tree_util.tree_flatten(dynamic)
        s_leaves, s_def = jax.tree_util.tree_flatten(s0)
        n_p, n_s = len(p_leaves), len(s_leaves)

        def flat(*a):
            m = eqx.combine(p_def.unflatten(a[:n_p]), static)
            s = s_def.unflatten(a[n_p : n_p + n_s])
            m2, s2, loss = step(m, s, a[-2], a[-1])
            p2 = jax.tree_util.tree_leaves(eqx.filter(m2, eqx.is_array))
            return (*p2, *jax.tree_util.tree_leaves(s2), loss)

        f = jax.jit(flat)
        state = [tuple(p_leaves) + tuple(s_leaves)]

        def run():
            out = f(*state[0], x, y)
            state[0] = out[:-1]
            return out[-1], out[:n_p]

        return run

    def make_partitioned():
        m0, s0 = init()
        dynamic, static = eqx.partition(m0, eqx.is_array)

        @jax.jit
        def pstep(d, s, x, y):
            m2, s2, loss = step(eqx.combine(d, static), s, x, y)
            return eqx.filter(m2, eqx.is_array), s2, loss

        state = [dynamic, s0]

        def run():
            d, s, loss = pstep(state[0], state[1], x, y)
            state[0], state[1] = d, s
            return loss, d

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager", stateful(step), timed=False),
            Variant("floor", make_floor, note="flat leaves in and out, rebound by hand"),
            Variant("fastcall.jit", stateful(fastcall.jit(step))),
            Variant("fastcall.filter_jit", stateful(fastcall.filter_jit(step))),
            Variant("eqx.filter_jit", stateful(eqx.filter_jit(step))),
            Variant("jax.jit(partitioned)", make_partitioned),
        ],
        _compare,
        peers=EQX_PEERS,
    )


def params_forward(name: str, description: str, params: Any, apply: Callable[[Any, Any], Any], x: Any) -> Workload:
    """A plain params pytree (nested dicts of arrays) and `apply(params, x)`: no Equinox
    module anywhere, so plain `jax.jit` on the dict is what most users write."""

    floor, floor_leaves = _flat_floor(params, apply)  # built once: see `forward`
    args = (*floor_leaves, x)
    return _params_workload(
        name, description, apply, lambda: (params, x), lambda: (lambda: floor(*args)),
        "jax.jit on the pre-flattened leaf list", "the params dict as argument",
    )


def params_variables(name: str, description: str, params: Any, x: Any) -> Workload:
    """`apply({"params": params}, x)`, as Linen's `jax.jit(model.apply)` is called: the
    variables dict built anew around the same params every call."""

    def apply(variables, x):
        return mlp_apply(variables["params"], x)

    floor, floor_leaves = _flat_floor(params, mlp_apply)
    args = (*floor_leaves, x)
    return _params_workload(
        name, description, apply, lambda: ({"params": params}, x), lambda: (lambda: floor(*args)),
        "jax.jit on the pre-flattened leaf list", "the variables dict as argument",
    )


def params_with_config(name: str, description: str, params: Any, x: Any) -> Workload:
    """`apply(params, x, {"scale": ..., "shift": ...})`: a params dict and a config dict of
    Python floats built anew each call (hyperparameters passed as an argument). jax.jit and
    fastcall.jit trace the floats; eqx.filter_jit and fastcall.filter_jit hold them static."""

    def apply(params, x, config):
        return mlp_apply(params, x) * config["scale"] + config["shift"]

    leaves, treedef = jax.tree_util.tree_flatten(params)
    n = len(leaves)
    floor = jax.jit(lambda *a: apply(treedef.unflatten(a[:n]), a[n], {"scale": a[n + 1], "shift": a[n + 2]}))
    args = (*leaves, x, 0.5, 0.25)
    return _params_workload(
        name, description, apply, lambda: (params, x, {"scale": 0.5, "shift": 0.25}), lambda: (lambda: floor(*args)),
        "jax.jit on the pre-flattened leaf list and the two floats", "both dicts as arguments",
    )


def params_in_turn(name: str, description: str, params: Any, x: Any) -> Workload:
    """`apply(variables, x)` called with three variables dicts in turn (`{"params"}`, then
    with a `scale`, then with a `scale` and a `shift`: one jitted apply serving calls that
    pass other collections), each built anew: three structures under one function. The
    floor: jax.jit on each structure's pre-flattened leaves, in the same turn."""
    scale, shift = jnp.full((1, x.shape[-1]), 0.5), jnp.full((1, x.shape[-1]), 0.25)
    forms = (
        lambda: {"params": params},
        lambda: {"params": params, "scale": scale},
        lambda: {"params": params, "scale": scale, "shift": shift},
    )

    def apply(variables, x):
        y = mlp_apply(variables["params"], x)
        y = y * variables["scale"] if "scale" in variables else y
        return y + variables["shift"] if "shift" in variables else y

    def in_turn(call: Callable[[Any], Any]) -> Callable[[], Any]:
        turn = itertools.count()  # (each variant its own: every variant sees the same order)
        return lambda: call(forms[next(turn) % len(forms)]())

    flat = [jax.tree_util.tree_flatten(form()) for form in forms]
    # one jitted function, the structure a static argument: one program per structure, as
    # jax.jit keeps them (three functions in turn were slower than jax.jit's one, here)
    floor = jax.jit(lambda k, *a: apply(flat[k][1].unflatten(a[:-1]), a[-1]), static_argnums=0)

    def make_floor():
        turn = itertools.count()
        calls = [(k, *leaves, x) for k, (leaves, _) in enumerate(flat)]
        return lambda: floor(*calls[next(turn) % len(calls)])

    def wrapped(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(apply)
            return in_turn(lambda variables: f(variables, x))

        return make

    return Workload(
        name,
        description,
        [
            Variant("eager", lambda: in_turn(lambda variables: apply(variables, x)), timed=False),
            Variant("floor", make_floor, note="jax.jit on each structure's pre-flattened leaf list"),
            Variant("fastcall.jit", wrapped(fastcall.jit)),
            Variant("fastcall.filter_jit", wrapped(fastcall.filter_jit)),
            Variant("jax.jit", wrapped(jax.jit), note="the variables dict as argument"),
            Variant("eqx.filter_jit", wrapped(eqx.filter_jit)),
        ],
        _compare,
        check_steps=6,
        peers={"fastcall.jit": ("jax.jit", "eqx.filter_jit"), "fastcall.filter_jit": ("eqx.filter_jit",)},
    )


def _params_workload(
    name: str, description: str, apply: Callable[..., Any], call_args: Callable[[], tuple[Any, ...]],
    make_floor: Callable[[], Any], floor_note: str, jax_note: str,
) -> Workload:
    """`apply(*call_args())` (a plain params pytree first) through fastcall and its peers
    (plain `jax.jit` and `eqx.filter_jit`), beside the eager call and `make_floor`'s floor.
    `call_args` is called every call: what it builds anew, each variant gets anew."""

    def wrapped(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(apply)
            return lambda: f(*call_args())

        return make

    return Workload(
        name,
        description,
        [
            Variant("eager", lambda: (lambda: apply(*call_args())), timed=False),
            Variant("floor", make_floor, note=floor_note),
            Variant("fastcall.jit", wrapped(fastcall.jit)),
            Variant("fastcall.filter_jit", wrapped(fastcall.filter_jit)),
            Variant("jax.jit", wrapped(jax.jit), note=jax_note),
            Variant("eqx.filter_jit", wrapped(eqx.filter_jit)),
        ],
        _compare,
        peers={"fastcall.jit": ("jax.jit", "eqx.filter_jit"), "fastcall.filter_jit": ("eqx.filter_jit",)},
    )


def stateful_step(name: str, description: str, model: Any, state: Any, x: Any) -> Workload:
    """Equinox's stateful pattern: `y, state = f(model, state, x)` with `state` an
    `eqx.nn.State` (from `eqx.nn.make_with_state`) rebound after every call; the model
    object is the same every call. `model(x, state)` returns `(y, new_state)`."""

    def call(m, s, x):
        return m(x, s)

    def stateful(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(call)
            current = [state]

            def run():
                y, current[0] = f(model, current[0], x)
                return y, current[0]

            return run

        return make

    def make_floor():
        dynamic, static = eqx.partition(model, eqx.is_array)
        m_leaves, m_def = jax.tree_util.tree_flatten(dynamic)
        s_leaves, s_def = jax.tree_util.tree_flatten(state)
        n_m, n_s = len(m_leaves), len(s_leaves)
        changed: list[int] = []  # state leaves the call replaces (found at trace time)

        def flat(*a):
            m = eqx.combine(m_def.unflatten(a[:n_m]), static)
            s_in = a[n_m : n_m + n_s]
            y, s2 = call(m, s_def.unflatten(s_in), a[-1])
            new = s_def.flatten_up_to(s2)
            changed[:] = [i for i in range(n_s) if new[i] is not s_in[i]]
            return (y, *[new[i] for i in changed])  # only what changed

        f = jax.jit(flat)
        current = list(s_leaves)

        def run():
            out = f(*m_leaves, *current, x)
            for i, v in zip(changed, out[1:]):  # rebind the updated state by hand
                current[i] = v
            return out[0], s_def.unflatten(current)

        return run

    def make_partitioned():
        dynamic, static = eqx.partition(model, eqx.is_array)
        f = jax.jit(lambda d, s, x: call(eqx.combine(d, static), s, x))
        current = [state]

        def run():
            y, current[0] = f(dynamic, current[0], x)
            return y, current[0]

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager", stateful(lambda f: f), timed=False),
            Variant("floor", make_floor, note="flat leaves in, changed state leaves out and rebound"),
            Variant("fastcall.jit", stateful(fastcall.jit)),
            Variant("fastcall.filter_jit", stateful(fastcall.filter_jit)),
            Variant("eqx.filter_jit", stateful(eqx.filter_jit)),
            Variant("jax.jit(partitioned)", make_partitioned, note="eqx.partition'ed model, state as argument"),
        ],
        _compare,
        peers=EQX_PEERS,
    )


def sgd_step(
    name: str, description: str, model: Any, x: Any, y: Any, lr: float = 0.01, unpacked: bool = False
) -> Workload:
    """`model = step(model, x, y)`: a bare gradient-descent update, no optimizer, a new
    model returned (and passed back in) every step, as in Equinox's getting-started
    example. `unpacked`: also time `fastcall.filter_jit(step, pack=False)` (its weights
    change every call: packing must cost nothing there)."""

    def loss_fn(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    def step(m, x, y):
        grads = eqx.filter_grad(loss_fn)(m, x, y)
        return eqx.apply_updates(m, jax.tree.map(lambda g: -lr * g, grads))

    def stateful(f):
        def make():
            current = [model]

            def run():
                current[0] = f(current[0], x, y)
                return current[0]

            return run

        return make

    def make_floor():
        dynamic, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(dynamic)
        n = len(leaves)

        def flat(*a):
            m2 = step(eqx.combine(treedef.unflatten(a[:n]), static), a[n], a[n + 1])
            return tuple(jax.tree_util.tree_leaves(eqx.filter(m2, eqx.is_array)))

        f = jax.jit(flat)
        current = [tuple(leaves)]

        def run():
            current[0] = f(*current[0], x, y)  # every leaf changes: all rebound
            return current[0]

        return run

    def make_partitioned():
        dynamic, static = eqx.partition(model, eqx.is_array)

        @jax.jit
        def pstep(d, x, y):
            return eqx.filter(step(eqx.combine(d, static), x, y), eqx.is_array)

        current = [dynamic]

        def run():
            current[0] = pstep(current[0], x, y)
            return current[0]

        return run

    return Workload(
        name,
        description,
        [
            Variant("eager", stateful(step), timed=False),
            Variant("floor", make_floor, note="flat leaves in and out, rebound by hand"),
            Variant("fastcall.jit", stateful(fastcall.jit(step))),
            Variant("fastcall.filter_jit", stateful(fastcall.filter_jit(step))),
            *([Variant(UNPACKED, stateful(fastcall.filter_jit(step, pack=False)))] if unpacked else []),
            Variant("eqx.filter_jit", stateful(eqx.filter_jit(step))),
            Variant("jax.jit(partitioned)", make_partitioned),
        ],
        _compare,
        peers={**EQX_PEERS, UNPACKED: ("eqx.filter_jit",)} if unpacked else EQX_PEERS,
    )


class ListMLP(eqx.Module):
    """Equinox's getting-started network: its layers in a plain Python list, plus a
    trainable bias of its own; every leaf is an array."""

    layers: list
    extra_bias: jax.Array

    def __init__(self, width: int, depth: int, key: jax.Array):
        keys = jax.random.split(key, depth)
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in keys]
        self.extra_bias = jnp.ones(width)

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x) + self.extra_bias


class Affine(eqx.Module):
    """A small submodule of two leaves: x * w + b."""

    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        return x * self.w + self.b


class ListOfBlocks(eqx.Module):
    """Many small submodules in a list, each applied to the input, the results summed
    (elementwise ops and one concatenate: a chain of 500 matmuls, or a sum or stack of
    500 results, takes 2-5 s per variant to compile here)."""

    blocks: list

    def __init__(self, n: int, width: int, key: jax.Array):
        keys = jax.random.split(key, n)
        self.blocks = [Affine(jax.random.normal(k, (width,)), jnp.full((width,), 0.01)) for k in keys]

    def __call__(self, x):
        width = x.shape[-1]
        return jnp.concatenate([block(x) for block in self.blocks]).reshape(-1, width).sum(0)


class StatefulNet(eqx.Module):
    """Linear -> BatchNorm -> relu -> Linear, as Equinox's stateful example: BatchNorm's
    running statistics live in an `eqx.nn.State`, updated on every call in training
    mode. Called on a batch through `jax.vmap(..., axis_name="batch")`."""

    linear1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, width: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(width, width, key=k1)
        self.norm = eqx.nn.BatchNorm(width, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(width, width, key=k2)

    def single(self, x, state):
        x, state = self.norm(self.linear1(x), state)
        return self.linear2(jax.nn.relu(x)), state

    def __call__(self, xs, state):
        return jax.vmap(self.single, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xs, state)


def params_dict(layers: int, width: int, key: jax.Array) -> dict[str, dict[str, jax.Array]]:
    """`{"layer_0": {"w": ..., "b": ...}, ...}`, the layout of a hand-written JAX MLP."""
    keys = jax.random.split(key, layers)
    return {
        f"layer_{i}": {"w": jax.random.normal(k, (width, width)) / jnp.sqrt(width), "b": jnp.full((width,), 0.01)}
        for i, k in enumerate(keys)
    }


def mlp_apply(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        layer = params[f"layer_{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def mlp_apply_scan(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    """`mlp_apply` for hundreds of layers: the layers stacked and run by `lax.scan` (an
    unrolled chain of 500 matmuls takes 3-5 s per variant to compile here)."""
    layers = [params[f"layer_{i}"] for i in range(len(params))]
    n, (d_in, d_out) = len(layers), layers[0]["w"].shape
    # concatenate, not stack: a stack of 500 operands compiles 30% slower here
    ws = jnp.concatenate([layer["w"].reshape(-1) for layer in layers]).reshape(n, d_in, d_out)
    bs = jnp.concatenate([layer["b"] for layer in layers]).reshape(n, d_out)

    def body(h, wb):
        return jnp.tanh(h @ wb[0] + wb[1]), None

    return jax.lax.scan(body, x, (ws, bs))[0]


class Identity(eqx.Module):
    """A model with no compute: isolates the cost of the call itself."""

    scale: jax.Array

    def __call__(self, x):
        return x


def build(quick: bool) -> dict[str, Callable[[], Workload]]:
    """Workload constructors (built lazily so --only skips the others)."""
    key = jax.random.PRNGKey(0)
    x32 = jnp.ones(32)
    # BatchNorm needs a batch whose rows differ: identical rows have zero variance,
    # and normalising by sqrt(eps) turns eager-vs-compiled rounding into 1e-5 errors
    xb8 = jax.random.normal(jax.random.PRNGKey(1), (8, 32))

    def mlp(depth, width=32):
        return eqx.nn.MLP(width, width, width, depth, key=key)

    out = {
        "identity": lambda: forward("identity", "identity model (1 leaf), same object", Identity(jnp.ones(())), x32),
        "eqx_mlp3": lambda: forward("eqx_mlp3", "eqx.nn.MLP width 32 depth 3, same object", mlp(3), x32),
        "eqx_mlp24": lambda: forward("eqx_mlp24", "eqx.nn.MLP width 32 depth 24, same object", mlp(24), x32),
        "eqx_mlp3_new": lambda: new_model(
            "eqx_mlp3_new", "eqx.nn.MLP width 32 depth 3, new object each call", mlp(3), x32
        ),
        "eqx_train": lambda: train_step(
            "eqx_train",
            "eqx MLP w32 d3 + optax adam, model = step(model, ...)",
            mlp(3),
            jnp.ones((8, 32)),
            jnp.zeros((8, 32)),
        ),
        "eqx_call_options": lambda: call_options(
            "eqx_call_options",
            "f(model, x, key=key, inference=False): eqx.nn.MLP w32 d3 + Dropout, keyword arguments",
            DropoutNet(mlp(3), eqx.nn.Dropout(0.1)),
            x32,
        ),
        "eqx_list_mlp": lambda: forward(
            "eqx_list_mlp",
            "Equinox getting-started network (3 Linear in a Python list + a bias), width 32, same object",
            ListMLP(32, 3, key),
            x32,
        ),
        "eqx_list_500": lambda: forward(
            "eqx_list_500",
            "500 small submodules (x * w + b, width 4) in a Python list, 1000 leaves, same object",
            ListOfBlocks(500, 4, key),
            jnp.ones(4),
        ),
        "params_dict": lambda: params_forward(
            "params_dict",
            "plain params dict {layer_i: {w, b}}, 4 layers width 32, f(params, x)",
            params_dict(4, 32, key),
            mlp_apply,
            jnp.ones((1, 32)),
        ),
        "params_dict_1000": lambda: params_forward(
            "params_dict_1000",
            "plain params dict of 500 layers width 4 (1000 leaves), f(params, x) scans the layers",
            params_dict(500, 4, key),
            mlp_apply_scan,
            jnp.ones((1, 4)),
        ),
        "params_variables": lambda: params_variables(
            "params_variables",
            'Linen-style f({"params": params}, x): a new variables dict each call around the same params dict',
            params_dict(4, 32, key),
            jnp.ones((1, 32)),
        ),
        "params_in_turn": lambda: params_in_turn(
            "params_in_turn",
            "one apply(variables, x) called with three variables dicts in turn (params; + scale; + scale, shift),"
            " each new",
            params_dict(4, 32, key),
            jnp.ones((1, 32)),
        ),
        "params_config": lambda: params_with_config(
            "params_config",
            "params dict (4 layers width 32) and a new config dict of two floats each call: f(params, x, config)",
            params_dict(4, 32, key),
            jnp.ones((1, 32)),
        ),
        "eqx_stateful": lambda: stateful_step(
            "eqx_stateful",
            "y, state = f(model, state, x): Linear+BatchNorm+Linear w32, eqx.nn.State rebound, batch 8",
            *eqx.nn.make_with_state(StatefulNet)(32, key),
            xb8,
        ),
        "eqx_stateful_partial": lambda: forward(
            "eqx_stateful_partial",
            "inference through eqx.Partial(inference-mode model, state=state), batch 8, same object",
            _inference_partial(*eqx.nn.make_with_state(StatefulNet)(32, key)),
            xb8,
        ),
        "eqx_step_noopt": lambda: sgd_step(
            "eqx_step_noopt",
            "model = step(model, x, y): bare SGD on the getting-started network w32, no optimizer",
            ListMLP(32, 3, key),
            jnp.ones((8, 32)),
            jnp.zeros((8, 32)),
        ),
    }
    if not quick:
        xb = jnp.ones((256, 512))
        out |= {
            "eqx_mlp3_compute": lambda: forward(
                "eqx_mlp3_compute",
                "eqx.nn.MLP width 512 depth 3, batch 256 (compute-bound)",
                _Batched(mlp(3, 512)),
                xb,
            ),
            "eqx_mlp24_compute": lambda: forward(
                "eqx_mlp24_compute",
                "eqx.nn.MLP width 512 depth 24, batch 256 (compute-bound)",
                _Batched(mlp(24, 512)),
                xb,
            ),
            "eqx_train_compute": lambda: train_step(
                "eqx_train_compute",
                "eqx MLP w512 d3 + adam, batch 256 (compute-bound)",
                mlp(3, 512),
                jnp.ones((256, 512)),
                jnp.zeros((256, 512)),
            ),
        }
    return out


def _inference_partial(model: StatefulNet, state: eqx.nn.State) -> eqx.Partial:
    """Equinox's stateful example's evaluation: BatchNorm in inference mode, the state
    bound with `eqx.Partial` so that the result is called as `model(xs)`."""
    return eqx.Partial(eqx.nn.inference_mode(model), state=state)


class _Batched(eqx.Module):
    inner: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.inner)(x)

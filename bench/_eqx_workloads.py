"""Equinox and plain-pytree workloads.

Every variant of a workload uses the very same model object (or the same
leaves, for the flat floor), so weights and layout cannot differ.
"""

from __future__ import annotations

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


class Identity(eqx.Module):
    """A model with no compute: isolates the cost of the call itself."""

    scale: jax.Array

    def __call__(self, x):
        return x


def build(quick: bool) -> dict[str, Callable[[], Workload]]:
    """Workload constructors (built lazily so --only skips the others)."""
    key = jax.random.PRNGKey(0)
    x32 = jnp.ones(32)

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


class _Batched(eqx.Module):
    inner: eqx.Module

    def __call__(self, x):
        return jax.vmap(self.inner)(x)

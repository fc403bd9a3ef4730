"""Run in a subprocess with 8 simulated CPU devices (see tests/test_sharding.py).

Data-parallel and model-parallel (2-D mesh) forward and train steps under
fastcall.jit must equal the unsharded computation, and produce the same output
shardings as jax.jit / nnx.jit (no resharding): the arrays pass through.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fastcall  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
AUTO = jax.sharding.AxisType.Auto  # GSPMD propagation, as with jax.jit before explicit sharding


def close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        if eqx.is_array(x):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def same_shardings(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        if isinstance(x, jax.Array):
            assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


def equinox_checks():
    key = jax.random.PRNGKey(0)
    model = eqx.nn.MLP(16, 8, 32, 2, key=key)
    x = jax.random.normal(key, (16, 16))
    y = jnp.zeros((16, 8))
    opt = optax.sgd(0.1)

    def forward(m, x):
        return jax.vmap(m)(x)

    def step(m, s, x, y):
        loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m)
        u, s = opt.update(g, s)
        return eqx.apply_updates(m, u), s, loss

    ref_out = forward(model, x)
    ref_step = step(model, opt.init(eqx.filter(model, eqx.is_array)), x, y)

    # data parallel: batch sharded over 8 devices, model replicated
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AUTO,))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ys = jax.device_put(y, NamedSharding(mesh, P("data")))
    rep = NamedSharding(mesh, P())
    m_rep = jax.tree_util.tree_map(lambda a: jax.device_put(a, rep) if eqx.is_array(a) else a, model)
    out = fastcall.jit(forward)(m_rep, xs)
    close(out, ref_out)
    same_shardings(out, eqx.filter_jit(forward)(m_rep, xs))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2), out.sharding
    f_step = fastcall.jit(step)
    s0 = opt.init(eqx.filter(m_rep, eqx.is_array))
    new = f_step(m_rep, s0, xs, ys)
    close(new, ref_step)
    same_shardings(new, eqx.filter_jit(step)(m_rep, s0, xs, ys))
    again = f_step(new[0], new[1], xs, ys)  # cached path with sharded leaves
    close(again, step(*ref_step[:2], x, y))

    # model parallel: 2-D mesh, hidden dimension sharded over "model"
    mesh2 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))

    def place(path, a):
        if not eqx.is_array(a):
            return a
        name = jax.tree_util.keystr(path)
        if a.ndim == 2 and "layers[0]" in name:
            return jax.device_put(a, NamedSharding(mesh2, P("model", None)))
        if a.ndim == 2:
            return jax.device_put(a, NamedSharding(mesh2, P(None, "model")))
        return jax.device_put(a, NamedSharding(mesh2, P()))

    m_mp = jax.tree_util.tree_map_with_path(place, model)
    x2 = jax.device_put(x, NamedSharding(mesh2, P("data")))
    y2 = jax.device_put(y, NamedSharding(mesh2, P("data")))
    out = fastcall.jit(forward)(m_mp, x2)
    close(out, ref_out)
    same_shardings(out, eqx.filter_jit(forward)(m_mp, x2))
    s0 = opt.init(eqx.filter(m_mp, eqx.is_array))
    new = fastcall.jit(step)(m_mp, s0, x2, y2)
    close(new, ref_step)
    same_shardings(new, eqx.filter_jit(step)(m_mp, s0, x2, y2))

    # explicit in_shardings / out_shardings, as jax.jit takes them
    g = fastcall.jit(forward, in_shardings=(rep, NamedSharding(mesh, P("data"))), out_shardings=rep)
    out = g(m_rep, xs)
    close(out, ref_out)
    assert out.sharding.is_equivalent_to(rep, 2)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
        self.l2 = nnx.Linear(32, 8, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def nnx_layout(mesh):
    """How Block's parameters (and their Adam moments) are created: filters to shardings."""
    return {
        nnx.All(nnx.PathContains("l1"), nnx.PathContains("kernel")): NamedSharding(mesh, P(None, "model")),
        nnx.All(nnx.PathContains("l2"), nnx.PathContains("kernel")): NamedSharding(mesh, P("model", None)),
        ...: NamedSharding(mesh, P()),
    }


def nnx_prefix_checks():
    """in_shardings and out_shardings with nnx.prefix(...) results (flax >= 0.12.7), as
    nnx.jit takes them."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
    with jax.set_mesh(mesh):
        data = NamedSharding(mesh, P("data"))
        xs = jax.device_put(x, data)
        a, b = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
        prefix = nnx.prefix(a, nnx_layout(mesh))
        f = fastcall.jit(lambda m, x: m(x), in_shardings=(prefix, data))
        close(f(a, xs), nnx.jit(lambda m, x: m(x))(b, xs))
        close(f(a, xs), Block(nnx.Rngs(0))(x))
        # A module created inside and returned, with out_shardings given as nnx.prefix in
        # both of its forms: each Variable gets its own path's sharding (not its neighbour's).
        kernel_sh, bias_sh = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))
        dummy = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
        by_path = {nnx.PathContains("kernel"): kernel_sh, nnx.PathContains("bias"): bias_sh}

        def create():
            return nnx.Linear(16, 32, rngs=nnx.Rngs(0))

        for graph in (False, True):
            prefix = nnx.prefix(dummy, by_path, graph=graph)
            made = fastcall.jit(create, out_shardings=prefix, graph=graph, graph_updates=False)()
            ref = nnx.jit(create, out_shardings=prefix, graph=graph, graph_updates=False)()
            assert made.kernel.get_raw_value().sharding.is_equivalent_to(kernel_sh, 2), (graph, made.kernel)
            assert made.bias.get_raw_value().sharding.is_equivalent_to(bias_sh, 1), (graph, made.bias)
            same_shardings(nnx.state(made), nnx.state(ref))
            close(nnx.state(made), nnx.state(ref))


def nnx_checks():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AUTO, AUTO))
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 16))
    y = jnp.zeros((16, 8))
    def train_step(model, opt, x, y):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, g)
        return loss

    uncommitted = nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        # The reference: eager execution on unsharded copies of the same initial weights.
        ref_model = Block(nnx.Rngs(0))
        nnx.update(ref_model, jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a)), nnx.state(ref_model)))
        ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
        ref_losses = [train_step(ref_model, ref_opt, x, y) for _ in range(3)]

        ours, theirs = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
        o_ours = nnx.Optimizer(ours, optax.adam(1e-2), wrt=nnx.Param)
        o_theirs = nnx.Optimizer(theirs, optax.adam(1e-2), wrt=nnx.Param)
        before = ours.l1.kernel.get_raw_value().sharding
        assert before.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2), before
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ys = jax.device_put(y, NamedSharding(mesh, P("data")))
        f, g = fastcall.jit(train_step), nnx.jit(train_step)
        for i in range(3):
            a, b = f(ours, o_ours, xs, ys), g(theirs, o_theirs, xs, ys)
            close(a, ref_losses[i])
            close(a, b)
        # state written back keeps the partitioning, exactly as nnx.jit's does
        same_shardings(nnx.state(ours), nnx.state(theirs))
        close(nnx.state(ours), nnx.state(ref_model))
        assert ours.l1.kernel.get_raw_value().sharding.is_equivalent_to(before, 2)
        # in_shardings with nnx.StateSharding, as nnx.jit takes it (nnx.prefix: nnx_prefix_checks)
        data = NamedSharding(mesh, P("data"))
        layout = nnx_layout(mesh)
        state_sharding = nnx.StateSharding(layout)
        opt_sharding = nnx.StateSharding(layout)
        a2, b2 = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
        oa2, ob2 = (nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param) for m in (a2, b2))
        f2 = fastcall.jit(train_step, in_shardings=(state_sharding, opt_sharding, data, data))
        g2 = nnx.jit(train_step, in_shardings=(state_sharding, opt_sharding, data, data))
        for _ in range(2):
            close(f2(a2, oa2, xs, ys), g2(b2, ob2, xs, ys))
        same_shardings(nnx.state(a2), nnx.state(b2))
        close(nnx.state(a2), nnx.state(b2))
        # out_shardings with an nnx.StateSharding for a returned module, as nnx.jit takes it
        def touch(m, x):
            m.l1.bias[...] = m.l1.bias[...] + 0.0 * x.sum()
            return m, m(x)

        a3, b3 = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
        io = dict(in_shardings=(nnx.StateSharding(layout), data), out_shardings=(nnx.StateSharding(layout), data))
        f4 = fastcall.jit(touch, **io)
        g4 = nnx.jit(touch, **io)
        (ma, ya), (mb, yb) = f4(a3, xs), g4(b3, xs)
        assert ma is a3 and mb is b3
        close(ya, yb)
        same_shardings(ya, yb)
        same_shardings(nnx.state(a3), nnx.state(b3))
        kernel_sh, bias_sh = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model"))
        by_path = {nnx.PathContains("kernel"): kernel_sh, nnx.PathContains("bias"): bias_sh}
        # in_shardings: every Variable of the argument ends with its sharding, changed or
        # not, and one replaced by a raw array inside too (as nnx.jit).
        def replace_kernel(m):
            m.kernel = m.kernel[...] * 1.0

        c, d = uncommitted  # (created outside the mesh: not committed to another sharding)
        fastcall.jit(replace_kernel, in_shardings=(nnx.StateSharding(by_path),))(c)
        nnx.jit(replace_kernel, in_shardings=(nnx.StateSharding(by_path),))(d)
        assert c.kernel.sharding.is_equivalent_to(kernel_sh, 2) and c.bias.get_raw_value().sharding.is_equivalent_to(bias_sh, 1)
        same_shardings(nnx.state(c), nnx.state(d))
        serve = fastcall.partial(lambda m, x: m(x), ours)
        out = serve(xs)
        close(out, ref_model(x))
        same_shardings(out, nnx.jit(lambda m, x: m(x))(theirs, xs))


if __name__ == "__main__":
    if sys.argv[1:] == ["prefix"]:
        nnx_prefix_checks()
    else:
        equinox_checks()
        nnx_checks()
    print("SHARDED CHECKS PASSED")
    sys.exit(0)

"""nnx.State arguments and results with shardings, against nnx.jit (run by
tests/test_sharding.py with 4 simulated devices). fastcall reads a State of Variables as one
cached object; to nnx.jit it is a pytree: in_shardings may be a pytree prefix of it, and
out_shardings applies to a returned State, of Variables or of raw arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fastcall

mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
rep, col, mat = (NamedSharding(mesh, P(*s)) for s in ((), ("d",), (None, "d")))
S = nnx.State({"w": mat, "b": col})


class M(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((4, 8)))
        self.b = nnx.Param(jnp.zeros(8))
        self.count = nnx.BatchStat(jnp.zeros(()))


def train_step(g, s, x):  # the functional API: returns the new state
    m = nnx.merge(g, s)
    m.w[...] = m.w[...] * 0.5
    m.count[...] += 1
    return nnx.state(m, nnx.Param), jnp.sum(x @ m.w[...])


def make_state(x):  # a State of new Variables
    return nnx.State({"w": nnx.Param(x * 2), "b": nnx.Param(x[0] + 1)})


def make_raw(x):  # a State of raw arrays
    return nnx.State({"w": x * 2, "b": x[0] + 1})


def value(v):
    return v[...] if isinstance(v, nnx.Variable) else v


def run(jit, fn, options, args):
    f = jit(fn, **options)
    a = args()
    outs = [f(*a) for _ in range(3)]
    out = outs[-1][0] if isinstance(outs[-1], tuple) else outs[-1]
    return (value(out["w"]).sharding.spec, value(out["b"]).sharding.spec,
            [float(jnp.sum(value(x))) for x in jax.tree_util.tree_leaves(outs[-1])],
            a[1]["count"][...].item() if len(a) > 1 else None)


cases = {
    "train_step, State prefix in and out": (
        train_step,
        dict(in_shardings=(None, nnx.State({"w": mat, "b": col, "count": rep}), None), out_shardings=(S, None)),
        lambda: (*nnx.split(M()), jnp.ones((2, 4))),
    ),
    "one sharding for a whole sub-State": (
        train_step,
        dict(in_shardings=(None, nnx.State({"w": None, "b": None, "count": rep}), None)),
        lambda: (*nnx.split(M()), jnp.ones((2, 4))),
    ),
    "a returned State of new Variables": (make_state, dict(out_shardings=S), lambda: (jnp.ones((4, 8)),)),
    "a returned State of raw arrays": (make_raw, dict(out_shardings=S), lambda: (jnp.ones((4, 8)),)),
}
for name, (fn, options, args) in cases.items():
    got, want = run(fastcall.jit, fn, options, args), run(nnx.jit, fn, options, args)
    assert got == want, (name, got, want)
    print("ok:", name, got[:2])
print("STATE SHARDING CHECKS PASSED")

"""Leaf-scaling sweep: microseconds per call against the number of array leaves.

The model holds N small arrays and uses every one of them (an unused leaf would
be pruned from the executable and make the floor cheaper), so what grows with N
is the per-leaf cost of each call path. (Its plot: `_plot.leaf_scaling`.)
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

import fastcall

from ._harness import Variant, Workload, allclose_tree

PREFIX = "leaves_"


class Leaves(eqx.Module):
    arrays: tuple

    def __call__(self, x):
        return x + jnp.concatenate(self.arrays).sum()  # one cheap op that reads every leaf


class NNXLeaves(nnx.Module):
    def __init__(self, values: list[Any]):
        self.arrays = nnx.List([nnx.Param(v) for v in values])

    def __call__(self, x):
        return x + jnp.concatenate([p[...] for p in self.arrays]).sum()


def _compare(ref: list[Any], outs: list[Any]) -> None:
    for a, b in zip(ref, outs):
        allclose_tree(a, b, rtol=1e-4, atol=1e-4)


def leaves_workload(n: int) -> Workload:
    values = [jnp.full((4,), (i % 7) * 0.01, jnp.float32) for i in range(n)]
    model = Leaves(tuple(values))
    x = jnp.ones(4)

    def call(m, x):
        return m(x)

    def make_floor():
        f = jax.jit(lambda *a: call(Leaves(a[:-1]), a[-1]))
        args = (*values, x)
        return lambda: f(*args)

    def eqx_variant(wrap: Callable[[Any], Any]):
        def make():
            f = wrap(call)
            return lambda: f(model, x)

        return make

    def make_partitioned():
        dynamic, static = eqx.partition(model, eqx.is_array)
        f = jax.jit(lambda d, x: call(eqx.combine(d, static), x))
        return lambda: f(dynamic, x)

    def nnx_variant(wrap: Callable[[Any], Any]):
        def make():
            m = NNXLeaves(values)
            f = wrap(call)
            return lambda: f(m, x)

        return make

    def make_jit_partial():
        f = nnx.jit_partial(call, NNXLeaves(values), graph=False)
        return lambda: f(x)

    return Workload(
        f"{PREFIX}{n}",
        f"{n} array leaves, every one used",
        [
            Variant("floor", make_floor, note="jax.jit on the flat leaves"),
            Variant("fastcall.jit", eqx_variant(fastcall.jit), note="Equinox model"),
            Variant("eqx.filter_jit", eqx_variant(eqx.filter_jit)),
            Variant("jax.jit(partitioned)", make_partitioned),
            Variant("fastcall.jit (nnx)", nnx_variant(fastcall.jit), note="NNX model"),
            Variant("nnx.jit", nnx_variant(nnx.jit)),
            Variant("nnx.jit(graph=False)", nnx_variant(lambda f: nnx.jit(f, graph=False))),
            Variant("nnx.jit_partial(graph=False)", make_jit_partial),
        ],
        _compare,
        # nnx.jit_partial binds the model: the peer of fastcall.partial, which the sweep leaves out
        peers={
            "fastcall.jit": ("eqx.filter_jit", "jax.jit(partitioned)"),
            "fastcall.jit (nnx)": ("nnx.jit", "nnx.jit(graph=False)"),
        },
    )


def build(sizes: list[int]) -> dict[str, Callable[[], Workload]]:
    return {f"{PREFIX}{n}": (lambda n=n: leaves_workload(n)) for n in sizes}


"""Models shared by several test files.

TinyDecoder is a copy of bench/_nnx_workloads.TinyDecoder (the decoder the
benchmark times): the tests keep their own so they do not depend on bench/.
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class WithStatics(eqx.Module):
    """Static fields, a callable leaf, a Python scalar leaf and arrays."""

    weight: jax.Array
    bias: jax.Array
    activation: Callable
    scale: float
    name: str = eqx.field(static=True)
    n: int = eqx.field(static=True)

    def __call__(self, x):
        y = self.activation(self.weight @ x + self.bias) * self.scale
        return y if self.n == 1 else jnp.tile(y, self.n)


def make_with_statics(seed: int = 0, n: int = 1, act: Callable = jax.nn.relu) -> WithStatics:
    """A (3, 4) WithStatics with random weights drawn from PRNGKey(seed)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return WithStatics(jax.random.normal(k1, (3, 4)), jax.random.normal(k2, (3,)), act, 2.0, "m", n)


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


class Sized(nnx.Module):
    """An NNX module whose output depends on a list attribute: a GraphDef of it holds that
    very list, so `features.append(...)` after `nnx.split` changes the GraphDef in place."""

    def __init__(self):
        self.features = [2, 3]
        self.w = nnx.Param(jnp.arange(3.0))

    def __call__(self, x):
        return x * len(self.features) + self.w[...]


class HashRunsCode(type):
    """A metaclass whose classes' hash runs code once armed (`armed`: an action, cleared as it
    runs): the leaf-type test of an item of such a class can change the container being read."""

    armed: Any = None

    def __hash__(cls):
        action, HashRunsCode.armed = HashRunsCode.armed, None
        if action is not None:
            action()
        return hash(np.ndarray)

    def __eq__(cls, other):
        return other is np.ndarray or cls is other


class OddArray(np.ndarray, metaclass=HashRunsCode):
    """A NumPy array whose type's hash runs `HashRunsCode.armed`."""

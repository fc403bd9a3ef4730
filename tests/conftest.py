"""Shared fixtures: small models, and comparison helpers (the peers are the oracle)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastcall

# tests/conformance runs the peers' own suites in subprocesses (python -m tests.conformance);
# nothing there belongs to this run.
collect_ignore = ["conformance"]


@pytest.fixture(autouse=True)
def _fresh_caches():
    fastcall.clear_caches()
    yield


def assert_trees_equal(a: Any, b: Any, *, exact: bool = False) -> None:
    """Same structure, same static leaves, same array shapes/dtypes/values."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, f"structure differs:\n{ta}\n{tb}"
    for x, y in zip(la, lb):
        if eqx.is_array(x) or eqx.is_array(y):
            assert eqx.is_array(x) and eqx.is_array(y), (x, y)
            x, y = np.asarray(x), np.asarray(y)
            assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
            if exact:
                np.testing.assert_array_equal(x, y)
            else:
                np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
        else:
            assert type(x) is type(y) and x == y, (x, y)


def check_against_peers(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run fn eagerly, under eqx.filter_jit and under fastcall.jit (twice, to
    exercise the cached path); assert all agree. Returns fastcall's output."""
    eager = fn(*args, **kwargs)
    peer = eqx.filter_jit(fn)(*args, **kwargs)
    wrapped = fastcall.jit(fn)
    first = wrapped(*args, **kwargs)
    second = wrapped(*args, **kwargs)
    assert_trees_equal(first, peer)
    assert_trees_equal(second, peer)
    assert_trees_equal(first, eager)
    return second


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


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


@pytest.fixture
def mlp(key):
    return eqx.nn.MLP(4, 3, 8, 2, key=key)


@pytest.fixture
def with_statics(key):
    k1, k2 = jax.random.split(key)
    return WithStatics(
        jax.random.normal(k1, (3, 4)), jax.random.normal(k2, (3,)), jax.nn.relu, 2.0, "m", 1
    )


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Run a test through the C fast path and through the pure-Python one."""
    from fastcall import _jit

    if request.param == "python":
        monkeypatch.setattr(_jit, "USE_ACCEL", False)
    elif _jit._accel is None:
        pytest.skip("the C accelerator is not built")
    return request.param


def run_threads(n: int, target, *args) -> list[BaseException]:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i):
        try:
            barrier.wait()
            target(i, *args)
        except BaseException as e:  # pragma: no cover - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors

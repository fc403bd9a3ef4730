"""The optional C fast path is built here and serves the hot case."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fastcall


def test_c_accelerator_is_built_and_used():
    """CI builds the C fast path; a silent fallback would only show up as lost speed."""
    from fastcall import _dispatch

    assert _dispatch._accel is not None, "fastcall/_accel.c was not built (is a C compiler installed?)"
    f = fastcall.jit(lambda m, x: m(x))
    assert type(f).__name__ == "FastWrapper"
    m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    for _ in range(3):
        f(m, jnp.ones(2))
    assert f._fastcall_c_calls >= 1
    assert f.stats().calls == 3 and f.stats().hits == 2
    # The first call resolves and caches the model, the second installs its fast record,
    # the third is served in C.
    assert f.stats().paths == {"c_fast": 1, "python_fast": 0, "c_structure": 0, "python_structure": 0, "general": 2}


def test_c_wrapper_behaves_like_a_function():
    from fastcall import _dispatch

    if _dispatch._accel is None:
        pytest.skip("not built")

    class Model(eqx.Module):
        w: jax.Array

        @fastcall.jit
        def __call__(self, x):
            return self.w * x

        @fastcall.jit
        def double(self, x):
            return 2 * self.w * x

    m = Model(jnp.full(2, 3.0))
    assert type(Model.__dict__["__call__"]).__name__ == "FastWrapper"
    assert jnp.allclose(m(jnp.ones(2)), 3.0) and jnp.allclose(m(jnp.ones(2)), 3.0)
    assert jnp.allclose(m.double(jnp.ones(2)), 6.0)
    assert Model.double.__name__ == "double"
    import weakref

    weakref.ref(Model.double)
    hash(Model.double)

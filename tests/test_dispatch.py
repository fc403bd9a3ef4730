"""The call route: which path serves a call (C fast, Python fast, general), the same
results and counts whichever it is, and the records the C path reads."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fastcall

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, served

pytestmark = pytest.mark.usefixtures("hot_path")


def forward(m, x):
    return m(x)


def test_same_equinox_model_takes_the_fast_path(hot_path):
    m = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(forward)
    x = jnp.ones(4)
    out, path = served(f, m, x)
    assert path == "general"  # first call: resolved, compiled, cached by identity
    out, path = served(f, m, x)
    assert path == "general"  # seen before: its fast record is installed now
    out2, path2 = served(f, m, x)
    assert path2 == FAST_PATH[hot_path]
    assert_trees_equal(out2, m(x))
    assert_trees_equal(out2, eqx.filter_jit(forward)(m, x))
    # Another model of the same structure is a new object: the structure path serves it;
    # passed again, it is cached by identity (general), then served fast.
    m2 = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(1))
    out3, path3 = served(f, m2, x)
    assert path3 == STRUCTURE_PATH[hot_path]
    assert_trees_equal(out3, m2(x))
    assert [served(f, m2, x)[1] for _ in range(2)] == ["general", "general"]
    out4, path4 = served(f, m2, x)
    assert path4 == FAST_PATH[hot_path]
    assert_trees_equal(out4, m2(x))


def test_fast_path_needs_plain_array_arguments(hot_path):
    m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x, scale: m(x) * scale)
    x = jnp.ones(2)
    served(f, m, x, 2.0)
    assert served(f, m, x, 2.0)[1] == "general"  # a Python scalar is not a plain array
    assert served(f, m, x, scale=2.0)[1] == "general"  # keyword arguments
    assert_trees_equal(f(m, x, 3.0), m(x) * 3.0)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_nnx_fast_path_reads_values_and_writes_state_back(hot_path):
    ours, theirs = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
    f, g = fastcall.jit(forward), nnx.jit(forward)
    x = jnp.arange(6.0).reshape(2, 3)
    paths = []
    for i in range(3):
        y, path = served(f, ours, x + i)
        paths.append(path)
        assert_trees_equal(y, g(theirs, x + i))
        assert_trees_equal(nnx.state(ours), nnx.state(theirs))
    assert paths == ["general", FAST_PATH[hot_path], FAST_PATH[hot_path]]
    # A value changed outside is read by the fast path.
    ours.lin.kernel[...] = ours.lin.kernel[...] * 2
    theirs.lin.kernel[...] = theirs.lin.kernel[...] * 2
    y, path = served(f, ours, x)
    assert path == FAST_PATH[hot_path]
    assert_trees_equal(y, g(theirs, x))
    # A structure change sends the next call to the general path, then fast again.
    ours.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(5))
    theirs.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(5))
    y, path = served(f, ours, x)
    assert path == "general"
    assert_trees_equal(y, g(theirs, x))
    y, path = served(f, ours, x)
    assert path == FAST_PATH[hot_path]
    assert_trees_equal(y, g(theirs, x))
    ours.eval()  # a static attribute: another compiled program
    theirs.eval()
    y, path = served(f, ours, x)
    assert path == "general"
    assert_trees_equal(y, g(theirs, x))


def test_stats_count_the_same_whichever_path_serves(monkeypatch):
    """The same call sequence, through the C path and through Python, counts the same:
    an output structure that varies, a failing call, and plain hits."""
    from fastcall import _native

    def sequence():
        fastcall.clear_caches()

        def f(m, x):
            # The output structure depends on the input shape: varies after the first.
            return m(x) if x.shape[0] == 2 else (m(x[:2]), x)

        w = fastcall.jit(f)
        m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
        w(m, jnp.ones(2))
        w(m, jnp.ones(2))
        w(m, jnp.ones(3))
        w(m, jnp.ones(2))
        deleted = jnp.ones(2)
        deleted.delete()
        with pytest.raises(fastcall.FastcallError, match="deleted"):
            w(m, deleted)
        w(m, jnp.ones(2))
        s = w.stats()
        return s.calls, s.compiles, s.hits, sum(s.paths.values())

    c = sequence()
    monkeypatch.setattr(_native, "ACCEL", None)
    python = sequence()
    assert c == python
    assert c[0] == c[3] == 6


def test_disable_accel_environment_variable():
    code = (
        "import jax, jax.numpy as jnp, equinox as eqx, fastcall\n"
        "f = fastcall.jit(lambda m, x: m(x))\n"
        "m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))\n"
        "f(m, jnp.ones(2)); f(m, jnp.ones(2)); f(m, jnp.ones(2))\n"
        "print(type(f).__name__, f.stats().paths['python_fast'], f.stats().paths['c_fast'])\n"
    )
    env = dict(os.environ, FASTCALL_DISABLE_ACCEL="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["function", "1", "0"]


def test_c_wrapper_checks_the_record_layout():
    from fastcall import _dispatch, _native

    if _native.BUILT is None:
        pytest.skip("the C accelerator is not built")
    records = ["FastSlot", "FastRecord", "StructureRecord", "CacheEntry", "ArgRead", "NodeRead", "NodesRead",
               "GraphdefRead", "KnownGraphdef", "NnxArg", "WriteBack", "RawLeaf", "VariableRead", "Registration",
               "Watched", "SequenceRead", "StaticRead", "JointRead", "SharedVariableRead", "TreeRead"]
    real = _native.BUILT.configure
    calls = []
    try:
        _native.BUILT.configure = lambda *a: calls.append(a)
        _dispatch.configure_accel()
    finally:
        _native.BUILT.configure = real
    (tables,) = calls
    assert sorted(tables[-1]) == sorted(records)
    try:
        for name in records:
            cls = tables[-1][name]
            for wrong_fields, match in [((*cls._fields[:-1], "other"), f"{name} field {len(cls._fields) - 1}"),
                                        (cls._fields + ("extra",), name)]:
                wrong = collections.namedtuple(name, wrong_fields)
                with pytest.raises(TypeError, match=match):
                    real(*tables[:-1], {**tables[-1], name: wrong})
            with pytest.raises(TypeError, match=f"no record class {name}"):
                real(*tables[:-1], {k: v for k, v in tables[-1].items() if k != name})
    finally:
        _dispatch.configure_accel()  # (a failed configure changes nothing; restore anyway)
    f = fastcall.jit(lambda x: x + 1)
    assert int(f(jnp.ones(()))) == 2

"""The write-back of a call that only writes new leaf values (`fastcall/_nnx/_leaf_writes.py`):
one source, compiled by Cython where it was built, run as Python where not; both hit routes
(C and Python, fast and structure) call it. Each test runs it both ways."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall
from fastcall import _nnx_gate
from fastcall._nnx import _adapter, _leaf_writes

from .conftest import FAST_PATH, STRUCTURE_PATH, served, source_as_python

AS_PYTHON = source_as_python(_leaf_writes)


@pytest.fixture(params=["compiled", "python"])
def leaf_writes(request, monkeypatch):
    """`LeafWrites` as compiled or as run from the same file (the plugin's name swapped:
    every record a call makes then uses that kind)."""
    module = _leaf_writes if request.param == "compiled" else AS_PYTHON
    if module is _leaf_writes and not _leaf_writes.COMPILED:
        pytest.skip("not compiled (FASTCALL_TEST_AS_PYTHON=1)")
    _nnx_gate.adapter()  # (loaded: the records below ask it)
    monkeypatch.setattr(_adapter, "LeafWrites", module.LeafWrites)
    return module


class Counter(nnx.Module):
    """Writes a Variable and a raw data leaf each call, changes no structure."""

    def __init__(self):
        self.w = nnx.Param(jnp.arange(3.0))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
        self.total = nnx.data(jnp.zeros(3))

    def __call__(self, x):
        self.count[...] += 1
        self.total = self.total + x
        return x * self.w[...]


def _general_write_back_refused(monkeypatch):
    """From here on, a call that reaches the general write-back fails."""

    def refuse(*args):
        raise AssertionError("the general write-back ran")

    monkeypatch.setattr(_adapter, "write_back", refuse)


def test_a_step_that_only_writes_leaves_is_written_back_by_leaf_writes(leaf_writes, hot_path, monkeypatch):
    ours, theirs = Counter(), Counter()
    f = fastcall.jit(lambda m, x: m(x))
    g = nnx.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    for _ in range(2):  # (the miss writes back through the general path)
        np.testing.assert_array_equal(f(ours, x), g(theirs, x))
    _general_write_back_refused(monkeypatch)
    for step in range(3):
        out, route = served(f, ours, x * step)
        np.testing.assert_array_equal(out, g(theirs, x * step))
        assert route == FAST_PATH[hot_path]
    assert int(ours.count[...]) == int(theirs.count[...]) == 5
    np.testing.assert_array_equal(ours.total, theirs.total)
    assert type(ours.total) is type(theirs.total)


def test_objects_in_a_container_argument_are_written_back_by_leaf_writes(leaf_writes, hot_path, monkeypatch):
    """The structure route: its third argument to the post is the call's list of NnxArgs."""
    ours, theirs = (Counter(), Counter()), (Counter(), Counter())
    f = fastcall.jit(lambda p, x: p[1](p[0](x)))
    g = nnx.jit(lambda p, x: p[1](p[0](x)))
    x = jnp.ones(3)
    for _ in range(2):
        np.testing.assert_array_equal(f(ours, x), g(theirs, x))
    _general_write_back_refused(monkeypatch)
    for step in range(3):
        out, route = served(f, ours, x + step)
        np.testing.assert_array_equal(out, g(theirs, x + step))
        assert route == STRUCTURE_PATH[hot_path]
    for a, b in zip(ours, theirs):
        assert int(a.count[...]) == int(b.count[...]) == 5
        np.testing.assert_array_equal(a.total, b.total)


def _direct(module, one_object):
    """A LeafWrites over one Counter's leaves (a Variable, then the raw leaf), with its
    result and general post recorded."""
    m = Counter()
    variables = [m.count, _leaf_item(m, "total")]
    seen = []
    writes = module.LeafWrites(
        ((0, 0), (0, 1)), lambda head: ("result", head), lambda *args: seen.append(args) or "general", one_object
    )
    nnx_arg = fastcall._plan.NnxArg(m, variables, None)
    return m, writes, (variables if one_object else [nnx_arg]), seen


def _leaf_item(m, name):
    """The handle by which fastcall reads and writes a raw leaf of `m` (`_plan.RawLeaf`)."""
    import weakref

    return fastcall._plan.RawLeaf(weakref.proxy(m), name)


@pytest.mark.parametrize("one_object", [True, False])
def test_leaf_writes_sets_each_value_and_builds_the_rest(leaf_writes, one_object):
    m, writes, nnx_arg, seen = _direct(leaf_writes, one_object)
    head, count, total = jnp.ones(2), jnp.asarray(7, jnp.int32), jnp.full(3, 2.0)
    kind, built = writes([head, count, total], m, nnx_arg)
    assert kind == "result" and len(built) == 1 and built[0] is head and not seen
    assert m.count.get_raw_value() is count and m.__dict__["total"] is total


@pytest.mark.parametrize(
    "case", ["not an array", "leaf index out of range", "not a Variable", "not a list", "too few outputs"]
)
def test_anything_unexpected_goes_to_the_general_write_back_with_nothing_written(leaf_writes, case):
    m, writes, nnx_arg, seen = _direct(leaf_writes, True)
    out = [jnp.ones(2), jnp.asarray(7, jnp.int32), jnp.full(3, 2.0)]
    if case == "not an array":
        out[1] = np.asarray(7, np.int32)  # (a tracer, say: not a jax Array of this process)
    elif case == "leaf index out of range":
        nnx_arg = nnx_arg[:1]
    elif case == "not a Variable":
        nnx_arg = [nnx_arg[0], ("owner", "name")]
    elif case == "not a list":
        out = tuple(out)
    else:
        out = out[:1]
    before = (m.count.get_raw_value(), m.__dict__["total"])
    assert writes(out, m, nnx_arg) == "general"
    assert len(seen) == 1 and seen[0][0] is out and seen[0][1] is m and seen[0][2] is nnx_arg
    assert (m.count.get_raw_value(), m.__dict__["total"]) == before


def test_a_fast_record_writes_only_its_one_object(leaf_writes):
    """A fast record's writes all name the one object (ordinal 0); any other is not its own."""
    m, _, variables, _ = _direct(leaf_writes, True)
    seen = []
    writes = leaf_writes.LeafWrites(((1, 0),), list, lambda *args: seen.append(args) or "general", True)
    assert writes([jnp.asarray(1, jnp.int32)], m, variables) == "general" and seen


def test_compiled_and_python_write_the_same(monkeypatch):
    if not _leaf_writes.COMPILED:
        pytest.skip("not compiled (FASTCALL_TEST_AS_PYTHON=1)")
    written = []
    for module in (_leaf_writes, AS_PYTHON):
        m, writes, nnx_arg, _ = _direct(module, False)
        count, total = jnp.asarray(3, jnp.int32), jnp.full(3, 1.5)
        assert writes([count, total], m, nnx_arg) == ("result", [])
        written.append((m.count.get_raw_value() is count, m.__dict__["total"] is total))
    assert written == [(True, True), (True, True)]


def test_a_step_under_an_outer_trace_writes_tracers_through_the_general_path(leaf_writes):
    """Inside another function's trace the outputs are tracers: the general write-back."""
    ours, theirs = Counter(), Counter()
    f = fastcall.jit(lambda m, x: m(x))
    g = nnx.jit(lambda m, x: m(x))
    f(ours, jnp.ones(3)), g(theirs, jnp.ones(3))

    @nnx.jit
    def outer(m, x):
        return f(m, x) + f(m, x)

    @nnx.jit
    def outer_peer(m, x):
        return g(m, x) + g(m, x)

    np.testing.assert_array_equal(outer(ours, jnp.ones(3)), outer_peer(theirs, jnp.ones(3)))
    assert int(ours.count[...]) == int(theirs.count[...]) == 3
    np.testing.assert_array_equal(ours.total, theirs.total)
    assert isinstance(ours.total, jax.Array)

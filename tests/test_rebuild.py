"""The output plans (`fastcall/_rebuild.py`): one source, compiled by Cython where it was
built and run as Python where not; both ways build the same outputs, which are Equinox's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fastcall
from fastcall import _codegen, _outputs, _rebuild

from . import conftest
from .conftest import STRUCTURE_PATH, assert_trees_equal, compiled_sources, served, source_as_python


AS_PYTHON = source_as_python(_rebuild)


def test_the_compiled_sources_are_compiled_where_fastcall_was_built():
    """CI builds with a C compiler and Cython: a silent fallback would only show as lost speed
    (except in the run that asks for the sources as Python, `FASTCALL_TEST_AS_PYTHON=1`)."""
    from fastcall import _native

    assert list(_native.COMPILED_SOURCES) == compiled_sources()  # (as setup.py lists them)
    for name in _native.COMPILED_SOURCES:
        module = importlib.import_module(name)
        assert (Path(module.__file__).suffix == ".py") == conftest.AS_PYTHON, module.__file__
        assert module.COMPILED != conftest.AS_PYTHON and _native.runs_as_python(name) == conftest.AS_PYTHON
    assert _rebuild.COMPILED != conftest.AS_PYTHON and AS_PYTHON.COMPILED is False


@pytest.fixture(params=["compiled", "python"])
def rebuild(request, monkeypatch):
    """The plans as compiled (`fastcall._rebuild`) or as run from the same file (the
    callers' module swapped: every plan a call makes is then of that kind)."""
    module = _rebuild if request.param == "compiled" else AS_PYTHON
    if module is _rebuild and not _rebuild.COMPILED:
        pytest.skip("not compiled (FASTCALL_TEST_AS_PYTHON=1)")
    monkeypatch.setattr(_codegen, "_rebuild", module)
    monkeypatch.setattr(_outputs, "_rebuild", module)
    return module


class _Pair(NamedTuple):
    a: Any
    b: Any


def _output_example():
    """An output holding every kind of node the plans rebuild."""
    mlp = eqx.nn.MLP(2, 2, 3, 2, key=jax.random.PRNGKey(0))
    _, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="batch")
    return (mlp, [jnp.ones(2), None, "static"], {"b": jnp.zeros(1), "a": _Pair(jnp.ones(3), 7)}, state, 1.5)


def _rebuilt(example: Any) -> tuple[Any, list[Any]]:
    build = _codegen.make_builder(example)
    assert build is not None
    dynamic = [x for x in jax.tree_util.tree_leaves(example) if isinstance(x, jax.Array)]
    fresh = [x + 1 for x in dynamic]
    return build(fresh), fresh


def test_a_plan_rebuilds_every_kind_of_node(rebuild):
    """An output of new objects from the flat dynamic outputs: the same tree, the same
    leaves (by identity), statics as they were, modules made as Equinox makes them."""
    example = _output_example()
    assert isinstance(_codegen.plan_of(_codegen.make_builder(example)), rebuild.OutNode)
    out, fresh = _rebuilt(example)
    leaves, treedef = jax.tree_util.tree_flatten(example)
    out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
    assert out_treedef == treedef
    assert all(a is b for a, b in zip([x for x in out_leaves if isinstance(x, jax.Array)], fresh, strict=True))
    assert [x for x in out_leaves if not isinstance(x, jax.Array)] == [x for x in leaves if not isinstance(x, jax.Array)]
    assert out[0] is not example[0] and type(out[0]) is type(example[0])
    assert type(out[1]) is list and type(out[2]["a"]) is _Pair and type(out[3]) is eqx.nn.State
    assert list(out[2]) == ["a", "b"]  # (jax's order, as treedef.unflatten gives it)
    # each module as Equinox's own unflatten makes it: its fields, in order, in its __dict__
    theirs = jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(out))
    for ours_m, their_m in [(out[0], theirs[0]), (out[0].layers[1], theirs[0].layers[1]), (out[3], theirs[3])]:
        assert list(vars(ours_m)) == list(vars(their_m))
        plain = [k for k, v in vars(ours_m).items() if not isinstance(v, (eqx.Module, tuple, dict))]
        assert all(vars(ours_m)[k] is vars(their_m)[k] for k in plain)


def test_compiled_and_python_plans_build_the_same_output():
    """The two ways of running the one source, against each other, on one output."""
    if not _rebuild.COMPILED:
        pytest.skip("not compiled (FASTCALL_TEST_AS_PYTHON=1)")
    example = _output_example()
    dynamic = [x for x in jax.tree_util.tree_leaves(example) if isinstance(x, jax.Array)]
    outs = []
    for module in (_rebuild, AS_PYTHON):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_codegen, "_rebuild", module)
            outs.append(_codegen.make_builder(example)(list(dynamic)))
    compiled, python = outs
    assert jax.tree_util.tree_structure(compiled) == jax.tree_util.tree_structure(python)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(compiled), jax.tree_util.tree_leaves(python), strict=True))
    assert list(vars(compiled[0])) == list(vars(python[0])) and list(vars(compiled[3])) == list(vars(python[3]))


def test_a_wide_output_and_finish_output(rebuild):
    """A tuple of 40 leaves; `finish_output` builds, then notes with `note(output, d)`."""
    leaves = [jnp.full(1, i) for i in range(40)]
    build = _codegen.make_builder(tuple(leaves))
    built = build(list(leaves))
    assert type(built) is tuple and all(a is b for a, b in zip(built, leaves, strict=True))
    plan = _codegen.plan_of(build)
    noted = []
    assert rebuild.finish_output(plan, None, leaves)[39] is leaves[39]
    out = rebuild.finish_output(plan, lambda result, d: noted.append((result, d)), leaves)
    assert noted == [(out, leaves)] and noted[0][1] is leaves
    with pytest.raises(IndexError):
        build(leaves[:39])  # (not this plan's outputs: never a read past the list)


class _ExceptionModule(eqx.Module, Exception):  # type: ignore[misc]
    w: jax.Array


def test_an_output_class_object_new_refuses_has_no_plan(rebuild):
    """object.__new__ refuses a class whose C base has its own __new__; the compiled plan
    calls object's constructor directly, so no plan is written for one and the output is
    built (or refused) as eqx.filter_jit builds it."""
    assert _codegen.make_builder(_ExceptionModule(jnp.ones(1))) is None
    with pytest.raises(TypeError) as theirs:
        eqx.filter_jit(lambda x: _ExceptionModule(x * 2))(jnp.ones(1))
    with pytest.raises(TypeError, match=str(theirs.value).replace("(", r"\(").replace(")", r"\)")):
        fastcall.jit(lambda x: _ExceptionModule(x * 2))(jnp.ones(1))


class _Described:
    """A data descriptor: object.__setattr__ calls its __set__ instead of storing the value."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        return self if obj is None else obj.__dict__["w"]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["w"] = value


class _DescribedModule(eqx.Module):
    w: jax.Array


_DescribedModule.w = _Described()  # (set after the class is made: the field stays a field)


def test_an_output_class_with_a_data_descriptor_field_has_no_plan(rebuild):
    """The compiled plan sets fields as object.__setattr__ does (which calls a data
    descriptor), the Python one assigns __dict__ (which does not): no plan is written for
    such a class, and jax's unflatten (Equinox's own) builds it."""
    assert _codegen.make_builder(_DescribedModule(jnp.ones(1))) is None
    assert _codegen.make_builder(eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))) is not None
    ours = fastcall.jit(lambda x: _DescribedModule(x * 2))(jnp.ones(1))
    theirs = eqx.filter_jit(lambda x: _DescribedModule(x * 2))(jnp.ones(1))
    assert type(ours) is _DescribedModule and list(ours.__dict__) == list(theirs.__dict__)
    assert_trees_equal(ours, theirs)


def test_a_training_step_returns_what_equinox_returns_through_either_plan(rebuild, hot_path):
    """End to end: a step returning the model and an optimizer-state tuple, served by the
    hit path (C or Python) with plans of this kind, equals eqx.filter_jit's and noted its
    outputs for the next step."""
    model = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.PRNGKey(1))

    def step(m, s, x):
        return jax.tree.map(lambda w: w * 0.5 if eqx.is_array(w) else w, m), (s[0] + x.sum(), s[1] * 2)

    f = fastcall.jit(step)
    m, s = model, (jnp.zeros(()), jnp.ones(2))
    em, es = model, s
    for _ in range(3):
        (m, s), route = served(f, m, s, jnp.ones(3))
        em, es = eqx.filter_jit(step)(em, es, jnp.ones(3))
        assert_trees_equal((m, s), (em, es))
    assert route == STRUCTURE_PATH[hot_path]  # (the step's outputs read from the memo)

"""Shared fixtures and comparison helpers (the peers are the oracle); shared models are in models.py."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import os
import pathlib
import sys
import threading
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository root


def compiled_sources() -> list[str]:
    """The modules setup.py compiles with Cython (its `COMPILED_SOURCES`), as module names."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "COMPILED_SOURCES":
            return [f"fastcall.{name}" for name in ast.literal_eval(node.value)]
    raise AssertionError("setup.py names no COMPILED_SOURCES")


class _AsPython(importlib.abc.MetaPathFinder):
    """Finds fastcall's compiled sources as their .py files, as an install without a C
    compiler has them (`FASTCALL_TEST_AS_PYTHON=1`: CI runs the suite so once)."""

    names = frozenset(compiled_sources())

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in self.names and path:
            return importlib.util.spec_from_file_location(name, os.path.join(path[0], name.rsplit(".", 1)[1] + ".py"))
        return None


def source_as_python(module: Any) -> Any:
    """A compiled source of fastcall's run as Python, as where Cython did not compile it:
    its .py file loaded anew, with no Cython to import (its stand-in, `_cython_shim`)."""
    name = module.__name__ + "_as_python"  # (in the same package: its relative imports hold)
    path = pathlib.Path(module.__file__).parent / (module.__name__.rsplit(".", 1)[1] + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    cython = sys.modules.get("cython", ...)
    sys.modules["cython"] = None  # type: ignore[assignment]
    try:
        spec.loader.exec_module(loaded)
    finally:
        if cython is ...:
            del sys.modules["cython"]
        else:
            sys.modules["cython"] = cython
    return loaded


AS_PYTHON = os.environ.get("FASTCALL_TEST_AS_PYTHON", "") == "1"
if AS_PYTHON:  # (before fastcall is imported)
    sys.meta_path.insert(0, _AsPython())

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

import fastcall  # noqa: E402

from .models import make_with_statics  # noqa: E402

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
    """Run fn eagerly, under eqx.filter_jit and under fastcall.filter_jit (twice, to
    exercise the cached path); assert all agree. Returns fastcall's output."""
    eager = fn(*args, **kwargs)
    peer = eqx.filter_jit(fn)(*args, **kwargs)
    wrapped = fastcall.filter_jit(fn)
    first = wrapped(*args, **kwargs)
    second = wrapped(*args, **kwargs)
    assert_trees_equal(first, peer)
    assert_trees_equal(second, peer)
    assert_trees_equal(first, eager)
    return second


def state_of(model: Any) -> Any:
    """nnx.state(model) with PRNG key arrays as their key data, so trees compare."""
    return jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        nnx.state(model),
    )


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python process that imports this checkout first."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


@pytest.fixture
def mlp(key):
    return eqx.nn.MLP(4, 3, 8, 2, key=key)


@pytest.fixture
def with_statics():
    return make_with_statics(0)


@pytest.fixture(params=["c", "python"])
def hot_path(request, monkeypatch):
    """Run a test through the C structure route and through the pure-Python one (the fast
    route in front of both is one source: the same under either)."""
    from fastcall import _native

    if request.param == "python":
        monkeypatch.setattr(_native, "ACCEL", None)
    elif _native.ACCEL is None:
        pytest.skip("the C accelerator is not built, or is disabled (FASTCALL_DISABLE_ACCEL)")
    return request.param


@pytest.fixture
def unchecked(monkeypatch):
    """The agreement mode (FASTCALL_CHECK_HITS=1, under which CI runs the suite again) off for
    the wrappers this test makes. For the few tests it cannot serve: those whose arguments are
    changed by user code while a hit reads them (the general path, reading them after, sees
    the change by design), those that count the reads a call makes (the mode reads each call
    a second time), and those that inspect the C wrapper object itself (the mode wraps it)."""
    from fastcall import _agreement

    monkeypatch.setattr(_agreement, "ENABLED", False)


# hot_path fixture value -> stats path. Each route is one source (`_fast_route`,
# `_structure_route`), the same under both: named for whether it was compiled (not, under
# FASTCALL_TEST_AS_PYTHON).
_FAST = "c_fast" if fastcall._fast_route.COMPILED else "python_fast"
FAST_PATH = {"c": _FAST, "python": _FAST}
_STRUCTURE = "c_structure" if fastcall._structure_route.COMPILED else "python_structure"
STRUCTURE_PATH = {"c": _STRUCTURE, "python": _STRUCTURE}  # (a new object, known structure)


def served(f: Any, *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """Call `f` once; return its output and which route served the call ("c_fast",
    "python_fast", "c_structure", "python_structure", or "general" for either of the
    general path's counts; `served_exactly` tells those apart)."""
    out, route = served_exactly(f, *args, **kwargs)
    return out, "general" if route in GENERAL_PATH else route


GENERAL_PATH = ("general_cached", "general_read")


def served_exactly(f: Any, *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """Call `f` once; return its output and the one count of `f.stats().paths` it added to."""
    before = f.stats().paths
    out = f(*args, **kwargs)
    after = f.stats().paths
    changed = [p for p in after if after[p] != before.get(p, 0)]
    assert len(changed) == 1 and after[changed[0]] == before.get(changed[0], 0) + 1, (before, after)
    return out, changed[0]


def general_calls(f: Any) -> int:
    """How many calls of `f` the general path served, either way."""
    paths = f.stats().paths
    return paths["general_cached"] + paths["general_read"]


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


def reads_in(f: Any, kind: type) -> list[Any]:
    """The reads of type `kind` (a `fastcall._plan` record) in `f`'s structure records."""
    found: list[Any] = []

    def walk(x: Any, depth: int) -> None:
        if type(x) is kind:
            found.append(x)
        elif depth < 8 and isinstance(x, (tuple, list)):
            for y in x:
                walk(y, depth + 1)
        elif depth < 8 and isinstance(x, dict):
            for y in x.values():
                walk(y, depth + 1)

    walk(f._fastcall_state.structures, 0)
    return found

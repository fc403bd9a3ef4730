"""The optional compiled modules are built here and serve the hot case: the hit routes
(`_fast_route`, `_structure_route`) and the memo, compiled by Cython, entered from the C
wrapper (`_accel.c`)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fastcall
from fastcall import _memo

from .conftest import AS_PYTHON, STRUCTURE_PATH, assert_trees_equal, compiled_sources, served, source_as_python


def test_c_accelerator_is_built_and_used(unchecked):
    """CI builds the C extension and compiles the fast route; a silent fallback would only
    show up as lost speed."""
    from fastcall import _fast_route, _native

    assert _native.BUILT is not None, "fastcall/_accel.c was not built (is a C compiler installed?)"
    assert _fast_route.COMPILED is not AS_PYTHON, "fastcall/_fast_route.py was not compiled (is Cython installed?)"
    f = fastcall.jit(lambda m, x: m(x))
    assert type(f).__name__ == "FastWrapper" and type(f.fast) is _fast_route.FastRoute
    m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    for _ in range(3):
        f(m, jnp.ones(2))
    assert f.fast.fast_calls == 1
    assert f.stats().calls == 3 and f.stats().hits == 2
    # The first call reads and caches the model, the second finds it in the cache and
    # installs its fast record, the third is served by the fast route.
    assert f.stats().paths == {
        "c_fast": 0 if AS_PYTHON else 1, "python_fast": 1 if AS_PYTHON else 0, "c_structure": 0,
        "python_structure": 0, "general_cached": 1, "general_read": 1,
    }


# (run before `import fastcall`: the modules setup.py compiles found as their sources, and
# Cython not there, as where nothing was compiled)
_SOURCES_AS_PYTHON = (
    "import importlib.abc, importlib.util\n"
    "class AsSource(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    f"        if name in {compiled_sources()!r}:\n"
    "            return importlib.util.spec_from_file_location(name, path[0] + '/' + name.rsplit('.', 1)[1] + '.py')\n"
    "sys.meta_path.insert(0, AsSource())\n"
    "sys.modules['cython'] = None\n"
)


def _import_without_the_extension(env: dict[str, str], sources: bool = False) -> subprocess.CompletedProcess[str]:
    """`import fastcall` in a fresh interpreter where the extension cannot load (and, with
    `sources`, where the modules setup.py compiles run from their sources), as after an
    install without a C compiler, warnings as errors; then one call served."""
    program = (
        "import sys, warnings\n"
        "sys.modules['fastcall._accel'] = None  # (its import fails, as where it was not built)\n"
        + (_SOURCES_AS_PYTHON if sources else "")
        + "warnings.simplefilter('error')\n"
        "import jax.numpy as jnp, fastcall\n"
        "import fastcall._native as native\n"
        "assert native.BUILT is None and native.ACCEL is None\n"
        f"assert all(native.runs_as_python(name) for name in native.COMPILED_SOURCES) is {sources}\n"
        "f = fastcall.jit(lambda x: x + 1)\n"
        "outs = [float(f(jnp.ones(()))) for _ in range(3)]\n"
        "paths = f.stats().paths\n"
        "print(outs, paths['c_fast'] + paths['python_fast'] + paths['c_structure'] + paths['python_structure'])\n"
    )
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "FASTCALL_DISABLE_ACCEL"} | env,
    )


def test_without_the_compiled_path_the_import_says_so_once_and_calls_still_run():
    ran = _import_without_the_extension({})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["[2.0,", "2.0,", "2.0]", "2"]  # (served by the hit routes)
    said = [line for line in ran.stderr.splitlines() if "compiled path" in line]
    assert len(said) == 1 and "was not built, or does not load: fastcall._accel (" in said[0], ran.stderr
    assert "FASTCALL_DISABLE_ACCEL=1" in said[0]
    # where Cython did not compile the sources either (no C compiler): all named, once
    all_ = _import_without_the_extension({}, sources=True)
    assert all_.returncode == 0, all_.stderr
    assert all_.stdout == ran.stdout
    said = [line for line in all_.stderr.splitlines() if "compiled path" in line]
    assert len(said) == 1, all_.stderr
    assert all(f"; {name} (runs as Python)" in said[0] for name in compiled_sources()), said[0]
    # the Python path asked for: nothing said
    quiet = _import_without_the_extension({"FASTCALL_DISABLE_ACCEL": "1"})
    assert quiet.returncode == 0 and "compiled path" not in quiet.stderr, quiet.stderr


def test_c_wrapper_behaves_like_a_function(unchecked):
    from fastcall import _native

    if _native.BUILT is None:
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


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_returned_modules_and_tuples_are_noted_for_the_next_call(native, monkeypatch):
    """`model, opt_state = step(model, opt_state)`: the entry notes what its latest call
    returned (the module by weak reference, the tuple strongly, each with its leaves) in
    one memo, which the next call's memo replaces; the next call reads them from it, with
    nothing made per returned object; the same whether the C wrapper (`latest_leaves`) or
    Python (`_memo.latest`) reads it. `_memo.note_latest` writes it either way."""
    import gc
    import weakref

    from fastcall import _flatten, _native, _rebuild

    if native and _native.BUILT is None:
        pytest.skip("not built")
    monkeypatch.setattr(_native, "ACCEL", _native.BUILT if native else None)
    model = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    state = (jnp.zeros(2), jnp.ones(1))

    @fastcall.jit
    def step(m, s):
        return jax.tree.map(lambda w: w * 0.5, m), (s[0] + 1, s[1] * 2)

    m1, s1 = step(model, state)
    leaves, spec, guard = _memo.latest(m1)
    assert all(a is b for a, b in zip(leaves, (m1.weight, m1.bias), strict=True)) and guard is None
    leaves, _, _ = _memo.latest(s1)
    assert leaves[0] is s1[0] and leaves[1] is s1[1]
    assert id(m1) not in _flatten.by_id and id(s1) not in _flatten.by_id
    out = entry_out(step)
    assert out.held[0] is not None and _memo.LATEST[0] is out.held
    (m2, s2), route = served(step, m1, s1)  # (built and noted in one call: finish_output)
    assert route == STRUCTURE_PATH["c" if native else "python"]
    assert out.fast_result.func is _rebuild.finish_output
    assert out.fast_result.args[1].func is _memo.note_latest
    assert_trees_equal((m2, s2), (jax.tree.map(lambda w: w * 0.25, model), (state[0] + 2, state[1] * 4)))
    assert_trees_equal((m2, s2), eqx.filter_jit(step.__wrapped__)(m1, s1))
    assert _memo.latest(m1) is None and _memo.latest(s1) is None  # (the newer memo replaced it)
    assert _memo.latest(m2) is not None and _memo.latest(s2) is not None
    assert [h for h in _memo.LATEST if h is out.held] == [out.held]  # (once, at the front)
    # A call served in Python takes a noted module into the identity cache (a tuple is
    # given an entry of its own, held by no table).
    hit = _flatten.lookup(m2)
    assert hit is not None and _flatten.by_id[id(m2)] is hit and hit.ref() is m2
    assert _flatten.lookup(s2).ref() is s2 and id(s2) not in _flatten.by_id
    # A returned module that dies takes its memo (and so the leaves it held) with it.
    (m3, s3) = step(m2, s2)
    weight = weakref.ref(m3.weight)
    del m3
    gc.collect()
    assert out.held[0] is None and weight() is None
    assert _memo.latest(s3) is None


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_a_call_finishing_while_the_previous_memo_is_released_leaves_one_memo(native, monkeypatch):
    """Releasing an entry's previous memo may run code (an object's __del__) that finishes
    another call of the entry. The memo left is a complete one of a finished call, which
    reads back exactly its own objects; the other call's tuple is not kept."""
    import gc
    import weakref

    from fastcall import _native

    if native and _native.BUILT is None:
        pytest.skip("not built")
    monkeypatch.setattr(_native, "ACCEL", _native.BUILT if native else None)
    hooks: list[Any] = []

    class Dying(eqx.Module):
        w: jax.Array

        def __del__(self) -> None:
            while hooks:
                hooks.pop()()

    @fastcall.jit
    def step(s):
        return ((Dying(s[0].w * 2), s[1] + 1),)  # (the inner tuple: noted, held strongly)

    (first,) = step((Dying(jnp.ones(2)), jnp.zeros(1)))
    out = entry_out(step)
    inner: list[Any] = []
    hooks.append(lambda: inner.append(out.result([jnp.full(2, 7.0), jnp.full(1, 7.0)])[0]))
    del first  # (the memo still holds it: released when the next call is noted)
    assert not inner
    (second,) = out.result([jnp.full(2, 3.0), jnp.full(1, 3.0)])
    assert len(inner) == 1 and not hooks  # (the inner call finished inside the outer one)
    noted = [x for x in (inner[0], second) if _memo.latest(x) is not None]
    assert len(noted) == 1
    leaves, _, _ = _memo.latest(noted[0])
    assert leaves[0] is noted[0][0].w and leaves[1] is noted[0][1]
    other = second if noted[0] is inner[0] else inner[0]
    kept = weakref.ref(other[1])
    del other, second, inner[:]
    gc.collect()
    assert kept() is None  # (not held by any memo)


class _Held(eqx.Module):
    w: jax.Array


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
def test_none_is_never_read_as_a_returned_module_that_is_dying(native, monkeypatch):
    """Before Python 3.13 a weak reference reads as None from the moment its object dies
    until the callbacks have run: a noted module dying must never be taken for a `None`
    argument in that window (here, code run by another callback of the same death)."""
    import weakref

    from fastcall import _native

    if native and _native.BUILT is None:
        pytest.skip("not built")
    monkeypatch.setattr(_native, "ACCEL", _native.BUILT if native else None)
    step = fastcall.jit(lambda a: _Held(a * 2))
    g = fastcall.jit(lambda model, other: model.w if other is None else model.w + other.w * 100)
    m = _Held(jnp.ones(2))
    for _ in range(3):  # (a structure record reading a _Held at position 1)
        g(m, _Held(jnp.ones(2)))
    out = step(jnp.ones(2))
    results: list[Any] = []
    probe = weakref.ref(out, lambda _: results.append(served(g, m, None)))
    del out
    assert probe() is None and len(results) == 1
    y, route = results[0]
    assert route == "general"  # (a new structure: nothing noted is read for None)
    assert_trees_equal(y, m.w)


def test_clear_caches_releases_every_noted_output():
    """Returned tuples are held by their function's memo until its next call, whether or
    not the function is still among the recently returned; `clear_caches` releases all."""
    import gc
    import weakref

    def make(i: int) -> Any:
        return fastcall.jit(lambda x: ((x + i, x * i),))

    fs = [make(i) for i in range(12)]  # (more than LATEST holds)
    outs = [f(jnp.ones(2)) for f in fs]
    kept = [weakref.ref(out[0][0]) for out in outs]
    infos = [entry_out(f) for f in fs]  # (entries something else still holds: jax's caches may)
    del outs
    gc.collect()
    assert all(r() is not None for r in kept)
    fastcall.clear_caches()
    gc.collect()
    assert all(r() is None for r in kept) and all(info.held[0] is None for info in infos)


def entry_out(f: Any) -> Any:
    """The OutInfo of the one compiled entry of `f`."""
    (entry,) = f._fastcall_state.table.values()
    return entry.out


def test_the_compiled_guard_skips_an_unchanged_dict_by_its_version_and_sees_every_change():
    """`_guard.holds` compiled stamps a dict's version tag when it finds the dict unchanged
    and then skips the walk while the tag is the same; any write moves the tag, so a change
    is still seen, and a dict changed and changed back is walked and found unchanged. The
    same source run as Python, which walks every dict, agrees at each step."""
    import sys

    from fastcall import _guard

    if not _guard.COMPILED:
        pytest.skip("not compiled")
    as_python = source_as_python(_guard)
    a, b, c = jnp.ones(2), jnp.zeros(2), jnp.ones(3)
    inner = {"w": a}
    outer = {"inner": inner, "b": b}
    guard = _guard.make([outer, inner])
    stamp = guard[0].stamp
    assert stamp == [None]

    def both() -> bool:
        held = _guard.holds(guard)
        assert held == as_python.holds(guard)  # (which walks every dict)
        return held

    assert both()
    has_version = sys.version_info < (3, 14)
    assert (type(stamp[0]) is int) == has_version
    first = stamp[0]
    assert both() and stamp[0] == first  # skipped: nothing changed
    outer["b"] = c  # a value replaced
    assert not both() and stamp[0] == first
    outer["b"] = b  # and put back: walked, found as it was, stamped anew
    assert both() and (stamp[0] != first) == has_version
    inner["extra"] = a  # a key added to a nested dict
    assert not both()
    del inner["extra"]
    assert both()
    outer.pop("b")
    outer["b"] = b  # the same items in the same order again
    assert both()
    del outer["b"], outer["inner"]
    outer["b"], outer["inner"] = b, inner  # the same items, another order
    assert not both()

    # An object's attribute dict (an eqx.nn.State's, an nnx.State's are guarded): on 3.13 it
    # shares its values with the object, and setting an attribute writes there without a new
    # version tag; the check must see it all the same.
    class Box:
        pass

    box = Box()
    box.a, box.b = a, b
    guard = _guard.make([_guard.Attributes(box)])
    assert guard[0].container is vars(box) and guard[0].owner() is box
    assert both() and both()
    box.a = c
    assert not both()
    box.a = a
    assert both() and both()
    box.extra = c
    assert not both()
    del box.extra
    assert both()
    # A new attribute dict (`obj.__dict__ = {...}`) leaves the watched one as it was: the
    # guard sees that it is no longer the object's.
    watched = vars(box)
    box.__dict__ = {"a": c, "b": b}
    assert not both()
    box.__dict__ = watched
    assert both()
    del box.b
    assert not both()
    del box
    assert not both()  # (its owner is gone)

"""Per-object flatten/partition cache.

Under `eqx.filter_jit` semantics every argument splits into *dynamic* leaves
(JAX and NumPy arrays, traced) and a *static* remainder (the tree structure
plus every other leaf, part of the compile key). This module computes that
split once per structure and once per object:

* `Spec`: the static remainder of one argument, interned to a small integer
  (`Spec.id`). Two arguments with equal specs run the same compiled program.
  Interning means the hot path hashes a tuple of small ints instead of a
  treedef and its static leaves.
* the identity cache (`lookup` / `remember`): `id(obj) -> (weakref, leaves,
  spec id)` for immutable structures (Equinox modules, tuples of them). The
  entry is checked with `weakref() is obj`, so a reused `id` never matches,
  and it is evicted by the weakref's callback when the object dies.
* `Template`: for a new object of a structure seen before, Python code
  generated for that structure reads the leaves straight from each node's
  `__dict__` and compares static fields by identity, several times faster
  than `jax.tree_util.tree_flatten` on Equinox modules (whose flatten runs
  Python per node). Anything unexpected makes the template decline, and the
  generic path (`flatten_generic`) takes over.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import threading
import weakref
from typing import Any, Callable, Sequence

import equinox as eqx
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import tree_flatten, tree_flatten_with_path, keystr

from ._errors import FastcallError, describe_arg

ArrayImpl = type(jnp.zeros(()))
_NNX_TYPES = (nnx.Pytree, nnx.Variable)
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_array(x: Any) -> bool:
    """The `eqx.filter_jit` rule: JAX and NumPy arrays (and NumPy scalars) are traced."""
    return isinstance(x, ARRAY_TYPES)


# --------------------------------------------------------------------------
# Static keys


def leaf_key(value: Any) -> Any:
    """A hashable key for a static leaf that tells apart what `==` conflates.

    `1 == 1.0 == True` and `0.0 == -0.0` hash equal in Python, but they trace
    to different programs (dtype, sign). Keys carry the type, and floats are
    compared by their exact bit pattern (`float.hex`; all NaNs are equal).
    """
    t = type(value)
    if t is float:
        return (t, value.hex())
    if t is complex:
        return (t, value.real.hex(), value.imag.hex())
    return (t, value)


def static_equal(a: Any, b: Any) -> bool:
    """Exact equality of two static values under `leaf_key`, never raising."""
    if a is b:
        return True
    try:
        return bool(leaf_key(a) == leaf_key(b))
    except Exception:
        return False


# Node types whose instances cannot change after construction. An argument
# whose every node is one of these may be cached by identity; anything holding
# a list, a dict or an unknown pytree node is re-read on every call.
def _node_is_immutable(node_type: type) -> bool:
    if node_type in (tuple, type(None)):
        return True
    if issubclass(node_type, tuple) and hasattr(node_type, "_fields"):
        return True  # namedtuple
    return isinstance(node_type, type) and issubclass(node_type, eqx.Module)


def _treedef_has_nnx(treedef: Any) -> bool:
    node_data = treedef.node_data()
    if node_data is not None and isinstance(node_data[0], type) and issubclass(node_data[0], _NNX_TYPES):
        return True
    return any(_treedef_has_nnx(c) for c in treedef.children())


def _treedef_is_immutable(treedef: Any) -> bool:
    node_data = treedef.node_data()
    if node_data is not None and not _node_is_immutable(node_data[0]):
        return False
    return all(_treedef_is_immutable(c) for c in treedef.children())


class Spec:
    """The static part of one argument: everything but its dynamic leaves.

    kind is "array" (the argument is one array), "tree" (a pytree split into
    dynamic leaves and static leaves) or "static" (a whole argument marked by
    static_argnums/argnames, compared by value).
    """

    __slots__ = (
        "id", "kind", "treedef", "mask", "statics", "n_dyn", "cacheable", "templated", "has_nnx", "__weakref__",
    )

    treedef: Any

    def __init__(self, kind: str, treedef: Any, mask: tuple[bool, ...], statics: tuple[Any, ...]):
        self.id = -1
        self.kind = kind
        self.treedef = treedef
        self.mask = mask
        self.statics = statics
        self.n_dyn = sum(mask)
        self.cacheable = kind == "tree" and _treedef_is_immutable(treedef)
        self.templated = False  # whether learn() has been tried for this structure
        # NNX objects nested inside (pytree ones as nodes, `nnx.Object`s as static leaves)
        self.has_nnx = kind == "tree" and (
            _treedef_has_nnx(treedef) or any(isinstance(s, _NNX_TYPES) for s in statics)
        )

    def rebuild(self, dynamic: Sequence[Any]) -> Any:
        """Put `dynamic` leaves back together with the static ones."""
        if self.kind == "array":
            return dynamic[0]
        if self.kind == "static":
            return self.statics[0]
        dyn = iter(dynamic)
        stat = iter(self.statics)
        leaves = [next(dyn) if m else next(stat) for m in self.mask]
        return self.treedef.unflatten(leaves)


_intern_lock = threading.Lock()
# key -> Spec (or NNX NodeSpec), oldest first; at most MAX_SPECS (then the oldest is
# dropped: an equal structure seen later gets a new id and compiles again).
_spec_ids: dict[Any, Any] = {}
MAX_SPECS = 16384
# id -> Spec, weakly: a spec lives while the intern table, a compiled entry, a template
# or a cached object refers to it.
_spec_by_id: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_next_id = itertools.count(1)

ARRAY_SPEC = Spec("array", None, (True,), ())
ARRAY_SPEC.id = 0
_spec_by_id[0] = ARRAY_SPEC  # (held by this module global)


def spec_by_id(spec_id: int) -> Any:
    return _spec_by_id[spec_id]


def intern(spec: Any, key: Any) -> Any:
    """Return the canonical Spec equal to `spec` (by `key`), giving it an id."""
    found = _spec_ids.get(key)
    if found is not None:
        return found
    with _intern_lock:
        found = _spec_ids.get(key)
        if found is not None:
            return found
        spec.id = next(_next_id)
        _spec_ids[key] = spec
        _spec_by_id[spec.id] = spec
        while len(_spec_ids) > MAX_SPECS:
            _spec_ids.pop(next(iter(_spec_ids)))
        return spec


def _unhashable_error(arg_name: str, value: Any, err: Exception) -> FastcallError:
    """Name the first static leaf of `value` that cannot be hashed or compared."""
    try:
        for path, leaf in tree_flatten_with_path(value)[0]:
            if is_array(leaf):
                continue
            try:
                hash(leaf_key(leaf))
                bool(leaf == leaf)  # __eq__ may raise too (tuples would skip it by identity)
            except Exception as leaf_err:
                return FastcallError(
                    f"fastcall.jit: {describe_arg(arg_name, keystr(path))} is a static "
                    f"(non-array) value of type {type(leaf).__name__} that cannot be used "
                    f"as part of the compile key ({type(leaf_err).__name__}: {leaf_err}). "
                    "Static values must be hashable and comparable: make it hashable, "
                    "wrap it in a JAX array to trace it, or close over it instead."
                )
    except Exception:
        pass
    return FastcallError(
        f"fastcall.jit: {describe_arg(arg_name)} has static data (a static field such "
        f"as `eqx.field(static=True)`, or pytree auxiliary data) that cannot be hashed "
        f"or compared ({type(err).__name__}: {err}). Static values must be hashable: "
        "make the field hashable or turn it into an array."
    )


def flatten_generic(value: Any, arg_name: str) -> tuple[Spec, list[Any]]:
    """Split `value` into its Spec and dynamic leaves with `tree_flatten` (the slow path)."""
    leaves, treedef = tree_flatten(value)
    mask = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
    dynamic = [x for x, m in zip(leaves, mask) if m]
    statics = tuple(x for x, m in zip(leaves, mask) if not m)
    spec = Spec("tree", treedef, mask, statics)
    try:
        key = ("tree", treedef, mask, tuple(leaf_key(s) for s in statics))
        return intern(spec, key), dynamic
    except Exception as err:
        raise _unhashable_error(arg_name, value, err) from None


def static_spec(value: Any, arg_name: str) -> Spec:
    """The Spec of an argument marked static (static_argnums / static_argnames)."""
    if is_array(value):
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is marked static "
            "(static_argnums/static_argnames) but is an array. Arrays cannot be part "
            "of the compile key: drop it from static_argnums/static_argnames (arrays "
            "are traced automatically)."
        )
    try:
        key = ("static", leaf_key(value))
        hash(key)
        return intern(Spec("static", None, (), (value,)), key)
    except FastcallError:
        raise
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is marked static "
            f"(static_argnums/static_argnames) but is not hashable "
            f"({type(err).__name__}: {err}). Pass a hashable value, or drop it from "
            "static_argnums/static_argnames so that its arrays are traced."
        ) from None


# --------------------------------------------------------------------------
# Identity cache: id(obj) -> (weakref, dynamic leaves, spec id)


_first = operator.itemgetter(0)


class _Ref(weakref.ref):
    __slots__ = ("oid",)
    oid: int


# The fourth element maps a wrapped function's state to a "bound" record for
# calls whose first argument is this object and whose other arguments are
# plain arrays: (number of arguments, compiled function with this object's
# leaves already bound, post-processing or None). `unbind` drops them when the
# state's compiled entries are replaced or cleared.
# The fifth element is the Spec itself, which keeps it alive while the object is cached.
by_id: dict[int, tuple[Callable[[], Any], Sequence[Any], int, dict[Any, Any], Any]] = {}


def _evict(ref: _Ref, _by_id: dict = by_id) -> None:
    # Runs when the object dies, before its id can be reused. The `is` check
    # keeps a newer entry under the same id (set by another thread) alive.
    # (`_by_id` is bound early: at interpreter exit module globals are gone.)
    entry = _by_id.get(ref.oid)
    if entry is not None and entry[0] is ref:
        _by_id.pop(ref.oid, None)


def remember(obj: Any, leaves: Sequence[Any], spec: Any) -> None:
    """Cache `obj`'s dynamic leaves by identity (no-op for non-weakrefable objects)."""
    try:
        ref = _Ref(obj, _evict)
    except TypeError:
        return
    ref.oid = id(obj)
    by_id[ref.oid] = (ref, leaves, spec.id, {}, spec)


def remember_strongly(obj: Any, leaves: Sequence[Any], spec: Any) -> Any:
    """Cache a non-weakrefable immutable object (a tuple such as an optax state) by
    identity, holding it alive so that its id cannot be reused while cached. The
    caller must `forget_strong` the returned token soon (fastcall keeps only the
    outputs of the latest call of each compiled entry)."""
    token = functools.partial(_first, (obj,))  # calling it returns obj, like a weakref
    by_id[id(obj)] = (token, leaves, spec.id, {}, spec)
    return id(obj), token


def forget_strong(registered: Any) -> None:
    oid, token = registered
    entry = by_id.get(oid)
    if entry is not None and entry[0] is token:
        by_id.pop(oid, None)


def unbind(state: Any) -> None:
    """Forget every bound record of `state` (its compiled entries were replaced)."""
    for entry in list(by_id.values()):
        entry[3].pop(state, None)


def clear() -> None:
    by_id.clear()
    templates.clear()
    with _intern_lock:
        _spec_ids.clear()


# --------------------------------------------------------------------------
# Templates: generated extractors for a structure seen before


class _NoTemplate(Exception):
    pass


_MAX_TEMPLATE_NODES = 4096


class _CodeGen:
    """Emits straight-line Python that walks one known structure.

    The generated `_inner(obj)` returns the tuple of dynamic leaves, or None as
    soon as anything differs from the structure it was generated for: a node
    of another type, a container of another length, an Equinox module with
    other attributes, a static value that is not the same (by identity, then
    by exact equality), or a leaf that is not a concrete jax array.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.counter = itertools.count()
        self.nodes = 0
        self.arrays: list[str] = []

    def const(self, value: Any) -> str:
        name = f"_c{next(self.counter)}"
        self.consts[name] = value
        return name

    def var(self) -> str:
        return f"_v{next(self.counter)}"

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def bind(self, expr: str) -> str:
        if expr.isidentifier():
            return expr
        v = self.var()
        self.emit(f"{v} = {expr}")
        return v

    def walk(self, expr: str, value: Any) -> None:
        self.nodes += 1
        if self.nodes > _MAX_TEMPLATE_NODES:
            raise _NoTemplate
        t = type(value)
        if t is ArrayImpl:
            v = self.var()
            self.emit(f"{v} = {expr}")
            self.arrays.append(v)
            return
        if value is None:
            self.emit(f"if {expr} is not None: return None")
            return
        if t is tuple or t is list:
            v = self.bind(expr)
            self.emit(f"if type({v}) is not {self.const(t)} or len({v}) != {len(value)}: return None")
            for i, item in enumerate(value):
                self.walk(f"{v}[{i}]", item)
            return
        if t is dict:
            try:
                keys = sorted(value)
            except TypeError:
                raise _NoTemplate from None
            v = self.bind(expr)
            self.emit(f"if type({v}) is not dict or len({v}) != {len(value)}: return None")
            for k in keys:
                self.walk(f"{v}[{self.const(k)}]", value[k])
            return
        if isinstance(value, eqx.Module):
            fields = dataclasses.fields(value)
            d = value.__dict__
            if len(d) != len(fields) or any(f.name not in d for f in fields):
                raise _NoTemplate  # wrapper modules carry extra attributes
            node = self.bind(expr)
            v = self.var()
            self.emit(f"if type({node}) is not {self.const(t)}: return None")
            # object.__getattribute__ skips eqx.Module.__getattribute__ (~1 us each).
            self.emit(f"{v} = _getattr({node}, '__dict__')")
            self.emit(f"if len({v}) != {len(fields)}: return None")
            statics = []
            for f in fields:
                if f.metadata.get("static", False):
                    statics.append((f"{v}[{f.name!r}]", d[f.name]))
                else:
                    self.walk(f"{v}[{f.name!r}]", d[f.name])
            self.statics(statics)
            return
        if issubclass(t, tuple) and hasattr(t, "_fields"):
            v = self.bind(expr)
            self.emit(f"if type({v}) is not {self.const(t)}: return None")
            for i, item in enumerate(value):
                self.walk(f"{v}[{i}]", item)
            return
        # A leaf, unless some other pytree node type: those are not specialised.
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            if isinstance(value, ARRAY_TYPES):
                raise _NoTemplate  # NumPy arrays and tracers: generic path
            self.statics([(expr, value)])
            return
        raise _NoTemplate

    def statics(self, pairs: list[tuple[str, Any]]) -> None:
        """One line checks every static value of a node by identity; only if that
        fails are they compared by exact equality."""
        if not pairs:
            return
        names = [self.bind(expr) for expr, _ in pairs]
        consts = [self.const(value) for _, value in pairs]
        fast = " and ".join(f"{n} is {c}" for n, c in zip(names, consts))
        slow = " and ".join(f"_static_equal({n}, {c})" for n, c in zip(names, consts))
        self.emit(f"if not ({fast}) and not ({slow}): return None")

    def finish(self) -> str:
        if self.arrays:
            check = " or ".join(f"type({a}) is not _ArrayImpl" for a in self.arrays)
            self.emit(f"if {check}: return None")
        self.emit(f"return ({', '.join(self.arrays)}{',' if self.arrays else ''})")
        return "\n".join(self.lines)


class Template:
    """Generated extractor for one structure: `extract(obj) -> leaves tuple | None`.

    Returns the dynamic leaves of `obj` (in `tree_flatten` order) if `obj` has
    exactly the structure and static values of `spec`, else None.
    """

    __slots__ = ("spec", "extract", "source")

    def __init__(self, spec: Spec, example: Any, dynamic: list[Any]):
        gen = _CodeGen()
        gen.walk("obj", example)
        body = gen.finish()
        self.source = (
            "def _extract(obj):\n"
            "    try:\n"
            "        return _inner(obj)\n"
            "    except (KeyError, AttributeError, IndexError, TypeError):\n"
            "        return None\n"
            "def _inner(obj):\n"
            f"{body}\n"
        )
        namespace: dict[str, Any] = dict(gen.consts)
        namespace.update(_ArrayImpl=ArrayImpl, _static_equal=static_equal, _getattr=object.__getattribute__)
        exec(compile(self.source, f"<fastcall template {spec.id}>", "exec"), namespace)
        self.spec = spec
        self.extract: Callable[[Any], tuple[Any, ...] | None] = namespace["_extract"]
        # Prove the template agrees with tree_flatten on the object it came from.
        check = self.extract(example)
        if check is None or len(check) != len(dynamic) or any(a is not b for a, b in zip(check, dynamic)):
            raise _NoTemplate


class _BuilderGen:
    """Emits one Python expression that rebuilds a known output structure from the flat
    list `d` of dynamic outputs (the inverse of a Template, used instead of
    `treedef.unflatten`, whose Equinox unflatten runs Python per node anyway)."""

    def __init__(self) -> None:
        self.consts: dict[str, Any] = {}
        self.counter = itertools.count()
        self.pos = 0
        self.nodes = 0
        self.stmts: list[str] = []  # modules are built by statements, leaves-first

    def const(self, value: Any) -> str:
        name = f"_c{next(self.counter)}"
        self.consts[name] = value
        return name

    def expr(self, value: Any) -> str:
        self.nodes += 1
        if self.nodes > _MAX_TEMPLATE_NODES:
            raise _NoTemplate
        t = type(value)
        if isinstance(value, ARRAY_TYPES):
            e = f"d[{self.pos}]"
            self.pos += 1
            return e
        if value is None:
            return "None"
        if t is tuple:
            items = [self.expr(v) for v in value]
            return "(" + "".join(i + ", " for i in items) + ")"
        if t is list:
            return "[" + ", ".join(self.expr(v) for v in value) + "]"
        if t is dict:
            try:
                keys = sorted(value)
            except TypeError:
                raise _NoTemplate from None
            # jax flattens dicts in sorted key order and rebuilds them that way too.
            return "{" + ", ".join(f"{self.const(k)}: {self.expr(value[k])}" for k in keys) + "}"
        if issubclass(t, tuple) and hasattr(t, "_fields"):
            items = [self.expr(v) for v in value]
            return f"_tnew({self.const(t)}, (" + "".join(i + ", " for i in items) + "))"
        if isinstance(value, eqx.Module):
            fields = dataclasses.fields(value)
            d = value.__dict__
            if len(d) != len(fields) or any(f.name not in d for f in fields):
                raise _NoTemplate
            parts = []
            for f in fields:
                v = d[f.name]
                if f.metadata.get("static", False):
                    parts.append(f"{f.name!r}: {self.const(v)}")
                else:
                    parts.append(f"{f.name!r}: {self.expr(v)}")
            # object.__new__ + setting __dict__: what Equinox's own unflatten does,
            # without a Python call per module.
            v = f"_o{next(self.counter)}"
            self.stmts.append(f"{v} = _new({self.const(t)})")
            self.stmts.append(f"_setattr({v}, '__dict__', {{{', '.join(parts)}}})")
            return v
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            return self.const(value)  # a static output, returned as it was at trace time
        raise _NoTemplate


def make_builder(example: Any) -> Callable[[Sequence[Any]], Any] | None:
    """Generated `build(dynamic_outputs) -> output` for `example`'s structure, or None."""
    gen = _BuilderGen()
    try:
        body = gen.expr(example)
    except (_NoTemplate, RecursionError):
        return None
    namespace: dict[str, Any] = dict(gen.consts)
    namespace.update(_tnew=tuple.__new__, _new=object.__new__, _setattr=object.__setattr__)
    lines = "".join(f"    {stmt}\n" for stmt in gen.stmts)
    try:
        exec(compile(f"def build(d):\n{lines}    return {body}\n", "<fastcall output builder>", "exec"), namespace)
    except Exception:
        return None
    return namespace["build"]


# root type -> templates, most recent first (a few structures per type).
templates: dict[type, list[Template]] = {}
_TEMPLATES_PER_TYPE = 4


def learn(value: Any, spec: Spec, dynamic: list[Any]) -> None:
    """Build a template for `value`'s structure so the next new object of it is fast."""
    if spec.kind != "tree" or not spec.n_dyn:
        return
    try:
        tmpl = Template(spec, value, dynamic)
    except (_NoTemplate, RecursionError):
        return
    except Exception:  # a template is an optimisation; never fail a call over it
        return
    group = templates.setdefault(type(value), [])
    group.insert(0, tmpl)
    del group[_TEMPLATES_PER_TYPE:]

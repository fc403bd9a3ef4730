"""Per-object flatten/partition cache.

Under `eqx.filter_jit` semantics every argument splits into *dynamic* leaves
(JAX and NumPy arrays, traced) and a *static* remainder (the tree structure
plus every other leaf, part of the compile key). This module computes that
split once per structure and once per object:

* `Spec`: the static remainder of one argument, interned to a small integer
  (`Spec.id`). Two arguments with equal specs run the same compiled program.
  Interning means the hot path hashes a tuple of small ints instead of a
  treedef and its static leaves.
* the identity cache (`by_id`, `remember`): `id(obj) -> CacheEntry` for
  immutable structures (Equinox modules, tuples of them). An entry is used
  only if `entry.ref() is obj`, so a reused `id` never matches, and it is
  evicted by the weakref's callback when the object dies. (A top-level list or
  dict is held strongly, by `_hold`'s rule.)
* `lookup` also takes back what the latest calls returned (`_memo`), so that
  `model = step(model, ...)` finds the model next step without an identity cache
  entry being made for each.

For a new object of a structure seen before, `_codegen` generates code that
extracts its leaves faster than `jax.tree_util.tree_flatten`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import equinox as eqx
import jax
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path

from . import _plan, _guard, _memo, _nnx_gate
from ._errors import FastcallError, describe_arg
from ._stats import read_whole

from ._arrays import ARRAY_TYPES, PLAIN_ARRAY_TYPES, ArrayImpl, is_array  # noqa: F401 (the array types, named here too)


# Python scalars: static under `eqx.filter_jit`'s rule (`fastcall.filter_jit`), traced
# (weakly typed) under `jax.jit`/`nnx.jit`'s (`fastcall.jit`), except inside an Equinox
# module, whose own rule (array fields traced, every other field static) always holds.
PY_SCALARS = (bool, int, float, complex)
# What `jax.jit` traces and `eqx.filter_jit` keeps static, outside Equinox modules: Python
# scalars, and `jax.ShapeDtypeStruct`s (abstract arrays: `f.lower`, `f.trace` and
# `f.eval_shape` take them for arrays, as jax.jit's do; a call given one fails in jax.jit,
# as jax.jit's does).
JIT_RULE_LEAVES = (*PY_SCALARS, jax.ShapeDtypeStruct)


def plain_leaf_types(trace_scalars: bool) -> frozenset[type]:
    """The types of argument a call passes to jax.jit as they are, under one rule: the plain
    arrays, and under `fastcall.jit`'s rule (`trace_scalars`) the Python scalars, traced
    (weakly typed) as jax.jit traces them. Exact types: a subclass is resolved as any other
    argument."""
    return (PLAIN_ARRAY_TYPES | frozenset(PY_SCALARS)) if trace_scalars else PLAIN_ARRAY_TYPES


def is_traced_leaf(x: Any, trace_scalars: bool) -> bool:
    """Whether a leaf outside any Equinox module is traced: an array, and under
    `fastcall.jit`'s rule (`trace_scalars`) a Python scalar. (The one statement of the
    rule, for arguments and outputs alike: a leaf inside an Equinox module is asked with
    `trace_scalars=False`.)"""
    return type(x) is ArrayImpl or isinstance(x, ARRAY_TYPES) or (trace_scalars and type(x) in JIT_RULE_LEAVES)


def traced_mask(value: Any, leaves: list[Any]) -> tuple[bool, ...]:
    """`fastcall.jit`'s rule, leaf by leaf (in `tree_flatten` order): arrays, and Python
    scalars that are not inside an Equinox module."""
    mask: list[bool] = []
    for top in jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, eqx.Module)):
        if isinstance(top, eqx.Module):
            mask += [is_traced_leaf(x, False) for x in jax.tree_util.tree_leaves(top)]
        else:
            mask.append(is_traced_leaf(top, True))
    assert len(mask) == len(leaves)
    return tuple(mask)


def dynamic_mask(value: Any, leaves: list[Any], trace_scalars: bool) -> tuple[bool, ...]:
    """Which of `value`'s leaves (`leaves`, in `tree_flatten` order) are dynamic under one
    scalar rule: the arrays, and under `fastcall.jit`'s (`trace_scalars`) the Python
    scalars outside Equinox modules too."""
    if trace_scalars and any(type(x) in JIT_RULE_LEAVES for x in leaves):
        return traced_mask(value, leaves)
    return tuple(isinstance(x, ARRAY_TYPES) for x in leaves)


def reads_alike(value: Any) -> bool:
    """Whether both scalar rules read `value` alike: no Python scalar outside an Equinox
    module in it (a flatten: for once-per-compile decisions; per call, `read_alike`)."""
    leaves = jax.tree_util.tree_leaves(value)
    return not any(type(x) in JIT_RULE_LEAVES for x in leaves) or traced_mask(value, leaves) == tuple(
        isinstance(x, ARRAY_TYPES) for x in leaves
    )


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
    if node_data is not None and isinstance(node_data[0], type) and _nnx_gate.is_node_type(node_data[0]):
        return True
    return any(_treedef_has_nnx(c) for c in treedef.children())


def _treedef_is_immutable(treedef: Any) -> bool:
    node_data = treedef.node_data()
    if node_data is not None and not _node_is_immutable(node_data[0]):
        return False
    return all(_treedef_is_immutable(c) for c in treedef.children())


# eqx.nn.State is not an Equinox module: its children are the values of its `_state`
# dict, which `.set` replaces in place (invalidating the old State). A guard watches both
# its attribute dict and that dict (`_memo.state_containers`).
STATE_TYPE = eqx.nn.State


def guards_as_state(spec: Any) -> bool:
    """Whether objects of `spec` are eqx.nn.States holding no list or dict below their
    `_state` dict: a guard over `_memo.state_containers` alone then covers every change."""
    node_data = spec.treedef.node_data() if spec.kind == "tree" else None
    return (
        node_data is not None
        and node_data[0] is STATE_TYPE
        and all(_treedef_is_immutable(c) for c in spec.treedef.children())
    )


def _treedef_is_guardable(treedef: Any) -> bool:
    """Immutable but for plain lists, dicts and eqx.nn.State, which a guard (`_guard`) can watch."""
    node_data = treedef.node_data()
    if node_data is not None and not (
        _node_is_immutable(node_data[0])
        or node_data[0] is list
        or node_data[0] is dict
        or node_data[0] is STATE_TYPE
    ):
        return False
    return all(_treedef_is_guardable(c) for c in treedef.children())


class Spec:
    """The static part of one argument: everything but its dynamic leaves.

    kind is "array" (the argument is one array), "tree" (a pytree split into
    dynamic leaves and static leaves) or "static" (a whole argument marked by
    static_argnums/argnames, compared by value).
    """

    __slots__ = (
        "id", "kind", "treedef", "mask", "statics", "n_dyn", "cacheable", "guardable", "templated", "has_nnx",
        "rule_free", "__weakref__",
    )

    treedef: Any

    def __init__(
        self, kind: str, treedef: Any, mask: tuple[bool, ...], statics: tuple[Any, ...], rule_free: bool = True
    ):
        self.id = -1
        # True when the split does not depend on the scalar rule (no Python scalar outside
        # an Equinox module): only then may objects of this spec be shared through the
        # identity cache and templates by functions of either rule.
        self.rule_free = rule_free
        self.kind = kind
        self.treedef = treedef
        self.mask = mask
        self.statics = statics
        self.n_dyn = sum(mask)
        # Objects of this structure may be cached by identity (`cacheable`: nothing in
        # them can change in place), or by identity under a guard (`guardable`: lists or
        # dicts inside, checked item by item on every use; see `remember_guarded`).
        self.cacheable = kind == "tree" and _treedef_is_immutable(treedef)
        self.guardable = kind == "tree" and not self.cacheable and _treedef_is_guardable(treedef)
        self.templated = False  # whether learn() is done with this structure
        # NNX objects nested inside (pytree ones as nodes, `nnx.Object`s as static leaves)
        self.has_nnx = kind == "tree" and (
            _treedef_has_nnx(treedef) or any(_nnx_gate.is_node(s) for s in statics)
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


def interned(key: Any) -> Any:
    """The canonical Spec for `key`, or None if there is none yet."""
    return _spec_ids.get(key)


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
        # (findable by id before it is found by key: another thread that finds it by key,
        # without the lock, at once looks its id up)
        _spec_by_id[spec.id] = spec
        _spec_ids[key] = spec
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


def flatten_generic(value: Any, arg_name: str, trace_scalars: bool = False) -> tuple[Spec, list[Any]]:
    """Split `value` into its Spec and dynamic leaves with `tree_flatten` (the slow path).
    `trace_scalars`: `fastcall.jit`'s rule (Python scalars outside Equinox modules are
    traced) instead of `eqx.filter_jit`'s (every non-array leaf is static)."""
    read_whole()
    leaves, treedef = tree_flatten(value)
    mask = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
    rule_free = True
    if any(type(x) in JIT_RULE_LEAVES for x in leaves):
        traced = traced_mask(value, leaves)
        rule_free = traced == mask
        if trace_scalars:
            mask = traced
    dynamic = [x for x, m in zip(leaves, mask) if m]
    statics = tuple(x for x, m in zip(leaves, mask) if not m)
    try:  # (a dict key whose __eq__ raises, an unhashable type: named below)
        by_value = _graphdefs_by_value(treedef, statics)
        key: Any = ("tree", treedef, mask, tuple(leaf_key(s) for s in statics))
        if by_value is not None:  # (GraphDefs that can change in place: keyed by their value now)
            key = (*key, by_value)
        found = _spec_ids.get(key)  # (a structure seen before: no new Spec to build)
        if found is not None:
            return found, dynamic
        spec = Spec("tree", treedef, mask, statics, rule_free)
        if by_value is not None:
            # Read afresh on every call, never by identity nor by a template (which compare
            # a GraphDef by identity): each call's key then holds the value it has now.
            spec.cacheable = spec.guardable = False
            spec.templated = True
        return intern(spec, key), dynamic
    except Exception as err:
        raise _unhashable_error(arg_name, value, err) from None


# treedef -> whether a node of it is an NNX GraphDef (flax registers GraphDef as a node)
_holds_graphdef_nodes: dict[Any, bool] = {}


def _graphdef_nodes(treedef: Any) -> list[Any]:
    found, pending = [], [treedef]
    while pending:
        node = pending.pop()
        data = node.node_data()
        if data is not None and _nnx_gate.is_graphdef(data[1]):
            found.append(data[1])
        pending.extend(node.children())
    return found


def _graphdefs_by_value(treedef: Any, statics: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys by value of the NNX GraphDefs in a pytree (static leaves, or nodes of its
    treedef, as flax registers them) whose statics can change in place (a list attribute,
    which `model.features.append(...)` changes after `nnx.split`): such a pytree is keyed by
    the value they have now, as a GraphDef passed on its own is (`read_graphdef`). None
    where there is none (the common case)."""
    if not _nnx_gate.flax_imported():
        return None
    found = [s for s in statics if _nnx_gate.is_graphdef(s)]
    if _holds_graphdef_nodes.get(treedef, True):  # (walked once per structure: most hold none)
        walked = _graphdef_nodes(treedef)
        if len(_holds_graphdef_nodes) >= 4096:
            _holds_graphdef_nodes.clear()
        _holds_graphdef_nodes[treedef] = bool(walked)
        found += walked
    if not found:
        return None
    adapter = _nnx_gate.adapter()
    keys = tuple(k for k in map(adapter.graphdef_by_value, found) if k is not None)
    return keys or None


# --------------------------------------------------------------------------
# Identity cache


class CacheEntry(NamedTuple):
    """What the identity cache knows about one object."""

    ref: Callable[[], Any]  # a weakref (or, for a container `hold` holds, a strong token)
    leaves: Sequence[Any]  # the object's dynamic leaves
    spec_id: int
    spec: Any  # held: keeps the interned Spec (and so its id) alive while cached
    guard: Any = None  # (lists or dicts inside) valid only while `_guard.holds(guard)`


def lookup(obj: Any, adopt: bool = True) -> CacheEntry | None:
    """The identity cache's entry for `obj` if it is current (the one place that decides).
    An object the latest call of a recent entry returned (`latest`) is taken into the cache
    here (a module by weak reference; a tuple is given an entry held only by the caller),
    unless `adopt` is False (the agreement mode's reading, which changes no cache): then it
    too gets an entry held only by the caller."""
    hit = by_id.get(id(obj))
    if hit is not None and hit.ref() is obj:
        if hit.guard is not None and not _guard.holds(hit.guard):
            return None  # a list or dict inside changed in place: read afresh
        return hit
    found = _memo.latest(obj)
    if found is None:
        return None
    leaves, spec, guard = found
    if type(obj) is tuple or not adopt:
        return CacheEntry(Strong(obj), leaves, spec.id, spec, guard)
    remember(obj, leaves, spec, guard)
    hit = by_id.get(id(obj))
    return hit if hit is not None and hit.ref() is obj else None


class _Ref(weakref.ref):
    __slots__ = ("oid",)
    oid: int


class Strong(tuple):
    """A strong stand-in for a weakref, `(obj, id(obj))`: calling it returns the object it
    holds, `.oid` is that object's id (as a `_Ref`'s). The C paths read item 0 directly
    (`_accel.ref_is`). Compared and hashed by identity, as a weakref to an unhashable
    object would be."""

    __slots__ = ()
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __new__(cls, obj: Any) -> "Strong":
        return tuple.__new__(cls, (obj, id(obj)))

    def __call__(self) -> Any:
        return self[0]

    @property
    def oid(self) -> int:
        return self[1]


by_id: dict[int, CacheEntry] = {}


def _evict(ref: _Ref, _by_id: dict = by_id, _withdraw: Callable = _plan.withdraw) -> None:
    # Runs when the object dies, before its id can be reused. The `is` check
    # keeps a newer entry under the same id (set by another thread) alive.
    # (Globals are bound early: at interpreter exit module globals are gone.)
    entry = _by_id.get(ref.oid)
    if entry is not None and entry.ref is ref:
        _by_id.pop(ref.oid, None)
    _withdraw(ref)


def remember(obj: Any, leaves: Sequence[Any], spec: Any, guard: Any = None) -> None:
    """Cache `obj`'s dynamic leaves by identity (no-op for non-weakrefable objects)."""
    try:
        ref = _Ref(obj, _evict)
    except TypeError:
        return
    ref.oid = id(obj)
    old = by_id.get(ref.oid)
    by_id[ref.oid] = CacheEntry(ref, leaves, spec.id, spec, guard)
    if old is not None:  # (its fast records bind the old leaves)
        _plan.withdraw(old.ref)


def remember_guarded(obj: Any, leaves: Sequence[Any], spec: Any) -> None:
    """`remember` an object of a guardable spec (lists or dicts inside), with a guard over
    every list and dict in it."""
    if not type(obj).__weakrefoffset__:
        return  # (a top-level list or dict: see `hold`)
    guard = guard_of(obj, leaves, spec)
    if guard is not None:
        remember(obj, leaves, spec, guard)


# Objects of guardable structures seen once by the generated extractors: guarding one
# costs a flatten, worth it only for an object that comes back (not for the new model a
# training step returns each call). id -> weakref; bounded (cleared when full).
_seen_once: dict[int, Any] = {}


def seen_before(obj: Any) -> bool:
    """Whether `obj` was passed here before (else it is noted, and False)."""
    ref = _seen_once.get(id(obj))
    if ref is not None and ref() is obj:
        return True
    if len(_seen_once) >= 1024:
        _seen_once.clear()
    try:
        _seen_once[id(obj)] = weakref.ref(obj)
    except TypeError:
        pass
    return False


def guard_of(obj: Any, leaves: Sequence[Any], spec: Any) -> Any:
    """A guard over every list and dict in `obj`, taken in a second flatten; None if that
    flatten did not see the very leaves `leaves` came from (a change in between)."""
    read_whole()
    containers: list[Any] = []

    def collect(x: Any) -> bool:
        if type(x) is list or isinstance(x, dict):
            containers.append(x)
        elif type(x) is STATE_TYPE:
            containers.extend(_memo.state_containers(x))
        return False

    again, treedef = tree_flatten(obj, is_leaf=collect)
    if not all(map(_guard.is_guardable, containers)):
        return None
    if treedef != spec.treedef:
        return None
    dyn = [x for x, m in zip(again, spec.mask) if m]
    if len(dyn) != len(leaves) or any(a is not b for a, b in zip(dyn, leaves)):
        return None
    return _guard.make(containers) or ()


def read_alike(spec: Any, leaves: Sequence[Any]) -> bool:
    """Whether both scalar rules read an object of `spec` with these dynamic `leaves` alike
    (no Python scalar outside an Equinox module in it), as the identity cache, which the
    functions of both share, requires of whatever it holds. Per object, not per spec: under
    fastcall.jit's rule `{"lr": array}` and `{"lr": 0.5}` are one spec (one leaf each, as
    jax.jit reads them: one program), and whichever made the spec set its `rule_free`; a
    Python scalar it traces is among the leaves, one it keeps static makes `rule_free` False."""
    return spec.rule_free and not any(type(x) in JIT_RULE_LEAVES for x in leaves)


def container_paths(item: Any) -> tuple[tuple[tuple[int, Any], ...], ...] | None:
    """The path from `item` (a module or tuple, as returned) to each plain list and dict in
    it that jax's flatten reaches, outermost first; None if one cannot be followed by
    attribute or item access (a node without keys), or is not a plain list or dict (an
    eqx.nn.State, an OrderedDict, ...) below the top."""
    paths: list[tuple[tuple[int, Any], ...]] = []

    def mutable(x: Any) -> bool:
        return isinstance(x, (list, dict)) or type(x) is STATE_TYPE

    def walk(node: Any, prefix: tuple[tuple[int, Any], ...]) -> bool:
        found, _ = tree_flatten_with_path(node, is_leaf=lambda x: x is not node and mutable(x))
        for keys, x in found:
            if not mutable(x):
                continue
            if not _guard.is_guardable(x):
                return False
            steps = []
            for k in keys:
                if type(k) is jax.tree_util.GetAttrKey:
                    steps.append((_memo.ATTR, k.name))
                elif type(k) is jax.tree_util.SequenceKey:
                    steps.append((_memo.ITEM, k.idx))
                elif type(k) is jax.tree_util.DictKey:
                    steps.append((_memo.ITEM, k.key))
                else:
                    return False
            path = prefix + tuple(steps)
            if _memo.follow(item, path) is not x:  # (an attribute that is not read as stored)
                return False
            paths.append(path)
            if not walk(x, path):
                return False
        return True

    return tuple(paths) if walk(item, ()) else None


def forget_strong(token: Strong) -> None:
    entry = by_id.get(token.oid)
    if entry is not None and entry.ref is token:
        by_id.pop(token.oid, None)


def clear() -> None:
    by_id.clear()
    _memo.clear()
    _seen_once.clear()
    _holds_graphdef_nodes.clear()
    with _intern_lock:
        _spec_ids.clear()

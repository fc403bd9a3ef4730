"""The Flax NNX graph adapter: cached graphdef and Variable list, write-back, structure checks.

For an NNX graph node (Module, Pytree, Rngs, Optimizer, Variable) passed to a
wrapped function, fastcall keeps per object (validated by weakref):

* the graphdef, interned to a spec id (static attributes such as
  `deterministic` or `use_running_average` are part of it, so `model.eval()`
  selects another compiled program);
* the list of its Variable objects in flatten order. Their values are read at
  call time through the `_raw_value` slot (no deprecated `.value`, no graph
  walk), so `v[...] = ...`, `nnx.update` and optimizer steps made outside are
  seen by the next call.

Structure changes are seen through a watch list: fastcall wraps
`nnx.Pytree.__setattr__`/`__delattr__` (which nnx.List and nnx.Dict also go
through), `Pytree._graph_node_clear`/`_graph_node_init` (NNX's own in-place
graph updates, e.g. nnx.jit with graph_updates), `Variable.set_metadata` and
`Variable.update_from_state`, and each call to them on a node that
belongs to a cached graph marks that cache entry stale (a dict lookup per
attribute assignment). A stale entry is re-flattened on its next use. What this
cannot see is listed in README.md ("NNX caveats").

Inside the trace, the module is rebuilt from the graphdef with the traced
values; after the function returns, each Variable whose value is no longer the
very tracer it was given is an output, and only those are written back.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import operator
import threading
import weakref
from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable

from ._errors import FastcallError, describe_arg

_raw = raw_value = operator.attrgetter("_raw_value")
RAW_VALUE_SLOT: Any = Variable.__dict__["_raw_value"]  # the slot descriptor (read from C too)
_set_raw: Any = RAW_VALUE_SLOT.__set__  # the slot itself: no checks, no hooks

_Pytree = getattr(nnx, "Pytree", None) or nnx.Module


_is_node_type: dict[type, bool] = {}


def is_node(x: Any) -> bool:
    """Whether x is an NNX graph node (handled by this adapter). Cached per type:
    NNX decides graph-node-ness by type registration."""
    t = type(x)
    known = _is_node_type.get(t)
    if known is None:
        known = _is_node_type[t] = isinstance(x, Variable) or graphlib.is_graph_node(x)
    return known


# --------------------------------------------------------------------------
# Watching for structure changes


_watch_lock = threading.Lock()
# id(graph node or Variable) -> entries whose graph contains it.
_watchers: dict[int, list[NodeEntry]] = {}


def _notify(obj: Any) -> None:
    entries = _watchers.get(id(obj))
    if entries:
        for e in list(entries):  # (the list may change under us in another thread)
            e.stale = True
            _drop_fast(e)


def _drop_fast(entry: NodeEntry) -> None:
    record = fast.get(entry.ref.oid)
    if record is not None and record[0] is entry.ref:
        fast.pop(entry.ref.oid, None)


def _notifying(method: Any) -> Any:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if _watchers:
            _notify(self)
        return result

    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


def _install_hooks() -> None:
    """Wrap the few NNX methods through which a graph's structure changes."""
    if getattr(_Pytree, "_fastcall_hooked", False):
        return
    orig_setattr = _Pytree.__setattr__
    orig_delattr = _Pytree.__delattr__
    orig_set_metadata = Variable.set_metadata

    def __setattr__(self: Any, name: str, value: Any) -> None:
        orig_setattr(self, name, value)
        if _watchers:
            _notify(self)

    def __delattr__(self: Any, name: str) -> None:
        orig_delattr(self, name)
        if _watchers:
            _notify(self)

    def set_metadata(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_set_metadata(self, *args, **kwargs)
        if _watchers:
            _notify(self)

    _Pytree.__setattr__ = __setattr__  # type: ignore[method-assign]
    _Pytree.__delattr__ = __delattr__  # type: ignore[method-assign]
    Variable.set_metadata = set_metadata  # type: ignore[method-assign]

    # NNX's own graph updates (nnx.jit with graph_updates, nnx.merge into existing
    # objects) rebuild nodes in place through these, bypassing __setattr__.
    for cls, name in (
        (_Pytree, "_graph_node_clear"),
        (_Pytree, "_graph_node_init"),
        (Variable, "update_from_state"),
        (Variable, "del_metadata"),
        (Variable, "copy_from"),
    ):
        original = getattr(cls, name, None)
        if original is not None:
            setattr(cls, name, _notifying(original))
    # NNX registers each graph node class's clear/init functions when the class is
    # created; classes created before this (every built-in layer) keep references to the
    # originals in the registry, so wrap those too. Classes created later are covered by
    # the base-class wrappers above (their registrations read the wrapped attributes).
    for node_type, impl in list(graphlib.GRAPH_REGISTRY.items()):
        if isinstance(node_type, type) and issubclass(node_type, _Pytree):
            try:
                graph_impl: Any = impl
                wrapped = dataclasses.replace(graph_impl, clear=_notifying(graph_impl.clear), init=_notifying(graph_impl.init))
                graphlib.GRAPH_REGISTRY[node_type] = wrapped
            except Exception:  # pragma: no cover - registry layout of other flax versions
                pass
    _Pytree._fastcall_hooked = True  # type: ignore[attr-defined,union-attr]


_install_hooks()


# --------------------------------------------------------------------------
# Per-object cache


class NodeEntry:
    """What fastcall knows about one NNX object: its spec id, Variables, fixed leaves."""

    __slots__ = (
        "ref", "spec_id", "spec", "items", "all_vars", "volatile", "direct", "stale", "watched", "fresh",
        "bound", "node_ids", "disjoint", "__weakref__",
    )

    def __init__(self, ref: Any, spec: Any, items: list[Any], watched: list[int]) -> None:
        self.ref = ref
        self.stale = False
        self.volatile = False
        self.direct = False
        self.set_spec(spec, items, False)
        self.fresh = True  # values not yet checked for tracers
        self.bound: dict[Any, Any] = {}  # wrapped-function state -> (arity, compiled entry)
        self.node_ids: frozenset[int] = frozenset(watched)  # every node and Variable
        self.disjoint: dict[int, Any] = {}  # id(other entry) -> (weakref, shares nothing?)
        self.watched = watched

    def set_spec(self, spec: Any, items: list[Any], volatile: bool) -> None:
        self.spec = spec  # held: keeps the interned spec (and its id) alive
        self.spec_id = spec.id if spec is not None else -1
        self.items = items  # Variables, or raw values (array attributes, list items)
        self.all_vars = all(isinstance(x, Variable) for x in items)
        self.volatile = volatile  # holds mutable containers: re-read every call
        self.direct = self.all_vars and not volatile  # eligible for the fast paths

    def values(self) -> list[Any]:
        """Current values of the leaves, read through the `_raw_value` slot."""
        if self.all_vars:
            return list(map(_raw, self.items))
        return [_raw(x) if isinstance(x, Variable) else x for x in self.items]


by_id: dict[int, NodeEntry] = {}
# For the C fast path: id -> (weakref, Variables, bound) of entries that are not stale
# and hold only Variables (an entry leaves this dict the moment it goes stale).
fast: dict[int, tuple[Any, list[Any], dict[Any, Any]]] = {}


def _evict(ref: Any, _by_id: dict = by_id) -> None:
    entry = _by_id.get(ref.oid)
    if entry is not None and entry.ref is ref:
        _by_id.pop(ref.oid, None)
        try:
            _drop_fast(entry)
            _unwatch(entry)
        except Exception:  # at interpreter exit module globals may be gone
            pass


class _Ref(weakref.ref):
    __slots__ = ("oid",)
    oid: int


def _unwatch(entry: NodeEntry) -> None:
    with _watch_lock:
        for oid in entry.watched:
            lst = _watchers.get(oid)
            if lst is not None:
                try:
                    lst.remove(entry)
                except ValueError:
                    pass
                if not lst:
                    del _watchers[oid]


def _is_container(x: Any) -> bool:
    return isinstance(x, (list, dict, collections.abc.MutableMapping)) and not is_node(x)


def _graph_nodes(node: Any) -> tuple[list[Any], bool]:
    """Every graph node and Variable reachable from `node` (each once), and whether the
    graph is volatile: a plain list or dict (`nnx.data([...])`) holding arrays, values or
    modules directly, which can change in place without any hook. Containers that hold
    only Variables (an nnx.Optimizer's optax state) are not volatile: their Variables'
    values are read every call."""
    seen: dict[int, Any] = {}
    by_path: dict[tuple[Any, ...], Any] = {}
    for path, sub in graphlib.iter_graph(node):
        by_path[tuple(path)] = sub
        if is_node(sub):
            seen[id(sub)] = sub
    volatile = False
    parents = set()
    for path, sub in by_path.items():
        if path and _is_container(by_path.get(path[:-1])):
            parents.add(path[:-1])
            if not (isinstance(sub, Variable) or _is_container(sub)):
                volatile = True  # arrays, None (a cache slot to fill), modules, values
                break
    if not volatile:  # an empty list or dict is waiting to be filled in place
        volatile = any(_is_container(sub) and path not in parents for path, sub in by_path.items())
    return list(seen.values()), volatile


def lookup(obj: Any, arg_name: str) -> NodeEntry:
    """The current entry for `obj`, built or rebuilt if missing or stale."""
    entry = by_id.get(id(obj))
    if entry is not None and entry.ref() is obj and not entry.stale:
        if not entry.volatile:
            return entry
        # Mutable containers (lists, dicts) in the graph change without any hook:
        # re-read the graph; reuse the entry if its structure is unchanged.
        graphdef, flat = _flatten_node(obj, arg_name)
        if graphdef == entry.spec.graphdef:
            entry.items = list(flat.leaves)
            return entry
    return _build(obj, arg_name, entry)


def _flatten_node(obj: Any, arg_name: str) -> tuple[Any, Any]:
    try:
        return graphlib.flatten(obj, with_paths=True)
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is an NNX object that could not be "
            f"flattened ({type(err).__name__}: {err})."
        ) from err


def _build(obj: Any, arg_name: str, old: NodeEntry | None) -> NodeEntry:
    from . import _flatten

    if old is not None:
        _drop_fast(old)
        _unwatch(old)
    # Watch first, then flatten: a change made while flattening marks the new entry
    # stale (re-read next call) instead of being lost.
    ref = _Ref(obj, _evict)
    ref.oid = id(obj)
    entry = NodeEntry(ref, None, [], [])
    watched_nodes, volatile = _graph_nodes(obj)
    entry.watched = [id(n) for n in watched_nodes]
    entry.node_ids = frozenset(entry.watched)
    with _watch_lock:
        for n in watched_nodes:
            _watchers.setdefault(id(n), []).append(entry)
    try:
        graphdef, flat = _flatten_node(obj, arg_name)
        try:
            spec = _flatten.intern(NodeSpec(graphdef, len(flat.leaves)), ("nnx", graphdef))
        except Exception as err:
            raise FastcallError(
                f"fastcall.jit: {describe_arg(arg_name)} has a static attribute that cannot be "
                f"hashed or compared ({type(err).__name__}: {err}). NNX static attributes "
                "become part of the compile key: make them hashable, or store them in a "
                "Variable."
            ) from None
    except BaseException:
        _unwatch(entry)
        raise
    entry.set_spec(spec, list(flat.leaves), volatile or not all(isinstance(x, Variable) for x in flat.leaves))
    if {id(n) for n in _graph_nodes(obj)[0]} != set(entry.watched):
        entry.stale = True  # the graph changed while we were building: rebuild next call
    previous = by_id.get(ref.oid)
    if previous is not None and previous is not old and previous is not entry:
        _drop_fast(previous)  # another thread built one concurrently: keep one only
        _unwatch(previous)
    by_id[ref.oid] = entry
    if entry.direct:
        fast[ref.oid] = (ref, entry.items, entry.bound)
    if entry.stale:  # changed while we were flattening
        _drop_fast(entry)
    return entry


def unbind(state: Any) -> None:
    """Forget the compiled entries of `state` remembered on NNX objects."""
    for entry in list(by_id.values()):
        entry.bound.pop(state, None)


def clear() -> None:
    for entry in list(by_id.values()):
        _unwatch(entry)
    by_id.clear()
    fast.clear()


# --------------------------------------------------------------------------
# Inside the trace


class NodeSpec:
    """Spec of an NNX argument (duck-types `_flatten.Spec` for the parts the compiled
    function uses): its graphdef; its leaves are all dynamic."""

    __slots__ = ("id", "kind", "graphdef", "n_dyn", "cacheable", "templated", "mask", "joint", "__weakref__")

    def __init__(self, graphdef: Any, n: int, joint: bool = False) -> None:
        self.id = -1
        self.joint = joint  # flattened together with the call's earlier NNX arguments
        self.kind = "nnx"
        self.graphdef = graphdef
        self.n_dyn = n
        self.mask = (True,) * n
        self.cacheable = False
        self.templated = True

    def rebuild(self, dynamic: Any) -> Any:
        """A fresh module with the traced values (its Variables are new objects)."""
        return graphlib.unflatten(self.graphdef, list(dynamic))


_ARG_STRIDE = 1 << 32  # outer indices of NNX argument k are k * _ARG_STRIDE + index


class Traced:
    """One NNX argument inside the trace: the rebuilt node and its leaves before the call.

    Arguments flattened jointly (they share objects) are rebuilt with one shared index
    map, so shared Variables and submodules are one object inside the trace too."""

    __slots__ = ("node", "spec", "inner", "given", "index_ref")

    def __init__(self, node_spec: Any, given: Any, shared_index: Any = None) -> None:
        self.spec = node_spec
        self.given = list(given)
        # graphdef index -> object rebuilt here
        self.index_ref = shared_index if shared_index is not None else graphlib.IndexMap()
        self.node = graphlib.unflatten(node_spec.graphdef, list(given), index_ref=self.index_ref)
        self.inner: list[Any] = []

    @staticmethod
    def _flatten_all(traced: list[Traced]) -> list[tuple[Any, list[Any]]]:
        """(graphdef, leaves) per argument, joint ones sharing one RefMap (as given)."""
        shared = graphlib.RefMap()
        out = []
        for t in traced:
            ref_index = shared if t.spec.joint else None
            graphdef, flat = graphlib.flatten(t.node, with_paths=True, ref_index=ref_index)
            out.append((graphdef, list(flat.leaves)))
        return out

    @staticmethod
    def snapshot(traced: list[Traced]) -> None:
        for t, (_, leaves) in zip(traced, Traced._flatten_all(traced)):
            t.inner = leaves

    @staticmethod
    def structure_changed(traced: list[Traced]) -> list[bool]:
        changed = []
        for t, (graphdef, after) in zip(traced, Traced._flatten_all(traced)):
            changed.append(
                graphdef != t.spec.graphdef
                or len(after) != len(t.inner)
                or any(a is not b for a, b in zip(after, t.inner))
            )
        return changed

    def writes(self, everything: bool) -> list[tuple[int, Any]]:
        """(leaf index, new value) for every Variable the function changed (or, for a
        donated argument, every Variable: its old buffers are gone after the call)."""
        out = []
        for i, (v, given) in enumerate(zip(self.inner, self.given)):
            if isinstance(v, Variable):
                new = v.get_raw_value()
                # A non-array value (a dict of arrays, ...) may have changed in place:
                # always written back.
                if everything or new is not given or not isinstance(new, jax.Array):
                    out.append((i, new))
        return out


def joint_structure_error(arg_name: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: the function changed the structure of {describe_arg(arg_name)}, which "
        "shares objects with another NNX argument. fastcall propagates structural changes only "
        "for NNX arguments that share nothing: make the change outside the compiled function, "
        "or pass only the object that holds the others (e.g. the optimizer that holds the model)."
    )


# --------------------------------------------------------------------------
# NNX arguments that share objects (a model and an optimizer that holds it)


def overlapping(entries: list[Any]) -> bool:
    """Whether any two of these NNX cache entries share a node or Variable (cached)."""
    for i, a in enumerate(entries):
        if a is None:
            return True  # (already flattened jointly)
        for b in entries[i + 1 :]:
            if b is None:
                return True
            known = a.disjoint.get(id(b))
            if known is None or known[0]() is not b:
                known = (weakref.ref(b), a.node_ids.isdisjoint(b.node_ids))
                a.disjoint[id(b)] = known
            if not known[1]:
                return True
    return False


def joint_flatten(obj: Any, shared: Any, arg_name: str) -> tuple[Any, list[Any], list[Any]]:
    """Flatten `obj` continuing the shared RefMap of the call's earlier NNX arguments:
    objects already seen become references, so each shared Variable is passed once."""
    from . import _flatten

    try:
        graphdef, flat = graphlib.flatten(obj, with_paths=True, ref_index=shared)
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is an NNX object that could not be "
            f"flattened ({type(err).__name__}: {err})."
        ) from err
    items = list(flat.leaves)
    spec = _flatten.intern(NodeSpec(graphdef, len(items), joint=True), ("nnx-joint", graphdef))
    values = [_raw(x) if isinstance(x, Variable) else x for x in items]
    return spec, items, values


def structure_error(arg_name: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: the function changed the structure of {describe_arg(arg_name)} (added, "
        "removed or replaced a submodule or Variable, or changed a static attribute) while "
        "traced, and graph_updates=False. Pass graph_updates=True (the default) to propagate "
        "such changes, or make them outside the compiled function."
    )


def outer_index_map(traced: list[Any]) -> Any:
    """inner object -> unique outer index, over every NNX argument of the call (trace time)."""
    refmap = graphlib.RefMap()
    for ordinal, (t, _) in enumerate(traced):
        for index, obj in t.index_ref.items():
            refmap[obj] = ordinal * _ARG_STRIDE + index
    return refmap


def split_updated(node: Any, refmap: Any) -> tuple[Any, list[Any]]:
    """The new graphdef (existing objects tagged with their outer index) and leaf values."""
    graphdef, leaves = graphlib.flatten(node, with_paths=False, ref_outer_index=refmap)
    return graphdef, list(leaves)


def apply_structure(graphdef: Any, values: list[Any], outer_objects: list[Any]) -> None:
    """Update the caller's objects in place to the structure and values made inside
    (existing nodes and Variables are reused by identity, new ones created), as nnx.jit
    does with graph updates."""
    outer = graphlib.IndexMap()
    for ordinal, obj in enumerate(outer_objects):
        refmap = graphlib.RefMap()
        graphlib.flatten(obj, with_paths=False, ref_index=refmap)
        for o, index in refmap.items():
            outer[ordinal * _ARG_STRIDE + index] = o
    graphlib.unflatten(graphdef, values, outer_index_outer_ref=outer)


def leaf_shardings(spec: Any, prefix: Any) -> list[Any]:
    """One sharding per leaf of an NNX argument, from an `nnx.StateSharding` (checked
    against each Variable's path and type, as nnx.jit does) or from an `nnx.prefix`
    result (one entry per leaf, in flatten order)."""
    n = spec.n_dyn
    if hasattr(prefix, "map_prefix") and hasattr(prefix, "filters"):
        placeholder = graphlib.unflatten(spec.graphdef, [None] * n)
        flat = graphlib.flatten(placeholder, with_paths=True)[1]
        return [prefix.map_prefix(path, leaf) for path, leaf in zip(flat.paths, flat.leaves)]
    import jax

    leaves = jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: x is None)
    if len(leaves) != n:
        raise FastcallError(
            f"fastcall.jit: in_shardings for an NNX argument has {len(leaves)} entries but the "
            f"object has {n} leaves. Pass one jax Sharding, an nnx.StateSharding, or "
            "nnx.prefix(obj, ...) computed for this very object."
        )
    return leaves


def object_at(root: Any, index: int) -> Any:
    """The object at graph index `index` of `root` (the caller's own submodule/Variable)."""
    refmap = graphlib.RefMap()
    graphlib.flatten(root, with_paths=False, ref_index=refmap)
    for obj, i in refmap.items():
        if i == index:
            return obj
    raise FastcallError(f"fastcall.jit: could not find object {index} of the returned NNX graph.")


def constrain(node: Any, sharding: Any) -> None:
    """Constrain the values of `node`'s Variables (inside a trace) to `sharding`: one jax
    Sharding for all, or an nnx.StateSharding mapping each Variable by path and type."""
    import jax

    flat = graphlib.flatten(node, with_paths=True)[1]
    for path, leaf in zip(flat.paths, flat.leaves):
        if not isinstance(leaf, Variable):
            continue
        target = sharding.map_prefix(path, leaf) if hasattr(sharding, "map_prefix") else sharding
        if target is not None:
            leaf.set_raw_value(jax.lax.with_sharding_constraint(leaf.get_raw_value(), target))


def write_back(items: list[Any], index: int, value: Any) -> None:
    _set_raw(items[index], value)

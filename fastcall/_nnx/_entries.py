"""The per-object cache: what fastcall knows about each NNX object passed to it, and
whether that knowledge is current.

For an NNX graph node (Module, Pytree, Rngs, Optimizer, Variable) passed to a wrapped
function, fastcall keeps per object (validated by weakref), in a `NodeEntry`:

* the graphdef, interned to a spec id (static attributes such as
  `deterministic` or `use_running_average` are part of it, so `model.eval()`
  selects another compiled program);
* the list of its Variable objects in flatten order. Their values are read at
  call time through the `_raw_value` slot (no deprecated `.value`, no graph
  walk), so `v[...] = ...`, `nnx.update` and optimizer steps made outside are
  seen by the next call.

An entry is read by one graph flatten (`_build`, `_read_graph`) and watched from then on
(`_watch`): a structure change marks it stale, and a stale entry is re-read on its next
use (`lookup`, the one place that decides whether an entry is usable). Plain lists and
dicts in the graph are checked by a guard, made when the object is seen a second time (an
object seen once is read with one flatten). Static scalars flipped (`model.train()`)
switch between variants of an entry; a graph NNX rebuilt in place is checked against the
last read (`_as_read`). An entry that can serve is published to the fast path (`_serve`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax.nnx import graphlib

from .. import _plan, _guard, _nnx_gate
from .._errors import FastcallError, describe_arg
from .._flatten import leaf_key as _leaf_key
from .._stats import read_whole
from . import _watch
from ._layout import _Layout, _layout, _nodes_as_read
from ._specs import NodeSpec, _freeze, _graphdefs, _intern_graphdef, _static_containers, _variable_specs
from ._variables import (
    _HIJAX_TYPE,
    RawItem,
    RawLeaf,
    _is_variable,
    _leaf_items,
    _var_metadata,
    read_leaf,
)
from ._watch import TRUSTED, _generation, _rebuild_lock, _unwatch, _watch_containers, _watch_lock


class _Ref(weakref.ref):
    __slots__ = ("oid",)
    oid: int


class NodeEntry:
    """What fastcall knows about one NNX object: its spec, its Variables, and whether
    that knowledge is current."""

    __slots__ = ("ref", "spec_id", "spec", "items", "paths", "volatile", "guard", "direct", "stale", "fresh",
                 "provisional", "fast", "node_ids", "disjoint", "watched", "flips", "variants", "flipped", "spec_key",
                 "version", "enumerated", "rebuilt", "layout", "__weakref__")

    def __init__(self, ref: _Ref) -> None:
        self.ref = ref
        self.stale = False  # a hook saw a structure change: re-read on next use
        # bumped by every change made to the entry in place (a flip, a variant switched to,
        # a Variable replaced): a structure record made from a read of it is made only if
        # it is the same after the call (see `joint_read`)
        self.version = 0
        self.provisional = False  # read once, unguarded and unwatched: stale too (see _build)
        self.spec: Any = None
        self.spec_id = -1
        self.items: list[Any] = []  # the leaves: Variables and handles of raw leaves (see `_leaf_items`)
        self.paths: list[Any] | None = []  # and their paths in the graph (None: not read)
        self.volatile = False  # re-read on every call (see _build)
        self.guard: Any = None  # plain lists and dicts in the graph, checked on every use
        self.direct = False  # eligible for the fast path: not volatile
        self.fresh = True  # values not yet checked for tracers
        self.fast: dict[Any, _plan.CallPlan] = {}  # published in the fast index while direct
        self.watched: list[int] = []  # ids of every node and Variable of the graph
        self.node_ids: frozenset[int] = frozenset()
        self.disjoint: dict[int, Any] = {}  # id(other entry) -> (weakref, shares nothing?)
        # Static scalar attributes replaced since the graph was read (`_flipped`): their
        # (node, name), in the order first seen. Each structure the graph had as they
        # changed (same Variables and nodes, other static values) is kept as a variant,
        # keyed by their values (`flip_key`): `model.train()`/`model.eval()` switch between
        # variants, no graph walk.
        self.flips: dict[tuple[int, str], tuple[Any, str]] = {}  # -> (weakref to node, name)
        self.variants: dict[tuple[Any, ...], tuple[Any, dict[Any, _plan.CallPlan]]] = {}
        self.flipped = False  # a flip since `spec` was current: look up the variant
        self.spec_key: tuple[Any, ...] = ()  # the flipped attributes' values `spec` is for
        # `items` are what NNX's graph flatten of the object indexes, in index order and
        # nothing else (an nnx.State of Variables only): a call's outputs are linked to them
        # without a flatten (`_Link`)
        self.enumerated = False
        # NNX rebuilt a node of the graph in place (`_rebuilt`): True, or a check of it under
        # way (`_rebuilt_as_read`); not usable until that check says the graph is as read
        self.rebuilt: Any = False
        self.layout: _Layout | None = None  # every node as read, for that check (None: not kept)

    def values(self) -> list[Any]:
        """Current values of the leaves (see `read_leaf`)."""
        return list(map(read_leaf, self.items))

    def flip_key(self) -> tuple[Any, ...]:
        """The current values of the flipped attributes (each with its type)."""
        key = []
        for node_ref, name in self.flips.values():
            node = node_ref()  # (a node that died left the graph: a hooked change, stale)
            key.append(_leaf_key(node.__dict__.get(name)) if node is not None else _GONE)
        return tuple(key)

    def flip(self, node: Any, name: str, old: Any) -> None:
        """A static scalar attribute of `node` went from `old` to another value."""
        with _variant_lock:
            self.version += 1
            if self.volatile or self.stale or len(self.flips) >= _MAX_FLIPS:
                self.stale = True
                _plan.withdraw(self.ref)
                return
            if (id(node), name) not in self.flips:
                # Until now it had its old value in every variant kept, and in the spec.
                # (Weakly: the entry must not keep its own object alive.)
                self.flips[(id(node), name)] = (weakref.ref(node), name)
                old_key = _leaf_key(old)
                self.variants = {k + (old_key,): v for k, v in self.variants.items()}
                self.spec_key += (old_key,)
            if not self.flipped:
                before = list(self.flip_key())
                before[list(self.flips).index((id(node), name))] = _leaf_key(old)
                # Kept as a variant only if the spec is the one for the values before this
                # change (another thread may have switched to the new values already).
                if self.spec_key == tuple(before):
                    self.variants[self.spec_key] = (self.spec, self.fast)
                self.flipped = True
                _plan.withdraw(self.ref)


_GONE = object()  # (in a flip key: the node is gone)
# Guards each entry's flips, variants and the switches between them (a flip reported by
# one thread while another switches variants or files a fast record).
_variant_lock = threading.RLock()

# A graph flipping more static attributes than this is re-read instead (keys stay short);
# at most this many variants are kept per graph, the oldest dropped first.
_MAX_FLIPS = 256
_MAX_VARIANTS = 16


by_id: dict[int, NodeEntry] = {}


def _evict(ref: _Ref, _by_id: dict = by_id) -> None:
    entry = _by_id.get(ref.oid)
    if entry is not None and entry.ref is ref:
        _by_id.pop(ref.oid, None)
        try:
            _plan.withdraw(ref)
            _unwatch(entry)
        except Exception:  # at interpreter exit module globals may be gone
            pass


def cached(obj: Any) -> NodeEntry | None:
    """`obj`'s entry if it can be used as it is (nothing to re-read or switch), else None:
    what `lookup` returns first (the structure path reads NNX arguments through this)."""
    entry = by_id.get(id(obj))
    if (
        entry is not None
        and entry.ref() is obj
        and not entry.stale
        and not entry.rebuilt
        and not entry.flipped
        and not entry.volatile
        and (entry.guard is None or _guard.holds(entry.guard))
    ):
        return entry
    return None


def lookup(obj: Any, arg_name: str) -> tuple[NodeEntry, Any]:
    """The current entry for `obj`: the cached one if its structure is known to be
    unchanged, else re-read. The one place that decides whether an entry is usable. With
    it, the RefMap of the flatten that re-read it (None: not re-read here), which indexes
    the object's nodes and Variables as the call reads them (`_Link` reuses it)."""
    found = cached(obj)
    if found is not None:
        return found, None
    entry = by_id.get(id(obj))
    if entry is not None and entry.ref() is obj and not entry.stale:
        if entry.rebuilt and (not _rebuilt_as_read(entry) or entry.stale):  # (stale: changed meanwhile)
            return _build(obj, arg_name, entry)
        if entry.flipped:
            entry = _switch_variant(obj, arg_name, entry)
            if entry.stale:
                return _build(obj, arg_name, entry)
        if not entry.volatile:
            if entry.guard is None or _guard.holds(entry.guard):
                return entry, None
            return _build(obj, arg_name, entry)  # a list or dict in the graph changed in place
        # Mutable containers in the graph (or unverified hooks): re-read the graph;
        # reuse the entry if its structure is unchanged.
        refmap = graphlib.RefMap()
        graphdef, flat = _flatten_node(obj, arg_name, ref_index=refmap)
        if graphdef == entry.spec.graphdef:
            entry.items = _leaf_items(obj, flat)[0]
            entry.paths = list(flat.paths)
            return entry, refmap
    return _build(obj, arg_name, entry)


def _switch_variant(obj: Any, arg_name: str, entry: NodeEntry) -> NodeEntry:
    """After static attributes flipped: the variant for their current values, or (a
    configuration not seen yet) the graph read again, keeping the variants seen so far
    if the Variables and nodes are the very same ones."""
    with _variant_lock:  # (flips, variants and the switch itself: see `NodeEntry.flip`)
        key = entry.flip_key()
        found = entry.variants.get(key)
        if found is not None:
            entry.version += 1
            entry.spec, entry.fast = found
            entry.spec_id = entry.spec.id
            entry.spec_key = key
            # (still flipped if a value changed meanwhile; the next use switches again)
            entry.flipped = entry.flip_key() != key
            _serve(entry)
            return entry
        # Kept only if nothing but flips changed since the variants were read: no plain
        # list or dict in the graph changed in place (the guard holds; such a change has
        # no hook).
        unchanged = entry.guard is None or _guard.holds(entry.guard)
    new = _build(obj, arg_name, entry)[0]
    with _variant_lock:
        if (
            unchanged
            and not new.stale
            and not new.volatile
            and not new.flips  # (a flip reported to the new entry since its read: it keeps its own)
            and not new.flipped
            and entry.flip_key() == key  # (no flip since the key was read)
            and new.paths == entry.paths
            and new.watched == entry.watched
            and len(new.items) == len(entry.items)
            and all(a is b or (type(a) is RawLeaf and a == b) for a, b in zip(new.items, entry.items))
        ):
            new.flips, new.variants, new.spec_key = entry.flips, entry.variants, key
            new.variants[key] = (new.spec, new.fast)
            while len(new.variants) > _MAX_VARIANTS:  # (a static changed to ever new values)
                new.variants.pop(next(iter(new.variants)))
            # One list of leaves for every variant's fast records: a Variable replaced in
            # place later (`_replace_variable`) is then replaced for all of them.
            new.items = entry.items
    return new


# --------------------------------------------------------------------------
# A graph NNX rebuilt in place: checked against the last read (`_layout`), not read again


def _as_read(entry: NodeEntry, layout: _Layout) -> bool:
    """Whether `entry`'s graph is the one its last read recorded (`layout`): every node
    holds the same class and attribute names; the very same object for each attribute
    (Variables, nodes, static values); a data array replaced by an array; an equal static
    scalar of the same type (as `_hooks` judges an assignment). A static scalar that
    has flipped since the read (`model.train()`: `entry.flips`) may differ from the record:
    its value is the one the entry's spec is for (`spec_key`), unless a flip is pending
    (`flipped`: the variant is switched to after this check). With its nodes the same, the
    graph reachable from the object is the one read. (A call that replaced a Variable in
    place dropped the record: `_replace_variable`.)"""
    try:
        if not _nodes_as_read(layout, entry.flips):
            return False
    except Exception:  # (an attribute missing, or one whose comparison raises: a change)
        return False
    if not entry.flips:
        return True
    with _variant_lock:
        return entry.flipped or entry.flip_key() == entry.spec_key


def _rebuilt_as_read(entry: NodeEntry) -> bool:
    """After NNX rebuilt nodes of `entry`'s graph in place (`_rebuilt`): whether the graph
    is as `entry` read it (`_as_read`); if so the entry is usable again, and serves from
    the fast path again. A rebuild or change reported while this runs makes it fail (the
    mark it clears must still be its own)."""
    layout = entry.layout
    if layout is None:
        return False
    checking = _Checking()
    with _rebuild_lock:
        if entry.rebuilt is not True:
            return False  # (another thread is checking it: this one reads the graph)
        entry.rebuilt = checking
    same = _as_read(entry, layout)
    with _rebuild_lock:
        if not same or entry.rebuilt is not checking:
            return False
        entry.rebuilt = False
    _serve(entry)
    return True


def slot_after_rebuild(obj: Any) -> _plan.FastSlot | None:
    """The fast path's slot of an NNX object whose graph NNX rebuilt in place since its
    last call (nnx.jit on a shared model), if the check finds it as read and it serves
    from the fast path again; None otherwise (and for any other object)."""
    entry = _rebuilt_entry(obj)
    return _plan.INDEX.get(id(obj)) if entry is not None and _rebuilt_as_read(entry) else None


def slot_as_checked(obj: Any) -> _plan.FastSlot | None:
    """What `slot_after_rebuild` would serve `obj` from, changing nothing (for `explain`)."""
    entry = _rebuilt_entry(obj)
    if entry is None or not entry.direct or entry.flipped or entry.layout is None:
        return None
    if not _as_read(entry, entry.layout):
        return None
    return _plan.FastSlot(entry.ref, entry.fast, entry.guard, entry)


def _rebuilt_entry(obj: Any) -> NodeEntry | None:
    """`obj`'s entry if NNX rebuilt its graph since its last call, and nothing else made it
    unusable."""
    entry = by_id.get(id(obj))
    if entry is None or entry.rebuilt is not True or entry.stale or entry.ref() is not obj:
        return None
    return entry


class _Checking:
    """The mark of a check under way (truthy: the entry is not usable meanwhile)."""

    __slots__ = ()


def install_record(entry: NodeEntry, state: Any, spec_id: int, record: _plan.CallPlan) -> None:
    """File a fast record made by a call that read `entry` with spec `spec_id`, if that is
    still the entry's current spec (another thread may have switched its variant since)."""
    with _variant_lock:
        if (
            entry.spec_id == spec_id and not entry.flipped and not entry.stale and not entry.rebuilt
            and state not in entry.fast
        ):
            entry.fast[state] = record


def forget_function(state: Any) -> None:
    """Drop a wrapped function's fast records from every entry and variant (its compiled
    entries were replaced): those not published in the fast index too."""
    with _variant_lock:
        for entry in list(by_id.values()):
            entry.fast.pop(state, None)
            for _, fast in entry.variants.values():
                fast.pop(state, None)


def _flatten_node(obj: Any, arg_name: str, **kwargs: Any) -> tuple[Any, Any]:
    """NNX's graph walk of `obj` (every read of an NNX object's graph goes through here)."""
    read_whole()
    try:
        graphdef, flat = graphlib.flatten(obj, with_paths=True, **kwargs)
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is an NNX object that could not be "
            f"flattened ({type(err).__name__}: {err})."
        ) from err
    if _HIJAX_TYPE is not None and _HIJAX_TYPE in set(map(type, flat.leaves)):  # (a C-speed scan)
        path = next(p for p, leaf in zip(flat.paths, flat.leaves) if type(leaf) is _HIJAX_TYPE)
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} holds a hijax Variable (at "
            f"{'.'.join(map(str, path)) or 'itself'}), made under nnx.var_defaults(hijax=True); "
            "fastcall does not support hijax Variables. Create the model with hijax=False, or "
            "call it under jax.jit."
        )
    return graphdef, flat


def _build(obj: Any, arg_name: str, old: NodeEntry | None) -> tuple[NodeEntry, Any]:
    """A new entry for `obj` (replacing `old`), read by NNX's graph flatten, and that
    flatten's RefMap."""
    entry = _new_entry(obj, old)
    first_sight = old is None or old.ref() is not obj
    plain = _plain_state_read(obj) if type(obj) is nnx.State and first_sight else None
    refmap = _read_graph(obj, arg_name, old, entry)
    if type(obj) is nnx.State:
        entry.enumerated = _indexed_in_order(refmap, entry.items)
    if plain is not None and plain.spec is None:
        _remember_plain_state(plain, entry, refmap)
    _file(entry, old)
    return entry, refmap


def _new_entry(obj: Any, old: NodeEntry | None) -> NodeEntry:
    if old is not None:
        # (stale before it is unwatched: a thread publishing it meanwhile, a check passing
        # or a variant switched to, sees that after publishing and withdraws it: `_serve`)
        old.stale = True
        _plan.withdraw(old.ref)
        _unwatch(old)
    ref = _Ref(obj, _evict)
    ref.oid = id(obj)
    return NodeEntry(ref)


def _file(entry: NodeEntry, old: NodeEntry | None) -> None:
    """Make `entry` its object's entry (publish it to the fast path if it can serve)."""
    previous = by_id.get(entry.ref.oid)
    by_id[entry.ref.oid] = entry
    # Withdrawn once replaced (`old` was when this read began, but another thread may have
    # published it since: see `_serve`); `previous`, another thread's read filed meanwhile,
    # is dropped (one entry per object).
    for replaced in (old, previous):
        if replaced is not None and replaced is not entry:
            _plan.withdraw(replaced.ref)
    if previous is not None and previous is not old and previous is not entry:
        _unwatch(previous)
    _serve(entry)


def _serve(entry: NodeEntry) -> None:
    """Publish `entry` to the fast path if it can serve: eligible (`direct`), current (no
    change, flip or rebuild reported), and its object's entry. Whatever ends one of these
    (a hook in another thread, another thread's read filing a new entry) marks it first,
    then withdraws it: the marks are read again after publishing, so that a withdraw that
    came before the publish is made good."""
    if entry.direct and _current(entry):
        _plan.publish(entry.ref, entry.fast, entry.guard, entry)
        if not _current(entry):
            _plan.withdraw(entry.ref)


def _current(entry: NodeEntry) -> bool:
    return not (entry.stale or entry.rebuilt or entry.flipped) and by_id.get(entry.ref.oid) is entry


def _read_graph(obj: Any, arg_name: str, old: NodeEntry | None, entry: NodeEntry) -> Any:
    """Fill `entry` by NNX's graph flatten of `obj`, whose RefMap it returns: one graph
    walk, whose reference index holds every node and Variable (what the hooks watch). Any
    hooked change made meanwhile (another thread) bumps the generation: the entry is then
    marked stale, re-read on its next use."""
    generation = _generation[0]
    guard = None
    guardable = True
    seen_before = old is not None and old.ref() is obj
    # Plain lists or dicts in the graph (which change in place without a hook) are watched
    # by a guard, whose snapshot must be taken before the leaves are read. Where the last
    # read had them, they are watched first.
    walked = old is not None and seen_before and old.spec is not None and old.spec.has_containers
    if walked:
        guard, guardable = _watch_containers(obj)
    refmap = graphlib.RefMap()
    graphdef, flat = _flatten_node(obj, arg_name, ref_index=refmap)
    spec = _intern_graphdef(graphdef, len(flat.leaves), arg_name)
    if not spec.has_containers:
        guard, guardable = None, True
    elif not seen_before:
        # The first sight of the object: the walk is worth it only for an object passed
        # again (not for the new nnx.State of a functional loop, read once). Read once
        # here, and marked stale: its next use builds the guarded entry.
        entry.provisional = entry.stale = True
    elif not walked:  # (new in the graph since the last read: watch them, read again)
        guard, guardable = _watch_containers(obj)
        refmap = graphlib.RefMap()
        again, flat = _flatten_node(obj, arg_name, ref_index=refmap)
        if again != graphdef:
            entry.stale = True
    statics_guarded = not spec.mutable_statics
    if spec.mutable_statics and guardable:
        containers = _static_containers(graphdef)
        if containers is not None:
            # (taken after the flatten: the values keyed must be the ones it holds, so they
            # are frozen again, from the graphdef, which holds the attributes themselves)
            more = _guard.make(containers)
            if _freeze(graphdef) != spec.frozen:
                entry.stale = True
            guard = more if guard is None else (*guard, *(more or ()))
            statics_guarded = True
    entry.watched = [id(n) for n in refmap.keys()]
    entry.node_ids = frozenset(entry.watched)
    if not entry.provisional:  # (a provisional entry is re-read anyway: nothing to watch)
        with _watch_lock:
            for oid in entry.watched:
                _watch._watchers.setdefault(oid, []).append(entry)
    entry.items, readable = _leaf_items(obj, flat)
    entry.paths = list(flat.paths)
    entry.spec, entry.spec_id = spec, spec.id
    # (raw leaves held by graph nodes are rebound through the hooked __setattr__: they
    # need no re-read, only a fresh read of their value, as Variables; plain lists and
    # dicts are watched by the guard)
    entry.volatile = not guardable or not readable or not TRUSTED or not statics_guarded
    entry.guard = None if entry.volatile else guard
    # (the fast path reads Variables and RawLeafs; a raw item of a plain list is read here)
    entry.direct = not entry.volatile and not any(type(x) is RawItem for x in entry.items)
    # Kept for an object read again (a structure that changed, an NNX rebuild): what an
    # NNX rebuild of it must put back to leave this read current (not for an object met
    # once, as the new State of a functional loop).
    if seen_before and not entry.volatile and not entry.provisional:
        try:
            entry.layout = _layout(refmap)
        except Exception:  # (a node another thread is rebuilding: the generation says so below)
            entry.layout = None
    if _generation[0] != generation or (entry.guard is not None and not _guard.holds(entry.guard)):
        entry.stale = True  # the graph may have changed while we were reading it
    return refmap


class _PlainState(NamedTuple):
    variables: list[Any]  # its Variables, in flatten order
    key: Any  # its pytree structure and each Variable's type and metadata
    spec: NodeSpec | None  # the spec a graph read gave that key (None: not read yet)


class _Enumerated(NamedTuple):
    """The objects a read indexed, in index order: what `_Link` reads of a RefMap."""

    objects: list[Any]

    def items(self) -> Any:
        return zip(self.objects, range(len(self.objects)))


# (pytree structure, Variable types and metadata) of a State of Variables -> its spec
_plain_state_specs: dict[Any, NodeSpec] = {}


def _plain_state_read(state: Any) -> _PlainState | None:
    """A State's Variables by jax's pytree flatten, if it holds Variables only, each once,
    with hashable metadata; with the spec remembered for their structure, if any."""
    read_whole()
    variables, treedef = jax.tree_util.tree_flatten(state, is_leaf=_nnx_gate.is_node)
    if not all(map(_is_variable, variables)) or len(set(map(id, variables))) != len(variables):
        return None
    try:  # (each Variable's key as `_variable_key` makes it, without copying its metadata)
        key = (treedef, tuple([(type(v), tuple(_var_metadata(v).items())) for v in variables]))
        spec = _plain_state_specs.get(key)
    except Exception:  # unhashable metadata (the graph read names it)
        return None
    return _PlainState(variables, key, spec)


def _indexed_in_order(refmap: Any, items: list[Any]) -> bool:
    """Whether a graph flatten's RefMap indexed exactly `items`, each at its position."""
    return len(refmap) == len(items) and all(
        obj is v and index == i for (obj, index), v, i in zip(refmap.items(), items, itertools.count())
    )


def _remember_plain_state(plain: _PlainState, entry: NodeEntry, refmap: Any) -> None:
    """After a graph read of a State `_plain_state_read` read just before: its spec, for
    later States of that structure, if the graph read found exactly those Variables in
    that order, each indexed by its position (what `_Enumerated` gives), and nothing else,
    and the State still has that structure (no change between the two reads)."""
    if len(entry.items) != len(plain.variables) or not all(a is b for a, b in zip(entry.items, plain.variables)):
        return
    if not _indexed_in_order(refmap, plain.variables):
        return
    again = _plain_state_read(entry.ref())
    if again is None or again.key != plain.key:
        return
    if len(_plain_state_specs) > 4096:
        _plain_state_specs.clear()
    _plain_state_specs[plain.key] = entry.spec


def clear() -> None:
    for entry in list(by_id.values()):
        _unwatch(entry)
        _plan.withdraw(entry.ref)
    by_id.clear()
    with _watch_lock:
        _watch._watchers.clear()  # (and any entry another thread replaced while it was being read)
    _variable_specs.clear()
    _plain_state_specs.clear()
    _graphdefs.clear()

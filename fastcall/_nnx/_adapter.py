"""The Flax NNX adapter: every line of fastcall that touches flax.

Loaded by `_nnx_gate` only once an NNX object reaches fastcall. For an NNX
graph node (Module, Pytree, Rngs, Optimizer, Variable) passed to a wrapped
function, fastcall keeps per object (validated by weakref), in a `NodeEntry`:

* the graphdef, interned to a spec id (static attributes such as
  `deterministic` or `use_running_average` are part of it, so `model.eval()`
  selects another compiled program);
* the list of its Variable objects in flatten order. Their values are read at
  call time through the `_raw_value` slot (no deprecated `.value`, no graph
  walk), so `v[...] = ...`, `nnx.update` and optimizer steps made outside are
  seen by the next call.

Structure changes are seen through the hooks of `_hooks` (its table lists
each method wrapped): a call of one on a node that belongs to a cached graph
marks that entry stale, and a stale entry is re-read on its next use. Plain
lists and dicts in the graph (which change in place without any hook) are
checked item by item by a guard, made when the object is seen a second time
(an object seen once is read with one flatten). If the hooks cannot be
verified on the installed flax, the entry is re-read on every call instead.
An `nnx.State` of Variables only, new, of a structure read before, is read by
jax's pytree flatten instead of a graph walk (`_read_plain_state`).

Inside the trace (`TracedInputs`), each NNX argument is rebuilt from its
graphdef with the traced values; after the function returns, each Variable
whose value is no longer the very tracer it was given is an output, and only
those are written back (`NnxOutputs`, `finish`). Structural changes made
inside are propagated to the caller's objects (graph updates), and NNX objects
in the output come back as the caller's own objects or as new ones.
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import dataclasses
import inspect
import itertools
import operator
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import jax
from flax import nnx
from flax.nnx import graphlib
from flax.nnx import variablelib
from flax.nnx.variablelib import Variable, is_array_ref

from .. import _debug_names, _fast, _guard, _native, _nnx_gate
from .._build import broadcast_prefix
from .._errors import FastcallError, describe_arg
from .._flatten import ArrayImpl, intern, spec_by_id
from .._flatten import flatten_generic as _flatten_generic
from .._flatten import interned as _interned
from .._flatten import is_traced_leaf
from .._flatten import leaf_key as _leaf_key
from .._stats import read_whole
from .._trace import StepAside, contains_tracer
from . import _hooks

# --------------------------------------------------------------------------
# Watching for structure changes


_watch_lock = threading.RLock()  # (reentrant: an entry's `_evict` may run in a GC at any allocation made under it)
# id(graph node or Variable) -> entries whose graph contains it.
_watchers: dict[int, list[NodeEntry]] = {}


_local = threading.local()

# Bumped by every hooked change anywhere: a build that saw it change marks its entry
# stale (a change made while it was reading the graph is not lost).
_generation = [0]


def _notify(obj: Any) -> None:
    _generation[0] += 1
    if not _watchers:
        return
    entries = _watchers.get(id(obj))
    if entries:
        updating = getattr(_local, "updating", None)  # (the entry fastcall itself is updating)
        for e in list(entries):  # (the list may change under us in another thread)
            if e is not updating:
                e.stale = True
                _fast.withdraw(e.ref)


# Guards each entry's `rebuilt` mark: a rebuild reported while a check of it runs is never lost.
_rebuild_lock = threading.RLock()


def _rebuilt(node: Any) -> None:
    """Half of NNX's in-place rebuild of `node` (its clear or its init: nnx.jit's graph
    updates on a model passed to it, and NNX's other transforms': nnx.grad, nnx.vmap) ran. A rebuild mostly puts back what was
    there, so it is not taken as a change: the entries watching the node leave the fast
    path and are marked `rebuilt`; their next use checks every node of the graph against
    what was read (`_rebuilt_as_read`) and serves again if nothing differs, else re-reads."""
    _generation[0] += 1  # (a graph read while a rebuild runs may have seen it half done)
    entries = _watchers.get(id(node))
    if entries:
        for e in tuple(entries):  # (the list may change under us in another thread)
            # (marked already: by this rebuild's report on another node, whose withdraw is
            # done or under way; a check started since has replaced the mark by its own)
            if e.rebuilt is not True and e is not getattr(_local, "updating", None):
                with _rebuild_lock:
                    e.rebuilt = True
                _fast.withdraw(e.ref)


def _flipped(obj: Any, name: str, old: Any) -> None:
    """A static scalar attribute of `obj` was replaced by another (`model.eval()`): the
    graphs holding it keep their Variables and nodes; only one static value differs.
    Each entry watching it records the attribute (see `NodeEntry.flips`) and, if its spec
    was current, keeps it as the variant for the values before this change."""
    _generation[0] += 1
    if not _watchers:
        return
    entries = _watchers.get(id(obj))
    if entries:
        updating = getattr(_local, "updating", None)
        for e in list(entries):
            if e is not updating:
                e.flip(obj, name, old)


# Whether the hooks can be trusted on this flax (see _hooks): if not, every
# entry is re-read on every call.
TRUSTED = not _hooks.install(_notify, _flipped, _rebuilt)

RAW_VALUE_SLOT: Any = inspect.getattr_static(Variable, "_raw_value", None)
if type(RAW_VALUE_SLOT).__name__ == "member_descriptor":
    # Values are read and written through the slot itself (no checks, no hooks; the C
    # fast path reads it too).
    raw_value: Any = operator.attrgetter("_raw_value")
    _set_raw: Any = RAW_VALUE_SLOT.__set__
    _fast.VALUE_SLOT[0] = RAW_VALUE_SLOT
else:  # pragma: no cover - an unverified flax without the slot: public, slower accessors
    RAW_VALUE_SLOT = None
    raw_value = operator.methodcaller("get_raw_value")
    _set_raw = Variable.set_raw_value


# jax's mutable array reference type (`jax.new_ref`), where this jax has one: a graph
# node to nnx.jit (traced, returned as the caller's own reference when passed in)
_REF_TYPE = getattr(variablelib, "Ref", None)
# What a Variable made under `nnx.var_defaults(hijax=True)` flattens to (flax 0.12.5 has it):
# refused with a clear error (its value is not read as a Variable's is)
_HIJAX_TYPE = getattr(variablelib, "HijaxVariable", None)


def is_node_type(t: type) -> bool:
    """Whether instances of `t` are NNX graph nodes, Variables or mutable array references
    (NNX decides this by type: registration in its graph registry)."""
    return issubclass(t, (_hooks.Pytree, Variable)) or t in graphlib.GRAPH_REGISTRY or t is _REF_TYPE


State = nnx.State


def _is_node(x: Any) -> bool:
    return isinstance(x, Variable) or graphlib.is_graph_node(x)


_node_types = _nnx_gate.node_types


def _is_node_fast(x: Any) -> bool:
    """`_is_node`, cached per type (the hot paths)."""
    t = type(x)
    try:
        known = _node_types.get(t)
    except TypeError:  # (a class whose metaclass cannot be hashed: NNX registers no such class)
        return False
    return _nnx_gate.is_node_type(t) if known is None else known


if _native.BUILT is not None:  # (the same test in C, for jax's flatten to call: `node_test`)
    _native.BUILT.configure_node_test(_node_types, _is_node_fast)


def node_test() -> Callable[[Any], bool]:
    """`_is_node_fast`, in C where calls use the extension (a MixedRead's flatten calls it
    once per node of its argument)."""
    return _native.ACCEL.node_test if _native.ACCEL is not None else _is_node_fast


# --------------------------------------------------------------------------
# Leaves: Variables, and handles of raw leaves

RawLeaf = _fast.RawLeaf


class RawItem:
    """A raw leaf held in a plain list or dict of the graph (`nnx.data([...])`), read at
    call time as `container[key]`. (Such graphs are re-read on every call: nothing hooks
    a plain container.)"""

    __slots__ = ("container", "key")

    def __init__(self, container: Any, key: Any) -> None:
        self.container, self.key = container, key


def read_leaf(item: Any) -> Any:
    """The current value of one leaf of a cached graph."""
    t = type(item)
    if t is RawLeaf:
        return _fast.read_raw(item)
    if t is RawItem:
        return item.container[item.key]
    if t is _Unreadable:
        return item.value
    return raw_value(item)


def write_leaf(item: Any, value: Any) -> None:
    """Write one leaf of the caller's graph back (the function changed it)."""
    t = type(item)
    if t is RawLeaf:
        owner, name = item.owner, item.name
        held = owner.__dict__
        if type(value) is ArrayImpl and type(held.get(name)) is ArrayImpl and owner._pytree__nodes.get(name) is True:
            # A data array rebound to an array: all NNX's __setattr__ would do (its checks
            # pass for it, and the hooks see no structure change), done directly.
            held[name] = value
        else:
            setattr(owner, name, value)
    elif t is RawItem:
        item.container[item.key] = value
    elif t is _Unreadable:
        raise FastcallError(
            "fastcall.jit: the function rebinds a raw (non-Variable) leaf of an NNX graph "
            "node of a custom type whose attributes fastcall cannot address. Hold the "
            "value in a Variable (nnx.Variable / nnx.BatchStat) instead."
        )
    else:
        _set_raw(item, value)


class _Unreadable:
    """A raw leaf whose owner could not be found from its path (a custom graph node type):
    its value as flattened; the graph holding it is re-read on every call."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _leaf_items(root: Any, flat: Any) -> tuple[list[Any], bool]:
    """The leaves of a flattened graph as items to read at call time: each Variable
    itself, each raw leaf as a handle on its owner. Also returns whether every raw leaf
    could be given a handle that reads back the very value flattened."""
    items: list[Any] = []
    readable = True
    for path, leaf in zip(flat.paths, flat.leaves):
        if _is_variable(leaf):
            items.append(leaf)
            continue
        try:
            owner = root
            for key in path[:-1]:
                owner = _child(owner, key)
            key = path[-1]
            # (the owner through a weak proxy: the entry must not keep the object alive)
            item: Any = (
                RawLeaf(weakref.proxy(owner), str(key)) if isinstance(owner, _hooks.Pytree) else RawItem(owner, key)
            )
            if read_leaf(item) is not leaf:
                raise LookupError(key)
        except Exception:
            item, readable = _Unreadable(leaf), False
        items.append(item)
    return items, readable


def _child(node: Any, key: Any) -> Any:
    if isinstance(node, _hooks.Pytree):
        return getattr(node, str(key))
    if isinstance(node, (list, dict, collections.abc.Mapping)):
        return node[key]
    raise LookupError(key)


# --------------------------------------------------------------------------
# Per-object cache


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
        self.fast: dict[Any, _fast.FastRecord] = {}  # published in the fast index while direct
        self.watched: list[int] = []  # ids of every node and Variable of the graph
        self.node_ids: frozenset[int] = frozenset()
        self.disjoint: dict[int, Any] = {}  # id(other entry) -> (weakref, shares nothing?)
        # Static scalar attributes replaced since the graph was read (`_flipped`): their
        # (node, name), in the order first seen. Each structure the graph had as they
        # changed (same Variables and nodes, other static values) is kept as a variant,
        # keyed by their values (`flip_key`): `model.train()`/`model.eval()` switch between
        # variants, no graph walk.
        self.flips: dict[tuple[int, str], tuple[Any, str]] = {}  # -> (weakref to node, name)
        self.variants: dict[tuple[Any, ...], tuple[Any, dict[Any, _fast.FastRecord]]] = {}
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
                _fast.withdraw(self.ref)
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
                _fast.withdraw(self.ref)


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
            _fast.withdraw(ref)
            _unwatch(entry)
        except Exception:  # at interpreter exit module globals may be gone
            pass


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
    return isinstance(x, (list, dict, collections.abc.MutableMapping)) and not _is_node(x)


def _watch_containers(node: Any) -> tuple[_guard.Guard | None, bool]:
    """A guard over every plain list or dict in `node`'s graph (`nnx.data([...])`, an optax
    state's containers), which can change in place without any hook, and whether it
    covers them all (not so if one is another kind of mutable mapping, or the graph cannot
    be walked: the graph is then re-read on every call, and its flatten names any error)."""
    containers: list[Any] = []
    guardable = True
    try:
        for _, sub in graphlib.iter_graph(node):
            if type(sub) is nnx.State:  # (an optimizer's state: its attributes and its dict)
                attributes = _guard.Attributes(sub)
                containers += [attributes, sub.raw_mapping]
                guardable = guardable and _guard.is_guardable(attributes) and _guard.is_guardable(sub.raw_mapping)
            elif _is_container(sub):
                containers.append(sub)
                guardable = guardable and _guard.is_guardable(sub)
    except Exception:
        return None, False
    return (_guard.make(containers) if containers and guardable else None), guardable


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
# A graph NNX rebuilt in place: checked against the last read, not read again
#
# nnx.jit (and NNX's other transforms) rebuild every node of a model passed to them in place after
# the call: each node's attributes cleared, then set again, mostly to the very objects
# they held. The check compares each node's attributes with a record of the read
# (`_Layout`): no graph walk, no graphdef built or compared.

_SAME, _SCALAR, _EQUAL = range(3)  # how else an attribute may compare (`_NodeLayout`)
_ABSENT = object()


class _NodeLayout(NamedTuple):
    node: Any  # weakref to the node (the entry must not keep its own object alive)
    cls: type  # its class when read (a class assigned since is a change)
    n: int  # how many attributes it had
    # NNX's per-object bookkeeping (`_pytree__state`, made anew by each rebuild): its class and
    # the flags its graphdef records (`_pytree_state_key`)
    state: tuple[Any, ...]
    # Attributes expected to hold the very same object, held strongly: Variables (which the
    # entry's leaves hold anyway), static values that keep no node alive, NNX's record of
    # which attributes are data; with how else each may compare (`_SCALAR`: an equal scalar,
    # `_EQUAL`: an equal mapping; `_SAME`: no other way). `get`: their current values, as a
    # tuple (KeyError if one is missing).
    names: tuple[str, ...]
    get: Callable[[dict[str, Any]], tuple[Any, ...]]
    values: tuple[Any, ...]
    kinds: tuple[int, ...]
    # Attributes expected to hold the very same object, held weakly (submodules, functions and
    # other static objects: one may refer back to the graph's root, which must not be kept
    # alive by its own entry).
    weak_names: tuple[str, ...]
    weak_values: tuple[Any, ...]
    # Raw data arrays: each may now be another array (its value is read at call time).
    arrays: tuple[str, ...]


class _Layout(NamedTuple):
    nodes: tuple[_NodeLayout, ...]


def _layout(refmap: Any) -> _Layout | None:
    """A record of every node of a graph just read (`refmap`: its flatten's index of nodes
    and Variables), or None where a node holds what the check cannot compare (a graph node
    that is not an NNX Pytree, a data attribute that is a list, tuple or other pytree)."""
    nodes = []
    for node in refmap.keys():
        if isinstance(node, Variable):
            continue  # (changes to a Variable's metadata or type are hooked as changes)
        node_layout = _node_layout(node) if isinstance(node, _hooks.Pytree) else None
        if node_layout is None:
            return None
        nodes.append(node_layout)
    return _Layout(tuple(nodes))


def _node_layout(node: Any) -> _NodeLayout | None:
    try:
        attributes = vars(node)
        data = attributes["_pytree__nodes"]  # (which attributes NNX holds as data)
        ref = weakref.ref(node)
    except Exception:
        return None
    strong: list[tuple[str, Any, int]] = []
    weak: list[tuple[str, Any]] = []
    arrays: list[str] = []
    state: tuple[Any, ...] | None = None
    for name, value in tuple(attributes.items()):  # (one step: another thread may rebuild it)
        if name == "_pytree__nodes":
            strong.append((name, value, _EQUAL))  # (a mapping of names to flags)
        elif name == "_pytree__state":
            state = _pytree_state_key(value)
        elif type(value) in _hooks.SCALARS:
            strong.append((name, value, _SCALAR))
        elif isinstance(value, Variable):
            strong.append((name, value, _SAME))
        elif type(value) is ArrayImpl and data.get(name) is True:
            arrays.append(name)
        elif data.get(name) and not _is_node(value):
            return None  # (data of another kind: a list or tuple of nodes, another pytree)
        elif not data.get(name) and _holds_no_object(value):
            strong.append((name, value, _SAME))
        else:  # (a submodule, or a static value that may refer to one)
            try:
                weak.append((name, weakref.ref(value)))
            except TypeError:
                if data.get(name):
                    return None
                strong.append((name, value, _SAME))  # (a tuple, a dict: the graphdef holds it too)
    if state is None:
        return None
    names, values, kinds = (tuple(column) for column in zip(*strong)) if strong else ((), (), ())
    weak_names, weak_values = (tuple(column) for column in zip(*weak)) if weak else ((), ())
    return _NodeLayout(
        ref, type(node), len(attributes), state, names, _getter(names), values, kinds, weak_names, weak_values,
        tuple(arrays),
    )


def _pytree_state_key(state: Any) -> tuple[Any, ...]:
    """What of NNX's per-object bookkeeping the graphdef records: its flags (set around
    nnx.bridge's setup and init; a module may read them), with its class."""
    return (type(state), getattr(state, "initializing", None), getattr(state, "is_setup", None))


def _getter(names: tuple[str, ...]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    if len(names) > 1:
        return operator.itemgetter(*names)
    return lambda attributes: tuple(attributes[name] for name in names)


def _holds_no_object(value: Any) -> bool:
    """Whether a static value can be held strongly by a record without keeping any node
    alive: a class, or a function with no closure and only scalar defaults (an initializer,
    `jax.lax.dot_general`; a lambda over `self` or a bound method is held weakly)."""
    if isinstance(value, type):
        return True
    if type(value) is not types.FunctionType or value.__closure__ is not None:
        return False
    defaults = (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values())
    return all(type(d) in _hooks.SCALARS for d in defaults)


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


def _nodes_as_read(layout: _Layout, flips: dict[tuple[int, str], Any]) -> bool:
    absent = itertools.repeat(_ABSENT)
    for ref, cls, n, state, names, get, values, kinds, weak_names, weak_values, arrays in layout.nodes:
        node = ref()
        if node is None or type(node) is not cls:
            return False
        attributes = vars(node)
        if len(attributes) != n or _pytree_state_key(attributes.get("_pytree__state")) != state:
            return False
        current = get(attributes)  # (with the count equal, no attribute missing: the same names)
        if not all(map(operator.is_, current, values)):
            for name, value, expected, kind in zip(names, current, values, kinds):
                if value is not expected and not (
                    (
                        kind == _SCALAR
                        and (
                            _hooks.same_scalar(expected, value)
                            or (_hooks.scalar_flip(expected, value) and (id(node), name) in flips)
                        )
                    )
                    or (kind == _EQUAL and type(value) is type(expected) and value == expected)
                ):
                    return False
        if weak_names:
            alive = tuple(map(operator.call, weak_values))  # (None: died, so not what is held)
            if not all(map(operator.is_not, alive, itertools.repeat(None))) or not all(
                map(operator.is_, map(attributes.get, weak_names, absent), alive)
            ):
                return False
        for name in arrays:
            if type(attributes.get(name)) is not ArrayImpl:
                return False
    return True


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


def slot_after_rebuild(obj: Any) -> _fast.FastSlot | None:
    """The fast path's slot of an NNX object whose graph NNX rebuilt in place since its
    last call (nnx.jit on a shared model), if the check finds it as read and it serves
    from the fast path again; None otherwise (and for any other object)."""
    entry = _rebuilt_entry(obj)
    return _fast.INDEX.get(id(obj)) if entry is not None and _rebuilt_as_read(entry) else None


def slot_as_checked(obj: Any) -> _fast.FastSlot | None:
    """What `slot_after_rebuild` would serve `obj` from, changing nothing (for `explain`)."""
    entry = _rebuilt_entry(obj)
    if entry is None or not entry.direct or entry.flipped or entry.layout is None:
        return None
    if not _as_read(entry, entry.layout):
        return None
    return _fast.FastSlot(entry.ref, entry.fast, entry.guard, entry)


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


def read_cached(obj: Any, spec_id: int, values: list[Any], nnx_args: list[NnxArg]) -> bool:
    """The structure path's reading of an NNX argument: its current leaf values and NnxArg,
    as `read_argument` gives them, if its cached entry is usable as it is and has spec
    `spec_id`; False (nothing appended) otherwise, or where `read_argument` would step
    aside or consume NNX's cached_partial cache."""
    entry = cached(obj)
    if entry is None or entry.spec_id != spec_id or entry.fresh or _fast.static_cache_pending():
        return False
    current = entry.values()
    if current and type(current[0]) is not ArrayImpl:
        return False  # (tracers: inside an NNX transform)
    values += current
    nnx_args.append(NnxArg(obj, entry.items, entry, paths=entry.paths))
    return True


def read_joint(obj: Any, read: _fast.JointRead, values: list[Any], nnx_args: list[NnxArg]) -> bool:
    """The structure path's reading of an NNX argument read jointly with others
    (`_fast.JointRead`): the values and NnxArg the general path's joint flatten gives it, if
    its cached entry is the recorded one, usable as it is, with the recorded spec and its
    nodes and Variables unchanged; False (nothing appended) otherwise, or where the joint
    read would step aside or consume NNX's cached_partial cache."""
    entry = cached(obj)
    if (
        entry is None or read.entry() is not entry or entry.node_ids is not read.node_ids
        or entry.spec_id != read.spec_id or entry.fresh or _fast.static_cache_pending()
    ):
        return False
    items = entry.items if read.keep is None else [entry.items[k] for k in read.keep]
    current = list(map(read_leaf, items))
    if current and type(current[0]) is not ArrayImpl:
        return False  # (tracers: inside an NNX transform)
    values += current
    # (as the joint flatten's NnxArg: no entry, whose leaves are not these; paths, where
    # a Variable replaced inside needs one, found by a search)
    nnx_args.append(NnxArg(obj, items, None, paths=entry.paths if read.keep is None else None))
    return True


def readable_argument(arg: NnxArg, spec_id: int) -> bool:
    """Whether the structure path may read this call's NNX argument as `read_cached` does:
    it was read from its cache entry, on its own (not jointly with another argument)."""
    entry = arg.entry
    return entry is not None and not entry.volatile and entry.spec_id == spec_id and not entry.spec.joint


def joint_read(arg: NnxArg, before: Any) -> _fast.JointRead | None:
    """How the structure path reads this call's NNX argument again, if the general path read
    it jointly with the call's other NNX arguments (`_read_node` with `joint`) and its cache
    entry is usable as it is, unchanged since the call's first, separate read found it
    (`before`: the object, its entry and the entry's version then): which of the entry's
    leaves the joint flatten passed (the same leaves, by path and identity). None if it
    cannot be said."""
    entry = cached(arg.obj)
    if entry is None or entry.paths is None or arg.entry is not None or arg.paths is None or entry.fresh:
        return None
    # (the very entry the call's first read found before the joint flatten, not changed in
    # place since: else the joint flatten may have seen another graph than the one the entry
    # describes, changed and re-read by another thread meanwhile, and the program compiled
    # for it would be pinned to the entry)
    if before is None or before[0] is not arg.obj or before[1] is not entry or before[2] != entry.version:
        return None
    position = {tuple(p): k for k, p in enumerate(entry.paths)}
    keep = [position.get(tuple(p), -1) for p in arg.paths]
    if len(keep) != len(arg.variables) or -1 in keep:
        return None
    for k, item in zip(keep, arg.variables):
        mine = entry.items[k]
        if mine is not item and not (type(item) is RawLeaf and type(mine) is RawLeaf and mine == item):
            return None
    whole = keep == list(range(len(entry.items)))
    return _fast.JointRead(entry.spec_id, weakref.ref(entry), entry.node_ids, None if whole else tuple(keep))


def shared_variable_read(arg: NnxArg, spec_id: int, reads: list[Any], at: int) -> _fast.SharedVariableRead | None:
    """How the structure path reads this call's Variable argument again (`at`: its position
    in `reads`, the record's reads of every argument), if it was passed on its own, read
    jointly, and another argument read by a JointRead in `reads` holds it: the holder passes
    its value if it comes first (the joint flatten met the Variable as a reference to one
    seen before: it passed no leaf), else the Variable does (and the holder's JointRead
    leaves it out); else None."""
    v = arg.obj
    if arg.entry is not None or not _is_variable(v):
        return None
    passed = len(arg.variables) == 1 and arg.variables[0] is v
    if not passed and arg.variables:
        return None
    for owner, read in enumerate(reads):
        entry = read.entry() if type(read) is _fast.JointRead and owner != at else None
        if entry is None or (owner > at) != passed:
            continue
        for index, item in enumerate(entry.items):
            if item is v and (read.keep is None or index in read.keep) != passed:
                return _fast.SharedVariableRead(spec_id, owner, index, passed)
    return None


def read_shared_variable(
    v: Any, read: _fast.SharedVariableRead, owner: _fast.JointRead, values: list[Any], nnx_args: list[NnxArg]
) -> bool:
    """The structure path's reading of a Variable argument another argument holds
    (`_fast.SharedVariableRead`; `owner`: that argument's JointRead, which the call reads
    too, checking the entry is its argument's): its value if it is met first (else its
    holder passes it) and the NnxArg the joint flatten gives it, if it is the Variable at
    the recorded place of the pinned entry; False otherwise."""
    entry = owner.entry()
    if entry is None or read.position >= len(entry.items) or entry.items[read.position] is not v:
        return False
    if not read.first:
        nnx_args.append(NnxArg(v, [], None, paths=[]))
        return True
    value = raw_value(v)
    if type(value) is not ArrayImpl:
        return False  # (a tracer: inside an NNX transform)
    values.append(value)
    nnx_args.append(NnxArg(v, [v], None, paths=[()]))
    return True


def install_record(entry: NodeEntry, state: Any, spec_id: int, record: _fast.FastRecord) -> None:
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


def _intern_graphdef(graphdef: Any, n: int, arg_name: str, joint: bool = False) -> NodeSpec:
    tag = "nnx-joint" if joint else "nnx"
    try:
        return intern(NodeSpec(graphdef, n, joint), (tag, graphdef))
    except TypeError:
        pass  # a mutable static attribute (a list, a dict, a dataclass holding one)
    except Exception as err:
        raise _static_error(arg_name, err) from None
    # Keyed by value: a frozen copy of the graphdef is the key, and the spec keeps a deep
    # copy (the caller's list may change in place later; the compiled program must not).
    try:
        key = (tag, "by value", _freeze(graphdef))
        found = _interned(key)
        if found is not None:
            return found
        copied = _copy_unhashable(graphdef)
        frozen = _freeze(copied)
        if frozen != key[2]:  # (changed by another thread meanwhile: keyed as the copy the program keeps)
            key = (tag, "by value", frozen)
        spec = NodeSpec(copied, n, joint)
        spec.mutable_statics = True
        spec.frozen = frozen
        return intern(spec, key)
    except Exception as err:
        raise _static_error(arg_name, err) from None


def _static_error(arg_name: str, err: Exception) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: {describe_arg(arg_name)} has a static attribute that cannot be "
        f"compared or copied ({type(err).__name__}: {err}). NNX static attributes are part "
        "of the compile key: use values that compare by value (numbers, strings, tuples, "
        "lists, dicts, dataclasses of these), or store them in a Variable."
    )


def _copy_unhashable(x: Any) -> Any:
    """A copy of `x` in which every part that cannot be hashed (and so may change in place)
    is copied, recursively; hashable parts (types, functions, numbers) are kept as they are."""
    try:
        hash(x)
        return x
    except TypeError:
        pass
    if type(x) is list:
        return [_copy_unhashable(i) for i in x]
    if type(x) is tuple:
        return tuple(_copy_unhashable(i) for i in x)
    if type(x) is dict:
        return {k: _copy_unhashable(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        new = copy.copy(x)  # (every field, init=False ones included; frozen ones set directly)
        for f in dataclasses.fields(x):
            object.__setattr__(new, f.name, _copy_unhashable(getattr(x, f.name)))
        return new
    return copy.deepcopy(x)


def _freeze(x: Any) -> Any:
    """A hashable value equal for equal `x` (compared as `==` compares them, but with each
    scalar's type: 1, 1.0 and True differ): lists, dicts, sets and dataclasses are
    frozen recursively. Raises TypeError for anything else that cannot be hashed."""
    memo: dict[int, Any] = {}  # (an object met again, as one config held by every layer: frozen once)

    def freeze(x: Any) -> Any:
        try:
            hash(x)
        except TypeError:
            pass
        else:
            return _leaf_key(x)
        done = memo.get(id(x))
        if done is not None:
            return done[1]
        t = type(x)
        out: tuple[type, Any]
        if isinstance(x, (list, tuple)):
            out = (t, tuple(map(freeze, x)))
        elif t is dict:  # (equal whatever the order of insertion)
            out = (t, frozenset((freeze(k), freeze(v)) for k, v in x.items()))
        elif isinstance(x, collections.abc.Mapping):  # (an OrderedDict's order counts)
            out = (t, tuple((freeze(k), freeze(v)) for k, v in x.items()))
        elif isinstance(x, (set, frozenset)):
            out = (t, frozenset(map(freeze, x)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            out = (t, tuple((f.name, freeze(getattr(x, f.name))) for f in dataclasses.fields(x)))
        else:
            raise TypeError(f"unhashable type: {t.__name__!r}")
        memo[id(x)] = (x, out)  # (x held: its id is not reused meanwhile)
        return out

    return freeze(x)


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
        _fast.withdraw(old.ref)
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
            _fast.withdraw(replaced.ref)
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
        _fast.publish(entry.ref, entry.fast, entry.guard, entry)
        if not _current(entry):
            _fast.withdraw(entry.ref)


def _current(entry: NodeEntry) -> bool:
    return not (entry.stale or entry.rebuilt or entry.flipped) and by_id.get(entry.ref.oid) is entry


def _read_plain_state(state: Any, plain: _PlainState, leaves: list[Any], nnx_args: list[NnxArg]) -> NodeSpec:
    """`read_argument` for a State of Variables only seen for the first time (the new
    State of a functional training loop), as jax.jit reads it: by its pytree flatten
    (`_plain_state_read`), under the spec a graph read gave that structure, without a
    graph walk. Its entry is provisional, as any first read of an object with plain dicts:
    its next use builds the watched entry. Raises StepAside for tracer values."""
    assert plain.spec is not None
    values = list(map(read_leaf, plain.variables))
    if contains_tracer(values):
        raise StepAside
    entry = _new_entry(state, None)
    entry.items, entry.paths = plain.variables, None
    entry.spec, entry.spec_id = plain.spec, plain.spec.id
    entry.node_ids = frozenset(map(id, plain.variables))
    entry.provisional = entry.stale = True
    entry.fresh = False
    entry.enumerated = True
    _file(entry, None)
    leaves += values
    nnx_args.append(NnxArg(state, entry.items, entry, index=_Enumerated(plain.variables)))
    return plain.spec


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
                _watchers.setdefault(oid, []).append(entry)
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
    variables, treedef = jax.tree_util.tree_flatten(state, is_leaf=_is_node_fast)
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
        _fast.withdraw(entry.ref)
    by_id.clear()
    with _watch_lock:
        _watchers.clear()  # (and any entry another thread replaced while it was being read)
    _variable_specs.clear()
    _plain_state_specs.clear()
    _graphdefs.clear()


# --------------------------------------------------------------------------
# Reading NNX arguments for a call

_GRAPH_CONTEXT: Any = graphlib.GRAPH_CONTEXT  # (thread-local)
_fast.GRAPH_CONTEXT[0] = _GRAPH_CONTEXT


NnxArg = _fast.NnxArg


def read_argument(obj: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any) -> int:
    """Append `obj`'s current leaf values to `leaves` and its NnxArg to `nnx_args`;
    return its spec id. With `joint` (a RefMap shared by the call's NNX arguments),
    objects already seen in an earlier argument become references, so each shared
    Variable is passed once (as nnx.jit does). Raises StepAside for tracer values."""
    return _read_node(obj, leaves, arg_name, nnx_args, joint).id


_variable_types: dict[type, bool] = {}


def _is_variable(obj: Any) -> bool:
    """isinstance(obj, Variable), cached per type (Variable's metaclass check is Python)."""
    t = type(obj)
    known = _variable_types.get(t)
    if known is None:
        known = _variable_types[t] = isinstance(obj, Variable)
    return known


def _read_node(obj: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any) -> Any:
    """`read_argument`, returning the spec itself."""
    if joint is None and _is_variable(obj):
        spec = _read_variable(obj, leaves, arg_name, nnx_args)
        if spec is not None:
            return spec
    if joint is not None or not type(obj).__weakrefoffset__ or type(obj) is _REF_TYPE:
        # Flattened afresh: jointly with the call's other NNX arguments, or an object the
        # cache cannot hold (a Variable passed on its own cannot be weakly referenced; a
        # mutable array reference has no graph to cache).
        refmap = joint if joint is not None else graphlib.RefMap()
        graphdef, flat = _flatten_node(obj, arg_name, ref_index=refmap)
        items = _leaf_items(obj, flat)[0]
        values = list(map(read_leaf, items))
        if contains_tracer(values):
            raise StepAside
        leaves += values
        ids = frozenset() if joint is not None else frozenset(map(id, refmap))
        nnx_args.append(NnxArg(obj, items, None, ids, list(flat.paths), refmap))
        return _intern_graphdef(graphdef, len(items), arg_name, joint=joint is not None)
    entry, index = lookup(obj, arg_name)
    values = entry.values()
    # Inside nnx.grad/vmap/scan the module is a copy holding tracers: run inline.
    # Variables of a module created outside cannot receive tracers (NNX forbids it),
    # so for a known object the first value tells.
    if values and (type(values[0]) is not ArrayImpl or entry.fresh):
        entry.fresh = False
        if contains_tracer(values):
            raise StepAside
    leaves += values
    nnx_args.append(NnxArg(obj, entry.items, entry, paths=entry.paths, index=index))
    return entry.spec


# A lone Variable's graphdef depends only on its type and metadata (given an array
# value: not a mutable array reference, not a hijax Variable): (type, metadata) -> spec.
_variable_specs: dict[Any, NodeSpec] = {}


def _read_variable(v: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg]) -> NodeSpec | None:
    """`read_argument` for a Variable on its own, without a graph walk (Variables cannot
    be weakly referenced, so they are not cached by identity): None if it takes one."""
    value = raw_value(v)
    if type(value) is not ArrayImpl:
        return None  # (a tracer, a NumPy array, a mutable array reference, ...)
    key = _variable_key(v)
    if key is None:
        return None  # (unhashable metadata: the graph walk names it)
    spec = _variable_specs.get(key)
    if spec is None:
        if v.get_metadata().get("hijax"):
            return None
        graphdef, flat = _flatten_node(v, arg_name, ref_index=graphlib.RefMap())
        if len(flat.leaves) != 1 or flat.leaves[0] is not v:
            return None
        spec = _intern_graphdef(graphdef, 1, arg_name)
        if len(_variable_specs) > 4096:
            _variable_specs.clear()
        _variable_specs[key] = spec
    leaves.append(value)
    nnx_args.append(NnxArg(v, [v], None, frozenset((id(v),))))
    return spec


def _variable_key(v: Any) -> tuple[Any, ...] | None:
    """What a lone Variable's spec is cached under (`_variable_specs`): its type and
    metadata; None if the metadata cannot be hashed."""
    try:
        key = (type(v), tuple(v.get_metadata().items()))
        hash(key)
    except Exception:
        return None
    return key


def variable_read(arg: NnxArg, spec_id: int) -> _fast.VariableRead | None:
    """How the structure path reads this call's Variable argument again, if it was read
    as `_read_variable` reads it (without a graph walk, under this spec); else None."""
    v = arg.obj
    if arg.entry is not None or not _is_variable(v) or len(arg.variables) != 1 or arg.variables[0] is not v:
        return None
    key = _variable_key(v)
    if key is None:
        return None
    spec = _variable_specs.get(key)
    if spec is None or spec.id != spec_id:
        return None
    if METADATA_SLOT is None or inspect.getattr_static(type(v), "_var_metadata", None) is not METADATA_SLOT:
        return None  # (a subclass that redefines it: not read through the slot)
    metadata = dict(key[1])  # (a copy, as taken now)
    try:
        if _var_metadata(v) != metadata:
            return None
    except Exception:
        return None
    return _fast.VariableRead(spec_id, type(v), metadata, METADATA_SLOT)


def read_variable_again(v: Any, read: _fast.VariableRead, values: list[Any], nnx_args: list[NnxArg]) -> bool:
    """The structure path's reading of a Variable argument (`VariableRead`): its value and
    NnxArg, as `_read_variable` gives them, if it is of the recorded type and metadata and
    holds a jax array; False (nothing appended) otherwise."""
    if type(v) is not read.kind or _fast.static_cache_pending():
        return False
    value = raw_value(v)
    if type(value) is not ArrayImpl:
        return False  # (a tracer: inside an NNX transform)
    try:
        if read.metadata_slot.__get__(v) != read.metadata:
            return False
    except Exception:
        return False
    values.append(value)
    nnx_args.append(NnxArg(v, [v], None, frozenset((id(v),))))
    return True


# A Variable's metadata dict itself; the structure path reads it through the slot (a
# `VariableRead` is made only where the slot is what getattr finds; else there is none).
_var_metadata = operator.attrgetter("_var_metadata")
METADATA_SLOT: Any = inspect.getattr_static(Variable, "_var_metadata", None)
if type(METADATA_SLOT).__name__ != "member_descriptor":  # pragma: no cover - an unverified flax
    METADATA_SLOT = None

GraphDef = graphlib.GraphDef


# GraphDefs passed as arguments (the functional API), by id, at most `_MAX_GRAPHDEFS`
# (`_fast.GRAPHDEFS`: the structure path reads it, in C too).
_graphdefs = _fast.GRAPHDEFS
_MAX_GRAPHDEFS = 64


def read_graphdef(graphdef: Any, arg_name: str, trace_scalars: bool) -> int:
    """Spec id of a GraphDef passed as an argument (`f(graphdef, state, x)`): static, part
    of the compile key. A GraphDef holds the module's static attributes as they are: a
    list or dict attribute is the module's own, so `model.features.append(...)` after
    `nnx.split` changes the GraphDef in place (nnx.jit and jax.jit then keep computing
    with the old value). Such a GraphDef is keyed by value and compared on every call with
    a copy taken when it was keyed; one with hashable statics only, by itself."""
    known = known_graphdef(graphdef)
    if known is not None:
        return known
    if _has_mutable_statics(graphdef):
        snapshot = _copy_unhashable(graphdef)
        try:
            key = ("graphdef by value", _freeze(graphdef))
            spec = _interned(key)
            if spec is None:
                spec = intern(_flatten_generic(snapshot, arg_name, trace_scalars)[0], key)
        except TypeError as err:
            raise _static_error(arg_name, err) from None
    else:
        snapshot, spec = None, _flatten_generic(graphdef, arg_name, trace_scalars)[0]
    if len(_graphdefs) >= _MAX_GRAPHDEFS:
        _graphdefs.clear()
    _graphdefs[id(graphdef)] = _fast.KnownGraphdef(graphdef, snapshot, spec.id, spec)
    return spec.id


known_graphdef = _fast.known_graphdef


def graphdef_by_value(graphdef: Any) -> Any:
    """For a GraphDef met inside another argument (`f((graphdef, x), state)`): its key by
    value where its statics can change in place (a list attribute, which
    `model.features.append(...)` changes after `nnx.split`), so that the argument is keyed
    by the value it has now, as `read_graphdef` keys one passed on its own; None where it
    cannot change."""
    return ("graphdef by value", _freeze(graphdef)) if _has_mutable_statics(graphdef) else None


def explain_graphdef(graphdef: Any) -> tuple[str, str]:
    """(what a GraphDef argument is to fastcall, what it costs per call), for `f.explain`."""
    if _has_mutable_statics(graphdef):
        return (
            "GraphDef holding lists or dicts (static, keyed by value)",
            "compared (==) with its copy taken when keyed: an in-place change is seen",
        )
    return "GraphDef (static, part of the compile key)", "one identity check once seen"


def _static_containers(graphdef: Any) -> list[Any] | None:
    """What a guard must watch so that the graph's static attributes that cannot be hashed
    (a list, a dict, a dataclass holding one: `self.config = config`) cannot change
    unseen: every list and dict in them, and the attribute dict of every dataclass, at any
    depth (through tuples too). A hashable part is taken as fixed, as every hashable static
    is (see docs/guarantees.md). None if one holds anything else that cannot be hashed (a
    set, an object of another kind): the graph is then walked on every call."""
    try:  # (every other part must be hashable: a Variable's metadata holding a list is not watched)
        hash((tuple(graphdef.nodes), tuple(a for a in graphdef.attributes if type(a[1]) is not graphlib.Static)))
    except TypeError:
        return None
    found: list[Any] = []
    seen: set[int] = set()
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static and _unwatchable(attr.value, found, seen, 0) is not _WATCHABLE:
            return None
    return found


_WATCHABLE = object()  # (what `_unwatchable` returns for a value a guard can watch)


def _unwatchable(x: Any, found: list[Any], seen: set[int], depth: int) -> Any:
    """The part of static value `x` that no guard can watch (a set, an object of another
    kind, a dataclass keeping a field out of its attribute dict, or `x` itself nested too
    deep), or `_WATCHABLE`; appends to `found` the lists, dicts and dataclass attribute
    dicts a guard must watch (`_static_containers`)."""
    try:
        hash(x)
        return _WATCHABLE
    except TypeError:
        pass
    if id(x) in seen:
        return _WATCHABLE
    if depth > 64:
        return x
    seen.add(id(x))
    t = type(x)
    if t is list or t is tuple or t is dict:
        if t is not tuple:
            found.append(x)
        for item in x.values() if t is dict else x:
            part = _unwatchable(item, found, seen, depth + 1)
            if part is not _WATCHABLE:
                return part
        return _WATCHABLE
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if isinstance(x, (list, tuple, dict)):
            return x  # (a dataclass that is also a container: its items are keyed too)
        attributes = _guard.Attributes(x)
        if not _guard.is_guardable(attributes):
            return x  # (no attribute dict to watch: slots)
        d = vars(x)
        if any(f.name not in d or hasattr(inspect.getattr_static(t, f.name, None), "__set__")
               for f in dataclasses.fields(x)):
            return x  # (a field kept out of the attribute dict: a slot, a descriptor)
        found.append(attributes)
        for item in vars(x).values():
            part = _unwatchable(item, found, seen, depth + 1)
            if part is not _WATCHABLE:
                return part
        return _WATCHABLE
    return x


def unwatchable_statics(obj: Any) -> list[str]:
    """Where `obj`'s graph holds what makes `_static_containers` refuse it, for `f.explain`:
    each static value holding a part no guard can watch ("tags holds a set", at every path
    that holds it), and each Variable whose metadata cannot be hashed."""
    graphdef, _ = graphlib.flatten(obj)
    refused = {}
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static:
            part = _unwatchable(attr.value, [], set(), 0)
            if part is not _WATCHABLE:
                refused[id(attr.value)] = part
    where = []
    for path, value in nnx.iter_graph(obj):  # (static values too, at each path that holds them)
        name = ".".join(map(str, path))
        if id(value) in refused:
            where.append(f"{name} holds {_describe_part(refused[id(value)])}")
        elif _is_variable(value):
            try:
                hash(tuple(_var_metadata(value).items()))
            except TypeError:
                where.append(f"{name} has metadata that cannot be hashed")
    return where


def _has_mutable_statics(graphdef: Any) -> bool:
    """Whether a static attribute in the GraphDef cannot be hashed (a list, a dict, a
    dataclass holding one: it may change in place)."""
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static:
            try:
                hash(attr.value)
            except TypeError:
                return True
    return False


_STATIC, _DYNAMIC = "static", "dynamic"  # TreeSpec.layout codes of a leaf that is not an NNX object


class TreeSpec:
    """Spec of an argument holding NNX objects inside a pytree (a tuple, list, dict,
    dataclass or nnx.State of modules or Variables): its structure with each NNX object
    as one leaf (what nnx.jit's `to_tree` splits on), and per leaf either an NNX object's
    NodeSpec or how a plain leaf is passed (`_DYNAMIC`: traced, `_STATIC`: part of the key)."""

    __slots__ = ("id", "kind", "treedef", "layout", "statics", "n_dyn", "cacheable", "templated", "mask",
                 "__weakref__")

    def __init__(self, treedef: Any, layout: tuple[Any, ...], statics: tuple[Any, ...]) -> None:
        self.id = -1
        self.kind = "nnx-tree"
        self.treedef = treedef
        self.layout = layout
        self.statics = statics
        self.n_dyn = sum(c.n_dyn if isinstance(c, NodeSpec) else c == _DYNAMIC for c in layout)
        self.mask = (True,) * self.n_dyn
        self.cacheable = False
        self.templated = True

    def nnx_objects(self) -> list[tuple[int, NodeSpec]]:
        """(offset of its first leaf, NodeSpec) per NNX object in the argument."""
        out, start = [], 0
        for code in self.layout:
            if isinstance(code, NodeSpec):
                out.append((start, code))
                start += code.n_dyn
            else:
                start += code == _DYNAMIC
        return out


def holds_nodes(value: Any) -> bool:
    """Whether `value` is an nnx.State, or a tuple, list or dict with an NNX object among
    its items (a cheap check that sends the common containers of NNX objects straight to
    `read_container`; deeper ones are found by the generic flatten)."""
    t = type(value)
    if t is tuple or t is list:
        return any(map(_is_node_fast, value))
    if t is dict:
        return any(map(_is_node_fast, value.values()))
    return t is nnx.State


def read_container(
    value: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any, trace_scalars: bool
) -> int:
    """`read_argument` for an argument holding NNX objects inside a pytree: each NNX
    object is read as if it were an argument of its own (in leaf order, so its ordinal
    among the call's NNX objects is the same at trace time); other leaves follow the
    call's rule (arrays, and with `trace_scalars` Python scalars, are traced)."""
    if joint is None and type(value) is nnx.State:
        # An nnx.State of Variables only (`nnx.split`'s): read and cached as one object, a
        # graph of its Variables (see `NodeSpec.values_only`).
        if cached(value) is not None:
            return _read_node(value, leaves, arg_name, nnx_args, None).id
        known = by_id.get(id(value))
        plain = _plain_state_read(value) if known is None or known.ref() is not value else None
        if plain is not None and plain.spec is not None:
            return _read_plain_state(value, plain, leaves, nnx_args).id
        if plain is not None or _plain_state(value):
            return _read_node(value, leaves, arg_name, nnx_args, None).id
    read_whole()
    items, treedef = jax.tree_util.tree_flatten(value, is_leaf=_is_node_fast)
    layout: list[Any] = []
    codes: list[Any] = []
    statics: list[Any] = []
    for x in items:
        if _is_node_fast(x):
            spec = _read_node(x, leaves, arg_name, nnx_args, joint)
            layout.append(spec)
            codes.append(spec.id)
        elif is_traced_leaf(x, trace_scalars):  # (a tracer too: the caller then steps aside)
            leaves.append(x)
            layout.append(_DYNAMIC)
            codes.append(_DYNAMIC)
        else:
            statics.append(x)
            layout.append(_STATIC)
            codes.append(_STATIC)
    try:
        key = ("nnx-tree", treedef, tuple(codes), tuple(_leaf_key(s) for s in statics))
        known = _interned(key)
        if known is not None:
            return known.id
        return intern(TreeSpec(treedef, tuple(layout), tuple(statics)), key).id
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} holds a static (non-array) value that "
            f"cannot be hashed or compared ({type(err).__name__}: {err}). Static values are "
            "part of the compile key: make them hashable, or wrap them in a JAX array."
        ) from None


def mixed_read(spec_id: int, nnx_args: Iterator[NnxArg]) -> _fast.MixedRead | None:
    """How the structure path reads again an argument `read_container` read under this
    spec (a TreeSpec: NNX objects beside other leaves in a pytree), taking its objects'
    NnxArgs from the iterator `nnx_args` (in the order the general path read them): each
    Variable as `variable_read` reads it, each other NNX object from its cache entry (as
    `readable_argument` allows), each static value if its identity (or a scalar's value)
    fixes it (`_fast.static_read`); None if one cannot be read so."""
    spec = spec_by_id(spec_id)
    if not isinstance(spec, TreeSpec):
        return None
    statics = iter(spec.statics)
    layout: list[Any] = []
    for code in spec.layout:
        if code == _DYNAMIC:
            layout.append(None)
        elif code == _STATIC:
            static = _fast.static_read(spec_id, next(statics))
            if static is None:
                return None
            layout.append(static)
        else:
            arg = next(nnx_args, None)
            if arg is None:
                return None
            if arg.entry is None:
                variable = variable_read(arg, code.id)
                if variable is None:
                    return None
                layout.append(variable)
            elif readable_argument(arg, code.id):
                layout.append(code.id)
            else:
                return None
    return _fast.MixedRead(spec_id, jax.tree_util.default_registry.flatten, node_test(), spec.treedef, tuple(layout))


def _plain_state(state: Any) -> bool:
    """Whether an nnx.State holds Variables only (in its dicts and nested States, at any
    depth): no module (which keeps its graph updates), no raw leaf (which nnx.jit does not
    write back)."""
    return all(map(_is_variable, jax.tree_util.tree_leaves(state, is_leaf=_is_node_fast)))


def read_as_one_object(state: Any) -> bool:
    """Whether `read_container` reads this nnx.State as one NNX object (cached, or of
    Variables only), not as a container of its NNX objects."""
    return cached(state) is not None or _plain_state(state)


def overlapping(nnx_args: list[NnxArg]) -> bool:
    """Whether any two of these NNX objects share a node or Variable (cached per pair
    of cache entries)."""
    entries = [arg.entry for arg in nnx_args if arg.entry is not None]
    if len(entries) < len(nnx_args):
        # Some read afresh (a Variable on its own: one id): their ids against each other's,
        # then against each entry's set (`isdisjoint` walks the smaller set: not the model)
        seen: set[int] = set()
        for arg in nnx_args:
            if arg.entry is None:
                if not seen.isdisjoint(arg.ids):
                    return True
                seen.update(arg.ids)
        if any(not entry.node_ids.isdisjoint(seen) for entry in entries):
            return True
    for i, a in enumerate(entries):
        for b in entries[i + 1 :]:
            known = a.disjoint.get(id(b))
            if known is None or known[0]() is not b:
                known = (weakref.ref(b), a.node_ids.isdisjoint(b.node_ids))
                a.disjoint[id(b)] = known
                b.disjoint[id(a)] = (weakref.ref(a), known[1])  # (C looks in one order only)
            if not known[1]:
                return True
    return False


def joint_index() -> Any:
    return graphlib.RefMap()


def explain_node(obj: Any) -> tuple[str, str]:
    """(what an NNX argument is to fastcall, what it costs per call), for `f.explain`."""
    if _is_variable(obj):
        if type(raw_value(obj)) is not ArrayImpl or _variable_key(obj) is None or obj.get_metadata().get("hijax"):
            return (
                "NNX Variable on its own, with unhashable metadata or a value that is not a jax array",
                "a graph walk every call (nnx.jit's cost)",
            )
        return (
            "NNX Variable on its own (no cache entry: it cannot be weakly referenced)",
            "its type and metadata compared with the recorded ones (they select the program), its value read",
        )
    entry = by_id.get(id(obj))
    if entry is None or entry.ref() is not obj:
        plain = _plain_state_read(obj) if type(obj) is nnx.State else None
        if plain is not None and plain.spec is not None:
            return (
                "nnx.State of Variables only, new, of a structure read before",
                "read by its pytree flatten, as jax.jit reads it (no graph walk): each Variable's "
                "type and metadata compared with the structure's",
            )
        return "NNX object, not read yet", "read on its first call"
    if entry.provisional:
        return (
            "NNX object read once, holding plain lists or dicts",
            "read again on its next call, watched from then on (an object passed once is not walked for them)",
        )
    if entry.stale:
        return "NNX object whose structure changed", "re-read on its next call, then cached again"
    if entry.rebuilt:
        return (
            "NNX object rebuilt in place by NNX (the graph update of nnx.jit or another NNX transform)",
            "its nodes' attributes compared with the last read on its next call (no graph walk if they are the same; "
            "else re-read)" if entry.layout is not None else "re-read on its next call, then cached again",
        )
    if entry.volatile:
        if not TRUSTED:
            why = "the structure hooks are not verified on this flax"
        elif entry.spec.mutable_statics:
            where = "; ".join(unwatchable_statics(obj)) or "not found where"
            why = (
                "a mutable static attribute holding what a guard cannot watch (a set, an object that is "
                f"not a list, dict or dataclass), or a Variable with unhashable metadata: {where}; its graph "
                "is walked and compared by value. For the fast path, keep hashable values there (a tuple, "
                "a frozenset, a frozen dataclass)"
            )
        else:
            why = "a container in its graph that cannot be guarded, or a raw leaf fastcall cannot address"
        return f"NNX object re-read on every call ({why})", "a graph walk (nnx.jit's cost)"
    n = sum(len(w.expected) for w in entry.guard) if entry.guard else 0
    checks = f", {n} list/dict item identity checks" if entry.guard else ""
    kind = "NNX object, structure cached" + (" (guarded lists/dicts)" if entry.guard else "")
    if not entry.direct:
        kind += "; raw arrays inside plain lists/dicts keep it on the general path"
    n_leaves = len(entry.items)
    return kind, f"{n_leaves} leaf value{'' if n_leaves == 1 else 's'} read{checks}"


def _describe_part(part: Any) -> str:
    kind = type(part).__name__
    return f"an {kind}" if kind[:1].lower() in "aeiou" else f"a {kind}"


def describe_node(obj: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """An NNX object's graphdef (what a recompile explanation compares; written out only
    if it differs) and (path, value) for each of its leaves, from one graph walk."""
    graphdef, flat = graphlib.flatten(obj, with_paths=True)
    return graphdef, _named(flat)


def named_leaves(obj: Any) -> list[tuple[str, Any]]:
    """(path, value) for every leaf of an NNX object (to name a deleted array)."""
    return _named(graphlib.flatten(obj, with_paths=True)[1])


def _named(flat: Any) -> list[tuple[str, Any]]:
    return [
        ("." + ".".join(map(str, p)), v.get_raw_value() if isinstance(v, Variable) else v)
        for p, v in zip(flat.paths, flat.leaves)
    ]


def leaf_names(spec: Any, name: str) -> list[str] | None:
    """One name per leaf an argument of this spec passes, as jax.jit names a module's
    leaves (`model.linear.kernel.value`, `model.layers[0].bias.value`), for jax's errors
    (`_debug_names`); None where they cannot be told (an object read jointly with
    another argument passes only some of its leaves)."""
    if isinstance(spec, NodeSpec):
        return None if spec.joint else _node_leaf_names(spec, name)
    names: list[str] = []
    tree_names = _debug_names.tree_leaf_names(
        spec.treedef, [code != _STATIC for code in spec.layout], spec.statics, name
    )
    if tree_names is None:
        return None
    for code, where in zip((c for c in spec.layout if c != _STATIC), tree_names):
        if code == _DYNAMIC:
            names.append(where)
        else:
            inner = None if code.joint else _node_leaf_names(code, where)
            if inner is None:
                return None
            names.extend(inner)
    return names


def _node_leaf_names(spec: NodeSpec, name: str) -> list[str] | None:
    """The paths of an NNX object's leaves, from its graphdef: the object rebuilt around
    stand-in values and flattened again (the order in which it passes its leaves)."""
    stand_ins = [_debug_names.Leaf() for _ in range(spec.n_dyn)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a Variable type may warn about its value)
        try:
            node = graphlib.unflatten(spec.graphdef, stand_ins, index_ref=graphlib.IndexMap())
            flat = graphlib.flatten(node, with_paths=True)[1]
        except Exception:
            return None
    if len(flat.leaves) != spec.n_dyn:
        return None
    out = []
    for path, leaf in zip(flat.paths, flat.leaves):
        steps = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        out.append(name + steps + (".value" if isinstance(leaf, Variable) else ""))
    return out


# --------------------------------------------------------------------------
# Inside the trace


def _may_hold_container(node_def: Any) -> bool:
    """Whether a node of a graphdef may be a plain list or dict (or another pytree node that
    can change in place): anything but a graph node, a Variable, and the leafless pytree
    nodes NNX keeps per object (its `PytreeState`)."""
    t = getattr(node_def, "type", None)
    if t is nnx.State:
        return True  # (its dict can change in place: `state["kernel"] = ...`)
    if not isinstance(t, type) or is_node_type(t) or t is tuple or t is type(None):
        return False  # (a tuple's items are nodes of their own: it cannot change in place)
    if t is getattr(graphlib, "GenericPytree", None):
        try:
            treedef = node_def.metadata[1]
            inner = treedef.node_data()
            if inner is None:
                return True
            if treedef.num_nodes == treedef.num_leaves + 1 and issubclass(inner[0], tuple):
                return False  # (a namedtuple, whose items are nodes of their own)
            return not (
                treedef.num_leaves == 0
                and treedef.num_nodes == 1
                and not issubclass(inner[0], (list, dict, collections.abc.MutableMapping))
            )
        except Exception:
            return True
    return True


class NodeSpec:
    """Spec of an NNX argument (duck-types `_flatten.Spec` for the parts the compiled
    function uses): its graphdef; its leaves are all dynamic."""

    __slots__ = (
        "id", "kind", "graphdef", "n_dyn", "cacheable", "templated", "mask", "joint", "mutable_statics",
        "frozen", "has_containers", "has_shared", "values_only", "__weakref__",
    )

    def __init__(self, graphdef: Any, n: int, joint: bool = False) -> None:
        self.id = -1
        # Static attributes that can change in place (a list, a dict, a dataclass holding
        # one): the spec is keyed by value (`frozen`: the graphdef frozen, see `_freeze`),
        # and the object's entry watches them with a guard (`_static_containers`), or, where
        # none can, the object's graph is walked and compared by value on every call.
        self.mutable_statics = False
        self.frozen: Any = None
        self.joint = joint  # flattened together with the call's earlier NNX arguments
        self.kind = "nnx"
        self.graphdef = graphdef
        self.n_dyn = n
        self.mask = (True,) * n
        self.cacheable = False
        self.templated = True
        # plain lists, dicts or other pytree nodes inside the graph (`nnx.data([...])`)
        nodes = getattr(graphdef, "nodes", None)
        self.has_containers = nodes is None or any(map(_may_hold_container, nodes))
        # an object reached by two paths (a shared Variable or submodule: a NodeRef)
        self.has_shared = nodes is None or any(type(n) is graphlib.NodeRef for n in nodes)
        # An nnx.State: a pytree to nnx.jit, which gives back only the new values of its
        # Variables (a Variable replaced in it, a key added or a raw leaf rebound inside
        # the function stay inside).
        self.values_only = nodes is not None and len(nodes) > 0 and getattr(nodes[0], "type", None) is nnx.State

    def nnx_objects(self) -> list[tuple[int, NodeSpec]]:
        return [(0, self)]


_ARG_STRIDE = 1 << 32  # outer indices of NNX argument k are k * _ARG_STRIDE + index


class _Traced:
    """One NNX argument inside the trace: the rebuilt node and its leaves before the call."""

    __slots__ = ("node", "spec", "inner", "paths", "owners", "given", "index_ref", "name", "state_treedef", "metadata")

    def __init__(self, node_spec: NodeSpec, given: Any, shared_index: Any, name: str) -> None:
        self.spec = node_spec
        self.name = name
        self.given = list(given)
        # graphdef index -> object rebuilt here
        self.index_ref = shared_index if node_spec.joint else graphlib.IndexMap()
        graphdef = node_spec.graphdef
        if node_spec.mutable_statics:  # (the function may change them in place: not the spec's)
            graphdef = _copy_unhashable(graphdef)
        self.node = graphlib.unflatten(graphdef, list(given), index_ref=self.index_ref)
        # an nnx.State's pytree structure as given, Variables as leaves (see `_twins`)
        self.state_treedef = (
            jax.tree_util.tree_structure(self.node, is_leaf=_is_node_fast) if type(self.node) is State else None
        )
        self.inner: list[Any] = []  # the leaves (Variables, raw values) before the call
        self.paths: list[Any] = []  # and their paths
        self.owners: list[Any] = []  # and the object holding each (None: not found)
        self.metadata: list[Any] = []  # and each Variable's metadata (a copy; None: a raw leaf)

    def metadata_changed(self) -> list[tuple[int, dict[str, Any]]]:
        """(leaf index, its metadata now) for each Variable given whose metadata the
        function changed in place (`v.set_metadata(...)` inside)."""
        out = []
        for i, (v, before) in enumerate(zip(self.inner, self.metadata)):
            now = v.get_metadata() if before is not None else None
            if now is not None and now != before:
                out.append((i, dict(now)))
        return out

    def writes(
        self, after: list[Any] | None, everything: bool, replace: bool, raw: bool = True, alive: Any = None
    ) -> list[tuple[int, Any, bool]]:
        """(leaf index, new value, whether its Variable was replaced) for every leaf the
        function changed (or, with `everything`, every leaf), given the leaves `after` the
        call if the graphdef is the same (raw leaves at the same places, Variables of the
        same types; None if not: then only the given Variables' values are compared).
        `replace`: a Variable replaced by a new one is written as such (graph updates);
        `raw`: raw leaves rebound are written too; `alive`: if given, the ids of the
        objects in the argument after the call, the only Variables written."""
        out = []
        for i, (v, given) in enumerate(zip(self.inner, self.given)):
            now = v if after is None else after[i]
            if isinstance(v, Variable) and now is not v and replace:
                value = now.get_raw_value()
                # (a new Variable holding a mutable array reference made in the trace, under
                # `nnx.var_defaults(ref=True)`: its value goes out; the caller's new Variable,
                # made as its metadata says, holds a reference of its own, as under nnx.jit)
                out.append((i, value[...] if is_array_ref(value) else value, True))
                continue
            # (without graph updates, a Variable the function replaced still gives back the
            # value it has now: it may have been changed before being moved or dropped)
            if isinstance(v, Variable) and alive is not None and id(v) not in alive:
                continue
            if isinstance(v, Variable):
                new = v.get_raw_value()
                if new is given and is_array_ref(new):
                    continue  # (a mutable array reference: jax changes the caller's in place)
                # A non-array value (a dict of arrays, ...) may have changed in place:
                # always written back.
                if everything or new is not given or not isinstance(new, jax.Array):
                    out.append((i, new, False))
            elif raw and (everything or now is not v) and not is_array_ref(now):
                # a raw leaf rebound (`self.count += 1`); (a mutable array reference is
                # changed in place through jax, and cannot be returned)
                out.append((i, now, False))
        return out


class NnxOutputs(NamedTuple):
    """What a compiled entry's NNX arguments need after each call (decided at trace time).

    The entry's flat outputs end with `n_written` extra leaves: first the leaves of
    each restructured argument, then the new value of each written Variable."""

    writes: tuple[tuple[int, int], ...]  # (NNX argument ordinal, leaf index) per written Variable
    restructure: tuple[tuple[int, Any, int], ...]  # (ordinal, new graphdef, number of leaves)
    has_nodes: bool  # the output holds NNX object markers to turn back into objects
    inner_nodes: tuple[int, ...]  # outer indices of the arguments' sub-objects returned
    n_written: int
    # the writes whose Variable the function replaced by a new one: the caller's object
    # gets a new Variable (same type and metadata) holding the value
    replaced: frozenset[tuple[int, int]] = frozenset()
    joint: bool = False  # the arguments were flattened jointly (one index space)
    links_outer: bool = False  # a new object returned holds objects of the arguments
    # new objects returned (`_NewNode` markers: pytree nodes of the output, not statics)
    new_objects: bool = True
    # nnx.States returned holding the very Variables of an nnx.State argument, in the same
    # pytree structure (a functional loop's `return loss, nnx.state(...)`): (where in the
    # output: None for the output itself, else its index in the output tuple or list; the
    # argument's ordinal). Each call gives each such State a cache entry (`twin_states`).
    twins: tuple[tuple[int | None, int], ...] = ()
    # without graph updates: (ordinal, leaf index, metadata) of each Variable given whose
    # metadata the function changed in place, set on the caller's Variable after each call
    metadata: tuple[tuple[int, int, dict[str, Any]], ...] = ()
    # new Variables returned on their own, as `_FreshVariable` nodes: the output is built
    # from the entry's own treedef (`OutInfo.result`), which holds them; jax's output tree
    # would not keep them (it re-flattens its first output, where they are Variables, by
    # flax's pytree node, which rebuilds the metadata sorted)
    fresh: bool = False


class TracedInputs:
    """The NNX arguments of one trace: rebuilt before the function runs, compared after."""

    def __init__(self) -> None:
        self.args: list[_Traced] = []
        self.shared_index = graphlib.IndexMap()  # for NNX arguments flattened jointly

    def rebuild(self, spec: NodeSpec, segment: Any, name: str) -> Any:
        t = _Traced(spec, segment, self.shared_index, name)
        self.args.append(t)
        return t.node

    def rebuild_tree(self, spec: TreeSpec, segment: Any, name: str) -> Any:
        """The container argument of `spec`, each NNX object in it rebuilt (in leaf order)."""
        items: list[Any] = []
        statics = iter(spec.statics)
        pos = 0
        for code in spec.layout:
            if code == _STATIC:
                items.append(next(statics))
            elif code == _DYNAMIC:
                items.append(segment[pos])
                pos += 1
            else:
                items.append(self.rebuild(code, segment[pos : pos + code.n_dyn], name))
                pos += code.n_dyn
        return spec.treedef.unflatten(items)

    def _flatten_all(self) -> list[tuple[Any, Any]]:
        """(graphdef, flat state) per argument, joint ones sharing one RefMap (as given)."""
        shared = graphlib.RefMap()
        out = []
        for t in self.args:
            ref_index = shared if t.spec.joint else None
            out.append(graphlib.flatten(t.node, with_paths=True, ref_index=ref_index))
        return out

    def snapshot(self) -> None:
        for t, (_, flat) in zip(self.args, self._flatten_all()):
            t.inner, t.paths = list(flat.leaves), list(flat.paths)
            t.owners = [_owner(t.node, path) for path in t.paths]
            t.metadata = [dict(v.get_metadata()) if _is_variable(v) else None for v in t.inner]

    def outputs(
        self, out: Any, graph_updates: bool, refuse_aliasing: bool, everything: list[bool], shardings: list[Any]
    ) -> tuple[Any, NnxOutputs | None, list[Any]]:
        """After the function returned `out`: (out with NNX objects replaced by markers,
        what to do after each call or None, the extra leaves to return). Per argument:
        `everything`, write back every Variable (not only the changed ones); `shardings`,
        one sharding per leaf (or None) that written values are constrained to."""
        writes: list[tuple[int, int]] = []
        written: list[Any] = []
        replaced: list[tuple[int, int]] = []
        restructured: list[Any] = []
        restructure: list[tuple[int, Any, int]] = []
        metadata: list[tuple[int, int, dict[str, Any]]] = []
        flattened = self._flatten_all()
        changed = [self._changed(t, graphdef, list(flat.leaves), out, flattened)
                   for t, (graphdef, flat) in zip(self.args, flattened)]
        # (the arguments only where the call's changes to their graphs are propagated: graph
        # mode with graph updates, as nnx.jit checks them)
        _refuse_outer_variables(
            out, [] if refuse_aliasing else [(t.name, flat) for t, (_, flat) in zip(self.args, flattened)]
        )
        joint = bool(self.args) and self.args[0].spec.joint  # (jointly: all of a call's arguments, or none)
        if joint and any(changed):
            # Arguments that share objects are restructured together, in one index space,
            # as they were read (a change made through one is seen through the others).
            changed = [True] * len(self.args)
        # Every graph flattened for the caller (restructured arguments, then new objects
        # returned) shares one index, so that an object both put in an argument and
        # returned comes back as one object; objects the function was given are named by
        # their outer index, so the caller's own objects are updated and linked.
        inner_ref = graphlib.RefMap()
        outer_index = self._outer_index_map()
        outer_ref = outer_index if graph_updates and not refuse_aliasing else None
        for ordinal, (t, (graphdef, flat)) in enumerate(zip(self.args, flattened)):
            if changed[ordinal] and graph_updates and not t.spec.values_only:
                # (without graph updates, as nnx.jit: values only)
                new_graphdef, new_flat = graphlib.flatten(
                    t.node, with_paths=True, ref_index=inner_ref, ref_outer_index=outer_ref
                )
                leaves = list(new_flat.leaves)
                if shardings[ordinal] is not None:  # each new leaf gets its path's in_sharding
                    by_path = dict(zip(map(tuple, t.paths), shardings[ordinal]))
                    leaves = [_constrained(leaf, by_path.get(tuple(p))) for p, leaf in zip(new_flat.paths, leaves)]
                restructure.append((ordinal, new_graphdef, len(leaves)))
                restructured += leaves
                continue
            after = list(flat.leaves)
            same_graph = graphdef == t.spec.graphdef and len(after) == len(t.inner)
            per_leaf = shardings[ordinal]
            aligned = after if same_graph else None
            values_only = t.spec.values_only
            # (an nnx.State, with graph updates: as nnx.jit, a Variable no longer in it after
            # the call gives nothing back)
            alive = {id(a) for a in after} if values_only and graph_updates else None
            for index, value, new_variable in t.writes(aligned, everything[ordinal], graph_updates and not values_only,
                                                       raw=not values_only, alive=alive):
                if per_leaf is not None and per_leaf[index] is not None:
                    value = jax.lax.with_sharding_constraint(value, per_leaf[index])
                writes.append((ordinal, index))
                written.append(value)
                if new_variable:
                    replaced.append((ordinal, index))
            if not graph_updates:
                # (as nnx.jit without graph updates, which writes each changed Variable back
                # whole with `update_from_state`: metadata changed in place inside too)
                metadata += [(ordinal, index, now) for index, now in t.metadata_changed()]
        twins = self._twins(out, {k for k, _ in replaced} | {k for k, _, _ in restructure}) if not joint else ()
        out, marks = self._mark_nodes(out, refuse_aliasing, inner_ref, outer_index, outer_ref)
        extra = restructured + written
        if not (writes or restructure or marks.found or metadata or marks.fresh):
            return out, None, []
        nnx_out = NnxOutputs(
            tuple(writes), tuple(restructure), marks.found, marks.sub_objects, len(extra), frozenset(replaced),
            joint, marks.links_outer, marks.new_objects, twins, tuple(metadata), marks.fresh,
        )
        return out, nnx_out, extra

    def _twins(self, out: Any, changed: set[int]) -> tuple[tuple[int | None, int], ...]:
        """`NnxOutputs.twins`: the nnx.States in `out` (itself, or an item of a tuple or
        list) holding exactly the Variables of an nnx.State argument whose Variables stay
        the caller's (`changed`: the ordinals of arguments restructured or with a Variable
        replaced), in its flatten order and pytree structure as given."""
        if type(out) is State:
            places: list[tuple[int | None, Any]] = [(None, out)]
        elif type(out) in (tuple, list):
            places = [(i, x) for i, x in enumerate(out) if type(x) is State]
        else:
            return ()

        def same(a: tuple[list[Any], Any], t: _Traced) -> bool:
            variables, treedef = a
            return (
                treedef == t.state_treedef and len(variables) == len(t.inner)
                and all(x is y for x, y in zip(variables, t.inner)) and all(map(_is_variable, variables))
            )

        # (the argument itself as it was given: each of its Variables is then still in it,
        # and returned as the caller's own)
        unchanged = [
            t.state_treedef is not None and ordinal not in changed
            and same(jax.tree_util.tree_flatten(t.node, is_leaf=_is_node_fast), t)
            for ordinal, t in enumerate(self.args)
        ]
        twins = []
        for position, state in places:
            flat = jax.tree_util.tree_flatten(state, is_leaf=_is_node_fast)
            ordinal = next((k for k, t in enumerate(self.args) if unchanged[k] and same(flat, t)), None)
            if ordinal is not None:
                twins.append((position, ordinal))
        return tuple(twins)

    def _changed(self, t: _Traced, graphdef: Any, after: list[Any], out: Any, flattened: list[Any]) -> bool:
        """Whether the function changed the structure of argument `t` (given its graphdef
        and leaves `after` the call): another graphdef, or a raw leaf that is no longer an
        array. The same graphdef with a raw leaf rebound to another array is a value
        written back; with a Variable replaced by a new one (of the same type and
        metadata: the graphdef says so), a Variable replaced in the caller's object
        (`self.loss = Loss(...)` on every call), unless that cannot be done alone: the new
        Variable is one the function was given (by any argument: a Variable moved keeps
        its identity), it sits in more than one place, the graph shares objects (a shared
        old Variable is reached by other paths too), or the output holds NNX objects."""
        if graphdef != t.spec.graphdef or len(after) != len(t.inner):
            return True
        if any(not isinstance(a, (jax.Array, Variable)) for a, b in zip(after, t.inner) if a is not b):
            return True
        replaced = [i for i, (a, b) in enumerate(zip(after, t.inner)) if a is not b and isinstance(a, Variable)]
        if not replaced:
            return False
        if t.spec.has_shared or self._returns_nodes(out):
            return True
        # (the same graphdef, but a submodule replaced by a new one of the same structure:
        # its Variables are new, and their owner too)
        if any(t.owners[i] is None or _owner(t.node, t.paths[i]) is not t.owners[i] for i in replaced):
            return True
        new_variables = [after[i] for i in replaced]
        given_ids = {id(v) for u in self.args for v in u.inner}
        new_places = collections.Counter(
            id(a)
            for u, (_, flat) in zip(self.args, flattened)
            for a, b in zip(flat.leaves, u.inner)
            if a is not b and isinstance(a, Variable)
        )
        return any(id(a) in given_ids or new_places[id(a)] > 1 for a in new_variables)

    @staticmethod
    def _returns_nodes(out: Any) -> bool:
        return any(_is_node(x) for x in jax.tree_util.tree_leaves(out, is_leaf=_is_node))

    def _outer_index_map(self) -> Any:
        """object rebuilt here -> its outer index (`outer_objects` gives the caller's
        object at each), over every NNX argument of the call."""
        refmap = graphlib.RefMap()
        for ordinal, t in enumerate(self.args):
            base = _outer_base(ordinal, t.spec.joint)
            for index, obj in t.index_ref.items():
                refmap[obj] = base + index
        return refmap

    def _mark_nodes(
        self, out: Any, refuse_inputs: bool, inner_ref: Any, outer_index: Any, outer_ref: Any
    ) -> tuple[Any, _Marks]:
        """Replace NNX objects in the output by markers. `refuse_inputs`: an input returned
        is an error (nnx.jit without graph updates). `outer_index`: each object the
        function was given (rebuilt in the trace) -> its outer index. New objects are
        flattened into `inner_ref` (after the restructured arguments, and rebuilt outside in
        the same order into one index), so that objects returned twice, or shared, stay one
        object; with `outer_ref`, objects of the arguments inside them are named by outer
        index."""
        marks = _Marks()
        # Every object of every input, for nnx.jit's refusal of inputs returned (aliasing).
        input_ids = {id(obj) for t in self.args for obj in t.index_ref.values()} if refuse_inputs else set()
        sub_objects: list[int] = []
        after: list[set[int]] = []

        def reachable() -> set[int]:
            """ids of every object in the arguments as they are after the call."""
            if not after:
                refmap = graphlib.RefMap()
                for t in self.args:
                    graphlib.flatten(t.node, with_paths=False, ref_index=refmap)
                after.append({id(obj) for obj in refmap})
            return after[0]

        loose = self._loose_variables(out, outer_index, inner_ref)

        def mark(x: Any) -> Any:
            if not _is_node(x):
                return x
            if id(x) in loose:
                marks.fresh = True
                return _FreshVariable(type(x), tuple(_var_metadata(x).items()), raw_value(x))
            marks.found = True
            if refuse_inputs and id(x) in input_ids:
                raise aliasing_error("both an input and an output")
            for k, t in enumerate(self.args):
                if x is t.node:
                    return _InputNode(k)
            # A sub-object of an argument still in one after the call: the caller's, whose
            # state is written back with the argument's. One the function detached is
            # flattened as a new object would be, linked to the caller's (its state comes
            # back with it).
            if x in outer_index and (outer_ref is None or id(x) in reachable()):
                sub_objects.append(outer_index[x])
                return _InputNode(-1, outer_index[x])
            graphdef, values = graphlib.flatten(x, with_paths=False, ref_index=inner_ref, ref_outer_index=outer_ref)
            if refuse_inputs and any(id(obj) in input_ids for obj in inner_ref):
                raise aliasing_error("both an input and an output (inside a new object)")
            marks.links_outer = marks.links_outer or _refers_outside(graphdef)
            marks.new_objects = True
            return _NewNode(graphdef, list(values))

        marked = jax.tree_util.tree_map(mark, out, is_leaf=_is_node)
        marks.sub_objects = tuple(sub_objects)
        return marked, marks

    @staticmethod
    def _loose_variables(out: Any, outer_index: Any, inner_ref: Any) -> frozenset[int]:
        """The ids of the Variables in `out` that the output's build makes anew after each
        call, from the `_FreshVariable` nodes put in their place (what the graph rebuild of
        a new Variable holding an array does: its type, metadata and value): those the
        function made (none of the arguments' objects, none put into a restructured
        argument), each returned once, holding an array, in an output holding no other NNX
        object (which might hold one). A returned `nnx.split` State of new Variables (a
        training step's `params`) then costs what jax.jit's output costs."""
        nodes = [x for x in jax.tree_util.tree_leaves(out, is_leaf=_is_node) if _is_node(x)]
        if not nodes or not all(map(_is_variable, nodes)):
            return frozenset()
        ids = frozenset(map(id, nodes))
        if len(ids) != len(nodes):
            return frozenset()
        for v in nodes:
            if (
                v in outer_index or v in inner_ref or not isinstance(raw_value(v), jax.Array)
                or _var_metadata(v).get("hijax")
                or not _own_maker(type(v))
            ):
                return frozenset()
        return ids


def _refuse_outer_variables(out: Any, arguments: list[tuple[str, Any]]) -> None:
    """Refuse, as nnx.jit does, a Variable made outside the trace (one the function closes
    over) returned, or put into an argument (`arguments`: each one's name and its graph as
    flattened after the call, where its changes are propagated): what comes back would be a
    copy made after the call, not that Variable, and its changes would be lost. (Trace time
    only.)"""
    places: list[tuple[str, Any]] = []
    try:
        places.append(("the output", [(path, v) for path, v in graphlib.iter_graph(out) if _is_variable(v)]))
    except Exception:  # (an output that cannot be walked: its flatten names the error)
        pass
    for name, flat in arguments:
        places.append((f"argument {name}", [(path, v) for path, v in zip(flat.paths, flat.leaves) if _is_variable(v)]))
    for where, found in places:
        for path, v in found:
            if getattr(v, "hijax", False):  # (read through: a hijax Variable in a trace forwards)
                continue
            trace_state = getattr(v, "_trace_state", None)
            if trace_state is None or trace_state.is_valid():
                continue
            at = "".join(f"[{k!r}]" for k in path) or " itself"
            raise ValueError(
                f"fastcall.jit: {where}{' at ' + at if path else at} holds a {type(v).__name__} made outside "
                "this function's trace (a Variable it closes over, say); nnx.jit refuses it too (\"Cannot "
                "extract graph node from different trace level\"). Pass the Variable (or the object holding "
                "it) as an argument, or make a new one inside the function."
            )


def _owner(root: Any, path: Any) -> Any:
    """The object holding the leaf at `path` of `root`'s graph (None if it cannot be found)."""
    node = root
    try:
        for key in path[:-1]:
            node = _child(node, key)
    except Exception:
        return None
    return node


class _Marks:
    """What `_mark_nodes` found in an output."""

    __slots__ = ("found", "sub_objects", "links_outer", "new_objects", "fresh")

    def __init__(self) -> None:
        self.found = False  # any NNX object marked (a `_FreshVariable` is not: see `fresh`)
        self.fresh = False  # any new Variable returned on its own (a `_FreshVariable`)
        self.new_objects = False  # any new one
        self.sub_objects: tuple[int, ...] = ()  # outer indices of the arguments' sub-objects returned
        self.links_outer = False  # a new object holds an object of the arguments


def _outer_base(ordinal: int, joint: bool) -> int:
    """The outer index of graph index 0 of NNX argument `ordinal` (arguments flattened
    jointly share one index space)."""
    return 0 if joint else ordinal * _ARG_STRIDE


def _refers_outside(graphdef: Any) -> bool:
    """Whether a graphdef flattened with an outer index names an object given by the caller."""
    for node in getattr(graphdef, "nodes", ()):
        if getattr(node, "outer_index", None) is not None:
            return True
        if getattr(getattr(node, "array_refdef", None), "outer_index", None) is not None:
            return True
    return False


def aliasing_error(where: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: duplicate NNX Variable found at paths in {where}. As nnx.jit, fastcall "
        "does not support Variable aliasing in tree mode (graph=False: a Variable in two arguments, or an "
        "input Variable returned) and without graph updates (graph_updates=False: an input "
        "Variable returned): remove the duplicate, use nnx.clone(), or pass graph=True and "
        "graph_updates=True."
    )


def _constrained(leaf: Any, sharding: Any) -> Any:
    """`leaf` (a Variable or a raw value, inside a trace) constrained to `sharding`."""
    if sharding is None:
        return leaf
    if isinstance(leaf, Variable):
        leaf.set_raw_value(jax.lax.with_sharding_constraint(leaf.get_raw_value(), sharding))
        return leaf
    if isinstance(leaf, jax.Array):
        return jax.lax.with_sharding_constraint(leaf, sharding)
    return leaf


class _InputNode:
    """Output marker: the function returned its k-th NNX argument (`outer` None), or the
    object at outer index `outer` of its arguments (a submodule, a Variable): the caller's
    own object is returned."""

    __slots__ = ("k", "outer")

    def __init__(self, k: int, outer: int | None = None) -> None:
        self.k = k
        self.outer = outer

    def __eq__(self, other: object) -> bool:
        return type(other) is _InputNode and (other.k, other.outer) == (self.k, self.outer)

    def __hash__(self) -> int:
        return hash((_InputNode, self.k, self.outer))


class _NewNode:
    """Output marker: an NNX object created by the function, rebuilt outside from its values."""

    __slots__ = ("graphdef", "values")

    def __init__(self, graphdef: Any, values: list[Any]) -> None:
        self.graphdef = graphdef
        self.values = values


jax.tree_util.register_pytree_node(
    _NewNode, lambda n: (n.values, n.graphdef), lambda gd, vals: _NewNode(gd, list(vals))
)


class _FreshVariable:
    """Output marker: a new Variable returned on its own (`TracedInputs._loose_variables`),
    a pytree node whose unflatten makes the Variable itself, as NNX's graph rebuild makes it
    (its type's `from_metadata`, Variable's own, which for a Variable that is not hijax is
    its `_new`: its type, its metadata in the order it had, its value). Built from the
    entry's own output tree (`NnxOutputs.fresh`). (Not flax's pytree node for a Variable,
    which rebuilds the metadata sorted.)"""

    __slots__ = ("kind", "metadata", "value")

    def __init__(self, kind: type, metadata: tuple[tuple[str, Any], ...], value: Any) -> None:
        self.kind = kind
        self.metadata = metadata
        self.value = value


def _fresh_variable(aux: tuple[Any, tuple[tuple[str, Any], ...]], children: Any) -> Any:
    kind, metadata = aux  # (a Variable type)
    return kind._new(children[0], dict(metadata))


jax.tree_util.register_pytree_node(_FreshVariable, lambda n: ((n.value,), (n.kind, n.metadata)), _fresh_variable)


# --------------------------------------------------------------------------
# After the call


def write_back(nnx_out: NnxOutputs, written: Any, nnx_args: list[NnxArg]) -> _Link | None:
    """Apply structural changes and write changed Variables back to the caller's objects.
    Returns the `_Link` that output markers are resolved through (None: none needed)."""
    if written and isinstance(written[0], jax.core.Tracer):  # all outputs are tracers, or none
        raise FastcallError(
            "fastcall.jit: the function changes NNX state (Variables), but it was "
            "called inside an outer JAX transformation with the NNX objects closed "
            "over, so the new values are tracers and cannot be written back. Pass the "
            "NNX objects through the outer transformation (use nnx.jit/nnx.grad/... "
            "or nnx.split/merge outside), or call the function outside of it."
        )
    link = None
    if nnx_out.restructure:
        link = _Link(nnx_out, nnx_args)  # (read before the caller's graphs change)
        pos = 0
        for _, graphdef, n in nnx_out.restructure:
            # Existing objects and Variables are reused by identity (updated in place to
            # the structure and values made inside), new ones created, as nnx.jit's graph
            # updates do.
            graphlib.unflatten(
                graphdef, list(written[pos : pos + n]), index_ref=link.index_ref, outer_index_outer_ref=link.outer
            )
            pos += n
        written = written[pos:]
    for (ordinal, index), value in zip(nnx_out.writes, written):
        if nnx_out.replaced and (ordinal, index) in nnx_out.replaced:
            _replace_variable(nnx_args[ordinal], index, value)
        else:
            write_leaf(nnx_args[ordinal].variables[index], value)
    for ordinal, index, metadata in nnx_out.metadata:
        nnx_args[ordinal].variables[index].set_metadata(dict(metadata))  # (all of it; seen by the hooks)
    return link


class _Link:
    """How one call's output is tied to the caller's objects. `outer`: the caller's objects
    (and their sub-objects and Variables) by outer index, read before any structural
    change (the indices name the graphs the function was given). `index_ref`: one index
    for every graph rebuilt after the call, restructured arguments first and then new
    objects returned, in the order they were flattened inside."""

    __slots__ = ("outer", "index_ref")

    def __init__(self, nnx_out: NnxOutputs, nnx_args: list[NnxArg]) -> None:
        self.index_ref = graphlib.IndexMap()
        self.outer = graphlib.IndexMap()
        if not (nnx_out.restructure or nnx_out.inner_nodes or nnx_out.links_outer):
            return
        # Each argument's objects as the call read them: the read's RefMap where it made one
        # (arguments read jointly share one), else flattened again (the same order).
        shared = None
        if nnx_out.joint:
            first = nnx_args[0].index
            shared = first if first is not None and all(a.index is first for a in nnx_args) else None
            if shared is None:
                shared = graphlib.RefMap()
                for arg in nnx_args:
                    graphlib.flatten(arg.obj, with_paths=False, ref_index=shared)
        for ordinal, arg in enumerate(nnx_args):
            if shared is None:
                refmap = arg.index
                entry = arg.entry
                if refmap is None and entry is not None and entry.enumerated and arg.variables is entry.items:
                    refmap = _Enumerated(arg.variables)  # (what a flatten would index)
                if refmap is None:
                    refmap = graphlib.RefMap()
                    graphlib.flatten(arg.obj, with_paths=False, ref_index=refmap)
                base = _outer_base(ordinal, False)
                for obj, index in refmap.items():
                    self.outer[base + index] = obj
        if shared is not None:
            for obj, index in shared.items():
                self.outer[index] = obj


def _replace_variable(arg: NnxArg, index: int, value: Any) -> None:
    """Put a new Variable (the old one's type and metadata) holding `value` where the
    caller's object holds its `index`-th leaf, as nnx.jit's graph updates do for a Variable
    the function replaced; the object's cache entry follows (no re-read)."""
    old = arg.variables[index]
    new = _renewed(old, value)
    entry: NodeEntry | None = arg.entry if arg.entry is not None else by_id.get(id(arg.obj))
    if entry is not None and (entry.ref() is not arg.obj or entry.items is not arg.variables):
        entry = None  # (not the entry this call read: it is left to the hooks)
    paths = arg.paths if arg.paths is not None else (entry.paths if entry is not None else None)
    if paths is not None and len(paths) == len(arg.variables):
        path = paths[index]
    else:  # (a fast-path call whose entry another thread replaced meanwhile: search)
        flat = graphlib.flatten(arg.obj, with_paths=True)[1]
        path = next(p for p, leaf in zip(flat.paths, flat.leaves) if leaf is old)
    owner = arg.obj
    for key in path[:-1]:
        owner = _child(owner, key)
    _local.updating = entry
    try:
        name = path[-1]
        if not isinstance(owner, _hooks.Pytree):
            owner[name] = new
        elif type(name) is str and _holds_data(owner, name, old):
            # A data attribute holding the Variable replaced by another: written as NNX's own
            # in-place rebuild (nnx.jit's graph update) writes it, `object.__setattr__` (a
            # property's setter runs; a class's own __setattr__, NNX's checks and the hooks do
            # not: the attribute stays data), and the hooks' report, which other entries
            # watching the object must see, made here.
            object.__setattr__(owner, name, new)
            _notify(owner)
        else:
            setattr(owner, str(name), new)
    finally:
        _local.updating = None
    arg.variables[index] = new
    if entry is not None:
        with _watch_lock:
            if by_id.get(id(arg.obj)) is not entry:
                return  # (replaced meanwhile by another thread's read: nothing to follow)
            lst = _watchers.get(id(old))
            if lst is not None and entry in lst:
                lst.remove(entry)
                if not lst:
                    del _watchers[id(old)]
            _watchers.setdefault(id(new), []).append(entry)
            watched = list(entry.watched)
            for i, w in enumerate(watched):
                if w == id(old):
                    watched[i] = id(new)
            entry.watched = watched
            entry.node_ids = frozenset(watched)
            entry.version += 1
            # (the record of the read holds `old`, which a rebuild may put back: the entry,
            # which holds `new`, would then pass the check; and the record kept `old` alive)
            entry.layout = None


def _renewed(old: Any, value: Any) -> Any:
    """A new Variable of `old`'s type and metadata holding `value`: what `old.replace(value)`
    (NNX's copy) makes, made directly where NNX's copy would come to `_new` with a copy of
    the metadata (a jax array as the value, no reference, not hijax, a type making Variables
    Variable's own way)."""
    metadata = _var_metadata(old)
    if type(value) is ArrayImpl and not metadata.get("ref") and not metadata.get("hijax") and _own_maker(type(old)):
        return type(old)._new(value, dict(metadata))
    return old.replace(value)


def _own_maker(kind: Any) -> bool:
    """Whether Variable type `kind` makes Variables with Variable's own `from_metadata` and
    `_new` (looked up each time: a class may be given others later)."""
    return (
        getattr(kind.from_metadata, "__func__", None) is _VARIABLE_FROM_METADATA
        and getattr(kind._new, "__func__", None) is _VARIABLE_NEW
    )


_VARIABLE_FROM_METADATA = Variable.from_metadata.__func__  # type: ignore[attr-defined]
_VARIABLE_NEW = Variable._new.__func__  # type: ignore[attr-defined]


def _holds_data(owner: Any, name: str, old: Any) -> bool:
    """Whether NNX object `owner` holds `old` in its data attribute `name` and may be
    changed now (the object is of this trace level)."""
    try:
        return (
            owner.__dict__.get(name) is old and owner._pytree__nodes.get(name) is True
            and owner._pytree__state.trace_state.is_valid()
        )
    except Exception:  # (a flax laid out otherwise: its __setattr__ does it)
        return False


def twin_states(nnx_out: NnxOutputs, result: Any, nnx_args: list[NnxArg]) -> None:
    """Give each nnx.State the call returned holding an argument's Variables
    (`NnxOutputs.twins`) a cache entry of its own, made from the argument's: a functional
    loop passes it back next call, where it is then read as a known object (no flatten, no
    metadata compared; the structure path serves it) instead of as a new State."""
    for position, ordinal in nnx_out.twins:
        state = result if position is None else result[position]
        arg = nnx_args[ordinal]
        source = arg.entry
        if (
            type(state) is not State or source is None or not source.enumerated or source.volatile
            or arg.variables is not source.items or source.ref() is not arg.obj or by_id.get(id(state)) is not None
        ):
            continue
        items = list(source.items)  # (not shared: a Variable replaced later is replaced in one)
        if contains_tracer(map(raw_value, items)):
            continue  # (values of an outer trace; an RNG key array is concrete, not an ArrayImpl)
        walked = _state_parts(state)
        if walked is None or len(walked[1]) != len(items) or frozenset(walked[1]) != source.node_ids:
            continue
        entry = _new_entry(state, None)
        entry.items, entry.paths = items, source.paths
        entry.spec, entry.spec_id = source.spec, source.spec_id
        entry.node_ids = source.node_ids
        entry.guard = _guard.make(walked[0])
        entry.direct = entry.enumerated = True
        entry.fresh = False
        entry.watched = [id(v) for v in items]
        with _watch_lock:
            for oid in entry.watched:
                _watchers.setdefault(oid, []).append(entry)
        # The Variables' types and metadata are the spec's: the source entry said so when
        # the call read it, and nothing changed them since if it is watched and still not
        # stale (checked after this entry watches them: a change from now on marks this
        # one). A provisional source is not watched: its State's key is read again.
        if source.provisional:
            plain = _plain_state_read(state)
            if plain is None or plain.spec is not source.spec or any(a is not b for a, b in zip(plain.variables, items)):
                entry.stale = True
        elif source.stale or source.rebuilt:
            entry.stale = True
        _file(entry, None)


def _state_parts(state: Any) -> tuple[list[Any], list[int]] | None:
    """The containers a guard over an nnx.State watches (its attribute dict and every dict
    of its mapping, nested States' too), and the ids of the Variables it holds; None if it
    holds anything else (or a container no guard can watch)."""
    containers: list[Any] = []
    ids: list[int] = []
    pending = [state]
    while pending:
        node = pending.pop()
        if type(node) is State:
            attributes = _guard.Attributes(node)
            if not _guard.is_guardable(attributes):
                return None
            containers.append(attributes)
            node = node.raw_mapping
        if type(node) is not dict:
            return None
        containers.append(node)
        for value in node.values():
            if type(value) is dict or type(value) is State:
                pending.append(value)
            elif _is_variable(value):
                ids.append(id(value))
            else:
                return None
    return containers, ids


def _unmarker(nnx_out: NnxOutputs, nnx_args: list[NnxArg], link: _Link | None) -> Any:
    """What turns one output marker back into an object (the caller's own, or a new one),
    and leaves anything else as it is. Markers must be given in the order `_mark_nodes`
    made them (leaf order): new objects share one index, filled as they are rebuilt."""
    if link is None:
        link = _Link(nnx_out, nnx_args)
    outer = link.outer if nnx_out.links_outer else None

    def unmark(x: Any) -> Any:
        if type(x) is _InputNode:
            return nnx_args[x.k].obj if x.outer is None else link.outer[x.outer]
        if type(x) is _NewNode:
            return graphlib.unflatten(x.graphdef, list(x.values), index_ref=link.index_ref, outer_index_outer_ref=outer)
        return x

    return unmark


def unmark_nodes(nnx_out: NnxOutputs, result: Any, nnx_args: list[NnxArg], link: _Link | None) -> Any:
    """`result` with its output markers turned back into objects."""
    unmark = _unmarker(nnx_out, nnx_args, link)
    return jax.tree_util.tree_map(unmark, result, is_leaf=lambda x: type(x) in (_InputNode, _NewNode))


def unmark_leaves(nnx_out: NnxOutputs, leaves: Any, nnx_args: list[NnxArg], link: _Link | None) -> list[Any]:
    """The output's static leaves in order with the markers among them turned back into
    the caller's objects: the output is then built once (not built, flattened and built
    again). Only for an output without new objects (whose markers are pytree nodes)."""
    return list(map(_unmarker(nnx_out, nnx_args, link), leaves))


# --------------------------------------------------------------------------
# Options


def resolve_options(
    graph: bool | None, graph_updates: bool | None, in_shardings: Any, out_shardings: Any
) -> tuple[bool, bool]:
    """At decoration, as nnx.jit: `graph_updates=None` (and `graph=None`) mean the current
    `nnx.set_graph_updates` (`nnx.set_graph_mode`) setting; shardings given as prefixes
    are checked as nnx.jit checks them. Returns (graph, graph_updates), resolved."""
    if graph is None:
        graph = graphlib.set_graph_mode.current_value()
    if graph_updates is None:
        setting = getattr(graphlib, "set_graph_updates", None)  # (flax >= 0.12.6)
        graph_updates = True if setting is None else setting.current_value()
    graph_updates = graph_updates and graph  # (tree mode has no graph updates, as in nnx.jit)
    for name, prefix in (("in_shardings", in_shardings), ("out_shardings", out_shardings)):
        for leaf in jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: _is_node(x) or hasattr(x, "map_prefix")):
            kind = type(leaf).__name__
            if isinstance(leaf, Variable):
                raise FastcallError(
                    f"fastcall.jit: {name} holds a Variable ({kind}). Variables prefixes are not "
                    "supported (as in nnx.jit): give one sharding for the whole Variable."
                )
            if _is_node(leaf) and graph:
                raise FastcallError(
                    f"fastcall.jit: {name} holds an NNX object ({kind}). Graph nodes are not allowed "
                    "as prefixes when graph=True (as in nnx.jit): pass shardings (a jax Sharding, an "
                    "nnx.StateSharding, nnx.prefix(..., graph=True)), or pass graph=False for "
                    "nnx.prefix(..., graph=False)'s result."
                )
            if hasattr(leaf, "map_prefix") and not (graph and graph_updates):
                raise FastcallError(
                    f"fastcall.jit: {name} cannot contain `{kind}` objects when graph=False or "
                    "graph_updates=False (as in nnx.jit): use nnx.prefix(...), or graph=True and "
                    "graph_updates=True."
                )
    return bool(graph), bool(graph_updates)


# --------------------------------------------------------------------------
# Shardings


def _structured_prefix(prefix: Any) -> dict[tuple[Any, ...], Any] | None:
    """Variable path -> sharding for a prefix shaped like an NNX object: what
    `nnx.prefix(obj, ..., graph=False)` returns (an object of obj's type whose Variables
    hold shardings) or `graph=True` returns (a TreeState holding a State of shardings).
    None for anything else (a single Sharding, an nnx.StateSharding, a flat list)."""
    state = getattr(prefix, "__state__", None)
    if state is not None and type(prefix).__name__ == "TreeState":
        return {tuple(path): value for path, value in nnx.to_flat_state(state)}
    if _is_node(prefix):
        flat = graphlib.flatten(prefix, with_paths=True)[1]
        return {
            tuple(path): raw_value(v) if isinstance(v, Variable) else v for path, v in zip(flat.paths, flat.leaves)
        }
    return None


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


class ShardingContext:
    """The in_shardings of one compiled entry's NNX arguments, read in argument order.
    Arguments flattened jointly are rebuilt as placeholders into one shared index (their
    graphdefs refer to objects of earlier arguments), and a Variable shared between
    arguments must get the same sharding from each (else nnx.jit's "Inconsistent aliasing")."""

    def __init__(self) -> None:
        self.joint_index = graphlib.IndexMap()
        self.assigned: dict[int, tuple[Any, Any, str]] = {}  # id(Variable) -> (it, sharding, arg)

    def leaf_shardings(self, spec: NodeSpec | TreeSpec, prefix: Any, arg_name: str) -> list[Any]:
        """One sharding per leaf of an NNX argument, or of a container holding NNX objects
        (`prefix` a pytree prefix of it; at each NNX object, any of the forms below)."""

        if isinstance(spec, NodeSpec) and spec.values_only:
            # An nnx.State read as one object: a pytree of Variables to nnx.jit, so `prefix`
            # is a pytree prefix of it, as for a container of Variables.
            placeholder = graphlib.unflatten(spec.graphdef, [_Slot() for _ in range(spec.n_dyn)])
            variables = jax.tree_util.tree_leaves(placeholder, is_leaf=_is_variable)
            per_variable: list[Any] = []
            for v, sharding in zip(variables, broadcast_prefix(prefix, placeholder, is_leaf=_is_variable)):
                per_variable += self._node(_intern_graphdef(graphlib.flatten(v)[0], 1, arg_name), sharding, arg_name)
            return per_variable
        if isinstance(spec, NodeSpec):
            return self._node(spec, prefix, arg_name)

        placeholder = spec.treedef.unflatten([object()] * len(spec.layout))
        per_item = broadcast_prefix(prefix, placeholder)
        out: list[Any] = []
        for code, sharding in zip(spec.layout, per_item):
            if isinstance(code, NodeSpec):
                out += self._node(code, sharding, arg_name)
            elif code == _DYNAMIC:
                out.append(sharding)
        return out

    def _node(self, spec: NodeSpec, prefix: Any, arg_name: str) -> list[Any]:
        """One sharding per leaf of an NNX object: from one jax Sharding (or PartitionSpec)
        for all, an `nnx.StateSharding` (checked against each Variable's path and type, as
        nnx.jit does), an `nnx.prefix` result (matched by Variable path), or a flat list
        (one entry per leaf, in flatten order)."""
        n = spec.n_dyn
        index = self.joint_index if spec.joint else graphlib.IndexMap()
        known = {id(obj) for obj in index.values()}  # (objects of earlier arguments)
        # (a stand-in per leaf: not None, which a mutable array reference's slot drops)
        placeholder = graphlib.unflatten(spec.graphdef, [_Slot() for _ in range(n)], index_ref=index)
        flat = graphlib.flatten(placeholder, with_paths=True)[1]  # (every Variable, shared too)
        if _is_sharding(prefix):
            every = [prefix] * len(flat.leaves)
        elif hasattr(prefix, "map_prefix") and hasattr(prefix, "filters"):
            every = [prefix.map_prefix(path, leaf) for path, leaf in zip(flat.paths, flat.leaves)]
        else:
            by_path = _structured_prefix(prefix)
            if by_path is None:
                leaves = jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: x is None)
                if len(leaves) != n or spec.joint:
                    raise FastcallError(
                        f"fastcall.jit: in_shardings for {describe_arg(arg_name)} has {len(leaves)} "
                        f"entries but the object has {n} leaves of its own. Pass one jax Sharding, "
                        "an nnx.StateSharding, or nnx.prefix(obj, ...) computed for this very object."
                    )
                return leaves
            every = [by_path.get(tuple(path)) for path in flat.paths]
        own = []
        for path, leaf, sharding in zip(flat.paths, flat.leaves, every):
            if id(leaf) not in known:
                own.append(sharding)
            if sharding is None or not isinstance(leaf, Variable):
                continue
            earlier = self.assigned.setdefault(id(leaf), (leaf, sharding, arg_name))
            if earlier[1] != sharding:
                where = "." + ".".join(map(str, path)) if path else ""
                raise FastcallError(
                    f"fastcall.jit: Inconsistent aliasing: the Variable {describe_arg(arg_name, where)} "
                    f"is also in {describe_arg(earlier[2])}, and in_shardings gives it {earlier[1]} "
                    f"there but {sharding} here. A shared Variable has one sharding: give both the same."
                )
        return own


class _Slot:
    """A leaf's place in a placeholder graph (see `ShardingContext._node`)."""

    __slots__ = ()


def constrain(node: Any, sharding: Any) -> None:
    """Constrain the values of `node`'s Variables (inside a trace) to `sharding`: one jax
    Sharding for all, an nnx.StateSharding mapping each Variable by path and type, or an
    `nnx.prefix` result for an object of this structure (matched by Variable path)."""
    flat = graphlib.flatten(node, with_paths=True)[1]
    by_path = _structured_prefix(sharding)
    for path, leaf in zip(flat.paths, flat.leaves):
        if not isinstance(leaf, Variable):
            continue
        if by_path is not None:
            target = by_path.get(tuple(path))
        elif hasattr(sharding, "map_prefix"):
            target = sharding.map_prefix(path, leaf)
        else:
            target = sharding
        if target is not None:
            leaf.set_raw_value(jax.lax.with_sharding_constraint(leaf.get_raw_value(), target))

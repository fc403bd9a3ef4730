"""What an NNX object is to fastcall, and how the leaves of its graph are read and written.

An NNX graph node (Module, Pytree, Rngs, Optimizer), a Variable or a mutable array
reference is an NNX object, by its type (`is_node_type`, which the core's `_nnx_gate.is_node`
caches per type).
The leaves of a graph fastcall caches are its Variable objects, in flatten order, and a
handle on each raw leaf (`_leaf_items`). The Variables' values are read at call time
through the `_raw_value` slot (no deprecated `.value`, no graph walk), so `v[...] = ...`,
`nnx.update` and optimizer steps made outside are seen by the next call; values the
function changed are written back through it too (`read_leaf`, `write_leaf`).
"""

from __future__ import annotations

import collections.abc
import inspect
import operator
import weakref
from typing import Any

from flax import nnx
from flax.nnx import graphlib, variablelib
from flax.nnx.tracers import TraceState as _TraceState
from flax.nnx.variablelib import Variable

from .. import _plan
from .._entry_reads import raw_leaf_value
from .._errors import FastcallError
from .._flatten import ArrayImpl
from . import _hooks

RAW_VALUE_SLOT: Any = inspect.getattr_static(Variable, "_raw_value", None)
if type(RAW_VALUE_SLOT).__name__ == "member_descriptor":
    # Values are read and written through the slot itself (no checks, no hooks; the C
    # fast path reads it too).
    raw_value: Any = operator.attrgetter("_raw_value")
    _set_raw: Any = RAW_VALUE_SLOT.__set__
    _plan.VALUE_SLOT[0] = RAW_VALUE_SLOT
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


# --------------------------------------------------------------------------
# Leaves: Variables, and handles of raw leaves

RawLeaf = _plan.RawLeaf


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
        return raw_leaf_value(item)
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


_variable_types: dict[type, bool] = {}


def _is_variable(obj: Any) -> bool:
    """isinstance(obj, Variable), cached per type (Variable's metaclass check is Python)."""
    t = type(obj)
    known = _variable_types.get(t)
    if known is None:
        known = _variable_types[t] = isinstance(obj, Variable)
    return known


# A Variable's metadata dict itself; the structure path reads it through the slot (a
# `VariableRead` is made only where the slot is what getattr finds; else there is none).
_var_metadata = operator.attrgetter("_var_metadata")
METADATA_SLOT: Any = inspect.getattr_static(Variable, "_var_metadata", None)
if type(METADATA_SLOT).__name__ != "member_descriptor":  # pragma: no cover - an unverified flax
    METADATA_SLOT = None

GraphDef = graphlib.GraphDef


# --------------------------------------------------------------------------
# A new Variable made as NNX makes it (for a Variable replaced: `_write_back._replace_variable`)


def _renewed(old: Any, value: Any) -> Any:
    """A new Variable of `old`'s type and metadata holding `value`: what `old.replace(value)`
    (NNX's copy) makes, made directly where NNX's copy would come to `_new` with a copy of
    the metadata (a jax array as the value, no reference, not hijax, a type making Variables
    Variable's own way)."""
    metadata = _var_metadata(old)
    if type(value) is ArrayImpl and not metadata.get("ref") and not metadata.get("hijax") and _own_maker(type(old)):
        return new_variable(type(old), value, dict(metadata))
    return old.replace(value)


def _trace_key() -> Any:
    """What a TraceState made now holds as its trace (`_jax_trace._trace_ref`): the current
    trace's own weak reference, read without making anything. None where this jax or flax
    is laid out otherwise; `new_variable` then makes each Variable as flax does."""
    try:
        from flax.nnx import tracers
        from jax._src.core import trace_ctx

        def key() -> Any:
            return trace_ctx.trace._weakref  # type: ignore[union-attr]  # typed Trace | None in jax 0.8

        made = tracers.TraceState()
        if made._jax_trace._trace_ref is not key():
            return None
        return key
    except Exception:  # pragma: no cover - depends on jax and flax internals
        return None


_current_trace_key = _trace_key()
# The TraceState the latest `new_variable` gave its Variable, shared by the next ones made
# at the same trace. Flax makes one per Variable; one is never changed once made, and two of
# the same trace compare equal (`TraceState.__eq__`, `is_valid`), so sharing it is seen only
# by `is`. It holds the trace by weak reference, as each Variable's own would. (Read once
# per call, into a local: another thread may replace it, never with one of another trace
# under the same key, since a key is a live weak reference the TraceState holds.)
_shared_trace_state: list[Any] = [None]


def new_variable(kind: Any, value: Any, metadata: dict[str, Any]) -> Any:
    """`kind._new(value, metadata)` for a Variable type with Variable's own `_new`
    (`_own_maker`), its TraceState shared with the Variables made before it at this trace:
    measured here 0.6 us a Variable, where `_new` makes a TraceState each time (1.5 us)."""
    if _current_trace_key is None:  # pragma: no cover - see _trace_key
        return kind._new(value, metadata)
    key = _current_trace_key()
    state = _shared_trace_state[0]
    if state is None or state._jax_trace._trace_ref is not key:
        state = _shared_trace_state[0] = _TraceState()
    made = _object_new(kind)
    _object_setattr(made, "_trace_state", state)
    _object_setattr(made, "_var_metadata", metadata)
    _object_setattr(made, "_raw_value", value)
    return made


_object_new = object.__new__
_object_setattr = object.__setattr__


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

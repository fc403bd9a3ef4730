"""The record of a graph as read (`_Layout`), against which a graph NNX rebuilt in place is
checked instead of being read again.

nnx.jit (and NNX's other transforms) rebuild every node of a model passed to them in place after
the call: each node's attributes cleared, then set again, mostly to the very objects
they held. The check compares each node's attributes with a record of the read
(`_Layout`): no graph walk, no graphdef built or compared. (A cache entry's check:
`_entries._as_read`.)
"""

from __future__ import annotations

import itertools
import operator
import types
import weakref
from typing import Any, Callable, NamedTuple

from flax.nnx.variablelib import Variable

from .._flatten import ArrayImpl
from . import _hooks
from ._variables import _is_node

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

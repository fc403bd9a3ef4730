"""Guards: the cheap check that a cached object holding lists or dicts is unchanged.

An Equinox module, a tuple or an NNX graph is cached by identity (`_flatten`,
`fastcall._nnx`): the same object means the same structure and leaves, because nothing
in it can change without a new object (Equinox) or a hooked write (NNX). A
plain `list` or `dict` inside breaks that: `layers[0] = new`, `append`, `del`,
`d[k] = v` change it in place and nothing is told. So an object holding any is
cached with a guard: every list and dict reachable in it, each with the exact
objects it held when the object was read. The guard holds while every one of
them still holds exactly those objects, compared by identity (`is`, never
`==`): the same length, the same item at each place, for dicts the same keys
and values in the same order. Anything else, and the object is read afresh.

Why identity of items is enough: every other part of the object is immutable
or itself guarded (a nested list is in the guard too), so an unchanged set of
items in every container means an unchanged object. What it costs: one pointer
comparison per item of every container, in C when the extension is built. The C
check also skips a dict whose version tag (PEP 509, which every dict operation that
changes it moves on) is the one it had when the check last found it unchanged
(`Watched.stamp`), for a dict that keeps its own values only: an object's attribute
dict may share them with the object (Python 3.13), which writes an attribute there
without a new tag. Python 3.14 has no such tag, and there every dict is walked.

An object's attribute dict (an `eqx.nn.State`'s, an `nnx.State`'s: `Attributes`) is
watched with its owner, by weak reference: `obj.__dict__ = {...}` gives the object
another dict and leaves the watched one as it was, so the guard also checks that
the dict is still the owner's.
"""

from __future__ import annotations

import importlib
import itertools
import weakref
from typing import Any, NamedTuple


class Watched(NamedTuple):
    """One container a guard watches."""

    container: Any  # a plain list or dict, held
    expected: tuple[Any, ...]  # a list's items; a dict's keys and values interleaved, in order
    # dicts: [the dict's version tag when the C check last found it holding `expected`, or
    # None]: written only by that check (`_accel.c`, `dict_holds`); None for lists
    stamp: list[Any] | None
    # an object's attribute dict: a weak reference to the object, whose `__dict__` the
    # container must still be; else None
    owner: Any


class Attributes(NamedTuple):
    """An object's attribute dict, as a container to watch (`make`)."""

    obj: Any


Guard = tuple[Watched, ...]


def is_guardable(container: Any) -> bool:
    """Whether a guard can watch this container: a plain list or dict, or the attribute dict
    of an object that can be weakly referenced. (Not an OrderedDict, whose order, which jax
    flattens by, is kept apart from its storage: `move_to_end` changes it without changing
    what the C check walks.)"""
    if type(container) is Attributes:
        obj = container.obj
        return type(getattr(obj, "__dict__", None)) is dict and bool(type(obj).__weakrefoffset__)
    return type(container) is list or type(container) is dict


def make(containers: list[Any]) -> Guard | None:
    """A guard over these containers (each once; each `is_guardable`), or None if there are none."""
    watched = []
    seen: set[int] = set()
    for c in containers:
        owner = None
        if type(c) is Attributes:
            owner, c = weakref.ref(c.obj), vars(c.obj)
        if id(c) in seen:
            continue
        seen.add(id(c))
        # (tuple.__new__: a Watched without the Python frame of its generated __new__; a
        # guard is made on every call that returns a new nnx.State, see _nnx._write_back.twin_states)
        if type(c) is list:
            watched.append(_new(Watched, (c, tuple(c), None, owner)))
        else:
            watched.append(_new(Watched, (c, tuple(_chain(c.items())), [None], owner)))
    return tuple(watched) or None


_new = tuple.__new__


_chain = itertools.chain.from_iterable  # (a dict's keys and values interleaved, in C)


def _holds(guard: Guard) -> bool:
    for c, expected, _, owner in guard:
        if owner is not None:
            obj = owner()
            if obj is None or getattr(obj, "__dict__", None) is not c:
                return False
        if type(c) is list:
            if len(c) != len(expected) or any(a is not b for a, b in zip(c, expected)):
                return False
        elif 2 * len(c) != len(expected) or any(a is not b for a, b in zip(_chain(c.items()), expected)):
            return False
    return True


try:  # the same check in C (fastcall/_accel.c), which the C structure path calls directly
    holds: Any = importlib.import_module("fastcall._accel").guard_holds
except (ImportError, AttributeError):  # pragma: no cover - not built
    holds = _holds

# cython: language_level=3, wraparound=False, boundscheck=False
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
comparison per item of every container. The check (`holds`) is one of the sources setup.py
compiles with Cython (see `fastcall/_rebuild.py`); compiled, the C wrapper and the fast route
call it as C (`_guard.pxd`), and it also skips a dict whose version tag (PEP 509, which every
dict operation that changes it moves on) is the one it had when the check last found it
unchanged (`Watched.stamp`), for a dict that keeps its own values only: an object's
attribute dict may share them with the object (Python 3.13), which writes an attribute
there without a new tag. Python 3.14 has no such tag, and there every dict is walked.

An object's attribute dict (an `eqx.nn.State`'s, an `nnx.State`'s: `Attributes`) is
watched with its owner, by weak reference: `obj.__dict__ = {...}` gives the object
another dict and leaves the watched one as it was, so the guard also checks that
the dict is still the owner's.
"""

import weakref
from typing import Any, NamedTuple, Optional

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.cpython.long import PyLong_FromVoidPtr
    from cython.cimports.cpython.weakref import PyWeakref_NewRef
    from cython.cimports.fastcall._capi import PyObject_GenericGetDict, dict_combined, dict_version, new_record

COMPILED: bool = cython.compiled


class Watched(NamedTuple):
    """One container a guard watches."""

    container: Any  # a plain list or dict, held
    expected: tuple[Any, ...]  # a list's items; a dict's keys and values interleaved, in order
    # dicts: [the dict's version tag when the compiled check last found it holding
    # `expected`, or None]: written only by that check (`_dict_holds`); None for lists
    stamp: Optional[list]
    # an object's attribute dict: a weak reference to the object, whose `__dict__` the
    # container must still be; else None
    owner: Any


class Attributes(NamedTuple):
    """An object's attribute dict, as a container to watch (`make`)."""

    obj: Any


Guard = tuple[Watched, ...]


@cython.ccall
@cython.exceptval(-1, check=True)
def is_guardable(container: Any) -> cython.bint:
    """Whether a guard can watch this container: a plain list or dict, or the attribute dict
    of an object that can be weakly referenced. (Not an OrderedDict, whose order, which jax
    flattens by, is kept apart from its storage: `move_to_end` changes it without changing
    what the check walks.)"""
    if type(container) is Attributes:
        obj = cython.cast(tuple, container)[0]
        return type(_own_dict(obj)) is dict and bool(type(obj).__weakrefoffset__)
    return type(container) is list or type(container) is dict


@cython.ccall
def make(containers: Any) -> Optional[Guard]:
    """A guard over these containers (each once; each `is_guardable`), or None if there are none."""
    watched: list = []
    seen: set = set()
    for c in containers:
        owner = None
        if type(c) is Attributes:
            obj = cython.cast(tuple, c)[0]
            owner = PyWeakref_NewRef(obj, None) if cython.compiled else weakref.ref(obj)
            c = _own_dict(obj)
        key = PyLong_FromVoidPtr(cython.cast(cython.p_void, c)) if cython.compiled else id(c)
        if key in seen:
            continue
        seen.add(key)
        watched.append(_watch(c, owner))
    return tuple(watched) or None


@cython.ccall
def make_checked(containers: Any) -> Optional[Guard]:
    """`make`, where each container `is_guardable`; else None (a container that is not plain
    cannot be watched, and the object holding it is not cached)."""
    for c in containers:
        if not is_guardable(c):
            return None
    return make(containers)


@cython.cfunc
def _watch(c: Any, owner: Any) -> Any:
    """A `Watched` of the list or dict `c` as it holds now. (Made by `tuple.__new__`, without
    the Python frame of a NamedTuple's generated `__new__`: a guard is made on every call
    that returns an eqx.nn.State or a new nnx.State, see `_memo` and `_nnx._write_back`.)"""
    if type(c) is list:
        return _new_watched((c, tuple(cython.cast(list, c)), None, owner))
    d = cython.cast(dict, c)
    expected: list = [None] * (2 * len(d))
    i: cython.Py_ssize_t = 0
    for k, v in d.items():  # (its keys and values interleaved, in order)
        expected[i] = k
        expected[i + 1] = v
        i += 2
    return _new_watched((c, tuple(expected), [None], owner))


@cython.cfunc
def _new_watched(fields: tuple) -> Any:
    """`Watched(*fields)`, made as its own `__new__` makes it (`tuple.__new__`); compiled,
    through the C slot, with no Python call."""
    if cython.compiled:
        return new_record(Watched, fields)
    else:
        return tuple.__new__(Watched, fields)


@cython.cfunc
def _own_dict(obj: Any) -> Any:
    """The object's own attribute dict, as `vars` finds it (no code of its runs), or None."""
    if cython.compiled:
        try:
            return PyObject_GenericGetDict(obj, cython.NULL)
        except AttributeError:
            return None
    else:
        return getattr(obj, "__dict__", None)


@cython.ccall
@cython.exceptval(-1, check=True)
def holds(guard: Any) -> cython.bint:
    """Whether every container of `guard` still holds exactly the objects it held when the
    guard was made (see the module's docstring): its items (a list's; a dict's keys and
    values, in order) compared by identity only, never by ==; an attribute dict still its
    owner's. Compiled, a dict whose version tag is the one stamped when this last found it
    holding is not walked again (`_dict_holds`). Anything not a guard does not hold."""
    if type(guard) is not tuple:
        return False
    watched: tuple
    for w in cython.cast(tuple, guard):
        if not isinstance(w, tuple) or len(w) != 4:
            return False
        watched = cython.cast(tuple, w) if cython.compiled else w  # (a Watched: read as the tuple it is)
        c = watched[0]
        expected = watched[1]
        owner = watched[3]
        if owner is not None and not _owns_dict(owner, c):
            return False
        if type(expected) is not tuple:
            return False
        if type(c) is list:
            items: list = c
            n: cython.Py_ssize_t = len(items)
            if n != len(expected):
                return False
            i: cython.Py_ssize_t
            for i in range(n):
                if items[i] is not cython.cast(tuple, expected)[i]:
                    return False
        elif type(c) is dict:  # (not a subclass: an OrderedDict keeps its order apart)
            if not _dict_holds(c, expected, watched[2]):
                return False
        else:
            return False
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _dict_holds(c: dict, expected: tuple, stamp: Any) -> cython.bint:
    """Whether the dict `c` holds exactly `expected` (keys and values interleaved, in order),
    by identity. Compiled, with `stamp` (a one-element list: the version tag `c` had when this
    last found it so, or None): an unchanged tag means unchanged contents, and a walk that
    finds it holding stamps the tag it held at. (A tag is trusted only for a dict that keeps
    its own values: an object's attribute dict may share them with the object, 3.13+, which
    writes an attribute there without a new tag. No tag on 3.14: always walked.)"""
    version: cython.ulonglong = 0
    if cython.compiled and type(stamp) is list and len(stamp) == 1 and dict_combined(c):
        version = dict_version(c)
        seen = cython.cast(list, stamp)[0]
        if version != 0 and type(seen) is int:
            seen_tag: cython.ulonglong = seen  # (read as C reads it: no int made for the comparison)
            if seen_tag == version:
                return True
    if 2 * len(c) != len(expected):
        return False
    i: cython.Py_ssize_t = 0
    for k, v in c.items():
        if k is not expected[i] or v is not expected[i + 1]:
            return False
        i += 2
    if version != 0:
        cython.cast(list, stamp)[0] = version
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _owns_dict(owner: Any, c: Any) -> cython.bint:
    """Whether `c` is still the attribute dict of the object the weak reference `owner`
    refers to, alive (`obj.__dict__ = {...}` gives the object another)."""
    if not isinstance(owner, weakref.ref):
        return False
    obj = owner()
    if obj is None:
        return False
    if cython.compiled:  # (the object's own dict, as `vars` finds it: no code runs)
        try:
            return PyObject_GenericGetDict(obj, cython.NULL) is c
        except AttributeError:
            return False
    else:
        return getattr(obj, "__dict__", None) is c

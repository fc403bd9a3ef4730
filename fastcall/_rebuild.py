# cython: language_level=3, wraparound=False
"""Rebuilding a call's output from the flat list of its dynamic outputs.

An output structure that jax cannot rebuild in C++ (an Equinox module, an `eqx.nn.State`,
anything holding one) or that fastcall must finish itself (static leaves, returned objects
noted for the next call) is rebuilt by a plan made once, when the function is traced
(`_codegen.make_builder` walks the output into it): a tree of nodes, each building one
value from `d`, the list of dynamic outputs. Compiled, building a module costs one
allocation and a field store per field, with no Python call per node (Equinox's own
unflatten, which jax would call, runs Python per node).

One source, two ways to run it: written in Cython's pure-Python mode, compiled by Cython
where the package was built with a C compiler (`COMPILED`), run as this very file where
not. The few lines that differ (`if cython.compiled:`) call the C API functions the
Python line beside them calls through Python; both make the same object. A test builds
every kind of node both ways and compares (`tests/test_rebuild.py`).
"""

from typing import Any

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.cpython.list import PyList_New, PyList_SET_ITEM
    from cython.cimports.cpython.object import PyObject, PyObject_GenericSetAttr, PyTypeObject
    from cython.cimports.cpython.ref import Py_INCREF
    from cython.cimports.cpython.tuple import PyTuple_New, PyTuple_SET_ITEM

COMPILED: bool = cython.compiled

_object_new = cython.declare(object, object.__new__)
_object_setattr = cython.declare(object, object.__setattr__)
_tuple_new = cython.declare(object, tuple.__new__)
_EMPTY = cython.declare(tuple, ())


@cython.cclass
class OutNode:
    """One value of an output, built from the dynamic outputs `d` of a call."""

    @cython.ccall
    def build(self, d: list) -> object:
        raise NotImplementedError


@cython.final
@cython.cclass
class OutLeaf(OutNode):
    """The dynamic output `d[index]`."""

    index: cython.Py_ssize_t

    def __init__(self, index: cython.Py_ssize_t):
        self.index = index

    @cython.ccall
    def build(self, d: list) -> object:
        return d[self.index]


@cython.final
@cython.cclass
class OutConst(OutNode):
    """A value returned as it was when traced (a static field or leaf, None)."""

    value: object

    def __init__(self, value: object):
        self.value = value

    @cython.ccall
    def build(self, d: list) -> object:
        return self.value


# OutSequence kinds
_TUPLE = cython.declare(cython.Py_ssize_t, 0)
_LIST = cython.declare(cython.Py_ssize_t, 1)
_NAMEDTUPLE = cython.declare(cython.Py_ssize_t, 2)


@cython.final
@cython.cclass
class OutSequence(OutNode):
    """A tuple or a list (`cls` tuple or list), or a namedtuple of class `cls` (made as
    its unflatten makes it, by tuple.__new__), of the values its `items` build."""

    kind: cython.Py_ssize_t
    cls: object
    items: tuple

    def __init__(self, cls: object, items: tuple):
        self.kind = _TUPLE if cls is tuple else _LIST if cls is list else _NAMEDTUPLE
        self.cls = cls
        self.items = items

    @cython.ccall
    def build(self, d: list) -> object:
        n: cython.Py_ssize_t = len(self.items)
        j: cython.Py_ssize_t
        item: OutNode
        if not cython.compiled:
            values = [item.build(d) for item in self.items]
            return values if self.kind == _LIST else tuple(values) if self.kind == _TUPLE else _tuple_new(self.cls, values)
        made = PyList_New(n) if self.kind == _LIST else PyTuple_New(n)
        for j in range(n):
            item = self.items[j]
            value = item.build(d)
            Py_INCREF(value)  # (the SET_ITEMs take a reference)
            if self.kind == _LIST:
                PyList_SET_ITEM(made, j, value)
            else:
                PyTuple_SET_ITEM(made, j, value)
        if self.kind == _NAMEDTUPLE:
            return _tuple_new(self.cls, made)
        return made


@cython.final
@cython.cclass
class OutFields(OutNode):
    """A dict with `keys` (cls None), or an object of class `cls` made as Equinox's
    unflatten makes a module: object.__new__, then each field set as object.__setattr__
    sets it, in order. (`make_builder` writes one only for a class object.__new__ accepts
    and whose field names are not data descriptors: then the fields all land in the
    instance's own storage, set one by one or as one dict alike.)"""

    cls: object
    keys: tuple
    items: tuple

    def __init__(self, cls: object, keys: tuple, items: tuple):
        self.cls = cls
        self.keys = keys
        self.items = items

    @cython.ccall
    def build(self, d: list) -> object:
        n: cython.Py_ssize_t = len(self.items)
        j: cython.Py_ssize_t
        item: OutNode
        if self.cls is None:
            made_dict: dict = {}
            for j in range(n):
                item = self.items[j]
                made_dict[self.keys[j]] = item.build(d)
            return made_dict
        if not cython.compiled:
            made = _object_new(self.cls)
            _object_setattr(made, "__dict__", {k: item.build(d) for k, item in zip(self.keys, self.items)})
            return made
        base: cython.pointer[PyTypeObject] = cython.cast(cython.pointer[PyTypeObject], object)
        made = base.tp_new(self.cls, cython.cast(cython.pointer[PyObject], _EMPTY), cython.NULL)
        for j in range(n):
            item = self.items[j]
            PyObject_GenericSetAttr(made, self.keys[j], item.build(d))
        return made


def finish_output(plan: OutNode, note: Any, d: list, first: Any = None, nnx: Any = None) -> object:
    """A call's output built from `d` by `plan`; then, if `note` is not None, noted with
    `note(output, d)` for the next call (`OutInfo.remember`). What a call does after the
    compiled program returns, where that is all (`OutInfo.fast_result`). It takes the
    arguments of a record's post-processing too, `post(d, first, nnx)`, and ignores the
    last two: it is the post of a call that writes nothing back (`OutInfo.fast_post`)."""
    result = plan.build(d)
    if note is not None:
        note(result, d)
    return result

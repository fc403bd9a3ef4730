# cython: language_level=3, wraparound=False, boundscheck=False
"""Reading NNX objects again from what the general path left: for the structure route.

An NNX object whose cache entry is usable as it is has a fast-index slot that publishes it
(`FastSlot.node`, an `_nnx._entries.NodeEntry`); the structure route (`_structure_route`)
reads its leaves' current values through it (`read_node`, `read_nodes`), checking the slot as
the fast route does. A Variable passed on its own has no entry (it cannot be weakly
referenced): it is read by its type and metadata (`read_variable`), or, where another
argument holds it, at its place in that argument's entry (`read_shared_variable`). `apart`
says whether the objects a call read share nothing. The core reads only the entry fields
`FastSlot.node` documents (`spec_id`, `fresh`, `items`, `paths`, `node_ids`, `disjoint`): the
NNX plugin fills them; nothing here imports flax.

One of the sources setup.py compiles with Cython; `_entry_reads.pxd` declares what the
compiled structure route calls directly (C calls, no Python call). Run as Python, the same
functions are called as Python.
"""

from typing import Any, Optional

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from ._arrays import ArrayImpl
from ._plan import INDEX, VALUE_SLOT, FastSlot, JointRead, NnxArg, NodesRead, RawLeaf
from ._flatten import Strong

if cython.compiled:
    from cython.cimports.cpython.object import Py_TYPE, PyObject
    from cython.cimports.cpython.ref import Py_XDECREF
    from cython.cimports.cpython.weakref import PyWeakref_CheckProxy, PyWeakref_CheckRef, PyWeakref_GetRef
    from cython.cimports.fastcall._capi import PyObject_GenericGetDict, dict_combined, dict_version, new_record
    from cython.cimports.fastcall._guard import holds
else:  # (the same function, called as Python)
    from ._guard import holds

COMPILED: bool = cython.compiled

_INDEX = cython.declare(dict, INDEX)
_VALUE_SLOT = cython.declare(list, VALUE_SLOT)
_ARRAY = cython.declare(object, ArrayImpl)
_RAW_LEAF = cython.declare(object, RawLeaf)
_STRONG = cython.declare(object, Strong)
_FAST_SLOT = cython.declare(object, FastSlot)
_JOINT_READ = cython.declare(object, JointRead)
_NNX_ARG = cython.declare(object, NnxArg)
_NODES_OBJECTS = cython.declare(object, NodesRead.objects)
_EMPTY_IDS = cython.declare(frozenset, frozenset())
_ABSENT = cython.declare(object, object())
# The VariableRead whose metadata a Variable's metadata dict was last found to hold, and that
# dict's version tag then (`_metadata_matches`)
_m_read = cython.declare(object, None)
_m_metadata_version = cython.declare(cython.ulonglong, 0)


@cython.ccall
@cython.exceptval(-1, check=True)
def ref_is(ref: Any, obj: Any) -> cython.bint:
    """Whether the weak reference `ref` (or `_flatten.Strong`, or a callable) refers to `obj`."""
    if cython.compiled and PyWeakref_CheckRef(ref):
        target = cython.declare(cython.pointer(PyObject), cython.NULL)
        if PyWeakref_GetRef(ref, cython.address(target)) < 0:
            raise RuntimeError("fastcall: a weak reference could not be read")
        Py_XDECREF(target)  # (compared only, by address: `obj` holds it alive)
        return target == cython.cast(cython.pointer(PyObject), obj)
    if type(ref) is _STRONG:
        return cython.cast(tuple, ref)[0] is obj if cython.compiled else ref[0] is obj
    return ref() is obj


@cython.cfunc
def _new_nnx_arg(obj: Any, variables: Any, entry: Any, ids: Any, paths: Any) -> object:
    """`NnxArg(obj, variables, entry, ids, paths)`, made as its own `__new__` makes it."""
    fields = (obj, variables, entry, ids, paths, None)
    if cython.compiled:
        return new_record(_NNX_ARG, fields)
    else:
        return tuple.__new__(_NNX_ARG, fields)


@cython.ccall
def item_value(descr: Any, item: Any) -> object:
    """The current value of one leaf of an NNX entry: a Variable's through the `_raw_value`
    slot descriptor `descr` (`_plan.VALUE_SLOT`), a RawLeaf's as `raw_leaf_value` reads it."""
    if type(item) is _RAW_LEAF:
        return raw_leaf_value(item)
    if cython.compiled:
        return Py_TYPE(descr).tp_descr_get(descr, item, type(item))
    else:
        return descr.__get__(item, type(item))


@cython.ccall
def raw_leaf_value(leaf: Any) -> object:
    """A raw leaf's (`_plan.RawLeaf`) current value as NNX's graph flatten reads it: from its
    owner's attribute dict (`vars(owner)`), by getattr where it is not there (they differ only
    where a property of the class shadows the attribute). The owner is a weak proxy: read
    through its referent while it lives (each read then goes to it directly)."""
    owner = leaf[0]
    name = leaf[1]
    if cython.compiled and PyWeakref_CheckProxy(owner):
        target = cython.declare(cython.pointer(PyObject), cython.NULL)
        if PyWeakref_GetRef(owner, cython.address(target)) < 0:
            raise RuntimeError("fastcall: a weak proxy could not be read")
        if target != cython.NULL:  # (dead: read through the proxy, which raises ReferenceError)
            owner = cython.cast(object, target)
            Py_XDECREF(target)  # (`owner` holds it now)
    if cython.compiled:
        try:
            attrs = PyObject_GenericGetDict(owner, cython.NULL)
        except AttributeError:
            attrs = None
    else:
        attrs = owner.__dict__
    if type(attrs) is dict:
        value = cython.cast(dict, attrs).get(name, _ABSENT)
        if value is not _ABSENT:
            return value
    return getattr(owner, name)


@cython.ccall
@cython.exceptval(-1, check=True)
def read_node(
    a: Any, spec_id: Any, joint: Any, values: list, entries: list, nnx_args: Optional[list]
) -> cython.bint:
    """An NNX object's leaves' current values, from the cache entry its fast-index slot
    publishes (checked as the fast route checks a slot), which must have spec `spec_id` and
    have had its values checked for tracers (not `fresh`): appended to `values`, the entry to
    `entries` and its NnxArg to `nnx_args`. With `joint` (a JointRead): only from the entry it
    names, its `node_ids` unchanged, and only the leaves it keeps, with an NnxArg of those
    and no entry (as the general path's joint flatten makes it). False where it cannot."""
    descr = _VALUE_SLOT[0]
    if descr is None:
        return False
    slot = _INDEX.get(id(a))
    if type(slot) is not _FAST_SLOT:
        return False
    s: tuple = cython.cast(tuple, slot) if cython.compiled else slot
    node = s[3]
    if node is None or not ref_is(s[0], a) or (s[2] is not None and not holds(s[2])):
        return False
    keep: Any = None
    if joint is not None:
        j: tuple = cython.cast(tuple, joint) if cython.compiled else joint
        if not ref_is(j[1], node) or node.node_ids is not j[2]:
            return False
        keep = j[3]
    if node.spec_id != spec_id or node.fresh is not False:
        return False
    items = node.items
    if type(items) is not list:
        return False
    listed: list = items
    start: cython.Py_ssize_t = len(values)
    k: cython.Py_ssize_t
    if keep is None:
        for item in listed:
            values.append(item_value(descr, item))
    else:
        for k in keep:
            if not 0 <= k < len(listed):
                return False
        kept: list = [listed[k] for k in keep]
        for item in kept:
            values.append(item_value(descr, item))
        listed = kept
    # (tracers: inside an NNX transform; the first value tells, as in the fast route)
    if len(values) > start and type(values[start]) is not _ARRAY:
        return False
    if joint is None:
        entries.append(node)
    if nnx_args is not None:
        nnx_args.append(_new_nnx_arg(a, listed, node if joint is None else None, _EMPTY_IDS,
                                     node.paths if keep is None else None))
    return True


@cython.ccall
@cython.exceptval(-1, check=True)
def read_nodes(a: Any, read: Any, values: list, entries: list, nnx_args: Optional[list]) -> cython.Py_ssize_t:
    """A container of NNX objects (`NodesRead`): each read as `_read_node` reads it; how
    many were read jointly, or -1 where the record does not serve it."""
    r: tuple = cython.cast(tuple, read) if cython.compiled else read
    objs = _objects_of(a, r)
    if objs is None:
        return -1
    joint: cython.Py_ssize_t = 0
    elements: tuple = r[2]
    j: cython.Py_ssize_t
    for j in range(len(elements)):
        element = elements[j]  # (a spec id, or a JointRead)
        if type(element) is _JOINT_READ:
            if not read_node(cython.cast(tuple, objs)[j], cython.cast(tuple, element)[0], element, values, entries,
                              nnx_args):
                return -1
            joint += 1
        elif not read_node(cython.cast(tuple, objs)[j], element, None, values, entries, nnx_args):
            return -1
    return joint


@cython.cfunc
def _objects_of(a: Any, r: tuple) -> object:
    """The NNX objects of a container to read (`NodesRead.objects`), as a tuple (reading
    values may run code that changes a list or dict), or None: not of the record's kind and
    size."""
    found = _NODES_OBJECTS(r, a)
    if found is None:
        return None
    objs: tuple = tuple(found)
    return objs if len(objs) == len(cython.cast(tuple, r[2])) else None


@cython.cfunc
@cython.exceptval(-1, check=True)
def _metadata_matches(a: Any, r: tuple) -> cython.bint:
    """Whether the Variable `a`'s metadata (read through the slot the VariableRead `r`
    names) equals the read's copy. Where the dict holds the very objects the copy holds, its
    version tag is remembered with the read: a dict with that tag again is in that same state
    (tags are never reused), so a loop passing one Variable compares once. (Only then: a memo
    of an `==` between distinct objects would miss a change inside one of them.)"""
    slot = r[3]
    metadata = Py_TYPE(slot).tp_descr_get(slot, a, type(a)) if cython.compiled else slot.__get__(a, type(a))
    expected = r[2]
    if cython.compiled:
        trusted: cython.bint = type(metadata) is dict and dict_combined(metadata)
        version: cython.ulonglong = dict_version(metadata) if trusted else 0
        global _m_read, _m_metadata_version
        if version != 0 and _m_read is r and _m_metadata_version == version:
            return True
        same: cython.bint = metadata == expected
        if same and version != 0 and dict_version(metadata) == version and _same_values(metadata, expected):
            _m_read = r
            _m_metadata_version = version
        return same
    else:
        return metadata == expected


@cython.cfunc
@cython.exceptval(-1, check=True)
def _same_values(d: dict, expected: Any) -> cython.bint:
    """Whether two dicts hold the very same values under the same str keys (no user code runs)."""
    if type(expected) is not dict or len(d) != len(cython.cast(dict, expected)):
        return False
    for k, v in d.items():
        if type(k) is not str or cython.cast(dict, expected).get(k, _ABSENT) is not v:
            return False
    return True


@cython.ccall
@cython.exceptval(-1, check=True)
def read_variable(a: Any, read: Any, values: list, nnx_args: Optional[list]) -> cython.bint:
    """A Variable passed on its own (`VariableRead`): of the record's type, with metadata equal
    to the record's copy and a jax array as value: that value appended to `values`, its NnxArg
    (as `_nnx._reads._read_variable` makes it) to `nnx_args`."""
    descr = _VALUE_SLOT[0]
    r: tuple = cython.cast(tuple, read) if cython.compiled else read
    if descr is None or type(a) is not r[1]:
        return False
    try:
        if not _metadata_matches(a, r):
            return False
    except Exception:  # (metadata that cannot be compared: the general path reads it)
        return False
    if not _append_array(descr, a, values):
        return False
    if nnx_args is not None:
        nnx_args.append(_new_nnx_arg(a, [a], None, frozenset((id(a),)), None))
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _append_array(descr: Any, v: Any, values: list) -> cython.bint:
    """Append the Variable `v`'s value to `values` if it is a jax array; False if not (a
    tracer: inside an NNX transform, where the general path reads it)."""
    value = item_value(descr, v)
    if type(value) is not _ARRAY:
        return False
    values.append(value)
    return True


@cython.ccall
@cython.exceptval(-1, check=True)
def read_shared_variable(a: Any, read: Any, reads: tuple, values: list, nnx_args: Optional[list]) -> cython.bint:
    """A Variable passed on its own that another argument holds (`SharedVariableRead`): the
    very Variable at the recorded position of the entry its owner's JointRead pins (the call
    reads the owner from that entry too); with `first` (met before its holder) its value
    appended to `values`, else nothing (its holder passes it); its NnxArg, as the joint
    flatten's, to `nnx_args`."""
    r: tuple = cython.cast(tuple, read) if cython.compiled else read
    owner: cython.Py_ssize_t = r[1]
    if owner < 0 or owner >= len(reads) or type(reads[owner]) is not _JOINT_READ:
        return False
    entry = cython.cast(tuple, reads[owner])[1]()
    if entry is None:
        return False
    items = entry.items
    position: cython.Py_ssize_t = r[2]
    if type(items) is not list or position < 0 or position >= len(items) or cython.cast(list, items)[position] is not a:
        return False
    first: cython.bint = r[3]
    if first:
        descr = _VALUE_SLOT[0]
        if descr is None or not _append_array(descr, a, values):
            return False
    if nnx_args is not None:
        nnx_args.append(_new_nnx_arg(a, [a] if first else [], None, _EMPTY_IDS, [()] if first else []))
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _known_disjoint(entries: list) -> cython.bint:
    """Whether the NNX objects read, by their cache entries in call order, are known to share
    nothing: each earlier entry's `disjoint` cache (`_nnx._reads.overlapping` fills it: id(later
    entry) -> (weak reference to it, shares nothing?)) says so for every later one."""
    n: cython.Py_ssize_t = len(entries)
    i: cython.Py_ssize_t
    j: cython.Py_ssize_t
    for i in range(n - 1):
        cache = entries[i].disjoint
        if type(cache) is not dict:
            return False
        for j in range(i + 1, n):
            other = entries[j]
            known = cython.cast(dict, cache).get(id(other))
            if type(known) is not tuple or len(known) != 2 or cython.cast(tuple, known)[1] is not True:
                return False
            if not ref_is(cython.cast(tuple, known)[0], other):
                return False
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _variables_apart(loose: list, entries: list) -> cython.bint:
    """Whether the Variables read on their own share nothing: none read twice, none a
    Variable of an NNX object read from its cache entry (its `node_ids`)."""
    ids = set()
    for v in loose:
        ids.add(id(v))
    if len(ids) != len(loose):
        return False
    for entry in entries:
        node_ids = entry.node_ids
        if type(node_ids) is not frozenset or not cython.cast(frozenset, node_ids).isdisjoint(ids):
            return False
    return True


@cython.ccall
@cython.exceptval(-1, check=True)
def apart(entries: list, loose: list) -> cython.bint:
    """Whether the NNX objects a call read on their own share nothing: the Variables read on
    their own (`loose`) none twice and none in an object read from its cache entry, and those
    objects (`entries`, in call order) known to share nothing."""
    if loose and (len(loose) > 1 or entries) and not _variables_apart(loose, entries):
        return False
    return len(entries) < 2 or _known_disjoint(entries)

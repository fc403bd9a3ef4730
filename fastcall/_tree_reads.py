# cython: language_level=3, wraparound=False
"""Reading a pytree argument's leaves by the structure a call recorded, with no Python frame.

A structure record (`_plan.ArgRead`) says how a later call reads a new object of a known
structure. For a tuple, list or dict of leaves, nested or not (`_plan.SequenceRead`: a batch,
a params dict of dicts), and for a pytree node type of its own whose leaves are all arrays
(`_plan.TreeRead`: a registered dataclass, read by jax's flatten), the reader is one of these
functions; so is the check of a static argument (`_plan.StaticRead`), and the read of the
nnx.States in a pytree holding NNX objects (`_plan.MappingRead`: `expand_into`). The
compiled structure route calls them as C (`_tree_reads.pxd`); the general path calls them
too (a template's `extract`, `_codegen`).

One of the sources setup.py compiles with Cython (see `fastcall/_rebuild.py`), run as this
file where it is not compiled.
"""

from typing import Any

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from ._arrays import ArrayImpl
from ._plan import VariableValueRead
from ._flatten import static_equal

COMPILED: bool = cython.compiled

_array = cython.declare(object, ArrayImpl)
_MISSING = cython.declare(object, object())  # (no such key)
_VALUE_READ = cython.declare(object, VariableValueRead)


@cython.ccall
def sequence_leaves(read: Any, a: Any) -> Any:
    """The leaves of `a` as the SequenceRead `read` reads them, as a tuple (`sequence_into`);
    None if `a` is not of its structure."""
    seq = cython.cast(tuple, read)
    if seq[4] is None:  # (leaves only: its items, as they are where `a` is a tuple)
        try:
            items = _items(seq, a)
            if items is None:
                return None
            for x in cython.cast(tuple, items):
                if type(x) is not _array and type(x) not in cython.cast(frozenset, seq[2]):
                    return None
        except Exception:  # (as `sequence_into`'s)
            return None
        return items
    out: list = []
    return tuple(out) if sequence_into(read, a, out) else None


@cython.ccall
@cython.exceptval(-1, check=True)
def sequence_into(read: Any, a: Any, out: list) -> cython.bint:
    """Appends the leaves of `a` as the SequenceRead `read` reads them to `out`: its items (a
    dict's values at the read's keys, in their order) if `a` is of exactly the read's type
    and length and each item's exact type is one of its leaf types, or, where the read nests,
    the leaves of each container among them, depth first. Whether `a` reads so (if not, `out`
    may hold some of its leaves). An exception of the checks (a dict key's `__eq__` may raise)
    says False too: the general path reads the argument again, and names any error."""
    seq = cython.cast(tuple, read)
    start: cython.Py_ssize_t = len(out)
    try:
        if not _fill(seq, a, seq[2], out):
            return False
    except Exception:
        return False
    return seq[4] is None or len(out) - start == seq[5]


@cython.ccall
@cython.exceptval(-1, check=True)
def shaped_as(read: Any, a: Any) -> cython.bint:
    """Whether `a` is of exactly the SequenceRead `read`'s container kind (a tuple, list or
    dict) and length, its items not looked at (a dict's length is its recorded keys')."""
    seq = cython.cast(tuple, read)
    kind = seq[0]
    if type(a) is not kind:
        return False
    if kind is dict:
        return len(cython.cast(dict, a)) == seq[1]
    if kind is list:
        return len(cython.cast(list, a)) == seq[1]
    return kind is tuple and len(cython.cast(tuple, a)) == seq[1]


@cython.cfunc
def _items(seq: tuple, a: Any) -> Any:
    """The items of `a` as the SequenceRead `seq` reads them, as a tuple, if it is
    `shaped_as` it; else None. (A list's or dict's items are taken into a new tuple: the leaf
    tests may run code, a metaclass's `__hash__`, that changes them.)"""
    if not shaped_as(seq, a):
        return None
    kind = seq[0]
    if kind is tuple:
        return a
    if kind is list:
        return tuple(cython.cast(list, a))
    d = cython.cast(dict, a)
    return tuple([d[k] for k in cython.cast(tuple, seq[3])])  # (a missing key: KeyError, not of this structure)


@cython.cfunc
@cython.exceptval(-1, check=True)
def _fill(seq: tuple, a: Any, leaf_types: frozenset, out: list) -> cython.bint:
    """Appends the leaves of `a`, nested as the SequenceRead `seq` says (its `items`: per
    item, None for a leaf or the read of the container it is), to `out`, depth first;
    whether `a` reads so. (As deep as the read nests: `_codegen.sequence_read` bounds it.)
    Read straight where no user code can run (`_straight_fill`); else from a snapshot of
    each container's items, taken as it is reached, so that code run by a leaf test cannot
    change what is read."""
    start: cython.Py_ssize_t = len(out)
    straight = _straight_fill(seq, a, leaf_types, out)
    if straight >= 0:
        return straight == 1
    del out[start:]
    items = _items(seq, a)
    if items is None:
        return False
    reads = seq[4]
    if reads is not None and len(cython.cast(tuple, reads)) != len(cython.cast(tuple, items)):
        return False
    i: cython.Py_ssize_t
    for i in range(len(cython.cast(tuple, items))):
        x = cython.cast(tuple, items)[i]
        inner = None if reads is None else cython.cast(tuple, reads)[i]
        if inner is not None:
            if not _fill(cython.cast(tuple, inner), x, leaf_types, out):
                return False
        elif type(x) is _array or type(x) in leaf_types:
            out.append(x)
        else:
            return False
    return True


@cython.cfunc
@cython.exceptval(-2, check=True)
def _straight_fill(seq: tuple, a: Any, leaf_types: frozenset, out: list) -> cython.int:
    """`_fill` with no snapshot of any container's items, the whole argument read in one go:
    1 (read so) or 0 (not of this structure); -1 where some read might run user code, which
    could change a container while it is read (a dict key that is not exactly a str, whose
    `__eq__` a lookup may call; a leaf whose type's type is not `type`, whose `__hash__` the
    leaf-type test calls): `_fill` then reads it again from snapshots."""
    if not shaped_as(seq, a):
        return 0
    kind = seq[0]
    n: cython.Py_ssize_t = seq[1]
    keys = seq[3]
    reads = seq[4]
    if reads is not None and len(cython.cast(tuple, reads)) != n:
        return 0
    i: cython.Py_ssize_t
    found: cython.int
    for i in range(n):
        if kind is dict:
            k = cython.cast(tuple, keys)[i]
            if type(k) is not str:
                return -1
            x = cython.cast(dict, a).get(k, _MISSING)
            if x is _MISSING:
                return 0
        elif kind is tuple:
            x = cython.cast(tuple, a)[i]
        else:  # (a list: its length checked, and no code runs between that and this read)
            x = cython.cast(list, a)[i]
        inner = None if reads is None else cython.cast(tuple, reads)[i]
        if inner is not None:
            found = _straight_fill(cython.cast(tuple, inner), x, leaf_types, out)
            if found != 1:
                return found
        elif type(x) is _array:
            out.append(x)
        elif type(type(x)) is not type:
            return -1
        elif type(x) in leaf_types:
            out.append(x)
        else:
            return 0
    return 1


@cython.ccall
def tree_leaves(read: Any, a: Any) -> Any:
    """The leaves of `a` as the TreeRead `read` reads them, as jax.jit reads it: jax's flatten
    of `a` (its States and Variables read by `expand_into`, where the read says so), if its
    treedef equals the read's (node types and node data, as jax compares them) and each
    leaf's exact type is one of the read's leaf types, as a tuple; else None
    (not of this structure; an exception of the flatten or the comparison says so too: the
    general path reads it again, and names the argument)."""
    flatten, treedef, leaf_types, is_leaf, expand = cython.cast(tuple, read)
    try:
        flat = flatten(a) if is_leaf is None else flatten(a, is_leaf)
        leaves, found = cython.cast(tuple, flat)
        if not found == treedef:
            return None
    except Exception:
        return None
    if expand is not None:
        expanded: list = []
        if not expand_into(cython.cast(list, leaves), cython.cast(tuple, expand), expanded):
            return None
        leaves = expanded
    for x in cython.cast(list, leaves):
        if type(x) is not _array and type(x) not in cython.cast(frozenset, leaf_types):
            return None
    return tuple(cython.cast(list, leaves))


@cython.ccall
@cython.exceptval(-1, check=True)
def expand_into(leaves: list, expand: tuple, out: list) -> cython.bint:
    """Appends to `out` each of `leaves` where `expand` (one item per leaf) says None, and
    where it gives a read (`_plan.MixedRead.expand`, `_plan.TreeRead.expand`), what jax's
    flatten gives for that leaf: a MappingRead's values at its keys, depth first; a
    VariableValueRead's raw value. Whether each reads so: exactly its kind, a dict of
    exactly its keys (then jax's sorted order is the read's), a Variable of its metadata,
    as deep as recorded. (The leaves are checked by the caller, as it checks jax's.) An
    exception of the checks (a key's `__eq__` may raise) says False too."""
    if len(leaves) != len(expand):
        return False
    i: cython.Py_ssize_t
    try:
        for i in range(len(leaves)):
            if not _expand_one(expand[i], leaves[i], out):
                return False
    except Exception:
        return False
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _expand_one(read: Any, a: Any, out: list) -> cython.bint:
    """`expand_into` for one leaf `a` and its read."""
    if read is None:
        out.append(a)
        return True
    if type(read) is _VALUE_READ:
        kind, metadata = cython.cast(tuple, read)
        if type(a) is not kind:
            return False
        found = getattr(a, "_var_metadata")
        if found is not metadata and not (type(found) is dict and found == metadata):
            return False
        out.append(getattr(a, "_raw_value"))
        return True
    return _mapping_fill(cython.cast(tuple, read), a, out)


@cython.cfunc
@cython.exceptval(-1, check=True)
def _mapping_fill(read: tuple, a: Any, out: list) -> cython.bint:
    """`_expand_one` for a MappingRead `read` (kind, attr, keys, items) and node `a`."""
    if type(a) is not read[0]:
        return False
    attr = read[1]
    d = a if attr is None else getattr(a, attr)
    if type(d) is not dict:
        return False
    keys: tuple = read[2]
    items: tuple = read[3]
    if len(cython.cast(dict, d)) != len(keys):
        return False
    i: cython.Py_ssize_t
    for i in range(len(keys)):
        x = cython.cast(dict, d).get(keys[i], _MISSING)
        if x is _MISSING or not _expand_one(items[i], x, out):
            return False
    return True


@cython.ccall
@cython.exceptval(-1, check=True)
def static_matches(read: Any, a: Any) -> cython.bint:
    """Whether `a` is the static argument the StaticRead `read` expects: the recorded object,
    or (`by_value`) one with its `_flatten.leaf_key` (its exact type and value: an int or
    str equal to it, a float of the same bits)."""
    _spec_id, value, by_value = cython.cast(tuple, read)
    if a is value:
        return True
    if by_value is not True or type(a) is not type(value):
        return False
    if type(a) is int or type(a) is str:
        return a == value  # (exact types: no user code)
    return static_equal(a, value)

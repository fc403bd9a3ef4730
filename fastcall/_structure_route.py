# cython: language_level=3, wraparound=False, boundscheck=False
"""The structure route: a call whose arguments have the structures of one the function ran.

A general call leaves a `_plan.CallPlan` in the function's `structures` table (made by
`_dispatch._publish_structure`), keyed by its first argument's type and keyword names
(`_plan.structure_key`; the record, then its `others`, tried in turn, the one that served the
last such call first). The route serves a later call under a record when the call has the
record's arity and keyword names, and each argument, taken in the record's `order`, reads as
its read says:

* None: a plain leaf (a jax array, or a type of the function's `plain`), passed as it is;
* `StaticRead`: the recorded object, or a scalar equal to it (`_tree_reads.static_matches`);
* `ArgRead`: a pytree's leaves from the identity cache (an entry whose ref is the argument,
  whose guard holds, of the expected spec), or the memo of returned objects
  (`_memo.latest_leaves`), or else its structure's extractor, unless it is the object last read
  there (`CallPlan.last`: the general path caches it by identity);
* `NodeRead`, `JointRead`: an NNX object, from the cache entry its fast-index slot publishes
  (`FastSlot.node`: checked as the fast route checks a slot), of the expected spec: its
  leaves' current values (a JointRead: from that very entry, unchanged, only the leaves it
  keeps); `NodesRead`: each of a tuple, list, dict or other pytree of them;
* `VariableRead`: a Variable on its own, of the recorded type and metadata;
  `SharedVariableRead`: one another argument holds at the recorded place;
* `MixedRead`: a pytree holding NNX objects beside other leaves, each read as above;
* `GraphdefRead`: a GraphDef `GRAPHDEFS` knows as this very object, unchanged.

A call with NNX objects is served where they share nothing (or all were read jointly, as
recorded) and `_trace.may_serve_nnx` allows it. The compiled function then runs on the
leaves, in order; the record's `post` finishes its output (writes NNX state back). Any other
call is declined (`DECLINED`): the general path serves it (`_dispatch`).

The cache entries read through a slot are the NNX plugin's; the route reads only the fields
`FastSlot.node` documents (`spec_id`, `fresh`, `items`, `paths`, `node_ids`, `disjoint`).

One source, two ways to run it, as `_fast_route`: compiled by Cython where the package was
built with a C compiler (the C wrapper enters it through `SERVE`, with the call's own argument
array), run as this very file where not (the Python wrapper calls the route). `f.explain`
reads a call through the same code (`declined_reads`), which then says why it declines.
"""

import weakref
from typing import Any, Optional

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from . import _flatten
from ._arrays import ArrayImpl
from ._fast_route import DECLINED
from ._plan import (
    GRAPHDEFS, ArgRead, CallPlan, FastSlot, GraphdefRead, JointRead, KnownGraphdef, MappingRead, MixedRead, NnxArg,
    NodeRead, NodesRead, SequenceRead, SharedVariableRead, StaticRead, TreeRead, VariableRead,
    VariableValueRead,
)
from ._outputs import Varying

if cython.compiled:  # (the other compiled modules' functions, called as C: their .pxd files)
    from cython.cimports.cpython.pycapsule import PyCapsule_New
    from cython.cimports.cpython.sequence import PySequence_Fast_ITEMS
    from cython.cimports.cpython.weakref import PyWeakref_NewRef
    from cython.cimports.fastcall._capi import PyObject_Vectorcall, dict_version, weakrefable
    from cython.cimports.fastcall._entry_reads import (
        apart, read_node, read_nodes, read_shared_variable, read_variable, ref_is,
    )
    from cython.cimports.fastcall._guard import holds
    from cython.cimports.fastcall._memo import latest_leaves
    from cython.cimports.fastcall._trace import may_serve_nnx
    from cython.cimports.fastcall._tree_reads import expand_into, sequence_into, shaped_as, static_matches, tree_leaves
else:  # (the same functions, called as Python)
    from ._entry_reads import apart, read_node, read_nodes, read_shared_variable, read_variable, ref_is
    from ._guard import holds
    from ._memo import latest_leaves
    from ._trace import may_serve_nnx
    from ._tree_reads import expand_into, sequence_into, shaped_as, static_matches, tree_leaves

if cython.compiled:  # (a call's arguments: C's array, `_capi.Argv`; run as Python, a tuple)
    from cython.cimports.fastcall._capi import Argv, arg
else:
    from operator import getitem as arg

    Argv = tuple

COMPILED: bool = cython.compiled

# (C constants where compiled: no module lookup per use)
_BY_ID = cython.declare(dict, _flatten.by_id)
_GRAPHDEFS = cython.declare(dict, GRAPHDEFS)
_ARRAY = cython.declare(object, ArrayImpl)
_VARYING = cython.declare(object, Varying)
_CACHE_ENTRY = cython.declare(object, _flatten.CacheEntry)
_KNOWN_GRAPHDEF = cython.declare(object, KnownGraphdef)
_PLAN = cython.declare(object, CallPlan)
_ARG_READ = cython.declare(object, ArgRead)
_STATIC_READ = cython.declare(object, StaticRead)
_NODE_READ = cython.declare(object, NodeRead)
_JOINT_READ = cython.declare(object, JointRead)
_NODES_READ = cython.declare(object, NodesRead)
_MIXED_READ = cython.declare(object, MixedRead)
_VARIABLE_READ = cython.declare(object, VariableRead)
_SHARED_READ = cython.declare(object, SharedVariableRead)
_GRAPHDEF_READ = cython.declare(object, GraphdefRead)
_TREE_READ = cython.declare(object, TreeRead)
_SEQUENCE_READ = cython.declare(object, SequenceRead)
_DECLINED = cython.declare(object, DECLINED)  # (what the routes return for a call they do not serve)
# (a CallPlan's fields, read by position where compiled: their places in the record itself)
_ARITY = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("arity"))
_CALL = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("call"))
_POST = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("post"))
_READS = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("reads"))
_LAST = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("last"))
_FAST_SHAPE = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("fast_shape"))
_KWNAMES = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("kwnames"))
_ORDER = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("order"))
_HOLD_FIRST = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("hold_first"))
_OTHERS = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("others"))

# The records the hit routes read by position (compiled, as tuples), with their fields in that
# order: checked at import, so that a change of layout fails there instead of misreading.
LAYOUTS: dict[Any, tuple[str, ...]] = {
    FastSlot: ("ref", "records", "guard", "node"),
    CallPlan: (
        "arity", "call", "post", "variables", "reads", "last", "fast_shape", "kwnames", "order", "hold_first",
        "others",
    ),
    _flatten.CacheEntry: ("ref", "leaves", "spec_id", "spec", "guard"),
    KnownGraphdef: ("graphdef", "snapshot", "spec_id", "spec"),
    ArgRead: ("spec_id", "extract", "sequence", "by_identity"),
    SequenceRead: ("kind", "length", "leaf_types", "keys", "items", "n_leaves"),
    TreeRead: ("flatten", "treedef", "leaf_types", "is_leaf", "expand"),
    StaticRead: ("spec_id", "value", "by_value"),
    NodeRead: ("spec_id",),
    GraphdefRead: ("spec_id",),
    JointRead: ("spec_id", "entry", "node_ids", "keep"),
    NodesRead: ("spec_id", "kind", "elements", "keys"),
    MixedRead: ("spec_id", "flatten", "is_leaf", "treedef", "layout", "expand"),
    MappingRead: ("kind", "attr", "keys", "items"),
    VariableValueRead: ("kind", "metadata"),
    VariableRead: ("spec_id", "kind", "metadata", "metadata_slot"),
    SharedVariableRead: ("spec_id", "owner", "position", "first"),
    NnxArg: ("obj", "variables", "entry", "ids", "paths", "index"),
}


def check_layout(cls: Any, fields: tuple) -> None:
    """Raise TypeError, naming the field, if the record class `cls` has other fields than
    `fields` (the order the routes read them in)."""
    given = tuple(cls._fields)
    for i, (field, expected) in enumerate(zip(given, fields)):
        if field != expected:
            raise TypeError(f"fastcall: {cls.__name__} field {i} is {field!r}; the hit routes read it as {expected!r}")
    if len(given) != len(fields):
        raise TypeError(f"fastcall: {cls.__name__} has {len(given)} fields; the hit routes read {len(fields)}")


for _cls, _fields in LAYOUTS.items():
    check_layout(_cls, _fields)


@cython.final
@cython.cclass
class StructureRoute:
    """A wrapped function's structure route. `structures`: its table of records
    (`state.structures`); `state`, `on_error`, `finish_varying`, `plain`, `serves_nested`: as
    `_fast_route.FastRoute`'s. Called as `route(*args, **kwargs)` (the Python wrapper) or
    through `SERVE` (the C wrapper): the output, or DECLINED."""

    structures: dict
    state: Any
    on_error: Any
    finish_varying: Any
    plain: frozenset
    serves_nested: cython.bint
    structure_calls = cython.declare(cython.Py_ssize_t, visibility="readonly")  # calls served here
    # The address of the record that served the last call among several of one key: compared
    # with that key's records' only, never followed (a new record at a reused address only
    # goes first)
    _last_served: cython.Py_ssize_t
    # The last call's lookup of its record (no keywords): the first argument's type, what was
    # found (borrowed, NULL: absent) and the table's version tag then (see `_fast_route`)
    _m_type: cython.p_void
    _m_head: cython.p_void
    _m_version: cython.ulonglong
    __weakref__: Any  # (FunctionState.structure_routes is a WeakSet)

    def __init__(
        self, structures: dict, state: Any, on_error: Any, finish_varying: Any, plain: frozenset, serves_nested: bool
    ):
        self.structures = structures
        self.state = state
        self.on_error = on_error
        self.finish_varying = finish_varying
        self.plain = plain
        self.serves_nested = serves_nested
        self.structure_calls = 0
        self._last_served = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        argv: tuple = (*args, *kwargs.values()) if kwargs else args
        kwnames: Any = tuple(kwargs) if kwargs else None
        if cython.compiled:
            return _serve(self, PySequence_Fast_ITEMS(argv), len(args), kwnames)
        else:
            return _serve(self, argv, len(args), kwnames)


@cython.cfunc
def _serve(route: StructureRoute, argv: Argv, nargs: cython.Py_ssize_t, kwnames: Any) -> object:
    """`f(*argv)` (`nargs` positional arguments, then one per name of `kwnames`, None if
    none) served by the first of its key's records that reads it, or DECLINED."""
    if nargs == 0:
        return _DECLINED
    head: Any = _record_for(route, type(arg(argv, 0)), kwnames)
    if type(head) is not _PLAN:
        return _DECLINED
    others: tuple = cython.cast(tuple, head)[_OTHERS] if cython.compiled else head.others
    if not others:
        return _serve_record(route, head, argv, nargs, kwnames)
    hot: Any = None  # (the record that served the last call, if it is one of these)
    if _address(head) == route._last_served:
        hot = head
    else:
        for r in others:
            if _address(r) == route._last_served:
                hot = r
                break
    out: Any
    if hot is not None:
        out = _serve_record(route, hot, argv, nargs, kwnames)
        if out is not _DECLINED:
            return out
    if head is not hot:
        out = _serve_record(route, head, argv, nargs, kwnames)
        if out is not _DECLINED:
            route._last_served = _address(head)
            return out
    for r in others:
        if r is not hot:
            out = _serve_record(route, r, argv, nargs, kwnames)
            if out is not _DECLINED:
                route._last_served = _address(r)
                return out
    return _DECLINED


@cython.cfunc
@cython.inline
def _address(obj: Any) -> cython.Py_ssize_t:
    """`id(obj)`, compiled without making an int."""
    if cython.compiled:
        return cython.cast(cython.Py_ssize_t, cython.cast(cython.p_void, obj))
    else:
        return id(obj)


@cython.cfunc
def _record_for(route: StructureRoute, first_type: Any, kwnames: Any) -> object:
    """`structures[_plan.structure_key(...)]`, or None; without keywords, remembered as
    `_fast_route` remembers its lookups."""
    if kwnames is not None:
        return route.structures.get((first_type, kwnames))
    if cython.compiled:
        version: cython.ulonglong = dict_version(route.structures)
        if version != 0 and route._m_type == cython.cast(cython.p_void, first_type) and route._m_version == version:
            return None if route._m_head == cython.NULL else cython.cast(object, route._m_head)
        found = route.structures.get(first_type)
        route._m_type = cython.cast(cython.p_void, first_type)
        route._m_head = cython.NULL if found is None else cython.cast(cython.p_void, found)
        route._m_version = version
        return found
    else:
        return route.structures.get(first_type)


@cython.cfunc
def _serve_record(route: StructureRoute, record: Any, argv: Argv, nargs: cython.Py_ssize_t, kwnames: Any) -> object:
    """`f(*argv)` served under `record`, or DECLINED."""
    known: tuple = cython.cast(tuple, record) if cython.compiled else record
    post = known[_POST]
    nnx_args: Optional[list] = [] if post is not None else None
    values = _read_arguments(route, known, argv, nargs, kwnames, nnx_args, None)
    if values is None:
        return _DECLINED
    _mark(known, argv)
    call = known[_CALL]
    route.structure_calls += 1
    try:
        if cython.compiled:
            out = PyObject_Vectorcall(call, PySequence_Fast_ITEMS(values), len(values), cython.NULL)
        else:
            out = call(*values)
    except Exception as err:
        route.on_error(err, *_call_arguments(argv, nargs, kwnames))
        raise  # (on_error raises; if it did not)
    if type(out) is _VARYING:  # (its trace met a new output structure: the general path finishes it)
        route.structure_calls -= 1
        return route.finish_varying(out, *_call_arguments(argv, nargs, kwnames))
    if post is None:
        return out
    return post(out, arg(argv, 0), nnx_args if nnx_args else None)


@cython.cfunc
def _call_arguments(argv: Argv, nargs: cython.Py_ssize_t, kwnames: Any) -> tuple:
    """(args, kwargs or None) of the call, for the general path's handlers."""
    args = tuple([arg(argv, i) for i in range(nargs)])
    if kwnames is None:
        return (args, None)
    names: tuple = kwnames
    return (args, {names[j]: arg(argv, nargs + j) for j in range(len(names))})


@cython.cfunc
def _read_arguments(
    route: StructureRoute, known: tuple, argv: Argv, nargs: cython.Py_ssize_t, kwnames: Any, nnx_args: Optional[list],
    why: Optional[list],
) -> Optional[list]:
    """The leaves the call passes, read as the record `known` says (its NNX objects' NnxArgs
    appended to `nnx_args`, if a list); None if the record does not serve it. `why`
    (`f.explain` only): where it declines, (argument index or None, reason in words)."""
    if not _passed_as_recorded(known, nargs, kwnames, why):
        return None
    reads: tuple = known[_READS]
    last: list = known[_LAST]
    n: cython.Py_ssize_t = len(reads)
    fast_shape: cython.bint = known[_FAST_SHAPE]
    values: list = []
    # (made at the first NNX object read) the cache entries of NNX objects read on their own,
    # and the Variables read on their own (by a VariableRead, or in a MixedRead)
    entries: Optional[list] = None
    loose: Optional[list] = None
    joint: cython.Py_ssize_t = 0  # (NNX objects read jointly: then every one must be)
    nnx: cython.bint = False
    found: cython.Py_ssize_t
    i: cython.Py_ssize_t
    for i in range(n):
        a = arg(argv, _position(known, i))
        read = reads[i]
        if read is None:
            t = type(a)
            if t is not _ARRAY and t not in route.plain:
                return _declined(why, i, f"a {t.__name__} where the recorded call passed an array")
            values.append(a)
            continue
        kind = type(read)
        if kind is _STATIC_READ:
            if a is not cython.cast(tuple, read)[1] and not static_matches(read, a):
                return _declined(why, i, "static, and not the value the recorded call passed")
            continue
        if kind is _ARG_READ:
            if not _read_pytree(read, a, i, last, fast_shape and i == 0, values, why):
                return None
            continue
        if kind is _GRAPHDEF_READ:
            if not _read_graphdef(a, cython.cast(tuple, read)[0]):
                return _declined(why, i, "not the graphdef the recorded call passed")
            continue
        if not nnx:
            nnx = True
            entries = []
            loose = []
        found = _read_nnx(route, a, read, reads, i, values, entries, loose, nnx_args, why)
        if found < 0:
            return None
        joint += found
    if nnx and (entries or loose or joint) and not _nnx_servable(route, known, entries, loose, joint, why):
        return None
    return values


@cython.cfunc
@cython.exceptval(-2, check=True)
def _read_nnx(
    route: StructureRoute, a: Any, read: Any, reads: tuple, i: cython.Py_ssize_t, values: list, entries: list,
    loose: list, nnx_args: Optional[list], why: Optional[list],
) -> cython.Py_ssize_t:
    """`_read_arguments` for an argument read as NNX objects (or a pytree holding them), the
    `i`-th: its leaves appended to `values`, its cache entries to `entries` and the Variables
    read on their own to `loose`; how many NNX objects it read jointly, or -1 where the record
    does not serve it (said in `why`)."""
    kind = type(read)
    if kind is _NODE_READ:
        if read_node(a, cython.cast(tuple, read)[0], None, values, entries, nnx_args):
            return 0
        _declined(why, i, "not an NNX object of the structure the recorded call read (or its cache entry changed)")
    elif kind is _JOINT_READ:
        if read_node(a, cython.cast(tuple, read)[0], read, values, entries, nnx_args):
            return 1
        _declined(why, i, "read jointly in the recorded call; not that object now, or its cache entry changed since")
    elif kind is _VARIABLE_READ:
        if read_variable(a, read, values, nnx_args):
            loose.append(a)
            return 0
        _declined(why, i, "not a Variable of the type and metadata the recorded call passed")
    elif kind is _SHARED_READ:
        if read_shared_variable(a, read, reads, values, nnx_args):
            return 1
        owner = cython.cast(tuple, read)[1]
        _declined(why, i, f"the recorded call passed the Variable that argument {owner} holds at one place; this is another")
    elif kind is _NODES_READ:
        found: cython.Py_ssize_t = read_nodes(a, read, values, entries, nnx_args)
        if found >= 0:
            return found
        _declined(why, i, "not a container of the NNX objects, of the structures, the recorded call read")
    elif kind is _MIXED_READ:
        if _read_mixed(route, a, read, values, entries, loose, nnx_args):
            return 0
        _declined(why, i, "not a pytree of the structure, static values and NNX objects the recorded call passed")
    else:
        _declined(why, i, "read in a way this route does not know")
    return -1


@cython.cfunc
@cython.exceptval(-1, check=True)
def _nnx_servable(
    route: StructureRoute, known: tuple, entries: list, loose: list, joint: cython.Py_ssize_t, why: Optional[list]
) -> cython.bint:
    """Whether a call whose NNX objects read as `entries` (cache entries read on their own),
    `loose` (Variables read on their own) and `joint` (how many read jointly) may be served:
    they share nothing, or (a record reading one jointly reads every one so) all were read
    jointly; and `_trace.may_serve_nnx` allows it now."""
    if not (not entries and not loose if joint else apart(entries, loose)):
        _declined(
            why,
            None,
            "its NNX arguments share Variables or nodes, and the recorded call's did not (or the other way"
            " round), or they are not known not to: the general path reads them jointly",
        )
        return False
    if not may_serve_nnx(known[_POST] is None and route.serves_nested):
        _declined(why, None, "called inside a jax transformation, which this plan cannot serve")
        return False
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _passed_as_recorded(known: tuple, nargs: cython.Py_ssize_t, kwnames: Any, why: Optional[list]) -> cython.bint:
    """Whether the call passes as many positional arguments and the same keyword names, in
    order, as the record's call (and the record's reads and `order` fit them)."""
    arity: cython.Py_ssize_t = known[_ARITY]
    if arity != nargs:
        _declined(why, None, "another number of positional arguments than the recorded call's")
        return False
    expected_names = known[_KWNAMES]
    if kwnames is None:
        if expected_names:
            _declined(why, None, "without the keyword arguments the recorded call passed")
            return False
    elif kwnames != expected_names:
        _declined(why, None, "other keyword arguments, or in another order, than the recorded call's")
        return False
    if type(known[_READS]) is not tuple or type(known[_LAST]) is not list:  # (never filed in the table)
        _declined(why, None, "a plan of the fast index, which reads no argument")
        return False
    reads: tuple = known[_READS]
    last: list = known[_LAST]
    n: cython.Py_ssize_t = len(reads)
    order = known[_ORDER]
    fits: cython.bint = n == nargs + (0 if kwnames is None else len(kwnames)) and len(last) == n
    if fits and order is not None:  # (each a position among the call's arguments: checked once here)
        for k in order:
            if type(k) is not int or not 0 <= k < n:
                fits = False
                break
    if not fits:
        _declined(why, None, "not passed as the recorded call's arguments were")
    return fits


@cython.cfunc
def _mark(known: tuple, argv: Argv) -> cython.void:
    """Note in the record's `last` the objects this call read by identity (`last_mark`)."""
    reads: tuple = known[_READS]
    last: list = known[_LAST]
    hold_first: cython.bint = known[_HOLD_FIRST]
    fast_shape: cython.bint = known[_FAST_SHAPE]
    i: cython.Py_ssize_t
    for i in range(len(reads)):
        read = reads[i]
        if type(read) is _ARG_READ:
            if cython.cast(tuple, read)[3] if cython.compiled else read.by_identity:
                last[i] = last_mark(arg(argv, _position(known, i)), hold_first and i == 0, fast_shape)
            else:
                last[i] = None


@cython.ccall
def last_mark(obj: Any, first: cython.bint, fast_shape: cython.bint) -> object:
    """What `CallPlan.last` keeps of an object read at one position, to tell whether
    a later call passes this very object again: a weak reference to it (a new object that
    reuses a dead one's id is not it); for a list or dict passed first (`first`: where the
    record's `hold_first` says), which `_hold.hold` caches (checking its leaves): with
    `fast_shape`, its id; without, a dict's id and version tag (a new dict, even at a freed
    one's id, takes a new tag from a global counter, as a changed one does: only the same
    dict unchanged goes back to the general path to be held, once; a list, or where there is
    no tag, is not marked); else None: the identity cache cannot hold it, so passing it again
    gains nothing (a new batch dict each call, whose id Python reuses, must not look passed
    again)."""
    if cython.compiled:
        if weakrefable(obj):
            return PyWeakref_NewRef(obj, None)
    elif type(obj).__weakrefoffset__:
        return _WEAKREF(obj)
    if not first or not (type(obj) is list or type(obj) is dict):
        return None
    if fast_shape:
        return id(obj)
    version = _version_of(obj)
    return (id(obj), version) if version != 0 else None


@cython.cfunc
@cython.inline
def _version_of(obj: Any) -> cython.ulonglong:
    """A dict's version tag (`_capi.dict_version`); 0 (none) for a list, or run as Python."""
    if cython.compiled:
        if type(obj) is dict:
            return dict_version(obj)
    return 0


_WEAKREF = cython.declare(object, weakref.ref)


@cython.cfunc
@cython.inline
def _position(known: tuple, i: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """Where the argument read `i`-th is among the call's positional then keyword ones."""
    order = known[_ORDER]
    if order is None:
        return i
    return cython.cast(tuple, order)[i] if cython.compiled else order[i]


@cython.cfunc
def _declined(why: Optional[list], index: Any, reason: str) -> Optional[list]:
    """Decline the call (None), saying why where `f.explain` asks."""
    if why is not None:
        why.append((index, reason))
    return None


# ---- the reads, one per kind ------------------------------------------------------------


@cython.cfunc
@cython.exceptval(-1, check=True)
def _read_pytree(
    read: Any, a: Any, i: cython.Py_ssize_t, last: list, first_again: cython.bint, values: list, why: Optional[list]
) -> cython.bint:
    """A pytree argument's leaves (`ArgRead`), appended to `values`; False where the record
    does not serve it (said in `why`)."""
    r: tuple = cython.cast(tuple, read) if cython.compiled else read
    sequence = r[2]
    if type(sequence) is _SEQUENCE_READ and not shaped_as(sequence, a):
        # (before the caches: a record of another structure among several tried in turn,
        # `params_in_turn`, declines at its first test)
        _declined(why, i, "not of the structure the recorded call passed")
        return False
    if first_again and _passed_again(last[0], a):
        _declined(why, i, "passed again: the general path gives it a fast record")
        return False
    leaves = _cached_leaves(a, r[0])
    if leaves is None:
        if r[1] is None or _passed_again(last[i], a):
            _declined(why, i, "passed again, or of a structure read whole: the general path caches it")
            return False
        if sequence is None:
            leaves = r[1](a)
        elif type(sequence) is _TREE_READ:
            leaves = tree_leaves(sequence, a)
        else:  # (straight into `values`: a call it does not serve discards them)
            if sequence_into(sequence, a, values):
                return True
            leaves = None
        if type(leaves) is not tuple:  # (None: not of this structure)
            _declined(why, i, "not of the structure the recorded call passed")
            return False
    values.extend(leaves)
    return True


@cython.cfunc
@cython.exceptval(-1, check=True)
def _passed_again(mark: Any, a: Any) -> cython.bint:
    """Whether `a` is the object `mark` (`_plan.last_mark`) was taken of."""
    if mark is None:
        return False
    if type(mark) is int:
        return mark == id(a)
    if type(mark) is tuple:  # (a dict's id and version tag)
        return cython.cast(tuple, mark)[0] == id(a) and cython.cast(tuple, mark)[1] == _version_of(a)
    return ref_is(mark, a)


@cython.cfunc
def _cached_leaves(a: Any, spec_id: Any) -> object:
    """`a`'s leaves from the identity cache (an entry of spec `spec_id`, current), or the memo
    of returned objects; None if neither has them."""
    entry = _BY_ID.get(id(a))
    if type(entry) is _CACHE_ENTRY:
        e: tuple = cython.cast(tuple, entry) if cython.compiled else entry
        if ref_is(e[0], a) and (e[4] is None or holds(e[4])):
            leaves = e[1]
            if (type(leaves) is tuple or type(leaves) is list) and e[2] == spec_id:
                return leaves
    return latest_leaves(a, spec_id)


@cython.cfunc
@cython.exceptval(-1, check=True)
def _read_graphdef(a: Any, spec_id: Any) -> cython.bint:
    """Whether `a` is the GraphDef `GRAPHDEFS` knows under `spec_id`, unchanged since."""
    known = _GRAPHDEFS.get(id(a))
    if type(known) is not _KNOWN_GRAPHDEF:
        return False
    k: tuple = cython.cast(tuple, known) if cython.compiled else known
    if k[0] is not a or k[2] != spec_id:
        return False
    return k[1] is None or a == k[1]


@cython.cfunc
@cython.exceptval(-1, check=True)
def _read_mixed(
    route: StructureRoute, a: Any, read: Any, values: list, entries: list, loose: list, nnx_args: Optional[list]
) -> cython.bint:
    """A pytree holding NNX objects beside other leaves (`MixedRead`): jax's flatten of `a`
    down to its NNX objects (and its nnx.States, each read by its mapping: `expand_into`),
    its treedef equal to the record's, then each leaf as the record's layout says: a plain
    leaf appended to `values`; a static one compared; a Variable read as `_read_variable`
    reads it (and added to `loose`); an NNX object (its spec id) read from its cache entry
    (`_read_node`)."""
    r: tuple = cython.cast(tuple, read) if cython.compiled else read
    layout = r[4]
    if type(layout) is not tuple:
        return False
    try:
        flat = r[1](a, r[2])
        items = flat[0]
        if type(items) is not list or not (flat[1] == r[3]):
            return False
    except Exception:  # (a node data whose `==` raises: the general path names it)
        return False
    expand = r[5]
    if expand is not None:
        found: list = []
        if not expand_into(cython.cast(list, items), cython.cast(tuple, expand), found):
            return False
        items = found
    if len(items) != len(layout):
        return False
    plain: frozenset = route.plain
    j: cython.Py_ssize_t
    for j in range(len(layout)):
        x = cython.cast(list, items)[j]
        code = cython.cast(tuple, layout)[j]
        if code is None:
            t = type(x)
            if t is not _ARRAY and t not in plain:
                return False
            values.append(x)
        elif type(code) is _STATIC_READ:
            if x is not cython.cast(tuple, code)[1] and not static_matches(code, x):
                return False
        elif type(code) is _VARIABLE_READ:
            if not read_variable(x, code, values, nnx_args):
                return False
            loose.append(x)
        elif type(code) is int:
            if not read_node(x, code, None, values, entries, nnx_args):
                return False
        else:
            return False
    return True


# ---- entries ------------------------------------------------------------------------------


@cython.cfunc
def _serve_c(route: object, argv: Argv, nargs: cython.Py_ssize_t, kwnames: object) -> object:
    """The C wrapper's entry (`SERVE`): `_serve`, for a StructureRoute it holds."""
    return _serve(cython.cast(StructureRoute, route), argv, nargs, kwnames)


# The C wrapper's entry, `PyObject *(*)(PyObject *route, PyObject *const *args, Py_ssize_t
# nargs, PyObject *kwnames)` (`kwnames`: None without keywords): a new reference to the output,
# DECLINED, or NULL with an error set. None run as Python.
SERVE: Any = (
    PyCapsule_New(cython.cast(cython.p_void, _serve_c), b"fastcall._structure_route.SERVE", cython.NULL)
    if cython.compiled else None
)


def arguments_as_read(known: Any, args: tuple, kwargs: dict) -> Optional[tuple]:
    """A call's arguments in the order `known`'s reads take them (`CallPlan.order`);
    None if the call has another number of positional arguments or other keywords than the
    record's call (`f.explain` names them so)."""
    if known.arity != len(args) or known.kwnames != (tuple(kwargs) if kwargs else ()):
        return None
    given = (*args, *kwargs.values())
    return given if known.order is None else tuple([given[k] for k in known.order])


def declined_reads(
    known: Any, args: tuple, kwargs: dict, plain: frozenset, serves_nested: bool
) -> list[tuple[Optional[int], str]]:
    """Why `known` would not serve this call (`f.explain`): (argument index, None for the call
    as a whole, and the reason in words), as the route reads it, changing nothing; empty if
    it would serve it."""
    route = StructureRoute({}, None, None, None, plain, serves_nested)
    argv: tuple = (*args, *kwargs.values()) if kwargs else args
    kwnames: Any = tuple(kwargs) if kwargs else None
    why: list = []
    if cython.compiled:  # (a CallPlan: a tuple, to the C reads)
        record: tuple = cython.cast(tuple, known)
        _read_arguments(route, record, PySequence_Fast_ITEMS(argv), len(args), kwnames, [], why)
    else:
        _read_arguments(route, known, argv, len(args), kwnames, [], why)
    return why


def reads_as_mixed(value: Any, read: Any, plain: frozenset) -> bool:
    """Whether `value` reads as the MixedRead `read` says (`f.explain`)."""
    route = StructureRoute({}, None, None, None, plain, False)
    return _read_mixed(route, value, read, [], [], [], None)

# cython: language_level=3, wraparound=False, boundscheck=False
"""The fast route: `f(first, *arrays)` served from the record `first` has in the fast index.

A general call of `f(first, *plain leaves)` whose first argument is a cached Equinox or
pytree object, or an NNX object of a cached structure, leaves a `_plan.CallPlan` for `f`
in that object's `_plan.FastSlot` (`_dispatch._file_plans` decides when). A later call
is served from it when: no keyword arguments; `INDEX[id(first)]` is a slot whose reference
is `first` and whose guard (an object holding lists or dicts, `_guard`) holds; the slot has
a record for `f` (its `state`) of this many arguments; and every other argument is a plain
leaf (a jax array, or a type of `plain`: FunctionState.plain_leaves). Then: nothing is
flattened or keyed; for an NNX object, its Variables' current values are read and passed
first (unless a JAX trace or an nnx transform is running, see `_nnx_values`); the compiled
entry runs; `post` finishes the output (writes NNX state back). Any other call is declined
(`DECLINED`), and the wrapper tries its structure route, then its general path
(`_dispatch`).

One source, two ways to run it: written in Cython's pure-Python mode, compiled by Cython
where the package was built with a C compiler, run as this very file where not (see
`fastcall/_rebuild.py`). Compiled, the C wrapper (`_accel.c`) enters it through one C
function (`SERVE`, a capsule) with the call's own argument array: no tuple, no Python call.
The compiled branches read the same things through the C API (a weak reference's target, a
slot's value) that the Python lines beside them read through Python.
"""

import types
from typing import Any, Optional

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from ._arrays import ArrayImpl
from ._plan import INDEX, VALUE_SLOT, CallPlan, FastSlot
from ._outputs import Varying

if cython.compiled:
    from cython.cimports.cpython.long import PyLong_FromVoidPtr
    from cython.cimports.cpython.pycapsule import PyCapsule_New
    from cython.cimports.cpython.ref import Py_INCREF
    from cython.cimports.cpython.sequence import PySequence_Fast_ITEMS
    from cython.cimports.cpython.tuple import PyTuple_New, PyTuple_SET_ITEM
    from cython.cimports.fastcall._capi import PyObject_Vectorcall, dict_version
    from cython.cimports.fastcall._entry_reads import item_value, ref_is
    from cython.cimports.fastcall._guard import holds
    from cython.cimports.fastcall._trace import may_serve_nnx
else:  # (the same functions, called as Python)
    from ._entry_reads import item_value, ref_is
    from ._guard import holds
    from ._trace import may_serve_nnx

if cython.compiled:  # (a call's arguments: C's array, `_capi.Argv`; run as Python, a tuple)
    from cython.cimports.fastcall._capi import Argv, arg
else:
    from operator import getitem as arg

    Argv = tuple

COMPILED: bool = cython.compiled

# (C constants where compiled: no module lookup per use)
_INDEX = cython.declare(dict, INDEX)
_VALUE_SLOT = cython.declare(list, VALUE_SLOT)
_ARRAY = cython.declare(object, ArrayImpl)
_VARYING = cython.declare(object, Varying)
_FAST_SLOT = cython.declare(object, FastSlot)
_PLAN = cython.declare(object, CallPlan)
# (a CallPlan's fields, read by position where compiled: their places in the record itself)
_ARITY = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("arity"))
_CALL = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("call"))
_POST = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("post"))
_VARIABLES = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("variables"))
_READS = cython.declare(cython.Py_ssize_t, CallPlan._fields.index("reads"))
_MEMBER = cython.declare(object, types.MemberDescriptorType)
DECLINED: Any = object()  # (what the route returns for a call it does not serve)
_DECLINED = cython.declare(object, DECLINED)


@cython.final
@cython.cclass
class FastRoute:
    """A wrapped function's fast route. `state`: the function's (its key in a slot's
    records); `on_error(err, args, kwargs)` re-raises an error of the compiled function, made
    clearer; `finish_varying(out, args, kwargs)` finishes a call whose output carries its own
    structure (`Varying`: the general path does, and counts it); `plain` and
    `serves_nested`: the function's (FunctionState). Called as `route(*args)` (the Python
    wrapper; the C wrapper where this file runs as Python) or through `SERVE` (the C wrapper):
    the output, or DECLINED."""

    state: Any
    on_error: Any
    finish_varying: Any
    plain: frozenset
    serves_nested: cython.bint
    fast_calls = cython.declare(cython.Py_ssize_t, visibility="readonly")  # calls served here
    # The last call's two lookups (`_serve`, `_record_of`): of `first` in the fast index, of
    # `state` in its slot's records; each with the dict's version tag then. What was found is
    # borrowed (NULL: absent): the dict holds it while its tag is unchanged, and the route
    # keeps no model alive.
    _m_first: cython.p_void
    _m_slot: cython.p_void
    _m_index_version: cython.ulonglong
    _m_records: cython.p_void
    _m_record: cython.p_void
    _m_records_version: cython.ulonglong
    __weakref__: Any  # (FunctionState.fast_routes is a WeakSet)

    def __init__(self, state: Any, on_error: Any, finish_varying: Any, plain: frozenset, serves_nested: bool):
        self.state = state
        self.on_error = on_error
        self.finish_varying = finish_varying
        self.plain = plain
        self.serves_nested = serves_nested
        self.fast_calls = 0

    def __call__(self, *args: Any) -> Any:
        if cython.compiled:
            return _serve(self, PySequence_Fast_ITEMS(args), len(args))
        else:
            return _serve(self, args, len(args))


@cython.cfunc
def _args_tuple(argv: Argv, n: cython.Py_ssize_t) -> tuple:
    """The call's arguments as a tuple (for the rare callee that takes one)."""
    if not cython.compiled:
        return argv
    args: tuple = PyTuple_New(n)
    i: cython.Py_ssize_t
    for i in range(n):
        Py_INCREF(cython.cast(object, argv[i]))
        PyTuple_SET_ITEM(args, i, cython.cast(object, argv[i]))
    return args


@cython.cfunc
def _serve(route: FastRoute, argv: Argv, n: cython.Py_ssize_t) -> object:
    """`f(*argv)` (`n` arguments) served by `route`, or DECLINED."""
    if n == 0:
        return _DECLINED
    first = arg(argv, 0)
    if cython.compiled:
        # A loop calling `f` with one object looks it up once (the C wrapper's `remembered`
        # says why that pays): the index's version tag unchanged, its answer is
        version: cython.ulonglong = dict_version(_INDEX)
        if version != 0 and route._m_first == cython.cast(cython.p_void, first) and route._m_index_version == version:
            if route._m_slot == cython.NULL:
                return _DECLINED
            found = cython.cast(object, route._m_slot)
        else:
            found = _INDEX.get(PyLong_FromVoidPtr(cython.cast(cython.p_void, first)))
            route._m_first = cython.cast(cython.p_void, first)
            route._m_slot = cython.NULL if found is None else cython.cast(cython.p_void, found)
            route._m_index_version = version
    else:
        found = _INDEX.get(id(first))
    if found is None:
        return _DECLINED
    return _serve_from(route, found, argv, n)


@cython.cfunc
def _record_of(route: FastRoute, records: dict) -> object:
    """`records.get(route.state)`, remembered as `_serve` remembers its index lookup."""
    if cython.compiled:
        version: cython.ulonglong = dict_version(records)
        same: cython.bint = route._m_records == cython.cast(cython.p_void, records)
        if version != 0 and same and route._m_records_version == version:
            return None if route._m_record == cython.NULL else cython.cast(object, route._m_record)
        found = records.get(route.state)
        route._m_records = cython.cast(cython.p_void, records)
        route._m_record = cython.NULL if found is None else cython.cast(cython.p_void, found)
        route._m_records_version = version
        return found
    else:
        return records.get(route.state)


@cython.cfunc
def _serve_from(route: FastRoute, found: Any, argv: Argv, n: cython.Py_ssize_t) -> object:
    """`f(*argv)` served from `found`, the fast index's slot for its first argument; or
    DECLINED."""
    if type(found) is not _FAST_SLOT:
        return _DECLINED
    slot: tuple = cython.cast(tuple, found) if cython.compiled else found
    first = arg(argv, 0)
    if not ref_is(slot[0], first):  # (a weak reference; `_flatten.Strong` for a held list or dict)
        return _DECLINED
    guard = slot[2]
    if guard is not None and not holds(guard):
        return _DECLINED  # (a list or dict it holds changed in place)
    records = slot[1]
    if type(records) is not dict:
        return _DECLINED
    found_record: Any = _record_of(route, records)
    if type(found_record) is not _PLAN:
        return _DECLINED
    record: tuple = cython.cast(tuple, found_record) if cython.compiled else found_record
    arity: cython.Py_ssize_t = record[_ARITY]
    if arity != n or record[_READS] is not None:  # (a plan with reads is the structure route's)
        return _DECLINED
    plain: frozenset = route.plain
    i: cython.Py_ssize_t
    for i in range(1, n):
        t = type(arg(argv, i))
        if t is not _ARRAY and t not in plain:
            return _DECLINED
    call = record[_CALL]
    post = record[_POST]
    variables = record[_VARIABLES]
    values: Optional[tuple] = None
    if variables is not None:
        values = _nnx_values(route, variables, argv, n, post is not None)
        if values is None:
            return _DECLINED
    route.fast_calls += 1
    try:
        if values is not None:
            out = call(*values)
        elif cython.compiled:
            out = PyObject_Vectorcall(call, argv + 1, n - 1, cython.NULL)  # type: ignore[operator]
        else:
            out = call(*argv[1:])
    except Exception as err:
        route.on_error(err, _args_tuple(argv, n), None)
        raise  # (on_error raises; if it did not)
    if type(out) is _VARYING:  # (its trace met a new output structure)
        route.fast_calls -= 1
        return route.finish_varying(out, _args_tuple(argv, n), None)
    return out if post is None else post(out, first, variables)


@cython.cfunc
def _nnx_values(
    route: FastRoute, variables: object, argv: Argv, n: cython.Py_ssize_t, writes: cython.bint
) -> Optional[tuple]:
    """An NNX call's arguments: its Variables' (and raw leaves') current values, then the
    other arguments; None where the general path serves it: the values are tracers
    (inside an nnx transform), or `_trace.may_serve_nnx` says no (`writes`: the call has a
    post, which may change state)."""
    descr = _VALUE_SLOT[0]  # (a member descriptor: see _nnx._variables)
    if type(variables) is not list or type(descr) is not _MEMBER:
        return None
    items: list = variables
    nvars: cython.Py_ssize_t = len(items)
    values: tuple
    i: cython.Py_ssize_t
    if cython.compiled:  # (the tuple the call takes, made to size)
        values = PyTuple_New(nvars + n - 1)
        for i in range(nvars):
            value = item_value(descr, items[i])
            Py_INCREF(value)
            PyTuple_SET_ITEM(values, i, value)
        for i in range(1, n):
            Py_INCREF(cython.cast(object, argv[i]))
            PyTuple_SET_ITEM(values, nvars + i - 1, cython.cast(object, argv[i]))
    else:
        values = (*[item_value(descr, item) for item in items], *argv[1:])
    if nvars and type(values[0]) is not _ARRAY:
        return None
    nested_ok: cython.bint = not writes and route.serves_nested
    if not may_serve_nnx(nested_ok):
        return None
    return values


@cython.cfunc
def _serve_c(route: object, argv: Argv, n: cython.Py_ssize_t) -> object:
    """The C wrapper's entry (`SERVE`): `_serve`, for a FastRoute it holds."""
    return _serve(cython.cast(FastRoute, route), argv, n)


# The C wrapper's entry, `PyObject *(*)(PyObject *route, PyObject *const *args, Py_ssize_t n)`:
# a new reference to the output, DECLINED, or NULL with an error set. None run as Python.
SERVE: Any = (
    PyCapsule_New(cython.cast(cython.p_void, _serve_c), b"fastcall._fast_route.SERVE", cython.NULL)
    if cython.compiled else None
)

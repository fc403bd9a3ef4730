# cython: language_level=3, wraparound=False
"""Writing a call's new leaf values back into the caller's NNX objects, where that is all
the call changed: the post-processing both hit routes run after the compiled program.

A function that updates Variables in place (`self.count[...] += 1`, a KV cache written
each step, an optimizer step) and changes no structure returns, after its own outputs, one
new value per leaf it wrote (`_outputs.OutInfo.plain_writes` lists them). `LeafWrites`
sets each into the leaf it names, a Variable through its `_raw_value` slot and a raw leaf
as `_variables.write_leaf` rebinds it, then builds the user's output from the other
outputs. Everything is checked before anything is written; anything unexpected (an output
that is not an array, say a tracer; a leaf list of another shape) goes to the general
write-back, which handles every case.

One source, two ways to run it: written in Cython's pure-Python mode, compiled by Cython
where the package was built with a C compiler, run as this very file where not (see
`fastcall/_rebuild.py`). The compiled branch sets a Variable's value by calling the slot
descriptor's C setter, which the Python line beside it calls through `__set__`.
"""

from types import MemberDescriptorType
from typing import Any

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from .._arrays import ArrayImpl
from .._plan import VALUE_SLOT, NnxArg, RawLeaf
from ._variables import write_leaf

if cython.compiled:
    from cython.cimports.cpython.object import Py_TYPE, PyObject_TypeCheck, PyTypeObject

COMPILED: bool = cython.compiled

# (C constants where compiled: no module lookup per use)
_VARIABLES = cython.declare(cython.Py_ssize_t, NnxArg._fields.index("variables"))  # (read by position)
_ARRAY = cython.declare(object, ArrayImpl)
_NNX_ARG = cython.declare(object, NnxArg)
_RAW_LEAF = cython.declare(object, RawLeaf)
_is_subtype = cython.declare(object, type.__subclasscheck__)  # (type's own: no metaclass's override)


@cython.final
@cython.cclass
class LeafWrites:
    """`post(out, first, nnx)` of a call whose only change to its NNX objects is new
    values of their leaves. `writes`: per new value, the last `len(writes)` of `out`, the
    (NNX object ordinal, leaf index) it goes to. `nnx` is the call's list of
    `_plan.NnxArg`, or with `one_object` the leaves of the call's one NNX object (the fast
    route's record). `result` builds the user's output from the other outputs; `post` is
    the general write-back. (Made once the NNX plugin has loaded, which sets the slot.)"""

    writes: tuple
    result: Any
    post: Any
    one_object: cython.bint
    slot: Any  # the Variable's `_raw_value` slot descriptor (None: writes go to `post`)
    variable: Any  # the class whose slot it is, nnx.Variable

    def __init__(self, writes: tuple, result: Any, post: Any, one_object: bool):
        self.writes = writes
        self.result = result
        self.post = post
        self.one_object = one_object
        descr = VALUE_SLOT[0]
        self.slot = descr if type(descr) is MemberDescriptorType else None
        self.variable = descr.__objclass__ if self.slot is not None else None

    def __call__(self, out: Any, first: Any, nnx: Any) -> Any:
        if not self._plain(out, nnx):
            return self.post(out, first, nnx)
        k: cython.Py_ssize_t = len(self.writes)
        n: cython.Py_ssize_t = len(out)
        j: cython.Py_ssize_t
        ordinal: cython.Py_ssize_t
        index: cython.Py_ssize_t
        descr = self.slot
        for j in range(k):
            ordinal, index = self.writes[j]
            items: list = nnx if self.one_object else cython.cast(tuple, nnx[ordinal])[_VARIABLES]
            if index >= len(items):  # (changed by code an old value's release ran)
                raise RuntimeError("fastcall: an NNX object's leaves changed during write-back")
            item = items[index]  # (held here: the old value's release may run code)
            value = out[n - k + j]
            if type(item) is _RAW_LEAF:
                write_leaf(item, value)
            elif cython.compiled:
                Py_TYPE(descr).tp_descr_set(descr, item, value)
            else:
                descr.__set__(item, value)
        return self.result(out[: n - k])

    @cython.cfunc
    def _plain(self, out: Any, nnx: Any) -> cython.bint:
        """Whether every write is one `__call__` makes itself: an array into a Variable or
        a raw leaf of an object the call read."""
        if type(out) is not list or type(nnx) is not list or self.slot is None:
            return False
        k: cython.Py_ssize_t = len(self.writes)
        n: cython.Py_ssize_t = len(out)
        j: cython.Py_ssize_t
        ordinal: cython.Py_ssize_t
        index: cython.Py_ssize_t
        if k > n:
            return False
        variable = self.variable
        for j in range(k):
            ordinal, index = self.writes[j]
            if type(out[n - k + j]) is not _ARRAY:
                return False
            if self.one_object:
                if ordinal != 0:
                    return False
                items = nnx
            else:
                if not 0 <= ordinal < len(nnx) or type(nnx[ordinal]) is not _NNX_ARG:
                    return False
                # (indexed as a tuple: Cython would index a tuple subclass through Python)
                items = cython.cast(tuple, nnx[ordinal])[_VARIABLES]
            if type(items) is not list or not 0 <= index < len(items):
                return False
            item = items[index]
            if type(item) is _RAW_LEAF:
                continue
            # A Variable by its type (not isinstance: Variable's metaclass answers for
            # other things too, through Python)
            if cython.compiled:
                if not PyObject_TypeCheck(item, cython.cast(cython.pointer[PyTypeObject], variable)):
                    return False
            elif not _is_subtype(variable, type(item)):
                return False
        return True

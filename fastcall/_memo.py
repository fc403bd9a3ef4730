# cython: language_level=3, wraparound=False
"""The memo of returned objects: what the latest calls returned, for the next call to take back.

Each compiled entry that returns modules, tuples or eqx.nn.States keeps a one-item list
`held`: held[0] is its latest call's *memo* (or None),
    (regs, ref_0, leaves_0, guard_0, ref_1, leaves_1, guard_1, ...)
per `Registration` of `OutInfo.regs`: the returned object known by a weak reference
(a module or State: released when it dies, by `forget_latest`) or by itself (a tuple, which
cannot be weakly referenced: held until the entry's next call), or None (not noted); its
leaves; and, for an object holding lists or dicts (the registration's `guard`), a guard over
them, which may change in place (else None). `LATEST` lists the `held` of the entries that
returned most recently, newest first. A lookup compares live objects by identity (`ref() is
obj`, or `ref is obj`), so a reused id never matches, and takes a guarded one only while its
guard holds. So `model = step(model, ...)` finds the model next step without an identity
cache entry being made for each (`_flatten.lookup` makes one when a call served in Python
reads one).

One of the sources setup.py compiles with Cython (see `fastcall/_rebuild.py`): the writer,
`note_latest`, runs after every call that returns such objects, and the compiled structure
route reads the memo through `latest_leaves` as C (`_memo.pxd`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, NamedTuple

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

from . import _guard
from ._arrays import ArrayImpl

if cython.compiled:
    from cython.cimports.cpython.object import PyObject_GenericGetAttr
    from cython.cimports.cpython.weakref import PyWeakref_NewRef
    from cython.cimports.fastcall._capi import new_record, weakrefable
    from cython.cimports.fastcall._guard import holds, make_checked
else:  # (the same functions, called as Python)
    from ._guard import holds, make_checked

COMPILED: bool = cython.compiled

LATEST_SIZE = 8
LATEST: list[Any] = [None] * LATEST_SIZE
_latest_lock = threading.Lock()
MEMO_STRIDE = 3  # (ref, leaves, guard) per registration

# A registration's `guard`: None (immutable: no guard); STATE_GUARD (an eqx.nn.State: over
# its dicts, `state_containers`); or the paths from the object to each list and dict it
# holds (`_flatten.container_paths`: a guard over them, made as it was returned).
STATE_GUARD = "state"
ATTR, ITEM = 0, 1  # the steps of a container path: (ATTR, name) or (ITEM, index or key)

_getattribute = object.__getattribute__
_array = cython.declare(object, ArrayImpl)
_ATTRIBUTES = cython.declare(type, _guard.Attributes)


class Registration(NamedTuple):
    """One object an entry's output holds that its memo notes (`OutInfo.regs`)."""

    position: int | None  # its place in the output tuple (None: the output itself)
    start: int  # its leaves: the dynamic outputs [start, stop)
    stop: int
    spec: Any
    spec_id: int  # (interned: compares by identity)
    # How each call's object is guarded: None (immutable: no guard); STATE_GUARD (an
    # eqx.nn.State: over its dicts, `state_containers`); or the paths from it to each list
    # and dict it holds (`_flatten.container_paths`: a guard over them, made as it was returned)
    guard: Any


@cython.ccall
def state_containers(state: Any) -> list:
    """The dicts a guard watches for an eqx.nn.State: its attribute dict (`.set` rebinds
    `_state` there) and its `_state` dict (what it flattens to)."""
    return [_attributes(state), vars(state).get("_state")]


@cython.cfunc
def _attributes(obj: Any) -> Any:
    """`_guard.Attributes(obj)`, made as its own `__new__` makes it (`tuple.__new__`);
    compiled, through the C slot, with no Python call."""
    if cython.compiled:
        return new_record(_ATTRIBUTES, (obj,))
    else:
        return _guard.Attributes(obj)


@cython.ccall
def follow(item: Any, path: Any) -> Any:
    """The object at `path` (`_flatten.container_paths`) in `item`. Attributes are read by
    `object.__getattribute__`: an Equinox module's own `__getattribute__` (Python code, which
    wraps methods) is skipped."""
    op: cython.int
    for step in path:
        op, key = cython.cast(tuple, step)
        if op == ATTR:
            item = PyObject_GenericGetAttr(item, key) if cython.compiled else _getattribute(item, key)
        else:
            item = item[key]
    return item


def note_latest(held: list, regs: tuple, on_death: Any, result: Any, dyn: list) -> None:
    """Note the objects a call returned (`OutInfo.remember`): its memo replaces the entry's
    previous one in `held`, and `held` goes to the front of `LATEST`. Only concrete arrays
    (not tracers of an outer trace) are noted; a container that is not plain, or an object
    that cannot be weakly referenced, is not."""
    n: cython.Py_ssize_t = len(regs)
    memo: list = [None] * (1 + MEMO_STRIDE * n)
    memo[0] = regs
    r: cython.Py_ssize_t
    k: cython.Py_ssize_t
    for r in range(n):
        position, start, stop, _spec, _spec_id, how = cython.cast(tuple, regs[r])
        first: cython.Py_ssize_t = start
        last: cython.Py_ssize_t = stop
        for k in range(first, last):
            if type(dyn[k]) is not _array:
                break  # (a tracer of an outer trace, which may be any of them: never noted)
        else:
            _note(memo, r, result if position is None else result[position], how, on_death, dyn[first:last])
    _to_front(held, tuple(memo))


@cython.cfunc
def _note(memo: list, r: cython.Py_ssize_t, item: Any, how: Any, on_death: Any, leaves: list) -> cython.void:
    """`note_latest`'s noting of one returned object `item` in `memo` (registration `r`),
    guarded as `how` says; not noted where it cannot be weakly referenced (a tuple is held
    itself) or a container it holds is not plain."""
    ref: Any = None
    guard: Any = None
    if type(item) is tuple:
        ref = item
    else:
        try:
            ref = PyWeakref_NewRef(item, on_death) if cython.compiled else weakref.ref(item, on_death)
        except TypeError:
            return  # (cannot be weakly referenced: not noted)
    if how is not None:
        containers = state_containers(item) if how == STATE_GUARD else [follow(item, path) for path in how]
        guard = make_checked(containers)
        if guard is None:
            return  # (a container that is not plain, or none at all: not noted)
    memo[1 + MEMO_STRIDE * r] = ref
    memo[2 + MEMO_STRIDE * r] = leaves
    memo[3 + MEMO_STRIDE * r] = guard


@cython.cfunc
def _to_front(held: list, memo: tuple) -> cython.void:
    """`memo` replaces `held[0]`, and `held` goes to the front of `LATEST`. The replaced
    memo and the entry that fell off are released after the swap, outside the lock:
    releasing may run code that calls back here."""
    if cython.compiled:
        # (compiled, the swap runs no Python code and releases nothing, so no other thread
        # runs during it: the GIL is its lock)
        released = _swap(held, memo)
    else:
        with _latest_lock:  # (two threads finishing calls at once)
            released = _swap(held, memo)
    del released


@cython.cfunc
def _swap(held: list, memo: tuple) -> tuple:
    """`_to_front`'s swap: (the replaced memo, the entry that fell off `LATEST`), for the
    caller to release. The others move one place back; the last falls off, unless it is
    `held`'s old place. Nothing is made or released until the swap is done."""
    i: cython.Py_ssize_t
    at: cython.Py_ssize_t = LATEST_SIZE - 1
    latest: list = LATEST
    previous = held[0]
    held[0] = memo
    dropped = None
    if latest[0] is not held:
        for i in range(1, LATEST_SIZE):
            if latest[i] is held:
                at = i
                break
        dropped = latest[at]
        for i in range(at, 0, -1):
            latest[i] = latest[i - 1]
        latest[0] = held
    return previous, dropped


def latest(obj: Any) -> tuple[list[Any], Any, Any] | None:
    """(leaves, spec, guard) of `obj` if the latest call of a recent entry returned it and
    its guard (if any) holds; else None."""
    found = _noted(obj)
    if found is None:
        return None
    leaves, reg, guard = cython.cast(tuple, found)
    return leaves, reg.spec, guard


@cython.ccall
def latest_leaves(obj: Any, spec_id: Any) -> Any:
    """The leaves of `obj` if the latest call of a recent entry returned it as an object of
    the spec `spec_id` and its guard (if any) holds; else None."""
    found = _noted(obj)
    if found is None:
        return None
    leaves, reg, _ = cython.cast(tuple, found)
    return leaves if cython.cast(tuple, reg)[4] == spec_id else None  # (Registration.spec_id)


@cython.cfunc
def _noted(obj: Any) -> Any:
    """(leaves, registration, guard) of `obj` as the newest memo that notes it holds it, or
    None: not noted, or changed in place since (its guard no longer holds: read afresh). None
    is never noted; a dead module's weak reference reads as None until its callback has
    dropped the memo."""
    if obj is None:
        return None
    # (only a tuple or an object that can be weakly referenced is ever noted: a dict or list
    # argument, read on every call, needs no scan)
    if type(obj) is not tuple and not (weakrefable(obj) if cython.compiled else type(obj).__weakrefoffset__):
        return None
    i: cython.Py_ssize_t
    r: cython.Py_ssize_t
    for i in range(LATEST_SIZE):
        held = LATEST[i]
        memo = held[0] if held is not None else None
        if memo is None:
            continue
        regs: tuple = memo[0]
        for r in range(len(regs)):
            ref = memo[1 + MEMO_STRIDE * r]
            if ref is not None and (ref is obj if type(ref) is tuple else ref() is obj):
                guard = memo[3 + MEMO_STRIDE * r]
                if guard is not None and not holds(guard):
                    return None
                return memo[2 + MEMO_STRIDE * r], regs[r], guard
    return None


def forget_latest(held: list[Any], ref: Any) -> None:
    """A returned module died: drop the memo that knew it (and so its leaves), if current.
    (The weak references' callback, bound to its entry's `held`. Not under the lock: it
    runs wherever the module dies; a memo noted meanwhile and dropped here costs the next
    call a read, never a wrong one.)"""
    memo = held[0]
    if memo is not None and any(x is ref for x in memo[1::MEMO_STRIDE]):
        held[0] = None


def clear() -> None:
    """Forget every memo (`fastcall.clear_caches`)."""
    with _latest_lock:
        memos = [held[0] for held in LATEST if held is not None]
        for held in LATEST:
            if held is not None:
                held[0] = None
        LATEST[:] = [None] * LATEST_SIZE
    del memos  # (released outside the lock)

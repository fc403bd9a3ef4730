"""The memo of returned objects: what the latest calls returned, for the next call to take back.

Each compiled entry that returns modules, tuples or eqx.nn.States keeps a one-item list
`held`: held[0] is its latest call's *memo* (or None),
    (regs, ref_0, leaves_0, guard_0, ref_1, leaves_1, guard_1, ...)
per `_flatten.Registration` of `OutInfo.regs`: the returned object known by a weak reference
(a module or State: released when it dies, by `forget_latest`) or by itself (a tuple, which
cannot be weakly referenced: held until the entry's next call), or None (not noted); its
leaves; and, for an object holding lists or dicts (the registration's `guard`), a guard over
them, which may change in place (else None). `LATEST` lists the `held` of the entries that
returned most recently, newest first. A lookup compares live objects by identity (`ref() is
obj`, or `ref is obj`), so a reused id never matches, and takes a guarded one only while its
guard holds. So `model = step(model, ...)` finds the model next step without an identity
cache entry being made for each (`_flatten.lookup` makes one when a call served in Python
reads one). The C extension has its own copy of the writer and the reader (`_accel.c`:
`remember_outputs`, `latest_leaves`), which calls it serves use.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import _guard
from ._arrays import ArrayImpl

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


def state_containers(state: Any) -> list[Any]:
    """The dicts a guard watches for an eqx.nn.State: its attribute dict (`.set` rebinds
    `_state` there) and its `_state` dict (what it flattens to)."""
    return [_guard.Attributes(state), vars(state).get("_state")]


def follow(item: Any, path: tuple[tuple[int, Any], ...]) -> Any:
    """The object at `path` (`_flatten.container_paths`) in `item`. Attributes are read by
    `object.__getattribute__`: an Equinox module's own `__getattribute__` (Python code, which
    wraps methods) is skipped."""
    for op, key in path:
        item = _getattribute(item, key) if op == ATTR else item[key]
    return item


def note_latest(held: list[Any], regs: tuple[Any, ...], on_death: Any, result: Any, dyn: list[Any]) -> None:
    """Note the objects a call returned (`OutInfo.remember`): its memo replaces the entry's
    previous one in `held`, and `held` goes to the front of `LATEST`. Only concrete arrays
    (not tracers of an outer trace) are noted; a container that is not plain, or an object
    that cannot be weakly referenced, is not."""
    memo: list[Any] = [regs]
    for reg in regs:
        ref: Any = None
        leaves = guard = None
        if all(type(x) is ArrayImpl for x in dyn[reg.start : reg.stop]):  # (none a tracer of an outer trace)
            item = result if reg.position is None else result[reg.position]
            if type(item) is tuple:
                ref = item
            else:
                try:
                    ref = weakref.ref(item, on_death)
                except TypeError:
                    pass  # (cannot be weakly referenced: not noted)
            if ref is not None and reg.guard is not None:
                if reg.guard == STATE_GUARD:
                    containers = state_containers(item)
                else:
                    containers = [follow(item, path) for path in reg.guard]
                guard = _guard.make(containers) if all(map(_guard.is_guardable, containers)) else None
                if guard is None:
                    ref = None
            if ref is not None:
                leaves = dyn[reg.start : reg.stop]
        memo += (ref, leaves, guard)
    new = tuple(memo)
    dropped = None
    # (nothing is made or released under the lock: either may run code that calls back here)
    with _latest_lock:  # (two threads finishing calls at once)
        previous, held[0] = held[0], new
        if LATEST[0] is not held:
            at = next((i for i in range(1, LATEST_SIZE) if LATEST[i] is held), LATEST_SIZE - 1)
            dropped = LATEST[at]
            for i in range(at, 0, -1):
                LATEST[i] = LATEST[i - 1]
            LATEST[0] = held
    del previous, dropped


def latest(obj: Any) -> tuple[list[Any], Any, Any] | None:
    """(leaves, spec, guard) of `obj` if the latest call of a recent entry returned it and
    its guard (if any) holds; else None. (None is never noted; a dead module's weak
    reference reads as None until its callback has dropped the memo.)"""
    if obj is None:
        return None
    for held in list(LATEST):
        memo = held[0] if held is not None else None
        if memo is None:
            continue
        for r, reg in enumerate(memo[0]):
            ref, leaves, guard = memo[1 + MEMO_STRIDE * r : 1 + MEMO_STRIDE * (r + 1)]
            if ref is not None and (ref is obj if type(ref) is tuple else ref() is obj):
                if guard is not None and not _guard.holds(guard):
                    return None  # (changed in place since it was returned: read afresh)
                return leaves, reg.spec, guard
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

"""Holding a top-level list or dict passed again: what lets the fast path serve `f(params, x)`,
and the structure path take the leaves of `params` in `f(params, x, config)` from the cache.

An Equinox module or a tuple is known by a weak reference in the identity cache
(`_flatten.by_id`). A top-level list or dict cannot be weakly referenced; this module
decides when the identity cache may hold one strongly, and releases it.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Sequence

from . import _plan
from ._flatten import CacheEntry, Strong, by_id, forget_strong, guard_of, lookup, read_alike

# Top-level lists and dicts (a params dict, `f(params, x)`) cannot be weakly referenced,
# so the identity cache can only hold them strongly. It does so for a container passed
# first in two consecutive calls of one function (an inference loop), and at most one per
# function: the next container held by that function releases it, and so do its wrapper's
# death and `clear_caches`. A training loop, which
# passes a new container each call, never has one held (its previous leaves are compared
# through weak references, which keep nothing alive).
#
# "Passed first in two consecutive calls" is told by id (`_plan.last_mark`), and a new
# container built each call with the same contents (`f({"params": params}, x)`, as Linen's
# `jax.jit(model.apply)` is called) often gets the id of the one before, which was freed:
# it looks passed again and goes to the general path, which holds it, and the next one, at
# another id, gains nothing from that. A function whose general path has come here this
# many times in a row without the fast path serving a call in between stops holding
# (`may_hold`): its lists and dicts are read by the structure path, whose test of each one
# cannot be fooled. (An inference loop comes here twice: to note its container, then to
# hold it; the fast path serves it from the next call.) Where other arguments are not plain
# leaves (`f(params, x, config)`), a dict is told passed again by its id and version tag
# (`_structure_route.last_mark`), which a new dict never shares: only that loop comes here.
HOLD_ATTEMPTS_LIMIT = 4


def may_hold(state: Any) -> bool:
    """Whether the function of `state` still holds top-level lists and dicts passed again."""
    return state.hold_attempts <= HOLD_ATTEMPTS_LIMIT


class LastFirst(NamedTuple):
    """The top-level container a function was last called with (not held)."""

    oid: int
    spec_id: int
    probes: tuple[Any, ...]  # per leaf: a weakref, or (not weakly referenceable) the leaf itself


def _probe(x: Any) -> Any:
    try:
        return weakref.ref(x)
    except TypeError:
        return Strong(x)


def holdable(obj: Any, spec: Any, leaves: Sequence[Any]) -> bool:
    """Whether `hold` may hold `obj` (of `spec`, with these dynamic `leaves`): a top-level list
    or dict whose structure can be guarded, and that both scalar rules read alike
    (`read_alike`)."""
    return type(obj) in (list, dict) and spec.kind == "tree" and (spec.guardable or spec.cacheable) and read_alike(
        spec, leaves
    )


def hold(state: Any, obj: Any, leaves: Sequence[Any], spec: Any) -> CacheEntry | None:
    """For a top-level list or dict passed first to the function of `state` (`holdable`): its
    identity cache entry, held strongly, if it was also passed first in the function's
    previous call with the very same leaves; else None (and it is noted for the next call)."""
    if not holdable(obj, spec, leaves) or not may_hold(state):
        return None
    fast = state.fast_calls()  # (attempts since the fast path last served a call: see above)
    state.hold_attempts = 1 if fast != state.fast_calls_at_attempt else state.hold_attempts + 1
    state.fast_calls_at_attempt = fast
    if not may_hold(state):
        release_held(state.held_box)
        return None
    last = state.last_first
    if last is None or last.oid != id(obj) or last.spec_id != spec.id or len(last.probes) != len(leaves) or any(
        p() is not x for p, x in zip(last.probes, leaves)
    ):
        state.last_first = LastFirst(id(obj), spec.id, tuple(map(_probe, leaves)))
        return None
    entry = lookup(obj)
    if entry is None or not isinstance(entry.ref, Strong):
        guard = guard_of(obj, leaves, spec)
        if guard is None:
            return None
        token = Strong(obj)
        entry = CacheEntry(token, tuple(leaves), spec.id, spec, guard or None)
        old = by_id.get(token.oid)
        by_id[token.oid] = entry
        if old is not None:
            _plan.withdraw(old.ref)
    box = state.held_box
    if box[0] is not None and box[0] is not entry.ref:
        release(box[0])
    box[0] = entry.ref
    return entry


def release(token: Strong) -> None:
    """Stop holding a container `hold` held (and serving it fast)."""
    forget_strong(token)
    _plan.withdraw(token)


def release_held(box: list[Any]) -> None:
    """Release what a function holds (`box` is its `held_box`): when it is cleared, and
    when its wrapper dies."""
    token, box[0] = box[0], None
    if token is not None:
        release(token)

"""Structure changes, as the hooks of `_hooks` report them, and the cache entries they reach.

Structure changes are seen through the hooks of `_hooks` (its table lists each method
wrapped): a call of one on a node that belongs to a cached graph marks that entry stale
(`_notify`), and a stale entry is re-read on its next use. A static scalar replaced by
another (`model.eval()`: `_flipped`) and NNX's in-place rebuild of a node (`_rebuilt`) are
reported apart. Plain lists and dicts in the graph (which change in place without any
hook) are checked item by item by a guard instead (`_watch_containers`). If the hooks
cannot be verified on the installed flax (`TRUSTED`), every entry is re-read on every call
instead.

Importing this module installs the hooks on NNX's classes.
"""

from __future__ import annotations

import collections.abc
import threading
from typing import Any

from flax import nnx
from flax.nnx import graphlib

from .. import _plan, _guard
from . import _hooks
from ._variables import _is_node

_watch_lock = threading.RLock()  # (reentrant: an entry's `_evict` may run in a GC at any allocation made under it)
# id(graph node or Variable) -> entries (`_entries.NodeEntry`) whose graph contains it.
_watchers: dict[int, list[Any]] = {}


_local = threading.local()

# Bumped by every hooked change anywhere: a build that saw it change marks its entry
# stale (a change made while it was reading the graph is not lost).
_generation = [0]


def _notify(obj: Any) -> None:
    _generation[0] += 1
    if not _watchers:
        return
    entries = _watchers.get(id(obj))
    if entries:
        updating = getattr(_local, "updating", None)  # (the entry fastcall itself is updating)
        for e in list(entries):  # (the list may change under us in another thread)
            if e is not updating:
                e.stale = True
                _plan.withdraw(e.ref)


# Guards each entry's `rebuilt` mark: a rebuild reported while a check of it runs is never lost.
_rebuild_lock = threading.RLock()


def _rebuilt(node: Any) -> None:
    """Half of NNX's in-place rebuild of `node` (its clear or its init: nnx.jit's graph
    updates on a model passed to it, and NNX's other transforms': nnx.grad, nnx.vmap) ran. A rebuild mostly puts back what was
    there, so it is not taken as a change: the entries watching the node leave the fast
    path and are marked `rebuilt`; their next use checks every node of the graph against
    what was read (`_rebuilt_as_read`) and serves again if nothing differs, else re-reads."""
    _generation[0] += 1  # (a graph read while a rebuild runs may have seen it half done)
    entries = _watchers.get(id(node))
    if entries:
        for e in tuple(entries):  # (the list may change under us in another thread)
            # (marked already: by this rebuild's report on another node, whose withdraw is
            # done or under way; a check started since has replaced the mark by its own)
            if e.rebuilt is not True and e is not getattr(_local, "updating", None):
                with _rebuild_lock:
                    e.rebuilt = True
                _plan.withdraw(e.ref)


def _flipped(obj: Any, name: str, old: Any) -> None:
    """A static scalar attribute of `obj` was replaced by another (`model.eval()`): the
    graphs holding it keep their Variables and nodes; only one static value differs.
    Each entry watching it records the attribute (see `NodeEntry.flips`) and, if its spec
    was current, keeps it as the variant for the values before this change."""
    _generation[0] += 1
    if not _watchers:
        return
    entries = _watchers.get(id(obj))
    if entries:
        updating = getattr(_local, "updating", None)
        for e in list(entries):
            if e is not updating:
                e.flip(obj, name, old)


# Whether the hooks can be trusted on this flax (see _hooks): if not, every
# entry is re-read on every call.
TRUSTED = not _hooks.install(_notify, _flipped, _rebuilt)


def _unwatch(entry: Any) -> None:  # (an `_entries.NodeEntry`)
    with _watch_lock:
        for oid in entry.watched:
            lst = _watchers.get(oid)
            if lst is not None:
                try:
                    lst.remove(entry)
                except ValueError:
                    pass
                if not lst:
                    del _watchers[oid]


def _is_container(x: Any) -> bool:
    return isinstance(x, (list, dict, collections.abc.MutableMapping)) and not _is_node(x)


def _watch_containers(node: Any) -> tuple[_guard.Guard | None, bool]:
    """A guard over every plain list or dict in `node`'s graph (`nnx.data([...])`, an optax
    state's containers), which can change in place without any hook, and whether it
    covers them all (not so if one is another kind of mutable mapping, or the graph cannot
    be walked: the graph is then re-read on every call, and its flatten names any error)."""
    containers: list[Any] = []
    guardable = True
    try:
        for _, sub in graphlib.iter_graph(node):
            if type(sub) is nnx.State:  # (an optimizer's state: its attributes and its dict)
                attributes = _guard.Attributes(sub)
                containers += [attributes, sub.raw_mapping]
                guardable = guardable and _guard.is_guardable(attributes) and _guard.is_guardable(sub.raw_mapping)
            elif _is_container(sub):
                containers.append(sub)
                guardable = guardable and _guard.is_guardable(sub)
    except Exception:
        return None, False
    return (_guard.make(containers) if containers and guardable else None), guardable

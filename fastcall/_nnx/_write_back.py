"""After the call: what the function did to its NNX arguments applied to the caller's
objects, and the NNX objects in its output given back.

Changed Variables are written back, and structural changes made inside are propagated to
the caller's objects (graph updates: `write_back`); NNX objects in the output come back as
the caller's own objects or as new ones (`unmark_nodes`, `unmark_leaves`); an nnx.State
returned holding an argument's Variables gets a cache entry of its own (`twin_states`).
"""

from __future__ import annotations

from typing import Any

import jax
from flax.nnx import graphlib

from .. import _guard
from .._errors import FastcallError
from .._plan import NnxArg
from .._trace import contains_tracer
from . import _hooks, _watch
from ._entries import NodeEntry, _Enumerated, _file, _new_entry, _plain_state_read, by_id
from ._inputs import NnxOutputs, _InputNode, _NewNode, _outer_base
from ._variables import State, _child, _holds_data, _is_variable, _renewed, raw_value, write_leaf
from ._watch import _local, _notify, _watch_lock


def write_back(nnx_out: NnxOutputs, written: Any, nnx_args: list[NnxArg]) -> _Link | None:
    """Apply structural changes and write changed Variables back to the caller's objects.
    Returns the `_Link` that output markers are resolved through (None: none needed)."""
    if written and isinstance(written[0], jax.core.Tracer):  # all outputs are tracers, or none
        raise FastcallError(
            "fastcall.jit: the function changes NNX state (Variables), but it was "
            "called inside an outer JAX transformation with the NNX objects closed "
            "over, so the new values are tracers and cannot be written back. Pass the "
            "NNX objects through the outer transformation (use nnx.jit/nnx.grad/... "
            "or nnx.split/merge outside), or call the function outside of it."
        )
    link = None
    if nnx_out.restructure:
        link = _Link(nnx_out, nnx_args)  # (read before the caller's graphs change)
        pos = 0
        for _, graphdef, n in nnx_out.restructure:
            # Existing objects and Variables are reused by identity (updated in place to
            # the structure and values made inside), new ones created, as nnx.jit's graph
            # updates do.
            graphlib.unflatten(
                graphdef, list(written[pos : pos + n]), index_ref=link.index_ref, outer_index_outer_ref=link.outer
            )
            pos += n
        written = written[pos:]
    for (ordinal, index), value in zip(nnx_out.writes, written):
        if nnx_out.replaced and (ordinal, index) in nnx_out.replaced:
            _replace_variable(nnx_args[ordinal], index, value)
        else:
            write_leaf(nnx_args[ordinal].variables[index], value)
    for ordinal, index, metadata in nnx_out.metadata:
        nnx_args[ordinal].variables[index].set_metadata(dict(metadata))  # (all of it; seen by the hooks)
    return link


class _Link:
    """How one call's output is tied to the caller's objects. `outer`: the caller's objects
    (and their sub-objects and Variables) by outer index, read before any structural
    change (the indices name the graphs the function was given). `index_ref`: one index
    for every graph rebuilt after the call, restructured arguments first and then new
    objects returned, in the order they were flattened inside."""

    __slots__ = ("outer", "index_ref")

    def __init__(self, nnx_out: NnxOutputs, nnx_args: list[NnxArg]) -> None:
        self.index_ref = graphlib.IndexMap()
        self.outer = graphlib.IndexMap()
        if not (nnx_out.restructure or nnx_out.inner_nodes or nnx_out.links_outer):
            return
        # Each argument's objects as the call read them: the read's RefMap where it made one
        # (arguments read jointly share one), else flattened again (the same order).
        shared = None
        if nnx_out.joint:
            first = nnx_args[0].index
            shared = first if first is not None and all(a.index is first for a in nnx_args) else None
            if shared is None:
                shared = graphlib.RefMap()
                for arg in nnx_args:
                    graphlib.flatten(arg.obj, with_paths=False, ref_index=shared)
        for ordinal, arg in enumerate(nnx_args):
            if shared is None:
                refmap = arg.index
                entry = arg.entry
                if refmap is None and entry is not None and entry.enumerated and arg.variables is entry.items:
                    refmap = _Enumerated(arg.variables)  # (what a flatten would index)
                if refmap is None:
                    refmap = graphlib.RefMap()
                    graphlib.flatten(arg.obj, with_paths=False, ref_index=refmap)
                base = _outer_base(ordinal, False)
                for obj, index in refmap.items():
                    self.outer[base + index] = obj
        if shared is not None:
            for obj, index in shared.items():
                self.outer[index] = obj


def _replace_variable(arg: NnxArg, index: int, value: Any) -> None:
    """Put a new Variable (the old one's type and metadata) holding `value` where the
    caller's object holds its `index`-th leaf, as nnx.jit's graph updates do for a Variable
    the function replaced; the object's cache entry follows (no re-read)."""
    old = arg.variables[index]
    new = _renewed(old, value)
    entry: NodeEntry | None = arg.entry if arg.entry is not None else by_id.get(id(arg.obj))
    if entry is not None and (entry.ref() is not arg.obj or entry.items is not arg.variables):
        entry = None  # (not the entry this call read: it is left to the hooks)
    paths = arg.paths if arg.paths is not None else (entry.paths if entry is not None else None)
    if paths is not None and len(paths) == len(arg.variables):
        path = paths[index]
    else:  # (a fast-path call whose entry another thread replaced meanwhile: search)
        flat = graphlib.flatten(arg.obj, with_paths=True)[1]
        path = next(p for p, leaf in zip(flat.paths, flat.leaves) if leaf is old)
    owner = arg.obj
    for key in path[:-1]:
        owner = _child(owner, key)
    _local.updating = entry
    try:
        name = path[-1]
        if not isinstance(owner, _hooks.Pytree):
            owner[name] = new
        elif type(name) is str and _holds_data(owner, name, old):
            # A data attribute holding the Variable replaced by another: written as NNX's own
            # in-place rebuild (nnx.jit's graph update) writes it, `object.__setattr__` (a
            # property's setter runs; a class's own __setattr__, NNX's checks and the hooks do
            # not: the attribute stays data), and the hooks' report, which other entries
            # watching the object must see, made here.
            object.__setattr__(owner, name, new)
            _notify(owner)
        else:
            setattr(owner, str(name), new)
    finally:
        _local.updating = None
    arg.variables[index] = new
    if entry is not None:
        with _watch_lock:
            if by_id.get(id(arg.obj)) is not entry:
                return  # (replaced meanwhile by another thread's read: nothing to follow)
            lst = _watch._watchers.get(id(old))
            if lst is not None and entry in lst:
                lst.remove(entry)
                if not lst:
                    del _watch._watchers[id(old)]
            _watch._watchers.setdefault(id(new), []).append(entry)
            watched = list(entry.watched)
            for i, w in enumerate(watched):
                if w == id(old):
                    watched[i] = id(new)
            entry.watched = watched
            entry.node_ids = frozenset(watched)
            entry.version += 1
            # (the record of the read holds `old`, which a rebuild may put back: the entry,
            # which holds `new`, would then pass the check; and the record kept `old` alive)
            entry.layout = None


def twin_states(nnx_out: NnxOutputs, result: Any, nnx_args: list[NnxArg]) -> None:
    """Give each nnx.State the call returned holding an argument's Variables
    (`NnxOutputs.twins`) a cache entry of its own, made from the argument's: a functional
    loop passes it back next call, where it is then read as a known object (no flatten, no
    metadata compared; the structure path serves it) instead of as a new State."""
    for position, ordinal in nnx_out.twins:
        state = result if position is None else result[position]
        arg = nnx_args[ordinal]
        source = arg.entry
        if (
            type(state) is not State or source is None or not source.enumerated or source.volatile
            or arg.variables is not source.items or source.ref() is not arg.obj or by_id.get(id(state)) is not None
        ):
            continue
        items = list(source.items)  # (not shared: a Variable replaced later is replaced in one)
        if contains_tracer(map(raw_value, items)):
            continue  # (values of an outer trace; an RNG key array is concrete, not an ArrayImpl)
        walked = _state_parts(state)
        if walked is None or len(walked[1]) != len(items) or frozenset(walked[1]) != source.node_ids:
            continue
        entry = _new_entry(state, None)
        entry.items, entry.paths = items, source.paths
        entry.spec, entry.spec_id = source.spec, source.spec_id
        entry.node_ids = source.node_ids
        entry.guard = _guard.make(walked[0])
        entry.direct = entry.enumerated = True
        entry.fresh = False
        entry.watched = [id(v) for v in items]
        with _watch_lock:
            for oid in entry.watched:
                _watch._watchers.setdefault(oid, []).append(entry)
        # The Variables' types and metadata are the spec's: the source entry said so when
        # the call read it, and nothing changed them since if it is watched and still not
        # stale (checked after this entry watches them: a change from now on marks this
        # one). A provisional source is not watched: its State's key is read again.
        if source.provisional:
            plain = _plain_state_read(state)
            if plain is None or plain.spec is not source.spec or any(a is not b for a, b in zip(plain.variables, items)):
                entry.stale = True
        elif source.stale or source.rebuilt:
            entry.stale = True
        _file(entry, None)


def _state_parts(state: Any) -> tuple[list[Any], list[int]] | None:
    """The containers a guard over an nnx.State watches (its attribute dict and every dict
    of its mapping, nested States' too), and the ids of the Variables it holds; None if it
    holds anything else (or a container no guard can watch)."""
    containers: list[Any] = []
    ids: list[int] = []
    pending = [state]
    while pending:
        node = pending.pop()
        if type(node) is State:
            attributes = _guard.Attributes(node)
            if not _guard.is_guardable(attributes):
                return None
            containers.append(attributes)
            node = node.raw_mapping
        if type(node) is not dict:
            return None
        containers.append(node)
        for value in node.values():
            if type(value) is dict or type(value) is State:
                pending.append(value)
            elif _is_variable(value):
                ids.append(id(value))
            else:
                return None
    return containers, ids


def _unmarker(nnx_out: NnxOutputs, nnx_args: list[NnxArg], link: _Link | None) -> Any:
    """What turns one output marker back into an object (the caller's own, or a new one),
    and leaves anything else as it is. Markers must be given in the order `_mark_nodes`
    made them (leaf order): new objects share one index, filled as they are rebuilt."""
    if link is None:
        link = _Link(nnx_out, nnx_args)
    outer = link.outer if nnx_out.links_outer else None

    def unmark(x: Any) -> Any:
        if type(x) is _InputNode:
            return nnx_args[x.k].obj if x.outer is None else link.outer[x.outer]
        if type(x) is _NewNode:
            return graphlib.unflatten(x.graphdef, list(x.values), index_ref=link.index_ref, outer_index_outer_ref=outer)
        return x

    return unmark


def unmark_nodes(nnx_out: NnxOutputs, result: Any, nnx_args: list[NnxArg], link: _Link | None) -> Any:
    """`result` with its output markers turned back into objects."""
    unmark = _unmarker(nnx_out, nnx_args, link)
    return jax.tree_util.tree_map(unmark, result, is_leaf=lambda x: type(x) in (_InputNode, _NewNode))


def unmark_leaves(nnx_out: NnxOutputs, leaves: Any, nnx_args: list[NnxArg], link: _Link | None) -> list[Any]:
    """The output's static leaves in order with the markers among them turned back into
    the caller's objects: the output is then built once (not built, flattened and built
    again). Only for an output without new objects (whose markers are pytree nodes)."""
    return list(map(_unmarker(nnx_out, nnx_args, link), leaves))

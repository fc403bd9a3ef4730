"""Reading a call's NNX arguments: their current leaf values and `NnxArg`s, and their specs.

The general path reads an NNX object through its cache entry (`read_argument`,
`_entries.lookup`), a Variable passed on its own without a graph walk (`_read_variable`),
a pytree holding NNX objects as a `TreeSpec` (`read_container`), and the arguments of a
call that share objects jointly, in one flatten. An `nnx.State` of Variables only, new, of
a structure read before, is read by jax's pytree flatten instead of a graph walk
(`_read_plain_state`). The records by which the structure route reads an argument again
are made here after a call (`joint_read`, `variable_read`, `mixed_read`, ...); the route
(`_structure_route`) reads them through the cache entries the fast index publishes.
`explain_node` says what reading one costs.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Iterator

import jax
from flax import nnx
from flax.nnx import graphlib

from .. import _plan, _nnx_gate, _tree_reads
from .._errors import FastcallError, describe_arg
from .._flatten import ArrayImpl, intern, is_traced_leaf, spec_by_id
from .._flatten import interned as _interned
from .._flatten import leaf_key as _leaf_key
from .._stats import read_whole
from .._trace import StepAside, contains_tracer
from ._entries import (
    _Enumerated,
    _file,
    _flatten_node,
    _new_entry,
    _plain_state_read,
    _PlainState,
    by_id,
    cached,
    lookup,
)
from ._specs import _DYNAMIC, _STATIC, NodeSpec, TreeSpec, _intern_graphdef, _variable_specs, unwatchable_statics
from ._variables import (
    _REF_TYPE,
    METADATA_SLOT,
    RawLeaf,
    _is_variable,
    _leaf_items,
    _var_metadata,
    raw_value,
    read_leaf,
)
from ._watch import TRUSTED

_GRAPH_CONTEXT: Any = graphlib.GRAPH_CONTEXT  # (thread-local)
_plan.GRAPH_CONTEXT[0] = _GRAPH_CONTEXT


NnxArg = _plan.NnxArg


def read_argument(obj: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any) -> int:
    """Append `obj`'s current leaf values to `leaves` and its NnxArg to `nnx_args`;
    return its spec id. With `joint` (a RefMap shared by the call's NNX arguments),
    objects already seen in an earlier argument become references, so each shared
    Variable is passed once (as nnx.jit does). Raises StepAside for tracer values."""
    return _read_node(obj, leaves, arg_name, nnx_args, joint).id


def _read_node(obj: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any) -> Any:
    """`read_argument`, returning the spec itself."""
    if joint is None and _is_variable(obj):
        spec = _read_variable(obj, leaves, arg_name, nnx_args)
        if spec is not None:
            return spec
    if joint is not None or not type(obj).__weakrefoffset__ or type(obj) is _REF_TYPE:
        # Flattened afresh: jointly with the call's other NNX arguments, or an object the
        # cache cannot hold (a Variable passed on its own cannot be weakly referenced; a
        # mutable array reference has no graph to cache).
        refmap = joint if joint is not None else graphlib.RefMap()
        graphdef, flat = _flatten_node(obj, arg_name, ref_index=refmap)
        items = _leaf_items(obj, flat)[0]
        values = list(map(read_leaf, items))
        if contains_tracer(values):
            raise StepAside
        leaves += values
        ids = frozenset() if joint is not None else frozenset(map(id, refmap))
        nnx_args.append(NnxArg(obj, items, None, ids, list(flat.paths), refmap))
        return _intern_graphdef(graphdef, len(items), arg_name, joint=joint is not None)
    entry, index = lookup(obj, arg_name)
    values = entry.values()
    # Inside nnx.grad/vmap/scan the module is a copy holding tracers: run inline.
    # Variables of a module created outside cannot receive tracers (NNX forbids it),
    # so for a known object the first value tells.
    if values and (type(values[0]) is not ArrayImpl or entry.fresh):
        entry.fresh = False
        if contains_tracer(values):
            raise StepAside
    leaves += values
    nnx_args.append(NnxArg(obj, entry.items, entry, paths=entry.paths, index=index))
    return entry.spec


def _read_variable(v: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg]) -> NodeSpec | None:
    """`read_argument` for a Variable on its own, without a graph walk (Variables cannot
    be weakly referenced, so they are not cached by identity): None if it takes one."""
    value = raw_value(v)
    if type(value) is not ArrayImpl:
        return None  # (a tracer, a NumPy array, a mutable array reference, ...)
    key = _variable_key(v)
    if key is None:
        return None  # (unhashable metadata: the graph walk names it)
    spec = _variable_specs.get(key)
    if spec is None:
        if v.get_metadata().get("hijax"):
            return None
        graphdef, flat = _flatten_node(v, arg_name, ref_index=graphlib.RefMap())
        if len(flat.leaves) != 1 or flat.leaves[0] is not v:
            return None
        spec = _intern_graphdef(graphdef, 1, arg_name)
        if len(_variable_specs) > 4096:
            _variable_specs.clear()
        _variable_specs[key] = spec
    leaves.append(value)
    nnx_args.append(NnxArg(v, [v], None, frozenset((id(v),))))
    return spec


def _variable_key(v: Any) -> tuple[Any, ...] | None:
    """What a lone Variable's spec is cached under (`_variable_specs`): its type and
    metadata; None if the metadata cannot be hashed."""
    try:
        key = (type(v), tuple(v.get_metadata().items()))
        hash(key)
    except Exception:
        return None
    return key


def variable_read(arg: NnxArg, spec_id: int) -> _plan.VariableRead | None:
    """How the structure path reads this call's Variable argument again, if it was read
    as `_read_variable` reads it (without a graph walk, under this spec); else None."""
    v = arg.obj
    if arg.entry is not None or not _is_variable(v) or len(arg.variables) != 1 or arg.variables[0] is not v:
        return None
    key = _variable_key(v)
    if key is None:
        return None
    spec = _variable_specs.get(key)
    if spec is None or spec.id != spec_id:
        return None
    if METADATA_SLOT is None or inspect.getattr_static(type(v), "_var_metadata", None) is not METADATA_SLOT:
        return None  # (a subclass that redefines it: not read through the slot)
    metadata = dict(key[1])  # (a copy, as taken now)
    try:
        if _var_metadata(v) != metadata:
            return None
    except Exception:
        return None
    return _plan.VariableRead(spec_id, type(v), metadata, METADATA_SLOT)


def _read_plain_state(state: Any, plain: _PlainState, leaves: list[Any], nnx_args: list[NnxArg]) -> NodeSpec:
    """`read_argument` for a State of Variables only seen for the first time (the new
    State of a functional training loop), as jax.jit reads it: by its pytree flatten
    (`_plain_state_read`), under the spec a graph read gave that structure, without a
    graph walk. Its entry is provisional, as any first read of an object with plain dicts:
    its next use builds the watched entry. Raises StepAside for tracer values."""
    assert plain.spec is not None
    values = list(map(read_leaf, plain.variables))
    if contains_tracer(values):
        raise StepAside
    entry = _new_entry(state, None)
    entry.items, entry.paths = plain.variables, None
    entry.spec, entry.spec_id = plain.spec, plain.spec.id
    entry.node_ids = frozenset(map(id, plain.variables))
    entry.provisional = entry.stale = True
    entry.fresh = False
    entry.enumerated = True
    _file(entry, None)
    leaves += values
    nnx_args.append(NnxArg(state, entry.items, entry, index=_Enumerated(plain.variables)))
    return plain.spec


def holds_nodes(value: Any) -> bool:
    """Whether `value` is an nnx.State, or a tuple, list or dict with an NNX object among
    its items (a cheap check that sends the common containers of NNX objects straight to
    `read_container`; deeper ones are found by the generic flatten)."""
    t = type(value)
    if t is tuple or t is list:
        return any(map(_nnx_gate.is_node, value))
    if t is dict:
        return any(map(_nnx_gate.is_node, value.values()))
    return t is nnx.State


def read_container(
    value: Any, leaves: list[Any], arg_name: str, nnx_args: list[NnxArg], joint: Any, trace_scalars: bool
) -> int:
    """`read_argument` for an argument holding NNX objects inside a pytree: each NNX
    object is read as if it were an argument of its own (in leaf order, so its ordinal
    among the call's NNX objects is the same at trace time); other leaves follow the
    call's rule (arrays, and with `trace_scalars` Python scalars, are traced)."""
    if joint is None and type(value) is nnx.State:
        # An nnx.State of Variables only (`nnx.split`'s): read and cached as one object, a
        # graph of its Variables (see `NodeSpec.values_only`).
        if cached(value) is not None:
            return _read_node(value, leaves, arg_name, nnx_args, None).id
        known = by_id.get(id(value))
        plain = _plain_state_read(value) if known is None or known.ref() is not value else None
        if plain is not None and plain.spec is not None:
            return _read_plain_state(value, plain, leaves, nnx_args).id
        if plain is not None or _plain_state(value):
            return _read_node(value, leaves, arg_name, nnx_args, None).id
    read_whole()
    items, treedef = jax.tree_util.tree_flatten(value, is_leaf=_nnx_gate.is_node)
    layout: list[Any] = []
    codes: list[Any] = []
    statics: list[Any] = []
    for x in items:
        if _nnx_gate.is_node(x):
            spec = _read_node(x, leaves, arg_name, nnx_args, joint)
            layout.append(spec)
            codes.append(spec.id)
        elif is_traced_leaf(x, trace_scalars):  # (a tracer too: the caller then steps aside)
            leaves.append(x)
            layout.append(_DYNAMIC)
            codes.append(_DYNAMIC)
        else:
            statics.append(x)
            layout.append(_STATIC)
            codes.append(_STATIC)
    try:
        key = ("nnx-tree", treedef, tuple(codes), tuple(_leaf_key(s) for s in statics))
        known = _interned(key)
        if known is not None:
            return known.id
        return intern(TreeSpec(treedef, tuple(layout), tuple(statics)), key).id
    except Exception as err:
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} holds a static (non-array) value that "
            f"cannot be hashed or compared ({type(err).__name__}: {err}). Static values are "
            "part of the compile key: make them hashable, or wrap them in a JAX array."
        ) from None


def mixed_read(spec_id: int, nnx_args: Iterator[NnxArg], value: Any) -> _plan.MixedRead | None:
    """How the structure path reads again `value`, an argument `read_container` read under
    this spec (a TreeSpec: NNX objects beside other leaves in a pytree), taking its objects'
    NnxArgs from the iterator `nnx_args` (in the order the general path read them): each
    Variable as `variable_read` reads it, each other NNX object from its cache entry (as
    `readable_argument` allows), each static value if its identity (or a scalar's value)
    fixes it (`_plan.static_read`); None if one cannot be read so. Its nnx.States are read
    by their mappings where that reads them as jax does (`_expansion`)."""
    spec = spec_by_id(spec_id)
    if not isinstance(spec, TreeSpec):
        return None
    statics = iter(spec.statics)
    layout: list[Any] = []
    for code in spec.layout:
        if code == _DYNAMIC:
            layout.append(None)
        elif code == _STATIC:
            static = _plan.static_read(spec_id, next(statics))
            if static is None:
                return None
            layout.append(static)
        else:
            arg = next(nnx_args, None)
            if arg is None:
                return None
            if arg.entry is None:
                variable = variable_read(arg, code.id)
                if variable is None:
                    return None
                layout.append(variable)
            elif readable_argument(arg, code.id):
                layout.append(code.id)
            else:
                return None
    flatten = jax.tree_util.default_registry.flatten
    found = _expansion(value, spec.treedef, as_pytree=False)
    if found is None:
        return _plan.MixedRead(spec_id, flatten, _nnx_gate.is_node, spec.treedef, tuple(layout))
    return _plan.MixedRead(spec_id, flatten, _nnx_gate.reads_as_node, found[0], tuple(layout), found[1])


def pytree_read(value: Any, read: _plan.TreeRead) -> _plan.TreeRead | None:
    """`read`, jax's flatten of `value` (a pytree holding nnx.States or Variables, read as
    jax.jit reads it: `nnx_as_pytree`), made to stop at each State and Variable, which
    `_tree_reads.expand_into` then reads as flax's flatten would (`_expansion`), without its
    Python frames; None where `value` holds neither, or one that read does not cover."""
    found = _expansion(value, read.treedef, as_pytree=True)
    if found is None:
        return None
    return read._replace(is_leaf=_nnx_gate.reads_as_value, treedef=found[0], expand=found[1])


def _expansion(value: Any, treedef: Any, as_pytree: bool) -> tuple[Any, tuple[Any, ...]] | None:
    """(treedef, expand) of a read of `value` by jax's flatten stopping at each nnx.State
    (and, `as_pytree`, each Variable), each then read by `_tree_reads.expand_into`: a State
    by its `_mapping` (as flax's flatten sorts it), a Variable (`as_pytree`) as its raw value
    and metadata. The leaves jax's flatten gives (with each NNX object a leaf, unless
    `as_pytree`), without flax's Python flatten of each State and Variable (a sort of its
    items: about 1 us a State here). None where `value` holds none, or one the read does not
    cover (a tuple or None in a State, a key that does not sort, a Variable type that jax
    flattens otherwise): checked here, against jax's own flatten of `value`."""
    flatten = jax.tree_util.default_registry.flatten
    try:
        want, want_treedef = flatten(value) if as_pytree else flatten(value, _nnx_gate.is_node)
        leaves, stopped = flatten(value, _nnx_gate.reads_as_value if as_pytree else _nnx_gate.reads_as_node)
        expand = tuple(_expand_read(x, as_pytree, 0) for x in leaves)
    except (_Unmapped, TypeError, RecursionError):
        return None
    if all(e is None for e in expand) or want_treedef != treedef:
        return None
    found: list[Any] = []
    if not _tree_reads.expand_into(leaves, expand, found):
        return None
    if len(found) != len(want) or any(a is not b for a, b in zip(found, want)):
        return None
    return stopped, expand


class _Unmapped(Exception):
    """A State or Variable that `_expand_read` does not read."""


def _expand_read(node: Any, as_pytree: bool, depth: int) -> Any:
    """The read of one leaf of `_expansion`'s flatten, or of an item of a State in it: a
    MappingRead for an nnx.State or a dict in one, a VariableValueRead for a Variable
    (`as_pytree`), else None (a leaf, which `_expansion` checks against jax's flatten)."""
    kind = type(node)
    if as_pytree and _is_variable(node):
        metadata = _var_metadata(node)
        structure: Any = jax.tree_util.tree_structure(node)
        if type(metadata) is not dict or structure.node_data() != (kind, tuple(sorted(metadata.items()))):
            raise _Unmapped  # (a Variable type whose node data is not flax's: jax's flatten reads it)
        return _plan.VariableValueRead(kind, dict(metadata))
    if kind is not dict and kind is not nnx.State:
        return None
    attr = None if kind is dict else "_mapping"
    mapping = node if attr is None else vars(node).get(attr)
    if type(mapping) is not dict or depth > _MAPPING_DEPTH:
        raise _Unmapped
    keys = tuple(sorted(mapping))  # (TypeError: keys that do not sort, which jax's flatten refuses too)
    return _plan.MappingRead(kind, attr, keys, tuple(_expand_read(mapping[k], as_pytree, depth + 1) for k in keys))


_MAPPING_DEPTH = 32  # (the compiled read recurses once per level)


def _plain_state(state: Any) -> bool:
    """Whether an nnx.State holds Variables only (in its dicts and nested States, at any
    depth): no module (which keeps its graph updates), no raw leaf (which nnx.jit does not
    write back)."""
    return all(map(_is_variable, jax.tree_util.tree_leaves(state, is_leaf=_nnx_gate.is_node)))


def read_as_one_object(state: Any) -> bool:
    """Whether `read_container` reads this nnx.State as one NNX object (cached, or of
    Variables only), not as a container of its NNX objects."""
    return cached(state) is not None or _plain_state(state)


def overlapping(nnx_args: list[NnxArg]) -> bool:
    """Whether any two of these NNX objects share a node or Variable (cached per pair
    of cache entries)."""
    entries = [arg.entry for arg in nnx_args if arg.entry is not None]
    if len(entries) < len(nnx_args):
        # Some read afresh (a Variable on its own: one id): their ids against each other's,
        # then against each entry's set (`isdisjoint` walks the smaller set: not the model)
        seen: set[int] = set()
        for arg in nnx_args:
            if arg.entry is None:
                if not seen.isdisjoint(arg.ids):
                    return True
                seen.update(arg.ids)
        if any(not entry.node_ids.isdisjoint(seen) for entry in entries):
            return True
    for i, a in enumerate(entries):
        for b in entries[i + 1 :]:
            known = a.disjoint.get(id(b))
            if known is None or known[0]() is not b:
                known = (weakref.ref(b), a.node_ids.isdisjoint(b.node_ids))
                a.disjoint[id(b)] = known
                b.disjoint[id(a)] = (weakref.ref(a), known[1])  # (C looks in one order only)
            if not known[1]:
                return True
    return False


def joint_index() -> Any:
    return graphlib.RefMap()


# --------------------------------------------------------------------------
# The structure path: an argument read again by its record


def readable_argument(arg: NnxArg, spec_id: int) -> bool:
    """Whether the structure route may read this call's NNX argument from its cache entry
    (`NodeRead`): it was read from it, on its own (not jointly with another argument)."""
    entry = arg.entry
    return entry is not None and not entry.volatile and entry.spec_id == spec_id and not entry.spec.joint


def joint_read(arg: NnxArg, before: Any) -> _plan.JointRead | None:
    """How the structure path reads this call's NNX argument again, if the general path read
    it jointly with the call's other NNX arguments (`_read_node` with `joint`) and its cache
    entry is usable as it is, unchanged since the call's first, separate read found it
    (`before`: the object, its entry and the entry's version then): which of the entry's
    leaves the joint flatten passed (the same leaves, by path and identity). None if it
    cannot be said."""
    entry = cached(arg.obj)
    if entry is None or entry.paths is None or arg.entry is not None or arg.paths is None or entry.fresh:
        return None
    # (the very entry the call's first read found before the joint flatten, not changed in
    # place since: else the joint flatten may have seen another graph than the one the entry
    # describes, changed and re-read by another thread meanwhile, and the program compiled
    # for it would be pinned to the entry)
    if before is None or before[0] is not arg.obj or before[1] is not entry or before[2] != entry.version:
        return None
    position = {tuple(p): k for k, p in enumerate(entry.paths)}
    keep = [position.get(tuple(p), -1) for p in arg.paths]
    if len(keep) != len(arg.variables) or -1 in keep:
        return None
    for k, item in zip(keep, arg.variables):
        mine = entry.items[k]
        if mine is not item and not (type(item) is RawLeaf and type(mine) is RawLeaf and mine == item):
            return None
    whole = keep == list(range(len(entry.items)))
    return _plan.JointRead(entry.spec_id, weakref.ref(entry), entry.node_ids, None if whole else tuple(keep))


def shared_variable_read(arg: NnxArg, spec_id: int, reads: list[Any], at: int) -> _plan.SharedVariableRead | None:
    """How the structure path reads this call's Variable argument again (`at`: its position
    in `reads`, the record's reads of every argument), if it was passed on its own, read
    jointly, and another argument read by a JointRead in `reads` holds it: the holder passes
    its value if it comes first (the joint flatten met the Variable as a reference to one
    seen before: it passed no leaf), else the Variable does (and the holder's JointRead
    leaves it out); else None."""
    v = arg.obj
    if arg.entry is not None or not _is_variable(v):
        return None
    passed = len(arg.variables) == 1 and arg.variables[0] is v
    if not passed and arg.variables:
        return None
    for owner, read in enumerate(reads):
        entry = read.entry() if type(read) is _plan.JointRead and owner != at else None
        if entry is None or (owner > at) != passed:
            continue
        for index, item in enumerate(entry.items):
            if item is v and (read.keep is None or index in read.keep) != passed:
                return _plan.SharedVariableRead(spec_id, owner, index, passed)
    return None


def explain_node(obj: Any) -> tuple[str, str]:
    """(what an NNX argument is to fastcall, what it costs per call), for `f.explain`."""
    if _is_variable(obj):
        if type(raw_value(obj)) is not ArrayImpl or _variable_key(obj) is None or obj.get_metadata().get("hijax"):
            return (
                "NNX Variable on its own, with unhashable metadata or a value that is not a jax array",
                "a graph walk every call (nnx.jit's cost)",
            )
        return (
            "NNX Variable on its own (no cache entry: it cannot be weakly referenced)",
            "its type and metadata compared with the recorded ones (they select the program), its value read",
        )
    entry = by_id.get(id(obj))
    if entry is None or entry.ref() is not obj:
        plain = _plain_state_read(obj) if type(obj) is nnx.State else None
        if plain is not None and plain.spec is not None:
            return (
                "nnx.State of Variables only, new, of a structure read before",
                "read by its pytree flatten, as jax.jit reads it (no graph walk): each Variable's "
                "type and metadata compared with the structure's",
            )
        return "NNX object, not read yet", "read on its first call"
    if entry.provisional:
        return (
            "NNX object read once, holding plain lists or dicts",
            "read again on its next call, watched from then on (an object passed once is not walked for them)",
        )
    if entry.stale:
        return "NNX object whose structure changed", "re-read on its next call, then cached again"
    if entry.rebuilt:
        return (
            "NNX object rebuilt in place by NNX (the graph update of nnx.jit or another NNX transform)",
            "its nodes' attributes compared with the last read on its next call (no graph walk if they are the same; "
            "else re-read)" if entry.layout is not None else "re-read on its next call, then cached again",
        )
    if entry.volatile:
        if not TRUSTED:
            why = "the structure hooks are not verified on this flax"
        elif entry.spec.mutable_statics:
            where = "; ".join(unwatchable_statics(obj)) or "not found where"
            why = (
                "a mutable static attribute holding what a guard cannot watch (a set, an object that is "
                f"not a list, dict or dataclass), or a Variable with unhashable metadata: {where}; its graph "
                "is walked and compared by value. For the fast path, keep hashable values there (a tuple, "
                "a frozenset, a frozen dataclass)"
            )
        else:
            why = "a container in its graph that cannot be guarded, or a raw leaf fastcall cannot address"
        return f"NNX object re-read on every call ({why})", "a graph walk (nnx.jit's cost)"
    n = sum(len(w.expected) for w in entry.guard) if entry.guard else 0
    checks = f", {n} list/dict item identity checks" if entry.guard else ""
    kind = "NNX object, structure cached" + (" (guarded lists/dicts)" if entry.guard else "")
    if not entry.direct:
        kind += "; raw arrays inside plain lists/dicts keep it on the general path"
    n_leaves = len(entry.items)
    return kind, f"{n_leaves} leaf value{'' if n_leaves == 1 else 's'} read{checks}"

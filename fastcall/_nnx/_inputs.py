"""Inside the trace: the NNX arguments rebuilt, and what the function did to them.

Inside the trace (`TracedInputs`), each NNX argument is rebuilt from its graphdef with the
traced values; after the function returns, each Variable whose value is no longer the very
tracer it was given is an output, and only those are written back (`NnxOutputs`,
`finish`). Structural changes made inside are returned too, to be propagated to the
caller's objects (graph updates), and NNX objects in the output are replaced by markers
(`_InputNode`, `_NewNode`, `_FreshVariable`), which `_write_back` turns back into the
caller's own objects or new ones.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable, is_array_ref

from .. import _nnx_gate
from .._errors import FastcallError
from ._specs import _DYNAMIC, _STATIC, NodeSpec, TreeSpec, _copy_unhashable
from ._variables import (
    State, _child, _is_node, _is_variable, _own_maker, _var_metadata, new_variable, raw_value
)

_ARG_STRIDE = 1 << 32  # outer indices of NNX argument k are k * _ARG_STRIDE + index


class _Traced:
    """One NNX argument inside the trace: the rebuilt node and its leaves before the call."""

    __slots__ = ("node", "spec", "inner", "paths", "owners", "given", "index_ref", "name", "state_treedef", "metadata")

    def __init__(self, node_spec: NodeSpec, given: Any, shared_index: Any, name: str) -> None:
        self.spec = node_spec
        self.name = name
        self.given = list(given)
        # graphdef index -> object rebuilt here
        self.index_ref = shared_index if node_spec.joint else graphlib.IndexMap()
        graphdef = node_spec.graphdef
        if node_spec.mutable_statics:  # (the function may change them in place: not the spec's)
            graphdef = _copy_unhashable(graphdef)
        self.node = graphlib.unflatten(graphdef, list(given), index_ref=self.index_ref)
        # an nnx.State's pytree structure as given, Variables as leaves (see `_twins`)
        self.state_treedef = (
            jax.tree_util.tree_structure(self.node, is_leaf=_nnx_gate.is_node) if type(self.node) is State else None
        )
        self.inner: list[Any] = []  # the leaves (Variables, raw values) before the call
        self.paths: list[Any] = []  # and their paths
        self.owners: list[Any] = []  # and the object holding each (None: not found)
        self.metadata: list[Any] = []  # and each Variable's metadata (a copy; None: a raw leaf)

    def metadata_changed(self) -> list[tuple[int, dict[str, Any]]]:
        """(leaf index, its metadata now) for each Variable given whose metadata the
        function changed in place (`v.set_metadata(...)` inside)."""
        out = []
        for i, (v, before) in enumerate(zip(self.inner, self.metadata)):
            now = v.get_metadata() if before is not None else None
            if now is not None and now != before:
                out.append((i, dict(now)))
        return out

    def writes(
        self, after: list[Any] | None, everything: bool, replace: bool, raw: bool = True, alive: Any = None
    ) -> list[tuple[int, Any, bool]]:
        """(leaf index, new value, whether its Variable was replaced) for every leaf the
        function changed (or, with `everything`, every leaf), given the leaves `after` the
        call if the graphdef is the same (raw leaves at the same places, Variables of the
        same types; None if not: then only the given Variables' values are compared).
        `replace`: a Variable replaced by a new one is written as such (graph updates);
        `raw`: raw leaves rebound are written too; `alive`: if given, the ids of the
        objects in the argument after the call, the only Variables written."""
        out = []
        for i, (v, given) in enumerate(zip(self.inner, self.given)):
            now = v if after is None else after[i]
            if isinstance(v, Variable) and now is not v and replace:
                value = now.get_raw_value()
                # (a new Variable holding a mutable array reference made in the trace, under
                # `nnx.var_defaults(ref=True)`: its value goes out; the caller's new Variable,
                # made as its metadata says, holds a reference of its own, as under nnx.jit)
                out.append((i, value[...] if is_array_ref(value) else value, True))
                continue
            # (without graph updates, a Variable the function replaced still gives back the
            # value it has now: it may have been changed before being moved or dropped)
            if isinstance(v, Variable) and alive is not None and id(v) not in alive:
                continue
            if isinstance(v, Variable):
                new = v.get_raw_value()
                if new is given and is_array_ref(new):
                    continue  # (a mutable array reference: jax changes the caller's in place)
                # A non-array value (a dict of arrays, ...) may have changed in place:
                # always written back.
                if everything or new is not given or not isinstance(new, jax.Array):
                    out.append((i, new, False))
            elif raw and (everything or now is not v) and not is_array_ref(now):
                # a raw leaf rebound (`self.count += 1`); (a mutable array reference is
                # changed in place through jax, and cannot be returned)
                out.append((i, now, False))
        return out


class NnxOutputs(NamedTuple):
    """What a compiled entry's NNX arguments need after each call (decided at trace time).

    The entry's flat outputs end with `n_written` extra leaves: first the leaves of
    each restructured argument, then the new value of each written Variable."""

    writes: tuple[tuple[int, int], ...]  # (NNX argument ordinal, leaf index) per written Variable
    restructure: tuple[tuple[int, Any, int], ...]  # (ordinal, new graphdef, number of leaves)
    has_nodes: bool  # the output holds NNX object markers to turn back into objects
    inner_nodes: tuple[int, ...]  # outer indices of the arguments' sub-objects returned
    n_written: int
    # the writes whose Variable the function replaced by a new one: the caller's object
    # gets a new Variable (same type and metadata) holding the value
    replaced: frozenset[tuple[int, int]] = frozenset()
    joint: bool = False  # the arguments were flattened jointly (one index space)
    links_outer: bool = False  # a new object returned holds objects of the arguments
    # new objects returned (`_NewNode` markers: pytree nodes of the output, not statics)
    new_objects: bool = True
    # nnx.States returned holding the very Variables of an nnx.State argument, in the same
    # pytree structure (a functional loop's `return loss, nnx.state(...)`): (where in the
    # output: None for the output itself, else its index in the output tuple or list; the
    # argument's ordinal). Each call gives each such State a cache entry (`twin_states`).
    twins: tuple[tuple[int | None, int], ...] = ()
    # without graph updates: (ordinal, leaf index, metadata) of each Variable given whose
    # metadata the function changed in place, set on the caller's Variable after each call
    metadata: tuple[tuple[int, int, dict[str, Any]], ...] = ()
    # new Variables returned on their own, as `_FreshVariable` nodes: the output is built
    # from the entry's own treedef (`OutInfo.result`), which holds them; jax's output tree
    # would not keep them (it re-flattens its first output, where they are Variables, by
    # flax's pytree node, which rebuilds the metadata sorted)
    fresh: bool = False


class TracedInputs:
    """The NNX arguments of one trace: rebuilt before the function runs, compared after."""

    def __init__(self) -> None:
        self.args: list[_Traced] = []
        self.shared_index = graphlib.IndexMap()  # for NNX arguments flattened jointly

    def rebuild(self, spec: NodeSpec, segment: Any, name: str) -> Any:
        t = _Traced(spec, segment, self.shared_index, name)
        self.args.append(t)
        return t.node

    def rebuild_tree(self, spec: TreeSpec, segment: Any, name: str) -> Any:
        """The container argument of `spec`, each NNX object in it rebuilt (in leaf order)."""
        items: list[Any] = []
        statics = iter(spec.statics)
        pos = 0
        for code in spec.layout:
            if code == _STATIC:
                items.append(next(statics))
            elif code == _DYNAMIC:
                items.append(segment[pos])
                pos += 1
            else:
                items.append(self.rebuild(code, segment[pos : pos + code.n_dyn], name))
                pos += code.n_dyn
        return spec.treedef.unflatten(items)

    def _flatten_all(self) -> list[tuple[Any, Any]]:
        """(graphdef, flat state) per argument, joint ones sharing one RefMap (as given)."""
        shared = graphlib.RefMap()
        out = []
        for t in self.args:
            ref_index = shared if t.spec.joint else None
            out.append(graphlib.flatten(t.node, with_paths=True, ref_index=ref_index))
        return out

    def snapshot(self) -> None:
        for t, (_, flat) in zip(self.args, self._flatten_all()):
            t.inner, t.paths = list(flat.leaves), list(flat.paths)
            t.owners = [_owner(t.node, path) for path in t.paths]
            t.metadata = [dict(v.get_metadata()) if _is_variable(v) else None for v in t.inner]

    def outputs(
        self, out: Any, graph_updates: bool, refuse_aliasing: bool, everything: list[bool], shardings: list[Any]
    ) -> tuple[Any, NnxOutputs | None, list[Any]]:
        """After the function returned `out`: (out with NNX objects replaced by markers,
        what to do after each call or None, the extra leaves to return). Per argument:
        `everything`, write back every Variable (not only the changed ones); `shardings`,
        one sharding per leaf (or None) that written values are constrained to."""
        writes: list[tuple[int, int]] = []
        written: list[Any] = []
        replaced: list[tuple[int, int]] = []
        restructured: list[Any] = []
        restructure: list[tuple[int, Any, int]] = []
        metadata: list[tuple[int, int, dict[str, Any]]] = []
        flattened = self._flatten_all()
        changed = [self._changed(t, graphdef, list(flat.leaves), out, flattened)
                   for t, (graphdef, flat) in zip(self.args, flattened)]
        # (the arguments only where the call's changes to their graphs are propagated: graph
        # mode with graph updates, as nnx.jit checks them)
        _refuse_outer_variables(
            out, [] if refuse_aliasing else [(t.name, flat) for t, (_, flat) in zip(self.args, flattened)]
        )
        joint = bool(self.args) and self.args[0].spec.joint  # (jointly: all of a call's arguments, or none)
        if joint and any(changed):
            # Arguments that share objects are restructured together, in one index space,
            # as they were read (a change made through one is seen through the others).
            changed = [True] * len(self.args)
        # Every graph flattened for the caller (restructured arguments, then new objects
        # returned) shares one index, so that an object both put in an argument and
        # returned comes back as one object; objects the function was given are named by
        # their outer index, so the caller's own objects are updated and linked.
        inner_ref = graphlib.RefMap()
        outer_index = self._outer_index_map()
        outer_ref = outer_index if graph_updates and not refuse_aliasing else None
        for ordinal, (t, (graphdef, flat)) in enumerate(zip(self.args, flattened)):
            if changed[ordinal] and graph_updates and not t.spec.values_only:
                # (without graph updates, as nnx.jit: values only)
                new_graphdef, new_flat = graphlib.flatten(
                    t.node, with_paths=True, ref_index=inner_ref, ref_outer_index=outer_ref
                )
                leaves = list(new_flat.leaves)
                if shardings[ordinal] is not None:  # each new leaf gets its path's in_sharding
                    by_path = dict(zip(map(tuple, t.paths), shardings[ordinal]))
                    leaves = [_constrained(leaf, by_path.get(tuple(p))) for p, leaf in zip(new_flat.paths, leaves)]
                restructure.append((ordinal, new_graphdef, len(leaves)))
                restructured += leaves
                continue
            after = list(flat.leaves)
            same_graph = graphdef == t.spec.graphdef and len(after) == len(t.inner)
            per_leaf = shardings[ordinal]
            aligned = after if same_graph else None
            values_only = t.spec.values_only
            # (an nnx.State, with graph updates: as nnx.jit, a Variable no longer in it after
            # the call gives nothing back)
            alive = {id(a) for a in after} if values_only and graph_updates else None
            for index, value, is_new in t.writes(aligned, everything[ordinal], graph_updates and not values_only,
                                                       raw=not values_only, alive=alive):
                if per_leaf is not None and per_leaf[index] is not None:
                    value = jax.lax.with_sharding_constraint(value, per_leaf[index])
                writes.append((ordinal, index))
                written.append(value)
                if is_new:
                    replaced.append((ordinal, index))
            if not graph_updates:
                # (as nnx.jit without graph updates, which writes each changed Variable back
                # whole with `update_from_state`: metadata changed in place inside too)
                metadata += [(ordinal, index, now) for index, now in t.metadata_changed()]
        twins = _twins(self.args, out, {k for k, _ in replaced} | {k for k, _, _ in restructure}) if not joint else ()
        out, marks = _mark_nodes(self.args, out, refuse_aliasing, inner_ref, outer_index, outer_ref)
        extra = restructured + written
        if not (writes or restructure or marks.found or metadata or marks.fresh):
            return out, None, []
        nnx_out = NnxOutputs(
            tuple(writes), tuple(restructure), marks.found, marks.sub_objects, len(extra), frozenset(replaced),
            joint, marks.links_outer, marks.new_objects, twins, tuple(metadata), marks.fresh,
        )
        return out, nnx_out, extra

    def _changed(self, t: _Traced, graphdef: Any, after: list[Any], out: Any, flattened: list[Any]) -> bool:
        """Whether the function changed the structure of argument `t` (given its graphdef
        and leaves `after` the call): another graphdef, or a raw leaf that is no longer an
        array. The same graphdef with a raw leaf rebound to another array is a value
        written back; with a Variable replaced by a new one (of the same type and
        metadata: the graphdef says so), a Variable replaced in the caller's object
        (`self.loss = Loss(...)` on every call), unless that cannot be done alone: the new
        Variable is one the function was given (by any argument: a Variable moved keeps
        its identity), it sits in more than one place, the graph shares objects (a shared
        old Variable is reached by other paths too), or the output holds NNX objects."""
        if graphdef != t.spec.graphdef or len(after) != len(t.inner):
            return True
        if any(not isinstance(a, (jax.Array, Variable)) for a, b in zip(after, t.inner) if a is not b):
            return True
        replaced = [i for i, (a, b) in enumerate(zip(after, t.inner)) if a is not b and isinstance(a, Variable)]
        if not replaced:
            return False
        if t.spec.has_shared or self._returns_nodes(out):
            return True
        # (the same graphdef, but a submodule replaced by a new one of the same structure:
        # its Variables are new, and their owner too)
        if any(t.owners[i] is None or _owner(t.node, t.paths[i]) is not t.owners[i] for i in replaced):
            return True
        new_variables = [after[i] for i in replaced]
        given_ids = {id(v) for u in self.args for v in u.inner}
        new_places = collections.Counter(
            id(a)
            for u, (_, flat) in zip(self.args, flattened)
            for a, b in zip(flat.leaves, u.inner)
            if a is not b and isinstance(a, Variable)
        )
        return any(id(a) in given_ids or new_places[id(a)] > 1 for a in new_variables)

    @staticmethod
    def _returns_nodes(out: Any) -> bool:
        return any(_is_node(x) for x in jax.tree_util.tree_leaves(out, is_leaf=_is_node))

    def _outer_index_map(self) -> Any:
        """object rebuilt here -> its outer index (`outer_objects` gives the caller's
        object at each), over every NNX argument of the call."""
        refmap = graphlib.RefMap()
        for ordinal, t in enumerate(self.args):
            base = _outer_base(ordinal, t.spec.joint)
            for index, obj in t.index_ref.items():
                refmap[obj] = base + index
        return refmap


def _twins(args: list[_Traced], out: Any, changed: set[int]) -> tuple[tuple[int | None, int], ...]:
    """`NnxOutputs.twins`: the nnx.States in `out` (itself, or an item of a tuple or
    list) holding exactly the Variables of an nnx.State argument whose Variables stay
    the caller's (`changed`: the ordinals of arguments restructured or with a Variable
    replaced), in its flatten order and pytree structure as given."""
    if type(out) is State:
        places: list[tuple[int | None, Any]] = [(None, out)]
    elif type(out) in (tuple, list):
        places = [(i, x) for i, x in enumerate(out) if type(x) is State]
    else:
        return ()

    def same(a: tuple[list[Any], Any], t: _Traced) -> bool:
        variables, treedef = a
        return (
            treedef == t.state_treedef and len(variables) == len(t.inner)
            and all(x is y for x, y in zip(variables, t.inner)) and all(map(_is_variable, variables))
        )

    # (the argument itself as it was given: each of its Variables is then still in it,
    # and returned as the caller's own)
    unchanged = [
        t.state_treedef is not None and ordinal not in changed
        and same(jax.tree_util.tree_flatten(t.node, is_leaf=_nnx_gate.is_node), t)
        for ordinal, t in enumerate(args)
    ]
    twins = []
    for position, state in places:
        flat = jax.tree_util.tree_flatten(state, is_leaf=_nnx_gate.is_node)
        ordinal = next((k for k, t in enumerate(args) if unchanged[k] and same(flat, t)), None)
        if ordinal is not None:
            twins.append((position, ordinal))
    return tuple(twins)


def _mark_nodes(
    args: list[_Traced], out: Any, refuse_inputs: bool, inner_ref: Any, outer_index: Any, outer_ref: Any
) -> tuple[Any, _Marks]:
    """Replace NNX objects in the output by markers. `refuse_inputs`: an input returned
    is an error (nnx.jit without graph updates). `outer_index`: each object the
    function was given (rebuilt in the trace) -> its outer index. New objects are
    flattened into `inner_ref` (after the restructured arguments, and rebuilt outside in
    the same order into one index), so that objects returned twice, or shared, stay one
    object; with `outer_ref`, objects of the arguments inside them are named by outer
    index."""
    marks = _Marks()
    # Every object of every input, for nnx.jit's refusal of inputs returned (aliasing).
    input_ids = {id(obj) for t in args for obj in t.index_ref.values()} if refuse_inputs else set()
    sub_objects: list[int] = []
    after: list[set[int]] = []

    def reachable() -> set[int]:
        """ids of every object in the arguments as they are after the call."""
        if not after:
            refmap = graphlib.RefMap()
            for t in args:
                graphlib.flatten(t.node, with_paths=False, ref_index=refmap)
            after.append({id(obj) for obj in refmap})
        return after[0]

    loose = _loose_variables(out, outer_index, inner_ref)

    def mark(x: Any) -> Any:
        if not _is_node(x):
            return x
        if id(x) in loose:
            marks.fresh = True
            return _FreshVariable(type(x), tuple(_var_metadata(x).items()), raw_value(x))
        marks.found = True
        if refuse_inputs and id(x) in input_ids:
            raise aliasing_error("both an input and an output")
        for k, t in enumerate(args):
            if x is t.node:
                return _InputNode(k)
        # A sub-object of an argument still in one after the call: the caller's, whose
        # state is written back with the argument's. One the function detached is
        # flattened as a new object would be, linked to the caller's (its state comes
        # back with it).
        if x in outer_index and (outer_ref is None or id(x) in reachable()):
            sub_objects.append(outer_index[x])
            return _InputNode(-1, outer_index[x])
        graphdef, values = graphlib.flatten(x, with_paths=False, ref_index=inner_ref, ref_outer_index=outer_ref)
        if refuse_inputs and any(id(obj) in input_ids for obj in inner_ref):
            raise aliasing_error("both an input and an output (inside a new object)")
        marks.links_outer = marks.links_outer or _refers_outside(graphdef)
        marks.new_objects = True
        return _NewNode(graphdef, list(values))

    marked = jax.tree_util.tree_map(mark, out, is_leaf=_is_node)
    marks.sub_objects = tuple(sub_objects)
    return marked, marks


def _loose_variables(out: Any, outer_index: Any, inner_ref: Any) -> frozenset[int]:
    """The ids of the Variables in `out` that the output's build makes anew after each
    call, from the `_FreshVariable` nodes put in their place (what the graph rebuild of
    a new Variable holding an array does: its type, metadata and value): those the
    function made (none of the arguments' objects, none put into a restructured
    argument), each returned once, holding an array, in an output holding no other NNX
    object (which might hold one). A returned `nnx.split` State of new Variables (a
    training step's `params`) then costs what jax.jit's output costs."""
    nodes = [x for x in jax.tree_util.tree_leaves(out, is_leaf=_is_node) if _is_node(x)]
    if not nodes or not all(map(_is_variable, nodes)):
        return frozenset()
    ids = frozenset(map(id, nodes))
    if len(ids) != len(nodes):
        return frozenset()
    for v in nodes:
        if (
            v in outer_index or v in inner_ref or not isinstance(raw_value(v), jax.Array)
            or _var_metadata(v).get("hijax")
            or not _own_maker(type(v))
        ):
            return frozenset()
    return ids


def _refuse_outer_variables(out: Any, arguments: list[tuple[str, Any]]) -> None:
    """Refuse, as nnx.jit does, a Variable made outside the trace (one the function closes
    over) returned, or put into an argument (`arguments`: each one's name and its graph as
    flattened after the call, where its changes are propagated): what comes back would be a
    copy made after the call, not that Variable, and its changes would be lost. (Trace time
    only.)"""
    places: list[tuple[str, Any]] = []
    try:
        places.append(("the output", [(path, v) for path, v in graphlib.iter_graph(out) if _is_variable(v)]))
    except Exception:  # (an output that cannot be walked: its flatten names the error)
        pass
    for name, flat in arguments:
        places.append((f"argument {name}", [(path, v) for path, v in zip(flat.paths, flat.leaves) if _is_variable(v)]))
    for where, found in places:
        for path, v in found:
            if getattr(v, "hijax", False):  # (read through: a hijax Variable in a trace forwards)
                continue
            trace_state = getattr(v, "_trace_state", None)
            if trace_state is None or trace_state.is_valid():
                continue
            at = "".join(f"[{k!r}]" for k in path) or " itself"
            raise ValueError(
                f"fastcall.jit: {where}{' at ' + at if path else at} holds a {type(v).__name__} made outside "
                "this function's trace (a Variable it closes over, say); nnx.jit refuses it too (\"Cannot "
                "extract graph node from different trace level\"). Pass the Variable (or the object holding "
                "it) as an argument, or make a new one inside the function."
            )


def _owner(root: Any, path: Any) -> Any:
    """The object holding the leaf at `path` of `root`'s graph (None if it cannot be found)."""
    node = root
    try:
        for key in path[:-1]:
            node = _child(node, key)
    except Exception:
        return None
    return node


class _Marks:
    """What `_mark_nodes` found in an output."""

    __slots__ = ("found", "sub_objects", "links_outer", "new_objects", "fresh")

    def __init__(self) -> None:
        self.found = False  # any NNX object marked (a `_FreshVariable` is not: see `fresh`)
        self.fresh = False  # any new Variable returned on its own (a `_FreshVariable`)
        self.new_objects = False  # any new one
        self.sub_objects: tuple[int, ...] = ()  # outer indices of the arguments' sub-objects returned
        self.links_outer = False  # a new object holds an object of the arguments


def _outer_base(ordinal: int, joint: bool) -> int:
    """The outer index of graph index 0 of NNX argument `ordinal` (arguments flattened
    jointly share one index space)."""
    return 0 if joint else ordinal * _ARG_STRIDE


def _refers_outside(graphdef: Any) -> bool:
    """Whether a graphdef flattened with an outer index names an object given by the caller."""
    for node in getattr(graphdef, "nodes", ()):
        if getattr(node, "outer_index", None) is not None:
            return True
        if getattr(getattr(node, "array_refdef", None), "outer_index", None) is not None:
            return True
    return False


def aliasing_error(where: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: duplicate NNX Variable found at paths in {where}. As nnx.jit, fastcall "
        "does not support Variable aliasing in tree mode (graph=False: a Variable in two arguments, or an "
        "input Variable returned) and without graph updates (graph_updates=False: an input "
        "Variable returned): remove the duplicate, use nnx.clone(), or pass graph=True and "
        "graph_updates=True."
    )


def _constrained(leaf: Any, sharding: Any) -> Any:
    """`leaf` (a Variable or a raw value, inside a trace) constrained to `sharding`."""
    if sharding is None:
        return leaf
    if isinstance(leaf, Variable):
        leaf.set_raw_value(jax.lax.with_sharding_constraint(leaf.get_raw_value(), sharding))
        return leaf
    if isinstance(leaf, jax.Array):
        return jax.lax.with_sharding_constraint(leaf, sharding)
    return leaf


class _InputNode:
    """Output marker: the function returned its k-th NNX argument (`outer` None), or the
    object at outer index `outer` of its arguments (a submodule, a Variable): the caller's
    own object is returned."""

    __slots__ = ("k", "outer")

    def __init__(self, k: int, outer: int | None = None) -> None:
        self.k = k
        self.outer = outer

    def __eq__(self, other: object) -> bool:
        return type(other) is _InputNode and (other.k, other.outer) == (self.k, self.outer)

    def __hash__(self) -> int:
        return hash((_InputNode, self.k, self.outer))


class _NewNode:
    """Output marker: an NNX object created by the function, rebuilt outside from its values."""

    __slots__ = ("graphdef", "values")

    def __init__(self, graphdef: Any, values: list[Any]) -> None:
        self.graphdef = graphdef
        self.values = values


jax.tree_util.register_pytree_node(
    _NewNode, lambda n: (n.values, n.graphdef), lambda gd, vals: _NewNode(gd, list(vals))
)


class _FreshVariable:
    """Output marker: a new Variable returned on its own (`_loose_variables`),
    a pytree node whose unflatten makes the Variable itself, as NNX's graph rebuild makes it
    (its type's `from_metadata`, Variable's own, which for a Variable that is not hijax is
    its `_new`: its type, its metadata in the order it had, its value). Built from the
    entry's own output tree (`NnxOutputs.fresh`). (Not flax's pytree node for a Variable,
    which rebuilds the metadata sorted.)"""

    __slots__ = ("kind", "metadata", "value")

    def __init__(self, kind: type, metadata: tuple[tuple[str, Any], ...], value: Any) -> None:
        self.kind = kind
        self.metadata = metadata
        self.value = value


def pytree_outputs(out: Any) -> tuple[Any, bool]:
    """The function's output, with jax.jit's reading of NNX objects (`nnx_as_pytree`), as
    the output tree to build after each call, and whether it holds a marker: each Variable
    in it that flax's pytree node would rebuild with its type's `_new` (Variable's own:
    `_own_maker`; not hijax, not a reference) put as a `_FreshVariable` holding its
    metadata sorted by name, as flax's flatten gives them. Its build then makes the same
    Variable as flax's unflatten (its type, `dict` of the sorted metadata, its value),
    through `new_variable`, for less."""
    marked = []

    def mark(x: Any) -> Any:
        if not _is_variable(x) or not _own_maker(type(x)):
            return x
        metadata = _var_metadata(x)
        if metadata.get("hijax") or metadata.get("ref"):
            return x
        marked.append(x)
        return _FreshVariable(type(x), tuple(sorted(metadata.items())), raw_value(x))

    out = jax.tree_util.tree_map(mark, out, is_leaf=_is_variable)
    return out, bool(marked)


def _fresh_variable(aux: tuple[Any, tuple[tuple[str, Any], ...]], children: Any) -> Any:
    kind, metadata = aux  # (a Variable type with Variable's own `_new`: `_loose_variables`)
    return new_variable(kind, children[0], dict(metadata))


jax.tree_util.register_pytree_node(_FreshVariable, lambda n: ((n.value,), (n.kind, n.metadata)), _fresh_variable)

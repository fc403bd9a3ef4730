"""The NNX options of a wrapped function and the shardings of its NNX arguments.

`resolve_options` resolves `graph` and `graph_updates` at decoration and checks sharding
prefixes as nnx.jit does; `ShardingContext` gives one sharding per leaf of each NNX
argument, and `constrain` constrains an NNX object's Variables inside a trace.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable

from .._build import broadcast_prefix
from .._errors import FastcallError, describe_arg
from ._specs import _DYNAMIC, NodeSpec, TreeSpec, _intern_graphdef
from ._variables import _is_node, _is_variable, raw_value

# --------------------------------------------------------------------------
# Options


def resolve_options(
    graph: bool | None, graph_updates: bool | None, in_shardings: Any, out_shardings: Any
) -> tuple[bool, bool]:
    """At decoration, as nnx.jit: `graph_updates=None` (and `graph=None`) mean the current
    `nnx.set_graph_updates` (`nnx.set_graph_mode`) setting; shardings given as prefixes
    are checked as nnx.jit checks them. Returns (graph, graph_updates), resolved."""
    if graph is None:
        graph = graphlib.set_graph_mode.current_value()
    if graph_updates is None:
        setting = getattr(graphlib, "set_graph_updates", None)  # (flax >= 0.12.6)
        graph_updates = True if setting is None else setting.current_value()
    graph_updates = graph_updates and graph  # (tree mode has no graph updates, as in nnx.jit)
    for name, prefix in (("in_shardings", in_shardings), ("out_shardings", out_shardings)):
        for leaf in jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: _is_node(x) or hasattr(x, "map_prefix")):
            kind = type(leaf).__name__
            if isinstance(leaf, Variable):
                raise FastcallError(
                    f"fastcall.jit: {name} holds a Variable ({kind}). Variables prefixes are not "
                    "supported (as in nnx.jit): give one sharding for the whole Variable."
                )
            if _is_node(leaf) and graph:
                raise FastcallError(
                    f"fastcall.jit: {name} holds an NNX object ({kind}). Graph nodes are not allowed "
                    "as prefixes when graph=True (as in nnx.jit): pass shardings (a jax Sharding, an "
                    "nnx.StateSharding, nnx.prefix(..., graph=True)), or pass graph=False for "
                    "nnx.prefix(..., graph=False)'s result."
                )
            if hasattr(leaf, "map_prefix") and not (graph and graph_updates):
                raise FastcallError(
                    f"fastcall.jit: {name} cannot contain `{kind}` objects when graph=False or "
                    "graph_updates=False (as in nnx.jit): use nnx.prefix(...), or graph=True and "
                    "graph_updates=True."
                )
    return bool(graph), bool(graph_updates)


# --------------------------------------------------------------------------
# Shardings


def _structured_prefix(prefix: Any) -> dict[tuple[Any, ...], Any] | None:
    """Variable path -> sharding for a prefix shaped like an NNX object: what
    `nnx.prefix(obj, ..., graph=False)` returns (an object of obj's type whose Variables
    hold shardings) or `graph=True` returns (a TreeState holding a State of shardings).
    None for anything else (a single Sharding, an nnx.StateSharding, a flat list)."""
    state = getattr(prefix, "__state__", None)
    if state is not None and type(prefix).__name__ == "TreeState":
        return {tuple(path): value for path, value in nnx.to_flat_state(state)}
    if _is_node(prefix):
        flat = graphlib.flatten(prefix, with_paths=True)[1]
        return {
            tuple(path): raw_value(v) if isinstance(v, Variable) else v for path, v in zip(flat.paths, flat.leaves)
        }
    return None


def _is_sharding(x: Any) -> bool:
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


class ShardingContext:
    """The in_shardings of one compiled entry's NNX arguments, read in argument order.
    Arguments flattened jointly are rebuilt as placeholders into one shared index (their
    graphdefs refer to objects of earlier arguments), and a Variable shared between
    arguments must get the same sharding from each (else nnx.jit's "Inconsistent aliasing")."""

    def __init__(self) -> None:
        self.joint_index = graphlib.IndexMap()
        self.assigned: dict[int, tuple[Any, Any, str]] = {}  # id(Variable) -> (it, sharding, arg)

    def leaf_shardings(self, spec: NodeSpec | TreeSpec, prefix: Any, arg_name: str) -> list[Any]:
        """One sharding per leaf of an NNX argument, or of a container holding NNX objects
        (`prefix` a pytree prefix of it; at each NNX object, any of the forms below)."""

        if isinstance(spec, NodeSpec) and spec.values_only:
            # An nnx.State read as one object: a pytree of Variables to nnx.jit, so `prefix`
            # is a pytree prefix of it, as for a container of Variables.
            placeholder = graphlib.unflatten(spec.graphdef, [_Slot() for _ in range(spec.n_dyn)])
            variables = jax.tree_util.tree_leaves(placeholder, is_leaf=_is_variable)
            per_variable: list[Any] = []
            for v, sharding in zip(variables, broadcast_prefix(prefix, placeholder, is_leaf=_is_variable)):
                per_variable += self._node(_intern_graphdef(graphlib.flatten(v)[0], 1, arg_name), sharding, arg_name)
            return per_variable
        if isinstance(spec, NodeSpec):
            return self._node(spec, prefix, arg_name)

        placeholder = spec.treedef.unflatten([object()] * len(spec.layout))
        per_item = broadcast_prefix(prefix, placeholder)
        out: list[Any] = []
        for code, sharding in zip(spec.layout, per_item):
            if isinstance(code, NodeSpec):
                out += self._node(code, sharding, arg_name)
            elif code == _DYNAMIC:
                out.append(sharding)
        return out

    def _node(self, spec: NodeSpec, prefix: Any, arg_name: str) -> list[Any]:
        """One sharding per leaf of an NNX object: from one jax Sharding (or PartitionSpec)
        for all, an `nnx.StateSharding` (checked against each Variable's path and type, as
        nnx.jit does), an `nnx.prefix` result (matched by Variable path), or a flat list
        (one entry per leaf, in flatten order)."""
        n = spec.n_dyn
        index = self.joint_index if spec.joint else graphlib.IndexMap()
        known = {id(obj) for obj in index.values()}  # (objects of earlier arguments)
        # (a stand-in per leaf: not None, which a mutable array reference's slot drops)
        placeholder = graphlib.unflatten(spec.graphdef, [_Slot() for _ in range(n)], index_ref=index)
        flat = graphlib.flatten(placeholder, with_paths=True)[1]  # (every Variable, shared too)
        if _is_sharding(prefix):
            every = [prefix] * len(flat.leaves)
        elif hasattr(prefix, "map_prefix") and hasattr(prefix, "filters"):
            every = [prefix.map_prefix(path, leaf) for path, leaf in zip(flat.paths, flat.leaves)]
        else:
            by_path = _structured_prefix(prefix)
            if by_path is None:
                leaves = jax.tree_util.tree_leaves(prefix, is_leaf=lambda x: x is None)
                if len(leaves) != n or spec.joint:
                    raise FastcallError(
                        f"fastcall.jit: in_shardings for {describe_arg(arg_name)} has {len(leaves)} "
                        f"entries but the object has {n} leaves of its own. Pass one jax Sharding, "
                        "an nnx.StateSharding, or nnx.prefix(obj, ...) computed for this very object."
                    )
                return leaves
            every = [by_path.get(tuple(path)) for path in flat.paths]
        own = []
        for path, leaf, sharding in zip(flat.paths, flat.leaves, every):
            if id(leaf) not in known:
                own.append(sharding)
            if sharding is None or not isinstance(leaf, Variable):
                continue
            earlier = self.assigned.setdefault(id(leaf), (leaf, sharding, arg_name))
            if earlier[1] != sharding:
                where = "." + ".".join(map(str, path)) if path else ""
                raise FastcallError(
                    f"fastcall.jit: Inconsistent aliasing: the Variable {describe_arg(arg_name, where)} "
                    f"is also in {describe_arg(earlier[2])}, and in_shardings gives it {earlier[1]} "
                    f"there but {sharding} here. A shared Variable has one sharding: give both the same."
                )
        return own


class _Slot:
    """A leaf's place in a placeholder graph (see `ShardingContext._node`)."""

    __slots__ = ()


def constrain(node: Any, sharding: Any) -> None:
    """Constrain the values of `node`'s Variables (inside a trace) to `sharding`: one jax
    Sharding for all, an nnx.StateSharding mapping each Variable by path and type, or an
    `nnx.prefix` result for an object of this structure (matched by Variable path)."""
    flat = graphlib.flatten(node, with_paths=True)[1]
    by_path = _structured_prefix(sharding)
    for path, leaf in zip(flat.paths, flat.leaves):
        if not isinstance(leaf, Variable):
            continue
        if by_path is not None:
            target = by_path.get(tuple(path))
        elif hasattr(sharding, "map_prefix"):
            target = sharding.map_prefix(path, leaf)
        else:
            target = sharding
        if target is not None:
            leaf.set_raw_value(jax.lax.with_sharding_constraint(leaf.get_raw_value(), target))

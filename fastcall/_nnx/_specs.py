"""Specs of NNX arguments, and what is static in them.

An NNX object passed as an argument has a `NodeSpec`: its graphdef, interned to a spec id
(`_intern_graphdef`). Static attributes such as `deterministic` or `use_running_average`
are part of it, so `model.eval()` selects another compiled program; those that can change
in place (a list, a dict, a dataclass holding one) are keyed by value, and watched by a
guard where one can (`_static_containers`). A pytree holding NNX objects has a `TreeSpec`;
a GraphDef passed as an argument (the functional API) is static (`read_graphdef`). Also
the names of an NNX object's leaves, for jax's errors and fastcall's reports
(`leaf_names`, `describe_node`, `named_leaves`).
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import inspect
import warnings
from typing import Any

from flax import nnx
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable

from .. import _debug_names, _plan, _guard
from .._errors import FastcallError, describe_arg
from .._flatten import flatten_generic as _flatten_generic
from .._flatten import intern
from .._flatten import interned as _interned
from .._flatten import leaf_key as _leaf_key
from ._variables import _is_variable, _var_metadata, is_node_type


def _may_hold_container(node_def: Any) -> bool:
    """Whether a node of a graphdef may be a plain list or dict (or another pytree node that
    can change in place): anything but a graph node, a Variable, and the leafless pytree
    nodes NNX keeps per object (its `PytreeState`)."""
    t = getattr(node_def, "type", None)
    if t is nnx.State:
        return True  # (its dict can change in place: `state["kernel"] = ...`)
    if not isinstance(t, type) or is_node_type(t) or t is tuple or t is type(None):
        return False  # (a tuple's items are nodes of their own: it cannot change in place)
    if t is getattr(graphlib, "GenericPytree", None):
        try:
            treedef = node_def.metadata[1]
            inner = treedef.node_data()
            if inner is None:
                return True
            if treedef.num_nodes == treedef.num_leaves + 1 and issubclass(inner[0], tuple):
                return False  # (a namedtuple, whose items are nodes of their own)
            return not (
                treedef.num_leaves == 0
                and treedef.num_nodes == 1
                and not issubclass(inner[0], (list, dict, collections.abc.MutableMapping))
            )
        except Exception:
            return True
    return True


class NodeSpec:
    """Spec of an NNX argument (duck-types `_flatten.Spec` for the parts the compiled
    function uses): its graphdef; its leaves are all dynamic."""

    __slots__ = (
        "id", "kind", "graphdef", "n_dyn", "cacheable", "templated", "mask", "joint", "mutable_statics",
        "frozen", "has_containers", "has_shared", "values_only", "__weakref__",
    )

    def __init__(self, graphdef: Any, n: int, joint: bool = False) -> None:
        self.id = -1
        # Static attributes that can change in place (a list, a dict, a dataclass holding
        # one): the spec is keyed by value (`frozen`: the graphdef frozen, see `_freeze`),
        # and the object's entry watches them with a guard (`_static_containers`), or, where
        # none can, the object's graph is walked and compared by value on every call.
        self.mutable_statics = False
        self.frozen: Any = None
        self.joint = joint  # flattened together with the call's earlier NNX arguments
        self.kind = "nnx"
        self.graphdef = graphdef
        self.n_dyn = n
        self.mask = (True,) * n
        self.cacheable = False
        self.templated = True
        # plain lists, dicts or other pytree nodes inside the graph (`nnx.data([...])`)
        nodes = getattr(graphdef, "nodes", None)
        self.has_containers = nodes is None or any(map(_may_hold_container, nodes))
        # an object reached by two paths (a shared Variable or submodule: a NodeRef)
        self.has_shared = nodes is None or any(type(n) is graphlib.NodeRef for n in nodes)
        # An nnx.State: a pytree to nnx.jit, which gives back only the new values of its
        # Variables (a Variable replaced in it, a key added or a raw leaf rebound inside
        # the function stay inside).
        self.values_only = nodes is not None and len(nodes) > 0 and getattr(nodes[0], "type", None) is nnx.State

    def nnx_objects(self) -> list[tuple[int, NodeSpec]]:
        return [(0, self)]


_STATIC, _DYNAMIC = "static", "dynamic"  # TreeSpec.layout codes of a leaf that is not an NNX object


class TreeSpec:
    """Spec of an argument holding NNX objects inside a pytree (a tuple, list, dict,
    dataclass or nnx.State of modules or Variables): its structure with each NNX object
    as one leaf (what nnx.jit's `to_tree` splits on), and per leaf either an NNX object's
    NodeSpec or how a plain leaf is passed (`_DYNAMIC`: traced, `_STATIC`: part of the key)."""

    __slots__ = ("id", "kind", "treedef", "layout", "statics", "n_dyn", "cacheable", "templated", "mask",
                 "__weakref__")

    def __init__(self, treedef: Any, layout: tuple[Any, ...], statics: tuple[Any, ...]) -> None:
        self.id = -1
        self.kind = "nnx-tree"
        self.treedef = treedef
        self.layout = layout
        self.statics = statics
        self.n_dyn = sum(c.n_dyn if isinstance(c, NodeSpec) else c == _DYNAMIC for c in layout)
        self.mask = (True,) * self.n_dyn
        self.cacheable = False
        self.templated = True

    def nnx_objects(self) -> list[tuple[int, NodeSpec]]:
        """(offset of its first leaf, NodeSpec) per NNX object in the argument."""
        out, start = [], 0
        for code in self.layout:
            if isinstance(code, NodeSpec):
                out.append((start, code))
                start += code.n_dyn
            else:
                start += code == _DYNAMIC
        return out


# --------------------------------------------------------------------------
# Graphdefs interned (keyed by value where a static can change in place)


def _intern_graphdef(graphdef: Any, n: int, arg_name: str, joint: bool = False) -> NodeSpec:
    tag = "nnx-joint" if joint else "nnx"
    try:
        return intern(NodeSpec(graphdef, n, joint), (tag, graphdef))
    except TypeError:
        pass  # a mutable static attribute (a list, a dict, a dataclass holding one)
    except Exception as err:
        raise _static_error(arg_name, err) from None
    # Keyed by value: a frozen copy of the graphdef is the key, and the spec keeps a deep
    # copy (the caller's list may change in place later; the compiled program must not).
    try:
        key = (tag, "by value", _freeze(graphdef))
        found = _interned(key)
        if found is not None:
            return found
        copied = _copy_unhashable(graphdef)
        frozen = _freeze(copied)
        if frozen != key[2]:  # (changed by another thread meanwhile: keyed as the copy the program keeps)
            key = (tag, "by value", frozen)
        spec = NodeSpec(copied, n, joint)
        spec.mutable_statics = True
        spec.frozen = frozen
        return intern(spec, key)
    except Exception as err:
        raise _static_error(arg_name, err) from None


def _static_error(arg_name: str, err: Exception) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: {describe_arg(arg_name)} has a static attribute that cannot be "
        f"compared or copied ({type(err).__name__}: {err}). NNX static attributes are part "
        "of the compile key: use values that compare by value (numbers, strings, tuples, "
        "lists, dicts, dataclasses of these), or store them in a Variable."
    )


def _copy_unhashable(x: Any) -> Any:
    """A copy of `x` in which every part that cannot be hashed (and so may change in place)
    is copied, recursively; hashable parts (types, functions, numbers) are kept as they are."""
    try:
        hash(x)
        return x
    except TypeError:
        pass
    if type(x) is list:
        return [_copy_unhashable(i) for i in x]
    if type(x) is tuple:
        return tuple(_copy_unhashable(i) for i in x)
    if type(x) is dict:
        return {k: _copy_unhashable(v) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        new = copy.copy(x)  # (every field, init=False ones included; frozen ones set directly)
        for f in dataclasses.fields(x):
            object.__setattr__(new, f.name, _copy_unhashable(getattr(x, f.name)))
        return new
    return copy.deepcopy(x)


def _freeze(x: Any) -> Any:
    """A hashable value equal for equal `x` (compared as `==` compares them, but with each
    scalar's type: 1, 1.0 and True differ): lists, dicts, sets and dataclasses are
    frozen recursively. Raises TypeError for anything else that cannot be hashed."""
    memo: dict[int, Any] = {}  # (an object met again, as one config held by every layer: frozen once)

    def freeze(x: Any) -> Any:
        try:
            hash(x)
        except TypeError:
            pass
        else:
            return _leaf_key(x)
        done = memo.get(id(x))
        if done is not None:
            return done[1]
        t = type(x)
        out: tuple[type, Any]
        if isinstance(x, (list, tuple)):
            out = (t, tuple(map(freeze, x)))
        elif t is dict:  # (equal whatever the order of insertion)
            out = (t, frozenset((freeze(k), freeze(v)) for k, v in x.items()))
        elif isinstance(x, collections.abc.Mapping):  # (an OrderedDict's order counts)
            out = (t, tuple((freeze(k), freeze(v)) for k, v in x.items()))
        elif isinstance(x, (set, frozenset)):
            out = (t, frozenset(map(freeze, x)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            out = (t, tuple((f.name, freeze(getattr(x, f.name))) for f in dataclasses.fields(x)))
        else:
            raise TypeError(f"unhashable type: {t.__name__!r}")
        memo[id(x)] = (x, out)  # (x held: its id is not reused meanwhile)
        return out

    return freeze(x)


# A lone Variable's graphdef depends only on its type and metadata (given an array
# value: not a mutable array reference, not a hijax Variable): (type, metadata) -> spec.
_variable_specs: dict[Any, NodeSpec] = {}


# GraphDefs passed as arguments (the functional API), by id, at most `_MAX_GRAPHDEFS`
# (`_plan.GRAPHDEFS`: the structure path reads it, in C too).
_graphdefs = _plan.GRAPHDEFS
_MAX_GRAPHDEFS = 64


def read_graphdef(graphdef: Any, arg_name: str, trace_scalars: bool) -> int:
    """Spec id of a GraphDef passed as an argument (`f(graphdef, state, x)`): static, part
    of the compile key. A GraphDef holds the module's static attributes as they are: a
    list or dict attribute is the module's own, so `model.features.append(...)` after
    `nnx.split` changes the GraphDef in place (nnx.jit and jax.jit then keep computing
    with the old value). Such a GraphDef is keyed by value and compared on every call with
    a copy taken when it was keyed; one with hashable statics only, by itself."""
    known = known_graphdef(graphdef)
    if known is not None:
        return known
    if _has_mutable_statics(graphdef):
        snapshot = _copy_unhashable(graphdef)
        try:
            key = ("graphdef by value", _freeze(graphdef))
            spec = _interned(key)
            if spec is None:
                spec = intern(_flatten_generic(snapshot, arg_name, trace_scalars)[0], key)
        except TypeError as err:
            raise _static_error(arg_name, err) from None
    else:
        snapshot, spec = None, _flatten_generic(graphdef, arg_name, trace_scalars)[0]
    if len(_graphdefs) >= _MAX_GRAPHDEFS:
        _graphdefs.clear()
    _graphdefs[id(graphdef)] = _plan.KnownGraphdef(graphdef, snapshot, spec.id, spec)
    return spec.id


known_graphdef = _plan.known_graphdef


def graphdef_by_value(graphdef: Any) -> Any:
    """For a GraphDef met inside another argument (`f((graphdef, x), state)`): its key by
    value where its statics can change in place (a list attribute, which
    `model.features.append(...)` changes after `nnx.split`), so that the argument is keyed
    by the value it has now, as `read_graphdef` keys one passed on its own; None where it
    cannot change."""
    return ("graphdef by value", _freeze(graphdef)) if _has_mutable_statics(graphdef) else None


def explain_graphdef(graphdef: Any) -> tuple[str, str]:
    """(what a GraphDef argument is to fastcall, what it costs per call), for `f.explain`."""
    if _has_mutable_statics(graphdef):
        return (
            "GraphDef holding lists or dicts (static, keyed by value)",
            "compared (==) with its copy taken when keyed: an in-place change is seen",
        )
    return "GraphDef (static, part of the compile key)", "one identity check once seen"


# --------------------------------------------------------------------------
# Statics a guard can watch


def _static_containers(graphdef: Any) -> list[Any] | None:
    """What a guard must watch so that the graph's static attributes that cannot be hashed
    (a list, a dict, a dataclass holding one: `self.config = config`) cannot change
    unseen: every list and dict in them, and the attribute dict of every dataclass, at any
    depth (through tuples too). A hashable part is taken as fixed, as every hashable static
    is (see docs/guarantees.md). None if one holds anything else that cannot be hashed (a
    set, an object of another kind): the graph is then walked on every call."""
    try:  # (every other part must be hashable: a Variable's metadata holding a list is not watched)
        hash((tuple(graphdef.nodes), tuple(a for a in graphdef.attributes if type(a[1]) is not graphlib.Static)))
    except TypeError:
        return None
    found: list[Any] = []
    seen: set[int] = set()
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static and _unwatchable(attr.value, found, seen, 0) is not _WATCHABLE:
            return None
    return found


_WATCHABLE = object()  # (what `_unwatchable` returns for a value a guard can watch)


def _unwatchable(x: Any, found: list[Any], seen: set[int], depth: int) -> Any:
    """The part of static value `x` that no guard can watch (a set, an object of another
    kind, a dataclass keeping a field out of its attribute dict, or `x` itself nested too
    deep), or `_WATCHABLE`; appends to `found` the lists, dicts and dataclass attribute
    dicts a guard must watch (`_static_containers`)."""
    try:
        hash(x)
        return _WATCHABLE
    except TypeError:
        pass
    if id(x) in seen:
        return _WATCHABLE
    if depth > 64:
        return x
    seen.add(id(x))
    t = type(x)
    if t is list or t is tuple or t is dict:
        if t is not tuple:
            found.append(x)
        for item in x.values() if t is dict else x:
            part = _unwatchable(item, found, seen, depth + 1)
            if part is not _WATCHABLE:
                return part
        return _WATCHABLE
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if isinstance(x, (list, tuple, dict)):
            return x  # (a dataclass that is also a container: its items are keyed too)
        attributes = _guard.Attributes(x)
        if not _guard.is_guardable(attributes):
            return x  # (no attribute dict to watch: slots)
        d = vars(x)
        if any(f.name not in d or hasattr(inspect.getattr_static(t, f.name, None), "__set__")
               for f in dataclasses.fields(x)):
            return x  # (a field kept out of the attribute dict: a slot, a descriptor)
        found.append(attributes)
        for item in vars(x).values():
            part = _unwatchable(item, found, seen, depth + 1)
            if part is not _WATCHABLE:
                return part
        return _WATCHABLE
    return x


def unwatchable_statics(obj: Any) -> list[str]:
    """Where `obj`'s graph holds what makes `_static_containers` refuse it, for `f.explain`:
    each static value holding a part no guard can watch ("tags holds a set", at every path
    that holds it), and each Variable whose metadata cannot be hashed."""
    graphdef, _ = graphlib.flatten(obj)
    refused = {}
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static:
            part = _unwatchable(attr.value, [], set(), 0)
            if part is not _WATCHABLE:
                refused[id(attr.value)] = part
    where = []
    for path, value in nnx.iter_graph(obj):  # (static values too, at each path that holds them)
        name = ".".join(map(str, path))
        if id(value) in refused:
            where.append(f"{name} holds {_describe_part(refused[id(value)])}")
        elif _is_variable(value):
            try:
                hash(tuple(_var_metadata(value).items()))
            except TypeError:
                where.append(f"{name} has metadata that cannot be hashed")
    return where


def _has_mutable_statics(graphdef: Any) -> bool:
    """Whether a static attribute in the GraphDef cannot be hashed (a list, a dict, a
    dataclass holding one: it may change in place)."""
    for _, attr in graphdef.attributes:
        if type(attr) is graphlib.Static:
            try:
                hash(attr.value)
            except TypeError:
                return True
    return False


# --------------------------------------------------------------------------
# Names of an object's leaves


def _describe_part(part: Any) -> str:
    kind = type(part).__name__
    return f"an {kind}" if kind[:1].lower() in "aeiou" else f"a {kind}"


def describe_node(obj: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """An NNX object's graphdef (what a recompile explanation compares; written out only
    if it differs) and (path, value) for each of its leaves, from one graph walk."""
    graphdef, flat = graphlib.flatten(obj, with_paths=True)
    return graphdef, _named(flat)


def named_leaves(obj: Any) -> list[tuple[str, Any]]:
    """(path, value) for every leaf of an NNX object (to name a deleted array)."""
    return _named(graphlib.flatten(obj, with_paths=True)[1])


def _named(flat: Any) -> list[tuple[str, Any]]:
    return [
        ("." + ".".join(map(str, p)), v.get_raw_value() if isinstance(v, Variable) else v)
        for p, v in zip(flat.paths, flat.leaves)
    ]


def leaf_names(spec: Any, name: str) -> list[str] | None:
    """One name per leaf an argument of this spec passes, as jax.jit names a module's
    leaves (`model.linear.kernel.value`, `model.layers[0].bias.value`), for jax's errors
    (`_debug_names`); None where they cannot be told (an object read jointly with
    another argument passes only some of its leaves)."""
    if isinstance(spec, NodeSpec):
        return None if spec.joint else _node_leaf_names(spec, name)
    names: list[str] = []
    tree_names = _debug_names.tree_leaf_names(
        spec.treedef, [code != _STATIC for code in spec.layout], spec.statics, name
    )
    if tree_names is None:
        return None
    for code, where in zip((c for c in spec.layout if c != _STATIC), tree_names):
        if code == _DYNAMIC:
            names.append(where)
        else:
            inner = None if code.joint else _node_leaf_names(code, where)
            if inner is None:
                return None
            names.extend(inner)
    return names


def _node_leaf_names(spec: NodeSpec, name: str) -> list[str] | None:
    """The paths of an NNX object's leaves, from its graphdef: the object rebuilt around
    stand-in values and flattened again (the order in which it passes its leaves)."""
    stand_ins = [_debug_names.Leaf() for _ in range(spec.n_dyn)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a Variable type may warn about its value)
        try:
            node = graphlib.unflatten(spec.graphdef, stand_ins, index_ref=graphlib.IndexMap())
            flat = graphlib.flatten(node, with_paths=True)[1]
        except Exception:
            return None
    if len(flat.leaves) != spec.n_dyn:
        return None
    out = []
    for path, leaf in zip(flat.paths, flat.leaves):
        steps = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        out.append(name + steps + (".value" if isinstance(leaf, Variable) else ""))
    return out

"""Code generated per known structure: leaf extractors and output builders.

* `Template`: for a new object of a structure seen before, Python code
  generated for that structure reads the leaves straight from each node's
  `__dict__` and compares static fields by identity, several times faster
  than `jax.tree_util.tree_flatten` on Equinox modules (whose flatten runs
  Python per node). Anything unexpected makes the template decline (it
  returns None), and the generic path (`_flatten.flatten_generic`) takes over.
* `make_builder`: the inverse for outputs: the plan (`_rebuild`) that rebuilds a
  known output structure from the flat list of dynamic outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable

import equinox as eqx
import jax

from . import _nnx_gate, _rebuild, _tree_reads
from ._stats import read_whole
from ._plan import SequenceRead, TreeRead
from ._flatten import (
    ARRAY_TYPES, JIT_RULE_LEAVES, PLAIN_ARRAY_TYPES, STATE_TYPE, ArrayImpl, Spec, is_traced_leaf, plain_leaf_types,
    static_equal,
)


class _NoTemplate(Exception):
    pass


class _NotForThisExample(_NoTemplate):
    """No template from this object, though another of its structure may give one: a leaf
    of it is not an array (a `TrainState.create`d state's Python int `step`, which the first
    step makes an array)."""


# The leaf types of fastcall.jit's scalar rule outside Equinox modules: arrays and Python scalars.
TRACED_TYPES = plain_leaf_types(True)


_MAX_TEMPLATE_NODES = 4096


class _CodeGen:
    """Emits straight-line Python that walks one known structure.

    The generated `_inner(obj)` returns the tuple of dynamic leaves, or None as
    soon as anything differs from the structure it was generated for: a node
    of another type, a container of another length, an Equinox module with
    other attributes, a static value that is not the same (by identity, then
    by exact equality), or a leaf that is not a concrete array (`PLAIN_ARRAY_TYPES`:
    a jax array, a NumPy array or scalar, a typed PRNG key; which of them, at each leaf, may
    change from object to object, as jax.jit's own call takes any of them).

    A Python scalar outside an Equinox module is read by the scalar rule the template is
    made under (`trace_scalars`, as `_flatten.flatten_generic` reads it): a leaf (a Python
    scalar or an array, at each call) under `fastcall.jit`'s, a static value under
    `fastcall.filter_jit`'s. `rule_bound` says whether the template met one.
    """

    def __init__(self, trace_scalars: bool) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {}
        self.counter = itertools.count()
        self.nodes = 0
        self.arrays: list[str] = []
        self.outside: list[str] = []  # (the leaves outside any Equinox module: `arrays` too)
        self.trace_scalars = trace_scalars
        self.rule_bound = False
        self.in_module = 0  # (inside an Equinox module, a Python scalar is static by either rule)

    def const(self, value: Any) -> str:
        name = f"_c{next(self.counter)}"
        self.consts[name] = value
        return name

    def var(self) -> str:
        return f"_v{next(self.counter)}"

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def bind(self, expr: str) -> str:
        if expr.isidentifier():
            return expr
        v = self.var()
        self.emit(f"{v} = {expr}")
        return v

    def walk(self, expr: str, value: Any) -> None:
        self.nodes += 1
        if self.nodes > _MAX_TEMPLATE_NODES:
            raise _NoTemplate
        t = type(value)
        if t in PLAIN_ARRAY_TYPES:
            v = self.var()
            self.emit(f"{v} = {expr}")
            self.arrays.append(v)
            if not self.in_module:
                self.outside.append(v)
            return
        if value is None:
            self.emit(f"if {expr} is not None: return None")
            return
        if t in JIT_RULE_LEAVES and not self.in_module:
            self.rule_bound = True
            if self.trace_scalars:
                v = self.var()
                self.emit(f"{v} = {expr}")
                self.arrays.append(v)
                self.outside.append(v)
                return
        if t is tuple or t is list:
            v = self.bind(expr)
            self.emit(f"if type({v}) is not {self.const(t)} or len({v}) != {len(value)}: return None")
            for i, item in enumerate(value):
                self.walk(f"{v}[{i}]", item)
            return
        if t is dict:
            try:
                keys = sorted(value)
            except TypeError:
                raise _NoTemplate from None
            v = self.bind(expr)
            self.emit(f"if type({v}) is not dict or len({v}) != {len(value)}: return None")
            for k in keys:
                self.walk(f"{v}[{self.const(k)}]", value[k])
            return
        if isinstance(value, eqx.Module):
            self.walk_module(expr, value)
            return
        if t is STATE_TYPE:  # eqx.nn.State: its children are its `_state` dict's values
            self.walk_state(expr, value)
            return
        if "_flax_dataclass" in t.__dict__:  # a flax.struct.dataclass (`TrainState`): see _flax_struct_fields
            self.walk_flax_struct(expr, value)
            return
        if issubclass(t, tuple) and hasattr(t, "_fields"):
            v = self.bind(expr)
            self.emit(f"if type({v}) is not {self.const(t)}: return None")
            for i, item in enumerate(value):
                self.walk(f"{v}[{i}]", item)
            return
        # A leaf, unless some other pytree node type: those are not specialised.
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            if isinstance(value, ARRAY_TYPES):
                raise _NoTemplate  # tracers, array subclasses: generic path
            self.statics([(expr, value)])
            return
        raise _NoTemplate

    def walk_module(self, expr: str, value: Any) -> None:
        """An Equinox module: its type and field count checked, its static fields compared,
        each other field walked."""
        t = type(value)
        fields = dataclasses.fields(value)
        d = value.__dict__
        if len(d) != len(fields) or any(f.name not in d for f in fields):
            raise _NoTemplate  # wrapper modules carry extra attributes
        node = self.bind(expr)
        v = self.var()
        self.emit(f"if type({node}) is not {self.const(t)}: return None")
        # object.__getattribute__ skips eqx.Module.__getattribute__ (~1 us each).
        self.emit(f"{v} = _getattr({node}, '__dict__')")
        self.emit(f"if len({v}) != {len(fields)}: return None")
        statics = []
        self.in_module += 1
        for f in fields:
            if f.metadata.get("static", False):
                statics.append((f"{v}[{f.name!r}]", d[f.name]))
            else:
                self.walk(f"{v}[{f.name!r}]", d[f.name])
        self.in_module -= 1
        self.statics(statics)

    def walk_state(self, expr: str, value: Any) -> None:
        """An eqx.nn.State: its type and keys checked, each item walked."""
        t = type(value)
        d = value.__dict__.get("_state")
        if type(d) is not dict or len(value.__dict__) != 1:
            raise _NoTemplate  # (an invalidated State holds a sentinel: tree_flatten raises)
        node = self.bind(expr)
        v = self.var()
        self.emit(f"if type({node}) is not {self.const(t)}: return None")
        self.emit(f"{v} = _getattr({node}, '__dict__')['_state']")
        # The keys, in order, are the node's auxiliary data (compared as jax compares it).
        self.emit(f"if type({v}) is not dict or tuple({v}) != {self.const(tuple(d))}: return None")
        for k, item in d.items():
            self.walk(f"{v}[{self.const(k)}]", item)

    def walk_flax_struct(self, expr: str, value: Any) -> None:
        """A flax.struct.dataclass: its type and fields checked, its metadata fields compared,
        each data field walked."""
        t = type(value)
        data, meta = _flax_struct_fields(t)
        own = getattr(value, "__dict__", None)
        if type(own) is not dict or len(own) != len(data) + len(meta) or any(n not in own for n in data + meta):
            raise _NoTemplate
        node = self.bind(expr)
        v = self.var()
        self.emit(f"if type({node}) is not {self.const(t)}: return None")
        self.emit(f"{v} = _getattr({node}, '__dict__')")
        self.emit(f"if len({v}) != {len(own)}: return None")
        for name in data:
            self.walk(f"{v}[{name!r}]", own[name])
        self.statics([(f"{v}[{name!r}]", own[name]) for name in meta])

    def statics(self, pairs: list[tuple[str, Any]]) -> None:
        """One line checks every static value of a node by identity; only if that
        fails are they compared by exact equality."""
        if not pairs:
            return
        names = [self.bind(expr) for expr, _ in pairs]
        consts = [self.const(value) for _, value in pairs]
        fast = " and ".join(f"{n} is {c}" for n, c in zip(names, consts))
        slow = " and ".join(f"_static_equal({n}, {c})" for n, c in zip(names, consts))
        self.emit(f"if not ({fast}) and not ({slow}): return None")

    @property
    def traces_scalars(self) -> bool:
        """Whether, outside Equinox modules, a Python scalar and an array are the same leaf
        (fastcall.jit's rule reads both as one; a template that met no Python scalar is also
        used by fastcall.filter_jit's, for which they are not)."""
        return self.trace_scalars and self.rule_bound

    def finish(self) -> str:
        if self.arrays:
            # (a jax array, the common leaf, costs one identity test)
            traced = set(self.outside) if self.traces_scalars else set()
            check = " or ".join(
                f"(type({a}) is not _ArrayImpl and type({a}) not in {'_TRACED' if a in traced else '_PLAIN'})"
                for a in self.arrays
            )
            self.emit(f"if {check}: return None")
        self.emit(f"return ({', '.join(self.arrays)}{',' if self.arrays else ''})")
        return "\n".join(self.lines)


def _flax_struct_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A flax.struct.dataclass's data fields (its children, in this order) and meta fields
    (its node data, compared), as `flax.struct.dataclass` registers them with
    `jax.tree_util.register_dataclass`: a field is data unless its metadata says
    `pytree_node=False`. (The template is proven against `tree_flatten` when made.)"""
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    meta = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))
    return data, meta


_MAX_SEQUENCE_DEPTH = 16  # (`_tree_reads` recurses once per level)


def sequence_read(value: Any, leaf_types: frozenset[type], depth: int = 0) -> SequenceRead | None:
    """How `_tree_reads.sequence_leaves` reads `value`, a tuple, list or dict (exactly) whose items are leaves
    (of `leaf_types`) or, nested, such containers themselves; None if it is not one."""
    kind = type(value)
    if kind not in (tuple, list, dict) or depth > _MAX_SEQUENCE_DEPTH:
        return None
    keys = None
    if kind is dict:
        try:
            keys = tuple(sorted(value))
        except TypeError:
            return None
    items = [value[k] for k in keys] if keys is not None else value
    reads: list[SequenceRead | None] = []
    n_leaves = 0
    for item in items:
        if type(item) in leaf_types:
            reads.append(None)
            n_leaves += 1
            continue
        inner = sequence_read(item, leaf_types, depth + 1)
        if inner is None:
            return None
        reads.append(inner)
        n_leaves += inner.n_leaves
    nested = tuple(reads) if any(r is not None for r in reads) else None
    return SequenceRead(kind, len(value), leaf_types, keys, nested, n_leaves)


class Template:
    """Generated extractor for one structure: `extract(obj) -> leaves tuple | None`.

    Returns the dynamic leaves of `obj` (in `tree_flatten` order) if `obj` has
    exactly the structure and static values of `spec`, else None. `rule`: None if the
    structure holds no Python scalar outside an Equinox module (the two scalar rules read
    it alike), else the rule it reads them by (`trace_scalars`): then only functions of
    that rule may use it (`serves`), and what it reads is not cached by identity, as
    the identity cache is shared by functions of both rules.
    """

    __slots__ = ("spec", "extract", "source", "sequence", "rule")

    def __init__(self, spec: Spec, example: Any, dynamic: list[Any], trace_scalars: bool):
        if spec.has_nnx:  # (NNX objects as pytrees: read by a FlattenTemplate, for those functions only)
            raise _NoTemplate
        gen = _CodeGen(trace_scalars)
        gen.walk("obj", example)
        body = gen.finish()
        self.source = (
            "def _extract(obj):\n"
            "    try:\n"
            "        return _inner(obj)\n"
            "    except Exception:\n"  # (not of this structure: a dict key's __eq__ may raise too;
            "        return None\n"  # the general path reads it again, and names any error)
            "def _inner(obj):\n"
            f"{body}\n"
        )
        namespace: dict[str, Any] = dict(gen.consts)
        namespace.update(
            _ArrayImpl=ArrayImpl, _PLAIN=PLAIN_ARRAY_TYPES, _TRACED=TRACED_TYPES,
            _static_equal=static_equal, _getattr=object.__getattribute__,
        )
        exec(compile(self.source, f"<fastcall template {spec.id}>", "exec"), namespace)
        self.spec = spec
        self.rule = trace_scalars if gen.rule_bound else None
        # Tuples, lists and dicts of leaves only, nested or not: read by `_tree_reads` (compiled),
        # which tests just each one's type, its length (and a dict's keys) and each leaf's type,
        # as `_inner` does; the structure route calls it too.
        self.sequence = sequence_read(example, TRACED_TYPES if gen.traces_scalars else PLAIN_ARRAY_TYPES)
        self.extract: Callable[[Any], tuple[Any, ...] | None] = (
            namespace["_extract"]
            if self.sequence is None
            else functools.partial(_tree_reads.sequence_leaves, self.sequence)
        )
        # Prove the template agrees with tree_flatten on the object it came from.
        check = self.extract(example)
        if check is None or len(check) != len(dynamic) or any(a is not b for a, b in zip(check, dynamic)):
            raise _NoTemplate

    def serves(self, trace_scalars: bool, nnx_as_pytree: bool = False) -> bool:
        """Whether a function of this scalar rule may read its arguments with this template."""
        return self.rule is None or self.rule == trace_scalars


class _PlanWalk:
    """Walks one known output structure (the inverse of a Template, used instead of
    `treedef.unflatten`, whose Equinox unflatten runs Python per node) into the plan that
    rebuilds it from the flat list `d` of dynamic outputs: a tree of `_rebuild` nodes.
    `trace_scalars`: the scalar rule the output was read under (`OutInfo`): under
    `fastcall.jit`'s, a Python scalar outside an Equinox module is one of the dynamic
    outputs, as an array."""

    def __init__(self, trace_scalars: bool) -> None:
        self.trace_scalars = trace_scalars
        self.in_module = 0
        self.pos = 0
        self.nodes = 0

    def node(self, value: Any) -> _rebuild.OutNode:
        self.nodes += 1
        if self.nodes > _MAX_TEMPLATE_NODES:
            raise _NoTemplate
        t = type(value)
        if is_traced_leaf(value, self.trace_scalars and not self.in_module):
            self.pos += 1
            return _rebuild.OutLeaf(self.pos - 1)
        if value is None:
            return _rebuild.OutConst(None)
        if t is tuple or t is list:
            return _rebuild.OutSequence(t, tuple(self.node(v) for v in value))
        if t is dict:
            try:
                keys = sorted(value)
            except TypeError:
                raise _NoTemplate from None
            # jax flattens dicts in sorted key order and rebuilds them that way too.
            return _rebuild.OutFields(None, tuple(keys), tuple(self.node(value[k]) for k in keys))
        if issubclass(t, tuple) and hasattr(t, "_fields"):
            return _rebuild.OutSequence(t, tuple(self.node(v) for v in value))
        if t is STATE_TYPE:  # (as its tree_unflatten builds it)
            d = value.__dict__.get("_state")
            if type(d) is not dict or len(value.__dict__) != 1:
                raise _NoTemplate
            inner = _rebuild.OutFields(None, tuple(d), tuple(self.node(v) for v in d.values()))
            return self._object(t, {"_state": inner})
        if isinstance(value, eqx.Module):
            fields = dataclasses.fields(value)
            d = value.__dict__
            if len(d) != len(fields) or any(f.name not in d for f in fields):
                raise _NoTemplate
            parts = {}
            self.in_module += 1
            for f in fields:
                v = d[f.name]
                parts[f.name] = _rebuild.OutConst(v) if f.metadata.get("static", False) else self.node(v)
            self.in_module -= 1
            return self._object(t, parts)
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
            return _rebuild.OutConst(value)  # a static output, returned as it was at trace time
        raise _NoTemplate

    def _object(self, t: type, parts: dict[str, _rebuild.OutNode]) -> _rebuild.OutNode:
        """`t` built with `parts` (field name -> its node) as its fields, as Equinox's own
        unflatten builds it (see `_rebuild.OutFields`)."""
        try:
            object.__new__(t)
        except TypeError:
            # (a class whose C base has its own __new__, an Exception say: object.__new__
            # refuses it, and the compiled plan, which calls object's constructor directly,
            # would skip that check; jax's unflatten builds it, or raises as Equinox does)
            raise _NoTemplate from None
        for name in parts:
            attr = inspect.getattr_static(t, name, None)
            if hasattr(type(attr), "__set__") or hasattr(type(attr), "__delete__"):
                raise _NoTemplate  # (object.__setattr__ would call it: jax's unflatten decides)
        return _rebuild.OutFields(t, tuple(parts), tuple(parts.values()))


def make_builder(example: Any, trace_scalars: bool = False) -> Callable[[list[Any]], Any] | None:
    """`build(dynamic_outputs) -> output` for `example`'s structure (read under the scalar
    rule `trace_scalars`: see `_PlanWalk`): the `build` method of its plan (`plan_of`
    gives the plan back), or None where no plan is written for it."""
    try:
        return _PlanWalk(trace_scalars).node(example).build
    except (_NoTemplate, RecursionError):
        return None


def plan_of(build: Any) -> _rebuild.OutNode | None:
    """The plan of a builder `make_builder` made (for `_rebuild.finish_output`)."""
    plan = getattr(build, "__self__", None)
    return plan if isinstance(plan, _rebuild.OutNode) else None


# root type -> templates, most recent first (a few structures per type: the general path
# tries each in turn; a function's structure records keep those they read by).
templates: dict[type, list[Template | FlattenTemplate]] = {}
_TEMPLATES_PER_TYPE = 8


class FlattenTemplate:
    """The extractor of a structure no Template is generated for (a pytree node type of its
    own: `jax.tree_util.register_dataclass`, `register_pytree_node_class`; an Equinox module
    carrying extra attributes), whose every leaf is an array: it reads an object as jax.jit
    does, by `tree_flatten` (jax's C++), compares the treedef with the spec's (node types and
    node data, as jax compares them), and checks each leaf's exact type. The same interface
    as a Template; it reads both scalar rules alike (no Python scalar among the leaves)."""

    __slots__ = ("spec", "extract", "sequence", "rule")

    def __init__(self, spec: Spec, example: Any, dynamic: list[Any]):
        # (a structure holding NNX objects is made one only for a function that reads them
        # as pytrees, `nnx_as_pytree`; only such functions use it: `serves`)
        if not all(spec.mask):
            raise _NoTemplate
        if not all(type(x) in PLAIN_ARRAY_TYPES for x in dynamic):
            raise _NotForThisExample
        # The read (`_tree_reads.tree_leaves`, which the structure route calls too): jax's
        # registry flatten (what `tree_flatten` calls), the treedef compared.
        read = TreeRead(jax.tree_util.default_registry.flatten, spec.treedef, PLAIN_ARRAY_TYPES)
        if spec.has_nnx:  # (its nnx.States and Variables read by fastcall, as jax's flatten would)
            read = _nnx_gate.adapter().pytree_read(example, read) or read

        def extract(obj: Any) -> tuple[Any, ...] | None:
            read_whole()  # (jax's flatten of the whole argument: `JitStats.paths` counts it a read)
            return _tree_reads.tree_leaves(read, obj)

        check = extract(example)
        if check is None or len(check) != len(dynamic) or any(a is not b for a, b in zip(check, dynamic)):
            raise _NoTemplate
        self.spec = spec
        self.extract: Callable[[Any], tuple[Any, ...] | None] = extract
        self.sequence = read
        self.rule = None

    def serves(self, trace_scalars: bool, nnx_as_pytree: bool = False) -> bool:
        return nnx_as_pytree or not self.spec.has_nnx


# How many objects of a structure may be tried for a template (`learn`) where each one's
# leaves alone refused it: a structure whose leaves stay Python scalars stops being tried.
_TRIES_PER_STRUCTURE = 3
_tries: dict[int, int] = {}  # spec id -> objects refused so


def clear() -> None:
    """Forget every template, and the objects tried for one (`fastcall.clear_caches`)."""
    templates.clear()
    _tries.clear()


def learn(value: Any, spec: Spec, dynamic: list[Any], trace_scalars: bool) -> bool:
    """Build a template for `value`'s structure, as a function of this scalar rule reads it
    (`trace_scalars`), so the next new object of it is fast: generated code, or else one
    that flattens it as jax.jit does (`FlattenTemplate`). Whether the structure is done with
    (a template made, or none possible); False where this object's leaves alone refused one
    and another object of the structure may be tried, up to `_TRIES_PER_STRUCTURE`."""
    if spec.kind != "tree":
        return True
    tmpl: Template | FlattenTemplate
    try:
        try:
            tmpl = Template(spec, value, dynamic, trace_scalars)
        except (_NoTemplate, RecursionError):
            tmpl = FlattenTemplate(spec, value, dynamic)
    except _NotForThisExample:
        _tries[spec.id] = tries = _tries.get(spec.id, 0) + 1
        return tries >= _TRIES_PER_STRUCTURE
    except (_NoTemplate, RecursionError):
        return True
    except Exception:  # a template is an optimisation; never fail a call over it
        return True
    group = templates.setdefault(type(value), [])
    group.insert(0, tmpl)
    del group[_TEMPLATES_PER_TYPE:]
    return True

"""The call plan: the one record a general call leaves for the hit routes, and the reads
it is made of.

The general path resolves a call; where later calls of the same shape may skip it, it
files a `CallPlan` (`_dispatch._file_plans`, the one eligibility rule), which the hit routes
execute: the compiled ones (`_fast_route`, `_structure_route`) read it by position, the
field order checked at import (`_structure_route.LAYOUTS`); Python reads it by name.

A call `f(first, *arrays)` whose first argument is an object seen before, and
whose other arguments are plain leaves (jax arrays; NumPy arrays and scalars,
typed PRNG keys; under `fastcall.jit`'s rule Python scalars: what jax.jit takes as it is,
`FunctionState.plain_leaves`), is served without flattening,
keying or looking up anything but one dict entry: the fast index.
`INDEX[id(obj)]` is a `FastSlot` for objects whose cached leaves or Variable
list are known to be current: Equinox modules and other pytrees in the
identity cache (`_flatten`), and NNX objects whose structure has not changed
since it was read (`fastcall._nnx`); for those holding lists or dicts, as long as the
slot's guard holds (`_guard`). Each slot maps a wrapped function's state
to the `CallPlan` that serves calls of that function with this object first.
A slot is withdrawn the moment its object dies or (NNX) its structure changes.

A call the fast index does not serve may still be one the function has run
with arguments of the same structures: the structure path. The function's
`state.structures[structure_key(...)]` is a `CallPlan` (with those of a few
other structures met under the key in its `others`, tried in turn) saying how to read each
argument (positional, then keyword): a plain leaf as is; a static one (no array
leaves) by comparing it with the recorded value; any other argument from the
identity cache (`_flatten.by_id`, when the cached object is of the expected
structure), or else by its structure's generated extractor (`_codegen.Template`),
which reads a new object's leaves and checks everything else about it, or
declines; an NNX argument from its cache entry, when that is usable as it is.
This serves the model a training step returned, the `eqx.nn.State` a stateful
call returned, a new params dict each call, `step(model, optimizer, x, y)`.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, NamedTuple, Sequence

import jax

from . import _nnx_gate
from ._trace import GRAPH_CONTEXT  # (NNX's graph context, which `consume_static_cache` writes)


class FastSlot(NamedTuple):
    ref: Any  # a weakref with the object's id as `.oid`: `ref() is first` validates the slot
    records: dict[Any, CallPlan]  # wrapped function's state -> record
    guard: Any = None  # (objects holding lists or dicts) `_guard.holds(guard)` validates it too
    # (NNX objects) the object's cache entry (`_nnx._entries.NodeEntry`), current while the slot is
    # published: the structure path reads NNX arguments through it
    node: Any = None


INDEX: dict[int, FastSlot] = {}


class SequenceRead(NamedTuple):
    """A structure that is a tuple, list or dict of leaves and nothing else (a batch,
    `step(model, (x, y))`, `step(model, {"image": x, "label": y})`), or of leaves and such
    containers, nested (a params dict of dicts, `{"layer_0": {"w": w, "b": b}, ...}`): its
    items (a dict's values, in the order of its sorted keys, as jax flattens it) are its
    leaves, or hold them, depth first. Read by `_tree_reads.sequence_leaves` (compiled), the
    extractor of its template (`_codegen.Template.sequence`), which the structure route
    calls too."""

    kind: type  # tuple, list or dict, exactly
    length: int
    # each leaf's exact type is one of these (_flatten.PLAIN_ARRAY_TYPES; with the Python
    # scalars, for a template of fastcall.jit's scalar rule that met one: `Template.rule`)
    leaf_types: frozenset[type]
    keys: tuple[Any, ...] | None = None  # (a dict: its keys, sorted)
    # None: every item is a leaf. Else, per item (in the order read), None where it is a
    # leaf, or the SequenceRead of the container it is; and how many leaves all hold.
    items: tuple[SequenceRead | None, ...] | None = None
    n_leaves: int = 0


class TreeRead(NamedTuple):
    """A structure that is a pytree node type of its own (`jax.tree_util.register_dataclass`,
    a flax struct dataclass, `register_pytree_node_class`), every leaf an array: read as
    jax.jit reads it, by jax's flatten, the treedef compared (`==`: node types and node data,
    as jax compares them) and each leaf's exact type checked: `_tree_reads.tree_leaves`
    (compiled), which the structure route calls too (`_codegen.FlattenTemplate`)."""

    flatten: Callable[[Any], Any]  # jax's registry flatten: obj -> (leaves list, treedef)
    treedef: Any
    leaf_types: frozenset[type]  # (_flatten.PLAIN_ARRAY_TYPES)
    # (a pytree holding nnx.States and Variables, read as jax.jit reads them: `nnx_as_pytree`)
    # jax's flatten stopping at each State and Variable, and per leaf of it None, or the
    # MappingRead or VariableValueRead that reads it as jax's flatten would (`MixedRead`'s)
    is_leaf: Callable[[Any], bool] | None = None
    expand: tuple[MappingRead | VariableValueRead | None, ...] | None = None


class ArgRead(NamedTuple):
    """How the structure path reads one positional argument that is not a plain array."""

    spec_id: int  # its structure: an identity-cache entry of this spec gives its leaves ...
    extract: Callable[[Any], Any] | None  # ... or else this: its leaves (a tuple), or None
    sequence: SequenceRead | TreeRead | None  # (the extractor's own test and result, when it is this simple)
    # Whether the general path caches an object of this structure by identity (then one
    # passed again is sent there: `CallPlan.last`); not one that can change in place
    # unseen, nor one read by a scalar rule's own template (`_codegen.Template.rule`).
    by_identity: bool = True


class NodeRead(NamedTuple):
    """How the structure path reads an NNX argument: from its cache entry, which must be
    usable as it is and have this spec: the entry published in the fast index
    (`FastSlot.node`, validated as a fast call validates its slot); any other call is
    declined to the general path."""

    spec_id: int


class JointRead(NamedTuple):
    """How the structure path reads an NNX argument that shares nodes or Variables with
    another argument of the call (`train_step(model, optimizer, ...)` where the optimizer
    holds the model): as NodeRead, but from this very cache entry only, whose nodes and
    Variables are still those it had (`node_ids`, the entry's own set, compared by
    identity), and passing only the leaves at `keep` (None: all). The general path's joint
    flatten passes each shared Variable once, with the argument that reaches it first;
    with every NNX argument's entry pinned, what is shared, and so what each passes,
    cannot have changed. A record holding a JointRead reads every NNX object of the call
    so."""

    spec_id: int  # the entry's own spec (the entry's variant: a flipped static changes it)
    entry: Any  # a weak reference to the entry
    node_ids: frozenset[int]  # the entry's `node_ids` when recorded (replaced on any change)
    keep: tuple[int, ...] | None  # positions in the entry's `items` this argument passes


class SharedVariableRead(NamedTuple):
    """How the structure path reads a Variable passed on its own that another NNX argument
    of the call holds (`f(model, model.kernel, x)`, `f(model.kernel, model, x)`), all of
    them read jointly: the very Variable at `position` among the leaves of the argument at
    position `owner`, read by a JointRead (which pins that argument's cache entry). As in
    the joint flatten, the one of the two met first passes the Variable's value: the holder
    (`first` False: the Variable is a reference to one seen before and passes nothing), or
    the Variable (`first` True: it passes its value, and the holder's JointRead leaves that
    leaf out). (C: `read_shared_variable`.)"""

    spec_id: int
    owner: int  # the position, among the record's reads, of the JointRead of its holder
    position: int  # its position in that entry's `items`
    first: bool  # met before its holder: it passes the value


class VariableRead(NamedTuple):
    """How the structure path reads a Variable passed on its own (`f(model.kernel, x)`,
    `f(model, offset, x)`; a Variable cannot be weakly referenced, so it has no cache
    entry): of this type, with metadata equal to this copy (which, with the type, makes
    its spec: `_nnx._reads._read_variable`), and a jax array as value; beside other NNX objects,
    only while it shares nothing with them (`_nnx._reads.overlapping`; C: `variables_apart`)."""

    spec_id: int
    kind: type
    metadata: dict[str, Any]  # a copy, of hashable values
    # the `_var_metadata` slot descriptor `kind` has (Variable's own, found at record time):
    # what getattr reads, read without the class lookup
    metadata_slot: Any


class GraphdefRead(NamedTuple):
    """How the structure path reads an NNX GraphDef argument (the functional API): one
    known under this spec (`GRAPHDEFS`), unchanged."""

    spec_id: int


class NodesRead(NamedTuple):
    """How the structure path reads a container of NNX objects (`f((model, optimizer),
    batch)`, `f({"encoder": e, "decoder": d}, x)`, a dataclass of them): of this type, and of
    this length (a tuple or list), these keys (a dict) or this shape (any other pytree: a
    PytreeShape), each object read as NodeRead reads it, with the spec given here (or, in a
    call whose NNX objects share nodes or Variables, as its JointRead reads it); the
    container then has spec `spec_id`."""

    spec_id: int
    kind: type
    elements: tuple[int | JointRead, ...]  # per object, its spec (or its JointRead)
    # None: a tuple or list, its items the objects. A tuple: a dict's keys, in the order the
    # general path read them. Else a PytreeShape (a nested tuple, a namedtuple, a
    # dataclass, ...: flattened on every call).
    keys: Any = None

    def objects(self, a: Any) -> Sequence[Any] | None:
        """The NNX objects of `a` to read, in order, if it is of this kind and size (a dict:
        with these keys; another pytree: of this PytreeShape); else None. (The C structure
        path's copy does the same, and calls this for a pytree more than one level deep.)"""
        given: Any = a  # (mypy narrows `a` by the type check below)
        if type(a) is not self.kind:
            return None
        keys = self.keys
        if keys is None or type(keys) is tuple:
            if len(given) != len(self.elements):
                return None
            if keys is None:
                return given  # type: ignore[no-any-return]
            try:
                return [given[k] for k in keys]
            except Exception:  # (a key missing, or a key's __eq__ raised: the general path reads it)
                return None
        return keys.objects(a, len(self.elements))


class PytreeShape:
    """How `NodesRead` finds the NNX objects of a pytree that is not a tuple, list or dict
    (a dataclass, a namedtuple, a nested tuple, ...): its treedef with the objects as
    leaves, compared (`==`: static data too, as the compile key compares it) with the
    treedef of the argument flattened down to its NNX objects. Where the objects are the
    pytree's own children (one level: a dataclass or namedtuple of modules), jax's
    one-level flatten says the same at a tenth of the cost: the type (checked by
    NodesRead), the node data (`==`), and as many children, each an NNX object. (The C
    structure path reads `level` itself, and leaves the NNX check to its reading of each
    object, which only an NNX object's cache entry passes.)"""

    __slots__ = ("treedef", "level")

    def __init__(self, a: Any, objs: Sequence[Any], treedef: Any) -> None:
        self.treedef = treedef
        # (jax's one-level flatten: a -> (children, node data) or None, the node data) where
        # one level deep; else None
        self.level: tuple[Callable[[Any], Any], Any] | None = None
        flatten = jax.tree_util.default_registry.flatten_one_level
        try:
            children, data = flatten(a)
        except Exception:
            return
        if len(children) == len(objs) and all(c is o for c, o in zip(children, objs)):
            self.level = (flatten, data)

    def objects(self, a: Any, count: int) -> Sequence[Any] | None:
        """`a`'s NNX objects in order, if `a` has this shape and `count` of them; else None."""
        try:
            if self.level is not None:
                flatten, data = self.level
                children, now = flatten(a)
                same = now == data and len(children) == count and all(map(_nnx_gate.is_node, children))
                return children if same else None
            objs, treedef = jax.tree_util.tree_flatten(a, is_leaf=_nnx_gate.is_node)
            same = treedef == self.treedef
        except Exception:
            return None
        return objs if same and len(objs) == count else None


class MixedRead(NamedTuple):
    """How the structure path reads a pytree holding NNX objects beside other leaves (flax's
    `TrainState` keeping `nnx.split`'s States with its step count and optimizer state; what
    the general path reads as an `_nnx._specs.TreeSpec`): jax's flatten down to its NNX objects
    (`tree_flatten` with each NNX object a leaf, as the general path flattens it), the
    treedef compared (`==`: node types and node data) with this one, then each leaf as
    `layout` says: None, an array or a Python scalar the function passes as it is (its
    `plain_leaves`); a StaticRead, a static value compared; a VariableRead, a Variable read
    as one passed on its own is; an int, an NNX object read from its cache entry, of that
    spec (as NodeRead). Where `expand` is given, jax's flatten stops at each `nnx.State` too
    (`is_leaf`), which `expand` reads by its mapping (`_tree_reads.expand_into`), to the same
    leaves without flax's Python flatten of each State. (`_structure_route._read_mixed`.)"""

    spec_id: int
    flatten: Callable[[Any, Any], Any]  # jax's registry flatten: (obj, is_leaf) -> (leaves list, treedef)
    is_leaf: Callable[[Any], bool]  # whether a node is an NNX object (or, with `expand`, an nnx.State)
    treedef: Any
    layout: tuple[None | StaticRead | VariableRead | int, ...]
    # per leaf of the flatten: None, or the MappingRead of the nnx.State it is
    expand: tuple[MappingRead | None, ...] | None = None


class MappingRead(NamedTuple):
    """How `_tree_reads.expand_into` reads a mapping node of a pytree as jax's flatten does,
    with no Python frame: a dict (jax's own node), or a node type that keeps its items in a
    dict attribute and flattens them as a dict (`nnx.State`, whose flatten sorts the
    `_mapping`'s items by key: what `_nnx._reads.mixed_read` checks before making one). Its
    items are the values at `keys` (sorted: jax's and flax's order) of a mapping of exactly
    these keys, each a leaf where `items` says None, else read by the MappingRead there."""

    kind: type  # dict, or the node type, exactly
    attr: str | None  # (the attribute holding its dict; None: a dict itself)
    keys: tuple[Any, ...]
    items: tuple[MappingRead | VariableValueRead | None, ...]


class VariableValueRead(NamedTuple):
    """How `_tree_reads.expand_into` reads an NNX Variable as jax's flatten does (flax's
    Variable flatten: its `_raw_value` the one leaf, its metadata the node data): a Variable
    of exactly `kind` whose metadata equals `metadata` gives its `_raw_value`. (Made where
    `_nnx._reads` has checked that jax flattens `kind` so.)"""

    kind: type
    metadata: dict[str, Any]


class StaticRead(NamedTuple):
    """How the structure path reads an argument with no dynamic leaves (a static scalar under
    `fastcall.filter_jit`'s rule, None, a string, an optax transformation, an argument named
    by static_argnums): this very object, or one with the same `_flatten.leaf_key` where
    `by_value` (an exact int, float, complex or str, whose spec that key makes). Made only
    for a `value` no call can change (`static_read`): its spec is then the one the general
    path would find again."""

    spec_id: int
    value: Any  # (held: an object compared by identity cannot die and give its id away)
    by_value: bool


# Leaves whose identity fixes their spec: nothing can change them in place, and a static
# leaf's spec (`_flatten.leaf_key`) compares them by value or, for functions and types, by
# identity. (A function's code or closure can be replaced in place; its key is its
# identity all the same, for the general path as for this one.)
_IDENTITY_LEAVES = frozenset({
    type(None), bool, int, float, complex, str, bytes, type, type(Ellipsis), types.FunctionType,
    types.BuiltinFunctionType,
})
_BY_VALUE = frozenset({int, float, complex, str})


def static_read(spec_id: int, value: Any) -> StaticRead | None:
    """A StaticRead for `value`, an argument of spec `spec_id` with no dynamic leaves, if its
    identity (or, for a scalar, its value) fixes that spec; else None (the general path
    reads it every call)."""
    if not _fixed_by_identity(value, 0):
        return None
    return StaticRead(spec_id, value, type(value) in _BY_VALUE)


def _fixed_by_identity(value: Any, depth: int) -> bool:
    """Whether `value` cannot change in place: an immutable leaf, or a tuple or namedtuple
    (which jax flattens to its items) of such, a few levels deep."""
    t = type(value)
    if t in _IDENTITY_LEAVES:
        return True
    if depth > 4 or not isinstance(value, tuple) or len(value) > 16:
        return False
    if t is not tuple:
        if not hasattr(t, "_fields") or t.__eq__ is not tuple.__eq__ or t.__hash__ is not tuple.__hash__:
            # (another tuple subclass: a leaf, keyed by its own __eq__; or a namedtuple whose
            # `==` may read more than its items, as a static_argnums key would)
            return False
        try:  # a namedtuple, unless registered as some other pytree node
            children, _ = jax.tree_util.default_registry.flatten_one_level(value)
        except Exception:
            return False
        if len(children) != len(value) or any(c is not v for c, v in zip(children, value)):
            return False
    return all(_fixed_by_identity(v, depth + 1) for v in value)


class CallPlan(NamedTuple):
    """How a hit serves a call the general path resolved: the one record the general path
    leaves for later calls of the same shape (`_dispatch._file_plans` decides when), which
    the hit routes execute, changing nothing in it but its marks (`last`); a plan that packs
    leaves files a packed copy in its own place at its first use (`_pack`). Its reads say
    how each argument's leaves are found and checked; the compiled entry runs on them;
    `post` finishes the output.

    Filed in one of two places, by what keys it:
    - the fast index (`INDEX[id(first)].records[state]`): a call `f(first, *plain leaves)`.
      `reads` is None: `first` is the slot's own object (its leaves bound into `call`, or
      its Variables' current values, `variables`, passed first), and every other argument
      must be a plain leaf (`_fast_route`);
    - the function's table (`state.structures[structure_key(...)]`): a call whose arguments
      have this call's structures. `reads` holds one read per argument (`_structure_route`).
    (The code calls the first a fast record, the second a structure record.)
    """

    arity: int  # the number of positional arguments the call must have
    call: Callable[..., Any]  # the compiled entry (in the fast index: first's leaves bound, for pytrees)
    # post(out, first, NNX state): None: out is the result (see `_dispatch._writing_back`).
    # The NNX state is `variables` in the fast index, the call's NnxArgs (or None) in the table.
    post: Callable[[Any, Any, Any], Any] | None
    # (fast index) NNX: the Variables and RawLeafs whose current values are passed first
    variables: Sequence[Any] | None = None
    # (table) per argument, in the order the general path resolves them (`order`); None: a
    # plain leaf (FunctionState.plain_leaves)
    reads: tuple[
        ArgRead | NodeRead | JointRead | SharedVariableRead | NodesRead | MixedRead | VariableRead | GraphdefRead
        | StaticRead | None,
        ...,
    ] | None = None
    # (table) Per positional argument, a mark of the object last read there (`last_mark`). An
    # object extracted again is left to the general path, which caches it by identity
    # (then it is read from the identity cache). With `fast_shape` (every other argument
    # a plain leaf), the first argument passed again is too, before its cache is read: the
    # general path gives it a plan in the fast index. (A list or dict is marked where
    # `hold_first`.)
    last: list[Any] | None = None
    fast_shape: bool = False
    # (table) The keyword arguments' names, in the order the call gives them (a call with
    # others, or in another order, is not served); and where each read's argument is in the
    # call's positional then keyword arguments (`keyword_order`), or None: in that order.
    kwnames: tuple[str, ...] = ()
    order: tuple[int, ...] | None = None
    # (table) Whether a list or dict passed first is marked (by id: `last_mark`), so that
    # passed again it goes to the general path, which holds it (`_hold.hold`, where
    # `_hold.holdable`): for the fast index with `fast_shape`, for this plan's identity
    # cache read without.
    hold_first: bool = False
    # (table) Plans of other structures met under the same key (`structure_key`), most
    # recent first, each with no `others` of its own: tried in turn when this one's reads
    # decline, so a function called with a few structures in turn (dicts of other keys,
    # say) keeps serving each from the structure path (`plans_of`; at most
    # `PLANS_PER_KEY` in all).
    others: tuple[CallPlan, ...] = ()


# Plans kept per key in a function's table: a function called with more structures than this
# in turn renews one on the general path (a call that costs what the peer's does) where it
# meets one not kept. Each plan tried before the one that serves costs a read that declines.
PLANS_PER_KEY = 4


def plans_of(record: CallPlan | None, hot: int = 0) -> tuple[CallPlan, ...]:
    """The records the structure path tries for a call, in order: `record` (the one under
    the call's key), then its `others`; the one whose id() is `hot` (the one that served the
    function's last such call) first, where it is one of them: a loop over one structure,
    after calls of others, is served without reading the newer records' first. (C: the same.
    An id is only compared with these records', never followed: a dead record's id reused by
    one of them only puts that one first, and every record still checks every argument.)"""
    if record is None:
        return ()
    if not record.others:
        return (record,)
    records = (record, *record.others)
    first = [r for r in records if id(r) == hot]
    return (*first, *(r for r in records if id(r) != hot)) if first else records


def structure_key(first: Any, kwnames: tuple[str, ...]) -> Any:
    """The key of a call's CallPlan in `state.structures`: its first argument's type,
    and for a call with keyword arguments their names, in call order (a function called both
    with and without them keeps a record for each). (C: the same.)"""
    return (type(first), kwnames) if kwnames else type(first)


class NnxArg(NamedTuple):
    """An NNX object of one call (an argument, or an object inside a container
    argument), for writing state back after it. (Made by the NNX adapter, and by the
    structure path in C for the NNX objects it reads.)"""

    obj: Any  # the caller's object
    variables: list[Any]  # its leaves in flatten order: Variables and raw-leaf handles
    entry: Any  # its cache entry, `_nnx._entries.NodeEntry` (None: flattened afresh for this call)
    ids: frozenset[int] = frozenset()  # (flattened afresh) ids of its nodes and Variables
    paths: Any = None  # the leaves' paths (None: the entry's)
    # the RefMap of the flatten that read it for this call (None: read from its entry);
    # held for this call only: it holds the object itself
    index: Any = None


class KnownGraphdef(NamedTuple):
    """A GraphDef passed as an argument (the functional API), as `_nnx._specs.read_graphdef` keyed it."""

    graphdef: Any  # held: its id cannot be reused while it is here
    snapshot: Any  # a copy of it as keyed, compared (==) on every use (None: it cannot change in place)
    spec_id: int
    spec: Any  # held: keeps the interned spec (and so its id) alive


# GraphDefs passed as arguments, by id (filled by the NNX adapter, at most 64).
GRAPHDEFS: dict[int, KnownGraphdef] = {}


def known_graphdef(graphdef: Any) -> int | None:
    """The spec id `_nnx._specs.read_graphdef` gave this very GraphDef, if it is unchanged since;
    else None. (The C structure path's copy reads GRAPHDEFS the same way.)"""
    known = GRAPHDEFS.get(id(graphdef))
    if known is not None and known.graphdef is graphdef:
        if known.snapshot is None or graphdef == known.snapshot:
            return known.spec_id
    return None


class RawLeaf(NamedTuple):
    """A leaf of an NNX graph held directly as an attribute of a graph node (a raw array
    attribute, `self.pos = nnx.data(jnp.arange(n))`; an item of an nnx.List), read at
    call time as NNX reads it (`_entry_reads.raw_leaf_value`; `owner` is a weak proxy: a cache entry holding
    it keeps nothing alive). Rebinding it goes through the node's hooked `__setattr__`,
    so the cached structure stays trustworthy."""

    owner: Any
    name: str


# NNX records pass their leaves' current values: each Variable's read through its
# `_raw_value` slot, each RawLeaf's by `_entry_reads.raw_leaf_value`. The slot descriptor is put in this
# one-element cell by the NNX adapter when it loads (C wrappers built before that read
# it from here); NNX records exist only after it loaded and verified the slot.
VALUE_SLOT: list[Any] = [None]

def consume_static_cache() -> None:
    """Consume nnx.cached_partial's pending static cache, as the NNX transform it hands it
    to would (fastcall's own cache supersedes it). The general path does, on every call."""
    context = GRAPH_CONTEXT[0]
    if context is None:  # (the NNX adapter is not loaded: a call without NNX objects)
        graphlib = sys.modules.get("flax.nnx.graphlib")
        if graphlib is None:
            return  # (no flax.nnx, no nnx.cached_partial)
        context = GRAPH_CONTEXT[0] = graphlib.GRAPH_CONTEXT
    if context.tmp_static_cache is not None:
        context.tmp_static_cache = None



def publish(ref: Any, records: dict[Any, CallPlan], guard: Any = None, node: Any = None) -> None:
    """Make `records` servable for the object `ref` refers to (`ref.oid` is its id), while
    `guard` (if any) holds; `node`: an NNX object's cache entry."""
    INDEX[ref.oid] = FastSlot(ref, records, guard, node)


def withdraw(ref: Any, _index: dict[int, FastSlot] = INDEX) -> None:
    """Stop serving the object `ref` refers to (only if this slot is still `ref`'s).
    (`_index` is bound early: weakref callbacks may run at interpreter exit, when
    module globals are already gone.)"""
    slot = _index.get(ref.oid)
    if slot is not None and slot.ref is ref:
        _index.pop(ref.oid, None)


def forget_function(state: Any) -> None:
    """Drop every record of one wrapped function (its compiled entries were replaced)."""
    state.structures.clear()
    for slot in list(INDEX.values()):
        slot.records.pop(state, None)


def clear() -> None:
    INDEX.clear()
    GRAPHDEFS.clear()

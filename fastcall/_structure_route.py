"""The structure route at call time: a call's arguments read as a `_fast.StructureRecord` says.

A structure record (left by `_dispatch._publish_structure` after a general call) says, per
argument, how to read it again without resolving it: a plain array; a static value compared
with the recorded one; the identity cache or a generated extractor; an NNX object's cache
entry, read by the NNX plugin; a known GraphDef. `read_arguments` reads each argument so, in
the order the general path resolves them (`arguments_as_read`), or declines the call, saying
why where `f.explain` asks. The Python hit route (`_dispatch.make_wrapper`) and `f.explain`
read through it; the C extension reads the same records (its `structure_call`).
"""

from __future__ import annotations

from typing import Any

from . import _fast, _flatten, _nnx_gate
from ._tree_reads import static_matches
from ._arrays import ArrayImpl
from ._fast import (
    ArgRead, GraphdefRead, JointRead, MixedRead, NodeRead, NodesRead, SharedVariableRead, StaticRead, StructureRecord,
    VariableRead,
)
from ._trace import at_top_level


def arguments_as_read(known: StructureRecord, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A call's arguments in the order `known`'s reads take them (positional, then keyword,
    as the general path resolves them: `StructureRecord.order`); None if the call has
    another number of positional arguments or other keywords than the record's call."""
    if known.arity != len(args) or known.kwnames != (tuple(kwargs) if kwargs else ()):
        return None
    if not kwargs:
        return args
    given = (*args, *kwargs.values())
    return given if known.order is None else tuple([given[k] for k in known.order])


def read_arguments(
    known: StructureRecord,
    args: tuple[Any, ...],
    serves_nested: bool,
    plain: frozenset[type],
    why: list[tuple[int | None, str]] | None = None,
) -> tuple[list[Any], list[Any]] | None:
    """The structure path's reading of a call's arguments (`_fast.StructureRecord`;
    `args`: as `arguments_as_read` gives them): their leaves, in order, and the NnxArgs of
    its NNX arguments; None if the record does not serve this call. (`serves_nested`,
    `plain`: the function's, see FunctionState.) `why` (`f.explain` only): where it
    declines, the argument's index (None: the call as a whole) and why, in words."""
    values: list[Any] = []
    nnx_args: list[Any] = []
    joint = 0  # NNX arguments read jointly (the record pins their entries: see JointRead)
    for i, (a, read) in enumerate(zip(args, known.reads)):
        if read is None:
            t = type(a)
            if t is not ArrayImpl and t not in plain:
                return _declined(why, i, f"a {t.__name__} where the recorded call passed an array")
            values.append(a)
            continue
        if isinstance(read, StaticRead):
            if not static_matches(read, a):
                return _declined(why, i, "static, and not the value the recorded call passed")
            continue
        if isinstance(read, NodeRead):
            if not _nnx_gate.reads_as_node(a) or not _nnx_gate.adapter().read_cached(a, read.spec_id, values, nnx_args):
                return _declined(
                    why, i, "not an NNX object of the structure the recorded call read (or its cache entry changed)"
                )
            continue
        if isinstance(read, JointRead):
            if not _nnx_gate.reads_as_node(a) or not _nnx_gate.adapter().read_joint(a, read, values, nnx_args):
                return _declined(
                    why, i, "read jointly in the recorded call; not that object now, or its cache entry changed since"
                )
            joint += 1
            continue
        if isinstance(read, SharedVariableRead):
            owner = known.reads[read.owner]  # (a JointRead: its argument read before or after this one)
            if not _nnx_gate.adapter().read_shared_variable(a, read, owner, values, nnx_args):
                return _declined(
                    why,
                    i,
                    f"the recorded call passed the Variable that argument {read.owner} holds at one place; this is"
                    " another",
                )
            joint += 1
            continue
        if isinstance(read, NodesRead):
            read_jointly = _read_nodes(a, read, values, nnx_args, why, i)
            if read_jointly is None:
                return None
            joint += read_jointly
            continue
        if isinstance(read, MixedRead):
            if not read_mixed(a, read, values, nnx_args, plain):
                return _declined(
                    why, i, "not a pytree of the structure, static values and NNX objects the recorded call passed"
                )
            continue
        if isinstance(read, VariableRead):
            if not _nnx_gate.adapter().read_variable_again(a, read, values, nnx_args):
                return _declined(why, i, "not a Variable of the type and metadata the recorded call passed")
            continue
        if isinstance(read, GraphdefRead):
            if not _nnx_gate.is_graphdef(a) or _fast.known_graphdef(a) != read.spec_id:
                return _declined(why, i, "not the graphdef the recorded call passed")
            continue
        if not _read_pytree(known, i, a, read, values, why):
            return None
    if nnx_args and not _serves_nnx_call(known, nnx_args, joint, serves_nested, why):
        return None
    last = known.last
    for i, read in enumerate(known.reads):
        if type(read) is ArgRead:
            last[i] = _fast.last_mark(args[i], i == 0 and known.hold_first) if read.by_identity else None
    return values, nnx_args


def _read_pytree(
    known: StructureRecord, i: int, a: Any, read: ArgRead, values: list[Any], why: list[tuple[int | None, str]] | None
) -> bool:
    """`read_arguments`' reading of a pytree argument `a` (argument `i`): its leaves from
    the identity cache or the record's extractor, added to `values`; False where the
    record does not serve it."""
    if i == 0 and known.fast_shape and _fast.passed_again(known.last[0], a):
        _declined(why, i, "passed again: the general path gives it a fast record")
        return False
    hit = _flatten.lookup(a)
    if hit is not None and hit.spec_id == read.spec_id:
        values += hit.leaves
        return True
    if read.extract is None or _fast.passed_again(known.last[i], a):
        # (extracted again: the general path caches it by identity)
        _declined(why, i, "passed again, or of a structure read whole: the general path caches it")
        return False
    leaves = read.extract(a)
    if leaves is None:
        _declined(why, i, "not of the structure the recorded call passed")
        return False
    values += leaves
    return True


def _read_nodes(
    a: Any, read: NodesRead, values: list[Any], nnx_args: list[Any], why: list[tuple[int | None, str]] | None, i: int
) -> int | None:
    """`read_arguments`' reading of a container of NNX objects (argument `i`): how many it
    read jointly, or None where the record does not serve it."""
    objs = read.objects(a)
    if objs is None:
        return _declined(why, i, "not a container of the type, length or keys the recorded call passed")
    joint = 0
    for x, element in zip(objs, read.elements):
        if not _nnx_gate.is_node(x):
            return _declined(why, i, "holds something other than an NNX object where the recorded call's did")
        if type(element) is JointRead:
            if not _nnx_gate.adapter().read_joint(x, element, values, nnx_args):
                return _declined(why, i, "holds an object read jointly in the recorded call, changed since")
            joint += 1
        elif not _nnx_gate.adapter().read_cached(x, element, values, nnx_args):
            return _declined(why, i, "holds an NNX object not of the structure the recorded call read")
    return joint


def _serves_nnx_call(
    known: StructureRecord, nnx_args: list[Any], joint: int, serves_nested: bool, why: list[tuple[int | None, str]] | None
) -> bool:
    """Whether the record serves a call whose arguments read as `nnx_args` (`joint` of them
    read jointly): not inside a trace where the call may change state, and its NNX arguments
    sharing nothing, or read jointly as the recorded call's were."""
    if (known.post is not None or not serves_nested) and not at_top_level():
        # (as the fast path: see FunctionState.serves_nested)
        _declined(why, None, "called inside a jax transformation, which this record cannot serve")
        return False
    if joint != len(nnx_args) if joint else len(nnx_args) > 1 and _nnx_gate.adapter().overlapping(nnx_args):
        # (NNX arguments sharing Variables are read jointly, each by a JointRead, or not here)
        _declined(
            why,
            None,
            "its NNX arguments share Variables or nodes, and the recorded call's did not (or the other way round): the"
            " general path reads them jointly",
        )
        return False
    return True


def read_mixed(a: Any, read: MixedRead, values: list[Any], nnx_args: list[Any], plain: frozenset[type]) -> bool:
    """`read_arguments`' reading of a pytree holding NNX objects beside other leaves
    (`MixedRead`): its leaves appended to `values` and its NNX objects' NnxArgs to
    `nnx_args`, in the order the general path's `read_container` reads them; False if it
    does not read as recorded."""
    try:
        items, treedef = read.flatten(a, read.is_leaf)
        if treedef != read.treedef:
            return False
    except Exception:  # (a node data whose `==` raises: the general path names it)
        return False
    adapter = _nnx_gate.adapter()
    for x, code in zip(items, read.layout):
        if code is None:
            t = type(x)
            if t is not ArrayImpl and t not in plain:
                return False
            values.append(x)
        elif type(code) is VariableRead:
            if not adapter.read_variable_again(x, code, values, nnx_args):
                return False
        elif type(code) is StaticRead:
            if not static_matches(code, x):
                return False
        elif not read.is_leaf(x) or not adapter.read_cached(x, code, values, nnx_args):
            return False
    return True


def _declined(why: list[tuple[int | None, str]] | None, index: int | None, reason: str) -> Any:
    """`read_arguments` declines the call (returns None): noted in `why` for `f.explain`,
    if it asks."""
    if why is not None:
        why.append((index, reason))
    return None

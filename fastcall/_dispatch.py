"""The call path of a wrapped function: the hot path, one `run`, and the call plans it files.

Reading order: `make_wrapper` builds the closure `wrapper`, whose body is the
whole route of a call (the C wrapper, `_accel.c`, enters routes 1 and 2 itself and hands a
call both decline to `miss`, as `wrapper` does: a miss is not tried by the routes again):

1. The fast route (`_fast_route`, one source: compiled by Cython, or run as that file).
   `f(first, *arrays)` where `first` has a `CallPlan` for this function in the fast
   index (`_plan.INDEX`) and every other argument is a plain leaf (a jax array, usually;
   `FunctionState.plain_leaves`): one dict lookup, one weakref check (and, for an object
   holding lists or dicts, its guard: `_guard`), one type check per argument, then the
   jax.jit C++ fast path. Nothing is flattened or keyed. The C wrapper (`_accel.c`) enters
   it through its C function; `wrapper` calls it.
2. The structure path. Any other call whose arguments have the structures of
   a call this function ran (`_plan.CallPlan`, per type of the first
   argument, with the call's keyword names; a few per key, tried in turn:
   `_plan.plans_of`): the structure route (`_structure_route`, one source as the
   fast route) reads each one, positional then keyword as the general path resolves
   them (`arguments_as_read`), as the record says (a plain array; a static value
   compared with the recorded one; the identity cache or a generated extractor; an
   NNX object's cache entry, as the fast index publishes it: `FastSlot.node`; a known
   GraphDef) or declines, and the compiled entry runs on those leaves.
3. The general path. Every argument is resolved (`_args.resolve_call`: plain
   arrays, identity-cache hits, NNX objects, new objects), the tuple of spec
   ids selects the compiled entry, and `run` runs it.

`run` is the one place the general path calls a compiled entry through:
translate errors, rebuild the output and write NNX state back. A call whose
trace met another output structure than the entry's first (it depends on input
shapes) returns a `Varying` carrying its own; the fast and structure paths hand
such a call, already run, to the general path (`general`), which finishes it.
The wrapper, `lower(...).compile()` and `fastcall.partial` all go through it.
After a general call, `_file_plans` decides (the one eligibility rule, for
Equinox and NNX alike) whether later calls of the same shape can take the fast
path, and leaves a structure record.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import jax

from . import (
    _agreement, _args, _codegen, _fast_route, _flatten, _hold, _native, _nnx_gate, _pack, _plan,
    _structure_route,
)
from ._build import Entry
from ._plan import (
    ArgRead, CallPlan, FastSlot, GraphdefRead, JointRead, MixedRead, NodeRead, NodesRead, PytreeShape,
    SharedVariableRead, StaticRead, VariableRead,
)
from ._errors import FastcallError, for_decorator
from ._outputs import Varying, on_error
from ._stats import WHOLE_READS
from ._structure_route import StructureRoute, last_mark
from ._trace import StepAside


def configure_accel() -> None:
    """Give the C wrapper the hit routes' C entries (None where a route runs as Python: it is
    called then) and what they return for a call they decline."""
    _native.BUILT.configure(_fast_route.SERVE, _structure_route.SERVE, _fast_route.DECLINED)


if _native.BUILT is not None:
    configure_accel()


def run(state: Any, entry: Entry, resolved: Any, executable: Any = None, ran: Varying | None = None) -> Any:
    """Run one call of `entry` on the resolved arguments and return the user's output.

    `executable`: an ahead-of-time compiled program to call instead of `entry.fn`.
    `ran`: the output of this very call, already run by the fast or structure path and
    found to carry an output structure of its own (`Varying`): finished here, with the
    NNX arguments the general path resolves."""
    if ran is not None:
        return ran.finish(resolved.nnx_args)
    try:
        out = entry.fn(*resolved.leaves) if executable is None else executable(*resolved.leaves)
    except (RuntimeError, ValueError) as err:
        on_error(err, list(state.named_args(resolved.args, resolved.kwargs)), state.decorator)
    if type(out) is Varying:  # (before `passthrough`: an entry whose output structure varies)
        return out.finish(resolved.nnx_args)
    if entry.passthrough:
        return out
    return entry.finish(out, resolved.nnx_args)


MAX_STRUCTURES = 64  # structure records per function (one per first-argument type and keyword names)


def _file_plans(state: Any, fun_leaves: tuple[Any, ...], resolved: Any, entry: Entry, kwnames: tuple[str, ...]) -> None:
    """After a general call: let later calls of this shape take the fast path, if the
    call was `f(first, *plain leaves)` with `first` a cached Equinox/pytree object or an
    NNX object whose structure is cached, and the compiled entry's outputs are fixed;
    and let later calls with arguments of these structures take the structure path
    (keyword arguments and static ones too: `kwnames`, the call's keyword names in its
    order). The one eligibility rule for both (Python and C)."""
    args = resolved.args
    # Records are per state, which equal functions carrying other arrays share.
    if fun_leaves or not args or entry.varies or entry.out is None:
        return
    if kwnames or state.has_static:  # (the fast path: positional traced ones only)
        _publish_structure(state, resolved, entry, False, kwnames, False)
        return
    fast_shape = all(k == 0 for k in resolved.key[1:])  # every other argument a plain leaf
    first = args[0]
    # `f(params, ...)` with a top-level list or dict: held when passed again (`_hold.hold`),
    # for the fast path to serve `f(params, *arrays)` and the structure path to take its
    # leaves from the identity cache (a guard check, not a read) in `f(params, x, config)`.
    first_spec = _flatten.spec_by_id(resolved.key[0]) if type(first) in (list, dict) else None
    hold_first = (
        first_spec is not None and not resolved.nnx_args and _hold.may_hold(state)
        and _hold.holdable(first, first_spec, resolved.leaves[: first_spec.n_dyn])
    )
    node = resolved.nnx_args[0].entry if len(resolved.nnx_args) == 1 and resolved.nnx_args[0].obj is first else None
    if fast_shape and node is not None:
        # `f(model, *arrays)`: a fast record on the model's cache entry (a Variable, which has
        # none, is left to the structure path)
        if not node.direct or state in node.fast:
            return
        record = CallPlan(len(args), entry.fn, _fast_post(entry), variables=node.items)
        if _pack.packs(state.options):
            record = _pack.nnx_record(state, node, entry, record)
        _nnx_gate.adapter().install_record(node, state, resolved.key[0], record)
        return
    _publish_structure(state, resolved, entry, fast_shape, (), hold_first)
    if resolved.nnx_args or type(first) is list or type(first) is dict:
        if hold_first and first_spec is not None:
            held = _hold.hold(state, first, resolved.leaves[: first_spec.n_dyn], first_spec)
            if held is not None and fast_shape:
                _publish_pytree(state, first, held, entry, len(args))
        return
    if not fast_shape:
        return
    hit = _flatten.lookup(first)
    if hit is None:
        return
    if not resolved.first_known and hit.guard is None:
        # Seen for the first time: a record waits for its second use (most die first).
        # (A guarded entry is made only for an object seen before: `_flatten.seen_before`.)
        return
    if not isinstance(hit.ref, weakref.ref):
        return  # not cached by weakref (a strongly held tuple is not served fast)
    _publish_pytree(state, first, hit, entry, len(args))


def _publish_structure(
    state: Any, resolved: Any, entry: Entry, fast_shape: bool, kwnames: tuple[str, ...], hold_first: bool
) -> None:
    """Serve later calls whose arguments have this call's structures through the structure
    path: each non-array argument from the identity cache or its structure's generated
    extractor (`_codegen.templates`), or compared with this call's (no dynamic leaves:
    `_plan.static_read`); not if one has none of these. `hold_first`: the general path
    holds a list or dict passed first again (see `CallPlan.hold_first`)."""
    args, key = resolved.args, resolved.key
    if resolved.kwargs:  # (resolved in sorted order, after their names: see _args._resolve_all)
        names = sorted(resolved.kwargs)
        args = (*args, *(resolved.kwargs[n] for n in names))
        key = (*key[: len(resolved.args)], *key[len(resolved.args) + 1 :])
    if len(args) == len(kwnames):
        return  # (no positional argument to key the record on: such calls take the general path)
    order = keyword_order(state.signature, len(args) - len(kwnames), kwnames) if kwnames else None
    if kwnames and order is None:
        return
    reads = _structure_reads(state, resolved, args, key, kwnames)
    if reads is not None:
        _file_structure(state, entry, args, reads, kwnames, order, fast_shape, hold_first)


_Read = (
    ArgRead | NodeRead | JointRead | SharedVariableRead | NodesRead | MixedRead | VariableRead | GraphdefRead
    | StaticRead | None
)


def _structure_reads(
    state: Any, resolved: Any, args: tuple[Any, ...], key: tuple[int, ...], kwnames: tuple[str, ...]
) -> tuple[_Read, ...] | None:
    """How the structure path reads each of this call's arguments (`args`, of spec ids
    `key`), or None where one cannot be read but by the general path."""
    reads: list[_Read] = []
    nnx_args = iter(resolved.nnx_args)
    loose: list[tuple[int, Any, int]] = []  # (position, NnxArg, spec id) of Variables read jointly
    before = (
        dict(zip(map(id, resolved.nnx_args), resolved.read_before))
        if resolved.joint and len(resolved.read_before) == len(resolved.nnx_args) else {}
    )
    previous = state.structures.get(_plan.structure_key(args[0], kwnames))
    for a, spec_id in zip(args, key):
        static = _plan.static_read(spec_id, a) if spec_id != 0 else None  # (None, a str, an optax transform)
        if static is not None and _flatten.spec_by_id(spec_id).n_dyn == 0:
            reads.append(static)
            continue
        if spec_id == 0:
            if type(a) not in state.plain_leaves:
                return None  # (a tracer of an outer trace, an array subclass: resolved every call)
            reads.append(None)
            continue
        if resolved.nnx_args and _nnx_gate.reads_as_node(a):
            # Read from its cache entry: on its own, or as the general path read it jointly
            # with the call's other NNX arguments; or a Variable read afresh.
            nnx_arg = next(nnx_args, None)
            if nnx_arg is None or nnx_arg.obj is not a:
                return None
            if resolved.joint:
                joint = _nnx_gate.adapter().joint_read(nnx_arg, before.get(id(nnx_arg)))
                if joint is None:  # (a Variable passed on its own, which another argument holds?)
                    loose.append((len(reads), nnx_arg, spec_id))  # (decided once all are read)
                reads.append(joint)
                continue
            node = _node_read(nnx_arg, spec_id)
            if node is None:
                return None
            reads.append(node)
            continue
        container = _node_container(a) if resolved.nnx_args else None
        if container is not None:
            # (a container of NNX objects only, `(model, optimizer)`, a dict or dataclass of
            # them: each read on its own)
            ahead, nnx_args = itertools.tee(nnx_args)
            nodes = _nodes_read(a, container, spec_id, ahead, before if resolved.joint else None)
            if nodes is not None:
                nnx_args = ahead
                reads.append(nodes)
                continue
            # (else one cannot be read from a cache entry: a Variable, which has none)
        if resolved.nnx_args and not resolved.joint and _flatten.spec_by_id(spec_id).kind == "nnx-tree":
            # (NNX objects beside arrays and static values in a pytree, flax's TrainState
            # holding `nnx.split`'s States; or Variables, which have no cache entry)
            mixed = _nnx_gate.adapter().mixed_read(spec_id, nnx_args, a)
            if mixed is None:
                return None
            reads.append(mixed)
            continue
        # (the functional API's GraphDef: static, known by identity)
        if not state.options.nnx_as_pytree and _nnx_gate.is_graphdef(a):
            reads.append(GraphdefRead(spec_id))
            continue
        read = _pytree_read(state, previous, a, spec_id, len(reads))
        if read is None:
            return None
        reads.append(read)
    if next(nnx_args, None) is not None:
        return None  # (NNX objects inside another argument: read by the general path only)
    for at, nnx_arg, spec_id in loose:
        shared = _nnx_gate.adapter().shared_variable_read(nnx_arg, spec_id, reads, at)
        if shared is None:
            return None
        reads[at] = shared
    return tuple(reads)


def _node_read(nnx_arg: Any, spec_id: int) -> NodeRead | VariableRead | None:
    """How the structure path reads an NNX argument read on its own (`nnx_arg`): from its
    cache entry, or None where that is not usable as it is."""
    if nnx_arg.entry is None:
        # (a Variable passed on its own, which has no cache entry: its type and metadata
        # compared, its value read; beside other NNX objects too, which the structure path
        # checks share nothing with it, as this call's did)
        return _nnx_gate.adapter().variable_read(nnx_arg, spec_id)  # type: ignore[no-any-return]
    return NodeRead(spec_id) if _nnx_gate.adapter().readable_argument(nnx_arg, spec_id) else None


def _pytree_read(state: Any, previous: CallPlan | None, a: Any, spec_id: int, at: int) -> ArgRead | None:
    """How the structure path reads argument `a` (at `at`, of spec `spec_id`), a pytree: by
    its structure's extractor, or as the function's record already reads it, or from the
    identity cache; None where none serves."""
    rule, as_pytree = state.options.trace_scalars, state.options.nnx_as_pytree
    template = next(
        (t for t in _codegen.templates.get(type(a), ()) if t.spec.id == spec_id and t.serves(rule, as_pytree)), None
    )
    kept = _kept_read(previous, at, spec_id)
    if template is None and kept is not None:
        # (its template was dropped from the few kept per type, `_codegen.learn`: the
        # read this function's record has keeps serving the structure)
        return kept
    if template is None:
        hit = _flatten.lookup(a)
        if hit is None or hit.spec_id != spec_id:
            return None
        return ArgRead(spec_id, None, None)
    spec = template.spec
    by_identity = template.rule is None and (spec.cacheable or spec.guardable)
    return ArgRead(spec_id, template.extract, template.sequence, by_identity)


def _file_structure(
    state: Any, entry: Entry, args: tuple[Any, ...], reads_now: tuple[_Read, ...], kwnames: tuple[str, ...],
    order: Any, fast_shape: bool, hold_first: bool,
) -> None:
    """File the structure record reading `args` by `reads_now` in the function's table, first
    under its key (a record reading them the same way is renewed)."""
    key = _plan.structure_key(args[0], kwnames)
    records = _plan.plans_of(state.structures.get(key))
    known = next(
        (
            r for r in records
            if r.reads == reads_now and r.call is entry.fn and r.kwnames == kwnames and r.order == order
            and r.fast_shape == fast_shape and r.hold_first == hold_first
        ),
        None,
    )
    if known is None:
        # A new record first; the others of this key kept behind it (those reading the same
        # arguments the same way are this one's older versions: dropped)
        others = tuple(
            r._replace(others=()) for r in records if not (r.reads == reads_now and r.kwnames == kwnames and r.order == order)
        )[: _plan.PLANS_PER_KEY - 1]
        known = CallPlan(
            len(args) - len(kwnames), entry.fn, _structure_post(entry), reads=reads_now, last=[None] * len(args),
            fast_shape=fast_shape, kwnames=kwnames, order=order, hold_first=hold_first, others=others,
        )
        if len(state.structures) >= MAX_STRUCTURES and key not in state.structures:
            state.structures.pop(next(iter(state.structures), None), None)  # (the oldest: many keyword sets)
        state.structures[key] = known
    # The objects of this call, passed again, come back to the general path (see `last`),
    # which caches them by identity.
    marks = known.last
    if marks is None:  # (never: a plan in the table has them)
        return
    for i, read in enumerate(reads_now):
        if type(read) is ArgRead:
            marks[i] = last_mark(args[i], i == 0 and hold_first, fast_shape) if read.by_identity else None


def _kept_read(record: CallPlan | None, at: int, spec_id: int) -> ArgRead | None:
    """The read of the argument at `at` in a function's `record` (or one of its `others`),
    if one reads this structure (`spec_id`) with an extractor."""
    for r in _plan.plans_of(record):
        reads = r.reads or ()
        read = reads[at] if at < len(reads) else None
        if type(read) is ArgRead and read.spec_id == spec_id and read.extract is not None:
            return read
    return None


def keyword_order(signature: Any, nargs: int, kwnames: tuple[str, ...]) -> tuple[int, ...] | None:
    """Where each argument the general path resolves is in a call's positional then keyword
    arguments, for a call with `nargs` positional arguments and keywords `kwnames` (in call
    order): the signature binds every such call alike, so binding positions in place of the
    values says it (the general path resolves the bound positional arguments, then the
    remaining keywords sorted by name). None if it cannot be said (it does not bind)."""
    positions = dict(zip(kwnames, range(nargs, nargs + len(kwnames))))
    if signature is None:
        return (*range(nargs), *(positions[n] for n in sorted(positions)))
    try:
        bound = signature.bind(*range(nargs), **positions)
    except TypeError:
        return None
    return (*bound.args, *(bound.kwargs[n] for n in sorted(bound.kwargs)))


def _node_container(a: Any) -> tuple[int, Any] | None:
    """If `a` is a non-empty container of NNX objects only: how many it holds, and how
    `NodesRead` finds them again (None: a tuple's or list's items; `dict`: a dict's values,
    keyed by `_nodes_read`; else a PytreeShape: any other pytree, a nested tuple, a
    namedtuple, a dataclass). Else None."""
    t = type(a)
    if t is dict and a and all(map(_nnx_gate.is_node, a.values())):
        return len(a), dict
    if (t is tuple or t is list) and a and all(map(_nnx_gate.is_node, a)):
        return len(a), None
    try:
        objs, treedef = jax.tree_util.tree_flatten(a, is_leaf=_nnx_gate.is_node)
    except Exception:
        return None
    if not objs or not all(map(_nnx_gate.is_node, objs)) or jax.tree_util.treedef_is_leaf(treedef):
        return None  # (a leaf: `a` itself is an NNX object)
    return len(objs), PytreeShape(a, objs, treedef)


def _nodes_read(
    a: Any, container: tuple[int, Any], spec_id: int, nnx_args: Any, joint: dict[int, Any] | None
) -> NodesRead | None:
    """How the structure path reads `a`, a container of NNX objects only (`container`, as
    `_node_container` gives it), as this call read it (taking its objects' NnxArgs from the
    iterator `nnx_args`, in the order the general path read them; `joint`: None, or read
    jointly with the call's other NNX objects, and what the call's first read found of each,
    by id of its NnxArg: see `joint_read`); None if an object cannot be read from its cache
    entry."""
    count, keys = container
    read: list[Any] = []
    elements: list[int | JointRead] = []
    for _ in range(count):
        n = next(nnx_args, None)
        if n is None:
            return None
        if joint is not None:
            element = _nnx_gate.adapter().joint_read(n, joint.get(id(n)))
            if element is None:
                return None
            elements.append(element)
        elif n.entry is None or not _nnx_gate.adapter().readable_argument(n, n.entry.spec_id):
            return None  # (volatile)
        else:
            elements.append(n.entry.spec_id)
        read.append(n)
    if keys is dict:  # (the general path reads a dict's values in jax's key order)
        key_of = {id(x): k for k, x in a.items()}
        if len(key_of) != len(a):
            return None  # (an object under two keys: its keys cannot be told by identity)
        keys = tuple(key_of.get(id(n.obj)) for n in read)
    nodes = NodesRead(spec_id, type(a), tuple(elements), keys)
    found = nodes.objects(a)
    if found is None or any(x is not n.obj for x, n in zip(found, read)):
        return None
    return nodes


def _publish_pytree(state: Any, first: Any, hit: Any, entry: Entry, arity: int) -> None:
    """Serve `f(first, *arrays)` fast from `first`'s identity cache entry `hit`."""
    ref: Any = hit.ref
    slot = _plan.INDEX.get(id(first))
    if slot is None or slot.ref is not ref:
        slot = FastSlot(ref, {}, hit.guard)
        _plan.publish(ref, slot.records, hit.guard)
    if state in slot.records:
        return
    call: Any = functools.partial(entry.fn, *hit.leaves)
    if _agreement.ENABLED:
        call = _agreement.checked_bound(call, entry, hit.leaves)
    record = CallPlan(arity, call, _fast_post(entry))
    if _pack.packs(state.options):

        def records() -> dict[Any, CallPlan] | None:  # (the slot of `ref`, while it is published)
            found = _plan.INDEX.get(ref.oid)
            return None if found is None or found.ref is not ref else found.records

        record = _pack.pytree_record(records, state, entry, record, hit.leaves)
    slot.records[state] = record


def _fast_post(entry: Entry) -> Any:
    """The post-processing of a fast record: None when jax's output is the result."""
    if entry.passthrough:
        return None
    finish = entry.finish
    adapter = _nnx_gate.loaded()
    nnx_arg = adapter.NnxArg if adapter is not None else None

    def post(out: Any, first: Any, variables: Any) -> Any:
        if variables is None:
            return finish(out, ())
        return finish(out, [nnx_arg(first, variables, None)])  # type: ignore[misc]

    return _writing_back(entry, post, one_object=True)


def _structure_post(entry: Entry) -> Any:
    """The post-processing of a structure record: None when jax's output is the result."""
    if entry.passthrough:
        return None
    finish = entry.finish

    def post(out: Any, first: Any, nnx_args: Any) -> Any:
        return finish(out, nnx_args or ())

    return _writing_back(entry, post, one_object=False)


def _writing_back(entry: Entry, post: Any, one_object: bool) -> Any:
    """`post`, or a faster one where the entry's calls write nothing back (the output
    built, `OutInfo.fast_post`) or only new values into the caller's Variables and raw
    leaves (the NNX plugin's `LeafWrites`). `one_object`: `post` is a fast record's, whose
    third argument is the leaves of the call's one NNX object, not its list of NnxArgs."""
    out = entry.out
    writes = out.plain_writes() if out is not None and not entry.varies else None
    if writes is None:
        return post
    if not writes:
        return out.fast_post  # type: ignore[union-attr]
    return _nnx_gate.adapter().LeafWrites(writes, out.fast_result, post, one_object)  # type: ignore[union-attr]


def make_wrapper(fun: Any, fun_leaves: tuple[Any, ...], state: Any, user_fun: Any) -> Any:
    checking = _agreement.ENABLED  # (FASTCALL_CHECK_HITS: see _agreement)
    general = functools.partial(_general, state, fun, fun_leaves, checking)
    on_error = functools.partial(_c_error, state)
    route = _fast_route.FastRoute(state, on_error, general, state.plain_leaves, state.serves_nested)
    structure = StructureRoute(state.structures, state, on_error, general, state.plain_leaves, state.serves_nested)
    state.fast_routes.add(route)
    state.structure_routes.add(structure)
    declined = _fast_route.DECLINED

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args:
            # ---- 1. the fast route: f(first, *arrays) with a record for `first` ----
            if not kwargs:
                out = route(*args)
                if out is not declined:
                    return out
            # ---- 2. the structure route: arguments of structures this function has run ----
            out = structure(*args, **kwargs)
            if out is not declined:
                return out
        return miss(*args, **kwargs)

    def miss(*args: Any, **kwargs: Any) -> Any:
        """A call both hit routes declined (the C wrapper's fallback too: a miss is not
        tried by the routes again)."""
        if args and not kwargs:
            nnx = _nnx_gate.loaded()
            if nnx is not None and nnx.slot_after_rebuild(args[0]) is not None:
                # (a model nnx.jit rebuilt in place: checked, and its slot restored)
                out = route(*args)
                if out is not declined:
                    return out
        # ---- 3. the general path ----
        return general(None, args, kwargs)

    return _public(wrapper, miss, route, structure, state, fun_leaves, user_fun)


def _public(
    wrapper: Any, miss: Any, route: Any, structure: Any, state: Any, fun_leaves: tuple[Any, ...], user_fun: Any
) -> Any:
    """What the user calls: `wrapper`, or the same hit routes entered from C (see _accel.c),
    which fall back to `miss`; checked against the general path in the agreement mode."""
    functools.update_wrapper(wrapper, user_fun)
    if _native.ACCEL is None:
        public: Any = wrapper
    else:
        public = _native.ACCEL.FastWrapper(miss, route, structure)
        functools.update_wrapper(public, user_fun)
    if _agreement.ENABLED:
        public = functools.update_wrapper(_agreement.checking_wrapper(public, state, fun_leaves), user_fun)
    return public


def _general(
    state: Any, fun: Any, fun_leaves: tuple[Any, ...], checking: bool, ran: Varying | None, args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
) -> Any:
    """The general path of a call of `fun` (`make_wrapper`'s `general`, bound to its
    state): resolve every argument, run the compiled entry (or finish the output `ran`,
    of a call the fast or structure path ran)."""
    if checking:
        _agreement.miss_taken()
    kwargs = kwargs or {}
    whole_reads = WHOLE_READS.count
    try:
        resolved = _args.resolve_call(state, fun_leaves, args, kwargs)
    except StepAside:
        resolved = None  # traced arguments: run inline below, outside this handler
    except FastcallError as err:  # (bad input: named as the wrapper the user wrote)
        raise for_decorator(err, state.decorator) from err.__cause__
    if resolved is None:  # (or the arguments do not fit: the function raises)
        if ran is not None and ran.info.nnx is None:
            # (a call the fast path served inside an outer trace, read-only: it ran, and
            # its output needs no NNX argument to finish; not run inline a second time)
            return ran.finish(())
        return fun(*args, **kwargs)
    entry = state.table.get(resolved.key) or state.entry(resolved.key)
    was_read = WHOLE_READS.count != whole_reads  # (an argument read whole while resolving)
    if was_read:
        state.counts.general_read += 1
    else:
        state.counts.general_cached += 1
    out = run(state, entry, resolved, ran=ran)  # (not counting the trace's reads: a compile reads no argument)
    whole_reads = WHOLE_READS.count
    _file_plans(state, fun_leaves, resolved, state.table.get(resolved.key) or entry, tuple(kwargs))
    if not was_read and WHOLE_READS.count != whole_reads:  # (holding a list or dict flattens it again)
        state.counts.general_cached -= 1
        state.counts.general_read += 1
    return out


def _c_error(state: Any, err: BaseException, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
    on_error(err, list(state.named_args(args, kwargs)), state.decorator)

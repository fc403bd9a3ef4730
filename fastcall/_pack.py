"""Packing: a model's small leaves passed to jax.jit as one buffer, below the floor.

jax.jit's C++ dispatch pays per argument (about 0.5-1 us per array on a CPU), so a
model's biases, norm scales and other small arrays cost as much to pass as its large
matrices. When the fast path serves an object called again, its small leaves are passed
instead in buffers (at most `MAX_PER_BUFFER` leaves each) per dtype and device, built at
the first call its fast record serves outside a trace (`ready`; a record is made for
every object the general path resolves, and most are never used; an NNX record's at the
second, leaving out what changed since the first), and sliced back
inside a second program (`packed_program`) that calls the function's own compiled entry
on the leaves. jax.jit reuses the entry's trace there, so the user's function is not
traced again; XLA compiles the packed program once per layout.

The buffer holds copies of leaves that are immutable (jax arrays). An Equinox module or a
held params dict binds its leaves to its record (`bound_call`), and is unchanged while
the record lives: a changed model is a new object (Equinox) or fails its guard (a dict),
and takes the general path, which never packs. An NNX model's Variables are read on
every call (`checked_call`): each packed one is compared by identity with the value
packed, and only those that did not change between the record's first two calls are packed
at all. One that differs after many calls served packed (new weights loaded now and then)
packs the model again; one that differs sooner is passed as it is from then on, and the
leaves that did not change are packed anew. So a training step whose weights change every
call pays nothing for packing, Equinox or NNX (but for the leaves no step changes, packed),
and a decoder's step counter leaves its weights packed.

What is packed (`plan`) was measured, not guessed (jax.jit on flat leaves against jax.jit
on the same leaves packed by hand, jax 0.10, CPU; the bench's eqx_tiny_leaves,
eqx_transformer_small and nnx_transformer_small workloads show the outcome): jax arrays
of at most one dimension and at most `MAX_ELEMENTS` elements, strongly typed (a slice is
strongly typed: a weak leaf would trace the entry again), of a dtype in
`PACKED_DTYPES`, on one device, at least `MIN_LEAVES` of a kind (dtype, device, memory
kind, committed). Matrices are passed as they are: slicing a dot operand out of a
buffer cost more than passing it (8x8 to 32x32, 8 to 50 leaves: 1.05-1.38x the floor),
while 1-D leaves of up to 256 elements were 0.28-0.88x (2 to 64 leaves). Only at default
options: nothing donated, no shardings, device, backend or compiler options given; `pack=False` turns
it off.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _agreement, _debug_names
from ._flatten import ArrayImpl
from ._options import UNSPECIFIED
from ._trace import currently_jitting

MAX_ELEMENTS = 256  # a leaf of more is passed as it is
# bool, integers, floats (bfloat16 too) and complex numbers of a byte or more; not PRNG keys
# nor the sub-byte and 8-bit float types
PACKED_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, jnp.bfloat16, np.float32, np.float64, np.complex64, np.complex128,
    )
)
MIN_LEAVES = 2  # fewer of a kind (dtype, device) are passed as they are
# XLA's compile time grows faster than linearly in the slices taken from one buffer (a 48-layer
# stack, 192 leaves of 32 floats, CPU: 0.4-0.5 s passed as they are; in one buffer 2.8 s; in 4 of
# 48 leaves 1.1 s; in 6 of 32, 0.56 s): a kind of more leaves is packed into several buffers.
MAX_PER_BUFFER = 32


class Group(NamedTuple):
    """Leaves packed into one buffer: their positions among the bound leaves, in order."""

    positions: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: Any


class PackPlan(NamedTuple):
    """How a bound prefix of `n` leaves is passed: each group as one buffer, then the
    leaves at `rest` as they are. Hashable: the packed programs of an entry are keyed by it."""

    n: int
    groups: tuple[Group, ...]
    rest: tuple[int, ...]

    @property
    def n_packed(self) -> int:
        return sum(len(g.positions) for g in self.groups)


def packs(options: Any) -> bool:
    """Whether a function with these options packs: `pack` on, and nothing donated, sharded
    or placed by an option (a packed buffer would carry none of it)."""
    return (
        options.pack
        and options.donate == "none"
        and not options.donate_argnums
        and not options.donate_argnames
        and options.device is None
        and options.backend is None
        and options.in_shardings is UNSPECIFIED
        # (a nested jit's options do not reach the program it is inlined into)
        and options.compiler_options is None
    )


def _kind(leaf: Any) -> Any:
    """The buffer a leaf may be packed into (dtype, device, memory kind, committed), or
    None if it is passed as it is."""
    if type(leaf) is not ArrayImpl or leaf.ndim > 1 or leaf.size > MAX_ELEMENTS or leaf.weak_type:
        return None
    if leaf.dtype not in PACKED_DTYPES:
        return None
    sharding = leaf.sharding
    if type(sharding) is not jax.sharding.SingleDeviceSharding:
        return None
    try:
        if leaf.is_deleted():
            return None
    except Exception:  # pragma: no cover - an array type without it
        return None
    (device,) = sharding.device_set
    return (leaf.dtype, device, sharding.memory_kind, leaf.committed)


def plan(leaves: Sequence[Any], exclude: frozenset[int] = frozenset()) -> PackPlan | None:
    """The packing of these bound leaves (but those at `exclude`, passed as they are), or
    None where nothing is worth packing."""
    by_kind: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        kind = None if i in exclude else _kind(leaf)
        if kind is not None:
            by_kind.setdefault(kind, []).append(i)
    groups = []
    packed: set[int] = set()
    for kind, positions in by_kind.items():
        if len(positions) < MIN_LEAVES:
            continue
        n_buffers = -(-len(positions) // MAX_PER_BUFFER)
        for b in range(n_buffers):  # (as even as can be: each holds MIN_LEAVES or more)
            chunk = positions[b * len(positions) // n_buffers : (b + 1) * len(positions) // n_buffers]
            groups.append(Group(tuple(chunk), tuple(tuple(leaves[i].shape) for i in chunk), kind[0]))
        packed.update(positions)
    if not groups:
        return None
    return PackPlan(len(leaves), tuple(groups), tuple(i for i in range(len(leaves)) if i not in packed))


def buffers(p: PackPlan, leaves: Sequence[Any]) -> list[Any]:
    """The buffers of plan `p` for these leaves (each group's leaves, raveled, in order):
    arrays, even where a trace is running (packing waits for the top level: `ready`)."""
    with jax.ensure_compile_time_eval():
        return [_concatenate(*(leaves[i] for i in g.positions)) for g in p.groups]


def ready() -> bool:
    """Whether a record may be packed now: no JAX trace running (its buffers would be built
    inside it; a later call packs it)."""
    return not currently_jitting()


def meshless() -> bool:
    """Whether no mesh is set as context (`jax.set_mesh`). Under one, leaves sliced from a
    buffer carry the context's mesh in their types, which the entry's trace did not see, and
    jax would trace the function again: a record first used there is not packed."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    return get_mesh is None or bool(get_mesh().empty)


@jax.jit
def _concatenate(*leaves: Any) -> Any:
    return jnp.concatenate([jnp.ravel(x) for x in leaves])


def packed_program(entry: Any, p: PackPlan) -> Callable[..., Any]:
    """`entry`'s program taking plan `p`'s buffers and other leaves, then the call's own
    arguments: a jax.jit that slices the leaves back and calls `entry.fn` on them (one per
    entry and plan)."""
    found = entry.packs.get(p)
    if found is not None:
        return found  # type: ignore[no-any-return]
    fn = entry.fn
    n_groups, n_rest = len(p.groups), len(p.rest)

    def unpacked(*given: Any) -> Any:
        leaves: list[Any] = [None] * p.n
        for g, buf in zip(p.groups, given[:n_groups]):
            start = 0
            for at, shape in zip(g.positions, g.shapes):
                size = int(np.prod(shape, dtype=np.int64))
                leaves[at] = jax.lax.slice(buf, (start,), (start + size,)).reshape(shape)
                start += size
        for at, x in zip(p.rest, given[n_groups : n_groups + n_rest]):
            leaves[at] = x
        return fn(*leaves, *given[n_groups + n_rest :])

    unpacked.__name__ = unpacked.__qualname__ = getattr(fn, "__name__", "packed")
    # (jax's errors name the user's function and each leaf, as the entry's own do)
    _debug_names.attach_packed(unpacked, fn, [g.positions for g in p.groups] + [(i,) for i in p.rest], p.n)
    program = jax.jit(unpacked)
    program._fastcall_pack_plan = p  # type: ignore[attr-defined]  # (read by `plan_of`)
    entry.packs[p] = program
    return program


def plan_of(call: Any) -> PackPlan | None:
    """The plan of a fast record's call, if it passes leaves packed (for `f.explain`)."""
    found = getattr(call, "_fastcall_pack_plan", None)  # (an NNX record's `checked_call`)
    return found if found is not None else getattr(getattr(call, "func", None), "_fastcall_pack_plan", None)


def _getter(positions: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items at `positions` of a sequence, as a tuple (in C: `operator.itemgetter`)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    return lambda values: tuple(values[i] for i in positions)


# A packed leaf that changed after at least this many calls were served from the buffers is
# packed again (weights loaded now and then: one more dispatch, amortised over the calls
# before). One that changed sooner is passed as it is from then on (a step counter, a
# model trained in place), the others packed anew; at an early change after `GIVE_UP_AFTER`
# of them, the record passes every leaf as it is for good.
REPACK_AFTER = 32
GIVE_UP_AFTER = 2


def worth_checking(p: PackPlan) -> bool:
    """Whether an NNX record's packing saves more than its checks cost. Its call is a Python
    frame that takes every leaf and compares each packed one with the value packed: about
    0.7 us and 0.02 us a leaf here, against about 0.9 us per argument saved. (Measured with
    `fastcall.jit` on NNX models of small vectors and 8x8 matrices, packed against
    `pack=False`, CPU: 2 vectors alone 1.18x; 2 beside 8 matrices 1.09x; 2 and 10 beside 290
    matrices 1.04x and 1.02x; 4 beside 20 matrices 0.94x. An Equinox model's bound leaves
    take no check: 2 vectors alone 0.91x.)"""
    return p.n_packed - len(p.groups) >= 2 + p.n // 32


def checked_call(
    entry: Any,
    values: Sequence[Any],
    exclude: frozenset[int],
    on_change: Callable[[Sequence[Any], frozenset[int], bool], Callable[..., Any] | None],
) -> tuple[Callable[..., Any], PackPlan] | None:
    """For an NNX record, whose leaves (Variable values) are read on every call and may
    change in place: `entry.fn`'s stand-in taking those values, then the call's own
    arguments, packing them by `plan(values, exclude)`. While every packed leaf is still the
    very value packed (compared by identity: a write gives a Variable a new array), it calls
    the packed program. When some differ, it asks `on_change(values, changed, late)`
    (`changed`: their positions; `late`: after `REPACK_AFTER` calls served packed) for the
    call of the record packed anew, and runs that; where that gives None, `entry.fn` on the
    values as they are. None where `plan` finds nothing to pack, or nothing worth its checks
    (`worth_checking`)."""
    p = plan(values, exclude)
    if p is None or not worth_checking(p):
        return None
    program = packed_program(entry, p)
    bufs = tuple(buffers(p, values))
    positions = tuple(i for g in p.groups for i in g.positions)
    snapshot = tuple(values[i] for i in positions)
    packed_of, rest_of = _getter(positions), _getter(p.rest)
    fn, n, is_, first = entry.fn, p.n, operator.is_, positions[0]
    served = itertools.count()  # (`next` per packed call: a C call, no frame)

    def call(*given: Any) -> Any:
        if all(map(is_, packed_of(given), snapshot)):
            next(served)
            return program(*bufs, *rest_of(given), *given[n:])
        if type(given[first]) is ArrayImpl:  # (not tracers, read under an NNX transform)
            late = next(served) >= REPACK_AFTER
            changed = frozenset(i for i, v, was in zip(positions, packed_of(given), snapshot) if v is not was)
            again = on_change(given[:n], changed, late)
            if again is not None:
                return again(*given)
        return fn(*given)

    call._fastcall_pack_plan = p  # type: ignore[attr-defined]
    return call, p


def bound_call(entry: Any, leaves: Sequence[Any]) -> tuple[Callable[..., Any], PackPlan | None]:
    """`entry.fn` with these leaves bound first: packed where `plan` finds it worth it
    (with the plan), else as they are (with None)."""
    p = plan(leaves)
    if p is None:
        return functools.partial(entry.fn, *leaves), None
    program = packed_program(entry, p)
    return functools.partial(program, *buffers(p, leaves), *(leaves[i] for i in p.rest)), p


# ---- fast records passing leaves packed (`_dispatch` files them) ----


def pytree_record(
    records: Callable[[], dict[Any, Any] | None], state: Any, entry: Any, record: Any, leaves: Any
) -> Any:
    """`record`, the fast record of an object whose `leaves` it binds (an Equinox module, a
    held params dict), to be filed in `records()` under `state`: it binds them packed
    (`bound_call`) from its first use on."""

    def pack(values: Sequence[Any]) -> Any:
        packed_call, p = bound_call(entry, leaves)
        if p is None:
            return record
        state.counts.packed_leaves += p.n_packed
        if _agreement.ENABLED:
            packed_call = _agreement.checked_bound(packed_call, entry, leaves)
        return record._replace(call=packed_call)

    return record._replace(call=_PackingOnFirstUse(records, state, record.call, pack))


def nnx_record(state: Any, node: Any, entry: Any, unpacked: Any) -> Any:
    """`unpacked`, an NNX object's fast record (filed in its cache entry `node`'s `fast`
    under `state`), passing its small leaves packed while they are unchanged
    (`checked_call`), from its first use on."""
    node_ref = weakref.ref(node)

    def records() -> dict[Any, Any] | None:
        found = node_ref()
        return None if found is None else found.fast  # type: ignore[no-any-return]

    packing = _NnxPacking(records, state, entry, unpacked, len(node.items))
    return unpacked._replace(call=_PackingOnFirstUse(records, state, unpacked.call, packing.on_use))


class _PackingOnFirstUse:
    """A fast record's call that files `pack(values)` in the record's place (`records()`,
    under `state`) on its first use outside a trace (`values`: what the fast path passes it;
    where `pack` gives None, at a later use), and runs the call as the record filed does. A fast
    record is made for each object the general path resolves, and most are never used: the
    model a training step returns is passed back once. Building buffers for those would cost
    a dispatch per step. (A class, holding nothing that holds it: a dead object's records,
    and the leaves they bind, are freed when it dies, not at the next garbage collection.)"""

    __slots__ = ("records", "state", "call", "pack")

    def __init__(self, records: Any, state: Any, call: Any, pack: Any) -> None:
        self.records, self.state, self.call, self.pack = records, state, call, pack

    def __call__(self, *values: Any) -> Any:
        filed = self.records()
        if filed is not None and ready():  # (else: at a later use)
            record = filed.get(self.state)
            if record is not None and record.call is self:
                packed = self.pack(values) if meshless() else record._replace(call=self.call)
                if packed is not None:
                    filed[self.state] = packed
                    # (this call runs as the record now filed: a packed program compiles here,
                    # at the call that packs, not at a later one)
                    return packed.call(*values)
        return self.call(*values)


class _NnxPacking:
    """The packing of one NNX object's fast record for one function. Its first use notes
    the small leaves' values, and its second packs those that did not change in between
    (`on_use`): a training step's weights, a decoder's step counter are passed as they are
    from the start, and a model whose small leaves all change packs nothing (no second
    program compiled). `pack(values)` is the record packed for these Variable values, but
    for the leaves seen changing (`volatile`). Its call reports changed leaves to
    `on_change`, which files the record packed anew (leaves that changed early made
    volatile), or, at an early change after `GIVE_UP_AFTER` of them, the unpacked record for good
    (`checked_call`); only while the record filed is the one it made (known by its plan, in
    `mine`). (A class: the record's call holds it, and it holds nothing that holds the call,
    so the object's Variables die with it.)"""

    __slots__ = ("records", "state", "entry", "unpacked", "n", "volatile", "early_changes", "first_seen")

    def __init__(self, records: Any, state: Any, entry: Any, unpacked: Any, n: int) -> None:
        self.records, self.state, self.entry, self.unpacked, self.n = records, state, entry, unpacked, n
        self.volatile: frozenset[int] = frozenset()
        self.early_changes = 0
        self.first_seen: tuple[tuple[int, Any], ...] | None = None  # (position, value) of the small leaves

    def on_use(self, values: Sequence[Any]) -> Any:
        """At the record's first uses outside a trace: None at the first (the small leaves'
        values noted), the record packed at the second."""
        seen = self.first_seen  # (read once: another thread may clear it)
        if seen is None:
            self.first_seen = tuple((i, v) for i, v in enumerate(values[: self.n]) if _kind(v) is not None)
            return None
        self.volatile = frozenset(i for i, v in seen if values[i] is not v)
        self.first_seen = None
        return self.pack(values)

    def pack(self, values: Sequence[Any]) -> Any:
        mine: list[PackPlan] = []  # (the plan of the record made here)
        made = checked_call(self.entry, values[: self.n], self.volatile, functools.partial(self.on_change, mine))
        if made is None:
            return self.unpacked
        call, p = made
        mine.append(p)
        self.state.counts.packed_leaves += p.n_packed
        if _agreement.ENABLED:
            call = _agreement.checked_bound(call, self.entry, ())
        return self.unpacked._replace(call=call)

    def on_change(self, mine: list[PackPlan], current: Sequence[Any], changed: frozenset[int], late: bool) -> Any:
        filed = self.records()
        call = filed.get(self.state, self.unpacked).call if filed is not None else None
        if call is None or plan_of(getattr(call, "call", call)) is not mine[0]:
            return None  # (not the record filed: it no longer serves)
        if not (ready() and meshless()):
            return None  # (counted, and packed again, at a later call outside a trace and mesh)
        if not late:
            self.early_changes += 1
            self.volatile |= changed
            if self.early_changes > GIVE_UP_AFTER:
                filed[self.state] = self.unpacked
                return None
        record = filed[self.state] = self.pack(current)
        return record.call

"""The call path of a wrapped function: the hot path, one `run`, and fast records.

Reading order: `make_wrapper` builds the closure `wrapper`, whose body is the
whole route of a call:

1. The fast path. `f(first, *arrays)` where `first` has a `FastRecord` for
   this function in the fast index (`_fast.INDEX`) and every other argument
   is a plain jax array: one dict lookup, one weakref check (and, for an
   object holding lists or dicts, its guard: `_guard`), one type check per
   array, then the jax.jit C++ fast path. Nothing is flattened or keyed.
   The C extension (`_accel.c`) serves exactly this case, reading the same
   records; this Python copy serves it when the C one is not built or is
   disabled (`FASTCALL_DISABLE_ACCEL=1`).
2. The general path. Every argument is resolved (`_args.resolve_call`: plain
   arrays, identity-cache hits, NNX objects, new objects), the tuple of spec
   ids selects the compiled entry, and `run` runs it.

`run` is the one place that calls a compiled entry: retry once if the output
structure turned out to vary, translate errors, rebuild the output and write
NNX state back. The wrapper, `lower(...).compile()` and `fastcall.partial`
all go through it. After a general call, `_install_fast` decides (the one
eligibility rule, for Equinox and NNX alike) whether later calls of the same
shape can take the fast path.
"""

from __future__ import annotations

import functools
import importlib
import os
import weakref
from typing import Any

from . import _args, _codegen, _fast, _flatten, _guard, _nnx_gate
from ._build import Entry, StructureVaries
from ._fast import FastRecord, FastSlot, StructureRecord
from ._flatten import ArrayImpl
from ._outputs import on_error
from ._trace import StepAside

_accel: Any
try:  # the optional C fast path (fastcall/_accel.c)
    _accel = importlib.import_module("fastcall._accel")
except ImportError:  # pragma: no cover - not built: pure Python, same behaviour
    _accel = None

# Read once, at import: `FASTCALL_DISABLE_ACCEL=1` serves every call from Python (for
# debugging, and for the tests that run every behaviour through both paths).
USE_ACCEL = os.environ.get("FASTCALL_DISABLE_ACCEL", "") not in ("1", "true", "yes")


def run(state: Any, entry: Entry, resolved: Any, executable: Any = None) -> Any:
    """Run one call of `entry` on the resolved arguments and return the user's output.

    `executable`: an ahead-of-time compiled program to call instead of `entry.fn`
    (its output structure is fixed, so there is nothing to retry)."""
    try:
        if executable is not None:
            out = executable(*resolved.leaves)
        else:
            try:
                out = entry.fn(*resolved.leaves)
            except StructureVaries:
                entry = state.make_varying(resolved.key, entry)
                out = entry.fn(*resolved.leaves)
    except (RuntimeError, ValueError) as err:
        on_error(err, list(state.named_args(resolved.args, resolved.kwargs)))
    if entry.passthrough:
        return out
    return entry.finish(out, resolved.nnx_args)


def _install_fast(state: Any, fun_leaves: tuple[Any, ...], resolved: Any, entry: Entry) -> None:
    """After a general call: let later calls of this shape take the fast path, if the
    call was `f(first, *plain arrays)` with `first` a cached Equinox/pytree object or an
    NNX object whose structure is cached, and the compiled entry's outputs are fixed.
    A new pytree `first` instead gets a structure record: later new objects of its
    structure take the structure path. The one eligibility rule for both (Python and C)."""
    args = resolved.args
    # Records are per state, which equal functions carrying other arrays share.
    if fun_leaves or resolved.kwargs or not args or entry.varies or entry.out is None:
        return
    for k in resolved.key[1:]:
        if k != 0:
            return  # every other argument must be a plain array
    first = args[0]
    if resolved.nnx_args:
        if len(resolved.nnx_args) != 1:
            return  # (NNX objects in the other, plain-array arguments? none can be)
        nnx_arg = resolved.nnx_args[0]
        node = nnx_arg.entry
        if nnx_arg.obj is not first or node is None or not node.direct or state in node.fast:
            return
        node.fast[state] = FastRecord(len(args), entry.fn, node.items, _fast_post(entry))
        return
    if not resolved.first_known:
        _publish_structure(state, first, resolved.key[0], entry, len(args))
    if type(first) is list or type(first) is dict:  # (see `hold`)
        spec = _flatten.spec_by_id(resolved.key[0])
        held = _flatten.hold(state, first, resolved.leaves[: spec.n_dyn], spec)
        if held is not None:
            _publish_pytree(state, first, held, entry, len(args))
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


def _publish_structure(state: Any, first: Any, spec_id: int, entry: Entry, arity: int) -> None:
    """Serve `f(new object of first's structure, *arrays)` through the structure's
    generated extractor (if it has one: `_codegen.templates`)."""
    for template in _codegen.templates.get(type(first), ()):
        if template.spec.id == spec_id:
            known = state.structures.get(type(first))
            if known is None or known.extract is not template.extract or known.call is not entry.fn or known.arity != arity:
                known = StructureRecord(arity, template.extract, entry.fn, _fast_post(entry), [0])
                state.structures[type(first)] = known
            # `first` itself, passed again, comes back here: then it is cached by identity
            # (`first_known`) and gets a fast record.
            known.last[0] = id(first)
            return


def _publish_pytree(state: Any, first: Any, hit: Any, entry: Entry, arity: int) -> None:
    """Serve `f(first, *arrays)` fast from `first`'s identity cache entry `hit`."""
    ref: Any = hit.ref
    slot = _fast.INDEX.get(id(first))
    if slot is None or slot.ref is not ref:
        slot = FastSlot(ref, {}, hit.guard)
        _fast.publish(ref, slot.records, hit.guard)
    if state not in slot.records:
        call = functools.partial(entry.fn, *hit.leaves)
        slot.records[state] = FastRecord(arity, call, None, _fast_post(entry))


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

    return post


def _all_arrays(values: tuple[Any, ...]) -> bool:
    for v in values:
        if type(v) is not ArrayImpl:
            return False
    return True


def make_wrapper(fun: Any, fun_leaves: tuple[Any, ...], state: Any, user_fun: Any) -> Any:
    index_get = _fast.INDEX.get
    structures_get = state.structures.get
    read_value = _fast.read_value
    guard_holds = _guard.holds
    counts = state.counts
    resolve_call = _args.resolve_call
    fast_ok = not (state.static_argnums or state.static_argnames)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # ---- 1. the fast path: f(first, *arrays) with a record for `first`, or a new
        # `first` of a structure this function has run (the structure path) ----
        if args and fast_ok and not kwargs:
            first = args[0]
            rest = args[1:]
            call = None
            slot = index_get(id(first))
            if slot is not None:
                if slot.ref() is first and (slot.guard is None or guard_holds(slot.guard)):
                    record = slot.records.get(state)
                    if record is not None and record.arity == len(args) and _all_arrays(rest):
                        arity, call, variables, post = record
                        if variables is None:
                            values: Any = ()
                        else:  # NNX: the Variables' current values, read through the slot
                            values = list(map(read_value, variables))
                        # (tracers inside an nnx transform: the general path steps aside)
                        if values and type(values[0]) is not ArrayImpl:
                            call = None
                        else:
                            counts.python_fast += 1
            else:
                known = structures_get(type(first))
                if known is not None and known.arity == len(args) and known.last[0] != id(first) and _all_arrays(rest):
                    values = known.extract(first)  # (None: not of this structure)
                    if values is not None:
                        known.last[0] = id(first)
                        call, variables, post = known.call, None, known.post
                        counts.python_structure += 1
            if call is not None:
                try:
                    out = call(*values, *rest)
                except StructureVaries:  # counted once, by the general path
                    if slot is not None:
                        counts.python_fast -= 1
                    else:
                        counts.python_structure -= 1
                except (RuntimeError, ValueError) as err:
                    on_error(err, list(state.named_args(args, kwargs)))
                else:
                    return out if post is None else post(out, first, variables)
        # ---- 2. the general path: resolve every argument, run the compiled entry ----
        try:
            resolved = resolve_call(state, fun_leaves, args, kwargs)
        except StepAside:
            resolved = None  # traced arguments: run inline below, outside this handler
        if resolved is None:  # (or the arguments do not fit: the function raises)
            return fun(*args, **kwargs)
        entry = state.table.get(resolved.key) or state.entry(resolved.key)
        counts.general += 1
        out = run(state, entry, resolved)
        if fast_ok:
            _install_fast(state, fun_leaves, resolved, state.table.get(resolved.key) or entry)
        return out

    functools.update_wrapper(wrapper, user_fun)
    if _accel is None or not USE_ACCEL:
        return wrapper
    # The same fast path in C (see _accel.c); every other call falls back to `wrapper`.
    public = _accel.FastWrapper(
        wrapper,
        _fast.INDEX,
        state.structures,
        state,
        ArrayImpl,
        StructureVaries,
        functools.partial(_c_error, state),
        _fast.VALUE_SLOT,
        FastSlot._fields,
        FastRecord._fields,
        StructureRecord._fields,
    )
    functools.update_wrapper(public, user_fun)
    state.c_wrappers.add(public)
    return public


def _c_error(state: Any, err: BaseException, args: tuple[Any, ...]) -> None:
    on_error(err, list(state.named_args(args, None)))

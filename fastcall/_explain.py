"""`f.explain(*args, **kwargs)`: which route a call would take, and why, argument by argument.

It answers "why is this call not at the floor?" without running the function:
the fast path's conditions are checked as the wrapper checks them, and the
structure path's by its own reading of the arguments (`_dispatch`),
and each argument is described by what the caches know about it (`_flatten`,
`fastcall._nnx`). Explaining reads the arguments as a call would (NNX structures may be
read and cached), but never traces, compiles or runs anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from . import _codegen, _plan, _flatten, _guard, _hold, _nnx_gate, _pack
from ._structure_route import arguments_as_read, declined_reads, reads_as_mixed
from ._tree_reads import static_matches


@dataclasses.dataclass(frozen=True)
class ArgumentReport:
    """What fastcall knows of one argument of a call, and what it costs per call.

    An entry of `fastcall.CallReport.arguments`, from `f.explain(*args, **kwargs)`.

    **Fields:**

    - `name`: the argument's name (its parameter name, `args[i]` for one taken by
      `*args`, or its keyword).
    - `kind`: what the argument is and how fastcall reads it, e.g. `jax array`,
      `cached by identity (immutable pytree)`, `NNX object, structure cached`,
      `Python scalar, traced (weakly typed)`, `top-level dict, not yet held`.
    - `per_call`: what it costs on every call (what is checked or re-read), e.g.
      `passed as is`, `one identity check`, `2 leaf values read`.

    **Example:**

    ```python
    import jax.numpy as jnp
    from flax import nnx

    import fastcall

    @fastcall.jit
    def forward(model, x):
        return model(x)

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = jnp.ones(2)
    forward(model, x)
    for arg in forward.explain(model, x).arguments:
        print(f"{arg.name}: {arg.kind} / {arg.per_call}")
    ```
    ```text
    model: NNX object, structure cached / 2 leaf values read
    x: jax array / passed as is
    ```
    """

    name: str
    kind: str  # what the argument is, and how fastcall reads it
    per_call: str  # what it costs on every call (what is checked or re-read)


@dataclasses.dataclass(frozen=True)
class CallReport:
    """Which route a call would take, and why: what `f.explain(*args, **kwargs)` returns.

    `f.explain` reads the arguments as a call would but traces, compiles and runs
    nothing. Use it when `f.stats().paths` shows calls off the fast path, to see
    which argument keeps them there. `print(report)` reads as text: the route, each
    reason, then one line per argument.

    **Fields:**

    - `route`: `"fast"` (a plan in the first argument's slot of the fast index serves the call: the
      floor), `"structure"` (arguments of structures this function has run, each
      read from a cache or by its structure's generated code) or `"general"`
      (everything else: each argument found in a cache or read whole).
    - `reasons`: why the call would not take the fast path (`"not fast: ..."`) and,
      where it takes neither, why not the structure path (`"not structure: ..."`:
      no plan for calls of its form yet, or the argument the plan declines and
      why). Empty on the fast or structure route.
    - `arguments`: a tuple of `fastcall.ArgumentReport`, one per argument.

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    scale = fastcall.jit(lambda params, x: params["w"] * x)
    params, x = {"w": jnp.full(2, 3.0)}, jnp.ones(2)
    print(scale.explain(params, x))  # before any call
    scale(params, x)
    scale(params, x)  # passed first again: the function holds the dict for the fast path
    report = scale.explain(params, x)
    print(report.route, report.reasons)
    ```
    ```text
    route: general
      not fast: params: no plan in the fast index (see its line below)
      not structure: no plan for calls whose first argument is a dict ...
      params: top-level dict, not yet held; ...
      x: jax array; per call: passed as is
    fast ()
    ```
    """

    # "fast" (a plan in the fast index serves it), "structure" (arguments of the structures of a call
    # this function ran: each read from the identity cache, by its structure's generated
    # extractor, or from its NNX cache entry) or "general"
    route: str
    # why not the fast path ("not fast: ..."), and why not the structure path under the
    # plan of its call shape ("not structure: ...", where there is one); empty on either
    reasons: tuple[str, ...]
    arguments: tuple[ArgumentReport, ...]

    def __str__(self) -> str:
        lines = [f"route: {self.route}"]
        lines += [f"  {r}" for r in self.reasons]
        for a in self.arguments:
            lines.append(f"  {a.name}: {a.kind}; per call: {a.per_call}")
        return "\n".join(lines)


def explain(state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallReport:
    reasons = [f"not fast: {r}" for r in _why_not_fast(state, args, kwargs)]
    route = "general" if reasons else "fast"
    known = _serving_plan(state, args, kwargs)
    named = [(state.arg_name(i), a) for i, a in enumerate(args)] + sorted(kwargs.items())
    reads = list(known.reads) if known is not None else []
    given = arguments_as_read(known, args, kwargs) if known is not None else None
    if known is not None and given is not None:  # (its reads take keywords in the general path's order)
        names = arguments_as_read(known, tuple(map(state.arg_name, range(len(args)))), {k: k for k in kwargs})
        named = list(zip(names or (), given))
    if reasons and known is None:
        form = f"whose first argument is {_a(type(args[0]).__name__)}" if args else "without positional arguments"
        reasons.append(
            f"not structure: no plan for calls {form}"
            + (f" and whose keywords are {', '.join(kwargs)}" if kwargs else "")
            + " (a call the structure path can serve files one)"
        )
    if reasons and known is not None:
        declined = declined_reads(known, args, kwargs, state.plain_leaves, state.serves_nested)
        if not declined:
            route, reasons = "structure", []
        else:
            for index, why in declined:
                reasons.append(f"not structure: {named[index][0] if index is not None else 'the call'}: {why}")
                if index is not None:  # (that argument is not read as the record reads it)
                    reads[index] = None
    static = state.static_positions(len(args))
    reports = tuple(
        _argument(state, name, value, i == 0, reads[i] if i < len(reads) else None, static)
        for i, (name, value) in enumerate(named)
    )
    if route == "fast" and reports:
        packed = _packed_note(state, args[0])
        if packed:
            first = reports[0]
            reports = (dataclasses.replace(first, per_call=f"{first.per_call}; {packed}"), *reports[1:])
    return CallReport(route, tuple(reasons), reports)


def _packed_note(state: Any, first: Any) -> str:
    """How the call plan for `first` in the fast index passes its leaves packed (`_pack`), in
    words; "" if not."""
    slot = _plan.INDEX.get(id(first))
    call_plan = slot.records.get(state) if slot is not None else None
    call = getattr(call_plan, "call", None)
    packing = _pack.plan_of(getattr(call, "call", call))  # (the agreement mode wraps it: `call.call`)
    if packing is None:
        return ""
    return (
        f"{packing.n_packed} of its {packing.n} leaves passed packed in {len(packing.groups)} "
        f"buffer{'s' if len(packing.groups) > 1 else ''} (small and unchanged: `pack`)"
    )


def _serving_plan(state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The plan in the function's table that would serve the call (of those kept under its key, the
    first whose reads take it), else the one under its key (None if none is)."""
    head = state.structures.get(_plan.structure_key(args[0], tuple(kwargs))) if args else None
    for known in _plan.plans_of(head):
        if not declined_reads(known, args, kwargs, state.plain_leaves, state.serves_nested):
            return known
    return head


def _why_not_fast(state: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The fast path's conditions (`_dispatch.make_wrapper`), each one that fails, in words."""
    if state.has_static:
        return ["the function has static_argnums/static_argnames (the general path binds them)"]
    reasons = []
    if kwargs:
        reasons.append(f"keyword arguments ({', '.join(sorted(kwargs))}): the fast path takes positional ones")
    if not args:
        return reasons + ["no positional argument to key the fast path on"]
    others = [state.arg_name(i) for i, a in enumerate(args[1:], 1) if type(a) not in state.plain_leaves]
    if others:
        reasons.append(f"{', '.join(others)}: not an array or traced scalar (the fast path is f(obj, *arrays))")
    slot = _plan.INDEX.get(id(args[0]))
    if slot is None and (nnx := _nnx_gate.loaded()) is not None:
        slot = nnx.slot_as_checked(args[0])  # (a model NNX rebuilt in place since its last call)
    first = state.arg_name(0)
    if slot is None or slot.ref() is not args[0]:
        reasons.append(f"{first}: no plan in the fast index (see its line below)")
    elif slot.guard is not None and not _guard.holds(slot.guard):
        reasons.append(f"{first}: a list or dict in it changed since it was cached (re-read on this call)")
    else:
        record = slot.records.get(state)
        if record is None and others:  # (plans are filed by calls the fast path can serve)
            reasons.append(f"{first}: cached, and no plan for it: one is filed only by a call f({first}, *arrays)")
        elif record is None:
            reasons.append(f"{first}: cached, but this function has no plan for it yet (filed after a call)")
        elif record.arity != len(args):
            reasons.append(f"{first}: its plan is for {record.arity} arguments, this call has {len(args)}")
    return reasons


def _container_note(state: Any, first: bool) -> str:
    """Why a list or dict that the identity cache does not hold is read every call, or
    when `_hold.hold` would hold it instead."""
    if not first:
        return "(a list or dict is held only when passed first, beside plain arrays)"
    if not _hold.may_hold(state):
        return (
            "(this function no longer holds lists and dicts: those passed first came back to its general"
            " path call after call, and none was served by the fast path, as with a new dict built each call)"
        )
    return "(held for the fast path if passed first again, beside plain arrays only)"


def _marked_static(state: Any, name: str, static: frozenset[int]) -> bool:
    """Whether the argument called `name` (`FunctionState.arg_name`) is marked static;
    `static`: the positions of this call's static arguments."""
    if name in state.static_argnames:
        return True
    if name in state.param_names:
        return state.param_names.index(name) in static
    return name.startswith("args[") and int(name[5:-1]) in static


def _argument(state: Any, name: str, value: Any, first: bool, read: Any, static: frozenset[int]) -> ArgumentReport:
    """What fastcall knows of argument `name` (`value`, read by the record's `read`, if any),
    and what it costs per call: the first of these descriptions that fits it."""
    report = _as_leaf(state, name, value, read, static)
    if report is None:
        report = _as_nnx_object(state, name, value, read)
    if report is None:
        report = _as_cached(name, value)
    if report is None and not state.options.nnx_as_pytree:  # (else NNX objects inside are pytree nodes)
        report = _as_nnx_container(state, name, value, read)
    if report is None:
        report = _as_pytree(state, name, value, first, read)
    return report


def _as_leaf(state: Any, name: str, value: Any, read: Any, static: frozenset[int]) -> ArgumentReport | None:
    """An array, a scalar or a static value, or None."""
    if type(value) is np.ndarray or (type(value) in _flatten.PLAIN_ARRAY_TYPES and isinstance(value, np.generic)):
        kind = "NumPy array" if type(value) is np.ndarray else "NumPy scalar"
        return ArgumentReport(name, kind, "passed as is (jax copies it to the device on every call)")
    if type(value) in _flatten.PLAIN_ARRAY_TYPES:
        return ArgumentReport(name, "jax array", "passed as is")
    if type(read) is _plan.StaticRead and static_matches(read, value):
        return ArgumentReport(
            name,
            f"{type(value).__name__}, static, as in a call this function ran",
            "compared with that call's (by identity, a scalar by value)",
        )
    if _marked_static(state, name, static):
        return ArgumentReport(
            name,
            f"{type(value).__name__}, static (static_argnums/static_argnames): part of the compile key",
            "hashed and compared (a new value compiles a new program)",
        )
    if type(value) in _flatten.PY_SCALARS:
        if state.options.trace_scalars:
            return ArgumentReport(name, "Python scalar, traced (weakly typed)", "passed as is")
        return ArgumentReport(name, "Python scalar, static (part of the compile key)", "hashed")
    if _flatten.is_traced_leaf(value, state.options.trace_scalars):  # (an array subclass, a tracer)
        return ArgumentReport(
            name,
            f"{type(value).__name__}, a leaf not of a type the fast paths pass as is",
            "passed to jax.jit as a leaf, by the general path on every call",
        )
    return None


def _as_nnx_object(state: Any, name: str, value: Any, read: Any) -> ArgumentReport | None:
    """An NNX object or Variable read on its own, or None."""
    if type(read) is _plan.SharedVariableRead:
        return ArgumentReport(
            name,
            f"NNX Variable on its own, held by {'a later' if read.first else 'an earlier'} argument (read jointly"
            " with it)",
            "checked to be the Variable at its recorded place in that argument's cache entry (by identity); its "
            + ("value is passed once, here (that argument leaves it out)" if read.first else "value is passed once, by"
               " that argument"),
        )
    if state.options.nnx_as_pytree and _nnx_gate.is_node(value):
        return ArgumentReport(
            name,
            "NNX object read as a plain pytree (nnx_as_pytree: jax.jit's semantics, nothing written back)",
            "flattened by jax's pytree flatten, its treedef compared with the recorded one (about jax.jit's cost)",
        )
    if _nnx_gate.is_node(value) or (_nnx_gate.reads_as_node(value) and _nnx_gate.adapter().read_as_one_object(value)):
        kind, per_call = _nnx_gate.adapter().explain_node(value)
        if type(read) is _plan.JointRead:
            kind += ", read jointly with the call's other NNX arguments (they share nodes or Variables)"
            if read.keep is not None:
                per_call += f"; {len(read.keep)} of its leaves passed (the others by an earlier argument)"
        return ArgumentReport(name, kind, per_call)
    return None


def _as_cached(name: str, value: Any) -> ArgumentReport | None:
    """An object of the identity cache, or None."""
    hit = _flatten.lookup(value)
    if hit is not None:
        if hit.guard is None:
            return ArgumentReport(name, "cached by identity (immutable pytree)", "one identity check")
        n = sum(len(w.expected) for w in hit.guard)
        return ArgumentReport(
            name,
            f"cached by identity, with a guard over {len(hit.guard)} lists/dicts",
            f"{n} item identity checks (an in-place change is seen)",
        )
    return None


def _as_nnx_container(state: Any, name: str, value: Any, read: Any) -> ArgumentReport | None:
    """A container or pytree holding NNX objects, or a GraphDef, or None."""
    adapter = _nnx_gate.loaded()
    if type(read) is _plan.NodesRead and read.objects(value) is not None:
        if read.keys is None or type(read.keys) is tuple:
            return ArgumentReport(
                name,
                f"{read.kind.__name__} of NNX objects, of types and length this function has run",
                "its type and length (a dict: its keys) checked, each object read from its cache entry (no flatten)",
            )
        if read.keys.level is not None:
            return ArgumentReport(
                name,
                f"{read.kind.__name__} of NNX objects, of a tree structure this function has run",
                "its top node flattened (one level: its node data compared, each child an NNX object), each object"
                " read from its cache entry (the objects are not flattened)",
            )
        return ArgumentReport(
            name,
            f"{read.kind.__name__} of NNX objects, of a tree structure this function has run",
            "flattened down to its NNX objects and its tree structure compared, each object read from its cache"
            " entry (the objects are not flattened)",
        )
    if type(read) is _plan.MixedRead and reads_as_mixed(value, read, state.plain_leaves):
        n_variables = sum(type(code) is _plan.VariableRead for code in read.layout)
        n_objects = sum(type(code) is int for code in read.layout)
        n_states = sum(e is not None for e in read.expand or ())
        states = f" (its {n_states} nnx.States each read by its dict)" if n_states else ""
        return ArgumentReport(
            name,
            f"{type(value).__name__} holding NNX objects beside other leaves, of a tree structure this function has"
            " run",
            f"flattened down to its NNX objects{states} and its tree structure compared; {n_variables} Variables'"
            f" types, metadata and values read, {n_objects} other objects read from their cache entries",
        )
    if adapter is not None and adapter.holds_nodes(value):
        return ArgumentReport(name, "container holding NNX objects", "the container flattened, each object read")
    if _nnx_gate.is_graphdef(value):
        return ArgumentReport(name, *_nnx_gate.adapter().explain_graphdef(value))
    return None


def _as_pytree(state: Any, name: str, value: Any, first: bool, read: Any) -> ArgumentReport:
    """Any other pytree: how the structure path or the general path reads it."""
    try:
        spec, _ = _flatten.flatten_generic(value, name, state.options.trace_scalars)
    except Exception as err:  # (the call itself would raise this, naming the argument)
        return ArgumentReport(name, f"cannot be read: {err}", "")
    if spec.kind != "tree":
        return ArgumentReport(name, spec.kind, "")
    if spec.has_nnx and not state.options.nnx_as_pytree:  # (a container not yet recorded)
        return ArgumentReport(
            name,
            f"{type(value).__name__} holding NNX objects beside other leaves",
            "flattened, each NNX object read as if passed on its own; the call files a plan for this structure on the"
            " structure path, unless its NNX objects share Variables",
        )
    if type(read) is _plan.ArgRead and read.extract is not None and read.extract(value) is not None:
        by_rule = any(t.extract is read.extract and t.rule is not None for t in _codegen.templates.get(type(value), ()))
        if by_rule:
            when = ", every call (it holds Python scalars, which the identity cache does not hold)"
        elif type(value) in (list, dict):
            when = ", every call " + _container_note(state, first)
        elif not read.by_identity:
            when = ", every call (it can change in place unseen: the identity cache does not hold it)"
        else:
            when = " (cached by identity if passed again)"
        flattened = any(
            t.extract is read.extract and isinstance(t, _codegen.FlattenTemplate)
            for t in _codegen.templates.get(type(value), ())
        )
        reading = (
            "its leaves read as jax.jit reads them (tree_flatten, the treedef compared with the recorded one"
            + (", its nnx.States and Variables read by fastcall as flax's flatten would" if _expands(read) else "")
            + ")" if flattened else "its leaves read by the structure's generated code"
        ) + when
        return ArgumentReport(name, "a new object of a structure this function has run", reading)
    # (how the general path reads it: by the structure's generated extractor, if it has one)
    templated = any(
        t.spec.id == spec.id and t.serves(state.options.trace_scalars, state.options.nnx_as_pytree) and t.extract(value) is not None
        for t in _codegen.templates.get(type(value), ())
    )
    every_call = "read by its structure's generated code every call" if templated else "flattened every call"
    if not type(value).__weakrefoffset__:
        if first and (spec.cacheable or spec.guardable) and type(value) in (list, dict) and _hold.may_hold(state):
            return ArgumentReport(
                name,
                f"top-level {type(value).__name__}, not yet held",
                "held for the fast path once passed first in two consecutive calls",
            )
        if type(value) in (list, dict):
            note = _container_note(state, first)
            return ArgumentReport(name, f"{type(value).__name__} (not held)", f"{every_call} {note}")
        return ArgumentReport(name, f"{type(value).__name__} (cannot be weakly referenced)", every_call)
    if spec.cacheable or spec.guardable:
        return ArgumentReport(name, "not cached yet (seen for the first time)", "cached after its first calls")
    return ArgumentReport(name, "holds a pytree node that can change in place and cannot be guarded", every_call)


def _a(noun: str) -> str:
    """`noun` with its indefinite article ("an ArrayImpl", "a Linear")."""
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _expands(read: Any) -> bool:
    """Whether an ArgRead's TreeRead reads nnx.States and Variables itself (`TreeRead.expand`)."""
    return type(read.sequence) is _plan.TreeRead and read.sequence.expand is not None

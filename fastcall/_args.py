"""Resolving a call's arguments: each one to its dynamic leaves and its spec id.

This is the one route for every call the fast path does not serve. Per
argument, cheapest first: a plain array is one leaf; an object in the
identity cache gives its cached leaves; an NNX object is read through the
adapter (values fresh, structure cached); a new object of a known structure
goes through its generated extractor; anything else is flattened once (and
cached by identity if immutable). Tracers of an outer transformation are leaves
like arrays (jax.jit nests); a call with NNX objects under an outer trace
(inside nnx.grad/vmap/scan/checkify) raises `StepAside`: the function runs inline.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from . import _codegen, _plan, _flatten, _nnx_gate
from ._errors import FastcallError, describe_arg
from ._flatten import ArrayImpl, Spec, remember
from ._trace import StepAside, contains_tracer, currently_jitting


class Resolved(NamedTuple):
    """One call, resolved."""

    leaves: list[Any]  # the function's own leaves, then every argument's, in order
    key: tuple[Any, ...]  # spec ids (and sorted keyword names): selects the compiled entry
    nnx_args: list[Any]  # the adapter's NnxArg per NNX argument, for write-back
    args: tuple[Any, ...]  # the positional arguments (keywords bound to positions where possible)
    kwargs: dict[str, Any]
    first_known: bool  # the first argument was in the identity cache before this call
    joint: bool = False  # its NNX objects were flattened jointly (they share nodes or Variables)
    # (joint) per NNX object, (the object, its entry, the entry's `version`) as the first,
    # separate read found them before the joint flatten (None: no entry)
    read_before: tuple[Any, ...] = ()


def resolve_call(
    state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], check_only: bool = False
) -> Resolved | None:
    """Resolve every argument of one call. Returns None if the arguments do not fit the
    function's signature (the caller then lets the function raise its own TypeError).
    NNX arguments that share objects are flattened jointly (as nnx.jit does).

    `check_only`: the agreement mode's second reading of a call a hit served, as the hit
    dispatches it. It notes nothing for later calls (`resolve`), so the routes they take stay
    as they were, and it reads NNX arguments inside an outer trace too (the hit served the
    call nested there; a call resolved to be run raises `StepAside` instead)."""
    # (called by nnx.cached_partial, which hands its static cache to the next NNX transform:
    # consumed here, whatever the arguments; the fast paths leave such calls to this path)
    if not check_only:  # (the agreement mode compares no call while the cache waits)
        _plan.consume_static_cache()
    if kwargs and state.signature is not None:
        try:
            bound = state.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        args, kwargs = bound.args, bound.kwargs
    resolved = _resolve_all(state, fun_leaves, args, kwargs, None, check_only)
    if resolved.nnx_args and not check_only and currently_jitting():
        # NNX objects inside an outer transformation (nnx.grad, nnx.checkify, jax.jit, ...):
        # NNX state changed inside must stay in that trace, so run inline, as nnx.jit
        # effectively does (NNX itself then refuses to mutate objects from outside it).
        raise StepAside
    if len(resolved.nnx_args) > 1 and _nnx_gate.adapter().overlapping(resolved.nnx_args):
        if state.options.graph is False:  # (nnx.jit's tree mode refuses shared Variables)
            raise _nnx_gate.adapter().aliasing_error("two arguments")
        before = tuple(
            (a.obj, a.entry, a.entry.version) if a.entry is not None else None for a in resolved.nnx_args
        )
        resolved = _resolve_all(state, fun_leaves, args, kwargs, _nnx_gate.adapter().joint_index(), check_only)
        resolved = resolved._replace(read_before=before)
    return resolved


def _resolve_all(
    state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], joint: Any, check_only: bool
) -> Resolved:
    leaves = list(fun_leaves)
    key: list[Any] = []
    nnx_args: list[Any] = []
    static_argnums = state.static_positions(len(args))
    trace_scalars = state.options.trace_scalars
    as_pytree = state.options.nnx_as_pytree
    first_known = False
    if args:
        first_known = _flatten.lookup(args[0], adopt=not check_only) is not None
    for i, a in enumerate(args):
        if i in static_argnums:
            key.append(static_spec(a, state.arg_name(i)).id)
        elif type(a) is ArrayImpl:
            leaves.append(a)
            key.append(0)
        else:
            key.append(resolve(a, leaves, state.arg_name(i), nnx_args, joint, trace_scalars, check_only, as_pytree))
    if kwargs:
        names = tuple(sorted(kwargs))
        key.append(names)
        for name in names:
            if name in state.static_argnames:
                key.append(static_spec(kwargs[name], name).id)
            else:
                key.append(resolve(kwargs[name], leaves, name, nnx_args, joint, trace_scalars, check_only, as_pytree))
    return Resolved(leaves, tuple(key), nnx_args, args, kwargs, first_known, joint is not None)


def resolve(
    value: Any,
    leaves: list[Any],
    arg_name: str,
    nnx_args: list[Any],
    joint: Any = None,
    trace_scalars: bool = False,
    check_only: bool = False,
    nnx_as_pytree: bool = False,
) -> int:
    """Append `value`'s dynamic leaves to `leaves`; return its spec id.

    NNX objects also append their NnxArg to `nnx_args`. With `joint` (a RefMap shared
    by the call's NNX arguments), NNX objects are flattened together. `trace_scalars`:
    Python scalars outside Equinox modules are traced (`fastcall.jit`, as jax.jit and
    nnx.jit do) rather than static (`fastcall.filter_jit`, as eqx.filter_jit does).
    `check_only`: nothing is cached by identity, marked as seen or learnt as a template.
    `nnx_as_pytree`: NNX objects are plain pytrees (`fastcall.jit(nnx_as_pytree=True)`,
    jax.jit's semantics): flattened and read as any other pytree, never by the adapter.
    """
    hit = _flatten.lookup(value, adopt=not check_only)
    if hit is not None:  # seen before, same object (and every list or dict in it unchanged)
        leaves += hit.leaves
        return hit.spec_id
    if not nnx_as_pytree and _nnx_gate.is_node(value):
        return _nnx_gate.adapter().read_argument(value, leaves, arg_name, nnx_args, joint)
    if not nnx_as_pytree and _nnx_gate.is_graphdef(value):  # (the functional API: static, compared by value)
        return _nnx_gate.adapter().read_graphdef(value, arg_name, trace_scalars)
    for template in _codegen.templates.get(type(value), ()):
        if not template.serves(trace_scalars, nnx_as_pytree):
            continue
        found = template.extract(value)
        if found is not None:
            leaves += found
            spec = template.spec
            if template.rule is not None or check_only:  # (a scalar rule's read: not cached by identity)
                return spec.id
            if spec.cacheable:
                remember(value, found, spec)
            elif spec.guardable and _flatten.seen_before(value):
                _flatten.remember_guarded(value, found, spec)  # (a new object each call is not)
            return spec.id
    adapter = None if nnx_as_pytree else _nnx_gate.loaded()
    if adapter is not None and adapter.holds_nodes(value):
        return adapter.read_container(value, leaves, arg_name, nnx_args, joint, trace_scalars)
    if _flatten.is_traced_leaf(value, trace_scalars):
        leaves.append(value)  # (jax.jit traces a Python scalar weakly typed; a tracer of an
        return 0  # outer transformation goes to jax.jit as such: a nested jit, as eqx.filter_jit)
    scalar = _scalar_spec(value)
    if scalar is not None:
        return scalar
    spec, dynamic = _flatten.flatten_generic(value, arg_name, trace_scalars)
    if spec.has_nnx and not nnx_as_pytree:  # NNX objects inside a container: each read as if passed on its own
        return _nnx_gate.adapter().read_container(value, leaves, arg_name, nnx_args, joint, trace_scalars)
    if spec.has_nnx and any(_nnx_gate.is_node(s) for s in spec.statics):
        raise _nnx_leaf_error(arg_name)
    leaves.extend(dynamic)
    if contains_tracer(dynamic) or check_only:  # (tracers are never cached)
        return spec.id
    # The identity cache is shared by functions of either scalar rule: it holds no object
    # that the two read differently (the template made next knows which rule it reads by);
    # nor NNX objects read as pytrees (`nnx_as_pytree`), which other functions read as NNX
    # objects (their template, a FlattenTemplate, serves such functions only).
    if _flatten.read_alike(spec, dynamic) and not spec.has_nnx:
        if spec.cacheable:
            remember(value, tuple(dynamic), spec)
        elif spec.guardable and _flatten.seen_before(value):
            _flatten.remember_guarded(value, tuple(dynamic), spec)
    if not spec.templated:
        spec.templated = _codegen.learn(value, spec, dynamic, trace_scalars)
    return spec.id


def static_spec(value: Any, arg_name: str) -> Spec:
    """The Spec of an argument marked static (static_argnums / static_argnames). One that is
    or holds an NNX object is refused (nnx.jit refuses it too, in graph mode; jax.jit and
    nnx.jit(graph=False) key the program on the object's identity, and its later changes are
    never seen): checked before its spec is first interned, so once per static value."""
    if _flatten.is_array(value):
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is marked static "
            "(static_argnums/static_argnames) but is an array. Arrays cannot be part "
            "of the compile key: drop it from static_argnums/static_argnames (arrays "
            "are traced automatically)."
        )
    try:
        key = ("static", _flatten.leaf_key(value))
        hash(key)
    except FastcallError:
        raise
    except Exception as err:
        if _nnx_gate.flax_imported() and _holds_nnx(value):
            raise _static_nnx_error(arg_name) from None
        raise FastcallError(
            f"fastcall.jit: {describe_arg(arg_name)} is marked static "
            f"(static_argnums/static_argnames) but is not hashable "
            f"({type(err).__name__}: {err}). Pass a hashable value, or drop it from "
            "static_argnums/static_argnames so that its arrays are traced."
        ) from None
    found = _flatten.interned(key)
    if found is not None:
        return found
    if _nnx_gate.flax_imported() and _holds_nnx(value):
        raise _static_nnx_error(arg_name)
    return _flatten.intern(Spec("static", None, (), (value,)), key)


def _nnx_leaf_error(arg_name: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit(nnx_as_pytree=True): {describe_arg(arg_name)} holds an NNX object that is not a "
        "pytree (a module declared with pytree=False), so jax.jit would refuse it as an argument, and as a "
        "static value its Variables would be baked into the compiled program. Pass it without "
        "nnx_as_pytree, or declare it a pytree."
    )


def _static_nnx_error(arg_name: str) -> FastcallError:
    return FastcallError(
        f"fastcall.jit: {describe_arg(arg_name)} is marked static (static_argnums/static_argnames) but "
        "holds an NNX object: its Variables would be baked into the compiled program and go stale "
        "when they change. Pass it as an ordinary argument: its Variables are traced, and what the "
        "function changes in them is written back."
    )


def _holds_nnx(value: Any) -> bool:
    """Whether a static argument is, or holds in a pytree, an NNX object or State."""
    try:
        leaves = jax.tree_util.tree_leaves(value, is_leaf=_nnx_gate.reads_as_node)
    except Exception:  # (a container jax cannot flatten: as a leaf)
        leaves = [value]
    return any(_nnx_gate.reads_as_node(x) for x in leaves)


_SCALARS = (int, float, bool, str, complex, type(None))
_scalar_specs: dict[Any, Spec] = {}


def _scalar_spec(value: Any) -> int | None:
    """Spec id of a Python scalar argument (static), without tree_flatten."""
    if type(value) not in _SCALARS:
        return None
    key = _flatten.leaf_key(value)
    spec = _scalar_specs.get(key)
    if spec is None:
        spec, _ = _flatten.flatten_generic(value, "scalar")
        if len(_scalar_specs) > 4096:
            _scalar_specs.clear()
        _scalar_specs[key] = spec
    return spec.id


def clear() -> None:
    _scalar_specs.clear()

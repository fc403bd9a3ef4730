"""Cheap questions about JAX's trace state.

`currently_jitting()` answers "is a JAX transformation tracing right now?" in
about 0.2 us by reading JAX's trace context directly. (Equinox once answered it
by building an array and checking whether the result was a tracer, which cost
tens of microseconds.) The hot path of `fastcall.jit` does not even pay that:
a tracer argument fails the `type(x) is ArrayImpl` test and falls into the
slow path, where `contains_tracer` decides to step aside.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import jax.numpy as jnp

Tracer = jax.core.Tracer


class StepAside(Exception):
    """An argument holds a tracer: the call comes from inside an outer JAX
    transformation, so the function runs inline in that trace instead."""

try:  # jax >= 0.4.36 keeps the current trace in a context object.
    from jax._src import core as _core
    from jax._src.core import trace_ctx as _trace_ctx

    _trace_ctx.is_top_level()  # check that the private route still works
    _is_top_level = _trace_ctx.is_top_level

except Exception:  # pragma: no cover - fallback for other jax versions

    def _is_top_level() -> bool:
        return not isinstance(jnp.zeros(()) + 1, Tracer)


def currently_jitting() -> bool:
    """True while a JAX transformation (jit, grad, vmap, scan, ...) is tracing.

    Use it to skip Python-side work that needs concrete values (printing,
    logging, checks with `if`) while a function is being traced, or to take
    another branch under a transformation. It reads JAX's trace context
    directly, so it costs about 0.2 us, where building an array to see whether
    it comes back a tracer costs tens of microseconds (what it falls back to on
    a jax whose trace context it cannot read).

    **Returns:**

    `False` in ordinary eager Python, `True` inside any traced function (a
    `fastcall.jit` or `jax.jit` function while it is traced, a `jax.grad`,
    `jax.vmap` or `lax.scan` body, ...).

    **Example:**

    ```python
    import jax

    import fastcall

    print(fastcall.currently_jitting())

    @jax.jit
    def f(x):
        print("tracing:", fastcall.currently_jitting())
        return x + 1

    f(1.0)
    ```
    ```text
    False
    tracing: True
    ```
    """
    return not _is_top_level()


def _top_level_probe() -> tuple[tuple[Any, str, Any], ...] | None:
    """`currently_jitting()` as (holder, attribute, value) triples for the compiled hit routes:
    eager Python exactly when `getattr(holder, attribute) is value` for each. This is what
    `trace_ctx.is_top_level()` compares (the current trace is the eval trace, the axis
    environment the top one), read without a Python frame: inside a call that the trace
    check would otherwise dominate, calling it costs more than the rest of the check.

    The state lives in jaxlib's context-local config objects (jax >= 0.9: `.value`) or on
    the thread-local context itself (older jax). Used only if it agrees with
    `is_top_level()` outside and inside a trace here; otherwise None, and those routes call
    `currently_jitting` instead."""
    try:
        top = (_core.eval_trace, _core.top_axis_env)
        config_objects = (getattr(_core, "trace_state_strong_ref", None), getattr(_core, "axis_env_state", None))
        if all(hasattr(c, "value") for c in config_objects):
            probe = tuple((c, "value", v) for c, v in zip(config_objects, top))
        else:
            probe = ((_trace_ctx, "trace", top[0]), (_trace_ctx, "axis_env", top[1]))

        def eager(probe: tuple[tuple[Any, str, Any], ...]) -> bool:
            return all(getattr(holder, name) is value for holder, name, value in probe)

        seen: list[bool] = []

        def traced() -> Any:
            seen.append(eager(probe) == _trace_ctx.is_top_level())
            return 0

        jax.make_jaxpr(traced)()
        agrees = seen == [True] and eager(probe) and _trace_ctx.is_top_level()
        return probe if agrees else None
    except Exception:  # pragma: no cover - depends on jax internals
        return None


TOP_LEVEL_PROBE = _top_level_probe()


def contains_tracer(leaves: Iterable[Any]) -> bool:
    """Whether any of `leaves` is a tracer (an argument that comes from an outer trace)."""
    for leaf in leaves:
        if isinstance(leaf, Tracer):
            return True
    return False


def _jaxpr_has_callback(eqns: Iterable[Any]) -> bool:
    for eqn in eqns:
        if "callback" in eqn.primitive.name:
            return True
        for param in eqn.params.values():
            subs = param if isinstance(param, (tuple, list)) else (param,)
            for sub in subs:
                jaxpr = getattr(sub, "jaxpr", sub)
                inner = getattr(jaxpr, "eqns", None)
                if inner is not None and _jaxpr_has_callback(inner):
                    return True
    return False


def current_trace_has_callback() -> bool:
    """Whether the function being traced right now contains a host callback.

    `eqx.error_if` raises through a `pure_callback` that only fires when the
    program runs; its error surfaces only when someone waits for the result. A
    function with such a check is therefore dispatched and then waited on (as
    `eqx.filter_jit` does for every function), so that the error reaches the
    caller at the call. Called at trace time only. If JAX's internals cannot be
    read, answers True: waiting is slower but never hides an error.
    """
    try:
        frame = _trace_ctx.trace.frame  # type: ignore[union-attr]  # typed Trace | None in jax 0.8
        eqns = []
        for ref in frame.tracing_eqns:
            eqn = ref() if callable(ref) and not hasattr(ref, "primitive") else ref
            if eqn is not None:
                eqns.append(eqn)
        return _jaxpr_has_callback(eqns)
    except Exception:  # pragma: no cover - depends on jax internals
        return True

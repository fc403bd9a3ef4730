# cython: language_level=3, wraparound=False, boundscheck=False
"""Cheap questions about JAX's trace state.

`currently_jitting()` answers "is a JAX transformation tracing right now?" in
about 0.2 us by reading JAX's trace context directly. (Equinox once answered it
by building an array and checking whether the result was a tracer, which cost
tens of microseconds.) The hot path of `fastcall.jit` does not even pay that:
a tracer argument fails the `type(x) is ArrayImpl` test and falls into the
slow path, where `contains_tracer` decides to step aside.

The hit routes ask one question here before they serve a call with NNX objects,
`may_serve_nnx`. This module is one of the sources setup.py compiles with Cython (see
`fastcall/_rebuild.py`): compiled, the compiled hit routes call it as C (`_trace.pxd`), and it reads the trace
state without a Python frame.
"""

import _thread
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

if cython.compiled:
    from cython.cimports.fastcall._capi import dict_combined, dict_version, thread_id

COMPILED: bool = cython.compiled

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


def _top_level_probe() -> Optional[tuple]:
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
_PROBE = cython.declare(object, TOP_LEVEL_PROBE)  # (what at_top_level reads: use_probe)


def use_probe(probe: Optional[tuple]) -> None:
    """Read the trace state as `probe` says from now on (None: by calling
    `currently_jitting`). The import sets TOP_LEVEL_PROBE; tests set None, to run the other way."""
    global _PROBE
    _PROBE = probe


@cython.ccall
@cython.exceptval(-1, check=True)
def at_top_level() -> cython.bint:
    """`not currently_jitting()`, read as the probe says (no Python frame), or by calling
    it where no probe was found."""
    if _PROBE is None:
        return not currently_jitting()
    triple: tuple
    for triple in _PROBE:
        if getattr(triple[0], triple[1]) is not triple[2]:
            return False
    return True


# NNX's graph context (thread-local), put in this cell by the NNX adapter when it loads (or
# by `_plan.consume_static_cache`, for a call without NNX objects while flax.nnx is
# imported). While its `tmp_static_cache` is set (nnx.cached_partial is calling the function
# with its cache pending), no hit route serves an NNX call: the general path consumes the
# cache (flax raises if nobody does).
GRAPH_CONTEXT: list = [None]
_GRAPH_CONTEXT = cython.declare(list, GRAPH_CONTEXT)
_LOCAL = cython.declare(object, _thread._local)
_ABSENT = cython.declare(object, object())
# (compiled) What the calling thread's graph-context dict said last: see `_kept_says`
_kept_context = cython.declare(object, None)
_kept_dict = cython.declare(object, None)
_kept_thread = cython.declare(cython.ulonglong, 0)
_kept_version = cython.declare(cython.ulonglong, 0)
_kept_pending = cython.declare(cython.bint, False)


@cython.ccall
@cython.exceptval(-1, check=True)
def static_cache_pending() -> cython.bint:
    """Whether nnx.cached_partial's static cache waits to be consumed (see GRAPH_CONTEXT)."""
    context = _GRAPH_CONTEXT[0]
    if context is None:
        return False
    if cython.compiled:
        said: cython.int = _kept_says(context)
        if said >= 0:
            return said == 1
    return getattr(context, "tmp_static_cache") is not None


@cython.cfunc
@cython.exceptval(-3, check=True)
def _kept_says(context: Any) -> cython.int:
    """(compiled) `static_cache_pending()` as the calling thread's dict of `context` says:
    for a `_thread._local` (one dict per thread state, which a thread's greenlets share), that
    dict, kept from the last call in the same thread state (known by its id, which no other
    gets), read directly; and what it said then, while its version tag is unchanged. -2 where
    this is not known so (another kind of context, or the name not in the dict: getattr reads
    it, from the class)."""
    global _kept_context, _kept_dict, _kept_thread, _kept_version, _kept_pending
    thread: cython.ulonglong = thread_id()
    if context is _kept_context and thread == _kept_thread:
        d = _kept_dict
    elif isinstance(context, _LOCAL):
        d = context.__dict__
        # (the old ones held until this returns: releasing them may run code that enters here)
        old = (_kept_context, _kept_dict)  # noqa: F841
        _kept_context = context
        _kept_dict = d
        _kept_thread = thread
        _kept_version = 0
    else:
        return -2
    if type(d) is not dict:
        return -2
    version: cython.ulonglong = dict_version(d) if dict_combined(d) and d is _kept_dict else 0
    if version != 0 and version == _kept_version:
        return _kept_pending
    found = cython.cast(dict, d).get("tmp_static_cache", _ABSENT)
    if found is _ABSENT:
        return -2
    pending: cython.bint = found is not None
    if version != 0 and d is _kept_dict:
        _kept_version = version
        _kept_pending = pending
    return pending


@cython.ccall
@cython.exceptval(-1, check=True)
def may_serve_nnx(nested_ok: cython.bint) -> cython.bint:
    """Whether a hit route may serve a call with NNX objects now: no nnx.cached_partial
    cache pending (the general path consumes it), and, unless `nested_ok` (the call writes
    nothing back and may run nested in a trace: FunctionState.serves_nested), no JAX trace
    running (the general path runs such a call inline in that trace, since state changed
    inside must stay in it)."""
    if static_cache_pending():
        return False
    return nested_ok or at_top_level()


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

"""Ahead-of-time objects: `wrapped.trace(...)` -> `Traced`, `wrapped.lower(...)` (or
`traced.lower()`) -> `Lowered`, `.compile()` -> `Compiled`; and `wrapped.eval_shape(...)`.

They resolve arguments exactly as a call does (`_args.resolve_call`) and a
`Compiled` runs through the same `_dispatch.run`, so calling it writes NNX
state back like a normal call. Everything else (`cost_analysis`,
`memory_analysis`, `as_text`, `compiler_ir`, shardings, ...) is delegated to
the underlying jax objects, which describe the program over flat leaves.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from . import _args, _dispatch, _function
from ._errors import FastcallError, for_decorator
from ._options import UNSPECIFIED
from ._outputs import Varying
from ._trace import StepAside


def lowering(state: Any, fun_leaves: tuple[Any, ...], bound: tuple[Any, ...]) -> Any:
    """A wrapper's `.lower`: `bound`, the leading arguments `fastcall.partial` bound (the
    `Compiled` it gives takes the remaining ones too)."""

    def lower_call(*args: Any, **kwargs: Any) -> Lowered:
        return lower(state, fun_leaves, (*bound, *args), kwargs, len(bound))

    lower_call.__doc__ = "Trace and lower for these arguments (as `jax.jit(...).lower`)."
    return lower_call


def tracing(state: Any, fun_leaves: tuple[Any, ...], bound: tuple[Any, ...]) -> Any:
    """A wrapper's `.trace` (`bound` as for `lowering`)."""

    def trace_call(*args: Any, **kwargs: Any) -> Traced:
        return trace(state, fun_leaves, (*bound, *args), kwargs, len(bound))

    trace_call.__doc__ = "Trace for these arguments (as `jax.jit(...).trace`); `.lower()` lowers it."
    return trace_call


def shape_evaluation(state: Any, fun_leaves: tuple[Any, ...], bound: tuple[Any, ...]) -> Any:
    """A wrapper's `.eval_shape` (`bound` as for `lowering`)."""

    def eval_shape_call(*args: Any, **kwargs: Any) -> Any:
        return eval_shape(state, fun_leaves, (*bound, *args), kwargs)

    eval_shape_call.__doc__ = (
        "The output's structure, with a `jax.ShapeDtypeStruct` for each array (as `jax.jit(...).eval_shape`); "
        "runs nothing and writes nothing back."
    )
    return eval_shape_call


def _entry_for(
    state: Any,
    fun_leaves: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    what: str,
    step_aside: bool = False,
):
    """The call's resolution and its compiled entry, as a call finds them: for `.lower`,
    `.trace` and `.eval_shape`, whose arguments may hold `jax.ShapeDtypeStruct`s for arrays.
    `step_aside`: let `StepAside` through (NNX objects inside an outer trace)."""
    try:
        resolved = _args.resolve_call(state, fun_leaves, args, kwargs)
    except StepAside:
        if step_aside:
            raise
        raise FastcallError(
            f"{state.decorator}(...).{what}: the arguments contain tracers; call it outside of any jax transformation."
        ) from None
    except FastcallError as err:
        raise for_decorator(err, state.decorator) from err.__cause__
    if resolved is None:
        state.fun(*args, **kwargs)  # raises the function's own TypeError
        raise FastcallError(f"{state.decorator}(...).{what}: could not bind the arguments.")
    return resolved, state.table.get(resolved.key) or state.entry(resolved.key)


def lower(
    state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], n_bound: int = 0
) -> Lowered:
    """Trace and lower `state`'s function for these arguments (as `jax.jit(...).lower`); the
    first `n_bound` were bound by `fastcall.partial`."""
    resolved, entry = _entry_for(state, fun_leaves, args, kwargs, "lower")
    lowered = entry.fn.lower(*resolved.leaves)
    return Lowered(lowered, entry, state, fun_leaves, resolved.key, tuple(args[:n_bound]))


def trace(
    state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], n_bound: int = 0
) -> Traced:
    """Trace `state`'s function for these arguments (as `jax.jit(...).trace`)."""
    resolved, entry = _entry_for(state, fun_leaves, args, kwargs, "trace")
    traced = entry.fn.trace(*resolved.leaves)
    return Traced(traced, entry, state, fun_leaves, resolved.key, tuple(args[:n_bound]), (args, kwargs))


def eval_shape(state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The output structure of a call with these arguments, a `jax.ShapeDtypeStruct` for
    each array (as `jax.jit(...).eval_shape`): traced, not run; nothing written back."""
    try:
        resolved, entry = _entry_for(state, fun_leaves, args, kwargs, "eval_shape", step_aside=True)
    except StepAside:  # (NNX objects inside an outer trace: nothing is written back here anyway)
        return eval_shape(_as_pytree(state), fun_leaves, args, kwargs)
    flat = entry.fn.eval_shape(*resolved.leaves)
    info = flat.info if type(flat) is Varying else entry.out  # (Varying: it carries its structure)
    assert info is not None  # (recorded by the trace that eval_shape ran or found)
    if info.holds_nnx_objects:
        # NNX objects returned come back new, holding the abstract values, as nnx.jit's
        # eval_shape returns them: what the same function reading NNX objects as pytrees
        # gives (which writes nothing back either)
        return eval_shape(_as_pytree(state), fun_leaves, args, kwargs)
    return info.shapes(flat.flat if type(flat) is Varying else flat)


def _as_pytree(state: Any) -> Any:
    """The state of `state`'s function with `nnx_as_pytree` (jax.jit's reading of NNX objects)."""
    return _function.state_for(state.fun, state.fun_spec, state.options._replace(nnx_as_pytree=True), state.user_fun)


class Traced:
    """A fastcall function traced for some arguments, not yet lowered.

    Made by `f.trace(*args, **kwargs)`, called with the arguments of a call (arrays or
    `jax.ShapeDtypeStruct`s), as `jax.jit(f).trace(...)`. The program is that of the
    function over the flat array leaves of the arguments, so jax's descriptions of it
    (`.jaxpr`, `.out_info`, ...) list leaves, not pytrees.

    **Methods:**

    - `.lower()` -> `fastcall.Lowered`.
    - everything else of `jax.stages.Traced`, forwarded to it: `.jaxpr`, `.out_info`, ...

    `jax.export.export(f)` works on a fastcall function whose arguments are arrays (or
    `jax.ShapeDtypeStruct`s), pytrees of them and static arguments, as it works on
    `jax.jit(f)`: an exported function is called on your arguments' structure, so what is
    exported is `jax.jit`'s program of `f` with the same static and sharding options
    (the same computation; fastcall's own runs over the flat leaves).

    **Example:**

    ```python
    import jax
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit
    def scale(x, s):
        return x * s

    traced = scale.trace(jax.ShapeDtypeStruct((3,), jnp.float32), 2.0)
    print([eqn.primitive.name for eqn in traced.jaxpr.eqns])
    print(traced.lower().compile()(jnp.ones(3), 2.0))
    ```
    ```text
    ['convert_element_type', 'mul']
    [2. 2. 2.]
    ```
    """

    def __init__(
        self,
        traced: Any,
        entry: Any,
        state: Any,
        fun_leaves: tuple[Any, ...],
        key: Any,
        bound: tuple[Any, ...],
        call: tuple[tuple[Any, ...], dict[str, Any]],
    ):
        self._traced = traced
        self._lowering = (entry, state, fun_leaves, key, bound)
        self._call = call  # (the arguments it was traced for, the bound ones first)
        self._exported: Any = None  # (jax.jit's trace of the function, once jax.export lowered it)

    def lower(self, **kwargs: Any) -> Any:
        if kwargs:  # (only jax.export passes any: lowering platforms, private parameters)
            return self._lower_for_export(kwargs)
        return Lowered(self._traced.lower(), *self._lowering)

    def _lower_for_export(self, lower_kwargs: dict[str, Any]) -> Any:
        """jax.export's lowering: jax.jit's program of the function over the arguments'
        own structure (what an exported function is called with), under the wrapper's
        static and sharding options. jax.export then reads the `jaxpr` and `fun_name` of
        this trace: from here on they are forwarded from it (`.lower()` still lowers
        fastcall's own program)."""
        entry, state, fun_leaves, key, bound = self._lowering
        fun = state.fun_spec.rebuild(list(fun_leaves))
        options, n = state.options, len(bound)
        if bound:  # (fastcall.partial: the bound objects are closed over, not arguments)
            fun = functools.partial(fun, *bound)
        bound_names = set(state.param_names[:n])
        jit_kwargs: dict[str, Any] = {"keep_unused": options.keep_unused}
        if options.static_argnums:  # (counted after the bound arguments, as the partial takes them)
            jit_kwargs["static_argnums"] = tuple(
                i - n if i >= 0 else i for i in options.static_argnums if i < 0 or i >= n
            )
        if options.static_argnames:
            jit_kwargs["static_argnames"] = tuple(a for a in options.static_argnames if a not in bound_names)
        for name in ("in_shardings", "out_shardings"):
            given = getattr(options, name)
            if given is UNSPECIFIED:
                continue
            if name == "in_shardings" and n and type(given) in (tuple, list):
                given = type(given)(given[n:])
            jit_kwargs[name] = given
        args, kwargs = self._call
        try:
            traced = jax.jit(fun, **jit_kwargs).trace(*args[n:], **kwargs)
        except TypeError as err:
            if not any(words in str(err) for words in ("as an abstract array", "not a valid JAX type")):
                raise  # (the function's own error)
            raise FastcallError(
                f"jax.export exports jax.jit's program of the function over its arguments, where "
                f"every leaf of an argument that is not static must be an array: {err}"
            ) from err
        self._exported = traced
        return traced.lower(**lower_kwargs)

    def __getattr__(self, name: str) -> Any:  # jaxpr, out_info, fun_name, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._exported if self._exported is not None else self._traced, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self._traced) if not n.startswith("_")})


class Lowered:
    """A fastcall function traced and lowered for some arguments, not yet compiled.

    Made by `f.lower(*args, **kwargs)` on a function wrapped by `fastcall.jit` (or
    `fastcall.filter_jit`, `fastcall.partial`), called with the arguments of a call,
    static ones included, as `jax.jit(f).lower(...)`. Use it to inspect the program
    (its StableHLO text, its cost) or to compile ahead of time. The program is that
    of the function over the flat array leaves of the arguments, so jax's own
    descriptions of it (`in_avals`, `args_info`, ...) list leaves, not pytrees.

    **Methods:**

    - `.compile(*args, **kwargs)` -> `fastcall.Compiled`: compile the program
      (arguments passed on to jax's `Lowered.compile`, e.g. `compiler_options`).
    - everything else of `jax.stages.Lowered`, forwarded to it: `.as_text()`,
      `.compiler_ir()`, `.cost_analysis()`, `.in_avals`, `.out_info`, ...

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit(static_argnames="n")
    def power(x, n):
        return x**n

    x = jnp.arange(3.0)
    lowered = power.lower(x, n=2)  # the arguments of a call, static ones included
    assert isinstance(lowered, fastcall.Lowered)
    assert "stablehlo" in lowered.as_text()
    compiled = lowered.compile()
    print(compiled(x, n=2))
    ```
    ```text
    [0. 1. 4.]
    ```
    """

    def __init__(self, lowered: Any, entry: Any, state: Any, fun_leaves: Any, key: Any, bound: tuple[Any, ...] = ()):
        self._lowered = lowered
        self._entry = entry
        self._state = state
        self._fun_leaves = fun_leaves
        self._key = key
        self._bound = bound  # (bound by fastcall.partial: the Compiled takes the rest)

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self._lowered.compile(*args, **kwargs), self)

    def __getattr__(self, name: str) -> Any:  # as_text, compiler_ir, cost_analysis, ...
        if name.startswith("_"):  # (not set yet, e.g. while copying: no recursion)
            raise AttributeError(name)
        return getattr(self._lowered, name)

    def __dir__(self) -> list[str]:  # (what it forwards, listed: tab completion, help)
        return sorted(set(super().__dir__()) | {n for n in dir(self._lowered) if not n.startswith("_")})


class Compiled:
    """A fastcall function compiled ahead of time: call it with the original arguments.

    Made by `f.lower(*args, **kwargs).compile()` (see `fastcall.Lowered`). Calling it
    runs the compiled program as a call of `f` would, NNX state written back
    included, without tracing or compiling anything; such calls are not counted in
    `f.stats()`.

    **Methods:**

    - `compiled(*args, **kwargs)`: run it. Takes the arguments `f.lower` took, static
      ones included (for a `fastcall.partial`, the remaining arguments only). Arrays
      must have the shapes and dtypes it was compiled for (else jax raises a
      `TypeError`); the static part (structure and non-array values) must equal the
      one it was compiled for, else `fastcall.FastcallError`: lower and compile
      again for those arguments.
    - everything else of `jax.stages.Compiled`, forwarded to it: `.as_text()`,
      `.cost_analysis()`, `.memory_analysis()`, `.input_shardings`, ...

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit(static_argnames="n")
    def power(x, n):
        return x**n

    x = jnp.arange(3.0)
    compiled = power.lower(x, n=2).compile()
    print(compiled(x, n=2))
    try:
        compiled(x, n=3)  # another static value: not this program
    except fastcall.FastcallError as err:
        print(err)
    ```
    ```text
    [0. 1. 4.]
    fastcall Compiled: the static part of these arguments ... differs from the one this was compiled for; ...
    ```
    """

    def __init__(self, compiled: Any, lowered: Lowered) -> None:
        self._compiled = compiled
        self._lowered = lowered

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        low = self._lowered
        try:
            resolved = _args.resolve_call(low._state, low._fun_leaves, (*low._bound, *args), kwargs)
        except FastcallError as err:
            raise for_decorator(err, low._state.decorator) from err.__cause__
        if resolved is None:
            raise FastcallError("fastcall Compiled: could not bind the arguments.")
        if resolved.key != low._key:
            raise FastcallError(
                "fastcall Compiled: the static part of these arguments (structure or "
                "non-array values) differs from the one this was compiled for; lower and "
                "compile again for these arguments."
            )
        return _dispatch.run(low._state, low._entry, resolved, executable=self._compiled)

    def __getattr__(self, name: str) -> Any:  # as_text, cost_analysis, memory_analysis, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._compiled, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self._compiled) if not n.startswith("_")})

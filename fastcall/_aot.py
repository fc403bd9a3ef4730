"""Ahead-of-time objects: `wrapped.lower(...)` -> `Lowered`, `.compile()` -> `Compiled`.

They resolve arguments exactly as a call does (`_args.resolve_call`) and a
`Compiled` runs through the same `_dispatch.run`, so calling it writes NNX
state back like a normal call. Everything else (`cost_analysis`,
`memory_analysis`, `as_text`, `compiler_ir`, shardings, ...) is delegated to
the underlying jax objects, which describe the program over flat leaves.
"""

from __future__ import annotations

from typing import Any

from . import _args, _dispatch
from ._errors import FastcallError, for_decorator
from ._trace import StepAside


def lowering(state: Any, fun_leaves: tuple[Any, ...], bound: tuple[Any, ...]) -> Any:
    """A wrapper's `.lower`: `bound`, the leading arguments `fastcall.partial` bound (the
    `Compiled` it gives takes the remaining ones too)."""

    def lower_call(*args: Any, **kwargs: Any) -> Lowered:
        return lower(state, fun_leaves, (*bound, *args), kwargs, len(bound))

    lower_call.__doc__ = "Trace and lower for these arguments (as `jax.jit(...).lower`)."
    return lower_call


def lower(
    state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any], n_bound: int = 0
) -> Lowered:
    """Trace and lower `state`'s function for these arguments (as `jax.jit(...).lower`); the
    first `n_bound` were bound by `fastcall.partial`."""
    try:
        resolved = _args.resolve_call(state, fun_leaves, args, kwargs)
    except StepAside:
        raise FastcallError(
            f"{state.decorator}(...).lower: the arguments contain tracers; lower outside of any jax transformation."
        ) from None
    except FastcallError as err:
        raise for_decorator(err, state.decorator) from err.__cause__
    if resolved is None:
        state.fun(*args, **kwargs)  # raises the function's own TypeError
        raise FastcallError(f"{state.decorator}(...).lower: could not bind the arguments.")
    entry = state.table.get(resolved.key) or state.entry(resolved.key)
    lowered = entry.fn.lower(*resolved.leaves)
    return Lowered(lowered, entry, state, fun_leaves, resolved.key, tuple(args[:n_bound]))


class Lowered:
    """A lowered fastcall function (from `wrapped.lower(...)`). `.compile()` gives a
    callable taking the same arguments (static ones included)."""

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
    """An ahead-of-time compiled fastcall function: call it with the original arguments."""

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

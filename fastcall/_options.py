"""The options of one `fastcall.jit(...)` call, as one frozen record.

Built once per decoration (like jax's `PjitInfo`); every later step reads its
fields by name and nobody re-parses options. The record is hashable, so that
wrappers of equal functions with equal options share compiled programs.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Literal, NamedTuple

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
DONATE_MODES = ("all", "all-except-first", "warn", "warn-except-first", "none")


class _Unspecified:
    def __repr__(self) -> str:
        return "UNSPECIFIED"


UNSPECIFIED: Any = _Unspecified()  # an option not given (None can be a meaningful value)


class JitOptions(NamedTuple):
    donate: Donate
    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    donate_argnums: tuple[int, ...]
    donate_argnames: tuple[str, ...]
    in_shardings: Any  # passed to jax.jit, per leaf (see _build)
    out_shardings: Any  # applied as a sharding constraint on the outputs
    device: Any
    backend: str | None
    keep_unused: bool
    inline: bool
    compiler_options: Any
    graph_updates: bool | None  # NNX: propagate structural changes made inside (None: yes)
    graph: bool | None  # NNX: False is nnx.jit's tree mode (no Variable shared between arguments)
    # Python scalars outside Equinox modules traced (fastcall.jit, as jax.jit/nnx.jit) or
    # static (fastcall.filter_jit, as eqx.filter_jit).
    trace_scalars: bool
    # NNX objects are plain pytrees, as jax.jit sees them (nothing written back, a shared
    # object passed once per place it is reached, returned objects new), not NNX objects
    # read and written back as nnx.jit reads them.
    nnx_as_pytree: bool = False
    # A model called again passes its small leaves packed, a few buffers per dtype
    # and device (`_pack`), at default options.
    pack: bool = True

    @property
    def decorator(self) -> str:
        """The decorator the user wrote, as errors and warnings name it (`_errors.for_decorator`)."""
        return decorator_name(self.trace_scalars)


def decorator_name(trace_scalars: bool) -> str:
    """`fastcall.jit` traces Python scalars; `fastcall.filter_jit` keeps them static."""
    return "fastcall.jit" if trace_scalars else "fastcall.filter_jit"


def make_options(**given: Any) -> JitOptions:
    """Validate and freeze the keyword options of `fastcall.jit`."""
    donate = given["donate"]
    if donate not in DONATE_MODES:
        raise ValueError(
            f"{decorator_name(given['trace_scalars'])}(donate=...) must be one of 'all', 'all-except-first', 'warn', "
            f"'warn-except-first' or 'none'; got {donate!r}."
        )
    for name in ("static_argnums", "donate_argnums"):
        given[name] = _as_ints(given[name])
    for name in ("static_argnames", "donate_argnames"):
        given[name] = _as_names(given[name])
    for name in ("in_shardings", "out_shardings", "compiler_options"):
        given[name] = _hashable(given[name])
    return JitOptions(**given)


def check_signature(options: JitOptions, fun: Callable[..., Any]) -> None:
    """At decoration, as jax.jit checks them: the argument numbers and names of `options`
    against `fun`'s signature (nothing to check where it has none): a ValueError, with
    jax.jit's message, for a number past the positional parameters (unless `*args`
    takes it), a name the function does not take (unless `**kwargs` does) or takes only
    by position, and an argument both static and donated."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return
    kinds = inspect.Parameter
    positional = [p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_position_only = {p.name for p in params if p.kind is kinds.POSITIONAL_ONLY}
    by_name = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
    n = len(positional)
    for option in ("static_argnums", "donate_argnums"):
        nums = getattr(options, option)
        if not var_positional and any(not -n <= i < n for i in nums):
            raise ValueError(f"Jitted function has {option}={nums}, but only accepts {n} positional arguments.")
    for option in ("static_argnames", "donate_argnames"):
        names = getattr(options, option)
        only_positional = {a for a in names if a in by_position_only}
        unknown = set() if var_keyword else {a for a in names if a not in by_name} - only_positional
        if unknown:
            raise ValueError(
                f"Jitted function has invalid argnames {unknown} in {option}. Function does not take these args."
            )
        if only_positional:
            raise ValueError(
                f"Jitted function has invalid argnames {only_positional} in {option}. These are positional-only"
            )

    def named(nums: tuple[int, ...], names: tuple[str, ...]) -> set[str]:
        # (as jax.jit infers them: the names given, else those of the positional-or-keyword
        # parameters the numbers count from the front)
        if names:
            return set(names)
        return {params[i].name for i in nums if 0 <= i < len(params) and params[i].kind is kinds.POSITIONAL_OR_KEYWORD}

    both = named(options.static_argnums, options.static_argnames) & named(
        options.donate_argnums, options.donate_argnames
    )
    if both:
        raise ValueError(
            "static_argnames and donate_argnames cannot intersect. Argument names "
            f"{both} appear in both static_argnames and donate_argnames"
        )


def _as_ints(x: Any) -> tuple[int, ...]:
    """Argument numbers as jax.jit takes them: one integer (a NumPy one too) or several."""
    if x is None:
        return ()
    try:
        return (operator.index(x),)
    except TypeError:
        return tuple(operator.index(i) for i in x)


def _as_names(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    if isinstance(x, str):
        return (x,)
    return tuple(x)


def _hashable(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_hashable(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x

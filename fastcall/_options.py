"""The options of one `fastcall.jit(...)` call, as one frozen record.

Built once per decoration (like jax's `PjitInfo`); every later step reads its
fields by name and nobody re-parses options. The record is hashable, so that
wrappers of equal functions with equal options share compiled programs.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

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


def make_options(**given: Any) -> JitOptions:
    """Validate and freeze the keyword options of `fastcall.jit`."""
    donate = given["donate"]
    if donate not in DONATE_MODES:
        raise ValueError(
            "fastcall.jit(donate=...) must be one of 'all', 'all-except-first', 'warn', "
            f"'warn-except-first' or 'none'; got {donate!r}."
        )
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
        given[name] = _as_tuple(given[name])
    for name in ("in_shardings", "out_shardings", "compiler_options"):
        given[name] = _hashable(given[name])
    return JitOptions(**given)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


def _hashable(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_hashable(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x

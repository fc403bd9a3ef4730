"""The names jax gives what fastcall traces, in its errors: the user's function and source
line, and each flat leaf as the user's argument and leaf path (`train`, `params['w']`,
`model.linear.kernel.value`), where jax would otherwise see only fastcall's function of
flat leaves (`flat_fn at _build.py`, `dyn[3]`).

jax reads a function's `__fun_debug_info__` in place of deriving the record from the
function's signature (`jax._src.api_util.debug_info`, the same in jax 0.8.1 through
0.12). That record, `jax._src.core.DebugInfo`, is private to jax: if it is missing or
differs, fastcall keeps jax's default naming, which is only less helpful.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import jax

from . import _nnx_gate

try:  # (private to jax: see the module docstring)
    from jax._src import api_util as _api_util
    from jax._src import core as _core

    _DEBUG_INFO: Any = _core.DebugInfo
    _INITIAL_RESULT_PATHS: Any = _core.initial_result_paths
    _fun_sourceinfo: Callable[[Any], str] | None = _api_util.fun_sourceinfo
except (ImportError, AttributeError):  # pragma: no cover - other jax internals
    _DEBUG_INFO = _INITIAL_RESULT_PATHS = _fun_sourceinfo = None


class Leaf:
    """A stand-in for one dynamic leaf, to find where the structure puts it."""

    __slots__ = ()


def attach(
    flat_fn: Callable[..., Any], fun: Any, specs: Sequence[Any], n_positional: int, keywords: Sequence[str]
) -> None:
    """Give `flat_fn` (which jax.jit traces over the flat leaves of `specs`: the function's
    own, then `n_positional` positional arguments, then the `keywords`) jax's record naming
    `fun` and the leaves."""
    if _DEBUG_INFO is None or _fun_sourceinfo is None:
        return
    try:
        source = _fun_sourceinfo(fun)
        names: list[str] = []
        for spec, name in zip(specs, ["fun", *argument_names(fun, n_positional, keywords)]):
            names.extend(leaf_names(spec, name))
        info = _DEBUG_INFO("jit", source, tuple(names), _INITIAL_RESULT_PATHS)
    except Exception:  # (naming must never stand in the way of the call)
        return
    flat_fn.__fun_debug_info__ = info  # type: ignore[attr-defined]


def argument_names(fun: Any, n_positional: int, keywords: Sequence[str]) -> list[str]:
    """The name of each argument of a call, as jax.jit names it: the parameter it binds
    to, `args[1]` for one gathered by `*args`, `kwargs['scale']` for one by `**kwargs`."""
    positional = [f"args[{i}]" for i in range(n_positional)]
    try:
        bound = inspect.signature(fun).bind_partial(*range(n_positional), **{k: k for k in keywords})
    except (TypeError, ValueError):
        return positional + list(keywords)
    by_index: dict[Any, str] = {}
    for param, value in bound.arguments.items():
        kind = bound.signature.parameters[param].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            by_index.update({(0, v): f"{param}[{j}]" for j, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            by_index.update({(1, k): f"{param}[{k!r}]" for k in value})
        elif param in keywords and value == param:
            by_index[(1, param)] = param
        else:
            by_index[(0, value)] = param
    return [by_index.get((0, i), positional[i]) for i in range(n_positional)] + [
        by_index.get((1, k), k) for k in keywords
    ]


def leaf_names(spec: Any, name: str) -> list[str]:
    """One name per dynamic leaf of an argument of this spec: its path, as jax.jit names
    the leaves of a pytree argument; the argument's name alone where the path cannot be
    told."""
    kind = spec.kind
    if kind == "array":
        return [name]
    if kind == "static" or spec.n_dyn == 0:
        return []
    if kind in ("nnx", "nnx-tree"):
        found = _nnx_gate.adapter().leaf_names(spec, name)
    else:
        found = tree_leaf_names(spec.treedef, spec.mask, spec.statics, name)
    return found if found is not None and len(found) == spec.n_dyn else [name] * spec.n_dyn


def tree_leaf_names(treedef: Any, mask: Sequence[bool], statics: Sequence[Any], name: str) -> list[str] | None:
    """The key paths of the dynamic leaves (`mask`) of a pytree of this treedef, found by
    rebuilding it around stand-ins and flattening it again with paths; None where the
    rebuilt tree does not flatten back to the same leaves (a node type whose unflatten
    checks its children)."""
    stat = iter(statics)
    placed = [Leaf() if dynamic else next(stat) for dynamic in mask]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a node type's unflatten may warn about stand-ins)
        try:
            tree = jax.tree_util.tree_unflatten(treedef, placed)
            with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
        except Exception:
            return None
    if len(with_paths) != len(placed) or any(leaf is not p for (_, leaf), p in zip(with_paths, placed)):
        return None
    return [name + jax.tree_util.keystr(path) for (path, _), dynamic in zip(with_paths, mask) if dynamic]

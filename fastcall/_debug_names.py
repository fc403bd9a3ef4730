"""The names jax gives what fastcall traces, in its errors: the user's function and source
line, and each flat leaf as the user's argument and leaf path (`train`, `params['w']`,
`model.linear.kernel.value`), where jax would otherwise see only fastcall's function of
flat leaves (`flat_fn at _build.py`, `dyn[3]`).

jax names a traced function by what `inspect.unwrap` finds (`__wrapped__`), and its
arguments by binding them to the function's signature and following each one's pytree
paths. So fastcall's function of flat leaves gets `__wrapped__` (the user's function) and
a signature of one positional parameter per leaf, each named by the leaf's path: jax then
names each array it passes (a leaf holding a pytree, such as a Variable holding a dict,
adds its own paths: `m.s.value['a']`), and the count is always jax's own. The names are not
Python identifiers, which `inspect.Parameter` refuses: they are set on its slot after.
Where that fails, jax's default naming stays, which is only less helpful.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Sequence

import jax

from . import _nnx_gate


class Leaf:
    """A stand-in for one dynamic leaf, to find where the structure puts it."""

    __slots__ = ()


def attach(
    flat_fn: Callable[..., Any], fun: Any, specs: Sequence[Any], n_positional: int, keywords: Sequence[str]
) -> None:
    """Name, for jax, `fun` and the parameters of `flat_fn` (which jax.jit traces over the
    flat leaves of `specs`: the function's own, then `n_positional` positional arguments,
    then the `keywords`)."""
    try:
        names: list[str] = []
        for spec, name in zip(specs, ["fun", *argument_names(fun, n_positional, keywords)]):
            names.extend(leaf_names(spec, name))
        signature = inspect.Signature([_parameter(i, name) for i, name in enumerate(_distinct(names))])
    except Exception:  # (naming must never stand in the way of the call)
        return
    flat_fn.__signature__ = signature  # type: ignore[attr-defined]
    flat_fn.__wrapped__ = fun  # type: ignore[attr-defined]


def _parameter(i: int, name: str) -> inspect.Parameter:
    parameter = inspect.Parameter(f"leaf{i}", inspect.Parameter.POSITIONAL_ONLY)
    parameter._name = name  # type: ignore[attr-defined]  # (see the module docstring)
    return parameter


def _distinct(names: list[str]) -> list[str]:
    """The names, each made unique (a signature binds by name): a repeated one, which names
    several leaves whose paths could not be told, numbered (`c (leaf 2 of 3)`)."""
    total = {n: names.count(n) for n in set(names)}
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if total[n] == 1:
            out.append(n)
        else:
            seen[n] = seen.get(n, 0) + 1
            out.append(f"{n} (leaf {seen[n]} of {total[n]})")
    return out


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


def attach_packed(fn: Callable[..., Any], entry_fn: Any, parts: Sequence[Sequence[int]], n: int) -> None:
    """Name, for jax, the parameters of `fn`, a packed program (`_pack`) of `entry_fn`'s flat
    function: one per part (the positions, among that function's first `n` leaves, that it
    passes: a buffer's, or one leaf's), then the call's own."""
    try:
        flat = entry_fn.__wrapped__  # (jax.jit's, or the agreement mode's, wrapper of flat_fn)
        names = list(flat.__signature__.parameters)
        named = [names[p[0]] if len(p) == 1 else f"{names[p[0]]} ... {names[p[-1]]} (packed)" for p in parts]
        signature = inspect.Signature([_parameter(i, name) for i, name in enumerate(_distinct(named + names[n:]))])
        fn.__signature__ = signature  # type: ignore[attr-defined]
        fn.__wrapped__ = flat.__wrapped__  # type: ignore[attr-defined]
    except Exception:  # (naming must never stand in the way of the call)
        return

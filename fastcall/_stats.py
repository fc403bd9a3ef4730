"""Introspection: how often a wrapped function compiled, and why."""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any, Iterable

import jax
from jax.tree_util import keystr, tree_flatten_with_path

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between two compiled signatures."""

    argument: str
    path: str
    old: str
    new: str

    def __str__(self) -> str:
        where = self.argument + (" " + self.path if self.path.startswith("(") else self.path)
        return f"{where}: {self.old} -> {self.new}"


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A compile after the first one, with what changed since the previous compile."""

    changes: tuple[Change, ...]

    def __str__(self) -> str:
        if not self.changes:
            return "recompiled with no visible change (a new function object, or a cache cleared)"
        return "; ".join(str(c) for c in self.changes)


@dataclasses.dataclass(frozen=True)
class JitStats:
    """Counts for one wrapped function (shared by wrappers of equal functions).

    - `calls`: calls made through the wrapper (stepping aside under an outer
      trace is not counted).
    - `compiles`: times the Python function was traced.
    - `hits`: calls that reused an already compiled program.
    - `recompiles`: one entry per compile after the first, saying what changed
      (argument, leaf path, old and new shape/dtype or static value).
    """

    calls: int
    compiles: int
    hits: int
    recompiles: tuple[Recompile, ...]


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, jax.core.Tracer):
        aval = leaf.aval
        weak = " (weak type)" if getattr(aval, "weak_type", False) else ""
        return f"array {aval.str_short()}{weak}"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"array {leaf.dtype}{list(leaf.shape)}"
    return f"static {type(leaf).__name__} {_repr.repr(leaf)}"


Signature = dict[tuple[str, str], str]


def describe(named_values: Iterable[tuple[str, Any]]) -> Signature:
    """What a trace saw, leaf by leaf: {(argument, path): description}. Trace time only."""
    sig: Signature = {}
    for name, value in named_values:
        leaves_with_paths, treedef = tree_flatten_with_path(value)
        sig[(name, "(structure)")] = str(treedef)
        for path, leaf in leaves_with_paths:
            sig[(name, keystr(path))] = _describe_leaf(leaf)
    return sig


def diff(old: Signature, new: Signature) -> tuple[Change, ...]:
    changes = []
    for k in list(old) + [k for k in new if k not in old]:
        a, b = old.get(k, "absent"), new.get(k, "absent")
        if a != b:
            if k[1] == "(structure)":
                a, b = _around_first_difference(a, b)
            changes.append(Change(k[0], k[1], a, b))
    return tuple(changes)


def _around_first_difference(a: str, b: str, width: int = 50) -> tuple[str, str]:
    """The part of two long structure descriptions where they start to differ."""
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    start = max(0, i - width)
    clip = lambda s: ("..." if start else "") + s[start : i + width] + ("..." if len(s) > i + width else "")  # noqa: E731
    return clip(a), clip(b)

"""Structure hooks on Flax NNX's classes, verified at load, failing safe.

fastcall caches each NNX object's structure (graphdef and Variable list) and
must learn when it changes. Nothing in flax tracks mutation, so fastcall wraps
the few methods through which a graph's structure changes (`HOOK_TARGETS`)
and, after each call of one on an object that belongs to a cached graph,
marks that cache entry stale. NNX's in-place rebuilds of a node (its clear,
then its init: the graph updates of nnx.jit and NNX's other transforms) are reported apart: they
mostly put back what was there, which the cache can check for itself.

These are private parts of flax. A release that renames or removes one would
make a hook silently miss changes, and a cache silently stale. So at load the
table is verified: every target present, NNX's graph registry patchable, the
`Variable._raw_value` slot present, and the flax version inside the range the
hooks were verified on. If anything is off, fastcall warns once
(`fastcall.UnverifiedFlaxWarning`) and the adapter stops trusting the hooks:
every NNX object then has its structure re-read on every call (correct, at
the cost of a graph walk per call), never a stale result.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import warnings
from typing import Any, Callable, NamedTuple

from flax import nnx
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable

from .._errors import UnverifiedFlaxWarning
from .._flatten import ArrayImpl

# Flax releases on which every hook below was verified (by the test suite, the
# version matrix in tests/matrix.py and the conformance runner); inclusive.
VERIFIED_FLAX = ((0, 12, 5), (0, 12, 12))

Pytree: Any = getattr(nnx, "Pytree", None) or nnx.Module
_ARRAY = ArrayImpl


_MISSING = object()
SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _attribute(obj: Any, name: Any, *_: Any) -> tuple[Any, Any]:
    """What an attribute assignment may change: the value, and whether NNX holds it as data."""
    return obj.__dict__.get(name, _MISSING), obj._pytree__nodes.get(name, _MISSING)


def _same_attribute(before: tuple[Any, Any], after: tuple[Any, Any]) -> bool:
    """Whether an assignment left the graph's structure as it was: the very same value;
    a data array replaced by an array (its value is read at call time); or a static
    scalar replaced by an equal one of the same type (`model.eval()` on a model already
    in eval mode). Anything else counts as a change."""
    (old, old_data), (new, new_data) = before, after
    if old is _MISSING or old_data is not new_data:
        return False
    if old is new:
        return True
    if type(old) is _ARRAY:
        return type(new) is _ARRAY and old_data is True
    return same_scalar(old, new)


def same_scalar(old: Any, new: Any) -> bool:
    """Whether static scalar `new` stands for `old`: of the same type and equal (a float
    by its bits: -0.0 is not 0.0). The one rule for what a write of a static value leaves
    unchanged (here, and in the check of a graph NNX rebuilt in place)."""
    t = type(old)
    return t in SCALARS and t is type(new) and old == new and (t is not float or old.hex() == new.hex())


def _static_flip(before: tuple[Any, Any], after: tuple[Any, Any]) -> bool:
    """Whether an assignment that changed something replaced one static scalar by another
    (`model.train()` / `model.eval()` flipping `deterministic`): the graph's structure is
    as it was but for that one static value."""
    (old, old_data), (new, new_data) = before, after
    return old is not _MISSING and old_data is False and new_data is False and scalar_flip(old, new)


def scalar_flip(old: Any, new: Any) -> bool:
    """Whether replacing static `old` by `new` may be a flip (one static scalar by another:
    the structure kept as a variant). The one rule (here, and in the check of a graph NNX
    rebuilt in place)."""
    return type(old) in SCALARS and type(new) in SCALARS


def _metadata_object(variable: Any, *_: Any) -> Any:
    return variable._var_metadata


def _same_object(before: Any, after: Any) -> bool:
    return before is after


class HookTarget(NamedTuple):
    owner: type
    name: str
    why: str  # which structural change goes through it
    # (optional) read before and after the call; `unchanged(before, after)` true means the
    # call changed no structure, and nothing is marked stale
    read: Callable[..., Any] | None = None
    unchanged: Callable[[Any, Any], bool] | None = None
    # (optional, with `read`) `flip(before, after)` true means the call only replaced one
    # static scalar attribute by another: reported as `flipped(obj, name, old value)`
    flip: Callable[[Any, Any], bool] | None = None
    # one half of NNX's in-place rebuild of a node (clear, init): reported as
    # `rebuilt(obj)`, not as a change (see `install`)
    rebuild: bool = False


HOOK_TARGETS: tuple[HookTarget, ...] = (
    HookTarget(
        Pytree,
        "__setattr__",
        "attribute assignment, nnx.List/nnx.Dict items",
        _attribute,
        _same_attribute,
        _static_flip,
    ),
    HookTarget(Pytree, "__delattr__", "attribute deletion"),
    HookTarget(
        Pytree, "_graph_node_clear", "NNX's in-place graph rebuilds (graph updates of nnx.jit and other transforms)",
        rebuild=True,
    ),
    HookTarget(Pytree, "_graph_node_init", "NNX's in-place graph rebuilds", rebuild=True),
    HookTarget(Variable, "set_metadata", "Variable metadata changes"),
    HookTarget(Variable, "del_metadata", "Variable metadata deletion"),
    # (nnx.update and nnx.jit's write-back: metadata is replaced only when it differs)
    HookTarget(
        Variable, "update_from_state", "Variables updated from a State", _metadata_object, _same_object
    ),
    HookTarget(Variable, "copy_from", "Variables copied into"),
)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def problems(flax_version: str, targets: tuple[HookTarget, ...] = HOOK_TARGETS) -> list[str]:
    """What is missing or changed on this flax (an empty list: the hooks can be trusted)."""
    found = []
    low, high = VERIFIED_FLAX
    if not low <= _version(flax_version) <= high:
        found.append(
            f"flax {flax_version} is outside the versions the hooks were verified on "
            f"({'.'.join(map(str, low))} to {'.'.join(map(str, high))})"
        )
    for t in targets:
        if not callable(t.owner.__dict__.get(t.name, getattr(t.owner, t.name, None))):
            found.append(f"{t.owner.__name__}.{t.name} is missing ({t.why})")
    if not hasattr(graphlib, "GRAPH_REGISTRY"):
        found.append("flax.nnx.graphlib.GRAPH_REGISTRY is missing")
    if type(Variable.__dict__.get("_raw_value")).__name__ != "member_descriptor":
        found.append("Variable._raw_value is not a slot")
    if not isinstance(getattr(nnx.Dropout(0.5), "_pytree__nodes", None), collections.abc.Mapping):
        found.append("Pytree._pytree__nodes (which attributes are data) is missing")
    if "_var_metadata" not in dir(Variable):
        found.append("Variable._var_metadata is missing")
    return found


def _notifying(
    method: Callable[..., Any],
    notify: Callable[[Any], None],
    target: HookTarget | None = None,
    flipped: Callable[[Any, Any, Any], None] | None = None,
) -> Callable[..., Any]:
    read = target.read if target is not None else None
    unchanged = target.unchanged if target is not None else None
    flip = target.flip if target is not None and flipped is not None else None
    if read is None or unchanged is None:

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = method(self, *args, **kwargs)
            notify(self)
            return result

    else:

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                before = read(self, *args)
            except Exception:  # (an object these hooks do not know: always a change)
                before = _MISSING
            result = method(self, *args, **kwargs)
            if before is _MISSING:
                notify(self)
                return result
            try:
                after = read(self, *args)
                same = unchanged(before, after)
                static = not same and flip is not None and flip(before, after)
            except Exception:
                same = static = False
            if static:
                flipped(self, args[0], before[0])  # type: ignore[misc]
            elif not same:
                notify(self)
            return result

    wrapped.__name__ = getattr(method, "__name__", "hook")
    wrapped.__doc__ = method.__doc__
    wrapped._fastcall_original = method  # type: ignore[attr-defined]
    return wrapped


def install(
    notify: Callable[[Any], None], flipped: Callable[[Any, Any, Any], None], rebuilt: Callable[[Any], None]
) -> list[str]:
    """Wrap every hook target present so that it calls `notify(obj)` after it ran (or, for
    a static scalar attribute replaced by another, `flipped(obj, name, old value)`; for
    each half of NNX's in-place rebuild of a node, its clear and its init, `rebuilt(node)`).

    Returns the problems found (see `problems`); any problem means the hooks
    must not be trusted. Idempotent: a second call installs nothing.
    """
    import flax

    found = problems(getattr(flax, "__version__", "0"))
    if getattr(Pytree, "_fastcall_hooked", False):
        return found
    for t in HOOK_TARGETS:
        original = getattr(t.owner, t.name, None)
        if callable(original):
            setattr(t.owner, t.name, _notifying(original, rebuilt if t.rebuild else notify, t, flipped))
    # NNX registers each graph node class's clear/init functions when the class is
    # created; classes created before this (every built-in layer) keep references to
    # the originals in the registry, so wrap those too. Classes created later are
    # covered by the base-class wrappers (their registrations read the wrapped ones).
    registry = getattr(graphlib, "GRAPH_REGISTRY", {})
    for node_type, impl in list(registry.items()):
        if isinstance(node_type, type) and issubclass(node_type, Pytree):
            try:
                registry[node_type] = dataclasses.replace(
                    impl, clear=_notifying(impl.clear, rebuilt), init=_notifying(impl.init, rebuilt)
                )
            except Exception as err:  # a registry layout these hooks were not verified on
                found.append(f"graph registry entry of {node_type.__name__} could not be hooked ({err})")
                break
    Pytree._fastcall_hooked = True
    if found:
        warnings.warn(
            "fastcall: NNX structure hooks could not be verified on this flax ("
            + "; ".join(found)
            + "). NNX objects will have their structure re-read on every call: results stay "
            "correct, calls are slower. Use a flax version in the verified range for the fast path.",
            UnverifiedFlaxWarning,
            stacklevel=2,
        )
    return found

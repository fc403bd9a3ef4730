"""Structure hooks on Flax NNX's classes, verified at load, failing safe.

fastcall caches each NNX object's structure (graphdef and Variable list) and
must learn when it changes. Nothing in flax tracks mutation, so fastcall wraps
the few methods through which a graph's structure changes (`HOOK_TARGETS`)
and, after each call of one on an object that belongs to a cached graph,
marks that cache entry stale.

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
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple

from flax import nnx
from flax.nnx import graphlib
from flax.nnx.variablelib import Variable

from ._errors import UnverifiedFlaxWarning
from ._flatten import ArrayImpl

# Flax releases on which every hook below was verified (by the test suite, the
# version matrix in tests/matrix.py and the conformance runner); inclusive.
VERIFIED_FLAX = ((0, 12, 5), (0, 12, 12))

Pytree: Any = getattr(nnx, "Pytree", None) or nnx.Module
_ARRAY = ArrayImpl


_MISSING = object()
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


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
    t = type(old)
    if t is not type(new):
        return False
    if t is _ARRAY:
        return old_data is True
    if t in _SCALARS:
        return old == new and (t is not float or old.hex() == new.hex())
    return False


def _static_flip(before: tuple[Any, Any], after: tuple[Any, Any]) -> bool:
    """Whether an assignment that changed something replaced one static scalar by another
    (`model.train()` / `model.eval()` flipping `deterministic`): the graph's structure is
    as it was but for that one static value."""
    (old, old_data), (new, new_data) = before, after
    return (
        old is not _MISSING
        and old_data is False
        and new_data is False
        and type(old) in _SCALARS
        and type(new) in _SCALARS
    )


def _same_rebuild(before: tuple[dict[str, Any], Any], node: Any) -> bool:
    """Whether NNX's in-place rebuild of `node` (its clear, then its init: `nnx.jit`'s graph
    updates on a model passed to it, any NNX transform's merge back into the caller's
    objects) put back the structure it had: the same attribute names, each value as
    `_same_attribute` says of an assignment (the very same object; a data array replaced
    by an array; an equal static scalar of the same type), the same record of which are
    data, and NNX's per-object bookkeeping (`_pytree__state`, which the rebuild makes anew)
    of the same kind. `before`: the attribute dict copied just before the clear, and the
    data record it held. Anything else (an attribute added, dropped or replaced by another
    object) counts as a change."""
    old, old_nodes = before
    new = node.__dict__
    new_nodes = new.get("_pytree__nodes", _MISSING)
    if old_nodes is _MISSING or new_nodes is _MISSING or old.keys() != new.keys():
        return False
    if new_nodes is not old_nodes and new_nodes != old_nodes:
        return False
    for name, value in new.items():
        if name == "_pytree__state":
            same = type(value) is type(old[name])
        elif name == "_pytree__nodes":
            continue
        else:
            same = _same_attribute(
                (old[name], old_nodes.get(name, _MISSING)), (value, new_nodes.get(name, _MISSING))
            )
        if not same:
            return False
    return True


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
    # (optional) one half of NNX's in-place rebuild of a node: "clear" empties it, "init"
    # fills it again (see `_rebuild_hooks`)
    rebuild: str | None = None


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
        Pytree, "_graph_node_clear", "NNX's in-place graph rebuilds (nnx.jit graph updates, nnx.update)",
        rebuild="clear",
    ),
    HookTarget(Pytree, "_graph_node_init", "NNX's in-place graph rebuilds", rebuild="init"),
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

    return _named(wrapped, method)


class Rebuilds:
    """NNX's in-place rebuilds under way: each node cleared and not yet filled again, known by
    a weak reference, with its attribute dict as it was (see `_same_rebuild`) and what
    `suspend(node)` returned at the clear (the cached structures holding the node, which stop
    serving). At the init, `resume(node, unchanged, that)`: `unchanged` where the structure
    came back as it was. A rebuild that never completes (an error in NNX's unflatten between
    the two) leaves what it suspended suspended (read again on next use); its record goes
    with its node."""

    def __init__(self, suspend: Callable[[Any], Any], resume: Callable[[Any, bool, Any], None]) -> None:
        self.suspend = suspend
        self.resume = resume
        # id(node) -> (weak reference to the node, its snapshot or _MISSING, suspend's result)
        self.pending: dict[int, tuple[Any, Any, Any]] = {}
        self.lock = threading.RLock()  # (reentrant: a node's death drops its record, anywhere)

    def _forget(self, ref: Any) -> None:
        with self.lock:
            for key, held in list(self.pending.items()):
                if held[0] is ref:
                    del self.pending[key]

    def clear(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def clear(node: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                d = node.__dict__
                before: Any = (dict(d), d.get("_pytree__nodes", _MISSING))
                ref: Any = weakref.ref(node, self._forget)
            except Exception:  # (an object these hooks do not know: always a change)
                before, ref = _MISSING, None
            suspended = self.suspend(node)
            if ref is not None:
                with self.lock:
                    self.pending[id(node)] = (ref, before, suspended)
            return method(node, *args, **kwargs)

        return _named(clear, method)

    def init(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def init(node: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                result = method(node, *args, **kwargs)
            finally:
                with self.lock:
                    held = self.pending.pop(id(node), None)
            if held is None or held[0]() is not node:  # (a node made new, not rebuilt)
                self.resume(node, False, [])
                return result
            _, before, suspended = held
            try:
                same = before is not _MISSING and _same_rebuild(before, node)
            except Exception:
                same = False
            self.resume(node, same, suspended)
            return result

        return _named(init, method)


def _named(wrapped: Callable[..., Any], method: Callable[..., Any]) -> Callable[..., Any]:
    wrapped.__name__ = getattr(method, "__name__", "hook")
    wrapped.__doc__ = method.__doc__
    wrapped._fastcall_original = method  # type: ignore[attr-defined]
    return wrapped


def install(
    notify: Callable[[Any], None], flipped: Callable[[Any, Any, Any], None], rebuilds: Rebuilds
) -> list[str]:
    """Wrap every hook target present so that it calls `notify(obj)` after it ran (or, for
    a static scalar attribute replaced by another, `flipped(obj, name, old value)`; for
    NNX's in-place rebuild of a node, `rebuilds`' suspend and resume).

    Returns the problems found (see `problems`); any problem means the hooks
    must not be trusted. Idempotent: a second call installs nothing.
    """
    import flax

    found = problems(getattr(flax, "__version__", "0"))
    if getattr(Pytree, "_fastcall_hooked", False):
        return found
    for t in HOOK_TARGETS:
        original = getattr(t.owner, t.name, None)
        if not callable(original):
            continue
        if t.rebuild is not None:
            setattr(t.owner, t.name, rebuilds.clear(original) if t.rebuild == "clear" else rebuilds.init(original))
        else:
            setattr(t.owner, t.name, _notifying(original, notify, t, flipped))
    # NNX registers each graph node class's clear/init functions when the class is
    # created; classes created before this (every built-in layer) keep references to
    # the originals in the registry, so wrap those too. Classes created later are
    # covered by the base-class wrappers (their registrations read the wrapped ones).
    registry = getattr(graphlib, "GRAPH_REGISTRY", {})
    for node_type, impl in list(registry.items()):
        if isinstance(node_type, type) and issubclass(node_type, Pytree):
            try:
                registry[node_type] = dataclasses.replace(
                    impl, clear=rebuilds.clear(impl.clear), init=rebuilds.init(impl.init)
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

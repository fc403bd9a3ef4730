"""The agreement mode: every call a hit served is resolved again by the miss path and compared.

fastcall serves most calls from records the general path (the miss) left behind: the fast
and structure routes, in C and in Python, read an argument's leaves without resolving it.
They must read exactly what the miss would read. With `FASTCALL_CHECK_HITS=1` in the
environment (read once, at import) every call a hit serves is checked against the miss at
the moment it dispatches, before the compiled program runs and before any NNX state is
written back:

- the miss resolves the same arguments (`_args.resolve_call`, `check_only`: noting nothing
  for later calls, so that the mode changes no route);
- the compiled entry it selects (by the static key) must be the one the hit is calling;
- the leaves it reads must be the very objects the hit passes, one by one (identity).

Any difference raises `AgreementError`, naming the argument and the leaf. It costs a full
resolution per call: a mode for tests and debugging, never for production. CI runs the
whole suite under it (README "Development", docs/how-it-works.md).

How the two meet: each wrapper made in this mode (`checking_wrapper`) pushes the call onto a
per-thread stack, armed; the general path disarms it when it takes the call (`miss_taken`);
each compiled entry's `fn` is a `_CheckedDispatch`, which checks an armed call when a hit
dispatches it. Not compared (counted in `skipped`): a call while `nnx.cached_partial`'s
static cache waits (the NNX hits decline those; the miss would consume it), and one whose
arguments the miss would not read (`StepAside`: tracers inside an NNX object).

What it cannot see: a cache that both read from (the identity cache, an NNX object's cache
entry) gone stale; the property tests compare outputs with eager execution for that. And a
call whose arguments user code changes while the hit reads them (a key's `__eq__`, a type's
`__hash__`) reads differently by design: the tests of that turn the mode off. After the
table of structures dropped a spec (`_flatten.MAX_SPECS` of them), a structure record still
serves its old entry where the miss would intern the structure anew and compile again: the
mode reports that difference too.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

from . import _args, _flatten, _trace
from ._trace import StepAside

ENABLED: bool = os.environ.get("FASTCALL_CHECK_HITS", "") in ("1", "true", "yes")


class AgreementError(AssertionError):
    """A call served by a hit (the fast or structure route) read other leaves, or chose
    another compiled entry, than the general path resolves for the same arguments: a bug
    in fastcall. Raised only in the agreement mode (`FASTCALL_CHECK_HITS=1`)."""


class _Call:
    """One call of a wrapper in the agreement mode, until a hit dispatches it or the
    general path takes it."""

    __slots__ = ("state", "fun_leaves", "args", "kwargs", "armed")

    def __init__(self, state: Any, fun_leaves: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.state = state
        self.fun_leaves = fun_leaves
        self.args = args
        self.kwargs = kwargs
        self.armed = True


class _Calls(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Call] = []


_calls = _Calls()
checked = 0  # calls compared so far (tests read it: a check that never ran proves nothing)
skipped = 0  # calls a hit served that were not compared (see above)


def checking_wrapper(public: Callable[..., Any], state: Any, fun_leaves: tuple[Any, ...]) -> Callable[..., Any]:
    """`public` (the C or Python wrapper), with each call noted for `_CheckedDispatch`."""

    def checking(*args: Any, **kwargs: Any) -> Any:
        stack = _calls.stack
        stack.append(_Call(state, fun_leaves, args, kwargs))
        try:
            return public(*args, **kwargs)
        finally:
            stack.pop()

    return checking


def miss_taken() -> None:
    """The general path takes the current call: it is the miss, nothing to compare."""
    stack = _calls.stack
    if stack:
        stack[-1].armed = False


class _CheckedDispatch:
    """An entry's compiled function in the agreement mode: `fn`, checking the call a hit
    dispatches through it against the general path's resolution first."""

    __slots__ = ("fn", "entry")

    def __init__(self, fn: Any, entry: Any) -> None:
        self.fn = fn
        self.entry = weakref.ref(entry)  # (the entry holds this: no cycle)

    def __call__(self, *leaves: Any) -> Any:
        stack = _calls.stack
        if stack and stack[-1].armed:
            call = stack[-1]
            call.armed = False
            _compare(call, self.entry(), leaves)
        return self.fn(*leaves)

    def __getattr__(self, name: str) -> Any:  # (lower, trace, eval_shape: jax.jit's own)
        return getattr(self.fn, name)


class _CheckedBound:
    """A fast record's call in the agreement mode: `call`, `entry.fn` with an object's leaves
    bound (packed or not, `_pack`), checking the call a hit dispatches through it as
    `_CheckedDispatch` does, on the leaves bound and the call's own."""

    __slots__ = ("call", "entry", "leaves")

    def __init__(self, call: Any, entry: Any, leaves: Any) -> None:
        self.call = call
        self.entry = weakref.ref(entry)
        self.leaves = tuple(leaves)

    def __call__(self, *args: Any) -> Any:
        stack = _calls.stack
        if stack and stack[-1].armed:
            call = stack[-1]
            call.armed = False  # (a packed program's trace calls the entry's fn: not again)
            _compare(call, self.entry(), (*self.leaves, *args))
        return self.call(*args)


def checked_bound(call: Any, entry: Any, leaves: Any) -> Any:
    """A fast record's `call` (entry.fn with `leaves` bound first), checked when a hit uses it."""
    return _CheckedBound(call, entry, leaves)


def check_entry(entry: Any) -> None:
    """Make `entry`'s calls through hits checked (once, when it is built)."""
    entry.fn = _CheckedDispatch(entry.fn, entry)


def _compare(call: _Call, entry: Any, leaves: tuple[Any, ...]) -> None:
    global checked, skipped
    state = call.state
    if _trace.static_cache_pending():
        skipped += 1
        return
    try:
        resolved = _args.resolve_call(state, call.fun_leaves, call.args, call.kwargs, check_only=True)
    except StepAside:
        skipped += 1
        return
    except Exception as err:
        raise AgreementError(
            f"fastcall agreement check, {state.name}: a hit served a call that the general path refuses"
            f" ({type(err).__name__}: {err})"
        ) from err
    if resolved is None:
        raise AgreementError(
            f"fastcall agreement check, {state.name}: a hit served a call whose arguments do not fit the"
            " function's signature"
        )
    checked += 1
    expected = state.table.get(resolved.key)
    if expected is not entry:
        raise AgreementError(
            f"fastcall agreement check, {state.name}: the hit called another compiled entry than the general path"
            f" selects; {_key_difference(state, entry, resolved.key)}"
        )
    miss = resolved.leaves
    for i in range(max(len(miss), len(leaves))):
        hit_leaf = leaves[i] if i < len(leaves) else _MISSING
        miss_leaf = miss[i] if i < len(miss) else _MISSING
        if hit_leaf is not miss_leaf:
            raise AgreementError(
                f"fastcall agreement check, {state.name}: {_leaf_place(state, resolved.key, len(call.fun_leaves), i)}:"
                f" the hit passed {_describe(hit_leaf)}, the general path reads {_describe(miss_leaf)}"
                f" ({len(leaves)} leaves passed, {len(miss)} read)"
            )


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


_MISSING = _Missing()


def _describe(leaf: Any) -> str:
    if leaf is _MISSING:
        return "nothing"
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    what = type(leaf).__name__ + (f" {dtype}{list(shape)}" if shape is not None else f" {leaf!r:.40}")
    return f"{what} (id {id(leaf):#x})"


def _slots(state: Any, key: tuple[Any, ...], n_fun: int) -> list[tuple[str, int]]:
    """(name, number of dynamic leaves) of the function and each argument, in leaf order."""
    layout = state.layout(key)
    slots = [("the function itself", n_fun)]
    for i, spec_id in enumerate(layout.positional):
        slots.append((f"argument {state.arg_name(i)!r}", _flatten.spec_by_id(spec_id).n_dyn))
    for name, spec_id in zip(layout.keyword_names, layout.keyword_ids):
        slots.append((f"argument {name!r}", _flatten.spec_by_id(spec_id).n_dyn))
    return slots


def _leaf_place(state: Any, key: tuple[Any, ...], n_fun: int, index: int) -> str:
    start = 0
    for name, n in _slots(state, key, n_fun):
        if index < start + n:
            return f"{name}, leaf {index - start} of {n}"
        start += n
    return f"leaf {index}, past the {start} the general path reads"


def _key_difference(state: Any, entry: Any, key: tuple[Any, ...]) -> str:
    hit_key = next((k for k, e in list(state.table.items()) if e is entry), None)
    if hit_key is None:
        return "the hit's entry is no longer in the function's table"
    hit, miss = state.layout(hit_key), state.layout(key)
    if hit.keyword_names != miss.keyword_names:
        return f"keyword arguments {hit.keyword_names} (hit) against {miss.keyword_names} (general path)"
    names = [state.arg_name(i) for i in range(len(miss.positional))] + list(miss.keyword_names)
    for name, h, m in zip(names, hit.positional + hit.keyword_ids, miss.positional + miss.keyword_ids):
        if h != m:
            return f"argument {name!r} has spec {h} in the hit's entry, {m} as the general path reads it"
    return f"static keys {hit_key} (hit) and {key} (general path)"

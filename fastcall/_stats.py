"""Introspection: how often a wrapped function compiled, and why."""

from __future__ import annotations

import dataclasses
import reprlib
import threading
from typing import Any, Iterable

import jax
from jax.tree_util import keystr, tree_flatten_with_path

from . import _nnx_gate

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between two compiled signatures: one leaf of one argument.

    An entry of `fastcall.Recompile.changes`: what changed, between the previous
    compile and this one, to make a wrapped function compile again.

    **Fields:**

    - `argument`: the argument's name (its parameter name, or `args[i]` for one
      taken by `*args`).
    - `path`: the leaf's path inside the argument, as `jax.tree_util.keystr` writes
      it (`.weight`, `['a']`, `[0]`), `""` for the argument itself, or ending in
      `(structure)` for a change of the pytree structure.
    - `old`, `new`: what the leaf was and is: `array float32[2]` (an array, by dtype
      and shape; a traced Python scalar is `... (weak type)`), `static float 2.0` (a
      static value, by type and value), a structure's description around where the
      two differ, or `absent`.

    `str(change)` gives `argument path: old -> new`.

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit
    def first(d):
        return d["a"]

    first({"a": jnp.ones(2), "tag": "hi"})
    first({"a": jnp.ones(2), "tag": "ho"})  # a string is static: compiles again
    (change,) = first.stats().recompiles[0].changes
    print(change)
    print(change.argument, change.path, change.old, change.new, sep=" | ")
    ```
    ```text
    d['tag']: static str 'hi' -> static str 'ho'
    d | ['tag'] | static str 'hi' | static str 'ho'
    ```
    """

    argument: str
    path: str
    old: str
    new: str

    def __str__(self) -> str:
        where = self.argument + (" " + self.path if self.path.startswith("(") else self.path)
        return f"{where}: {self.old} -> {self.new}"


@dataclasses.dataclass(frozen=True)
class Recompile:
    """A compile after the first one, with what changed since the previous compile.

    An entry of `fastcall.JitStats.recompiles` (the most recent 256 are kept). Read
    it to find which input keeps making a function compile again: a new shape or
    dtype, a new static value, a new structure.

    **Fields:**

    - `changes`: a tuple of `fastcall.Change`, one per leaf that differs from the
      previous compile's arguments; empty if none does (the same arguments compiled
      again, e.g. after `f.clear_cache()`).

    `str(recompile)` joins its changes with `; `, or says
    `recompiled with no visible change (...)` when there are none.

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit(static_argnames="n")
    def power(x, n):
        return x**n

    x = jnp.ones(2)
    power(x, n=2)
    power(x.astype(jnp.float16), n=3)  # two changes: compiles again
    (recompile,) = power.stats().recompiles
    print(recompile)
    print(len(recompile.changes))
    ```
    ```text
    x: array float32[2] -> array float16[2]; n: static int 2 -> static int 3
    2
    ```
    """

    changes: tuple[Change, ...]

    def __str__(self) -> str:
        if not self.changes:
            return "recompiled with no visible change (a new function object, or a cache cleared)"
        return "; ".join(str(c) for c in self.changes)


@dataclasses.dataclass(frozen=True)
class JitStats:
    """Counts for one wrapped function, from `f.stats()`.

    A snapshot, taken when `f.stats()` is called, of how often the function was
    called and compiled, why it compiled again, and which route served its calls.
    Wrappers of equal functions with equal options share one table of compiled
    programs, and so their counts. Use it to find recompiles you did not expect
    (see `recompiles`) and calls that miss the fast path (see `paths`, then
    `f.explain(...)`).

    **Fields:**

    - `calls`: calls made through the wrapper (a call with NNX objects run inline
      under an outer trace is not counted, nor a call of a `fastcall.Compiled`).
    - `compiles`: times the Python function was traced.
    - `hits`: calls that reused an already compiled program.
    - `recompiles`: one entry per compile after the first, saying what changed
      (argument, leaf path, old and new shape/dtype or static value).
    - `paths`: how many calls each route served: `"c_fast"` (the fast route,
      compiled), `"python_fast"` (the same route run as Python, where fastcall
      was installed without a C compiler), `"c_structure"` / `"python_structure"` (a new
      object of a structure this function has run, read by that structure's
      generated code: the structure path, in C or in Python), and the general
      path, everything else: `"general_cached"` (every argument found in a
      cache: the identity cache, an NNX object's cached structure, a structure's
      generated extractor) or `"general_read"` (at least one argument read whole,
      by jax's flatten or NNX's graph walk: what the peer does on every call; so is
      the flatten that takes a guard over an object's lists and dicts).
      They add up to `calls`. Which of `c_` and `python_` serve a call depends on
      whether the compiled modules were built (and, for the structure route, not
      disabled by `FASTCALL_DISABLE_ACCEL=1`).
    - `packed_leaves`: small leaves the fast path passes packed into buffers (see
      `fastcall.jit`'s `pack`), counted each time a plan of the fast index packs them (an
      NNX model packed again after new weights were loaded counts again); 0 where none is.

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit
    def double(x):
        return 2 * x

    double(jnp.ones(2))  # compiles
    double(jnp.ones(2))  # a hit
    double(jnp.ones(3))  # a new shape: compiles again
    stats = double.stats()
    print(stats.calls, stats.compiles, stats.hits)
    print([str(r) for r in stats.recompiles])
    assert sum(stats.paths.values()) == stats.calls
    ```
    ```text
    3 2 1
    ['x: array float32[2] -> array float32[3]']
    ```
    """

    calls: int
    compiles: int
    hits: int
    recompiles: tuple[Recompile, ...]
    paths: dict[str, int] = dataclasses.field(default_factory=dict)
    packed_leaves: int = 0


def _describe_leaf(leaf: Any) -> str:
    if isinstance(leaf, jax.core.Tracer):
        aval = leaf.aval
        weak = " (weak type)" if getattr(aval, "weak_type", False) else ""
        return f"array {aval.str_short()}{weak}"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"array {leaf.dtype}{list(leaf.shape)}"
    return f"static {type(leaf).__name__} {_repr.repr(leaf)}"


class Shown:
    """A description compared by value and written out (`str`) only when a recompile
    explanation shows it: an NNX graphdef's text costs milliseconds on every trace."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        try:
            return type(other) is Shown and bool(self.value == other.value)
        except Exception:
            return False

    __hash__ = None  # type: ignore[assignment]

    def __str__(self) -> str:
        return str(self.value)


Signature = dict[tuple[str, str], Any]  # (argument, path) -> description (a str, or a Shown)


def describe(named_values: Iterable[tuple[str, Any]]) -> Signature:
    """What a trace saw, leaf by leaf: {(argument, path): description}. Trace time only."""
    sig: Signature = {}
    for name, value in named_values:
        # (NNX objects through NNX's own graph walk: their graphs may share or cycle)
        leaves_with_paths, treedef = tree_flatten_with_path(value, is_leaf=_nnx_gate.is_node)
        sig[(name, "(structure)")] = str(treedef)
        for path, leaf in leaves_with_paths:
            if _nnx_gate.is_node(leaf):
                graphdef, named = _nnx_gate.adapter().describe_node(leaf)
                sig[(name, (keystr(path) + " (structure)").strip())] = Shown(graphdef)
                for sub, value_leaf in named:
                    sig[(name, keystr(path) + sub)] = _describe_leaf(value_leaf)
            else:
                sig[(name, keystr(path))] = _describe_leaf(leaf)
    return sig


def diff(old: Signature, new: Signature) -> tuple[Change, ...]:
    changes = []
    for k in list(old) + [k for k in new if k not in old]:
        a, b = old.get(k, "absent"), new.get(k, "absent")
        if a != b:
            a, b = str(a), str(b)
            if k[1].endswith("(structure)"):
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


class _WholeReads(threading.local):
    """How many arguments this thread has read whole (`read_whole`)."""

    count = 0


WHOLE_READS = _WholeReads()


def read_whole() -> None:
    """Count one argument read whole (jax's flatten of it, NNX's graph walk of it): the
    general path compares the count around resolving a call and around installing its
    fast record, to tell `"general_read"` from `"general_cached"` (per thread: another
    thread's read is not this call's)."""
    WHOLE_READS.count += 1


class RecompileWarning(UserWarning):
    """A wrapped function keeps recompiling because the same input keeps changing.

    Warned once per function, where you asked jax to explain its cache misses
    (`jax.config.update("jax_explain_cache_misses", True)`, or the
    `jax.explain_cache_misses(True)` context), once the function has compiled at
    least 8 times and the same leaf changed in each of the last 6 recompiles. The message
    names the input and what to do: pass a changing non-array value as an array
    (`jnp.asarray(value)`) so that it is traced, or pad changing shapes to a few
    fixed sizes. Without that flag nothing is warned (`f.stats().recompiles` keeps
    the history either way). A subclass of `UserWarning`.

    **Example:**

    ```python
    import warnings

    import jax
    import jax.numpy as jnp

    import fastcall

    @fastcall.filter_jit  # a Python float is static: each new value compiles
    def scale(x, factor):
        return x * factor

    x = jnp.ones(2)
    with jax.explain_cache_misses(True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):
            scale(x, float(i))
    (warning,) = [w for w in caught if w.category is fastcall.RecompileWarning]
    print(warning.message)
    ```
    ```text
    fastcall.filter_jit(scale): compiled 8 times; each of the last 6 recompiles changed factor ...
    ```
    """


MAX_RECOMPILE_RECORDS = 256  # JitStats.recompiles keeps the most recent ones
STORM_COMPILES = 8  # warn once a function has compiled this often ...
STORM_WINDOW = 6  # ... and the same leaf changed in this many of the latest recompiles


def storm(traces: int, recompiles: list[Recompile]) -> str | None:
    """A warning message if the latest recompiles keep changing the same input, else None."""
    if traces < STORM_COMPILES or len(recompiles) < STORM_WINDOW:
        return None
    recent = recompiles[-STORM_WINDOW:]
    counts: dict[tuple[str, str], int] = {}
    for r in recent:
        # A storm is a value or shape that keeps changing (a float, a sequence length). A
        # function called with many structures (equinox's own filter_jvp tests do it) is
        # ordinary use, and warning there would fail suites run with filterwarnings=error.
        for c in {(c.argument, c.path) for c in r.changes if not c.path.endswith("(structure)")}:
            counts[c] = counts.get(c, 0) + 1
    culprits = [k for k, n in counts.items() if n == STORM_WINDOW]
    if not culprits:
        return None
    argument, path = culprits[0]
    last = next(c for c in recent[-1].changes if (c.argument, c.path) == (argument, path))
    where = argument + (" " + path if path.startswith("(") else path)
    if last.old.startswith("static") or last.new.startswith("static"):
        advice = (
            "A non-array value is part of the compile key, so every new value compiles a new "
            "program: pass it as an array (jnp.asarray(value)) to trace it instead."
        )
    else:
        advice = (
            "Every new shape or dtype compiles a new program: pad inputs to a few fixed sizes "
            "(bucketing), or keep the dtype fixed."
        )
    return (
        f"compiled {traces} times; each of the last {STORM_WINDOW} recompiles changed {where} "
        f"(latest: {last.old} -> {last.new}). {advice} (See .stats().recompiles for the history.)"
    )

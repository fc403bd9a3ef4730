"""Per wrapped function: its signature, options, table of compiled entries, and stats.

Wrappers of equal functions with equal options share one `FunctionState`
(`state_for`), so that `fastcall.jit(eqx.filter_grad(loss))` rebuilt every
step does not recompile.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from typing import Any, Iterator, NamedTuple

import jax

from . import _agreement, _build, _plan, _fast_route, _flatten, _hold, _nnx_gate, _stats, _structure_route
from ._build import Entry
from ._errors import FastcallError
from ._flatten import Spec
from ._options import UNSPECIFIED, JitOptions

# Bounds on what fastcall keeps (documented in docs/guarantees.md, "Threads and memory").
MAX_SIGNATURES = 1024  # static signatures (compiled entries) per wrapped function
_MAX_STATES = 8192


class KeyLayout(NamedTuple):
    """A call's key split into its parts: positional spec ids, then (if any keyword
    arguments) the sorted keyword names and their spec ids."""

    positional: tuple[int, ...]
    keyword_names: tuple[str, ...]
    keyword_ids: tuple[int, ...]


class PathCounts:
    """Calls served by each route (see `JitStats.paths`). The fast and structure routes
    count their own calls, on each wrapper's route objects."""

    __slots__ = ("general_cached", "general_read", "packed_leaves")

    def __init__(self) -> None:
        self.packed_leaves = 0  # (not a route: leaves bound packed into fast records, `_pack`)
        self.general_cached = 0
        self.general_read = 0

    def paths(self, fast_routes: list[Any], structure_routes: list[Any]) -> dict[str, int]:
        """The calls each route served (`JitStats.paths`), the routes' own counts added."""
        fast = sum(r.fast_calls for r in fast_routes)
        structure = sum(r.structure_calls for r in structure_routes)
        return {
            "c_fast": fast if _fast_route.COMPILED else 0,
            "python_fast": 0 if _fast_route.COMPILED else fast,
            "c_structure": structure if _structure_route.COMPILED else 0,
            "python_structure": 0 if _structure_route.COMPILED else structure,
            "general_cached": self.general_cached,
            "general_read": self.general_read,
        }


def _positional_names(signature: inspect.Signature | None) -> list[str]:
    """The names of the parameters an argument can be passed to by position."""
    if signature is None:
        return []
    return [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _serves_nested(options: JitOptions, donates: bool) -> bool:
    """Whether a call with NNX objects and nothing to write back, made while a JAX trace runs
    but served without a tracer in sight (the model closed over by the outer function), may
    be served by calling its compiled function nested in that trace instead of running
    inline, as the general path runs such calls. Nested, it gives what inline gives, except
    where jax treats a nested jit otherwise: it refuses compiler_options there, places a jit
    with a device, backend or shardings of its own apart from the outer computation, and
    under eager grad/vmap consumes donated inputs. The fast and structure paths (C and
    Python) check the trace for NNX calls unless this holds. (Calls without NNX objects never
    check: they never run inline.)"""
    return (
        options.compiler_options is None
        and (options.device, options.backend) == (None, None)
        and options.in_shardings is UNSPECIFIED
        and options.out_shardings is UNSPECIFIED
        and options.donate == "none"
        and not donates
    )


class FunctionState:
    def __init__(self, fun: Any, fun_spec: Spec, options: JitOptions, user_fun: Any) -> None:
        self.fun = fun  # what is traced (the user's function, or it with out_shardings)
        self.user_fun = user_fun
        self.fun_spec = fun_spec
        self.options = options
        self.table: dict[Any, Entry] = {}
        self.lock = threading.RLock()
        self.counts = PathCounts()
        self.traces = 0
        self.recompiles: list[_stats.Recompile] = []
        self.last_signature: _stats.Signature | None = None
        try:
            self.signature: inspect.Signature | None = inspect.signature(user_fun)
        except (TypeError, ValueError):
            self.signature = None
        self.param_names = _positional_names(self.signature)
        self.static_argnums, self.static_from_end = self._static_numbers(options)
        self.static_argnames = frozenset(options.static_argnames)
        self.donate_argnums = self._argnums(options.donate_argnums, options.donate_argnames)
        # (the fast path takes positional traced arguments only)
        self.has_static = bool(self.static_argnums or self.static_from_end or self.static_argnames)
        self.donate_argnames = frozenset(options.donate_argnames)
        self.serves_nested = _serves_nested(options, bool(self.donate_argnums or self.donate_argnames))
        # The arguments the fast and structure paths pass to jax.jit as they are, where a call
        # of this function passed a plain leaf (its spec id 0): `_flatten.plain_leaf_types`.
        self.plain_leaves = _flatten.plain_leaf_types(options.trace_scalars)
        # The wrapper's routes, for their call counts (`_fast_route.FastRoute`,
        # `_structure_route.StructureRoute`)
        self.fast_routes: weakref.WeakSet[Any] = weakref.WeakSet()
        self.structure_routes: weakref.WeakSet[Any] = weakref.WeakSet()
        # The structure path (`_plan.CallPlan`): `_plan.structure_key` -> record (the
        # newest; those of other structures met under the key in its `others`).
        self.structures: dict[Any, Any] = {}
        self.storm_warned = False
        # (top-level lists and dicts passed first: see `_hold.hold`)
        self.last_first: Any = None
        self.held_box: list[Any] = [None]  # (released when a wrapper of it dies: _api)
        self.hold_attempts = 0  # (`hold` calls since the fast path last served one)
        self.fast_calls_at_attempt = 0  # (`fast_calls()` at the latest)
        self.name = getattr(user_fun, "__qualname__", None) or type(user_fun).__name__
        # (what errors and warnings call the wrapper: `_errors.for_decorator`)
        self.decorator = options.decorator
        _all_states.add(self)

    def _static_numbers(self, options: JitOptions) -> tuple[frozenset[int], tuple[int, ...]]:
        """The static argument numbers, and those counted from the end of each call. A
        negative static argument number counts as the installed jax.jit counts it: from the
        end of each call's positional arguments (jax 0.10; always where `*args` takes any
        number), or from the end of the signature's positional parameters (jax 0.12),
        resolved here (`_negatives_per_call`). A negative donated one donates nothing, as in
        jax.jit (its donation vector matches numbers as given)."""
        static = self._argnums(options.static_argnums, options.static_argnames)
        negatives = tuple(i for i in options.static_argnums if i < 0)
        var_positional = self.signature is not None and any(
            p.kind is p.VAR_POSITIONAL for p in self.signature.parameters.values()
        )
        n = len(self.param_names)
        if negatives and not var_positional and n and not _negatives_per_call():
            return static | {i + n for i in negatives if i + n >= 0}, ()
        return static, negatives

    def _argnums(self, argnums: tuple[int, ...], argnames: tuple[str, ...]) -> frozenset[int]:
        """The non-negative numbers, and those of the positional parameters named."""
        nums = {i for i in argnums if i >= 0}
        for name in argnames:
            if name in self.param_names:
                nums.add(self.param_names.index(name))
        return frozenset(nums)

    def static_positions(self, nargs: int) -> frozenset[int]:
        """The positions of a call's static arguments, for a call of `nargs` positional ones
        (a negative number past the first is refused, with jax.jit's message)."""
        if not self.static_from_end:
            return self.static_argnums
        if any(i + nargs < 0 for i in self.static_from_end):
            raise FastcallError(
                "Positional argument indices, e.g. for `static_argnums`, must have value greater than or "
                f"equal to -len(args) and less than len(args), but got value {min(self.static_from_end)} "
                f"for len(args) == {nargs}."
            )
        return self.static_argnums | {i + nargs for i in self.static_from_end}

    def arg_name(self, i: int) -> str:
        return self.param_names[i] if i < len(self.param_names) else f"args[{i}]"

    def named_args(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Iterator[tuple[str, Any]]:
        for i, a in enumerate(args):
            yield self.arg_name(i), a
        if kwargs:
            yield from kwargs.items()

    # ---- the table of compiled entries ----

    def entry(self, key: tuple[Any, ...]) -> Entry:
        """The compiled entry for `key`, built on first use (once, under the lock)."""
        found = self.table.get(key)
        if found is not None:
            return found
        with self.lock:
            found = self.table.get(key)
            if found is not None:
                return found
            e = _build.build(self, key, self.fun)
            if _agreement.ENABLED:
                _agreement.check_entry(e)
            state_ref = weakref.ref(self)
            e.on_varies = functools.partial(_forget_records, state_ref)
            if len(self.table) >= MAX_SIGNATURES:
                # Drop the oldest static signature (its compiled programs go with it).
                self.table.pop(next(iter(self.table)))
                self.forget_records()
            self.table[key] = e
            return e

    def layout(self, key: tuple[Any, ...]) -> KeyLayout:
        for i, k in enumerate(key):
            if type(k) is tuple:
                return KeyLayout(tuple(key[:i]), k, tuple(key[i + 1 :]))
        return KeyLayout(tuple(key), (), ())

    def donated_slots(self, n_slots: int, n_positional: int, keyword_names: tuple[str, ...]) -> Iterator[int]:
        """Slots (0: the function, then positional, then keyword arguments) donated."""
        mode = self.options.donate
        for slot in range(n_slots):
            arg_index = slot - 1  # slot 0 is the function itself
            if arg_index < 0:
                give = mode in ("all", "warn")
            elif arg_index < n_positional:
                first = arg_index == 0
                give = (
                    mode in ("all", "warn")
                    or (mode in ("all-except-first", "warn-except-first") and not first)
                    or arg_index in self.donate_argnums
                )
            else:
                name = keyword_names[arg_index - n_positional]
                give = mode != "none" or name in self.donate_argnames
            if give:
                yield slot

    def forget_records(self) -> None:
        """Drop every fast and structure record of this function (its compiled entries
        were replaced or cleared)."""
        _plan.forget_function(self)
        adapter = _nnx_gate.loaded()
        if adapter is not None:
            adapter.forget_function(self)

    def clear(self) -> None:
        with self.lock:
            # (the latest outputs each entry noted: released after the lock, as releasing
            # may run code)
            memos = [entry.out.take_memo() for entry in self.table.values() if entry.out is not None]
            self.table.clear()
            self.forget_records()
            _hold.release_held(self.held_box)
            self.last_first = None
            self.hold_attempts = 0
        del memos

    # ---- stats ----

    def on_trace(self, named_values: list[tuple[str, Any]]) -> None:
        """Count a trace and explain it if it is a recompile. Trace time only."""
        signature = _stats.describe(named_values)
        storm = None
        with self.lock:
            self.traces += 1
            if self.last_signature is not None:
                self.recompiles.append(_stats.Recompile(_stats.diff(self.last_signature, signature)))
                del self.recompiles[: -_stats.MAX_RECOMPILE_RECORDS]
            self.last_signature = signature
            # (only where the user asked jax to explain its cache misses: a program that
            # compiles once per length, as nnx.jit's users' do, must not fail under
            # filterwarnings=error; .stats().recompiles keeps the explanations anyway)
            if not self.storm_warned and getattr(jax.config, "jax_explain_cache_misses", False):
                storm = _stats.storm(self.traces, self.recompiles)
                self.storm_warned = storm is not None
        if storm is not None:
            warnings.warn(f"{self.decorator}({self.name}): {storm}", _stats.RecompileWarning, stacklevel=2)

    def fast_calls(self) -> int:
        """How many calls the fast route (compiled or run as Python) has served."""
        return sum(r.fast_calls for r in list(self.fast_routes))

    def stats(self) -> _stats.JitStats:
        paths = self.counts.paths(list(self.fast_routes), list(self.structure_routes))
        calls = sum(paths.values())
        return _stats.JitStats(
            calls=calls,
            compiles=self.traces,
            hits=max(calls - self.traces, 0),
            recompiles=tuple(self.recompiles),
            paths=paths,
            packed_leaves=self.counts.packed_leaves,
        )


_all_states: weakref.WeakSet[FunctionState] = weakref.WeakSet()
_states: dict[Any, FunctionState] = {}
_states_lock = threading.Lock()


@functools.cache
def _negatives_per_call() -> bool:
    """Whether the installed jax.jit counts a negative static argument number from the end
    of each call's positional arguments (jax 0.10), rather than from the end of the
    signature's positional parameters (jax 0.12): asked of jax.jit once, by tracing a probe
    (no compile) for a function of two parameters and a default, called with two."""
    seen: list[bool] = []

    def probe(a: Any, b: Any, c: Any = 0) -> Any:
        seen.append(not isinstance(b, jax.core.Tracer))
        return a

    jax.jit(probe, static_argnums=-1).eval_shape(0.0, 0)
    return seen[0]


def state_for(fun: Any, fun_spec: Spec, options: JitOptions, user_fun: Any) -> FunctionState:
    """The state shared by wrappers of equal functions with equal options."""
    try:
        key = (fun_spec.id, options)
        hash(key)
    except TypeError:
        return FunctionState(fun, fun_spec, options, user_fun)
    with _states_lock:
        state = _states.get(key)
        if state is None:
            if len(_states) >= _MAX_STATES:
                _states.pop(next(iter(_states)))
            state = _states[key] = FunctionState(fun, fun_spec, options, user_fun)
        return state


def clear_all() -> None:
    with _states_lock:
        _states.clear()
    for state in list(_all_states):
        state.clear()


def _forget_records(state_ref: weakref.ref[FunctionState]) -> None:
    """Drop the records of a function whose entry started to vary, if it is alive (an entry
    holds its function weakly: jax may keep a trace's function alive longer)."""
    state = state_ref()
    if state is not None:
        state.forget_records()

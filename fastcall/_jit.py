"""`fastcall.jit`: the decorator, its per-function state, and the hot path.

Reading order: `jit` builds a wrapper closure; the closure's body (in
`_make_wrapper`) is the whole hot path. Everything that runs once per object,
per structure or per compile lives in `_JitState` methods or `_flatten`.

What a call costs on a cache hit (same model object as before):
  - one `type(x) is ArrayImpl` test per plain array argument;
  - one dict lookup and one weakref call per pytree argument (the identity
    cache: `id(obj) -> (weakref, leaves, spec id)`);
  - one dict lookup of the tuple of spec ids (a few small ints, not a treedef)
    to find the compiled entry;
  - the jax.jit C++ fast path on the flat list of leaves;
  - for a single array or a container of arrays, nothing after that: jax
    rebuilds the output in C++.
Nothing walks a pytree, nothing hashes a treedef, and nothing blocks.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
import warnings
import weakref
from typing import Any, Callable, Literal, ParamSpec, Protocol, Sequence, TypeVar, overload


import equinox as eqx
import jax
from jaxtyping import PyTree

from . import _flatten, _nnx, _stats
from ._errors import FastcallError
from ._errors import describe_arg as _describe
from ._flatten import ARRAY_TYPES, ArrayImpl, Spec, remember, spec_by_id
from ._trace import Tracer, contains_tracer, current_trace_has_callback

_accel: Any
try:  # the optional C fast path (fastcall/_accel.c)
    _accel = importlib.import_module("fastcall._accel")
except ImportError:  # pragma: no cover - not built: pure Python, same behaviour
    _accel = None

# Tests set this to False to exercise the pure-Python hot path.
USE_ACCEL = True

try:
    _JaxRuntimeError: type[BaseException] = jax.errors.JaxRuntimeError
except AttributeError:  # pragma: no cover
    _JaxRuntimeError = RuntimeError

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
P = ParamSpec("P")
R = TypeVar("R")


class JitWrapped(Protocol[P, R]):
    """What `fastcall.jit` returns: `fun` with the same signature, plus AOT and stats."""

    __wrapped__: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> Lowered: ...

    def stats(self) -> _stats.JitStats: ...

    def clear_cache(self) -> None: ...
_UNSPECIFIED: Any = object()


class _StructureVaries(Exception):
    """Raised inside a trace whose output structure differs from an earlier trace's."""


class _StepAside(Exception):
    """An argument is a tracer: run the function inline inside the outer trace."""


# --------------------------------------------------------------------------
# Output handling, decided at trace time


class _OutInfo:
    """How the flat outputs of one compiled entry become the user's output.

    mode "pass": the traced function returned the user's pytree itself (all
    leaves arrays, nothing to register); jax rebuilt it in C++.
    mode "flat": it returned a flat list of dynamic leaves (plus a marker when
    `block`); `post` merges static leaves back, unflattens, and registers
    returned Equinox modules in the identity cache.
    """

    __slots__ = (
        "mode", "treedef", "mask", "statics", "static_keys", "block", "regs", "writes", "nodes", "build",
        "strong", "restructure", "n_written",
    )
    treedef: Any

    def __init__(self, out: Any, block: bool, writes: tuple = (), nodes: bool = False, restructure: tuple = ()) -> None:
        self.writes = writes  # (NNX argument ordinal, leaf index) per written Variable
        self.restructure = restructure  # (NNX argument ordinal, new graphdef, n leaves)
        self.n_written = len(writes) + sum(n for _, _, n in restructure)  # trailing outputs
        self.nodes = nodes  # output holds NNX node markers to turn back into objects
        leaves, treedef = jax.tree_util.tree_flatten(out)
        mask = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
        self.treedef = treedef
        self.mask = mask
        self.statics = tuple(x for x, m in zip(leaves, mask) if not m)
        try:
            self.static_keys: Any = tuple(_flatten.leaf_key(s) for s in self.statics)
            hash(self.static_keys)
        except Exception:
            self.static_keys = None  # compared by identity below
        self.block = block
        self.regs = tuple(_registrations(out, mask))
        self.mode = "flat" if (self.statics or self.block or self.regs or writes or nodes or restructure) else "pass"
        # Generated code that rebuilds this output structure (None: use treedef.unflatten).
        self.build = _flatten.make_builder(out) if self.mode == "flat" else None
        self.strong: list[Any] = []  # tuples returned by the latest call, cached by identity

    def same_as(self, other: _OutInfo) -> bool:
        if self.static_keys is None or other.static_keys is None:
            same_statics = len(self.statics) == len(other.statics) and all(
                a is b for a, b in zip(self.statics, other.statics)
            )
        else:
            try:
                same_statics = bool(self.static_keys == other.static_keys)
            except Exception:
                same_statics = False
        return (
            same_statics
            and self.mode == other.mode
            and self.block == other.block
            and self.mask == other.mask
            and self.treedef == other.treedef
            and self.regs == other.regs
            and self.writes == other.writes
            and self.nodes == other.nodes
            and self.restructure == other.restructure
        )

    def flat_outputs(self, out: Any) -> list[Any]:
        dyn = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, ARRAY_TYPES)]
        if self.block:
            dyn.append(jax.numpy.zeros((), jax.numpy.int8))  # marker to wait on
        return dyn

    def post_nnx(self, dyn: Any, nnx_refs: list[tuple[Any, list[Any]]]) -> Any:
        """Write changed Variables back to the caller's objects, then post-process."""
        k = self.n_written
        if k:
            values = dyn[-k:]
            dyn = dyn[:-k]
            if isinstance(values[0], Tracer):  # all outputs are tracers, or none
                raise FastcallError(
                    "fastcall.jit: the function changes NNX state (Variables), but it was "
                    "called inside an outer JAX transformation with the NNX objects closed "
                    "over, so the new values are tracers and cannot be written back. Pass the "
                    "NNX objects through the outer transformation (use nnx.jit/nnx.grad/... "
                    "or nnx.split/merge outside), or call the function outside of it."
                )
            pos = 0
            # Objects returned from inside an argument's graph are looked up before the
            # graph changes (the indices refer to the graph the function was given).
            resolved = self._resolve_input_nodes(nnx_refs) if self.nodes and self.restructure else None
            for _, graphdef, n in self.restructure:
                _nnx.apply_structure(graphdef, list(values[pos : pos + n]), [ref[0] for ref in nnx_refs])
                pos += n
            for (ordinal, index), value in zip(self.writes, values[pos:]):
                _nnx.write_back(nnx_refs[ordinal][1], index, value)
        else:
            resolved = None
        result = dyn if self.mode == "pass" else self.post(dyn)
        if self.nodes:
            result = _unmark_nodes(result, nnx_refs, resolved)
        return result

    def _resolve_input_nodes(self, nnx_refs: list[Any]) -> dict[tuple[int, int], Any]:
        return {
            (m.k, m.index): _nnx.object_at(nnx_refs[m.k][0], m.index)
            for m in self.statics
            if type(m) is _InputNode and m.index != 0
        }

    def post(self, dyn: list[Any]) -> Any:
        if self.block:
            marker = dyn.pop()
            if type(marker) is ArrayImpl:
                _wait_and_translate(marker)
        if self.build is not None:
            result = self.build(dyn)
        elif self.statics:
            it_dyn, it_stat = iter(dyn), iter(self.statics)
            result = self.treedef.unflatten([next(it_dyn) if m else next(it_stat) for m in self.mask])
        else:
            result = self.treedef.unflatten(dyn)
        if self.regs:
            self._register(result, dyn)
        return result

    def _register(self, result: Any, dyn: Sequence[Any]) -> None:
        """Cache returned modules (and tuples such as optimizer states) by identity, so
        that `model, opt_state = step(model, opt_state, ...)` hits the cache next step.
        Only concrete arrays (not tracers of an outer trace) may be cached."""
        strong: list[Any] = []
        with _strong_lock:  # (two threads finishing calls of one program at once)
            previous, self.strong = self.strong, strong
        for old in previous:
            _flatten.forget_strong(old)
        for index, start, stop, spec in self.regs:
            if type(dyn[start]) is not ArrayImpl:
                continue
            item = result if index is None else result[index]
            if type(item) is tuple:
                strong.append(_flatten.remember_strongly(item, dyn[start:stop], spec))
            else:
                remember(item, dyn[start:stop], spec)


_strong_lock = threading.Lock()


def _registrations(out: Any, mask: tuple[bool, ...]):
    """(index, start, stop, spec) for each Equinox module or immutable tuple returned
    at top level (as the output, or as an element of an output tuple)."""
    if isinstance(out, eqx.Module):
        candidates: list[tuple[int | None, Any]] = [(None, out)]
    elif type(out) is tuple:
        candidates = list(enumerate(out))
    else:
        return
    pos = 0  # position in the dynamic outputs
    for index, item in candidates:
        leaves = jax.tree_util.tree_leaves(item)
        n_dyn = sum(isinstance(x, ARRAY_TYPES) for x in leaves)
        if (isinstance(item, eqx.Module) or type(item) is tuple) and n_dyn:
            try:
                spec, _ = _flatten.flatten_generic(item, "output")
            except FastcallError:
                spec = None
            if spec is not None and spec.cacheable:
                yield (index, pos, pos + n_dyn, spec)  # (interned: compares by identity)
        pos += n_dyn


def _wait_and_translate(marker: Any) -> None:
    """Wait for a program with `eqx.error_if` checks and raise their error as Equinox does."""
    try:
        marker.block_until_ready()
    except (_JaxRuntimeError, ValueError) as err:
        _translate(err)


def _translate(err: BaseException) -> None:
    """Re-raise an `eqx.error_if` failure as `eqx.EquinoxRuntimeError` with its message
    (as eqx.filter_jit does); re-raise anything else unchanged."""
    if "_EquinoxRuntimeError" in str(err):
        from equinox import _jit as eqx_jit  # where eqx.error_if leaves its message

        info = getattr(eqx_jit, "last_error_info", None)
        msg = info[0] if info else str(err)
        raise eqx.EquinoxRuntimeError(msg) from None
    raise err


def _on_error(err: BaseException, args: Any = (), kwargs: Any = None, state: Any = None) -> None:
    """Re-raise an exception from running a compiled function, made clearer where we can:
    a deleted (e.g. donated) input array is named by argument and leaf path; an
    `eqx.error_if` failure becomes `eqx.EquinoxRuntimeError`. Always raises."""
    if isinstance(err, RuntimeError) and "has been deleted" in str(err):
        culprit = _find_deleted(args, kwargs or {}, state)
        if culprit is not None:
            raise FastcallError(
                f"fastcall.jit: {culprit} is a deleted array: it was donated to an earlier call "
                "(donate=... / donate_argnums) or deleted explicitly, and cannot be used again. "
                "Pass the new value returned by that call instead, or do not donate it."
            ) from err
    _translate(err)


def _find_deleted(args: Any, kwargs: dict[str, Any], state: Any) -> str | None:
    from ._errors import describe_arg

    named = [(state.arg_name(i) if state is not None else f"args[{i}]", a) for i, a in enumerate(args)]
    named += list(kwargs.items())
    for name, value in named:
        if _nnx.is_node(value):
            try:
                flat = _nnx.graphlib.flatten(value, with_paths=True)[1]
                pairs = [
                    ("." + ".".join(map(str, p)), v.get_raw_value() if isinstance(v, _nnx.Variable) else v)
                    for p, v in zip(flat.paths, flat.leaves)
                ]
            except Exception:
                continue
        else:
            pairs = [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(value)[0]]
        for path, leaf in pairs:
            is_deleted = getattr(leaf, "is_deleted", None)
            if is_deleted is not None and not isinstance(leaf, Tracer):
                try:
                    if is_deleted():
                        return describe_arg(name, path)
                except Exception:
                    pass
    return None


class _QuietEquinoxCallbacks(logging.Filter):
    """jax logs every failed pure_callback; an `eqx.error_if` failure is raised to the
    caller as an EquinoxRuntimeError instead, so its log record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "_EquinoxRuntimeError")


logging.getLogger("jax._src.callback").addFilter(_QuietEquinoxCallbacks())


class _InputNode:
    """Output marker: the function returned its k-th NNX argument, or the object at graph
    index `index` inside it (a submodule, a Variable): the caller's own object is returned."""

    __slots__ = ("k", "index")

    def __init__(self, k: int, index: int = 0) -> None:
        self.k = k
        self.index = index

    def __eq__(self, other: object) -> bool:
        return type(other) is _InputNode and (other.k, other.index) == (self.k, self.index)

    def __hash__(self) -> int:
        return hash((_InputNode, self.k, self.index))


class _NewNode:
    """Output marker: an NNX object created by the function, rebuilt outside from its values."""

    __slots__ = ("graphdef", "values")

    def __init__(self, graphdef: Any, values: list[Any]) -> None:
        self.graphdef = graphdef
        self.values = values


jax.tree_util.register_pytree_node(
    _NewNode, lambda n: (n.values, n.graphdef), lambda gd, vals: _NewNode(gd, list(vals))
)


def _mark_nodes(out: Any, traced: list[Any]) -> tuple[Any, bool]:
    """Replace NNX objects in the output by markers (trace time)."""
    found = [False]

    inner: dict[int, tuple[int, int]] = {}  # id(object rebuilt in the trace) -> (k, index)
    for k, (t, _) in enumerate(traced):
        if t.spec.joint:
            continue  # (indices shared between arguments: sub-objects come back as copies)
        for index, obj in t.index_ref.items():
            inner.setdefault(id(obj), (k, index))

    def mark(x: Any) -> Any:
        if not _nnx.is_node(x):
            return x
        found[0] = True
        for k, (t, _) in enumerate(traced):
            if x is t.node:
                return _InputNode(k)
        if id(x) in inner:
            return _InputNode(*inner[id(x)])
        graphdef, values = _nnx.graphlib.flatten(x, with_paths=False)
        return _NewNode(graphdef, list(values))

    marked = jax.tree_util.tree_map(mark, out, is_leaf=_nnx.is_node)
    return marked, found[0]


def _unmark_nodes(result: Any, nnx_refs: list[tuple[Any, list[Any]]], resolved: Any = None) -> Any:
    def unmark(x: Any) -> Any:
        if type(x) is _InputNode:
            if x.index == 0:
                return nnx_refs[x.k][0]
            if resolved is not None:
                return resolved[(x.k, x.index)]
            return _nnx.object_at(nnx_refs[x.k][0], x.index)
        if type(x) is _NewNode:
            return _nnx.graphlib.unflatten(x.graphdef, list(x.values))
        return x

    return jax.tree_util.tree_map(unmark, result, is_leaf=lambda x: type(x) in (_InputNode, _NewNode))


class _Box:
    """Carries an _OutInfo through jax's output pytree (used only for varying outputs)."""

    __slots__ = ("info",)

    def __init__(self, info: _OutInfo) -> None:
        self.info = info


jax.tree_util.register_pytree_node(_Box, lambda b: ((), b.info), lambda info, _: _Box(info))


# --------------------------------------------------------------------------
# One compiled entry per static signature


class _Entry:
    """One static signature of a wrapped function: a jax.jit over flat leaves.

    `fn(*leaves)` runs it; `passthrough` says the result needs no post-processing
    (otherwise call `post`). jax.jit's own cache handles shapes and dtypes.
    """

    __slots__ = ("fn", "passthrough", "post", "post_nnx", "out", "varies", "lock", "key", "on_varies", "__weakref__")

    def __init__(self) -> None:
        self.key: Any = None
        self.on_varies: Callable[[], Any] | None = None  # installs the varying replacement
        self.post_nnx: Callable[[Any, Any], Any] | None = None
        self.fn: Any = None
        self.passthrough = False
        self.post: Callable[[Any], Any] = _not_traced
        self.out: _OutInfo | None = None
        self.varies = False
        self.lock = threading.Lock()

    def set_out(self, info: _OutInfo) -> None:
        varied = False
        with self.lock:
            if self.out is None:
                self.out = info
                # NNX post-processing only when Variables are written or NNX objects returned.
                self.post_nnx = info.post_nnx if (info.writes or info.nodes or info.restructure) else None
                if info.mode == "pass":
                    self.post = _identity
                    self.passthrough = True
                else:
                    self.post = info.post
            elif not self.out.same_as(info):
                varied = True
        if varied:
            # Install the replacement now, so that the caller's retry finds it and this
            # shape is traced once more, not twice.
            if self.on_varies is not None:
                self.on_varies()
            raise _StructureVaries


def _identity(x: Any) -> Any:
    return x


def _not_traced(out: Any) -> Any:  # pragma: no cover - set_out always runs first
    raise AssertionError("fastcall: output structure unknown before the first trace")


def _post_varying(out: Any) -> Any:
    dyn, box = out
    info = box.info
    return dyn if info.mode == "pass" else info.post(dyn)


def _post_varying_nnx(out: Any, nnx_refs: list[Any]) -> Any:
    dyn, box = out
    return box.info.post_nnx(dyn, nnx_refs)



# --------------------------------------------------------------------------
# Per-function state (shared by wrappers of equal functions)


class _JitState:
    def __init__(self, fun: Any, fun_spec: Spec, options: dict[str, Any]) -> None:
        user_fun = fun.fun if isinstance(fun, _OutShardings) else fun
        self.fun_spec = fun_spec
        self.options = options
        self.table: dict[Any, _Entry] = {}
        self.lock = threading.RLock()
        self.calls = [0]
        self.traces = 0
        self.recompiles: list[_stats.Recompile] = []
        self.last_signature: _stats.Signature | None = None
        try:
            self.signature: inspect.Signature | None = inspect.signature(user_fun)
        except (TypeError, ValueError):
            self.signature = None
        self.param_names: list[str] = []
        if self.signature is not None:
            self.param_names = [
                p.name
                for p in self.signature.parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        self.static_argnums = self._argnums(options["static_argnums"], options["static_argnames"])
        self.static_argnames = frozenset(_as_tuple(options["static_argnames"]))
        self.donate_argnums = self._argnums(options["donate_argnums"], options["donate_argnames"])
        self.donate_argnames = frozenset(_as_tuple(options["donate_argnames"]))
        self.needs_slow_path = bool(self.static_argnums or self.static_argnames)
        self.accelerated: weakref.WeakSet[Any] = weakref.WeakSet()  # C wrappers (their call counts)
        self.storm_warned = False
        self.name = getattr(user_fun, "__qualname__", None) or type(user_fun).__name__
        _all_states.add(self)

    def _argnums(self, argnums: Any, argnames: Any) -> frozenset[int]:
        nums = set(_as_tuple(argnums))
        for name in _as_tuple(argnames):
            if name in self.param_names:
                nums.add(self.param_names.index(name))
        n = len(self.param_names)
        return frozenset(i + n if i < 0 and n else i for i in nums)

    def arg_name(self, i: int) -> str:
        return self.param_names[i] if i < len(self.param_names) else f"args[{i}]"

    # ---- resolving one argument (the miss path) ----

    def resolve(
        self, value: Any, leaves: list[Any], arg_name: str, nnx_refs: list[Any], joint: Any = None
    ) -> int:
        """Append `value`'s dynamic leaves to `leaves`; return its spec id.

        NNX objects also append (object, Variables, cache entry) to `nnx_refs` for
        write-back. With `joint` (a shared NNX RefMap), NNX arguments that share objects
        are flattened together, so that shared Variables stay shared (as in nnx.jit).
        Raises _StepAside if `value` holds a tracer.
        """
        if joint is not None and _nnx.is_node(value):
            spec, items, current = _nnx.joint_flatten(value, joint, arg_name)
            if contains_tracer(current):
                raise _StepAside
            leaves += current
            nnx_refs.append((value, items, None))
            return spec.id
        if _nnx.is_node(value):
            node_entry = _nnx.lookup(value, arg_name)
            current = node_entry.values()
            # Inside nnx.grad/vmap/scan the module is a copy holding tracers: run
            # inline. Variables of a module created outside cannot receive tracers
            # (NNX forbids it), so for a known object the first value tells.
            if current and (type(current[0]) is not ArrayImpl or node_entry.fresh):
                node_entry.fresh = False
                if contains_tracer(current):
                    raise _StepAside
            leaves += current
            nnx_refs.append((value, node_entry.items, node_entry))
            return node_entry.spec_id
        for template in _flatten.templates.get(type(value), ()):
            found = template.extract(value)
            if found is not None:
                leaves += found
                spec = template.spec
                if spec.cacheable:
                    remember(value, found, spec)
                return spec.id
        if isinstance(value, ARRAY_TYPES):
            if isinstance(value, Tracer):
                raise _StepAside
            leaves.append(value)
            return 0
        scalar = _scalar_spec(value)
        if scalar is not None:
            return scalar
        spec, dynamic = _flatten.flatten_generic(value, arg_name)
        if contains_tracer(dynamic):
            raise _StepAside
        if spec.has_nnx:
            raise FastcallError(
                f"fastcall.jit: {_describe(arg_name)} holds NNX objects inside a container "
                f"({type(value).__name__}). fastcall tracks NNX state (values read, changes "
                "written back) only for NNX objects passed directly as arguments: pass each "
                "module, Optimizer or Rngs as its own argument."
            )
        leaves.extend(dynamic)
        if spec.cacheable:
            remember(value, tuple(dynamic), spec)
        if not spec.templated:
            spec.templated = True
            _flatten.learn(value, spec, dynamic)
        return spec.id

    def prepare(self, fun_leaves: Sequence[Any], args: tuple[Any, ...], kwargs: dict[str, Any], joint: bool = False):
        """The general path: kwargs, static arguments, NNX arguments sharing objects.
        Returns (args, kwargs, leaves, key, nnx_refs)."""
        if kwargs and self.signature is not None:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError:
                return None  # let the function itself raise its own TypeError
            args, kwargs = bound.args, bound.kwargs
        leaves = list(fun_leaves)
        key: list[Any] = []
        nnx_refs: list[Any] = []
        shared = _nnx.graphlib.RefMap() if joint else None
        for i, a in enumerate(args):
            name = self.arg_name(i)
            if i in self.static_argnums or name in self.static_argnames:
                key.append(_flatten.static_spec(a, name).id)
            else:
                key.append(self.resolve(a, leaves, name, nnx_refs, shared))
        if kwargs:
            names = tuple(sorted(kwargs))
            key.append(names)
            for name in names:
                if name in self.static_argnames:
                    key.append(_flatten.static_spec(kwargs[name], name).id)
                else:
                    key.append(self.resolve(kwargs[name], leaves, name, nnx_refs, shared))
        if not joint and len(nnx_refs) > 1 and _nnx.overlapping([r[2] for r in nnx_refs]):
            return self.prepare(fun_leaves, args, kwargs, joint=True)
        return args, kwargs, leaves, tuple(key), nnx_refs

    # ---- compiling ----

    def entry(self, key: tuple[Any, ...], fun_leaves: Sequence[Any], fun: Any) -> _Entry:
        with self.lock:
            found = self.table.get(key)
            if found is not None:
                return found
            e = _Entry()
            self._build(e, key, fun)
            e.key = key
            state_ref = weakref.ref(self)
            e.on_varies = lambda: (s := state_ref()) is not None and s.make_varying(key, e, fun)
            if len(self.table) >= MAX_SIGNATURES:
                # Drop the oldest static signature (its compiled programs go with it).
                self.table.pop(next(iter(self.table)))
                _flatten.unbind(self)
                _nnx.unbind(self)
            self.table[key] = e
            return e

    def _layout(self, key: tuple[Any, ...]):
        """Split a key into positional spec ids, keyword names and keyword spec ids."""
        for i, k in enumerate(key):
            if type(k) is tuple:
                return list(key[:i]), k, list(key[i + 1 :])
        return list(key), (), []

    def _build(self, e: _Entry, key: tuple[Any, ...], fun: Any, varies: bool = False) -> None:
        pos_ids, kw_names, kw_ids = self._layout(key)
        fun_spec = self.fun_spec
        pos_specs = [spec_by_id(k) for k in pos_ids]
        kw_specs = [spec_by_id(k) for k in kw_ids]
        arg_names = [self.arg_name(i) for i in range(len(pos_specs))] + list(kw_names)
        all_specs = [fun_spec] + pos_specs + kw_specs
        counts = [s.n_dyn for s in all_specs]
        e.varies = varies
        state_ref = weakref.ref(self)
        graph_updates = self.options["graph_updates"] is not False
        # For each NNX argument (in order): is it donated? Then every Variable is
        # returned and written back, so that the caller's Variables stay usable.
        donated = set(self._donated_slots(all_specs, pos_specs, kw_names))
        donated_slots = [slot in donated for slot, sp in enumerate(all_specs) if sp.kind == "nnx"]
        # in_shardings, one per leaf, computed once; with them, written-back Variables
        # keep their input sharding (as nnx.jit).
        in_shardings = self.options["in_shardings"]
        slot_shardings = None if in_shardings is _UNSPECIFIED else _leaf_shardings(in_shardings, all_specs)
        state_shardings = [
            slot_shardings[slot] if slot_shardings is not None else None
            for slot, sp in enumerate(all_specs)
            if sp.kind == "nnx"
        ]

        def flat_fn(*dyn: Any) -> Any:
            values = []
            traced = []  # NNX arguments: (_nnx.Traced, argument name)
            shared_index = _nnx.graphlib.IndexMap()  # for NNX arguments flattened jointly
            start = 0
            for spec, n, arg_name in zip(all_specs, counts, ["fun"] + arg_names):
                segment = dyn[start : start + n]
                if spec.kind == "nnx":
                    t = _nnx.Traced(spec, segment, shared_index if spec.joint else None)
                    traced.append((t, arg_name))
                    values.append(t.node)
                else:
                    values.append(spec.rebuild(segment))
                start += n
            _nnx.Traced.snapshot([t for t, _ in traced])
            f, rest = values[0], values[1:]
            args = rest[: len(pos_specs)]
            kwargs = dict(zip(kw_names, rest[len(pos_specs) :]))
            state = state_ref()
            if state is not None:
                state.on_trace(list(zip(arg_names, rest)))
            out = f(*args, **kwargs)
            # NNX: which Variables changed (decided here, once per compile), and whether
            # the graph itself changed (then the new structure is propagated back).
            writes, written, restructured = [], [], []
            restructure: list[tuple[int, Any, int]] = []  # (ordinal, new graphdef, n leaves)
            refmap = None
            changed = _nnx.Traced.structure_changed([t for t, _ in traced])
            for ordinal, (t, arg_name) in enumerate(traced):
                if changed[ordinal]:
                    if t.spec.joint:
                        raise _nnx.joint_structure_error(arg_name)
                    if not graph_updates:
                        raise _nnx.structure_error(arg_name)
                    if refmap is None:
                        refmap = _nnx.outer_index_map(traced)
                    graphdef, leaves = _nnx.split_updated(t.node, refmap)
                    restructure.append((ordinal, graphdef, len(leaves)))
                    restructured += leaves
                    continue
                shardings = state_shardings[ordinal]
                for index, value in t.writes(everything=donated_slots[ordinal]):
                    if shardings is not None and shardings[index] is not None:
                        value = jax.lax.with_sharding_constraint(value, shardings[index])
                    writes.append((ordinal, index))
                    written.append(value)
            out, has_nodes = _mark_nodes(out, traced)
            info = _OutInfo(out, current_trace_has_callback(), tuple(writes), has_nodes, tuple(restructure))
            # Layout: user outputs, restructured graphs' leaves, then written Variables
            # (the order post_nnx reads them back in).
            flat = out if info.mode == "pass" else info.flat_outputs(out) + restructured + written
            if varies:
                return flat, _Box(info)
            e.set_out(info)
            return flat

        name = getattr(fun, "__name__", None) or type(fun).__name__
        flat_fn.__name__ = flat_fn.__qualname__ = str(name)
        jit_kwargs = self._jit_kwargs(counts, donated, slot_shardings)
        e.fn = jax.jit(flat_fn, **jit_kwargs)
        if self.options["donate"] in ("all", "all-except-first"):
            e.fn = _suppress_donation_warning(e.fn)
        if varies:
            e.post = _post_varying
            e.post_nnx = _post_varying_nnx
            e.passthrough = False

    def _jit_kwargs(self, counts: list[int], donated_slots: set[int], slot_shardings: Any) -> dict[str, Any]:
        opts = self.options
        kw: dict[str, Any] = {}
        for name in ("keep_unused", "inline"):
            if opts[name]:
                kw[name] = opts[name]
        for name in ("device", "backend", "compiler_options"):
            if opts[name] is not None:
                kw[name] = opts[name]
        # Donation and shardings are decided per argument (slot), then listed per leaf.
        donated: list[int] = []
        start = 0
        for slot, n in enumerate(counts):
            if slot in donated_slots:
                donated.extend(range(start, start + n))
            start += n
        if donated:
            kw["donate_argnums"] = tuple(donated)
        if slot_shardings is not None:
            kw["in_shardings"] = tuple(sh for per_leaf in slot_shardings for sh in per_leaf)
        return kw

    def _donated_slots(self, all_specs: list[Any], pos_specs: list[Any], kw_names: Any):
        """Slots (0: the function, then positional, then keyword arguments) donated."""
        donate_mode = self.options["donate"]
        for slot in range(len(all_specs)):
            arg_index = slot - 1  # slot 0 is the function itself
            if arg_index < 0:
                give = donate_mode in ("all", "warn")
            elif arg_index < len(pos_specs):
                first = arg_index == 0
                give = (
                    donate_mode in ("all", "warn")
                    or (donate_mode in ("all-except-first", "warn-except-first") and not first)
                    or arg_index in self.donate_argnums
                )
            else:
                name = kw_names[arg_index - len(pos_specs)]
                give = donate_mode in ("all", "warn", "all-except-first", "warn-except-first") or (
                    name in self.donate_argnames
                )
            if give:
                yield slot

    def on_trace(self, named_values: list[tuple[str, Any]]) -> None:
        """Count a trace and explain it if it is a recompile. Trace time only."""
        signature = _stats.describe(named_values)
        storm = None
        with self.lock:
            self.traces += 1
            if self.last_signature is not None:
                self.recompiles.append(_stats.Recompile(_stats.diff(self.last_signature, signature)))
                del self.recompiles[:-_stats.MAX_RECOMPILE_RECORDS]
            self.last_signature = signature
            if not self.storm_warned:
                storm = _stats.storm(self.traces, self.recompiles)
                self.storm_warned = storm is not None
        if storm is not None:
            warnings.warn(f"fastcall.jit({self.name}): {storm}", _stats.RecompileWarning, stacklevel=2)

    def make_varying(self, key: tuple[Any, ...], old: _Entry, fun: Any) -> _Entry:
        """Swap in an entry that carries its output structure through jax (rare)."""
        with self.lock:
            current = self.table.get(key)
            if current is not None and current is not old and current.varies:
                return current
            e = _Entry()
            self._build(e, key, fun, varies=True)
            self.table[key] = e
            _flatten.unbind(self)
            _nnx.unbind(self)
            return e

    def stats(self) -> _stats.JitStats:
        calls = self.calls[0] + sum(w._fastcall_c_calls for w in list(self.accelerated))
        return _stats.JitStats(
            calls=calls,
            compiles=self.traces,
            hits=max(calls - self.traces, 0),
            recompiles=tuple(self.recompiles),
        )

    def clear(self) -> None:
        with self.lock:
            self.table.clear()
            _flatten.unbind(self)
            _nnx.unbind(self)


# Bounds on what fastcall keeps (documented in README "Guarantees and limits").
MAX_SIGNATURES = 1024  # static signatures (compiled entries) per wrapped function
_all_states: weakref.WeakSet[_JitState] = weakref.WeakSet()
_states: dict[Any, _JitState] = {}
_states_lock = threading.Lock()
_MAX_STATES = 8192


def _leaf_shardings(shardings: Any, all_specs: list[Any]) -> list[list[Any]]:
    """jax.jit-style in_shardings (one for all, or one entry per positional argument, each
    a Sharding or a pytree prefix; for NNX arguments also an nnx.StateSharding or an
    nnx.prefix result) as one sharding per dynamic leaf, per slot (0: the function)."""
    per_slot: list[list[Any]] = []
    for slot, spec in enumerate(all_specs):
        if not isinstance(shardings, (tuple, list)):
            entry = shardings
        else:
            entry = shardings[slot - 1] if 0 < slot <= len(shardings) else None
        if entry is None or isinstance(entry, jax.sharding.Sharding):
            per_slot.append([entry] * spec.n_dyn)
        elif spec.kind == "nnx":
            per_slot.append(_nnx.leaf_shardings(spec, entry))
        elif spec.kind == "tree":  # a pytree prefix of the argument
            full = spec.treedef.unflatten([object()] * len(spec.mask))
            per_leaf = _broadcast_prefix(entry, full)
            per_slot.append([sh for sh, m in zip(per_leaf, spec.mask) if m])
        else:
            per_slot.append([entry] * spec.n_dyn)
    return per_slot


def _broadcast_prefix(prefix: Any, full: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    prefix_def: Any
    prefix_leaves, prefix_def = jax.tree_util.tree_flatten(
        prefix, is_leaf=lambda x: x is None or hasattr(x, "map_prefix")  # (nnx.StateSharding)
    )
    subtrees = prefix_def.flatten_up_to(full)
    out: list[Any] = []
    for p, sub in zip(prefix_leaves, subtrees):
        out.extend([p] * len(jax.tree_util.tree_leaves(sub, is_leaf=is_leaf)))
    return out


def _suppress_donation_warning(fn: Any) -> Any:
    # donate="all" promises silence about unusable donated buffers, as in eqx.
    def call(*leaves: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            return fn(*leaves)

    call.lower = fn.lower  # type: ignore[attr-defined]
    return call


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    if isinstance(x, (int, str)):
        return (x,)
    return tuple(x)


_SCALARS = (int, float, bool, str, complex, type(None))
_scalar_specs: dict[Any, Spec] = {}


def _scalar_spec(value: Any) -> int | None:
    """Spec id of a Python scalar argument (static), without tree_flatten."""
    if type(value) not in _SCALARS:
        return None
    key = _flatten.leaf_key(value)
    spec = _scalar_specs.get(key)
    if spec is None:
        spec, _ = _flatten.flatten_generic(value, "scalar")
        if len(_scalar_specs) > 4096:
            _scalar_specs.clear()
        _scalar_specs[key] = spec
    return spec.id


def _state_for(fun: Any, fun_spec: Spec, options: dict[str, Any]) -> _JitState:
    """Equal functions with equal options share compiled programs (no recompiles
    for `fastcall.jit(eqx.filter_grad(loss))` rebuilt every step)."""
    try:
        key = (fun_spec.id, tuple(sorted(options.items(), key=lambda kv: kv[0])))
        hash(key)
    except TypeError:
        return _JitState(fun, fun_spec, options)
    with _states_lock:
        state = _states.get(key)
        if state is None:
            if len(_states) >= _MAX_STATES:
                _states.pop(next(iter(_states)))
            state = _states[key] = _JitState(fun, fun_spec, options)
        return state


def clear_caches() -> None:
    """Drop every cache fastcall holds: identity cache, templates, compiled programs.

    Wrapped functions keep working; their next call re-flattens and recompiles.
    """
    _flatten.clear()
    _nnx.clear()
    _scalar_specs.clear()
    with _states_lock:
        _states.clear()
    for state in list(_all_states):
        state.clear()


# --------------------------------------------------------------------------
# The decorator


@overload
def jit(
    fun: Callable[P, R],
    *,
    donate: Donate = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Sequence[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Sequence[str] | None = ...,
    in_shardings: PyTree = ...,
    out_shardings: PyTree = ...,
    device: Any = ...,
    backend: str | None = ...,
    keep_unused: bool = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool | None = ...,
    graph_updates: bool | None = ...,
) -> JitWrapped[P, R]: ...


@overload
def jit(
    fun: None = None,
    *,
    donate: Donate = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Sequence[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Sequence[str] | None = ...,
    in_shardings: PyTree = ...,
    out_shardings: PyTree = ...,
    device: Any = ...,
    backend: str | None = ...,
    keep_unused: bool = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool | None = ...,
    graph_updates: bool | None = ...,
) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...


def jit(
    fun: Callable | None = None,
    *,
    donate: Donate = "none",
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = _UNSPECIFIED,
    out_shardings: Any = _UNSPECIFIED,
    device: Any = None,
    backend: str | None = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
) -> Any:
    """Compile `fun` with `eqx.filter_jit` semantics at close to `jax.jit`'s cost.

    **Arguments:**

    - `fun`: the function to compile. May be a plain function, a method (the
      wrapper is a descriptor, so `@fastcall.jit def __call__(self, x)` works
      on an `eqx.Module`), or any callable pytree (e.g. an `eqx.Module`, whose
      arrays are then traced).
    - `donate`: as in `eqx.filter_jit`: `"all"`, `"all-except-first"`,
      `"warn"`, `"warn-except-first"` or `"none"`.
    - `static_argnums`, `static_argnames`: as in `jax.jit`; the whole argument
      is static (hashed and compared by value). Non-array leaves are static
      anyway; use these only to force a value into the compile key whole.
    - `donate_argnums`, `donate_argnames`: donate the arrays of these arguments.
    - `in_shardings`, `out_shardings`, `device`, `backend`, `keep_unused`,
      `inline`, `compiler_options`: passed to `jax.jit`. `in_shardings` is one
      sharding for all arrays or one entry per positional argument (a pytree
      prefix of it); `out_shardings` (a sharding or a pytree prefix of the
      output) is applied as a sharding constraint on the outputs.
    - `graph`, `graph_updates`: as in `nnx.jit`. fastcall always keeps NNX
      sharing (what graph mode gives) at tree-mode cost, so `graph` changes
      nothing; structural changes made inside the function are propagated to
      the caller's objects unless `graph_updates=False`, which makes them a
      `FastcallError`.

    **Returns:** a function with `fun`'s name, docstring and signature, plus
    `.lower(*args, **kwargs)`, `.stats()` and `.clear_cache()`.

    Every JAX/NumPy array leaf of the arguments is traced; every other leaf
    (Python scalars, strings, callables, `eqx.field(static=True)`, None) is
    static and part of the compile key. Called under an outer trace (jit,
    grad, vmap, scan, ...) with traced arguments, it runs `fun` inline.

    !!! example

        ```python
        @fastcall.jit
        def forward(model, x):
            return model(x)

        forward(model, x)  # compiles
        forward(model, x)  # ~1 us of Python on top of jax.jit's own dispatch
        ```
    """
    options = dict(
        donate=donate,
        static_argnums=_hashable_option(static_argnums),
        static_argnames=_hashable_option(static_argnames),
        donate_argnums=_hashable_option(donate_argnums),
        donate_argnames=_hashable_option(donate_argnames),
        in_shardings=_hashable_option(in_shardings),
        out_shardings=_hashable_option(out_shardings),
        device=device,
        backend=backend,
        keep_unused=keep_unused,
        inline=inline,
        compiler_options=_hashable_option(compiler_options),
        graph_updates=graph_updates,
    )
    if donate not in ("all", "all-except-first", "warn", "warn-except-first", "none"):
        raise ValueError(
            "fastcall.jit(donate=...) must be one of 'all', 'all-except-first', 'warn', "
            f"'warn-except-first' or 'none'; got {donate!r}."
        )
    if fun is None:
        return functools.partial(jit, **{k: v for k, v in options.items()})
    if not callable(fun):
        raise TypeError(f"fastcall.jit expects a callable, got {type(fun).__name__}.")
    if out_shardings is not _UNSPECIFIED:
        fun = _with_out_shardings(fun, out_shardings)
    fun_spec, fun_leaves = _flatten.flatten_generic(fun, "fun")
    state = _state_for(fun, fun_spec, options)
    return _make_wrapper(fun, tuple(fun_leaves), state)


def _hashable_option(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_hashable_option(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable_option(v)) for k, v in x.items()))
    return x


class _OutShardings(eqx.Module):
    """`fun` with a sharding constraint on its array outputs (for `out_shardings`)."""

    fun: Callable
    shardings: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fun(*args, **kwargs)
        treedef: Any
        # NNX objects stay whole (their identity matters for write-back); their Variables
        # are constrained in place, per Variable for an nnx.StateSharding.
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=_nnx.is_node)
        if isinstance(self.shardings, jax.sharding.Sharding) or self.shardings is None:
            per_leaf = [self.shardings] * len(leaves)
        else:
            per_leaf = _broadcast_prefix(self.shardings, out, is_leaf=_nnx.is_node)
        constrained = []
        for x, sh in zip(leaves, per_leaf):
            if sh is None:
                constrained.append(x)
            elif _nnx.is_node(x):
                _nnx.constrain(x, sh)
                constrained.append(x)
            elif isinstance(x, jax.Array):
                constrained.append(jax.lax.with_sharding_constraint(x, sh))
            else:
                constrained.append(x)
        return treedef.unflatten(constrained)


def _with_out_shardings(fun: Any, shardings: Any) -> Any:
    wrapped = _OutShardings(fun, _hashable_option(shardings))
    return wrapped


def _make_wrapper(fun: Any, fun_leaves: tuple[Any, ...], state: _JitState) -> Any:
    table = state.table
    on_error = functools.partial(_on_error, state=state)
    by_id_get = _flatten.by_id.get
    nnx_get = _nnx.by_id.get
    raw_value = _nnx.raw_value
    resolve = state.resolve
    calls = state.calls
    slow = state.needs_slow_path
    user_fun = getattr(fun, "fun", fun) if isinstance(fun, _OutShardings) else fun

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # ---- the hot path ----
        if kwargs or slow:
            return _call_general(args, kwargs)
        if args:
            # Fastest case: the first argument (the model) was seen before and
            # every other argument is a plain jax array. The compiled function
            # already has the model's leaves bound (a functools.partial), so
            # nothing is flattened, listed or keyed.
            a = args[0]
            hit = by_id_get(id(a))
            if hit is not None and hit[0]() is a:
                bound = hit[3].get(state)
                if bound is not None and bound[0] == len(args):
                    rest = args[1:]
                    for b in rest:
                        if type(b) is not ArrayImpl:
                            break
                    else:
                        calls[0] += 1
                        try:
                            out = bound[1](*rest)
                        except _StructureVaries:
                            pass  # the general path below switches entries
                        except (RuntimeError, ValueError) as err:
                            on_error(err, args)
                        else:
                            return out if bound[2] is None else bound[2](out)
            else:
                node = nnx_get(id(a))
                if node is not None and node.ref() is a and not node.stale and node.direct:
                    # Same for a known NNX object (structure unchanged): the compiled
                    # entry is remembered on it; only its Variables' values are read.
                    bound = node.bound.get(state)  # (arity, fn, post_nnx or None, post or None)
                    if bound is not None and bound[0] == len(args):
                        rest = args[1:]
                        for b in rest:
                            if type(b) is not ArrayImpl:
                                break
                        else:
                            values = list(map(raw_value, node.items))
                            if not values or type(values[0]) is ArrayImpl:
                                calls[0] += 1
                                try:
                                    out = bound[1](*values, *rest)
                                except _StructureVaries:
                                    pass  # the general path below switches entries
                                except (RuntimeError, ValueError) as err:
                                    on_error(err, args)
                                else:
                                    if bound[2] is not None:
                                        return bound[2](out, [(a, node.items, node)])
                                    return out if bound[3] is None else bound[3](out)
        # Any positional call: each argument is a plain array (one leaf), an
        # object in the identity cache (its cached leaves), or resolved once.
        leaves = list(fun_leaves)
        key: list[Any] = []
        nnx_refs: list[Any] = []  # (NNX object, its Variables) for write-back
        inline = False
        try:
            for a in args:
                if type(a) is ArrayImpl:
                    leaves.append(a)
                    key.append(0)
                    continue
                hit = by_id_get(id(a))
                if hit is not None and hit[0]() is a:  # seen before, same object
                    leaves += hit[1]
                    key.append(hit[2])
                    continue
                node = nnx_get(id(a))
                if node is not None and node.ref() is a and not node.stale and node.direct:
                    # A known NNX object whose structure has not changed: read its
                    # Variables' current values through the slot, nothing else.
                    n0 = len(leaves)
                    leaves += map(raw_value, node.items)
                    if len(leaves) == n0 or type(leaves[n0]) is ArrayImpl:
                        nnx_refs.append((a, node.items, node))
                        key.append(node.spec_id)
                        continue
                    del leaves[n0:]  # tracers (inside an nnx transform): take the slow path
                # NNX objects (values read now), new objects, scalars, containers.
                key.append(resolve(a, leaves, state.arg_name(len(key)), nnx_refs))
        except _StepAside:
            inline = True  # (run inline below, outside this handler: no chained traceback)
        if inline:
            return fun(*args)
        if len(nnx_refs) > 1 and _nnx.overlapping([r[2] for r in nnx_refs]):
            return _call_general(args, kwargs)  # NNX arguments share objects: flatten jointly
        key_t = tuple(key)
        entry = table.get(key_t)
        if entry is None:
            entry = state.entry(key_t, fun_leaves, fun)
        calls[0] += 1
        try:
            out = entry.fn(*leaves)
        except _StructureVaries:
            entry = state.make_varying(key_t, entry, fun)
            out = entry.fn(*leaves)
        except (RuntimeError, ValueError) as err:
            on_error(err, args)  # an eqx.error_if check failed, a deleted array, ...
        if nnx_refs:
            if len(nnx_refs) == 1 and nnx_refs[0][0] is args[0] and not fun_leaves and not entry.varies:
                _bind_first_nnx(args, key_t, entry)
            if entry.post_nnx is not None:
                return entry.post_nnx(out, nnx_refs)
        elif key_t and key_t[0] != 0 and not entry.varies and entry.out is not None:
            _bind_first(args, key_t, entry)
        if entry.passthrough:
            return out
        return entry.post(out)

    def _bind_first_nnx(args: tuple[Any, ...], key_t: tuple[Any, ...], entry: _Entry) -> None:
        """Remember `entry` on args[0]'s NNX cache entry (see the hot path)."""
        if entry.out is None:
            return
        for k in key_t[1:]:
            if k != 0:
                return
        node = nnx_get(id(args[0]))
        if node is not None and node.ref() is args[0] and state not in node.bound:
            post = None if entry.passthrough else entry.post
            node.bound[state] = (len(args), entry.fn, entry.post_nnx, post)

    def _bind_first(args: tuple[Any, ...], key_t: tuple[Any, ...], entry: _Entry) -> None:
        """Install the bound record on args[0]'s identity entry (see the hot path)."""
        if fun_leaves:
            # Wrappers of equal functions share a state; records are keyed by state, so
            # a wrapper whose function carries arrays of its own must not bind them.
            return
        for k in key_t[1:]:
            if k != 0:
                return
        a = args[0]
        hit = by_id_get(id(a))
        if hit is None or hit[0]() is not a or state in hit[3]:
            return
        call = functools.partial(entry.fn, *fun_leaves, *hit[1])
        hit[3][state] = (len(args), call, None if entry.passthrough else entry.post)

    def _call_general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            prepared = state.prepare(fun_leaves, args, kwargs)
        except _StepAside:
            prepared = None  # traced arguments: run inline
        if prepared is None:
            return fun(*args, **kwargs)  # (or raises the function's own TypeError)
        _, _, leaves, key_t, nnx_refs = prepared
        entry = table.get(key_t) or state.entry(key_t, fun_leaves, fun)
        calls[0] += 1
        try:
            out = entry.fn(*leaves)
        except _StructureVaries:
            entry = state.make_varying(key_t, entry, fun)
            out = entry.fn(*leaves)
        except (RuntimeError, ValueError) as err:
            on_error(err, args, kwargs)
        if nnx_refs and entry.post_nnx is not None:
            return entry.post_nnx(out, nnx_refs)
        return out if entry.passthrough else entry.post(out)

    def lower(*args: Any, **kwargs: Any) -> Lowered:
        """Trace and lower for these arguments (as `jax.jit(...).lower`)."""
        try:
            prepared = state.prepare(fun_leaves, args, kwargs)
        except _StepAside:
            raise FastcallError(
                "fastcall.jit(...).lower: the arguments contain tracers; lower outside of "
                "any jax transformation."
            ) from None
        if prepared is None:
            fun(*args, **kwargs)  # raises the function's own TypeError
            raise FastcallError("fastcall.jit(...).lower: could not bind the arguments.")
        _, _, leaves, key_t, _ = prepared
        entry = table.get(key_t) or state.entry(key_t, fun_leaves, fun)
        try:
            lowered = entry.fn.lower(*leaves)
        except _StructureVaries:
            entry = state.make_varying(key_t, entry, fun)
            lowered = entry.fn.lower(*leaves)
        return Lowered(lowered, entry, state, fun_leaves, key_t)

    functools.update_wrapper(wrapper, user_fun)
    public: Any = wrapper
    if _accel is not None and USE_ACCEL:
        # The same fast case in C (see _accel.c); everything else falls back to `wrapper`.
        public = _accel.FastWrapper(
            wrapper,
            _flatten.by_id,
            state,
            ArrayImpl,
            _StructureVaries,
            on_error,
            _nnx.fast,
            _nnx.RAW_VALUE_SLOT,
        )
        functools.update_wrapper(public, user_fun)
        state.accelerated.add(public)
    public._fastcall_state = state
    public._fastcall_fun_leaves = fun_leaves
    public.lower = lower
    public.stats = state.stats
    public.clear_cache = state.clear
    return public


class Lowered:
    """A lowered fastcall function (from `wrapped.lower(...)`). `.compile()` gives a
    callable taking the same arguments (static ones included)."""

    def __init__(self, lowered: Any, entry: _Entry, state: _JitState, fun_leaves: Any, key: Any):
        self._lowered = lowered
        self._entry = entry
        self._state = state
        self._fun_leaves = fun_leaves
        self._key = key

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self._lowered.as_text(*args, **kwargs)

    def compiler_ir(self, *args: Any, **kwargs: Any) -> Any:
        return self._lowered.compiler_ir(*args, **kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> Compiled:
        return Compiled(self._lowered.compile(*args, **kwargs), self)


class Compiled:
    """An ahead-of-time compiled fastcall function: call it with the original arguments."""

    def __init__(self, compiled: Any, lowered: Lowered) -> None:
        self._compiled = compiled
        self._lowered = lowered

    def as_text(self) -> Any:
        return self._compiled.as_text()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        low = self._lowered
        prepared = low._state.prepare(low._fun_leaves, args, kwargs)
        if prepared is None:
            raise FastcallError("fastcall Compiled: could not bind the arguments.")
        _, _, leaves, key, nnx_refs = prepared
        if key != low._key:
            raise FastcallError(
                "fastcall Compiled: the static part of these arguments (structure or "
                "non-array values) differs from the one this was compiled for; lower and "
                "compile again for these arguments."
            )
        entry = low._entry
        try:
            out = self._compiled(*leaves)
        except (RuntimeError, ValueError) as err:
            _on_error(err, args, kwargs, low._state)
        if entry.varies:
            return _post_varying_nnx(out, nnx_refs) if nnx_refs else _post_varying(out)
        if nnx_refs and entry.post_nnx is not None:
            return entry.post_nnx(out, nnx_refs)
        return out if entry.passthrough else entry.post(out)


def partial(fun: Callable, *bound: Any, **jit_options: Any) -> Callable:
    """Bind leading arguments (typically the model) for serving, like
    `nnx.jit_partial` / `nnx.cached_partial`, without their staleness.

    **Arguments:**

    - `fun`: a function, or a function already wrapped by `fastcall.jit`.
    - `*bound`: leading positional arguments to bind (NNX modules, Equinox
      modules, arrays, anything).
    - `**jit_options`: options for `fastcall.jit` when `fun` is not wrapped yet.

    **Returns:** a callable taking the remaining arguments. The bound objects
    are flattened once, here; each call reads their current Variable values,
    writes changed state back, and re-flattens a bound NNX module only after
    its structure changed (`model.layers[1] = nnx.Linear(...)`,
    `model.eval()`), where `nnx.jit_partial` and `nnx.cached_partial` would
    return stale results.

    !!! example

        ```python
        serve = fastcall.partial(forward, model)
        y = serve(x)
        ```
    """
    wrapped = fun if getattr(fun, "_fastcall_state", None) is not None else jit(fun, **jit_options)
    state: _JitState = wrapped._fastcall_state  # type: ignore[attr-defined]
    scratch: list[Any] = []
    for i, arg in enumerate(bound):  # flatten once now: errors surface here, caches are warm
        if type(arg) is not ArrayImpl:
            try:
                state.resolve(arg, scratch, state.arg_name(i), [])
            except _StepAside:
                pass
    bound_call = functools.partial(wrapped, *bound)
    functools.update_wrapper(bound_call, wrapped)  # type: ignore[arg-type]
    return bound_call

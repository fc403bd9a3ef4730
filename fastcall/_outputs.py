"""Outputs: how the flat results of one compiled entry become the user's output.

Decided at trace time, per compiled entry, and recorded in an `OutInfo`:
whether jax's own output tree already is the user's output ("pass": arrays in
standard containers, rebuilt by jax in C++), or fastcall must merge static
leaves back, rebuild modules, wait for `eqx.error_if` checks, write NNX state
back and note returned modules and tuples for the next call ("flat").

Also here: what happens when running a compiled function raises (an
`eqx.error_if` failure becomes `eqx.EquinoxRuntimeError`, a deleted array is
named by argument and leaf path).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Sequence

import equinox as eqx
import jax

from . import _codegen, _flatten, _memo, _nnx_gate, _rebuild
from ._errors import FastcallError, describe_arg, for_decorator
from ._flatten import ArrayImpl
from ._trace import Tracer

try:
    _JaxRuntimeError: type[BaseException] = jax.errors.JaxRuntimeError
except AttributeError:  # pragma: no cover
    _JaxRuntimeError = RuntimeError


def _static_keys(statics: tuple[Any, ...]) -> Any:
    """The hashable keys of an output's static leaves (`_flatten.leaf_key`), or None where one
    has none (they are then compared by identity: `OutInfo.same_as`)."""
    for x in statics:
        if isinstance(x, Tracer):  # (an array is never static: this is not an array)
            raise FastcallError(
                f"fastcall: the function returned a traced value of type {jax.typeof(x)}, "
                "which is not an array (a mutable array reference made inside?). A compiled "
                "function cannot return one here: return its value (ref[...]) instead."
            )
    try:
        keys = tuple(_flatten.leaf_key(s) for s in statics)
        hash(keys)
    except Exception:
        return None
    return keys


class OutInfo:
    """The output structure of one compiled entry, and what each call must do with it."""

    __slots__ = (
        "mode", "treedef", "mask", "statics", "static_keys", "block", "regs", "remember", "nnx", "build", "held",
        "passthrough", "adapter", "fast_result", "fast_post", "on_death",
    )
    treedef: Any

    def __init__(
        self, out: Any, block: bool, nnx: Any = None, trace_scalars: bool = False, remade: bool = False
    ) -> None:
        """`out`: the function's output (NNX objects already replaced by markers);
        `block`: wait for the result (the function has `eqx.error_if` checks);
        `nnx`: the NNX adapter's `NnxOutputs`, or None (no NNX state to write back);
        `trace_scalars`: `fastcall.jit`'s rule, under which a Python scalar returned outside
        an Equinox module is an output of the compiled function (jax makes it an array, as
        `jax.jit` and `nnx.jit` return it); under `fastcall.filter_jit`'s it is static and
        comes back as returned, as `eqx.filter_jit` returns it; `remade`: the output holds
        Variables the NNX adapter's markers rebuild (`pytree_outputs`), which jax's own
        output tree, built from the output as first returned, would rebuild flax's way."""
        leaves, treedef = jax.tree_util.tree_flatten(out)
        mask = _flatten.dynamic_mask(out, leaves, trace_scalars)
        self.treedef = treedef
        self.mask = mask
        self.statics = tuple(x for x, m in zip(leaves, mask) if not m)
        self.static_keys = _static_keys(self.statics)
        self.block = block
        self.nnx = nnx
        self.adapter: Any = _nnx_gate.adapter() if nnx is not None else None
        # (an output holding Variables remade by markers is not noted: its spec, read off the
        # markers, is not the spec of the objects a call returns)
        self.regs = () if remade else tuple(_registrations(out, mask))
        # [the latest call's memo of what it returned], replaced each call (`_memo`)
        self.held: list[Any] = [None]
        # (the callback of the memo's weak references: a returned module died)
        self.on_death = functools.partial(_memo.forget_latest, self.held)
        # `remember(result, dyn)`: note what a call returned, for the next call (`_memo`)
        self.remember: Callable[[Any, list[Any]], None] | None = (
            functools.partial(_memo.note_latest, self.held, self.regs, self.on_death) if self.regs else None
        )
        needs_flat = bool(self.statics or self.block or self.regs or nnx is not None or remade)
        # The plan that rebuilds this output structure (None: use treedef.unflatten).
        # jax rebuilds an Equinox module or eqx.nn.State by calling its Python unflatten,
        # once per node; the plan builds the whole output in one call, so an output
        # holding any is rebuilt by it too.
        self.build = (
            _codegen.make_builder(out, trace_scalars) if needs_flat or _has_python_nodes(treedef) else None
        )
        self.mode = "flat" if needs_flat or self.build is not None else "pass"
        # Nothing to do after a call: jax's output is the user's output.
        self.passthrough = self.mode == "pass"
        # `result`, as one call (build by the plan, then note) where that is all it does
        plan = _codegen.plan_of(self.build)
        self.fast_result: Callable[[list[Any]], Any] = self.result
        if self.build is None and not (block or self.statics or self.regs):
            # (all `result` does then: jax's C++ unflatten, called directly; an output holding
            # new Variables on their own, `NnxOutputs.fresh`)
            self.fast_result = self.treedef.unflatten
        # `fast_result` as the post-processing of a call that writes nothing back,
        # `post(out, first, nnx)`
        self.fast_post: Callable[[list[Any], Any, Any], Any] = _as_post(self.fast_result)
        if plan is not None and not block:  # (the plan's `finish_output` takes a post's arguments itself)
            self.fast_result = self.fast_post = functools.partial(_rebuild.finish_output, plan, self.remember)

    def same_as(self, other: OutInfo) -> bool:
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
            and self.nnx == other.nnx
        )

    def flat_outputs(self, out: Any, nnx_extra: list[Any]) -> Any:
        """What the traced function returns: `out` itself ("pass"), or its dynamic leaves,
        then a marker to wait on (`block`), then the NNX adapter's extra leaves."""
        if self.mode == "pass":
            return out
        dyn = [x for x, m in zip(jax.tree_util.tree_leaves(out), self.mask) if m]
        if self.block:
            dyn.append(jax.numpy.zeros((), jax.numpy.int8))
        return dyn + nnx_extra

    def finish(self, dyn: Any, nnx_args: Sequence[Any]) -> Any:
        """The user's output from the flat outputs of one call; NNX state written back."""
        if self.passthrough:
            return dyn
        link = None  # (how returned NNX objects are tied to the caller's)
        if self.nnx is not None:
            k = self.nnx.n_written
            # (a new structure may have no leaves at all; nor metadata written back)
            if k or self.nnx.restructure or self.nnx.metadata:
                link = self.adapter.write_back(self.nnx, dyn[len(dyn) - k :], nnx_args)
                dyn = dyn[: len(dyn) - k]
        if self.nnx is None or not self.nnx.has_nodes:
            return self.result(dyn)
        if self.build is None and not self.nnx.new_objects:
            # (the markers, all for the caller's objects, are among the statics: the output
            # is built once, with the objects in their place)
            result = self.result(dyn, self.adapter.unmark_leaves(self.nnx, self.statics, nnx_args, link))
        else:
            result = self.adapter.unmark_nodes(self.nnx, self.result(dyn), nnx_args, link)
        if self.nnx.twins:  # (nnx.States returned holding an argument's Variables)
            self.adapter.twin_states(self.nnx, result, nnx_args)
        return result

    def result(self, dyn: Any, statics: Any = None) -> Any:
        """The user's output from the flat outputs of one call, less those written back
        (returned NNX objects still markers, unless `statics` replaces them)."""
        if self.block:
            marker = dyn.pop()
            if type(marker) is ArrayImpl:
                _wait_and_translate(marker)
        if self.build is not None:
            result = self.build(dyn)
        elif self.statics:
            it_dyn, it_stat = iter(dyn), iter(self.statics if statics is None else statics)
            result = self.treedef.unflatten([next(it_dyn) if m else next(it_stat) for m in self.mask])
        else:
            result = self.treedef.unflatten(dyn)
        # Returned modules (and tuples such as optimizer states) noted with their leaves, so
        # that `model, opt_state = step(model, opt_state, ...)` finds them next step
        # (`remember`). Not an output whose markers `statics` replaced: `regs` was found on
        # the marked output, where a marker is a static leaf; the caller's objects in its
        # place would be taken back as if they were that static.
        if self.regs and statics is None:
            self.remember(result, dyn if type(dyn) is list else list(dyn))  # type: ignore[misc]
        return result

    @property
    def holds_nnx_objects(self) -> bool:
        """Whether the output holds NNX objects (marked at trace time, rebuilt after a call)."""
        return self.nnx is not None and bool(self.nnx.has_nodes)

    def shapes(self, flat: Any) -> Any:
        """The user's output around the abstract outputs of `eval_shape` (a
        `jax.ShapeDtypeStruct` per array): built as `result` builds it, less the NNX
        write-back, the wait and the memo of returned objects (nothing ran). Not for an
        output holding NNX objects (`holds_nnx_objects`), which are rebuilt from the call's."""
        if self.passthrough:
            return flat
        dyn = list(flat)
        if self.nnx is not None:
            assert not self.nnx.has_nodes
            del dyn[len(dyn) - self.nnx.n_written :]
        if self.block:
            dyn.pop()  # (the marker a call waits on)
        if self.build is not None:
            return self.build(dyn)
        it_dyn, it_stat = iter(dyn), iter(self.statics)
        return self.treedef.unflatten([next(it_dyn) if m else next(it_stat) for m in self.mask])

    def plain_writes(self) -> tuple[tuple[int, int], ...] | None:
        """The (NNX object ordinal, leaf index) of each leaf written back, if writing new
        values into the caller's Variables and raw leaves is all a call does to its NNX
        objects (no structural change, no Variable replaced, no NNX object returned but new
        Variables on their own, which `result` builds): none where it has no NNX state to
        write back; else None. (None too where jax's output is the user's output: nothing
        to do.)"""
        nnx = self.nnx
        if self.passthrough:
            return None
        if nnx is None:
            return ()
        if nnx.restructure or nnx.replaced or nnx.has_nodes or nnx.metadata:
            return None
        if nnx.n_written != len(nnx.writes) or not (nnx.writes or nnx.fresh):
            return None
        return nnx.writes

    def take_memo(self) -> Any:
        """Stop noting the latest call's outputs: the memo, for the caller to release."""
        memo, self.held[0] = self.held[0], None
        return memo

    def __del__(self) -> None:
        # (the memo's weak references hold `on_death`, which holds `held`: a cycle, broken
        # here so that the latest outputs' leaves go with the entry)
        if hasattr(self, "held"):
            self.take_memo()


def _as_post(result: Callable[[list[Any]], Any]) -> Callable[[list[Any], Any, Any], Any]:
    """`result(out)`, called as a record's post-processing is: `post(out, first, nnx)`."""

    def post(out: list[Any], first: Any, nnx: Any) -> Any:
        return result(out)

    return post


def _has_python_nodes(treedef: Any) -> bool:
    """Whether jax rebuilds some node of `treedef` by calling Python (any node type but
    tuples, lists, dicts, None and namedtuples, which it rebuilds in C++)."""
    node_data = treedef.node_data()
    if node_data is not None:
        t = node_data[0]
        if not (t in (tuple, list, dict, type(None)) or (issubclass(t, tuple) and hasattr(t, "_fields"))):
            return True
    return any(_has_python_nodes(c) for c in treedef.children())


_UNNOTED = object()  # (`_noted_guard`: an output that is not noted)


def _noted_guard(spec: Any, item: Any) -> Any:
    """How a returned object of `spec` is guarded when noted (`Registration.guard`), or
    _UNNOTED."""
    if not spec.rule_free or not _flatten.reads_alike(item):
        return _UNNOTED
    if _flatten.guards_as_state(spec):
        return _memo.STATE_GUARD
    if spec.cacheable:
        return None  # (immutable: nothing to guard)
    # lists or dicts inside, which can change in place
    return (spec.guardable and _flatten.container_paths(item)) or _UNNOTED


def _registrations(out: Any, mask: tuple[bool, ...]):
    """A `_memo.Registration` for each Equinox module, tuple or eqx.nn.State returned at
    top level (as the output, or as an element of an output tuple) that is immutable, or
    whose lists and dicts a guard can watch. (`mask`: which of the output's leaves are
    outputs of the compiled function.)"""
    if isinstance(out, eqx.Module) or type(out) is _flatten.STATE_TYPE:
        candidates: list[tuple[int | None, Any]] = [(None, out)]
    elif type(out) is tuple:
        candidates = list(enumerate(out))
    else:
        return
    pos = 0  # position in the dynamic outputs
    start = 0  # position in the output's leaves (an item's leaves are a run of them)
    for index, item in candidates:
        n_leaves = len(jax.tree_util.tree_leaves(item))
        # (a Python scalar made an output counts here; the item holding it is not noted:
        # not `rule_free`, see `_noted_guard`)
        n_dyn = sum(mask[start : start + n_leaves])
        start += n_leaves
        if (isinstance(item, eqx.Module) or type(item) in (tuple, _flatten.STATE_TYPE)) and n_dyn:
            try:
                spec, _ = _flatten.flatten_generic(item, "output")
            except FastcallError:
                spec = None
            guard = _UNNOTED if spec is None else _noted_guard(spec, item)
            if spec is not None and guard is not _UNNOTED:
                yield _memo.Registration(index, pos, pos + n_dyn, spec, spec.id, guard)
        pos += n_dyn


class Varying:
    """A call's output that carries its own structure: what a compiled function returns for
    input shapes whose output structure differs from the one its first trace recorded
    (`_build.Entry.record_output`). Made by jax's unflatten, as the top of its output tree,
    so a caller tells it apart by its type, whichever path ran the call."""

    __slots__ = ("flat", "info")

    def __init__(self, flat: Any, info: OutInfo) -> None:
        self.flat = flat  # the flat outputs (`OutInfo.flat_outputs`)
        self.info = info

    def finish(self, nnx_args: Sequence[Any]) -> Any:
        return self.info.finish(self.flat, nnx_args)


jax.tree_util.register_pytree_node(
    Varying, lambda v: ((v.flat,), v.info), lambda info, children: Varying(children[0], info)
)


# --------------------------------------------------------------------------
# Errors from running a compiled function


def _wait_and_translate(marker: Any) -> None:
    """Wait for a program with `eqx.error_if` checks and raise their error as Equinox does."""
    try:
        marker.block_until_ready()
    except (_JaxRuntimeError, ValueError) as err:
        _translate(err)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_BOUNDARY = os.path.join(_PACKAGE_DIR, "_dispatch.py")  # a frame that calls a compiled function


def _translate(err: BaseException) -> None:
    """Re-raise an `eqx.error_if` failure as `eqx.EquinoxRuntimeError` with its message
    (as eqx.filter_jit does); re-raise anything else unchanged."""
    if "_EquinoxRuntimeError" in str(err):
        from equinox import _jit as eqx_jit  # where eqx.error_if leaves its message and stack

        info = getattr(eqx_jit, "last_error_info", None)
        template = getattr(eqx_jit, "_on_error_msg", None)
        if not info:
            raise eqx.EquinoxRuntimeError(str(err)) from None
        msg, stack = info
        if template is None:
            raise eqx.EquinoxRuntimeError(msg) from None
        # Equinox's own message: the stack inside the compiled function (the user's frames
        # recorded by eqx.error_if, innermost first, up to the call of the compiled
        # function that raised) and how to debug.
        pieces = []
        for piece in stack:
            if type(piece) is not str:
                continue  # (Equinox's markers of its own jit frames)
            if _PACKAGE_DIR in piece:
                if _BOUNDARY in piece:
                    break
                continue
            pieces.append(piece)
        raise eqx.EquinoxRuntimeError(template.format(msg=msg, stack="".join(reversed(pieces)))) from None
    raise err


def on_error(err: BaseException, named_args: Sequence[tuple[str, Any]], decorator: str = "fastcall.jit") -> None:
    """Re-raise an exception from running a compiled function, made clearer where we can:
    a deleted (e.g. donated) input array is named by argument and leaf path; an
    `eqx.error_if` failure becomes `eqx.EquinoxRuntimeError`; fastcall's own errors name
    `decorator`, the wrapper the user wrote. Always raises."""
    # (jax's own words: a RuntimeError "Array has been deleted" for an array deleted before
    # the call; XLA's ValueError "Buffer has been deleted or donated" (jax 0.10; "buffer" in
    # jax 0.8) for one donated to an earlier call. A user's error in other words is never
    # taken for one.)
    if isinstance(err, (RuntimeError, ValueError)) and any(words in str(err).lower() for words in _DELETED):
        culprit = _find_deleted(named_args)
        if culprit is not None:
            raise FastcallError(
                f"{decorator}: {culprit} is a deleted array: it was donated to an earlier call "
                "(donate=... / donate_argnums) or deleted explicitly, and cannot be used again. "
                "Pass the new value returned by that call instead, or do not donate it."
            ) from err
    if isinstance(err, FastcallError):  # (raised while tracing: the output's own checks)
        raise for_decorator(err, decorator) from err.__cause__
    _translate(err)


_DELETED = ("array has been deleted", "buffer has been deleted or donated")


def _find_deleted(named_args: Sequence[tuple[str, Any]]) -> str | None:
    for name, value in named_args:
        if _nnx_gate.is_node(value):
            try:
                pairs = _nnx_gate.adapter().named_leaves(value)
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

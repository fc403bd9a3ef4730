"""Building one compiled entry: the traced function over flat leaves, and its jax.jit.

A wrapped function has one `Entry` per static signature (the tuple of interned
spec ids of its arguments). The entry's `fn` is a `jax.jit` of a function of
the flat list of dynamic leaves: it rebuilds each argument from its spec (NNX
arguments through the adapter), calls the user's function, and returns the
flat outputs. What the output looks like is recorded at trace time
(`Entry.out`, an `_outputs.OutInfo`); jax.jit's own cache handles shapes and
dtypes.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Sequence

import jax

from . import _debug_names, _nnx_gate
from ._errors import FastcallError
from ._flatten import spec_by_id
from ._options import UNSPECIFIED
from ._outputs import OutInfo, Varying
from ._trace import current_trace_has_callback


class Entry:
    """One static signature of a wrapped function: a jax.jit over flat leaves."""

    __slots__ = ("fn", "out", "varies", "passthrough", "lock", "on_varies", "packs", "__weakref__")

    def __init__(self) -> None:
        self.fn: Any = None  # fn(*leaves) runs it
        self.out: OutInfo | None = None  # the output structure of the first trace
        # True once a trace met another output structure (it depends on input shapes): the
        # outputs of such traces carry theirs (`Varying`); every other trace's is `out`.
        self.varies = False
        self.passthrough = False  # jax's output is the user's output: nothing to do after
        self.lock = threading.Lock()
        self.on_varies: Callable[[], Any] | None = None  # called once, when it starts to vary
        self.packs: dict[Any, Any] = {}  # `_pack.PackPlan` -> the program taking that plan's buffers

    def finish(self, out: Any, nnx_args: Sequence[Any]) -> Any:
        """The user's output from one call's outputs (NNX state written back)."""
        if type(out) is Varying:
            return out.finish(nnx_args)
        assert self.out is not None
        return self.out.finish(out, nnx_args)

    def record_output(self, info: OutInfo) -> bool:
        """At trace time: remember the output structure of the first trace; for a later
        one, whether its output must carry its own (it differs from the first's). The trace
        that finds it differing carries on, so jax compiles it once, as jax.jit would; the
        fast and structure records, which read the first structure, are dropped then
        (`on_varies`), and a call one of them had under way finds a `Varying` output."""
        with self.lock:
            if self.out is None:
                self.out = info
                self.passthrough = info.passthrough
                return False
            if self.out.same_as(info):
                return False
            first_time = not self.varies
            self.varies = True
        if first_time and self.on_varies is not None:
            self.on_varies()
        return True


def build(state: Any, key: tuple[Any, ...], fun: Any) -> Entry:
    """The compiled entry of `state`'s function `fun` for the static signature `key`."""
    e = Entry()
    layout = state.layout(key)
    pos_specs = [spec_by_id(k) for k in layout.positional]
    kw_specs = [spec_by_id(k) for k in layout.keyword_ids]
    all_specs = [state.fun_spec] + pos_specs + kw_specs
    arg_names = [state.arg_name(i) for i in range(len(pos_specs))] + list(layout.keyword_names)
    counts = [s.n_dyn for s in all_specs]
    graph_updates = state.options.graph_updates is not False
    # nnx.jit's tree mode, or graph mode without graph updates: no Variable aliasing
    refuse_aliasing = state.options.graph is False or not graph_updates
    donated = set(state.donated_slots(len(all_specs), len(pos_specs), layout.keyword_names))
    # in_shardings, one per leaf, computed once; with them, written-back Variables keep
    # their input sharding (as nnx.jit).
    in_shardings = state.options.in_shardings
    slot_shardings = (
        None
        if in_shardings is UNSPECIFIED
        else _leaf_shardings(in_shardings, all_specs, ["fun"] + arg_names, len(pos_specs))
    )
    has_nnx = any(sp.kind in ("nnx", "nnx-tree") for sp in all_specs)
    # (NNX objects as plain pytrees, jax.jit's semantics: nothing is marked or written back,
    # and NNX objects returned are built from the output as jax builds any pytree)
    reads_nnx = not state.options.nnx_as_pytree
    nnx_shardings, nnx_everything = _nnx_write_plan(all_specs, slot_shardings, donated)
    # Weakly: jax may keep the traced function alive longer than the wrapped function.
    state_ref = weakref.ref(state)
    trace_scalars = state.options.trace_scalars

    def flat_fn(*dyn: Any) -> Any:
        values = []
        # (With flax imported, NNX objects the function creates and returns are marked too,
        # so that one returned twice, or shared, comes back as one object.)
        nnx_inputs = (
            _nnx_gate.adapter().TracedInputs() if reads_nnx and (has_nnx or _nnx_gate.flax_imported()) else None
        )
        start = 0
        for spec, n, arg_name in zip(all_specs, counts, ["fun"] + arg_names):
            segment = dyn[start : start + n]
            if nnx_inputs is not None and spec.kind == "nnx":
                values.append(nnx_inputs.rebuild(spec, segment, arg_name))
            elif nnx_inputs is not None and spec.kind == "nnx-tree":
                values.append(nnx_inputs.rebuild_tree(spec, segment, arg_name))
            else:
                values.append(spec.rebuild(segment))
            start += n
        if nnx_inputs is not None:
            nnx_inputs.snapshot()
        f, rest = values[0], values[1:]
        traced_state = state_ref()
        if traced_state is not None:
            traced_state.on_trace(list(zip(arg_names, rest)))
        out = f(*rest[: len(pos_specs)], **dict(zip(layout.keyword_names, rest[len(pos_specs) :])))
        nnx_out, nnx_extra = None, []
        remade = False  # (Variables returned, under jax.jit's reading, made by fastcall)
        if not reads_nnx and _nnx_gate.flax_imported():
            out, remade = _nnx_gate.adapter().pytree_outputs(out)
        if nnx_inputs is not None:
            # Which Variables changed (decided here, once per compile), and whether the
            # graph itself changed (then the new structure is propagated back).
            out, nnx_out, nnx_extra = nnx_inputs.outputs(
                out, graph_updates, refuse_aliasing, nnx_everything, nnx_shardings
            )
        info = OutInfo(out, current_trace_has_callback(), nnx_out, trace_scalars, remade)
        flat = info.flat_outputs(out, nnx_extra)
        return Varying(flat, info) if e.record_output(info) else flat

    name = getattr(fun, "__name__", None) or type(fun).__name__
    flat_fn.__name__ = flat_fn.__qualname__ = str(name)
    # jax's errors name the user's function, its source line and each leaf's argument and path
    _debug_names.attach(flat_fn, state.user_fun, all_specs, len(pos_specs), layout.keyword_names)
    e.fn = jax.jit(flat_fn, **_jit_kwargs(state.options, counts, donated, slot_shardings))
    if state.options.donate in ("all", "all-except-first"):
        e.fn = _suppress_donation_warning(e.fn)
    return e


def _nnx_write_plan(all_specs: list[Any], slot_shardings: Any, donated: set[int]) -> tuple[list[Any], list[bool]]:
    """Per NNX object of the call (arguments, and objects inside container arguments, in
    order): its leaves' in_shardings, and whether every Variable is returned and written
    back: for a donated one, so that the caller's Variables stay usable; for one with
    in_shardings, so that each Variable ends up with its sharding (as nnx.jit does)."""
    nnx_shardings: list[Any] = []
    nnx_everything: list[bool] = []
    for slot, sp in enumerate(all_specs):
        per_leaf = slot_shardings[slot] if slot_shardings is not None else None
        for start, node in sp.nnx_objects() if sp.kind in ("nnx", "nnx-tree") else ():
            node_leaves = per_leaf[start : start + node.n_dyn] if per_leaf is not None else None
            nnx_shardings.append(node_leaves)
            nnx_everything.append(
                slot in donated or (node_leaves is not None and any(sh is not None for sh in node_leaves))
            )
    return nnx_shardings, nnx_everything


def _jit_kwargs(options: Any, counts: list[int], donated_slots: set[int], slot_shardings: Any) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in ("keep_unused", "inline"):
        if getattr(options, name):
            kw[name] = getattr(options, name)
    for name in ("device", "backend"):
        if getattr(options, name) is not None:
            kw[name] = getattr(options, name)
    if options.compiler_options is not None:
        kw["compiler_options"] = dict(options.compiler_options)  # (frozen as pairs)
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


def _leaf_shardings(
    shardings: Any, all_specs: list[Any], arg_names: list[str], n_positional: int
) -> list[list[Any]]:
    """jax.jit-style in_shardings (one for all, or one entry per positional argument that is
    not static, as jax.jit counts them, each a Sharding or a pytree prefix; for NNX arguments
    also an nnx.StateSharding or an nnx.prefix result) as one sharding per dynamic leaf, per
    slot (0: the function; then the positional arguments, then the keyword ones)."""
    per_arg = isinstance(shardings, (tuple, list))
    # (jax.jit's own check, one entry per positional argument that is not static; fewer are
    # taken: arguments passed by keyword, which jax.jit does not count, are bound to their
    # positions here, and get none, as in jax.jit)
    traced = [slot for slot in range(1, n_positional + 1) if all_specs[slot].kind != "static"]
    if per_arg and len(shardings) > len(traced):
        raise ValueError(
            "pjit in_shardings specification must be a tree prefix of the positional arguments tuple. "
            f"In particular, pjit in_shardings must either be a Sharding, a PartitionSpec, or a tuple of "
            f"length equal to the number of positional arguments that are not static: {len(traced)}; "
            f"got a {type(shardings).__name__} of length {len(shardings)}."
        )
    entries = dict(zip(traced, shardings)) if per_arg else {}
    per_slot: list[list[Any]] = []
    nnx_shardings = None
    for slot, spec in enumerate(all_specs):
        entry = entries.get(slot) if per_arg else shardings
        if spec.kind in ("nnx", "nnx-tree") and entry is not None:
            if nnx_shardings is None:
                nnx_shardings = _nnx_gate.adapter().ShardingContext()
            per_slot.append(nnx_shardings.leaf_shardings(spec, entry, arg_names[slot]))
        elif entry is None or isinstance(entry, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
            per_slot.append([entry] * spec.n_dyn)
        elif spec.kind == "tree":  # a pytree prefix of the argument
            full = spec.treedef.unflatten([object()] * len(spec.mask))
            try:
                per_leaf = broadcast_prefix(entry, full)
            except ValueError as err:  # (jax's message names no argument)
                raise FastcallError(
                    f"in_shardings for argument {arg_names[slot]!r} is not a pytree prefix of it ({err}): give "
                    "one Sharding for the whole argument, or a pytree of its structure (or a prefix of it)"
                ) from None
            per_slot.append([sh for sh, m in zip(per_leaf, spec.mask) if m])
        else:
            per_slot.append([entry] * spec.n_dyn)
    return per_slot


def broadcast_prefix(prefix: Any, full: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """One entry of the pytree prefix `prefix` per leaf of `full`."""
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

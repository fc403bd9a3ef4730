# cython: language_level=3
"""The gate to the Flax NNX plugin (`fastcall._nnx`): what the core needs of it, and when it loads.

The core never imports the plugin, nor flax. It asks this gate. `NnxAdapter` is the whole
contract: the functions and classes the core calls on NNX objects. The plugin is loaded
through the loader the public API registers (`register`; `fastcall._api` registers
`fastcall._nnx.load`), the first time it is needed: while `flax.nnx` has not been imported
by anyone, no NNX object can exist, so `is_node` answers False without loading anything and
an Equinox-only program never pays for flax. Once the user has imported `flax.nnx`, the
first NNX object that reaches fastcall loads the plugin (which installs its structure hooks
on NNX's classes; objects created earlier are covered, since the hooks patch classes).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator, Protocol

try:
    import cython
except ImportError:  # (Cython is needed only to build; run as Python without it)
    from fastcall import _cython_shim as cython  # type: ignore[no-redef]

# (compiled by Cython, as setup.py's COMPILED_SOURCES: `is_node` runs once per node of every
# pytree holding NNX objects that a hit route flattens)
COMPILED: bool = cython.compiled


class NnxAdapter(Protocol):
    """What the core calls on the NNX plugin (the module `fastcall._nnx._adapter` is one).

    Arguments and records named here are the core's own: `NnxArg`, the read records of
    `_plan` (`JointRead`, `VariableRead`, ...), the `FunctionState` of a wrapped function
    (`state`), the identity cache's spec ids. Each function says, in its own docstring,
    what it promises; the groups below say where the core uses it."""

    # ---- kinds of object (`_nnx_gate`, `_flatten`, `_args`) ----
    @property
    def GraphDef(self) -> type: ...
    @property
    def State(self) -> type: ...
    @property
    def Variable(self) -> type: ...
    @property
    def NnxArg(self) -> Callable[..., Any]: ...  # (`_plan.NnxArg`: an NNX argument of one call)

    def is_node_type(self, t: type) -> bool: ...
    def holds_nodes(self, value: Any) -> bool: ...

    # ---- the general path: resolving a call's NNX arguments (`_args`) ----
    def read_argument(self, obj: Any, leaves: list[Any], arg_name: str, nnx_args: list[Any], joint: Any) -> int: ...
    def read_container(
        self, value: Any, leaves: list[Any], arg_name: str, nnx_args: list[Any], joint: Any, trace_scalars: bool
    ) -> int: ...
    def read_graphdef(self, graphdef: Any, arg_name: str, trace_scalars: bool) -> int: ...
    def graphdef_by_value(self, graphdef: Any) -> Any: ...
    def overlapping(self, nnx_args: list[Any]) -> bool: ...
    def joint_index(self) -> Any: ...
    def aliasing_error(self, where: str) -> Exception: ...

    # ---- records for later calls (`_dispatch._file_plans`, `_publish_structure`) ----
    def install_record(self, entry: Any, state: Any, spec_id: int, record: Any) -> None: ...
    def readable_argument(self, arg: Any, spec_id: int) -> bool: ...
    def read_as_one_object(self, state: Any) -> bool: ...
    def joint_read(self, arg: Any, before: Any) -> Any: ...
    def variable_read(self, arg: Any, spec_id: int) -> Any: ...
    def shared_variable_read(self, arg: Any, spec_id: int, reads: list[Any], at: int) -> Any: ...
    def mixed_read(self, spec_id: int, nnx_args: Iterator[Any], value: Any) -> Any: ...
    def pytree_read(self, value: Any, read: Any) -> Any: ...
    def forget_function(self, state: Any) -> None: ...

    # ---- the hit routes (`_dispatch.make_wrapper`, `_agreement`) ----
    def slot_after_rebuild(self, obj: Any) -> Any: ...
    def slot_as_checked(self, obj: Any) -> Any: ...

    # ---- inside the trace and after the call (`_build`, `_outputs`) ----
    @property
    def TracedInputs(self) -> Callable[[], Any]: ...  # (rebuild, rebuild_tree, snapshot, outputs)
    @property
    def ShardingContext(self) -> Callable[[], Any]: ...  # (leaf_shardings)

    @property
    def LeafWrites(self) -> Callable[[tuple[tuple[int, int], ...], Any, Any, bool], Any]: ...  # (a post)

    def write_back(self, nnx_out: Any, written: Any, nnx_args: list[Any]) -> Any: ...
    def unmark_nodes(self, nnx_out: Any, result: Any, nnx_args: list[Any], link: Any) -> Any: ...
    def unmark_leaves(self, nnx_out: Any, leaves: Any, nnx_args: list[Any], link: Any) -> list[Any]: ...
    def twin_states(self, nnx_out: Any, result: Any, nnx_args: list[Any]) -> None: ...
    def pytree_outputs(self, out: Any) -> tuple[Any, bool]: ...  # (`nnx_as_pytree`: Variables returned)
    def named_leaves(self, obj: Any) -> list[tuple[str, Any]]: ...
    def leaf_names(self, spec: Any, name: str) -> list[str] | None: ...

    # ---- options, shardings, caches, reports (`_api`, `_stats`, `_explain`) ----
    def resolve_options(
        self, graph: bool | None, graph_updates: bool | None, in_shardings: Any, out_shardings: Any
    ) -> tuple[bool, bool]: ...
    def constrain(self, node: Any, sharding: Any) -> None: ...
    def clear(self) -> None: ...
    def describe_node(self, obj: Any) -> tuple[Any, list[tuple[str, Any]]]: ...
    def explain_node(self, obj: Any) -> tuple[str, str]: ...
    def explain_graphdef(self, graphdef: Any) -> tuple[str, str]: ...


_loader: Callable[[], NnxAdapter] | None = None
_adapter: NnxAdapter | None = None
node_types: dict[type, bool] = {}  # filled only once flax.nnx is loaded


def register(loader: Callable[[], NnxAdapter]) -> None:
    """Say how to load the NNX plugin (called once, by the public API's module)."""
    global _loader
    _loader = loader


def adapter() -> NnxAdapter:
    """The NNX plugin, loaded (and its hooks installed) on first use."""
    global _adapter
    if _adapter is None:
        if _loader is None:  # pragma: no cover - fastcall/__init__ imports _api, which registers it
            raise RuntimeError("fastcall: the NNX plugin was not registered (import fastcall first)")
        _adapter = _loader()
    return _adapter


def loaded() -> NnxAdapter | None:
    """The plugin if it is loaded, else None (nothing NNX has reached fastcall)."""
    return _adapter


def flax_imported() -> bool:
    """Whether anyone has imported flax.nnx (no NNX object can exist before)."""
    return "flax.nnx" in sys.modules


@cython.ccall
@cython.exceptval(-1, check=True)
def is_node_type(t: Any) -> cython.bint:
    """Whether instances of `t` are NNX graph nodes or Variables (cached per type)."""
    table: dict = node_types
    try:
        known = table.get(t)
    except TypeError:  # (a class whose metaclass cannot be hashed: NNX registers no such class)
        return False
    if known is not None:
        return known is True
    if "flax.nnx" not in sys.modules:
        return False  # no NNX class exists yet; not cached (flax may be imported later)
    known = table[t] = adapter().is_node_type(t)
    return known is True


graphdef_types: dict[type, bool] = {}
state_types: dict[type, bool] = {}


@cython.cfunc
@cython.exceptval(-1, check=True)
def _is_adapter_type(known: dict, t: Any, name: str) -> cython.bint:
    """Whether `t` is the adapter's class `name` (cached per type; never loads the adapter
    before flax.nnx is imported, and caches nothing then: flax may be imported later)."""
    found = known.get(t)
    if found is None:
        if "flax.nnx" not in sys.modules:
            return False
        found = known[t] = t is getattr(adapter(), name)
    return found


def is_graphdef(x: Any) -> bool:
    """Whether `x` is an NNX GraphDef (`nnx.split`'s first result)."""
    return _is_adapter_type(graphdef_types, type(x), "GraphDef")


def reads_as_node(x: Any) -> bool:
    """`is_node`, or an `nnx.State` (which the adapter may read and cache as one object)."""
    t = type(x)
    return is_node_type(t) or _is_adapter_type(state_types, t, "State")


variable_types: dict[type, bool] = {}


@cython.ccall
@cython.exceptval(-1, check=True)
def reads_as_value(x: Any) -> cython.bint:
    """Whether `x` is an `nnx.State` or a Variable: where jax's flatten stops for a TreeRead
    that reads them itself, as jax's flatten would (`_plan.TreeRead.expand`)."""
    t = type(x)
    if _is_adapter_type(state_types, t, "State"):
        return True
    found = variable_types.get(t)
    if found is None:
        if "flax.nnx" not in sys.modules:
            return False
        found = variable_types[t] = issubclass(t, adapter().Variable)
    return found is True


@cython.ccall
@cython.exceptval(-1, check=True)
def is_node(x: Any) -> cython.bint:
    """Whether `x` is an NNX graph node (Module, Pytree, Rngs, Optimizer) or a Variable. (jax's
    flatten calls it once per node of a pytree holding NNX objects: `is_leaf=is_node`.)"""
    return is_node_type(type(x))

"""The gate to the Flax NNX adapter: loads it only when NNX is in use.

No module but `_nnx` (and its hooks, `_nnx_hooks`) imports flax. Everything
else asks this gate, which never imports flax itself: while `flax.nnx` has not
been imported by anyone, no NNX object can exist, so `is_node` answers False
without loading anything and an Equinox-only program never pays for flax.
Once the user has imported `flax.nnx`, the first NNX object that reaches
fastcall loads the adapter (which installs its structure hooks on NNX's
classes; objects created earlier are covered, since the hooks patch classes).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

_adapter: ModuleType | None = None
node_types: dict[type, bool] = {}  # filled only once flax.nnx is loaded


def adapter() -> ModuleType:
    """The NNX adapter module, loaded (and its hooks installed) on first use."""
    global _adapter
    if _adapter is None:
        from . import _nnx

        _adapter = _nnx
    return _adapter


def loaded() -> ModuleType | None:
    """The adapter if it is loaded, else None (nothing NNX has reached fastcall)."""
    return _adapter


def flax_imported() -> bool:
    """Whether anyone has imported flax.nnx (no NNX object can exist before)."""
    return "flax.nnx" in sys.modules


def is_node_type(t: type) -> bool:
    """Whether instances of `t` are NNX graph nodes or Variables (cached per type)."""
    known = node_types.get(t)
    if known is not None:
        return known
    if "flax.nnx" not in sys.modules:
        return False  # no NNX class exists yet; not cached (flax may be imported later)
    known = node_types[t] = adapter().is_node_type(t)
    return known


graphdef_types: dict[type, bool] = {}
state_types: dict[type, bool] = {}


def _is_adapter_type(known: dict[type, bool], t: type, name: str) -> bool:
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


def is_node(x: Any) -> bool:
    """Whether `x` is an NNX graph node (Module, Pytree, Rngs, Optimizer) or a Variable."""
    return is_node_type(type(x))

"""fastcall's Flax NNX plugin: every line of fastcall that touches flax lives in this package.

The core (`fastcall/_*.py`) never imports it. It asks `fastcall._nnx_gate`, which defines
what it needs of a plugin (`_nnx_gate.NnxAdapter`) and loads the plugin through the loader
`fastcall._api` registers: `load` below. Importing this package imports no flax; `load`
does, the first time an NNX object reaches a wrapped function (flax is in use by then).

- `_adapter`: the plugin's side of `NnxAdapter` (what `load` returns). It holds no code:
  it names what the core calls, from the modules below.
- `_hooks`: the structure hooks on NNX's classes, verified when the plugin loads.
- `_variables`: what an NNX object is; how the leaves of its graph are read and written.
- `_watch`: structure changes, as the hooks report them, and the cache entries they reach.
- `_specs`: specs of NNX arguments (graphdefs interned, statics), GraphDef arguments, the
  names of an object's leaves.
- `_layout`: the record of a graph as read, against which a graph NNX rebuilt in place is
  checked.
- `_entries`: the per-object cache (`NodeEntry`).
- `_reads`: reading a call's NNX arguments, and the structure path's records of them.
- `_inputs`: inside the trace: the arguments rebuilt, what the function changed.
- `_write_back`: after the call: changes written back, NNX objects in the output given back.
- `_leaf_writes`: after a call that only wrote new leaf values: those written (compiled).
- `_sharding`: the NNX options (`graph`, `graph_updates`) and shardings.

From `_hooks` down, each module imports only modules listed before it (no import cycle).
"""

from __future__ import annotations

from .._nnx_gate import NnxAdapter


def load() -> NnxAdapter:
    """The NNX adapter (`_nnx_gate.NnxAdapter`), imported on first use (it imports flax and
    installs its hooks on NNX's classes)."""
    from . import _adapter

    return _adapter

"""The Flax NNX plugin's side of `_nnx_gate.NnxAdapter`: the module the gate loads and the
core calls (`_nnx_gate.adapter().read_argument(...)`).

Loaded by `_nnx_gate` only once an NNX object reaches fastcall; importing it imports flax
and installs the structure hooks of `_hooks` on NNX's classes. It holds no code: it names
what the core uses, from the modules that hold it (each imports only `_hooks` and those
above it here):

- `_variables`: what an NNX object is; how the leaves of its graph (Variables, raw leaves)
  are read and written.
- `_watch`: structure changes, as the hooks report them, and the cache entries they reach.
- `_specs`: specs of NNX arguments (graphdefs interned, statics), GraphDefs passed as
  arguments, the names of an object's leaves.
- `_layout`: the record of a graph as read, against which a graph NNX rebuilt in place is
  checked.
- `_entries`: the per-object cache (`NodeEntry`): read, looked up, kept current, published
  to the fast path.
- `_reads`: reading a call's NNX arguments (the general path), and the records by which the
  structure path reads them again.
- `_inputs`: inside the trace: the arguments rebuilt, what the function changed, NNX objects
  in the output marked.
- `_write_back`: after the call: changes written back to the caller's objects, markers
  turned back into objects.
- `_leaf_writes`: after the call, where new leaf values are all it changed: those written
  back (compiled by Cython where it can be; both hit routes call it).
- `_sharding`: the NNX options (`graph`, `graph_updates`) and the shardings of NNX
  arguments.
"""

from __future__ import annotations

from ._entries import clear, forget_function, install_record, slot_after_rebuild, slot_as_checked
from ._inputs import TracedInputs, aliasing_error, pytree_outputs
from ._leaf_writes import LeafWrites
from ._reads import (
    NnxArg,
    explain_node,
    holds_nodes,
    joint_index,
    joint_read,
    mixed_read,
    pytree_read,
    overlapping,
    read_argument,
    read_as_one_object,
    read_container,
    readable_argument,
    shared_variable_read,
    variable_read,
)
from ._sharding import ShardingContext, constrain, resolve_options
from ._specs import (
    describe_node,
    explain_graphdef,
    graphdef_by_value,
    leaf_names,
    named_leaves,
    read_graphdef,
)
from ._variables import GraphDef, State, Variable, is_node_type
from ._write_back import twin_states, unmark_leaves, unmark_nodes, write_back

__all__ = [
    # `_nnx_gate.NnxAdapter`, in its order
    "GraphDef",
    "State",
    "Variable",
    "NnxArg",
    "is_node_type",
    "holds_nodes",
    "read_argument",
    "read_container",
    "read_graphdef",
    "graphdef_by_value",
    "overlapping",
    "joint_index",
    "aliasing_error",
    "install_record",
    "readable_argument",
    "read_as_one_object",
    "joint_read",
    "variable_read",
    "shared_variable_read",
    "mixed_read",
    "pytree_read",
    "forget_function",
    "slot_after_rebuild",
    "slot_as_checked",
    "TracedInputs",
    "ShardingContext",
    "LeafWrites",
    "write_back",
    "unmark_nodes",
    "unmark_leaves",
    "twin_states",
    "pytree_outputs",
    "named_leaves",
    "leaf_names",
    "resolve_options",
    "constrain",
    "clear",
    "describe_node",
    "explain_node",
    "explain_graphdef",
]

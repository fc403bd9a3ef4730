"""fastcall's Flax NNX plugin: every line of fastcall that touches flax lives in this package.

The core (`fastcall/_*.py`) never imports it. It asks `fastcall._nnx_gate`, which defines
what it needs of a plugin (`_nnx_gate.NnxAdapter`) and loads the plugin through the loader
`fastcall._api` registers: `load` below. Importing this package imports no flax; `load`
does, the first time an NNX object reaches a wrapped function (flax is in use by then).

- `_adapter`: NNX objects as arguments and outputs (per-object cache, reads, the trace,
  write-back, options, shardings).
- `_hooks`: the structure hooks on NNX's classes, verified when the plugin loads.
"""

from __future__ import annotations

from .._nnx_gate import NnxAdapter


def load() -> NnxAdapter:
    """The NNX adapter (`_nnx_gate.NnxAdapter`), imported on first use (it imports flax and
    installs its hooks on NNX's classes)."""
    from . import _adapter

    return _adapter

"""Every workload by name, built lazily."""

from __future__ import annotations

from typing import Callable

from . import _eqx_workloads, _nnx_workloads
from ._harness import Workload


def workloads(quick: bool) -> dict[str, Callable[[], Workload]]:
    out: dict[str, Callable[[], Workload]] = {}
    out.update(_eqx_workloads.build(quick))
    out.update(_nnx_workloads.build(quick))
    return out

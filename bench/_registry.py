"""Every workload by name, built lazily."""

from __future__ import annotations

from typing import Callable

from . import _cross_workloads, _eqx_workloads, _nnx_workloads, _pack_workloads, _sweep
from ._harness import Workload

QUICK_SWEEP = [10, 100, 1000, 2000]
FULL_SWEEP = [10, 30, 100, 300, 1000, 2000]


def workloads(quick: bool, sweep: bool = False) -> dict[str, Callable[[], Workload]]:
    """All workloads; the leaf-scaling sweep is included in --full, or when asked for."""
    out: dict[str, Callable[[], Workload]] = {}
    out.update(_eqx_workloads.build(quick))
    out.update(_nnx_workloads.build(quick))
    out.update(_cross_workloads.build(quick))
    out.update(_pack_workloads.build(quick))
    if sweep or not quick:
        out.update(_sweep.build(QUICK_SWEEP if quick else FULL_SWEEP))
    return out

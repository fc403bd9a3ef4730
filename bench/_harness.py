"""Workloads x variants -> verified equal -> timed (interleaved) -> results.

Honesty rules, each enforced here rather than by convention:
- every variant of a workload is checked against the workload's reference
  (values, structure, returned state) before any timing; a variant that fails
  is reported as FAILED, never as a number;
- compile time is excluded: verification doubles as warm-up, and one more
  untimed call follows;
- variants are interleaved round by round (the order rotates each round), each
  round ends by blocking on the last result, and the statistic is the median
  over rounds with the min and max alongside.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np


@dataclasses.dataclass
class Variant:
    """One way of running a workload.

    `make()` builds fresh state and returns `step`, a zero-argument callable
    that performs one call and returns its output. `prepare(n)` (optional) runs
    untimed before each timed batch of `n` calls (e.g. to build n new objects).
    """

    name: str
    make: Callable[[], Callable[[], Any]]
    prepare: Callable[[Callable[[], Any], int], None] | None = None
    note: str = ""
    timed: bool = True  # False for a reference (e.g. eager) that is only checked


@dataclasses.dataclass
class Workload:
    name: str
    description: str
    variants: list[Variant]
    # Compares a variant's outputs over `check_steps` steps against the
    # reference variant's (the first); raises AssertionError on a mismatch.
    compare: Callable[[list[Any], list[Any]], None]
    check_steps: int = 3
    floor: str = "floor"
    subject: str = "fastcall.jit"
    unit: str = "us/call"
    # The peers each fastcall variant replaces: {fastcall variant: (peer variant, ...)}.
    # Only call paths a user would otherwise write go here (eqx.filter_jit, nnx.jit,
    # plain jax.jit on the same structure, ...): never the floor, the eager reference or
    # a hand-written split/merge floor. `python -m bench` fails (exit 2) when a fastcall
    # variant is slower than one of its peers by more than its tolerance (`slower_than_peers`).
    peers: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # The least tolerance the speed check allows this workload (over --tolerance), for
    # workloads whose medians vary more between runs (a first call: a compile each time).
    min_tolerance: float = 0.0

    def __post_init__(self) -> None:
        names = {v.name for v in self.variants}
        unknown = [n for variant, peers in self.peers.items() for n in (variant, *peers) if n not in names]
        assert not unknown, f"{self.name}: peers name no variant: {unknown}"
        bad = [n for peers in self.peers.values() for n in peers if n == self.floor or n in self.peers]
        assert not bad, f"{self.name}: the floor or a fastcall variant listed as a peer: {bad}"


@dataclasses.dataclass
class Row:
    workload: str
    variant: str
    median_us: float | None
    min_us: float | None
    max_us: float | None
    rounds: int
    calls_per_round: int
    x_floor: float | None = None
    x_subject: float | None = None  # this variant's time / fastcall's time
    error: str | None = None
    note: str = ""
    # each round's time (us per call), in round order: the speed check pairs them by round
    samples: list[float] = dataclasses.field(default_factory=list, repr=False)


@dataclasses.dataclass
class PeerGap:
    """A fastcall variant slower than a peer it replaces."""

    workload: str
    variant: str
    peer: str
    median_us: float
    peer_median_us: float
    ratio: float  # variant / peer: paired by round (`paired_ratio`), else the medians'
    # The floor's median (None: no floor row), and whether the gap is not fastcall's to
    # close: the floor, jax.jit on the pre-flattened leaves with no wrapper at all, lost to
    # the peer too (by more than the tolerance) while fastcall was within the tolerance of it.
    floor_median_us: float | None = None
    at_floor: bool = False
    # Whether `ratio` pairs the rounds (else it is the medians'); and then the floor's time
    # over the peer's, paired the same way
    paired: bool = False
    floor_ratio: float | None = None

    def message(self) -> str:
        head = f"fastcall slower than its peer: {self.workload}: {self.variant} "
        if self.paired:
            text = (
                f"{head}{self.ratio:.2f}x {self.peer}, the median of their times' ratio round by round "
                f"(medians {self.median_us:.1f} us and {self.peer_median_us:.1f} us)"
            )
        else:
            text = f"{head}{self.median_us:.1f} us vs {self.peer} {self.peer_median_us:.1f} us ({self.ratio:.2f}x)"
        if self.at_floor:
            floor = (
                f"was {self.floor_ratio:.2f}x {self.peer} round by round" if self.paired and self.floor_ratio
                else f"took {self.floor_median_us:.1f} us, slower than {self.peer}"
            )
            text += f"; the floor {floor} too: not the call's cost (no wrapper has less), the CPU runtime's scheduling"
        return text


def slower_than_peers(workload: Workload, rows: list[Row], tolerance: float) -> list[PeerGap]:
    """Each (fastcall variant, peer) pair of `workload.peers` where the fastcall variant is
    slower than the peer by more than `tolerance` (0.05: more than 5% slower): by the median
    over rounds of the ratio of the two variants' times in the same round (`paired_ratio`),
    as `x_floor` is, where both rows carry their rounds; else by the ratio of their medians. Paired, a
    drift of the machine between rounds (a compute-bound workload's times swing 2x here)
    cancels instead of deciding the verdict.

    Such a pair is `at_floor` (reported, not counted) when the floor is slower than the peer
    by more than the tolerance as well and the fastcall variant is within the tolerance of
    the floor: a gap that a call with no wrapper at all shows too is not fastcall's cost.
    (On this 2-core machine, in compute-bound steps, a few microseconds of host work more
    between dispatches can make a loop faster, not slower.) Pairs where either row is missing
    (filtered out with --variants) or FAILED are skipped: a failed correctness check is
    reported (and fails the run) on its own."""
    tolerance = max(tolerance, workload.min_tolerance)
    timed = {r.variant: r for r in rows if r.workload == workload.name and r.median_us}

    def paired(a: str, b: str) -> float | None:
        return paired_ratio(timed[a].samples, timed[b].samples) if timed[a].samples else None

    def ratio(a: str, b: str) -> float:
        by_round = paired(a, b)
        return by_round if by_round is not None else timed[a].median_us / timed[b].median_us

    floor = timed.get(workload.floor)
    gaps = []
    for variant, peers in workload.peers.items():
        if variant not in timed:
            continue
        for peer in peers:
            if peer not in timed or ratio(variant, peer) <= 1 + tolerance:
                continue
            at_floor = (
                floor is not None and ratio(workload.floor, peer) > 1 + tolerance
                and ratio(variant, workload.floor) <= 1 + tolerance
            )
            mine, theirs = timed[variant].median_us, timed[peer].median_us
            gaps.append(
                PeerGap(
                    workload.name, variant, peer, mine, theirs, ratio(variant, peer),
                    floor.median_us if floor is not None else None, at_floor, paired(variant, peer) is not None,
                    paired(workload.floor, peer) if floor is not None else None,
                )
            )
    return gaps


def allclose_tree(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Assert two pytrees have the same structure, shapes, dtypes and close values."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert len(la) == len(lb), f"different number of leaves: {len(la)} vs {len(lb)} ({ta} vs {tb})"
    for i, (x, y) in enumerate(zip(la, lb)):
        if hasattr(x, "shape") or hasattr(y, "shape"):
            x, y = _plain(x), _plain(y)
            assert x.shape == y.shape, f"leaf {i}: shape {x.shape} vs {y.shape}"
            assert x.dtype == y.dtype, f"leaf {i}: dtype {x.dtype} vs {y.dtype}"
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"leaf {i}")
        else:
            assert x == y, f"leaf {i}: {x!r} vs {y!r}"


def _plain(x: Any) -> np.ndarray:
    """A NumPy view of an array leaf (PRNG key arrays compared through their key data)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


WARM_STEPS = 4  # (calls run before timing: every compile done, `measure`)


def _run_steps(step: Callable[[], Any], n: int) -> list[Any]:
    outs = []
    for _ in range(n):
        out = step()
        jax.block_until_ready(out)
        outs.append(out)
    return outs


def verify(workload: Workload) -> dict[str, str | None]:
    """Run each variant from fresh state and compare with the first variant."""
    errors: dict[str, str | None] = {}
    ref_outs: list[Any] | None = None
    for v in workload.variants:
        try:
            outs = _run_steps(v.make(), workload.check_steps)
            if ref_outs is None:
                ref_outs = outs
            else:
                workload.compare(ref_outs, outs)
            errors[v.name] = None
        except Exception as err:  # a broken variant is reported, not timed
            errors[v.name] = f"{type(err).__name__}: {err}"[:300]
    return errors


def _time_batch(step: Callable[[], Any], n: int) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n * 1e6


def measure(
    workload: Workload,
    rounds: int,
    round_seconds: float,
    progress: Callable[[str], None] = lambda s: None,
) -> list[Row]:
    errors = verify(workload)
    live = [v for v in workload.variants if errors[v.name] is None and v.timed]
    steps = {}
    calls = {}
    for v in live:
        step = v.make()
        if v.prepare:
            v.prepare(step, 3)
        # compile + warm: fastcall compiles a second program for a model it packs, at the
        # record's first fast call (Equinox) or second (NNX): the third call
        _run_steps(step, WARM_STEPS)
        if v.prepare:
            v.prepare(step, 5)
        est = _time_batch(step, 5)
        calls[v.name] = int(min(20000, max(3, round_seconds * 1e6 / max(est, 0.1))))
        steps[v.name] = step
    samples: dict[str, list[float]] = {v.name: [] for v in live}
    for r in range(rounds):
        progress(f"{workload.name}: round {r + 1}/{rounds}")
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for v in order:
            n = calls[v.name]
            if v.prepare:
                v.prepare(steps[v.name], n)
            samples[v.name].append(_time_batch(steps[v.name], n))
    rows = []
    for v in workload.variants:
        if not v.timed and errors[v.name] is None:
            continue
        if errors[v.name] is not None:
            rows.append(Row(workload.name, v.name, None, None, None, 0, 0, error=errors[v.name], note=v.note))
            continue
        s = samples[v.name]
        rows.append(
            Row(
                workload.name, v.name, statistics.median(s), min(s), max(s), len(s), calls[v.name], note=v.note,
                samples=s,
            )
        )
    for row in rows:
        if row.median_us is None:
            continue
        row.x_floor = paired_ratio(samples[row.variant], samples.get(workload.floor))
        row.x_subject = paired_ratio(samples[row.variant], samples.get(workload.subject))
    return rows


def paired_ratio(mine: list[float], base: list[float] | None) -> float | None:
    """The median over rounds of `mine`'s time over `base`'s in the same round (None without
    `base`). Paired, because the variants of one round run back to back: a drift of the
    machine between rounds (this one's times swing 2x between processes, and by several %
    within one) moves both and cancels, where the ratio of the two medians keeps it."""
    if not base or len(base) != len(mine):
        return None
    return statistics.median([a / b for a, b in zip(mine, base)])

"""`python -m bench`: what fastcall saves against every peer, on this machine.

Exit status: 0 when every variant verified and no fastcall variant was slower than
a peer it replaces (each workload's `peers`) by more than --tolerance (a gap the
floor shows too, with fastcall at the floor, is printed and not counted:
`_harness.PeerGap.at_floor`); 1 when a
variant FAILED its correctness check; 2 when only the speed check failed (each
case named on stderr and listed under "slower_than_peer" in --json). The serving
run is reported, not checked: its latencies are dominated by HTTP and threads.

Results go to bench-results/results.json (--json FILE: elsewhere), with a plot beside
it (results.png: each variant's time over the floor's, per workload; with the
leaf-scaling sweep, --plot or --full, results-leaf-scaling.png too); --no-plot skips
the plots. `python -m bench.render` turns such a JSON into docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path

from . import _harness, _plot, _report, _serving
from ._registry import workloads


SERVING = "serving"
DEFAULT_JSON = "bench-results/results.json"


# Rounds of the second measurement of a workload where a gap was found: --full's count (a
# quick run's 15 let one noisy stretch confirm a gap at parity: cnn at 1.07x, then 0.97-1.02x
# in 41-round runs).
CONFIRM_ROUNDS = 41


def _counted(gaps: list[_harness.PeerGap], at_floor: list[_harness.PeerGap]) -> list[_harness.PeerGap]:
    """The gaps that count; those at the floor (`PeerGap.at_floor`) go to `at_floor`
    instead, the latest measurement's replacing an earlier one of the same pair."""
    for g in gaps:
        if g.at_floor:
            at_floor[:] = [a for a in at_floor if (a.workload, a.variant, a.peer) != (g.workload, g.variant, g.peer)]
            at_floor.append(g)
    return [g for g in gaps if not g.at_floor]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--full", action="store_true", help="more rounds, compute-bound sizes too")
    p.add_argument("--only", action="append", metavar="WORKLOAD", help="run only these workloads")
    p.add_argument("--variants", nargs="+", metavar="NAME", help="time only these variants (plus floor)")
    p.add_argument("--rounds", type=int, help="rounds per workload (default 15 quick, 41 full)")
    p.add_argument("--round-ms", type=float, help="target milliseconds per variant per round")
    p.add_argument(
        "--json",
        metavar="FILE",
        default=DEFAULT_JSON,
        help=f"write results as JSON to FILE, and the plots beside it (default {DEFAULT_JSON})",
    )
    p.add_argument("--no-plot", action="store_true", help="write no plots beside the JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="run the leaf-scaling sweep (10 to 2000 leaves) and plot us/call against leaves to FILE.png "
        "(--full runs it too, its plot beside the JSON)",
    )
    p.add_argument("--list", action="store_true", help="list workloads and exit")
    p.add_argument("--requests", type=int, help="serving: requests per call path per round (default 300)")
    p.add_argument("--concurrency", type=int, default=8, help="serving: client threads (default 8)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="exit 2 when a fastcall variant is slower than a peer (the call path it replaces) by more "
        "than this fraction, their times paired by round (default 0.05: ratios within one process still "
        "carry a few %% of noise)",
    )
    p.add_argument(
        "--sync-dispatch",
        action="store_true",
        help="CPU: run each computation in the calling thread (jax_cpu_enable_async_dispatch off), so "
        "each call's host work adds to its compute: no hand-off to worker threads, whose scheduling "
        "moves compute-bound steps by more than the host work does",
    )
    if argv is None:
        argv = sys.argv[1:]
    args = p.parse_args(argv)
    if args.sync_dispatch:
        import jax  # (read when jax makes its CPU client: before anything below runs on it)

        jax.config.update("jax_cpu_enable_async_dispatch", False)

    quick = not args.full
    rounds = args.rounds or (15 if quick else 41)
    round_s = (args.round_ms or (8.0 if quick else 25.0)) / 1000
    builders = workloads(quick, sweep=bool(args.plot))
    if args.list:
        for name in [*builders, SERVING]:
            print(name)
        return 0
    serving = not args.only or SERVING in args.only
    if args.only:
        unknown = [w for w in args.only if w not in builders and w != SERVING]
        if unknown:
            p.error(f"unknown workload(s) {unknown}; choose from {[*builders, SERVING]}")
        builders = {k: v for k, v in builders.items() if k in args.only}

    # (before the run, not after minutes of it)
    if (args.plot or not args.no_plot) and importlib.util.find_spec("matplotlib") is None:
        p.error("the plots need matplotlib (pip install matplotlib); or pass --no-plot")
    info = _report.machine(argv)
    print(_report.machine_line(info), file=sys.stderr)
    rows: list[_harness.Row] = []
    gaps: list[_harness.PeerGap] = []
    at_floor: list[_harness.PeerGap] = []  # (reported, not counted: see PeerGap.at_floor)
    not_confirmed: list[_harness.PeerGap] = []  # (found once, not in the re-measurement)
    described: dict[str, dict] = {}
    t0 = time.time()
    for i, (name, build) in enumerate(builders.items()):
        workload = build()
        described[name] = {"description": workload.description, "floor": workload.floor, "peers": workload.peers}
        if args.variants:
            keep = set(args.variants) | {workload.floor, "eager"}
            workload.variants = [v for v in workload.variants if v.name in keep]

        def progress(msg: str, i: int = i) -> None:
            line = f"[{i + 1}/{len(builders)}] {msg} ({time.time() - t0:.0f}s)"
            if sys.stderr.isatty():
                print(f"\r{line}   ", end="", file=sys.stderr, flush=True)
            elif msg.endswith("verifying"):
                print(line, file=sys.stderr, flush=True)

        progress(f"{name}: verifying")
        measured = _harness.measure(workload, rounds, round_s, progress)
        found = _counted(_harness.slower_than_peers(workload, measured, args.tolerance), at_floor)
        if found:
            # This machine's noise can move one run's ratios by more than the tolerance:
            # a gap counts only if a second measurement, of more rounds (CONFIRM_ROUNDS),
            # finds it again (its rows replace the first's, so the table shows what the
            # verdict rests on).
            measured = _harness.measure(workload, max(rounds, CONFIRM_ROUNDS), round_s, progress)
            first = {(g.variant, g.peer) for g in found}
            again = _harness.slower_than_peers(workload, measured, args.tolerance)
            at_floor[:] = [a for a in at_floor if a.workload != name]  # (the first measurement's: replaced)
            confirmed = [g for g in _counted(again, at_floor) if (g.variant, g.peer) in first]
            kept = {(g.variant, g.peer) for g in confirmed}
            for g in found:
                if (g.variant, g.peer) not in kept and not any(
                    (a.workload, a.variant, a.peer) == (name, g.variant, g.peer) for a in at_floor
                ):
                    print(f"\n  re-measured, not found again (not counted): {g.message()}", file=sys.stderr)
                    not_confirmed.append(g)
            found = confirmed
        gaps += found
        rows += measured
    served: list[_serving.LoadResult] = []
    if serving:
        print(f"[serving] {args.concurrency} client threads on 127.0.0.1 ({time.time() - t0:.0f}s)", file=sys.stderr)
        served = _serving.run(
            requests=args.requests or (300 if quick else 2000),
            concurrency=args.concurrency,
            rounds=3 if quick else 7,
        )
    print(file=sys.stderr)

    print(_report.machine_line(info) if not args.markdown else "")
    if rows:
        print(_report.table(rows, markdown=args.markdown))
    if served:
        print(f"\n{_serving.caption(args.concurrency)}\n")
        print(_serving.table(served, markdown=args.markdown))
    code = _verdict(rows, gaps, at_floor, args.tolerance)
    peers = {peer for w in described.values() for names in w["peers"].values() for peer in names}
    plots = {}
    for kind, path in _plot_paths(args.json, args.plot, args.no_plot).items():
        if DRAW[kind](rows, peers, path, _report.machine_line(info)):
            plots[kind] = path
    if args.plot and "leaf_scaling" not in plots:
        print("\nno leaf-scaling rows to plot (use --only leaves_N or no --only)", file=sys.stderr)
    extra = {
        "rounds": rounds,
        "tolerance": args.tolerance,
        "exit_status": code,
        "slower_than_peer": _listed(gaps),
        "slower_than_peer_at_floor": _listed(at_floor),
        "slower_than_peer_not_confirmed": _listed(not_confirmed),
        "serving": [dataclasses.asdict(r) for r in served],
        "workloads": described,
        # (relative to the JSON's folder: where `python -m bench.render` looks for them)
        "plots": {kind: Path(os.path.relpath(path, Path(args.json).parent)).as_posix() for kind, path in plots.items()},
    }
    _report.write_json(args.json, rows, info, extra)
    print(f"\nresults written to {args.json}", file=sys.stderr)
    for path in plots.values():
        print(f"plot written to {path}", file=sys.stderr)
    return code


DRAW = {"ratios": _plot.ratios, "leaf_scaling": _plot.leaf_scaling}


def _plot_paths(json_path: str, sweep_path: str | None, no_plot: bool) -> dict[str, str]:
    """Where each plot goes: beside the JSON, named after its stem (results.json:
    results.png, results-leaf-scaling.png), unless --no-plot; the sweep's to --plot's
    FILE where given. (A plot with no rows to draw is skipped when drawn.)"""
    base = Path(json_path)
    paths = {}
    if not no_plot:
        paths["ratios"] = str(base.with_suffix(".png"))
        paths["leaf_scaling"] = str(base.with_name(f"{base.stem}-leaf-scaling.png"))
    if sweep_path:
        paths["leaf_scaling"] = sweep_path
    for path in paths.values():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return paths


def _listed(found: list[_harness.PeerGap]) -> list[dict]:
    return [{**dataclasses.asdict(g), "message": g.message()} for g in found]


def _verdict(
    rows: list[_harness.Row], gaps: list[_harness.PeerGap], at_floor: list[_harness.PeerGap], tolerance: float
) -> int:
    """Print what did not pass (or passed only at the floor); the exit status."""
    for g in at_floor:
        print(f"\nnot counted, the floor was slower than the peer too: {g.message()}", file=sys.stderr)
    if gaps:
        print(
            f"\n{len(gaps)} (fastcall variant, peer it replaces) pair(s) where fastcall was slower by "
            f"more than {tolerance:.0%} (--tolerance {tolerance:g}), in "
            f"{', '.join(dict.fromkeys(g.workload for g in gaps))}:",
            file=sys.stderr,
        )
        for g in gaps:
            print(f"  {g.message()}", file=sys.stderr)
    failed = [r for r in rows if r.error]
    if failed:
        print(f"\n{len(failed)} variant(s) FAILED their correctness check:", file=sys.stderr)
        for r in failed:
            print(f"  {r.workload} / {r.variant}: {r.error}", file=sys.stderr)
        return 1  # a wrong result outranks a slow one
    return 2 if gaps else 0

if __name__ == "__main__":
    sys.exit(main())

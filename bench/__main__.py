"""`python -m bench`: what fastcall saves against every peer, on this machine.

Exit status: 0 when every variant verified and no fastcall variant was slower than
a peer it replaces (each workload's `peers`) by more than --tolerance; 1 when a
variant FAILED its correctness check; 2 when only the speed check failed (each
case named on stderr and listed under "slower_than_peer" in --json). The serving
run is reported, not checked: its latencies are dominated by HTTP and threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from . import _harness, _report, _serving, _sweep
from ._registry import workloads


SERVING = "serving"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--full", action="store_true", help="more rounds, compute-bound sizes too")
    p.add_argument("--only", action="append", metavar="WORKLOAD", help="run only these workloads")
    p.add_argument("--variants", nargs="+", metavar="NAME", help="time only these variants (plus floor)")
    p.add_argument("--rounds", type=int, help="rounds per workload (default 15 quick, 41 full)")
    p.add_argument("--round-ms", type=float, help="target milliseconds per variant per round")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="run the leaf-scaling sweep (10 to 2000 leaves) and plot us/call against leaves",
    )
    p.add_argument("--list", action="store_true", help="list workloads and exit")
    p.add_argument("--requests", type=int, help="serving: requests per call path per round (default 300)")
    p.add_argument("--concurrency", type=int, default=8, help="serving: client threads (default 8)")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="exit 2 when a fastcall variant's median exceeds a peer's (the call path it replaces) "
        "by more than this fraction (default 0.05: ratios within one process still carry a few %% of noise)",
    )
    args = p.parse_args(argv)

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

    info = _report.machine()
    print(_report.machine_line(info), file=sys.stderr)
    rows: list[_harness.Row] = []
    gaps: list[_harness.PeerGap] = []
    t0 = time.time()
    for i, (name, build) in enumerate(builders.items()):
        workload = build()
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
        found = _harness.slower_than_peers(workload, measured, args.tolerance)
        if found:
            # This machine's noise can move one run's medians by more than the tolerance:
            # a gap counts only if a second measurement finds it again (its rows replace
            # the first's, so the table shows what the verdict rests on).
            measured = _harness.measure(workload, rounds, round_s, progress)
            first = {(g.variant, g.peer) for g in found}
            confirmed = [g for g in _harness.slower_than_peers(workload, measured, args.tolerance) if (g.variant, g.peer) in first]
            kept = {(g.variant, g.peer) for g in confirmed}
            for g in found:
                if (g.variant, g.peer) not in kept:
                    print(f"\n  re-measured, not found again (not counted): {g.message()}", file=sys.stderr)
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
        print(
            f"\nserving: NNX/Equinox MLP width 32 depth 3 behind a threaded HTTP server on loopback, "
            f"{args.concurrency} concurrent clients; medians over rounds\n"
        )
        print(_serving.table(served, markdown=args.markdown))
    if args.json:
        extra = {
            "rounds": rounds,
            "tolerance": args.tolerance,
            "slower_than_peer": [{**dataclasses.asdict(g), "message": g.message()} for g in gaps],
            "serving": [dataclasses.asdict(r) for r in served],
        }
        _report.write_json(args.json, rows, info, extra)
    if args.plot:
        if _sweep.plot(rows, args.plot, _report.machine_line(info)):
            print(f"\nleaf-scaling plot written to {args.plot}", file=sys.stderr)
        else:
            print("\nno leaf-scaling rows to plot (use --only leaves_N or no --only)", file=sys.stderr)
    if gaps:
        print(
            f"\n{len(gaps)} (fastcall variant, peer it replaces) pair(s) where fastcall was slower by "
            f"more than {args.tolerance:.0%} (--tolerance {args.tolerance:g}), in "
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

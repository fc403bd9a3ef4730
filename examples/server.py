"""A threaded HTTP inference server and a load generator, on loopback only.

    python examples/server.py                       # compare call paths: p50/p99, throughput
    python examples/server.py --serve fastcall --seconds 30   # serve one model for 30 s

The comparison serves the same weights (an NNX model and its Equinox twin)
through fastcall.jit, nnx.jit and eqx.filter_jit, checks the responses are
equal, then sends a bounded number of requests from several client threads.
nnx.jit's default graph mode is not thread-safe: its failed requests are
counted in the "errors" column.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

# bench/ is not an installed package: import it from the repository this example lives in.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench import _serving  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--requests", type=int, default=500, help="requests per call path per round")
    p.add_argument("--concurrency", type=int, default=8, help="client threads")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve", choices=["fastcall", "nnx", "eqx"], help="run one server instead")
    p.add_argument("--seconds", type=float, default=30.0, help="with --serve: stop after this long")
    args = p.parse_args(argv)

    if args.serve:
        name = {"fastcall": "fastcall.jit (nnx)", "nnx": "nnx.jit", "eqx": "eqx.filter_jit"}[args.serve]
        predict = _serving.predictors(args.width, args.depth)[name]
        with _serving.Server(predict) as server:
            print(f"serving {name} at {server.url} for {args.seconds:.0f} s", flush=True)
            print(f'try: curl -s -X POST {server.url} -d \'{{"x": [{", ".join(["0.5"] * args.width)}]}}\'')
            time.sleep(args.seconds)
        return 0

    results = _serving.run(args.width, args.depth, args.requests, args.concurrency, args.rounds)
    print(
        f"MLP width {args.width} depth {args.depth}; {args.requests} requests x {args.rounds} rounds per "
        f"call path, {args.concurrency} client threads, 127.0.0.1\n"
    )
    print(_serving.table(results, markdown=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

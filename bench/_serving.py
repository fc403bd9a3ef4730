"""Serving: a threaded HTTP inference server on loopback and a load generator.

The same model is served through each call path; a bounded number of requests
is sent from several client threads, and the report gives latency percentiles
(p50, p99) and throughput. Responses are checked equal across call paths
before anything is timed. Traffic goes to 127.0.0.1 only; every loop is
bounded in count and the server stops by itself when the run ends.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import statistics
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fastcall

from ._nnx_workloads import MLP


def models(width: int, depth: int) -> tuple[Any, Any]:
    """An NNX model and an Equinox model with the same weights (layout converted)."""
    nm = MLP(width, depth, nnx.Rngs(0))
    em = eqx.nn.MLP(width, width, width, depth - 1, key=jax.random.PRNGKey(0))
    for i, layer in enumerate(nm.layers):
        em = eqx.tree_at(lambda m, i=i: m.layers[i].weight, em, layer.kernel[...].T)  # (in,out) -> (out,in)
        em = eqx.tree_at(lambda m, i=i: m.layers[i].bias, em, layer.bias[...])
    return nm, em


def predictors(width: int, depth: int) -> dict[str, Callable[[Any], Any]]:
    """Call path name -> predict(x) on the same weights."""
    nm, em = models(width, depth)

    def call(m, x):
        return m(x)

    fc, nj, ej, fe = fastcall.jit(call), nnx.jit(call), eqx.filter_jit(call), fastcall.jit(call)
    return {
        "fastcall.jit (nnx)": lambda x: fc(nm, x),
        "nnx.jit": lambda x: nj(nm, x),
        "fastcall.jit (eqx)": lambda x: fe(em, x),
        "eqx.filter_jit": lambda x: ej(em, x),
    }


class _Handler(http.server.BaseHTTPRequestHandler):
    predict: Callable[[Any], Any]
    protocol_version = "HTTP/1.1"  # keep-alive: one connection per client thread
    disable_nagle_algorithm = True  # no 40 ms Nagle/delayed-ACK stalls on small responses

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        x = jnp.asarray(json.loads(body)["x"], jnp.float32)
        try:
            y = np.asarray(self.predict(x)).tolist()
        except Exception as err:  # reported to the client as a failed request
            payload = repr(err).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        payload = json.dumps({"y": y}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


class Server:
    """A ThreadingHTTPServer on 127.0.0.1 (an ephemeral port) serving `predict`."""

    def __init__(self, predict: Callable[[Any], Any]) -> None:
        handler = type("Handler", (_Handler,), {"predict": staticmethod(predict)})
        server_cls = type("Server", (http.server.ThreadingHTTPServer,), {"request_queue_size": 128})
        self.httpd = server_cls(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/predict"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def request(url: str, x: list[float], timeout: float = 30.0) -> list[float]:
    """One request on a new connection."""
    data = json.dumps({"x": x}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())["y"]


class Client:
    """A keep-alive connection to the server (one per load-generator thread)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.path = parsed.path
        self.conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)

    def __call__(self, x: list[float]) -> list[float]:
        body = json.dumps({"x": x}).encode()
        self.conn.request("POST", self.path, body=body, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        return json.loads(data)["y"]

    def close(self) -> None:
        self.conn.close()


@dataclasses.dataclass
class LoadResult:
    name: str
    requests: int
    concurrency: int
    p50_ms: float
    p99_ms: float
    throughput_rps: float
    errors: int


def load(url: str, inputs: list[list[float]], requests: int, concurrency: int, name: str = "") -> LoadResult:
    """Send `requests` requests from `concurrency` threads; latencies per request."""
    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    counter = iter(range(requests))

    def client() -> None:
        conn = Client(url)
        try:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    conn(inputs[i % len(inputs)])
                except Exception:  # a failed request (e.g. nnx.jit's thread-safety errors)
                    with lock:
                        errors[0] += 1
                    conn.close()
                    conn = Client(url)
                    continue
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    wall = time.perf_counter() - t0
    lat = sorted(latencies) or [float("nan")]
    return LoadResult(
        name,
        requests,
        concurrency,
        p50_ms=statistics.median(lat) * 1e3,
        p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        throughput_rps=len(latencies) / wall,
        errors=errors[0],
    )


def run(width: int = 32, depth: int = 3, requests: int = 400, concurrency: int = 8, rounds: int = 3) -> list[LoadResult]:
    """Serve the same model through each call path; check responses equal; measure.

    Call paths are interleaved round by round; each row is the median of rounds
    for p50/p99/throughput.
    """
    preds = predictors(width, depth)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(width).astype(np.float32).tolist() for _ in range(16)]
    servers = {name: Server(p) for name, p in preds.items()}
    for s in servers.values():
        s.__enter__()
    try:
        reference = None
        for name, s in servers.items():  # warm-up (compiles) and the equality check
            outs = [request(s.url, x) for x in inputs]
            if reference is None:
                reference = outs
            else:
                np.testing.assert_allclose(np.asarray(outs), np.asarray(reference), rtol=1e-5, atol=1e-5)
        samples: dict[str, list[LoadResult]] = {name: [] for name in servers}
        for r in range(rounds):
            names = list(servers)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                samples[name].append(load(servers[name].url, inputs, requests, concurrency, name))
    finally:
        for s in servers.values():
            s.__exit__(None, None, None)
    out = []
    for name, rs in samples.items():
        out.append(
            LoadResult(
                name,
                requests,
                concurrency,
                statistics.median(r.p50_ms for r in rs),
                statistics.median(r.p99_ms for r in rs),
                statistics.median(r.throughput_rps for r in rs),
                sum(r.errors for r in rs),
            )
        )
    return out


def table(results: list[LoadResult], markdown: bool) -> str:
    header = ["call path", "p50 ms", "p99 ms", "requests/s", "errors"]
    rows = [[r.name, f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.throughput_rps:.0f}", str(r.errors)] for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    return "\n".join(line.rstrip() for line in [fmt.format(*header)] + [fmt.format(*r) for r in rows])


def caption(concurrency: int) -> str:
    """What the serving table measured (`run`'s model, served to `concurrency` clients)."""
    return (
        "serving: NNX/Equinox MLP width 32 depth 3 behind a threaded HTTP server on loopback, "
        f"{concurrency} concurrent clients; medians over rounds"
    )

"""The examples run end to end at tiny size (as README shows them)."""

from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT, child_env


def run_example(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_decode_example():
    out = run_example("examples/decode.py", "--steps", "6", "--dim", "16", "--vocab", "32", "--layers", "1")
    assert "same tokens and same KV cache" in out
    assert "fastcall.jit:" in out and "nnx.jit:" in out


def test_server_example():
    out = run_example("examples/server.py", "--requests", "20", "--concurrency", "2", "--rounds", "1", "--width", "8")
    for name in ("fastcall.jit (nnx)", "nnx.jit", "fastcall.jit (eqx)", "eqx.filter_jit"):
        assert name in out
    assert "p50 ms" in out


def test_server_example_serves_one_model():
    out = run_example("examples/server.py", "--serve", "fastcall", "--seconds", "0.2", "--width", "4")
    assert "serving fastcall.jit (nnx) at http://127.0.0.1:" in out

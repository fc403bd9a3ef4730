"""bench/ runs end to end at tiny size, and its correctness checks can fail."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from bench import __main__ as bench_main
from bench import _harness


def test_bench_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = bench_main.main(
        ["--only", "identity", "--only", "eqx_mlp3_new", "--rounds", "1", "--round-ms", "0.2", "--json", str(out)]
    )
    assert code == 0
    data = json.loads(out.read_text())
    rows = {(r["workload"], r["variant"]): r for r in data["rows"]}
    assert rows[("identity", "floor")]["x_floor"] == pytest.approx(1.0)
    assert rows[("identity", "fastcall.jit")]["median_us"] > 0
    assert "jax" in data["machine"]
    assert "fastcall.jit" in capsys.readouterr().out


def test_bench_markdown(capsys):
    assert bench_main.main(["--only", "identity", "--rounds", "1", "--round-ms", "0.2", "--markdown"]) == 0
    assert "| workload | variant |" in capsys.readouterr().out


def test_a_wrong_variant_is_reported_as_failed_not_timed():
    x = jnp.ones(3)
    workload = _harness.Workload(
        "w",
        "",
        [
            _harness.Variant("floor", lambda: (lambda: x)),
            _harness.Variant("fastcall.jit", lambda: (lambda: x + 1)),  # wrong values
            _harness.Variant("shape", lambda: (lambda: jnp.ones(4))),  # wrong shape
        ],
        lambda ref, outs: [_harness.allclose_tree(a, b) for a, b in zip(ref, outs)] and None,
    )
    rows = {r.variant: r for r in _harness.measure(workload, rounds=1, round_seconds=0.0002)}
    assert rows["floor"].median_us is not None
    assert rows["fastcall.jit"].median_us is None and "AssertionError" in rows["fastcall.jit"].error
    assert rows["shape"].median_us is None and "shape" in rows["shape"].error


def test_unknown_workload_is_an_error():
    with pytest.raises(SystemExit):
        bench_main.main(["--only", "nope"])

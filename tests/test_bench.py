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


def test_leaf_sweep_plot(tmp_path):
    png = tmp_path / "sweep.png"
    code = bench_main.main(["--only", "leaves_10", "--rounds", "1", "--round-ms", "0.2", "--plot", str(png)])
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cross_framework_workloads_are_proven_equal():
    """The 3D transposed conv (eqx vs Flax) and the CNN (NNX vs Linen) pass their
    equality checks; a wrong conversion would be reported as FAILED."""
    from bench import _cross_workloads, _nnx_workloads

    for workload in (
        _cross_workloads.build(quick=True)["conv3d_transpose"](),
        _nnx_workloads.build(quick=True)["cnn"](),
    ):
        errors = _harness.verify(workload)
        assert all(e is None for e in errors.values()), errors


# Workloads whose fastcall.jit variant passes NNX objects inside a container: until
# fastcall supports that, it refuses them with a FastcallError (the bench reports the
# variant as FAILED, never timed); once it does, it must verify like every other variant.
CONTAINER_WORKLOADS = ("nnx_functional", "nnx_train_tuple", "nnx_kv_list")


@pytest.mark.parametrize("name", ["nnx_variable_arg", *CONTAINER_WORKLOADS])
def test_nnx_argument_shape_workloads_are_proven_equal(name):
    """The floor and every peer agree with eager (outputs and written-back state)."""
    from bench import _nnx_workloads

    errors = _harness.verify(_nnx_workloads.build(quick=True)[name]())
    subject = errors.pop("fastcall.jit")
    assert all(e is None for e in errors.values()), errors
    if name in CONTAINER_WORKLOADS and subject is not None:
        assert subject.startswith("FastcallError") and "inside a container" in subject, subject
    else:
        assert subject is None, subject


def test_a_wrong_layout_conversion_is_caught():
    """Using the Equinox kernel without transposing it to Flax's layout must fail the check."""
    from bench import _cross_workloads

    workload = _cross_workloads.conv_transpose_3d("w", "", 2, 3)
    broken = [v for v in workload.variants if v.name == "linen jax.jit(apply)"][0]
    import jax

    def make_wrong():
        import jax.numpy as jnp
        from flax import linen

        m = linen.ConvTranspose(2, kernel_size=(3, 3, 3), strides=(2, 2, 2), padding="VALID")
        params = {"params": {"kernel": jnp.ones((3, 3, 3, 2, 2)), "bias": jnp.zeros(2)}}
        x = jnp.ones((1, 3, 3, 3, 2))
        f = jax.jit(m.apply)
        return lambda: f(params, x)

    broken.make = make_wrong
    errors = _harness.verify(workload)
    assert errors["linen jax.jit(apply)"] is not None


def test_serving_workload(capsys):
    assert bench_main.main(["--only", "serving", "--requests", "10", "--concurrency", "2"]) == 0
    out = capsys.readouterr().out
    assert "p99 ms" in out and "fastcall.jit (nnx)" in out and "eqx.filter_jit" in out

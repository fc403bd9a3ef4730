"""Sharded models on 8 simulated CPU devices, and two JAX processes over loopback.

Each check runs in its own Python process: the device count is fixed when JAX
starts, so the child gets XLA_FLAGS=--xla_force_host_platform_device_count=N
from this test (the test session itself keeps its single device).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from .conftest import ROOT, child_env

SCRIPTS = ROOT / "tests" / "scripts"


def _env(devices: int) -> dict[str, str]:
    return child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")


def _check_script(devices: int, marker: str, script: str, *args: str) -> None:
    """Run tests/scripts/`script` on `devices` simulated devices; it must print `marker`."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert marker in proc.stdout


def test_data_and_model_parallel_on_eight_devices():
    _check_script(8, "SHARDED CHECKS PASSED", "sharded_check.py")


def test_in_shardings_with_nnx_prefix_on_eight_devices():
    from flax import nnx

    if not hasattr(nnx, "prefix"):
        pytest.skip("nnx.prefix needs flax >= 0.12.7")
    _check_script(8, "SHARDED CHECKS PASSED", "sharded_check.py", "prefix")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_with_jax_distributed_on_loopback():
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "multiprocess_check.py"), str(i), port],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (code, out, err) in enumerate(outputs):
        assert code == 0, f"process {i}:\n{out[-2000:]}\n{err[-4000:]}"
        assert f"process {i}: MULTIPROCESS CHECK PASSED" in out


def test_nnx_state_arguments_and_results_with_shardings():
    _check_script(4, "STATE SHARDING CHECKS PASSED", "state_shardings_check.py")


def test_packing_keeps_a_model_on_its_device_and_leaves_sharded_leaves_alone():
    _check_script(2, "PACK DEVICE ERRORS NAMED", "pack_devices_check.py")

"""fastcall's own code passes a type checker (mypy), as shipped with py.typed."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT


def test_mypy_passes():
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"]).returncode:
        pytest.skip("mypy not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_py_typed_is_shipped():
    assert (ROOT / "fastcall" / "py.typed").exists()

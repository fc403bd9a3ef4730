"""fastcall's own code passes a type checker (mypy), as shipped with py.typed.

Both tests look at the fastcall that is imported: the checkout under an editable
install, the installed copy when tests/matrix.py runs the suite outside the checkout.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

import fastcall

from .conftest import ROOT

PACKAGE = pathlib.Path(fastcall.__file__).resolve().parent


def test_mypy_passes():
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"]).returncode:
        pytest.skip("mypy not installed")
    proc = subprocess.run(
        # -p finds the package from cwd (a checkout) or else from site-packages (an install)
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "fastcall"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_py_typed_is_shipped():
    assert (PACKAGE / "py.typed").exists()

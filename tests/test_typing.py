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

from .conftest import ROOT, child_env

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


USER_SCRIPT = """
import jax
import jax.numpy as jnp

import fastcall


@fastcall.filter_jit
def forward(scale: float, x: jax.Array, flag: bool) -> jax.Array:
    return x * scale if flag else x


@fastcall.jit
def step(x: jax.Array, n: int) -> jax.Array:
    return x + n


forward(2.0, jnp.ones(2), True)
forward(2.0, "oops", 3)  # E: filter_jit keeps the signature
serve = fastcall.partial(forward, 2.0)
serve(jnp.ones(2), False)
serve("oops", False)  # E: partial keeps the rest of it
step(jnp.ones(2), "n")  # E: jit keeps it
reveal_type(serve.lower)
"""


def test_the_wrappers_keep_the_signature_for_a_type_checker(tmp_path):
    """A user's script checked by mypy against fastcall as installed: `filter_jit`, `jit` and
    `partial` (the bound arguments taken off) keep the wrapped function's signature. (With
    setuptools' default editable install mypy cannot find fastcall at all: README installs in
    compat mode.)"""
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"]).returncode:
        pytest.skip("mypy not installed")
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--ignore-missing-imports", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        # (no path given: mypy finds fastcall as README's install leaves it, an editable install in
        # setuptools' compat mode, or the installed copy the version matrix tests)
        env={k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "MYPYPATH")},
    )
    lines = USER_SCRIPT.splitlines()
    errors = sorted({int(line.split(":")[1]) for line in proc.stdout.splitlines() if ": error:" in line})
    assert errors == [i + 1 for i, line in enumerate(lines) if "# E:" in line], proc.stdout
    revealed = next(line for line in proc.stdout.splitlines() if "Revealed type" in line)
    assert "def (x: jax._src.basearray.Array, flag: " in revealed and "-> fastcall._aot.Lowered" in revealed, revealed


def test_py_typed_is_shipped():
    assert (PACKAGE / "py.typed").exists()

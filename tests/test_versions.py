"""The supported versions stated in README.md and pyproject.toml are the ones tests/matrix.py tests."""

from __future__ import annotations

import os
import pathlib
import re
import tomllib

import pytest

import fastcall
from tests import matrix

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_table() -> dict[str, dict[str, str]]:
    """README's "Supported versions" table: point name -> {column (lowercase): cell}."""
    section = (ROOT / "README.md").read_text().split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    head, body = [h.lower() for h in cells[0]], cells[2:]
    assert set(cells[1]) <= {"---", ":---", "---:"}, cells[1]
    return {row[0]: dict(zip(head[1:], row[1:])) for row in body}


def test_readme_table_matches_the_matrix_points():
    table = readme_table()
    assert list(table) == list(matrix.POINTS)
    for name, spec in matrix.POINTS.items():
        row = table[name]
        assert {"python", "jax", "flax", "equinox"} <= set(row), row
        for column, cell in row.items():
            assert cell == spec[column], (name, column, cell, spec[column])


def test_readme_shows_the_matrix_command():
    section = (ROOT / "README.md").read_text().split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    assert "python tests/matrix.py" in section


def test_pyproject_lower_bounds_are_the_oldest_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = matrix.POINTS["oldest"]
    assert project["requires-python"] == f">={oldest['python']}"
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    bounds: dict[str, set[str]] = {}
    for req in requirements:
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", req.strip()):
            bounds.setdefault(m.group(1).lower(), set()).add(m.group(2))
    for package in ("jax", "flax", "equinox", "jaxtyping", "optax"):
        assert bounds.get(package) == {oldest[package]}, (package, bounds.get(package), oldest[package])


@pytest.mark.skipif("FASTCALL_MATRIX_SITE" not in os.environ, reason="checks a tests/matrix.py run only")
def test_matrix_run_imports_the_installed_package():
    site = pathlib.Path(os.environ["FASTCALL_MATRIX_SITE"]).resolve()
    assert pathlib.Path(fastcall.__file__).resolve().is_relative_to(site), fastcall.__file__
    from fastcall import _accel  # the C extension was built for this interpreter

    assert pathlib.Path(_accel.__file__).resolve().parent == pathlib.Path(fastcall.__file__).resolve().parent

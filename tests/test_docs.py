"""README.md's commands are the ones CI runs."""

from __future__ import annotations

from .conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = [line for line in ci.splitlines() if "pytest" in line and not line.startswith("#")]
    assert len(command) == 1
    assert command[0].strip() in readme
    assert 'pip install -q -e ".[bench]" && python -m bench' in readme.split("## Why")[0]


def test_the_version_matrix_runs_the_suite_as_the_readme_does():
    from . import matrix

    readme = (ROOT / "README.md").read_text()
    assert f"python -m pytest {' '.join(matrix.PYTEST_WORKERS)}\n" in readme


def test_public_api_is_listed_in_readme():
    import fastcall

    readme = (ROOT / "README.md").read_text()
    public = [n for n in dir(fastcall) if not n.startswith("_")]
    for name in public:
        assert f"fastcall.{name}" in readme, name

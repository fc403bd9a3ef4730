"""README.md's commands are the ones CI runs; README and the docs site hold together."""

from __future__ import annotations

import re

from .conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if "pytest" in line and not line.startswith("#")]
    # README's test command, then the suite again in the agreement mode, compiled and with the
    # compiled sources as Python (README shows them all)
    assert len(commands) == 3, commands
    assert commands[0].startswith("python3 -m venv") and commands[0] in readme.split("## Why")[0]
    assert commands[1:] == [
        "FASTCALL_CHECK_HITS=1 python -m pytest -n auto --maxprocesses 4",
        "FASTCALL_CHECK_HITS=1 FASTCALL_TEST_AS_PYTHON=1 python -m pytest -n auto --maxprocesses 4",
    ]
    for command in commands[1:]:
        assert f"\n{command}\n" in readme.split("## Development", 1)[1]
    assert 'pip install -q -e ".[bench]" --config-settings editable_mode=compat && python -m bench' in readme.split("## Why")[0]


def test_the_version_matrix_runs_the_suite_as_the_readme_does():
    from . import matrix

    readme = (ROOT / "README.md").read_text()
    assert f"python -m pytest {' '.join(matrix.PYTEST_WORKERS)}\n" in readme


def test_every_public_name_is_in_the_api_reference():
    import fastcall

    api = (ROOT / "docs" / "api.md").read_text()
    public = [n for n in dir(fastcall) if not n.startswith("_")]
    for name in public:
        assert f"::: fastcall.{name}\n" in api, name


def test_the_site_lists_every_page_and_ci_builds_it_strictly():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert listed == pages, (listed ^ pages)
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[docs]" && mkdocs build --strict' in ci


def test_readme_is_one_page_and_its_links_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).exists(), target


def test_how_it_works_fits_in_80_lines():
    assert len((ROOT / "docs" / "how-it-works.md").read_text().splitlines()) <= 80


def test_readmes_results_table_is_the_committed_runs():
    """README's results table is generated from docs/bench/results.json (the run the
    performance page shows), never edited by hand."""
    import json

    from bench import render

    data = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert render.readme_table(data) in readme
    assert render.with_readme_table(readme, data) == readme

"""README.md's commands are the ones CI runs."""

from __future__ import annotations

from .conftest import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in ci.splitlines() if "pytest" in line and not line.startswith("#")]
    # README's test command, then the suite again in the agreement mode (README shows both)
    assert len(commands) == 2, commands
    assert commands[0].startswith("python3 -m venv") and commands[0] in readme.split("## Why")[0]
    assert commands[1] == "FASTCALL_CHECK_HITS=1 python -m pytest -n auto --maxprocesses 4"
    assert f"```bash\n{commands[1]}\n```" in readme
    assert 'pip install -q -e ".[bench]" --config-settings editable_mode=compat && python -m bench' in readme.split("## Why")[0]


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


def test_the_performance_sections_route_example_prints_what_readme_shows(capsys):
    """README's "Which route your calls take" snippet, run, prints the output shown below
    it; with the tuple the text names instead of the set, the fast path serves it."""
    import jax.numpy as jnp
    from flax import nnx

    import fastcall

    readme = (ROOT / "README.md").read_text()
    section = readme.split("**Which route your calls take.**")[1]
    code = section.split("```python\n")[1].split("```")[0]
    shown = section.split("```python\n")[1].split("```\n")[2].split("```")[0]
    namespace = {"jnp": jnp, "nnx": nnx, "fastcall": fastcall}
    exec(code, namespace)
    assert capsys.readouterr().out == shown
    exec(code.replace('{"cls", "seg"}', '("cls", "seg")'), namespace)
    out = " ".join(capsys.readouterr().out.split())
    sentence = section.split("With `{\"task\": (\"cls\", \"seg\")}` instead")[1].split("\n\n")[0]
    counts, route, argument = " ".join(sentence.split()).split("`")[1:6:2]
    assert all(count in out for count in counts.split(", ")), (counts, out)
    assert route in out and argument in out, out

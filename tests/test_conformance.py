"""The conformance runner's own logic (tests/conformance), on synthetic data: no network,
no peer suites. The runner itself is `python -m tests.conformance`."""

from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys
import tarfile
import tomllib
import types

import pytest

from tests.conformance import fastcall_conformance_plugin as plugin
from tests.conformance import runner

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _lines(*records):
    return [json.dumps(r) for r in records]


def _run(selected, results, **extra):
    records = [{"event": "configure", "peer": "flax", "patch": True}, {"event": "collected", "selected": selected, "deselected": 3}]
    for nodeid, outcome, error in results:
        records.append({"event": "start", "nodeid": nodeid})
        if outcome is not None:
            records.append({"event": "result", "nodeid": nodeid, "outcome": outcome, "error": error})
    records.append({"event": "finish", "exitstatus": 1})
    return runner.parse_results(_lines(*records), **extra)


def test_parse_results_outcomes_and_unfinished_tests():
    run = runner.parse_results(
        _lines(
            {"event": "configure", "patched": {"flax.nnx.jit": "fastcall.jit"}},
            {"event": "collected", "selected": ["a", "b", "c", "d"], "deselected": 7, "unpatched_aliases": []},
            {"event": "start", "nodeid": "a"},
            {"event": "result", "nodeid": "a", "outcome": "pass", "error": ""},
            {"event": "start", "nodeid": "b"},
            {"event": "result", "nodeid": "b", "outcome": "fail", "error": "TypeError: boom"},
            {"event": "start", "nodeid": "c"},
        )
        + ['{"event": "result", "nodeid": "c", "outc'],  # cut short by the kill
        returncode=-9,
        timed_out=True,
        timeout_s=60,
    )
    assert run.deselected == 7 and run.patched == {"flax.nnx.jit": "fastcall.jit"}
    assert run.outcomes["a"] == {"outcome": "pass", "error": ""}
    assert run.outcomes["b"] == {"outcome": "fail", "error": "TypeError: boom"}
    assert run.outcomes["c"]["outcome"] == "error" and "60 s" in run.outcomes["c"]["error"]
    assert run.outcomes["d"]["outcome"] == "not run"
    assert not run.finished

    crashed = _run(["x"], [("x", None, "")], returncode=-11)
    assert crashed.outcomes["x"]["outcome"] == "error" and "died (exit code -11)" in crashed.outcomes["x"]["error"]

    with pytest.raises(runner.RunnerError):
        runner.parse_results(_lines({"event": "configure"}))  # pytest never collected


def test_merge_totals_and_groups():
    unpatched = _run(["m.py::a", "m.py::b", "m.py::c", "n.py::d", "n.py::e"],
                     [("m.py::a", "pass", ""), ("m.py::b", "pass", ""), ("m.py::c", "skip", "no GPU"),
                      ("n.py::d", "pass", ""), ("n.py::e", "fail", "env problem")])
    patched = _run(["m.py::a", "m.py::b", "m.py::c"],
                   [("m.py::a", "pass", ""), ("m.py::b", "fail", "TypeError: cannot create weak reference to 'Param' object"),
                    ("m.py::c", "skip", "no GPU")])
    patched.collect_errors["n.py"] = "ImportError: fastcall broke the import"
    tests = runner.merge_runs(unpatched, patched)
    assert list(tests) == ["m.py::a", "m.py::b", "m.py::c", "n.py::d", "n.py::e"]
    assert tests["n.py::d"]["patched"] == {"outcome": "error", "error": "[collection] ImportError: fastcall broke the import"}
    tot = runner.totals(tests)
    assert tot["pass_unpatched"] == 3 and tot["pass_unpatched_and_patched"] == 1 and tot["percent"] == 33.3
    assert tot["unpatched"] == {"pass": 3, "fail": 1, "skip": 1}
    groups = dict(runner.group_failures(tests))
    assert groups == {
        "fail: TypeError: cannot create weak reference to 'Param' object": ["m.py::b"],
        "error: [collection] ImportError: fastcall broke the import": ["n.py::d"],
    }
    assert runner.totals({})["percent"] is None


def test_check_and_record():
    recorded = ["t1", "t2", "t3", "t4"]
    now = {"t1": "pass", "t2": "fail", "t3": "skip", "t5": "pass", "t6": "fail"}
    regressions, improvements = runner.check_expected(recorded, now)
    assert regressions == ["t2", "t3", "t4"]  # failing, skipped, and no longer collected
    assert improvements == ["t5"]
    assert runner.check_expected(["t1"], {"t1": "pass"}) == ([], [])

    data = {"flax": {"0.12.7": ["old"], "0.12.8": ["x"]}}
    out = runner.record_expected(data, "flax", "0.12.8", ["b", "a"])
    assert out == {"flax": {"0.12.7": ["old"], "0.12.8": ["a", "b"]}}
    assert data["flax"]["0.12.8"] == ["x"]  # not modified in place
    assert runner.record_expected(out, "equinox", "0.13.8", ["e"])["equinox"] == {"0.13.8": ["e"]}


def test_recorded_list_is_well_formed():
    data = runner.load_expected()
    for peer, versions in data.items():
        assert peer in runner.PEERS
        for version, tests in versions.items():
            assert tests == sorted(set(tests)) and all("::" in t for t in tests), (peer, version)


def test_selection_patterns():
    flax, eqx = runner.FILE_PATTERNS["flax"], runner.FILE_PATTERNS["equinox"]
    assert flax.pattern == plugin.SELECT["flax"].pattern and eqx.pattern == plugin.SELECT["equinox"].pattern
    for text in ["@nnx.jit\ndef f(): ...", "nnx.jit(f, graph=True)", "@nnx.compat.jit", "(jax.jit, nnx.jit)"]:
        assert flax.search(text), text
    for text in ["nnx.jit_partial(f, m)", "jax.jit(f)", "nnx.cached_partial(f, m)", "nnx.jitter"]:
        assert not flax.search(text), text
    assert eqx.search("@eqx.filter_jit(donate='all')") and eqx.search("equinox.filter_jit")
    assert not eqx.search("eqx.filter_jvp") and not eqx.search("eqx.filter_jit_thing")


def test_plugin_error_line():
    crash = types.SimpleNamespace(reprcrash=types.SimpleNamespace(message="TypeError: first\nsecond line"))
    assert plugin.error_line(types.SimpleNamespace(longrepr=crash)) == "TypeError: first"
    skip = types.SimpleNamespace(longrepr=("f.py", 3, "Skipped: needs a GPU"))
    assert plugin.error_line(skip) == "needs a GPU"
    text = types.SimpleNamespace(longrepr="collecting ...\nE   ImportError: no module x\nmore")
    assert plugin.error_line(text) == "ImportError: no module x"
    assert plugin.error_line(types.SimpleNamespace(longrepr=None)) == ""
    assert len(plugin.first_line("x" * 1000)) == 300


def _tarball(path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_sdist_extraction_and_file_selection(tmp_path):
    tarball = _tarball(tmp_path / "flax-9.9.tar.gz", {
        "flax-9.9/PKG-INFO": "Metadata-Version: 2.1\nName: flax\nVersion: 9.9\n",
        "flax-9.9/pyproject.toml": "[tool.pytest.ini_options]\n",
        "flax-9.9/flax/__init__.py": "raise ImportError('the sdist package must not be extracted')\n",
        "flax-9.9/tests/nnx/uses_jit_test.py": "m = nnx.jit(f)\n",
        "flax-9.9/tests/nnx/partial_only_test.py": "m = nnx.jit_partial(f)\n",
        "flax-9.9/tests/nnx/helpers.py": "nnx.jit\n",
    })
    dest = tmp_path / "cache" / "flax-9.9"
    dest.parent.mkdir()
    runner._extract_sdist(tarball, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["PKG-INFO", "pyproject.toml", "tests"]
    assert runner.source_version(dest) == "9.9"
    assert runner.select_files("flax", dest) == ["tests/nnx/uses_jit_test.py"]


def test_conformance_package_is_not_collected():
    names = [p.name for p in (ROOT / "tests" / "conformance").iterdir()]
    assert not [n for n in names if n.startswith("test_") or n.endswith("_test.py")]
    assert "conformance" in (ROOT / "tests" / "conftest.py").read_text()


def test_plugin_patches_selects_and_reports(tmp_path):
    """One small patched run of a synthetic flax-style suite, in a fresh process."""
    peer = tmp_path / "peer"
    (peer / "tests").mkdir(parents=True)
    # The peer's settings: warnings are errors, but for the named third-party deprecations our
    # own settings ignore on supported versions (flax 0.12.5 under jax 0.10 warns on import).
    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert ours[0] == "error"
    (peer / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\nfilterwarnings = {json.dumps(ours)}\n")
    (peer / "tests" / "fake_test.py").write_text(
        "import fastcall, functools, pytest\n"
        "from flax import nnx\n"
        "try:\n"
        "    import flax.nnx.compat as compat  # (flax >= 0.12.7)\n"
        "except ImportError:\n"
        "    compat = None\n"
        "def test_patched():\n"
        "    assert nnx.jit is fastcall.jit\n"
        "    if compat is not None:\n"
        "        assert isinstance(compat.jit, functools.partial) and compat.jit.func is fastcall.jit\n"
        "def test_fails():\n"
        "    nnx.jit\n"
        "    raise TypeError('boom\\nsecond line')\n"
        "def test_skips():\n"
        "    pytest.skip('not here: nnx.jit')\n"
        "def test_not_selected():\n"
        "    pass\n"
    )
    result, wall, log = runner.run_pytest("flax", peer, ["tests/fake_test.py"], patch=True, timeout=240,
                                          extra=[], log_dir=tmp_path, log=lambda msg: None)
    assert result.finished, log.read_text()
    assert result.deselected == 1 and result.unpatched_aliases == []
    assert result.patched["flax.nnx.jit"] == "fastcall.jit"
    assert {n.split("::")[1]: o["outcome"] for n, o in result.outcomes.items()} == {
        "test_patched": "pass", "test_fails": "fail", "test_skips": "skip"}
    errors = {n.split("::")[1]: o["error"] for n, o in result.outcomes.items()}
    assert errors["test_fails"] == "TypeError: boom" and errors["test_skips"] == "not here: nnx.jit"


def test_cli_help_runs_without_jax():
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from tests.conformance import runner; "
                           "assert 'jax' not in sys.modules and 'flax' not in sys.modules; "
                           "runner.build_parser().parse_args(['--check', '--only', 'flax'])"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr

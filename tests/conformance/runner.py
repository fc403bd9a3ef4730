"""Conformance runner: the peers' own jit tests, unpatched and with fastcall patched in.

Run from the repository root:

    python -m tests.conformance                 # run and report
    python -m tests.conformance --check         # also fail on regressions vs expected_passing.json
    python -m tests.conformance --record        # rewrite expected_passing.json from this run
    python -m tests.conformance --equinox-src PATH --json report.json

For each peer (flax, equinox) at its INSTALLED version:

1. Get the peer's tests into a cache directory outside the repository
   (``--cache-dir``, ``$FASTCALL_CONFORMANCE_CACHE``, default ``~/.cache/fastcall-conformance``).
   flax: ``pip download --no-deps --no-binary :all: flax==<version>`` (the sdist ships
   ``tests/``); only ``tests/`` and ``pyproject.toml`` are extracted, so the sdist's
   ``flax/`` never shadows the installed package. equinox: its sdist has no tests, so
   the runner needs ``--equinox-src PATH`` (or ``$FASTCALL_CONFORMANCE_EQUINOX_SRC``):
   either a checkout (a directory with ``tests/``) or a git repository (bare or not)
   from which tag ``v<version>`` is extracted with ``git archive``. Without one, the
   equinox part is skipped and says so.
2. Pick the test files whose source names the entry point, and run them with the peer's
   own ``pyproject.toml`` (``filterwarnings = error``, equinox's jaxtyping/beartype
   ``addopts``) and conftest, twice, each in a fresh process: unpatched, then with the
   entry point replaced by fastcall's (see ``fastcall_conformance_plugin.py``). Inside
   those files, a test is counted when its own source (decorators included) names the
   entry point: ``nnx.jit``/``nnx.compat.jit`` (not ``nnx.jit_partial``) for flax,
   ``eqx.filter_jit`` for equinox. Environment as the peers' CI sets it: flax runs with
   ``XLA_FLAGS=--xla_force_host_platform_device_count=4``, ``JAX_NUMPY_RANK_PROMOTION=raise``
   and ``FLAX_PROFILE=1`` (its ``tests/run_all_tests.sh``); equinox's conftest sets its own
   jax config. ``JAX_PLATFORMS`` defaults to ``cpu``.
3. Report both outcomes per test with the first error line, totals (of the tests that pass
   unpatched, how many pass patched) and the patched failures grouped by error line.

This module does not import jax, flax or equinox: the peers run in subprocesses.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Iterable

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
EXPECTED = HERE / "expected_passing.json"
PLUGIN = "fastcall_conformance_plugin"

PEERS = ("flax", "equinox")
OUTCOMES = ("pass", "fail", "error", "skip", "xfail", "xpass", "not run")

# Files whose source names the entry point are run; the plugin then keeps the tests
# whose own source does (same patterns as the plugin's SELECT).
FILE_PATTERNS = {
    "flax": re.compile(r"\bnnx\.(?:compat\.)?jit\b"),
    "equinox": re.compile(r"\b(?:eqx|equinox)\.filter_jit\b"),
}
ENTRY_POINTS = {
    "flax": "flax.nnx.jit, flax.nnx.compat.jit -> fastcall.jit",
    "equinox": "equinox.filter_jit -> fastcall.filter_jit (fastcall.jit while there is none)",
}
PEER_ENV = {
    # flax's tests/run_all_tests.sh exports these for its pytest run.
    "flax": {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_NUMPY_RANK_PROMOTION": "raise",
        "FLAX_PROFILE": "1",
    },
    # equinox's tests/conftest.py sets jax_num_cpu_devices=2, strict dtype promotion and
    # rank promotion=raise itself.
    "equinox": {},
}
# Modules the peers' tests import (or their pytest config needs) beyond fastcall's own
# dependencies: module -> pip name. `pip install -e ".[conformance]"` installs them.
PEER_REQUIRES = {
    "flax": {"absl": "absl-py", "cloudpickle": "cloudpickle", "optax": "optax"},
    "equinox": {"beartype": "beartype", "optax": "optax"},  # beartype: equinox's pytest addopts
}
EQUINOX_SRC_ENV = "FASTCALL_CONFORMANCE_EQUINOX_SRC"
CACHE_ENV = "FASTCALL_CONFORMANCE_CACHE"


class RunnerError(Exception):
    """The runner could not do its job (no sources, pytest did not start, ...)."""


# ---------------------------------------------------------------------------
# Results: parsing the plugin's JSON lines, comparing runs, checking.


@dataclasses.dataclass
class RunResult:
    """One pytest run (unpatched or patched) of one peer, as the plugin reported it."""

    selected: list[str]
    outcomes: dict[str, dict[str, str]]  # nodeid -> {"outcome", "error"}
    collect_errors: dict[str, str]  # collector nodeid (a file) -> error line
    deselected: int = 0
    patched: dict[str, str] = dataclasses.field(default_factory=dict)
    unpatched_aliases: list[str] = dataclasses.field(default_factory=list)
    still_patched: dict[str, bool] = dataclasses.field(default_factory=dict)
    finished: bool = False
    exitstatus: int | None = None
    returncode: int | None = None
    timed_out: bool = False


def parse_results(lines: Iterable[str], *, returncode: int | None = None, timed_out: bool = False,
                  timeout_s: float | None = None) -> RunResult:
    """Build a RunResult from the plugin's JSON lines.

    A test that started but never reported (the process hung and was killed, or died)
    is an ``error``; a selected test that never started is ``not run``.
    """
    result = RunResult(selected=[], outcomes={}, collect_errors={}, returncode=returncode,
                       timed_out=timed_out)
    started: list[str] = []
    collected = False
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        event = record.get("event")
        if event == "configure":
            result.patched = record.get("patched", {})
        elif event == "collected":
            collected = True
            result.selected = list(record["selected"])
            result.deselected = int(record.get("deselected", 0))
            result.unpatched_aliases = list(record.get("unpatched_aliases", []))
        elif event == "collect_error":
            result.collect_errors[record["nodeid"]] = record.get("error", "")
        elif event == "start":
            started.append(record["nodeid"])
        elif event == "result":
            result.outcomes[record["nodeid"]] = {"outcome": record["outcome"], "error": record.get("error", "")}
        elif event == "finish":
            result.finished = True
            result.exitstatus = record.get("exitstatus")
            result.still_patched = record.get("still_patched", {})
    if not collected and not result.collect_errors:
        raise RunnerError("pytest reported no collection (see the log above)")
    for nodeid in started:
        if nodeid not in result.outcomes:
            if timed_out:
                why = f"did not finish: the run was stopped after {timeout_s:g} s" if timeout_s else "did not finish: timed out"
            else:
                why = f"did not finish: the test process died (exit code {returncode})"
            result.outcomes[nodeid] = {"outcome": "error", "error": why}
    for nodeid in result.selected:
        if nodeid not in result.outcomes:
            result.outcomes[nodeid] = {"outcome": "not run", "error": "not reached (the run stopped earlier)"}
    return result


def _outcome_in(run: RunResult, nodeid: str) -> dict[str, str]:
    if nodeid in run.outcomes:
        return run.outcomes[nodeid]
    for collector, error in run.collect_errors.items():
        if nodeid.startswith(collector.split("::")[0]):
            return {"outcome": "error", "error": f"[collection] {error}"}
    return {"outcome": "not run", "error": "not collected in this run"}


def merge_runs(unpatched: RunResult, patched: RunResult) -> dict[str, dict[str, dict[str, str]]]:
    """nodeid -> {"unpatched": {...}, "patched": {...}}, in the unpatched run's order."""
    order = list(dict.fromkeys([*unpatched.selected, *patched.selected]))
    return {n: {"unpatched": _outcome_in(unpatched, n), "patched": _outcome_in(patched, n)} for n in order}


def totals(tests: dict[str, dict[str, dict[str, str]]]) -> dict[str, Any]:
    def count(mode: str) -> dict[str, int]:
        c = collections.Counter(t[mode]["outcome"] for t in tests.values())
        return {k: c[k] for k in OUTCOMES if c[k]}

    base = [n for n, t in tests.items() if t["unpatched"]["outcome"] == "pass"]
    both = [n for n in base if tests[n]["patched"]["outcome"] == "pass"]
    return {
        "selected": len(tests),
        "unpatched": count("unpatched"),
        "patched": count("patched"),
        "pass_unpatched": len(base),
        "pass_patched": sum(t["patched"]["outcome"] == "pass" for t in tests.values()),
        "pass_unpatched_and_patched": len(both),
        "percent": round(100.0 * len(both) / len(base), 1) if base else None,
    }


def normalise_error(line: str) -> str:
    """A grouping key for an error line: addresses and numbers blurred, length capped."""
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"\d+", "N", line)
    return line[:140]


def group_failures(tests: dict[str, dict[str, dict[str, str]]]) -> list[tuple[str, list[str]]]:
    """Tests that pass unpatched but not patched, grouped by their patched error line."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for nodeid, t in tests.items():
        if t["unpatched"]["outcome"] == "pass" and t["patched"]["outcome"] != "pass":
            key = f'{t["patched"]["outcome"]}: {normalise_error(t["patched"]["error"])}'
            groups[key].append(nodeid)
    return sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))


def check_expected(expected: Iterable[str], patched: dict[str, str]) -> tuple[list[str], list[str]]:
    """(regressions, improvements).

    ``expected``: the recorded list of tests passing patched. ``patched``: nodeid -> patched
    outcome for this run. A regression is a recorded test that does not pass now (whatever
    the reason: failure, error, skip, not collected); an improvement is a test that passes
    now and is not recorded.
    """
    expected = list(expected)
    recorded = set(expected)
    regressions = [n for n in expected if patched.get(n) != "pass"]
    improvements = [n for n, o in patched.items() if o == "pass" and n not in recorded]
    return regressions, improvements


def load_expected(path: pathlib.Path = EXPECTED) -> dict[str, Any]:
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def record_expected(data: dict[str, Any], peer: str, version: str, passing: Iterable[str]) -> dict[str, Any]:
    """A copy of ``data`` with ``peer``'s list for ``version`` replaced (other entries kept)."""
    data = json.loads(json.dumps(data))
    data.setdefault(peer, {})[version] = sorted(passing)
    return {k: data[k] for k in sorted(data)}


# ---------------------------------------------------------------------------
# Getting the peers' tests.


def missing_requirements(peer: str) -> list[str]:
    import importlib.util

    return [pip for module, pip in PEER_REQUIRES[peer].items() if importlib.util.find_spec(module) is None]


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_dir(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg).expanduser().resolve()
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "fastcall-conformance"


def _extract_sdist(tarball: pathlib.Path, dest: pathlib.Path) -> None:
    """Extract only ``<top>/tests/``, ``<top>/pyproject.toml`` and ``<top>/PKG-INFO`` into ``dest``."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".extract-", dir=dest.parent))
    try:
        with tarfile.open(tarball) as tar:
            members = []
            for m in tar.getmembers():
                parts = pathlib.PurePosixPath(m.name).parts
                if len(parts) >= 2 and (parts[1] == "tests" or (len(parts) == 2 and parts[1] in ("pyproject.toml", "PKG-INFO"))):
                    if m.isfile() or m.isdir():
                        members.append(m)
            if not members:
                raise RunnerError(f"{tarball} has no tests/ directory")
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **kwargs)
        (top,) = [p for p in tmp.iterdir() if p.is_dir()]
        if dest.exists():
            shutil.rmtree(dest)
        top.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_flax(version: str, cache: pathlib.Path, src: str | None, log) -> pathlib.Path:
    dest = cache / f"flax-{version}"
    if src:
        path = pathlib.Path(src).expanduser().resolve()
        if path.is_dir():
            if not (path / "tests" / "nnx").is_dir():
                raise RunnerError(f"--flax-src {path}: no tests/nnx directory")
            _copy_tests(path, dest)
            return dest
        _extract_sdist(path, dest)
        return dest
    if (dest / "tests" / "nnx").is_dir() and (dest / "PKG-INFO").exists():
        log(f"flax: using cached tests in {dest}")
        return dest
    downloads = cache / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    tarball = downloads / f"flax-{version}.tar.gz"
    if not tarball.exists():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"flax=={version}", "-d", str(downloads), "-q", "--disable-pip-version-check"]
        log(f"flax: {' '.join(cmd[2:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not tarball.exists():
            raise RunnerError(f"pip download of the flax {version} sdist failed:\n{proc.stdout}{proc.stderr}")
    _extract_sdist(tarball, dest)
    return dest


def _copy_tests(src: pathlib.Path, dest: pathlib.Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(src / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(src / "pyproject.toml", dest / "pyproject.toml")
    if (src / "PKG-INFO").exists():
        shutil.copy2(src / "PKG-INFO", dest / "PKG-INFO")


def _is_git_repo(path: pathlib.Path) -> bool:
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def prepare_equinox(version: str, cache: pathlib.Path, src: str, log) -> tuple[pathlib.Path, str]:
    """Returns (directory with tests/ and pyproject.toml, description of where they came from)."""
    path = pathlib.Path(src).expanduser().resolve()
    dest = cache / f"equinox-{version}"
    if not path.exists():
        raise RunnerError(f"equinox source {path} does not exist")
    if _is_git_repo(path) and not (path / "tests").is_dir():
        tag = f"v{version}"
        git_dir = path / ".git" if (path / ".git").exists() else path
        archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "--format=tar", tag, "tests", "pyproject.toml"],
                                 capture_output=True)
        if archive.returncode != 0:
            raise RunnerError(f"git archive {tag} from {git_dir} failed: {archive.stderr.decode(errors='replace').strip()}")
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
            kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, **kwargs)
        return dest, f"{git_dir} at tag {tag}"
    if not (path / "tests").is_dir() or not (path / "pyproject.toml").exists():
        raise RunnerError(f"equinox source {path}: expected a checkout with tests/ and pyproject.toml, or a git repository")
    _copy_tests(path, dest)
    return dest, str(path)


def source_version(peer_dir: pathlib.Path) -> str | None:
    """The version the tests come from: an sdist's PKG-INFO, else pyproject's static version."""
    pkg_info = peer_dir / "PKG-INFO"
    if pkg_info.exists():
        m = re.search(r"^Version:\s*(\S+)", pkg_info.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    m = re.search(r'^version\s*=\s*"([^"]+)"', (peer_dir / "pyproject.toml").read_text(), re.M)
    return m.group(1) if m else None


def select_files(peer: str, peer_dir: pathlib.Path) -> list[str]:
    pattern = FILE_PATTERNS[peer]
    files = []
    for path in sorted((peer_dir / "tests").rglob("*.py")):
        name = path.name
        if not (name.endswith("_test.py") or name.startswith("test_")):
            continue
        if pattern.search(path.read_text(errors="replace")):
            files.append(path.relative_to(peer_dir).as_posix())
    return files


# ---------------------------------------------------------------------------
# Running.


def run_pytest(peer: str, peer_dir: pathlib.Path, files: list[str], *, patch: bool, timeout: float,
               extra: list[str], log_dir: pathlib.Path, log) -> tuple[RunResult, float, pathlib.Path]:
    mode = "patched" if patch else "unpatched"
    results = log_dir / f"{peer}-{mode}.jsonl"
    out = log_dir / f"{peer}-{mode}.log"
    results.unlink(missing_ok=True)
    env = dict(os.environ)
    for key in list(env):
        # The peers' settings, not the caller's: no inherited pytest options, plugins or
        # paths, no inherited XLA/JAX flags (JAX_PLATFORMS excepted).
        if key.startswith(("PYTEST_", "XLA_", "JAX_")) and key != "JAX_PLATFORMS" or key == "PYTHONPATH":
            env.pop(key)
    env.update(PEER_ENV[peer])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = str(HERE)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["FASTCALL_CONFORMANCE_PEER"] = peer
    env["FASTCALL_CONFORMANCE_PATCH"] = "1" if patch else "0"
    env["FASTCALL_CONFORMANCE_RESULTS"] = str(results)
    cmd = [sys.executable, "-m", "pytest", "-c", "pyproject.toml", "--rootdir", ".", "-q", "-p", "no:cacheprovider",
           "-p", PLUGIN, "-o", "console_output_style=classic", *extra, *files]
    log(f"{peer} {mode}: {len(files)} files, fresh process (log: {out})")
    t0 = time.monotonic()
    timed_out = False
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=peer_dir, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)
            returncode = proc.wait()
    wall = time.monotonic() - t0
    lines = results.read_text().splitlines() if results.exists() else []
    try:
        result = parse_results(lines, returncode=returncode, timed_out=timed_out, timeout_s=timeout)
    except RunnerError as e:
        tail = "\n".join(out.read_text(errors="replace").splitlines()[-40:])
        raise RunnerError(f"{peer} {mode}: {e}\n--- last lines of {out} ---\n{tail}") from None
    if not result.finished and not timed_out:
        tail = "\n".join(out.read_text(errors="replace").splitlines()[-15:])
        log(f"WARNING: {peer} {mode}: pytest exited with code {returncode} before the end of the session:\n{tail}")
    return result, wall, out


def fastcall_origin() -> str:
    proc = subprocess.run([sys.executable, "-c", "import fastcall, os; print(os.path.dirname(fastcall.__file__))"],
                          capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return proc.stdout.strip() if proc.returncode == 0 else f"(cannot import fastcall: {proc.stderr.strip()[-200:]})"


# ---------------------------------------------------------------------------
# Reporting.

SHORT = {"pass": "pass", "fail": "FAIL", "error": "ERROR", "skip": "skip", "xfail": "xfail", "xpass": "XPASS",
         "not run": "NOTRUN"}


def print_peer_report(name: str, version: str, tests: dict[str, Any], tot: dict[str, Any], out) -> None:
    out(f"\n== {name} {version}: per test (unpatched -> patched) ==")
    for nodeid, t in tests.items():
        u, p = t["unpatched"], t["patched"]
        out(f"  {SHORT[u['outcome']]:>6} -> {SHORT[p['outcome']]:<6} {nodeid}")
        if u["outcome"] not in ("pass",) and u["error"]:
            out(f"           unpatched: {u['error']}")
        if p["outcome"] not in ("pass",) and p["error"] and p != u:
            out(f"           patched:   {p['error']}")
    out(f"\n== {name} {version}: totals ==")
    out(f"  selected {tot['selected']} tests; unpatched {_fmt_counts(tot['unpatched'])}; patched {_fmt_counts(tot['patched'])}")
    pct = "n/a" if tot["percent"] is None else f"{tot['percent']:.1f}%"
    out(f"  of the {tot['pass_unpatched']} tests that pass unpatched, {tot['pass_unpatched_and_patched']} pass patched ({pct})")
    groups = group_failures(tests)
    if groups:
        out(f"\n== {name} {version}: passing unpatched, not patched, by first error line ==")
        for key, ids in groups:
            out(f"  [{len(ids)}] {key}")
            for nodeid in ids:
                out(f"        {nodeid}")


def _fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "nothing"


# ---------------------------------------------------------------------------
# Main.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.conformance",
        description="Run the peers' own nnx.jit / eqx.filter_jit tests unpatched and with fastcall patched in.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help=f"exit 1 if a test on {EXPECTED.name} (for the installed peer version) no longer passes patched")
    mode.add_argument("--record", action="store_true", help=f"rewrite {EXPECTED.name} from this run's patched passes")
    p.add_argument("--json", metavar="FILE", help="write a machine-readable report")
    p.add_argument("--only", choices=PEERS, action="append", help="run only this peer (repeatable)")
    p.add_argument("--equinox-src", metavar="PATH", default=os.environ.get(EQUINOX_SRC_ENV),
                   help=f"equinox checkout, or git repository holding tag v<installed version> (or ${EQUINOX_SRC_ENV})")
    p.add_argument("--flax-src", metavar="PATH", help="flax sdist tarball or source directory (default: pip download)")
    p.add_argument("--cache-dir", metavar="DIR", help=f"where peer tests and logs go (${CACHE_ENV}, default ~/.cache/fastcall-conformance)")
    p.add_argument("--timeout", type=float, default=1500.0, metavar="S", help="limit per pytest run in seconds (default 1500)")
    p.add_argument("-k", metavar="EXPR", dest="keyword", help="pytest -k filter (for debugging; not with --record)")
    p.add_argument("--quiet", action="store_true", help="print only tests whose outcomes differ, and the totals")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.record and args.keyword:
        print("--record records the whole selection: drop -k", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[conformance] {msg}", flush=True)

    out = lambda msg: print(msg, flush=True)  # noqa: E731
    cache = cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    log_dir = cache / "logs"
    log_dir.mkdir(exist_ok=True)
    expected = load_expected()
    origin = fastcall_origin()
    log(f"python {platform.python_version()}, fastcall from {origin}")
    if not origin.startswith(str(REPO)):
        log(f"WARNING: fastcall is imported from {origin}, not from this checkout ({REPO}); "
            'install it with pip install -e ".[test]"')
    report: dict[str, Any] = {
        "command": " ".join(["python -m tests.conformance", *(argv if argv is not None else sys.argv[1:])]),
        "python": platform.python_version(),
        "fastcall": {"version": installed_version("fastcall"), "path": origin},
        "jax": installed_version("jax"),
        "jaxlib": installed_version("jaxlib"),
        "peers": {},
    }
    failures: list[str] = []
    regressions_total = 0
    started = time.monotonic()
    peers = [p for p in PEERS if not args.only or p in args.only]
    for peer in peers:
        entry: dict[str, Any] = {"entry_points": ENTRY_POINTS[peer], "selection": FILE_PATTERNS[peer].pattern}
        report["peers"][peer] = entry
        version = installed_version(peer)
        entry["version"] = version
        if version is None:
            entry["status"] = "skipped"
            entry["reason"] = f"{peer} is not installed"
            out(f"\n== {peer}: SKIPPED: {entry['reason']} ==")
            continue
        t0 = time.monotonic()
        try:
            missing = missing_requirements(peer)
            if missing:
                raise RunnerError(f"{peer}'s tests need {', '.join(missing)}: "
                                  f'pip install -e ".[conformance]" (or pip install {" ".join(missing)})')
            if peer == "flax":
                peer_dir = prepare_flax(version, cache, args.flax_src, log)
                entry["source"] = str(peer_dir)
            else:
                if not args.equinox_src:
                    entry["status"] = "skipped"
                    entry["reason"] = (f"no equinox checkout given (--equinox-src PATH or ${EQUINOX_SRC_ENV}); "
                                       "equinox's sdist ships no tests")
                    out(f"\n== equinox {version}: SKIPPED: {entry['reason']} ==")
                    continue
                peer_dir, where = prepare_equinox(version, cache, args.equinox_src, log)
                entry["source"] = where
            src_version = source_version(peer_dir)
            entry["tests_version"] = src_version
            if src_version != version:
                log(f"WARNING: {peer} tests are from version {src_version}, installed is {version}")
            files = select_files(peer, peer_dir)
            entry["files"] = files
            entry.setdefault("wall_s", {})["prepare"] = round(time.monotonic() - t0, 1)
            extra = ["-k", args.keyword] if args.keyword else []
            unpatched, wall_u, log_u = run_pytest(peer, peer_dir, files, patch=False, timeout=args.timeout,
                                                  extra=extra, log_dir=log_dir, log=log)
            entry["wall_s"]["unpatched"] = round(wall_u, 1)
            log(f"{peer} unpatched: {wall_u:.0f} s")
            patched, wall_p, log_p = run_pytest(peer, peer_dir, files, patch=True, timeout=args.timeout,
                                                extra=extra, log_dir=log_dir, log=log)
            entry["wall_s"]["patched"] = round(wall_p, 1)
            log(f"{peer} patched: {wall_p:.0f} s")
        except RunnerError as e:
            entry["status"] = "error"
            entry["reason"] = str(e)
            out(f"\n== {peer}: RUNNER ERROR ==\n{e}")
            failures.append(peer)
            continue
        entry["status"] = "ran"
        entry["patched"] = patched.patched
        entry["logs"] = {"unpatched": str(log_u), "patched": str(log_p)}
        if patched.unpatched_aliases:
            log(f"WARNING: {peer}: test modules hold the original entry point under other names, not patched: "
                f"{', '.join(patched.unpatched_aliases)}")
            entry["unpatched_aliases"] = patched.unpatched_aliases
        if patched.still_patched and not all(patched.still_patched.values()):
            log(f"WARNING: {peer}: the patch was undone during the run: {patched.still_patched}")
        tests = merge_runs(unpatched, patched)
        tot = totals(tests)
        entry["totals"] = tot
        entry["tests"] = tests
        entry["collect_errors"] = {"unpatched": unpatched.collect_errors, "patched": patched.collect_errors}
        entry["groups"] = [{"error": k, "count": len(v), "tests": v} for k, v in group_failures(tests)]
        if args.quiet:
            shown = {n: t for n, t in tests.items() if t["unpatched"]["outcome"] != t["patched"]["outcome"]}
        else:
            shown = tests
        print_peer_report(peer, version, shown, tot, out)
        if shown is not tests:
            out(f"  ({len(tests) - len(shown)} tests with the same outcome in both runs not listed)")
        for mode_name, run in (("unpatched", unpatched), ("patched", patched)):
            if mode_name == "unpatched" and run.collect_errors:
                out(f"  unpatched collection errors: {run.collect_errors}")
            if run.timed_out:
                out(f"  {peer} {mode_name}: STOPPED after {args.timeout:g} s (--timeout)")
        out(f"  wall time: prepare {entry['wall_s']['prepare']:.0f} s, unpatched {wall_u:.0f} s, patched {wall_p:.0f} s")

        patched_outcomes = {n: t["patched"]["outcome"] for n, t in tests.items()}
        recorded = expected.get(peer, {}).get(version)
        if args.record:
            passing = [n for n, o in patched_outcomes.items() if o == "pass"]
            expected = record_expected(expected, peer, version, passing)
            out(f"  recorded {len(passing)} passing tests for {peer} {version} in {EXPECTED.relative_to(REPO)}")
        elif recorded is None:
            msg = (f"  {peer} {version}: NOT CHECKED: {EXPECTED.relative_to(REPO)} has no list for this version "
                   f"(it has: {', '.join(expected.get(peer, {})) or 'none'}); run with --record to create one")
            out(msg)
            entry["check"] = {"status": "no recorded list"}
        else:
            if args.keyword:
                recorded = [n for n in recorded if n in patched_outcomes]
            regressions, improvements = check_expected(recorded, patched_outcomes)
            entry["check"] = {"regressions": regressions, "improvements": improvements}
            if regressions:
                word = "REGRESSION" if args.check else "regression"
                out(f"\n  {word}: {len(regressions)} test(s) on the recorded passing list for {peer} {version} "
                    "no longer pass with fastcall:")
                for n in regressions:
                    t = tests.get(n)
                    detail = f"{t['patched']['outcome']}: {t['patched']['error']}" if t else "not collected"
                    out(f"    {n}\n        {detail}")
                if args.check:
                    regressions_total += len(regressions)
            else:
                out(f"  {peer} {version}: all {len(recorded)} recorded passing tests still pass with fastcall")
            if improvements:
                out(f"  improvement: {len(improvements)} test(s) now pass with fastcall and are not on the recorded list "
                    f"(run python -m tests.conformance --record to add them):")
                for n in improvements:
                    out(f"    {n}")

    report["wall_s"] = round(time.monotonic() - started, 1)
    if args.record:
        EXPECTED.write_text(json.dumps(expected, indent=1) + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        log(f"JSON report written to {args.json}")

    out("\n== summary ==")
    for peer in peers:
        entry = report["peers"][peer]
        if entry.get("status") != "ran":
            out(f"  {peer} {entry.get('version') or ''}: {entry.get('status', '?').upper()}: "
                f"{entry.get('reason', '').splitlines()[0] if entry.get('reason') else ''}")
            continue
        tot = entry["totals"]
        pct = "n/a" if tot["percent"] is None else f"{tot['percent']:.1f}%"
        out(f"  {peer} {entry['version']}: {tot['pass_unpatched_and_patched']} of {tot['pass_unpatched']} tests passing "
            f"unpatched pass patched ({pct}); wall {entry['wall_s']['unpatched'] + entry['wall_s']['patched']:.0f} s")
    out(f"  total wall time {report['wall_s']:.0f} s")
    if failures:
        out(f"  FAILED to run: {', '.join(failures)}")
        return 2
    if regressions_total:
        out(f"  FAILED: {regressions_total} regression(s) against {EXPECTED.relative_to(REPO)} (listed above)")
        return 1
    return 0

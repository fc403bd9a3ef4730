"""pytest plugin loaded into a peer's own test run by the conformance runner.

Loaded with ``-p fastcall_conformance_plugin`` (the runner puts this directory on
PYTHONPATH; the module is deliberately standalone so that it never imports the
``tests`` package, which would clash with the peers' own ``tests`` packages).
Configured through environment variables set by the runner:

- ``FASTCALL_CONFORMANCE_PEER``: ``flax`` or ``equinox``.
- ``FASTCALL_CONFORMANCE_PATCH``: ``1`` to replace the peer's entry points by
  fastcall's, ``0`` to run the peer unpatched.
- ``FASTCALL_CONFORMANCE_RESULTS``: a file receiving one JSON object per line
  (written as the run goes, so a hang or a crash still leaves the results so far).

What it does:

1. ``pytest_configure`` (trylast: after the peer's conftest and every other
   plugin, e.g. jaxtyping's import hook, configured; before any test module is
   imported) replaces the public aliases the tests use:
   flax: ``flax.nnx.jit`` -> ``fastcall.jit`` and ``flax.nnx.compat.jit`` ->
   ``functools.partial(fastcall.jit, graph=True, graph_updates=True)`` (the
   compat alias is that partial of ``nnx.jit``);
   equinox: ``equinox.filter_jit`` -> ``fastcall.filter_jit`` if fastcall has one,
   else ``fastcall.jit``.
2. ``pytest_collection_modifyitems`` keeps only the tests whose own source
   (decorators included) names the entry point (``SELECT`` below) and deselects
   the rest. In patched runs it also checks that no collected test module holds the
   original entry point under another name (an alias the patch missed).
3. Reports every test's outcome and first error line.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
import time
from typing import Any

import pytest

# A test is selected when its own source names the entry point. \b excludes
# nnx.jit_partial; nnx.compat.jit is included.
SELECT = {
    "flax": re.compile(r"\bnnx\.(?:compat\.)?jit\b"),
    "equinox": re.compile(r"\b(?:eqx|equinox)\.filter_jit\b"),
}

_PEER = os.environ.get("FASTCALL_CONFORMANCE_PEER", "")
_PATCH = os.environ.get("FASTCALL_CONFORMANCE_PATCH", "0") == "1"
_RESULTS = os.environ.get("FASTCALL_CONFORMANCE_RESULTS")

_originals: dict[str, Any] = {}
_outcomes: dict[str, dict[str, Any]] = {}


def _emit(record: dict[str, Any]) -> None:
    if not _RESULTS:
        return
    with open(_RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def first_line(text: str, limit: int = 300) -> str:
    for line in str(text).splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def error_line(report: Any) -> str:
    """The first line of the exception (type: message) or the skip reason."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # skip: (path, lineno, reason)
        reason = str(longrepr[2])
        return first_line(reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason)
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return first_line(crash.message)
    text = str(longrepr)
    for line in text.splitlines():
        if line.startswith("E "):
            return first_line(line[1:])
    lines = [line for line in text.splitlines() if line.strip()]
    return first_line(lines[-1]) if lines else ""


def _apply_patch() -> dict[str, str]:
    import fastcall

    patched: dict[str, str] = {}
    if _PEER == "flax":
        import flax.nnx

        _originals["flax.nnx.jit"] = flax.nnx.jit
        flax.nnx.jit = fastcall.jit
        patched["flax.nnx.jit"] = "fastcall.jit"
        try:  # flax.nnx.compat arrived in flax 0.12.7
            import flax.nnx.compat
        except ImportError:
            pass
        else:
            _originals["flax.nnx.compat.jit"] = flax.nnx.compat.jit
            flax.nnx.compat.jit = functools.partial(fastcall.jit, graph=True, graph_updates=True)
            patched["flax.nnx.compat.jit"] = "functools.partial(fastcall.jit, graph=True, graph_updates=True)"
    elif _PEER == "equinox":
        import equinox

        name = "filter_jit" if hasattr(fastcall, "filter_jit") else "jit"
        _originals["equinox.filter_jit"] = equinox.filter_jit
        equinox.filter_jit = getattr(fastcall, name)
        patched["equinox.filter_jit"] = f"fastcall.{name}"
    else:
        raise pytest.UsageError(f"FASTCALL_CONFORMANCE_PEER={_PEER!r}: expected flax or equinox")
    return patched


def _original_ids() -> set[int]:
    ids = set()
    for obj in _originals.values():
        ids.add(id(obj))
        func = getattr(obj, "func", None)  # nnx.compat.jit is a functools.partial
        if func is not None:
            ids.add(id(func))
    return ids


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    info: dict[str, Any] = {"event": "configure", "peer": _PEER, "patch": _PATCH, "pid": os.getpid()}
    if _PATCH:
        info["patched"] = _apply_patch()
        import fastcall

        info["fastcall"] = getattr(fastcall, "__version__", "?")
    _emit(info)


def _source(item: pytest.Item) -> str:
    fn = getattr(item, "function", None) or getattr(item, "obj", None)
    if fn is None:
        return ""
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    pattern = SELECT.get(_PEER)
    if pattern is None:
        return
    selected, deselected = [], []
    for item in items:
        (selected if pattern.search(_source(item)) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    missed = []
    if _PATCH:
        # An alias bound to the original entry point (e.g. imported from the defining
        # module) would silently run the peer's own jit in a "patched" run.
        originals = _original_ids()
        modules = {id(m): m for m in (getattr(i, "module", None) for i in selected) if m is not None}
        for module in modules.values():
            for name, value in vars(module).items():
                if id(value) in originals:
                    missed.append(f"{module.__name__}.{name}")
    _emit(
        {
            "event": "collected",
            "selected": [i.nodeid for i in selected],
            "deselected": len(deselected),
            "unpatched_aliases": sorted(missed),
        }
    )


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid, "error": error_line(report)})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _outcomes[nodeid] = {"outcome": None, "error": "", "t0": time.monotonic()}
    _emit({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    state = _outcomes.setdefault(report.nodeid, {"outcome": None, "error": "", "t0": time.monotonic()})
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfail" if report.skipped else "xpass"
        else:
            outcome = {"passed": "pass", "failed": "fail", "skipped": "skip"}[report.outcome]
        state["outcome"], state["error"] = outcome, error_line(report) if outcome != "pass" else ""
    elif report.failed:  # setup or teardown error: overrides a passed call
        if state["outcome"] not in ("fail", "error"):
            state["outcome"], state["error"] = "error", f"[{report.when}] {error_line(report)}"
    elif report.skipped and report.when == "setup":
        if hasattr(report, "wasxfail"):
            state["outcome"], state["error"] = "xfail", error_line(report)
        else:
            state["outcome"], state["error"] = "skip", error_line(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    state = _outcomes.get(nodeid, {"outcome": None, "error": "", "t0": time.monotonic()})
    _emit(
        {
            "event": "result",
            "nodeid": nodeid,
            "outcome": state["outcome"] or "error",
            "error": state["error"],
            "seconds": round(time.monotonic() - state["t0"], 3),
        }
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    still = {}
    if _PATCH:
        # Did anything restore the peer's entry point during the run?
        if _PEER == "flax":
            import flax.nnx

            still["flax.nnx.jit"] = flax.nnx.jit is not _originals.get("flax.nnx.jit")
        elif _PEER == "equinox":
            import equinox

            still["equinox.filter_jit"] = equinox.filter_jit is not _originals.get("equinox.filter_jit")
    _emit({"event": "finish", "exitstatus": int(exitstatus), "still_patched": still})
    sys.stdout.flush()

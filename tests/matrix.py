"""Run the test suite against pinned dependency stacks, oldest to newest supported.

    python tests/matrix.py                   # every point in POINTS
    python tests/matrix.py --point oldest    # one point (repeatable)
    python tests/matrix.py --list            # name the points and their pins

For each point: a fresh virtual environment made with that point's CPython (found
through pyenv, else on PATH), the checkout installed *non-editable* (a copy of its
files is built, so the C extension is compiled for that interpreter) with the pinned
versions, then pytest run on a copy of tests/ (with bench/, examples/, README.md,
.ci/ and pyproject.toml, which the tests read) in a temporary directory outside the
checkout, so that the suite imports the *installed* fastcall. Both the script and the
suite itself (tests/test_versions.py) check that fastcall and its C extension
fastcall._accel come from the venv's site-packages. Prints one row per point and
exits non-zero if any point fails. Only the standard library is used; needs network
access to PyPI (or a mirror pip is configured for).

README.md's "Supported versions" table lists these points (tests/test_versions.py
checks that it matches POINTS), and pyproject.toml's lower bounds are the oldest
point's versions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The points: CPython minor version, then exact versions. The one table of the matrix.
# - oldest: the lowest of everything that installs together and passes (pyproject's lower
#   bounds). flax 0.12.5 pins optax 0.2.6.
# - middle: the oldest flax/equinox/jaxtyping on the newest jax they import with (flax
#   0.12.5-0.12.6 use jax.core APIs that jax 0.10 deprecates and jax 0.11 removes), on
#   Python 3.12: exercises pyproject's named ignores of those deprecation warnings.
# - newest: what `pip install fastcall[test]` resolved to on Python 3.13 when last updated.
PACKAGES = ("jax", "jaxlib", "flax", "equinox", "jaxtyping", "optax")
POINTS: dict[str, dict[str, str]] = {
    "oldest": dict(python="3.11", jax="0.8.1", jaxlib="0.8.1", flax="0.12.5", equinox="0.13.1",
                   jaxtyping="0.2.33", optax="0.2.6"),
    "middle": dict(python="3.12", jax="0.10.2", jaxlib="0.10.2", flax="0.12.5", equinox="0.13.1",
                   jaxtyping="0.2.33", optax="0.2.6"),
    "newest": dict(python="3.13", jax="0.12.0.1", jaxlib="0.12.0.1", flax="0.12.12", equinox="0.13.8",
                   jaxtyping="0.3.11", optax="0.2.8"),
}

# Copied next to tests/ for the run: the suite reads them (bench/ and examples/ are
# imported or run from the checkout root; README.md (and the pages it links), docs/ and
# .ci/run by tests/test_docs.py and tests/test_doc_examples.py;
# pyproject.toml holds the pytest settings and the mypy configuration; setup.py names the
# modules Cython compiles, which tests/conftest.py reads).
# Never fastcall/: pytest puts the run directory on sys.path, where it would shadow the
# installed package.
SUITE_FILES = (
    "tests", "bench", "examples", "README.md", "CHANGELOG.md", "docs", "mkdocs.yml", ".ci", "pyproject.toml", "setup.py",
)
# Left out when the checkout is not a git work tree (else git decides what is source).
SKIP_IN_SOURCE = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
                  ".hypothesis", ".mypy_cache"}

TEST_TIMEOUT_S = 45 * 60
# The suite's workers, as README's test command runs it (pytest-xdist: one per core, at most 4).
PYTEST_WORKERS = ("-n", "auto", "--maxprocesses", "4")
INSTALL_TIMEOUT_S = 20 * 60


class PointFailed(Exception):
    pass


@dataclasses.dataclass
class Result:
    name: str
    python: str = "?"
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    accel: str = "?"
    tests: str = "not run"
    install_s: float = 0.0
    test_s: float = 0.0
    total_s: float = 0.0
    ok: bool = False
    error: str = ""
    build_warnings: list[str] = dataclasses.field(default_factory=list)


def find_python(minor: str) -> pathlib.Path:
    """The interpreter for CPython `minor` ("3.11"): pyenv's highest 3.11.N, else python3.11 on PATH."""
    pyenv = shutil.which("pyenv")
    root = os.environ.get("PYENV_ROOT")
    if not root and pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
    exe = None
    versions = pathlib.Path(root) / "versions" if root else None
    if versions is not None and versions.is_dir():
        pattern = re.compile(rf"{re.escape(minor)}\.(\d+)")
        patches = sorted((int(m.group(1)), p.name) for p in versions.iterdir() if (m := pattern.fullmatch(p.name)))
        if patches:
            version = patches[-1][1]
            exe = versions / version / "bin" / f"python{minor}"
            if pyenv:  # ask pyenv itself, as a user would
                out = subprocess.run([pyenv, "which", f"python{minor}"], capture_output=True, text=True,
                                     env=dict(os.environ, PYENV_VERSION=version))
                if out.returncode == 0 and out.stdout.strip():
                    exe = pathlib.Path(out.stdout.strip())
    if exe is None or not exe.exists():
        on_path = shutil.which(f"python{minor}")
        exe = pathlib.Path(on_path) if on_path else None
    if exe is None:
        raise PointFailed(f"no CPython {minor} found (pyenv root: {root or 'none'}): install it, e.g. "
                          f"`pyenv install {minor}`, or put python{minor} on PATH")
    got = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True).stdout.strip()
    if got != minor:
        raise PointFailed(f"{exe} is Python {got or '?'}, not {minor}")
    return exe


def run(cmd: list[str], *, log: pathlib.Path | None = None, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return proc


def checkout_files() -> list[pathlib.Path]:
    """Files of the checkout to build from: what git tracks plus untracked files it does not ignore."""
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout:
        names = [n for n in proc.stdout.split("\0") if n]
        return [pathlib.Path(n) for n in names if (ROOT / n).is_file()]
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not set(rel.parts) & SKIP_IN_SOURCE and not rel.parts[0].endswith(".egg-info"):
            files.append(rel)
    return files


def copy_files(files: list[pathlib.Path], dest: pathlib.Path) -> None:
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)


def run_point(name: str, work: pathlib.Path, stream: bool) -> Result:
    spec = POINTS[name]
    res = Result(name)
    start = time.perf_counter()
    log = work / "install.log"
    try:
        python = find_python(spec["python"])
        venv = work / "venv"
        proc = run([str(python), "-m", "venv", str(venv)], log=log, timeout=300)
        if proc.returncode:
            raise PointFailed(f"venv creation failed:\n{proc.stderr[-2000:]}")
        vpy = str(venv / "bin" / "python")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", VIRTUAL_ENV=str(venv),
                   PATH=str(venv / "bin") + os.pathsep + env.get("PATH", ""))

        # Install a copy of the checkout (not the checkout itself: building in place would
        # leave build/ and *.egg-info there, and an editable install would test the checkout).
        src = work / "src"
        copy_files(checkout_files(), src)
        pins = [f"{pkg}=={spec[pkg]}" for pkg in PACKAGES if pkg in spec]
        run([vpy, "-m", "pip", "install", "-q", "--upgrade", "pip"], log=log, timeout=600, env=env)
        proc = run([vpy, "-m", "pip", "install", "-v", f"{src}[test]", *pins], log=log, timeout=INSTALL_TIMEOUT_S, env=env)
        output = proc.stdout + proc.stderr
        # C compiler warnings (fastcall/_accel.c) and setuptools/pip deprecation warnings, if any
        res.build_warnings = sorted({line.strip() for line in output.splitlines()
                                     if re.search(r"\.[ch]:\d+:\d+: warning:|DeprecationWarning|DEPRECATION:", line)})
        if proc.returncode:
            errors = [line for line in output.splitlines() if "ERROR" in line or "error:" in line]
            raise PointFailed("pip install failed:\n" + "\n".join(errors[-20:] or output.splitlines()[-30:]))
        # The C extension must build cleanly on every supported Python (no deprecated API).
        accel_warnings = [line for line in res.build_warnings if "_accel.c" in line]
        if accel_warnings:
            raise PointFailed("fastcall/_accel.c built with warnings:\n" + "\n".join(accel_warnings))

        # What was installed, and where fastcall and its C extension come from.
        probe = (
            "import importlib.metadata as md, json, sys, sysconfig, fastcall\n"
            "try:\n    import fastcall._accel as a; accel = a.__file__\nexcept ImportError as e:\n    accel = 'ImportError: %s' % e\n"
            f"pkgs = {list(PACKAGES)!r}\n"
            "print(json.dumps(dict(python=sys.version.split()[0], fastcall=fastcall.__file__, accel=accel,"
            " site=sysconfig.get_paths()['purelib'], platsite=sysconfig.get_paths()['platlib'],"
            " versions={p: md.version(p) for p in pkgs})))\n"
        )
        proc = run([vpy, "-c", probe], log=log, timeout=300, env=env, cwd=work)
        if proc.returncode:
            raise PointFailed(f"import fastcall failed in the venv:\n{proc.stderr[-3000:]}")
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        res.python, res.versions = info["python"], info["versions"]
        site = pathlib.Path(info["site"]).resolve()
        platsite = pathlib.Path(info["platsite"]).resolve()
        if not pathlib.Path(info["fastcall"]).resolve().is_relative_to(site):
            raise PointFailed(f"fastcall imported from {info['fastcall']}, not from the venv's {site}")
        accel = pathlib.Path(info["accel"])
        if not (accel.exists() and accel.resolve().is_relative_to(platsite)):
            res.accel = "missing"
            raise PointFailed(f"the C extension fastcall._accel was not built or does not import: {info['accel']}")
        res.accel = "built"
        wrong = {p: v for p, v in res.versions.items() if p in spec and v != spec[p]}
        if wrong:
            raise PointFailed(f"installed versions differ from the pins: {wrong}")
        check = run([vpy, "-m", "pip", "check"], log=log, timeout=300, env=env)
        if check.returncode:
            raise PointFailed(f"pip check: {check.stdout.strip()}")
        res.install_s = time.perf_counter() - start

        # The suite, from a directory outside the checkout that holds no fastcall/.
        suite = work / "suite"
        copy_files([f for f in checkout_files() if f.parts[0] in SUITE_FILES], suite)
        assert not (suite / "fastcall").exists()
        env["FASTCALL_MATRIX_SITE"] = str(site)  # tests/test_versions.py checks the import location
        t0 = time.perf_counter()
        cmd = [vpy, "-m", "pytest", "-p", "no:cacheprovider", *PYTEST_WORKERS]
        print(f"[{name}] $ {' '.join(cmd)}   (in {suite})", flush=True)
        lines: list[str] = []
        with subprocess.Popen(cmd, cwd=suite, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as p, (work / "pytest.log").open("w") as logfile:
            assert p.stdout is not None
            deadline = time.monotonic() + TEST_TIMEOUT_S
            for line in p.stdout:
                lines.append(line)
                logfile.write(line)
                if stream:
                    print(f"[{name}] {line}", end="", flush=True)
                if time.monotonic() > deadline:
                    p.kill()
                    raise PointFailed(f"pytest ran over {TEST_TIMEOUT_S} s")
            code = p.wait()
        res.test_s = time.perf_counter() - t0
        summary = [ln.strip("= \n") for ln in lines if re.match(r"^=+ .*\b(passed|failed|error|errors|no tests ran)\b", ln)]
        res.tests = re.sub(r" in [\d.]+s.*$", "", summary[-1]) if summary else f"pytest exit code {code}"
        if code:
            failing = [ln.rstrip() for ln in lines if ln.startswith(("FAILED", "ERROR"))]
            tail = "" if stream else "".join(lines[-60:])
            raise PointFailed("pytest failed:\n" + "\n".join(failing) + ("\n" + tail if tail else ""))
        res.ok = True
    except PointFailed as e:
        res.error = str(e)
    except subprocess.TimeoutExpired as e:
        res.error = f"timed out: {' '.join(map(str, e.cmd))[:200]}"
    finally:
        res.total_s = time.perf_counter() - start
    return res


def table(results: list[Result]) -> str:
    head = ["point", "result", "python", *PACKAGES, "_accel", "tests", "install s", "tests s", "total s"]
    rows = [head]
    for r in results:
        rows.append([r.name, "PASS" if r.ok else "FAIL", r.python, *(r.versions.get(p, "?") for p in PACKAGES),
                     r.accel, r.tests, f"{r.install_s:.0f}", f"{r.test_s:.0f}", f"{r.total_s:.0f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, rows[1:])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", action="append", choices=sorted(POINTS), metavar="NAME",
                        help="run this point (repeatable; default: all). --list names them.")
    parser.add_argument("--list", action="store_true", help="list the points and their pins, then exit")
    parser.add_argument("--keep", action="store_true", help="keep each point's temporary directory (venv, logs)")
    parser.add_argument("--quiet", action="store_true", help="do not stream pytest's output")
    args = parser.parse_args(argv)
    if args.list:
        for name, spec in POINTS.items():
            print(f"{name}: Python {spec['python']}, " + ", ".join(f"{p}=={spec[p]}" for p in PACKAGES if p in spec))
        return 0
    names = list(dict.fromkeys(args.point or POINTS))
    results = []
    for name in names:
        work = pathlib.Path(tempfile.mkdtemp(prefix=f"fastcall-matrix-{name}-"))
        assert not work.resolve().is_relative_to(ROOT), "the run directory must be outside the checkout"
        print(f"[{name}] {POINTS[name]} in {work}", flush=True)
        res = run_point(name, work, stream=not args.quiet)
        results.append(res)
        for line in res.build_warnings:
            print(f"[{name}] build warning: {line}")
        print(f"[{name}] {'PASS' if res.ok else 'FAIL'} in {res.total_s:.0f} s ({res.tests})", flush=True)
        if res.error:
            print(f"[{name}] {res.error}\n[{name}] install log: {work / 'install.log'}", flush=True)
        if args.keep:
            print(f"[{name}] kept {work}", flush=True)
        elif res.ok:
            shutil.rmtree(work, ignore_errors=True)
        else:  # keep the logs and the suite copy, not the (large) venv
            shutil.rmtree(work / "venv", ignore_errors=True)
            print(f"[{name}] kept {work} (without the venv; --keep keeps it)", flush=True)
    print()
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

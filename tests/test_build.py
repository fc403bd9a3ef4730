"""setup.py: the modules Cython compiles are built all or none (`AllOrNone`), since they call
one another as C; the C wrapper is kept either way. The build is driven here with a stand-in
for the compiler, so that no C is compiled."""

from __future__ import annotations

import pathlib
import sys
import types

import pytest
from setuptools import Distribution, Extension
from setuptools.command import build_ext as setuptools_build_ext
from setuptools.errors import CompileError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_namespace(monkeypatch) -> dict:
    """setup.py's names, run with `setup` and Cython's `cythonize` stood in for (nothing is
    built; Cython is a build requirement, not installed with the tests)."""
    cython, build = types.ModuleType("Cython"), types.ModuleType("Cython.Build")
    build.cythonize = lambda exts, **_: exts  # type: ignore[attr-defined]  # (the .py source, as is)
    cython.Build = build  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "Cython", cython)
    monkeypatch.setitem(sys.modules, "Cython.Build", build)
    namespace: dict = {"__name__": "setup_under_test"}
    source = (ROOT / "setup.py").read_text()
    exec(compile(source.replace("\nsetup(", "\n_setup_call = dict("), "setup.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("failing", [None, "fastcall._tree_reads", "fastcall._accel"])
def test_the_compiled_sources_are_built_all_or_none(tmp_path, monkeypatch, failing):
    namespace = _setup_namespace(monkeypatch)
    command_class = namespace["_setup_call"]["cmdclass"]["build_ext"]
    extensions = namespace["_setup_call"]["ext_modules"]
    names = [ext.name for ext in extensions]
    assert names[0] == "fastcall._accel" and set(names[1:]) == {f"fastcall.{n}" for n in namespace["COMPILED_SOURCES"]}

    def build_one(self, ext: Extension) -> None:  # (the compiler, stood in for)
        if ext.name == failing:
            raise CompileError(f"no compiler for {ext.name}")
        path = pathlib.Path(self.build_lib, self.get_ext_filename(ext.name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("built")

    monkeypatch.setattr(setuptools_build_ext.build_ext, "build_extension", build_one)
    monkeypatch.chdir(tmp_path)
    command = command_class(Distribution({"ext_modules": extensions}))
    command.build_lib = str(tmp_path / "build")
    command.extensions = extensions
    command.compiler = None
    command.parallel = False
    command.build_extensions()
    built = {ext.name for ext in extensions if pathlib.Path(command.build_lib, command.get_ext_filename(ext.name)).exists()}
    if failing is None:
        assert built == set(names)
    elif failing == "fastcall._accel":  # (the C wrapper calls no compiled module as C)
        assert built == set(names[1:])
    else:
        assert built == {"fastcall._accel"}

"""fastcall's compiled modules, each optional: where one cannot be built (no C compiler, or
no Cython for the second), the package runs as Python and `import fastcall` says so once
(`fastcall/_native.py`).

* `fastcall._accel`: the C wrapper (`fastcall/_accel.c`).
* `COMPILED_SOURCES`: Python modules written in Cython's pure-Python mode, compiled by Cython,
  all or none (`AllOrNone`); the same file is the module where it is not compiled.

Everything else about the package is in pyproject.toml."""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# (as module names under fastcall; `fastcall/_native.py` names the same list, to say which
# were not compiled)
COMPILED_SOURCES = ["_trace", "_guard", "_memo", "_nnx_gate", "_tree_reads", "_fast_route", "_entry_reads", "_structure_route", "_rebuild", "_nnx._leaf_writes"]

extensions = [Extension("fastcall._accel", ["fastcall/_accel.c"], optional=True)]
for name in COMPILED_SOURCES:
    source = "fastcall/" + name.replace(".", "/") + ".py"
    try:
        from Cython.Build import cythonize

        (ext,) = cythonize([Extension(f"fastcall.{name}", [source])], quiet=True)
    except Exception as err:  # (no Cython, or it failed on this file: the module runs as Python)
        print(f"fastcall: {source} not compiled: {err!r}")
    else:
        ext.optional = True
        extensions.append(ext)



class AllOrNone(build_ext):
    """Builds the modules of COMPILED_SOURCES all or none. They call one another as C (`.pxd`
    files), so one compiled beside a neighbour that was not would fail at import: where any
    fails to build, those built are removed, and every one runs as Python (which `import
    fastcall` says once). `fastcall._accel` calls none of them as C: it is kept either way."""

    def build_extensions(self) -> None:
        self.failed: list[str] = []
        super().build_extensions()
        cython_built = [ext for ext in self.extensions if ext.name != "fastcall._accel"]
        if not any(ext.name in self.failed for ext in cython_built):
            return
        print(f"fastcall: {', '.join(self.failed)} not built: every module of COMPILED_SOURCES runs as Python")
        for ext in cython_built:
            built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
            in_place = self.get_ext_filename(ext.name)  # (an earlier in-place build's, if any)
            for path in (built, in_place):
                if os.path.exists(path):
                    os.remove(path)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception:
            self.failed.append(ext.name)
            raise


setup(ext_modules=extensions, cmdclass={"build_ext": AllOrNone})

"""fastcall's compiled modules, each optional: where one cannot be built (no C compiler, or
no Cython for the second), the package runs as Python and `import fastcall` says so once
(`fastcall/_native.py`).

* `fastcall._accel`: the C wrapper (`fastcall/_accel.c`).
* `COMPILED_SOURCES`: Python modules written in Cython's pure-Python mode, compiled by Cython;
  the same file is the module where it is not compiled.

Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

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

setup(ext_modules=extensions)

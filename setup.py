"""fastcall's compiled modules, each optional: where one cannot be built (no C compiler, or
no Cython for the second), the package runs as Python and `import fastcall` says so once
(`fastcall/_native.py`).

* `fastcall._accel`: the C wrapper (`fastcall/_accel.c`).
* `fastcall._rebuild`: `fastcall/_rebuild.py`, Python written in Cython's pure-Python mode,
  compiled by Cython; the same file is the module where it is not compiled.

Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

extensions = [Extension("fastcall._accel", ["fastcall/_accel.c"], optional=True)]
try:
    from Cython.Build import cythonize
except ImportError:  # (a build without its build requirements: the module runs as Python)
    pass
else:
    for ext in cythonize([Extension("fastcall._rebuild", ["fastcall/_rebuild.py"])], quiet=True):
        ext.optional = True
        extensions.append(ext)

setup(ext_modules=extensions)

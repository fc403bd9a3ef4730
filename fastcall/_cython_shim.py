"""What `import cython` gives a module that Cython did not compile, where Cython is not
installed (it is a build requirement only): the names fastcall's pure-Python-mode modules
use, each doing nothing. Compiled, those names are Cython's own and this module is unused."""

from __future__ import annotations

from typing import Any, Callable

compiled = False

# C types, named in annotations (evaluated only at a function's definition)
Py_ssize_t = int
bint = bool
ulonglong = int
int = int  # (C int)
p_void = object
void = None
NULL = None


def pointer(_type: Any) -> Any:
    return object


def _same(f: Callable[..., Any]) -> Callable[..., Any]:
    return f


cclass = final = ccall = cfunc = inline = _same


def exceptval(*_args: Any, **_kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return _same


def declare(_type: Any, value: Any = None, visibility: str = "private") -> Any:
    return value


def cast(_type: Any, value: Any) -> Any:
    return value

"""fastcall's compiled modules, and whether calls use them: decided here.

`BUILT` is the C extension (`fastcall/_accel.c`, the C wrapper), or None where it was not
built. `ACCEL` is the module where wrappers are made with it: `BUILT`, unless
`FASTCALL_DISABLE_ACCEL=1` (read once, at import: every wrapper is then the Python one, which
calls the same routes, for debugging) or a test sets it to None to run that wrapper. Read when
a wrapper is made, not per call. `COMPILED_SOURCES` are
compiled by Cython from their own source where a C compiler was found at install, and run as
that source where not, whatever `ACCEL` says: one source, no twin to choose. Where something
was not compiled, the import says so once, as a log record on the "fastcall" logger.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import Any

DISABLED = os.environ.get("FASTCALL_DISABLE_ACCEL", "") in ("1", "true", "yes")

# (as setup.py lists them; found, not imported: the NNX plugin's loads with flax)
COMPILED_SOURCES = (
    "fastcall._trace", "fastcall._guard", "fastcall._memo", "fastcall._nnx_gate", "fastcall._tree_reads", "fastcall._fast_route", "fastcall._entry_reads", "fastcall._structure_route", "fastcall._rebuild", "fastcall._nnx._leaf_writes",
)


def runs_as_python(name: str) -> bool:
    """Whether the module `name` of COMPILED_SOURCES is (or will be) loaded from its .py file."""
    spec = importlib.util.find_spec(name)
    return spec is None or (spec.origin or "").endswith(".py")

BUILT: Any
_missing: list[str] = []
try:
    BUILT = importlib.import_module("fastcall._accel")
except ImportError as err:  # not built: pure Python, same behaviour
    BUILT = None
    _missing.append(f"fastcall._accel ({err})")
_missing += [f"{name} (runs as Python)" for name in COMPILED_SOURCES if runs_as_python(name)]
if _missing and not DISABLED:
    # Said once per process, where it is seen: pip hides the build's own output, in which
    # setuptools notes the failed compile. A log record, not a warning (programs run with
    # warnings as errors would stop here). Setting FASTCALL_DISABLE_ACCEL=1 says the
    # Python path is meant, and silences it.
    logging.getLogger("fastcall").warning(
        "fastcall: its compiled path was not built, or does not load: %s. Calls run the Python "
        "code instead: the same results, a few microseconds more per call. Reinstall fastcall where a "
        "C compiler is found (the CC variable names it), or set FASTCALL_DISABLE_ACCEL=1 to run the "
        "Python path on purpose and silence this.",
        "; ".join(_missing),
    )

ACCEL: Any = None if DISABLED else BUILT

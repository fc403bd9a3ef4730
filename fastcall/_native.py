"""The optional C extension (`fastcall/_accel.c`), and whether calls use it: decided here.

`BUILT` is the extension module, or None where it was not built (no C compiler: said once,
on import, as a log record on the "fastcall" logger). `ACCEL` is
the module where fastcall serves calls with it (the C wrapper, the C output builder):
`BUILT`, unless `FASTCALL_DISABLE_ACCEL=1` (read once, at import: every call is then
served by the pure-Python twin, for debugging) or a test sets it to None to run that twin.
Read when a wrapper or an output builder is made, not per call.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

DISABLED = os.environ.get("FASTCALL_DISABLE_ACCEL", "") in ("1", "true", "yes")

BUILT: Any
try:
    BUILT = importlib.import_module("fastcall._accel")
except ImportError as err:  # not built: pure Python, same behaviour
    BUILT = None
    if not DISABLED:
        # Said once per process, where it is seen: pip hides the build's own output, in which
        # setuptools notes the failed compile. A log record, not a warning (programs run with
        # warnings as errors would stop here). Setting FASTCALL_DISABLE_ACCEL=1 says the
        # Python path is meant, and silences it.
        logging.getLogger("fastcall").warning(
            "fastcall: its compiled path (fastcall._accel) was not built, or does not load (%s). Calls run "
            "the Python hit path instead: the same results, a few microseconds more per call. Reinstall "
            "fastcall where a C compiler is found (the CC variable names it), or set FASTCALL_DISABLE_ACCEL=1 "
            "to run the Python path on purpose and silence this.",
            err,
        )

ACCEL: Any = None if DISABLED else BUILT

"""The optional C extension (`fastcall/_accel.c`), and whether calls use it: decided here.

`BUILT` is the extension module, or None where it was not built (no C compiler). `ACCEL` is
the module where fastcall serves calls with it (the C wrapper, the C output builder):
`BUILT`, unless `FASTCALL_DISABLE_ACCEL=1` (read once, at import: every call is then
served by the pure-Python twin, for debugging) or a test sets it to None to run that twin.
Read when a wrapper or an output builder is made, not per call.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

BUILT: Any
try:
    BUILT = importlib.import_module("fastcall._accel")
except ImportError:  # pragma: no cover - not built: pure Python, same behaviour
    BUILT = None

ACCEL: Any = BUILT if os.environ.get("FASTCALL_DISABLE_ACCEL", "") not in ("1", "true", "yes") else None

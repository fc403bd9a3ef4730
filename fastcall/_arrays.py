"""The array types: which leaves are arrays, and which pass to jax.jit as they are."""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# jax's concrete array class, named directly: making an array here to learn it would start
# jax's backend at import, fixing the device count before a program sets XLA_FLAGS.
ArrayImpl: Any
try:
    from jax._src.array import ArrayImpl
except ImportError:  # pragma: no cover - another jax layout
    ArrayImpl = type(jnp.zeros(()))
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_KEY_ARRAY: tuple[type, ...] = ()
for _module in ("jax._src.random.prng", "jax._src.prng"):  # (the typed PRNG key array)
    try:
        _KEY_ARRAY = (importlib.import_module(_module).PRNGKeyArray,)
        break
    except (ImportError, AttributeError):  # pragma: no cover - another jax layout
        pass
_NUMPY_SCALARS = (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128,
)
# Arrays (and NumPy scalars) the fast and structure paths pass to jax.jit as they are,
# checked by exact type: jax's own call path takes each, both scalar rules trace each, none
# is a tracer, and none is cached (a NumPy array changed in place is read afresh by jax on
# every call, as jax.jit reads it).
PLAIN_ARRAY_TYPES = frozenset((ArrayImpl, np.ndarray, *_KEY_ARRAY, *_NUMPY_SCALARS))


def is_array(x: Any) -> bool:
    """The `eqx.filter_jit` rule: JAX and NumPy arrays (and NumPy scalars) are traced."""
    return isinstance(x, ARRAY_TYPES)

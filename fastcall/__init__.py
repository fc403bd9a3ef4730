"""fastcall: call JAX models (Equinox, Flax NNX, plain pytrees) at close to `jax.jit`'s floor."""

from ._aot import Compiled as Compiled
from ._aot import Lowered as Lowered
from ._aot import Traced as Traced
from ._api import clear_caches as clear_caches
from ._api import filter_jit as filter_jit
from ._api import jit as jit
from ._api import partial as partial
from ._errors import FastcallError as FastcallError
from ._explain import ArgumentReport as ArgumentReport
from ._explain import CallReport as CallReport
from ._errors import UnverifiedFlaxWarning as UnverifiedFlaxWarning
from ._stats import Change as Change
from ._stats import JitStats as JitStats
from ._stats import Recompile as Recompile
from ._stats import RecompileWarning as RecompileWarning
from ._trace import currently_jitting as currently_jitting

__version__ = "0.1.0"

"""NNX support is loaded only when NNX is used, and its structure hooks fail safe."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_equinox_users_never_import_flax():
    out = run_python(
        """
        import sys, jax, jax.numpy as jnp, equinox as eqx
        import fastcall
        m = eqx.nn.MLP(2, 2, 4, 2, key=jax.random.PRNGKey(0))
        f = fastcall.jit(lambda m, x: m(x))
        f(m, jnp.ones(2)); f(m, jnp.ones(2))
        f.lower(m, jnp.ones(2)).compile()(m, jnp.ones(2))
        print(sorted(name for name in sys.modules if name == "flax" or name.startswith("flax.")))
        """
    )
    assert out.strip() == "[]"


def test_importing_fastcall_and_its_nnx_support_starts_no_jax_backend():
    """A program may set XLA_FLAGS (e.g. a simulated device count, as flax's toy example
    10 does) after its imports: importing fastcall, and loading its NNX support, must not
    start jax's backend, which fixes the device count."""
    out = run_python(
        """
        import os
        import jax
        from flax import nnx
        import fastcall
        from fastcall import _nnx_gate
        _nnx_gate.adapter()  # (the NNX support, loaded)
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
        print(len(jax.devices()))
        """
    )
    assert out.strip() == "4"


@pytest.mark.parametrize("flax_first", [True, False], ids=["flax-imported-first", "fastcall-imported-first"])
def test_nnx_objects_created_before_and_after_support_loads(flax_first):
    """Hooks patch NNX's classes when the adapter loads: objects created earlier are
    watched too, and structure changes on either are seen."""
    imports = "from flax import nnx\nimport fastcall" if flax_first else "import fastcall\nfrom flax import nnx"
    out = run_python(
        imports
        + """
import jax.numpy as jnp
early = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
f = fastcall.jit(lambda m, x: m(x))
x = jnp.ones(2)
late = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
ok = []
for m in (early, late):
    for _ in range(2):
        ok.append(bool(jnp.allclose(f(m, x), m(x))))
    m.kernel = nnx.Param(m.kernel[...] * 3)  # a replaced Variable: structure change
    ok.append(bool(jnp.allclose(f(m, x), m(x))))
print(all(ok), len(ok))
"""
    )
    assert out.split() == ["True", "6"]


def test_problems_reports_missing_targets_and_unverified_versions():
    from fastcall._nnx import _hooks

    low, high = _hooks.VERIFIED_FLAX
    assert _hooks.problems(".".join(map(str, low))) == []
    assert _hooks.problems(".".join(map(str, high))) == []
    assert any("outside the versions" in p for p in _hooks.problems("0.99.0"))
    bogus = _hooks.HookTarget(_hooks.Variable, "no_such_method", "a test")
    found = _hooks.problems(".".join(map(str, low)), (*_hooks.HOOK_TARGETS, bogus))
    assert found == ["Variable.no_such_method is missing (a test)"]


def test_a_missing_hook_target_warns_once_and_never_goes_stale():
    """Simulate a flax release without one hooked method: fastcall warns once, and
    every NNX call re-reads the structure, so even a change no hook sees is seen."""
    out = run_python(
        """
        import warnings
        import jax.numpy as jnp
        from flax import nnx
        from flax.nnx import variablelib
        del variablelib.Variable.copy_from  # a hook target this 'release' lacks
        import fastcall
        m = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        x = jnp.ones(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            f = fastcall.jit(lambda m, x: m(x))  # (NNX support loads here or at the call)
            f(m, x)
            f(m, x)
            g = fastcall.jit(lambda m, x: m(x) * 2)
            g(m, x)
        kinds = [type(w.message).__name__ for w in caught]
        # A change that bypasses every hook: only a re-read can see it.
        object.__setattr__(m, "kernel", nnx.Param(m.kernel[...] * 5))
        y = f(m, x)
        print(kinds, bool(jnp.allclose(y, m(x))), f.stats().paths["c_fast"] + f.stats().paths["python_fast"])
        """
    )
    assert out.split() == ["['UnverifiedFlaxWarning']", "True", "0"]


def test_hooks_are_trusted_on_this_flax():
    """The installed flax is inside the verified range (the suite would warn otherwise)."""
    from fastcall._nnx import _watch

    assert _watch.TRUSTED

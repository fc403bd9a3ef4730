"""Errors and warnings raised by fastcall itself (never by the user's function)."""

from __future__ import annotations


class FastcallError(TypeError, ValueError):
    """Bad input to a fastcall-wrapped function.

    Raised by a call (or `f.lower`, `fastcall.partial`, a `fastcall.Compiled`) before
    anything is traced or run, never by your function itself. The message names the
    wrapper (`fastcall.jit` or `fastcall.filter_jit`), the argument and the leaf path
    at fault, and says what to do: e.g. an NNX object passed as a static argument
    (its Variables would be baked into the program and go stale), unhashable static
    data, an array where a static value is required, or NNX arguments that share
    Variables under `graph=False`. Fix the call as the message says; nothing needs
    resetting.

    It subclasses `TypeError` because most such cases are a value of the wrong kind
    (unhashable static data, an array where a static value is required, ...), and
    `ValueError` because that is what the peers raise for the rest (`nnx.jit`'s
    prefix and aliasing errors, and its refusal of a static NNX object), so code
    written against them catches it too.

    **Example:**

    ```python
    import jax.numpy as jnp
    from flax import nnx

    import fastcall

    def forward(model, x):
        return model(x)

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    forward_static = fastcall.jit(forward, static_argnums=0)  # wrong: `model` static
    try:
        forward_static(model, jnp.ones(2))
    except fastcall.FastcallError as err:  # also a TypeError and a ValueError
        print(err)
    ```
    ```text
    fastcall.jit: argument 'model' is marked static (static_argnums/static_argnames) but holds an NNX object: ...
    ```
    """


class UnverifiedFlaxWarning(UserWarning):
    """fastcall could not verify its Flax NNX structure hooks on the installed flax.

    fastcall caches each NNX object's structure and learns of structural changes
    through hooks on a few private flax methods. When NNX support loads (the first
    time an NNX object reaches fastcall), it checks them: if the flax version is
    outside the verified range (flax 0.12.5 to 0.12.12) or a hooked method is
    missing, it warns once with this and stops trusting the hooks: NNX objects then
    have their structure re-read on every call, which is correct but slower. Use a
    flax version in the verified range for the fast path, or filter the warning if
    the slower calls are acceptable. A subclass of `UserWarning`.

    **Example:**

    It is warned only on an unverified flax, once per process, so there is no cheap
    way to trigger it here; this filters it (before the first NNX call):

    ```python
    import warnings

    import fastcall

    assert issubclass(fastcall.UnverifiedFlaxWarning, UserWarning)
    warnings.filterwarnings("ignore", category=fastcall.UnverifiedFlaxWarning)
    ```
    """


def for_decorator(err: BaseException, decorator: str) -> BaseException:
    """`err` as the decorator the user wrote reports it. fastcall's messages are written
    as `fastcall.jit`'s ("fastcall.jit: ..."); under `fastcall.filter_jit` they say so. The
    innermost wrapper names an error (a wrapped function calling another names the inner
    one's error as the inner one's); its traceback is kept."""
    if type(err) is not FastcallError or getattr(err, "_fastcall_named", False):
        return err
    message = str(err)
    if decorator != "fastcall.jit" and message.startswith("fastcall.jit"):
        err = FastcallError(decorator + message[len("fastcall.jit") :]).with_traceback(err.__traceback__)
    err._fastcall_named = True  # type: ignore[attr-defined]
    return err


def describe_arg(arg_name: str, path: str = "") -> str:
    """`argument 'model'` or `argument 'model' at leaf .layers[0].weight`."""
    where = f"argument {arg_name!r}"
    if path:
        where += f" at leaf {path}"
    return where

"""Errors and warnings raised by fastcall itself (never by the user's function)."""

from __future__ import annotations


class FastcallError(TypeError, ValueError):
    """Bad input to a fastcall-wrapped function.

    Raised before anything is traced or run. The message names the argument and
    the leaf path at fault and says what to do. It subclasses `TypeError`
    because most such cases are a value of the wrong kind (unhashable static
    data, an array where a static value is required, ...), and `ValueError`
    because that is what the peers raise for the rest (`nnx.jit`'s prefix and
    aliasing errors), so code written against them catches it too.
    """


class UnverifiedFlaxWarning(UserWarning):
    """fastcall could not verify its Flax NNX structure hooks on the installed flax
    (a version outside the verified range, or a hooked method missing): NNX objects
    have their structure re-read on every call, which is correct but slower. Warned
    once, when NNX support loads; filter it if that is acceptable."""


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

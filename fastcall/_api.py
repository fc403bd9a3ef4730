"""The public entry points: `fastcall.jit`, `fastcall.partial`, `fastcall.clear_caches`.

`jit` freezes its options into a `JitOptions` record, flattens the function
itself once (a callable pytree may carry arrays), finds the per-function state
shared by equal functions, and builds the wrapper (`_dispatch.make_wrapper`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Concatenate, ParamSpec, Protocol, Sequence, TypeVar, overload

import equinox as eqx
import jax
from jaxtyping import PyTree

from . import _aot, _args, _codegen, _dispatch, _explain, _plan, _flatten, _function, _hold, _nnx_gate, _stats
from . import _nnx
from ._build import broadcast_prefix
from ._errors import FastcallError, for_decorator
from ._options import UNSPECIFIED, Donate, check_signature, make_options
from ._trace import StepAside

# The core reaches Flax NNX only through the gate; this module plugs the NNX plugin in.
_nnx_gate.register(_nnx.load)

P = ParamSpec("P")
R = TypeVar("R")
A1 = TypeVar("A1")
A2 = TypeVar("A2")
A3 = TypeVar("A3")


class JitWrapped(Protocol[P, R]):
    """What `fastcall.jit` returns: `fun` with the same signature, plus AOT and stats."""

    __wrapped__: Callable[P, R]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def lower(self, *args: P.args, **kwargs: P.kwargs) -> _aot.Lowered:
        """Trace and lower for these arguments, static ones included (as `jax.jit(...).lower`)."""

    def trace(self, *args: P.args, **kwargs: P.kwargs) -> _aot.Traced:
        """Trace for these arguments (as `jax.jit(...).trace`); `.lower()` lowers it."""

    def eval_shape(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The output's structure, a `jax.ShapeDtypeStruct` per array (as `jax.jit(...).eval_shape`)."""

    def stats(self) -> _stats.JitStats:
        """Calls, compiles, hits, what each recompile changed, and the route each call took."""

    def explain(self, *args: P.args, **kwargs: P.kwargs) -> _explain.CallReport:
        """Which route a call with these arguments would take, and why (runs nothing)."""

    def clear_cache(self) -> None:
        """Drop this function's compiled programs and call plans; the next call compiles again."""


@overload
def jit(
    fun: Callable[P, R],
    *,
    donate: Donate = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Sequence[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Sequence[str] | None = ...,
    in_shardings: PyTree = ...,
    out_shardings: PyTree = ...,
    device: Any = ...,
    backend: str | None = ...,
    keep_unused: bool = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool | None = ...,
    graph_updates: bool | None = ...,
    nnx_as_pytree: bool = ...,
    pack: bool = ...,
) -> JitWrapped[P, R]: ...


@overload
def jit(
    fun: None = None,
    *,
    donate: Donate = ...,
    static_argnums: int | Sequence[int] | None = ...,
    static_argnames: str | Sequence[str] | None = ...,
    donate_argnums: int | Sequence[int] | None = ...,
    donate_argnames: str | Sequence[str] | None = ...,
    in_shardings: PyTree = ...,
    out_shardings: PyTree = ...,
    device: Any = ...,
    backend: str | None = ...,
    keep_unused: bool = ...,
    inline: bool = ...,
    compiler_options: dict[str, Any] | None = ...,
    graph: bool | None = ...,
    graph_updates: bool | None = ...,
    nnx_as_pytree: bool = ...,
    pack: bool = ...,
) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...


def jit(
    fun: Callable | None = None,
    *,
    donate: Donate = "none",
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Sequence[str] | None = None,
    in_shardings: Any = UNSPECIFIED,
    out_shardings: Any = UNSPECIFIED,
    device: Any = None,
    backend: str | None = None,
    keep_unused: bool = False,
    inline: bool = False,
    compiler_options: dict[str, Any] | None = None,
    graph: bool | None = None,
    graph_updates: bool | None = None,
    nnx_as_pytree: bool = False,
    pack: bool = True,
) -> Any:
    """Compile `fun` as `nnx.jit` / `jax.jit` would, at close to `jax.jit`'s floor.

    The drop-in for `nnx.jit` and `jax.jit`: use it bare (`@fastcall.jit`) or with
    options (`@fastcall.jit(static_argnames="n")`). Arguments and outputs are any
    pytrees (Equinox modules, Flax NNX objects, dicts, lists, arrays), and a call with
    a model it has seen costs about 1 us of Python on top of `jax.jit`'s own dispatch.

    What is traced follows `nnx.jit` / `jax.jit`: every JAX/NumPy array leaf and every
    Python scalar (bool, int, float, complex; weakly typed, so a growing step counter
    compiles once). Other leaves (strings, callables, None) are static and part of the
    compile key, where `jax.jit` would reject them. Equinox modules keep Equinox's own
    rule wherever they appear: array fields traced, every other field static (use
    `fastcall.filter_jit` for `eqx.filter_jit`'s rule everywhere). NNX objects follow
    `nnx.jit`: their Variables are traced, and what `fun` changes in them is written
    back to the caller's objects. Called inside another transformation (`jax.jit`,
    `jax.grad`, `jax.vmap`, ...), it nests as `jax.jit` does; a call with NNX objects
    made while a trace runs runs `fun` inline in that trace (NNX state changed inside
    must stay in it). Wrappers of equal functions with equal options share one table
    of compiled programs (and so their `.stats()` and `.clear_cache()`), as `jax.jit`
    shares its cache between wrappers of one function.

    **Arguments:**

    - `fun`: the function to compile. May be a plain function, a method (the
      wrapper is a descriptor, so `@fastcall.jit def __call__(self, x)` works
      on an `eqx.Module`), or any callable pytree (e.g. an `eqx.Module`, whose
      arrays are then traced). Left out, `jit(...)` returns a decorator.
    - `donate`: as in `eqx.filter_jit`: `"all"` (donate the arrays of every argument),
      `"all-except-first"`, `"warn"`, `"warn-except-first"` (the same, warning
      where jax cannot use a donated buffer; the `"all"` forms keep quiet) or
      `"none"` (the default).
    - `static_argnums`, `static_argnames`: as in `jax.jit`; the whole argument
      is static (hashed and compared by value, part of the compile key). Use them
      for a Python scalar that selects a different program (a flag, a size),
      which is traced otherwise. An NNX object may not be static.
    - `donate_argnums`, `donate_argnames`: as in `jax.jit`: donate the arrays of
      these arguments. An argument may not be both static and donated.
    - `in_shardings`: as in `jax.jit`: one sharding for all arrays, or one entry
      per positional argument (a pytree prefix of it).
    - `out_shardings`: a sharding, or a pytree prefix of the output; applied as a
      sharding constraint on the outputs.
    - `device`, `backend`, `keep_unused`, `inline`, `compiler_options`: passed to
      `jax.jit`.
    - `graph`, `graph_updates`: as in `nnx.jit`. fastcall always keeps NNX
      sharing (what graph mode gives) at tree-mode cost, so `graph` changes
      nothing (except that, as in `nnx.jit`, `graph=False` refuses Variables
      shared between arguments and `nnx.StateSharding` prefixes); structural
      changes made inside the function are propagated to the caller's objects
      unless `graph_updates=False`, which (as in `nnx.jit`) propagates changed
      Variable values only. `None` means the current `nnx.set_graph_mode` /
      `nnx.set_graph_updates` setting.
    - `nnx_as_pytree`: `True` gives `jax.jit`'s semantics for Flax NNX objects, where
      they differ from `nnx.jit`'s: NNX modules, Variables and States are plain pytrees,
      nothing the function changes in them is written back to the caller's objects, an
      object reached twice is two objects inside, and NNX objects returned are new.
      (`graph` and `graph_updates` then have no effect.) The default, `False`, is
      `nnx.jit`'s.
    - `pack`: `True` (the default) passes a model's small leaves (arrays of at most
      one dimension and 256 elements: biases, norm scales) packed into one buffer per
      dtype and device when the fast path serves it again unchanged, at default
      options (nothing donated; no shardings, device, backend or compiler options); fewer arguments to
      dispatch cost less than `jax.jit` on the model's own leaves. The packed program
      is compiled once per layout, beside the function's own (the function is not
      traced again). `False` passes every leaf as it is.

    **Returns:**

    A function with `fun`'s name, docstring and signature (for a type checker too),
    hashable, usable as a static argument and as a method. With `fun` left out, a
    decorator that returns it.

    **Methods of the returned function:**

    - `.lower(*args, **kwargs)` -> `fastcall.Lowered`: trace and lower for these
      arguments, static ones included (as `jax.jit(...).lower`); its `.compile()`
      gives a `fastcall.Compiled`. Arrays may be given as `jax.ShapeDtypeStruct`s.
    - `.trace(*args, **kwargs)` -> `fastcall.Traced` (as `jax.jit(...).trace`): its
      `.jaxpr`, and `.lower()`.
    - `.eval_shape(*args, **kwargs)`: the output's structure with a
      `jax.ShapeDtypeStruct` per array (as `jax.jit(...).eval_shape`); nothing runs and
      nothing is written back.
    - `.stats()` -> `fastcall.JitStats`: calls, compiles, hits, what each recompile
      changed, and the route each call took.
    - `.explain(*args, **kwargs)` -> `fastcall.CallReport`: the route a call with
      these arguments would take and why, argument by argument. It traces, compiles
      and runs nothing.
    - `.clear_cache()`: drop this function's compiled programs and call plans; the next
      call compiles again (`.stats()` keeps counting).

    **Raises:**

    - `ValueError`, at decoration: an unknown `donate` value; argument numbers or
      names that `fun` does not take, or an argument both static and donated (with
      `jax.jit`'s messages); a bound method of an NNX object as `fun`.
    - `TypeError`, at decoration: `fun` is not callable.
    - `fastcall.FastcallError` (a `TypeError` and a `ValueError`), at a call, before
      anything runs: bad input, naming the argument and leaf path (e.g. an NNX object
      passed as a static argument).

    **Example:**

    ```python
    import jax.numpy as jnp
    from flax import nnx

    import fastcall

    @fastcall.jit
    def shift(model, delta):
        model.bias[...] += delta  # changed inside: written back to `model`
        return model(jnp.zeros(2))

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))  # bias starts at zero
    shift(model, 1.0)  # traces and compiles
    shift(model, 2.0)  # a Python float is traced: no recompile
    print(model.bias[...])
    print(shift.stats().compiles)
    ```
    ```text
    [3. 3.]
    1
    ```

    With an Equinox model, and what `.stats()` and `.explain()` tell:

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit
    def forward(model, x):
        return model(x)

    model = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    x = jnp.ones(2)
    forward(model, x)  # compiles
    forward(model, x)  # reuses the compiled program
    forward(model, x.astype(jnp.float16))  # a new dtype: compiles again
    stats = forward.stats()
    print(stats.calls, stats.compiles, stats.hits)
    print(stats.recompiles[0])
    print(forward.explain(model, x).route)
    ```
    ```text
    3 2 1
    x: array float32[2] -> array float16[2]
    fast
    ```
    """
    if _nnx_gate.flax_imported():  # NNX's settings and its checks of prefixes, as nnx.jit
        graph, graph_updates = _nnx_gate.adapter().resolve_options(graph, graph_updates, in_shardings, out_shardings)
    options = make_options(
        donate=donate,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
        donate_argnums=donate_argnums,
        donate_argnames=donate_argnames,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        device=device,
        backend=backend,
        keep_unused=keep_unused,
        inline=inline,
        compiler_options=compiler_options,
        graph_updates=graph_updates,
        graph=graph,
        trace_scalars=True,
        nnx_as_pytree=bool(nnx_as_pytree),
        pack=bool(pack),
    )
    if fun is None:
        return functools.partial(_wrap, options=options)
    return _wrap(fun, options)


@overload
def filter_jit(fun: Callable[P, R], *, donate: Donate = ..., pack: bool = ...) -> JitWrapped[P, R]: ...


@overload
def filter_jit(fun: None = None, *, donate: Donate = ..., pack: bool = ...) -> Callable[[Callable[P, R]], JitWrapped[P, R]]: ...


def filter_jit(fun: Callable | None = None, *, donate: Donate = "none", pack: bool = True) -> Any:
    """Compile `fun` with `eqx.filter_jit`'s rules, at close to `jax.jit`'s cost.

    The drop-in for `eqx.filter_jit` (same arguments): every JAX/NumPy array leaf of
    the arguments is traced, and every other leaf (Python scalars included) is static
    and part of the compile key. It runs on the same engine as `fastcall.jit` (which
    follows `nnx.jit`/`jax.jit` instead: Python scalars traced) and returns the same
    kind of wrapper, with the same `.lower`, `.stats()`, `.explain` and
    `.clear_cache()` (see `fastcall.jit`). Use it where a Python scalar argument should
    select its own program, as under `eqx.filter_jit`.

    **Arguments:**

    - `fun`: the function to compile (as for `fastcall.jit`). Left out,
      `filter_jit(donate=...)` returns a decorator.
    - `donate`: `"all"`, `"all-except-first"`, `"warn"`, `"warn-except-first"` or
      `"none"` (the default), as in `eqx.filter_jit`.
    - `pack`: as for `fastcall.jit`: `False` passes every leaf as it is.

    **Returns:**

    A function with `fun`'s name, docstring and signature, as `fastcall.jit` returns.

    **Raises:**

    - `ValueError`, at decoration: an unknown `donate` value.
    - `TypeError`, at decoration: `fun` is not callable.
    - `fastcall.FastcallError`, at a call: bad input, naming the argument and leaf
      path.

    **Example:**

    ```python
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import fastcall

    @fastcall.filter_jit  # was: @eqx.filter_jit
    def forward(model, x, scale):
        return model(x) * scale  # `scale`, a Python float, is static

    model = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    x = jnp.ones(2)
    forward(model, x, 2.0)  # compiles
    forward(model, x, 2.0)  # the same static value: no recompile
    forward(model, x, 3.0)  # a new static value: compiles again
    print(forward.stats().compiles)
    print(forward.stats().recompiles[-1])
    ```
    ```text
    2
    scale: static float 2.0 -> static float 3.0
    ```
    """
    options = make_options(
        donate=donate,
        static_argnums=None,
        static_argnames=None,
        donate_argnums=None,
        donate_argnames=None,
        in_shardings=UNSPECIFIED,
        out_shardings=UNSPECIFIED,
        device=None,
        backend=None,
        keep_unused=False,
        inline=False,
        compiler_options=None,
        graph_updates=None,
        graph=None,
        trace_scalars=False,
        pack=bool(pack),
    )
    if fun is None:
        return functools.partial(_wrap, options=options)
    return _wrap(fun, options)


def _wrap(fun: Any, options: Any) -> Any:
    if not callable(fun):
        raise TypeError(f"{options.decorator} expects a callable, got {type(fun).__name__}.")
    if inspect.ismethod(fun) and _nnx_gate.is_node(fun.__self__):
        # The object would be closed over: its state neither traced nor written back, and
        # its current weights baked into the program (stale after an update). As nnx.jit.
        raise ValueError(
            f"{options.decorator}: {fun.__qualname__} is a bound method of an NNX object; bound methods "
            "are not supported (the object's state would not be tracked). Decorate the method "
            "in the class body (@fastcall.jit def method(self, ...)), or wrap the unbound method "
            "and pass the object: fastcall.jit(type(obj).method)(obj, ...)."
        )
    user_fun = fun
    check_signature(options, fun)
    if options.out_shardings is not UNSPECIFIED:
        fun = _OutShardings(fun, options.out_shardings)
    fun_spec, leaves = _flatten.flatten_generic(fun, "fun")
    fun_leaves = tuple(leaves)
    state = _function.state_for(fun, fun_spec, options, user_fun)
    public = _dispatch.make_wrapper(fun, fun_leaves, state, user_fun)
    public._fastcall_state = state
    # (a top-level list or dict the function holds for the fast path dies with the wrapper)
    weakref.finalize(public, _hold.release_held, state.held_box).atexit = False
    public._fastcall_fun_leaves = fun_leaves
    public.lower = _aot.lowering(state, fun_leaves, ())
    public.trace = _aot.tracing(state, fun_leaves, ())
    public.eval_shape = _aot.shape_evaluation(state, fun_leaves, ())
    public.stats = state.stats
    public.explain = lambda *args, **kwargs: _explain.explain(state, args, kwargs)
    public.explain.__doc__ = "Which route a call with these arguments would take, and why (runs nothing)."
    public.clear_cache = state.clear
    return public


class _OutShardings(eqx.Module):
    """`fun` with a sharding constraint on its array outputs (for `out_shardings`)."""

    fun: Callable
    shardings: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fun(*args, **kwargs)
        treedef: Any
        # NNX objects stay whole (their identity matters for write-back); their Variables
        # are constrained in place, per Variable for an nnx.StateSharding.
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=_nnx_gate.is_node)
        if isinstance(self.shardings, jax.sharding.Sharding) or self.shardings is None:
            per_leaf = [self.shardings] * len(leaves)
        else:
            try:  # a prefix as deep as the output: one entry per array or NNX object
                per_leaf = treedef.flatten_up_to(self.shardings)
            except Exception:  # a shallower prefix: one entry for a whole subtree
                per_leaf = broadcast_prefix(self.shardings, out, is_leaf=_nnx_gate.is_node)
        constrained = []
        for x, sh in zip(leaves, per_leaf):
            if sh is None:
                constrained.append(x)
            elif _nnx_gate.is_node(x):
                _nnx_gate.adapter().constrain(x, sh)
                constrained.append(x)
            elif isinstance(x, jax.Array):
                constrained.append(jax.lax.with_sharding_constraint(x, sh))
            else:
                constrained.append(x)
        return treedef.unflatten(constrained)


def clear_caches() -> None:
    """Drop every cache fastcall holds: identity cache, templates, compiled programs.

    For every wrapped function at once (`f.clear_cache()` clears one function's).
    Wrapped functions keep working; their next call re-reads its arguments and
    compiles again. Use it to free memory held for models no longer in use, or to
    measure first-call costs again; `.stats()` counts are kept.

    **Returns:**

    `None`.

    **Example:**

    ```python
    import jax.numpy as jnp

    import fastcall

    @fastcall.jit
    def double(x):
        return 2 * x

    x = jnp.ones(2)
    double(x)  # compiles
    fastcall.clear_caches()
    print(double(x))  # still works: compiled again
    print(double.stats().compiles)
    ```
    ```text
    [2. 2.]
    2
    ```
    """
    _flatten.clear()
    _codegen.clear()
    _plan.clear()
    adapter = _nnx_gate.loaded()
    if adapter is not None:
        adapter.clear()
    _args.clear()
    _function.clear_all()


# (typed for up to three bound arguments: the call keeps the rest of `fun`'s signature)
@overload
def partial(fun: Callable[Concatenate[A1, P], R], a1: A1, /, **jit_options: Any) -> JitWrapped[P, R]: ...


@overload
def partial(
    fun: Callable[Concatenate[A1, A2, P], R], a1: A1, a2: A2, /, **jit_options: Any
) -> JitWrapped[P, R]: ...


@overload
def partial(
    fun: Callable[Concatenate[A1, A2, A3, P], R], a1: A1, a2: A2, a3: A3, /, **jit_options: Any
) -> JitWrapped[P, R]: ...


@overload
def partial(fun: Callable[..., R], /, *bound: Any, **jit_options: Any) -> JitWrapped[..., R]: ...


def partial(fun: Callable, /, *bound: Any, **jit_options: Any) -> Any:
    """Bind leading arguments (typically the model) for serving, like
    `nnx.jit_partial` / `nnx.cached_partial`, without their staleness.

    The bound objects are flattened once, here (so errors in them surface here); each
    call reads their current Variable values, writes changed state back, and
    re-flattens a bound NNX module only after its structure changed
    (`model.layers[1] = nnx.Linear(...)`, `model.eval()`), where `nnx.jit_partial`
    and `nnx.cached_partial` would return stale results. Use it for a serving or
    training loop that calls one model many times.

    **Arguments:**

    - `fun`: a function, or a function already wrapped by `fastcall.jit` or
      `fastcall.filter_jit` (or a `fastcall.partial`: the bindings add up).
    - `*bound`: leading positional arguments to bind (NNX modules, Equinox
      modules, arrays, anything).
    - `**jit_options`: options for `fastcall.jit` (`static_argnums`, `donate`, ...),
      used where `fun` is not wrapped yet.

    **Returns:**

    A callable taking the remaining arguments. Its `.lower(...)`, `.trace(...)`,
    `.eval_shape(...)` and `.explain(...)` take what a call takes (the remaining arguments), and the `fastcall.Compiled`
    that `.lower(x).compile()` gives is called as `compiled(x)`; `.stats()` and
    `.clear_cache()` are the wrapped function's.

    **Raises:**

    `fastcall.FastcallError`, here: a bound argument that a call could not take.

    **Example:**

    ```python
    import jax.numpy as jnp
    from flax import nnx

    import fastcall

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.proj(x)

    def forward(model, x):
        return model(x)

    model = Model(nnx.Rngs(0))
    serve = fastcall.partial(forward, model)  # `model` is read once, here
    x = jnp.ones(2)
    print(serve(x).shape)
    model.proj = nnx.Linear(2, 3, rngs=nnx.Rngs(1))  # a structural change: seen
    print(serve(x).shape)
    print(serve.lower(x).compile()(x).shape)  # .lower takes what a call takes
    ```
    ```text
    (2,)
    (3,)
    (3,)
    ```
    """
    inner = getattr(fun, "_fastcall_bound", None)
    if inner is not None:  # (a fastcall.partial of one: a single binding of both's arguments)
        bound, fun = (*inner, *bound), fun.func  # type: ignore[attr-defined]
    wrapped = fun if getattr(fun, "_fastcall_state", None) is not None else jit(fun, **jit_options)
    state: _function.FunctionState = wrapped._fastcall_state  # type: ignore[attr-defined]
    scratch: list[Any] = []
    for i, arg in enumerate(bound):  # flatten once now: errors surface here, caches are warm
        if type(arg) is not _flatten.ArrayImpl:
            try:
                _args.resolve(
                    arg, scratch, state.arg_name(i), [], None, state.options.trace_scalars,
                    nnx_as_pytree=state.options.nnx_as_pytree,
                )
            except StepAside:
                pass
            except FastcallError as err:
                raise for_decorator(err, state.decorator) from err.__cause__
    bound_call = functools.partial(wrapped, *bound)
    functools.update_wrapper(bound_call, wrapped)  # type: ignore[arg-type]
    # (its lower and explain take what a call takes: the bound arguments go first)
    bound_call.lower = _aot.lowering(state, wrapped._fastcall_fun_leaves, bound)  # type: ignore[attr-defined]
    bound_call.trace = _aot.tracing(state, wrapped._fastcall_fun_leaves, bound)  # type: ignore[attr-defined]
    bound_call.eval_shape = _aot.shape_evaluation(  # type: ignore[attr-defined]
        state, wrapped._fastcall_fun_leaves, bound  # type: ignore[attr-defined]
    )
    bound_call.explain = lambda *args, **kwargs: _explain.explain(  # type: ignore[attr-defined]
        state, (*bound, *args), kwargs
    )
    bound_call.explain.__doc__ = wrapped.explain.__doc__  # type: ignore[attr-defined]
    bound_call._fastcall_bound = bound  # type: ignore[attr-defined]
    return bound_call

"""Options checked at decoration as jax.jit checks them, with jax.jit's error types and
messages; an NNX object marked static refused as nnx.jit refuses it (and never baked in)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall


def train_step(x, train):
    return x * 2 if train else x


def with_var_args(x, *rest):
    return x


def with_var_keywords(x, **options):
    return x


def positional_only(x, /, y, *, z):
    return x + y + z


OPTIONS = [
    (train_step, dict(static_argnames="trian")),
    (train_step, dict(static_argnums=5)),
    (train_step, dict(static_argnums=-3)),
    (train_step, dict(static_argnums="1")),
    (train_step, dict(static_argnums=1.0)),
    (train_step, dict(static_argnames=1)),
    (train_step, dict(donate_argnums=5)),
    (train_step, dict(donate_argnames="y")),
    (train_step, dict(static_argnums=0, donate_argnums=0)),
    (train_step, dict(static_argnames="x", donate_argnums=0)),
    (positional_only, dict(static_argnames="x")),
    (positional_only, dict(static_argnums=2)),
    # accepted by both:
    (train_step, dict(static_argnums=(1, 1))),
    (train_step, dict(static_argnums=-1)),
    (train_step, dict(static_argnums=(0,), static_argnames="x")),
    (with_var_args, dict(static_argnums=5)),
    (with_var_keywords, dict(static_argnames="anything")),
    (positional_only, dict(static_argnames="z")),
    (train_step, dict(static_argnums=-1, donate_argnums=0)),
    (with_var_args, dict(static_argnums=-1, donate_argnums=0)),
    (positional_only, dict(static_argnums=0, donate_argnums=0)),
    (train_step, dict(static_argnums=0, static_argnames="train", donate_argnames="x")),
    (train_step, dict(static_argnums=np.int64(1))),
    (train_step, dict(static_argnums=np.array(1))),
]


def _outcome(make):
    try:
        make()
    except Exception as err:  # (what the decorator raises is the subject)
        return type(err), str(err)
    return None


# jax.jit before 0.10 also refused argument numbers both static and donated where its names
# do not tell them ("`static_argnums` [0] and `donate_argnums` [0] cannot intersect."); jax
# 0.10 and later accept these, and so does fastcall.
NUMBERS_CHECKED_BEFORE_JAX_0_10 = [
    (positional_only, dict(static_argnums=0, donate_argnums=0)),
    (train_step, dict(static_argnums=0, static_argnames="train", donate_argnames="x")),
]


@pytest.mark.parametrize("fun, options", OPTIONS, ids=[f"{f.__name__}-{o}" for f, o in OPTIONS])
def test_options_checked_at_decoration_as_jax_jit(fun, options):
    expected = _outcome(lambda: jax.jit(fun, **options))
    if (fun, options) in NUMBERS_CHECKED_BEFORE_JAX_0_10 and expected is not None:
        assert "`static_argnums` [0] and `donate_argnums` [0] cannot intersect" in expected[1]
        expected = None  # (an older jax's refusal: fastcall follows the current one)
    assert _outcome(lambda: fastcall.jit(fun, **options)) == expected
    # (as a decorator factory and through fastcall.partial, the same check)
    assert _outcome(lambda: fastcall.jit(**options)(fun)) == expected


def test_a_misspelt_static_name_is_named_before_any_call():
    with pytest.raises(ValueError, match=r"invalid argnames \{'trian'\} in static_argnames"):
        fastcall.jit(train_step, static_argnames="trian")
    with pytest.raises(ValueError, match=r"invalid argnames \{'trian'\} in static_argnames"):
        fastcall.partial(train_step, jnp.ones(2), static_argnames="trian")
    f = fastcall.jit(train_step, static_argnames="train")  # (the right name works)
    assert jnp.array_equal(f(jnp.ones(2), train=True), jnp.full(2, 2.0))


@pytest.mark.parametrize("graph", [None, False])
def test_an_nnx_object_marked_static_is_refused(graph):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x), static_argnums=0, graph=graph)
    with pytest.raises(ValueError, match=r"argument 'm' is marked static .* holds an NNX object"):
        f(model, jnp.ones(2))
    g = fastcall.jit(lambda ms, x: ms[0](x), static_argnames="ms")
    with pytest.raises(ValueError, match=r"argument 'ms' is marked static .* holds an NNX object"):
        g(x=jnp.ones(2), ms=(model,))
    if graph is None:  # (nnx.jit's graph mode refuses it too)
        with pytest.raises(ValueError, match="Non-hashable static arguments are not supported"):
            nnx.jit(lambda m, x: m(x), static_argnums=0)(model, jnp.ones(2))


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("decorator", ["jit", "filter_jit"])
def test_errors_name_the_decorator_the_user_wrote(decorator, hot_path):
    wrap = getattr(fastcall, decorator)
    name = f"fastcall.{decorator}:"
    f = wrap(lambda tag, x: x)
    with pytest.raises(fastcall.FastcallError, match=r"^" + name.replace(".", r"\.") + " argument 'tag'"):
        f(_Unhashable(), jnp.ones(2))  # (a static value that cannot be hashed)
    with pytest.raises(fastcall.FastcallError, match=r"^" + name.replace(".", r"\.") + " argument 'tag'"):
        f.lower(_Unhashable(), jnp.ones(2))
    g = wrap(lambda x, y: x + y, donate="all")
    x = jnp.ones(3)
    for _ in range(2):
        g(jnp.ones(3), jnp.ones(3))
    g(x, jnp.ones(3))
    with pytest.raises(fastcall.FastcallError, match=r"^" + name.replace(".", r"\.") + " argument 'x' is a deleted"):
        g(x, jnp.ones(3))
    with pytest.raises(TypeError, match=f"^fastcall.{decorator} expects a callable"):
        wrap(3)


def test_an_inner_wrappers_error_keeps_its_name():
    """A fastcall.jit function called inside a fastcall.filter_jit one: its error names it,
    not the outer wrapper, and the traceback still shows the user's outer function."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    inner = fastcall.jit(lambda x, m: m(x), static_argnums=1)

    def outer(x):
        return inner(x, model)

    with pytest.raises(fastcall.FastcallError, match=r"^fastcall\.jit: argument 'm' is marked static") as info:
        fastcall.filter_jit(outer)(jnp.ones(2))
    assert "outer" in [entry.name for entry in info.traceback]


def test_in_shardings_per_argument_skip_static_arguments_as_jax_jit_counts_them():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def f(a, n, b):
        return a * n + b

    x = jnp.ones(3)
    ours = fastcall.jit(f, static_argnums=1, in_shardings=(sharding, sharding))
    assert jnp.allclose(ours(x, 2, x), jax.jit(f, static_argnums=1, in_shardings=(sharding, sharding))(x, 2, x))
    for wrap in (jax.jit, fastcall.jit):  # one entry per traced argument, no more
        with pytest.raises(ValueError, match="in_shardings specification must be a tree prefix"):
            wrap(f, static_argnums=1, in_shardings=(sharding, None, sharding))(x, 2, x)


def test_in_shardings_as_a_pytree_prefix_of_an_argument_as_jax_jit_takes_it():
    """A pytree prefix per argument (a dict's entries each one sharding, or None: unconstrained)
    places each leaf as jax.jit places it; a prefix of another structure is an error that names
    the argument (jax's names none)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def f(p, x):
        return jax.tree_util.tree_map(lambda v: v * x, p)

    p = {"a": jnp.ones(3), "b": (jnp.arange(2.0), jnp.zeros(1))}
    for shardings in [({"a": sharding, "b": None}, None), ({"a": sharding, "b": (sharding, None)}, sharding)]:
        ours, peer = fastcall.jit(f, in_shardings=shardings)(p, 2.0), jax.jit(f, in_shardings=shardings)(p, 2.0)
        assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(peer)
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(peer)):
            assert jnp.array_equal(a, b) and a.sharding == b.sharding
    with pytest.raises(ValueError):
        jax.jit(f, in_shardings=({"other": sharding}, None))(p, 2.0)
    with pytest.raises(fastcall.FastcallError, match="in_shardings for argument 'p' is not a pytree prefix of it"):
        fastcall.jit(f, in_shardings=({"other": sharding}, None))(p, 2.0)

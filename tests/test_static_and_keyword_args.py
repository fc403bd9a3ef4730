"""Keyword arguments and static arguments on the structure path.

`f(model, x, key=key)`, `f(model, x, None)`, `step(model, opt_state, optim, x)` (an optax
transformation, static), `f(model, x, train=False)` with static_argnames: each call whose
arguments have the structures, keyword names and static values of a call the function ran
is served without resolving it (no signature binding, no hashing of statics). A static
argument is compared with the recorded one: by identity for objects nothing can change in
place, by exact value for scalars (`True` is not `1`, `-0.0` is not `0.0`); anything else
is read by the general path, so no change can give a stale program.

Each test checks values against the eager call and the peer, and the route that served
the call, through the C path and the Python one."""

from __future__ import annotations

import collections
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import fastcall

from .conftest import STRUCTURE_PATH, assert_trees_equal, served, state_of

pytestmark = pytest.mark.usefixtures("hot_path")

X = jnp.arange(4.0)
MLP = eqx.nn.MLP(4, 4, 8, 2, key=jax.random.PRNGKey(0))


def _weight(tag):
    """A number that differs for every static value these tests tell apart (by repr and
    type: 1 and True, 0.0 and -0.0), so that a program compiled for another tag shows."""
    return float(len(repr(tag)) + 3 * len(type(tag).__name__))


def _tagged(m, x, tag):
    return m(x) * _weight(tag)


def _evaluate(m, x, *, key=None, inference=False, scale=1.0):
    y = m(x) * scale
    if not inference:
        y = y + jax.random.normal(key, y.shape)
    return y


def test_keyword_arguments_take_the_structure_path(hot_path):
    f, peer = fastcall.filter_jit(_evaluate), eqx.filter_jit(_evaluate)
    routes = []
    for i in range(4):
        key = jax.random.PRNGKey(i)  # (a new array each call, as a keyword argument)
        y, route = served(f, MLP, X, key=key, inference=False, scale=2.0)
        routes.append(route)
        assert_trees_equal(y, _evaluate(MLP, X, key=key, inference=False, scale=2.0))
        assert_trees_equal(y, peer(MLP, X, key=key, inference=False, scale=2.0))
    assert routes == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    y, route = served(f, MLP, X, key=key, inference=True, scale=2.0)  # another static value
    assert route == "general"
    assert_trees_equal(y, peer(MLP, X, key=key, inference=True, scale=2.0))
    assert f.stats().compiles == 2


def _scaled(m, x, s=1.0, *, t=1.0):
    return m(x) * s - t


def test_keywords_in_another_order_or_bound_to_positions_are_read_as_the_general_path_reads_them(hot_path):
    f = fastcall.jit(_scaled)
    calls = [
        ((MLP, X), {"s": 2.0, "t": 3.0}),
        ((MLP, X), {"t": 5.0, "s": 4.0}),  # the same names in another order
        ((MLP,), {"x": X, "s": 6.0}),  # a positional parameter by keyword
        ((MLP,), {"s": 7.0, "x": X}),
        ((MLP, X, 8.0), {"t": 9.0}),
    ]
    for args, kwargs in calls:
        for _ in range(3):  # (the first of each: general; then its own record)
            y, route = served(f, *args, **kwargs)
            assert_trees_equal(y, _scaled(*args, **kwargs))
        assert route == STRUCTURE_PATH[hot_path], (args, kwargs)
    assert f.stats().compiles <= 2  # (s passed positionally and by keyword: one program each at most)


def _with_options(m, x, **options):
    return m(x) * sum(options.values())


def test_other_keyword_names_are_not_read_as_the_recorded_ones(hot_path):
    f = fastcall.jit(_with_options)
    for _ in range(2):
        f(MLP, X, a=1.0, b=2.0)
    y, route = served(f, MLP, X, a=1.0, c=5.0)
    assert route == "general"
    assert_trees_equal(y, _with_options(MLP, X, a=1.0, c=5.0))


@pytest.mark.parametrize(
    "first, other",
    [
        (2.0, 3.0),
        (1, True),
        (0.0, -0.0),
        (1, 1.0),
        ("relu", "tanh"),
        (None, 0),
        ((1, "a"), (1, "b")),
        ((1, 2), (1, 2.0)),
        (jnp.tanh, jax.nn.relu),
    ],
    # (functions by name: a repr holds an address, which differs between processes)
    ids=lambda v: getattr(v, "__name__", None) or repr(v),
)
def test_a_static_argument_changed_is_compiled_for(first, other, hot_path):
    """(Against the eager call only for `other`: eqx.filter_jit keys statics by `==` and
    hash, so after 1 it serves 1.0 and True, and after 0.0 serves -0.0, from 1's and
    0.0's program.)"""
    f, peer = fastcall.filter_jit(_tagged), eqx.filter_jit(lambda m, x, tag: _tagged(m, x, tag))
    for _ in range(3):
        y, route = served(f, MLP, X, first)
        assert_trees_equal(y, _tagged(MLP, X, first))
        assert_trees_equal(y, peer(MLP, X, first))
    assert route == STRUCTURE_PATH[hot_path]
    y, route = served(f, MLP, X, other)
    assert route == "general"
    assert_trees_equal(y, _tagged(MLP, X, other))
    assert f.stats().compiles == 2


@pytest.mark.parametrize(
    "make",
    [lambda: 10**20 + 1, lambda: float("1e300") * 1.5, lambda: "".join(["ab", "cd"]), lambda: float("nan")],
    ids=["big int", "float", "str", "nan"],
)
def test_an_equal_scalar_made_anew_each_call_is_served(make, hot_path):
    """Scalars are compared by value (exact type, exact bits; every NaN alike, as the
    compile key has it), so a value computed each call still takes the structure path."""
    f = fastcall.filter_jit(_tagged)
    for _ in range(3):
        value = make()
        y, route = served(f, MLP, X, value)
        assert_trees_equal(y, _tagged(MLP, X, value))
    assert route == STRUCTURE_PATH[hot_path]
    assert f.stats().compiles == 1


def test_an_optax_transformation_passed_in_each_step(hot_path):
    def step(model, opt_state, optim, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    f, peer = fastcall.filter_jit(step), eqx.filter_jit(step)
    optim = optax.adam(1e-2)
    ours = theirs = (MLP, optim.init(eqx.filter(MLP, eqx.is_array)))
    routes = []
    for _ in range(4):
        (model, state, loss), route = served(f, *ours, optim, X)
        model_p, state_p, loss_p = peer(*theirs, optim, X)
        routes.append(route)
        assert_trees_equal((model, state, loss), (model_p, state_p, loss_p))
        ours, theirs = (model, state), (model_p, state_p)
    assert routes[2:] == [STRUCTURE_PATH[hot_path]] * 2
    (_, _, loss), route = served(f, *ours, optax.adam(1e-2), X)  # another transformation: other functions
    assert route == "general"
    assert_trees_equal(loss, peer(*theirs, optax.adam(1e-2), X)[2])


def test_static_argnums_take_the_structure_path(hot_path):
    f = fastcall.jit(_tagged, static_argnums=2)
    for _ in range(3):
        y, route = served(f, MLP, X, 2)
        assert_trees_equal(y, _tagged(MLP, X, 2))
    assert route == STRUCTURE_PATH[hot_path]
    y, route = served(f, MLP, X, True)
    assert route == "general"
    assert_trees_equal(y, _tagged(MLP, X, True))
    with pytest.raises(fastcall.FastcallError, match="tag.*is marked static.*array"):
        f(MLP, X, jnp.asarray(2))
    assert f.stats().compiles == 2


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x, train):
        return self.dropout(self.bn(self.linear(x), use_running_average=not train), deterministic=not train)


def _forward(x, *, model, train):
    return model(x, train)


def test_nnx_model_as_keyword_with_a_static_flag_writes_state_back_as_nnx_jit(hot_path):
    f = fastcall.jit(_forward, static_argnames="train")
    peer = nnx.jit(_forward, static_argnames="train")
    ours, theirs = _Block(nnx.Rngs(0)), _Block(nnx.Rngs(0))
    batch = jnp.ones((3, 4)) + jnp.arange(4.0)
    routes = []
    for train in (True, True, True, False, False, True):
        y, route = served(f, batch, model=ours, train=train)
        routes.append(route)
        assert_trees_equal(y, peer(batch, model=theirs, train=train))
        assert_trees_equal(state_of(ours), state_of(theirs))
    assert routes[2] == STRUCTURE_PATH[hot_path] and routes[4] == STRUCTURE_PATH[hot_path]
    assert f.stats().compiles == 2


def test_explain_names_the_structure_path_for_keywords_and_statics(hot_path):
    f = fastcall.filter_jit(_evaluate)
    key = jax.random.PRNGKey(0)
    for _ in range(2):
        f(MLP, X, key=key, inference=True)
    report = f.explain(MLP, X, key=key, inference=True)
    assert report.route == "structure" and not report.reasons, str(report)
    lines = {a.name: a for a in report.arguments}
    assert "static, as in a call this function ran" in lines["inference"].kind
    report = f.explain(MLP, X, key=key, inference=False)
    assert report.route == "general" and any("keyword" in r for r in report.reasons), str(report)
    assert math.isfinite(float(f(MLP, X, key=key, inference=True)[0]))


def test_calls_with_and_without_keywords_keep_a_record_each(hot_path):
    """One record per first-argument type and keyword names: a loop alternating
    `f(m, x)` and `f(m, x, scale=2.0)` (new models each step), or calling with keywords
    only, does not evict the other form's record."""
    f = fastcall.filter_jit(_scaled)
    routes = []
    for i in range(8):
        m = eqx.tree_at(lambda m: m.layers[0].bias, MLP, MLP.layers[0].bias + i)  # a new model
        kwargs = {"s": 2.0} if i % 2 else {}
        y, route = served(f, m, X, **kwargs)
        routes.append(route)
        assert_trees_equal(y, _scaled(m, X, **kwargs))
        y, route = served(f, m=m, x=X)  # (no positional argument: general, and records nothing)
        assert route == "general"
        assert_trees_equal(y, _scaled(m, X))
    assert routes[2:] == [STRUCTURE_PATH[hot_path]] * 6


class _Scaled(eqx.Module):
    w: jax.Array


def test_an_error_in_a_keyword_argument_names_it(hot_path):
    f = fastcall.filter_jit(lambda x, *, m: x * m.w)
    for _ in range(3):
        f(X, m=_Scaled(jnp.ones(4)))
    w = jnp.ones(4)
    w.delete()
    with pytest.raises(fastcall.FastcallError, match="argument 'm' at leaf .w is a deleted array"):
        f(X, m=_Scaled(w))
    assert_trees_equal(f(X, m=_Scaled(jnp.ones(4))), X)  # (and the wrapper keeps working)


class _Options(collections.namedtuple("_Options", "a")):
    """A namedtuple whose `==` and hash also read an attribute that can be set."""

    def __eq__(self, other):
        return type(other) is _Options and tuple(self) == tuple(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((tuple(self), tuple(sorted(vars(self).items()))))


def test_a_static_namedtuple_keyed_by_more_than_its_items_is_compared_every_call(hot_path):
    def g(x, options):
        return x * options.a + options.shift

    f, peer = fastcall.jit(g, static_argnums=1), jax.jit(g, static_argnums=1)
    options = _Options(2.0)
    options.shift = 1.0
    for _ in range(3):
        assert_trees_equal(f(X, options), X * 2.0 + 1.0)
    options.shift = 100.0
    assert_trees_equal(f(X, options), X * 2.0 + 100.0)
    assert_trees_equal(f(X, options), peer(X, options))


def test_negative_static_argnums_count_from_the_end_of_each_call_with_star_args():
    """As jax.jit counts them: with `*args`, -1 is each call's last positional argument
    (it was counted from the end of the signature's: `x`, an array, refused as static)."""

    def scaled(x, *rest):
        n = rest[-1]
        assert isinstance(n, int)  # static: a Python int while tracing
        return x * n

    ours, theirs = fastcall.jit(scaled, static_argnums=-1), jax.jit(scaled, static_argnums=-1)
    x = jnp.ones(2)
    for args in ((x, 3), (x, 1.0, 3), (x, 1.0, 2.0, 4), (x, 3)):
        assert jnp.array_equal(ours(*args), theirs(*args))
    assert ours.stats().compiles == 3
    assert ours.explain(x, 1.0, 3).arguments[2].kind.startswith("int, static")


def test_negative_static_argnums_without_star_args_count_as_the_installed_jax_jit_counts_them():
    """jax 0.10 counts them from the call's positional arguments (`f(x, 2)` makes `b`
    static), jax 0.12 from the signature's (`c`); fastcall asks jax.jit which, once."""
    seen = {}

    def f(a, b, c=1):
        seen.setdefault(wrap_name, []).append(tuple(isinstance(v, jax.core.Tracer) for v in (a, b, c)))
        return a

    for wrap_name, wrap in (("jax.jit", jax.jit), ("fastcall.jit", fastcall.jit)):
        g = wrap(f, static_argnums=-1)
        g(jnp.ones(2), 2)
        g(jnp.ones(2), 2, 3)
    assert seen["fastcall.jit"] == seen["jax.jit"]


def test_a_negative_static_argnum_past_the_first_argument_is_refused_as_jax_jit_refuses_it():
    def g(*args):
        return args[0]

    with pytest.raises(Exception):  # (jax 0.10: ValueError; jax 0.12: AssertionError)
        jax.jit(g, static_argnums=-2)(jnp.ones(2))
    with pytest.raises(fastcall.FastcallError, match="must have value greater than or equal to -len"):
        fastcall.jit(g, static_argnums=-2)(jnp.ones(2))


def test_negative_donate_argnums_donate_nothing_as_in_jax_jit():
    def donated(lowered):
        infos = jax.tree.leaves(lowered.args_info, is_leaf=lambda x: hasattr(x, "donated"))
        return [x.donated for x in infos]

    def add(*xs):
        return sum(xs)

    for numbers in (-1, (0, -1)):
        args = (jnp.ones(2), jnp.ones(2), jnp.ones(2))
        ours = donated(fastcall.jit(add, donate_argnums=numbers).lower(*args))
        assert ours == donated(jax.jit(add, donate_argnums=numbers).lower(*args)) == [numbers == (0, -1), False, False]

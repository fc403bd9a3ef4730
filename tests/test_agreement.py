"""The agreement mode (FASTCALL_CHECK_HITS=1): every call a hit served, resolved again by the
general path and compared (leaves by identity, the compiled entry). CI runs the whole suite
under it; these tests show that it checks the hits, only the hits, and catches a hit that
reads what the general path would not."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fastcall
from fastcall import _agreement, _plan

from .conftest import FAST_PATH, STRUCTURE_PATH, served


@pytest.fixture
def agreement(monkeypatch):
    """The agreement mode on for the wrappers and compiled entries the test makes."""
    monkeypatch.setattr(_agreement, "ENABLED", True)


class Counter(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.count = nnx.BatchStat(jnp.zeros(()))

    def __call__(self, x):
        self.count[...] += 1
        return self.linear(x)


def _record(f, first):
    """`f`'s fast record for `first` (the same dict the C path reads)."""
    return _plan.INDEX[id(first)].records[f._fastcall_state]


def test_hits_are_checked_and_misses_are_not(agreement, hot_path):
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    expected = model(x)
    routes = []
    for _ in range(4):
        before = _agreement.checked
        out, route = served(f, model, x)
        routes.append((route, _agreement.checked - before))
        assert jnp.array_equal(out, expected)
    # (a model seen once is cached on its second call; the fast record serves the rest)
    assert routes == [("general", 0), ("general", 0), (FAST_PATH[hot_path], 1), (FAST_PATH[hot_path], 1)]


def test_nnx_hit_checked_before_write_back(agreement, hot_path):
    model, peer = Counter(), Counter()
    f = fastcall.jit(lambda m, x: m(x))
    g = nnx.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    before = _agreement.checked
    for _ in range(4):
        out = f(model, x)
        assert jnp.array_equal(out, g(peer, x))
    assert float(model.count[...]) == float(peer.count[...]) == 4.0
    assert f.stats().paths[FAST_PATH[hot_path]] >= 2
    assert _agreement.checked - before == f.stats().paths[FAST_PATH[hot_path]]


def test_structure_path_checked(agreement, hot_path):
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    before = _agreement.checked
    routes = []
    for seed in range(4):
        model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(seed))
        out, route = served(f, model, x)
        assert jnp.array_equal(out, model(x))
        routes.append(route)
    assert routes[1:] == [STRUCTURE_PATH[hot_path]] * 3
    assert _agreement.checked - before == 3


def test_stale_leaf_named(agreement, hot_path):
    model = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    for _ in range(3):
        f(model, x)
    record = _record(f, model)
    entry = record.call.entry()  # (in the agreement mode a record's call is checked: `_CheckedBound`)
    bound = list(record.call.leaves)
    bound[1] = bound[1] + 1.0  # a record reading an old value of the model's second leaf
    _plan.INDEX[id(model)].records[f._fastcall_state] = record._replace(
        call=_agreement.checked_bound(functools.partial(entry.fn, *bound), entry, bound)
    )
    with pytest.raises(_agreement.AgreementError, match=r"argument 'm', leaf 1 of 6: the hit passed"):
        f(model, x)


def test_nnx_variables_out_of_order_named(agreement, hot_path):
    model = Counter()
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    for _ in range(3):
        f(model, x)
    record = _record(f, model)
    variables = list(record.variables)
    variables[0], variables[1] = variables[1], variables[0]
    _plan.INDEX[id(model)].records[f._fastcall_state] = record._replace(variables=variables)
    with pytest.raises(_agreement.AgreementError, match=r"argument 'm', leaf 0 of 3"):
        f(model, x)


def test_wrong_entry_named(agreement, hot_path):
    small = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    other = eqx.nn.MLP(4, 3, 8, 2, activation=jax.nn.tanh, key=jax.random.PRNGKey(0))  # another static field
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    for _ in range(3):
        f(small, x)
        f(other, x)
    record, wrong = _record(f, small), _record(f, other)
    # (the same leaves, bound to the other model's compiled entry)
    wrong_entry, leaves = wrong.call.entry(), record.call.leaves
    _plan.INDEX[id(small)].records[f._fastcall_state] = record._replace(
        call=_agreement.checked_bound(functools.partial(wrong_entry.fn, *leaves), wrong_entry, leaves)
    )
    with pytest.raises(_agreement.AgreementError, match=r"another compiled entry .* argument 'm' has spec"):
        f(small, x)


def test_off_by_default_in_a_child_process():
    # (the suite itself may run under FASTCALL_CHECK_HITS=1: a child with it unset)
    import subprocess
    import sys

    from .conftest import child_env

    env = child_env()
    env.pop("FASTCALL_CHECK_HITS", None)
    code = "from fastcall import _agreement; print(_agreement.ENABLED)"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "False\n"
    env["FASTCALL_CHECK_HITS"] = "1"
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "True\n"


def test_nested_nnx_hit_is_compared(agreement, hot_path):
    """A read-only NNX call served by a hit inside an outer trace (the model closed over):
    compared too, though the general path would run such a call inline."""
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    for _ in range(3):
        f(model, x)
    outer = jax.jit(lambda y: f(model, x).sum() + y)
    checked, skipped = _agreement.checked, _agreement.skipped
    hits = f.stats().paths[FAST_PATH[hot_path]]
    assert jnp.allclose(outer(1.0), model(x).sum() + 1.0)
    assert f.stats().paths[FAST_PATH[hot_path]] == hits + 1  # (served by the hit, nested)
    assert (_agreement.checked - checked, _agreement.skipped - skipped) == (1, 0)


def test_a_returned_model_is_not_adopted_by_the_check(agreement, hot_path):
    """The check's reading takes nothing into the identity cache (a model the latest call
    returned is read from that call's record, not remembered): the routes stay as without it."""
    from fastcall import _flatten

    step = fastcall.jit(lambda m: eqx.tree_at(lambda t: t.bias, m, m.bias + 1.0))
    g = fastcall.jit(lambda m, x: m(x))
    x = jnp.ones(4)
    m0 = eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(0))
    for _ in range(2):
        g(eqx.nn.Linear(4, 3, key=jax.random.PRNGKey(1)), x)  # (a structure record for g)
    m1 = step(m0)
    m1 = step(m1)
    in_cache = id(m1) in _flatten.by_id and _flatten.by_id[id(m1)].ref() is m1
    checked = _agreement.checked
    _, route = served(g, m1, x)
    assert route == STRUCTURE_PATH[hot_path] and _agreement.checked == checked + 1
    # (the structure route reads it from the memo of returned objects, taking nothing into the cache)
    assert (id(m1) in _flatten.by_id and _flatten.by_id[id(m1)].ref() is m1) == in_cache

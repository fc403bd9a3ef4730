"""Packing (`fastcall._pack`): an object the fast path serves again unchanged passes its
small leaves packed into one buffer per dtype and device.

Each test checks the result against the eager call and the peer, that the fast path
served the call with leaves packed (`stats().packed_leaves`), and that the user's
function was traced no more often than the peer traces it; and that whatever changes the
model (a new Equinox model, a dict written in place) is seen on the next call.
"""

from __future__ import annotations

import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastcall
from fastcall import _pack
from fastcall._nnx._variables import raw_value

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, served

pytestmark = pytest.mark.usefixtures("hot_path")

X = jnp.arange(4.0)


class Block(eqx.Module):
    scale: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return jnp.tanh(x * self.scale + self.bias)


class Stack(eqx.Module):
    blocks: list
    proj: eqx.nn.Linear  # a (4, 4) matrix, passed as it is, and a bias, packed
    steps: jax.Array  # an int32 leaf: its own buffer, with its kind

    def __init__(self, key, n=6):
        keys = jax.random.split(key, 2 * n + 1)
        self.blocks = [Block(jax.random.normal(keys[2 * i], (4,)), jax.random.normal(keys[2 * i + 1], (4,))) for i in range(n)]
        self.proj = eqx.nn.Linear(4, 4, key=keys[-1])
        self.steps = jnp.arange(3, dtype=jnp.int32)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.proj(x) + self.steps.sum()


def forward(model, x):
    return model(x)


def _counting(decorator, **options):
    traces = []

    def f(model, x):
        traces.append(1)
        return model(x)

    return decorator(f, **options), traces


@pytest.mark.parametrize("decorator", [fastcall.jit, fastcall.filter_jit])
def test_a_model_called_again_is_served_packed(decorator, hot_path):
    model = Stack(jax.random.PRNGKey(0))
    f, traces = _counting(decorator)
    peer = eqx.filter_jit(forward)
    routes = []
    for _ in range(4):
        out, route = served(f, model, X)
        assert_trees_equal(out, peer(model, X))
        np.testing.assert_allclose(out, model(X), rtol=1e-6)
        routes.append(route)
    assert routes[2:] == [FAST_PATH[hot_path]] * 2
    # 6 scales and 6 biases and the Linear's bias (float32), and the int32 leaf alone: as it is
    assert f.stats().packed_leaves == 13
    assert len(traces) == 1  # the packed program reuses the entry's trace
    assert f.stats().compiles == 1


def test_pack_false_passes_every_leaf_as_it_is(hot_path):
    model = Stack(jax.random.PRNGKey(0))
    f = fastcall.jit(forward, pack=False)
    for _ in range(4):
        out, route = served(f, model, X)
        np.testing.assert_allclose(out, model(X), rtol=1e-6)
    assert route == FAST_PATH[hot_path]
    assert f.stats().packed_leaves == 0


@pytest.mark.parametrize(
    "options", [{"donate": "all-except-first"}, {"donate_argnums": 1}, {"compiler_options": {"xla_cpu_enable_fast_math": False}}]
)
def test_donation_or_placement_options_never_pack(options, hot_path):
    model = Stack(jax.random.PRNGKey(0))
    f = fastcall.jit(forward, **options)
    for _ in range(4):
        out = f(model, jnp.arange(4.0))
        np.testing.assert_allclose(out, model(X), rtol=1e-6)
    assert f.stats().packed_leaves == 0


def test_a_new_model_is_read_again_not_served_from_the_buffer(hot_path):
    model = Stack(jax.random.PRNGKey(0))
    f = fastcall.jit(forward)
    for _ in range(3):
        f(model, X)
    assert f.stats().packed_leaves > 0
    changed = eqx.tree_at(lambda m: m.blocks[2].bias, model, model.blocks[2].bias + 1.0)
    out, route = served(f, changed, X)
    assert route == STRUCTURE_PATH[hot_path]
    np.testing.assert_allclose(out, changed(X), rtol=1e-6)
    assert not np.allclose(out, model(X))
    out, _ = served(f, model, X)  # the old model, still packed, still its own result
    np.testing.assert_allclose(out, model(X), rtol=1e-6)


def test_a_params_dict_written_in_place_is_seen(hot_path):
    params = {f"b{i}": jnp.full((4,), i, dtype=jnp.float32) for i in range(5)}

    def apply(p, x):
        for i in range(5):
            x = x * 0.5 + p[f"b{i}"]
        return x

    f = fastcall.jit(apply)
    for _ in range(4):
        out, route = served(f, params, X)
    assert route == FAST_PATH[hot_path]
    assert f.stats().packed_leaves == 5
    np.testing.assert_allclose(out, apply(params, X), rtol=1e-6)
    params["b3"] = params["b3"] + 10.0  # in place: the guard sees it
    out, route = served(f, params, X)
    assert route != FAST_PATH[hot_path]
    np.testing.assert_allclose(out, apply(params, X), rtol=1e-6)
    assert_trees_equal(out, jax.jit(apply)(params, X))


def test_a_training_loop_packs_nothing():
    # each step's model is new and used once: no fast record, so no buffer built per step
    model = Stack(jax.random.PRNGKey(0))

    @fastcall.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: m(x).sum())(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

    peer = eqx.filter_jit(step.__wrapped__)
    ref = model
    for _ in range(5):
        model = step(model, X)
        ref = peer(ref, X)
    assert_trees_equal(model, ref)
    assert step.stats().packed_leaves == 0


def test_fastcall_partial_packs_its_bound_model(hot_path):
    model = Stack(jax.random.PRNGKey(1))
    serve = fastcall.partial(forward, model)
    for _ in range(4):
        out = serve(X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6)
    assert serve.stats().packed_leaves == 13
    assert serve.stats().paths[FAST_PATH[hot_path]] >= 2


def test_packed_calls_inside_an_outer_trace_and_threads(hot_path):
    model = Stack(jax.random.PRNGKey(2))
    f = fastcall.jit(forward)
    for _ in range(3):
        f(model, X)
    assert f.stats().packed_leaves > 0
    outer = jax.jit(lambda x: f(model, x) * 2)
    np.testing.assert_allclose(outer(X), 2 * model(X), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: f(model, x).sum())(X), jax.grad(lambda x: model(x).sum())(X), rtol=1e-4, atol=1e-9)
    results: list = []

    def worker(i):
        x = X + i
        results.append((i, f(model, x)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, out in results:
        np.testing.assert_allclose(out, model(X + i), rtol=1e-6)


def test_a_new_input_shape_traces_once_as_the_peer():
    model = Stack(jax.random.PRNGKey(3))
    f, traces = _counting(fastcall.filter_jit)
    peer, peer_traces = _counting(eqx.filter_jit)
    wide = jnp.arange(4, dtype=jnp.int32)  # (another dtype: another trace)
    for x in (X, X, X, wide, wide):  # `wide` first meets the packed program, which traces the entry
        assert_trees_equal(f(model, x), peer(model, x))
    other = Stack(jax.random.PRNGKey(4))  # the same structure, unpacked: that trace serves it
    for x in (X, wide):
        assert_trees_equal(f(other, x), peer(other, x))
    assert len(traces) == len(peer_traces) == 2


def test_the_rule_of_what_is_packed():
    small = jnp.ones(4)
    leaves = [
        small,  # 0: packed (float32)
        jnp.ones((2, 2)),  # 1: two dimensions: as it is
        jnp.ones(300),  # 2: over MAX_ELEMENTS: as it is
        jnp.asarray(1.0) * 1,  # 3: weakly typed: as it is
        jax.random.key(0),  # 4: a typed key: as it is
        jnp.zeros((), jnp.int32),  # 5: alone of its kind: as it is
        jnp.ones(3),  # 6: packed with 0
        jnp.float32(2.0) + jnp.zeros(()),  # 7: a 0-d float32: packed
    ]
    assert leaves[3].weak_type
    p = _pack.plan(leaves)
    assert p is not None
    assert [g.positions for g in p.groups] == [(0, 6, 7)]
    assert p.rest == (1, 2, 3, 4, 5)
    (buf,) = _pack.buffers(p, leaves)
    np.testing.assert_array_equal(buf, np.concatenate([np.ravel(leaves[i]) for i in (0, 6, 7)]))
    many = _pack.plan([jnp.ones(2) for _ in range(70)])  # (XLA compiles many slices of one buffer slowly)
    assert [len(g.positions) for g in many.groups] == [23, 23, 24]
    assert _pack.plan([small]) is None
    assert _pack.plan([small, jnp.ones((2, 2))]) is None
    assert [g.positions for g in _pack.plan(leaves, exclude=frozenset({6})).groups] == [(0, 7)]
    # an NNX record checks its packed leaves on every call: packed only where that saves more
    # than it costs (2 + n // 32 arguments)
    assert not _pack.worth_checking(_pack.plan([small, small]))
    assert _pack.worth_checking(_pack.plan([small] * 4))
    assert not _pack.worth_checking(_pack.plan([small] * 10 + [jnp.ones((2, 2))] * 290))
    assert _pack.worth_checking(_pack.plan([small] * 16 + [jnp.ones((2, 2))] * 284))


def test_an_nnx_model_of_few_small_leaves_is_not_packed_an_equinox_one_is(hot_path):
    class Two(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.ones(4))
            self.b = nnx.Param(jnp.arange(4.0))

        def __call__(self, x):
            return x * self.a[...] + self.b[...]

    class EqxTwo(eqx.Module):
        a: jax.Array
        b: jax.Array

        def __call__(self, x):
            return x * self.a + self.b

    model, peer = Two(), Two()
    f = fastcall.jit(forward)
    for _ in range(4):
        out, route = served(f, model, X)
        assert_trees_equal(out, nnx.jit(forward)(peer, X))
    assert route == FAST_PATH[hot_path]
    assert f.stats().packed_leaves == 0
    g = fastcall.jit(lambda m, x: m(x))
    eqx_model = EqxTwo(jnp.ones(4), jnp.arange(4.0))
    for _ in range(4):
        out, route = served(g, eqx_model, X)
        assert_trees_equal(out, eqx_model(X))
    assert route == FAST_PATH[hot_path]
    assert g.stats().packed_leaves == 2


def test_the_agreement_mode_checks_packed_calls(monkeypatch, hot_path):
    from fastcall import _agreement

    monkeypatch.setattr(_agreement, "ENABLED", True)
    model = Stack(jax.random.PRNGKey(4))
    f = fastcall.jit(forward)
    before = _agreement.checked
    for _ in range(4):
        out = f(model, X)
    np.testing.assert_allclose(out, model(X), rtol=1e-6)
    assert f.stats().packed_leaves > 0
    assert _agreement.checked - before == f.stats().paths[FAST_PATH[hot_path]] >= 2


def test_explain_and_stats_tell_what_is_packed():
    model = Stack(jax.random.PRNGKey(5))
    f = fastcall.jit(forward)
    for _ in range(3):
        f(model, X)
    report = f.explain(model, X)
    assert report.route == "fast"
    assert "13 of its 15 leaves passed packed in 1 buffer" in report.arguments[0].per_call
    unpacked = fastcall.jit(lambda m, x: m(x), pack=False)
    for _ in range(3):
        unpacked(model, X)
    assert "packed" not in unpacked.explain(model, X).arguments[0].per_call


# ---- NNX: Variable values are read on every call; packed ones are compared by identity ----

from flax import nnx  # noqa: E402


class NnxBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.table = nnx.data(jnp.arange(float(d)))  # a raw array attribute, small: packed too
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.proj(self.norm(x)) + self.table))


class NnxStack(nnx.Module):
    def __init__(self, n=3, d=4, seed=0):
        rngs = nnx.Rngs(seed)
        self.blocks = nnx.List([NnxBlock(d, rngs) for _ in range(n)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _values(model):
    """An NNX model's state, its PRNG keys as their data (comparable)."""
    return jax.tree_util.tree_map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, nnx.state(model)
    )


def _nnx_pair(seed=0):
    model, peer = NnxStack(seed=seed), NnxStack(seed=seed)
    model.eval()
    peer.eval()
    return model, peer


def test_an_nnx_model_called_again_is_served_packed(hot_path):
    model, peer = _nnx_pair()
    f, traces = _counting(fastcall.jit)
    g = nnx.jit(forward)
    for _ in range(4):
        out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
    assert route == FAST_PATH[hot_path]
    # per block: the norm's scale and bias, the bias, the table (float32); the dropouts' stream
    # counts (uint32, a buffer of their own); not the kernels nor the streams' keys
    assert f.stats().packed_leaves == 15
    assert len(traces) == 1
    assert "15 of its 21 leaves passed packed in 2 buffers" in f.explain(model, X).arguments[0].per_call


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.blocks[1].norm.bias.__setitem__(..., m.blocks[1].norm.bias[...] + 1.0),  # in place
        lambda m: setattr(m.blocks[2], "table", m.blocks[2].table + 1.0),  # a raw array rebound
        lambda m: setattr(m.blocks[0].proj, "bias", nnx.Param(jnp.ones(4))),  # a Variable replaced
        lambda m: nnx.update(m, jax.tree_util.tree_map(lambda v: v * 2, nnx.state(m, nnx.Param))),  # made outside
        lambda m: m.train(),  # a static flip: dropout on
    ],
    ids=["in-place", "raw-array", "replaced-variable", "nnx-update", "train"],
)
def test_a_change_to_a_packed_nnx_model_is_seen(change, hot_path):
    model, peer = _nnx_pair()
    f = fastcall.jit(forward)
    g = nnx.jit(forward)
    for _ in range(3):
        assert_trees_equal(f(model, X), g(peer, X))
    assert f.stats().packed_leaves > 0
    for _ in range(3):  # a change, then the same model again (and again: the record gives up packing)
        change(model)
        change(peer)
        assert_trees_equal(f(model, X), g(peer, X))
        assert_trees_equal(_values(model), _values(peer))


def test_an_nnx_model_given_new_weights_now_and_then_is_packed_again(hot_path):
    # an inference server loading new weights (made outside: `nnx.update`) between long runs of
    # calls: each load packs the model again, where a change soon after packing would count
    # towards giving up
    model, peer = _nnx_pair()
    f, traces = _counting(fastcall.jit)
    g = nnx.jit(forward)
    for load in range(3):
        for _ in range(_pack.REPACK_AFTER + 4):  # (noted at the 2nd call, packed at the 3rd)
            out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
        assert route == FAST_PATH[hot_path]
        assert f.stats().packed_leaves == 15 * (load + 1)
        assert "15 of its 21 leaves passed packed in 2 buffers" in f.explain(model, X).arguments[0].per_call
        for m in (model, peer):
            nnx.update(m, jax.tree_util.tree_map(lambda v: v + 1.0, nnx.state(m, nnx.Param)))
        assert_trees_equal(f(model, X), g(peer, X))  # (the first call after the load packs again)
    assert f.stats().packed_leaves == 15 * 4
    assert len(traces) == 1
    # the same load soon after: the leaves it changes (the Params) are passed as they are from
    # then on; the others (the tables, the streams' counts) are packed anew, once
    for _ in range(3):
        for m in (model, peer):
            nnx.update(m, jax.tree_util.tree_map(lambda v: v * 0.5, nnx.state(m, nnx.Param)))
        out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
        assert route == FAST_PATH[hot_path]
    assert f.stats().packed_leaves == 15 * 4 + 6
    assert "6 of its 21 leaves passed packed in 2 buffers" in f.explain(model, X).arguments[0].per_call
    assert len(traces) == 1
    assert_trees_equal(_values(model), _values(peer))


def test_new_weights_first_seen_inside_an_outer_trace_are_packed_at_the_top_level(hot_path):
    model, peer = _nnx_pair()
    f, g = fastcall.jit(forward), nnx.jit(forward)
    for _ in range(_pack.REPACK_AFTER + 4):  # (noted at the 2nd call, packed at the 3rd)
        f(model, X)
    for m in (model, peer):
        nnx.update(m, jax.tree_util.tree_map(lambda v: v + 1.0, nnx.state(m, nnx.Param)))
    # (buffers built there would be tracers: the call runs on the leaves as they are)
    assert_trees_equal(jax.jit(lambda: f(model, X))(), g(peer, X))
    assert f.stats().packed_leaves == 15
    out, route = served(f, model, X)
    assert_trees_equal(out, g(peer, X))
    assert route == FAST_PATH[hot_path]
    assert f.stats().packed_leaves == 30
    assert_trees_equal(f(model, X), g(peer, X))


def test_an_nnx_training_step_passes_what_it_trains_as_it_is_and_matches_nnx_jit(hot_path):
    model, peer = NnxStack(seed=1), NnxStack(seed=1)

    def step(m, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)
        nnx.update(m, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
        return loss

    f, g = fastcall.jit(step), nnx.jit(step)
    for _ in range(6):
        assert_trees_equal(f(model, X), g(peer, X))
    assert_trees_equal(_values(model), _values(peer))
    assert f.stats().paths[FAST_PATH[hot_path]] >= 4
    # (the Params and the dropout streams' counts change every step: seen changing between
    # the first two fast calls, never packed; the tables, which no step changes, are)
    assert "3 of its 21 leaves passed packed in 1 buffer" in f.explain(model, X).arguments[0].per_call
    assert f.stats().packed_leaves == 3


def test_a_training_step_that_changes_every_small_leaf_compiles_no_packed_program(monkeypatch, hot_path):
    built = []
    real = _pack.packed_program
    monkeypatch.setattr(_pack, "packed_program", lambda *a: built.append(a[1]) or real(*a))
    model, peer = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    model.bias[...] = jnp.arange(4.0)
    peer.bias[...] = jnp.arange(4.0)
    for m in (model, peer):  # (with the bias, 4 small leaves of a kind: worth packing)
        m.extra = nnx.List([nnx.Param(jnp.full(4, float(i), jnp.float32)) for i in range(3)])

    def step(m, x):
        grads = nnx.grad(lambda m: (m(x) * m.extra[0][...] * m.extra[1][...] * m.extra[2][...]).sum())(m)
        nnx.update(m, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
        return m.bias[...]

    f, g = fastcall.jit(step), nnx.jit(step)
    for _ in range(6):
        out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
    assert route == FAST_PATH[hot_path]
    assert_trees_equal(_values(model), _values(peer))
    assert f.stats().packed_leaves == 0 and built == []


def _write_bias(m, k):
    b = m.blocks[k].norm.bias
    b[...] = b[...] + 1.0


def test_early_changes_of_other_leaves_leave_the_rest_packed_until_the_third(hot_path):
    model, peer = _nnx_pair()
    f, g = fastcall.jit(forward), nnx.jit(forward)
    for _ in range(4):
        f(model, X)
    packed = []
    for k in range(3):  # (a write to another leaf each time, soon after packing)
        for m in (model, peer):
            _write_bias(m, k)
        out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
        assert route == FAST_PATH[hot_path]
        packed.append(f.explain(model, X).arguments[0].per_call.split("; ")[-1])
    assert packed[0].startswith("14 of its 21 leaves passed packed")
    assert packed[1].startswith("13 of its 21 leaves passed packed")
    assert "packed" not in packed[2]  # (the third: every leaf passed as it is, for good)
    for m in (model, peer):
        _write_bias(m, 0)
    assert_trees_equal(f(model, X), g(peer, X))
    assert_trees_equal(_values(model), _values(peer))


@pytest.mark.parametrize("k, packed", [(_pack.REPACK_AFTER - 1, 14), (_pack.REPACK_AFTER, 15)], ids=["early", "late"])
def test_a_change_after_repack_after_calls_packs_the_same_leaves_again(k, packed, hot_path):
    model, peer = _nnx_pair()
    f, g = fastcall.jit(forward), nnx.jit(forward)
    for _ in range(2 + k):  # (the call that packs, the third, is served packed: k in all)
        f(model, X)
    for m in (model, peer):
        _write_bias(m, 0)
    assert_trees_equal(f(model, X), g(peer, X))
    assert f.explain(model, X).arguments[0].per_call.split("; ")[-1].startswith(f"{packed} of its 21 leaves passed packed")


def test_an_early_change_first_seen_inside_a_trace_is_counted_once(hot_path):
    model, peer = _nnx_pair()
    f, g = fastcall.jit(forward), nnx.jit(forward)
    for _ in range(4):
        f(model, X)
    for m in (model, peer):
        _write_bias(m, 0)
    # (three calls inside an outer trace see the write; it is counted when acted on, at the top level)
    assert_trees_equal(jax.jit(lambda: f(model, X) + f(model, X) + f(model, X))(), 3 * g(peer, X))
    assert_trees_equal(f(model, X), g(peer, X))
    assert f.explain(model, X).arguments[0].per_call.split("; ")[-1].startswith("14 of its 21 leaves passed packed")


def test_the_call_that_packs_runs_the_packed_program(monkeypatch, hot_path):
    runs = []
    real = _pack.packed_program

    def counting(entry, plan):
        program = real(entry, plan)
        return lambda *a: runs.append(1) or program(*a)

    monkeypatch.setattr(_pack, "packed_program", counting)
    model, peer = _nnx_pair(1)
    f = fastcall.jit(forward)
    f(model, X), f(model, X)  # (the general path; the first fast call notes the leaves)
    assert runs == []
    assert_trees_equal(f(model, X), nnx.jit(forward)(peer, X))  # (packs, and runs packed: it compiles here)
    assert runs == [1]


class CountingStack(nnx.Module):
    """A decoder-like model: small weights that do not change, and two step counters (int32,
    one kind: packed together) written on every call."""

    def __init__(self):
        self.stack = NnxStack(seed=3)
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))
        self.tokens = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.steps[...] += 1
        self.tokens[...] += 2
        return self.stack(x) + self.steps[...]


def test_counters_written_every_call_leave_the_other_leaves_packed(hot_path):
    model, peer = CountingStack(), CountingStack()
    model.eval()
    peer.eval()
    f, traces = _counting(fastcall.jit)
    g = nnx.jit(forward)
    for _ in range(8):
        out, route = served(f, model, X)
        assert_trees_equal(out, g(peer, X))
    assert route == FAST_PATH[hot_path]
    assert_trees_equal(_values(model), _values(peer))
    # the small leaves noted at the second call, packed at the third but for the counters,
    # which changed in between
    assert f.stats().packed_leaves == 15
    assert "15 of its 23 leaves passed packed in 2 buffers" in f.explain(model, X).arguments[0].per_call
    assert len(traces) == 1


def test_a_packed_nnx_model_under_an_nnx_transform(hot_path):
    model, peer = _nnx_pair()
    f = fastcall.jit(forward)
    for _ in range(3):
        f(model, X)
    batch = jnp.stack([X, X + 1.0])
    out = nnx.vmap(lambda m, x: f(m, x), in_axes=(None, 0))(model, batch)
    ref = nnx.vmap(lambda m, x: nnx.jit(forward)(m, x), in_axes=(None, 0))(peer, batch)
    assert_trees_equal(out, ref)
    assert_trees_equal(f(model, X), nnx.jit(forward)(peer, X))


def test_nnx_agreement_mode_checks_packed_calls(monkeypatch, hot_path):
    from fastcall import _agreement

    monkeypatch.setattr(_agreement, "ENABLED", True)
    model, peer = _nnx_pair()
    f = fastcall.jit(forward)
    before = _agreement.checked
    for _ in range(4):
        assert_trees_equal(f(model, X), nnx.jit(forward)(peer, X))
    assert f.stats().packed_leaves > 0
    assert _agreement.checked - before == f.stats().paths[FAST_PATH[hot_path]] >= 2


def test_objects_used_once_build_no_buffers(hot_path):
    # a module merged each step, and an Equinox model a step returns and passes back: each gets
    # a fast record, never used; packing waits for a record's first use
    model = NnxStack(seed=2)
    model.eval()
    graphdef, params = nnx.split(model)
    f = fastcall.jit(forward)
    for _ in range(5):
        out = f(nnx.merge(graphdef, params), X)
    assert_trees_equal(out, nnx.jit(forward)(nnx.merge(graphdef, params), X))
    assert f.stats().packed_leaves == 0

    @fastcall.filter_jit
    def step(m, x):
        return eqx.apply_updates(m, jax.tree_util.tree_map(lambda g: 0.01 * g, eqx.filter_grad(lambda m: m(x).sum())(m)))

    eqx_model = Stack(jax.random.PRNGKey(6))
    for _ in range(5):
        eqx_model = step(eqx_model, X)
    assert step.stats().packed_leaves == 0


@pytest.mark.parametrize("kind", ["eqx", "nnx"])
@pytest.mark.parametrize(
    "inside",
    [
        lambda f, m: jax.eval_shape(lambda: f(m, X)),
        lambda f, m: jax.jit(lambda: f(m, X))(),
        lambda f, m: jax.lax.scan(lambda c, _: (c + f(m, X), None), jnp.zeros(4), None, length=2),
    ],
    ids=["eval_shape", "jit", "scan"],
)
def test_a_first_fast_call_inside_a_trace_packs_nothing_there(kind, inside, hot_path):
    # (the buffers built inside would be tracers, kept by the record: every later call would fail)
    if kind == "eqx":
        model = Stack(jax.random.PRNGKey(7))
        expected = model(X)
    else:
        model, peer = _nnx_pair(seed=3)
        expected = nnx.jit(forward)(peer, X)
    f = fastcall.jit(forward)
    for _ in range(2 if kind == "eqx" else 1):
        f(model, X)  # (its fast record is made; not used yet)
    inside(f, model)
    assert f.stats().packed_leaves == 0
    for _ in range(3):
        assert_trees_equal(f(model, X), expected)
    assert f.stats().packed_leaves > 0  # (at the top level)
    inside(f, model)
    assert_trees_equal(f(model, X), expected)


def test_no_packing_under_a_mesh_context(hot_path):
    set_mesh = getattr(jax, "set_mesh", None)
    if set_mesh is None:
        pytest.skip("jax.set_mesh needs a newer jax")
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))  # (jax 0.8.1 warns without)
    model = Stack(jax.random.PRNGKey(8))
    results = {}
    for pack in (True, False):
        f, traces = _counting(fastcall.jit, pack=pack)
        with set_mesh(mesh):
            for _ in range(5):
                out = f(model, X)
        results[pack] = (len(traces), f.stats().packed_leaves)
        np.testing.assert_allclose(out, model(X), rtol=1e-6)
    assert results == {True: (1, 0), False: (1, 0)}


def test_a_dead_models_records_and_leaves_are_freed_without_garbage_collection(hot_path):
    # (a record that would pack on first use holds nothing that holds it: no reference cycle
    # keeps a dead model's leaves, bound to its record, alive until the next collection)
    import gc
    import weakref

    f = fastcall.jit(forward)
    alive = []
    gc.disable()
    try:
        for i in range(4):
            model = Stack(jax.random.PRNGKey(10 + i))
            f(model, X)
            f(model, X)  # (its record is made: used never, or once)
            if i % 2:
                f(model, X)
            alive.append(weakref.ref(model.blocks[0].bias))
            del model
        for i in range(4):
            nnx_model = NnxStack(seed=10 + i)
            for _ in range(1 + i % 3):
                f(nnx_model, X)
            alive.append(weakref.ref(raw_value(nnx_model.blocks[0].norm.bias)))
            del nnx_model
        assert [r() is None for r in alive] == [True] * 8
    finally:
        gc.enable()

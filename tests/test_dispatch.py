"""The call route: which path serves a call (C fast, Python fast, general), the same
results and counts whichever it is, and the records the C path reads."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fastcall

from .conftest import FAST_PATH, STRUCTURE_PATH, assert_trees_equal, served, served_exactly

pytestmark = pytest.mark.usefixtures("hot_path")


def forward(m, x):
    return m(x)


def test_same_equinox_model_takes_the_fast_path(hot_path):
    m = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(forward)
    x = jnp.ones(4)
    out, path = served_exactly(f, m, x)
    assert path == "general_read"  # first call: read whole, compiled, cached by identity
    out, path = served_exactly(f, m, x)
    assert path == "general_cached"  # seen before: its fast record is installed now
    out2, path2 = served(f, m, x)
    assert path2 == FAST_PATH[hot_path]
    assert_trees_equal(out2, m(x))
    assert_trees_equal(out2, eqx.filter_jit(forward)(m, x))
    # Another model of the same structure is a new object: the structure path serves it;
    # passed again, it is cached by identity (general, read by its structure's extractor,
    # then found in the cache), then served fast.
    m2 = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(1))
    out3, path3 = served(f, m2, x)
    assert path3 == STRUCTURE_PATH[hot_path]
    assert_trees_equal(out3, m2(x))
    assert [served_exactly(f, m2, x)[1] for _ in range(2)] == ["general_cached", "general_cached"]
    out4, path4 = served(f, m2, x)
    assert path4 == FAST_PATH[hot_path]
    assert_trees_equal(out4, m2(x))


def test_fast_path_needs_plain_array_arguments(hot_path):
    m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x, scale: m(x) * scale)
    x = jnp.ones(2)
    served(f, m, x, 2.0)
    assert served(f, m, x, 2.0)[1] == "general"  # a Python scalar is not a plain array
    assert served(f, m, x, scale=2.0)[1] == "general"  # keyword arguments
    assert_trees_equal(f(m, x, 3.0), m(x) * 3.0)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_nnx_fast_path_reads_values_and_writes_state_back(hot_path):
    ours, theirs = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
    f, g = fastcall.jit(forward), nnx.jit(forward)
    x = jnp.arange(6.0).reshape(2, 3)
    paths = []
    for i in range(3):
        y, path = served_exactly(f, ours, x + i)
        paths.append(path)
        assert_trees_equal(y, g(theirs, x + i))
        assert_trees_equal(nnx.state(ours), nnx.state(theirs))
    assert paths == ["general_read", FAST_PATH[hot_path], FAST_PATH[hot_path]]
    # A value changed outside is read by the fast path.
    ours.lin.kernel[...] = ours.lin.kernel[...] * 2
    theirs.lin.kernel[...] = theirs.lin.kernel[...] * 2
    y, path = served(f, ours, x)
    assert path == FAST_PATH[hot_path]
    assert_trees_equal(y, g(theirs, x))
    # A structure change sends the next call to the general path, which reads the graph
    # again; then fast again.
    ours.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(5))
    theirs.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(5))
    y, path = served_exactly(f, ours, x)
    assert path == "general_read"
    assert_trees_equal(y, g(theirs, x))
    y, path = served(f, ours, x)
    assert path == FAST_PATH[hot_path]
    assert_trees_equal(y, g(theirs, x))
    ours.eval()  # a static attribute: another compiled program (its first time: read again)
    theirs.eval()
    y, path = served_exactly(f, ours, x)
    assert path == "general_read"
    assert_trees_equal(y, g(theirs, x))
    ours.train()  # back to the variant read before: switched to, not read
    theirs.train()
    y, path = served_exactly(f, ours, x)
    assert path == "general_cached"
    assert_trees_equal(y, g(theirs, x))


def test_stats_count_the_same_whichever_path_serves(monkeypatch):
    """The same call sequence, through the C path and through Python, counts the same:
    an output structure that varies, a failing call, and plain hits."""
    from fastcall import _native

    def sequence():
        fastcall.clear_caches()

        def f(m, x):
            # The output structure depends on the input shape: varies after the first.
            return m(x) if x.shape[0] == 2 else (m(x[:2]), x)

        w = fastcall.jit(f)
        m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))
        w(m, jnp.ones(2))
        w(m, jnp.ones(2))
        w(m, jnp.ones(3))
        w(m, jnp.ones(2))
        deleted = jnp.ones(2)
        deleted.delete()
        with pytest.raises(fastcall.FastcallError, match="deleted"):
            w(m, deleted)
        w(m, jnp.ones(2))
        s = w.stats()
        return s.calls, s.compiles, s.hits, sum(s.paths.values())

    c = sequence()
    monkeypatch.setattr(_native, "ACCEL", None)
    python = sequence()
    assert c == python
    assert c[0] == c[3] == 6


def test_disable_accel_environment_variable():
    code = (
        "import jax, jax.numpy as jnp, equinox as eqx, fastcall\n"
        "f = fastcall.jit(lambda m, x: m(x))\n"
        "m = eqx.nn.Linear(2, 2, key=jax.random.PRNGKey(0))\n"
        "f(m, jnp.ones(2)); f(m, jnp.ones(2)); f(m, jnp.ones(2))\n"
        "print(type(f).__name__, f.stats().paths['c_fast'] + f.stats().paths['python_fast'])\n"
    )
    env = dict(os.environ, FASTCALL_DISABLE_ACCEL="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    # (the C extension off: the Python wrapper, in front of the same fast route)
    assert out.stdout.split() == ["function", "1"]


def test_the_hit_routes_check_the_record_layout():
    """The compiled routes read records by position: each record's fields are checked, at
    import, against the order they are read in, so that a changed layout fails loudly."""
    from fastcall import _structure_route

    for cls, fields in _structure_route.LAYOUTS.items():
        assert cls._fields == fields
        name = cls.__name__
        for wrong_fields, match in [((*fields[:-1], "other"), f"{name} field {len(fields) - 1} is 'other'"),
                                    ((*fields, "extra"), f"{name} has {len(fields) + 1} fields")]:
            with pytest.raises(TypeError, match=match):
                _structure_route.check_layout(collections.namedtuple(name, wrong_fields), fields)


def test_c_wrapper_checks_the_routes_entries():
    from fastcall import _dispatch, _fast_route, _native, _structure_route

    if _native.BUILT is None:
        pytest.skip("the C accelerator is not built")
    # (the C entries: capsules, or None where their module runs as Python)
    entries = (_fast_route.SERVE, _structure_route.SERVE)
    assert all(e is None or type(e).__name__ == "PyCapsule" for e in entries)
    try:
        for at in (0, 1):
            wrong = [*entries[:at], "not the entry", *entries[at + 1 :]]
            with pytest.raises(ValueError, match="PyCapsule"):
                _native.BUILT.configure(*wrong, _fast_route.DECLINED)
    finally:
        _dispatch.configure_accel()
    f = fastcall.jit(lambda x: x + 1)
    assert int(f(jnp.ones(()))) == 2


class _WithSet(nnx.Module):
    """A mutable static attribute holding a set, which no guard watches: read every call."""

    def __init__(self):
        self.config = {"scale": 2.0, "tags": {"a"}}
        self.w = nnx.Param(jnp.arange(3.0))

    def __call__(self, x):
        return self.w[...] * x * self.config["scale"]


def test_general_calls_that_read_an_argument_whole_are_counted_apart(hot_path, monkeypatch):
    """`paths["general_read"]` counts the general path's calls that read an argument whole
    (NNX's graph walk, jax's flatten); `"general_cached"` those served from the caches. A
    call for which fastcall built a new entry for the model counts as read; one counted
    cached built none."""
    from fastcall._nnx import _entries

    builds = []
    original = _entries._build
    monkeypatch.setattr(_entries, "_build", lambda *a: builds.append(a[0]) or original(*a))

    def route(f, *args):
        before = len(builds)
        out, path = served_exactly(f, *args)
        if len(builds) > before:
            assert path == "general_read"
        if path == "general_cached":
            assert len(builds) == before
        return out, path

    ours, theirs = Block(nnx.Rngs(0)), Block(nnx.Rngs(0))
    f, g = fastcall.jit(forward), nnx.jit(forward)
    x = jnp.arange(6.0).reshape(2, 3)
    seen = []
    for step in range(8):
        if step == 2:  # a structure change: read again
            ours.extra = theirs.extra = nnx.Param(jnp.ones(3))
        if step == 4:  # nnx.jit rebuilds the model in place: checked (in Python), not read again
            g(ours, x)
            g(theirs, x)
        if step == 6:  # a new variant: read; back to the old one: switched to, not read
            ours.eval(), theirs.eval()
        if step == 7:
            ours.train(), theirs.train()
        y, path = route(f, ours, x)
        seen.append(path)
        assert_trees_equal(y, g(theirs, x))
        assert_trees_equal(nnx.state(ours), nnx.state(theirs))
    fast = FAST_PATH[hot_path]
    assert seen == [
        "general_read", fast, "general_read", fast, fast, fast, "general_read", "general_cached"
    ], seen
    assert builds == [ours] * 3  # (the three calls read whole built its entry: the patch is reached)
    # A module the caches cannot hold (a set among its statics) is read on every call.
    h, peer = fastcall.jit(lambda m, x: m(x)), nnx.jit(forward)  # (h: stats of its own)
    m, twin = _WithSet(), _WithSet()
    for _ in range(3):
        y, path = route(h, m, jnp.ones(3))
        assert path == "general_read"
        assert_trees_equal(y, peer(twin, jnp.ones(3)))
    assert h.stats().paths["general_read"] == 3


def test_an_equinox_list_changed_in_place_is_counted_as_read_again(hot_path):
    """An Equinox model holding a list: its first call reads it whole, and so does its
    second, which flattens it once more to take the guard over its list; a list changed in
    place between calls (the guard fails) is read whole again, the same way, then the fast
    path serves it again; a list grown in place is a structure not seen: read whole."""

    class Net(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    m = Net([eqx.nn.Linear(3, 3, key=keys[0]), eqx.nn.Linear(3, 3, key=keys[1])])
    f, peer = fastcall.jit(forward), eqx.filter_jit(forward)
    x = jnp.ones(3)
    routes = [served_exactly(f, m, x)[1] for _ in range(3)]
    assert routes == ["general_read", "general_read", FAST_PATH[hot_path]]
    m.layers[0] = eqx.nn.Linear(3, 3, key=keys[2])
    routes = []
    for _ in range(2):
        y, path = served_exactly(f, m, x)
        routes.append(path)
        assert_trees_equal(y, peer(m, x))
        assert_trees_equal(y, m(x))
    assert routes == ["general_read", FAST_PATH[hot_path]]
    m.layers.append(eqx.nn.Linear(3, 3, key=keys[0]))
    y, path = served_exactly(f, m, x)
    assert path == "general_read"
    assert_trees_equal(y, peer(m, x))
    assert_trees_equal(y, m(x))


def test_a_read_in_another_thread_is_not_counted_as_this_calls(hot_path, monkeypatch):
    """Reads are counted per thread: a call served from the caches while another thread
    reads a model whole (here, inside this call's resolving) still counts as cached."""
    import threading

    from fastcall import _args

    m = eqx.nn.Linear(3, 3, key=jax.random.PRNGKey(0))
    other = fastcall.jit(lambda m, x: m(x))  # (called in the other thread on new NNX models)
    x = jnp.ones(3)
    fastcall.jit(forward)(m, x)  # (`m` read and cached by identity)
    original = _args.resolve_call

    def resolve_while_another_thread_reads(*a):
        monkeypatch.setattr(_args, "resolve_call", original)  # (once: the other thread's call resolves as usual)
        t = threading.Thread(target=other, args=(nnx.Linear(3, 3, rngs=nnx.Rngs(1)), x))
        t.start()
        t.join()
        return original(*a)

    g = fastcall.jit(lambda m, x: m(x) * 2.0)
    monkeypatch.setattr(_args, "resolve_call", resolve_while_another_thread_reads)
    y, path = served_exactly(g, m, x)  # (its first call: the general path, `m` from the cache)
    assert path == "general_cached"
    assert_trees_equal(y, m(x) * 2.0)
    assert other.stats().paths["general_read"] == 1


def test_containers_and_states_flattened_every_call_are_counted_as_read(hot_path, monkeypatch):
    """An NNX model in a tuple beside an array, passed again (the tuple is flattened each
    call, the model taken from its cache entry: after the first call, by the structure
    path's MixedRead), and a new `nnx.split` State each call (read by jax's flatten, as
    jax.jit reads it): each such call on the general path counts as `"general_read"`, with
    the model's graph read only at the first call."""
    from fastcall._nnx import _entries

    builds = []
    original = _entries._build
    monkeypatch.setattr(_entries, "_build", lambda *a: builds.append(a[0]) or original(*a))
    m, twin = nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    x = jnp.arange(3.0)
    pair = (m, x)
    f, peer = fastcall.jit(lambda p, x: p[0](x) + p[1]), nnx.jit(lambda p, x: p[0](x) + p[1])
    paths = []
    for _ in range(3):
        y, path = served_exactly(f, pair, x)
        paths.append(path)
        assert_trees_equal(y, peer((twin, x), x))
    assert paths == ["general_read", STRUCTURE_PATH[hot_path], STRUCTURE_PATH[hot_path]]
    assert builds == [m]
    builds.clear()
    h = fastcall.jit(lambda state, x: state["kernel"][...] @ x + state["bias"][...])
    h_peer = jax.jit(lambda state, x: state["kernel"][...] @ x + state["bias"][...])
    for _ in range(3):
        state = nnx.split(m)[1]
        y, path = served_exactly(h, state, x)
        assert path == "general_read"
        assert_trees_equal(y, h_peer(state, x))
    assert len(builds) <= 1  # (a State's first read builds its entry; later ones are flattened)


@jax.tree_util.register_pytree_node_class
class _Pair:
    """A pytree node type of its own (read by jax's flatten, as jax.jit reads it)."""

    def __init__(self, w, b):
        self.w, self.b = w, b

    def tree_flatten(self):
        return (self.w, self.b), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_every_whole_flatten_on_the_general_path_is_counted_as_read(hot_path):
    """Each of the general path's other whole flattens counts the call as read: a params
    dict's second call (held for the fast path, under a guard its flatten takes); a pytree
    node type of its own, read by jax's flatten on a function's first call although another
    function has read it before; a GraphDef not seen before, flattened to its spec."""
    x = jnp.arange(3.0)
    params = {"w": x, "b": x + 1}
    f = fastcall.jit(lambda p, x: p["w"] * x + p["b"])
    routes = [served_exactly(f, params, x)[1] for _ in range(3)]
    assert routes == ["general_read", "general_read", FAST_PATH[hot_path]]
    assert_trees_equal(f(params, x), jax.jit(lambda p, x: p["w"] * x + p["b"])(params, x))

    pair = _Pair(x, x + 1)
    fastcall.jit(lambda p, x: p.w * x)(pair, x)  # (its structure learned by another function)
    g = fastcall.jit(lambda p, x: p.w - p.b * x)
    y, path = served_exactly(g, pair, x)
    assert path == "general_read"
    assert_trees_equal(y, jax.jit(lambda p, x: p.w - p.b * x)(pair, x))

    m = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)
    h = fastcall.jit(lambda g, s, x: nnx.merge(g, s)(x))
    routes = []
    for _ in range(2):
        y, path = served_exactly(h, nnx.graphdef(m), state, x)  # (a new GraphDef object each call)
        routes.append(path)
        assert_trees_equal(y, m(x))
    assert routes == ["general_read", "general_read"]


def _nested_code(name: str):
    """The code object of `make_wrapper`'s inner function `name`."""
    from fastcall import _dispatch

    (code,) = [c for c in _dispatch.make_wrapper.__code__.co_consts if getattr(c, "co_name", None) == name]
    return code


def test_a_miss_goes_to_the_general_path_once_not_through_the_routes_again():
    """A call both hit routes decline reaches the general path through `miss`: from the C
    wrapper, without the Python wrapper trying the two routes a second time."""
    from fastcall import _native

    if _native.ACCEL is None:  # (under hot_path "python", or not built)
        pytest.skip("about the C wrapper, which this run does not use")
    f = fastcall.jit(lambda x: jax.tree_util.tree_map(lambda v: v * 2, x))
    x = jnp.ones(3)
    f(x)
    wrapper, miss = _nested_code("wrapper"), _nested_code("miss")
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in (wrapper, miss):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        out = f({"a": x})  # (no record of a dict first: both routes decline)
    finally:
        sys.setprofile(None)
    assert entered == ["miss"]
    assert_trees_equal(out, {"a": x * 2})
    assert f.stats().paths["general_cached"] + f.stats().paths["general_read"] == 2


def test_a_plan_is_served_only_by_the_route_of_the_place_it_is_filed_in(hot_path):
    """A call plan in the fast index reads no argument (`reads` None); one in the function's
    table reads every one. Each route declines a plan of the other kind, should one be found
    in its place, and the call is served by the general path, right."""
    from fastcall import _plan

    m = eqx.nn.MLP(4, 3, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(forward)
    x = jnp.ones(4)
    for _ in range(3):
        f(m, x)
    _, path = served(f, m, x)
    assert path == FAST_PATH[hot_path]
    state = f._fastcall_state
    records = _plan.INDEX[id(m)].records
    fast_plan, table_plan = records[state], state.structures[type(m)]
    assert fast_plan.reads is None and table_plan.reads is not None  # (not vacuous)
    records[state], state.structures[type(m)] = table_plan, fast_plan
    out, path = served(f, m, x)
    assert path == "general"
    assert_trees_equal(out, m(x))
    assert_trees_equal(out, eqx.filter_jit(forward)(m, x))

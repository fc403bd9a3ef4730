"""NNX arguments that share nodes or Variables, read jointly on the structure path.

`train_step(model, optimizer, x, y)` with `nnx.ModelAndOptimizer` (which holds the model, as
flax's machine translation and diffusion examples write it), `f(outer, outer.inner, x)`,
`f(m, m, x)`: the general path flattens such arguments together, as nnx.jit does, so each
shared Variable is passed once. Its structure record then pins every NNX argument's cache
entry (`_plan.JointRead`): a later call with the same objects, unchanged, is read from those
entries, each passing the leaves the joint flatten gave it. Any change that could move what
is shared (a submodule or Variable replaced, a static flipped, a list in the graph changed
in place, other objects) declines to the general path.

Each test checks values, returned objects and the state written back against nnx.jit (and
the eager call), and the route that served the call, through the C path and the Python one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fastcall

from .conftest import STRUCTURE_PATH, assert_trees_equal, served, state_of

pytestmark = pytest.mark.usefixtures("hot_path")

X = jnp.arange(8.0).reshape(2, 4) / 8
Y = jnp.ones((2, 4))


class Net(nnx.Module):
    def __init__(self, rngs, raw=False):
        self.l1 = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.l2 = nnx.Linear(4, 4, rngs=rngs)
        self.calls = nnx.data(jnp.zeros(())) if raw else None

    def __call__(self, x):
        if self.calls is not None:
            self.calls = self.calls + 1.0  # (a raw array leaf rebound inside)
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


class Outer(nnx.Module):
    def __init__(self, rngs, raw=False):
        self.inner = Net(rngs, raw)
        self.scale = nnx.Param(jnp.full((4,), 2.0))
        self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))


def _train_step(model, optimizer, x, y):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(grads)
    return loss


def _pair():
    model = Net(nnx.Rngs(0))
    return model, nnx.ModelAndOptimizer(model, optax.adam(1e-2))


def _outer_inner(outer, inner, x):
    outer.count[...] += 1
    return inner(x) * outer.scale[...]


def _same_state(ours, theirs):
    assert_trees_equal(state_of(ours), state_of(theirs))


def _outer_and_inner(f, peer, ours, theirs, n):
    """`n` calls f(outer, outer.inner, X), each checked against the peer's on the twins
    (values and state); the routes that served them."""
    routes = []
    for _ in range(n):
        y, route = served(f, ours, ours.inner, X)
        routes.append(route)
        assert_trees_equal(y, peer(theirs, theirs.inner, X))
        _same_state(ours, theirs)
    return routes


def test_model_and_optimizer_train_step(hot_path):
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    (eager_m, eager_opt) = _pair()
    f, peer = fastcall.jit(_train_step), nnx.jit(_train_step)
    routes = []
    for _ in range(5):
        loss, route = served(f, m, opt, X, Y)
        routes.append(route)
        assert_trees_equal(loss, peer(ref_m, ref_opt, X, Y))
        np.testing.assert_allclose(loss, _train_step(eager_m, eager_opt, X, Y), rtol=1e-4)  # (eager: rounding)
        _same_state(m, ref_m)
        _same_state(opt, ref_opt)
    assert opt.model is m  # (still one model: written back jointly)
    # (the first read of an optimizer's state dicts is provisional: read again, then recorded)
    assert routes == ["general", "general"] + [STRUCTURE_PATH[hot_path]] * 3
    assert f.stats().compiles == 1


@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_model_and_optimizer_in_one_container(container, hot_path):
    pack = (lambda m, o: (m, o)) if container == "tuple" else (lambda m, o: {"model": m, "optimizer": o})

    def step(state, x, y):
        model, optimizer = (state if container == "tuple" else (state["model"], state["optimizer"]))
        return _train_step(model, optimizer, x, y)

    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    f, peer = fastcall.jit(step), nnx.jit(step)
    routes = []
    for _ in range(5):
        loss, route = served(f, pack(m, opt), X, Y)  # (a new container each call)
        routes.append(route)
        assert_trees_equal(loss, peer(pack(ref_m, ref_opt), X, Y))
        _same_state(m, ref_m)
        _same_state(opt, ref_opt)
    assert routes == ["general", "general"] + [STRUCTURE_PATH[hot_path]] * 3
    # one of them another object: declines, and is right
    other, ref_other = _pair()[1], _pair()[1]
    other.model, ref_other.model = m, ref_m  # (sharing the model too, and its own state)
    for _ in range(3):
        assert_trees_equal(f(pack(m, other), X, Y), peer(pack(ref_m, ref_other), X, Y))
        _same_state(other, ref_other)


@pytest.mark.parametrize("raw", [False, True], ids=["variables", "raw leaf"])
def test_a_module_and_its_submodule(raw, hot_path):
    ours, theirs = Outer(nnx.Rngs(0), raw), Outer(nnx.Rngs(0), raw)
    f, peer = fastcall.jit(_outer_inner), nnx.jit(_outer_inner)
    assert _outer_and_inner(f, peer, ours, theirs, 4) == ["general"] + [STRUCTURE_PATH[hot_path]] * 3
    # the other way round: the submodule first (the outer one then passes only its own)
    g, peer_g = fastcall.jit(lambda inner, outer, x: _outer_inner(outer, inner, x)), nnx.jit(
        lambda inner, outer, x: _outer_inner(outer, inner, x)
    )
    for i in range(3):
        y, route = served(g, ours.inner, ours, X)
        assert route == ("general" if i == 0 else STRUCTURE_PATH[hot_path])
        assert_trees_equal(y, peer_g(theirs.inner, theirs, X))
        _same_state(ours, theirs)


def test_the_same_module_twice(hot_path):
    def f(a, b, x):
        a.l1.kernel[...] = a.l1.kernel[...] + 1.0
        return b(x)

    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    g, peer = fastcall.jit(f), nnx.jit(f)
    for i in range(3):
        y, route = served(g, ours, ours, X)
        assert route == ("general" if i == 0 else STRUCTURE_PATH[hot_path])
        assert_trees_equal(y, peer(theirs, theirs, X))
        _same_state(ours, theirs)


def _changes():
    """Changes between calls that move what the two arguments share, or their structure."""

    def new_submodule(o):  # same structure, no longer shared with the inner argument
        o.inner = Net(nnx.Rngs(5))

    def new_variable(o):  # a shared Variable replaced in one of them
        o.inner.l1.kernel = nnx.Param(o.inner.l1.kernel[...] * 0.5)

    def flip(o):  # a static attribute flipped (eval mode): another structure variant
        o.eval()

    def train_again(o):
        o.eval()
        o.train()

    return {"new submodule": new_submodule, "new variable": new_variable, "eval": flip, "eval, train": train_again}


def _read_by_another_function(*objects):
    """Another wrapped function reads the objects (an eval step between train steps): their
    cache entries are then current again, for the changed structure, before the joint
    record sees them; it must still not serve them as it recorded them."""
    for obj in objects:
        fastcall.jit(lambda m: jax.tree_util.tree_leaves(nnx.state(m))[0])(obj)


@pytest.mark.parametrize("read_first", [False, True], ids=["called next", "read by another function first"])
@pytest.mark.parametrize("change", list(_changes()))
def test_a_change_between_calls_declines(change, read_first, hot_path):
    ours, theirs = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
    f, peer = fastcall.jit(_outer_inner), nnx.jit(_outer_inner)
    inner, ref_inner = ours.inner, theirs.inner
    for _ in range(3):
        f(ours, inner, X), peer(theirs, ref_inner, X)
    _changes()[change](ours)
    _changes()[change](theirs)
    if read_first:
        _read_by_another_function(ours, inner)
    y, route = served(f, ours, inner, X)
    # (eval then train, seen by another function: the entries are back on the variant the
    # record was made for, the same structure, and it serves them)
    assert route == (STRUCTURE_PATH[hot_path] if change == "eval, train" and read_first else "general")
    assert_trees_equal(y, peer(theirs, ref_inner, X))
    _same_state(ours, theirs)
    _same_state(inner, ref_inner)
    for _ in range(2):  # (then recorded again for the new structure)
        y, route = served(f, ours, inner, X)
        assert_trees_equal(y, peer(theirs, ref_inner, X))
        _same_state(ours, theirs)
        _same_state(inner, ref_inner)
    assert route == STRUCTURE_PATH[hot_path]


class Holder(nnx.Module):
    """Holds another module's Variable directly (not through its owner)."""

    def __init__(self, v):
        self.v = v


def test_a_variable_held_directly_then_replaced_in_its_owner(hot_path):
    def f(net, holder, x):
        return net(x) + holder.v[...].sum()

    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    hold, ref_hold = Holder(ours.l1.kernel), Holder(theirs.l1.kernel)
    g, peer = fastcall.jit(f), nnx.jit(f)
    for _ in range(3):
        assert_trees_equal(g(ours, hold, X), peer(theirs, ref_hold, X))
    # The owner gets a new kernel; the holder keeps the old one (no hook sees the holder
    # change: it did not). They now share nothing.
    ours.l1.kernel = nnx.Param(ours.l1.kernel[...] + 1.0)
    theirs.l1.kernel = nnx.Param(theirs.l1.kernel[...] + 1.0)
    for _ in range(3):
        assert_trees_equal(g(ours, hold, X), peer(theirs, ref_hold, X))
    assert hold.v is not ours.l1.kernel


def test_a_list_in_the_graph_changed_in_place(hot_path):
    class Blocks(nnx.Module):
        def __init__(self):
            self.blocks = nnx.data([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])

    def f(blocks, first, x):
        for b in blocks.blocks:
            x = b(x)
        return x + first(x)

    ours, theirs = Blocks(), Blocks()
    g, peer = fastcall.jit(f), nnx.jit(f)
    first, ref_first = ours.blocks[0], theirs.blocks[0]
    for _ in range(3):
        assert_trees_equal(g(ours, first, X), peer(theirs, ref_first, X))
    # the shared block taken out of the list (no hook sees a plain list change)
    ours.blocks[0] = nnx.Linear(4, 4, rngs=nnx.Rngs(7))
    theirs.blocks[0] = nnx.Linear(4, 4, rngs=nnx.Rngs(7))
    y, route = served(g, ours, first, X)
    assert route == "general"
    assert_trees_equal(y, peer(theirs, ref_first, X))
    for _ in range(2):
        assert_trees_equal(g(ours, first, X), peer(theirs, ref_first, X))


def test_other_objects_of_the_same_structures(hot_path):
    f, peer = fastcall.jit(_outer_inner), nnx.jit(_outer_inner)
    for seed in range(3):
        ours, theirs = Outer(nnx.Rngs(seed)), Outer(nnx.Rngs(seed))
        routes = _outer_and_inner(f, peer, ours, theirs, 2)
        assert routes == ["general", STRUCTURE_PATH[hot_path]]  # (the record pins the objects)
    # a disjoint pair of the same types: not read jointly, and not as the joint record says
    ours, theirs = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
    other, ref_other = Net(nnx.Rngs(3)), Net(nnx.Rngs(3))
    for _ in range(3):
        assert_trees_equal(f(ours, other, X), peer(theirs, ref_other, X))
        _same_state(ours, theirs)
        _same_state(other, ref_other)


def test_returning_the_shared_objects(hot_path):
    def f(outer, inner, x):
        outer.count[...] += 1
        return inner, outer, inner(x)

    ours, theirs = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
    g, peer = fastcall.jit(f), nnx.jit(f)
    for i in range(3):
        (inner, outer, y), route = served(g, ours, ours.inner, X)
        assert inner is ours.inner and outer is ours
        ref = peer(theirs, theirs.inner, X)
        assert ref[0] is theirs.inner and ref[1] is theirs
        assert_trees_equal(y, ref[2])
        _same_state(ours, theirs)
    assert route == STRUCTURE_PATH[hot_path]


def test_a_structural_change_inside_every_call(hot_path):
    def f(outer, inner, x):
        outer.extra = nnx.BatchStat(outer.count[...] * 1.0)  # (a Variable created each call)
        outer.count[...] += 1
        return inner(x)

    ours, theirs = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
    g, peer = fastcall.jit(f), nnx.jit(f)
    for _ in range(4):
        assert_trees_equal(g(ours, ours.inner, X), peer(theirs, theirs.inner, X))
        _same_state(ours, theirs)


def test_an_error_inside_the_function_reaches_the_caller(hot_path):
    def f(outer, inner, x, check):
        y = inner(x)
        return jax.lax.cond(check, lambda: y, lambda: y * 0)  # fine when traced

    ours = Outer(nnx.Rngs(0))
    g = fastcall.jit(f)
    for _ in range(3):
        g(ours, ours.inner, X, jnp.asarray(True))
    with pytest.raises(TypeError):  # (a wrong shape: jax's own error, unchanged)
        g(ours, ours.inner, X, jnp.ones((3,)))
    y, route = served(g, ours, ours.inner, X, jnp.asarray(True))
    assert route == STRUCTURE_PATH[hot_path]


def test_explain_says_the_arguments_are_read_jointly(hot_path):
    (m, opt) = _pair()
    f = fastcall.jit(_train_step)
    for _ in range(3):
        f(m, opt, X, Y)
    report = f.explain(m, opt, X, Y)
    assert report.route == "structure"
    kinds = {a.name: a.kind for a in report.arguments}
    assert "read jointly" in kinds["optimizer"] and "read jointly" in kinds["model"]


def test_a_variable_replaced_inside_another_function(hot_path):
    """The other function replaces a Variable its object shares with a Holder (which holds
    it directly, not through its owner): the entry follows the replacement in place (its
    `node_ids` changes), and the two arguments no longer share it."""
    from fastcall._nnx import _entries

    def replace(net):
        net.l1.kernel = nnx.Param(net.l1.kernel[...] + 1.0)
        return net.l1.kernel[...].sum()

    def f(net, holder, x):
        return net(x) + holder.v[...].sum()

    ours, theirs = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    hold, ref_hold = Holder(ours.l1.kernel), Holder(theirs.l1.kernel)
    g, peer = fastcall.jit(f), nnx.jit(f)
    r, peer_r = fastcall.jit(replace), nnx.jit(replace)
    for _ in range(3):
        assert_trees_equal(g(ours, hold, X), peer(theirs, ref_hold, X))
    entry = _entries.by_id[id(ours)]
    assert_trees_equal(r(ours), peer_r(theirs))
    assert _entries.by_id[id(ours)] is entry and not entry.stale  # (the entry followed the new Variable in place)
    assert hold.v is not ours.l1.kernel and ref_hold.v is not theirs.l1.kernel
    for i in range(3):
        y, route = served(g, ours, hold, X)
        assert route == ("general" if i == 0 else STRUCTURE_PATH[hot_path])
        assert_trees_equal(y, peer(theirs, ref_hold, X))


def test_train_and_eval_alternating_seen_first_by_another_function(hot_path):
    """Once both modes have been seen, another function switches the entries between their
    variants in place (same entry, same Variables, another spec): the joint record, made
    for one mode, must not serve the other."""
    ours, theirs = Outer(nnx.Rngs(0)), Outer(nnx.Rngs(0))
    f, peer = fastcall.jit(_outer_inner), nnx.jit(_outer_inner)
    inner, ref_inner = ours.inner, theirs.inner
    for mode in ["train", "eval", "train", "eval", "train"]:
        for o in (ours, theirs):
            getattr(o, mode)()
        _read_by_another_function(ours, inner)
        for _ in range(2):
            y, route = served(f, ours, inner, X)
            assert_trees_equal(y, peer(theirs, ref_inner, X))
            _same_state(ours, theirs)
    assert route == STRUCTURE_PATH[hot_path]


def test_the_same_module_under_two_keys_of_a_dict(hot_path):
    """`f({"a": m, "b": m}, x)`: its keys cannot be told apart by the object under them, so no
    record is made that could read `d["b"]` for both (a later `{"a": other, "b": m}` must be
    read as it is)."""

    def f(d, x):
        return d["a"](x) * 10 + d["b"](x)

    m, other = nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    ref_m, ref_other = nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    g, peer = fastcall.jit(f), nnx.jit(f)
    for _ in range(3):
        assert_trees_equal(g({"a": m, "b": m}, X), peer({"a": ref_m, "b": ref_m}, X))
    for _ in range(2):
        assert_trees_equal(g({"a": other, "b": m}, X), peer({"a": ref_other, "b": ref_m}, X))


# Another thread changes the objects, and has them read again, while the first (general)
# call is being traced: the record that call makes must not pin the entries as they are
# after the change to the program compiled before it.


def _traced_with(hook):
    """`_train_step`, running `hook` once while it is traced (in the calling thread: a slow
    compile, in effect)."""
    pending = [hook]

    def step(model, optimizer, x, y):
        if pending:
            pending.pop()()
        return _train_step(model, optimizer, x, y)

    return step


def _while_traced(change):
    """A hook that has another thread run `change` and waits for it to finish."""
    import threading

    def hook():
        t = threading.Thread(target=change)
        t.start()
        t.join()

    return hook


def test_another_thread_moves_what_is_shared_during_the_first_call(hot_path):
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    other, ref_other = Net(nnx.Rngs(1)), Net(nnx.Rngs(1))
    peek = fastcall.jit(lambda o: o.step[...])

    def change():
        opt.model = other  # (the optimizer now holds another model)
        peek(opt), peek(opt)  # (its entry built again, current)

    f = fastcall.jit(_traced_with(_while_traced(change)))
    peer = nnx.jit(_train_step)
    f(m, opt, X, Y), peer(ref_m, ref_opt, X, Y)
    ref_opt.model = ref_other
    for _ in range(3):
        assert_trees_equal(f(m, opt, X, Y), peer(ref_m, ref_opt, X, Y))
        _same_state(m, ref_m)
        _same_state(other, ref_other)


def test_another_thread_switches_the_mode_during_the_first_call(hot_path):
    """Both modes seen before: the entries switch variants in place (the same entries, the
    same Variables), so only the entries' versions tell the call's read from the current one."""
    (m, opt), (ref_m, ref_opt) = _pair(), _pair()
    peek = fastcall.jit(lambda a, b: a.l1.kernel[...].sum() + b.step[...])
    for mode in ("train", "eval", "train"):
        getattr(m, mode)()
        peek(m, opt), peek(m, opt)

    def change():
        m.eval()
        peek(m, opt), peek(m, opt)

    f = fastcall.jit(_traced_with(_while_traced(change)))
    peer = nnx.jit(_train_step)
    f(m, opt, X, Y), peer(ref_m, ref_opt, X, Y)  # (traced in train mode)
    ref_m.eval()
    for _ in range(3):
        assert_trees_equal(f(m, opt, X, Y), peer(ref_m, ref_opt, X, Y))
        _same_state(m, ref_m)
        _same_state(opt, ref_opt)

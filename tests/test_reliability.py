"""Threads, bounded memory, clear errors and recompile-storm warnings."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fastcall
from fastcall import _plan, _flatten
from fastcall._nnx import _entries, _watch

from .conftest import STRUCTURE_PATH, assert_trees_equal, run_threads


# ---- threads ----


def test_threads_compile_each_static_signature_once():
    traces: list[int] = []
    lock = threading.Lock()

    def fn(x, k):
        with lock:
            traces.append(k)
        return x * k

    f = fastcall.filter_jit(fn)  # (Python scalars static: one signature per value)

    def work(i):
        for _ in range(20):
            np.testing.assert_allclose(f(jnp.ones(3), i), np.full(3, float(i)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastcall.RecompileWarning)  # 8 values of a static: warned
        assert not run_threads(8, work)
    assert sorted(traces) == list(range(8))  # 8 signatures, each traced once


def test_threads_first_call_of_one_signature():
    """Eight threads make the first call of the same signature at once."""
    traces: list[int] = []
    f = fastcall.jit(lambda m, x: traces.append(1) or m(x))
    m = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))

    def work(i):
        assert_trees_equal(f(m, jnp.ones(3)), m(jnp.ones(3)))

    assert not run_threads(8, work)
    # One compiled entry; jax may trace it more than once when threads race on
    # the very first call (harmless: same program, see docs/guarantees.md, "Threads and memory").
    assert len(f._fastcall_state.table) == 1
    assert 1 <= len(traces) <= 8


def test_threads_equinox_new_and_shared_models():
    f = fastcall.jit(lambda m, x: m(x))
    shared = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))

    def work(i):
        own = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(i + 1))
        for j in range(30):
            m = shared if j % 2 else own
            assert_trees_equal(f(m, jnp.full(3, float(i))), m(jnp.full(3, float(i))))

    assert not run_threads(8, work)


def test_threads_mutating_nnx_module_with_a_lock():
    class Stat(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
            self.total = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.count[...] += 1
            self.total[...] += x
            return self.total[...]

    m = Stat()
    f = fastcall.jit(lambda m, x: m(x))
    lock = threading.Lock()

    def work(i):
        for _ in range(25):
            with lock:
                f(m, jnp.asarray(1.0))

    assert not run_threads(8, work)
    assert int(m.count[...]) == 200
    assert float(m.total[...]) == 200.0


def test_threads_reading_while_another_swaps_a_submodule():
    """Documented behaviour: each call sees one consistent structure or the other."""

    class Two(nnx.Module):
        def __init__(self):
            self.layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.layer(x)

    m = Two()
    layers = [nnx.Linear(2, 2, rngs=nnx.Rngs(k)) for k in range(2)]
    x = jnp.ones(2)
    allowed = [np.asarray(layer(x)) for layer in layers]
    f = fastcall.jit(lambda m, x: m(x))
    m.layer = layers[0]

    def work(i):
        for j in range(40):
            if i == 0:
                m.layer = layers[j % 2]
            else:
                out = np.asarray(f(m, x))
                assert any(np.allclose(out, a) for a in allowed)

    assert not run_threads(4, work)


@pytest.mark.usefixtures("hot_path")
def test_change_made_while_the_cache_entry_is_built_is_not_lost(monkeypatch):
    class Model(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.array(0.0))
            self.flag = 0

    f = fastcall.jit(lambda m: m.p[...] + m.flag)
    m = Model()
    f(m)
    original = _entries._flatten_node

    def interleaved(*args, **kwargs):  # another thread's assignment lands mid-build
        out = original(*args, **kwargs)
        monkeypatch.setattr(_entries, "_flatten_node", original)
        m.flag = 1
        return out

    m.flag = 2  # marks the entry stale: the next call rebuilds it
    monkeypatch.setattr(_entries, "_flatten_node", interleaved)
    f(m)
    assert float(f(m)) == 1.0


@pytest.mark.usefixtures("hot_path")
def test_submodule_replaced_while_the_entry_is_built_is_watched(monkeypatch):
    class M(nnx.Module):
        def __init__(self):
            self.sub = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0))

    m = M()
    g = fastcall.jit(lambda m, x: m.sub(x))
    x = jnp.ones((1, 2))
    original = _entries._flatten_node
    raced = []

    def racing(node, *args, **kwargs):
        result = original(node, *args, **kwargs)
        if node is m and not raced:
            raced.append(1)
            m.sub = nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(1))  # "another thread"
        return result

    monkeypatch.setattr(_entries, "_flatten_node", racing)
    g(m, x)
    monkeypatch.setattr(_entries, "_flatten_node", original)
    assert raced
    m.sub.kernel = nnx.Param(jnp.zeros((2, 2)))
    assert_trees_equal(g(m, x), m.sub(x))


# ---- memory ----


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def test_new_model_every_call_keeps_memory_bounded():
    f = fastcall.jit(lambda m, x: m(x))
    refs = []
    x = jnp.ones(3)
    for i in range(300):  # warm up allocators and caches
        f(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(i)), x)
    gc.collect()
    before_rss, before_entries = _rss_mb(), len(_flatten.by_id)
    for i in range(3000):
        m = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(i % 50))
        if i % 500 == 0:
            refs.append(weakref.ref(m))
        f(m, x)
        del m
    gc.collect()
    assert all(r() is None for r in refs), "dropped models are kept alive"
    assert len(_flatten.by_id) <= before_entries + 5
    assert f.stats().compiles == 1
    assert _rss_mb() - before_rss < 60, "RSS grew with the number of calls"


def test_new_nnx_model_every_call_keeps_caches_bounded():
    f = fastcall.jit(lambda m, x: m(x))
    refs = []
    for i in range(200):
        m = nnx.Linear(3, 2, rngs=nnx.Rngs(i))
        if i % 50 == 0:
            refs.append(weakref.ref(m))
        f(m, jnp.ones(3))
        del m
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(_entries.by_id) < 5 and len(_plan.INDEX) < 5
    assert len(_watch._watchers) < 50
    assert f.stats().compiles == 1


def _tracer_count() -> int:
    gc.collect()
    return sum(isinstance(o, jax.core.Tracer) for o in gc.get_objects())


def test_no_tracers_or_executables_kept_after_clear():
    before = _tracer_count()  # (earlier tests may hold tracers in kept tracebacks)
    m = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x: m(x))
    f(m, jnp.ones(3))
    g = fastcall.jit(lambda m, x: m(x))
    g(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), jnp.ones((2, 3)))
    (entry,) = f._fastcall_state.table.values()
    compiled = weakref.ref(entry)
    del entry
    assert _tracer_count() == before
    fastcall.clear_caches()
    gc.collect()
    assert compiled() is None


def test_signature_table_is_bounded(monkeypatch):
    from fastcall import _function

    monkeypatch.setattr(_function, "MAX_SIGNATURES", 4)
    f = fastcall.jit(lambda x, k: x * k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fastcall.RecompileWarning)
        for k in range(10):
            assert_trees_equal(f(jnp.ones(1), k), jnp.full(1, float(k)))
    assert len(f._fastcall_state.table) <= 4
    assert_trees_equal(f(jnp.ones(1), 0), jnp.zeros(1))  # evicted: recompiles, still right


# ---- errors ----


def test_static_leaf_whose_eq_raises():
    class BadEq:
        def __hash__(self):
            return 1

        def __eq__(self, other):
            raise RuntimeError("no comparisons")

    f = fastcall.jit(lambda cfg, x: x)
    assert_trees_equal(f({"bad": BadEq()}, jnp.ones(1)), jnp.ones(1))  # nothing cached to compare with yet
    with pytest.raises(fastcall.FastcallError, match=r"argument 'cfg' at leaf \['bad'\].*no comparisons"):
        f({"bad": BadEq()}, jnp.ones(1))  # the lookup compares with the cached key: __eq__ raises


def test_dict_key_whose_eq_raises_is_read_as_jax_reads_it(hot_path):
    """A dict keyed by objects whose `__eq__` raises for other types (equal to themselves,
    hashing like the ints 1 and 2): the same keys in new dicts each call are read as jax.jit
    reads them, whichever path serves the call (the structure path's read of a dict looks
    its keys up: a raising comparison there means "not this structure", not an error).
    Another function given int keys of those hashes afterwards is refused with an error
    naming the argument (fastcall's structures are shared by all functions; jax.jit's cache
    is per function), not the comparison's own error from inside fastcall."""

    class Key:
        def __init__(self, n):
            self.n = n

        def __hash__(self):
            return hash(self.n)

        def __eq__(self, other):
            if isinstance(other, Key):
                return self.n == other.n
            raise RuntimeError("no comparisons with other types")

        def __lt__(self, other):
            return self.n < other.n

    keys = Key(1), Key(2)

    def total(d, x):
        return sum(d.values()) + x

    f, g = fastcall.jit(total), jax.jit(total)
    for _ in range(4):
        d = {keys[0]: jnp.ones(2), keys[1]: jnp.full(2, 2.0)}
        assert_trees_equal(f(d, jnp.ones(2)), g(d, jnp.ones(2)))
    assert f.stats().paths[STRUCTURE_PATH[hot_path]] >= 2
    h = fastcall.jit(lambda d, x: total(d, x) * 2)
    with pytest.raises(fastcall.FastcallError, match=r"argument 'd'.*no comparisons"):
        h({1: jnp.ones(2), 2: jnp.ones(2)}, jnp.ones(2))
    assert_trees_equal(h({"a": jnp.ones(2)}, jnp.ones(2)), jnp.full(2, 4.0))


def test_static_leaf_whose_hash_raises():
    class BadHash:
        def __hash__(self):
            raise ValueError("no hashing")

    f = fastcall.jit(lambda cfg, x: x)
    with pytest.raises(fastcall.FastcallError, match=r"argument 'cfg' at leaf \[0\].*no hashing"):
        f((BadHash(),), jnp.ones(1))


def test_deleted_array_is_named():
    m = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(0))
    f = fastcall.jit(lambda m, x: m(x))
    f(m, jnp.ones(3))
    m.layers[1].bias.delete()
    with pytest.raises(fastcall.FastcallError, match=r"argument 'm' at leaf \.layers\[1\]\.bias.*deleted"):
        f(m, jnp.ones(3))
    fresh = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.PRNGKey(1))
    assert_trees_equal(f(fresh, jnp.ones(3)), fresh(jnp.ones(3)))  # the wrapper still works


def test_deleted_nnx_variable_is_named():
    m = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    f(m, jnp.ones(3))
    m.bias.get_raw_value().delete()
    with pytest.raises(fastcall.FastcallError, match=r"argument 'm' at leaf \.bias.*deleted"):
        f(m, jnp.ones(3))


def test_leaked_tracer_gets_jax_error():
    leaked = []
    jax.jit(lambda x: leaked.append(x) or x)(jnp.ones(2))
    f = fastcall.jit(lambda x: x + 1)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        f(leaked[0])
    assert_trees_equal(f(jnp.ones(2)), jnp.full(2, 2.0))


def test_non_weakrefable_argument_is_reread_each_call():
    f = fastcall.jit(lambda t, x: t[0] * x)
    t = (jnp.full(2, 2.0),)  # tuples cannot be weakly referenced
    assert_trees_equal(f(t, jnp.ones(2)), jnp.full(2, 2.0))
    t = (jnp.full(2, 3.0),)
    assert_trees_equal(f(t, jnp.ones(2)), jnp.full(2, 3.0))


# ---- recompile storms ----


@pytest.fixture
def explain_cache_misses():
    """jax's own switch for explaining recompiles, under which fastcall warns of storms."""
    jax.config.update("jax_explain_cache_misses", True)
    yield
    jax.config.update("jax_explain_cache_misses", False)


def test_recompile_storm_warns_once_with_what_changed(explain_cache_misses):
    f = fastcall.filter_jit(lambda x, n: x * n)  # (a static scalar that keeps changing)
    with pytest.warns(fastcall.RecompileWarning, match=r"changed n .*static int 6 -> static int 7.*jnp.asarray"):
        for n in range(8):
            f(jnp.ones(2), n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(8, 16):  # warned once only
            f(jnp.ones(2), n)


def test_no_recompile_warning_by_default():
    """A prompt growing one token per step (flax's minigpt example) compiles once per length,
    as under nnx.jit: no warning unless jax is asked to explain its cache misses, so suites
    run with filterwarnings=error keep passing; the explanations are in .stats()."""
    f = fastcall.jit(lambda tokens: tokens.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(1, 12):
            f(jnp.ones(n))
    assert f.stats().compiles == 11 and len(f.stats().recompiles) == 10


def test_shape_drift_warns(explain_cache_misses):
    f = fastcall.jit(lambda x: x.sum())
    with pytest.warns(fastcall.RecompileWarning, match=r"changed x .*float32\[7\] -> array float32\[8\].*bucket"):
        for n in range(1, 9):
            f(jnp.ones(n))


def test_no_warning_for_many_structures():
    """Calling one function with many structures is ordinary use (equinox's own
    test_filter_jvp does it), not a storm: under filterwarnings=error it must not fail."""
    f = fastcall.jit(lambda xs: sum(x.sum() for x in xs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(1, 12):
            f(tuple(jnp.ones(2) for _ in range(n)))
    assert f.stats().compiles == 11


def test_no_warning_for_a_few_recompiles():
    f = fastcall.jit(lambda x, n: x * n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3):
            f(jnp.ones(2), n)


_GC_UNDER_THE_WATCH_LOCK = '''
import gc
import jax.numpy as jnp
from flax import nnx
import fastcall
from fastcall._nnx import _watch


class Block(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.lin(x)


class CycleModel(nnx.Module):
    def __init__(self):
        self.c = Block()
        self.c.owner = self  # (a back reference: cyclic garbage when dropped)

    def __call__(self, x):
        return self.c(x)


class Watchers(dict):  # (the cyclic GC run at this allocation, as Python may run one)
    def setdefault(self, *args):
        gc.collect()
        return super().setdefault(*args)


f = fastcall.jit(lambda m, x: m(x))
x = jnp.ones((1, 2))
m = CycleModel()
f(m, x)
del m  # cyclic garbage with a cache entry, whose weak reference's callback unwatches it
gc.disable()
_watch._watchers = Watchers(_watch._watchers)
f(CycleModel(), x)  # reads the new model's graph: watched under the lock
print("done")
'''


def test_a_model_collected_while_another_is_watched_does_not_deadlock():
    """(Found by review.) A model dropped in a reference cycle dies in a cyclic GC, which
    Python may run at any allocation, including one made while fastcall registers another
    model's graph under its watch lock; its cache entry's callback takes that lock too. Run
    in a subprocess: a deadlock there fails the test instead of hanging the suite."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _GC_UNDER_THE_WATCH_LOCK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("done")


def test_a_spec_found_by_key_is_found_by_id(monkeypatch):
    """(Seen once as `KeyError(691)` in eight threads' first calls of one function.) A spec
    is interned under the lock but found by key without it: another thread that finds it
    by key, between the two publications, looks its id up at once. Replayed in one thread:
    a lookup by id made the moment the spec becomes findable by key."""
    seen = []

    class Publishing(dict):
        def __setitem__(self, key, spec):
            super().__setitem__(key, spec)
            seen.append(_flatten.spec_by_id(spec.id))  # (another thread, finding it now)

    monkeypatch.setattr(_flatten, "_spec_ids", Publishing(_flatten._spec_ids))
    f = fastcall.jit(lambda t, x: t[0] * x)
    f((jnp.ones(3), "a new static, a new spec"), jnp.ones(3))
    assert seen

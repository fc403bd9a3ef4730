"""Packing workloads: models of many small leaves, called again unchanged.

fastcall passes the small leaves (at most one dimension and 256 elements) of an object
its fast path serves again packed into buffers of at most 32 leaves per dtype
(`fastcall/_pack.py`), so that jax.jit's per-argument dispatch is paid once per buffer
rather than once per leaf. Each workload here times, beside the usual floor (jax.jit on the model's
pre-flattened leaves), a second reference: "floor, packed by hand", jax.jit taking the
small leaves concatenated into one buffer per dtype (built once, before timing) and
slicing them back inside, matrices passed as they are. That one is a reference, what
packing by hand reaches, never a peer fastcall must beat.

What packing aims at (fastcall.filter_jit's "x floor", jax 0.10 on a CPU): 1000 leaves
of shape (4,) (eqx_tiny_leaves), at most 0.2x; a 24-layer transformer-like stack at
d=32 (eqx_transformer_small, 192 of its 288 leaves 1-D), at most 0.85x; compute-bound
(eqx_wide_stack), at most 1.02x; a training step whose weights change every call
(eqx_train_changing: the general path, never packed), at most 1.05x. The bench reports
these ratios; it checks only that fastcall is not slower than its peers. The NNX twin of
the transformer-like stack (nnx_transformer_small) shows fastcall.jit, which packs an NNX
model's small Variables while each is the value packed, against the floor packed by hand.

Every "fastcall.*" variant's note says how many leaves its fast path packed
(`stats().packed_leaves`, read before each timed batch: every fast record its wrapper
made until then, counted once each).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

import fastcall

from . import _eqx_workloads, _nnx_workloads
from ._eqx_workloads import UNPACKED, _compare, _flat_floor
from ._harness import Variant, Workload

PACKED_FLOOR = "floor, packed by hand"
MAX_ELEMENTS = 256  # (fastcall's own limit: the same leaves packed by hand)


# ---- packing by hand ----


def _small(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and leaf.ndim <= 1 and leaf.size <= MAX_ELEMENTS


class HandPacked:
    """Packing by hand: the small 1-D leaves of a leaf list (at most `MAX_ELEMENTS`
    elements) concatenated into one buffer per dtype (of two leaves or more), the other
    leaves passed as they are."""

    def __init__(self, leaves: Sequence[Any]):
        by_dtype: dict[Any, list[int]] = {}
        for i, leaf in enumerate(leaves):
            if _small(leaf):
                by_dtype.setdefault(leaf.dtype, []).append(i)
        self.groups = [positions for positions in by_dtype.values() if len(positions) >= 2]
        packed = {i for positions in self.groups for i in positions}
        self.rest = [i for i in range(len(leaves)) if i not in packed]
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        self.note = (
            f"{len(packed)} of {len(leaves)} leaves in {len(self.groups)} buffer(s), {len(self.rest)} as they are"
        )

    def program(self, apply: Callable[[list[Any], Any], Any]) -> Callable[..., Any]:
        """jax.jit of `apply(leaves, x)` taking `args(leaves)`, then `x`."""
        groups, rest, shapes = self.groups, self.rest, self.shapes
        n_groups, n_rest = len(groups), len(rest)

        def unpacked(*given: Any) -> Any:
            out: list[Any] = [None] * len(shapes)
            for positions, buf in zip(groups, given[:n_groups]):
                start = 0
                for i in positions:
                    size = math.prod(shapes[i])
                    out[i] = buf[start : start + size].reshape(shapes[i])
                    start += size
            for i, v in zip(rest, given[n_groups : n_groups + n_rest]):
                out[i] = v
            return apply(out, given[-1])

        return jax.jit(unpacked)

    def args(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        """The buffers (built now: once, before timing), then the leaves passed as they are."""
        buffers = [jnp.concatenate([jnp.ravel(leaves[i]) for i in positions]) for positions in self.groups]
        return (*jax.block_until_ready(buffers), *(leaves[i] for i in self.rest))


def _noting_packed(
    name: str, wrap: Callable[[], Any], step_of: Callable[[Any], Callable[[], Any]], note: str = ""
) -> Variant:
    """A fastcall variant whose note says how many leaves its fast path packed (read
    before each timed batch, untimed). `make` builds the wrapper with `wrap()` and
    returns `step_of(wrapper)`: one wrapper, made at the first `make`, so that verification
    and timing share its programs (the packed one included)."""
    made: list[Any] = []

    def make():
        if not made:
            made.append(wrap())
        return step_of(made[0])

    def prepare(step: Callable[[], Any], n: int) -> None:  # (untimed, before each timed batch)
        if made:
            variant.note = ", ".join(filter(None, [note, f"packed_leaves={made[0].stats().packed_leaves}"]))

    variant = Variant(name, make, prepare=prepare, note=note)
    return variant


# ---- Equinox models ----


class TinyBlock(eqx.Module):
    a: jax.Array
    b: jax.Array

    def __call__(self, x):
        # (soft_sign, not tanh: XLA's CPU compile of 500 tanh in a chain takes 8-9 s a
        # variant here, of 500 soft_sign ~2 s; the call's cost is what is measured)
        return jax.nn.soft_sign(x * self.a + self.b)


class TinyLeaves(eqx.Module):
    """`n` submodules of two (width,) leaves each, applied in turn."""

    blocks: list

    def __init__(self, n: int, width: int, key: jax.Array):
        ka, kb = jax.random.split(key)
        a = jax.random.uniform(ka, (n, width), minval=0.5, maxval=1.5)
        b = 0.1 * jax.random.normal(kb, (n, width))
        self.blocks = [TinyBlock(a[i], b[i]) for i in range(n)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class EqxBlock(eqx.Module):
    """Pre-norm block on (seq, d): an attention-like mix (q, k projections; the normed
    input as values), then an MLP of hidden 2d. 12 leaves: LayerNorm scale and bias
    twice and four Linear with biases (8 of them 1-D)."""

    ln1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, key: jax.Array):
        kq, kk, ku, kd = jax.random.split(key, 4)
        self.ln1 = eqx.nn.LayerNorm(d)
        self.q = eqx.nn.Linear(d, d, key=kq)
        self.k = eqx.nn.Linear(d, d, key=kk)
        self.ln2 = eqx.nn.LayerNorm(d)
        self.up = eqx.nn.Linear(d, 2 * d, key=ku)
        self.down = eqx.nn.Linear(2 * d, d, key=kd)

    def __call__(self, h):
        a = jax.vmap(self.ln1)(h)
        scores = jax.vmap(self.q)(a) @ jax.vmap(self.k)(a).T / math.sqrt(h.shape[-1])
        h = h + jax.nn.softmax(scores, axis=-1) @ a
        b = jax.vmap(self.ln2)(h)
        return h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(b)))


class EqxStack(eqx.Module):
    blocks: list

    def __init__(self, layers: int, d: int, key: jax.Array):
        self.blocks = [EqxBlock(d, k) for k in jax.random.split(key, layers)]

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


# ---- NNX model (the same block) ----


class NNXBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.q = nnx.Linear(d, d, rngs=rngs)
        self.k = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, h):
        a = self.ln1(h)
        scores = self.q(a) @ self.k(a).T / math.sqrt(h.shape[-1])
        h = h + jax.nn.softmax(scores, axis=-1) @ a
        return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))


class NNXStack(nnx.Module):
    def __init__(self, layers: int, d: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([NNXBlock(d, rngs) for _ in range(layers)])

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


# ---- workloads ----

EQX_SUBJECT = "fastcall.filter_jit"
EQX_PACK_PEERS = {EQX_SUBJECT: ("eqx.filter_jit",), UNPACKED: ("eqx.filter_jit",)}


def eqx_forward(name: str, description: str, model: Any, x: Any) -> Workload:
    """The same Equinox model every call, `f(model, x)`: fastcall.filter_jit with and
    without packing against eqx.filter_jit, the floor and the floor packed by hand."""

    def call(m, x):
        return m(x)

    # (the jax.jit programs are built once, here: verification and timing share them)
    floor, floor_leaves = _flat_floor(model, call)
    dynamic, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(dynamic)
    layout = HandPacked(leaves)
    by_hand = layout.program(lambda ls, x: call(eqx.combine(treedef.unflatten(ls), static), x))
    by_hand_args = layout.args(leaves)

    def make_eager():
        return lambda: call(model, x)

    def make_floor():
        args = (*floor_leaves, x)
        return lambda: floor(*args)

    def make_by_hand():
        args = (*by_hand_args, x)
        return lambda: by_hand(*args)

    def make_filter_jit():
        f = eqx.filter_jit(call)
        return lambda: f(model, x)

    def step_of(f):
        return lambda: f(model, x)

    return Workload(
        name,
        description,
        [
            Variant("eager", make_eager, timed=False),
            Variant("floor", make_floor, note="jax.jit on the pre-flattened leaf list"),
            Variant(PACKED_FLOOR, make_by_hand, note=f"{layout.note}; a reference, not a peer"),
            _noting_packed(EQX_SUBJECT, lambda: fastcall.filter_jit(call), step_of),
            _noting_packed(UNPACKED, lambda: fastcall.filter_jit(call, pack=False), step_of),
            Variant("eqx.filter_jit", make_filter_jit, note="model as argument"),
        ],
        _compare,
        subject=EQX_SUBJECT,
        peers=EQX_PACK_PEERS,
    )


def nnx_forward(name: str, description: str, build: Callable[[], Any], x: Any) -> Workload:
    """The same NNX model every call: fastcall.jit against nnx.jit, the NNX workloads'
    floor (jax.jit on the flat State leaves) and that floor packed by hand. Each variant
    builds its own model from the same seed, as in the other NNX workloads: fastcall's
    one wrapper serves two models (verification's, then timing's), so its packed_leaves
    counts the leaves of both."""

    def call(m, x):
        return m(x)

    def step_of(f):
        model = build()
        getter = lambda: _nnx_workloads._state_leaves(model)  # noqa: E731 - only called when verifying
        return lambda: (f(model, x), getter)

    by_hand: list[Any] = []  # (layout, program): one program, shared by verification and timing

    def make_by_hand():
        model = build()
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if not by_hand:
            layout = HandPacked(leaves)
            by_hand.extend([layout, layout.program(lambda ls, x: nnx.merge(graphdef, treedef.unflatten(ls))(x))])
            reference.note = f"flat state leaves: {layout.note}; a reference, not a peer"
        layout, f = by_hand
        args = (*layout.args(leaves), x)  # (this model's own leaves, packed)
        getter = lambda: _nnx_workloads._state_leaves(model)  # noqa: E731 - nothing written back
        return lambda: (f(*args), getter)

    keep = ("eager", "floor", "nnx.jit")  # (the NNX workloads' own, floor included)
    variants = [v for v in _nnx_workloads._forward_variants(build, x, writes_state=False) if v.name in keep]
    reference = Variant(PACKED_FLOOR, make_by_hand, note="small state leaves packed; a reference, not a peer")
    subject = _noting_packed("fastcall.jit", lambda: fastcall.jit(call), step_of, note="one wrapper, 2 models")
    variants[2:2] = [reference, subject]
    return Workload(name, description, variants, _nnx_workloads._compare, peers={"fastcall.jit": ("nnx.jit",)})


def build(quick: bool) -> dict[str, Callable[[], Workload]]:
    """Workload constructors (built lazily so --only skips the others). Quick mode keeps
    the three whose point is packing's dispatch saving; the compute-bound stack and the
    training step (whose path never packs; eqx_train covers it) run with --full."""
    key = jax.random.PRNGKey(0)
    seq8 = jax.random.normal(jax.random.PRNGKey(1), (8, 32))
    out = {
        "eqx_tiny_leaves": lambda: eqx_forward(
            "eqx_tiny_leaves",
            "500 submodules of two (4,) leaves (1000 leaves), x = soft_sign(x * a + b) in turn, same object",
            TinyLeaves(500, 4, key),
            jnp.ones(4),
        ),
        "eqx_transformer_small": lambda: eqx_forward(
            "eqx_transformer_small",
            "24 pre-norm blocks d=32 (LayerNorm x2, q/k mix, MLP 2d; 288 leaves, 192 1-D), seq 8, same object",
            EqxStack(24, 32, key),
            seq8,
        ),
        "nnx_transformer_small": lambda: nnx_forward(
            "nnx_transformer_small",
            "eqx_transformer_small in NNX (nnx.LayerNorm, nnx.Linear; 288 state leaves), seq 8, same model",
            lambda: NNXStack(24, 32, nnx.Rngs(0)),
            seq8,
        ),
    }
    if not quick:
        out |= {
            "eqx_wide_stack": lambda: eqx_forward(
                "eqx_wide_stack",
                "4 pre-norm blocks d=256 (48 leaves, 28 packable), seq 128 (compute-bound), same object",
                EqxStack(4, 256, key),
                jax.random.normal(jax.random.PRNGKey(1), (128, 256)),
            ),
            "eqx_train_changing": lambda: _eqx_workloads.sgd_step(
                "eqx_train_changing",
                "model = step(model, x, y): SGD (eqx.filter_grad, eqx.apply_updates) on eqx.nn.MLP w32 d4, batch 8",
                eqx.nn.MLP(32, 32, 32, 4, key=key),
                jnp.ones((8, 32)),
                jnp.zeros((8, 32)),
                unpacked=True,
            ),
        }
    return out

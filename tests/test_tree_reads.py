"""The readers of a pytree argument by its recorded structure (`fastcall/_tree_reads.py`): one
source, compiled by Cython where it was built and run as Python where not. Both ways read what
jax's flatten reads (the very leaves, by identity) or decline, and match static arguments by
`_flatten.leaf_key`; the structure routes that call them are tested in test_structure_path.py."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastcall import _codegen, _plan, _flatten, _tree_reads

from .conftest import source_as_python
from .models import HashRunsCode, OddArray

AS_PYTHON = source_as_python(_tree_reads)


@pytest.fixture(params=["compiled", "python"])
def reads(request):
    """The readers as compiled (`fastcall._tree_reads`) or as run from the same file."""
    if request.param == "compiled" and not _tree_reads.COMPILED:
        pytest.skip("not compiled (FASTCALL_TEST_AS_PYTHON=1)")
    return _tree_reads if request.param == "compiled" else AS_PYTHON


def _x(n=3):
    return jnp.arange(float(n))


def _sequences():
    """Tuples, lists and dicts of leaves, flat and nested (a batch, a params dict of dicts)."""
    return [
        (_x(), _x(2)),
        [_x(), np.ones(2, np.float32)],
        {"label": _x(), "image": _x(2)},
        {"layer_1": {"w": _x(), "b": _x(1)}, "layer_0": {"w": _x(2), "b": (_x(1), [_x(4)])}},
        (),
    ]


@pytest.mark.parametrize("example", _sequences(), ids=["tuple", "list", "dict", "nested", "empty"])
def test_a_sequence_reads_as_jax_flattens_it(reads, example):
    read = _codegen.sequence_read(example, _flatten.PLAIN_ARRAY_TYPES)
    assert read is not None
    leaves = reads.sequence_leaves(read, example)
    assert type(leaves) is tuple
    assert [id(x) for x in leaves] == [id(x) for x in jax.tree_util.tree_leaves(example)]


class _Eq:
    """A dict key whose `==` raises (reached when a lookup meets an equal hash)."""

    def __hash__(self) -> int:
        return hash("image")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no")


def test_a_sequence_of_another_structure_is_declined(reads):
    """Each difference the recorded structure does not hold reads as None, never an error: the
    general path reads the argument again (and names any error)."""
    flat = _codegen.sequence_read((_x(), _x()), _flatten.PLAIN_ARRAY_TYPES)
    batch = _codegen.sequence_read({"image": _x(), "label": _x()}, _flatten.PLAIN_ARRAY_TYPES)
    nested = _codegen.sequence_read({"a": (_x(), _x()), "b": _x()}, _flatten.PLAIN_ARRAY_TYPES)
    assert reads.sequence_leaves(flat, [_x(), _x()]) is None  # (another type)
    assert reads.sequence_leaves(flat, (_x(), _x(), _x())) is None  # (another length)
    assert reads.sequence_leaves(flat, (_x(), 1.0)) is None  # (a leaf of another type)
    assert reads.sequence_leaves(batch, {"image": _x(), "other": _x()}) is None  # (another key)
    assert reads.sequence_leaves(batch, {"image": _x()}) is None
    assert reads.sequence_leaves(batch, {_Eq(): _x(), "label": _x()}) is None  # (its `==` raised)
    assert reads.sequence_leaves(nested, {"a": [_x(), _x()], "b": _x()}) is None  # (a nested type)
    assert reads.sequence_leaves(nested, {"a": _x(), "b": _x()}) is None  # (a leaf for a container)
    assert reads.sequence_leaves(nested, {"a": (_x(), (_x(),)), "b": _x()}) is None
    # the keys in another insertion order are the same structure, read by sorted key
    x, y = _x(), _x(2)
    assert reads.sequence_leaves(batch, {"label": y, "image": x}) == (x, y)


def test_python_scalars_are_leaves_where_the_read_says(reads):
    """Under `fastcall.jit`'s rule a template's read takes Python scalars as leaves."""
    traced = _flatten.plain_leaf_types(True)
    read = _codegen.sequence_read((_x(), 1.5), traced)
    assert read is not None and reads.sequence_leaves(read, (_x(), 2)) is not None
    assert reads.sequence_leaves(_codegen.sequence_read((_x(), _x()), _flatten.PLAIN_ARRAY_TYPES), (_x(), 2)) is None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Params:
    w: jax.Array
    b: jax.Array
    tag: str = dataclasses.field(metadata=dict(static=True), default="a")


def _tree_read(example):
    return _plan.TreeRead(
        jax.tree_util.default_registry.flatten, jax.tree_util.tree_structure(example), _flatten.PLAIN_ARRAY_TYPES
    )


def test_a_registered_node_reads_as_jax_flattens_it(reads):
    read = _tree_read(_Params(_x(), _x(2)))
    p = _Params(_x(4), _x(5))
    assert [id(x) for x in reads.tree_leaves(read, p)] == [id(x) for x in jax.tree_util.tree_leaves(p)]
    assert reads.tree_leaves(read, _Params(_x(), _x(), tag="b")) is None  # (other node data)
    assert reads.tree_leaves(read, _Params(_x(), 1.0)) is None  # (a leaf of another type)
    assert reads.tree_leaves(read, (_x(), _x())) is None  # (another node type)


@pytest.mark.parametrize(
    ("recorded", "given", "by_value", "matches"),
    [
        ("relu", "relu", False, True),
        (7, 7, True, True),
        (10**20, int("1" + "0" * 20), True, True),  # (equal, not the same object)
        (10**20, int("1" + "0" * 20), False, False),  # (compared by identity only)
        ("ab", "".join(["a", "b"]), True, True),
        (1, 1.0, True, False),  # (another type: another program)
        (1, True, True, False),
        (0.0, -0.0, True, False),  # (floats by their bits)
        (0.5, float("0.5"), True, True),
        (math.nan, float("nan"), True, True),
        (1 + 2j, complex(1, 2), True, True),
    ],
)
def test_a_static_argument_matches_by_its_leaf_key(reads, recorded, given, by_value, matches):
    read = _plan.StaticRead(0, recorded, by_value)
    assert reads.static_matches(read, given) is matches
    assert reads.static_matches(read, given) == (given is recorded or (by_value and _flatten.static_equal(given, recorded)))


@pytest.mark.parametrize("example", _sequences(), ids=["tuple", "list", "dict", "nested", "empty"])
def test_sequence_into_appends_the_leaves_sequence_leaves_gives(reads, example):
    """The structure route reads a sequence straight into its list of the call's leaves."""
    read = _codegen.sequence_read(example, _flatten.PLAIN_ARRAY_TYPES)
    out = ["before"]
    assert reads.sequence_into(read, example, out) is True
    assert out[0] == "before" and [id(x) for x in out[1:]] == [id(x) for x in reads.sequence_leaves(read, example)]
    assert reads.sequence_into(read, [example], out) is False  # (another structure)


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_a_dict_changed_by_its_leaf_type_test_reads_as_it_was(reads, nested):
    """An argument is read straight, with no copy of any container's items, only where no
    read can run user code; an item whose type's hash runs code (here: replacing a later item,
    and nested, an item of the outer dict too) makes the whole argument read from snapshots,
    as jax would have flattened it when the call began."""
    x, y = _x(), _x(2)
    odd = np.ones(3, np.float32).view(OddArray)
    d = {"a": odd, "b": x}
    arg = {"outer": d, "z": y} if nested else d
    read = _codegen.sequence_read({"a": np.ones(3, np.float32), "b": x} if not nested else
                                  {"outer": {"a": np.ones(3, np.float32), "b": x}, "z": y}, _flatten.PLAIN_ARRAY_TYPES)
    expected = [id(v) for v in jax.tree_util.tree_leaves(arg)]
    out: list = []
    # (nested: the outer dict, read before the leaf that runs the code, is changed too)
    HashRunsCode.armed = lambda: (d.__setitem__("b", _x(5)), nested and arg.__setitem__("z", _x(7)))
    try:
        assert reads.sequence_into(read, arg, out) is True
    finally:
        HashRunsCode.armed = None
    assert [id(v) for v in out] == expected


def test_a_dict_with_keys_that_are_not_str_reads_as_jax_flattens_it(reads):
    """A key that is not exactly a str (its `==` may run code) is read from a snapshot too."""
    example = {"w": {2: _x(), 1: _x(2)}, "b": {(0, "k"): _x(1)}}
    read = _codegen.sequence_read(example, _flatten.PLAIN_ARRAY_TYPES)
    out: list = []
    assert reads.sequence_into(read, example, out) is True
    assert [id(v) for v in out] == [id(v) for v in jax.tree_util.tree_leaves(example)]
    assert reads.sequence_into(read, {"w": {2: _x(), 3: _x(2)}, "b": {(0, "k"): _x(1)}}, []) is False

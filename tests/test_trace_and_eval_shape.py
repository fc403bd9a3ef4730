"""`.trace`, `.eval_shape` and `jax.ShapeDtypeStruct` arguments, as jax.jit's; what
jax.export does with a fastcall function."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fastcall


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert type(x) is type(y) and x == y, (x, y)


def params_fn(x, p):
    return {"y": jnp.tanh(x @ p["w"] + p["b"]), "n": 3, "parts": (x.sum(), p["b"][:1])}


def _args(abstract):
    x, p = jnp.ones(3), {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    if abstract:
        x, p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, p))
    return x, p


@pytest.mark.parametrize("abstract", [False, True], ids=["arrays", "ShapeDtypeStructs"])
def test_eval_shape_is_jax_jits(abstract):
    args = _args(abstract)
    _same(fastcall.jit(params_fn).eval_shape(*args), jax.jit(params_fn).eval_shape(*args))


def test_eval_shape_of_static_and_keyword_arguments():
    def f(x, n, *, scale):
        return x * n * scale

    args, kwargs = (jax.ShapeDtypeStruct((2,), jnp.float16), 3), {"scale": 2.0}
    _same(
        fastcall.jit(f, static_argnums=1).eval_shape(*args, **kwargs),
        jax.jit(f, static_argnums=1).eval_shape(*args, **kwargs),
    )


def test_eval_shape_of_an_equinox_model_is_filter_eval_shapes():
    model = eqx.nn.MLP(3, 2, 4, depth=1, key=jax.random.key(0))

    def f(model, x):
        return model, model(x), "tag"

    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    expected = eqx.filter_eval_shape(f, model, x)
    # (fastcall.filter_jit keeps eqx.filter_jit's rule: a ShapeDtypeStruct is static there,
    # as eqx.filter_jit(f).lower takes it; it is given the array)
    for wrap, given in ((fastcall.jit, x), (fastcall.filter_jit, jnp.ones(3))):
        got = wrap(f).eval_shape(model, given)
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        assert jax.tree.leaves(got) == jax.tree.leaves(expected)


def test_eval_shape_runs_nothing_writes_nothing_back_and_compiles_as_a_call_would():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(model, x):
        model.bias[...] += 1.0
        return model(x)

    f = fastcall.jit(step)
    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    _same(f.eval_shape(model, x), nnx.jit(step).eval_shape(model, x))
    assert jnp.all(model.bias[...] == 0.0)
    y = f(model, jnp.ones(2))  # the entry eval_shape traced serves the call: one program
    assert f.stats().compiles == 1 and f.stats().calls == 1
    assert jnp.all(model.bias[...] == 1.0) and y.shape == (2,)


def test_eval_shape_of_a_function_returning_nnx_objects_is_nnx_jits():
    """New objects holding the abstract values, as nnx.jit's eval_shape returns them; the
    caller's objects untouched."""
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def f(m, x):
        m.bias[...] += 1.0
        return m, nnx.Linear(2, 3, rngs=nnx.Rngs(1)), m(x)

    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    ours, theirs = fastcall.jit(f).eval_shape(model, x), nnx.jit(f).eval_shape(model, x)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert jax.tree.leaves(ours) == jax.tree.leaves(theirs)
    assert ours[0] is not model and type(ours[1]) is nnx.Linear
    assert model.bias[...].tolist() == [0.0, 0.0]


def test_trace_then_lower_then_compile_runs_as_a_call():
    for abstract in (False, True):
        traced = fastcall.jit(params_fn).trace(*_args(abstract))
        assert isinstance(traced, fastcall.Traced)
        assert "tanh" in str(traced.jaxpr) and "jaxpr" in dir(traced)
        compiled = traced.lower().compile()
        _same(
            jax.tree.map(lambda a: a.tolist(), compiled(*_args(False))),
            jax.tree.map(lambda a: a.tolist(), jax.jit(params_fn)(*_args(False))),
        )


def test_lower_takes_shape_dtype_structs_with_their_shardings():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=sharding)
    compiled = fastcall.jit(lambda x: x * 2).lower(x).compile()
    assert compiled.input_shardings == jax.jit(lambda x: x * 2).lower(x).compile().input_shardings
    assert jnp.allclose(compiled(jnp.ones(4)), 2.0)


def test_an_abstract_nnx_model_lowers_for_its_concrete_twin():
    abstract = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    compiled = fastcall.jit(lambda m, x: m(x)).lower(abstract, jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    assert jnp.allclose(compiled(model, jnp.ones(2)), model(jnp.ones(2)))


def test_a_call_given_a_shape_dtype_struct_fails_as_jax_jits():
    x = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(TypeError) as ours:
        fastcall.jit(lambda x: x * 2)(x)
    with pytest.raises(TypeError) as theirs:
        jax.jit(lambda x: x * 2)(x)
    assert str(ours.value) == str(theirs.value)


def _spec(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def test_the_wrappers_are_jax_stages_wrapped_and_export_as_jax_jit_exports():
    """jax.export works on fastcall's wrappers with the user's argument structure: a
    function taking arrays and statics, one closing over a model, a fastcall.partial; the
    exported program computes what jax.jit's export computes."""

    def f(x, p, n):
        return {"y": jnp.tanh(x @ p["w"]) * n}

    wrapped = fastcall.jit(f, static_argnums=2)
    assert isinstance(wrapped, jax.stages.Wrapped)
    x, p = jnp.arange(3.0), {"w": jnp.ones((3, 2))}
    ours = jax.export.export(wrapped)(_spec(x), jax.tree.map(_spec, p), 3)
    theirs = jax.export.export(jax.jit(f, static_argnums=2))(_spec(x), jax.tree.map(_spec, p), 3)
    assert ours.in_tree == theirs.in_tree and ours.out_tree == theirs.out_tree
    assert jnp.allclose(ours.call(x, p)["y"], theirs.call(x, p)["y"])

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    closing = jax.export.export(fastcall.jit(lambda x: model(x)))(_spec(x))
    bound = jax.export.export(fastcall.partial(lambda m, x: m(x), model))(_spec(x))
    for exported in (closing, bound):
        assert jnp.allclose(exported.call(x), model(x))
    # the wrapper still calls as before, on fastcall's own program
    assert jnp.allclose(wrapped(x, p, 3)["y"], f(x, p, 3)["y"])


def test_export_of_arguments_jax_jit_cannot_take_says_why():
    wrapped = fastcall.jit(lambda x, tag: x)
    with pytest.raises(fastcall.FastcallError, match="must be an array"):
        jax.export.export(wrapped)(jax.ShapeDtypeStruct((2,), jnp.float32), {"name": "a string"})


def test_partial_trace_and_eval_shape_take_the_remaining_arguments():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    serve = fastcall.partial(lambda m, x: m(x), model)
    x = jax.ShapeDtypeStruct((5, 2), jnp.float32)
    assert serve.eval_shape(x) == jax.ShapeDtypeStruct((5, 2), jnp.float32)
    assert jnp.allclose(serve.trace(x).lower().compile()(jnp.ones((5, 2))), model(jnp.ones((5, 2))))


def test_eval_shape_inside_a_trace_gives_shapes_as_jax_jits():
    f = fastcall.jit(lambda x: x[:1] + 1)
    g = jax.jit(lambda x: jnp.zeros(f.eval_shape(x).shape))
    assert g(jnp.ones(3)).shape == (1,)


def test_eval_shape_of_nnx_arguments_inside_an_outer_trace():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    f = fastcall.jit(lambda m, x: m(x))
    spec = jax.ShapeDtypeStruct((4, 2), jnp.float32)
    outer = jax.jit(lambda y: jnp.zeros(f.eval_shape(model, spec).shape) + y)
    assert outer(1.0).shape == nnx.jit(lambda m, x: m(x)).eval_shape(model, spec).shape == (4, 3)


def test_export_of_a_partial_drops_what_the_binding_took_and_a_traced_still_lowers_its_own():
    def f(n, x, scale=1.0):
        return x * n * scale

    x = jnp.arange(3.0)
    bound = fastcall.partial(fastcall.jit(f, static_argnames="n"), 3)
    assert jnp.allclose(jax.export.export(bound)(_spec(x)).call(x), f(3, x))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharded = fastcall.partial(fastcall.jit(f, in_shardings=(sharding, sharding)), 2.0)
    assert jnp.allclose(jax.export.export(sharded)(_spec(x)).call(x), f(2.0, x))

    g = fastcall.jit(lambda a, p: a @ p["w"])
    p = {"w": jnp.ones((3, 2))}
    traced = g.trace(_spec(x), jax.tree.map(_spec, p))
    traced.lower(lowering_platforms=("cpu",))  # (as jax.export lowers it)
    assert jnp.allclose(traced.lower().compile()(x, p), x @ p["w"])

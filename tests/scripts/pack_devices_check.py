"""Packing on two devices (run by tests/test_sharding.py with 2 simulated CPU devices): a
model committed to the second device is packed there and its output stays there, as
jax.jit's does on the model's own leaves; one sharded over both devices is not packed."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import fastcall


class Net(eqx.Module):
    biases: list

    def __call__(self, x):
        for b in self.biases:
            x = jnp.tanh(x + b)
        return x


def forward(model, x):
    return model(x)


devices = jax.devices()
assert len(devices) == 2, devices
net = Net([jnp.full((4,), i, dtype=jnp.float32) for i in range(4)])
x = jnp.arange(4.0)

on_second = jax.device_put(net, devices[1])
f = fastcall.jit(forward)
floor = jax.jit(forward)
for _ in range(4):
    out = f(on_second, jax.device_put(x, devices[1]))
expected = floor(on_second, jax.device_put(x, devices[1]))
np.testing.assert_allclose(out, expected, rtol=1e-6)
assert out.sharding == expected.sharding, (out.sharding, expected.sharding)
assert f.stats().packed_leaves == 4, f.stats()

mesh = jax.sharding.Mesh(np.array(devices), ("d",))
sharded = jax.device_put(net, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
g = fastcall.jit(lambda model, x: model(x))  # (not `forward`: equal functions share counts)
for _ in range(4):
    out = g(sharded, x)
np.testing.assert_allclose(out, floor(sharded, x), rtol=1e-6)
assert g.stats().packed_leaves == 0, g.stats()
print("PACK DEVICE CHECKS PASSED")

# an error in a packed call names the user's function, leaves and arguments, as the unpacked one
h = fastcall.jit(lambda model, x: model(x))
on_first = jax.device_put(net, devices[0])  # (committed there)
for _ in range(4):
    h(on_first, x)
assert h.stats().packed_leaves == 4, h.stats()
try:
    h(on_first, jax.device_put(x, devices[1]))
    raise AssertionError("no error")
except ValueError as err:
    message = str(err)
assert "model.biases[0] ... model.biases[3] (packed) of <lambda>" in message, message
assert "argument x of <lambda>" in message, message
print("PACK DEVICE ERRORS NAMED")

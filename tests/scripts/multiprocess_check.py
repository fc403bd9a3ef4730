"""One of two JAX processes on this machine (see tests/test_sharding.py).

Usage: multiprocess_check.py PROCESS_ID PORT. Each process has 2 CPU devices;
jax.distributed joins them over loopback into one 4-device mesh. A
fastcall-wrapped data-parallel train step runs on the global mesh; its loss
and parameters must equal a single-process computation of the same step.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

process_id, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60
)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fastcall  # noqa: E402

assert jax.process_count() == 2 and len(jax.devices()) == 4, (jax.process_count(), jax.devices())
mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.PRNGKey(0))
x_full = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (16, 8)))
y_full = np.zeros((16, 4), np.float32)


def step(m, x, y):
    loss, g = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m)
    return eqx.apply_updates(m, jax.tree_util.tree_map(lambda d: -0.1 * d, g)), loss


# The single-process reference (same data, same weights, computed locally).
with jax.default_device(jax.local_devices()[0]):
    ref_model, ref_loss = eqx.filter_jit(step)(model, jnp.asarray(x_full), jnp.asarray(y_full))

rep = NamedSharding(mesh, P())
data = NamedSharding(mesh, P("data"))
half = slice(process_id * 8, process_id * 8 + 8)
x = jax.make_array_from_process_local_data(data, x_full[half], x_full.shape)
y = jax.make_array_from_process_local_data(data, y_full[half], y_full.shape)
m = jax.tree_util.tree_map(
    lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a), a.shape) if eqx.is_array(a) else a, model
)
f = fastcall.jit(step)
for _ in range(2):  # second call: the cached path
    new_m, loss = f(m, x, y)
loss_local = float(multihost_utils.process_allgather(loss, tiled=True))
np.testing.assert_allclose(loss_local, float(ref_loss), rtol=1e-5)
for a, b in zip(jax.tree_util.tree_leaves(new_m), jax.tree_util.tree_leaves(ref_model)):
    if eqx.is_array(a):
        np.testing.assert_allclose(multihost_utils.process_allgather(a, tiled=True), np.asarray(b), rtol=1e-5, atol=1e-6)
print(f"process {process_id}: MULTIPROCESS CHECK PASSED", flush=True)
jax.distributed.shutdown()

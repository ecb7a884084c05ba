"""One process of the 2-process sharding test (run by tests/sharding/test_sharding_multiprocess.py).

Joins the distributed runtime from the env vars the harness sets, builds a global mesh, assembles
a global batch from per-process rows, and runs a jitted loss + gradient that needs cross-process
collectives. Prints one JSON line with the results.
"""
import json

import numpy as np

from jaxrl_llm import sharding

assert sharding.initialize(), "expected a multi-process run"
assert sharding.initialize(), "initialize must be idempotent"

import jax  # noqa: E402  (after initialize on purpose: nothing may touch the backend before it)
import jax.numpy as jnp  # noqa: E402

from sharding_fixtures import GLOBAL_BATCH, logical_axes, make_batch, make_params, mlp_loss  # noqa: E402

results = {"process_index": jax.process_index(), "process_count": jax.process_count(),
           "local_devices": jax.local_device_count(), "global_devices": jax.device_count()}
host_params = make_params()
host_batch = make_batch()
for name, mesh_cfg in [("data2_tensor4", {"data": 2, "fsdp": 1, "tensor": 4}),
                       ("fsdp8", {"data": 1, "fsdp": -1, "tensor": 1})]:
    mesh = sharding.make_mesh(mesh_cfg)
    params = sharding.shard_params(host_params, logical_axes(), mesh)
    rows = sharding.process_slice(GLOBAL_BATCH, mesh)
    batch = sharding.host_local_to_global({k: v[rows] for k, v in host_batch.items()}, mesh)
    assert batch["x"].shape[0] == GLOBAL_BATCH, batch["x"].shape
    with jax.set_mesh(mesh):  # activation constraints inside forward() use this mesh
        loss, grads = jax.jit(jax.value_and_grad(mlp_loss))(params, batch)
    grad_sq = sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads))
    total = jax.jit(lambda b: jnp.sum(b["x"]))(batch)  # a plain cross-process all-reduce
    # fully replicated scalars: every process holds a copy
    results[name] = {"rows": [rows.start, rows.stop], "loss": float(loss.addressable_data(0)),
                     "grad_sq": float(jax.jit(lambda g: g)(grad_sq).addressable_data(0)),
                     "x_sum": float(total.addressable_data(0))}
print(json.dumps(results))

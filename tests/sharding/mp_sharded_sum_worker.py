"""One process of the 2-process sharding test (run by tests/sharding/test_sharding_multiprocess.py).

Joins the distributed runtime from the env vars the harness sets, builds a global mesh, assembles
a global batch from per-process rows, and runs a jitted loss + gradient that needs cross-process
collectives. Prints one JSON line with the results.
"""
import json

from jaxrl_llm import sharding

assert sharding.initialize(), "expected a multi-process run"
assert sharding.initialize(), "initialize must be idempotent"

import jax  # noqa: E402  (after initialize on purpose: nothing may touch the backend before it)
from sharding_fixtures import GLOBAL_BATCH, logical_axes, loss_grad_metrics, make_batch, make_params  # noqa: E402

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
        metrics = jax.jit(loss_grad_metrics)(params, batch)
    # fully replicated scalars: every process holds a copy
    results[name] = {"rows": [rows.start, rows.stop],
                     **{k: float(v.addressable_data(0)) for k, v in metrics.items()}}
print(json.dumps(results))

"""Device mesh from config, logical-axis rules, param/batch/optimizer sharding, host <-> device batch
transfer (`to_device` / `to_host`, multi-host aware), multi-host init."""
from jaxrl_llm.sharding.batch import (
    batch_sharding,
    host_local_to_global,
    process_slice,
    rows_sharding,
    shard_batch,
    to_device,
    to_device_if_rows_split,
    to_host,
)
from jaxrl_llm.sharding.distributed import detect_cluster, initialize
from jaxrl_llm.sharding.mesh import (
    BATCH_AXES,
    DEFAULT_MESH_SIZES,
    MESH_AXES,
    batch_axes,
    batch_axis_size,
    make_mesh,
    mesh_context,
    on_own_mesh,
    resolve_mesh_shape,
)
from jaxrl_llm.sharding.optimizer import optimizer_state_sharding
from jaxrl_llm.sharding.rules import (
    DEFAULT_RULES,
    logical_to_sharding,
    logical_to_spec,
    rules_dict,
    shard_params,
    with_activation_constraint,
)

__all__ = [
    "BATCH_AXES", "DEFAULT_MESH_SIZES", "DEFAULT_RULES", "MESH_AXES", "batch_axes", "batch_axis_size",
    "batch_sharding", "detect_cluster", "host_local_to_global", "initialize", "logical_to_sharding",
    "logical_to_spec", "make_mesh", "mesh_context", "on_own_mesh", "optimizer_state_sharding", "process_slice",
    "resolve_mesh_shape",
    "rows_sharding", "rules_dict", "shard_batch", "shard_params", "to_device", "to_device_if_rows_split", "to_host",
    "with_activation_constraint",
]

"""The weights the paged engine decodes from: a copy of the policy's made once per rollout, its matmul weights in the
compute dtype (decode reads every weight at every step), and with `EngineSpec.whole_weights` whole on every device
over 'data' and 'fsdp' (kept split over 'tensor' and 'expert').

Why whole: with the slots split over the batch axes (engine/slot_shards.py) each device decodes its own rows, and
FSDP-sharded weights are then all-gathered at every decode step, as the update gathers them for its rows; on
0.5B x v5e-8 that was 4.5 TB of interconnect a chip per rollout, written to and read back from HBM. A copy gathered
once per rollout removes that traffic (vLLM's data-parallel replicas each hold their weights, split over tensor
parallelism only). `engine_spec` takes it where it fits (`WHOLE_WEIGHTS_SHARE` of the KV budget) and takes its
bytes out of the pool's.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import ModelConfig, init_params, param_logical_axes
from jaxrl_llm.models.dtypes import as_jnp_dtype, is_uncast_matmul_weight, matmul_weights_in, uncast_matmul_weights
from jaxrl_llm.sharding.rules import logical_to_sharding

WHOLE_AXES = ("data", "fsdp")  # the axes a whole copy is gathered over: 'expert' keeps a MoE layer's experts split
# the whole copy is taken where its bytes a device are at most this share of the KV budget (the rest: the pool)
WHOLE_WEIGHTS_SHARE = 0.25


def whole_sharding(sharding: Any) -> Any:
    """`sharding` (a NamedSharding) with WHOLE_AXES dropped from its spec; anything else as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding

    def keep(entry: Any) -> Any:
        if entry is None:
            return None
        names = tuple(a for a in ((entry,) if isinstance(entry, str) else entry) if a not in WHOLE_AXES)
        return names[0] if len(names) == 1 else (names or None)

    return NamedSharding(sharding.mesh, PartitionSpec(*(keep(e) for e in sharding.spec)))


def decode_leaf(path: tuple, x: Any, dtype: Any, whole: bool) -> jax.ShapeDtypeStruct:
    """The abstract decode copy of one (abstract) param leaf with a sharding."""
    target = jnp.dtype(dtype) if is_uncast_matmul_weight(path, x, dtype) else x.dtype
    sharding = whole_sharding(x.sharding) if whole else x.sharding
    return jax.ShapeDtypeStruct(x.shape, target, sharding=sharding)


def per_device_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    size = 1
    for n in shape:
        size *= n
    return size * leaf.dtype.itemsize


@functools.lru_cache(maxsize=16)
def whole_weight_bytes(cfg: ModelConfig, mesh: Mesh, compute_dtype: str) -> int:
    """Bytes a device holds of a whole decode copy of `cfg`'s weights on `mesh`."""
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    shardings = logical_to_sharding(param_logical_axes(cfg), abstract, mesh)
    placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    dtype = as_jnp_dtype(compute_dtype)
    leaves = jax.tree_util.tree_leaves_with_path(placed)
    return sum(per_device_bytes(decode_leaf(path, x, dtype, True)) for path, x in leaves)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _weights_in(params: dict, dtype: str) -> dict:
    return matmul_weights_in(params, dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "shardings"))
def _whole_weights_in(params: dict, dtype: str, shardings: tuple) -> dict:
    leaves, treedef = jax.tree.flatten(matmul_weights_in(params, dtype))
    return treedef.unflatten([jax.lax.with_sharding_constraint(x, s) for x, s in zip(leaves, shardings)])


def decode_copy(params: dict, compute_dtype: str, whole: bool = False) -> dict:
    """`params` with their matmul weights in the compute dtype (no copy when they already are and `whole` is off);
    `whole`: gathered over WHOLE_AXES (module doc), once."""
    leaves = jax.tree.leaves(params)
    if whole and all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in leaves):
        return _whole_weights_in(params, compute_dtype, tuple(whole_sharding(x.sharding) for x in leaves))
    if not uncast_matmul_weights(params, as_jnp_dtype(compute_dtype)):
        return params
    return _weights_in(params, compute_dtype)

"""Batch placement: the leading (batch) dim is split over ('data', 'fsdp', 'expert'), the rest replicated.

Single process: `shard_batch` device_puts a host batch. Multi-host: every process loads only its
own rows (`process_slice`) and `host_local_to_global` assembles the global jax.Array without any
process seeing the whole batch.
"""
from __future__ import annotations

from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.arrays import ArrayTree
from jaxrl_llm.sharding.mesh import BATCH_AXES, batch_axis_size, mesh_axis_sizes

BatchTree = TypeVar("BatchTree")  # a pytree of arrays, returned with the same structure


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading dim over ('data', 'fsdp', 'expert'), other `ndim - 1` dims replicated."""
    if ndim < 1:
        raise ValueError(f"batch_sharding: a batch array needs a leading batch dim, got ndim={ndim}")
    axes = tuple(a for a in BATCH_AXES if a in mesh_axis_sizes(mesh))
    return NamedSharding(mesh, PartitionSpec(axes or None, *([None] * (ndim - 1))))


def rows_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """`batch_sharding` when the leading dim (rows) splits over the mesh's batch axes, else replicated."""
    if shape[0] % batch_axis_size(mesh):
        return NamedSharding(mesh, PartitionSpec())
    return batch_sharding(mesh, len(shape))


def shard_batch(batch: BatchTree, mesh: Mesh) -> BatchTree:
    """Single-process: device_put every array of `batch` (any pytree) split along its leading dim."""
    if jax.process_count() > 1:
        raise RuntimeError("shard_batch is single-process; with several processes each one loads "
                           "its rows (process_slice) and calls host_local_to_global")
    ways = batch_axis_size(mesh)

    def put(path: tuple, leaf: Any) -> jax.Array:
        shape = np.shape(leaf)
        if not shape or shape[0] % ways:
            raise ValueError(f"batch[{_path_str(path)}]: leading dim of shape {shape} must be divisible "
                             f"by the data x fsdp x expert mesh size {ways}")
        return jax.device_put(leaf, batch_sharding(mesh, len(shape)))

    return jax.tree_util.tree_map_with_path(put, batch)


def _local_batch_shards(mesh: Mesh, global_rows: int) -> list[tuple[int, int]]:
    """Distinct (start, stop) row ranges of a `global_rows` batch held by this process's devices."""
    index_map = batch_sharding(mesh, 1).addressable_devices_indices_map((global_rows,))
    return sorted({(idx[0].start or 0, global_rows if idx[0].stop is None else idx[0].stop)
                   for idx in index_map.values() if idx is not None})


def host_local_to_global(batch: ArrayTree, mesh: Mesh) -> ArrayTree:
    """Multi-host: turns this process's rows of every array in `batch` into global jax.Arrays.

    Each process passes the rows `process_slice(global_batch_size, mesh)` selects; the global
    batch size is inferred (local rows x number of batch shards / shards held locally).
    """
    ways = batch_axis_size(mesh)

    def put(path: tuple, leaf: Any) -> jax.Array:
        leaf = np.asarray(leaf)
        if leaf.ndim == 0:
            raise ValueError(f"batch[{_path_str(path)}]: a batch array needs a leading batch dim")
        # how many distinct batch shards this process holds (processes may also replicate them)
        local_shards = len(_local_batch_shards(mesh, ways))
        if leaf.shape[0] % local_shards:
            raise ValueError(f"batch[{_path_str(path)}]: {leaf.shape[0]} local rows cannot be split into "
                             f"the {local_shards} batch shards this process holds")
        return jax.make_array_from_process_local_data(batch_sharding(mesh, leaf.ndim), leaf)

    return jax.tree_util.tree_map_with_path(put, batch)


def process_slice(global_batch_size: int, mesh: Mesh | None = None) -> slice:
    """The rows of a global batch this process loads.

    Without `mesh`: an even split by process index. With `mesh`: exactly the rows this process's
    devices hold under `batch_sharding(mesh, ...)`, which is what `host_local_to_global` expects.
    """
    count, index = jax.process_count(), jax.process_index()
    if mesh is None:
        if global_batch_size % count:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by the "
                             f"{count} processes")
        per = global_batch_size // count
        return slice(index * per, (index + 1) * per)
    ways = batch_axis_size(mesh)
    if global_batch_size % ways:
        raise ValueError(f"global batch size {global_batch_size} is not divisible by the data x fsdp x expert "
                         f"mesh size {ways}")
    ranges = _local_batch_shards(mesh, global_batch_size)
    start, stop = ranges[0][0], ranges[-1][1]
    if sum(b - a for a, b in ranges) != stop - start:
        raise ValueError(f"process {index} holds non-contiguous batch rows {ranges}; build the mesh "
                         "so each process's devices are adjacent along data/fsdp")
    return slice(start, stop)


def to_device(arrays: ArrayTree, mesh: Mesh) -> ArrayTree:
    """Global batch-sharded arrays from host arrays that hold the whole batch on every process
    (each process contributes the rows its devices hold)."""
    if jax.process_count() == 1:
        return shard_batch(arrays, mesh)
    rows = np.shape(jax.tree.leaves(arrays)[0])[0]
    local = process_slice(rows, mesh)
    return host_local_to_global(jax.tree.map(lambda x: np.asarray(x)[local], arrays), mesh)


def to_device_if_rows_split(arrays: ArrayTree, mesh: Mesh) -> ArrayTree:
    """`to_device` when the rows split over the mesh's batch axes (a training batch), else plain
    device arrays (a short validation batch that the batch axes do not divide)."""
    rows = np.shape(jax.tree.leaves(arrays)[0])[0]
    if rows % batch_axis_size(mesh):
        return jax.tree.map(jax.numpy.asarray, arrays)
    return to_device(arrays, mesh)


def to_host(x: ArrayTree) -> ArrayTree:  # numpy leaves
    """The full value of (a pytree of) global arrays as numpy, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)

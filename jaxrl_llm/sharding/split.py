"""Split mesh: a device subset that only generates (`mesh.rollout_devices`) beside the training mesh.

The rollout mesh has the training mesh's axes ('data', 'fsdp', 'expert', 'tensor'; its `expert` is 1:
the experts are not split there), so every parameter's PartitionSpec means the same thing on both;
weights move with `jax.device_put` onto the rollout mesh's `NamedSharding`s (device to device, no
host staging). A dimension that the rollout mesh cannot split evenly is replicated there instead.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.arrays import ArrayTree, ShardingTree
from jaxrl_llm.platform.chips import Device
from jaxrl_llm.sharding.mesh import MESH_AXES, make_mesh


def split_devices(rollout_devices: int | Sequence[int] | None, devices: Sequence[Device] | None = None
                  ) -> tuple[list[Device], list[Device]]:
    """(training devices, rollout devices); rollout empty when `rollout_devices` is None.
    An int N takes the last N devices; a list names device ids. ValueError naming the key."""
    devices = list(jax.devices() if devices is None else devices)
    if rollout_devices is None:
        return devices, []
    if isinstance(rollout_devices, bool):
        raise ValueError(f"mesh.rollout_devices={rollout_devices!r}: expected a device count or a list of ids")
    if isinstance(rollout_devices, int):
        if not 0 < rollout_devices < len(devices):
            raise ValueError(f"mesh.rollout_devices={rollout_devices}: must be between 1 and {len(devices) - 1} "
                             f"(the other devices of the {len(devices)} train)")
        return devices[:-rollout_devices], devices[-rollout_devices:]
    ids = [int(i) for i in rollout_devices]
    by_id = {d.id: d for d in devices}
    unknown = [i for i in ids if i not in by_id]
    if unknown or len(set(ids)) != len(ids) or not 0 < len(ids) < len(devices):
        raise ValueError(f"mesh.rollout_devices={list(rollout_devices)!r}: expected distinct ids of 1 to "
                         f"{len(devices) - 1} of the devices {sorted(by_id)}")
    chosen = set(ids)
    return [d for d in devices if d.id not in chosen], [by_id[i] for i in ids]


def num_training_devices(rollout_devices: int | Sequence[int] | None, num_devices: int) -> int:
    """Devices left for training on `num_devices` (config validation, before any mesh exists)."""
    if rollout_devices is None:
        return num_devices
    taken = rollout_devices if isinstance(rollout_devices, int) else len(list(rollout_devices))
    return max(num_devices - int(taken), 1)


def make_split_meshes(mesh_cfg: Mapping[str, Any] | Any) -> tuple[Mesh, Mesh | None]:
    """(training mesh, rollout mesh or None) from the config's `mesh` section. The training mesh
    takes data / fsdp / expert / tensor as configured; the rollout mesh keeps the tensor size when it
    divides its devices and splits the rest over 'fsdp'."""
    items = getattr(mesh_cfg, "to_dict")() if hasattr(mesh_cfg, "to_dict") else dict(mesh_cfg or {})
    train_devices, rollout = split_devices(items.pop("rollout_devices", None))
    train_mesh = make_mesh(items, train_devices)
    if not rollout:
        return train_mesh, None
    tensor = int(items.get("tensor", 1))
    tensor = tensor if tensor > 0 and len(rollout) % tensor == 0 else 1
    return train_mesh, make_mesh({"data": 1, "fsdp": -1, "tensor": tensor}, rollout)


def _spec_on(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with every dimension that `mesh` cannot split evenly replicated."""
    sizes = dict(mesh.shape)
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        ways = math.prod(sizes.get(a, 1) for a in names if a in MESH_AXES)
        out.append(axes if names and dim % ways == 0 else None)
    return PartitionSpec(*out)


def shardings_on(tree: ArrayTree, mesh: Mesh) -> ShardingTree:
    """A NamedSharding on `mesh` per array of `tree`, with each array's own PartitionSpec."""
    def one(x: jax.Array) -> NamedSharding:
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
        return NamedSharding(mesh, _spec_on(spec, tuple(x.shape), mesh))

    return jax.tree.map(one, tree)


def transfer(tree: ArrayTree, mesh: Mesh) -> ArrayTree:
    """`tree`'s arrays moved onto `mesh` (device to device; new buffers, never aliases). Across
    processes `jax.device_put` refuses meshes of different device sets (outside Pathways / TPU's TFRT
    runtime): there each array moves by `_transfer_across_processes`."""
    return move(tree, shardings_on(tree, mesh))


def move(tree: ArrayTree, shardings: ShardingTree) -> ArrayTree:
    """`tree`'s arrays as new buffers on `shardings` (a tree of them, or one for every array), whatever
    devices they are on now: `jax.device_put`, or across processes `_transfer_across_processes`."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings, may_alias=False)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(_transfer_across_processes, tree, shardings)


def _index_key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _transfer_across_processes(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    """`x` on `target` in a multi-process run. Where every target shard's data is on a source device of
    the same process (a split that gives each host's training and rollout devices the same layout),
    each process copies its own shards device to device; otherwise the array is all-gathered to every
    host and each process places its target shards from host memory. The choice is made from the
    global shardings alone, so every process takes the same path (the gather is a collective)."""
    if x.sharding.device_set == target.device_set:
        return jax.device_put(x, target, may_alias=False)
    sources: dict[tuple[int, tuple], Any] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        sources.setdefault((device.process_index, _index_key(index)), device)
    wanted = {d: sources.get((d.process_index, _index_key(index)))
              for d, index in target.devices_indices_map(x.shape).items()}
    if all(source is not None for source in wanted.values()):
        local = {shard.device: shard.data for shard in x.addressable_shards}
        me = jax.process_index()
        shards = [jax.device_put(local[source], device, may_alias=False) for device, source in wanted.items()
                  if device.process_index == me]
        return jax.make_array_from_single_device_arrays(x.shape, target, shards)
    whole = multihost_utils.process_allgather(x, tiled=True)
    return jax.make_array_from_callback(x.shape, target, lambda index: whole[index])


def copy_tree(tree: ArrayTree) -> ArrayTree:
    """A real copy of `tree` on the same devices: new buffers that outlive a donation of the originals."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), tree)

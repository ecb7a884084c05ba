"""The engine's slots and KV pages split over the mesh's batch axes ('data', 'fsdp', 'expert' where > 1).

Without it every chip of a data-parallel mesh decodes every slot: it holds the whole pool (split over
'tensor' only) and reads every sequence's KV each step, so a rollout's KV traffic per chip does not fall
with the chips. With `EngineSpec.slot_shards` = D > 1 (`engine_spec` sets it to the batch axes' product):

- slot s lives on shard s // (S / D) (S: the slot set's size, a multiple of D; every drain set too);
- the pool's page axis is split D ways, and a slot's page table holds page ids local to its shard (each
  shard's page 0 is its own scratch page); the scheduler keeps one page pool per shard
  (engine/scheduler.py), and a prompt's shared pages live in each shard that holds one of its samples;
- the decoder's matmuls see the slots split over the batch axes, as the trainer's rows are, and read weights
  that stay split in place (engine/decode_layout.py: a step moves rows, not weights); every read and
  write of the pool by page id (a decode step's token writes and its attention, a prompt's KV written by
  `insert`) runs per shard under `shard_map` over (batch axes, 'tensor' for the kv heads where they divide
  it), where the ids are local and each kernel sees its shard's slots and pages only.

Each shard computes its slots exactly as one device computes them, so the results are the replicated
engine's (tests/sampler/test_engine_parity.py on 2- and 8-way batch splits).
"""
from __future__ import annotations

import math
from collections.abc import Container, Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.sampler.engine.pages import PagePool
from jaxrl_llm.sampler.kv_shards import kv_head_axis
from jaxrl_llm.sharding.mesh import batch_axis_size, row_split_axes

Array = jax.Array


def batch_split(mesh: Mesh | None) -> tuple[tuple[str, ...], int]:
    """(the mesh's batch axes over 1, the product of their sizes): the axes and count of the slot shards a
    paged engine on `mesh` takes; ((), 1) without a multi-device mesh."""
    if mesh is None:
        return (), 1
    count = batch_axis_size(mesh)
    return row_split_axes(dict(mesh.shape), count) or (), count


def slot_axes(mesh: Mesh | None, shards: int) -> tuple[str, ...]:
    """The axes `shards` slot shards are split over on `mesh`: () for 1 (slots replicated)."""
    if shards == 1:
        return ()
    axes, count = batch_split(mesh)
    if count != shards:
        raise ValueError(f"the engine's slot_shards={shards} is not the mesh's batch split ({count} over {axes})")
    return axes


def shard_count(mesh: Mesh | None, axes: tuple[str, ...]) -> int:
    """How many slot shards `axes` of `mesh` make (1 for none)."""
    if not axes:
        return 1
    assert mesh is not None, "slot shards need the engine's mesh"
    return math.prod(dict(mesh.shape)[a] for a in axes)


def pool_spec(mesh: Mesh, pool: dict, axes: tuple[str, ...]) -> dict:
    """PartitionSpecs of a pool dict ([L, kv, pages, ...] leaves; a Gemma 4 pool: one dict per type): kv heads
    over 'tensor' where they divide it, pages over `axes`."""
    if "k" not in pool:
        return {kind: pool_spec(mesh, sub, axes) for kind, sub in pool.items()}
    heads = kv_head_axis(mesh, pool["k"].shape[1])
    return {name: P(None, heads, axes or None) for name in pool}


def per_slot_shard(fn: Callable[..., Any], mesh: Mesh, in_specs: tuple, out_specs: Any) -> Callable[..., Any]:
    """`fn` run per (slot shard, kv-head shard) under shard_map (every mesh axis manual)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def shard_index(axes: tuple[str, ...]) -> Array:
    """Inside `per_slot_shard`: this shard's index among the slot shards (the slot axis's block order)."""
    return lax.axis_index(axes) if axes else jnp.int32(0)


# host side: the scheduler's per-shard bookkeeping (engine/scheduler.py)

def free_by_shard(slots: Sequence[int], size: int, shards: int) -> list[list[int]]:
    """The free `slots` of a set of `size` slots, listed per slot shard (engine/slot_shards.py), ascending."""
    free: list[list[int]] = [[] for _ in range(shards)]
    for slot in sorted(slots):
        free[slot // (size // shards)].append(slot)
    return free


def kept_in_shards(running: Sequence[int], size: int, target: int, shards: int) -> list[int]:
    """keep for `resize_slots` from `size` slots to `target`: each shard's running slots, in order, at the start
    of that shard's block of the new set (-1: empty); a slot never leaves its shard (its pages are there)."""
    keep = [-1] * target
    old_block, new_block = size // shards, target // shards
    filled = [0] * shards
    for slot in running:
        shard = slot // old_block
        keep[shard * new_block + filled[shard]] = slot
        filled[shard] += 1
    return keep


def choose_shard(group_shards: Container[int], free: list[list[int]], pools: list[PagePool], total: int,
                 shared_n: int) -> int | None:
    """The slot shard a request runs in: one with a free slot and the pages it needs (its own `total - shared_n`,
    and the `shared_n` prompt pages where its group has none there yet: not in `group_shards`), preferring a shard
    where its group's prompt pages already are (read once per group with cascade rows), then the most free
    slots, then the lowest index; None when none has room."""
    best: tuple[tuple[bool, int, int], int] | None = None
    for shard, slots in enumerate(free):
        there = shard in group_shards
        if not slots or total - shared_n + (0 if there else shared_n) > pools[shard].num_free:
            continue
        key = (not there, -len(slots), shard)
        if best is None or key < best[0]:
            best = (key, shard)
    return None if best is None else best[1]

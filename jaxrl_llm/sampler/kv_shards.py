"""Decode attention kernels on a device mesh: the KV pool's kv heads split over 'tensor' where they
divide it, and a kernel's custom call (which XLA cannot partition) run per kv-head shard under
`shard_map`. Shared by the Pallas kernels (sampler/paged_attention.py) and the CPU kernel
(sampler/native), and the engine's pool sharding (engine/programs.py)."""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

Array = jax.Array


def kv_head_axis(mesh: Mesh, kv_heads: int) -> str | None:
    """'tensor' when a KV pool's kv heads are split over it (they divide its size), else None: the
    engine's pool sharding (engine/programs.py `state_sharding`) and the kernels' shard_map."""
    tensor = dict(mesh.shape).get("tensor", 1)
    return "tensor" if tensor > 1 and kv_heads % tensor == 0 else None


def per_kv_head_shard(kernel: Callable[..., Array], mesh: Mesh | None, k_pages: Array, replicated: int,
                      per_head: tuple[int, ...] = ()) -> Callable[..., Array]:
    """`kernel(q [S, H, D], k_pages, v_pages, *rest)` as one call on `mesh`: per shard of the kv heads
    (the pool's axis -4, q's heads and the output's axis 1 split alike; `replicated` trailing
    arguments whole on every shard, except those at the positions `per_head` among them: per query
    head on their axis 0, split as q's heads) under shard_map, or `kernel` itself without a
    multi-device mesh. Each (slot, kv head) is computed as on one device."""
    if mesh is None or mesh.size == 1:
        return kernel
    heads = kv_head_axis(mesh, k_pages.shape[-4])
    pool = P(*(None,) * (k_pages.ndim - 4), heads)
    rest = tuple(P(heads) if i in per_head else P() for i in range(replicated))
    return jax.shard_map(kernel, mesh=mesh, in_specs=(P(None, heads), pool, pool, *rest),
                         out_specs=P(None, heads), check_vma=False)

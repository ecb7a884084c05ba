"""The decode weights' layout on a mesh whose slots are split (engine/slot_shards.py): weight-stationary.

The trainer keeps a weight's embed dim split over 'fsdp' (FSDP) and its mlp / heads / vocab dim over
'tensor'. A training forward has thousands of rows a chip, so gathering each layer's weights once is cheap
beside its matmuls. A decode step has a few slots a chip: gathering the whole model every step made the
decode's weight all-gathers the bound of every large slice (docs/performance-history.md, 2026-12-07: on
0.5B v5e-8 the tied embedding alone moved 272 MB a chip a step).

The engine's copy of the weights (made once per rollout, in the compute dtype: engine/scheduler.py) is laid
out the other way: a weight's fsdp split (and 'data' where it shards the weight) moves from its embed dim to
the dim 'tensor' splits (mlp, heads, vocab), or where that dim does not divide, to the dim after it (a head's
dims). Each chip then holds and reads 1 / (batch x tensor) of the big matmuls' weights and keeps them where
they are; what moves is a step's activations: a few slots' [S, H] rows gathered before a projection and
reduced after it (Megatron's column / row split over every chip). A weight with no such dim (norm scales,
biases) is small and is held whole.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models.dtypes import as_jnp_dtype, matmul_weights_in, uncast_matmul_weights
from jaxrl_llm.sharding.rules import logical_to_spec

# a weight without a dim to take the batch axes is held whole on every chip below this size (norm scales,
# biases, a small projection); larger ones keep their trainer layout (gathered each step, as before)
WHOLE_BELOW_BYTES = 4 << 20


def _entry_axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def decode_spec(spec: P, shape: tuple[int, ...], itemsize: int, mesh: Mesh, slot_axes: tuple[str, ...]) -> P:
    """A weight's decode layout (module doc): `spec` (its trainer layout on `mesh`) with the slot axes that split
    it moved onto its tensor dim (or the dim after it), or dropped when it is small; `spec` when neither."""
    sizes = dict(mesh.shape)
    entries = [_entry_axes(e) for e in (*spec, *(None,) * (len(shape) - len(spec)))]
    moving = tuple(a for a in slot_axes if sizes.get(a, 1) > 1 and any(a in e for e in entries))
    if not moving:
        return spec
    base = [tuple(a for a in e if a not in moving) for e in entries]
    ways = math.prod(sizes[a] for a in moving)
    tensor_dims = [d for d, e in enumerate(base) if "tensor" in e]
    candidates = tensor_dims + [d + 1 for d in tensor_dims if d + 1 < len(shape) and not base[d + 1]]
    for d in candidates:
        split = math.prod(sizes[a] for a in base[d])
        if shape[d] % (split * ways) == 0:
            base[d] = (*base[d], *moving)
            return P(*(_entry(e) for e in base))
    if math.prod(shape) * itemsize < WHOLE_BELOW_BYTES:
        return P(*(_entry(e) for e in base))
    return spec


def head_rows_spec(mesh: Mesh, slot_axes: tuple[str, ...], hidden: int, heads: int, head_dim: int,
                   heads_name: str = "heads") -> P | None:
    """The split of a decode step's q (or k / v: `heads_name` 'kv_heads') rows [S, 1, heads, head_dim] that its
    projection in the decode layout produces from whole rows (the weight's heads split, rows whole), or None
    where the projection keeps the trainer's layout or splits its head dim. Constrained to it, a step all-gathers
    its [S, hidden] rows into the projection and all-to-alls its q / k / v into the attention's slot shards; left
    to itself XLA gathered each layer's projection weights instead (engine/forward.py)."""
    shape = (hidden, heads, head_dim)
    trainer = logical_to_spec(("embed", heads_name, "head_dim"), shape, mesh)
    before = tuple(trainer) + (None,) * 3
    decode = tuple(decode_spec(trainer, shape, 2, mesh, slot_axes)) + (None,) * 3
    moved = set(_entry_axes(decode[1])) - set(_entry_axes(before[1]))
    if decode[2] != before[2] or moved != {a for a in slot_axes if dict(mesh.shape).get(a, 1) > 1}:
        # kept, split on the head dim (RoPE pairs a head's dims across the split, and XLA then gathered the weight
        # whatever the rows' layout: the k / v of 2 kv heads on 4 chips of v5e), or heads split over some of the
        # slot axes only (a slot shard's rows then reach their heads by no one collective: XLA gathers them whole)
        return None
    return P(None, None, decode[1], decode[2])


def decode_sharding(x: Any, mesh: Mesh | None, slot_axes: tuple[str, ...]) -> Any:
    """The decode layout's NamedSharding of an array or ShapeDtypeStruct placed on `mesh`; its own sharding
    (None where it has none) without slot axes or a NamedSharding."""
    sharding = getattr(x, "sharding", None)
    if mesh is None or not slot_axes or not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(mesh, decode_spec(sharding.spec, tuple(x.shape), x.dtype.itemsize, mesh, slot_axes))


@functools.lru_cache(maxsize=8)
def _weights_in(dtype: str, treedef: Any, shardings: tuple | None) -> Any:
    """The jitted cast of a params tree's matmul weights to `dtype`, placed at `shardings` (its leaves', in order;
    None: where the cast leaves them)."""
    placed = None if shardings is None else jax.tree.unflatten(treedef, shardings)
    return jax.jit(functools.partial(matmul_weights_in, dtype=dtype), out_shardings=placed)


def decode_weights(params: dict, compute_dtype: str, mesh: Mesh | None = None,
                   slot_axes: tuple[str, ...] = ()) -> dict:
    """`params` with their matmul weights in the compute dtype, in the decode layout where the slots are split
    over `slot_axes` (module doc): the engine's copy, made once per rollout; no copy when they already are both."""
    leaves, treedef = jax.tree.flatten(params)
    layout = [decode_sharding(x, mesh, slot_axes) for x in leaves]
    moved = all(new is not None for new in layout) and any(new != x.sharding for new, x in zip(layout, leaves))
    if not moved and not uncast_matmul_weights(params, as_jnp_dtype(compute_dtype)):
        return params
    return _weights_in(compute_dtype, treedef, tuple(layout) if moved else None)(params)

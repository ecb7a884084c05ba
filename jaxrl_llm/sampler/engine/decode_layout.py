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
biases) is small and is held whole. A MoE's expert stacks keep the trainer's layout: the experts' shard_map
(models/expert_parallel.py) takes them split by experts over 'expert' and brings a step's tokens to them.

With `model.batch_invariant` (models/invariant.py) every output column's sum runs on one chip in the kernel's
order, so a row split's partial sums (o_proj, down_proj) cannot be added across chips. The layout is then by
columns only (`column_spec`): each matmul weight splits its output dim (the first after its contraction: heads,
mlp, vocab; embed for the weights that write the residual stream) over 'tensor' and the slot axes
(`column_axes`), and `invariant.weight_columns` has each chip compute its columns for every row.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import invariant
from jaxrl_llm.models.dtypes import as_jnp_dtype, matmul_weights_in, uncast_matmul_weights
from jaxrl_llm.models.param_axes import logical_axes_at
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


def column_axes(mesh: Mesh, slot_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the batch-invariant decode layout splits each matmul weight's output columns
    over, in the order both that layout (`column_spec`) and the matmul's split (`invariant.weight_columns`) use."""
    sizes = dict(mesh.shape)
    return tuple(dict.fromkeys(a for a in ("tensor", *slot_axes) if sizes.get(a, 1) > 1))


def matmul_columns(batch_invariant: bool, mesh: Mesh | None, slot_axes: tuple[str, ...]) -> Any:
    """A context in which the batch-invariant matmuls split each weight by its output columns
    (`invariant.weight_columns`), as `decode_weights(..., by_columns=True)` laid the weights out: the mode with slot
    shards, for the decode step and the prefill alike (both read the engine's one copy of the weights). Else no
    change."""
    if not batch_invariant or mesh is None or not slot_axes:
        return contextlib.nullcontext()
    return invariant.weight_columns(column_axes(mesh, slot_axes))


def output_dim(names: tuple | None) -> int | None:
    """The dim along which a matmul weight's output columns run (models/numerics.py `matmul_f32` multiplies by
    its [K, F] view), by its logical axis names: an input projection's first dim after its `embed` (heads, mlp),
    `embed` where the weight writes the residual stream (o_proj, down_proj, out_proj), the vocabulary of the
    (tied) embedding. None: not such a weight (a norm scale, a bias, an expert stack: models/expert_parallel.py)."""
    if names is None:
        return None
    offset = 1 if names and names[0] == "layers" else 0
    body = tuple(names[offset:])
    if len(body) < 2 or "expert" in body:
        return None
    if body[0] == "vocab":
        return offset
    if body[0] == "embed":
        return offset + 1
    return offset + len(body) - 1 if body[-1] == "embed" else None


def column_spec(spec: P, shape: tuple[int, ...], itemsize: int, mesh: Mesh, slot_axes: tuple[str, ...],
                dim: int) -> P:
    """A matmul weight's batch-invariant decode layout (module doc): its output `dim` split over `column_axes`,
    every other dim whole; held whole where that split does not divide it and it is small, else `spec` (its
    trainer layout: gathered each step)."""
    axes = column_axes(mesh, slot_axes)
    sizes = dict(mesh.shape)
    if not axes:
        return spec
    if shape[dim] % math.prod(sizes[a] for a in axes) == 0:
        return P(*(_entry(axes) if d == dim else None for d in range(len(shape))))
    return P() if math.prod(shape) * itemsize < WHOLE_BELOW_BYTES else spec


def decode_sharding(x: Any, mesh: Mesh | None, slot_axes: tuple[str, ...], names: tuple | None = None,
                    by_columns: bool = False) -> Any:
    """The decode layout's NamedSharding of an array or ShapeDtypeStruct placed on `mesh`; its own sharding
    (None where it has none) without slot axes or a NamedSharding, and for an expert stack. `names`: the leaf's
    logical axis names (`leaf_names`; None: not known); `by_columns`: the batch-invariant layout (`column_spec`)."""
    sharding = getattr(x, "sharding", None)
    if mesh is None or not slot_axes or not isinstance(sharding, NamedSharding):
        return sharding
    if names is not None and "expert" in names:
        # the MoE's shard_map takes an expert stack in its trainer layout (models/expert_parallel.py): moved, every
        # decode step moved each layer's experts back (30B-A3B on v5p-32, 'expert' 16 ways: an all-to-all and five
        # copies of 25-50 MB a layer, 0.72 GB of HBM a layer a step where its experts are 75 MB)
        return sharding
    dim = output_dim(names) if by_columns else None
    shape, itemsize = tuple(x.shape), x.dtype.itemsize
    if dim is not None and dim < len(shape):
        return NamedSharding(mesh, column_spec(sharding.spec, shape, itemsize, mesh, slot_axes, dim))
    return NamedSharding(mesh, decode_spec(sharding.spec, shape, itemsize, mesh, slot_axes))


def leaf_names(path: tuple) -> tuple | None:
    """The logical axis names of the params leaf at `path` (a key path), for `decode_sharding`."""
    return logical_axes_at(tuple(str(getattr(k, "key", k)) for k in path))


@functools.lru_cache(maxsize=8)
def _weights_in(dtype: str, treedef: Any, shardings: tuple | None) -> Any:
    """The jitted cast of a params tree's matmul weights to `dtype`, placed at `shardings` (its leaves', in order;
    None: where the cast leaves them)."""
    placed = None if shardings is None else jax.tree.unflatten(treedef, shardings)
    return jax.jit(functools.partial(matmul_weights_in, dtype=dtype), out_shardings=placed)


def decode_weights(params: dict, compute_dtype: str, mesh: Mesh | None = None,
                   slot_axes: tuple[str, ...] = (), by_columns: bool = False) -> dict:
    """`params` with their matmul weights in the compute dtype, in the decode layout where the slots are split
    over `slot_axes` (module doc; `by_columns`: the batch-invariant one): the engine's copy, made once per
    rollout; no copy when they already are both."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [x for _, x in paths]
    layout = [decode_sharding(x, mesh, slot_axes, leaf_names(path), by_columns) for path, x in paths]
    moved = all(new is not None for new in layout) and any(new != x.sharding for new, x in zip(layout, leaves))
    if not moved and not uncast_matmul_weights(params, as_jnp_dtype(compute_dtype)):
        return params
    return _weights_in(compute_dtype, treedef, tuple(layout) if moved else None)(params)

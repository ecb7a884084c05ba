"""Logical-axis rules: map the logical dimension names that params and activations carry to
mesh axes, and turn (logical names, shape) into PartitionSpecs / NamedShardings.

A mesh axis is never assigned to a dimension it does not divide (e.g. kv_heads=1 with tensor=4,
or a vocabulary of 49152 on tensor=5): that dimension falls back to replication, logged once at
debug level. A mesh axis is also never used twice in one spec (the later dimension replicates).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.arrays import ArrayTree, LogicalAxesTree, Params, ShardingTree
from jaxrl_llm.sharding.mesh import mesh_axis_sizes

logger = logging.getLogger(__name__)

MeshAxes = Union[None, str, tuple[str, ...]]
Rules = Union[Mapping[str, MeshAxes], Sequence[tuple[str, MeshAxes]]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("expert", "expert"),  # mixture-of-experts weights [E, ...]: experts over 'expert', then embed / mlp
    # activations (constrained at block boundaries)
    ("batch", ("data", "fsdp", "expert")),
    ("length", "context"),  # context parallelism (the training forward only: models/decoder.py)
    # [rows x tokens] flattened (the log-prob head's rows): split over every axis the two were split over
    ("tokens", ("data", "fsdp", "expert", "context")),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_vocab", "tensor"),
)

_logged_fallbacks: set[tuple] = set()


def rules_dict(rules: Rules | None) -> dict[str, tuple[str, ...]]:
    """Normalises rules to {logical name: tuple of mesh axes}; ValueError on a duplicate name."""
    items = (rules.items() if isinstance(rules, Mapping)
             else (DEFAULT_RULES if rules is None else rules))
    out: dict[str, tuple[str, ...]] = {}
    for name, axes in items:
        if name in out:
            raise ValueError(f"sharding rules: logical axis {name!r} appears twice")
        if axes is None:
            out[name] = ()
        elif isinstance(axes, str):
            out[name] = (axes,)
        else:
            out[name] = tuple(axes)
    return out


def _names(logical_axes: Any) -> tuple[Any, ...]:
    """A leaf of a logical-axes tree (tuple / list / PartitionSpec / None) as a tuple of names."""
    if logical_axes is None:
        return ()
    if isinstance(logical_axes, str):
        return (logical_axes,)
    return tuple(logical_axes)


def _log_fallback_once(where: str, name: str, axis: str, dim: int, reason: str) -> None:
    key = (where, name, axis, dim, reason)
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        logger.debug("%s: logical axis %r (size %d) not sharded over mesh axis %r: %s",
                     where, name, dim, axis, reason)


def logical_to_spec(logical_axes: Any, shape: Sequence[int], mesh: Mesh | Any,
                    rules: Rules | None = None, where: str = "array") -> PartitionSpec:
    """PartitionSpec for one array of `shape` whose dims carry `logical_axes` (names or None).

    `logical_axes=None` means fully replicated. Unknown names, or a name count that differs from
    the rank, raise ValueError naming `where` (the param path).
    """
    names = _names(logical_axes)
    shape = tuple(shape)
    if logical_axes is not None and len(names) != len(shape):
        raise ValueError(f"{where}: logical axes {names} name {len(names)} dims but the shape is {shape}")
    table = rules_dict(rules)
    sizes = mesh_axis_sizes(mesh)
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in zip(shape, names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"{where}: logical axis {name!r} has no sharding rule "
                             f"(known: {', '.join(sorted(table))})")
        chosen: list[str] = []
        ways = 1
        for axis in table[name]:
            if axis not in sizes:
                continue  # a mesh without this axis (e.g. a user-built mesh): replicate over it
            if axis in used:
                _log_fallback_once(where, name, axis, dim, "mesh axis already used by another dim")
            elif dim % (ways * sizes[axis]):
                _log_fallback_once(where, name, axis, dim, f"{ways * sizes[axis]} does not divide it")
            else:
                chosen.append(axis)
                ways *= sizes[axis]
        used.update(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*spec)


def _path_str(path: tuple) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def logical_to_sharding(logical_axes_tree: LogicalAxesTree, shapes_tree: ArrayTree, mesh: Mesh,
                        rules: Rules | None = None) -> ShardingTree:
    """NamedSharding tree for `shapes_tree` (arrays or ShapeDtypeStructs) with logical names from
    `logical_axes_tree` (same structure; leaves are tuples / PartitionSpecs of names, or None)."""

    def one(path: tuple, leaf: Any, logical: Any) -> NamedSharding:
        spec = logical_to_spec(logical, leaf.shape, mesh, rules, where=_path_str(path))
        return NamedSharding(mesh, spec)

    try:
        return jax.tree_util.tree_map_with_path(one, shapes_tree, logical_axes_tree)
    except ValueError as err:
        if "logical axis" in str(err) or "logical axes" in str(err):
            raise
        raise ValueError(f"logical axes tree does not match the param tree: {err}") from err


def shard_params(params: Params, logical_axes: LogicalAxesTree, mesh: Mesh, rules: Rules | None = None) -> Params:
    """Places `params` (host arrays or arrays already on devices) with their logical shardings."""
    return jax.device_put(params, logical_to_sharding(logical_axes, params, mesh, rules))


def with_activation_constraint(x: jax.Array, logical_names: Sequence[str | None],
                               mesh: Mesh | None = None, rules: Rules | None = None) -> jax.Array:
    """Constrains activation `x` (inside jit) to the sharding its logical names map to.

    Without `mesh`, the mesh in context (`with jax.set_mesh(mesh):`) is used; with neither it
    returns `x` unchanged, so model code runs the same on a single device.
    """
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        if context.empty:
            return x
        spec = logical_to_spec(logical_names, x.shape, context, rules, where="activation")
        return jax.lax.with_sharding_constraint(x, spec)
    spec = logical_to_spec(logical_names, x.shape, mesh, rules, where="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

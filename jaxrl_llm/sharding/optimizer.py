"""Optimizer-state shardings: optax states hold trees that mirror the params (Adam moments,
MultiSteps' accumulated grads); those are sharded like the params, everything else (step counts,
scalars, factored statistics of other shapes) is replicated.

Typical use, with no unsharded copy of the state ever materialised:
    shapes = jax.eval_shape(tx.init, params)
    opt_state = jax.jit(tx.init, out_shardings=optimizer_state_sharding(shapes, param_shardings))(params)
"""
from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.arrays import ArrayTree, ShardingTree
from jaxrl_llm.sharding.mesh import mesh_axis_sizes


def _fits(leaf: Any, sharding: NamedSharding) -> bool:
    """Whether `sharding`'s spec applies to `leaf`'s shape (rank matches, every split divides)."""
    shape = getattr(leaf, "shape", None)
    if shape is None or len(sharding.spec) > len(shape):
        return False
    sizes = mesh_axis_sizes(sharding.mesh)
    for dim, axes in zip(shape, sharding.spec):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        if dim % math.prod(sizes[a] for a in axes):
            return False
    return True


def optimizer_state_sharding(opt_state: ArrayTree, params_shardings: ShardingTree) -> ShardingTree:
    """NamedSharding tree for `opt_state` (arrays or ShapeDtypeStructs, e.g. from eval_shape)."""
    leaves, params_def = jax.tree.flatten(params_shardings)
    if not leaves:
        raise ValueError("optimizer_state_sharding: params_shardings has no leaves")
    replicated = NamedSharding(leaves[0].mesh, PartitionSpec())

    def mirrors_params(node: Any) -> bool:
        return jax.tree.structure(node) == params_def

    def assign(node: Any) -> Any:
        if mirrors_params(node):
            return jax.tree.map(lambda leaf, s: s if _fits(leaf, s) else replicated,
                                node, params_shardings)
        return replicated

    return jax.tree.map(assign, opt_state, is_leaf=mirrors_params)

"""The one table of floating-point dtype names used by configs, loaders, the sampler and export.

`DTYPES` maps each accepted name to its JAX dtype; `COMPUTE_DTYPES` are the names a forward or
backward pass may run in (the config's `model.dtype` / `model.param_dtype`, the sampler's
`compute_dtype`). `as_jnp_dtype` turns a name or a dtype into a `jnp.dtype` with one clear error
naming the accepted names; `dtype_name` gives the canonical name (a hashable static setting).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType, Params

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def dtype_name(name_or_dtype: DType, *, allowed: Sequence[str] | None = None, what: str | None = None) -> str:
    """Canonical name (`"bfloat16"`, ...) of a name in `DTYPES` or of a dtype (`jnp.bfloat16`, np.dtype).

    `allowed` narrows the accepted names (e.g. `COMPUTE_DTYPES`); `what` names the setting in the
    error (e.g. `"actor_rollout_ref.model.dtype"`).
    """
    accepted = tuple(DTYPES) if allowed is None else tuple(allowed)
    name: str | None = name_or_dtype if isinstance(name_or_dtype, str) else None
    if not isinstance(name_or_dtype, str):
        try:
            name = np.dtype(name_or_dtype).name
        except TypeError:
            name = None
    if name is None or name not in accepted:
        where = f" for {what}" if what else ""
        raise ValueError(f"unknown dtype {name_or_dtype!r}{where}; accepted names: {', '.join(accepted)}")
    return name


def as_jnp_dtype(name_or_dtype: DType, *, allowed: Sequence[str] | None = None, what: str | None = None) -> np.dtype:
    """`jnp.dtype` of a name in `DTYPES` (or of a dtype); ValueError naming the accepted names otherwise."""
    return jnp.dtype(DTYPES[dtype_name(name_or_dtype, allowed=allowed, what=what)])


def matmul_weights_in(params: Params, dtype: DType) -> Params:
    """`params` with their matmul weights (projections, embeddings, lm head, stacked over layers or not) in
    `dtype`; norm scales and attention sinks as they are (the forward reads those in fp32: a stacked
    [layers, hidden] norm scale is 2-D, and rounding it to bf16 put the paged engine's bf16 log-probs off
    the trainer's once an update had moved the scales off bf16 values). Decoding reads every weight once
    per token: a copy in the compute dtype made once per rollout replaces a cast of the fp32 master
    weights at every step (the forward casts each of these weights to the compute dtype anyway, so the
    values are the same bits)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if is_uncast_matmul_weight(path, x, dtype) else x, params)


def uncast_matmul_weights(params: Params, dtype: DType) -> list:
    """The leaves `matmul_weights_in` casts (none: `params` are already the decode weights)."""
    return [x for path, x in jax.tree_util.tree_leaves_with_path(params) if is_uncast_matmul_weight(path, x, dtype)]


# parts of a param's path the forward reads in fp32: norm scales, attention sinks, and a gated delta-net layer's
# decay (A_log, dt_bias: stacked [layers, heads]) and conv taps (models/hybrid.py); rounded to bf16 in the paged
# engine's copy, a Qwen3.5 rollout's every log-prob was off the trainer's (up to 1.6e-3 in bf16)
_KEPT_AS_THEY_ARE = ("norm", "sinks", "A_log", "dt_bias", "conv1d")


def is_uncast_matmul_weight(path: tuple, x: Any, dtype: DType) -> bool:
    """A matmul weight at `path` (a floating leaf of 2 or more dims, no norm scale or sink) not yet in `dtype`:
    what `matmul_weights_in` casts."""
    if getattr(x, "ndim", 0) < 2 or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
        return False
    names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
    return not any(part in name for name in names for part in _KEPT_AS_THEY_ARE)

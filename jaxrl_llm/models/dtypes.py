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
    """`params` with every floating leaf of 2 or more dims (projections, embeddings, lm head) in
    `dtype`; 1-D leaves (norm scales) as they are. Decoding reads every weight once per token: a
    copy in the compute dtype made once per rollout replaces a cast of the fp32 master weights at
    every step (the forward casts each weight to the compute dtype anyway, so the values are the
    same bits)."""

    return jax.tree.map(lambda x: x.astype(dtype) if is_uncast_matmul_weight(x, dtype) else x, params)


def is_uncast_matmul_weight(x: Any, dtype: DType) -> bool:
    """A floating leaf of 2 or more dims not yet in `dtype` (what `matmul_weights_in` casts)."""
    return getattr(x, "ndim", 0) >= 2 and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.dtype(dtype)

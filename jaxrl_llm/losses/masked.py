"""Masked reductions and group (segment) statistics shared by the losses and estimators."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.core import Tracer

Array = jax.Array


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
    # `where` (not x * mask) so junk (even inf) in padded positions cannot leak.
    return jnp.sum(jnp.where(mask > 0, x, 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """veRL's `masked_mean`: sum(x*m) / (sum(m) + 1e-8)."""
    return masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def is_concrete(x) -> bool:
    """True when `x` holds values on the host side of jit (not a tracer)."""
    return not isinstance(x, Tracer)


def masked_whiten(x: Array, mask: Array) -> Array:
    """`(x - mean) * rsqrt(var + 1e-8)` with masked mean and unbiased masked variance.

    veRL errors when the mask sum n <= 1. Called eagerly (concrete mask) this raises ValueError;
    under jit the check cannot run on the host, so the result is NaN everywhere instead and
    `check_finite(advantages, "advantages")` (or any isfinite test) catches it after the step.
    """
    n = jnp.sum(mask)
    if is_concrete(mask) and float(n) <= 1:
        raise ValueError(f"masked_whiten needs more than one valid token (mask sum = {float(n)})")
    mean = masked_mean(x, mask)
    centered = x - mean
    var = masked_mean(centered**2, mask) * (n / (n - 1))
    out = centered * jax.lax.rsqrt(var + 1e-8)
    return jnp.where(n > 1, out, jnp.nan)


def check_finite(x: Array, name: str) -> None:
    """Host-side check for results computed under jit (e.g. whitening with <= 1 valid token)."""
    if not bool(jnp.all(jnp.isfinite(x))):
        raise ValueError(f"{name} contains NaN/inf (e.g. masked_whiten over <= 1 valid token)")


def dense_group_index(group_ids: Array) -> Array:
    """Map arbitrary int ids to segment indices in [0, B): the first row holding the same id.

    Sorting-free and jittable; O(B^2) compares, negligible next to the model for RL batch sizes.
    """
    group_ids = jnp.asarray(group_ids)
    same = group_ids[None, :] == group_ids[:, None]
    return jnp.argmax(same, axis=1).astype(jnp.int32)


def group_sum(x: Array, seg: Array) -> Array:
    """Per-row sum of `x` over the row's group (segment sum gathered back to rows)."""
    b = x.shape[0]
    return jax.ops.segment_sum(x, seg, num_segments=b)[seg]


def group_count(seg: Array, dtype=jnp.float32) -> Array:
    return group_sum(jnp.ones(seg.shape, dtype), seg)

"""Loss aggregation (veRL's `loss_agg_mode`), exact under micro-batching with global counts.

The modes and the micro-batch rule: docs/algorithms.md, "Loss aggregation".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.masked import masked_sum

Array = jax.Array
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat: Array, mask: Array, mode: str, *, num_tokens: Array | float | None = None,
             num_seqs: Array | float | None = None, loss_scale_factor: float | None = None) -> Array:
    """Aggregate a `[B, T]` loss to a scalar.

    Deferred normalisation: pass the *global* (whole mini-batch) `num_tokens` (valid tokens) and
    `num_seqs` (non-empty rows) and every micro-batch's loss is its partial sum over the global
    denominator, so summing micro-batch losses and grads gives the full-batch numbers exactly.
    Without them the local counts are used (clamped at 1 so an all-masked batch gives 0, not NaN).
    """
    mask = jnp.asarray(mask, jnp.float32)
    if mode == "token-mean":
        denom = jnp.maximum(jnp.sum(mask), 1.0) if num_tokens is None else num_tokens
        return masked_sum(loss_mat, mask) / denom
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {mode!r}; valid names: {sorted(LOSS_AGG_MODES)}")
    row_sum = masked_sum(loss_mat, mask, axis=-1)
    if mode == "seq-mean-token-sum-norm":
        scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return jnp.sum(row_sum) / scale
    row_count = jnp.sum(mask, axis=-1)
    seqs = jnp.maximum(jnp.sum(row_count > 0), 1) if num_seqs is None else num_seqs
    if mode == "seq-mean-token-sum":
        return jnp.sum(row_sum) / seqs
    return jnp.sum(row_sum / (row_count + 1e-8)) / seqs


def global_counts(mask: Array) -> dict[str, Array]:
    """`num_tokens` / `num_seqs` of a full mini-batch, to pass to every micro-batch's loss."""
    mask = jnp.asarray(mask, jnp.float32)
    return {"num_tokens": jnp.sum(mask), "num_seqs": jnp.sum(jnp.sum(mask, -1) > 0).astype(jnp.float32)}

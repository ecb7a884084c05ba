"""Clipped value (critic) loss, veRL's `compute_value_loss` (docs/algorithms.md, "Value loss")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.masked import masked_sum

Array = jax.Array


def compute_value_loss(vpreds: Array, returns: Array, values: Array, response_mask: Array, cliprange_value: float,
                       loss_agg_mode: str = "token-mean", *, num_tokens: Array | float | None = None,
                       num_seqs: Array | float | None = None, loss_scale_factor: float | None = None,
                       ) -> tuple[Array, Array]:
    """`0.5 * agg(max((v - R)^2, (vclip - R)^2))` and `vf_clipfrac` (critic/vf_loss, critic/vf_clipfrac).

    With the global `num_tokens` the clipfrac is a partial sum that adds up over micro-batches.
    """
    mask = jnp.asarray(response_mask, jnp.float32)
    vclip = values + jnp.clip(vpreds - values, -cliprange_value, cliprange_value)
    loss1 = jnp.square(vpreds - returns)
    loss2 = jnp.square(vclip - returns)
    loss = 0.5 * agg_loss(jnp.maximum(loss1, loss2), mask, loss_agg_mode, num_tokens=num_tokens,
                          num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    denom = jnp.sum(mask) + 1e-8 if num_tokens is None else num_tokens
    # Where vpreds is not clipped, loss2 equals loss1 up to rounding (values + (vpreds - values));
    # counting only clipped tokens keeps the metric veRL's without rounding coin flips.
    clipped = (jnp.abs(vpreds - values) > cliprange_value) & (loss2 > loss1)
    clipfrac = jax.lax.stop_gradient(masked_sum(clipped.astype(jnp.float32), mask) / denom)
    return loss, clipfrac

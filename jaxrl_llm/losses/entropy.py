"""Token entropy of the policy and the aggregated entropy bonus (docs/algorithms.md, "Entropy")."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.agg import agg_loss

Array = jax.Array


def entropy_from_logits(logits: Array) -> Array:
    """`logsumexp(z) - sum softmax(z) * z` over the last axis, in fp32."""
    z = logits.astype(jnp.float32)
    return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


def entropy_bonus(entropy: Array, response_mask: Array, loss_agg_mode: str = "token-mean", **global_counts) -> Array:
    """`agg(entropy)` (actor/entropy); the actor loss subtracts `entropy_coeff * entropy_bonus`."""
    return agg_loss(entropy, response_mask, loss_agg_mode, **global_counts)

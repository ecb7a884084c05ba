"""fp32 helpers shared by every attention path, the default one (models/numerics.py) and the batch-invariant
one (models/invariant.py), so the two compute probabilities x V and mask scores by one definition. A leaf
module: numerics imports invariant, so what both need lives here."""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# the fp32 score of a masked key in every attention path: finite, so a fully masked (padding) query row
# stays NaN-free
MASKED_SCORE = float(jnp.finfo(jnp.float32).min)


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """`jnp.einsum` with fp32 accumulation and an fp32 result (operands keep their dtype)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def probs_times_values(spec: str, probs: Array, v: Array) -> Array:
    """fp32 `einsum(spec, probs, v)` of fp32 attention probabilities and V in the compute dtype.

    fp32 V: one fp32 matmul (fp32 results are unchanged by this policy). bf16 V: probs = hi + lo
    with hi = bf16(probs), lo = bf16(probs - hi); two bf16 x bf16 -> fp32 matmuls, added in fp32.
    """
    probs = probs.astype(jnp.float32)
    if v.dtype == jnp.float32:
        return einsum_f32(spec, probs, v)
    hi = probs.astype(v.dtype)
    lo = (probs - hi.astype(jnp.float32)).astype(v.dtype)
    return einsum_f32(spec, hi, v) + einsum_f32(spec, lo, v)

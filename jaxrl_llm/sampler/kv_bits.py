"""bf16 KV pools stored as their 16-bit patterns (uint16) on the CPU backend.

XLA:CPU has no bf16 gather or scatter: float normalization converts the whole operand to fp32 and
back around each one. With a bf16 page pool, every decode step's K/V write and every attention
block read therefore converted the pool of every layer (measured at 32 slots on SmolLM2: a write
122 ms and an attention call 182 ms per layer, against 0.06 ms and 3.8 ms in fp32). Integer
gathers and scatters run natively, so the engine keeps such a pool as uint16 and bitcasts the
values it writes (per token) and reads (per block). GPU and TPU keep bf16 pools (their kernels
read them directly).

int8 pools carry fp32 scales beside the pages; `scale_pair` checks the K and V scales come together.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.platform.target import target_platform

Array = jax.Array
BITS = jnp.uint16


def storage_dtype(dtype: Any) -> Any:
    """The dtype a pool of `dtype` values is stored in on this backend."""
    if jnp.dtype(dtype) == jnp.bfloat16 and target_platform() == "cpu":
        return BITS
    return dtype


def to_storage(x: Array, storage: Any) -> Array:
    """Values (any float dtype) as a pool of dtype `storage` holds them."""
    if jnp.dtype(storage) == BITS:
        return lax.bitcast_convert_type(x.astype(jnp.bfloat16), BITS)
    return x.astype(storage)


def from_storage(x: Array) -> Array:
    """Pool contents as values (bf16 for a uint16 pool; anything else as stored)."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS else x


def scale_pair(k_scales: Array | None, v_scales: Array | None) -> tuple[Array, Array] | None:
    """(k_scales, v_scales) as arrays for an int8 pool, None for a float pool; one without the other
    is an error."""
    if k_scales is None or v_scales is None:
        if k_scales is not None or v_scales is not None:
            raise ValueError("paged attention: pass both k_scales and v_scales or neither")
        return None
    return jnp.asarray(k_scales), jnp.asarray(v_scales)

"""How a KV pool is stored on each backend, and how values are written into it.

bf16 pools are stored as their 16-bit patterns (uint16) on the CPU backend.

XLA:CPU has no bf16 gather or scatter: float normalization converts the whole operand to fp32 and
back around each one. With a bf16 page pool, every decode step's K/V write and every attention
block read therefore converted the pool of every layer (measured at 32 slots on SmolLM2: a write
122 ms and an attention call 182 ms per layer, against 0.06 ms and 3.8 ms in fp32). Integer
gathers and scatters run natively, so the engine keeps such a pool as uint16 and bitcasts the
values it writes (per token) and reads (per block). GPU and TPU keep bf16 pools (their kernels
read them directly).

TPU pools store the head dim padded up to whole 128-lane rows (`storage_head_dim`; zeros in the pad
lanes, which add nothing to q.k or probs.V). The TPU compiler tiles an array's two minor dims as
(8|16, 128): a [.., page_size, 64] pool is laid out padded to 128 lanes anyway, and the layout the
device gives such an array by default is a different, unpadded one (pages as the minor dim), so a
program reading a 64-wide pool with the attention kernel copied the whole pool into the kernel's
layout on entry and back on exit (4 pool-sized copies per `generate` call, the 0.5B sampler's 18 GiB
of temporaries beside a 9 GiB pool on v5p-8). A 128-wide pool is the same bytes with no copy.

`write_rows` writes K/V rows with one scatter index per (token, kv head) row. A scatter whose window
spanned (kv heads, head dim) made the TPU compiler keep the pool in a layout of its own (those two
dims minor) and copy the whole pool into the kernel's layout at every layer of every decode step.

int8 pools carry fp32 scales beside the pages; `scale_pair` checks the K and V scales come together.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.platform.target import target_platform

Array = jax.Array
BITS = jnp.uint16
LANES = 128  # a TPU vector register's lanes: the minor dim of every tiled array is padded to a multiple


def storage_head_dim(head_dim: int) -> int:
    """The head dim a pool stores on the target backend: on TPU rounded up to whole lane rows."""
    if target_platform() == "tpu":
        return -(-head_dim // LANES) * LANES
    return head_dim


def storage_dtype(dtype: DType) -> DType:
    """The dtype a pool of `dtype` values is stored in on this backend."""
    if jnp.dtype(dtype) == jnp.bfloat16 and target_platform() == "cpu":
        return BITS
    return dtype


def to_storage(x: Array, storage: DType) -> Array:
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


def write_rows(pages: Array, index: tuple[Array, ...], rows: Array) -> Array:
    """`pages` [L, kv, P, page_size, D'] (or int8 scales [L, kv, P, page_size]) with `rows` written at
    `index` = (layer, kv head, page, offset) int arrays broadcasting to the rows' leading shape: rows
    [..., D] (D <= D', zero-padded) or scales [...]. One scatter index per row (see the module doc)."""
    if pages.ndim == 5 and rows.shape[-1] < pages.shape[-1]:
        rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, pages.shape[-1] - rows.shape[-1])])
    lead = rows.shape[:-1] if pages.ndim == 5 else rows.shape
    index = tuple(jnp.broadcast_to(jnp.asarray(i, jnp.int32), lead) for i in index)
    return pages.at[index].set(to_storage(rows, pages.dtype) if pages.ndim == 5 else rows)

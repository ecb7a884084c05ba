"""What the paged attention kernels share (the default ones, sampler/paged_attention_pallas.py and
sampler/paged_attention_mosaic.py, and the batch-invariant one, models/invariant_paged_attention.py `paged_attention`):
the key blocks a slot's visible keys fill, their mask, the page table's share of a Mosaic call's SMEM, and a
Mosaic kernel's double-buffered DMA walk over the blocks."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Page-table entries per Mosaic call (int32 in SMEM): 64Ki entries = 256 KiB, a quarter of the
# 1 MiB SMEM of TPUs up to v6e (vLLM keeps its block tables under half).
MOSAIC_MAX_TABLE_ENTRIES = 1 << 16


def visible_blocks(length, block_tokens: int, sliding_window: int | None):
    """[lo, hi) block range holding every key p with max(0, length - W) <= p < length."""
    hi = lax.div(length + block_tokens - 1, block_tokens)
    if sliding_window is None:
        return jnp.int32(0), hi
    return lax.div(jnp.maximum(length - sliding_window, 0), block_tokens), hi


def visible_keys(start, length, sliding_window: int | None, shape: tuple[int, ...]):
    """bool `shape` [rows, keys]: whether the keys at positions start + column are visible to a slot of
    `length` keys (p < length, and p >= length - W with a window)."""
    pos = start + lax.broadcasted_iota(jnp.int32, shape, 1)
    valid = pos < length
    return valid if sliding_window is None else jnp.logical_and(valid, pos >= length - sliding_window)


def double_buffered_walk(lo: Any, hi: Any, copies: Callable[[Any, Any], Sequence[Any]],
                         step: Callable[[Any, Any, Any], Any], init: Any) -> Any:
    """`fori_loop` over blocks [lo, hi): block i's DMAs (`copies(i, buf)`, started async copies into buffer
    buf = (i - lo) % 2) are issued one block ahead and waited before `step(i, buf, carry)` reads the buffer;
    the final carry. `copies` must build the same descriptors for starting and for waiting."""
    @pl.when(hi > lo)
    def _():
        for c in copies(lo, 0):
            c.start()

    def body(i, carry):
        buf = lax.rem(i - lo, 2)

        @pl.when(i + 1 < hi)
        def _():
            for c in copies(i + 1, 1 - buf):
                c.start()

        for c in copies(i, buf):
            c.wait()
        return step(i, buf, carry)

    return lax.fori_loop(lo, hi, body, init)

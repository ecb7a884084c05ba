"""A Mosaic (TPU) kernel's walk over blocks whose data it DMAs itself from HBM, double-buffered: the paged
attention kernels' (sampler/paged_attention_mosaic.py, models/invariant_attention.py `paged_attention`)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax import lax
from jax.experimental import pallas as pl


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

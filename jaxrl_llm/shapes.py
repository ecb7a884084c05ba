"""Shape buckets shared by the sampler, the batching and the kernels (a leaf module: no imports).

Static shapes mean one compiled program per bucket, so every length or row count is rounded up
to a bucket before it reaches a jitted function.
"""
from __future__ import annotations


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def previous_power_of_two(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(int(n).bit_length() - 1, 0)


def head_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """head_dim as (offset, width) pieces of power-of-2 widths >= 16, largest first (Triton's blocks are
    powers of 2 and tl.dot needs 16): 128 -> one piece; MLA's latent + rope key, 576 -> (0, 512), (512, 64);
    192 -> (0, 128), (128, 64). Each offset is a multiple of its width (it sums larger powers of 2), so a
    piece is one block of a BlockSpec over the full head_dim. Empty when head_dim is not a multiple of 16."""
    if head_dim <= 0 or head_dim % 16:
        return ()
    pieces, offset = [], 0
    for bit in reversed(range(head_dim.bit_length())):
        if head_dim & (1 << bit):
            pieces.append((offset, 1 << bit))
            offset += 1 << bit
    return tuple(pieces)

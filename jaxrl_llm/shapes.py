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

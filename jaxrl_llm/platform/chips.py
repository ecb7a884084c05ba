"""Published per-chip figures: HBM and dense matmul peaks, keyed by what `jax.Device.device_kind` says.

The MFU denominator on an accelerator and the memory plan's limit and time estimate for a TPU
topology. Peaks are the vendors' dense (no sparsity) figures per chip (per GPU; per TPU chip, which
is one JAX device on v5e / v6e and, in megacore mode, on v4 / v5p). fp32 on TPU: XLA's default
precision runs fp32 matmuls as one bf16 MXU pass, so the fp32 row is the bf16 peak; on NVIDIA it is
the non-tensor-core fp32 rate (TF32 is a precision choice the run makes, not the fp32 peak).
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeAlias

GB, GiB = 10**9, 1 << 30
# a jax device (`jax.Device` is a runtime alias of jaxlib's class that type checkers cannot use as a type)
Device: TypeAlias = Any


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    device_kinds: tuple[str, ...]  # `device_kind` strings that name this chip (lower-case prefixes)
    hbm_bytes: int
    bf16_flops: float  # dense bf16 matmul peak, FLOP/s
    fp32_flops: float

    def peak_flops(self, dtype: str) -> float:
        return self.bf16_flops if dtype in ("bfloat16", "bf16", "float16") else self.fp32_flops


# Sources: NVIDIA H100 / H200 / B200 datasheets (SXM, dense); Google Cloud TPU system architecture pages.
CHIPS: tuple[Chip, ...] = (
    Chip("H100 SXM", ("nvidia h100 80gb hbm3", "nvidia h100 sxm"), 80 * GB, 989e12, 67e12),
    Chip("H100 PCIe", ("nvidia h100 pcie",), 80 * GB, 756e12, 51e12),
    Chip("H100 NVL", ("nvidia h100 nvl",), 94 * GB, 835e12, 60e12),
    Chip("H200", ("nvidia h200",), 141 * GB, 989e12, 67e12),
    Chip("B200", ("nvidia b200",), 180 * GB, 2250e12, 80e12),
    Chip("TPU v4", ("tpu v4",), 32 * GiB, 275e12, 275e12),
    Chip("TPU v5e", ("tpu v5 lite", "tpu v5e"), 16 * GiB, 197e12, 197e12),
    Chip("TPU v5p", ("tpu v5p", "tpu v5"), 95 * GiB, 459e12, 459e12),
    Chip("TPU v6e", ("tpu v6 lite", "tpu v6e", "tpu trillium"), 32 * GiB, 918e12, 918e12),
)


def chip_for(device: Device | str) -> Chip | None:
    """The table's chip for a device (or a `device_kind` string); None for CPUs and unknown chips.
    The longest matching prefix wins ('tpu v5 lite' before 'tpu v5')."""
    kind = (device if isinstance(device, str) else device.device_kind).lower().strip()
    best, length = None, -1
    for chip in CHIPS:
        for prefix in chip.device_kinds:
            if kind.startswith(prefix) and len(prefix) > length:
                best, length = chip, len(prefix)
    return best


def peak_flops_of(device: Device | str, dtype: str) -> float | None:
    """The published matmul peak of `device` for `dtype` compute, or None where the table has no row."""
    chip = chip_for(device)
    return None if chip is None else chip.peak_flops(dtype)

"""Published per-device figures: HBM size and bandwidth, dense matmul peaks and interconnect bandwidth,
keyed by what `jax.Device.device_kind` says.

The MFU denominator on an accelerator and the memory plan's limit and roofline (planning/roofline.py)
for a TPU topology. Figures are per JAX device: per GPU; per TPU chip where a chip is one device
(v5e / v6e, and v4 / v5p in megacore mode); per TensorCore on TPU7x (Ironwood), whose two chiplets
are two devices, each with half the chip's HBM, bandwidth and peak. Peaks are the vendors' dense (no
sparsity) figures. fp32 on TPU: XLA's default precision runs fp32 matmuls as one bf16 MXU pass, so
the fp32 row is the bf16 peak; on NVIDIA it is the non-tensor-core fp32 rate (TF32 is a precision
choice the run makes, not the fp32 peak). Interconnect: the bidirectional ICI bandwidth per chip
(TPU) or NVLink per GPU, as published; a collective's time estimate is its bytes over it.
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
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s: ICI (TPU, bidirectional per chip) or NVLink (GPU)

    def peak_flops(self, dtype: str) -> float:
        return self.bf16_flops if dtype in ("bfloat16", "bf16", "float16") else self.fp32_flops


# Sources: NVIDIA H100 / H200 / B200 datasheets (SXM, dense); Google Cloud TPU system architecture pages
# (v4, v5e, v5p, v6e, TPU7x).
CHIPS: tuple[Chip, ...] = (
    Chip("H100 SXM", ("nvidia h100 80gb hbm3", "nvidia h100 sxm"), 80 * GB, 989e12, 67e12, 3.35e12, 900 * GB),
    Chip("H100 PCIe", ("nvidia h100 pcie",), 80 * GB, 756e12, 51e12, 2.0e12, 600 * GB),
    Chip("H100 NVL", ("nvidia h100 nvl",), 94 * GB, 835e12, 60e12, 3.9e12, 600 * GB),
    Chip("H200", ("nvidia h200",), 141 * GB, 989e12, 67e12, 4.8e12, 900 * GB),
    Chip("B200", ("nvidia b200",), 180 * GB, 2250e12, 80e12, 8.0e12, 1800 * GB),
    Chip("TPU v4", ("tpu v4",), 32 * GiB, 275e12, 275e12, 1200 * GB, 300 * GB),
    Chip("TPU v5e", ("tpu v5 lite", "tpu v5e"), 16 * GiB, 197e12, 197e12, 819 * GB, 400 * GB),
    Chip("TPU v5p", ("tpu v5p", "tpu v5"), 95 * GiB, 459e12, 459e12, 2765 * GB, 1200 * GB),
    Chip("TPU v6e", ("tpu v6 lite", "tpu v6e", "tpu trillium"), 32 * GiB, 918e12, 918e12, 1638 * GB, 800 * GB),
    # one of the chip's two TensorCores (a JAX device): half of 192 GiB, 2307 TFLOP/s, 7380 GB/s; the chip's
    # 1200 GB/s of ICI shared by its two devices
    Chip("TPU7x", ("tpu7x", "tpu 7x", "tpu v7"), 96 * GiB, 1153.5e12, 1153.5e12, 3690 * GB, 600 * GB),
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

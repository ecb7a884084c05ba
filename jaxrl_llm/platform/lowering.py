"""Lowering for CUDA on a host without a GPU, and finding the kernels in a lowered module.

`jax.export(..., platforms=["cuda"])` runs the Pallas -> Triton lowering (and Mosaic GPU's) on the
CPU: shapes Triton refuses (non-power-of-two arrays) fail here, before any GPU. Only the steps after
it (Triton -> PTX, autotuning) need the device.
"""
from __future__ import annotations

from typing import Any

from jax import export

# custom-call targets of our Pallas kernels, per platform
KERNEL_CALL_TARGETS = {"cuda": ("__gpu$xla.gpu.triton", "mosaic_gpu"), "tpu": ("tpu_custom_call",)}


def export_for_cuda(jitted: Any, *args: Any, **kwargs: Any) -> export.Exported:
    """`jitted` (a `jax.jit` function) lowered for CUDA on abstract or concrete `args`. The kernels'
    custom calls have no cross-version serialization guarantee, which is fine for a check that
    never ships the artifact."""
    from jaxrl_llm.platform.target import CompileTarget, compiling_for

    checks = [export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_CALL_TARGETS["cuda"]]
    with compiling_for(CompileTarget("gpu", None)):  # trace-time choices follow the GPU, not this host
        return export.export(jitted, platforms=["cuda"], disabled_checks=checks)(*args, **kwargs)


def kernel_calls(module_text: str, platform: str) -> dict[str, int]:
    """How many times each of `platform`'s kernel call targets appears in a lowered / compiled module."""
    return {t: module_text.count(t) for t in KERNEL_CALL_TARGETS[platform] if t in module_text}

"""What the code runs on or is compiled for: published chip figures (HBM, bf16 / fp32 matmul peaks)
keyed by `device_kind`, TPU slices named as gcloud names them turned into compile-only devices
(libtpu compiles for them on any host), and CUDA lowering on a host without a GPU.

    chip_for(device)                      -> Chip | None (H100, H200, B200, TPU v4 / v5e / v5p / v6e)
    tpu_target("v5p-64", num_slices=1)    -> TpuTarget: compile-only devices of that slice
    export_for_cuda(jitted, *args)        -> jax.export.Exported lowered for CUDA (kernels included)
"""
from jaxrl_llm.platform.chips import CHIPS, Chip, chip_for, peak_flops_of
from jaxrl_llm.platform.lowering import KERNEL_CALL_TARGETS, export_for_cuda, kernel_calls
from jaxrl_llm.platform.tpu import TpuPlanError, TpuTarget, accelerator_chip, parse_accelerator_type, tpu_target

__all__ = ["CHIPS", "Chip", "KERNEL_CALL_TARGETS", "TpuPlanError", "TpuTarget", "accelerator_chip", "chip_for",
           "export_for_cuda", "kernel_calls", "parse_accelerator_type", "peak_flops_of", "tpu_target"]

"""The suite's XLA:CPU compile settings (why: tests/conftest.py), for conftest.py and for the helpers
that build a subprocess's environment from scratch. Imports nothing of jax."""

import os

CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# appended to XLA_FLAGS: one codegen thread per compile, the classic elemental emitters (a test that
# needs XLA:CPU's default emitters reruns itself with JAXRL_LLM_TEST_XLA_FLAGS set without them)
TEST_XLA_FLAGS = os.environ.get("JAXRL_LLM_TEST_XLA_FLAGS",
                                f"--xla_cpu_parallel_codegen_split_count=1 {CLASSIC_EMITTERS}")
# jax's `jax_disable_most_optimizations` (LLVM at -O0): "1" in the suite, "0" for an `optimized_xla` test
UNOPTIMIZED = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a test subprocess of `devices` CPU devices, compiled as the suite compiles."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"

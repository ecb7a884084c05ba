"""The suite's XLA:CPU compile settings (why: tests/conftest.py), for conftest.py and for the helpers
that build a subprocess's environment from scratch. Imports nothing of jax."""

import os

CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# appended to XLA_FLAGS: one codegen thread per compile, the classic elemental emitters (a test that
# needs XLA:CPU's default emitters reruns itself with JAXRL_LLM_TEST_XLA_FLAGS set without them)
TEST_XLA_FLAGS = os.environ.get("JAXRL_LLM_TEST_XLA_FLAGS",
                                f"--xla_cpu_parallel_codegen_split_count=1 {CLASSIC_EMITTERS}")
# XLA:CPU aborts the process when a collective's threads do not all reach its rendezvous in time: a warning
# after --xla_cpu_collective_call_warn_stuck_timeout_seconds, the abort that many seconds later again (40 by
# default; "Termination timeout for `all reduce ...`", rendezvous.cc). On the suite's overloaded 2-core host
# (three workers, 8 virtual devices each) a device thread can wait that long for a core: the abort took a worker
# twice in rehearsals (2026-12-05/06), and once xdist's replacement worker then never got work and the run hung.
# XLA's own "unstuck after N s ... the system can be overloaded" note says the same. 5 minutes instead: a test
# whose collective is really deadlocked still ends (and its file reruns once, conftest.py).
COLLECTIVE_TIMEOUT_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
# jax's `jax_disable_most_optimizations` (LLVM at -O0): "1" in the suite, "0" for an `optimized_xla` test
UNOPTIMIZED = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a test subprocess of `devices` CPU devices, compiled as the suite compiles."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS} {COLLECTIVE_TIMEOUT_FLAGS}"

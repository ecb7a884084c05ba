"""trainer.compilation_cache_dir (platform/compile_cache.py): the folder each setting names, a program
compiled once is read back from that folder after the in-memory caches are gone, None turns the cache
off, and a tiny run's second launch reads its programs from the first one's folder."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_runs import tiny_config

from jaxrl_llm.config import apply_overrides, validate_config
from jaxrl_llm.hf.tokenizer import tokenizer_cache_dir
from jaxrl_llm.platform.compile_cache import AUTO_CACHE_BYTES, compilation_cache_dir, jax_setting, use_compilation_cache
from jaxrl_llm.sampler import native


@pytest.fixture
def cache_hits():
    """A list that grows by one per program JAX read from its persistent cache; the suite's cache folder
    (tests/conftest.py) is in use again afterwards."""
    suite_dir = jax_setting("jax_compilation_cache_dir")
    suite_max = jax_setting("jax_compilation_cache_max_size")
    hits: list[str] = []

    def listen(event: str, **_: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.config.update("jax_compilation_cache_max_size", suite_max)
        use_compilation_cache(suite_dir)


def _entries(folder) -> set[str]:
    """The compiled programs kept in `folder` (not the bounded cache's access times and lock)."""
    return {name for name in os.listdir(folder) if name.endswith("-cache")} if os.path.isdir(folder) else set()


def test_each_setting_names_its_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXRL_LLM_CACHE_DIR", raising=False)  # the suite's (tests/conftest.py)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/shared/xla")
    assert compilation_cache_dir("auto") == "/shared/xla"  # the environment's, as JAX itself reads it
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache_dir("auto") == str(tmp_path / "jaxrl_llm" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache_dir("auto") == str(tmp_path / "home" / ".cache" / "jaxrl_llm" / "xla")
    monkeypatch.setenv("JAXRL_LLM_CACHE_DIR", str(tmp_path / "scratch"))  # jaxrl_llm's caches, all moved
    assert compilation_cache_dir("auto") == str(tmp_path / "scratch" / "xla")
    assert tokenizer_cache_dir() == tmp_path / "scratch" / "tokenizers"
    assert native._cache_dir() == tmp_path / "scratch" / "native"
    monkeypatch.setenv("JAXRL_LLM_NATIVE_CACHE", str(tmp_path / "kernel"))  # the kernel's own, first
    assert native._cache_dir() == tmp_path / "kernel"
    monkeypatch.delenv("JAXRL_LLM_CACHE_DIR")
    assert compilation_cache_dir("~/xla") == str(tmp_path / "home" / "xla")
    assert compilation_cache_dir("gs://bucket/xla") == "gs://bucket/xla"
    assert compilation_cache_dir(None) is None and compilation_cache_dir("") is None
    # several processes: auto is off (module doc), a named folder is every process's
    assert compilation_cache_dir("auto", processes=2) is None
    assert compilation_cache_dir("gs://bucket/xla", processes=2) == "gs://bucket/xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/shared/xla")
    assert compilation_cache_dir("auto", processes=2) == "/shared/xla"  # the environment's, as JAX reads it
    monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")  # JAX's own switch, off
    assert compilation_cache_dir("auto") is None and compilation_cache_dir("~/xla") is not None
    # veRL-style overrides: null turns it off
    cfg = apply_overrides(tiny_config(tmp_path / "run"), ["trainer.compilation_cache_dir=null"])
    assert validate_config(cfg, num_devices=1, check_paths=False).trainer.compilation_cache_dir is None


def test_a_program_compiled_once_is_read_back_and_none_turns_the_cache_off(tmp_path, cache_hits):
    folder = tmp_path / "xla"
    assert use_compilation_cache(str(folder)) == str(folder)
    program = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) * 3.0) + 0.25)  # a program no other test compiles
    x = np.arange(37, dtype=np.float32)
    first = np.asarray(program(x))
    written = _entries(folder)
    assert len(written) == 1 and not cache_hits
    jax.clear_caches()  # as a new process: nothing compiled in memory
    np.testing.assert_array_equal(np.asarray(program(x)), first)
    assert len(cache_hits) == 1 and _entries(folder) == written

    assert use_compilation_cache(None) is None
    jax.jit(lambda x: jnp.cumsum(jnp.cos(x) * 5.0))(x)
    assert _entries(folder) == written and len(cache_hits) == 1  # neither written nor read
    use_compilation_cache(str(folder))  # on again, the same folder: read back
    jax.clear_caches()
    program(x)
    assert len(cache_hits) == 2


def test_auto_without_a_folder_from_the_environment_keeps_a_bounded_one_of_its_own(monkeypatch, tmp_path, cache_hits):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.delenv("JAXRL_LLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "jaxrl_llm" / "xla"
    assert use_compilation_cache("auto") == str(folder)
    assert jax_setting("jax_compilation_cache_max_size") == AUTO_CACHE_BYTES
    program = jax.jit(lambda x: jnp.tanh(x) @ x.T - 0.5)
    x = np.ones((5, 3), np.float32)
    program(x)
    assert len(_entries(folder)) == 1 and (folder / ".lockfile").exists()  # the bounded (LRU) cache's lock
    jax.clear_caches()
    program(x)
    assert len(cache_hits) == 1


def test_a_relaunched_run_reads_its_programs_from_the_first_launchs_folder(tmp_path, cache_hits):
    from jaxrl_llm.trainer import Trainer

    folder = tmp_path / "xla"
    overrides = {"trainer.compilation_cache_dir": str(folder), "trainer.total_training_steps": 1}
    first = Trainer(tiny_config(tmp_path / "first", **overrides))
    first_metrics = first.fit()
    written = _entries(folder)
    assert len(written) >= 3, written  # at least the rollout, the log-prob pass and the update
    jax.clear_caches()
    hits_before = len(cache_hits)
    again = Trainer(tiny_config(tmp_path / "again", **overrides))
    again_metrics = again.fit()
    # the suite keeps every program (tests/conftest.py: no minimum compile time), so a program the relaunch
    # compiled would be a new entry: there is none, and it read its programs back (21 of the 24 the first
    # launch wrote, 2026-12-07: the rest were compiled once, for the first launch's setup)
    assert _entries(folder) == written, sorted(_entries(folder) - written)
    assert len(cache_hits) - hits_before >= len(written) // 2, (len(cache_hits) - hits_before, len(written))
    for key in ("actor/pg_loss", "critic/score/mean", "actor/grad_norm"):
        assert again_metrics[key] == first_metrics[key], key

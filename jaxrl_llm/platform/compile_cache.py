"""XLA's compiled programs kept between launches: JAX's persistent compilation cache, on by default
(`trainer.compilation_cache_dir`).

A relaunch after a preemption, a resume or a second run of the same config reads the step's programs
from the cache instead of compiling them again (on a TPU slice a large model's programs take minutes
each; measured on the 2-core CPU: docs/performance.md). JAX keys each entry by the program, the
compile options, the devices and the jax / jaxlib versions, so a changed config or release compiles
afresh; programs that compile in under `jax_persistent_cache_min_compile_time_secs` (JAX's default
1 s) are not kept. (MaxText keeps its compiled programs the same way: `jax_cache_dir`.)

Several processes: 'auto' leaves the cache off (unless $JAX_COMPILATION_CACHE_DIR names one). One
process can then load a program from its folder while its peer compiles the same program afresh (a host
whose folder is newer, or a shared folder read while another process writes it), and two such CPU
processes ran mismatched gloo collectives and aborted in this project's tests (tests/multiprocess_util.py).
A folder named in the key is used by every process, at that risk.

The cache is trusted code: a folder others can write to lets them run code in the run (JAX's
warning), so the default lives under the user's own cache folder.
"""
from __future__ import annotations

import os
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxrl_llm.cache_dirs import cache_root

# 'auto' picks a local folder of its own: least recently used entries go past this size
AUTO_CACHE_BYTES = 10 * 2**30


def jax_setting(name: str) -> Any:
    """A JAX config value by its name (`jax.config` declares them at run time, out of a type checker's sight)."""
    return getattr(jax.config, name)


def compilation_cache_dir(setting: str | None, processes: int = 1) -> str | None:
    """The folder `trainer.compilation_cache_dir` names in a run of `processes` JAX processes: 'auto' ->
    $JAX_COMPILATION_CACHE_DIR when set, else `xla` under jaxrl_llm's cache root (cache_dirs.py: by default
    <$XDG_CACHE_HOME or ~/.cache>/jaxrl_llm) with one process and
    None with several (module doc), None where $JAX_ENABLE_COMPILATION_CACHE is false; None or '' -> None (no
    cache); a path (~ expanded) or a gs:// URL as it is."""
    if not setting:
        return None
    if setting == "auto":
        if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in ("0", "false", "no", "off"):
            return None  # JAX's own switch, set off in the environment
        from_env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        if from_env:
            return from_env
        if processes > 1:
            return None
        return str(cache_root() / "xla")
    return setting if "://" in setting else os.path.expanduser(setting)


def use_compilation_cache(setting: str | None) -> str | None:
    """Points JAX's persistent compilation cache at `compilation_cache_dir(setting)` (None: turns it off) for
    every program compiled from now on in this process, even after earlier compiles; returns the folder."""
    path = compilation_cache_dir(setting, jax.process_count())
    if path is None:
        if jax_setting("jax_enable_compilation_cache"):
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
        return None
    if path == jax_setting("jax_compilation_cache_dir") and jax_setting("jax_enable_compilation_cache"):
        return path  # already in use (tests/conftest.py, or an earlier run of this process)
    if setting == "auto" and path != os.environ.get("JAX_COMPILATION_CACHE_DIR") \
            and jax_setting("jax_compilation_cache_max_size") == -1:
        jax.config.update("jax_compilation_cache_max_size", AUTO_CACHE_BYTES)  # our own folder: bounded
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.set_cache_dir(path)
    compilation_cache.reset_cache()  # a cache JAX opened on another folder (or none) is read no more
    return path

"""The CPU paged decode attention kernel (paged_attention_cpu.cc), built on first use and called
through the XLA FFI.

Why a hand-written kernel: on XLA:CPU the XLA path (sampler/paged_attention.py) materialises each
block of gathered pages and reduces q.k over the minor head_dim, reading the pool at ~2-6 GB/s on
a host whose plain reads reach ~27 GB/s; at 32 slots and ~512 tokens of context that attention
was ~2/3 of a SmolLM2 decode step. The kernel reads every slot's keys and values in place through
its page table, 16 keys at a time in vector registers (7.5x the XLA path per layer there, within
~15% of the read floor; docs/performance-history.md). No library offers paged decode attention for JAX on
CPU.

Build: the C++ source is compiled with the host's C++ compiler (`$CXX`, else g++) against
jaxlib's FFI headers into a cache folder (`$JAXRL_LLM_NATIVE_CACHE`, else `native` under jaxrl_llm's
cache root, cache_dirs.py: ~/.cache/jaxrl_llm/native by default), keyed by the source, the headers, the
compiler and the CPU's instruction-set flags (it is built for the host CPU, -march=native), written to a
temporary name and renamed, so concurrent processes never load a half-written library; a lock file in the folder makes
processes that start together wait for one build. Without a compiler (or if the
build fails) `available()` is False with the reason in `unavailable_reason()`, and
`rollout.paged_attention='auto'` keeps the XLA path.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_llm.cache_dirs import cache_root
from jaxrl_llm.sampler.kv_shards import per_kv_head_shard

Array = jax.Array
_SOURCE = pathlib.Path(__file__).with_name("paged_attention_cpu.cc")
_TARGET = "jaxrl_llm_paged_attention_cpu"
_lock = threading.Lock()


def _cpu_flags() -> str | None:
    """The CPU's instruction-set flags (Linux), or None where they cannot be read."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def compiler() -> str | None:
    """The C++ compiler the kernel is built with: `$CXX`, else the first of g++ / c++ / clang++ found."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("JAXRL_LLM_NATIVE_CACHE")
    return pathlib.Path(root) if root else cache_root() / "native"


def build() -> pathlib.Path:
    """The compiled library's path in the cache folder (compiled now unless there); raises
    RuntimeError with the reason when it cannot be built."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    include = pathlib.Path(jax.ffi.include_dir())
    header = include / "xla" / "ffi" / "api" / "ffi.h"
    if not header.exists():
        raise RuntimeError(f"jaxlib's FFI headers are missing ({header})")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    flags = _cpu_flags()
    arch = ["-march=native"] if flags is not None else []
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), header.read_bytes(), (include / "xla" / "ffi" / "api" / "api.h").read_bytes(),
                 version.encode(), (flags or "portable").encode(), " ".join(arch).encode()):
        key.update(part)
    out = _cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # one build per host: the processes that start together (a host's workers, a test session's) wait for the
    # first one's library (half a minute of the compiler each) instead of all compiling it
    with open(out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            _compile(cxx, arch, include, out)
    return out


def _compile(cxx: str, arch: list[str], include: pathlib.Path, out: pathlib.Path) -> None:
    """The library compiled to a temporary name and renamed to `out` (a reader sees all of it or nothing)."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    cmd = [cxx, "-std=c++17", "-O3", *arch, "-shared", "-fPIC", "-w", f"-I{include}", str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: another process loads either nothing or the whole library
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _register() -> str | None:
    """Builds and registers the kernel once per process; None on success, else the reason."""
    with _lock:  # the cache is read under the lock: concurrent first calls build and register once
        return _build_and_register()


@functools.cache
def _build_and_register() -> str | None:
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.JaxrlPagedAttentionCpu), platform="cpu")
        return None
    except (RuntimeError, OSError) as e:
        warnings.warn(f"the CPU paged-attention kernel is unavailable, decode attention takes the XLA path: {e}",
                      stacklevel=4)
        return str(e)


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _register() is None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    return _register()


def supports(q_dtype, page_dtype, int8_pages: bool) -> bool:
    """Whether the kernel takes these inputs: fp32 queries and pages (bf16 and int8 pools keep the
    XLA path)."""
    return not int8_pages and jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(page_dtype) == jnp.float32


def paged_decode_attention_cpu(q: Array, k_pages: Array, v_pages: Array, lengths: Array, page_indices: Array, *,
                               sliding_window: int | None = None, layer: Array | None = None,
                               softcap: float | None = None, mesh: Mesh | None = None) -> Array:
    """The paged-attention contract (sampler/paged_attention.py) on the CPU kernel: fp32 q [S, H, D],
    pages [KV, P, PS, D] (or the stacked pool [L, KV, P, PS, D] with `layer`). On a multi-device
    `mesh` it runs per kv-head shard under shard_map (XLA cannot partition a custom call;
    sampler/kv_shards.py)."""
    if not available():
        raise RuntimeError(f"rollout.paged_attention='cpu': {unavailable_reason()}")
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], jnp.int32(0)
    call = functools.partial(_call, window=int(sliding_window or 0), softcap=float(softcap or 0.0))
    lengths, page_indices = jnp.asarray(lengths, jnp.int32), jnp.asarray(page_indices, jnp.int32)
    return per_kv_head_shard(call, mesh, k_pages, replicated=3)(q, k_pages, v_pages, lengths, page_indices,
                                                                jnp.asarray(layer, jnp.int32))


def _call(q: Array, k_pages: Array, v_pages: Array, lengths: Array, page_indices: Array, layer: Array, *,
          window: int, softcap: float) -> Array:
    return jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))(
        q, k_pages, v_pages, lengths, page_indices, layer, window=np.int64(window), softcap=np.float32(softcap))

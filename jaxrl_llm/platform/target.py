"""The platform a program is being built for, when that is not this host's backend.

Planning a TPU slice from a CPU host (`--plan --topology=v5p-64`) traces the run's programs here
but for TPU devices: choices made at trace time from the backend (how a bf16 KV pool is stored,
which Pallas variant, whether pinned host memory exists, how much memory a KV pool may take) must
follow the target, not the host. Kernels chosen by `lax.platform_dependent` follow the lowering
platform by themselves; the rest read `target_platform()` / `target_memory_bytes()`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import jax


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    platform: str  # "tpu" | "gpu" | "cpu"
    memory_bytes: int | None  # per device


_TARGET: contextvars.ContextVar[CompileTarget | None] = contextvars.ContextVar("jaxrl_llm_target", default=None)


@contextlib.contextmanager
def compiling_for(target: CompileTarget) -> Iterator[CompileTarget]:
    """Within the block, `target_platform()` / `target_memory_bytes()` describe `target`."""
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)


def target_platform() -> str:
    """The platform programs are built for: the active `compiling_for` target, else this host's backend."""
    target = _TARGET.get()
    return target.platform if target is not None else jax.default_backend()


def target_memory_bytes() -> int | None:
    """Per-device memory of the active target; None when no target is active (read the device instead)."""
    target = _TARGET.get()
    return None if target is None else target.memory_bytes


def has_target() -> bool:
    return _TARGET.get() is not None


_IN_USE: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxrl_llm_in_use", default=None)


@contextlib.contextmanager
def planning_in_use(bytes_per_device: int) -> Iterator[None]:
    """Within the block, sizing that reads the device's memory in use (the paged engine's KV pool) reads
    `bytes_per_device` instead: what the run will hold when it samples (its params, optimizer state,
    reference), not what this host holds while it plans."""
    token = _IN_USE.set(bytes_per_device)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def planned_in_use_bytes() -> int | None:
    """The in-use bytes of an active `planning_in_use`, else None."""
    return _IN_USE.get()

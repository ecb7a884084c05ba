"""Rematerialisation (gradient checkpointing) policies of the decoder layers, by name.

`REMAT_POLICIES` are the names `actor.remat_policy` / `critic.remat_policy` accept (docs/config.md):

- `none`: no remat; every layer's activations stay live for the backward pass (most memory).
- `full`: each layer is recomputed in the backward pass, only its input is kept
  (`jax.checkpoint_policies.nothing_saveable`; least memory, about one more forward of compute).
- `dots_saveable`: matmul outputs are kept, the cheap elementwise ops (norms, activations, RoPE)
  are recomputed (`jax.checkpoint_policies.dots_saveable`).
- `offload`: the weight matmul outputs are moved to pinned host memory in the forward pass and
  back in the backward pass (`offload_dot_with_no_batch_dims`); where the backend has no pinned
  host memory it falls back to `dots_with_no_batch_dims_saveable` with one warning.

The policy name is a hashable static setting; `checkpoint_policy(name)` gives what `jax.checkpoint`
takes, `scan_step` the layer scans' trip body and `scan_layers` the scans (models/decoder.py, gemma4.py,
hybrid.py).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax

from jaxrl_llm.platform.chips import Device
from jaxrl_llm.platform.target import has_target, target_platform

log = logging.getLogger("jaxrl_llm")

REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots_saveable", "offload")
_warned: set[str] = set()


def remat_name(value: bool | str | None) -> str:
    """The policy name of `value`: a name in REMAT_POLICIES, or a bool (True = full, False/None = none)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    if value not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {value!r}; valid: {', '.join(REMAT_POLICIES)}")
    return value


def supports_pinned_host(device: Device | None = None) -> bool:
    """Whether `device` (default: the first device) has a `pinned_host` memory space."""
    if device is None and has_target():  # planning for another platform: TPU and GPU have pinned host memory
        return target_platform() in ("tpu", "gpu")
    target = jax.devices()[0] if device is None else device
    try:
        return any(m.kind == "pinned_host" for m in target.addressable_memories())
    except Exception:  # backends without the memories API have no host offload
        return False


def warn_once(key: str, message: str, *args: Any) -> None:
    """Logs `message` once per `key` per process (trace-time fallbacks would otherwise repeat)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def checkpoint_policy(name: bool | str | None) -> Callable[..., bool] | None:
    """The `jax.checkpoint` policy of a remat policy name (None for `none`: do not remat)."""
    name = remat_name(name)
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "dots_saveable":
        return cp.dots_saveable
    if not supports_pinned_host():
        warn_once("remat_offload", "remat_policy=offload: no effect on this backend (%s has no pinned_host "
                  "memory); using dots_with_no_batch_dims_saveable instead", jax.default_backend())
        return cp.dots_with_no_batch_dims_saveable
    return cp.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host")


# the layer scans' name in compiled programs: the TPU plan reads one layer's bytes from their loop bodies
# (planning/hbm_bytes.py `layer_loop_bytes`)
LAYER_SCAN = "layer_scan"


def scan_layers(layer: Callable, remat: bool | str | None, repeat: int, init: Any, xs: Any,
                length: int | None = None) -> tuple[Any, Any]:
    """`lax.scan` of `scan_step(layer, remat, repeat)` from `init` over `xs` (the stacked layers), under the name
    LAYER_SCAN."""
    with jax.named_scope(LAYER_SCAN):
        return jax.lax.scan(scan_step(layer, remat, repeat), init, xs, length=length)


def scan_step(layer: Callable, remat: bool | str | None, repeat: int = 1) -> Callable:
    """A layer scan's trip body: `layer` (carry, xs) -> (carry, out), checkpointed by the remat policy and, where
    `repeat` > 1, run that many times per trip on the trip's weights (`ModelConfig.scan_repeat`: the memory plan
    compiles a program with 2 so that XLA's count, which holds a loop body once, holds 2 layers; the
    difference is one layer's cost). Repeats return the last one's `out`, of the shape a run returns."""
    step = layer
    if remat_name(remat) != "none":  # prevent_cse=False: the layers run under scan, which keeps them apart
        step = jax.checkpoint(layer, prevent_cse=False, policy=checkpoint_policy(remat))
    if repeat == 1:
        return step

    def repeated(carry: Any, xs: Any) -> tuple[Any, Any]:
        carry, out = step(carry, xs)
        for _ in range(repeat - 1):
            carry, out = step(carry, xs)
        return carry, out
    return repeated

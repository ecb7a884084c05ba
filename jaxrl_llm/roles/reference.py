"""The frozen reference policy of full fine-tuning: a copy of the initial policy params, stored in
`actor_rollout_ref.ref.param_dtype` (default: the compute dtype, so a bf16 run keeps a half-size
copy) and, with `ref.param_offload`, in pinned host memory between reference passes.

`make_reference` builds it once (same shardings as the policy, memory kind aside);
`reference_on_device` gives the arrays the reference pass reads: the stored ones, or a transient
device copy of the offloaded ones that is freed once the pass's result is computed. With LoRA the
reference is the frozen base itself (adapters off): no copy. `ReferenceRole` is the role a run holds.
"""
from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import ArrayTree, Params
from jaxrl_llm.config.spec import ModelSpec, RefSpec
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.remat import supports_pinned_host, warn_once
from jaxrl_llm.roles.forward import compute_dtype_of

HOST = "pinned_host"
log = logging.getLogger("jaxrl_llm")


@dataclasses.dataclass(frozen=True)
class ReferenceRole:
    """The frozen reference policy of a run: the model it is (the policy's `model` spec and config)
    and its params, stored as `make_reference` placed them (or the LoRA base, `shares_base`)."""

    model: ModelSpec
    model_cfg: ModelConfig
    params: dict
    param_dtype: str
    shares_base: bool = False

    def device_params(self) -> dict:
        """The params a reference pass reads (a transient device copy when they are offloaded)."""
        return reference_on_device(self.params)

    def describe(self) -> str:
        if self.shares_base:
            return "on (the LoRA base, adapters off; no copy)"
        where = "pinned host" if is_offloaded(self.params) else "device"
        return f"on ({self.param_dtype}, {where} memory)"


def make_reference_role(model: ModelSpec, model_cfg: ModelConfig, params: dict, spec: RefSpec, *,
                        lora_base: dict | None = None) -> ReferenceRole:
    """The reference of a policy that starts from `params`: with LoRA its frozen base `lora_base`
    (no copy), else a copy in `spec.param_dtype` (`make_reference`)."""
    if lora_base is not None:
        if spec.param_offload:
            log.warning("actor_rollout_ref.ref.param_offload: no effect with LoRA (the reference is the frozen base "
                        "the policy also reads)")
        return ReferenceRole(model, model_cfg, lora_base, spec.param_dtype, shares_base=True)
    return ReferenceRole(model, model_cfg, make_reference(params, spec), spec.param_dtype)


def offload_supported() -> bool:
    """Whether this backend can keep arrays in pinned host memory (`jax.sharding` memory kinds)."""
    return supports_pinned_host()


def make_reference(params: dict, spec: RefSpec) -> dict:
    """A separate copy of `params` in `spec.param_dtype`, on the same shardings; in pinned host
    memory when `spec.param_offload` and the backend supports it (else one warning)."""
    dtype = compute_dtype_of(spec.param_dtype)
    memory_kind = None
    if spec.param_offload:
        if offload_supported():
            memory_kind = HOST
        else:
            warn_once("ref_param_offload", "actor_rollout_ref.ref.param_offload: no effect on this backend (%s has "
                      "no pinned_host memory); the reference params stay in device memory", jax.default_backend())
    shardings = jax.tree.map(lambda x: x.sharding.with_memory_kind(memory_kind) if memory_kind else x.sharding,
                             params)
    # jnp.copy: a returned input would be forwarded as the same buffer, which the actor update donates
    cast = jax.jit(lambda p: jax.tree.map(lambda x: jnp.copy(x.astype(dtype)), p), out_shardings=shardings)
    return cast(params)


def is_offloaded(params: Params) -> bool:
    return any(getattr(x.sharding, "memory_kind", None) == HOST for x in jax.tree.leaves(params))


def reference_on_device(params: Params) -> Params:
    """`params` in device memory: themselves, or a device copy of offloaded (pinned host) arrays."""
    if not is_offloaded(params):
        return params
    kind = jax.devices()[0].default_memory().kind
    return jax.device_put(params, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), params))


def to_host(tree: ArrayTree) -> ArrayTree:
    """`tree` moved to pinned host memory, on the same shardings (the device buffers are freed when
    nothing else holds them)."""
    return jax.device_put(tree, jax.tree.map(lambda x: x.sharding.with_memory_kind(HOST), tree))

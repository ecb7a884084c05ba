"""The frozen reference policy of full fine-tuning: a copy of the initial policy params, stored in
`actor_rollout_ref.ref.param_dtype` (default: the compute dtype, so a bf16 run keeps a half-size
copy) and, with `ref.param_offload`, in pinned host memory between reference passes.

`make_reference` builds it once (same shardings as the policy, memory kind aside);
`reference_on_device` gives the arrays the reference pass reads: the stored ones, or a transient
device copy of the offloaded ones that is freed once the pass's result is computed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.config.spec import RefSpec
from jaxrl_llm.models.remat import supports_pinned_host, warn_once
from jaxrl_llm.trainer.forward import compute_dtype_of

HOST = "pinned_host"


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


def is_offloaded(params: dict) -> bool:
    return any(getattr(x.sharding, "memory_kind", None) == HOST for x in jax.tree.leaves(params))


def reference_on_device(params: dict) -> dict:
    """`params` in device memory: themselves, or a device copy of offloaded (pinned host) arrays."""
    if not is_offloaded(params):
        return params
    kind = jax.devices()[0].default_memory().kind
    return jax.device_put(params, jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), params))

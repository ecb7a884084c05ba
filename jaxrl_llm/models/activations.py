"""The gated MLP's activation product, shared by dense MLPs and MoE experts: act(gate) * up,
recomputed in the backward from gate and up."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import DType

Array = jax.Array

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": jax.nn.silu,  # SwiGLU
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma)
}


def gated_product(gate: Array, up: Array, activation: str, dtype: DType,
                  clamp: tuple[float, float] | None = None) -> Array:
    """act(gate) * up in the compute dtype, recomputed in the backward from gate and up. `clamp`
    (limit, alpha): GPT-OSS's clamped SwiGLU instead, (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
    with g = min(gate, limit) (transformers' GptOssExperts; `activation` is then unused).

    Why: differentiated as written, the activation keeps its own intermediates alive for the
    backward (silu's sigmoid and quotient, the product's factors: [tokens, intermediate] tensors
    beside gate and up, each stacked by the layer scan; six such stacks per layer in a SmolLM2
    update). Recomputing them is a few elementwise passes; keeping them cost 2.5% of that update on
    CPU (docs/performance-history.md, 2026-11-29)."""
    return _gated_product(gate, up, activation, dtype, clamp)


@functools.partial(jax.checkpoint, static_argnums=(2, 3, 4))
def _gated_product(gate: Array, up: Array, activation: str, dtype: DType, clamp: tuple[float, float] | None) -> Array:
    if clamp is not None:
        limit, alpha = clamp
        gate = jnp.minimum(gate, limit)
        return ((jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(alpha * gate))).astype(dtype)
    return (ACTIVATIONS[activation](gate) * up).astype(dtype)

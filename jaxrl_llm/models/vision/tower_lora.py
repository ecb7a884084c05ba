"""LoRA on a vision tower (`model.lora_rank > 0` with `actor.freeze_vision_tower=False`, as ms-swift's
`freeze_vit=False` or Unsloth's `finetune_vision_layers`): adapters on the tower's blocks' attention and MLP
projections (each block stack's [depth, in, out] kernels: Qwen's qkv / proj / gate / up / down or fc1 / fc2,
SigLIP's qkv / proj / fc1 / fc2, Gemma 4's q / k / v / o / gate / up / down), the tower itself frozen. They live
beside the text model's adapters, in `params["lora"]["vision"]`, so they train, checkpoint and reach the sampler
with them.

The tower runs on W + scale x A @ B, merged per call (`merged_tower`): one [in, r] x [r, out] product per kernel,
a fraction of the tower's own work on a batch's images, so every tower kind takes adapters without a LoRA path of
its own. LoRA dropout does not reach the tower (a merged kernel has no per-token input to drop).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def tower_lora_targets(tower: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the tower's block kernels adapters attach to: the [depth, in, out] stacks of its blocks."""
    return tuple(sorted(name for name, value in tower["blocks"].items()
                        if not isinstance(value, Mapping) and len(getattr(value, "shape", ())) == 3))


def init_tower_lora(tower: Mapping[str, Any], rank: int, rng: Array) -> dict[str, Any]:
    """Fresh fp32 adapters of a tower: A ~ U(+-1/sqrt(in)) [depth, in, r] (PEFT's init), B = 0 [depth, r, out]."""
    blocks = {}
    for i, name in enumerate(tower_lora_targets(tower)):
        depth, fan_in, fan_out = tower["blocks"][name].shape
        bound = 1.0 / math.sqrt(fan_in)
        blocks[name] = {"A": jax.random.uniform(jax.random.fold_in(rng, i), (depth, fan_in, rank), jnp.float32,
                                                -bound, bound),
                        "B": jnp.zeros((depth, rank, fan_out), jnp.float32)}
    return {"blocks": blocks}


def merged_tower(tower: Mapping[str, Any], adapters: Mapping[str, Any] | None, scale: float) -> dict[str, Any]:
    """The tower's params with each adapted kernel W + scale x A @ B (fp32 math, W's dtype); the tower as it is
    without adapters. Differentiable in the adapters."""
    if not adapters:
        return dict(tower)
    blocks = dict(tower["blocks"])
    for name, adapter in adapters["blocks"].items():
        kernel = blocks[name]
        delta = jnp.einsum("dir,dro->dio", jnp.asarray(adapter["A"], jnp.float32), jnp.asarray(adapter["B"],
                                                                                                jnp.float32))
        blocks[name] = (jnp.asarray(kernel, jnp.float32) + scale * delta).astype(kernel.dtype)
    return {**tower, "blocks": blocks}


def tower_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """The tower a pass reads of the policy's params: `params["vision"]`, with LoRA's tower adapters merged where
    `params["lora"]` (models/lora.py `LoraAdapters`) holds them."""
    lora = params.get("lora")
    weights = getattr(lora, "weights", None) or {}
    return merged_tower(params["vision"], weights.get("vision"), float(getattr(lora, "scale", 0.0)))

"""The decoder's building blocks, shared by every family's layer (models/decoder.py; Gemma 4's typed layers:
models/gemma4.py): the attention protocol each path implements, RMSNorm, RoPE, the projection (one 2-D
matmul of compute-dtype operands with fp32 accumulation, + bias, + LoRA) and the gated MLP. The
numerics conventions are models/decoder.py's module docstring."""
from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.activations import gated_product
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import lora_delta
from jaxrl_llm.models.numerics import matmul_f32
from jaxrl_llm.models.rope_freqs import rope_attention_factor, rope_inv_freq
from jaxrl_llm.sharding.mesh import context_parallel_size
from jaxrl_llm.sharding.rules import with_activation_constraint

Array = jax.Array

class LayerAttention(Protocol):
    """One layer's attention with its cache: q [B, T, heads, D] and k / v [B, T, kv_heads, D] in the
    compute dtype (RoPE applied), `state` (the cache, carried through the layer scan), the layer
    index (int32 scalar) and the layer's attention sinks (fp32 [heads], GPT-OSS; else None: a logit per
    head in every softmax's denominator) -> (output [B, T, heads, D], fp32 or compute dtype; the new state)."""

    def __call__(self, q: Array, k: Array, v: Array, state: ArrayTree, layer: Array, sinks: Array | None, /
                 ) -> tuple[Array, Any]: ...


def rms_norm(x: Array, scale: Array, eps: float, dtype: DType, offset: float = 0.0) -> Array:
    """RMSNorm over the last axis in fp32, times (offset + scale) (Gemma: 1 + w), the result in `dtype`.
    Batch-invariant mode (models/invariant.py): the mean of squares by `tree_sum`."""
    x32 = x.astype(jnp.float32)
    if invariant.enabled():
        mean_square = (invariant.tree_sum(x32 * x32) / x32.shape[-1])[..., None]
    else:
        mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    y = x32 * lax.rsqrt(mean_square + eps)
    weight = scale.astype(jnp.float32)
    return (y * (weight + offset if offset else weight)).astype(dtype)


def rope_cos_sin(cfg: ModelConfig, positions: Array, *, local: bool = False) -> tuple[Array, Array]:
    """cos/sin tables [B, T, head_dim] (fp32) for integer positions [B, T] (HF rotate-half layout),
    times YaRN's attention factor where the model has one (as transformers scales them). `local`: the
    sliding layers' table of a model with a RoPE base of their own (Gemma 3: unscaled, `rope_local_theta`).
    M-RoPE (`cfg.mrope_section`, Qwen2.5-VL / Qwen3-VL): positions [3, B, T] (temporal, height, width streams),
    the frequencies of section i turned by stream i (contiguous sections, or interleaved: `cfg.mrope_interleaved`)."""
    if positions.ndim == 3:
        return _mrope_cos_sin(cfg, positions)
    if local:
        assert cfg.rope_local_theta is not None
        dim = cfg.head_dim
        inv = 1.0 / (cfg.rope_local_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
        angles = jnp.concatenate([angles, angles], axis=-1)
        return jnp.cos(angles), jnp.sin(angles)
    if cfg.rope_scaling_dict.get("rope_type") == "dynamic":
        inv = dynamic_ntk_inv_freq(cfg, positions)
    else:
        inv = jnp.asarray(rope_inv_freq(cfg))
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    scale = rope_attention_factor(cfg)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def _mrope_cos_sin(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    sections = cfg.mrope_section
    if not sections or len(positions) != 3:
        raise ValueError(f"positions {positions.shape}: [3, B, T] positions need a model with mrope_section")
    inv = jnp.asarray(rope_inv_freq(cfg))
    if sum(sections) != inv.shape[0]:
        raise ValueError(f"mrope_section {sections} must sum to head_dim / 2 = {inv.shape[0]}")
    if cfg.mrope_interleaved:  # Qwen3-VL: T H W T H W ... over 3 x the height / width sections, then T
        stream = np.zeros(inv.shape[0], np.int64)
        for axis in (1, 2):
            stream[axis:3 * sections[axis]:3] = axis
    else:  # Qwen2.5-VL: contiguous sections
        stream = np.repeat(np.arange(len(sections)) % 3, sections)  # the position stream of each frequency
    angles = positions.astype(jnp.float32)[..., None] * inv  # [3, B, T, D/2]
    angles = jnp.einsum("sbtd,sd->btd", angles, jnp.asarray(np.eye(3, dtype=np.float32)[:, stream]),
                        precision=lax.Precision.HIGHEST)  # one stream per frequency (exact: the others times 0)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def dynamic_ntk_inv_freq(cfg: ModelConfig, positions: Array) -> Array:
    """Dynamic NTK scaling: past max_position_embeddings the RoPE base grows with the longest position
    of this forward (transformers' dynamic_rope_update within one generate call: a decode step uses the
    current length, the cached keys keep theirs). A full-sequence pass thus scores early tokens under
    the final length's base, which is why the trainer refuses it past the context (trainer.py)."""
    dim, limit = cfg.rotary_dim, cfg.max_position_embeddings
    factor = float(cfg.rope_scaling_dict["factor"])
    seq = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1, float(limit))
    base = cfg.rope_theta * ((factor * seq / limit) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [B, T, heads, D]; cos/sin: [B, T, D]. Computed in fp32, returned in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def project(x: Array, weights: dict, adapter: dict | None, lora_scale: float, dtype: DType, *,
            in_axes: int = 1) -> Array:
    """fp32 [..., *out] = x [..., *in] @ kernel [*in, *out] (+ bias, + the LoRA delta), as one matmul of
    compute-dtype operands over the flattened in / out axes (`in_axes`: the trailing axes of x
    contracted) and the flattened leading axes (kept apart under context parallelism)."""
    kernel = weights["kernel"]
    n_in = math.prod(kernel.shape[:in_axes])
    out_shape = kernel.shape[in_axes:]
    lead = x.shape[:x.ndim - in_axes]
    rows = (math.prod(lead),) if context_parallel_size() == 1 else lead  # see the module docstring
    y = matmul_f32(x.reshape(*rows, n_in).astype(dtype), kernel.reshape(n_in, -1).astype(dtype))
    if "bias" in weights:
        y = y + weights["bias"].reshape(-1).astype(dtype)
    y = y.reshape(*lead, *out_shape)
    delta = lora_delta(x, adapter, lora_scale, dtype)
    return y if delta is None else y + delta


def batch_rows(x: Array, split: bool, last: str = "act_embed") -> Array:
    """x [B, T, F] (or [B, T, heads, D]) constrained to its rows split over the batch axes (and tokens over
    'context'), F over `last`'s axes, where `split` (the training and scoring forward). Without it XLA
    may carry an FSDP kernel's split of its contracting (embed) dim over to the activations, so that
    every device computes every row: a Qwen2-7B update at one sequence per chip kept [rows, intermediate]
    whole on each chip and asked for 43 GiB on v5e-32 (docs/performance-history.md). The sampler's decode leaves
    its few rows to XLA (an all-reduce of [slots, F] costs less there than all-gathering the weights)."""
    if not split:
        return x
    names = ("batch", "length", last) if x.ndim == 3 else ("batch", "length", last, "act_head_dim")
    return with_activation_constraint(x, names)


def mlp_block(weights: dict, adapters: dict, x: Array, *, dtype: DType, lora_scale: float,
              activation: str = "silu", split_rows: bool = False) -> Array:
    """fp32 [..., H] gated MLP (SwiGLU, or GeGLU with activation="gelu_pytorch_tanh") of normed x [..., H]
    (compute dtype); `split_rows`: `batch_rows` on a [B, T, ...] x's activations."""
    split_rows = split_rows and x.ndim == 3

    def dense(name: str, h: Array) -> Array:
        y = project(batch_rows(h, split_rows, "act_mlp" if name == "down_proj" else "act_embed"), weights[name],
                    adapters.get(name), lora_scale, dtype)
        return batch_rows(y, split_rows, "act_embed" if name == "down_proj" else "act_mlp")

    return dense("down_proj", gated_product(dense("gate_proj", x), dense("up_proj", x), activation, dtype))


def embed_tokens(params: dict, cfg: ModelConfig, input_ids: Array, dtype: DType) -> tuple[Array, Array]:
    """(the fp32 residual stream [B, T, H] the layers start from, and the same embedding in the compute
    dtype): the embedding rows in the compute dtype, times sqrt(hidden_size) for Gemma (a constant in the
    compute dtype, as HF multiplies in the weights' dtype)."""
    x = jnp.take(params["embedding"], input_ids, axis=0).astype(dtype)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(np.sqrt(cfg.hidden_size), dtype)
    return x.astype(jnp.float32), x


def take_row(tree: Any, index: Array) -> Any:
    """Row `index` of every leaf of a tree stacked on a leading axis (a layer kind's weights stacked over its
    own layers: a mixed-layer MoE model's MLPs, Gemma 4's per-kind stacks)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def image_rows(slots: Array, features: Array, dtype: Any) -> Array:
    """[B, T, H] fp32: the feature each image token takes (slots [B, T], -1 elsewhere) from the batch's packed
    features [M, H] (a sampler's prefill) or each row's own [B, K, H] (a training batch: rows split, sharded
    alike), rounded to the compute dtype as transformers scatters them."""
    if features.ndim == 3:
        picked = jnp.take_along_axis(features.astype(dtype), jnp.maximum(slots, 0)[..., None], axis=1)
    else:
        picked = jnp.take(features.astype(dtype), jnp.maximum(slots, 0), axis=0)
    # rows over the batch axes, the hidden width whole: the embedding gather's own layout (split by the table's)
    # met the row-split features in the backward, and XLA rematerialised them whole
    return with_activation_constraint(picked.astype(jnp.float32), ("batch", "length", "act_embed"))

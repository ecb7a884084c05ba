"""Multi-head latent attention (DeepSeek-V2 / V3, Kimi-K2): the attention sublayer of a `cfg.is_mla` model,
called by the decoder in place of `attention_block` with the same `LayerAttention` (models/blocks.py).

Per token: a query per head through a low-rank bottleneck (q_a_proj -> RMSNorm -> q_b_proj, or one q_proj),
split into a part without position (qk_nope_head_dim) and a RoPE'd part (head_dim); a compressed latent
c = RMSNorm(x @ W_kv_a)[:kv_lora_rank] and one RoPE'd key k_rope shared by every head. Each head expands
the latent into its key and value: [k_nope | v] = c @ W_kv_b. Scores are
(q_nope . k_nope + q_rope . k_rope) * softmax_scale (models/config_deepseek.py `mla_softmax_scale`).

Two equal ways to compute it, picked by the path:

- expanded (the trainer's forward and scoring: no cache): keys and values per head, as transformers
  computes them; FLOPs per (query, key) pair grow with heads x (qk + v) head dims.
- absorbed (every path with a cache: the static sampler and the paged engine's prefill and decode, and
  every path in batch-invariant mode): q_nope . k_nope = (q_nope W_uk^T) . c, and the value sum
  P (c W_uv) = (P c) W_uv. The query becomes [q_nope W_uk^T | q_rope] (kv_lora_rank + head_dim wide) and
  attends, as multi-query attention with ONE kv head, over keys [c | k_rope]; the values are the same
  vectors (their first kv_lora_rank numbers are c; the rest of the output is dropped). A cache therefore
  holds kv_lora_rank + head_dim numbers a token a layer (576 for DeepSeek-V3, against 2 x 128 heads x 192
  expanded), in the pool's key array (`cfg.cache_head_dim`, one kv head). Decode reads only that.

Both are the same math; they differ by fp32 rounding (the sum orders differ), as the attention kernels of a
decode and a training forward do. Batch-invariant mode (models/invariant.py) runs the absorbed form in
every path so that a token's numbers are the same bits wherever it is computed.

The attention kernels scale scores by (their head dim)^-0.5; the query is multiplied beforehand so the
product is `mla_softmax_scale`. Values narrower than the keys (expanded: v_head_dim < nope + rope) are
zero-padded to the keys' width and the output's extra columns dropped, so every kernel (dense, blockwise,
context-parallel, paged, Pallas) serves MLA unchanged.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.blocks import LayerAttention, apply_rope, batch_rows, project, rms_norm
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.config_deepseek import mla_softmax_scale
from jaxrl_llm.models.numerics import matmul_f32

Array = jax.Array


def deinterleave(x: Array) -> Array:
    """Rope dims stored as (even, odd) pairs -> [evens | odds], the rotate-half layout `apply_rope` turns
    (transformers' `apply_rotary_pos_emb_interleave` gives the same numbers in that layout)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _scaled(x: Array, factor: float) -> Array:
    return x if abs(factor - 1.0) < 1e-12 else x * factor


def mla_attention_block(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, cos: Array, sin: Array,
                        attention: LayerAttention, state: ArrayTree, layer: Array, *, dtype: DType, lora_scale: float,
                        split_rows: bool = False) -> tuple[Array, Any]:
    """fp32 [B, T, H] output of the MLA sublayer for normed x [B, T, H] (compute dtype) and the attention's new
    state; `attention` is the path's (a cache's holds one kv head of `cfg.cache_head_dim`)."""
    nope, r, eps = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
    x = batch_rows(x, split_rows)

    def proj(name: str, inp: Array) -> Array:  # fp32
        return project(inp, weights[name], adapters.get(name), lora_scale, dtype)

    if cfg.q_lora_rank:
        q = proj("q_b_proj", rms_norm(proj("q_a_proj", x), weights["q_a_norm"]["scale"], eps, dtype))
    else:
        q = proj("q_proj", x)  # fp32 [B, T, heads, nope + rope]
    q = batch_rows(q, split_rows, "act_heads")
    compressed = proj("kv_a_proj_with_mqa", x)  # fp32 [B, T, kv_lora + rope]
    latent = rms_norm(compressed[..., :r], weights["kv_a_norm"]["scale"], eps, dtype)  # [B, T, kv_lora]
    q_rope, k_rope = q[..., nope:], compressed[..., None, r:]  # [B, T, heads | 1, rope]
    if cfg.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
    scale = mla_softmax_scale(cfg)
    if state is None and not invariant.enabled():
        out, state = _expanded(cfg, weights, adapters, q[..., :nope], q_rope, latent, k_rope, attention, layer,
                               scale, dtype=dtype, lora_scale=lora_scale, split_rows=split_rows)
    else:
        out, state = _absorbed(cfg, weights, adapters, q[..., :nope], q_rope, latent, k_rope, attention, state,
                               layer, scale, dtype=dtype, lora_scale=lora_scale)
    return project(out.astype(dtype), weights["o_proj"], adapters.get("o_proj"), lora_scale, dtype, in_axes=2), state


def _expanded(cfg: ModelConfig, weights: dict, adapters: dict, q_nope: Array, q_rope: Array, latent: Array,
              k_rope: Array, attention: LayerAttention, layer: Array, scale: float, *, dtype: DType,
              lora_scale: float, split_rows: bool) -> tuple[Array, Any]:
    """Per-head keys and values (no cache): out [B, T, heads, v_head_dim]."""
    nope, vd = cfg.qk_nope_head_dim, cfg.v_head_dim
    kv = project(latent, weights["kv_b_proj"], adapters.get("kv_b_proj"), lora_scale, dtype)  # [B, T, heads, nope+v]
    kv = batch_rows(kv, split_rows, "act_heads")
    q = jnp.concatenate([q_nope, q_rope.astype(jnp.float32)], axis=-1)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope.astype(jnp.float32), (*kv.shape[:3], cfg.head_dim))],
                        axis=-1)
    v = kv[..., nope:]
    width = max(q.shape[-1], vd)
    pad = [(0, 0)] * 3

    def widen(a: Array) -> Array:
        return a if a.shape[-1] == width else jnp.pad(a, pad + [(0, width - a.shape[-1])])

    q = _scaled(widen(q), scale * math.sqrt(width))
    out, state = attention(q.astype(dtype), widen(k).astype(dtype), widen(v).astype(dtype), None, layer, None)
    return out.reshape(*q.shape[:3], width)[..., :vd], state


def _absorbed(cfg: ModelConfig, weights: dict, adapters: dict, q_nope: Array, q_rope: Array, latent: Array,
              k_rope: Array, attention: LayerAttention, state: ArrayTree, layer: Array, scale: float, *,
              dtype: DType, lora_scale: float) -> tuple[Array, Any]:
    """Queries absorbed into the latent, one kv head [c | k_rope] as keys and values: out [B, T, heads, v]."""
    b, t, nh, nope = q_nope.shape
    r = cfg.kv_lora_rank
    w = kv_b_matrix(weights["kv_b_proj"], adapters.get("kv_b_proj"), lora_scale, dtype)  # [kv_lora, heads, nope + v]
    w_uk, w_uv = w[..., :nope], w[..., nope:]
    # q_nope [B, T, h, n] . W_uk [r, h, n] over n, per head: one batched matmul over the heads
    q_latent = jnp.einsum("bthn,rhn->bthr", q_nope.astype(dtype), w_uk, preferred_element_type=jnp.float32)
    q = jnp.concatenate([q_latent, q_rope.astype(jnp.float32)], axis=-1)
    q = _scaled(q, scale * math.sqrt(r + cfg.head_dim)).astype(dtype)
    key = jnp.concatenate([latent, k_rope.astype(dtype)[:, :, 0]], axis=-1)[:, :, None]  # [B, T, 1, kv_lora + rope]
    out, state = attention(q, key, key, state, layer, None)
    out = out.reshape(b, t, nh, r + cfg.head_dim)[..., :r].astype(dtype)
    return jnp.einsum("bthr,rhv->bthv", out, w_uv, preferred_element_type=jnp.float32), state


def kv_b_matrix(weights: dict, adapter: dict | None, lora_scale: float, dtype: DType) -> Array:
    """kv_b_proj's [kv_lora, heads, nope + v] kernel in the compute dtype, with a LoRA adapter's delta merged
    (the absorbed form multiplies by the matrix, not a row of activations)."""
    kernel = weights["kernel"]
    if adapter is None or not lora_scale:
        return kernel.astype(dtype)
    a, b_ = adapter["A"], adapter["B"]  # [kv_lora, rank], [rank, heads, nope + v]
    delta = matmul_f32(a.astype(dtype), b_.reshape(b_.shape[0], -1).astype(dtype)).reshape(kernel.shape)
    return (kernel.astype(jnp.float32) + lora_scale * delta).astype(dtype)

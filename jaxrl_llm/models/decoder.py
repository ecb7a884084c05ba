"""The decoder backbone as flax linen modules: embedding -> scanned layers -> final RMSNorm.

One implementation for Llama / Mistral / Qwen2 / Qwen3 (differences are `ModelConfig` flags:
q/k/v bias, per-head q/k RMSNorm, sliding window). Layers run under `nn.scan`, so their params
carry a leading layer axis and compile time does not grow with depth; `remat` (a policy name of
jaxrl_llm/models/remat.py, or a bool) wraps each layer in `nn.remat` with that policy. Params are
kept in their own dtype (fp32 master); matmuls run in `compute_dtype`; norms, softmax and RoPE
angles are computed in fp32. LoRA adapters (models/lora.py), when given, are scanned with the
layers and add `scale * (x @ A) @ B` to each targeted projection's output.

Numerics (rollout/trainer agreement: `jaxrl_llm.models.numerics`, docs/performance.md): every
matmul takes compute-dtype operands and accumulates AND returns fp32; the fp32 result is rounded to
the compute dtype once, where the next matmul consumes it (bias add, q/k norm, RoPE and the SiLU
gate run in fp32 before that rounding); the residual stream between layers is fp32 (the
embedding rows rounded to the compute dtype, then fp32 sums). Attention: fp32 scores, fp32 softmax
with a finite mask value, fp32 probabilities times V (`probs_times_values`; the core with its
hand-written backward and causal query chunks is `jaxrl_llm.models.attention`). In bf16 this is more
accurate (half the log-prob error against fp32 on SmolLM2) and keeps a token's numbers
independent of how many tokens share a matmul (a decode step, a prefill, the trainer's full
sequence) wherever the matmul kernels are row-independent. In fp32 nothing changes.

Matmuls run on [tokens, features] (the [B, T] axes flattened): XLA:CPU turned the weight gradient
of a [B, T, H] x [H, F] matmul (a contraction over two axes) into a transposing copy of the
[B, T, F] gradient that ran at a few GB/s; flattened, the backward of SmolLM2's MLP stack runs
~1.8x faster (tests pin the numbers, not the layout). The per-head q/k/v/o projections keep
DenseGeneral's 3-D kernels as params but multiply them as 2-D matrices (`FlatDense`) for the same
reason.

Masking is by slot: a query at slot `q` sees key slot `s` iff `s <= q`, the key slot is valid (its
attention-mask bit is 1) and, with a sliding window W, `q - s < W`. Without a cache the slots are
the sequence indices; with a cache they are cache indices (see `jaxrl_llm.models.cache`).
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models.attention import attend
from jaxrl_llm.models.config import ModelConfig, rope_inv_freq
from jaxrl_llm.models.lora import lora_delta
from jaxrl_llm.models.numerics import dot_general_f32
from jaxrl_llm.models.remat import checkpoint_policy, remat_name

Array = jax.Array


class RMSNorm(nn.Module):
    eps: float
    compute_dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.compute_dtype)


def rope_cos_sin(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos/sin tables [B, T, head_dim] (fp32) for integer positions [B, T] (HF rotate-half layout)."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x: [B, T, heads, D]; cos/sin: [B, T, D]."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def _plus(y: Array, delta: Array | None) -> Array:
    return y if delta is None else y + delta


class FlatDense(nn.Module):
    """`nn.DenseGeneral`'s params (kernel [*in, *features] with the same initial values, bias
    [*features]) computed as one 2-D matmul: x [tokens, *in] -> fp32 [tokens, *features].

    Why not DenseGeneral: with a 3-D kernel (the per-head q/k/v/o projections) the weight
    gradient contracts tokens against a 3-D cotangent, and XLA:CPU fed it a transposed
    [features, tokens] copy fused with RoPE's backward that ran at well under 1 GB/s (~0.5 s of a
    SmolLM2 4 x 512 forward+backward); as a 2-D matmul the reshapes are free bitcasts."""

    features: tuple[int, ...]
    use_bias: bool
    compute_dtype: Any
    param_dtype: Any
    kernel_init: Any
    in_axes: int = 1  # trailing axes of x that are contracted

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape = x.shape[x.ndim - self.in_axes:]
        n_in, n_out = math.prod(in_shape), math.prod(self.features)
        kernel = self.param("kernel", lambda rng, shape, dtype: self.kernel_init(rng, (n_in, n_out), dtype)
                            .reshape(shape), in_shape + self.features, self.param_dtype)
        lead = x.shape[:x.ndim - self.in_axes]
        y = dot_general_f32(x.reshape(-1, n_in).astype(self.compute_dtype),
                            kernel.reshape(n_in, n_out).astype(self.compute_dtype), (((1,), (0,)), ((), ())))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, self.features, self.param_dtype)
            y = y + bias.reshape(n_out).astype(self.compute_dtype)
        return y.reshape(*lead, *self.features)


class Attention(nn.Module):
    cfg: ModelConfig
    compute_dtype: Any
    param_dtype: Any
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x, cos, sin, allowed, write_index, layer_index, k_cache, v_cache, lora=None):
        cfg = self.cfg
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        init = nn.initializers.normal(cfg.initializer_range)

        lora = lora or {}
        b, t = x.shape[:2]
        tokens = x.reshape(b * t, x.shape[-1])  # [tokens, H]: 2-D matmuls (module docstring)

        def proj(name: str, heads: int) -> Array:  # fp32 [B, T, heads, D] (bias added in fp32)
            y = FlatDense((heads, hd), cfg.attention_bias, self.compute_dtype, self.param_dtype, init,
                          name=name)(tokens)
            y = _plus(y, lora_delta(tokens, lora.get(name), self.lora_scale, self.compute_dtype))
            return y.reshape(b, t, heads, hd)

        q, k, v = proj("q_proj", nh), proj("k_proj", nkv), proj("v_proj", nkv)
        if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim, per head, before RoPE (kept fp32 until after RoPE)
            q = RMSNorm(cfg.rms_norm_eps, jnp.float32, self.param_dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, jnp.float32, self.param_dtype, name="k_norm")(k)
        # one rounding to the compute dtype; the K/V cache stores exactly these values
        q = apply_rope(q, cos, sin).astype(self.compute_dtype)
        k = apply_rope(k, cos, sin).astype(self.compute_dtype)
        v = v.astype(self.compute_dtype)

        # head-major [B, kv, S, D]: the layout both attention matmuls read without a transposed copy
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if k_cache is not None:  # write this chunk at [layer, :, :, write_index], attend over all slots
            start = (layer_index, 0, 0, write_index, 0)
            k_cache = lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), start)
            v_cache = lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), start)
            k = lax.dynamic_index_in_dim(k_cache, layer_index, 0, keepdims=False)
            v = lax.dynamic_index_in_dim(v_cache, layer_index, 0, keepdims=False)
            k, v = k.astype(self.compute_dtype), v.astype(self.compute_dtype)

        # without a cache the mask is causal over the sequence itself (models/attention.py chunks)
        out = attend(q, k, v, allowed, nkv, causal=k_cache is None)  # [B * T, heads, D] fp32
        out = out.astype(self.compute_dtype)
        o = FlatDense((cfg.hidden_size,), False, self.compute_dtype, self.param_dtype, init, in_axes=2,
                      name="o_proj")(out)
        o = _plus(o, lora_delta(out, lora.get("o_proj"), self.lora_scale, self.compute_dtype))
        return o.reshape(b, t, -1), k_cache, v_cache  # o: fp32 [B, T, H]


class MLP(nn.Module):
    cfg: ModelConfig
    compute_dtype: Any
    param_dtype: Any
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: Array, lora: dict | None = None) -> Array:
        cfg, lora = self.cfg, lora or {}

        def dense(n: int, name: str, h: Array) -> Array:  # fp32 results, see the module docstring
            y = nn.Dense(n, use_bias=False, dtype=self.compute_dtype, param_dtype=self.param_dtype,
                         kernel_init=nn.initializers.normal(cfg.initializer_range), dot_general=dot_general_f32,
                         name=name)(h)
            return _plus(y, lora_delta(h, lora.get(name), self.lora_scale, self.compute_dtype))

        tokens = x.reshape(-1, x.shape[-1])  # [tokens, H]: 2-D matmuls (module docstring)
        gate = dense(cfg.intermediate_size, "gate_proj", tokens)
        up = dense(cfg.intermediate_size, "up_proj", tokens)
        act = (jax.nn.silu(gate) * up).astype(self.compute_dtype)
        return dense(cfg.hidden_size, "down_proj", act).reshape(*x.shape[:-1], -1)  # fp32 [..., H]


class DecoderLayer(nn.Module):
    """One pre-norm block. Scan signature: (carry, *broadcast) -> (carry, None)."""

    cfg: ModelConfig
    compute_dtype: Any
    param_dtype: Any
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, carry, cos, sin, allowed, write_index, lora=None):
        x, k_cache, v_cache, layer_index = carry
        lora = lora or {}
        norm = lambda name: RMSNorm(self.cfg.rms_norm_eps, self.compute_dtype,  # noqa: E731
                                    self.param_dtype, name=name)
        h, k_cache, v_cache = Attention(self.cfg, self.compute_dtype, self.param_dtype, self.lora_scale, name="attn")(
            norm("attn_norm")(x), cos, sin, allowed, write_index, layer_index, k_cache, v_cache, lora.get("attn"))
        # the residual stream x is fp32 (h and the MLP output are fp32): no rounding of the sum
        x = x + h
        x = x + MLP(self.cfg, self.compute_dtype, self.param_dtype, self.lora_scale, name="mlp")(
            norm("mlp_norm")(x), lora.get("mlp"))
        return (x, k_cache, v_cache, layer_index + 1), None


class Decoder(nn.Module):
    """Embedding + scanned layers + final norm. Returns (hidden [B,T,H], k_cache, v_cache)."""

    cfg: ModelConfig
    compute_dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool | str = False  # a policy name of models/remat.py (True = full, False = none)
    lora_scale: float = 0.0  # alpha / rank of the adapters given to __call__ (models/lora.py)

    @nn.compact
    def __call__(self, input_ids, positions, allowed, write_index=0, k_cache=None, v_cache=None, lora=None):
        cfg = self.cfg
        embed = self.param("embedding", nn.initializers.normal(cfg.initializer_range),
                           (cfg.vocab_size, cfg.hidden_size), self.param_dtype)
        # the embedding rows in the compute dtype, carried as an fp32 residual stream
        x = jnp.take(embed, input_ids, axis=0).astype(self.compute_dtype).astype(jnp.float32)
        cos, sin = rope_cos_sin(cfg, positions)
        policy = remat_name(self.remat)
        layer = DecoderLayer
        if policy != "none":  # prevent_cse=False: the layers run under scan, which already keeps them apart
            layer = nn.remat(DecoderLayer, prevent_cse=False, policy=checkpoint_policy(policy))
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,) * 4 + (0,), length=cfg.num_hidden_layers,
                        unroll=cfg.scan_unroll)
        carry = (x, k_cache, v_cache, jnp.int32(0))
        (x, k_cache, v_cache, _), _ = stack(cfg, self.compute_dtype, self.param_dtype, self.lora_scale,
                                            name="layers")(carry, cos, sin, allowed, write_index, lora)
        x = RMSNorm(cfg.rms_norm_eps, self.compute_dtype, self.param_dtype, name="final_norm")(x)
        return x, k_cache, v_cache

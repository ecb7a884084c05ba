"""One decode token per slot through the decoder, reading and writing a paged KV pool.

A pure function over the policy's own params dict (the layout of jaxrl_llm/models/model.py), so
the engine needs no second copy of the weights. It repeats the math of
jaxrl_llm/models/decoder.py for T = 1 (same dtype casts: matmuls in the compute dtype, norms /
RoPE in fp32), with attention replaced by `paged_decode_attention`; tests check that its logits
equal the dense model's (tests/sampler/test_engine_core.py).

KV pool layout (a dict pytree, carried through the decode loop and updated in place):

    k, v        [L, kv_heads, num_pages, page_size, head_dim]   compute dtype, or int8
    k_scale, v_scale [L, kv_heads, num_pages, page_size] fp32    (int8 only: value = int8 * scale)

Page 0 is a scratch page no request owns: empty slots write their (ignored) token there.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models import ModelConfig, logits_from_hidden
from jaxrl_llm.models.config import rope_inv_freq
from jaxrl_llm.models.lora import lora_delta
from jaxrl_llm.sampler.paged_attention import paged_decode_attention
from jaxrl_llm.sampler.kv_bits import to_storage

Array = jax.Array


def rms_norm(x: Array, scale: Array, eps: float, dtype: Any) -> Array:
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(dtype)


def rope(x: Array, positions: Array, cfg: ModelConfig) -> Array:
    """x [S, heads, D] rotated at integer positions [S] (HF rotate-half layout, fp32 angles)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def quantize_int8(x: Array) -> tuple[Array, Array]:
    """Per-vector symmetric int8 over the last axis: (int8 values, fp32 scales [...])."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    q = jnp.round(x32 / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def write_tokens(pool: dict, layer: Array, k: Array, v: Array, pages: Array, offsets: Array) -> dict:
    """Writes k / v [N, kv_heads, D] of N tokens at (pages[N], offsets[N]) of one layer."""
    out = dict(pool)
    for name, x in (("k", k), ("v", v)):
        if f"{name}_scale" in pool:
            x, scale = quantize_int8(x)
            # mixed advanced indices separated by a slice: the indexed dims come first -> [N, kv]
            out[f"{name}_scale"] = pool[f"{name}_scale"].at[layer, :, pages, offsets].set(scale)
        out[name] = pool[name].at[layer, :, pages, offsets].set(to_storage(x, pool[name].dtype))
    return out


def _dense(x: Array, kernel: Array, dtype: Any, spec: str) -> Array:
    return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype))


def decode_hidden(params: dict, cfg: ModelConfig, pool: dict, tokens: Array, positions: Array,
                  page_table: Array, active: Array, *, compute_dtype: Any, attn_impl: str = "auto",
                  mesh: Any = None) -> tuple[Array, dict]:
    """Final-norm hidden [S, H] for one token per slot, and the pool with their K/V written.

    tokens / positions [S]: the token fed to each slot and its position (= tokens already in the
    slot's KV). page_table [S, pages_per_slot]. active [S] bool: inactive slots write to the
    scratch page and attend to nothing.
    """
    dt = compute_dtype
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ps = pool["k"].shape[3]
    page = jnp.take_along_axis(page_table, (positions // ps)[:, None], axis=1)[:, 0]
    page = jnp.where(active, page, 0)
    offset = jnp.where(active, positions % ps, 0)
    lengths = jnp.where(active, positions + 1, 0)
    x = jnp.take(params["embedding"], tokens, axis=0).astype(dt)
    # LoRA (models/lora.py): the adapters apply inside each targeted projection, as in training
    adapters = params.get("lora")
    lora_layers = {} if adapters is None else adapters.weights["layers"]
    lora_scale = 0.0 if adapters is None else adapters.scale

    def layer(carry, xs):
        x, pool, i = carry
        lp, ad = xs
        a = lp["attn"]

        def proj(h: Array, group: str, name: str, spec: str) -> Array:
            y = _dense(h, lp[group][name]["kernel"], dt, spec)
            delta = lora_delta(h, ad.get(group, {}).get(name), lora_scale, dt)
            return y if delta is None else y + delta

        h = rms_norm(x, lp["attn_norm"]["scale"], cfg.rms_norm_eps, dt)
        q = proj(h, "attn", "q_proj", "sh,hnd->snd")
        k = proj(h, "attn", "k_proj", "sh,hnd->snd")
        v = proj(h, "attn", "v_proj", "sh,hnd->snd")
        if cfg.attention_bias:
            q, k, v = (y + a[f"{n}_proj"]["bias"].astype(dt) for y, n in ((q, "q"), (k, "k"), (v, "v")))
        if cfg.qk_norm:
            q = rms_norm(q, a["q_norm"]["scale"], cfg.rms_norm_eps, dt)
            k = rms_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps, dt)
        q, k = rope(q, positions, cfg), rope(k, positions, cfg)
        pool = write_tokens(pool, i, k, v, page, offset)
        attn = paged_decode_attention(q, pool["k"], pool["v"], lengths, page_table, layer=i,
                                      sliding_window=cfg.sliding_window, impl=attn_impl, mesh=mesh,
                                      k_scales=pool.get("k_scale"), v_scales=pool.get("v_scale"))
        x = x + proj(attn.astype(dt), "attn", "o_proj", "snd,ndh->sh")
        h = rms_norm(x, lp["mlp_norm"]["scale"], cfg.rms_norm_eps, dt)
        gate = proj(h, "mlp", "gate_proj", "sh,hf->sf")
        up = proj(h, "mlp", "up_proj", "sh,hf->sf")
        x = x + proj(jax.nn.silu(gate) * up, "mlp", "down_proj", "sf,fh->sh")
        return (x, pool, i + 1), None

    (x, pool, _), _ = lax.scan(layer, (x, pool, jnp.int32(0)), (params["layers"], lora_layers))
    del nh, nkv, hd
    return rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, dt), pool


def decode_logits(params: dict, cfg: ModelConfig, pool: dict, tokens: Array, positions: Array,
                  page_table: Array, active: Array, *, compute_dtype: Any, attn_impl: str = "auto",
                  mesh: Any = None) -> tuple[Array, dict]:
    """fp32 next-token logits [S, V] and the updated pool (see `decode_hidden`)."""
    hidden, pool = decode_hidden(params, cfg, pool, tokens, positions, page_table, active,
                                 compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh)
    return logits_from_hidden(params, cfg, hidden), pool

"""Qwen3.5's hybrid decoder: gated delta-net linear attention (`cfg.linear_layers`) between gated full-attention
layers, as pure functions over the params dict (layout: models/param_init.py `_HybridStack`; the decoder calls
`hybrid_decoder_hidden` in place of its own layer scan).

Each layer is pre-norm with (1 + w) RMSNorms and a SwiGLU MLP, like Qwen3; its mixer is one of:

- gated full attention (`gated_attention`): q_proj gives a query and an output gate per head; q / k RMS-normed per
  head, RoPE on the first `rotary_dim` dims of each head (rotate-half within them); the attention output times
  sigmoid(gate) before o_proj. The attention itself is the path's `LayerAttention` (models/blocks.py).
- the gated delta net (`delta_net`): one fused projection to q / k / v, a causal depthwise conv of
  `linear_conv_kernel` taps over them (SiLU), q / k L2-normalised and repeated from the key heads to the value
  heads, the gated delta rule (models/delta_rule.py, chunked) with beta = sigmoid(b) and
  g = -exp(A_log) softplus(a + dt_bias), then an RMSNorm of each head's output times SiLU(z) and out_proj.

The two kinds' weights are stacked over their own layers; the layer scan stays one loop and each layer runs its
kind with `lax.cond`, reading its row of that kind's stack.

Rows: padding tokens are zeroed before the delta net reads them (as transformers does), so a left-padded row
equals the same row alone. Packed rows (several sequences in one row) restart the state and the conv window at
each sequence's first token: a token's conv tap d tokens back is read only when the token's position is >= d,
and the delta rule restarts where the position is 0 (positions restart per sequence, `attention_context`). A
prompt followed by ONE response (branch 1 of `branch_ids`, what SFT / DPO packing lays out) is one sequence to the
delta net; a prompt shared by several responses (the RL update's prompt sharing) is not supported: the second
response would read the first one's state (RL is refused for these models anyway, below).

Sampling is not built yet: a cache (the static sampler's, the paged engine's) would have to hold each slot's
conv window and delta-rule state beside the attention layers' KV, and the engines do not (issue #64);
`hybrid_decoder_hidden` refuses a state, so a Qwen3.5 model trains and scores (SFT, DPO, the trainer's forward
passes) but does not generate.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models.blocks import (
    LayerAttention,
    apply_rope,
    embed_tokens,
    mlp_block,
    project,
    rms_norm,
    rope_cos_sin,
    take_row,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.delta_rule import chunked_delta_rule, l2_normalize
from jaxrl_llm.models.param_init import hybrid_layer_ids
from jaxrl_llm.models.remat import checkpoint_policy, remat_name

Array = jax.Array
DELTA_CHUNK = 64  # tokens per chunk of the gated delta rule (transformers' and fla's default)


class HybridSamplingError(NotImplementedError):
    """A hybrid (Qwen3.5) model was asked to decode with a cache."""


def gated_attention(cfg: ModelConfig, weights: dict, x: Array, cos: Array, sin: Array, attention: LayerAttention,
                    layer: Array, *, dtype: DType) -> Array:
    """fp32 [B, T, H] output of a full-attention layer for normed x [B, T, H] (compute dtype)."""
    b, t, _ = x.shape
    hd, rd, eps = cfg.head_dim, cfg.rotary_dim, cfg.rms_norm_eps
    q = project(x, weights["q_proj"], None, 0.0, dtype)  # [B, T, heads, 2 x head_dim]: query, gate
    gate = q[..., hd:] if cfg.attention_output_gate else None
    q = rms_norm(q[..., :hd], weights["q_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    k = rms_norm(project(x, weights["k_proj"], None, 0.0, dtype), weights["k_norm"]["scale"], eps, jnp.float32,
                 cfg.norm_offset)
    v = project(x, weights["v_proj"], None, 0.0, dtype)

    def rope(a: Array) -> Array:
        return jnp.concatenate([apply_rope(a[..., :rd], cos, sin), a[..., rd:]], axis=-1)

    out, _ = attention(rope(q).astype(dtype), rope(k).astype(dtype), v.astype(dtype), None, layer, None)
    out = out.reshape(b, t, -1, hd).astype(jnp.float32)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return project(out.astype(dtype), weights["o_proj"], None, 0.0, dtype, in_axes=2)


def causal_conv(x: Array, kernel: Array, positions: Array) -> Array:
    """Causal depthwise conv of x [B, T, C] with taps kernel [K, C] (the last tap on the token itself), reading a
    tap d tokens back only where the token's position is >= d (a packed row's sequences do not see each other)."""
    taps = kernel.shape[0]
    out = jnp.zeros(x.shape, jnp.float32)
    for d in range(taps):
        back = jnp.pad(x, [(0, 0), (d, 0), (0, 0)])[:, :x.shape[1]] if d else x
        seen = (positions >= d)[..., None]
        out = out + jnp.where(seen, back, 0.0) * kernel[taps - 1 - d].astype(jnp.float32)
    return out


def delta_net(cfg: ModelConfig, weights: dict, x: Array, valid: Array, positions: Array, *, dtype: DType) -> Array:
    """fp32 [B, T, H] output of a gated delta-net layer for normed x [B, T, H] (compute dtype); valid [B, T]: the
    real tokens, positions [B, T]: where each sequence starts (module doc)."""
    b, t, _ = x.shape
    hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))  # padding reads as nothing
    mixed = causal_conv(project(x, weights["in_proj_qkv"], None, 0.0, dtype), weights["conv1d"]["kernel"], positions)
    mixed = jax.nn.silu(mixed)
    q = mixed[..., :hk * dk].reshape(b, t, hk, dk)
    k = mixed[..., hk * dk:2 * hk * dk].reshape(b, t, hk, dk)
    v = mixed[..., 2 * hk * dk:].reshape(b, t, hv, dv)
    q, k = (l2_normalize(jnp.repeat(a, hv // hk, axis=2)) for a in (q, k))  # key head i // (hv / hk) per value head
    beta = jax.nn.sigmoid(project(x, weights["in_proj_b"], None, 0.0, dtype))
    a = project(x, weights["in_proj_a"], None, 0.0, dtype) + weights["dt_bias"].astype(jnp.float32)
    g = -jnp.exp(weights["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)
    out, _ = chunked_delta_rule(q, k, v, g, beta, starts=positions == 0, chunk=DELTA_CHUNK)
    z = project(x, weights["in_proj_z"], None, 0.0, dtype)  # [B, T, value heads, Dv]
    normed = rms_norm(out, weights["norm"]["scale"], cfg.rms_norm_eps, jnp.float32) * jax.nn.silu(z)
    return project(normed.astype(dtype), weights["out_proj"], None, 0.0, dtype, in_axes=2)


def hybrid_decoder_hidden(params: dict, cfg: ModelConfig, input_ids: Array, positions: Array,
                          attention: LayerAttention, state: ArrayTree, *, dtype: DType, remat: bool | str,
                          valid: Array | None) -> tuple[Array, Any, None]:
    """`decoder_hidden` of a Qwen3.5 model: hidden states after the final norm [B, T, H] (compute dtype)."""
    if state is not None:
        raise HybridSamplingError(
            f"{cfg.architecture}: decoding with a cache needs each slot's gated delta-net state (conv window and "
            "delta-rule state) beside the attention layers' KV, which the samplers do not hold yet; this model "
            "trains and scores (SFT, DPO, log-prob passes) but cannot generate rollouts")
    if params.get("lora") is not None:
        raise ValueError(f"{cfg.architecture}: LoRA adapters on the hybrid layers are not supported yet")
    valid = jnp.ones(input_ids.shape, bool) if valid is None else valid
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    x, _ = embed_tokens(params, cfg, input_ids, dtype)
    cos, sin = rope_cos_sin(cfg, positions)
    kinds = hybrid_layer_ids(cfg)
    stacks = {kind: params["layers"][kind] for kind in kinds}
    layers = {k: v for k, v in params["layers"].items() if k not in kinds}
    is_linear = np.isin(np.arange(cfg.num_hidden_layers), cfg.linear_layers)
    row = np.zeros(cfg.num_hidden_layers, np.int32)  # each layer's row in its kind's stack
    for ids in kinds.values():
        row[list(ids)] = np.arange(len(ids))

    def layer(carry: tuple[Array, Array], weights: dict) -> tuple[tuple[Array, Array], None]:
        x, index = carry
        normed = rms_norm(x, weights["attn_norm"]["scale"], eps, dtype, offset)

        def full(n: Array) -> Array:
            return gated_attention(cfg, take_row(stacks["attn"], jnp.asarray(row)[index]), n, cos, sin, attention,
                                   index, dtype=dtype)

        def linear(n: Array) -> Array:
            return delta_net(cfg, take_row(stacks["linear"], jnp.asarray(row)[index]), n, valid, positions,
                             dtype=dtype)

        if len(kinds) == 2:
            h = lax.cond(jnp.asarray(is_linear)[index], linear, full, normed)
        else:
            h = (linear if "linear" in kinds else full)(normed)
        x = x + h
        normed = rms_norm(x, weights["mlp_norm"]["scale"], eps, dtype, offset)
        x = x + mlp_block(weights["mlp"], {}, normed, dtype=dtype, lora_scale=0.0, activation=cfg.hidden_act)
        return (x, index + 1), None

    step: Callable = layer
    if remat_name(remat) != "none":
        step = jax.checkpoint(layer, prevent_cse=False, policy=checkpoint_policy(remat))
    (x, _), _ = lax.scan(step, (x, jnp.int32(0)), layers, unroll=cfg.scan_unroll)
    return rms_norm(x, params["final_norm"]["scale"], eps, dtype, offset), None, None

"""Gemma 4's decoder (`cfg.typed_layers`): the layers of one model differ in shape, so their attention and
MLP weights are stacked per kind (layout: models/param_init.py) and each step of the one layer scan takes
its rows of the kinds it is (`lax.switch` / `lax.cond`; compile time does not grow with depth).

What Gemma 4 adds to Gemma 3's layer (transformers' `Gemma4TextDecoderLayer` is the reference):
- **Two attention types with their own shapes.** Sliding layers: `head_dim`, `num_key_value_heads`, RoPE
  base `rope_local_theta`; full layers: `full_head_dim`, `full_kv_heads` and "proportional" RoPE (only the
  first `rope_partial_factor` of a head's dims turn; the rest see frequency 0). Each type has its own KV
  cache (state `{"sliding": ..., "full": ...}`) and its own `LayerAttention` (its mask and kv heads).
- **Unscaled attention of normed q, k, v.** q and k are RMS-normed per head with a scale, v without one;
  scores are q . k (scaling 1.0): the queries are multiplied by sqrt(head dim) because every attention
  kernel applies head_dim^-0.5.
- **k = v** (`attention_k_eq_v`, full layers): the keys' projection, before its norm and RoPE, is the values'.
- **Shared KV** (`kv_shared_layers`): the last layers compute no keys or values; they attend with those of
  the last earlier layer of their type (its cache row, `cfg.kv_rows`). The scan carries the producers'
  k / v of the current tokens (`produced`); a sharing layer hands them to its attention with the producer's
  cache row, so a cache write rewrites the same values and the attention reads the producer's whole row.
  The caches and pools hold the producing layers only.
- **Per-layer inputs** (`per_layer_input_size` P): a second embedding [V_ple, L * P] and a projection of
  the embedded tokens give each layer a [B, T, P] input; after the MLP each layer adds
  norm(proj(gelu(gate(x)) * input)) to the residual stream.
- **A learned scalar per layer** multiplies the layer's output, and an MLP twice as wide on the sharing
  layers (`double_wide_mlp`).
- **The MoE block** (`enable_moe_block`, gemma-4-26B-A4B): routed GeGLU experts beside every layer's dense
  MLP, reading the same residual stream through norms of their own (`moe_beside_mlp`); the two outputs are
  summed before the layer's post-MLP norm. Router stats, routing replay and expert parallelism are the
  other MoE families' (models/moe.py, models/expert_parallel.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models.activations import gated_product
from jaxrl_llm.models.blocks import (
    LayerAttention,
    apply_rope,
    batch_rows,
    embed_tokens,
    image_rows,
    mlp_block,
    project,
    rms_norm,
    rope_cos_sin,
    take_row,
)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.expert_parallel import routed_experts
from jaxrl_llm.models.lora import LoraAdapters
from jaxrl_llm.models.moe import MoeOut, RouterStats, route, router_stats
from jaxrl_llm.models.numerics import matmul_f32
from jaxrl_llm.models.param_init import typed_layer_ids
from jaxrl_llm.models.remat import scan_layers
from jaxrl_llm.sharding.mesh import context_parallel_size
from jaxrl_llm.sharding.rules import with_activation_constraint

Array = jax.Array
TYPES = ("sliding", "full")


class TypedStacks(NamedTuple):
    """The per-kind weight stacks (kind -> params / adapters stacked over that kind's layers) and each
    layer's row in every kind [L] int32 (0 where the layer is not of that kind)."""

    params: dict
    adapters: dict
    rows: dict


def typed_stacks(cfg: ModelConfig, layers: dict, lora_layers: dict) -> tuple[dict, dict, TypedStacks]:
    """(the params and adapters the layer scan steps through, and the per-kind stacks)."""
    kinds = typed_layer_ids(cfg)
    rows = {}
    for kind, ids in kinds.items():
        row = np.zeros(cfg.num_hidden_layers, np.int32)
        row[list(ids)] = np.arange(len(ids))
        rows[kind] = jnp.asarray(row)
    stacks = TypedStacks({k: layers[k] for k in kinds}, {k: lora_layers[k] for k in kinds if k in lora_layers}, rows)
    return ({k: v for k, v in layers.items() if k not in kinds},
            {k: v for k, v in lora_layers.items() if k not in kinds}, stacks)


def full_rope_cos_sin(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """The full layers' cos / sin tables [B, T, full_head_dim]: "proportional" RoPE, whose first
    rope_partial_factor x D / 2 frequencies are theta^(-2i / D) over the whole head dim D and the rest 0
    (those dims pass unrotated), divided by a linear factor where the config has one (transformers'
    `_compute_proportional_rope_parameters`)."""
    dim = cfg.full_head_dim
    turning = int(cfg.rope_partial_factor * dim // 2)
    inv = np.zeros(dim // 2, np.float32)
    inv[:turning] = 1.0 / (cfg.rope_theta ** (np.arange(0, 2 * turning, 2, dtype=np.int64).astype(np.float32) / dim))
    inv /= np.float32(cfg.rope_scaling_dict.get("factor", 1.0))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def per_layer_inputs(params: dict, cfg: ModelConfig, input_ids: Array, embedded: Array, dtype: DType) -> Array:
    """Each layer's input [L, B, T, P] (compute dtype) from the tokens and their embedding [B, T, H]
    (compute dtype, scaled): (norm(embedded @ W / sqrt(H)) + E_ple[ids] * sqrt(P)) / sqrt(2)
    (transformers' `get_per_layer_inputs` + `project_per_layer_inputs`)."""
    b, t = input_ids.shape
    layers, p = cfg.num_hidden_layers, cfg.per_layer_input_size
    kernel = params["ple_model_proj"]["kernel"]
    projected = matmul_f32(embedded.reshape(b * t, -1), kernel.astype(dtype)) * np.float32(cfg.hidden_size ** -0.5)
    projected = rms_norm(projected.reshape(b, t, layers, p), params["ple_proj_norm"]["scale"], cfg.rms_norm_eps,
                         jnp.float32, cfg.norm_offset)
    table = jnp.take(params["ple_embedding"], input_ids, axis=0).astype(dtype)
    table = (table * jnp.asarray(np.sqrt(p), dtype)).astype(jnp.float32).reshape(b, t, layers, p)
    return ((projected + table) * np.float32(2 ** -0.5)).astype(dtype).transpose(2, 0, 1, 3)


Ropes = dict[str, tuple[Array, Array]]
Produced = dict[str, tuple[Array, Array]] | None


def typed_attention(cfg: ModelConfig, stacks: TypedStacks, x: Array, ropes: Ropes,
                    attention: dict[str, LayerAttention], state: dict | None, produced: Produced, layer: Array, *,
                    dtype: DType, lora_scale: float, split_rows: bool) -> tuple[Array, dict | None, Produced]:
    """fp32 [B, T, H] output of `layer`'s attention sublayer for normed x [B, T, H] (compute dtype), the
    new per-type state and the carried producers' k / v (module docstring)."""
    b, t, _ = x.shape
    nh, eps = cfg.num_attention_heads, cfg.rms_norm_eps
    x = batch_rows(x, split_rows)
    kv_rows = jnp.asarray(cfg.kv_rows)
    local_flags = cfg.local_layer_flags

    def branch(local: bool, own: bool) -> Callable:
        kind = "sliding" if local else "full"
        suffix = "" if local else "_full"
        hd = cfg.head_dim if local else cfg.full_head_dim
        nkv = cfg.num_key_value_heads if local else cfg.full_kv_heads

        def heads(name: str, weights: dict, adapters: dict, count: int) -> Array:  # fp32 [B, T, count, hd]
            y = project(x, weights[name], adapters.get(name), lora_scale, dtype).reshape(b, t, count, hd)
            return batch_rows(y, split_rows, "act_heads" if count == nh else "act_kv_heads")

        def run(state: dict | None, produced: Produced) -> tuple[Array, dict | None, Produced]:
            w = take_row(stacks.params["attn" + suffix], stacks.rows["attn" + suffix][layer])
            a = take_row(stacks.adapters.get("attn" + suffix, {}), stacks.rows["attn" + suffix][layer])
            cos, sin = ropes[kind]
            q = rms_norm(heads("q_proj", w, a, nh), w["q_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
            # scores are q . k unscaled: undo the kernels' head_dim^-0.5 (exact in bf16 for a power-of-4 width)
            q = (apply_rope(q, cos, sin) * np.float32(math.sqrt(hd))).astype(dtype)
            if own:
                kw = take_row(stacks.params["kv" + suffix], stacks.rows["kv" + suffix][layer])
                ka = take_row(stacks.adapters.get("kv" + suffix, {}), stacks.rows["kv" + suffix][layer])
                k_raw = heads("k_proj", kw, ka, nkv)
                v_raw = heads("v_proj", kw, ka, nkv) if "v_proj" in kw else k_raw  # attention_k_eq_v
                k = apply_rope(rms_norm(k_raw, kw["k_norm"]["scale"], eps, jnp.float32, cfg.norm_offset),
                               cos, sin).astype(dtype)
                v = rms_norm(v_raw, jnp.ones((), jnp.float32), eps, dtype)  # no scale
                if produced is not None:
                    produced = {**produced, kind: (k, v)}
            else:
                assert produced is not None
                k, v = produced[kind]
            sub = None if state is None else state[kind]
            out, sub = attention[kind](q, k, v, sub, kv_rows[layer], None)
            if state is not None:
                state = {**state, kind: sub}
            out = out.astype(dtype).reshape(b, t, nh, hd)
            return project(out, w["o_proj"], a.get("o_proj"), lora_scale, dtype, in_axes=2), state, produced

        return run

    present = sorted({(bool(local_flags[i]), i < cfg.first_shared_layer) for i in range(cfg.num_hidden_layers)},
                     reverse=True)
    branches = [branch(local, own) for local, own in present]
    if len(branches) == 1:
        return branches[0](state, produced)
    index = np.zeros(cfg.num_hidden_layers, np.int32)
    for i in range(cfg.num_hidden_layers):
        index[i] = present.index((bool(local_flags[i]), i < cfg.first_shared_layer))
    return lax.switch(jnp.asarray(index)[layer], branches, state, produced)


def typed_mlp(cfg: ModelConfig, stacks: TypedStacks, x: Array, layer: Array, *, dtype: DType, lora_scale: float,
              split_rows: bool) -> Array:
    """fp32 [B, T, H] GeGLU MLP of `layer` (its row of `mlp`, or of `mlp_wide` on a sharing layer of a
    double-wide model) for normed x [B, T, H] (compute dtype)."""
    def run(kind: str) -> Callable[[Array], Array]:
        def mlp(x: Array) -> Array:
            row = stacks.rows[kind][layer]
            return mlp_block(take_row(stacks.params[kind], row), take_row(stacks.adapters.get(kind, {}), row), x,
                             dtype=dtype, lora_scale=lora_scale, activation=cfg.hidden_act, split_rows=split_rows)
        return mlp

    if "mlp_wide" not in stacks.params:
        return run("mlp")(x)
    wide = np.arange(cfg.num_hidden_layers) >= cfg.first_shared_layer
    return lax.cond(jnp.asarray(wide)[layer], run("mlp_wide"), run("mlp"), x)


def moe_beside_mlp(cfg: ModelConfig, weights: dict, x: Array, valid: Array, replay: Array | None, *,
                   dtype: DType) -> tuple[Array, RouterStats, Array]:
    """fp32 [B, T, H] output of the MoE block of a layer on its residual stream x [B, T, H] (fp32), its
    `RouterStats` over valid [B, T] tokens and the experts each token ran [B, T, k] (`replay` [B, T, k]:
    experts to run instead). The router reads x RMS-normed without a scale, times `router_scale` and
    H^-0.5; its renormalised top-k weights are multiplied by each chosen expert's `expert_scale`; the
    experts (GeGLU) read x through the block's own norm (transformers' `Gemma4TextRouter` / `Experts`)."""
    b, t, h = x.shape
    moe, eps = weights["moe"], cfg.rms_norm_eps
    tokens = x.reshape(b * t, h)
    if context_parallel_size() > 1:  # the merged axis lost the token split: restore it
        tokens = with_activation_constraint(tokens, ("tokens", None))
    scaled = rms_norm(tokens, jnp.ones((), jnp.float32), eps, jnp.float32) * moe["router_scale"].astype(jnp.float32)
    router_in = (scaled * np.float32(h ** -0.5)).astype(dtype)
    k = cfg.num_experts_per_tok
    routing = route(cfg, moe["router"]["kernel"], router_in, None if replay is None else replay.reshape(b * t, k))
    routing = routing._replace(weights=routing.weights * moe["expert_scale"].astype(jnp.float32)[routing.ids])
    experts_in = rms_norm(tokens, weights["moe_norm"]["scale"], eps, dtype, cfg.norm_offset)
    out = routed_experts(moe["experts"], experts_in, routing, cfg, dtype=dtype)
    out = rms_norm(out, weights["moe_out_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    return out.reshape(b, t, h), router_stats(routing, valid.reshape(b * t)), routing.ids.reshape(b, t, k)


def typed_layer(cfg: ModelConfig, weights: dict, x: Array, layer_input: Array | None, ropes: Ropes,
                attention: dict[str, LayerAttention], state: dict | None, produced: Produced, layer: Array,
                stacks: TypedStacks, *, dtype: DType, lora_scale: float, split_rows: bool, valid: Array,
                replay: Array | None = None) -> tuple[Array, dict | None, Produced, tuple[RouterStats, Array] | None]:
    """One Gemma 4 layer on the fp32 residual stream x [B, T, H]; `layer_input` [B, T, P]: its per-layer input.
    With the MoE block, also its router stats over valid [B, T] tokens and the experts each token ran
    (`replay`: the experts to run instead)."""
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    normed = rms_norm(x, weights["attn_norm"]["scale"], eps, dtype, offset)
    h, state, produced = typed_attention(cfg, stacks, normed, ropes, attention, state, produced, layer, dtype=dtype,
                                         lora_scale=lora_scale, split_rows=split_rows)
    x = x + rms_norm(h, weights["attn_post_norm"]["scale"], eps, jnp.float32, offset)
    normed = rms_norm(x, weights["mlp_norm"]["scale"], eps, dtype, offset)
    h = typed_mlp(cfg, stacks, normed, layer, dtype=dtype, lora_scale=lora_scale, split_rows=split_rows)
    moe = None
    if cfg.is_moe:  # the dense MLP's output normed, plus the experts' (both from the same residual stream)
        experts, stats, ids = moe_beside_mlp(cfg, weights, x, valid, replay, dtype=dtype)
        h = rms_norm(h, weights["mlp_out_norm"]["scale"], eps, jnp.float32, offset) + experts
        moe = (stats, ids)
    x = x + rms_norm(h, weights["mlp_post_norm"]["scale"], eps, jnp.float32, offset)
    if layer_input is not None:  # the per-layer input, gated by the residual stream itself (not normed)
        gate = project(x.astype(dtype), weights["ple_gate"], None, 0.0, dtype)
        h = project(gated_product(gate, layer_input.astype(jnp.float32), cfg.hidden_act, dtype), weights["ple_proj"],
                    None, 0.0, dtype)
        x = x + rms_norm(h, weights["ple_norm"]["scale"], eps, jnp.float32, offset)
    return x * weights["layer_scalar"].astype(jnp.float32), state, produced, moe


def typed_decoder_hidden(params: dict, cfg: ModelConfig, input_ids: Array, positions: Array,
                         attention: dict[str, LayerAttention], state: dict | None, *, dtype: DType,
                         remat: bool | str = False, valid: Array | None = None, replay: Array | None = None,
                         record_routing: bool = False, embeds: tuple[Array, ...] | None = None
                         ) -> tuple[Array, dict | None, MoeOut | None]:
    """`decoder_hidden` (models/decoder.py) of a Gemma 4 model: hidden states after the final norm [B, T, H]
    (compute dtype), the new per-type attention state and, with the MoE block, its `MoeOut`. `embeds` (slots,
    features): image features in place of the image tokens' embeddings; the per-layer inputs then read the pad
    token's identity there and the features as the embedding they project (transformers' `Gemma4Model`)."""
    valid = jnp.ones(input_ids.shape, bool) if valid is None else valid
    if embeds is None:
        x, embedded = embed_tokens(params, cfg, input_ids, dtype)
    else:
        slots, features, *deepstack = embeds
        if deepstack:
            raise ValueError("deepstack features: Gemma 4 has none")
        is_image = (slots >= 0)[..., None]
        input_ids = jnp.where(slots >= 0, jnp.int32(cfg.pad_token_id or 0), input_ids)
        x, embedded = embed_tokens(params, cfg, input_ids, dtype)
        features = image_rows(slots, features, dtype)  # in the compute dtype, as transformers scatters them
        x = jnp.where(is_image, features, x)
        embedded = jnp.where(is_image, features.astype(embedded.dtype), embedded)
    split_rows = state is None  # the training / scoring forward (`batch_rows`)
    split_tokens = split_rows and context_parallel_size() > 1
    if split_tokens:
        x = with_activation_constraint(x, ("batch", "length", "act_embed"))
    ropes = {"sliding": rope_cos_sin(cfg, positions, local=True), "full": full_rope_cos_sin(cfg, positions)}
    adapters: LoraAdapters | None = params.get("lora")
    lora_layers = {} if adapters is None else adapters.weights["layers"]
    lora_scale = 0.0 if adapters is None else adapters.scale
    layers, _, stacks = typed_stacks(cfg, params["layers"], lora_layers)
    inputs = per_layer_inputs(params, cfg, input_ids, embedded, dtype) if cfg.per_layer_input_size else None
    produced = None
    if cfg.kv_shared_layers:
        b, t = input_ids.shape
        shapes = {"sliding": (cfg.num_key_value_heads, cfg.head_dim), "full": (cfg.full_kv_heads, cfg.full_head_dim)}
        produced = {kind: (jnp.zeros((b, t, *shape), dtype),) * 2 for kind, shape in shapes.items()}

    def layer(carry: tuple[Array, Any, Produced, Array], xs: tuple[dict, Array | None, Array | None]
              ) -> tuple[tuple, Any]:
        x, state, produced, index = carry
        weights, layer_input, layer_replay = xs
        x, state, produced, moe = typed_layer(cfg, weights, x, layer_input, ropes, attention, state, produced, index,
                                              stacks, dtype=dtype, lora_scale=lora_scale, split_rows=split_rows,
                                              valid=valid, replay=layer_replay)
        if split_tokens:
            x = with_activation_constraint(x, ("batch", "length", "act_embed"))
        if moe is not None and not record_routing:
            moe = (moe[0], None)
        return (x, state, produced, index + 1), moe

    (x, state, _, _), moe = scan_layers(layer, remat, cfg.scan_repeat, (x, state, produced, jnp.int32(0)),
                                        (layers, inputs, replay))
    hidden = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, dtype, cfg.norm_offset)
    return hidden, state, None if moe is None else MoeOut(*moe)


def typed_state(cache: dict | None) -> dict | None:
    """A dense cache dict (models/cache.py) as the per-type attention state, (k, v) per type."""
    if cache is None:
        return None
    return {kind: (cache["k" if kind == "sliding" else "k_full"], cache["v" if kind == "sliding" else "v_full"])
            for kind in TYPES}


def untyped_state(state: ArrayTree) -> dict:
    """The per-type state back as a dense cache dict's k / v entries."""
    return {"k": state["sliding"][0], "v": state["sliding"][1], "k_full": state["full"][0], "v_full": state["full"][1]}

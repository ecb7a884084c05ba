"""The decoder, once: embedding -> layers -> final RMSNorm as pure functions over the params dict
(layout: jaxrl_llm/models/param_init.py), with the attention and its cache injected.

Every path runs this code: the trainer's forward and scoring (`forward_hidden`, attention over
the sequence itself), the static sampler's prefill and decode (a dense KV cache), the paged
engine's prefill (dense cache) and decode (`jaxrl_llm.sampler.engine.forward`: a paged KV pool).
What differs between them is only the `LayerAttention` given to `decoder_hidden`: a function that
takes one layer's RoPE'd q / k / v, its state (nothing, a dense cache, a page pool) and the layer
index, and returns the attention output and the new state. A model family is added here once.

Differences between Llama / Mistral / Qwen2 / Qwen3 are `ModelConfig` flags: q/k/v bias, per-head
q/k RMSNorm, sliding window. The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) replace
the MLP with `moe_block`: a router, dropless routed experts (models/moe.py) and Qwen2-MoE's gated
shared expert; each layer also reports its router statistics (and, when asked, the experts each
token ran, for routing replay) as the layer scan's outputs. A MoE model may keep dense MLPs in some
layers (`mixed_mlp`): the scan stays one loop, and each layer picks its MLP with `lax.cond`.

Layers run under `lax.scan` (params carry a leading layer axis, so compile time does not grow with
depth); params whose `layers` is a tuple of per-layer dicts (`unstack_layers`: the paged engine's
decode with rollout.unroll_layers) run them one after another instead. `remat` (a policy name of
jaxrl_llm/models/remat.py, or a bool) checkpoints each layer with that policy. LoRA adapters
(models/lora.py) in `params["lora"]` are scanned with the layers and add
`scale * (x @ A) @ B` to each targeted projection's output.

Numerics (rollout/trainer agreement: `jaxrl_llm.models.numerics`, docs/performance-history.md): every
matmul takes compute-dtype operands and accumulates AND returns fp32; the fp32 result is rounded to
the compute dtype once, where the next matmul consumes it (bias add, q/k norm, RoPE and the SiLU
gate run in fp32 before that rounding); the residual stream between layers is fp32 (the
embedding rows rounded to the compute dtype, then fp32 sums); norms, softmax and RoPE angles in
fp32. Because all paths share this code, a token's numbers do not depend on the path that
computes them, up to the attention kernel's summation order.

Matmuls run on [tokens, features] (the [B, T] axes flattened) as 2-D matrices, the per-head
kernels [H, heads, D] / [heads, D, H] reshaped for free: XLA:CPU turned the weight gradient of a
contraction over two axes into a transposing copy that ran at a few GB/s (~0.5 s of a SmolLM2
4 x 512 forward+backward); flattened, the backward of SmolLM2's MLP stack runs ~1.8x faster.
Under context parallelism (a mesh whose 'context' axis splits T) they keep [B, T] apart instead: the
merged axis cannot hold a split of its minor part, so every device would run every token.

Masking (dense attention) is by slot: a query at slot `q` sees key slot `s` iff `s <= q`, the key
slot is valid (its attention-mask bit is 1) and, with a sliding window W, `q - s < W`. Without a
cache the slots are the sequence indices; with a cache they are cache indices
(`jaxrl_llm.models.cache`).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models import blockwise, invariant
from jaxrl_llm.models.attention import attend, attend_invariant
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
from jaxrl_llm.models.context_parallel import context_parallel_attend
from jaxrl_llm.models.expert_parallel import routed_experts
from jaxrl_llm.models.gemma4 import typed_decoder_hidden
from jaxrl_llm.models.hybrid import hybrid_decoder_hidden
from jaxrl_llm.models.lora import LoraAdapters
from jaxrl_llm.models.mla import mla_attention_block
from jaxrl_llm.models.moe import MoeOut, RouterStats, route, router_stats
from jaxrl_llm.models.remat import scan_layers, scan_step
from jaxrl_llm.sharding.mesh import context_parallel_size
from jaxrl_llm.sharding.rules import with_activation_constraint

Array = jax.Array


def attention_block(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, cos: Array, sin: Array,
                    attention: LayerAttention, state: ArrayTree, layer: Array, *, dtype: DType, lora_scale: float,
                    split_rows: bool = False) -> tuple[Array, Any]:
    """fp32 [B, T, H] output of the attention sublayer for normed x [B, T, H] (compute dtype);
    `split_rows`: `batch_rows` on its activations."""
    b, t, h = x.shape
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    x = batch_rows(x, split_rows)

    def qkv(name: str, heads: int) -> Array:  # fp32 [B, T, heads, D] (bias added in fp32)
        y = project(x, weights[name], adapters.get(name), lora_scale, dtype).reshape(b, t, heads, hd)
        return batch_rows(y, split_rows, "act_heads" if heads == nh else "act_kv_heads")

    q, k, v = qkv("q_proj", nh), qkv("k_proj", nkv), qkv("v_proj", nkv)
    if cfg.qk_norm:  # Qwen3: RMSNorm over head_dim per head, before RoPE (fp32 until after RoPE)
        q = rms_norm(q, weights["q_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
        k = rms_norm(k, weights["k_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    q = apply_rope(q, cos, sin)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != hd:
        # Gemma scales scores by query_pre_attn_scalar^-0.5; the attention applies head_dim^-0.5
        q = q * float(np.sqrt(hd / cfg.query_pre_attn_scalar))
    # one rounding to the compute dtype; a KV cache stores exactly these values
    q, k = q.astype(dtype), apply_rope(k, cos, sin).astype(dtype)
    sinks = weights["sinks"].astype(jnp.float32) if cfg.attention_sinks else None
    out, state = attention(q, k, v.astype(dtype), state, layer, sinks)
    out = out.astype(dtype).reshape(b, t, nh, hd)
    return project(out, weights["o_proj"], adapters.get("o_proj"), lora_scale, dtype, in_axes=2), state


def moe_block(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, valid: Array, replay: Array | None, *,
              dtype: DType, lora_scale: float) -> tuple[Array, RouterStats, Array]:
    """fp32 [B, T, H] MoE MLP of normed x [B, T, H] (compute dtype), this layer's `RouterStats` over
    valid [B, T] tokens, and the experts each token ran [B, T, k] (the router's own top-k, or the
    replayed ones). `replay` [B, T, k]: experts to use (NOT_RECORDED: the router's choice)."""
    b, t, h = x.shape
    tokens = x.reshape(b * t, h)
    if context_parallel_size() > 1:  # the merged axis lost the token split (module docstring): restore it
        tokens = with_activation_constraint(tokens, ("tokens", None))
    k = cfg.num_experts_per_tok
    routing = route(cfg, weights["router"]["kernel"], tokens, None if replay is None else replay.reshape(b * t, k),
                    weights["router"].get("bias"), weights.get("score_bias"))
    out = routed_experts(weights["experts"], tokens, routing, cfg, dtype=dtype)  # expert parallel on a mesh
    if "shared_expert" in weights:  # a dense expert every token runs (Qwen2-MoE: gated by sigmoid(x @ w))
        shared = mlp_block(weights["shared_expert"], adapters.get("shared_expert", {}), tokens, dtype=dtype,
                           lora_scale=lora_scale)
        if "shared_expert_gate" in weights:
            shared = jax.nn.sigmoid(project(tokens, weights["shared_expert_gate"], None, 0.0, dtype)) * shared
        out = out + shared
    stats = router_stats(routing, valid.reshape(b * t))
    return out.reshape(b, t, h), stats, routing.ids.reshape(b, t, k)


def layer_mlp(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, valid: Array, replay: Array | None,
              lora_scale: float, *, dtype: DType) -> tuple[Array, tuple[RouterStats, Array] | None]:
    """A layer's MLP of normed x [B, T, H] (the hybrid decoder's, models/hybrid.py) with its LoRA adapters
    ({"mlp": ...} or a shared expert's): the dense SwiGLU, or the experts (`moe_block`) with their router stats and
    the experts each token ran."""
    if not cfg.is_moe:
        return mlp_block(weights["mlp"], adapters.get("mlp", {}), x, dtype=dtype, lora_scale=lora_scale,
                         activation=cfg.hidden_act), None
    out, stats, ids = moe_block(cfg, weights["moe"], adapters, x, valid, replay, dtype=dtype, lora_scale=lora_scale)
    return out, (stats, ids)


MlpStacks = tuple[dict, dict, Array, Array]  # a mixed-layer model's (params, adapters, is_moe [L], row [L])


def decoder_layer(cfg: ModelConfig, weights: dict, adapters: dict, x: Array, cos: Array, sin: Array,
                  attention: LayerAttention, state: ArrayTree, layer: Array, *, dtype: DType, lora_scale: float,
                  valid: Array | None = None, replay: Array | None = None, stacks: MlpStacks | None = None,
                  split_rows: bool = False) -> tuple[Array, Any, tuple[RouterStats, Array] | None]:
    """One pre-norm block on the fp32 residual stream x [B, T, H] -> (x, attention state, and for a
    MoE model its router stats over valid [B, T] tokens and its router's top-k ids; see `moe_block`).
    `stacks`: a mixed-layer model's MLPs, stacked apart from the layers (`mixed_mlp`). `split_rows`:
    the activations kept split over the batch axes (`batch_rows`: the training and scoring forward)."""
    eps = cfg.rms_norm_eps
    normed = rms_norm(x, weights["attn_norm"]["scale"], eps, dtype, cfg.norm_offset)
    block = mla_attention_block if cfg.is_mla else attention_block  # DeepSeek's latent attention: models/mla.py
    h, state = block(cfg, weights["attn"], adapters.get("attn", {}), normed, cos, sin, attention,
                               state, layer, dtype=dtype, lora_scale=lora_scale, split_rows=split_rows)
    if cfg.sandwich_norms:  # Gemma: the sublayer's output is normed before the residual add (kept fp32)
        h = rms_norm(h, weights["attn_post_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
    x = x + h  # fp32 + fp32: the residual stream is never rounded
    normed = rms_norm(x, weights["mlp_norm"]["scale"], eps, dtype, cfg.norm_offset)
    if not cfg.is_moe:
        h = mlp_block(weights["mlp"], adapters.get("mlp", {}), normed, dtype=dtype, lora_scale=lora_scale,
                      activation=cfg.hidden_act, split_rows=split_rows)
        if cfg.sandwich_norms:
            h = rms_norm(h, weights["mlp_post_norm"]["scale"], eps, jnp.float32, cfg.norm_offset)
        return x + h, state, None
    valid = jnp.ones(x.shape[:2], bool) if valid is None else valid
    if stacks is not None:
        out, stats, ids = mixed_mlp(cfg, stacks, layer, normed, valid, replay, dtype=dtype, lora_scale=lora_scale)
    else:
        out, stats, ids = moe_block(cfg, weights["moe"], adapters, normed, valid, replay, dtype=dtype,
                                    lora_scale=lora_scale)
    return x + out, state, (stats, ids)


def mixed_mlp(cfg: ModelConfig, stacks: MlpStacks, layer: Array, x: Array, valid: Array, replay: Array | None, *,
              dtype: DType, lora_scale: float) -> tuple[Array, RouterStats, Array]:
    """A mixed-layer model's MLP of `layer`: its row of the dense stack or of the MoE stack, chosen with
    `lax.cond`, so the layer scan stays one loop. A dense layer reports empty router stats (no tokens:
    the pooled losses and metrics count the sparse layers only, as HF's) and zero expert ids."""
    params, adapters, is_moe, row = stacks
    take = functools.partial(take_row, index=row[layer])

    def sparse(x: Array) -> tuple[Array, RouterStats, Array]:
        return moe_block(cfg, take(params["moe"]), take({k: v for k, v in adapters.items() if k != "mlp"}), x,
                         valid, replay, dtype=dtype, lora_scale=lora_scale)

    def dense(x: Array) -> tuple[Array, RouterStats, Array]:
        out = mlp_block(take(params["mlp"]), take(adapters.get("mlp", {})), x, dtype=dtype, lora_scale=lora_scale)
        e, zero = cfg.num_experts, jnp.zeros((), jnp.float32)
        stats = RouterStats(jnp.zeros((e,), jnp.float32), jnp.zeros((e,), jnp.float32), zero, zero, zero)
        return out.reshape(*x.shape[:-1], -1), stats, jnp.zeros((*x.shape[:-1], cfg.num_experts_per_tok), jnp.int32)

    return lax.cond(is_moe[layer], sparse, dense, x)


def mlp_stacks(cfg: ModelConfig, layers: dict, lora_layers: dict) -> tuple[dict, dict, MlpStacks | None]:
    """(the params and adapters the layer scan steps through, and a mixed-layer model's MLP stacks: the
    `mlp` / `moe` params and adapters stacked over their own layers, indexed per layer instead)."""
    if not cfg.mixed_layers:
        return layers, lora_layers, None
    apart = ("mlp", "moe", "shared_expert")
    is_moe = np.zeros(cfg.num_hidden_layers, bool)
    is_moe[list(cfg.moe_layer_ids)] = True
    row = np.zeros(cfg.num_hidden_layers, np.int32)  # each layer's row in its kind's stack
    row[list(cfg.moe_layer_ids)] = np.arange(len(cfg.moe_layer_ids))
    row[list(cfg.dense_layer_ids)] = np.arange(len(cfg.dense_layer_ids))
    stacks = ({k: v for k, v in layers.items() if k in apart}, {k: v for k, v in lora_layers.items() if k in apart},
              jnp.asarray(is_moe), jnp.asarray(row))
    return ({k: v for k, v in layers.items() if k not in apart},
            {k: v for k, v in lora_layers.items() if k not in apart}, stacks)


def unstack_layers(params: dict, cfg: ModelConfig) -> dict:
    """`params` with `layers` as a tuple of per-layer dicts (each its own arrays) instead of one stack:
    `decoder_hidden` then runs the layers one after another instead of scanning them. On CPU a scan
    copies each layer's weights out of the stack before its matmuls (XLA:CPU's dot fusions read whole
    buffers, not a dynamic slice of one): 14% of a 16-slot SmolLM2 decode step (docs/performance-history.md).
    Mixed-layer MoE models (whose MLPs are stacked apart), Gemma 4's and Qwen3.5's per-kind stacks stay stacked;
    LoRA adapters stay stacked and are sliced per layer."""
    layers = params["layers"]
    if isinstance(layers, tuple) or not unstackable(cfg):
        return params
    return dict(params, layers=_layer_slices(layers, cfg.num_hidden_layers))


def unstackable(cfg: ModelConfig) -> bool:
    """Whether `unstack_layers` splits `cfg`'s layer stack (not the mixed-layer, per-kind or hybrid stacks)."""
    return not (cfg.mixed_layers or cfg.typed_layers or cfg.hybrid)


@functools.partial(jax.jit, static_argnums=1)
def _layer_slices(layers: dict, count: int) -> tuple[dict, ...]:
    return tuple(jax.tree.map(operator.itemgetter(i), layers) for i in range(count))  # one program, not one per slice


def decoder_hidden(params: dict, cfg: ModelConfig, input_ids: Array, positions: Array,
                   attention: LayerAttention | dict[str, LayerAttention], state: ArrayTree, *,
                   compute_dtype: DType = jnp.float32,
                   remat: bool | str = False, valid: Array | None = None, replay: Array | None = None,
                   record_routing: bool = False, embeds: tuple[Array, ...] | None = None
                   ) -> tuple[Array, Any, MoeOut | None]:
    """Hidden states after the final norm [B, T, H] (compute dtype) of input_ids [B, T] at integer
    positions [B, T], the attention's final state (see `LayerAttention`) and, for a mixture-of-experts
    model, its `MoeOut`: router stats over valid [B, T] tokens (default all) and, with
    `record_routing`, the experts each layer ran [L, B, T, k] (its router's top-k where not replayed).
    `replay` [L, B, T, k]: the experts each layer runs instead of its router's top-k (routing replay;
    a sampler's prefill replays a multi-turn conversation's earlier turns). A mixed-layer model's dense layers
    have stats of no tokens and ids 0, and ignore their `replay` rows. A Gemma 4 model (`cfg.typed_layers`)
    takes one attention per type and a state per type ({"sliding": ..., "full": ...}: models/gemma4.py).
    `embeds` (slots [B, T] int32, features [M, H]): a vision-language model's image features, feature
    slots[b, t] in place of token (b, t)'s embedding where slots >= 0 (models/vision/qwen_vl.py); or features
    [B, K, H], each row's own (slots index them per row); positions may then be M-RoPE's [3, B, T]. A third
    member, deepstack features [D, M, H] / [D, B, K, H] (Qwen3-VL): layer i < D adds feature i to the image
    tokens' hidden states after it."""
    with invariant.mode(cfg.batch_invariant):  # traced with the model's numerics (models/invariant.py)
        return _decoder_hidden(params, cfg, input_ids, positions, attention, state, compute_dtype=compute_dtype,
                               remat=remat, valid=valid, replay=replay, record_routing=record_routing,
                               embeds=embeds)


def _decoder_hidden(params: dict, cfg: ModelConfig, input_ids: Array, positions: Array,
                    attention: LayerAttention | dict[str, LayerAttention], state: ArrayTree, *, compute_dtype: DType,
                    remat: bool | str, valid: Array | None, replay: Array | None,
                    record_routing: bool, embeds: tuple[Array, ...] | None) -> tuple[Array, Any, MoeOut | None]:
    dtype = jnp.dtype(compute_dtype)
    if embeds is not None and cfg.hybrid:
        raise ValueError(f"image features: {cfg.model_type} has no vision-language model here")
    if cfg.typed_layers:  # Gemma 4: per-kind weight stacks, a state per attention type (models/gemma4.py)
        assert isinstance(attention, dict)
        if positions.ndim == 3:  # a vision-language row's streams, all equal (Gemma 4 has no M-RoPE)
            positions = positions[0]
        return typed_decoder_hidden(params, cfg, input_ids, positions, attention, state, dtype=dtype, remat=remat,
                                    valid=valid, replay=replay, record_routing=record_routing, embeds=embeds)
    assert not isinstance(attention, dict)
    if cfg.hybrid:  # Qwen3.5: gated delta-net and gated attention layers (models/hybrid.py)
        return hybrid_decoder_hidden(params, cfg, input_ids, positions, attention, state, dtype=dtype, remat=remat,
                                     valid=valid, mlp=functools.partial(layer_mlp, cfg, dtype=dtype), replay=replay,
                                     record_routing=record_routing)
    # the embedding rows in the compute dtype, carried as an fp32 residual stream
    x, _ = embed_tokens(params, cfg, input_ids, dtype)
    deepstack: tuple[Array, Array] | None = None  # (slots, features [D, ...]): Qwen3-VL's, after the first layers
    if embeds is not None:  # image tokens take their features (in the compute dtype, as transformers scatters)
        slots, features = embeds[:2]
        deepstack = (slots, embeds[2]) if len(embeds) > 2 else None
        x = jnp.where((slots >= 0)[..., None], image_rows(slots, features, dtype),
                      with_activation_constraint(x, ("batch", "length", "act_embed")))
    # context parallelism (the training / scoring forward: no cache): the tokens split over 'context'
    split_rows = state is None  # no cache: the training / scoring forward (`batch_rows`)
    split_tokens = split_rows and context_parallel_size() > 1
    if split_tokens:
        x = with_activation_constraint(x, ("batch", "length", "act_embed"))
    if positions.ndim == 3 and not cfg.mrope_section:  # a vision-language row's streams, all equal (Gemma 3)
        positions = positions[0]
    cos, sin = rope_cos_sin(cfg, positions)
    local_rope = None
    if cfg.rope_local_theta is not None and cfg.local_layer_ids:  # Gemma 3: the sliding layers' own base
        local_rope = (jnp.asarray(cfg.local_layer_flags), *rope_cos_sin(cfg, positions, local=True))
    adapters: LoraAdapters | None = params.get("lora")
    lora_layers = {} if adapters is None else adapters.weights["layers"]
    lora_scale = 0.0 if adapters is None else adapters.scale
    layers, lora_layers, stacks = params["layers"], lora_layers, None
    if not isinstance(layers, tuple):
        layers, lora_layers, stacks = mlp_stacks(cfg, layers, lora_layers)

    def layer(carry: tuple[Array, Any, Array], xs: tuple[dict, dict, Array | None]) -> tuple[tuple, Any]:
        x, state, index = carry
        weights, adapters, layer_replay = xs
        c, s = cos, sin
        if local_rope is not None:
            flags, local_cos, local_sin = local_rope
            c, s = jnp.where(flags[index], local_cos, cos), jnp.where(flags[index], local_sin, sin)
        x, state, moe = decoder_layer(cfg, weights, adapters, x, c, s, attention, state, index, dtype=dtype,
                                      lora_scale=lora_scale, valid=valid, replay=layer_replay, stacks=stacks,
                                      split_rows=split_rows)
        if deepstack is not None:  # Qwen3-VL: layer i < D adds deepstack feature i to the image tokens
            image_slots, stacked = deepstack
            depth = stacked.shape[0]
            table = lax.dynamic_index_in_dim(stacked, jnp.minimum(index, depth - 1), 0, keepdims=False)
            x = x + jnp.where((index < depth) & (image_slots >= 0)[..., None], image_rows(image_slots, table, dtype),
                              0.0)
        if split_tokens:
            x = with_activation_constraint(x, ("batch", "length", "act_embed"))
        if moe is not None and not record_routing:
            moe = (moe[0], None)
        return (x, state, index + 1), moe

    if isinstance(layers, tuple):  # unstacked (`unstack_layers`): one call per layer, each its own arrays
        step = scan_step(layer, remat)
        carry, outs = (x, state, jnp.int32(0)), []
        for i, weights in enumerate(layers):
            layer_lora = jax.tree.map(operator.itemgetter(i), lora_layers)
            carry, out = step(carry, (weights, layer_lora, None if replay is None else replay[i]))
            outs.append(out)
        (x, state, _), moe = carry, jax.tree.map(lambda *o: jnp.stack(o), *outs)
    else:
        (x, state, _), moe = scan_layers(layer, remat, cfg.scan_repeat, (x, state, jnp.int32(0)),
                                         (layers, lora_layers, replay))
    hidden = rms_norm(x, params["final_norm"]["scale"], cfg.rms_norm_eps, dtype, cfg.norm_offset)
    return hidden, state, None if moe is None else MoeOut(*moe)


def dense_attention(cfg: ModelConfig, allowed: Array, write_index: Array | int = 0,
                    local_allowed: Array | None = None, kv_heads: int | None = None,
                    key_start: Array | None = None, lookahead: int = 0) -> LayerAttention:
    """The trainer's and the static sampler's attention: `allowed` [B, T, S] from
    `jaxrl_llm.models.cache.attention_context`. State: None (attention over the sequence itself,
    causal query chunks) or a dense cache (k, v) [L, B, kv_heads, S, D], written at slots
    [write_index, write_index + T) of the layer before attending over all its slots (v None: the values
    are the keys, MLA's cache: models/mla.py).
    `local_allowed` [B, T, S]: the mask of a mixed-window model's sliding layers (`cfg.local_layer_ids`).

    Context parallelism (no cache, a mesh whose 'context' axis is > 1): the queries, keys, values and
    mask rows stay split over the tokens and the devices attend as `cfg.context_attention` says
    (models/context_parallel.py: ring, all-to-all over heads, or gathered keys / values). `kv_heads`: the
    keys' heads where they are not the config's (Gemma 4's full layers). `key_start` [B]: each row's first
    valid key slot, where the batch-invariant attention anchors its key blocks (models/invariant.py). `lookahead`:
    how far past itself a query's `allowed` reaches without a cache (Gemma 3's images: `attention_context`)."""
    nkv = kv_heads or cfg.num_key_value_heads

    def attention(q: Array, k: Array, v: Array, cache: tuple[Array, Array] | None, layer: Array,
                  sinks: Array | None) -> tuple[Array, tuple[Array, Array] | None]:
        dtype = q.dtype
        # head-major [B, kv, S, D]: the layout both attention matmuls read without a transposed copy
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if cache is not None:
            k_cache, v_cache = cache
            start = (layer, 0, 0, write_index, 0)
            k_cache = lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), start)
            k = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False).astype(dtype)
            if v_cache is None:  # the caller's values are its keys (MLA)
                v = k
            else:
                v_cache = lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), start)
                v = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False).astype(dtype)
            cache = (k_cache, v_cache)
        if local_allowed is not None:
            mask = jnp.where(jnp.asarray(cfg.local_layer_flags)[layer], local_allowed, allowed)
        else:
            mask = allowed
        split_tokens = cache is None and context_parallel_size() > 1 and q.shape[1] % context_parallel_size() == 0
        if key_start is not None and split_tokens:  # batch-invariant over a context split: gathered keys
            return (context_parallel_attend(q, k, v, mask, nkv, cfg.attn_logit_softcapping, "gather", sinks=sinks,
                                            key_start=key_start), cache)
        if key_start is not None:  # batch-invariant (model.batch_invariant): one blocked order for every path
            out = attend_invariant(q, k, v, mask, key_start, nkv, causal=cache is None,
                                   softcap=cfg.attn_logit_softcapping, sinks=sinks, lookahead=lookahead)
            return out.reshape(q.shape), cache
        if split_tokens:
            if lookahead:  # the ring's blocks skip every later key
                raise ValueError("context parallelism with Gemma 3's bidirectional image tokens is not supported")
            return (context_parallel_attend(q, k, v, mask, nkv, cfg.attn_logit_softcapping, cfg.context_attention,
                                            sinks=sinks), cache)
        if cache is None:  # long rows blockwise (one chunk x block of scores at a time)
            return (blockwise.causal_attention(q, k, v, mask, nkv, cfg.attn_logit_softcapping, sinks, lookahead),
                    cache)
        out = attend(q, k, v, mask, nkv, causal=False, softcap=cfg.attn_logit_softcapping,
                     sinks=sinks)  # fp32 [B * T, heads, D]
        return out.reshape(q.shape), cache

    return attention

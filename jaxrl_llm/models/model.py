"""Pure functions over a plain params dict (layout and init: models/param_init.py): the forward
with the trainer's dense attention (the decoder's math: models/decoder.py), and the LM / value /
score heads."""
from __future__ import annotations

from typing import Any, overload

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.cache import attention_context, image_blocks_of, window_mask
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.decoder import decoder_hidden, dense_attention
from jaxrl_llm.models.gemma4 import typed_state, untyped_state
from jaxrl_llm.models.hybrid import HybridState
from jaxrl_llm.models.moe import MoeOut
from jaxrl_llm.models.numerics import cap_logits

Array = jax.Array


@overload
def forward_hidden(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                   positions: Array | None = None, cache: None = None, compute_dtype: DType = jnp.float32,
                   remat: bool | str = False, segment_ids: Array | None = None, branch_ids: Array | None = None,
                   embeds: tuple[Array, ...] | None = None, position_offset: Array | None = None
                   ) -> tuple[Array, None]: ...
@overload
def forward_hidden(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                   positions: Array | None = None, cache: dict, compute_dtype: DType = jnp.float32,
                   remat: bool | str = False, segment_ids: Array | None = None, branch_ids: Array | None = None,
                   embeds: tuple[Array, ...] | None = None, position_offset: Array | None = None
                   ) -> tuple[Array, dict]: ...
def forward_hidden(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                   positions: Array | None = None, cache: dict | None = None,
                   compute_dtype: DType = jnp.float32, remat: bool | str = False,
                   segment_ids: Array | None = None, branch_ids: Array | None = None,
                   embeds: tuple[Array, ...] | None = None, position_offset: Array | None = None
                   ) -> tuple[Array, dict | None]:
    """Hidden states after the final norm [B, T, H] (compute dtype) and the updated cache or None.

    Positions default to cumsum(attention_mask) - 1 clipped at 0 (over the cache slots too when a
    cache is given), so left padding does not change any real token's output. segment_ids [B, T]
    (no cache): packed rows holding several sequences (ids 1, 2, ... per row, attention_mask 0 on
    the padding); attention stays within a segment and positions restart per segment, so every
    sequence's hidden states equal those of the sequence alone (jaxrl_llm/batching). branch_ids [B, T]
    (with segment_ids and positions): a segment holding one prompt and several continuations of it,
    each seeing the prompt and itself only (`attention_context`). LoRA adapters in
    `params["lora"]` (models/lora.py) are applied inside the layers. `embeds`: image features in place of
    image tokens' embeddings, with M-RoPE positions [3, B, T] (`decoder_hidden`; models/vision/qwen_vl.py);
    `position_offset` [B]: added to the default positions (a vision-language row's decode delta).
    """
    hidden, new_cache, _ = _forward(params, cfg, input_ids, attention_mask, positions=positions, cache=cache,
                                    compute_dtype=compute_dtype, remat=remat, segment_ids=segment_ids,
                                    branch_ids=branch_ids, embeds=embeds, position_offset=position_offset)
    return hidden, new_cache


def forward_hidden_moe(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                       positions: Array | None = None, compute_dtype: DType = jnp.float32, remat: bool | str = False,
                       segment_ids: Array | None = None, branch_ids: Array | None = None,
                       replay: Array | None = None, record_routing: bool = False,
                       embeds: tuple[Array, ...] | None = None) -> tuple[Array, MoeOut | None]:
    """`forward_hidden` (no cache) with the mixture-of-experts layers' `MoeOut` (None for a dense
    model): router stats over the attention mask's tokens, the router's top-k ids per layer with
    `record_routing`, and `replay` [L, B, T, k] expert ids used in place of the router's choice.
    `embeds`: image features in place of image tokens (`decoder_hidden`)."""
    hidden, _, moe = _forward(params, cfg, input_ids, attention_mask, positions=positions, cache=None,
                              compute_dtype=compute_dtype, remat=remat, segment_ids=segment_ids,
                              branch_ids=branch_ids, replay=replay, record_routing=record_routing, embeds=embeds)
    return hidden, moe


def forward_hidden_routed(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *,
                          cache: dict, compute_dtype: DType = jnp.float32, replay: Array | None = None,
                          positions: Array | None = None, embeds: tuple[Array, ...] | None = None,
                          position_offset: Array | None = None) -> tuple[Array, dict, Array | None]:
    """`forward_hidden` with a cache that also returns the experts each MoE layer ran [L, B, T, k]
    int32 (None for a dense model): what a sampler records for routing replay. `replay` [L, B, T, k]:
    experts to run instead of the router's choice (NOT_RECORDED: the router's). `positions`, `embeds`,
    `position_offset`: a vision-language prompt's M-RoPE positions and image features, a decode step's delta
    (`forward_hidden`)."""
    hidden, new_cache, moe = _forward(params, cfg, input_ids, attention_mask, positions=positions, cache=cache,
                                      compute_dtype=compute_dtype, remat=False, segment_ids=None, branch_ids=None,
                                      replay=replay, record_routing=True, embeds=embeds,
                                      position_offset=position_offset)
    assert new_cache is not None
    return hidden, new_cache, None if moe is None else moe.routing


def _forward(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array, *, positions: Array | None,
             cache: dict | None, compute_dtype: DType, remat: bool | str, segment_ids: Array | None,
             branch_ids: Array | None, replay: Array | None = None, record_routing: bool = False,
             embeds: tuple[Array, ...] | None = None, position_offset: Array | None = None
             ) -> tuple[Array, dict | None, MoeOut | None]:
    image_blocks = None  # Gemma 3 / 4: an image's tokens see each other (`attention_context`)
    if cfg.bidirectional_image_tokens and embeds is not None:
        image_blocks = image_blocks_of(embeds[0])
    positions, allowed, write_index, new_mask = attention_context(cfg, attention_mask, positions, cache, segment_ids,
                                                                  branch_ids, position_offset, image_blocks)
    lookahead = 0 if image_blocks is None else cfg.bidirectional_image_tokens
    causal_allowed = allowed  # Gemma 4's full layers: causal whatever the images (transformers' vision masks)
    if cfg.typed_layers and image_blocks is not None:
        _, causal_allowed, _, _ = attention_context(cfg, attention_mask, positions, cache, segment_ids, branch_ids)
    # batch-invariant attention anchors its key blocks at each row's first token (models/invariant.py)
    key_start = None
    if cfg.batch_invariant:
        slots = attention_mask if new_mask is None else new_mask  # the cache's slots, or the row's own tokens
        key_start = jnp.argmax(slots > 0, axis=1).astype(jnp.int32)
    local = None
    if cfg.mixed_windows:  # the local layers' mask: `allowed` within the sliding window
        window = window_mask(cfg, write_index, input_ids.shape[1], allowed.shape[2], segment_ids, branch_ids)
        local = allowed & (window if window.ndim == 3 else window[None])
    if cfg.typed_layers:  # Gemma 4: an attention and a cache per attention type (models/gemma4.py)
        attention: Any = {"sliding": dense_attention(cfg, allowed if local is None else local, write_index,
                                                     key_start=key_start, lookahead=lookahead),
                          "full": dense_attention(cfg, causal_allowed, write_index, kv_heads=cfg.full_kv_heads,
                                                  key_start=key_start)}
        kv: Any = typed_state(cache)
    else:
        # MLA's cache paths (and batch-invariant mode) attend with one kv head over the latent (models/mla.py)
        kv_heads = cfg.cache_kv_heads if cache is not None or cfg.batch_invariant else None
        attention = dense_attention(cfg, allowed, write_index, local_allowed=local, key_start=key_start,
                                    kv_heads=kv_heads, lookahead=lookahead)
        kv = None if cache is None else (cache["k"], cache.get("v"))  # no "v": the values are the keys (MLA)
        if cfg.hybrid and cache is not None:  # and the delta-net layers' recurrent state (models/hybrid.py)
            kv = HybridState.of(kv, cache)
    hidden, kv, moe = decoder_hidden(params, cfg, input_ids, positions, attention, kv, compute_dtype=compute_dtype,
                                     remat=remat, valid=attention_mask > 0, replay=replay,
                                     record_routing=record_routing, embeds=embeds)
    if cache is None:
        return hidden, None, moe
    if cfg.typed_layers:
        arrays = untyped_state(kv)
    elif isinstance(kv, HybridState):
        arrays = {"k": kv.attention[0], "v": kv.attention[1], **kv.recurrent}
    else:
        arrays = {"k": kv[0]} if kv[1] is None else {"k": kv[0], "v": kv[1]}
    new_cache = {**arrays, "mask": new_mask, "index": cache["index"] + input_ids.shape[1]}
    return hidden, new_cache, moe


def lm_head_weight(params: dict, cfg: ModelConfig) -> Array:
    """The [H, V] output projection (the embedding transposed when tied)."""
    if cfg.tie_word_embeddings:
        return params["embedding"].T
    return params["lm_head"]["kernel"]


def logits_from_hidden(params: dict, cfg: ModelConfig, hidden: Array) -> Array:
    """[..., V] float32 logits (matmul in the hidden's dtype, fp32 accumulation; soft-capped where the
    model caps them, as the fused log-prob head does: losses/logprob_xla.cap_logits)."""
    w = lm_head_weight(params, cfg).astype(hidden.dtype)
    if cfg.batch_invariant:  # the trainer's fused log-prob's vocabulary chunks (models/invariant.py)
        rows2d = hidden.reshape(-1, hidden.shape[-1])
        # with the weights split by columns (the paged engine's decode: `invariant.weight_columns`) each device
        # computes its vocabulary columns whole: the kernels give a column the bits of its VOCAB_CHUNK chunk
        split = invariant.column_split(w.shape[1])
        rows = invariant.matmul(rows2d, w) if split else invariant.chunked_logits(rows2d, w)
        return cap_logits(rows.reshape(*hidden.shape[:-1], -1), cfg.final_logit_softcapping, 1.0)
    logits = jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)
    return cap_logits(logits, cfg.final_logit_softcapping, 1.0)


def compute_logits(params: dict, cfg: ModelConfig, input_ids: Array, attention_mask: Array,
                   **kwargs: Any) -> Array | tuple[Array, dict]:
    """Full [B, T, V] fp32 logits (tests / eval). With `cache=` returns (logits, new_cache)."""
    hidden, new_cache = forward_hidden(params, cfg, input_ids, attention_mask, **kwargs)
    logits = logits_from_hidden(params, cfg, hidden)
    return logits if new_cache is None else (logits, new_cache)


def value_from_hidden(params: dict, hidden: Array) -> Array:
    """Critic value per token [B, T] fp32."""
    head = params["value_head"]
    v = jnp.einsum("bth,ho->bto", hidden.astype(jnp.float32), head["kernel"].astype(jnp.float32))
    return v[..., 0] + head["bias"].astype(jnp.float32)[0]


def last_valid_index(attention_mask: Array) -> Array:
    """Index of the last position whose mask is 1, per row [B] (works for left or right padding)."""
    t = attention_mask.shape[1]
    return jnp.argmax(jnp.arange(t) * (attention_mask > 0), axis=1)


def score_from_hidden(params: dict, hidden: Array, attention_mask: Array) -> Array:
    """Sequence score [B, num_labels] fp32 at the last valid token (HF *ForSequenceClassification)."""
    idx = last_valid_index(attention_mask)
    last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return last.astype(jnp.float32) @ params["score"]["kernel"].astype(jnp.float32)

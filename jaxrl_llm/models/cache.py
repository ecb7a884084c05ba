"""KV cache for prefill + token-by-token decode, built for a sampler that LEFT-pads prompts.

Layout (a plain dict pytree, so it can be donated to `jit` and carried through `lax.while_loop`):

    cache = {
      "k":     [L, B, kv_heads, S, head_dim]   keys, S = max_len slots (cache dtype, e.g. bf16/fp32);
                                             head-major, the layout attention reads with no copy
      "v":     [L, B, kv_heads, S, head_dim]   values (none for MLA: its values are its keys, models/mla.py)
      ("k_full", "v_full": a Gemma 4 model's full-attention layers, `kv_shapes`)
      ("conv", "delta": a hybrid (Qwen3.5) model's per-row recurrent state [linear layers, B, ...], fp32,
       models/hybrid.py; its "k" / "v" then cover the full-attention layers only)
      "mask":  [B, S] int32                    1 where a slot holds a real (non-pad) token
      "index": int32 scalar                    next slot to write; the same for every row
    }

Calling convention (`forward_hidden` / `compute_logits` with `cache=`):

    cache = init_cache(cfg, batch=B, max_len=S, dtype=jnp.float32)
    # prefill: prompts left-padded to P (pads have attention_mask 0)
    hidden, cache = forward_hidden(params, cfg, prompt_ids[B, P], prompt_mask[B, P], cache=cache)
    next_token = argmax(hidden[:, -1] @ lm_head_weight(params, cfg))      # last slot is real
    # decode: one token per step (T=1), mask 1 for rows still generating (0 is allowed: the slot
    # is then ignored by every later query, e.g. for rows that already finished)
    hidden, cache = forward_hidden(params, cfg, next_token[:, None], ones[B, 1], cache=cache)

Each call writes its T tokens into slots [index, index + T) of every row, sets `mask` there from
`attention_mask`, and advances `index` by T. Queries attend to slots <= their own slot whose mask
is 1. Positions (RoPE) default to (number of valid slots up to and including this one) - 1,
clipped at 0, i.e. `cumsum(mask) - 1` over the whole cache, so a left-padded row gets positions
0, 1, 2, ... exactly as the same row unpadded, and the decode logits equal the full-forward logits
on the concatenated sequence. Pass `positions=` to override. The caller must keep
`index + T <= S` (`S >= prompt_len + max_new_tokens`); writes past the end are clamped by XLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.hybrid import recurrent_shapes

Array = jax.Array


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: DType = jnp.float32) -> dict:
    """An empty cache of `max_len` slots per row (see the module docstring for the convention). A Gemma 4
    model's holds one pair per attention type, over the layers that compute keys / values (`kv_shapes`)."""
    kv = {name: jnp.zeros(shape, dtype) for name, shape in kv_shapes(cfg, batch, max_len).items()}
    if cfg.hybrid:  # the delta-net layers' state (models/hybrid.py)
        kv.update({name: jnp.zeros(shape, jnp.float32) for name, shape in recurrent_shapes(cfg, batch).items()})
    return {**kv, "mask": jnp.zeros((batch, max_len), jnp.int32), "index": jnp.zeros((), jnp.int32)}


def kv_shapes(cfg: ModelConfig, batch: int, slots: int) -> dict[str, tuple[int, ...]]:
    """The cache's key / value arrays: "k" / "v" [L, B, kv_heads, S, head_dim] (L: the layers with attention,
    a hybrid model's full-attention layers only); a Gemma 4 model
    (`cfg.typed_layers`) has them for its sliding layers and "k_full" / "v_full" for its full layers, each over
    the layers of that type that compute keys / values (`cfg.kv_layer_ids`: the KV-sharing layers hold none)."""
    if not cfg.typed_layers:
        shape = (len(cfg.full_attention_layers), batch, cfg.cache_kv_heads, slots, cfg.cache_head_dim)
        if cfg.is_mla:  # the latent and rope key; the values are the keys' first kv_lora_rank (models/mla.py)
            return {"k": shape}
        return {"k": shape, "v": shape}
    local = (len(cfg.kv_layer_ids(True)), batch, cfg.num_key_value_heads, slots, cfg.head_dim)
    full = (len(cfg.kv_layer_ids(False)), batch, cfg.full_kv_heads, slots, cfg.full_head_dim)
    return {"k": local, "v": local, "k_full": full, "v_full": full}


def segment_positions(segment_ids: Array) -> Array:
    """Positions [B, T] that restart at 0 at the first token of every segment (a run of equal ids)."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = lax.cummax(jnp.where(starts, idx[None], 0), axis=1)
    return idx[None] - first


def attention_context(cfg: ModelConfig, attention_mask: Array, positions: Array | None,
                      cache: dict | None, segment_ids: Array | None = None, branch_ids: Array | None = None,
                      position_offset: Array | None = None, image_blocks: Array | None = None
                      ) -> tuple[Array, Array, Array, Array | None]:
    """(positions [B,T], allowed [B,T,S] bool, write_index, new cache mask or None).

    segment_ids [B, T] (packed rows, no cache): several sequences share a row; a query sees only
    keys of its own segment, and positions (when not given) restart at 0 per segment.
    branch_ids [B, T] (with segment_ids): a segment that is one prompt followed by several
    continuations of it (branch 0 = the prompt, 1, 2, ... = the continuations back to back); a
    query sees the prompt and its own branch only, as if each continuation followed the prompt
    alone (pass the positions such a sequence would have). position_offset [B]: added to the positions it
    computes (not to given ones): a vision-language row's M-RoPE delta when it decodes (models/vision/qwen_vl.py).
    image_blocks [B, T] (Gemma 3 multimodal, `image_blocks_of`): each token's image (-1: not an image token); a query
    also sees every later key of its own image (transformers' OR(causal, same image), then the window and padding).
    With a cache they are the T tokens written now: an image is never split between two calls (models/vision)."""
    b, t = attention_mask.shape
    if branch_ids is not None and (segment_ids is None or positions is None):
        raise ValueError("branch_ids (shared-prompt packing) need segment_ids and explicit positions")
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("segment_ids (packed sequences) cannot be combined with a KV cache")
        if positions is None:
            positions = segment_positions(segment_ids)
    mask = attention_mask.astype(jnp.int32)
    if cache is None:
        write_index = jnp.int32(0)
        slot_mask, new_mask = mask, None
    else:
        write_index = cache["index"]
        slot_mask = new_mask = lax.dynamic_update_slice(cache["mask"], mask, (0, write_index))
    if positions is None:
        valid_upto = lax.dynamic_slice(jnp.cumsum(slot_mask, axis=1), (0, write_index), (b, t))
        positions = jnp.maximum(valid_upto - 1, 0)
        if position_offset is not None:
            positions = positions + position_offset[:, None].astype(positions.dtype)
    q_slot = write_index + jnp.arange(t, dtype=jnp.int32)
    k_slot = jnp.arange(slot_mask.shape[1], dtype=jnp.int32)
    visible = k_slot[None, :] <= q_slot[:, None]
    if image_blocks is not None:  # [B, T, S]: and the keys of the query's own image
        key_blocks = lax.dynamic_update_slice(jnp.full(slot_mask.shape, -1, jnp.int32),
                                              image_blocks.astype(jnp.int32), (0, write_index))
        visible = visible[None] | ((image_blocks[:, :, None] >= 0) & (image_blocks[:, :, None] == key_blocks[:, None]))
    if cfg.sliding_window is not None and not cfg.mixed_windows:  # mixed: `window_mask` per local layer
        visible &= window_mask(cfg, write_index, t, slot_mask.shape[1], segment_ids, branch_ids)
    allowed = (visible if visible.ndim == 3 else visible[None]) & (slot_mask[:, None, :] > 0)
    if segment_ids is not None:
        allowed &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if branch_ids is not None:
        allowed &= (branch_ids[:, None, :] == 0) | (branch_ids[:, :, None] == branch_ids[:, None, :])
    return positions, allowed, write_index, new_mask


def image_blocks_of(slots: Array) -> Array:
    """[B, T] int32: which image each image token (slots >= 0, `decoder_hidden`'s embeds) belongs to, numbered by
    runs of consecutive image tokens in a row; -1 elsewhere (transformers' block ids of Gemma 3's mask)."""
    is_image = slots >= 0
    before = jnp.concatenate([jnp.zeros_like(is_image[:, :1]), is_image[:, :-1]], axis=1)
    runs = jnp.cumsum((is_image & ~before).astype(jnp.int32), axis=1) - 1
    return jnp.where(is_image, runs, -1)


def sequence_index(segment_ids: Array, branch_ids: Array) -> Array:
    """[B, T] int32: each token's index in the sequence it belongs to, unpacked (the tokens of its segment it sees
    before it: the prompt's, then its own branch's), for shared-prompt packing (`attention_context`)."""
    t = segment_ids.shape[1]
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (
        (branch_ids[:, None, :] == 0) | (branch_ids[:, :, None] == branch_ids[:, None, :]))
    earlier = jnp.arange(t)[None, :] < jnp.arange(t)[:, None]
    return jnp.sum(same & earlier[None], axis=2, dtype=jnp.int32)


def window_mask(cfg: ModelConfig, write_index: Array, t: int, slots: int, segment_ids: Array | None = None,
                branch_ids: Array | None = None) -> Array:
    """[T, S] bool: key slot s is within the sliding window of query slot q (q - s < W). A model whose
    layers differ (`cfg.mixed_windows`) ANDs it into `allowed` on its local layers only. With shared-prompt packing
    (`branch_ids`, no cache) [B, T, T]: the distance is the unpacked sequence's (`sequence_index`), since a later
    response sits further from its prompt in the packed row than in its sequence."""
    assert cfg.sliding_window is not None
    if branch_ids is not None:
        assert segment_ids is not None
        index = sequence_index(segment_ids, branch_ids)
        return (index[:, :, None] - index[:, None, :]) < cfg.sliding_window
    q_slot = write_index + jnp.arange(t, dtype=jnp.int32)
    k_slot = jnp.arange(slots, dtype=jnp.int32)
    return (q_slot[:, None] - k_slot[None, :]) < cfg.sliding_window

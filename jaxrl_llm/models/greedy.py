"""Reference greedy decoding over the KV cache (tests, demo). The real sampler is `jaxrl_llm.sampler`.

Follows the calling convention in `jaxrl_llm.models.cache`: prefill the left-padded prompts, then
one token per step for a fixed number of steps (no early stop), all inside one jitted program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.cache import init_cache
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.model import forward_hidden, logits_from_hidden


@functools.partial(jax.jit, static_argnums=(1, 4), static_argnames=("compute_dtype",))
def greedy_generate(params: dict, cfg: ModelConfig, input_ids: jax.Array,
                    attention_mask: jax.Array, max_new_tokens: int, *,
                    compute_dtype: DType = jnp.float32, positions: jax.Array | None = None,
                    embeds: tuple[jax.Array, ...] | None = None,
                    position_offset: jax.Array | None = None) -> jax.Array:
    """[B, max_new_tokens] argmax continuations of left-padded prompts [B, P]. A vision-language prompt
    (models/vision/qwen_vl.py) passes its image features `embeds` and M-RoPE `positions` for the prefill and
    each row's delta `position_offset` [B] for the decode steps (`forward_hidden`)."""
    b, p = input_ids.shape
    cache = init_cache(cfg, b, p + max_new_tokens, compute_dtype)
    hidden, cache = forward_hidden(params, cfg, input_ids, attention_mask, cache=cache,
                                   compute_dtype=compute_dtype, positions=positions, embeds=embeds)
    first = jnp.argmax(logits_from_hidden(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, cache = carry
        hidden, cache = forward_hidden(params, cfg, token[:, None], jnp.ones((b, 1), jnp.int32),
                                       cache=cache, compute_dtype=compute_dtype, position_offset=position_offset)
        nxt = jnp.argmax(logits_from_hidden(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32)
        return (nxt, cache), token

    (_, _), tokens = lax.scan(step, (first, cache), None, length=max_new_tokens)
    return tokens.T

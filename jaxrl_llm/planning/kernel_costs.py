"""Costs the compiled count of a program cannot see, by formula: a kernel is a custom call XLA's cost analysis
does not look into, and a loop's body is counted once (planning/programs.py adds these to the programs'
counts)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxrl_llm.models import ModelConfig
from jaxrl_llm.planning.roofline import Cost
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.roles.forward import compute_dtype_of


def head_cost(cfg: ModelConfig, tokens: float, passes: int, dtype: str) -> Cost:
    """The fused log-prob head over `tokens` rows, `passes` vocab-sized matmuls each (1 forward; an update's
    backward adds the recomputed logits and the two gradients: 4): its vocabulary chunks run in a loop the
    compiled count holds once, and its TPU / GPU kernel is a custom call XLA does not count. Bytes: the
    unembedding read once per pass and 2048-row block (losses/logprob.py)."""
    unembedding = cfg.vocab_size * cfg.hidden_size
    blocks = max(1.0, tokens / 2048)
    return Cost(flops=2.0 * passes * tokens * unembedding,
                hbm_bytes=passes * blocks * unembedding * jnp.dtype(compute_dtype_of(dtype)).itemsize)


def invariant_attention_cost(cfg: ModelConfig, sequences: float, t: int, passes: int, dtype: str) -> Cost:
    """The batch-invariant attention kernel's work in `passes` causal forwards of `sequences` rows of t tokens
    (models/invariant_attention.py; zero without `model.batch_invariant`): a custom call the compiled count
    does not see. Per tile of query rows it reads the keys and values of the blocks it visits (about half the
    row under a causal mask) and its rows of the int8 token mask; q.k and p.v (two products: p's high and low
    halves) over the same keys."""
    if not cfg.batch_invariant:
        return Cost()
    from jaxrl_llm.models.invariant_attention import TPU_BLOCKS, gpu_blocks

    # as the kernel sees the heads: MLA attends in its absorbed form in the mode (one kv head of the latent and
    # the rope key, kv_lora_rank + head_dim wide, for every query head)
    kv_heads, width = cfg.cache_kv_heads, cfg.cache_head_dim
    rows, keys = TPU_BLOCKS if target_platform() == "tpu" else gpu_blocks(width)[:2]
    group = cfg.num_attention_heads // kv_heads
    visited = t / 2 + keys / 2  # keys a query tile walks, on average, under a causal mask
    tiles = group * -(-t // rows)  # query tiles per (row, kv head): each group's tokens in whole tiles
    kv_bytes = tiles * visited * 2 * width * jnp.dtype(compute_dtype_of(dtype)).itemsize
    mask_bytes = group * t * visited
    layers = cfg.num_hidden_layers  # the attending ones: a hybrid's full-attention layers only
    if not cfg.is_mla:
        layers = cfg.num_hidden_layers * cfg.attention_width / (cfg.num_attention_heads * cfg.head_dim)
    per_row = layers * (kv_heads * kv_bytes + mask_bytes)
    flops = 6.0 * layers * cfg.num_attention_heads * width * t * visited
    return Cost(flops=passes * sequences * flops, hbm_bytes=passes * sequences * per_row)

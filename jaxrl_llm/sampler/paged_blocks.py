"""The XLA paged-attention paths' building blocks, shared by the plain path
(sampler/paged_attention.py) and the cascade path (sampler/cascade_attention.py)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.numerics import softmax_terms
from jaxrl_llm.sampler.kv_bits import from_storage, scale_pair

Array = jax.Array
_BLOCK_TOKENS = 128  # keys per loop iteration (rounded to whole pages)


class BlockLayout(NamedTuple):
    """How the XLA loops walk a page table: `pages` pages (`tokens` keys) per iteration, `blocks`
    iterations covering the whole table."""

    pages: int
    blocks: int
    tokens: int


def block_layout(page_size: int, pages_per_slot: int) -> BlockLayout:
    ppb = max(1, min(pages_per_slot, _BLOCK_TOKENS // page_size))
    return BlockLayout(pages=ppb, blocks=-(-pages_per_slot // ppb), tokens=ppb * page_size)


def query_rows(q: Array, pool: FlatPool) -> Array:
    """q [slots, heads, head_dim] as [slots, kv heads, GQA group, head_dim]."""
    slots, nh, hd = q.shape
    return q.reshape(slots, pool.kv_heads, nh // pool.kv_heads, hd)


class FlatPool(NamedTuple):
    """A KV pool as the XLA path reads it: (kv head, page) flattened into one row axis per layer,
    so a block's gather itself yields the [rows, kv, keys, head_dim] layout both matmuls read
    (gathering [slots, pages, kv, ...] and transposing it was ~half of a decode step on CPU)."""

    k: Array  # [layers, kv * pages, page_size, head_dim]
    v: Array
    k_scales: Array | None  # [layers, kv * pages, page_size] fp32 (int8 pages) or None
    v_scales: Array | None
    layer: Array  # int32 scalar
    kv_heads: int
    num_pages: int
    page_size: int
    head_dim: int  # the queries' (a TPU pool stores it lane-padded: sampler/kv_bits.py)


def flat_pool(k_pages: Array, v_pages: Array, k_scales: Array | None, v_scales: Array | None,
              layer: Array | None, head_dim: int) -> FlatPool:
    """The contract's pages (one layer's, or the stacked pool with `layer`) as a `FlatPool` read by
    queries of `head_dim` (at most the pages' own, which may be lane-padded)."""
    k_pages, v_pages = jnp.asarray(k_pages), jnp.asarray(v_pages)
    scales = scale_pair(k_scales, v_scales)
    if layer is None:  # one layer's pages: a layer axis of 1
        k_pages, v_pages, layer = k_pages[None], v_pages[None], jnp.int32(0)
        if scales is not None:
            scales = (scales[0][None], scales[1][None])
    num_layers, nkv, num_pages, ps, hd = k_pages.shape
    if head_dim > hd:
        raise ValueError(f"paged attention: queries of head_dim {head_dim} do not fit pages {k_pages.shape}")
    rows = (num_layers, nkv * num_pages, ps)
    return FlatPool(k=k_pages.reshape(*rows, hd), v=v_pages.reshape(*rows, hd),
                    k_scales=None if scales is None else scales[0].reshape(rows),
                    v_scales=None if scales is None else scales[1].reshape(rows),
                    layer=jnp.asarray(layer, jnp.int32), kv_heads=nkv, num_pages=num_pages, page_size=ps,
                    head_dim=head_dim)


def gather_block(pool: FlatPool, name: str, ids: Array, compute_dtype: DType) -> Array:
    """K or V of the pages `ids` [R, ppb] for every kv head: [R, kv, ppb * page_size, pool.head_dim].
    int8 pages are dequantised here: K rounded to the compute dtype (as a caller-side
    dequantisation would store it), V kept in fp32."""
    pages, scales = (pool.k, pool.k_scales) if name == "k" else (pool.v, pool.v_scales)
    heads = jnp.arange(pool.kv_heads, dtype=jnp.int32)[None, :, None] * pool.num_pages
    flat = heads + ids[:, None, :]  # [R, kv, ppb] rows of the flattened pool
    blk = from_storage(pages[pool.layer, flat])  # [R, kv, ppb, ps, hd]; uint16 pools: sampler/kv_bits.py
    blk = blk[..., :pool.head_dim]  # a lane-padded pool's real head dim (a slice of the gathered block only)
    if scales is not None:
        blk = blk.astype(jnp.float32) * scales[pool.layer, flat][..., None]
        if name == "k":
            blk = blk.astype(compute_dtype)
    r, nkv, ppb = flat.shape
    return blk.reshape(r, nkv, ppb * pool.page_size, blk.shape[-1])


def attention_scores(q: Array, k: Array, softcap: float | None) -> Array:
    """fp32 scaled (and soft-capped) q.k scores [A, B, rows, keys] of q [A, B, rows, D] and k
    [A, B, keys, D], as the trainer's attention computes them (operands in their dtype, products
    and sums in fp32). Written as a product summed over D rather than a batched matmul: with a few
    query rows per (slot, kv head), XLA:CPU runs the batched matmul as thousands of tiny dots after
    copying out the gathered K block, while the product-and-sum is one loop that reads K straight
    from the pool (1.8x faster attention at 64 slots on SmolLM2; the same fp32 numbers here)."""
    products = q[:, :, :, None, :].astype(jnp.float32) * k[:, :, None, :, :].astype(jnp.float32)
    scores = jnp.sum(products, axis=-1) * (q.shape[-1] ** -0.5)
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def trainer_softmax(scores: Array, lengths: Array, sinks: Array | None = None) -> Array:
    """The trainer's softmax over a slot's key buffer [S, kv, g, keys], operation for operation
    (models/attention.py); empty slots (length 0) get all-zero probabilities. `sinks` fp32 [heads]:
    GPT-OSS's attention sinks, one more term of each row's denominator."""
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(scores.shape[1], scores.shape[2], 1)
    _, unnormalized, total = softmax_terms(scores, sink)
    probs = unnormalized / total
    return probs * (lengths > 0)[:, None, None, None]


def with_sinks(out: Array, lse: Array, sinks: Array | None) -> Array:
    """A normalised attention output [S, heads, D] (fp32) and its log-sum-exp [S, heads] (-inf: no key) with
    attention sinks (fp32 [heads]) joined to its denominator: out * Z / (Z + e^sink) = out * sigmoid(lse - sink).
    For the kernels whose online softmax returns the log-sum-exp (Pallas, cascade)."""
    if sinks is None:
        return out
    return out * jax.nn.sigmoid(lse - sinks.astype(jnp.float32))[..., None]

"""Blockwise attention: query chunks against key blocks, one (chunk, block) pair at a time, over the
pairs the mask lets see anything, with the results merged by log-sum-exp (the flash-attention
recurrence, in XLA). Memory: one chunk x block of scores, where a Python loop of chunks
(models/attention.py) lets XLA keep every chunk's scores alive at once.

Used by ring attention for each key / value block it holds (models/context_parallel.py), and by the
trainer's unsplit causal pass for long rows (`causal_blockwise_attend`, from `BLOCKWISE_MIN_TOKENS`).

The loops are `fori_loop`s of dynamic length over the chunks and blocks that see anything (a causal
chunk's keys end at its last row; a packed segment's start where it starts; a sliding window's
before it). They are not `lax.cond`s over every pair: inside the decoder's layer scan a cond in the
forward made reverse-mode keep every pair's scores (the custom VJP's forward is then linearized
with the scan). Pairs between two that see anything run too; their masked scores weigh nothing.

Layouts: chunked queries [n, B, size, heads, D] (`chunked`), head-major keys / values [B, kv, S, D],
masks [n, B, size, S], outputs [n, B, size, heads, D] fp32 and log-sum-exps [n, B, size, heads].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models.attention import (
    _chunk_grads,
    _forward,
    _group_queries,
    _ungroup,
    attend,
    chunk_bounds,
    sink_grads,
    token_major_lse,
)
from jaxrl_llm.models.numerics import MASKED_SCORE

Array = jax.Array
# the unsplit causal pass runs blockwise from this many tokens per row (shorter rows keep the static
# causal chunks of models/attention.py, which measured faster on CPU where their scores fit)
BLOCKWISE_MIN_TOKENS = 4096


def chunk_rows(t: int) -> int:
    """Rows per query chunk (and keys per block) of t: the causal chunks' size (models/attention.py
    `chunk_bounds`) where it divides t, else t (one chunk)."""
    size = chunk_bounds(t)[0][1]
    return size if t % size == 0 else t


def chunked(x: Array, size: int) -> Array:
    """[B, t, ...] -> [t / size, B, size, ...]."""
    b, t = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, t // size, size, *x.shape[2:]), 1, 0)


def unchunked(x: Array) -> Array:
    """[n, B, size, ...] -> [B, n * size, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def seen_range(seen: Array) -> tuple[Array, Array]:
    """[first, end) of the True entries of `seen` [n]; (0, 0) if there are none."""
    n = seen.shape[0]
    first = jnp.argmax(seen)
    end = jnp.where(jnp.any(seen), n - jnp.argmax(seen[::-1]), 0)
    return first, end


def _key_blocks_seen(mask: Array, block: int) -> tuple[Array, Array]:
    """The key blocks of `block` keys a chunk's mask [B, size, S] sees any of: [first, end)."""
    b, size, keys = mask.shape
    return seen_range(jnp.any(mask.reshape(b, size, keys // block, block), axis=(0, 1, 3)))


def _grouped_lse(lse: Array, nkv: int) -> Array:
    """[B, t, heads] -> [B, kv, g, t] (`_forward`'s layout)."""
    b, t, nh = lse.shape
    return lse.reshape(b, t, nkv, nh // nkv).transpose(0, 2, 3, 1)


def _keys(x: Array, j: Array, block: int) -> Array:
    return lax.dynamic_slice_in_dim(x, j * block, block, axis=2)


def blockwise_update(q_chunks: Array, k: Array, v: Array, masks: Array, out: Array, lse: Array, nkv: int,
                     softcap: float | None, block: int) -> tuple[Array, Array]:
    """The running (out, lse) of every query chunk merged with its attention over keys k / v [B, kv, S, D]
    in blocks of `block` keys (layouts: module doc)."""
    size = q_chunks.shape[2]
    chunk_any = jnp.any(masks, axis=(1, 2, 3))

    def chunk(c, acc):
        out, lse = acc
        mask = masks[c]

        def pair(j, running):
            out_c, lse_c = running
            part_out, part_lse = _forward(q_chunks[c], _keys(k, j, block), _keys(v, j, block),
                                          lax.dynamic_slice_in_dim(mask, j * block, block, axis=2), nkv, softcap)
            part_out, part_lse = _ungroup(part_out, size), token_major_lse(part_lse)
            merged = jnp.logaddexp(lse_c, part_lse)
            new = out_c * jnp.exp(lse_c - merged)[..., None] + part_out * jnp.exp(part_lse - merged)[..., None]
            return new, merged

        out_c, lse_c = lax.fori_loop(*_key_blocks_seen(mask, block), pair, (out[c], lse[c]))
        return out.at[c].set(out_c), lse.at[c].set(lse_c)

    return lax.fori_loop(*seen_range(chunk_any), chunk, (out, lse))


def blockwise_grads(q_chunks: Array, k: Array, v: Array, masks: Array, out: Array, lse: Array, d_out: Array,
                    nkv: int, softcap: float | None, block: int) -> tuple[Array, Array, Array]:
    """(dq [n, B, size, heads, D], dk, dv [B, kv, S, D]) fp32 of the attention over k / v against the
    final `out` / `lse` (the flash-attention backward per (chunk, block) pair that sees anything)."""
    chunk_any = jnp.any(masks, axis=(1, 2, 3))

    def chunk(c, acc):
        d_q, d_k, d_v = acc
        mask = masks[c]
        out_c, lse_c = _group_queries(out[c], nkv), _grouped_lse(lse[c], nkv)

        def pair(j, running):
            d_q_c, d_k, d_v = running
            dq, dk, dv = _chunk_grads(q_chunks[c], _keys(k, j, block), _keys(v, j, block),
                                      lax.dynamic_slice_in_dim(mask, j * block, block, axis=2), out_c, lse_c,
                                      d_out[c], nkv, softcap)
            d_k = lax.dynamic_update_slice_in_dim(d_k, _keys(d_k, j, block) + dk, j * block, axis=2)
            d_v = lax.dynamic_update_slice_in_dim(d_v, _keys(d_v, j, block) + dv, j * block, axis=2)
            return d_q_c + dq, d_k, d_v

        d_q_c, d_k, d_v = lax.fori_loop(*_key_blocks_seen(mask, block), pair, (d_q[c], d_k, d_v))
        return d_q.at[c].set(d_q_c), d_k, d_v

    init = (jnp.zeros(q_chunks.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return lax.fori_loop(*seen_range(chunk_any), chunk, init)


def empty_results(q_chunks: Array, sinks: Array | None = None) -> tuple[Array, Array]:
    """(out, lse) before any key: zeros and MASKED_SCORE (weight 0 in the first merge); with attention
    sinks (fp32 [heads]) the lse starts at the sink, a key of value zero merged like any other block."""
    out = jnp.zeros(q_chunks.shape, jnp.float32)
    if sinks is None:
        return out, jnp.full(q_chunks.shape[:4], MASKED_SCORE, jnp.float32)
    return out, jnp.broadcast_to(sinks.astype(jnp.float32), q_chunks.shape[:4])



# ---- the unsplit causal pass ----

def causal_attention(q: Array, k: Array, v: Array, allowed: Array, nkv: int, softcap: float | None,
                     sinks: Array | None = None, lookahead: int = 0) -> Array:
    """fp32 [B, T, heads, D] causal attention of a whole row (no cache, no split): blockwise from
    BLOCKWISE_MIN_TOKENS tokens (where the chunks split the row; its key blocks follow the mask), else the chunked
    attention, whose chunks reach `lookahead` keys past their last row (Gemma 3's images).
    `sinks`: fp32 [heads] attention sinks (GPT-OSS) or None."""
    t = q.shape[1]
    if t >= BLOCKWISE_MIN_TOKENS and chunk_rows(t) < t:
        return causal_blockwise_attend(q, k, v, allowed, sinks, nkv, softcap)
    return attend(q, k, v, allowed, nkv, causal=True, softcap=softcap, sinks=sinks,
                  lookahead=lookahead).reshape(q.shape)


def _causal_primal(q, k, v, allowed, sinks, nkv, softcap):
    return _causal_fwd(q, k, v, allowed, sinks, nkv, softcap)[0]


def _causal_fwd(q, k, v, allowed, sinks, nkv, softcap):
    size = chunk_rows(q.shape[1])
    q_chunks = chunked(q, size)
    out, lse = blockwise_update(q_chunks, k, v, chunked(allowed, size), *empty_results(q_chunks, sinks), nkv,
                                softcap, size)
    return unchunked(out), (q, k, v, allowed, sinks, out, lse)


def _causal_bwd(nkv, softcap, residuals, d_out):
    q, k, v, allowed, sinks, out, lse = residuals
    size = chunk_rows(q.shape[1])
    d_out = chunked(d_out.astype(jnp.float32), size)
    d_q, d_k, d_v = blockwise_grads(chunked(q, size), k, v, chunked(allowed, size), out, lse, d_out, nkv, softcap,
                                    size)
    d_sinks = None if sinks is None else sink_grads(sinks, out, lse, d_out).astype(sinks.dtype)
    return unchunked(d_q).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, d_sinks


causal_blockwise_attend = jax.custom_vjp(_causal_primal, nondiff_argnums=(5, 6))
causal_blockwise_attend.defvjp(_causal_fwd, _causal_bwd)
causal_blockwise_attend.__doc__ = """fp32 [B, T, heads, D] attention of q [B, T, heads, D] over head-major
k / v [B, kv, T, D] where `allowed` [B, T, T] (causal: a query sees no later key), blockwise (module doc)."""

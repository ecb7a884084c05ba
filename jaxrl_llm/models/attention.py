"""Grouped-query attention core of the decoder: fp32 scores and softmax, a hand-written backward,
and causal query chunks that skip the key blocks a chunk cannot see.

Backward (`jax.custom_vjp`): the forward keeps q, k, v, the mask, the fp32 output and one fp32
log-sum-exp per query row; the backward recomputes the scores and gets the probabilities in one
pass as exp(scores - lse), then dS = P * (dP - rowsum(dO * O)) (the flash-attention identity),
instead of replaying the softmax's max / sum / divide and differentiating each of them. Neither
direction keeps [B, heads, T, S] probabilities alive between the forward and the backward (the
activation memory of long rows), and each direction makes two fewer passes over the T x S
scores. Measured on SmolLM2 packed rows (4 x 512, CPU): the score passes were ~30% of a
forward+backward, most of it memory traffic of the fp32 score tensors.

One `custom_vjp` covers all chunks of a call, so its residuals hold q, k and v once (per-chunk
key prefixes as residuals would store k / v ~(chunks + 1) / 2 times per layer).

Causal chunks: without a KV cache (the trainer's full-sequence passes) the mask is causal, so a
query chunk [s, e) sees no key past e - 1. The queries run in static chunks, each over keys
[0, e) only: at T = 512 in chunks of 128 that is 10 of 16 key blocks, and each chunk's scores
are a quarter the size (they stay in cache). Results are unchanged for every query with at least
one visible key; a query with none (left padding) gets a uniform average over its chunk's keys
instead of over all keys, which nothing reads.

Attention sinks (GPT-OSS): a learned logit per query head that joins the softmax's denominator as a
key whose value is zero. It is one more term in the row's log-sum-exp, so the backward's
P = exp(scores - lse) is already right; the sink's own gradient is -sum over rows of
exp(sink - lse) * rowsum(dO * O) (dP for a zero value is 0).

Numerics (models/numerics.py): the forward is exactly the shared policy (fp32 scores, fp32
softmax with a finite mask value, `probs_times_values`); the backward's matmuls take
compute-dtype operands and accumulate in fp32, like the rest of the backward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.models import invariant
from jaxrl_llm.models.numerics import MASKED_SCORE, einsum_f32, probs_times_values, softmax_terms

Array = jax.Array
CAUSAL_CHUNK = 128  # query rows per chunk (the smallest; long rows use at most MAX_CHUNKS chunks)
MAX_CHUNKS = 8


def _group_queries(q: Array, nkv: int) -> Array:
    """[B, T, heads, D] -> [B, kv, g * T, D] (the g query heads of a kv head share its keys)."""
    b, t, nh, hd = q.shape
    return q.reshape(b, t, nkv, nh // nkv, hd).transpose(0, 2, 3, 1, 4).reshape(b, nkv, -1, hd)


def _ungroup(x: Array, t: int) -> Array:
    """[B, kv, g * T, D] -> [B, T, heads, D]."""
    b, nkv, gt, hd = x.shape
    return x.reshape(b, nkv, gt // t, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, -1, hd)


def _masked_scores(qg: Array, k: Array, allowed: Array, groups: int, softcap: float | None) -> Array:
    """fp32 scaled scores [B, kv, g, T, S] (soft-capped: cap * tanh(s / cap), Gemma 2), MASKED_SCORE
    where not allowed."""
    b, nkv, gt, hd = qg.shape
    scores = einsum_f32("bkqd,bksd->bkqs", qg, k).reshape(b, nkv, groups, gt // groups, -1) * (hd ** -0.5)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    return jnp.where(allowed[:, None, None], scores, MASKED_SCORE)


def _forward(q: Array, k: Array, v: Array, allowed: Array, nkv: int, softcap: float | None,
             sinks: Array | None = None) -> tuple[Array, Array]:
    b, t, nh, _ = q.shape
    scores = _masked_scores(_group_queries(q, nkv), k, allowed, nh // nkv, softcap)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(nkv, -1, 1, 1)  # [kv, g, 1, 1]
    peak, unnormalized, total = softmax_terms(scores, sink)
    probs = (unnormalized / total).reshape(b, nkv, -1, scores.shape[-1])
    out = probs_times_values("bkqs,bksd->bkqd", probs, v)  # fp32 [B, kv, g * T, D]
    lse = (peak + jnp.log(total))[..., 0]  # [B, kv, g, T]
    return out, lse


def sink_grads(sinks: Array, out: Array, lse: Array, d_out: Array) -> Array:
    """d(loss)/d(sinks) [heads] (fp32) from token-major fp32 out / d_out [..., heads, D] and lse [..., heads]:
    -sum over rows of exp(sink - lse) * rowsum(dO * O) (module doc)."""
    row_dot = jnp.sum(d_out * out, axis=-1)
    p_sink = jnp.exp(sinks.astype(jnp.float32) - lse)
    return -jnp.sum((p_sink * row_dot).reshape(-1, lse.shape[-1]), axis=0)


def token_major_lse(lse: Array) -> Array:
    """`_forward`'s lse [B, kv, g, t] -> [B, t, heads]."""
    b, nkv, g, t = lse.shape
    return lse.transpose(0, 3, 1, 2).reshape(b, t, nkv * g)


def _chunk_grads(q, k, v, allowed, out, lse, d_out, nkv, softcap):
    """(dq, dk, dv) of one query chunk: q [B, t, heads, D], k / v [B, kv, e, D], d_out fp32
    [B, t, heads, D]; `out` (fp32 [B, kv, g * t, D]) and `lse` [B, kv, g, t] from `_forward`."""
    b, t, nh, hd = q.shape
    cd = v.dtype
    qg = _group_queries(q, nkv)
    dog = _group_queries(d_out, nkv)  # fp32 [B, kv, g * t, D]
    scores = _masked_scores(qg, k, allowed, nh // nkv, softcap)
    probs = jnp.exp(scores - lse[..., None])  # [B, kv, g, t, e]; 0 where masked (unless the row is)
    d_probs = einsum_f32("bkqd,bksd->bkqs", dog.astype(cd), v).reshape(probs.shape)
    row_dot = jnp.sum(dog * out, axis=-1).reshape(lse.shape)[..., None]
    d_scores = probs * (d_probs - row_dot)
    if softcap is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2 (the masked scores left out: no overflow)
        capped = jnp.where(allowed[:, None, None], scores, 0.0)
        d_scores = d_scores * (1.0 - jnp.square(capped / softcap))
    # masked scores got no gradient in the forward's where(), fully masked rows included
    d_scores = jnp.where(allowed[:, None, None], d_scores, 0.0) * (hd ** -0.5)
    probs = probs.reshape(b, nkv, -1, probs.shape[-1]).astype(cd)
    d_scores = d_scores.reshape(probs.shape).astype(cd)
    d_v = einsum_f32("bkqs,bkqd->bksd", probs, dog.astype(cd))
    d_k = einsum_f32("bkqs,bkqd->bksd", d_scores, qg)
    d_q = _ungroup(einsum_f32("bkqs,bksd->bkqd", d_scores, k), t)
    return d_q, d_k, d_v


def _run_chunks(q, k, v, allowed, sinks, nkv, chunks, softcap):
    """Per chunk (s, e, keys): the grouped fp32 output and lse of queries [s, e) over keys [0, keys)."""
    return [_forward(q[:, s:e], k[:, :, :n], v[:, :, :n], allowed[:, s:e, :n], nkv, softcap, sinks)
            for s, e, n in chunks]


def _attend_chunks_primal(q: Array, k: Array, v: Array, allowed: Array, sinks: Array | None, nkv: int,
                          chunks: tuple[tuple[int, int, int], ...], softcap: float | None) -> Array:
    """fp32 [B, T, heads, D] attention of q [B, T, heads, D] over head-major k / v [B, kv, S, D],
    query chunks (start, end, keys) attending to keys [0, keys) only."""
    return _attend_chunks_fwd(q, k, v, allowed, sinks, nkv, chunks, softcap)[0]


def _attend_chunks_fwd(q, k, v, allowed, sinks, nkv, chunks, softcap):
    results = _run_chunks(q, k, v, allowed, sinks, nkv, chunks, softcap)
    out = jnp.concatenate([_ungroup(o, e - s) for (o, _), (s, e, _) in zip(results, chunks)], axis=1)
    # residuals: the inputs once (not per chunk), each chunk's fp32 output and lse
    return out, (q, k, v, allowed, sinks, [o for o, _ in results], [lse for _, lse in results])


def _attend_chunks_bwd(nkv, chunks, softcap, residuals, d_out):
    q, k, v, allowed, sinks, outs, lses = residuals
    d_out = d_out.astype(jnp.float32)
    d_q, d_k, d_v = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    d_sink_parts = []
    for (s, e, n), out, lse in zip(chunks, outs, lses):
        dq, dk, dv = _chunk_grads(q[:, s:e], k[:, :, :n], v[:, :, :n], allowed[:, s:e, :n], out, lse,
                                  d_out[:, s:e], nkv, softcap)
        d_q.append(dq)
        d_k, d_v = d_k.at[:, :, :n].add(dk), d_v.at[:, :, :n].add(dv)
        if sinks is not None:
            d_sink_parts.append(sink_grads(sinks, _ungroup(out, e - s), token_major_lse(lse), d_out[:, s:e]))
    d_q = jnp.concatenate(d_q, axis=1)
    d_sinks = None if sinks is None else jnp.sum(jnp.stack(d_sink_parts), axis=0).astype(sinks.dtype)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, d_sinks


_attend_chunks = jax.custom_vjp(_attend_chunks_primal, nondiff_argnums=(5, 6, 7))
_attend_chunks.defvjp(_attend_chunks_fwd, _attend_chunks_bwd)


def chunk_bounds(t: int) -> list[tuple[int, int]]:
    """Static [start, end) query chunks of a causal pass over t rows."""
    size = max(CAUSAL_CHUNK, -(-t // MAX_CHUNKS))
    return [(s, min(s + size, t)) for s in range(0, t, size)]


def causal_chunks(t: int, keys: int, causal: bool, lookahead: int = 0) -> tuple[tuple[int, int, int], ...]:
    """Static (start, end, keys seen) query chunks: causal (S == T), each over the keys up to its last row plus
    `lookahead` (an image's tokens see its later ones: Gemma 3); else one chunk over every key."""
    if causal and t == keys:
        return tuple((s, e, min(keys, e + lookahead)) for s, e in chunk_bounds(t))
    return ((0, t, keys),)


def attend(q: Array, k: Array, v: Array, allowed: Array, nkv: int, *, causal: bool,
           softcap: float | None = None, sinks: Array | None = None, lookahead: int = 0) -> Array:
    """Attention of q [B, T, heads, D] over head-major k / v [B, kv, S, D] where `allowed` [B, T, S];
    fp32 [B * T, heads, D]. `causal` (S == T, `allowed` implies key <= query + `lookahead`): run the queries in
    chunks, each over the keys up to its last row (+ lookahead) only. `softcap`: scores become cap * tanh(s / cap)
    (Gemma 2's attn_logit_softcapping). `sinks` fp32 [heads]: GPT-OSS's attention sinks (module doc)."""
    b, t, nh, hd = q.shape
    chunks = causal_chunks(t, k.shape[2], causal, lookahead)
    return _attend_chunks(q, k, v, allowed, sinks, nkv, chunks, softcap).reshape(b * t, nh, hd)


# ---- batch-invariant (models/invariant.py) ----

def _invariant_chunks_fwd(q, k, v, allowed, key_start, sinks, nkv, chunks, softcap):
    """`_attend_chunks_fwd` with each chunk's forward by `invariant.attend_blocks` over keys anchored at
    each row's first token; the residuals are `_attend_chunks_bwd`'s (the backward needs no invariance)."""
    b, t, nh, hd = q.shape
    g = nh // nkv
    k_anchored, v_anchored = invariant.anchor_keys(k, key_start, 2), invariant.anchor_keys(v, key_start, 2)
    allowed_anchored = invariant.anchor_keys(allowed, key_start, 2)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, nkv, g, 1)
    outs, lses = [], []
    for s, e, n in chunks:
        rows = e - s
        valid = allowed_anchored[:, None, s:e, :n]  # [B, 1, t, n]: one row per token of the g-major rows
        row_sink = None if sink is None else jnp.broadcast_to(sink, (1, nkv, g, rows)).reshape(1, nkv, g * rows)
        out, lse = invariant.attend_blocks(_group_queries(q[:, s:e], nkv), k_anchored[:, :, :n], v_anchored[:, :, :n],
                                           valid, row_sink, softcap, groups=g)
        outs.append(out)
        lses.append(lse.reshape(b, nkv, g, rows))
    out = jnp.concatenate([_ungroup(o, e - s) for o, (s, e, _) in zip(outs, chunks)], axis=1)
    return out, (q, k, v, allowed, sinks, outs, lses)


def _invariant_chunks_primal(q, k, v, allowed, key_start, sinks, nkv, chunks, softcap):
    return _invariant_chunks_fwd(q, k, v, allowed, key_start, sinks, nkv, chunks, softcap)[0]


def _invariant_chunks_bwd(nkv, chunks, softcap, residuals, d_out):
    d_q, d_k, d_v, _, d_sinks = _attend_chunks_bwd(nkv, chunks, softcap, residuals, d_out)
    return d_q, d_k, d_v, None, None, d_sinks


_invariant_chunks = jax.custom_vjp(_invariant_chunks_primal, nondiff_argnums=(6, 7, 8))
_invariant_chunks.defvjp(_invariant_chunks_fwd, _invariant_chunks_bwd)


def attend_invariant(q: Array, k: Array, v: Array, allowed: Array, key_start: Array, nkv: int, *, causal: bool,
                     softcap: float | None = None, sinks: Array | None = None, lookahead: int = 0) -> Array:
    """`attend` with the batch-invariant numerics (models/invariant.py): key blocks anchored at each row's
    first valid key slot `key_start` [B], so a token's output is the same bits whether it is computed in a
    training forward, a prefill or a decode step. fp32 [B * T, heads, D]; gradients as `attend`'s."""
    b, t, nh, hd = q.shape
    chunks = causal_chunks(t, k.shape[2], causal, lookahead)
    return _invariant_chunks(q, k, v, allowed, key_start, sinks, nkv, chunks, softcap).reshape(b * t, nh, hd)

"""The chunked-XLA backend of the fused log-prob and full KL: vocab chunks under `lax.scan`.

Never holds `[tokens, vocab]` logits: each chunk's logits are computed, folded into running
statistics (an online logsumexp) and dropped; the backward passes recompute them chunk by chunk.
`xla_stats` is the forward on CPU (and the fallback of the Pallas kernels), `xla_backward` the
backward on every backend; `kl_stats` / `kl_backward` do the same for the exact KL between two
heads. `Layout` and `Stats` are the contract every forward backend (`logprob_pallas.py`) shares.
The differentiable entry points live in `logprob.py`.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import invariant
from jaxrl_llm.models.numerics import cap_logits

Array = jax.Array


class Layout(NamedTuple):
    """Static settings of one fused call (hashable: passed as a non-differentiable argument)."""

    temperature: float
    chunk: int
    vocab_major: bool  # unembed is [V, H] (True) or [H, V] (False)
    with_entropy: bool
    softcap: float | None = None  # logits become cap * tanh(logits / cap) before the temperature (Gemma 2)


def cap_grad(dz: Array, z: Array, softcap: float | None, temperature: float) -> Array:
    """The gradient w.r.t. the raw logits h @ W of one w.r.t. z = cap_logits(raw)."""
    dz = dz / temperature
    if softcap is not None:  # d(cap * tanh(r / cap)) / dr = 1 - tanh^2, and tanh = z * T / cap
        dz = dz * (1.0 - jnp.square(z * (temperature / softcap)))
    return dz


def vocab_size(w: Array, vocab_major: bool) -> int:
    """V of an unembedding stored `[V, H]` (vocab_major) or `[H, V]`."""
    return w.shape[0] if vocab_major else w.shape[1]


def chunk_logits(h: Array, w: Array, start, size: int, lay: Layout) -> tuple[Array, Array]:
    """Logits of vocab ids [start, start+size) in fp32, and that weight slice."""
    if lay.vocab_major:
        wc = jax.lax.dynamic_slice_in_dim(w, start, size, axis=0)
        z = jnp.einsum("nh,ch->nc", h, wc, preferred_element_type=jnp.float32)
    else:
        wc = jax.lax.dynamic_slice_in_dim(w, start, size, axis=1)
        z = jnp.einsum("nh,hc->nc", h, wc, preferred_element_type=jnp.float32)
    return cap_logits(z, lay.softcap, lay.temperature), wc


def chunk_plan(vocab: int, chunk: int) -> tuple[int, int, int]:
    """(chunk size, number of full chunks, size of the last partial chunk or 0)."""
    chunk = min(chunk, vocab)
    return chunk, vocab // chunk, vocab % chunk


def over_vocab_chunks(update, state, vocab: int, chunk: int):
    """`update(state, start, size)` over the vocabulary's chunks: a `lax.scan` over the full ones,
    then the partial last one; returns the final state."""
    chunk, n_full, rem = chunk_plan(vocab, chunk)
    state, _ = jax.lax.scan(lambda st, i: (update(st, i * chunk, chunk), None), state, jnp.arange(n_full))
    return update(state, n_full * chunk, rem) if rem else state


def online_lse(m: Array, s: Array, z: Array) -> tuple[Array, Array]:
    """The running (max, sum of exp(z - max)) of an online logsumexp, with chunk logits z [N, C] added."""
    m_new = jnp.maximum(m, jnp.max(z, axis=-1))
    return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)


def chunk_grads(dz: Array, h: Array, wc: Array, vocab_major: bool) -> tuple[Array, Array]:
    """(dh [N, H], dW's chunk) of the chunk logits' gradient dz [N, C] (fp32), for the weight slice wc."""
    wc32, h32 = wc.astype(jnp.float32), h.astype(jnp.float32)
    if vocab_major:
        return jnp.einsum("nc,ch->nh", dz, wc32), jnp.einsum("nc,nh->ch", dz, h32)
    return jnp.einsum("nc,hc->nh", dz, wc32), jnp.einsum("nh,nc->hc", h32, dz)


class Stats(NamedTuple):
    """Per-token forward statistics every backend returns (the backward needs only these)."""

    lse: Array  # [N] logsumexp of the scaled logits
    target_logit: Array  # [N]
    mean_logit: Array  # [N] E_p[z] (zeros when entropy is off)


def xla_stats(h: Array, w: Array, targets: Array, lay: Layout) -> Stats:
    """Online logsumexp (+ E_p[z] for entropy) over vocab chunks with lax.scan."""
    n = h.shape[0]

    def update(state, start, size):
        m, s, a, tgt = state
        z, _ = chunk_logits(h, w, start, size, lay)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(z - m_new[:, None])
        s = s * scale + jnp.sum(e, axis=-1)
        if lay.with_entropy:
            a = a * scale + jnp.sum(e * z, axis=-1)
        hit = (jnp.arange(size)[None, :] + start) == targets[:, None]
        tgt = tgt + jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
        return m_new, s, a, tgt

    zeros = jnp.zeros((n,), jnp.float32)
    state = (jnp.full((n,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, a, tgt = over_vocab_chunks(update, state, vocab_size(w, lay.vocab_major), lay.chunk)
    return Stats(m + jnp.log(s), tgt, a / s if lay.with_entropy else zeros)


def xla_backward(h, w, targets, stats: Stats, g_lp, g_ent, lay: Layout, dw_into: Array | None = None):
    """Recompute each chunk's softmax and accumulate dh and dW (written chunk by chunk). `dw_into`
    (fp32, w's shape): add dW to it and return the fp32 sum (row blocks of one call share one dW)."""
    def update(carry, start, size):
        dh, dw = carry
        z, wc = chunk_logits(h, w, start, size, lay)
        p = jnp.exp(z - stats.lse[:, None])
        hit = (jnp.arange(size)[None, :] + start) == targets[:, None]
        dz = g_lp[:, None] * (hit.astype(jnp.float32) - p)
        if lay.with_entropy:
            dz = dz + g_ent[:, None] * p * (stats.mean_logit[:, None] - z)
        dz = cap_grad(dz, z, lay.softcap, lay.temperature)
        dh_chunk, dwc = chunk_grads(dz, h, wc, lay.vocab_major)
        dh = dh + dh_chunk
        axis = 0 if lay.vocab_major else 1
        if dw_into is not None:
            dwc = dwc + jax.lax.dynamic_slice_in_dim(dw, start, size, axis=axis)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dwc, start, axis=axis)
        return dh, dw

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32) if dw_into is None else dw_into)
    dh, dw = over_vocab_chunks(update, carry, vocab_size(w, lay.vocab_major), lay.chunk)
    return dh.astype(h.dtype), (dw if dw_into is not None else dw.astype(w.dtype))


# ---------------------------------------------------------------- full KL between two heads


class KLLayout(NamedTuple):
    """Static settings of one full-KL call (both heads share temperature and vocabulary)."""

    temperature: float
    chunk: int
    policy_vocab_major: bool
    ref_vocab_major: bool
    softcap: float | None = None  # both heads' final logit soft-cap (one model family)


def kl_chunk(hp, wp, hr, wr, start, size, lay: KLLayout):
    """Policy and reference logits of one vocab chunk, and the two weight slices."""
    zp, wpc = chunk_logits(hp, wp, start, size,
                           Layout(lay.temperature, size, lay.policy_vocab_major, False, lay.softcap))
    zq, wqc = chunk_logits(hr, wr, start, size, Layout(lay.temperature, size, lay.ref_vocab_major, False, lay.softcap))
    return zp, zq, wpc, wqc


def kl_stats(hp, wp, hr, wr, lay: KLLayout):
    """(KL(p || q), logsumexp_p, logsumexp_q, E_p[zp - zq]) per token, one pass over the chunks."""
    n = hp.shape[0]

    def update(state, start, size):
        mp, sp, a, mq, sq = state
        zp, zq, _, _ = kl_chunk(hp, wp, hr, wr, start, size, lay)
        mp_new = jnp.maximum(mp, jnp.max(zp, -1))
        scale = jnp.exp(mp - mp_new)
        e = jnp.exp(zp - mp_new[:, None])
        sp = sp * scale + jnp.sum(e, -1)
        a = a * scale + jnp.sum(e * (zp - zq), -1)
        mq, sq = online_lse(mq, sq, zq)
        return mp_new, sp, a, mq, sq

    zeros = jnp.zeros((n,), jnp.float32)
    ninf = jnp.full((n,), -jnp.inf, jnp.float32)
    state = (ninf, zeros, zeros, ninf, zeros)
    mp, sp, a, mq, sq = over_vocab_chunks(update, state, vocab_size(wp, lay.policy_vocab_major), lay.chunk)
    lse_p, lse_q = mp + jnp.log(sp), mq + jnp.log(sq)
    mean_diff = a / sp  # E_p[zp - zq]
    return mean_diff - lse_p + lse_q, lse_p, lse_q, mean_diff


def kl_backward(hp, wp, hr, wr, lse_p, lse_q, mean_diff, g, lay: KLLayout):
    """Gradients of sum(g * KL) w.r.t. both heads' hidden states and unembeddings, chunk by chunk."""
    def update(carry, start, size):
        dhp, dwp, dhr, dwr = carry
        zp, zq, wpc, wqc = kl_chunk(hp, wp, hr, wr, start, size, lay)
        p = jnp.exp(zp - lse_p[:, None])
        q = jnp.exp(zq - lse_q[:, None])
        # d KL / d zp = p (zp - zq - E_p[zp - zq]); d KL / d zq = q - p.
        dzp = cap_grad(g[:, None] * p * (zp - zq - mean_diff[:, None]), zp, lay.softcap, lay.temperature)
        dzq = cap_grad(g[:, None] * (q - p), zq, lay.softcap, lay.temperature)
        a, b = chunk_grads(dzp, hp, wpc, lay.policy_vocab_major)
        c, d = chunk_grads(dzq, hr, wqc, lay.ref_vocab_major)
        dwp = jax.lax.dynamic_update_slice_in_dim(dwp, b, start, axis=0 if lay.policy_vocab_major else 1)
        dwr = jax.lax.dynamic_update_slice_in_dim(dwr, d, start, axis=0 if lay.ref_vocab_major else 1)
        return dhp + a, dwp, dhr + c, dwr

    f32 = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    carry = (f32(hp), f32(wp), f32(hr), f32(wr))
    dhp, dwp, dhr, dwr = over_vocab_chunks(update, carry, vocab_size(wp, lay.policy_vocab_major), lay.chunk)
    return dhp.astype(hp.dtype), dwp.astype(wp.dtype), dhr.astype(hr.dtype), dwr.astype(wr.dtype)


def invariant_stats(h: Array, w: Array, targets: Array, lay: Layout) -> Stats:
    """`xla_stats` with the batch-invariant numerics (models/invariant.py): the vocabulary in the fixed
    chunks the sampler walks too (`invariant.vocab_scan`), each chunk's logits by the invariant matmul; a
    token's statistics do not depend on the other rows. `lay.chunk` is not used."""
    w_chunks, vocab = invariant.vocab_chunks(w, lay.vocab_major)

    def chunk_at(index: Array) -> Array:
        w_chunk = jax.lax.dynamic_index_in_dim(w_chunks, index, 0, keepdims=False)
        return cap_logits(invariant.matmul(h, w_chunk), lay.softcap, 1.0)

    # the sampler divides by its temperature knob, a traced value: so does this (vocab_scan's docstring)
    temperature = jax.lax.optimization_barrier(jnp.float32(lay.temperature))
    return Stats(*invariant.vocab_scan(chunk_at, h.shape[0], vocab, targets, temperature, lay.with_entropy))

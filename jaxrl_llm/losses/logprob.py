"""Fused token log-probs / entropy / full KL from hidden states, never holding [B, T, V] logits.

`token_logprobs` streams the vocabulary in chunks with an online logsumexp; its custom VJP
recomputes each chunk's logits in the backward pass, so peak memory is O(tokens x chunk) instead
of O(tokens x vocab). The forward statistics come from a Pallas kernel on GPU (Triton) and TPU
(Mosaic) and from the chunked-XLA scan on CPU; the backward is the chunked-XLA recompute on
every backend. All paths equal `log_softmax(hidden @ W / temperature)` and its gradients.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
DEFAULT_CHUNK = 2048
IMPLS = ("auto", "xla", "pallas_triton", "pallas_mosaic")


class Layout(NamedTuple):
    """Static settings of one fused call (hashable: passed as a non-differentiable argument)."""

    temperature: float
    chunk: int
    vocab_major: bool  # unembed is [V, H] (True) or [H, V] (False)
    with_entropy: bool


def _vocab_size(w: Array, vocab_major: bool) -> int:
    return w.shape[0] if vocab_major else w.shape[1]


def _resolve_vocab_major(hidden_size: int, unembed: Array, vocab_major: bool | None) -> bool:
    if unembed.ndim != 2:
        raise ValueError(f"unembed must be 2-D [H, V] or [V, H], got shape {unembed.shape}")
    if vocab_major is not None:
        expect = unembed.shape[1] if vocab_major else unembed.shape[0]
        if expect != hidden_size:
            raise ValueError(f"unembed {unembed.shape} does not match hidden size {hidden_size} "
                             f"with vocab_major={vocab_major}")
        return vocab_major
    rows_h, cols_h = unembed.shape[0] == hidden_size, unembed.shape[1] == hidden_size
    if rows_h and cols_h:
        raise ValueError(f"unembed {unembed.shape} is square: pass vocab_major=True ([V, H]) or False ([H, V])")
    if not (rows_h or cols_h):
        raise ValueError(f"unembed {unembed.shape} has no axis of hidden size {hidden_size}")
    return cols_h


def _chunk_logits(h: Array, w: Array, start, size: int, lay: Layout) -> tuple[Array, Array]:
    """Logits of vocab ids [start, start+size) in fp32, and that weight slice."""
    if lay.vocab_major:
        wc = jax.lax.dynamic_slice_in_dim(w, start, size, axis=0)
        z = jnp.einsum("nh,ch->nc", h, wc, preferred_element_type=jnp.float32)
    else:
        wc = jax.lax.dynamic_slice_in_dim(w, start, size, axis=1)
        z = jnp.einsum("nh,hc->nc", h, wc, preferred_element_type=jnp.float32)
    return z / lay.temperature, wc


def _chunk_plan(vocab: int, chunk: int) -> tuple[int, int, int]:
    chunk = min(chunk, vocab)
    return chunk, vocab // chunk, vocab % chunk


class Stats(NamedTuple):
    lse: Array  # [N] logsumexp of the scaled logits
    target_logit: Array  # [N]
    mean_logit: Array  # [N] E_p[z] (zeros when entropy is off)


def _xla_stats(h: Array, w: Array, targets: Array, lay: Layout) -> Stats:
    """Online logsumexp (+ E_p[z] for entropy) over vocab chunks with lax.scan."""
    n = h.shape[0]
    chunk, n_full, rem = _chunk_plan(_vocab_size(w, lay.vocab_major), lay.chunk)

    def update(state, start, size):
        m, s, a, tgt = state
        z, _ = _chunk_logits(h, w, start, size, lay)
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
    state, _ = jax.lax.scan(lambda st, i: (update(st, i * chunk, chunk), None), state, jnp.arange(n_full))
    if rem:
        state = update(state, n_full * chunk, rem)
    m, s, a, tgt = state
    return Stats(m + jnp.log(s), tgt, a / s if lay.with_entropy else zeros)


def _xla_backward(h, w, targets, stats: Stats, g_lp, g_ent, lay: Layout):
    """Recompute each chunk's softmax and accumulate dh and dW (written chunk by chunk)."""
    chunk, n_full, rem = _chunk_plan(_vocab_size(w, lay.vocab_major), lay.chunk)

    def update(carry, start, size):
        dh, dw = carry
        z, wc = _chunk_logits(h, w, start, size, lay)
        p = jnp.exp(z - stats.lse[:, None])
        hit = (jnp.arange(size)[None, :] + start) == targets[:, None]
        dz = g_lp[:, None] * (hit.astype(jnp.float32) - p)
        if lay.with_entropy:
            dz = dz + g_ent[:, None] * p * (stats.mean_logit[:, None] - z)
        dz = dz / lay.temperature
        if lay.vocab_major:
            dh = dh + jnp.einsum("nc,ch->nh", dz, wc.astype(jnp.float32))
            dwc = jnp.einsum("nc,nh->ch", dz, h.astype(jnp.float32))
        else:
            dh = dh + jnp.einsum("nc,hc->nh", dz, wc.astype(jnp.float32))
            dwc = jnp.einsum("nh,nc->hc", h.astype(jnp.float32), dz)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dwc, start, axis=0 if lay.vocab_major else 1)
        return dh, dw

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
    carry, _ = jax.lax.scan(lambda c, i: (update(c, i * chunk, chunk), None), carry, jnp.arange(n_full))
    if rem:
        carry = update(carry, n_full * chunk, rem)
    dh, dw = carry
    return dh.astype(h.dtype), dw.astype(w.dtype)


def _stats(h, w, targets, lay: Layout, impl: str, interpret: bool) -> Stats:
    if impl == "xla":
        return _xla_stats(h, w, targets, lay)
    from jaxrl_llm.losses import logprob_pallas

    return logprob_pallas.pallas_stats(h, w, targets, lay, kind=impl, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(h, w, targets, lay: Layout, impl: str, interpret: bool):
    st = _stats(h, w, targets, lay, impl, interpret)
    return st.target_logit - st.lse, st.lse - st.mean_logit


def _fused_fwd(h, w, targets, lay, impl, interpret):
    st = _stats(h, w, targets, lay, impl, interpret)
    return (st.target_logit - st.lse, st.lse - st.mean_logit), (h, w, targets, st)


def _fused_bwd(lay, impl, interpret, res, cotangents):
    h, w, targets, st = res
    g_lp, g_ent = cotangents
    dh, dw = _xla_backward(h, w, targets, st, g_lp, g_ent, lay)
    return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _pick_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"Unknown token_logprobs impl {impl!r}; valid names: {list(IMPLS)}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    return {"gpu": "pallas_triton", "tpu": "pallas_mosaic"}.get(backend, "xla")


def token_logprobs(hidden: Array, unembed: Array, targets: Array, *, temperature: float = 1.0,
                   return_entropy: bool = False, chunk_size: int | None = None,
                   vocab_major: bool | None = None, impl: str = "auto", interpret: bool = False):
    """log p(target) under `softmax(hidden @ W / temperature)` (and the entropy), fp32 `[B, T]`.

    `unembed` is `[H, V]` or `[V, H]` (tied embeddings), told apart by shape or `vocab_major`.
    Differentiable w.r.t. `hidden` and `unembed` (entropy too, for an entropy bonus).
    `impl`: "auto" (Triton on GPU, Mosaic on TPU, chunked XLA on CPU) or one explicitly;
    `interpret=True` runs a Pallas kernel in interpret mode (CPU tests).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    hidden_size = hidden.shape[-1]
    vm = _resolve_vocab_major(hidden_size, unembed, vocab_major)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {targets.shape} must match hidden {hidden.shape} without the last axis")
    lay = Layout(float(temperature), int(chunk_size or DEFAULT_CHUNK), vm, bool(return_entropy))
    lead = hidden.shape[:-1]
    lp, ent = _fused(hidden.reshape(-1, hidden_size), unembed, targets.reshape(-1).astype(jnp.int32),
                     lay, _pick_impl(impl), interpret)
    lp = lp.reshape(lead)
    return (lp, ent.reshape(lead)) if return_entropy else lp


# ---------------------------------------------------------------- full KL between two heads


class KLLayout(NamedTuple):
    temperature: float
    chunk: int
    policy_vocab_major: bool
    ref_vocab_major: bool


def _kl_chunk(hp, wp, hr, wr, start, size, lay: KLLayout):
    zp, wpc = _chunk_logits(hp, wp, start, size, Layout(lay.temperature, size, lay.policy_vocab_major, False))
    zq, wqc = _chunk_logits(hr, wr, start, size, Layout(lay.temperature, size, lay.ref_vocab_major, False))
    return zp, zq, wpc, wqc


def _kl_stats(hp, wp, hr, wr, lay: KLLayout):
    n = hp.shape[0]
    chunk, n_full, rem = _chunk_plan(_vocab_size(wp, lay.policy_vocab_major), lay.chunk)

    def update(state, start, size):
        mp, sp, a, mq, sq = state
        zp, zq, _, _ = _kl_chunk(hp, wp, hr, wr, start, size, lay)
        mp_new = jnp.maximum(mp, jnp.max(zp, -1))
        scale = jnp.exp(mp - mp_new)
        e = jnp.exp(zp - mp_new[:, None])
        sp = sp * scale + jnp.sum(e, -1)
        a = a * scale + jnp.sum(e * (zp - zq), -1)
        mq_new = jnp.maximum(mq, jnp.max(zq, -1))
        sq = sq * jnp.exp(mq - mq_new) + jnp.sum(jnp.exp(zq - mq_new[:, None]), -1)
        return mp_new, sp, a, mq_new, sq

    zeros = jnp.zeros((n,), jnp.float32)
    ninf = jnp.full((n,), -jnp.inf, jnp.float32)
    state = (ninf, zeros, zeros, ninf, zeros)
    state, _ = jax.lax.scan(lambda st, i: (update(st, i * chunk, chunk), None), state, jnp.arange(n_full))
    if rem:
        state = update(state, n_full * chunk, rem)
    mp, sp, a, mq, sq = state
    lse_p, lse_q = mp + jnp.log(sp), mq + jnp.log(sq)
    mean_diff = a / sp  # E_p[zp - zq]
    return mean_diff - lse_p + lse_q, lse_p, lse_q, mean_diff


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kl_fused(hp, wp, hr, wr, lay: KLLayout):
    return _kl_stats(hp, wp, hr, wr, lay)[0]


def _kl_fwd(hp, wp, hr, wr, lay):
    kl, lse_p, lse_q, mean_diff = _kl_stats(hp, wp, hr, wr, lay)
    return kl, (hp, wp, hr, wr, lse_p, lse_q, mean_diff)


def _kl_bwd(lay, res, g):
    hp, wp, hr, wr, lse_p, lse_q, mean_diff = res
    chunk, n_full, rem = _chunk_plan(_vocab_size(wp, lay.policy_vocab_major), lay.chunk)

    def grads_of(dz, h, wc, vocab_major):
        if vocab_major:
            return jnp.einsum("nc,ch->nh", dz, wc.astype(jnp.float32)), jnp.einsum("nc,nh->ch", dz, h.astype(jnp.float32))
        return jnp.einsum("nc,hc->nh", dz, wc.astype(jnp.float32)), jnp.einsum("nh,nc->hc", h.astype(jnp.float32), dz)

    def update(carry, start, size):
        dhp, dwp, dhr, dwr = carry
        zp, zq, wpc, wqc = _kl_chunk(hp, wp, hr, wr, start, size, lay)
        p = jnp.exp(zp - lse_p[:, None])
        q = jnp.exp(zq - lse_q[:, None])
        # d KL / d zp = p (zp - zq - E_p[zp - zq]); d KL / d zq = q - p.
        dzp = g[:, None] * p * (zp - zq - mean_diff[:, None]) / lay.temperature
        dzq = g[:, None] * (q - p) / lay.temperature
        a, b = grads_of(dzp, hp, wpc, lay.policy_vocab_major)
        c, d = grads_of(dzq, hr, wqc, lay.ref_vocab_major)
        dwp = jax.lax.dynamic_update_slice_in_dim(dwp, b, start, axis=0 if lay.policy_vocab_major else 1)
        dwr = jax.lax.dynamic_update_slice_in_dim(dwr, d, start, axis=0 if lay.ref_vocab_major else 1)
        return dhp + a, dwp, dhr + c, dwr

    f32 = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    carry = (f32(hp), f32(wp), f32(hr), f32(wr))
    carry, _ = jax.lax.scan(lambda c, i: (update(c, i * chunk, chunk), None), carry, jnp.arange(n_full))
    if rem:
        carry = update(carry, n_full * chunk, rem)
    dhp, dwp, dhr, dwr = carry
    return dhp.astype(hp.dtype), dwp.astype(wp.dtype), dhr.astype(hr.dtype), dwr.astype(wr.dtype)


_kl_fused.defvjp(_kl_fwd, _kl_bwd)


def token_kl_full(h_policy: Array, w_policy: Array, h_ref: Array, w_ref: Array, *, temperature: float = 1.0,
                  chunk_size: int | None = None, policy_vocab_major: bool | None = None,
                  ref_vocab_major: bool | None = None) -> Array:
    """Exact per-token KL(pi || ref) over the vocabulary, `[B, T]`, streamed over vocab chunks.

    Differentiable w.r.t. all four inputs (stop-gradient the reference side at the call site).
    """
    hs = h_policy.shape[-1]
    pvm = _resolve_vocab_major(hs, w_policy, policy_vocab_major)
    rvm = _resolve_vocab_major(h_ref.shape[-1], w_ref, ref_vocab_major)
    if _vocab_size(w_policy, pvm) != _vocab_size(w_ref, rvm):
        raise ValueError(f"policy and reference vocab sizes differ: {w_policy.shape} vs {w_ref.shape}")
    if h_policy.shape[:-1] != h_ref.shape[:-1]:
        raise ValueError(f"h_policy {h_policy.shape} and h_ref {h_ref.shape} must share [B, T]")
    lay = KLLayout(float(temperature), int(chunk_size or DEFAULT_CHUNK), pvm, rvm)
    lead = h_policy.shape[:-1]
    kl = _kl_fused(h_policy.reshape(-1, hs), w_policy, h_ref.reshape(-1, h_ref.shape[-1]), w_ref, lay)
    return kl.reshape(lead)

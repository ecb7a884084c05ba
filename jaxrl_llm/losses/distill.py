"""Distillation signals from a teacher model (`algorithm.distillation`; formulas in docs/algorithms.md).

reverse_kl (on-policy distillation): the student samples, the teacher scores the student's own
tokens, and each token's advantage is the negative per-token reverse KL estimate

    A_t = sum_{s >= t} discount^(s - t) * -(log pi(y_s) - log teacher(y_s))     (discount 0: A_t = -kl_t)

added to the task advantage with weight `coef` (roles/experience.py `mix_advantages`).

topk_forward_kl: at every response position the teacher's top-k tokens S_k and their log-probs
t_j; the student's log-probs s_j at the same ids (through the fused head, `topk_log_probs`); the
KL between the two distributions coarsened to the k tokens plus one "rest of the vocabulary" bucket

    KL_t = sum_j p_T(j) (t_j - s_j) + (1 - P_T) (log(1 - P_T) - log(1 - P_S)),   P = sum_j p(j)

which is >= 0, is 0 (with a zero gradient) when the student equals the teacher, and is the full
forward KL once k covers the vocabulary. Neither side ever holds [tokens, vocab] logits: both
stream the vocabulary in chunks (`losses/logprob_xla.py` chunk helpers).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.logprob_xla import (
    Layout,
    cap_grad,
    chunk_grads,
    chunk_logits,
    online_lse,
    over_vocab_chunks,
    vocab_size,
)

Array = jax.Array
SIGNALS = ("reverse_kl", "topk_forward_kl")
_TAIL_FLOOR = 1e-6  # the rest-of-vocabulary mass is floored here before its log (k ~ V, bf16 rounding)


def reverse_kl_advantages(log_probs: Array, teacher_log_probs: Array, response_mask: Array,
                          discount: float = 0.0) -> Array:
    """[N, R] per-token advantages -(log pi - log teacher) on sampled tokens, summed over later
    tokens with `discount` (0: each token's own); 0 outside `response_mask`."""
    signal = (teacher_log_probs - log_probs) * response_mask
    if discount == 0.0:
        return signal

    def step(later, x):
        total = x + discount * later
        return total, total

    _, out = jax.lax.scan(step, jnp.zeros(signal.shape[0], signal.dtype), signal.T, reverse=True)
    return out.T * response_mask


def topk_forward_kl(student_topk: Array, teacher_topk: Array) -> Array:
    """[...] the coarsened forward KL(teacher || student) of log-probs [..., k] at the teacher's
    top-k ids (module docstring); differentiable in `student_topk`."""
    p_teacher = jnp.exp(teacher_topk)
    mass_teacher, mass_student = p_teacher.sum(-1), jnp.exp(student_topk).sum(-1)
    tail_teacher = jnp.maximum(1.0 - mass_teacher, _TAIL_FLOOR)
    tail_student = jnp.maximum(1.0 - mass_student, _TAIL_FLOOR)
    head = jnp.sum(p_teacher * (teacher_topk - student_topk), axis=-1)
    return head + tail_teacher * (jnp.log(tail_teacher) - jnp.log(tail_student))


class TopK(NamedTuple):
    ids: Array  # int32 [..., k], the largest log-prob first
    log_probs: Array  # float32 [..., k]


def _layout(temperature: float, chunk: int, vocab_major: bool, softcap: float | None) -> Layout:
    return Layout(float(temperature), int(chunk), bool(vocab_major), False, None if softcap is None else float(softcap))


@functools.partial(jax.jit, static_argnames=("k", "temperature", "chunk", "vocab_major", "softcap"))
def teacher_topk(hidden: Array, unembed: Array, *, k: int, temperature: float = 1.0, chunk: int = 2048,
                 vocab_major: bool = True, softcap: float | None = None) -> TopK:
    """The k most likely tokens [M, k] and their log-probs under softmax(hidden @ W / temperature)
    for hidden [M, H], a running top-k merged chunk by chunk (no gradient: the teacher's side)."""
    lay = _layout(temperature, chunk, vocab_major, softcap)
    if k > vocab_size(unembed, vocab_major):
        raise ValueError(f"distillation topk={k} exceeds the vocabulary ({vocab_size(unembed, vocab_major)})")
    n = hidden.shape[0]

    def update(state, start, size):
        m, s, best, best_ids = state
        z, _ = chunk_logits(hidden, unembed, start, size, lay)
        m, s = online_lse(m, s, z)
        ids = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32) + start, z.shape)
        best, pick = jax.lax.top_k(jnp.concatenate([best, z], axis=1), k)
        best_ids = jnp.take_along_axis(jnp.concatenate([best_ids, ids], axis=1), pick, axis=1)
        return m, s, best, best_ids

    state = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
             jnp.full((n, k), -jnp.inf, jnp.float32), jnp.zeros((n, k), jnp.int32))
    m, s, best, best_ids = over_vocab_chunks(update, state, vocab_size(unembed, vocab_major), chunk)
    return TopK(best_ids, best - (m + jnp.log(s))[:, None])


def _gather_stats(h: Array, w: Array, ids: Array, lay: Layout) -> tuple[Array, Array]:
    """(logsumexp [M], the scaled logits at `ids` [M, k])."""
    n = h.shape[0]

    def update(state, start, size):
        m, s, picked = state
        z, _ = chunk_logits(h, w, start, size, lay)
        m, s = online_lse(m, s, z)
        local = ids - start
        inside = (local >= 0) & (local < size)
        values = jnp.take_along_axis(z, jnp.clip(local, 0, size - 1), axis=1)
        return m, s, jnp.where(inside, values, picked)

    state = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros(ids.shape, jnp.float32))
    m, s, picked = over_vocab_chunks(update, state, vocab_size(w, lay.vocab_major), lay.chunk)
    return m + jnp.log(s), picked


def _topk_primal(h, w, ids, lay: Layout):
    lse, picked = _gather_stats(h, w, ids, lay)
    return picked - lse[:, None]


def _topk_fwd(h, w, ids, lay):
    lse, picked = _gather_stats(h, w, ids, lay)
    return picked - lse[:, None], (h, w, ids, lse)


def _topk_bwd(lay: Layout, res, g):
    """d/dz of sum_j g_j (z_{id_j} - lse) = scatter(g) - (sum_j g_j) softmax(z), chunk by chunk."""
    h, w, ids, lse = res
    rows = jnp.arange(h.shape[0])[:, None]
    total = g.sum(-1)

    def update(carry, start, size):
        dh, dw = carry
        z, wc = chunk_logits(h, w, start, size, lay)
        dz = -total[:, None] * jnp.exp(z - lse[:, None])
        local = ids - start
        inside = (local >= 0) & (local < size)
        dz = dz.at[rows, jnp.clip(local, 0, size - 1)].add(jnp.where(inside, g, 0.0))
        dh_chunk, dwc = chunk_grads(cap_grad(dz, z, lay.softcap, lay.temperature), h, wc, lay.vocab_major)
        return dh + dh_chunk, jax.lax.dynamic_update_slice_in_dim(dw, dwc, start, axis=0 if lay.vocab_major else 1)

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
    dh, dw = over_vocab_chunks(update, carry, vocab_size(w, lay.vocab_major), lay.chunk)
    return dh.astype(h.dtype), dw.astype(w.dtype), None


_topk = jax.custom_vjp(_topk_primal, nondiff_argnums=(3,))
_topk.defvjp(_topk_fwd, _topk_bwd)


def topk_log_probs(hidden: Array, unembed: Array, ids: Array, *, temperature: float = 1.0, chunk: int = 2048,
                   vocab_major: bool = True, softcap: float | None = None) -> Array:
    """float32 [..., k] log-probs of `ids` [..., k] under softmax(hidden @ W / temperature) for
    hidden [..., H], streamed over vocab chunks; differentiable in `hidden` and `unembed` (the
    backward recomputes each chunk's softmax)."""
    lead, k = ids.shape[:-1], ids.shape[-1]
    if hidden.shape[:-1] != lead:
        raise ValueError(f"topk ids {ids.shape} must match hidden {hidden.shape} without the last axis")
    lay = _layout(temperature, chunk, vocab_major, softcap)
    out = _topk(hidden.reshape(-1, hidden.shape[-1]), unembed, ids.reshape(-1, k).astype(jnp.int32), lay)
    return out.reshape(*lead, k)

"""The online-softmax step both Pallas lowerings of paged decode attention run (sampler/paged_attention_pallas.py:
Triton; sampler/paged_attention_mosaic.py: Mosaic): one block of keys at a time, 2-D ops only, fp32 statistics."""
from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.platform.paged_kernels import visible_keys

# Finite (not -inf) so that exp(mask - max) is an exact 0 and no inf - inf NaN can appear.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def attend_block(q, k, v, k_scale, v_scale, start, length, carry, *, scale: float, softcap: float | None,
                  sliding_window: int | None, compute_dtype):
    """One online-softmax step over `block_tokens` keys starting at token position `start`.

    q, k, v: tuples of pieces along head_dim (the Triton variant splits a head_dim that is not a power of 2
    into power-of-2 pieces; the Mosaic one passes one piece): q [G, d], k / v [T, d] each; the scores are
    the sum of the pieces' dots. k_scale, v_scale [T, 1] fp32 or None (int8 pages, dequantised K is
    rounded to `compute_dtype`, the caller's q dtype, before the q.k product); carry (m [G, 1],
    l [G, 1], acc: a tuple of [G, d] pieces) in fp32. Works unchanged under the Triton and Mosaic
    lowerings: 2-D ops only, and the scales broadcast along lanes (no lane<->sublane relayout on TPU).
    """
    m_prev, l_prev, acc_prev = carry
    hp = lax.Precision.HIGHEST
    v = tuple(piece.astype(jnp.float32) for piece in v)
    if k_scale is not None:
        k = tuple((piece.astype(jnp.float32) * k_scale).astype(compute_dtype) for piece in k)
        v = tuple(piece * v_scale for piece in v)
    dots = [lax.dot_general(q_piece, k_piece.astype(q_piece.dtype), (((1,), (1,)), ((), ())), precision=hp,
                            preferred_element_type=jnp.float32) for q_piece, k_piece in zip(q, k, strict=True)]
    s = functools.reduce(operator.add, dots) * scale
    if softcap is not None:  # Gemma 2's attn_logit_softcapping, as the trainer's attention
        s = softcap * jnp.tanh(s / softcap)
    valid = visible_keys(start, length, sliding_window, s.shape)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # where(): a block with no visible key (m_new still MASK_VALUE) must add nothing.
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_new = tuple(alpha * acc + lax.dot_general(p, v_piece, (((1,), (0,)), ((), ())), precision=hp,
                                                  preferred_element_type=jnp.float32)
                    for acc, v_piece in zip(acc_prev, v, strict=True))
    return m_new, l_new, acc_new


def init_carry(rows: int, widths: tuple[int, ...]):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            tuple(jnp.zeros((rows, w), jnp.float32) for w in widths))


def finish(denom, acc):
    # Empty slot (length 0): nothing was attended, denom == 0 -> zeros (the contract's output).
    return jnp.where(denom > 0.0, acc / jnp.where(denom > 0.0, denom, 1.0), 0.0)


def log_sum_exp(m, denom):
    """log(sum exp(scores)) from the online-softmax max and sum; -inf for an empty row."""
    return jnp.where(denom > 0.0, m + jnp.log(jnp.where(denom > 0.0, denom, 1.0)), -jnp.inf)

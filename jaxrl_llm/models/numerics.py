"""The matmul numerics shared by the trainer's forward and every decode path (rollout/trainer parity).

Policy (docs/performance.md, "Rollout/trainer numerics"): operands in the compute dtype, products
accumulated AND returned in fp32, one rounding to the compute dtype where the next matmul consumes
the result. In bf16 the one exception is attention's probabilities x V: the probabilities stay
fp32, and are split into two bf16 terms (`hi + lo`, 16 significant bits) so that the product runs
as two bf16 x bf16 -> fp32 matmuls instead of one fp32 matmul. Why: bf16 x bf16 products are exact
in fp32 on every backend (CPU, GPU tensor cores, TPU MXU), while fp32 x fp32 matmuls are not
(TPU's default precision rounds fp32 operands to bf16; XLA CPU sums the tail rows of an fp32
matmul in another order than the others, so a one-token decode step and the same token inside a
full sequence differ). What remains is the kernels' summation order over the contraction: with
row-independent kernels a bf16 decode step and the trainer's forward are bit-identical
(tests/models/test_bf16_numerics.py); where a kernel's order depends on the number of rows, an
fp32 last-bit difference rounded to bf16 flips an activation (the floor in docs/performance.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models import invariant
from jaxrl_llm.models.precision import MASKED_SCORE as MASKED_SCORE
from jaxrl_llm.models.precision import einsum_f32 as einsum_f32
from jaxrl_llm.models.precision import probs_times_values as probs_times_values

Array = jax.Array


MATMUL_2D = (((1,), (0,)), ((), ()))  # [N, K] x [K, F]


def _last_by_first(ndim: int) -> tuple:
    """dot_general dimensions of x [..., K] x w [K, F] -> [..., F]."""
    return (((ndim - 1,), (0,)), ((), ()))


def matmul_f32(x: Array, w: Array) -> Array:
    """fp32 [..., F] = x [..., K] @ w [K, F]: compute-dtype operands, fp32 accumulation and result (every
    projection of models/decoder.py). The leading axes stay apart: merging a row axis and a token axis
    split over the mesh's 'context' axis into one would lose the token split (each device would run
    every row's tokens). bf16 operands also run the backward as bf16 matmuls
    (`matmul_low_precision_grads`); fp32 operands keep JAX's own gradient. Traced in the batch-invariant
    mode (models/invariant.py), a row's sums do not depend on the other rows."""
    if invariant.enabled():
        return invariant_matmul(x, w.astype(x.dtype))
    if x.dtype != w.dtype or x.dtype == jnp.float32:
        return _matmul_f32(x, w, _last_by_first(x.ndim))
    return matmul_low_precision_grads(x, w)


def _matmul_f32(a: Array, b: Array, dims) -> Array:
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


@jax.custom_vjp
def matmul_low_precision_grads(x: Array, w: Array) -> Array:
    """fp32 [..., F] = x [..., K] @ w [K, F] (both bf16, fp32 accumulation). Backward: the fp32 output
    cotangent is rounded to bf16 once, as mixed-precision training does (torch autocast's matmul
    outputs, hence its gradients, are bf16), so dx and dw are bf16 x bf16 matmuls with fp32
    accumulation; JAX's own transpose would multiply the fp32 cotangent by a bf16 operand, which XLA
    runs as an fp32 matmul (on a CPU with AMX ~5x slower than bf16)."""
    return _matmul_f32(x, w, _last_by_first(x.ndim))


def _low_residuals(x, w):
    # 2-D: keep x^T, so dw is a plain [K, N] x [N, F] matmul (XLA:CPU, models/decoder.py's docstring)
    return x.T if x.ndim == 2 else x, w


def _low_fwd(x, w):
    return _matmul_f32(x, w, _last_by_first(x.ndim)), _low_residuals(x, w)


def _low_bwd(residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = _matmul_f32(g, w, (((g.ndim - 1,), (1,)), ((), ())))  # [..., F] x [K, F] -> [..., K]
    if g.ndim == 2:  # x holds x^T [K, N]
        dw = _matmul_f32(x, g, MATMUL_2D)  # [K, N] x [N, F] -> [K, F]
    else:
        lead = tuple(range(x.ndim - 1))
        dw = _matmul_f32(x, g, ((lead, lead), ((), ())))  # [..., K] x [..., F] -> [K, F]
    return dx.astype(x.dtype), dw.astype(w.dtype)


matmul_low_precision_grads.defvjp(_low_fwd, _low_bwd)


@jax.custom_vjp
def invariant_matmul(x: Array, w: Array) -> Array:
    """`invariant.matmul` (the batch-invariant forward) with `matmul_low_precision_grads`'s backward."""
    return invariant.matmul(x, w)


invariant_matmul.defvjp(lambda x, w: (invariant.matmul(x, w), _low_residuals(x, w)), _low_bwd)


def softmax_terms(scores: Array, sink: Array | None = None) -> tuple[Array, Array, Array]:
    """(peak, exp(scores - peak), their sum) over the last axis of fp32 `scores`, as every attention path
    computes its softmax (probs = unnormalized / total, lse = peak + log total). `sink` (broadcastable against
    the [..., 1] peak): GPT-OSS's attention sink, one more term of the denominator (a key of value 0)."""
    peak = jnp.max(scores, axis=-1, keepdims=True)
    if sink is not None:
        peak = jnp.maximum(peak, sink)
    unnormalized = jnp.exp(scores - peak)
    total = jnp.sum(unnormalized, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - peak)
    return peak, unnormalized, total


def cap_logits(raw: jax.Array, softcap: float | None, temperature: float) -> jax.Array:
    """fp32 logits as the model's head gives them (soft-capped, Gemma 2's final_logit_softcapping),
    divided by the sampling temperature."""
    if softcap is not None:
        raw = softcap * jnp.tanh(raw / softcap)
    return raw / temperature

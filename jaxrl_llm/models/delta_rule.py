"""The gated delta rule (Qwen3.5 / Qwen3-Next's linear-attention layers, Gated DeltaNet, arXiv 2412.06464): a
fixed-size state per head S [Dk, Dv] that every token decays, corrects and reads,

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T (q_t / sqrt(Dk)),

with q / k L2-normalised per head, g_t <= 0 a log-decay and beta_t in (0, 1) a write strength. Two ways to
compute it, the same numbers up to fp32 rounding:

- `recurrent_delta_rule`: token by token (`lax.scan` over T): the definition, a one-token decode step, and the
  reference the tests hold the other to.
- `chunked_delta_rule`: the training form. The tokens are cut into chunks of C; inside a chunk the
  recurrence is solved at once (the WY / UT representation: with A = strictly-lower((beta k) k^T * decay),
  (I + A)^-1 turns the chunk's corrections into matmuls; the inverse itself by `unit_lower_inverse`, block
  doubling), and only the
  state crosses from chunk to chunk (`lax.scan` over T / C chunks). FLOPs grow with T x C, memory with one
  chunk's C x C blocks, the state carried between chunks: what transformers' `torch_chunk_gated_delta_rule` and
  the fla kernels compute. Its gradient is JAX's of these operations (the scan, the solve, the matmuls),
  checked against the recurrence's gradient in tests/models/test_delta_rule.py.

Packed rows (several sequences in one row): `starts` [B, T] marks each sequence's first token, where the state
restarts at zero. In the chunked form a token reads the incoming state only if no sequence starts in its chunk
at or before it, pairs of tokens interact only within one sequence, and only the chunk's last sequence writes
the outgoing state (and the incoming one survives only a chunk without a start).

Everything runs in fp32 (as transformers' reference does), matmuls at full precision (`_einsum`): the state is a sum
over the whole sequence.

Batch-invariant mode (models/invariant.py): the two forms round differently, so training, prefill and decoding
all run the recurrence, its state-times-vector sums and the L2 norms by `invariant.tree_sum` (an einsum's order
may follow the batch): a token's output is then the same bits in a training forward and a decode step, at the
cost of T sequential steps per layer in training. The training rule's backward is the chunked form's
(`invariant_delta_rule`): the backward needs no invariance, and the recurrence's own keeps a state per token.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.models import invariant

Array = jax.Array


# fp32 products at full precision: on a TPU an fp32 matmul rounds its operands to bf16 by default (and a GPU's may run
# TF32), which the chunk's inverse and the state's long sum cannot afford; these are small next to the projections
_einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
_dot = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """x / sqrt(sum x^2 + eps) over the last axis (fla's and transformers' l2norm)."""
    x = x.astype(jnp.float32)
    square_sum = invariant.tree_sum(x * x)[..., None] if invariant.enabled() else jnp.sum(x * x, -1, keepdims=True)
    return x * lax.rsqrt(square_sum + eps)


def _as_f32(*xs: Array) -> list[Array]:
    return [x.astype(jnp.float32) for x in xs]


def unit_lower_inverse(a: Array) -> Array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by recursive block doubling: with X the inverse of
    the diagonal blocks of size m and E the lower-left m x m block inside each 2m block, the 2m blocks' inverse
    is X - X E X ((I + X E)^-1 = I - X E, as (X E)^2 = 0). log2(C) levels of two C x C matmuls each: what the MXU /
    tensor cores run well, where a triangular solve is a sequential custom call on every backend (and XLA:CPU
    deadlocked 8-device programs that ran one inside a scan). Only true inverses of smaller blocks are
    multiplied, so it is as accurate as the substitution; the power series (I - A)(I + A^2)(I + A^4)..., the same
    matrix in exact arithmetic, loses everything to cancellation once keys are alike (A^n's entries grow
    binomially: 1e8 off with correlated keys in fp32)."""
    c = a.shape[-1]
    size = 1 << max(0, (c - 1).bit_length())  # a power of two: pad with an identity block
    if size != c:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, size - c), (0, size - c)])
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), a.shape)
    rows = np.arange(size)
    m = 1
    while m < size:
        block = rows // m
        lower_left = (block[:, None] == block[None, :] + 1) & (block[None, :] % 2 == 0)
        e = jnp.where(lower_left, a, 0.0)
        inverse = inverse - _dot(_dot(inverse, e), inverse)
        m *= 2
    return inverse[..., :c, :c]


def recurrent_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None = None,
                         starts: Array | None = None) -> tuple[Array, Array]:
    """(fp32 outputs [B, T, H, Dv], the final state [B, H, Dk, Dv]) of q / k [B, T, H, Dk] (L2-normalised, one per
    value head), v [B, T, H, Dv], log-decay g and beta [B, T, H], from `state` (None: zeros); `starts` [B, T]
    bool: the state restarts at zero at these tokens."""
    q, k, v, g, beta = _as_f32(q, k, v, g, beta)
    b, t, h, dk = k.shape
    s0 = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)
    q = q * dk ** -0.5
    restart = jnp.zeros((b, t), bool) if starts is None else starts
    read = _state_times if invariant.enabled() else functools.partial(_einsum, "bhkv,bhk->bhv")

    def step(s: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        q_t, k_t, v_t, g_t, beta_t, r_t = xs
        s = jnp.where(r_t[:, None, None, None], 0.0, s * jnp.exp(g_t)[..., None, None])
        delta = (v_t - read(s, k_t)) * beta_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, read(s, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, restart))
    final, out = lax.scan(step, s0, xs)
    return jnp.moveaxis(out, 0, 1), final


def _state_times(s: Array, x: Array) -> Array:
    """S^T x [B, H, Dv] of states s [B, H, Dk, Dv] and x [B, H, Dk], summed over Dk by a fixed tree."""
    return invariant.tree_sum(s * x[..., :, None], axis=2)


def chunk_terms(q: Array, k: Array, v: Array, beta: Array, cum: Array, began: Array) -> tuple[Array, Array, Array]:
    """The chunks' parallel part: q / k [..., C, Dk] (q scaled), v [..., C, Dv], beta, the cumulative log-decay
    and the sequence starts so far (float) [..., C] -> (the corrected values before the incoming state's share
    [..., C, Dv], the keys that read the incoming state [..., C, Dk], the causal decayed q k^T [..., C, C])."""
    c = q.shape[-2]
    same = began[..., :, None] == began[..., None, :]  # one sequence
    causal = jnp.tril(jnp.ones((c, c), bool))
    pair = jnp.where(causal & same, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    decay = jnp.exp(pair)  # exp(sum of g over (j, i]) for j <= i of one sequence, else 0
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = _einsum("...ik,...jk->...ij", k_beta, k) * decay
    system = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), system, 0.0)  # I + strictly lower
    inverse = unit_lower_inverse(system)
    seen = (began == 0).astype(jnp.float32)
    new_values = _einsum("...ij,...jd->...id", inverse, v_beta)
    k_cumdecay = _einsum("...ij,...jd->...id", inverse, k_beta * (jnp.exp(cum) * seen)[..., None])
    return new_values, k_cumdecay, _einsum("...ik,...jk->...ij", q, k) * decay


ChunkTerms = Callable[[Array, Array, Array, Array, Array, Array], tuple[Array, Array, Array]]


def chunked_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None = None,
                       starts: Array | None = None, chunk: int = 64, terms: ChunkTerms = chunk_terms
                       ) -> tuple[Array, Array]:
    """`recurrent_delta_rule`'s numbers in chunks of `chunk` tokens (module doc); T need not be a multiple of
    it (the tail is padded with tokens that neither decay nor write). `terms`: the chunks' parallel part,
    `chunk_terms` (XLA) or a kernel of the same numbers (models/delta_rule_pallas.py)."""
    q, k, v, g, beta = _as_f32(q, k, v, g, beta)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    restart = jnp.zeros((b, t), bool) if starts is None else starts.astype(bool)
    if pad:  # beta = 0: no write; g = 0: no decay; the final state is the last real token's
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
        restart = jnp.pad(restart, [(0, 0), (0, pad)])
    n = (t + pad) // chunk

    def chunks(x: Array) -> Array:  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = x.reshape(b, n, chunk, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v = chunks(q * dk ** -0.5), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [N, B, H, C]
    r = jnp.moveaxis(restart.reshape(b, n, chunk), 1, 0)[:, :, None, :]  # [N, B, 1, C]
    began = jnp.broadcast_to(jnp.cumsum(r, axis=-1), g.shape)  # sequence starts in the chunk at or before each token
    seen = (began == 0).astype(jnp.float32)  # reads the incoming state
    last = (began == began[..., -1:]).astype(jnp.float32)  # in the chunk's last sequence: writes the outgoing one
    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]
    new_values, k_cumdecay, intra = terms(q, k, v, beta, cum, began.astype(jnp.float32))
    q_state = q * (jnp.exp(cum) * seen)[..., None]
    k_state = k * (jnp.exp(cum[..., -1:] - cum) * last)[..., None]
    keep = jnp.exp(cum[..., -1]) * (began[..., -1] == 0)  # [N, B, H]: the incoming state survives the chunk

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(s: Array, xs: tuple[Array, ...]) -> tuple[Array, Array]:
        new_v, kcd, intra_c, q_c, k_c, keep_c = xs
        v_c = new_v - _einsum("bhck,bhkv->bhcv", kcd, s)
        out = _einsum("bhck,bhkv->bhcv", q_c, s) + _einsum("bhij,bhjv->bhiv", intra_c, v_c)
        s = s * keep_c[..., None, None] + _einsum("bhck,bhcv->bhkv", k_c, v_c)
        return s, out

    final, out = lax.scan(step, s0, (new_values, k_cumdecay, intra, q_state, k_state, keep))
    out = jnp.moveaxis(out, 0, 1)  # [B, N, H, C, Dv]
    out = jnp.moveaxis(out, 2, 3).reshape(b, n * chunk, h, dv)
    return out[:, :t], final


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _recurrence_chunked_gradient(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array, chunk: int,
                                 terms: ChunkTerms) -> tuple[Array, Array]:
    return recurrent_delta_rule(q, k, v, g, beta, starts=starts)


def _recurrence_forward(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array, chunk: int,
                        terms: ChunkTerms) -> tuple[tuple[Array, Array], tuple[Array, ...]]:
    return recurrent_delta_rule(q, k, v, g, beta, starts=starts), (q, k, v, g, beta, starts)


def _chunked_backward(chunk: int, terms: ChunkTerms, residuals: tuple[Array, ...],
                      cotangents: tuple[Array, Array]) -> tuple[Array | None, ...]:
    q, k, v, g, beta, starts = residuals
    _, pullback = jax.vjp(lambda *xs: chunked_delta_rule(*xs, starts=starts, chunk=chunk, terms=terms),
                          q, k, v, g, beta)
    return (*pullback(cotangents), None)


_recurrence_chunked_gradient.defvjp(_recurrence_forward, _chunked_backward)


def invariant_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array, *, chunk: int = 64,
                         terms: ChunkTerms = chunk_terms) -> tuple[Array, Array]:
    """Batch-invariant mode's training rule: `recurrent_delta_rule`'s outputs and final state (the bits a
    prefill or decode step gives) with `chunked_delta_rule`'s gradient. The backward needs no invariance, and
    the recurrence's own would keep every token's state for it: T x [B, H, Dk, Dv] per layer (gigabytes a layer
    for a real model's rows), where the chunked backward keeps one state per chunk."""
    return _recurrence_chunked_gradient(q, k, v, g, beta, starts.astype(bool), chunk, terms)

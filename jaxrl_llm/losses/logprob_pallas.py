"""Pallas forward kernels for the fused log-prob: Triton (GPU) and Mosaic (TPU).

Both compute, per token, the online logsumexp of `h @ W / temperature` over the vocabulary, the
target logit and (for entropy) E_p[z], without writing logits to memory. The backward pass is the
chunked-XLA recompute in `logprob_xla.py`. Both kernels run on CPU with `interpret=True` (tests).

- Triton: grid over token blocks; each program loops over vocab blocks (`fori_loop`), and for
  each vocab block over pieces of the hidden axis (an inner `fori_loop`, the matmul-kernel
  pattern): a [64, piece] slice of the hidden rows and a [piece, 128] slice of the unembedding
  per step, read from global memory. The piece is the largest power of two (Triton's arrays must
  have power-of-two sizes) dividing the hidden size, at most 64 (fp32) / 128 (16-bit), so the
  pipelined tiles stay far inside a GPU's shared memory (H100 / H200: 227 KiB per block) at any
  hidden size; holding all the rows' hidden pieces at once asked for 800 KiB at H = 896 (seen on
  an H200). Hidden sizes with no power-of-two divisor of 16 or more (tl.dot's least) use XLA.
- Mosaic: grid (token blocks, vocab blocks) with the vocab axis "arbitrary" (sequential): the
  running statistics live in the output blocks, which stay resident while the vocab axis
  advances (the flash-attention pattern on TPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_llm.losses.logprob_xla import Layout, Stats, cap_logits, vocab_size, xla_stats

TOKEN_BLOCK = 64
VOCAB_BLOCKS = (512, 256, 128)
TRITON_VOCAB_BLOCK = 128  # a [64, 128] fp32 logit tile per program and step
# the largest piece of the hidden axis per inner step, by operand bytes: the [64, piece] rows and the
# [piece, 128] unembedding slice take 48 KiB per pipeline stage either way
TRITON_HIDDEN_PIECE = {4: 64, 2: 128}
TRITON_MIN_PIECE = 16  # tl.dot's least contraction size
TRITON_STAGES = 3
KINDS = ("pallas_triton", "pallas_mosaic")


def hidden_piece(hidden: int, itemsize: int) -> int:
    """The Triton kernel's piece of the hidden axis: the largest power of two dividing `hidden`, at
    most TRITON_HIDDEN_PIECE[itemsize] (below TRITON_MIN_PIECE the kernel does not serve)."""
    largest = TRITON_HIDDEN_PIECE.get(itemsize, 64)
    return min(largest, hidden & -hidden)


def supports(vocab: int, hidden: int | None = None, itemsize: int = 4, kind: str = "pallas_mosaic") -> bool:
    """Whether the `kind` kernel serves this vocabulary (a block of VOCAB_BLOCKS divides it) and, for
    Triton, this hidden size (a power-of-two piece of at least TRITON_MIN_PIECE divides it)."""
    if _vocab_block(vocab) is None:
        return False
    return kind != "pallas_triton" or hidden is None or hidden_piece(hidden, itemsize) >= TRITON_MIN_PIECE


def _vocab_block(vocab: int) -> int | None:
    for block in VOCAB_BLOCKS:
        if vocab % block == 0:
            return block
    return None


def _block_update(state, z, targets, start, block_v, with_entropy):
    """One vocab block of the online logsumexp; `z` is [bn, bv] fp32, `targets` [bn, 1]."""
    m, s, a, tgt = state
    m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new)
    s = s * scale + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:
        a = a * scale + jnp.sum(e * z, axis=1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, z.shape, 1) + start
    tgt = tgt + jnp.sum(jnp.where(ids == targets, z, 0.0), axis=1, keepdims=True)
    return m_new, s, a, tgt


def _precision(dtype) -> jax.lax.Precision | None:
    """HIGHEST for fp32 operands when the run asks for full fp32 matmuls (`jax_default_matmul_precision`
    'highest' / 'float32', as the device tests do): a kernel's dot does not read that setting itself,
    and Triton would otherwise use TF32."""
    wanted = str(jax.config.jax_default_matmul_precision or "").lower()  # pyright: ignore[reportAttributeAccessIssue]
    full = wanted in ("highest", "float32", "precision.highest")
    return jax.lax.Precision.HIGHEST if full and jnp.dtype(dtype) == jnp.float32 else None


def _dot(h, w, lay: Layout):
    """fp32 h @ W (W stored [V, H] when vocab-major), at the run's fp32 matmul precision."""
    dims = (((1,), (1,)), ((), ())) if lay.vocab_major else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(h, w, dims, preferred_element_type=jnp.float32, precision=_precision(h.dtype))


def _logits(h, w, lay: Layout):
    return cap_logits(_dot(h, w, lay), lay.softcap, lay.temperature)


def _triton_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, tgt_ref, *, lay: Layout, block_v: int, n_blocks: int,
                   piece: int):
    targets = t_ref[...]
    bn = targets.shape[0]
    n_pieces = h_ref.shape[1] // piece

    def body(j, state):
        start = j * block_v

        def add_piece(k, z):  # one piece of the hidden axis: z += h[:, piece] @ W[piece, block]
            off = pl.multiple_of(k * piece, piece)
            h = h_ref[:, pl.ds(off, piece)]
            if lay.vocab_major:
                w = w_ref[pl.ds(start, block_v), pl.ds(off, piece)]
            else:
                w = w_ref[pl.ds(off, piece), pl.ds(start, block_v)]
            return z + _dot(h, w, lay)

        z = jax.lax.fori_loop(0, n_pieces, add_piece, jnp.zeros((bn, block_v), jnp.float32))
        return _block_update(state, cap_logits(z, lay.softcap, lay.temperature), targets, start, block_v,
                             lay.with_entropy)

    zeros = jnp.zeros((bn, 1), jnp.float32)
    init = (jnp.full((bn, 1), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, a, tgt = jax.lax.fori_loop(0, n_blocks, body, init)
    m_ref[...], s_ref[...], a_ref[...], tgt_ref[...] = m, s, a, tgt


def _mosaic_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, tgt_ref, *, lay: Layout, block_v: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        a_ref[...] = jnp.zeros(a_ref.shape, jnp.float32)
        tgt_ref[...] = jnp.zeros(tgt_ref.shape, jnp.float32)

    z = _logits(h_ref[...], w_ref[...], lay)
    state = (m_ref[...], s_ref[...], a_ref[...], tgt_ref[...])
    m, s, a, tgt = _block_update(state, z, t_ref[...], j * block_v, block_v, lay.with_entropy)
    m_ref[...], s_ref[...], a_ref[...], tgt_ref[...] = m, s, a, tgt


def pallas_stats(h, w, targets, lay: Layout, *, kind: str, interpret: bool = False) -> Stats:
    """Forward statistics with the `kind` ("pallas_triton" | "pallas_mosaic") kernel.

    Vocab sizes with no block in VOCAB_BLOCKS dividing them use the chunked-XLA path.
    """
    vocab = vocab_size(w, lay.vocab_major)
    block_v = _vocab_block(vocab)
    if not supports(vocab, h.shape[1], jnp.dtype(h.dtype).itemsize, kind) or block_v is None:
        return xla_stats(h, w, targets, lay)
    if kind == "pallas_triton":
        block_v = min(block_v, TRITON_VOCAB_BLOCK)
    n, hidden = h.shape
    bn = TOKEN_BLOCK
    n_pad = pl.cdiv(n, bn) * bn
    h_p = jnp.pad(h, ((0, n_pad - n), (0, 0)))
    t_p = jnp.pad(targets, (0, n_pad - n))[:, None]
    out_shape = [jax.ShapeDtypeStruct((n_pad, 1), jnp.float32)] * 4
    if kind == "pallas_triton":
        from jax.experimental.pallas import triton as plt

        grid = (n_pad // bn,)
        tok = pl.BlockSpec((bn, hidden), lambda i: (i, 0))
        col = pl.BlockSpec((bn, 1), lambda i: (i, 0))
        whole_w = pl.BlockSpec(w.shape, lambda i: (0, 0))
        kernel = functools.partial(_triton_kernel, lay=lay, block_v=block_v, n_blocks=vocab // block_v,
                                   piece=hidden_piece(hidden, jnp.dtype(h.dtype).itemsize))
        call = pl.pallas_call(kernel, grid=grid, in_specs=[tok, whole_w, col], out_specs=[col] * 4,
                              out_shape=out_shape, interpret=interpret,
                              compiler_params=plt.CompilerParams(num_warps=4, num_stages=TRITON_STAGES))
    elif kind == "pallas_mosaic":
        from jax.experimental.pallas import tpu as pltpu

        grid = (n_pad // bn, vocab // block_v)
        tok = pl.BlockSpec((bn, hidden), lambda i, j: (i, 0))
        col = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
        if lay.vocab_major:
            w_spec = pl.BlockSpec((block_v, hidden), lambda i, j: (j, 0))
        else:
            w_spec = pl.BlockSpec((hidden, block_v), lambda i, j: (0, j))
        kernel = functools.partial(_mosaic_kernel, lay=lay, block_v=block_v)
        call = pl.pallas_call(kernel, grid=grid, in_specs=[tok, w_spec, col], out_specs=[col] * 4,
                              out_shape=out_shape, interpret=interpret,
                              compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))
    else:
        raise ValueError(f"Unknown Pallas kernel kind {kind!r}; valid names: {list(KINDS)}")
    m, s, a, tgt = (x[:n, 0] for x in call(h_p, w, t_p))
    mean_logit = a / s if lay.with_entropy else jnp.zeros_like(s)
    return Stats(m + jnp.log(s), tgt, mean_logit)

"""The batch-invariant GEMM kernels (models/invariant.py `matmul`): every row and every column of x @ w summed in
one order, whatever the other rows and columns of the call.

- GPU: a Pallas (Triton) GEMM, blocks of GPU_BLOCKS (rows, columns), K summed in one sequential loop of pieces
  of at most 64 (no split-K); a width or K without whole pieces is padded with zeros (Triton masks no edge).
- TPU: a Pallas (Mosaic) GEMM, blocks of TPU_BLOCKS (128 rows for 128 or fewer), K the grid's last, sequential
  axis in pieces of 512 (or whole); the last column block of a width that is no multiple runs past the edge.
- CPU (and any other backend): `lax.map` over tiles of CPU_ROW_TILE rows, each one XLA dot of the same shape.

A column is computed in a block of one width whatever the matrix's, so a chip's share of the columns (the paged
engine's decode split by columns: engine/decode_layout.py) gets the bits the trainer's whole matrix gives it.
Each call carries a `pl.CostEstimate` (`_gemm_cost`): XLA's cost analysis then reports its FLOPs, and the TPU
plan counts its operands (planning/hbm_bytes.py).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

if TYPE_CHECKING:
    from jax.experimental.pallas import CostEstimate

Array = jax.Array

CPU_ROW_TILE = 8  # rows per XLA dot on CPU (bench/row_invariance.py: every tile shape measured row-invariant)
GPU_BLOCKS = (64, 64)  # the Triton GEMM's (rows, columns) per program; K in pieces of at most 64
TPU_BLOCKS = (256, 128)  # the Mosaic GEMM's (rows, columns) per program (128 rows for 128 or fewer); K in pieces
# of 512 (or whole)


def _dot(x: Array, w: Array) -> Array:
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def pad_rows(x: Array, multiple: int, least: int = 0) -> Array:
    """x with zero rows added along its first axis up to a multiple of `multiple` (and at least `least`)."""
    rows = max(-(-x.shape[0] // multiple) * multiple, least)
    return x if rows == x.shape[0] else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _xla_tiles(x: Array, w: Array) -> Array:
    """Fixed-shape tiles of CPU_ROW_TILE rows, one XLA dot each (at least two tiles: a loop of one trip is
    inlined, and its dot may then fuse into another kernel)."""
    n = x.shape[0]
    tiles = pad_rows(x, CPU_ROW_TILE, 2 * CPU_ROW_TILE).reshape(-1, CPU_ROW_TILE, x.shape[1])
    return lax.map(lambda tile: _dot(tile, w), tiles).reshape(-1, w.shape[1])[:n]


def _largest_block(size: int, most: int, least: int = 16) -> int:
    """The largest power of two in [least, most] dividing `size`, or 0."""
    block = most
    while block >= least:
        if size % block == 0:
            return block
        block //= 2
    return 0


def _gemm_cost(x: Array, w: Array, blocks: tuple[int, int, int]) -> CostEstimate:
    """The GEMM kernel's `pl.CostEstimate` for x [N, K] @ w [K, F] in (row, column, K) blocks, which XLA's cost
    analysis reports for the custom call (the plans' FLOPs; the TPU plan counts its bytes from the memory spaces
    of its operands: planning/hbm_bytes.py): every block's products; w read once per row block, x once per
    column block where K runs in pieces (its block changes along the K loop, so it is fetched again for the next
    column block), once where K is whole; the fp32 result written once."""
    from jax.experimental import pallas as pl

    (n, k), cols = x.shape, w.shape[1]
    bm, bn, bk = blocks
    row_blocks, col_blocks = -(-n // bm), -(-cols // bn)
    x_reads = col_blocks if bk < k else 1
    return pl.CostEstimate(flops=2 * row_blocks * bm * k * col_blocks * bn, transcendentals=0,
                           bytes_accessed=x.size * x.dtype.itemsize * x_reads
                           + w.size * w.dtype.itemsize * row_blocks + n * cols * 4)


def _triton_gemm(x: Array, w: Array, interpret: bool = False) -> Array:
    """GPU: a Pallas (Triton) GEMM with fixed blocks, each program summing K in one sequential loop."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    bm, bn = GPU_BLOCKS
    n, k = x.shape
    cols = w.shape[1]
    bk = _largest_block(k, 64)
    # every column in a program of bn columns, whatever the matrix's width (a vocabulary shard's too:
    # `vocab_split_logits`); Triton masks no edge, so a width or K without whole pieces is padded with zeros (exact)
    if bk == 0 or cols % bn:
        k_pad = (-k % 64) if bk == 0 else 0
        x, w = jnp.pad(x, ((0, 0), (0, k_pad))), jnp.pad(w, ((0, k_pad), (0, -cols % bn)))
        return _triton_gemm(x, w, interpret)[:, :cols]
    xp = pad_rows(x, bm)

    def kernel(x_ref, w_ref, o_ref):
        def piece(i, acc):
            off = pl.multiple_of(i * bk, bk)
            return acc + _dot(x_ref[:, pl.ds(off, bk)], w_ref[pl.ds(off, bk), :])
        o_ref[...] = lax.fori_loop(0, k // bk, piece, jnp.zeros((bm, bn), jnp.float32))

    out = pl.pallas_call(
        kernel, grid=(xp.shape[0] // bm, cols // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], cols), jnp.float32), interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=3), name="invariant_gemm",
        cost_estimate=_gemm_cost(xp, w, (bm, bn, bk)))(xp, w)
    return out[:n]


def _mosaic_gemm(x: Array, w: Array, interpret: bool = False) -> Array:
    """TPU: a Pallas (Mosaic) GEMM with fixed blocks; K is the grid's last, sequential axis, summed into the
    resident fp32 output block in order. Every column is computed in a block of TPU_BLOCKS[1] columns, whatever
    the width (the last block of a width that is no multiple runs past its edge: Mosaic drops what it writes
    there), so a vocabulary shard's columns (`vocab_split_logits`) are the full matrix's bits."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    most_m, most_n = TPU_BLOCKS
    n, k = x.shape
    cols = w.shape[1]
    # a decode step's rows (every slot of the mode's column split: engine/decode_layout.py) in one block where
    # they fit, so the weight is read once; a row's sum does not depend on the block's height
    bm = most_m if n > most_m // 2 else most_m // 2
    bn = most_n if cols > most_n else cols
    bk = 512 if k % 512 == 0 else k
    xp = pad_rows(x, bm)

    def kernel(x_ref, w_ref, o_ref):
        @pl.when(pl.program_id(2) == 0)
        def _init():
            o_ref[...] = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] += _dot(x_ref[...], w_ref[...])

    out = pl.pallas_call(
        kernel, grid=(xp.shape[0] // bm, pl.cdiv(cols, bn), k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, s: (i, s)), pl.BlockSpec((bk, bn), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], cols), jnp.float32), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        name="invariant_gemm", cost_estimate=_gemm_cost(xp, w, (bm, bn, bk)))(xp, w)
    return out[:n]


def matmul_2d(x: Array, w: Array) -> Array:
    """fp32 [N, F] = x [N, K] @ w [K, F] by the kernel of the platform the program is lowered for."""
    return lax.platform_dependent(x, w, cuda=_triton_gemm, tpu=_mosaic_gemm, default=_xla_tiles)


@functools.partial(jax.jit, static_argnames=("interpret",))
def gemm_for_tests(x: Array, w: Array, interpret: bool = True) -> tuple[Array, Array]:
    """(the Triton GEMM, the Mosaic GEMM) in Pallas's interpreter: their values on any backend."""
    return _triton_gemm(x, w, interpret), _mosaic_gemm(x, w, interpret)

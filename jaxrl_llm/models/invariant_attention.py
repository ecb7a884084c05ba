"""The batch-invariant attention's device kernels: `invariant.attend_blocks` on GPU (Pallas Triton) and TPU
(Pallas Mosaic); other backends run its blocked XLA form (models/invariant.py).

    out, lse = triton_attention(qg, k, v, valid, sink, softcap)   # or mosaic_attention(...)
    qg [B, kv, R, D] grouped query rows; k / v [B, kv, S, D] keys anchored at key 0 (`invariant.anchor_keys`);
    valid [B, kv or 1, R, S] bool; sink None or fp32 broadcastable to [B, kv, R]. fp32 out [B, kv, R, D] and
    lse [B, kv, R] (MASKED_SCORE for a row without a valid key: zeros out), as `attend_blocks`.

Why a row's bits do not depend on the call (a decode step of 8 slots, a chunked prefill, a training forward,
a packed row, a cache of any size): every call, on one backend, runs one kernel configuration, fixed per head
width (`gpu_blocks`, `TPU_BLOCKS`): one program holds a tile of ROWS query rows of one (batch row, kv head),
and walks the key blocks one after another from block 0 with the online softmax (`online_step`): the q.k and p.v
products of fixed tile shapes, their fp32 statistics. Only the tile's own rows enter a row's sums (a matrix
product's output row reads its own input row), and where the tile sits among the call's rows, or how many
tiles there are, changes no instruction. The walk visits the blocks from the tile's first to its last holding
a valid key (`visited_blocks`): a block without one adds exact zeros (p = 0, the running max unmoved, its
rescale exp(0) = 1), so skipping it gives the same bits as visiting it, and a decode step over a long cache
reads only the blocks up to its slot's length. A call's key count (the cache's size) only adds such blocks.

The online softmax here and the blocked XLA form's two passes round differently; they never meet: a program
built for a backend runs one of them on every path (`lax.platform_dependent`, by the lowering platform).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_llm.models.precision import MASKED_SCORE
from jaxrl_llm.shapes import head_pieces

Array = jax.Array

TPU_BLOCKS = (128, 128)  # (query rows, keys) per Mosaic program step: the MXU's 128 x 128
STAT_LANES = 128  # the Mosaic kernel's softmax statistics live in (rows, 128) tiles


def gpu_blocks(head_dim: int) -> tuple[int, int, int]:
    """(query rows, keys, warps) per Triton program for a (power-of-2) head width: fp32 accumulators of
    rows x head_dim in registers, a K and a V block of keys x head_dim in shared memory, double-buffered.
    Fixed per head width, so every call of a model runs one configuration."""
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 32, 32, 4
    return 16, 16, 8


def visited_blocks(valid: Array, rows: int, keys: int) -> tuple[Array, Array]:
    """int32 [B * tiles] first and one-past-last key block holding a valid key, per (batch row, tile of `rows`
    query rows), over every kv head; (0, 0) for a tile without one. `valid` [B, kv, R, S] with R a multiple
    of `rows` and S of `keys`."""
    b, nkv, r, s = valid.shape
    blocks = s // keys
    seen = valid.reshape(b, nkv, r // rows, rows, blocks, keys).any(axis=(1, 3, 5))  # [B, tiles, blocks]
    index = jnp.arange(blocks, dtype=jnp.int32)
    hi = jnp.max(jnp.where(seen, index + 1, 0), axis=-1)
    lo = jnp.where(hi > 0, jnp.min(jnp.where(seen, index, blocks), axis=-1), 0)
    return lo.reshape(-1).astype(jnp.int32), hi.reshape(-1).astype(jnp.int32)


def _precision(dtype) -> lax.Precision | None:
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def triton_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """The (offset, width) power-of-2 pieces the Triton kernels read a head of `head_dim` in (`shapes.head_pieces`
    of the width rounded up to 16, the rest read zero-padded): MLA's 576 -> 512 + 64, 40 -> 32 + 16, 128 -> 128."""
    return head_pieces(-(-head_dim // 16) * 16)


def online_step(q: Array, k: Array, v: Array, valid: Array, carry: tuple[Array, Array, Array], *, scale: float,
                softcap: float | None) -> tuple[Array, Array, Array]:
    """One online-softmax step of query rows q [rows, D] over one key block k / v [keys, D] where `valid`
    [rows, keys]; carry (max [rows, 1], sum [rows, 1], acc [rows, D]) fp32. 2-D ops only (Triton and
    Mosaic). p.v as the XLA path's `probs_times_values`: fp32 V one fp32 product; bf16 V two bf16
    products of p's high and low halves, added in fp32. `pieces_step` with one piece."""
    m, denom, (acc,) = pieces_step((q,), (k,), (v,), valid, (carry[0], carry[1], (carry[2],)), scale=scale,
                                   softcap=softcap)
    return m, denom, acc


def pieces_step(qs: tuple[Array, ...], ks: tuple[Array, ...], vs: tuple[Array, ...], valid: Array,
                carry: tuple[Array, Array, tuple[Array, ...]], *, scale: float, softcap: float | None
                ) -> tuple[Array, Array, tuple[Array, ...]]:
    """`online_step` with the head width in pieces (`triton_pieces`): q.k the pieces' products added in order,
    p.v one accumulator per piece."""
    m_prev, l_prev, accs = carry
    s = None
    for q, k in zip(qs, ks):
        part = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                               preferred_element_type=jnp.float32)
        s = part if s is None else s + part
    assert s is not None
    s = s * scale
    if softcap is not None:  # Gemma 2's attn_logit_softcapping
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid, s, MASKED_SCORE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # a block without a valid key adds exact zeros
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    dims = (((1,), (0,)), ((), ()))
    out = []
    for v, acc_prev in zip(vs, accs):
        if v.dtype == jnp.float32:
            pv = lax.dot_general(p, v, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        else:
            hi = p.astype(v.dtype)
            lo = (p - hi.astype(jnp.float32)).astype(v.dtype)
            pv = (lax.dot_general(hi, v, dims, preferred_element_type=jnp.float32)
                  + lax.dot_general(lo, v, dims, preferred_element_type=jnp.float32))
        out.append(alpha * acc_prev + pv)
    return m_new, l_new, tuple(out)


def online_init(rows: int, width: int, sink: Array | None) -> tuple[Array, Array, Array]:
    """The online softmax before any key: a sink is a key of score `sink` and a zero value."""
    if sink is None:
        m, denom = jnp.full((rows, 1), MASKED_SCORE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
    else:
        m, denom = sink, jnp.ones((rows, 1), jnp.float32)
    return m, denom, jnp.zeros((rows, width), jnp.float32)


def pieces_init(rows: int, widths: tuple[int, ...], sink: Array | None) -> tuple[Array, Array, tuple[Array, ...]]:
    """`online_init` with one accumulator per piece of the head width (`pieces_step`'s carry)."""
    m, denom, _ = online_init(rows, 1, sink)
    return m, denom, tuple(jnp.zeros((rows, width), jnp.float32) for width in widths)


def online_finish(m: Array, denom: Array, acc: Array) -> tuple[Array, Array]:
    seen = denom > 0.0
    safe = jnp.where(seen, denom, 1.0)
    return jnp.where(seen, acc / safe, 0.0), jnp.where(seen, m + jnp.log(safe), MASKED_SCORE)


# ---- the operands both lowerings take ----

class _Operands(NamedTuple):
    """The kernels' operands: qg [B, kv, tiles * rows, width]; k / v [B, kv, blocks * keys, width]; valid int8
    [B, kv or 1, mask_tiles * rows, blocks * keys]: query tile i reads mask tile i % mask_tiles (its visited
    blocks too: lo / hi [B * mask_tiles]); sink fp32 [B, kv, tiles * rows, 1] or None."""

    qg: Array
    k: Array
    v: Array
    valid: Array
    sink: Array | None
    lo: Array
    hi: Array
    mask_tiles: int
    unpad: Callable[[Array], Array]  # [B, kv, tiles * rows, ...] -> the caller's [B, kv, R, ...]


def _operands(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, groups: int, rows: int, keys: int,
              width: int) -> _Operands:
    """Padded with zeros to whole tiles (rows), key blocks (keys) and `width` lanes (exact in the products; the
    padded keys masked). `valid` holds a row per query row, or with `groups` > 1 one per token of the g-major
    rows (row = group * t + token, as `attend_blocks`' caller groups them): then, where t fills a tile, each
    group's rows are padded to whole tiles and every group's tiles read the one token mask (a g-fold smaller
    mask than repeating it); shorter rows (a decode step) repeat the mask and share tiles."""
    b, nkv, r, d = qg.shape
    t = r // groups
    s_pad = max(1, -(-k.shape[2] // keys)) * keys

    def pad(x: Array, *sizes: int) -> Array:
        return jnp.pad(x, [(0, 0)] * (x.ndim - len(sizes)) + [(0, n - m) for n, m in zip(sizes, x.shape[-len(sizes):])])

    sink = None if sink is None else jnp.broadcast_to(sink.astype(jnp.float32), (b, nkv, r))
    if groups > 1 and t >= rows:
        t_pad = -(-t // rows) * rows

        def by_group(x: Array) -> Array:  # [B, kv, g * t, ...] -> [B, kv, g * t_pad, ...]
            x = x.reshape(b, nkv, groups, t, *x.shape[3:])
            x = jnp.pad(x, [(0, 0)] * 3 + [(0, t_pad - t)] + [(0, 0)] * (x.ndim - 4))
            return x.reshape(b, nkv, groups * t_pad, *x.shape[4:])

        def unpad(x: Array) -> Array:
            x = x.reshape(b, nkv, groups, t_pad, *x.shape[3:])[:, :, :, :t]
            return x.reshape(b, nkv, r, *x.shape[4:])

        qg, sink, mask_rows = by_group(qg), None if sink is None else by_group(sink), t_pad
    else:
        if groups > 1:
            valid = jnp.tile(valid, (1, 1, groups, 1))
        r_pad = mask_rows = -(-r // rows) * rows
        qg = pad(qg, r_pad, d)
        sink = None if sink is None else pad(sink, r_pad)

        def unpad(x: Array) -> Array:
            return x[:, :, :r]

    valid = pad(valid, mask_rows, s_pad)
    lo, hi = visited_blocks(valid, rows, keys)
    return _Operands(pad(qg, qg.shape[2], width), pad(k, s_pad, width), pad(v, s_pad, width), valid.astype(jnp.int8),
                     None if sink is None else sink[..., None], lo, hi, mask_rows // rows, unpad)


# ---- Triton (GPU) ----

def _triton_kernel(lo_ref, hi_ref, *refs, pieces: int, keys: int, scale: float, softcap: float | None,
                   has_sink: bool):
    # refs: q, k and v pieces, the mask, [sink], then the out pieces and the lse
    q_refs, k_refs, v_refs = refs[:pieces], refs[pieces:2 * pieces], refs[2 * pieces:3 * pieces]
    valid_ref, rest = refs[3 * pieces], refs[3 * pieces + 1:]
    sink_ref, rest = (rest[0], rest[1:]) if has_sink else (None, rest)
    out_refs, lse_ref = rest[:pieces], rest[pieces]
    qs = tuple(ref[...] for ref in q_refs)
    rows = qs[0].shape[0]
    sink = sink_ref[...] if sink_ref is not None else None

    def block(j, carry):
        at = pl.multiple_of(j * keys, keys)
        return pieces_step(qs, tuple(ref[pl.ds(at, keys), :] for ref in k_refs),
                           tuple(ref[pl.ds(at, keys), :] for ref in v_refs), valid_ref[:, pl.ds(at, keys)] != 0,
                           carry, scale=scale, softcap=softcap)

    init = pieces_init(rows, tuple(q.shape[1] for q in qs), sink)
    m, denom, accs = lax.fori_loop(lo_ref[0], hi_ref[0], block, init)
    for ref, acc in zip(out_refs, accs):
        ref[...] = online_finish(m, denom, acc)[0]
    lse_ref[...] = online_finish(m, denom, accs[0])[1]


def triton_attention(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None,
                     groups: int = 1, interpret: bool = False) -> tuple[Array, Array]:
    """GPU: the module's kernel as a Pallas Triton call (grid: batch row, kv head, row tile; the key blocks a
    sequential loop inside the program). The head width is read in power-of-2 pieces (`triton_pieces`: Triton's
    blocks), each a block of the one zero-padded array; `groups`: `_operands`."""
    b, nkv, r, d = qg.shape
    offsets, pieces = zip(*triton_pieces(d))
    width = sum(pieces)
    rows, keys, warps = gpu_blocks(d)
    ops = _operands(qg, k, v, valid, sink, groups, rows, keys, width)
    tiles, s_pad, mask_tiles = ops.qg.shape[2] // rows, ops.k.shape[2], ops.mask_tiles
    per_kv = ops.valid.shape[1] > 1

    def tile_spec(last: int, at: int = 0):  # column block `at // last`: a piece starts at a multiple of its width
        return pl.BlockSpec((None, None, rows, last), lambda i, h, t: (i, h, t, at // last))

    def whole(last: int, at: int):
        return pl.BlockSpec((None, None, s_pad, last), lambda i, h, t: (i, h, 0, at // last))

    bound = pl.BlockSpec((1,), lambda i, h, t: (i * mask_tiles + lax.rem(t, mask_tiles),))
    mask = pl.BlockSpec((None, None, rows, s_pad), lambda i, h, t: (i, h if per_kv else 0, lax.rem(t, mask_tiles), 0))
    piece_specs = list(zip(pieces, offsets))
    in_specs = [bound, bound, *[tile_spec(p, at) for p, at in piece_specs], *[whole(p, at) for p, at in piece_specs],
                *[whole(p, at) for p, at in piece_specs], mask] + ([tile_spec(1)] if ops.sink is not None else [])
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        compiler_params = plt.CompilerParams(num_warps=warps, num_stages=2)
    kernel = functools.partial(_triton_kernel, pieces=len(pieces), keys=keys, scale=d ** -0.5, softcap=softcap,
                               has_sink=ops.sink is not None)
    n = len(pieces)
    *outs, lse = pl.pallas_call(
        kernel, grid=(b, nkv, tiles), in_specs=in_specs, out_specs=[*[tile_spec(p) for p in pieces], tile_spec(1)],
        out_shape=[*[jax.ShapeDtypeStruct(ops.qg.shape[:3] + (p,), jnp.float32) for p in pieces],
                   jax.ShapeDtypeStruct(ops.qg.shape[:3] + (1,), jnp.float32)],
        interpret=interpret, compiler_params=compiler_params, name="invariant_attention_triton",
    )(ops.lo, ops.hi, *[ops.qg] * n, *[ops.k] * n, *[ops.v] * n, ops.valid, *([] if ops.sink is None else [ops.sink]))
    out = outs[0] if n == 1 else jnp.concatenate(outs, axis=-1)
    return ops.unpad(out)[..., :d], ops.unpad(lse)[..., 0]


# ---- Mosaic (TPU) ----

def _mosaic_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, valid_ref, *refs, mask_tiles: int, scale: float,
                   softcap: float | None, has_sink: bool):
    sink_ref, out_ref, lse_ref, m_ref, l_ref, acc_ref = refs if has_sink else (None, *refs)
    tile = pl.program_id(0) * mask_tiles + lax.rem(pl.program_id(2), mask_tiles)
    j = pl.program_id(3)
    lo, hi = lo_ref[tile], hi_ref[tile]

    @pl.when(j == 0)
    def _start():
        m, denom, acc = online_init(q_ref.shape[0], q_ref.shape[1], sink_ref[...] if sink_ref is not None else None)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(jnp.logical_and(j >= lo, j < hi))  # the blocks outside add exact zeros (module doc)
    def _block():
        valid = valid_ref[...].astype(jnp.int32) != 0
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = online_step(q_ref[...], k_ref[...], v_ref[...], valid, carry,
                                                           scale=scale, softcap=softcap)

    @pl.when(j == pl.num_programs(3) - 1)
    def _end():
        out, lse = online_finish(m_ref[...], l_ref[...], acc_ref[...])
        out_ref[...] = out
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def mosaic_attention(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None,
                     groups: int = 1, interpret: bool = False) -> tuple[Array, Array]:
    """TPU: the module's kernel as a Pallas Mosaic call (grid: batch row, kv head, row tile, key block; the key
    blocks the grid's last, sequential axis, the online-softmax state in VMEM scratch). The per-tile
    first / last visited blocks are scalar-prefetched: a skipped step's K / V index is clamped into the
    visited range, so it starts no new DMA. `groups`: `_operands`."""
    from jax.experimental.pallas import tpu as pltpu

    b, nkv, r, d = qg.shape
    rows, keys = TPU_BLOCKS
    ops = _operands(qg, k, v, valid, sink, groups, rows, keys, d)
    tiles, blocks, mask_tiles = ops.qg.shape[2] // rows, ops.k.shape[2] // keys, ops.mask_tiles
    per_kv = ops.valid.shape[1] > 1

    def clamped(i, t, j, lo_ref, hi_ref):
        at = i * mask_tiles + lax.rem(t, mask_tiles)
        first = lo_ref[at]
        return jnp.minimum(jnp.maximum(j, first), jnp.maximum(hi_ref[at] - 1, first))

    def tile_spec(last: int):
        return pl.BlockSpec((None, None, rows, last), lambda i, h, t, j, *_: (i, h, t, 0))

    kv_spec = pl.BlockSpec((None, None, keys, d), lambda i, h, t, j, lo_ref, hi_ref:
                           (i, h, clamped(i, t, j, lo_ref, hi_ref), 0))
    mask = pl.BlockSpec((None, None, rows, keys), lambda i, h, t, j, lo_ref, hi_ref:
                        (i, h if per_kv else 0, lax.rem(t, mask_tiles), clamped(i, t, j, lo_ref, hi_ref)))
    in_specs = [tile_spec(d), kv_spec, kv_spec, mask] + ([tile_spec(1)] if ops.sink is not None else [])
    scratch = [pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
               pltpu.VMEM((rows, d), jnp.float32)]
    kernel = functools.partial(_mosaic_kernel, mask_tiles=mask_tiles, scale=d ** -0.5, softcap=softcap,
                               has_sink=ops.sink is not None)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(b, nkv, tiles, blocks),
                                               in_specs=in_specs, out_specs=[tile_spec(d), tile_spec(STAT_LANES)],
                                               scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct(ops.qg.shape, jnp.float32),
                   jax.ShapeDtypeStruct(ops.qg.shape[:3] + (STAT_LANES,), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False, name="invariant_attention_mosaic",
    )(ops.lo, ops.hi, ops.qg, ops.k, ops.v, ops.valid, *([] if ops.sink is None else [ops.sink]))
    return ops.unpad(out), ops.unpad(lse)[..., 0]

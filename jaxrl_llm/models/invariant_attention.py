"""The batch-invariant attention's device kernels: `invariant.attend_blocks` on GPU (Pallas Triton) and TPU
(Pallas Mosaic); other backends run its blocked XLA form (models/invariant.py).

    out, lse = triton_attention(qg, k, v, valid, sink, softcap)   # or mosaic_attention(...)
    qg [B, kv, R, D] grouped query rows; k / v [B, kv, S, D] keys anchored at key 0 (`invariant.anchor_keys`);
    valid [B, kv or 1, R, S] bool; sink None or fp32 broadcastable to [B, kv, R]. fp32 out [B, kv, R, D] and
    lse [B, kv, R] (MASKED_SCORE for a row without a valid key: zeros out), as `attend_blocks`.

Why a row's bits do not depend on the call (a decode step of 8 slots, a chunked prefill, a training forward,
a packed row, a cache of any size): every call, on one backend, runs one kernel configuration, fixed per head
width (`gpu_blocks`, `TPU_BLOCKS`): one program holds a tile of ROWS query rows of one (batch row, kv head),
and walks the key blocks one after another from block 0 with the online softmax (`_step`): the q.k and p.v
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
from jaxrl_llm.platform.paged_kernels import (
    MOSAIC_MAX_TABLE_ENTRIES,
    double_buffered_walk,
    visible_blocks,
    visible_keys,
)
from jaxrl_llm.shapes import next_power_of_two

Array = jax.Array

TPU_BLOCKS = (128, 128)  # (query rows, keys) per Mosaic program step: the MXU's 128 x 128
_LANES = 128  # the Mosaic kernel's softmax statistics live in (rows, 128) tiles


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


def _step(q: Array, k: Array, v: Array, valid: Array, carry: tuple[Array, Array, Array], *, scale: float,
          softcap: float | None) -> tuple[Array, Array, Array]:
    """One online-softmax step of query rows q [rows, D] over one key block k / v [keys, D] where `valid`
    [rows, keys]; carry (max [rows, 1], sum [rows, 1], acc [rows, D]) fp32. 2-D ops only (Triton and
    Mosaic). p.v as the XLA path's `probs_times_values`: fp32 V one fp32 product; bf16 V two bf16
    products of p's high and low halves, added in fp32."""
    m_prev, l_prev, acc_prev = carry
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_precision(q.dtype),
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:  # Gemma 2's attn_logit_softcapping
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid, s, MASKED_SCORE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # a block without a valid key adds exact zeros
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    dims = (((1,), (0,)), ((), ()))
    if v.dtype == jnp.float32:
        pv = lax.dot_general(p, v, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    else:
        hi = p.astype(v.dtype)
        lo = (p - hi.astype(jnp.float32)).astype(v.dtype)
        pv = (lax.dot_general(hi, v, dims, preferred_element_type=jnp.float32)
              + lax.dot_general(lo, v, dims, preferred_element_type=jnp.float32))
    return m_new, l_new, alpha * acc_prev + pv


def _init(rows: int, width: int, sink: Array | None) -> tuple[Array, Array, Array]:
    """The online softmax before any key: a sink is a key of score `sink` and a zero value."""
    if sink is None:
        m, denom = jnp.full((rows, 1), MASKED_SCORE, jnp.float32), jnp.zeros((rows, 1), jnp.float32)
    else:
        m, denom = sink, jnp.ones((rows, 1), jnp.float32)
    return m, denom, jnp.zeros((rows, width), jnp.float32)


def _finish(m: Array, denom: Array, acc: Array) -> tuple[Array, Array]:
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

def _triton_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, valid_ref, *refs, keys: int, scale: float,
                   softcap: float | None, has_sink: bool):
    sink_ref, out_ref, lse_ref = refs if has_sink else (None, *refs)
    q = q_ref[...]
    sink = sink_ref[...] if sink_ref is not None else None

    def block(j, carry):
        at = pl.multiple_of(j * keys, keys)
        return _step(q, k_ref[pl.ds(at, keys), :], v_ref[pl.ds(at, keys), :], valid_ref[:, pl.ds(at, keys)] != 0,
                     carry, scale=scale, softcap=softcap)

    m, denom, acc = lax.fori_loop(lo_ref[0], hi_ref[0], block, _init(q.shape[0], q.shape[1], sink))
    out_ref[...], lse_ref[...] = _finish(m, denom, acc)


def triton_attention(qg: Array, k: Array, v: Array, valid: Array, sink: Array | None, softcap: float | None,
                     groups: int = 1, interpret: bool = False) -> tuple[Array, Array]:
    """GPU: the module's kernel as a Pallas Triton call (grid: batch row, kv head, row tile; the key blocks a
    sequential loop inside the program). head_dim is read zero-padded to a power of 2 (Triton's blocks);
    `groups`: `_operands`."""
    b, nkv, r, d = qg.shape
    width = max(16, next_power_of_two(d))
    rows, keys, warps = gpu_blocks(width)
    ops = _operands(qg, k, v, valid, sink, groups, rows, keys, width)
    tiles, s_pad, mask_tiles = ops.qg.shape[2] // rows, ops.k.shape[2], ops.mask_tiles
    per_kv = ops.valid.shape[1] > 1

    def tile_spec(last: int):
        return pl.BlockSpec((None, None, rows, last), lambda i, h, t: (i, h, t, 0))

    whole = pl.BlockSpec((None, None, s_pad, width), lambda i, h, t: (i, h, 0, 0))
    bound = pl.BlockSpec((1,), lambda i, h, t: (i * mask_tiles + lax.rem(t, mask_tiles),))
    mask = pl.BlockSpec((None, None, rows, s_pad), lambda i, h, t: (i, h if per_kv else 0, lax.rem(t, mask_tiles), 0))
    in_specs = [bound, bound, tile_spec(width), whole, whole, mask] + ([tile_spec(1)] if ops.sink is not None else [])
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt
        compiler_params = plt.CompilerParams(num_warps=warps, num_stages=2)
    kernel = functools.partial(_triton_kernel, keys=keys, scale=d ** -0.5, softcap=softcap,
                               has_sink=ops.sink is not None)
    out, lse = pl.pallas_call(
        kernel, grid=(b, nkv, tiles), in_specs=in_specs, out_specs=[tile_spec(width), tile_spec(1)],
        out_shape=[jax.ShapeDtypeStruct(ops.qg.shape[:3] + (width,), jnp.float32),
                   jax.ShapeDtypeStruct(ops.qg.shape[:3] + (1,), jnp.float32)],
        interpret=interpret, compiler_params=compiler_params, name="invariant_attention_triton",
    )(ops.lo, ops.hi, ops.qg, ops.k, ops.v, ops.valid, *([] if ops.sink is None else [ops.sink]))
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
        m, denom, acc = _init(q_ref.shape[0], q_ref.shape[1], sink_ref[...] if sink_ref is not None else None)
        m_ref[...], l_ref[...], acc_ref[...] = m, denom, acc

    @pl.when(jnp.logical_and(j >= lo, j < hi))  # the blocks outside add exact zeros (module doc)
    def _block():
        valid = valid_ref[...].astype(jnp.int32) != 0
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = _step(q_ref[...], k_ref[...], v_ref[...], valid, carry, scale=scale,
                                                     softcap=softcap)

    @pl.when(j == pl.num_programs(3) - 1)
    def _end():
        out, lse = _finish(m_ref[...], l_ref[...], acc_ref[...])
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
                                               in_specs=in_specs, out_specs=[tile_spec(d), tile_spec(_LANES)],
                                               scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct(ops.qg.shape, jnp.float32),
                   jax.ShapeDtypeStruct(ops.qg.shape[:3] + (_LANES,), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False, name="invariant_attention_mosaic",
    )(ops.lo, ops.hi, ops.qg, ops.k, ops.v, ops.valid, *([] if ops.sink is None else [ops.sink]))
    return ops.unpad(out), ops.unpad(lse)[..., 0]


# ---- the paged engine's decode step: pages read in place ----
#
# The same `_step` on the same tile shapes as the kernels above (a slot's GQA group is its rows, padded to a
# tile), its key blocks assembled from the slot's pages in the pool (no gathered copy of the page table) and
# its mask made from the slot's length (and window) rather than read: the values are those of the kernels
# above given the gathered keys and the mask `pos < length` (`paged_supported` names the shapes it takes).

def paged_blocks(variant: str, head_dim: int) -> tuple[int, int]:
    """(query rows, keys) per program of `variant`'s kernel for queries of `head_dim`: the kernels' above."""
    return gpu_blocks(max(16, next_power_of_two(head_dim)))[:2] if variant == "triton" else TPU_BLOCKS


def paged_supported(variant: str, head_dim: int, pool_head_dim: int, page_size: int) -> bool:
    """Whether the paged kernel reads a pool of these shapes in place: a key block is whole pages, and (Triton) the
    head width a power of 2 the pool stores unpadded. Elsewhere the caller gathers the pages and runs the
    contiguous kernel (the same values)."""
    _, keys = paged_blocks(variant, head_dim)
    whole_pages = 0 < page_size <= keys and keys % page_size == 0
    if variant == "triton":
        return whole_pages and head_dim >= 16 and head_dim == next_power_of_two(head_dim) == pool_head_dim
    return whole_pages


class OnlineState(NamedTuple):
    """The online softmax between two key blocks, per query row: fp32 running max and sum [..., rows, w] (w = 1, or
    the Mosaic kernels' 128 lanes, every lane equal) and the unnormalised output acc [..., rows, D]. Carried
    between two calls exactly (stored fp32 as computed), so a walk split at a block boundary, its first blocks in
    one call and the rest in another, gives the bits of the unsplit walk: the cascade's shared prompt blocks
    (sampler/paged_attention.py `paged_decode_attention_invariant`)."""

    m: Array
    denom: Array
    acc: Array


def _split_refs(refs: tuple, has_sink: bool, has_state: bool):
    """(sink, (m0, l0, acc0) or None, outputs) of a paged kernel's refs after its fixed operands."""
    refs = list(refs)
    sink = refs.pop(0) if has_sink else None
    state = tuple(refs.pop(0) for _ in range(3)) if has_state else None
    return sink, state, refs


def _walk_start(lo, start, state_refs, rows: int, width: int, sink_ref):
    """The first block and the carry a paged kernel's walk starts from: the given state at block `start` (a
    cascade member, its blocks before `start` walked by the shared call), else block `lo` and `_init`."""
    if state_refs is None:
        return lo, _init(rows, width, sink_ref[...] if sink_ref is not None else None)
    m0, l0, acc0 = (ref[...] for ref in state_refs)
    return jnp.maximum(lo, start), (m0[:, :1], l0[:, :1], acc0)


def _write_result(out_refs, carry) -> None:
    """The walk's end: the normalised output, or (return_state) the carry itself for a later call."""
    if len(out_refs) == 1:
        out_refs[0][...] = _finish(*carry)[0]
        return
    for ref, value in zip(out_refs, carry):
        ref[...] = jnp.broadcast_to(value, ref.shape)


def _paged_triton_kernel(len_ref, table_ref, q_ref, k_ref, v_ref, *refs, pages_per_block: int, keys: int,
                         pages_per_head: int, tiles: int, window: int | None, scale: float, softcap: float | None,
                         has_sink: bool, has_state: bool):
    start_ref, refs = (refs[0], refs[1:]) if has_state else (None, refs)
    sink_ref, state_refs, out_refs = _split_refs(refs, has_sink, has_state)
    length = len_ref[0]
    offset = lax.div(pl.program_id(1), tiles) * pages_per_head  # this kv head's pages in the flattened pool
    q = q_ref[...]

    def block(j, carry):
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)] + offset
        k, v = (ref[pages].reshape(keys, q.shape[1]) for ref in (k_ref, v_ref))
        valid = visible_keys(j * keys, length, window, (q.shape[0], keys))
        return _step(q, k, v, valid, carry, scale=scale, softcap=softcap)

    lo, hi = visible_blocks(length, keys, window)
    lo, init = _walk_start(lo, None if start_ref is None else start_ref[0], state_refs, q.shape[0], q.shape[1],
                           sink_ref)
    _write_result(out_refs, lax.fori_loop(lo, hi, block, init))


def _paged_mosaic_kernel(len_ref, table_ref, *refs, pages_per_block: int, pages_per_slot: int, keys: int,
                         pages_per_head: int, tiles: int, window: int | None, scale: float, softcap: float | None,
                         has_sink: bool, has_state: bool):
    from jax.experimental.pallas import tpu as pltpu

    start_ref, refs = (refs[0], refs[1:]) if has_state else (None, refs)
    q_ref, k_hbm, v_hbm, *refs = refs
    sink_ref, state_refs, refs = _split_refs(tuple(refs), has_sink, has_state)
    *out_refs, k_buf, v_buf, sems = refs
    slot = pl.program_id(0)
    head = lax.div(pl.program_id(1), tiles)
    length = len_ref[slot]
    q = q_ref[...]
    width = q.shape[1]

    def copies(block, buf):
        out = []
        for i in range(pages_per_block):
            page = table_ref[slot * pages_per_slot + block * pages_per_block + i] + head * pages_per_head
            out += [pltpu.make_async_copy(src.at[page], dst.at[buf, i], sems.at[buf])
                    for src, dst in ((k_hbm, k_buf), (v_hbm, v_buf))]
        return out

    def block(j, buf, carry):
        # fp32 for the reshape (pages of any row packing merge as whole (8, 128) tiles), back to the pool's dtype
        # (exact) and to the queries' width (a lane-padded pool): the contiguous kernel's operands
        k, v = (b[buf].astype(jnp.float32).reshape(keys, b.shape[-1])[:, :width].astype(b.dtype)
                for b in (k_buf, v_buf))
        valid = visible_keys(j * keys, length, window, (q.shape[0], keys))
        return _step(q, k, v, valid, carry, scale=scale, softcap=softcap)

    lo, hi = visible_blocks(length, keys, window)
    lo, init = _walk_start(lo, None if start_ref is None else start_ref[slot], state_refs, q.shape[0], width,
                           sink_ref)
    _write_result(out_refs, double_buffered_walk(lo, hi, copies, block, init))


def paged_attention(q4: Array, k_pool: Array, v_pool: Array, lengths: Array, table: Array, *, layer: Array,
                    window: int | None, sink: Array | None, softcap: float | None, variant: str,
                    interpret: bool = False, start: Array | None = None, state: OnlineState | None = None,
                    return_state: bool = False) -> Array | OnlineState:
    """fp32 [slots, kv, g, D]: the decode step's attention of q4 [slots, kv, g, D] over the slots' pages of the
    pool [layers, kv, pages, page_size, D'] (layer `layer`; D' >= D: a TPU pool's lane padding), `lengths`
    [slots] keys each (0: zeros), `table` [slots, pages_per_slot]; `sink` fp32 [kv, g] or None. `variant`:
    'triton' or 'mosaic' (`paged_supported` must hold).

    A walk in two calls (the cascade): `return_state` returns the walk's `OnlineState` ([slots, kv, g, 1] and
    [slots, kv, g, D]) instead of its output, and a call given `state` (the sink already in it: pass no `sink`)
    and `start` [slots] continues each slot's walk from that state at block `start` (the blocks before it are
    the state's)."""
    slots, nkv, g, d = q4.shape
    layers, _, num_pages, page_size, pool_width = k_pool.shape
    rows, keys = paged_blocks(variant, d)
    per_block = keys // page_size
    tiles = -(-g // rows)
    lanes = 1 if variant == "triton" else _LANES  # the statistics' width in and out (`OnlineState`)

    def tile_rows(x: Array) -> Array:  # [slots, kv, g, ...] -> [slots, kv, tiles * rows, ...]
        return jnp.pad(x, ((0, 0), (0, 0), (0, tiles * rows - g)) + ((0, 0),) * (x.ndim - 3))

    q4 = tile_rows(q4)
    pages_per_slot = -(-table.shape[1] // per_block) * per_block  # whole blocks (the pad pages are masked)
    table = jnp.pad(table.astype(jnp.int32), ((0, 0), (0, pages_per_slot - table.shape[1])))
    table = table + layer.astype(jnp.int32) * (nkv * num_pages)  # rows of the flattened pool
    flat = [pool.reshape(layers * nkv * num_pages, page_size, pool_width) for pool in (k_pool, v_pool)]
    if sink is not None:
        sink = jnp.pad(sink.astype(jnp.float32).reshape(nkv, g), ((0, 0), (0, tiles * rows - g)))[..., None]
    lengths = lengths.astype(jnp.int32)
    has_state = state is not None
    state_in: list[Array] = []
    if state is not None:
        stats = [jnp.broadcast_to(x.astype(jnp.float32), (slots, nkv, g, lanes)) for x in (state.m, state.denom)]
        state_in = [tile_rows(x) for x in (*stats, state.acc.astype(jnp.float32))]
        start = jnp.zeros((slots,), jnp.int32) if start is None else start.astype(jnp.int32)
    common = dict(pages_per_block=per_block, keys=keys, pages_per_head=num_pages, tiles=tiles, window=window,
                  scale=d ** -0.5, softcap=softcap, has_sink=sink is not None, has_state=has_state)

    def head_tile(h):
        return lax.div(h, tiles), lax.rem(h, tiles)

    state_widths = (lanes, lanes, d) if has_state else ()
    out_widths = (lanes, lanes, d) if return_state else (d,)
    out_shape = [jax.ShapeDtypeStruct((*q4.shape[:3], w), jnp.float32) for w in out_widths]

    # the cascade's two calls named apart (their compiled programs are told apart by it)
    role = "_shared" if return_state else "_continued" if has_state else ""

    def results(outs: list[Array]) -> Array | OnlineState:
        outs = [x[:, :, :g] for x in outs]
        return OnlineState(outs[0][..., :1], outs[1][..., :1], outs[2]) if return_state else outs[0]

    if variant == "triton":
        def row_spec(width: int):
            return pl.BlockSpec((None, None, rows, width), lambda s, h: (s, *head_tile(h), 0))

        per_slot = pl.BlockSpec((1,), lambda s, h: (s,))
        pool_spec = pl.BlockSpec(flat[0].shape, lambda s, h: (0, 0, 0))
        in_specs = [per_slot, pl.BlockSpec((None, pages_per_slot), lambda s, h: (s, 0)), row_spec(d), pool_spec,
                    pool_spec]
        in_specs += [per_slot] if has_state else []
        in_specs += [pl.BlockSpec((None, rows, 1), lambda s, h: (*head_tile(h), 0))] if sink is not None else []
        in_specs += [row_spec(w) for w in state_widths]
        compiler_params = None
        if not interpret:
            from jax.experimental.pallas import triton as plt
            compiler_params = plt.CompilerParams(num_warps=gpu_blocks(d)[2], num_stages=2)
        outs = pl.pallas_call(
            functools.partial(_paged_triton_kernel, **common), grid=(slots, nkv * tiles), in_specs=in_specs,
            out_specs=[row_spec(w) for w in out_widths], out_shape=out_shape, interpret=interpret,
            compiler_params=compiler_params, name=f"invariant_paged_attention_triton{role}",
        )(lengths, table, q4, *flat, *([start] if has_state else []), *([] if sink is None else [sink]), *state_in)
        return results(outs)

    from jax.experimental.pallas import tpu as pltpu

    def tpu_row_spec(width: int):
        return pl.BlockSpec((None, None, rows, width), lambda s, h, *_: (s, *head_tile(h), 0))

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [tpu_row_spec(d), any_spec, any_spec]
    in_specs += [pl.BlockSpec((None, rows, 1), lambda s, h, *_: (*head_tile(h), 0))] if sink is not None else []
    in_specs += [tpu_row_spec(w) for w in state_widths]
    scratch = [pltpu.VMEM((2, per_block, page_size, pool_width), pool.dtype) for pool in flat]
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    kernel = functools.partial(_paged_mosaic_kernel, pages_per_slot=pages_per_slot, **common)
    chunk = max(1, min(slots, MOSAIC_MAX_TABLE_ENTRIES // pages_per_slot))  # the table's SMEM share per call
    chunks: list[list[Array]] = []
    for at in range(0, slots, chunk):
        n = min(chunk, slots - at)
        prefetch = [lengths[at:at + n], table[at:at + n].reshape(-1)] + ([start[at:at + n]] if has_state else [])
        chunks.append(pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=(n, nkv * tiles),
                                                   in_specs=in_specs, out_specs=[tpu_row_spec(w) for w in out_widths],
                                                   scratch_shapes=scratch),
            out_shape=[jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype) for x in out_shape],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=pltpu.InterpretParams() if interpret else False, name=f"invariant_paged_attention_mosaic{role}",
        )(*prefetch, q4[at:at + n], *flat, *([] if sink is None else [sink]), *[x[at:at + n] for x in state_in]))
    return results([jnp.concatenate(parts) for parts in zip(*chunks)])

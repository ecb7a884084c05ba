"""The batch-invariant attention's paged form: the paged engine's decode step with the pages read in place
(models/invariant_attention.py's kernels for the contiguous form; sampler/paged_attention.py dispatches).

The same `online_step` on the same tile shapes as the contiguous kernels (a slot's GQA group is its rows, padded
to a tile), its key blocks assembled from the slot's pages in the pool (no gathered copy of the page table) and
its mask made from the slot's length (and window) rather than read: the values are those of the contiguous
kernels given the gathered keys and the mask `pos < length` (`paged_supported` names the shapes it takes). A walk
can be cut at a key block and continued in a second call (`OnlineState`): the cascade's shared prompt blocks.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_llm.models.invariant_attention import (
    STAT_LANES,
    TPU_BLOCKS,
    gpu_blocks,
    online_finish,
    online_init,
    online_step,
    pieces_init,
    pieces_step,
    triton_pieces,
)
from jaxrl_llm.platform.paged_kernels import (
    MOSAIC_MAX_TABLE_ENTRIES,
    double_buffered_walk,
    visible_blocks,
    visible_keys,
)
from jaxrl_llm.shapes import head_pieces

Array = jax.Array


def paged_blocks(variant: str, head_dim: int) -> tuple[int, int]:
    """(query rows, keys) per program of `variant`'s kernel for queries of `head_dim`: the contiguous kernels'."""
    return gpu_blocks(head_dim)[:2] if variant == "triton" else TPU_BLOCKS


def paged_supported(variant: str, head_dim: int, pool_head_dim: int, page_size: int) -> bool:
    """Whether the paged kernel reads a pool of these shapes in place: a key block is whole pages, and (Triton) the
    pool stores the head width unpadded in whole power-of-2 pieces (`shapes.head_pieces`: a multiple of 16, as MLA's
    576). Elsewhere the caller gathers the pages and runs the contiguous kernel (the same values)."""
    _, keys = paged_blocks(variant, head_dim)
    whole_pages = 0 < page_size <= keys and keys % page_size == 0
    if variant == "triton":
        return whole_pages and bool(head_pieces(head_dim)) and head_dim == pool_head_dim
    return whole_pages


class OnlineState(NamedTuple):
    """The online softmax between two key blocks, per query row: fp32 running max and sum [..., rows, w] (w = 1, or
    the Mosaic kernels' 128 lanes, every lane equal) and the unnormalised output acc [..., rows, D]. Carried
    between two calls exactly (stored fp32 as computed), so a walk split at a block boundary, its first blocks in
    one call and the rest in another, gives the bits of the unsplit walk: the cascade's shared prompt blocks
    (sampler/paged_attention.py `invariant_cascade`)."""

    m: Array
    denom: Array
    acc: Array


def _split_refs(refs: tuple, has_sink: bool, has_state: bool):
    """(sink, (m0, l0, acc0) or None, outputs) of a paged kernel's refs after its fixed operands."""
    rest = list(refs)
    sink = rest.pop(0) if has_sink else None
    state = tuple(rest.pop(0) for _ in range(3)) if has_state else None
    return sink, state, rest


def _walk_start(lo, start, state, fresh):
    """The first block and the carry of a paged kernel's walk: a slot whose `start` > 0 (a cascade member: the
    blocks before `start` were walked by the shared call) continues from the loaded `state` (m0, l0, acc0) at
    block `start`; any other slot walks from block `lo` with `fresh` (`online_init`, its sink included)."""
    if state is None:
        return lo, fresh
    go_on = start > 0
    return jnp.maximum(lo, start), jax.tree.map(lambda kept, new: jnp.where(go_on, kept, new), state, fresh)


def _write_result(out_refs, carry) -> None:
    """The walk's end: the normalised output, or (return_state) the carry itself for a later call."""
    if len(out_refs) == 1:
        out_refs[0][...] = online_finish(*carry)[0]
        return
    for ref, value in zip(out_refs, carry):
        ref[...] = jnp.broadcast_to(value, ref.shape)


def _paged_triton_kernel(len_ref, table_ref, *refs, pieces: int, pages_per_block: int, keys: int,
                         pages_per_head: int, tiles: int, window: int | None, scale: float, softcap: float | None,
                         has_sink: bool, has_state: bool, return_state: bool):
    # refs: the q, k-pool and v-pool pieces, [start], [sink], [m0, l0, the acc0 pieces], then the outputs
    n = pieces
    q_refs, k_refs, v_refs, refs = refs[:n], refs[n:2 * n], refs[2 * n:3 * n], refs[3 * n:]
    start_ref, refs = (refs[0], refs[1:]) if has_state else (None, refs)
    sink_ref, refs = (refs[0], refs[1:]) if has_sink else (None, refs)
    state_refs, out_refs = (refs[:2 + n], refs[2 + n:]) if has_state else (None, refs)
    length = len_ref[0]
    offset = lax.div(pl.program_id(1), tiles) * pages_per_head  # this kv head's pages in the flattened pool
    qs = tuple(ref[...] for ref in q_refs)
    rows = qs[0].shape[0]

    def block(j, carry):
        pages = table_ref[pl.ds(j * pages_per_block, pages_per_block)] + offset
        ks, vs = (tuple(ref[pages].reshape(keys, q.shape[1]) for ref, q in zip(pool, qs)) for pool in (k_refs, v_refs))
        valid = visible_keys(j * keys, length, window, (rows, keys))
        return pieces_step(qs, ks, vs, valid, carry, scale=scale, softcap=softcap)

    lo, hi = visible_blocks(length, keys, window)
    fresh = pieces_init(rows, tuple(q.shape[1] for q in qs), sink_ref[...] if sink_ref is not None else None)
    state = None if state_refs is None else (
        state_refs[0][...][:, :1], state_refs[1][...][:, :1], tuple(ref[...] for ref in state_refs[2:]))
    lo, init = _walk_start(lo, None if start_ref is None else start_ref[0], state, fresh)
    m, denom, accs = lax.fori_loop(lo, hi, block, init)
    if return_state:
        values = (m, denom, *accs)
    else:
        values = tuple(online_finish(m, denom, acc)[0] for acc in accs)
    for ref, value in zip(out_refs, values):
        ref[...] = jnp.broadcast_to(value, ref.shape)


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
        return online_step(q, k, v, valid, carry, scale=scale, softcap=softcap)

    lo, hi = visible_blocks(length, keys, window)
    fresh = online_init(q.shape[0], width, sink_ref[...] if sink_ref is not None else None)
    state = None if state_refs is None else (state_refs[0][...][:, :1], state_refs[1][...][:, :1], state_refs[2][...])
    lo, init = _walk_start(lo, None if start_ref is None else start_ref[slot], state, fresh)
    _write_result(out_refs, double_buffered_walk(lo, hi, copies, block, init))


def paged_attention(q4: Array, k_pool: Array, v_pool: Array, lengths: Array, table: Array, *, layer: Array,
                    window: int | None, sink: Array | None, softcap: float | None, variant: str,
                    interpret: bool = False, start: Array | None = None, state: OnlineState | None = None) -> Array:
    """fp32 [slots, kv, g, D]: the decode step's attention of q4 [slots, kv, g, D] over the slots' pages of the
    pool [layers, kv, pages, page_size, D'] (layer `layer`; D' >= D: a TPU pool's lane padding), `lengths`
    [slots] keys each (0: zeros), `table` [slots, pages_per_slot]; `sink` fp32 [kv, g] or None. `variant`:
    'triton' or 'mosaic' (`paged_supported` must hold). Given `state` (`paged_walk_state`'s) and `start` [slots],
    each slot with `start` > 0 continues its walk from its state at block `start` (the blocks before it are the
    state's, the sink included); the others walk from their first block."""
    outs = _paged_call(q4, k_pool, v_pool, lengths, table, layer=layer, window=window, sink=sink, softcap=softcap,
                       variant=variant, interpret=interpret, start=start, state=state, return_state=False)
    return outs[0]


def paged_walk_state(q4: Array, k_pool: Array, v_pool: Array, lengths: Array, table: Array, *, layer: Array,
                     sink: Array | None, softcap: float | None, variant: str, interpret: bool = False) -> OnlineState:
    """`paged_attention`'s walk (no window) over each slot's `lengths` keys, stopped there: its `OnlineState`
    ([slots, kv, g, 1] twice and [slots, kv, g, D]) for a later call to continue (the cascade's shared blocks)."""
    m, denom, acc = _paged_call(q4, k_pool, v_pool, lengths, table, layer=layer, window=None, sink=sink,
                                softcap=softcap, variant=variant, interpret=interpret, start=None, state=None,
                                return_state=True)
    return OnlineState(m, denom, acc)


def _paged_call(q4: Array, k_pool: Array, v_pool: Array, lengths: Array, table: Array, *, layer: Array,
                window: int | None, sink: Array | None, softcap: float | None, variant: str, interpret: bool,
                start: Array | None, state: OnlineState | None, return_state: bool) -> list[Array]:
    """The kernel call behind `paged_attention` ([out]) and `paged_walk_state` ([m, denom, acc])."""
    slots, nkv, g, d = q4.shape
    layers, _, num_pages, page_size, pool_width = k_pool.shape
    rows, keys = paged_blocks(variant, d)
    per_block = keys // page_size
    tiles = -(-g // rows)
    lanes = 1 if variant == "triton" else STAT_LANES  # the statistics' width in and out (`OnlineState`)

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
    start_in: list[Array] = []  # the continued walk's first block per slot
    if state is not None:
        stats = [jnp.broadcast_to(x.astype(jnp.float32), (slots, nkv, g, lanes)) for x in (state.m, state.denom)]
        state_in = [tile_rows(x) for x in (*stats, state.acc.astype(jnp.float32))]
        start_in = [jnp.zeros((slots,), jnp.int32) if start is None else start.astype(jnp.int32)]
    common = dict(pages_per_block=per_block, keys=keys, pages_per_head=num_pages, tiles=tiles, window=window,
                  scale=d ** -0.5, softcap=softcap, has_sink=sink is not None, has_state=has_state)

    def head_tile(h):
        return lax.div(h, tiles), lax.rem(h, tiles)

    state_widths = (lanes, lanes, d) if has_state else ()
    out_widths = (lanes, lanes, d) if return_state else (d,)
    out_shape = [jax.ShapeDtypeStruct((*q4.shape[:3], w), jnp.float32) for w in out_widths]

    # the cascade's two calls named apart (their compiled programs are told apart by it)
    role = "_shared" if return_state else "_continued" if has_state else ""

    def results(outs: list[Array]) -> list[Array]:  # the padded rows off, the statistics' lanes to one
        outs = [x[:, :, :g] for x in outs]
        return [outs[0][..., :1], outs[1][..., :1], outs[2]] if return_state else outs

    if variant == "triton":
        offsets, pieces = zip(*triton_pieces(d))

        def row_spec(width: int, at: int = 0):  # column block `at // width`: a piece starts at a multiple of it
            return pl.BlockSpec((None, None, rows, width), lambda s, h: (s, *head_tile(h), at // width))

        def pool_spec(width: int, at: int):
            return pl.BlockSpec((flat[0].shape[0], page_size, width), lambda s, h: (0, 0, at // width))

        per_slot = pl.BlockSpec((1,), lambda s, h: (s,))
        split = list(zip(pieces, offsets))
        in_specs = [per_slot, pl.BlockSpec((None, pages_per_slot), lambda s, h: (s, 0)),
                    *[row_spec(p, at) for p, at in split], *[pool_spec(p, at) for p, at in split] * 2]
        in_specs += [per_slot] if has_state else []
        in_specs += [pl.BlockSpec((None, rows, 1), lambda s, h: (*head_tile(h), 0))] if sink is not None else []
        in_specs += [row_spec(lanes), row_spec(lanes), *[row_spec(p, at) for p, at in split]] if has_state else []
        piece_outs = [jax.ShapeDtypeStruct((*q4.shape[:3], p), jnp.float32) for p in pieces]
        triton_out_shape = (out_shape[:2] if return_state else []) + piece_outs
        compiler_params = None
        if not interpret:
            from jax.experimental.pallas import triton as plt
            compiler_params = plt.CompilerParams(num_warps=gpu_blocks(d)[2], num_stages=2)
        n = len(pieces)
        state_args = [*state_in[:2], *[state_in[2]] * n] if has_state else []
        outs = pl.pallas_call(
            functools.partial(_paged_triton_kernel, pieces=n, return_state=return_state, **common),
            grid=(slots, nkv * tiles), in_specs=in_specs, out_specs=[row_spec(x.shape[-1]) for x in triton_out_shape],
            out_shape=triton_out_shape, interpret=interpret, compiler_params=compiler_params,
            name=f"invariant_paged_attention_triton{role}",
        )(lengths, table, *[q4] * n, *flat[:1] * n, *flat[1:] * n, *start_in, *([] if sink is None else [sink]),
          *state_args)
        head, acc = (outs[:2], outs[2:]) if return_state else ([], outs)
        return results([*head, acc[0] if n == 1 else jnp.concatenate(acc, axis=-1)])

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
        prefetch = [lengths[at:at + n], table[at:at + n].reshape(-1)] + [x[at:at + n] for x in start_in]
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

"""The Mosaic (TPU) lowering of paged decode attention: `mosaic_call`, run by `paged_decode_attention_pallas`
(sampler/paged_attention_pallas.py, whose docstring is the contract). Lengths and the flattened page table are
scalar-prefetched into SMEM; K/V stay in HBM and each block's pages are DMA'd into a double-buffered VMEM
scratch (block i+1 in flight while block i is computed); a latent pool (values_are_keys) is DMA'd once."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrl_llm.platform.paged_kernels import MOSAIC_MAX_TABLE_ENTRIES, double_buffered_walk, visible_blocks
from jaxrl_llm.sampler.paged_attention_block import attend_block, finish, init_carry, log_sum_exp

_LANES = 128  # the Mosaic kernel's softmax statistics are written as one (rows, 128) tile


def _mosaic_kernel(lengths_ref, page_table_ref, q_ref, *refs, pages_per_block: int, pages_per_slot: int,
                   pages_per_head: int, scale: float, softcap: float | None, sliding_window: int | None,
                   quantized: bool, values_are_keys: bool, compute_dtype, stats: bool):
    # operands: pools (K, and V unless the values are the keys), their scales, outputs, scratch the same way
    pools = 1 if values_are_keys else 2
    per_pool = 2 if quantized else 1
    hbm, rest = refs[:pools * per_pool], refs[pools * per_pool:]
    if stats:
        o_ref, m_ref, l_ref, *rest = rest
    else:
        (o_ref, *rest), m_ref, l_ref = rest, None, None
    bufs, sems = rest[:-1], rest[-1]
    k_buf, v_buf = bufs[0], bufs[pools - 1]  # MLA: the keys' buffer is read as the values
    ks_buf, vs_buf = (bufs[pools], bufs[-1]) if quantized else (None, None)
    slot, head = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_buf.shape[-2:]
    block_tokens = pages_per_block * page_size
    length = lengths_ref[slot]
    lo, hi = visible_blocks(length, block_tokens, sliding_window)
    from jax.experimental.pallas import tpu as pltpu

    def copies(block, buf):
        """The DMAs bringing block `block`'s pages (and scales) into buffer `buf` (one semaphore
        per buffer: waiting on every descriptor consumes exactly what they signalled)."""
        out = []
        for j in range(pages_per_block):
            page = page_table_ref[slot * pages_per_slot + block * pages_per_block + j] + head * pages_per_head
            pairs = list(zip(hbm, bufs, strict=True))  # MLA: the keys' pages only, read as values too
            out += [pltpu.make_async_copy(src.at[page], dst.at[buf, j], sems.at[buf])
                    for src, dst in pairs]
        return out

    q = q_ref[...]

    def body(i, buf, carry):
        # fp32 before the reshape: merging (pages, page_size) rows is then a plain (8, 128)-tile
        # concatenation whatever the page dtype's packing (bf16 16 rows, int8 32 rows a tile).
        k = k_buf[buf].astype(jnp.float32).reshape(block_tokens, head_dim)
        v = v_buf[buf].astype(jnp.float32).reshape(block_tokens, head_dim)
        k_scale = ks_buf[buf].reshape(block_tokens, 1) if ks_buf is not None else None
        v_scale = vs_buf[buf].reshape(block_tokens, 1) if vs_buf is not None else None
        return attend_block((q,), (k,), (v,), k_scale, v_scale, i * block_tokens, length, carry, scale=scale,
                             softcap=softcap, sliding_window=sliding_window, compute_dtype=compute_dtype)

    m, denom, (acc,) = double_buffered_walk(lo, hi, copies, body, init_carry(q.shape[0], (head_dim,)))
    o_ref[...] = finish(denom, acc).astype(o_ref.dtype)
    if m_ref is not None and l_ref is not None:  # softmax statistics over a lane tile (TPU blocks: (8, 128))
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(denom, l_ref.shape)


def mosaic_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, *,
                 pages_per_block, pages_per_head, scale, softcap, sliding_window, interpret, compute_dtype, return_lse,
                 values_are_keys):
    from jax.experimental.pallas import tpu as pltpu
    slots, kv_heads, group, head_dim = q4.shape
    _, page_size, _ = k_pages.shape
    pages_per_slot = page_indices.shape[1]
    pools = 1 if values_are_keys else 2
    # q in fp32 (exact for bf16 inputs: products of bf16 values are exact in fp32, so the scores
    # are the policy's fp32-accumulated q.k) padded to the 8-row fp32 sublane tile.
    rows = -(-group // 8) * 8
    q4 = jnp.pad(q4.astype(jnp.float32), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    quantized = k_scales is not None
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, *_: (s, h, 0, 0))
    in_specs = [q_spec] + [any_spec] * (pools * (2 if quantized else 1))
    buf_shape = (2, pages_per_block, page_size, head_dim)
    scratch = [pltpu.VMEM(buf_shape, k_pages.dtype)] + ([] if values_are_keys else [pltpu.VMEM(buf_shape,
                                                                                                 v_pages.dtype)])
    if quantized:
        # Scales as [.., page_size, 1] columns: they multiply K/V rows (sublanes) on TPU.
        k_scales, v_scales = k_scales[..., None], v_scales[..., None]
        scratch += [pltpu.VMEM((2, pages_per_block, page_size, 1), jnp.float32)] * pools
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    kernel = functools.partial(_mosaic_kernel, pages_per_block=pages_per_block,
                               pages_per_slot=pages_per_slot, pages_per_head=pages_per_head, scale=scale,
                               softcap=softcap, sliding_window=sliding_window, quantized=quantized,
                               values_are_keys=values_are_keys, compute_dtype=compute_dtype, stats=return_lse)
    stat_spec = pl.BlockSpec((None, None, rows, _LANES), lambda s, h, *_: (s, h, 0, 0))
    out_specs = [q_spec] + ([stat_spec, stat_spec] if return_lse else [])
    pages = [k_pages, v_pages][:pools] + ([k_scales, v_scales][:pools] if quantized else [])
    # The page table is scalar-prefetched whole into SMEM (1 MiB up to v6e): slots go in chunks
    # whose table stays under MOSAIC_MAX_TABLE_ENTRIES, one kernel call each.
    chunk = max(1, min(slots, MOSAIC_MAX_TABLE_ENTRIES // pages_per_slot))
    outs = []
    for start in range(0, slots, chunk):
        n = min(chunk, slots - start)
        stat_shape = jax.ShapeDtypeStruct((n, kv_heads, rows, _LANES), jnp.float32)
        outs.append(pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(n, kv_heads),
                                                   in_specs=in_specs, out_specs=out_specs,
                                                   scratch_shapes=scratch),
            out_shape=[jax.ShapeDtypeStruct((n, *q4.shape[1:]), jnp.float32)] + [stat_shape] * (2 * return_lse),
            # Each program issues and waits its own DMAs: programs are independent (megacore).
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
            interpret=pltpu.InterpretParams() if interpret else False,
            name="paged_decode_attention_mosaic",
        )(lengths[start:start + n], page_indices[start:start + n].reshape(-1),
          q4[start:start + n], *pages))
    out, *stats = (jnp.concatenate(parts) for parts in zip(*outs, strict=True))
    lse = log_sum_exp(stats[0][..., 0], stats[1][..., 0])[:, :, :group] if return_lse else None
    return out[:, :, :group], lse

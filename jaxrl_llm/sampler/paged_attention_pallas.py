"""Pallas paged decode attention: one query token per slot over its paged K/V (flash decoding).

    out = paged_decode_attention_pallas(q, k_pages, v_pages, lengths, page_indices,
                                        sliding_window=None, interpret=False, layer=None)
    q [slots, heads, head_dim]; k/v_pages [kv_heads, num_pages, page_size, head_dim], or with
    `layer` the engine's whole pool [layers, kv_heads, num_pages, page_size, head_dim]; the pages'
    head_dim may be q's lane-padded (a TPU pool, sampler/kv_bits.py: zero pad lanes);
    lengths [slots] int32 (0 = empty slot -> zeros); page_indices [slots, pages_per_slot] int32

Both kernels read the pool flattened to [layers * kv_heads * num_pages, page_size, head_dim] (a
free reshape of the contiguous pool): the layer offset is added to the page table once per call
and the kv head's offset inside the kernel, so no layer's pool is ever sliced out and copied.

The contract (shapes, GQA, window, numerics) is the one of `paged_attention.paged_decode_attention`;
the engine's dispatcher imports this module lazily on gpu/tpu. Per program (slot, kv head) the
kernel walks only the blocks of `pages_per_block` pages that hold visible keys: from the block of
position max(0, length - window) to ceil(length / block_tokens), so the cost grows with the real
length, not with pages_per_slot. All query heads of the kv head (the GQA group) are one matrix of
rows in the same program, so each K/V page is read once per kv head.

Numerics (shared with the XLA path and the trainer's dense attention): scores q.k with fp32
accumulation, scaled by head_dim**-0.5 in fp32, masked with a finite large-negative value; online
softmax statistics, probabilities and the probs.V product in fp32 (V upcast); output cast to q's
dtype. fp32 matmuls ask for Precision.HIGHEST (Triton would otherwise use TF32).

int8 K/V: pass `k_scales`/`v_scales` [kv_heads, num_pages, page_size] (fp32, one scale per cached
token and kv head). Each loaded block is dequantised in VMEM/registers, never written back, so
HBM traffic stays int8: K = k_int8 * k_scale in fp32 rounded to the compute dtype (q's dtype, as a
caller-side dequantisation would store it; the engine's XLA path does the same), then q.k as
above; V = v_int8 * v_scale stays fp32.

Two lowerings of the same step (`_attend_block`), chosen by `variant` (default: the backend):
- "triton" (GPU): grid (slot, kv_head, split); the page table row is a block, K/V pages are
  gathered from the kv head's page pool with a vector of page ids per block (`k_ref[page_ids]`).
  With num_splits > 1 each split walks its share of the slot's visible blocks and writes its
  (max, sum, unnormalised output); a small XLA merge rescales and sums them (flash decoding, for
  few slots * kv_heads). Block shapes must be powers of 2: the GQA group is padded to >= 16 rows,
  page_size / pages_per_block / head_dim must be powers of 2.
- "mosaic" (TPU): lengths and the flattened page table are scalar-prefetched into SMEM
  (`PrefetchScalarGridSpec`); K/V stay in HBM and each block's pages are DMA'd into a
  double-buffered VMEM scratch (block i+1 is in flight while block i is computed).
`interpret=True` runs either on CPU (the mosaic variant through the TPU interpreter).
"""
from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler.kv_bits import scale_pair
from jaxrl_llm.shapes import next_power_of_two

# Finite (not -inf) so that exp(mask - max) is an exact 0 and no inf - inf NaN can appear.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
Variant = Literal["triton", "mosaic"]
# Page-table entries per Mosaic call (int32 in SMEM): 64Ki entries = 256 KiB, a quarter of the
# 1 MiB SMEM of TPUs up to v6e (vLLM keeps its block tables under half).
MOSAIC_MAX_TABLE_ENTRIES = 1 << 16
_LANES = 128  # the Mosaic kernel's softmax statistics are written as one (rows, 128) tile


def default_pages_per_block(page_size: int, pages_per_slot: int, variant: Variant) -> int:
    """Pages per loop step: ~128 tokens (Triton: registers) / ~512 tokens (TPU: DMA size) a block,
    never more than the page table holds (rounded up to a power of 2 for Triton)."""
    target_tokens = 128 if variant == "triton" else 512
    ppb = max(1, target_tokens // page_size)
    return min(ppb, next_power_of_two(pages_per_slot))


def _visible_blocks(length, block_tokens: int, sliding_window: int | None):
    """[lo, hi) block range holding every key p with max(0, length - W) <= p < length."""
    hi = lax.div(length + block_tokens - 1, block_tokens)
    if sliding_window is None:
        return jnp.int32(0), hi
    return lax.div(jnp.maximum(length - sliding_window, 0), block_tokens), hi


def _attend_block(q, k, v, k_scale, v_scale, start, length, carry, *, scale: float, softcap: float | None,
                  sliding_window: int | None, compute_dtype):
    """One online-softmax step over `block_tokens` keys starting at token position `start`.

    q [G, D]; k, v [T, D]; k_scale, v_scale [T, 1] fp32 or None (int8 pages, dequantised K is
    rounded to `compute_dtype`, the caller's q dtype, before the q.k product); carry (m [G, 1],
    l [G, 1], acc [G, D]) in fp32. Works unchanged under the Triton and Mosaic lowerings: 2-D ops
    only, and the scales broadcast along lanes (no lane<->sublane relayout on TPU).
    """
    m_prev, l_prev, acc_prev = carry
    hp = lax.Precision.HIGHEST
    v = v.astype(jnp.float32)
    if k_scale is not None:
        k = (k.astype(jnp.float32) * k_scale).astype(compute_dtype)
        v = v * v_scale
    s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=hp,
                        preferred_element_type=jnp.float32) * scale
    if softcap is not None:  # Gemma 2's attn_logit_softcapping, as the trainer's attention
        s = softcap * jnp.tanh(s / softcap)
    pos = start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    valid = pos < length
    if sliding_window is not None:
        valid = jnp.logical_and(valid, pos >= length - sliding_window)
    s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # where(): a block with no visible key (m_new still MASK_VALUE) must add nothing.
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_new = alpha * acc_prev + lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=hp,
                                                 preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


def _init_carry(rows: int, head_dim: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def _finish(carry):
    _, denom, acc = carry
    # Empty slot (length 0): nothing was attended, denom == 0 -> zeros (the contract's output).
    return jnp.where(denom > 0.0, acc / jnp.where(denom > 0.0, denom, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------
# Triton (GPU)


def _triton_kernel(lengths_ref, page_ids_ref, q_ref, k_ref, v_ref, *rest, pages_per_block: int,
                   pages_per_head: int, scale: float, softcap: float | None, sliding_window: int | None,
                   quantized: bool, compute_dtype, num_splits: int, stats: bool):
    ks_ref, vs_ref = rest[:2] if quantized else (None, None)
    out_refs = rest[2:] if quantized else rest
    page_size, head_dim = k_ref.shape[-2:]
    block_tokens = pages_per_block * page_size
    length = lengths_ref[0]
    q = q_ref[...]
    lo, hi = _visible_blocks(length, block_tokens, sliding_window)
    if num_splits > 1:  # this program's share of the visible blocks (flash-decoding partition)
        per_split = lax.div(hi - lo + num_splits - 1, num_splits)
        lo = lo + pl.program_id(2) * per_split
        hi = jnp.minimum(hi, lo + per_split)

    head_offset = pl.program_id(1) * pages_per_head  # this kv head's pages in the flattened pool

    def body(i, carry):
        pages = page_ids_ref[pl.ds(i * pages_per_block, pages_per_block)] + head_offset
        k = k_ref[pages].reshape(block_tokens, head_dim)
        v = v_ref[pages].reshape(block_tokens, head_dim)
        k_scale = ks_ref[pages].reshape(block_tokens, 1) if ks_ref is not None else None
        v_scale = vs_ref[pages].reshape(block_tokens, 1) if vs_ref is not None else None
        return _attend_block(q, k, v, k_scale, v_scale, i * block_tokens, length, carry, scale=scale,
                             softcap=softcap, sliding_window=sliding_window, compute_dtype=compute_dtype)

    carry = lax.fori_loop(lo, hi, body, _init_carry(q.shape[0], head_dim))
    if not stats:
        (o_ref,) = out_refs
        o_ref[...] = _finish(carry).astype(o_ref.dtype)
    else:  # unnormalised partial results, merged by _merge_splits
        m_ref, l_ref, acc_ref = out_refs
        m, denom, acc = carry
        m_ref[...], l_ref[...], acc_ref[...] = m.reshape(m_ref.shape), denom.reshape(l_ref.shape), acc


def _merge_splits(m, denom, acc):
    """Combine per-split online-softmax states [..., splits, rows(, D)] (fp32) into the output and
    its log-sum-exp [..., rows] (-inf where nothing was attended). Empty splits carry
    m = MASK_VALUE, denom = 0, acc = 0 and get weight 0 (or l_total = 0 -> 0)."""
    m_total = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_total)
    l_total = jnp.sum(w * denom, axis=2)
    acc_total = jnp.sum(w[..., None] * acc, axis=2)
    out = jnp.where(l_total[..., None] > 0.0, acc_total / jnp.where(l_total > 0.0, l_total, 1.0)[..., None], 0.0)
    return out, _log_sum_exp(m_total[:, :, 0], l_total)


def _log_sum_exp(m, denom):
    """log(sum exp(scores)) from the online-softmax max and sum; -inf for an empty row."""
    return jnp.where(denom > 0.0, m + jnp.log(jnp.where(denom > 0.0, denom, 1.0)), -jnp.inf)


def default_num_splits(slots: int, kv_heads: int, num_blocks: int) -> int:
    """Split each slot's blocks over enough programs to give ~256 (2 per SM of an H100) in all."""
    return max(1, min(num_blocks, -(-256 // (slots * kv_heads)), 16))


def _triton_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, *,
                 pages_per_block, pages_per_head, scale, softcap, sliding_window, interpret, compute_dtype, num_splits,
                 return_lse):
    slots, kv_heads, group, head_dim = q4.shape
    flat_pages, page_size, _ = k_pages.shape
    for name, n in (("page_size", page_size), ("pages_per_block", pages_per_block),
                    ("head_dim", head_dim)):
        if n & (n - 1):
            raise ValueError(f"paged attention (triton): {name}={n} must be a power of 2")
    if num_splits is None:
        num_splits = default_num_splits(slots, kv_heads, page_indices.shape[1] // pages_per_block)
    rows = max(16, next_power_of_two(group))  # tl.dot needs >= 16 rows; Triton blocks are powers of 2
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    quantized = k_scales is not None
    # the whole flattened pool: each program gathers its kv head's pages by id (no per-head block copy)
    pool = pl.BlockSpec((flat_pages, page_size, head_dim), lambda s, h, j: (0, 0, 0))
    scale_pool = pl.BlockSpec((flat_pages, page_size), lambda s, h, j: (0, 0))
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, j: (s, h, 0, 0))
    in_specs = [pl.BlockSpec((1,), lambda s, h, j: (s,)),
                pl.BlockSpec((None, page_indices.shape[1]), lambda s, h, j: (s, 0)), q_spec, pool,
                pool]
    args = [lengths, page_indices, q4, k_pages, v_pages]
    if quantized:
        in_specs += [scale_pool, scale_pool]
        args += [k_scales, v_scales]
    stats = num_splits > 1 or return_lse  # per-split (max, sum, unnormalised output), merged below
    if not stats:
        out_specs, out_shape = q_spec, jax.ShapeDtypeStruct(q4.shape, q4.dtype)
    else:
        stat = pl.BlockSpec((None, None, None, rows), lambda s, h, j: (s, h, j, 0))
        part = pl.BlockSpec((None, None, None, rows, head_dim), lambda s, h, j: (s, h, j, 0, 0))
        out_specs = [stat, stat, part]
        stat_shape = jax.ShapeDtypeStruct((slots, kv_heads, num_splits, rows), jnp.float32)
        out_shape = [stat_shape, stat_shape,
                     jax.ShapeDtypeStruct((slots, kv_heads, num_splits, rows, head_dim), jnp.float32)]
    kernel = functools.partial(_triton_kernel, pages_per_block=pages_per_block, pages_per_head=pages_per_head,
                               scale=scale, softcap=softcap, sliding_window=sliding_window, quantized=quantized,
                               compute_dtype=compute_dtype, num_splits=num_splits, stats=stats)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    out = pl.pallas_call(
        kernel, grid=(slots, kv_heads, num_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="paged_decode_attention_triton",
    )(*args)
    if not stats:
        return out[:, :, :group], None
    out, lse = _merge_splits(*out)
    return out[:, :, :group], lse[:, :, :group] if return_lse else None


# ----------------------------------------------------------------------------------------------
# Mosaic (TPU)


def _mosaic_kernel(lengths_ref, page_table_ref, q_ref, k_hbm, v_hbm, *rest, pages_per_block: int,
                   pages_per_slot: int, pages_per_head: int, scale: float, softcap: float | None,
                   sliding_window: int | None, quantized: bool, compute_dtype, stats: bool):
    if quantized:
        ks_hbm, vs_hbm, *rest = rest
    else:
        ks_hbm = vs_hbm = None
    if stats:
        o_ref, m_ref, l_ref, *rest = rest
    else:
        (o_ref, *rest), m_ref, l_ref = rest, None, None
    if quantized:
        k_buf, v_buf, ks_buf, vs_buf, sems = rest
    else:
        (k_buf, v_buf, sems), ks_buf, vs_buf = rest, None, None
    slot, head = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_buf.shape[-2:]
    block_tokens = pages_per_block * page_size
    length = lengths_ref[slot]
    lo, hi = _visible_blocks(length, block_tokens, sliding_window)
    from jax.experimental.pallas import tpu as pltpu

    def copies(block, buf):
        """The DMAs bringing block `block`'s pages (and scales) into buffer `buf` (one semaphore
        per buffer: waiting on every descriptor consumes exactly what they signalled)."""
        out = []
        for j in range(pages_per_block):
            page = page_table_ref[slot * pages_per_slot + block * pages_per_block + j] + head * pages_per_head
            pairs = [(k_hbm, k_buf), (v_hbm, v_buf)]
            if quantized:
                pairs += [(ks_hbm, ks_buf), (vs_hbm, vs_buf)]
            out += [pltpu.make_async_copy(src.at[page], dst.at[buf, j], sems.at[buf])
                    for src, dst in pairs]
        return out

    @pl.when(hi > lo)
    def _():
        for c in copies(lo, 0):
            c.start()

    q = q_ref[...]

    def body(i, carry):
        buf = lax.rem(i - lo, 2)

        @pl.when(i + 1 < hi)
        def _():
            for c in copies(i + 1, 1 - buf):
                c.start()

        for c in copies(i, buf):
            c.wait()
        # fp32 before the reshape: merging (pages, page_size) rows is then a plain (8, 128)-tile
        # concatenation whatever the page dtype's packing (bf16 16 rows, int8 32 rows a tile).
        k = k_buf[buf].astype(jnp.float32).reshape(block_tokens, head_dim)
        v = v_buf[buf].astype(jnp.float32).reshape(block_tokens, head_dim)
        k_scale = ks_buf[buf].reshape(block_tokens, 1) if ks_buf is not None else None
        v_scale = vs_buf[buf].reshape(block_tokens, 1) if vs_buf is not None else None
        return _attend_block(q, k, v, k_scale, v_scale, i * block_tokens, length, carry, scale=scale,
                             softcap=softcap, sliding_window=sliding_window, compute_dtype=compute_dtype)

    carry = lax.fori_loop(lo, hi, body, _init_carry(q.shape[0], head_dim))
    o_ref[...] = _finish(carry).astype(o_ref.dtype)
    if m_ref is not None and l_ref is not None:  # softmax statistics over a lane tile (TPU blocks: (8, 128))
        m_ref[...] = jnp.broadcast_to(carry[0], m_ref.shape)
        l_ref[...] = jnp.broadcast_to(carry[1], l_ref.shape)


def _mosaic_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, *,
                 pages_per_block, pages_per_head, scale, softcap, sliding_window, interpret, compute_dtype, return_lse):
    from jax.experimental.pallas import tpu as pltpu
    slots, kv_heads, group, head_dim = q4.shape
    _, page_size, _ = k_pages.shape
    pages_per_slot = page_indices.shape[1]
    # q in fp32 (exact for bf16 inputs: products of bf16 values are exact in fp32, so the scores
    # are the policy's fp32-accumulated q.k) padded to the 8-row fp32 sublane tile.
    rows = -(-group // 8) * 8
    q4 = jnp.pad(q4.astype(jnp.float32), ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    quantized = k_scales is not None
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda s, h, *_: (s, h, 0, 0))
    in_specs = [q_spec, any_spec, any_spec] + ([any_spec, any_spec] if quantized else [])
    buf_shape = (2, pages_per_block, page_size, head_dim)
    scratch = [pltpu.VMEM(buf_shape, k_pages.dtype), pltpu.VMEM(buf_shape, v_pages.dtype)]
    if quantized:
        # Scales as [.., page_size, 1] columns: they multiply K/V rows (sublanes) on TPU.
        k_scales, v_scales = k_scales[..., None], v_scales[..., None]
        scratch += [pltpu.VMEM((2, pages_per_block, page_size, 1), jnp.float32)] * 2
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    kernel = functools.partial(_mosaic_kernel, pages_per_block=pages_per_block,
                               pages_per_slot=pages_per_slot, pages_per_head=pages_per_head, scale=scale,
                               softcap=softcap, sliding_window=sliding_window, quantized=quantized,
                               compute_dtype=compute_dtype, stats=return_lse)
    stat_spec = pl.BlockSpec((None, None, rows, _LANES), lambda s, h, *_: (s, h, 0, 0))
    out_specs = [q_spec] + ([stat_spec, stat_spec] if return_lse else [])
    pages = [k_pages, v_pages] + ([k_scales, v_scales] if quantized else [])
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
    lse = _log_sum_exp(stats[0][..., 0], stats[1][..., 0])[:, :, :group] if return_lse else None
    return out[:, :, :group], lse


# ----------------------------------------------------------------------------------------------


def triton_supports(head_dim: int, page_size: int) -> bool:
    """Whether the Triton variant takes these shapes (its blocks must be powers of 2)."""
    return all(n > 0 and not n & (n - 1) for n in (head_dim, page_size))


def default_variant() -> Variant:
    return "mosaic" if target_platform() == "tpu" else "triton"


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "interpret", "pages_per_block",
                                             "variant", "num_splits", "return_lse"))
def paged_decode_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  lengths: jax.Array, page_indices: jax.Array, *,
                                  k_scales: jax.Array | None = None,
                                  v_scales: jax.Array | None = None,
                                  sliding_window: int | None = None, softcap: float | None = None,
                                  interpret: bool = False,
                                  pages_per_block: int | None = None,
                                  variant: Variant | None = None,
                                  num_splits: int | None = None,
                                  layer: jax.Array | None = None,
                                  return_lse: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of one query per slot over paged K/V; see the module docstring.

    `pages_per_block`: pages per inner-loop step (default `default_pages_per_block`).
    `variant`: "triton" | "mosaic" (default: "mosaic" on TPU, else "triton").
    `num_splits` (triton): programs sharing one slot's visible blocks, merged after the kernel
    (flash-decoding; default `default_num_splits`: more when slots * kv_heads is small).
    `layer`: int32 scalar; the pages (and scales) are then the whole pool with a leading layer axis.
    `softcap`: scores become cap * tanh(s / cap) (Gemma 2's attn_logit_softcapping).
    `return_lse`: also the log-sum-exp of each row's scores [slots, heads] fp32 (-inf: no key), and
    the output in fp32: a partial attention another part merges with (cascade_attention.py).
    """
    variant = variant or default_variant()
    scales = scale_pair(k_scales, v_scales)
    if layer is None:  # one layer's pages: a layer axis of 1
        k_pages, v_pages, layer = k_pages[None], v_pages[None], jnp.int32(0)
        if scales is not None:
            scales = (scales[0][None], scales[1][None])
    if k_pages.ndim != 5:
        raise ValueError(f"paged attention: k_pages {k_pages.shape} must be [kv_heads, num_pages, page_size, "
                         "head_dim], or [layers, ...] with layer=")
    if variant not in ("triton", "mosaic"):
        raise ValueError(f"paged attention: variant={variant!r}, expected 'triton' or 'mosaic'")
    slots, num_heads, head_dim = q.shape
    num_layers, kv_heads, num_pages, page_size, kv_dim = k_pages.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"paged attention: v_pages {v_pages.shape} != k_pages {k_pages.shape}")
    if kv_dim < head_dim or num_heads % kv_heads:
        raise ValueError(f"paged attention: q {q.shape} does not fit k_pages {k_pages.shape} "
                         "(the pages' head_dim must be q's, or q's lane-padded; num_heads a multiple of num_kv_heads)")
    if lengths.shape != (slots,) or page_indices.ndim != 2 or page_indices.shape[0] != slots:
        raise ValueError(f"paged attention: lengths {lengths.shape} / page_indices "
                         f"{page_indices.shape} must be [slots={slots}] / [slots, pages_per_slot]")
    if scales is None and not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"paged attention: {k_pages.dtype} pages need k_scales/v_scales")
    if scales is not None and (scales[0].shape != k_pages.shape[:-1] or scales[1].shape != scales[0].shape):
        raise ValueError(f"paged attention: k_scales/v_scales {scales[0].shape}/{scales[1].shape} "
                         f"must be the pages' shape without head_dim, {k_pages.shape[:-1]}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"paged attention: sliding_window={sliding_window} must be >= 1 or None")
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size, page_indices.shape[1], variant)
    if num_splits is not None and (num_splits < 1 or variant != "triton"):
        raise ValueError(f"paged attention: num_splits={num_splits} needs variant='triton' and >= 1")
    if pages_per_block < 1:
        raise ValueError(f"paged attention: pages_per_block={pages_per_block} must be >= 1")
    # Pad the page table to whole blocks; the padding (page 0, a valid id) is never visible.
    pad = -page_indices.shape[1] % pages_per_block
    page_indices = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pad)))
    # the layer's first page in the flattened pool (the kernels add the kv head's)
    page_indices = page_indices + jnp.asarray(layer, jnp.int32) * (kv_heads * num_pages)
    flat = (num_layers * kv_heads * num_pages, page_size)
    k_pages, v_pages = k_pages.reshape(*flat, kv_dim), v_pages.reshape(*flat, kv_dim)
    lengths = lengths.astype(jnp.int32)
    k_scales, v_scales = (None, None) if scales is None else (
        scales[0].astype(jnp.float32).reshape(flat), scales[1].astype(jnp.float32).reshape(flat))
    # a lane-padded pool (sampler/kv_bits.py): q padded with zeros, which add nothing to q.k; the pad
    # lanes of the output (probs x zero V lanes) are dropped below
    q4 = jnp.pad(q, ((0, 0), (0, 0), (0, kv_dim - head_dim))).reshape(slots, kv_heads, num_heads // kv_heads, kv_dim)
    kw = dict(pages_per_block=pages_per_block, pages_per_head=num_pages, scale=head_dim ** -0.5,
              softcap=softcap, sliding_window=sliding_window,
              interpret=interpret, compute_dtype=q.dtype, return_lse=return_lse)
    if variant == "triton":
        out, lse = _triton_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices,
                                num_splits=num_splits, **kw)
    else:
        out, lse = _mosaic_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, **kw)
    out = out.reshape(slots, num_heads, kv_dim)[..., :head_dim]
    if lse is not None:  # return_lse
        return out.astype(jnp.float32), lse.reshape(slots, num_heads)
    return out.astype(q.dtype)

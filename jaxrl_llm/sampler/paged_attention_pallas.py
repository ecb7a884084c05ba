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

Two lowerings of the same step (`attend_block`), chosen by `variant` (default: the backend):
- "triton" (GPU): grid (slot, kv_head, split); the page table row is a block, K/V pages are
  gathered from the kv head's page pool with a vector of page ids per block (`k_ref[page_ids]`).
  With num_splits > 1 each split walks its share of the slot's visible blocks and writes its
  (max, sum, unnormalised output); a small XLA merge rescales and sums them (flash decoding, for
  few slots * kv_heads). Block shapes must be powers of 2: the GQA group is padded to >= 16 rows
  (at most TRITON_MAX_ROWS a program: a larger group, MLA's every head, takes several programs on
  grid axis 1), page_size / pages_per_block must be powers of 2, and a head_dim that is not one is
  read as power-of-2 pieces (`head_pieces`: MLA's 576 = the latent's 512 + the rope key's 64), each
  its own block of q, pool and output, the scores summed over the pieces' dots.
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
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_llm.platform.paged_kernels import visible_blocks
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler.kv_bits import scale_pair
from jaxrl_llm.sampler.paged_attention_block import attend_block, finish, init_carry, log_sum_exp
from jaxrl_llm.sampler.paged_attention_mosaic import mosaic_call
from jaxrl_llm.shapes import head_pieces, next_power_of_two

Variant = Literal["triton", "mosaic"]


def default_pages_per_block(page_size: int, pages_per_slot: int, variant: Variant, head_dim: int = 128) -> int:
    """Pages per loop step: ~128 tokens (Triton: registers; 64 past 256-wide heads, MLA's 576) / ~512 tokens
    (TPU: DMA size) a block, never more than the page table holds (rounded up to a power of 2 for Triton)."""
    target_tokens = (128 if head_dim <= 256 else 64) if variant == "triton" else 512
    ppb = max(1, target_tokens // page_size)
    return min(ppb, next_power_of_two(pages_per_slot))


# ----------------------------------------------------------------------------------------------
# Triton (GPU)


def _triton_kernel(lengths_ref, page_ids_ref, *refs, pieces: int, pages_per_block: int, pages_per_head: int,
                   row_blocks: int, scale: float, softcap: float | None, sliding_window: int | None, quantized: bool,
                   values_are_keys: bool, compute_dtype, num_splits: int, stats: bool):
    pools = 1 if values_are_keys else 2
    q_refs, k_refs = refs[:pieces], refs[pieces:2 * pieces]
    v_refs = k_refs if values_are_keys else refs[2 * pieces:3 * pieces]
    rest = refs[(1 + pools) * pieces:]
    ks_ref, vs_ref = (rest[0], rest[pools - 1]) if quantized else (None, None)
    out_refs = rest[pools:] if quantized else rest
    page_size = k_refs[0].shape[-2]
    widths = tuple(ref.shape[-1] for ref in k_refs)
    block_tokens = pages_per_block * page_size
    length = lengths_ref[0]
    q = tuple(ref[...] for ref in q_refs)
    lo, hi = visible_blocks(length, block_tokens, sliding_window)
    if num_splits > 1:  # this program's share of the visible blocks (flash-decoding partition)
        per_split = lax.div(hi - lo + num_splits - 1, num_splits)
        lo = lo + pl.program_id(2) * per_split
        hi = jnp.minimum(hi, lo + per_split)

    # this kv head's pages in the flattened pool (axis 1 of the grid: kv head x row block of its group)
    head_offset = lax.div(pl.program_id(1), row_blocks) * pages_per_head

    def body(i, carry):
        pages = page_ids_ref[pl.ds(i * pages_per_block, pages_per_block)] + head_offset
        k = tuple(ref[pages].reshape(block_tokens, w) for ref, w in zip(k_refs, widths, strict=True))
        k_scale = ks_ref[pages].reshape(block_tokens, 1) if ks_ref is not None else None
        if values_are_keys:  # MLA: the block just loaded is the values too (one read of the pool)
            v, v_scale = k, k_scale
        else:
            v = tuple(ref[pages].reshape(block_tokens, w) for ref, w in zip(v_refs, widths, strict=True))
            v_scale = vs_ref[pages].reshape(block_tokens, 1) if vs_ref is not None else None
        return attend_block(q, k, v, k_scale, v_scale, i * block_tokens, length, carry, scale=scale,
                             softcap=softcap, sliding_window=sliding_window, compute_dtype=compute_dtype)

    m, denom, acc = lax.fori_loop(lo, hi, body, init_carry(q[0].shape[0], widths))
    if not stats:
        for o_ref, piece in zip(out_refs, acc, strict=True):
            o_ref[...] = finish(denom, piece).astype(o_ref.dtype)
    else:  # unnormalised partial results, merged by _merge_splits
        m_ref, l_ref, *acc_refs = out_refs
        m_ref[...], l_ref[...] = m.reshape(m_ref.shape), denom.reshape(l_ref.shape)
        for acc_ref, piece in zip(acc_refs, acc, strict=True):
            acc_ref[...] = piece


def _merge_splits(m, denom, acc):
    """Combine per-split online-softmax states [..., splits, rows(, D)] (fp32) into the output and
    its log-sum-exp [..., rows] (-inf where nothing was attended). Empty splits carry
    m = MASK_VALUE, denom = 0, acc = 0 and get weight 0 (or l_total = 0 -> 0)."""
    m_total = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_total)
    l_total = jnp.sum(w * denom, axis=2)
    acc_total = jnp.sum(w[..., None] * acc, axis=2)
    out = jnp.where(l_total[..., None] > 0.0, acc_total / jnp.where(l_total > 0.0, l_total, 1.0)[..., None], 0.0)
    return out, log_sum_exp(m_total[:, :, 0], l_total)


def default_num_splits(slots: int, kv_heads: int, num_blocks: int) -> int:
    """Split each slot's blocks over enough programs to give ~256 (2 per SM of an H100) in all."""
    return max(1, min(num_blocks, -(-256 // (slots * kv_heads)), 16))


TRITON_MAX_ROWS = 64  # query rows a program holds (an MLA group is every head: DeepSeek-V3's 128 take 2 programs)


def _triton_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, *,
                 pages_per_block, pages_per_head, scale, softcap, sliding_window, interpret, compute_dtype, num_splits,
                 return_lse, values_are_keys):
    slots, kv_heads, group, head_dim = q4.shape
    flat_pages, page_size, _ = k_pages.shape
    for name, n in (("page_size", page_size), ("pages_per_block", pages_per_block)):
        if n & (n - 1):
            raise ValueError(f"paged attention (triton): {name}={n} must be a power of 2")
    pieces = head_pieces(head_dim)
    if not pieces:
        raise ValueError(f"paged attention (triton): head_dim={head_dim} must be a multiple of 16")
    if num_splits is None:
        num_splits = default_num_splits(slots, kv_heads, page_indices.shape[1] // pages_per_block)
    rows = max(16, next_power_of_two(group))  # tl.dot needs >= 16 rows; Triton blocks are powers of 2
    tile = min(rows, TRITON_MAX_ROWS)
    row_blocks = rows // tile
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    quantized = k_scales is not None

    def head(h):  # grid axis 1 -> (kv head, row block of its query rows)
        return lax.div(h, row_blocks), lax.rem(h, row_blocks)

    # Each piece of head_dim is its own block of q, of the pool and of the output (a BlockSpec over the full
    # head_dim); every program gathers its kv head's pages from the whole flattened pool by id (no copy).
    def q_spec(offset, width):
        return pl.BlockSpec((None, None, tile, width), lambda s, h, j: (s, *head(h), offset // width))

    def pool_spec(offset, width):
        return pl.BlockSpec((flat_pages, page_size, width), lambda s, h, j: (0, 0, offset // width))

    scale_pool = pl.BlockSpec((flat_pages, page_size), lambda s, h, j: (0, 0))
    in_specs = [pl.BlockSpec((1,), lambda s, h, j: (s,)),
                pl.BlockSpec((None, page_indices.shape[1]), lambda s, h, j: (s, 0))]
    pools = [k_pages] if values_are_keys else [k_pages, v_pages]
    in_specs += [q_spec(*p) for p in pieces] + [pool_spec(*p) for p in pieces] * len(pools)
    args = [lengths, page_indices] + [q4] * len(pieces) + [pool for pool in pools for _ in pieces]
    if quantized:
        in_specs += [scale_pool] * len(pools)
        args += [k_scales] if values_are_keys else [k_scales, v_scales]
    stats = num_splits > 1 or return_lse  # per-split (max, sum, unnormalised output), merged below
    if not stats:
        out_specs = [pl.BlockSpec((None, None, tile, w), lambda s, h, j: (s, *head(h), 0)) for _, w in pieces]
        out_shape = [jax.ShapeDtypeStruct((slots, kv_heads, rows, w), q4.dtype) for _, w in pieces]
    else:
        def stat_index(s, h, j):
            kv, block = head(h)
            return s, kv, j, block

        def part_index(s, h, j):
            return (*stat_index(s, h, j), 0)

        stat = pl.BlockSpec((None, None, None, tile), stat_index)
        out_specs = [stat, stat] + [pl.BlockSpec((None, None, None, tile, w), part_index) for _, w in pieces]
        stat_shape = jax.ShapeDtypeStruct((slots, kv_heads, num_splits, rows), jnp.float32)
        out_shape = [stat_shape, stat_shape] + [
            jax.ShapeDtypeStruct((slots, kv_heads, num_splits, rows, w), jnp.float32) for _, w in pieces]
    kernel = functools.partial(_triton_kernel, pieces=len(pieces), pages_per_block=pages_per_block,
                               pages_per_head=pages_per_head, row_blocks=row_blocks, scale=scale, softcap=softcap,
                               sliding_window=sliding_window, quantized=quantized, values_are_keys=values_are_keys,
                               compute_dtype=compute_dtype, num_splits=num_splits, stats=stats)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=4 if head_dim <= 256 else 8, num_stages=2)
    out = pl.pallas_call(
        kernel, grid=(slots, kv_heads * row_blocks, num_splits), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret, compiler_params=compiler_params,
        name="paged_decode_attention_triton",
    )(*args)
    if not stats:
        return jnp.concatenate(out, axis=-1)[:, :, :group], None
    m, denom, *parts = out
    out, lse = _merge_splits(m, denom, jnp.concatenate(parts, axis=-1))
    return out[:, :, :group], lse[:, :, :group] if return_lse else None


# ----------------------------------------------------------------------------------------------


def triton_supports(head_dim: int, page_size: int) -> bool:
    """Whether the Triton variant takes these shapes (its blocks are powers of 2: page_size one, head_dim a
    multiple of 16, split into power-of-2 pieces by `head_pieces`)."""
    return bool(head_pieces(head_dim)) and page_size > 0 and not page_size & (page_size - 1)


def default_variant() -> Variant:
    return "mosaic" if target_platform() == "tpu" else "triton"


@functools.partial(jax.jit, static_argnames=("sliding_window", "softcap", "interpret", "pages_per_block",
                                             "variant", "num_splits", "return_lse", "values_are_keys"))
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
                                  return_lse: bool = False,
                                  values_are_keys: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention of one query per slot over paged K/V; see the module docstring.

    `pages_per_block`: pages per inner-loop step (default `default_pages_per_block`).
    `variant`: "triton" | "mosaic" (default: "mosaic" on TPU, else "triton").
    `num_splits` (triton): programs sharing one slot's visible blocks, merged after the kernel
    (flash-decoding; default `default_num_splits`: more when slots * kv_heads is small).
    `layer`: int32 scalar; the pages (and scales) are then the whole pool with a leading layer axis.
    `softcap`: scores become cap * tanh(s / cap) (Gemma 2's attn_logit_softcapping).
    `return_lse`: also the log-sum-exp of each row's scores [slots, heads] fp32 (-inf: no key), and
    the output in fp32: a partial attention another part merges with (cascade_attention.py).
    `values_are_keys`: v_pages (and v_scales) are k_pages (and k_scales), as MLA's latent pool reads them
    (models/mla.py): each block is read from HBM once and serves as both.
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
        pages_per_block = default_pages_per_block(page_size, page_indices.shape[1], variant, kv_dim)
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
              interpret=interpret, compute_dtype=q.dtype, return_lse=return_lse, values_are_keys=values_are_keys)
    if variant == "triton":
        out, lse = _triton_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices,
                                num_splits=num_splits, **kw)
    else:
        out, lse = mosaic_call(q4, k_pages, v_pages, k_scales, v_scales, lengths, page_indices, **kw)
    out = out.reshape(slots, num_heads, kv_dim)[..., :head_dim]
    if lse is not None:  # return_lse
        return out.astype(jnp.float32), lse.reshape(slots, num_heads)
    return out.astype(q.dtype)

"""Paged decode attention: one query per slot over that slot's KV pages (block table).

Contract (shared with the Pallas kernel, jaxrl_llm/sampler/paged_attention_pallas.py, and the CPU
kernel, jaxrl_llm/sampler/native):

    paged_decode_attention(q, k_pages, v_pages, lengths, page_indices, *, sliding_window=None) -> out
    q            [slots, num_heads, head_dim]                      compute dtype, RoPE'd
    k/v_pages    [num_kv_heads, num_pages, page_size, head_dim]    KV dtype
    lengths      [slots] int32  valid KV tokens (incl. the current one); 0 = empty slot -> output 0
    page_indices [slots, pages_per_slot] int32; entries past ceil(length / page_size) are ignored
    sliding_window: a key at position p is seen iff p >= length - W
    layer        optional int32 scalar: k/v_pages (and scales) are then the whole pool with a leading
                 layer axis [layers, num_kv_heads, num_pages, page_size, head_dim]
    out          [slots, num_heads, head_dim] in q's dtype

GQA: query head h reads kv head h // (num_heads // num_kv_heads); scale head_dim ** -0.5.
Numerics (the trainer's dense attention, models/attention.py): q.k with fp32 accumulation, scaled
in fp32, softmax in fp32 with a finite mask value, probabilities times V by `probs_times_values`
(two bf16 terms for bf16 V), the result cast to q's dtype.

The XLA path runs the trainer's attention operation for operation, so a bf16 rollout's log-probs
follow the trainer's scoring (up to the summation order of the probs.V sum over blocks): pass 1
computes the scores block by block into a [slots, heads, keys] fp32 buffer (4 bytes per key and
head, against the K row's head_dim x 2), the softmax runs over that buffer exactly as the
trainer's, and pass 2 multiplies the probabilities by V block by block. Both passes are
`lax.while_loop`s over blocks of pages up to the longest slot only, so the K/V reads of a decode
step grow with the real lengths, not with the pool or the page-table width. (An online softmax,
flash-decoding's running max / sum / output, reads K and V once too, but rescales partial sums
in an order the trainer never uses: on SmolLM2 in bf16 it put the rollout ~4x further from the
trainer than the static sampler.) Optional int8 pages (`k_scales` / `v_scales`, per token per
head) are dequantised block by block. The Pallas kernels keep the online softmax. On CPU, fp32 pages
go to a C++ kernel (sampler/native) that runs the same two passes per (slot, kv head) straight from
the pages, without the gathered blocks XLA:CPU materialises (4x faster per layer at 32 slots of ~512
keys); its sums run in another order, so it agrees with this path to fp32 rounding (~5e-7).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import invariant
from jaxrl_llm.models.numerics import MASKED_SCORE, probs_times_values
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler import cascade_attention, native
from jaxrl_llm.sampler.kv_bits import from_storage
from jaxrl_llm.sampler.kv_shards import per_kv_head_shard
from jaxrl_llm.sampler.paged_blocks import (
    attention_scores,
    block_layout,
    flat_pool,
    gather_block,
    query_rows,
    trainer_softmax,
    with_sinks,
)

Array = jax.Array
IMPLS = ("auto", "xla", "pallas", "cpu")


def paged_decode_attention_xla(q: Array, k_pages: Array, v_pages: Array, lengths: Array,
                               page_indices: Array, *, sliding_window: int | None = None,
                               k_scales: Array | None = None, v_scales: Array | None = None,
                               layer: Array | None = None, softcap: float | None = None,
                               sinks: Array | None = None) -> Array:
    """The contract's attention in plain XLA (any backend); see the module docstring. `sinks`: fp32
    [heads] attention sinks (GPT-OSS) in the trainer's softmax.

    k_scales / v_scales: fp32 [num_kv_heads, num_pages, page_size] when the pages hold int8
    (value = int8 * scale), else None. layer: with a layer index, the pages (and scales) are the
    whole pool with a leading layer axis and each block gathers its pages from that layer directly
    (slicing the layer out first copies the layer's entire pool every step: on CPU that copy was
    ~40% of a decode step at 32 slots). softcap: scores become cap * tanh(s / cap) (Gemma 2).
    """
    q = jnp.asarray(q)
    pool = flat_pool(k_pages, v_pages, k_scales, v_scales, layer, q.shape[-1])
    qg = query_rows(q, pool)
    slots, nkv, g, hd = qg.shape
    ppb, num_blocks, block_tokens = block_layout(pool.page_size, page_indices.shape[1])
    # pad the table so every block slice is in range (padding entries are never valid keys)
    table = jnp.pad(jnp.asarray(page_indices, jnp.int32), ((0, 0), (0, num_blocks * ppb - page_indices.shape[1])))
    lengths = jnp.asarray(lengths, jnp.int32)
    lo = jnp.zeros_like(lengths) if sliding_window is None else lengths - sliding_window

    def block_scores(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, buf = carry
        ids = lax.dynamic_slice_in_dim(table, i * ppb, ppb, axis=1)  # [slots, ppb]
        scores = attention_scores(qg, gather_block(pool, "k", ids, q.dtype), softcap)
        pos = i * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        valid = (pos[None, :] < lengths[:, None]) & (pos[None, :] >= lo[:, None])  # [slots, n]
        scores = jnp.where(valid[:, None, None, :], scores, MASKED_SCORE)
        return i + 1, lax.dynamic_update_slice_in_dim(buf, scores, i * block_tokens, axis=3)

    def block_values(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, acc = carry
        ids = lax.dynamic_slice_in_dim(table, i * ppb, ppb, axis=1)
        p = lax.dynamic_slice_in_dim(probs, i * block_tokens, block_tokens, axis=3)
        return i + 1, acc + probs_times_values("skgn,sknd->skgd", p, gather_block(pool, "v", ids, q.dtype))

    first = jnp.min(jnp.where(lengths > 0, lo, jnp.iinfo(jnp.int32).max)) // block_tokens
    first = jnp.clip(first, 0, num_blocks)
    last = jnp.minimum(-(-jnp.max(lengths) // block_tokens), num_blocks)
    # pass 1: the scores of the blocks up to the longest slot (a few bytes per key, against the K/V
    # rows' hundreds); blocks outside stay masked
    buf = jnp.full((slots, nkv, g, num_blocks * block_tokens), MASKED_SCORE, jnp.float32)
    _, scores = lax.while_loop(lambda c: c[0] < last, block_scores, (first, buf))
    probs = trainer_softmax(scores, lengths, sinks)
    # pass 2: probabilities x V block by block, with the trainer's `probs_times_values`
    init = (first, jnp.zeros((slots, nkv, g, hd), jnp.float32))
    _, out = lax.while_loop(lambda c: c[0] < last, block_values, init)
    return out.reshape(q.shape).astype(q.dtype)


def paged_decode_attention_invariant(q: Array, k_pages: Array, v_pages: Array, lengths: Array,
                                     page_indices: Array, *, sliding_window: int | None = None,
                                     layer: Array | None = None, softcap: float | None = None,
                                     sinks: Array | None = None, mesh: Mesh | None = None,
                                     cascade: cascade_attention.Cascade | None = None) -> Array:
    """The contract's attention with the batch-invariant numerics (models/invariant.py): a token's output has the
    bits of the trainer's and the static sampler's attention. On GPU and TPU the pool is read in place by the
    mode's paged kernel (models/invariant_paged_attention.py `paged_attention`: the contiguous kernel's tiles and
    steps, its key blocks made of the slot's pages) where its shapes hold (`paged_supported`), per kv-head shard
    on `mesh` as the default kernels; elsewhere each slot's pages are gathered in order (position 0 first) and
    attended by `invariant.attend_blocks`. Compute-dtype pages only (int8 pages are refused by the config).
    `cascade` (the kernels, no sliding window): `invariant_cascade`."""
    from jaxrl_llm.models import invariant_paged_attention

    q = jnp.asarray(q)
    if layer is None:  # one layer's pages: the kernels read a stacked pool
        k_pages, v_pages, layer = jnp.asarray(k_pages)[None], jnp.asarray(v_pages)[None], jnp.int32(0)
    layer = jnp.asarray(layer, jnp.int32)

    def gathered(q, k_pages, v_pages, lengths, page_indices):
        pool = flat_pool(k_pages, v_pages, None, None, layer, q.shape[-1])
        qg = query_rows(q, pool)  # [slots, kv, g, D]
        slots, nkv, g, _ = qg.shape
        table = jnp.asarray(page_indices, jnp.int32)
        k, v = gather_block(pool, "k", table, q.dtype), gather_block(pool, "v", table, q.dtype)
        lengths = jnp.asarray(lengths, jnp.int32)
        pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
        valid = pos < lengths[:, None]
        if sliding_window is not None:
            valid &= pos >= (lengths - sliding_window)[:, None]
        valid = jnp.broadcast_to(valid[:, None, None, :], (slots, 1, g, k.shape[2]))
        sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, nkv, g)
        out, _ = invariant.attend_blocks(qg, k, v, valid, sink, softcap)
        out = out * (lengths > 0)[:, None, None, None]
        return out.reshape(q.shape).astype(q.dtype)

    groups = () if cascade is None or sliding_window is not None else (cascade.group_slots, cascade.prefix_pages)

    def in_place(variant: str, interpret: bool = False):
        if not invariant_paged_attention.paged_supported(variant, q.shape[-1], k_pages.shape[-1], k_pages.shape[-2]):
            return gathered

        def run(q, k_pages, v_pages, lengths, table, layer, *rest):
            nkv = k_pages.shape[1]
            qg = q.reshape(q.shape[0], nkv, q.shape[1] // nkv, q.shape[2])
            sink = rest[len(groups)] if sinks is not None else None
            kp, vp = from_storage(k_pages), from_storage(v_pages)
            if groups:
                out = invariant_cascade(qg, kp, vp, lengths, table, cascade_attention.Cascade(*rest[:len(groups)]),
                                        layer=layer, sink=sink, softcap=softcap, variant=variant, interpret=interpret)
            else:
                out = invariant_paged_attention.paged_attention(qg, kp, vp, lengths, table, layer=layer,
                                                                window=sliding_window, sink=sink, softcap=softcap,
                                                                variant=variant, interpret=interpret)
            return out.reshape(q.shape).astype(q.dtype)

        # the sinks (split per query head) last: their position among the replicated arguments is fixed
        rest = (layer, *groups) + (() if sinks is None else (sinks.astype(jnp.float32),))
        per_shard = per_kv_head_shard(run, mesh, k_pages, replicated=2 + len(rest),
                                      per_head=() if sinks is None else (1 + len(rest),))
        return lambda q, kp, vp, lens, table: per_shard(q, kp, vp, lens, table, *rest)

    interpreted = invariant.interpreted_kernel()  # tests: a kernel in Pallas's interpreter on CPU
    default = gathered if interpreted is None else in_place(interpreted, interpret=True)
    return lax.platform_dependent(q, k_pages, v_pages, lengths, page_indices, cuda=in_place("triton"),
                                  tpu=in_place("mosaic"), default=default)


def invariant_cascade(q4: Array, k_pool: Array, v_pool: Array, lengths: Array, table: Array,
                      cascade: cascade_attention.Cascade, *, layer: Array, sink: Array | None,
                      softcap: float | None, variant: str, interpret: bool = False) -> Array:
    """The mode's paged kernel (`invariant_paged_attention.paged_attention`) with the cascade's groups reading their
    shared prompt pages once: fp32 [slots, kv, g, D] with the bits of the plain call. A walk over a slot's key
    blocks is a sequence of fixed-tile online-softmax steps in which a query row's sums read only that row, so
    the walk can be cut at a block boundary: the shared call walks each group's whole shared key blocks (the
    members' M x g query rows stacked in the kernel's row tiles, one read of each shared page per kv head) and
    returns its exact fp32 state; each member's own call continues from that state at the first unshared block
    (the block holding the end of the shared pages, partly shared, is the member's own). No sliding window."""
    from jaxrl_llm.models import invariant_paged_attention

    slots, nkv, g, d = q4.shape
    page_size = k_pool.shape[-2]
    keys = invariant_paged_attention.paged_blocks(variant, d)[1]
    lengths = jnp.asarray(lengths, jnp.int32)
    idx, safe, _, slot_pages, row_pages = cascade_attention.members(cascade, lengths)
    rows, m = idx.shape
    shared_tokens = (row_pages * page_size) // keys * keys  # whole key blocks of each group's shared pages
    q_rows = q4[safe].transpose(0, 2, 1, 3, 4).reshape(rows, nkv, m * g, d)  # kv head h: members x g rows
    row_sink = None if sink is None else jnp.tile(sink.astype(jnp.float32).reshape(nkv, 1, g), (1, m, 1))
    shared = invariant_paged_attention.paged_walk_state(
        q_rows, k_pool, v_pool, shared_tokens, cascade_attention.group_table(table, cascade, row_pages, table.shape[1]),
        layer=layer, sink=row_sink, softcap=softcap, variant=variant, interpret=interpret)

    def per_slot(x: Array) -> Array:  # [G, kv, M * g, w] -> [slots, kv, g, w]; zeros where no member (unread)
        x = x.reshape(rows, nkv, m, g, x.shape[-1]).swapaxes(1, 2)
        return jnp.zeros((slots + 1, *x.shape[2:]), x.dtype).at[idx].set(x)[:slots]

    # the shared blocks each slot skips: 0 (a walk from its first block) outside a group, for a finished member,
    # or where the group shares no whole block
    start = jnp.where(lengths > 0, (slot_pages * page_size) // keys, 0)
    state = invariant_paged_attention.OnlineState(per_slot(shared.m), per_slot(shared.denom), per_slot(shared.acc))
    return invariant_paged_attention.paged_attention(q4, k_pool, v_pool, lengths, table, layer=layer, window=None,
                                                     sink=sink, softcap=softcap, variant=variant, interpret=interpret,
                                                     start=start, state=state)


def takes_xla_path(impl: str, int8_pages: bool) -> bool:
    """Whether `paged_decode_attention` runs the XLA path or the CPU kernel (not a Pallas kernel) for
    programs built for `target_platform()`: impl 'xla' or 'cpu', int8 pages, or 'auto' on CPU. (On
    CUDA the dispatcher also falls back to XLA where the Triton kernel's power-of-two shapes do not
    hold; that choice is made at lowering.)"""
    return impl in ("xla", "cpu") or int8_pages or (impl == "auto" and target_platform() == "cpu")


def takes_cpu_kernel(impl: str, q_dtype: DType, page_dtype: DType, int8_pages: bool, cascade: bool) -> bool:
    """Whether `paged_decode_attention` runs the CPU kernel (sampler/native): impl 'cpu', or 'auto' for
    a CPU target where the kernel builds, on fp32 pages without cascade rows (bf16 / int8 pools and
    cascade rows keep the XLA path). impl 'cpu' on inputs it does not take is an error."""
    if impl not in ("auto", "cpu") or (impl == "auto" and target_platform() != "cpu"):
        return False
    fits = not cascade and native.supports(q_dtype, page_dtype, int8_pages)
    if impl == "cpu" and not fits:
        raise ValueError(f"rollout.paged_attention='cpu' takes fp32 pages without int8 KV or cascade rows; got "
                         f"{jnp.dtype(page_dtype).name} pages, kv_cache_dtype {'int8' if int8_pages else 'auto'}, "
                         f"cascade {'on' if cascade else 'off'} (use 'auto' or 'xla')")
    return fits and (impl == "cpu" or native.available())


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"paged attention impl={impl!r}: expected one of {IMPLS}")


def paged_decode_attention(q: Array, k_pages: Array, v_pages: Array, lengths: Array, page_indices: Array, *,
                           sliding_window: int | None = None, impl: str = "auto",
                           k_scales: Array | None = None, v_scales: Array | None = None,
                           layer: Array | None = None, mesh: Mesh | None = None,
                           softcap: float | None = None, cascade: cascade_attention.Cascade | None = None,
                           sinks: Array | None = None) -> Array:
    """Dispatcher: the Pallas kernel (imported lazily), the CPU kernel or the XLA path. 'auto' takes the
    kernel of the platform the program is lowered for (Triton on CUDA where its power-of-two shapes
    hold, Mosaic on TPU; `lax.platform_dependent`, so a program compiled here for a TPU topology gets
    Mosaic; on CPU the C++ kernel of sampler/native for fp32 pages where it builds) and the XLA path
    elsewhere; 'pallas' forces the Pallas kernel (on CPU: interpreted), 'cpu' the CPU one. int8 pages always take
    the XLA path (it dequantises block by block; the kernel reads compute-dtype pages). layer: the
    pages are the whole pool [layers, kv, pages, page_size, head_dim], read by layer index. mesh: the
    program's mesh (an engine's whose slots are replicated: pool kv heads over 'tensor' where they divide;
    XLA cannot partition a kernel's custom call, so there it runs per shard under shard_map). An engine
    with slot shards calls it per shard without a mesh (engine/slot_shards.py).
    cascade: a `cascade_attention.Cascade` (slots sharing leading pages read them once per group;
    the Pallas path keeps the plain kernel in sliding-window layers), or None. sinks: fp32 [heads] attention
    sinks (GPT-OSS): in the XLA paths' softmax, joined to the Pallas kernels' results by their
    log-sum-exp (`with_sinks`); the CPU kernel does not take them (the XLA path runs)."""
    _check_impl(impl)
    if invariant.enabled():  # model.batch_invariant: the dense path's blocked order (models/invariant.py)
        return paged_decode_attention_invariant(q, k_pages, v_pages, lengths, page_indices,
                                                sliding_window=sliding_window, layer=layer, softcap=softcap,
                                                sinks=sinks, mesh=mesh, cascade=cascade)
    if impl == "cpu" and sinks is not None:
        raise ValueError("rollout.paged_attention='cpu' does not take attention sinks (GPT-OSS); use 'auto' or 'xla'")
    if sinks is None and takes_cpu_kernel(impl, q.dtype, k_pages.dtype, k_scales is not None, cascade is not None):
        return native.paged_decode_attention_cpu(q, k_pages, v_pages, lengths, page_indices, layer=layer,
                                                 sliding_window=sliding_window, softcap=softcap, mesh=mesh)

    def xla(q, k_pages, v_pages, lengths, page_indices):
        if cascade is not None:
            return cascade_attention.cascade_decode_attention_xla(
                q, k_pages, v_pages, lengths, page_indices, cascade, sliding_window=sliding_window,
                k_scales=k_scales, v_scales=v_scales, layer=layer, softcap=softcap, sinks=sinks)
        return paged_decode_attention_xla(q, k_pages, v_pages, lengths, page_indices, sliding_window=sliding_window,
                                          k_scales=k_scales, v_scales=v_scales, layer=layer, softcap=softcap,
                                          sinks=sinks)

    if takes_xla_path(impl, k_scales is not None):
        return xla(q, k_pages, v_pages, lengths, page_indices)
    from jaxrl_llm.sampler.paged_attention_pallas import paged_decode_attention_pallas, triton_supports
    use_cascade = cascade is not None and sliding_window is None
    values_are_keys = v_pages is k_pages  # MLA's latent pool (models/mla.py): the kernels read each block once

    def kernel(variant: str, interpret: bool = False):
        def run(q, k_pages, v_pages, lengths, page_indices, sinks, groups, layer=None):
            k_pages, v_pages = from_storage(k_pages), from_storage(v_pages)
            if use_cascade:
                return cascade_attention.cascade_decode_attention_pallas(
                    q, k_pages, v_pages, lengths, page_indices, cascade_attention.Cascade(*groups), layer=layer,
                    softcap=softcap, variant=variant, interpret=interpret, sinks=sinks,
                    values_are_keys=values_are_keys)
            kw = dict(sliding_window=sliding_window, layer=layer, softcap=softcap, variant=variant,
                      interpret=interpret, values_are_keys=values_are_keys)
            if sinks is None:
                return paged_decode_attention_pallas(q, k_pages, v_pages, lengths, page_indices, **kw)
            out, lse = paged_decode_attention_pallas(q, k_pages, v_pages, lengths, page_indices, return_lse=True,
                                                     **kw)
            return with_sinks(out, lse, sinks).astype(q.dtype)
        groups = (cascade.group_slots, cascade.prefix_pages) if use_cascade and cascade is not None else ()
        rest = (sinks, groups) if layer is None else (sinks, groups, layer)
        per_shard = per_kv_head_shard(run, mesh, k_pages, replicated=2 + len(rest), per_head=(2,))
        return lambda q, kp, vp, lens, pages: per_shard(q, kp, vp, lens, pages, *rest)

    triton = kernel("triton") if impl == "pallas" or triton_supports(q.shape[-1], k_pages.shape[-2]) else xla
    default = kernel("triton", interpret=True) if impl == "pallas" else xla
    # the kernel reads the stacked pool by layer index (no copy of the layer's pool per step)
    return lax.platform_dependent(q, k_pages, v_pages, lengths, page_indices, cuda=triton, tpu=kernel("mosaic"),
                                  default=default)

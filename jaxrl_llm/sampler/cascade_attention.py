"""Cascade (shared-prefix) decode attention: a group's prompt pages read once for its n samples.

The n samples of a prompt share the prompt's full KV pages (the scheduler allocates them once,
engine/scheduler.py). Plain paged attention still reads those pages once per sample every decode
step; here the group's shared pages are read once and attended by all its members' queries
(n query rows against one K/V stream), and each slot's own pages (the partial last prompt page and
the response) are read by the slot alone. Prompt-KV traffic drops by the group size.

    cascade = Cascade(group_slots [G, M] int32, prefix_pages [G] int32)

Row g lists the slots of one group (-1: no member) and how many leading pages of their page tables
they share (every member's first `prefix_pages[g]` table entries are the same pages, all full of
valid keys). A slot appears in at most one row; slots in no row (or in a row with 0 pages) are
read the plain way. The engine builds the rows on the host before each `generate` call from its
own bookkeeping; G = slots // 2 rows suffice (only groups with two or more members in slots get
one) and M = the samples per prompt.

XLA path: the same two passes and the same softmax as `paged_attention_xla` (the trainer's
numerics, the reason that path keeps a score buffer rather than an online softmax): pass 1 writes
the shared blocks' scores from the group's K once per group, and each slot's own blocks at its
own offset; the softmax over the slot's buffer is the plain path's; pass 2 multiplies the shared
probabilities by the group's V once per group. Only the order of the probs.V sum over blocks
differs from the plain path (equal to 1e-6 in fp32, tests/sampler/test_cascade_attention.py).

Pallas path: the kernel itself, twice. The shared part is one kernel call with one "slot" per
group whose query heads are the members' (kv head h attends with its M x g query rows: one read
of each shared page per kv head); the own part is the kernel over the tables shifted past the
shared pages. Both return their log-sum-exps, and the two partial outputs merge by them (flash
decoding's merge). Sliding-window layers keep the plain kernel (a member's window can cut into
the shared prefix at a member-dependent point, which one kernel slot per group cannot express).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.models.numerics import MASKED_SCORE, probs_times_values
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


class Cascade(NamedTuple):
    """Which slots share which leading pages (see the module doc). Fields are jax or numpy int32
    arrays (the scheduler builds them on the host), or ShapeDtypeStructs when a program is lowered."""

    group_slots: Any  # int32 [G, M]: member slots, -1 = none
    prefix_pages: Any  # int32 [G]: shared full pages of the row's members (0 = unused row)


class Members(NamedTuple):
    """A cascade's rows resolved against the slots' lengths (both paths start from these)."""

    slot_ids: Array  # [G, M] member slots, `slots` (a scratch row past the last, dropped by scatters) for none
    safe: Array  # [G, M] slot_ids clipped into range, for gathers (a non-member's values land in the scratch row)
    member: Array  # [G, M] bool
    slot_pages: Array  # [S] shared pages each slot reads through its row (0: none, or its row idle)
    row_pages: Array  # [G] shared pages of each row, 0 where no member is live (length > 0)


def members(cascade: Cascade, lengths: Array) -> Members:
    slots = lengths.shape[0]
    gs = jnp.asarray(cascade.group_slots, jnp.int32)
    index = jnp.where(gs >= 0, gs, slots)
    safe = jnp.minimum(index, slots - 1)
    member = index < slots
    live = jnp.any(member & (jnp.asarray(lengths, jnp.int32)[safe] > 0), axis=1)
    rows = jnp.where(live, jnp.asarray(cascade.prefix_pages, jnp.int32), 0)
    per_slot = jnp.zeros((slots + 1,), jnp.int32).at[index].set(jnp.broadcast_to(rows[:, None], index.shape))
    return Members(index, safe, member, per_slot[:slots], rows)


def shifted_table(page_indices: Array, skip: Array, width: int) -> Array:
    """Each slot's page table from entry skip[s] on, `width` entries (zeros past its end)."""
    table = jnp.pad(jnp.asarray(page_indices, jnp.int32), ((0, 0), (0, width)))
    cols = jnp.arange(width, dtype=jnp.int32)[None, :] + skip[:, None]
    return jnp.take_along_axis(table, cols, axis=1)


def group_table(page_indices: Array, cascade: Cascade, rows: Array, width: int) -> Array:
    """[G, width] the shared pages of each row (its first member's first rows[g] entries; 0 after)."""
    leader = jnp.maximum(jnp.asarray(cascade.group_slots, jnp.int32)[:, 0], 0)
    table = jnp.pad(jnp.asarray(page_indices, jnp.int32), ((0, 0), (0, max(0, width - page_indices.shape[1]))))
    table = table[leader, :width]
    return jnp.where(jnp.arange(width)[None, :] < rows[:, None], table, 0)


def cascade_decode_attention_xla(q: Array, k_pages: Array, v_pages: Array, lengths: Array, page_indices: Array,
                                 cascade: Cascade, *, sliding_window: int | None = None,
                                 k_scales: Array | None = None, v_scales: Array | None = None,
                                 layer: Array | None = None, softcap: float | None = None,
                                 sinks: Array | None = None) -> Array:
    """`paged_decode_attention_xla` with the rows of `cascade` reading their shared pages once."""
    q = jnp.asarray(q)
    pool = flat_pool(k_pages, v_pages, k_scales, v_scales, layer, q.shape[-1])
    qg = query_rows(q, pool)
    slots, nkv, g, hd = qg.shape
    ps = pool.page_size
    ppb, num_blocks, bt = block_layout(ps, page_indices.shape[1])  # bt: keys per block
    width = num_blocks * bt  # the plain path's score buffer
    lengths = jnp.asarray(lengths, jnp.int32)
    lo = jnp.zeros_like(lengths) if sliding_window is None else lengths - sliding_window
    idx, safe, member, pre, rows = members(cascade, lengths)
    pre_tok, row_tok = pre * ps, rows * ps
    big = jnp.iinfo(jnp.int32).max

    # --- shared part, per row, laid out [G, kv, M * g, ...] (the members' query rows of a kv head
    # side by side: the plain path's 4-D matmuls) with one K/V gather per row
    gtable = group_table(page_indices, cascade, rows, num_blocks * ppb)
    nrows, m = idx.shape
    q_rows = qg[safe].swapaxes(1, 2).reshape(nrows, nkv, m * g, hd)
    m_len, m_lo = lengths[safe], lo[safe]
    m_live = member & (m_len > 0)
    sh_first = jnp.clip(jnp.min(jnp.where(m_live & (row_tok[:, None] > 0), m_lo, big)) // bt, 0, num_blocks)
    sh_last = jnp.minimum(-(-jnp.max(row_tok) // bt), num_blocks)

    def shared_scores(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, buf = carry
        ids = lax.dynamic_slice_in_dim(gtable, i * ppb, ppb, axis=1)  # [G, ppb]
        k = gather_block(pool, "k", ids, q.dtype)  # [G, kv, bt, hd]
        scores = attention_scores(q_rows, k, softcap).reshape(nrows, nkv, m, g, bt)
        pos = i * bt + jnp.arange(bt, dtype=jnp.int32)
        valid = ((pos[None, None] < row_tok[:, None, None]) & (pos[None, None] >= m_lo[..., None])
                 & m_live[..., None])  # [G, M, bt]
        scores = jnp.where(valid[:, None, :, None], scores, MASKED_SCORE)
        return i + 1, lax.dynamic_update_slice_in_dim(buf, scores, i * bt, axis=4)

    gbuf = jnp.full((nrows, nkv, m, g, width), MASKED_SCORE, jnp.float32)
    _, gbuf = lax.while_loop(lambda c: c[0] < sh_last, shared_scores, (sh_first, gbuf))
    # one block of headroom: a slot's own blocks start at its own offset (no clamped write)
    buf = jnp.full((slots + 1, nkv, g, width + bt), MASKED_SCORE, jnp.float32)
    buf = buf.at[idx, ..., :width].set(gbuf.swapaxes(1, 2))[:slots]

    # --- own part, per slot, from its first unshared page
    own_table = shifted_table(page_indices, pre, num_blocks * ppb)
    own_len = jnp.where(lengths > 0, lengths - pre_tok, 0)
    own_first = jnp.clip(jnp.min(jnp.where(lengths > 0, lo - pre_tok, big)) // bt, 0, num_blocks)
    own_last = jnp.minimum(-(-jnp.max(own_len) // bt), num_blocks)
    at_offset = jax.vmap(lambda row, blk, start: lax.dynamic_update_slice_in_dim(row, blk, start, axis=2))
    slice_at = jax.vmap(lambda row, start: lax.dynamic_slice_in_dim(row, start, bt, axis=2))

    def own_scores(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, buf = carry
        ids = lax.dynamic_slice_in_dim(own_table, i * ppb, ppb, axis=1)
        scores = attention_scores(qg, gather_block(pool, "k", ids, q.dtype), softcap)
        pos = pre_tok[:, None] + i * bt + jnp.arange(bt, dtype=jnp.int32)[None, :]  # absolute positions
        valid = (pos < lengths[:, None]) & (pos >= lo[:, None])
        scores = jnp.where(valid[:, None, None, :], scores, MASKED_SCORE)
        return i + 1, at_offset(buf, scores, pre_tok + i * bt)

    _, buf = lax.while_loop(lambda c: c[0] < own_last, own_scores, (own_first, buf))
    probs = trainer_softmax(buf, lengths, sinks)

    def shared_values(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, acc = carry
        ids = lax.dynamic_slice_in_dim(gtable, i * ppb, ppb, axis=1)
        p = lax.dynamic_slice_in_dim(probs, i * bt, bt, axis=3)[safe]  # [G, M, kv, g, bt]
        # only the shared keys: the block's later positions are the members' own (read below)
        pos = i * bt + jnp.arange(bt, dtype=jnp.int32)
        shared_key = pos[None] < row_tok[:, None]  # [G, bt]
        p = jnp.where(shared_key[:, None, None, None], p, 0.0).swapaxes(1, 2).reshape(nrows, nkv, m * g, bt)
        return i + 1, acc + probs_times_values("gkrn,gknd->gkrd", p, gather_block(pool, "v", ids, q.dtype))

    def own_values(carry: tuple[Array, Array]) -> tuple[Array, Array]:
        i, acc = carry
        ids = lax.dynamic_slice_in_dim(own_table, i * ppb, ppb, axis=1)
        p = slice_at(probs, pre_tok + i * bt)
        return i + 1, acc + probs_times_values("skgn,sknd->skgd", p, gather_block(pool, "v", ids, q.dtype))

    _, shared = lax.while_loop(lambda c: c[0] < sh_last, shared_values,
                               (sh_first, jnp.zeros((nrows, nkv, m * g, hd), jnp.float32)))
    shared = shared.reshape(nrows, nkv, m, g, hd).swapaxes(1, 2)  # [G, M, kv, g, hd]
    _, out = lax.while_loop(lambda c: c[0] < own_last, own_values,
                            (own_first, jnp.zeros((slots, nkv, g, hd), jnp.float32)))
    out = out + jnp.zeros((slots + 1, nkv, g, hd), jnp.float32).at[idx].add(shared)[:slots]
    return out.reshape(q.shape).astype(q.dtype)


def merge_partials(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> Array:
    """Softmax-weighted sum of two normalised partial attentions over disjoint keys (fp32 [S, H, D]
    and their log-sum-exps [S, H]; -inf: that part saw no key)."""
    peak = jnp.maximum(lse_a, lse_b)
    safe_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    wa = jnp.where(jnp.isfinite(lse_a), jnp.exp(lse_a - safe_peak), 0.0)
    wb = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - safe_peak), 0.0)
    total = wa + wb
    merged = (wa[..., None] * out_a + wb[..., None] * out_b) / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.where(total[..., None] > 0, merged, 0.0)


def cascade_decode_attention_pallas(q: Array, k_pages: Array, v_pages: Array, lengths: Array, page_indices: Array,
                                    cascade: Cascade, *, layer: Array | None = None, softcap: float | None = None,
                                    variant: Any = None, interpret: bool = False, sinks: Array | None = None,
                                    values_are_keys: bool = False) -> Array:
    """The Pallas kernel twice (shared rows as one slot each with the members' query heads, then
    every slot's own pages) merged by log-sum-exp; see the module doc. No sliding window. `sinks`:
    attention sinks joined to the merged result by its log-sum-exp. `values_are_keys`: MLA's latent pool,
    read once a block (paged_attention_pallas.py)."""
    from jaxrl_llm.sampler.paged_attention_pallas import paged_decode_attention_pallas
    slots, nh, hd = q.shape
    nkv = k_pages.shape[-4]
    ps = k_pages.shape[-2]
    g = nh // nkv
    lengths = jnp.asarray(lengths, jnp.int32)
    idx, safe, _, pre, rows = members(cascade, lengths)
    kw = dict(layer=layer, softcap=softcap, variant=variant, interpret=interpret, return_lse=True,
              values_are_keys=values_are_keys)
    # shared: row r is one kernel slot whose kv head h has the members' M x g query rows
    m = idx.shape[1]
    qv = q.reshape(slots, nkv, g, hd)[safe]  # [G, M, kv, g, hd]
    qv = qv.transpose(0, 2, 1, 3, 4).reshape(idx.shape[0], nkv * m * g, hd)
    gtable = group_table(page_indices, cascade, rows, page_indices.shape[1])
    out_s, lse_s = paged_decode_attention_pallas(qv, k_pages, v_pages, rows * ps, gtable, **kw)

    def per_slot(x: Array, fill: float) -> Array:  # [G, kv * M * g, ...] -> [S, nh, ...]
        x = x.reshape(idx.shape[0], nkv, m, g, *x.shape[2:]).swapaxes(1, 2)  # [G, M, kv, g, ...]
        base = jnp.full((slots + 1, *x.shape[2:]), fill, x.dtype)
        return base.at[idx].set(x)[:slots].reshape(slots, nh, *x.shape[4:])

    out_s, lse_s = per_slot(out_s, 0.0), per_slot(lse_s, -jnp.inf)
    lse_s = jnp.where(((pre > 0) & (lengths > 0))[:, None], lse_s, -jnp.inf)  # finished members: nothing
    # own: each slot's table past its shared pages, its length counted from there (a window is shift-free)
    own_len = jnp.where(lengths > 0, lengths - pre * ps, 0)
    own_table = shifted_table(page_indices, pre, page_indices.shape[1])
    out_o, lse_o = paged_decode_attention_pallas(q, k_pages, v_pages, own_len, own_table, **kw)
    merged = merge_partials(out_s, lse_s, out_o, lse_o)
    if sinks is not None:
        merged = with_sinks(merged, jnp.logaddexp(lse_s, lse_o), sinks)
    return merged.astype(q.dtype)

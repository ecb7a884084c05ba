"""Attention (and Qwen3.5's gated delta rule, `context_parallel_delta_rule`) with each row's tokens split over the
mesh's 'context' axis (context parallelism): the
training forward / backward and the no-grad scoring passes of `dense_attention` (models/decoder.py)
when the traced program's mesh has context > 1. Three ways to attend, `ModelConfig.context_attention`:

- `ring` (the default: the fastest and by far the leanest measured, docs/long_context.md): each
  device keeps its own query rows and passes its key / value block around the axis (`ppermute`), one
  block per step. Its rows run in query chunks, one at a time (a loop of dynamic length over the
  chunks that see the block: none for the causal future or another packed segment), and merge into
  the running result by log-sum-exp. A hand-written backward passes the blocks around again with
  their key / value gradients travelling beside them, so each block returns home with its gradient
  summed. Per device: one block, one chunk's scores [chunk, T / context], the mask rows [T / context, T].
- `all_to_all` (DeepSpeed Ulysses, veRL's `ulysses_sequence_parallel_size`): an all-to-all trades the
  token split for a head split, each device attends the whole row for num_heads / context heads
  (causal, as the unsplit pass: blockwise for long rows), and a second all-to-all trades it back.
  Needs the query heads divisible by the context size; key / value heads that are not are repeated
  first. Per device: the whole mask [T, T] and its heads' scores.
- `gather`: every device gathers the row's keys / values and scores its query rows against all of
  them ([T / context, T] scores at once). Batch-invariant mode (models/invariant.py) always attends this
  way, with the invariant kernel (`key_start`): a query's whole sum then runs on one device in the
  kernel's fixed block order, so the split changes no bit (a ring would add blocks in another order).

All three take the packed rows' mask as it is ([B, T, S] bool, split over T: segments, shared-prompt
branches, causality, sliding windows), so each gives the unsplit attention's numbers. They run per
device (`shard_map`): under automatic partitioning the grouped queries' (group, token) merge lost the
token split and every device computed all the scores. Rows stay split over the batch axes and heads
over 'tensor' where they divide.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxrl_llm.models.attention import attend, attend_invariant, sink_grads
from jaxrl_llm.models.blockwise import (
    blockwise_grads,
    blockwise_update,
    causal_attention,
    chunk_rows,
    chunked,
    empty_results,
    unchunked,
)
from jaxrl_llm.models.delta_rule import ChunkTerms, chunked_delta_rule, invariant_delta_rule
from jaxrl_llm.models.families import CONTEXT_ATTENTION
from jaxrl_llm.sharding.mesh import CONTEXT_AXIS, TENSOR_AXIS, row_split_axes

Array = jax.Array


def heads_per_device(heads: int, kv_heads: int, tensor: int) -> tuple[int, int]:
    """(query heads, key / value heads) on each device: split over 'tensor' where both divide by it."""
    if tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0:
        return heads // tensor, kv_heads // tensor
    return heads, kv_heads


def context_parallel_attend(q: Array, k: Array, v: Array, allowed: Array, nkv: int, softcap: float | None,
                            kind: str = "ring", *, sinks: Array | None = None, key_start: Array | None = None
                            ) -> Array:
    """fp32 [B, T, heads, D] attention of q [B, T, heads, D] over head-major k / v [B, kv, T, D] where
    `allowed` [B, T, T], with T split over the mesh's 'context' axis; `kind` one of CONTEXT_ATTENTION.
    `sinks`: fp32 [heads] attention sinks (GPT-OSS), each device given its own copy of its heads' (a row of
    a [batch shards, context, heads] broadcast), so that their gradients are summed outside the manual region.
    `key_start` [B] (batch-invariant mode): `gather` with the invariant kernel, its key blocks anchored there."""
    if kind not in CONTEXT_ATTENTION:
        raise ValueError(f"context_attention={kind!r}; expected one of {CONTEXT_ATTENTION}")
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(mesh.shape)
    context = sizes[CONTEXT_AXIS]
    nh = q.shape[2]
    row_spec = row_split_axes(sizes, q.shape[0])
    rows = row_spec or ()
    local_heads, local_kv = heads_per_device(nh, nkv, sizes.get(TENSOR_AXIS, 1))
    heads = TENSOR_AXIS if local_heads < nh else None
    if kind == "all_to_all" and local_heads % context:
        raise ValueError(f"mesh.context_attention=all_to_all splits the attention heads over the context axis: "
                         f"{local_heads} heads per device do not divide by mesh.context={context}; use ring")
    row_shards = math.prod(sizes[a] for a in rows)
    sink_rows = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32), (row_shards, context, nh))
    split = PartitionSpec(row_spec, CONTEXT_AXIS, heads, None)  # q / the output [B, T, heads, D]
    kv_split = PartitionSpec(row_spec, heads, CONTEXT_AXIS, None)  # head-major k / v [B, kv, T, D]
    mask_split = PartitionSpec(row_spec, CONTEXT_AXIS, None)

    if key_start is not None:
        kind = "gather"
    if kind == "ring":
        def local(q: Array, k: Array, v: Array, allowed: Array, sinks: Array | None, key_start: Array | None
                  ) -> Array:
            return _ring(q, k, v, allowed, None if sinks is None else sinks[0, 0], local_kv, softcap, context)
    elif kind == "all_to_all":
        def local(q: Array, k: Array, v: Array, allowed: Array, sinks: Array | None, key_start: Array | None
                  ) -> Array:
            return _all_to_all(q, k, v, allowed, None if sinks is None else sinks[0, 0], local_kv, softcap, context)
    else:
        def local(q: Array, k: Array, v: Array, allowed: Array, sinks: Array | None, key_start: Array | None
                  ) -> Array:
            # the whole keys / values on every device of the axis (their cotangents, each device's part,
            # are summed back over it by the gather's transpose)
            k, v = (lax.all_gather(x, CONTEXT_AXIS, axis=2, tiled=True) for x in (k, v))
            sink = None if sinks is None else sinks[0, 0]
            if key_start is not None:
                return attend_invariant(q, k, v, allowed, key_start, local_kv, causal=False, softcap=softcap,
                                        sinks=sink).reshape(q.shape)
            return attend(q, k, v, allowed, local_kv, causal=False, softcap=softcap, sinks=sink).reshape(q.shape)

    # the blockwise loops' (models/blockwise.py) and the invariant kernel's constant carries are not typed as
    # varying over the axes
    sink_spec = None if sinks is None else PartitionSpec(row_spec, CONTEXT_AXIS, heads)
    start_spec = None if key_start is None else PartitionSpec(row_spec)
    run = jax.shard_map(local, mesh=mesh, in_specs=(split, kv_split, kv_split, mask_split, sink_spec, start_spec),
                        out_specs=split, check_vma=kind == "gather" and key_start is None)
    return run(q, k, v, allowed, sink_rows, key_start)


# ---- Ulysses: all-to-all over heads ----

def _all_to_all(q: Array, k: Array, v: Array, allowed: Array, sinks: Array | None, nkv: int, softcap: float | None,
                context: int) -> Array:
    """One device's part: q [B, t, heads, D], k / v [B, kv, t, D], allowed [B, t, T] (t = T / context);
    sinks [heads] (the device attends for its context index's share of them)."""
    if nkv % context:  # repeat each key / value head so that the heads' split keeps their groups whole
        repeat = context // math.gcd(nkv, context)
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
        nkv *= repeat
    q_heads = lax.all_to_all(q, CONTEXT_AXIS, split_axis=2, concat_axis=1, tiled=True)  # [B, T, heads / c, D]
    k, v = (lax.all_to_all(x, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True) for x in (k, v))
    whole_mask = lax.all_gather(allowed, CONTEXT_AXIS, axis=1, tiled=True)  # [B, T, T]
    if sinks is not None:
        share = sinks.shape[0] // context
        sinks = lax.dynamic_slice_in_dim(sinks, lax.axis_index(CONTEXT_AXIS) * share, share)
    out = causal_attention(q_heads, k, v, whole_mask, nkv // context, softcap, sinks)  # as the unsplit pass
    return lax.all_to_all(out, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True)


# ---- ring attention ----

def _ring_perm(context: int) -> list[tuple[int, int]]:
    """Each device sends its current block to the next one around the axis."""
    return [(i, (i + 1) % context) for i in range(context)]


def _block_mask(allowed: Array, step: Array, context: int) -> Array:
    """The mask columns [B, t, t] of the key block a device holds at ring step `step`: the block of
    device (own index - step) mod context."""
    t = allowed.shape[1]
    source = (lax.axis_index(CONTEXT_AXIS) - step) % context
    return lax.dynamic_slice_in_dim(allowed, source * t, t, axis=2)


def _ring_fwd_parts(q, k, v, allowed, sinks, nkv, softcap, context):
    """fp32 output and lse of the local queries (chunked: models/blockwise.py) over every device's block:
    at each step the (query chunk, key sub-block) pairs that see anything of the held block attend to
    it (blockwise), merging into the running results by log-sum-exp."""
    size = chunk_rows(q.shape[1])
    q_chunks = chunked(q, size)

    def step(i, carry):
        out, lse, k, v = carry
        masks = chunked(_block_mask(allowed, i, context), size)
        out, lse = blockwise_update(q_chunks, k, v, masks, out, lse, nkv, softcap, size)
        k, v = (lax.ppermute(x, CONTEXT_AXIS, _ring_perm(context)) for x in (k, v))
        return out, lse, k, v

    out, lse, _, _ = lax.fori_loop(0, context, step, (*empty_results(q_chunks, sinks), k, v))
    return out, lse


def _ring_primal(q, k, v, allowed, sinks, nkv, softcap, context):
    return unchunked(_ring_fwd_parts(q, k, v, allowed, sinks, nkv, softcap, context)[0])


def _ring_fwd(q, k, v, allowed, sinks, nkv, softcap, context):
    out, lse = _ring_fwd_parts(q, k, v, allowed, sinks, nkv, softcap, context)
    return unchunked(out), (q, k, v, allowed, sinks, out, lse)


def _ring_bwd(nkv, softcap, context, residuals, d_out):
    """The flash-attention backward per held block (blockwise) against the final output and lse; each key /
    value block travels the ring once more with its gradient accumulating beside it, and is home after
    `context` steps."""
    q, k, v, allowed, sinks, out, lse = residuals
    size = chunk_rows(q.shape[1])
    q_chunks, d_out = chunked(q, size), chunked(d_out.astype(jnp.float32), size)
    d_sinks = None if sinks is None else sink_grads(sinks, out, lse, d_out).astype(sinks.dtype)

    def step(i, carry):
        d_q, k_blk, v_blk, d_k_blk, d_v_blk = carry
        masks = chunked(_block_mask(allowed, i, context), size)
        dq, dk, dv = blockwise_grads(q_chunks, k_blk, v_blk, masks, out, lse, d_out, nkv, softcap, size)
        k_blk, v_blk, d_k_blk, d_v_blk = (lax.ppermute(x, CONTEXT_AXIS, _ring_perm(context))
                                          for x in (k_blk, v_blk, d_k_blk + dk, d_v_blk + dv))
        return d_q + dq, k_blk, v_blk, d_k_blk, d_v_blk

    init = (jnp.zeros(q_chunks.shape, jnp.float32), k, v, jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
    d_q, _, _, d_k, d_v = lax.fori_loop(0, context, step, init)
    return unchunked(d_q).astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None, d_sinks


_ring = jax.custom_vjp(_ring_primal, nondiff_argnums=(5, 6, 7))
_ring.defvjp(_ring_fwd, _ring_bwd)


# ---- the gated delta rule (Qwen3.5's linear layers) with the tokens split: the state passed between devices ----

def context_parallel_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array, *,
                                chunk: int) -> Array:
    """`chunked_delta_rule`'s outputs [B, T, H, Dv] (fp32) with T split over the mesh's 'context' axis. The rule is
    affine in the incoming state: a device's block maps S_in to A S_in + B, with B its final state from zero and A
    its final state from the identity with no values (A [Dk, Dk] per head, 0 where a packed sequence restarts in
    the block). Each device computes its (A, B), gathers every device's ([B, H, Dk, Dk + Dv] each: a state's worth,
    not the tokens), folds those of the devices before it into its incoming state, and runs its block again from
    it. Per device: its T / context tokens three times (A's pass with Dk values), no token moved."""
    context = dict(jax.sharding.get_abstract_mesh().shape)[CONTEXT_AXIS]

    def local(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array) -> Array:
        b, _, h, dk = k.shape
        _, carried = chunked_delta_rule(q, k, v, g, beta, starts=starts, chunk=chunk)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk))
        _, kept = chunked_delta_rule(q, k, jnp.zeros((*k.shape[:3], dk), jnp.float32), g, beta, state=eye,
                                     starts=starts, chunk=chunk)
        maps, adds = lax.all_gather(kept, CONTEXT_AXIS), lax.all_gather(carried, CONTEXT_AXIS)  # [context, ...]
        me = lax.axis_index(CONTEXT_AXIS)

        def fold(state: Array, j: Array) -> tuple[Array, None]:  # the blocks before this device's, in order
            after = jnp.einsum("bhij,bhjv->bhiv", maps[j], state) + adds[j]
            return jnp.where(j < me, after, state), None

        incoming, _ = lax.scan(fold, jnp.zeros_like(carried), jnp.arange(context))
        out, _ = chunked_delta_rule(q, k, v, g, beta, state=incoming, starts=starts, chunk=chunk)
        return out

    return _per_context_block(local, q, k, v, g, beta, starts)


def context_parallel_invariant_delta_rule(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array, *,
                                          chunk: int, terms: ChunkTerms) -> Array:
    """Batch-invariant mode's `context_parallel_delta_rule`: each device gathers the row's tokens and runs
    `invariant_delta_rule` (the recurrence; the chunked form's gradient) over all of them, keeping its own block's
    outputs. The recurrence adds its state token after token, so a device's incoming state folded from the
    others' affine maps (the default way) is another sum; run over the whole row it is one device's bits. Per
    device: the whole row's recurrence (the one-device cost) and its delta-net inputs gathered (a [T, H, D] set
    per layer), where the default way moves a state's worth."""
    def local(q: Array, k: Array, v: Array, g: Array, beta: Array, starts: Array) -> Array:
        block = q.shape[1]
        whole = [lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True) for x in (q, k, v, g, beta, starts)]
        out, _ = invariant_delta_rule(*whole, chunk=chunk, terms=terms)
        return lax.dynamic_slice_in_dim(out, lax.axis_index(CONTEXT_AXIS) * block, block, axis=1)

    return _per_context_block(local, q, k, v, g, beta, starts)


def _per_context_block(local: Callable[..., Array], q: Array, k: Array, v: Array, g: Array, beta: Array,
                       starts: Array) -> Array:
    """`local` run per device on its rows' block of tokens (q / k / v [B, T, H, D], g / beta [B, T, H], starts
    [B, T], each split over 'context' on T and over the batch axes on B), its outputs [B, T, H, Dv] split alike."""
    mesh = jax.sharding.get_abstract_mesh()
    row_spec = row_split_axes(dict(mesh.shape), q.shape[0])
    split4, split3 = PartitionSpec(row_spec, CONTEXT_AXIS, None, None), PartitionSpec(row_spec, CONTEXT_AXIS, None)
    run = jax.shard_map(local, mesh=mesh,
                        in_specs=(split4, split4, split4, split3, split3, PartitionSpec(row_spec, CONTEXT_AXIS)),
                        out_specs=split4, check_vma=False)
    return run(q, k, v, g, beta, starts)

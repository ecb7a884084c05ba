"""One decode token per slot through the decoder, reading and writing a paged KV pool.

The decoder is the trainer's own (`jaxrl_llm.models.decoder.decoder_hidden`, over the policy's
params dict, so the engine needs no second copy of the weights and follows the same numerics:
fp32 residual stream, fp32-returning matmuls); only its attention is this module's
`paged_attention`, which writes each token's K/V into the pool and runs `paged_decode_attention`.
Tests check that its logits equal the dense model's (tests/sampler/test_engine_core.py).

KV pool layout (a dict pytree, carried through the decode loop and updated in place):

    k, v        [L, kv_heads, num_pages, page_size, head_dim']  compute dtype, or int8 (head_dim' = the
                                                                 head dim, lane-padded on TPU: kv_bits.py);
                                                                 MLA: k only, one kv head of the latent and
                                                                 rope key, read as the values too (models/mla.py)
    k_scale, v_scale [L, kv_heads, num_pages, page_size] fp32    (int8 only: value = int8 * scale)

A hybrid (Qwen3.5) model's pool covers its full-attention layers only; the decode step takes and returns a
`HybridState(pool, conv, delta)` (models/hybrid.py): the pool and each slot's delta-net state, which inactive
slots leave as it is.

A Gemma 4 model's pool is one such dict per attention type, {"sliding": ..., "full": ...}, each over the
layers of its type that compute keys / values (engine/programs.py `pool_dims`); the KV-sharing layers
rewrite and read their producer's rows (models/gemma4.py).

Page 0 is a scratch page no request owns: empty slots write their (ignored) token there.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.arrays import DType
from jaxrl_llm.models import ModelConfig, logits_from_hidden
from jaxrl_llm.models.decoder import LayerAttention, decoder_hidden
from jaxrl_llm.models.hybrid import HybridState
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine import decode_layout, slot_shards
from jaxrl_llm.sampler.kv_bits import write_rows
from jaxrl_llm.sampler.kv_shards import kv_head_axis
from jaxrl_llm.sampler.paged_attention import paged_decode_attention

Array = jax.Array


def quantize_int8(x: Array) -> tuple[Array, Array]:
    """Per-vector symmetric int8 over the last axis: (int8 values, fp32 scales [...])."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
    q = jnp.round(x32 / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def write_tokens(pool: dict, layer: Array, k: Array, v: Array, pages: Array, offsets: Array) -> dict:
    """Writes k / v [N, kv_heads, D] of N tokens at (pages[N], offsets[N]) of one layer."""
    if pages.shape[0] == 1:
        # one token: XLA rewrites a one-index scatter as a dynamic-update-slice and fuses it into
        # each reader of the pool, each with its own copy of the whole pool (all layers): ~8 copies
        # per layer and step, a 1-slot SmolLM2 step 20x slower than a 3-slot one. A second write of
        # the same values to the scratch page 0 keeps it a scatter, done in place.
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
        pages, offsets = jnp.concatenate([pages, jnp.zeros_like(pages)]), jnp.concatenate([offsets, offsets])
    heads = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    return write_pool_rows(pool, (layer, heads, pages[:, None], offsets[:, None]), k, v)  # index -> [N, kv]


def write_pool_rows(pool: dict, index: tuple[Array, ...], k: Array, v: Array | None) -> dict:
    """`pool` with k and v written at `index` (`kv_bits.write_rows`), as int8 with their scales where the pool
    stores int8; a pool without "v" (MLA's: its values are its keys) takes the keys only."""
    out = dict(pool)
    for name, x in (("k", k), ("v", v)):
        if name not in pool:
            continue
        assert x is not None, f"the pool holds {name!r}: its rows are needed"
        if f"{name}_scale" in pool:
            x, scale = quantize_int8(x)
            out[f"{name}_scale"] = write_rows(pool[f"{name}_scale"], index, scale)
        out[name] = write_rows(pool[name], index, x)
    return out


def paged_attention(cfg: ModelConfig, page_size: int, page_table: Array, positions: Array, active: Array, *,
                    attn_impl: str = "auto", mesh: Mesh | None = None, cascade: Cascade | None = None,
                    window: int | None | str = "per_layer", slot_axes: tuple[str, ...] = ()) -> LayerAttention:
    """The decoder's attention for one token per slot over the paged pool (the attention state):
    writes the token's K/V at its page and offset, then attends over the slot's pages. Inactive
    slots write to the scratch page 0 and attend to nothing. `cascade`: the groups of slots that
    read their shared prompt pages once (sampler/cascade_attention.py). `window`: the sliding window
    of every layer it serves (a Gemma 4 pool's type), or "per_layer" (the config's, by layer index).
    `slot_axes`: the mesh axes the slots and the pool's pages are split over (engine/slot_shards.py): the
    writes and the attention then run per shard, on its slots, its pages and its local page ids."""
    page = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    page = jnp.where(active, page, 0)
    offset = jnp.where(active, positions % page_size, 0)
    lengths = jnp.where(active, positions + 1, 0)

    def write_and_attend(q: Array, k: Array, v: Array, pool: dict, layer: Array, sinks: Array | None, page: Array,
                         offset: Array, lengths: Array, table: Array, cascade: Cascade | None,
                         kernel_mesh: Mesh | None) -> tuple[Array, dict]:
        pool = write_tokens(pool, layer, k[:, 0], v[:, 0], page, offset)

        def attend(window: int | None) -> Array:  # a local layer reads only its window's pages
            values = "v" if "v" in pool else "k"  # MLA: the values are the keys (models/mla.py)
            return paged_decode_attention(q[:, 0], pool["k"], pool[values], lengths, table, layer=layer,
                                          sliding_window=window, impl=attn_impl, mesh=kernel_mesh,
                                          softcap=cfg.attn_logit_softcapping, cascade=cascade, sinks=sinks,
                                          k_scales=pool.get("k_scale"), v_scales=pool.get(f"{values}_scale"))

        if window != "per_layer":
            out = attend(window if isinstance(window, int) else None)
        elif cfg.mixed_windows:  # each layer its own variant of the kernel (static windows), by index
            local = jnp.asarray(cfg.local_layer_flags)[layer]
            out = lax.cond(local, lambda: attend(cfg.sliding_window), lambda: attend(None))
        else:
            out = attend(cfg.sliding_window)
        return out[:, None], pool

    def attention(q: Array, k: Array, v: Array, pool: dict, layer: Array, sinks: Array | None) -> tuple[Array, dict]:
        args = (q, k, v, pool, layer, sinks, page, offset, lengths, page_table, cascade)
        if not slot_axes:
            return write_and_attend(*args, kernel_mesh=mesh)
        assert mesh is not None, "slot shards need the engine's mesh"
        args = (q, k, v, pool, jnp.asarray(layer, jnp.int32), *args[5:])  # an unrolled layer's index: an array
        heads = kv_head_axis(mesh, pool["k"].shape[1])
        rows, per_head = P(slot_axes), P(slot_axes, None, heads)  # q / k / v [S, 1, heads, D]
        pools = slot_shards.pool_spec(mesh, pool, slot_axes)
        groups = None if cascade is None else Cascade(rows, rows)
        in_specs = (per_head, per_head, per_head, pools, P(), P(heads), rows, rows, rows, rows, groups)
        run = slot_shards.per_slot_shard(functools.partial(write_and_attend, kernel_mesh=None), mesh, in_specs,
                                         (per_head, pools))
        if cfg.kv_lora_rank:  # MLA's q / k are in its latent space: no projection of the rules' shape
            return run(*args)
        # q / k / v as the decode layout's projections produce them from whole rows, and the output as o_proj
        # (split as q_proj is) takes it: the rows move, not the weights (engine/decode_layout.py)
        whole = [None if cfg.batch_invariant else  # the mode's layout is by columns: XLA places q / k / v
                 decode_layout.head_rows_spec(mesh, slot_axes, cfg.hidden_size, x.shape[2], x.shape[3], name)
                 for x, name in ((q, "heads"), (k, "kv_heads"), (v, "kv_heads"))]
        placed = [x if spec is None else lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                  for x, spec in zip((q, k, v), whole)]
        out, pool = run(*placed, *args[3:])
        return (out if whole[0] is None else lax.with_sharding_constraint(out, NamedSharding(mesh, whole[0])),
                pool)

    return attention


def decode_hidden(params: dict, cfg: ModelConfig, pool: Any, tokens: Array, positions: Array,
                  page_table: Array, active: Array, *, compute_dtype: DType, attn_impl: str = "auto",
                  mesh: Mesh | None = None, record_routing: bool = False, cascade: Cascade | None = None,
                  rope_offset: Array | None = None, slot_axes: tuple[str, ...] = ()) -> tuple[Array, Any, Array | None]:
    """Final-norm hidden [S, H] for one token per slot, the pool with their K/V written, and with
    `record_routing` a MoE model's router top-k ids of each fed token [S, L, k] (else None).

    tokens / positions [S]: the token fed to each slot and its position (= tokens already in the
    slot's KV). page_table [S, pages_per_slot]. active [S] bool: inactive slots write to the
    scratch page and attend to nothing. The decoder is the trainer's (models/decoder.py), T = 1. `pool`: the KV
    pool, or a hybrid model's `HybridState` (module doc), returned in the same form. `rope_offset` [S]: added to
    the rotary positions only (a vision-language prompt's M-RoPE delta: its KV rows stay at their token index).
    `slot_axes`: the slot shards' mesh axes (engine/slot_shards.py; () when the slots are replicated).
    """
    kv = pool.attention if isinstance(pool, HybridState) else pool  # a hybrid model's: with the slots' state
    if cfg.typed_layers:  # Gemma 4: a pool and an attention per type (models/gemma4.py)
        attention: Any = {kind: paged_attention(cfg, kv[kind]["k"].shape[3], page_table, positions, active,
                                                attn_impl=attn_impl, mesh=mesh, cascade=cascade,
                                                window=cfg.sliding_window if kind == "sliding" else None,
                                                slot_axes=slot_axes)
                          for kind in ("sliding", "full")}
    else:
        attention = paged_attention(cfg, kv["k"].shape[3], page_table, positions, active, attn_impl=attn_impl,
                                    mesh=mesh, cascade=cascade, slot_axes=slot_axes)
    rotary = positions if rope_offset is None else positions + rope_offset
    with decode_layout.matmul_columns(cfg.batch_invariant, mesh, slot_axes):
        hidden, pool, moe = decoder_hidden(params, cfg, tokens[:, None], rotary[:, None], attention, pool,
                                           compute_dtype=compute_dtype, valid=active[:, None],
                                           record_routing=record_routing)
    routing = None if moe is None or moe.routing is None else jnp.moveaxis(moe.routing[:, :, 0], 0, 1)
    return hidden[:, 0], pool, routing


def decode_logits(params: dict, cfg: ModelConfig, pool: Any, tokens: Array, positions: Array,
                  page_table: Array, active: Array, *, compute_dtype: DType, attn_impl: str = "auto",
                  mesh: Mesh | None = None, record_routing: bool = False, cascade: Cascade | None = None,
                  rope_offset: Array | None = None, slot_axes: tuple[str, ...] = ()) -> tuple[Array, Any, Array | None]:
    """fp32 next-token logits [S, V], the updated pool and the recorded routing (see `decode_hidden`)."""
    hidden, pool, routing = decode_hidden(params, cfg, pool, tokens, positions, page_table, active,
                                          compute_dtype=compute_dtype, attn_impl=attn_impl, mesh=mesh,
                                          record_routing=record_routing, cascade=cascade, rope_offset=rope_offset,
                                          slot_axes=slot_axes)
    with decode_layout.matmul_columns(cfg.batch_invariant, mesh, slot_axes):
        return logits_from_hidden(params, cfg, hidden), pool, routing


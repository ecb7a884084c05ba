"""The engine's jitted programs, shaped like JetStream's Engine:

    prefix = prefill(params, prompt_ids[Pb], length)              one prompt, once for its n samples
    state  = insert(prefix, state, slot, page_row, request ids, budget)  KV into a slot's pages + token 0
    state  = generate(params, state, max_steps, stop_early, stop_below)   up to max_steps decode steps

Compiled programs: one `generate` and one `insert` per engine spec, plus one `prefill` /
`insert` per prompt-length bucket (jaxrl_llm/sampler/host.py buckets); nothing depends on which
slots are busy, how long the sequences are or how many requests are queued.

Prefill reuses the model's own dense forward (jaxrl_llm/models, the trainer's scoring code) on a
right-padded prompt, so prompt KV and the first token's logits are the trainer's numbers.

Random numbers: the token t of sample j of prompt i draws with
fold_in(fold_in(fold_in(rng, i), j), t), never depending on the slot or the slot count.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import (
    ModelConfig,
    as_jnp_dtype,
    forward_hidden,
    forward_hidden_routed,
    init_cache,
    logits_from_hidden,
)
from jaxrl_llm.models.gemma4 import typed_state
from jaxrl_llm.models.hybrid import RECURRENT_KEYS, HybridState
from jaxrl_llm.models.moe import NOT_RECORDED, routing_dtype
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine import decode_layout, slot_shards
from jaxrl_llm.sampler.engine.decode_state import (
    DecodeState,
    Prefix,
    PromptImages,
)
from jaxrl_llm.sampler.engine.draws import choose_per_row, finish_codes, request_keys
from jaxrl_llm.sampler.engine.forward import decode_logits, write_pool_rows
from jaxrl_llm.sampler.engine.verify import verify_step
from jaxrl_llm.sampler.kv_shards import kv_head_axis
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.speculative import SpeculativeSpec
from jaxrl_llm.sharding import mesh_context

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "compute_dtype", "record_routing", "mesh", "chunk", "slot_axes"))
def prefill(params: dict, cfg: ModelConfig, prompt_ids: Array, length: Array, *, compute_dtype: str,
            record_routing: bool = False, mesh: Mesh | None = None, replay: Array | None = None,
            chunk: int | None = None, images: PromptImages | None = None, slot_axes: tuple[str, ...] = ()) -> Prefix:
    """KV of one right-padded prompt [Pb] (its first `length` ids real) and its next-token logits
    (and with `record_routing`, a MoE model's experts per prompt token). `replay` [Pb, L, k]: experts
    to run (a multi-turn conversation's earlier turns; NOT_RECORDED: the router's choice); they are
    what is recorded for those tokens. `chunk` (chunked prefill, dividing Pb): the prompt runs `chunk`
    tokens at a time over the growing cache (a `lax.scan`), so the program's activations and attention
    scores are [chunk, Pb] rather than [Pb, Pb]. `images`: a vision-language prompt's (`PromptImages`): its image
    tokens take the features, every token its M-RoPE position, and the prefix carries the decode delta. Traced on
    `mesh`. A Gemma 3 prompt with images prefills whole: an image's tokens see each other, so no chunk boundary may
    split one (vLLM's answer is the same: an image is scheduled in one piece). `slot_axes`: the engine's slot shards
    (engine/slot_shards.py); in the mode the weights are split by columns over them (`decode_layout.matmul_columns`)
    and each device computes its columns of every prompt token rather than gathering each layer's weights."""
    if images is not None and cfg.bidirectional_image_tokens:
        chunk = None
    with mesh_context(mesh), decode_layout.matmul_columns(cfg.batch_invariant, mesh, slot_axes):
        if chunk is not None and chunk < prompt_ids.shape[0]:
            prefix = _chunked_prefill(params, cfg, prompt_ids, length, compute_dtype=compute_dtype,
                                      record_routing=record_routing, replay=replay, chunk=chunk, images=images)
        else:
            prefix = _prefill(params, cfg, prompt_ids, length, compute_dtype=compute_dtype,
                              record_routing=record_routing, replay=replay, images=images)
        return prefix if images is None else prefix._replace(rope_delta=images.delta.astype(jnp.int32))


def _prefill_step(params: dict, cfg: ModelConfig, ids: Array, mask: Array, cache: dict, replay: Array | None, *,
                  dt: Any, record: bool, images: PromptImages | None = None) -> tuple[Array, dict, Array | None]:
    """One forward of ids / mask [1, T] over the dense cache: (hidden [T, H], cache, routing [T, L, k] or None);
    `images`: these T tokens' M-RoPE positions [3, T] and feature slots [T] over the prompt's features."""
    if images is not None and not record:
        hidden, cache = forward_hidden(params, cfg, ids, mask, cache=cache, compute_dtype=dt,
                                       positions=images.positions[:, None], embeds=images.embeds)
        return hidden[0], cache, None
    if not record:
        hidden, cache = forward_hidden(params, cfg, ids, mask, cache=cache, compute_dtype=dt)
        return hidden[0], cache, None
    fixed = None if replay is None else jnp.moveaxis(replay.astype(jnp.int32), 1, 0)[:, None]  # [L, 1, T, k]
    hidden, cache, recorded = forward_hidden_routed(
        params, cfg, ids, mask, cache=cache, compute_dtype=dt, replay=fixed,
        positions=None if images is None else images.positions[:, None],
        embeds=None if images is None else images.embeds)
    assert recorded is not None
    return hidden[0], cache, jnp.moveaxis(recorded[:, 0], 0, 1).astype(routing_dtype(cfg.num_experts))


def _prefix(params: dict, cfg: ModelConfig, hidden: Array, cache: dict, length: Array, routing: Array | None,
            ids: Array) -> Prefix:
    last = lax.dynamic_index_in_dim(hidden, length - 1, 0, keepdims=False)
    k, v = _cache_kv(cfg, cache, lambda x: x[:, 0])
    return Prefix(k=k, v=v, logits=logits_from_hidden(params, cfg, last), length=length.astype(jnp.int32),
                  routing=routing, ids=ids.astype(jnp.int32), recurrent=_cache_recurrent(cfg, cache, 0))


def _cache_recurrent(cfg: ModelConfig, cache: dict, row: int | None) -> dict | None:
    """A hybrid model's delta-net state from a dense cache (models/hybrid.py): one row's, or every row's (None)."""
    if not cfg.hybrid:
        return None
    return {name: jnp.moveaxis(cache[name], 1, 0) if row is None else cache[name][:, row] for name in RECURRENT_KEYS}


def _cache_kv(cfg: ModelConfig, cache: dict, take: Callable[[Array], Array]) -> tuple[Any, Any]:
    """A dense cache's (k, v) through `take`: arrays, or for a Gemma 4 model one per attention type."""
    if not cfg.typed_layers:  # no "v": the values are the keys (MLA)
        return take(cache["k"]), take(cache["v"]) if "v" in cache else None
    typed = typed_state(cache)  # models/gemma4.py: the one place that names the per-type cache entries
    assert typed is not None
    return {kind: take(k) for kind, (k, _) in typed.items()}, {kind: take(v) for kind, (_, v) in typed.items()}


def _prefill(params: dict, cfg: ModelConfig, prompt_ids: Array, length: Array, *, compute_dtype: str,
             record_routing: bool, replay: Array | None, images: PromptImages | None) -> Prefix:
    dt = as_jnp_dtype(compute_dtype)
    pb = prompt_ids.shape[0]
    mask = (jnp.arange(pb) < length).astype(jnp.int32)[None]
    cache = init_cache(cfg, 1, pb, dt)
    hidden, cache, routing = _prefill_step(params, cfg, prompt_ids[None].astype(jnp.int32), mask, cache, replay,
                                           dt=dt, record=record_routing and cfg.is_moe, images=images)
    return _prefix(params, cfg, hidden, cache, length, routing, prompt_ids)


def _chunked_prefill(params: dict, cfg: ModelConfig, prompt_ids: Array, length: Array, *, compute_dtype: str,
                     record_routing: bool, replay: Array | None, chunk: int, images: PromptImages | None) -> Prefix:
    dt = as_jnp_dtype(compute_dtype)
    pb = prompt_ids.shape[0]
    if pb % chunk:
        raise ValueError(f"chunked prefill: the prompt bucket {pb} is not a multiple of the chunk {chunk}")
    n = pb // chunk
    record = record_routing and cfg.is_moe
    mask = (jnp.arange(pb) < length).astype(jnp.int32)
    xs = (prompt_ids.astype(jnp.int32).reshape(n, 1, chunk), mask.reshape(n, 1, chunk),
          None if replay is None or not record else replay.reshape(n, chunk, *replay.shape[1:]),
          None if images is None else (jnp.moveaxis(images.positions.reshape(3, n, chunk), 1, 0),
                                       images.slots.reshape(n, chunk)))

    def step(cache: dict, x: tuple) -> tuple[dict, tuple[Array, Array | None]]:
        ids, chunk_mask, chunk_replay, chunk_images = x
        part = None
        if images is not None:  # this chunk's positions and slots, over the prompt's features
            part = images._replace(positions=chunk_images[0], slots=chunk_images[1])
        hidden, cache, routing = _prefill_step(params, cfg, ids, chunk_mask, cache, chunk_replay, dt=dt,
                                               record=record, images=part)
        return cache, (hidden, routing)

    cache, (hidden, routing) = lax.scan(step, init_cache(cfg, 1, pb, dt), xs)
    hidden = hidden.reshape(pb, -1)
    routing = None if routing is None else routing.reshape(pb, *routing.shape[2:])
    return _prefix(params, cfg, hidden, cache, length, routing, prompt_ids)


@functools.partial(jax.jit, static_argnames=("cfg", "compute_dtype", "mesh", "slot_axes"))
def prefill_batch(params: dict, cfg: ModelConfig, prompt_ids: Array, lengths: Array, *, compute_dtype: str,
                  mesh: Mesh | None = None, slot_axes: tuple[str, ...] = ()) -> Prefix:
    """`prefill` of B right-padded prompts [B, Pb] of one bucket in one forward (their first
    `lengths[b]` ids real): a Prefix whose every field has a leading [B] axis (`insert_at` takes
    one row). Many short prompts then cost one program call rather than one each (no routing
    recording, no chunking: the scheduler keeps those on `prefill`). `slot_axes`: as `prefill`'s."""
    with mesh_context(mesh), decode_layout.matmul_columns(cfg.batch_invariant, mesh, slot_axes):
        dt = as_jnp_dtype(compute_dtype)
        b, pb = prompt_ids.shape
        mask = (jnp.arange(pb)[None] < lengths[:, None]).astype(jnp.int32)
        hidden, cache = forward_hidden(params, cfg, prompt_ids.astype(jnp.int32), mask,
                                       cache=init_cache(cfg, b, pb, dt), compute_dtype=dt)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        k, v = _cache_kv(cfg, cache, lambda x: jnp.moveaxis(x, 1, 0))
        return Prefix(k=k, v=v, logits=logits_from_hidden(params, cfg, last), length=lengths.astype(jnp.int32),
                      ids=prompt_ids.astype(jnp.int32), recurrent=_cache_recurrent(cfg, cache, None))


@functools.partial(jax.jit, static_argnames=("settings", "mesh", "slot_axes"), donate_argnames=("state",))
def insert(prefix: Prefix, state: DecodeState, slot: Array, page_row: Array, request: Array, budget: Array,
           rng: Array, knobs: SampleKnobs, draft: Prefix | None = None, *, settings: SampleSettings,
           mesh: Mesh | None = None, slot_axes: tuple[str, ...] = ()) -> DecodeState:
    """Copies the prefix KV into the pages of `page_row` (the slot's page table), draws token 0.
    The slot then generates at most `budget` (<= settings.max_new_tokens) tokens. `draft`: the
    draft model's prefix of the same prompt (speculative method 'draft'), copied into its pool.
    `slot_axes` (with the state's `mesh`): the slot shards' axes (engine/slot_shards.py): `page_row` holds
    page ids of the slot's shard, and only that shard's pages are written.

    Pages shared by the samples of one prompt are rewritten with identical values (harmless)."""
    return _insert(prefix, state, slot, page_row, request, budget, rng, knobs, draft, settings=settings, mesh=mesh,
                   slot_axes=slot_axes)


@functools.partial(jax.jit, static_argnames=("settings", "mesh", "slot_axes"), donate_argnames=("state",))
def insert_at(prefixes: Prefix, index: Array, state: DecodeState, slot: Array, page_row: Array, request: Array,
              budget: Array, rng: Array, knobs: SampleKnobs, drafts: Prefix | None = None, *,
              settings: SampleSettings, mesh: Mesh | None = None, slot_axes: tuple[str, ...] = ()) -> DecodeState:
    """`insert` of row `index` of a batched prefix (`prefill_batch`), and of the draft model's."""
    row = lambda tree: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)  # noqa: E731
    return _insert(row(prefixes), state, slot, page_row, request, budget, rng, knobs,
                   None if drafts is None else row(drafts), settings=settings, mesh=mesh, slot_axes=slot_axes)


def _write_prefix(pool: dict, prefix: Prefix, page_row: Array) -> dict:
    """`pool` with the prompt KV of `prefix` written at its positions' pages of `page_row`."""
    return _write_prompt_kv(pool, prefix.k, prefix.v, prefix.length, page_row)


def _write_prompt_kv(pool: dict, k: Any, v: Any, length: Array, page_row: Array) -> dict:
    if "k" not in pool:  # one pool per attention type (Gemma 4)
        return {kind: _write_kv(sub, k[kind], v[kind], length, page_row) for kind, sub in pool.items()}
    return _write_kv(pool, k, v, length, page_row)


def _write_prefix_in_shard(pool: dict, prefix: Prefix, page_row: Array, slot: Array, *, slots: int, mesh: Mesh,
                           slot_axes: tuple[str, ...]) -> dict:
    """`_write_prefix` into a pool whose pages are split over the slot shards: the slot's shard writes the prompt
    at its local page ids, every other shard into its own scratch page 0 (engine/slot_shards.py)."""
    per_shard = slots // slot_shards.shard_count(mesh, slot_axes)

    def local(pool: dict, k: Any, v: Any, length: Array, page_row: Array, slot: Array) -> dict:
        mine = slot // per_shard == slot_shards.shard_index(slot_axes)
        return _write_prompt_kv(pool, k, v, length, jnp.where(mine, page_row, 0))

    heads = lambda x: P(None, kv_head_axis(mesh, x.shape[1]))  # noqa: E731  prompt k / v [L, kv, Pb, D]
    pools = slot_shards.pool_spec(mesh, pool, slot_axes)
    in_specs = (pools, jax.tree.map(heads, prefix.k), jax.tree.map(heads, prefix.v), P(), P(), P())
    run = slot_shards.per_slot_shard(local, mesh, in_specs, pools)
    return run(pool, prefix.k, prefix.v, prefix.length, page_row, slot)


def _write_kv(pool: dict, k: Array, v: Array | None, length: Array, page_row: Array) -> dict:
    ps = pool["k"].shape[3]
    t = jnp.arange(k.shape[2], dtype=jnp.int32)
    real = t < length
    pages = jnp.where(real, page_row[jnp.minimum(t // ps, page_row.shape[0] - 1)], 0)
    offsets = jnp.where(real, t % ps, 0)
    num_layers, kv = k.shape[:2]
    index = (jnp.arange(num_layers, dtype=jnp.int32)[:, None, None], jnp.arange(kv, dtype=jnp.int32)[None, :, None],
             pages[None, None], offsets[None, None])  # -> [L, kv, Pb], the prefix's rows
    return write_pool_rows(pool, index, k, v)


def _insert(prefix: Prefix, state: DecodeState, slot: Array, page_row: Array, request: Array, budget: Array,
            rng: Array, knobs: SampleKnobs, draft: Prefix | None, *, settings: SampleSettings, mesh: Mesh | None,
            slot_axes: tuple[str, ...]) -> DecodeState:
    def write(pool: dict, prefix: Prefix) -> dict:
        if not slot_axes:
            return _write_prefix(pool, prefix, page_row)
        assert mesh is not None, "slot shards need the engine's mesh"
        return _write_prefix_in_shard(pool, prefix, page_row, slot, slots=state.active.shape[0], mesh=mesh,
                                      slot_axes=slot_axes)

    new_pool = write(state.pool, prefix)
    draft_pool = state.draft_pool
    if draft_pool is not None:
        assert draft is not None, "a draft-model engine inserts the draft model's prefix too"
        draft_pool = write(draft_pool, draft)
    t = jnp.arange(jax.tree.leaves(prefix.k)[0].shape[2], dtype=jnp.int32)
    real = t < prefix.length
    keys = request_keys(rng, request[None], jnp.zeros((1,), jnp.int32))
    tok, lp = choose_per_row(prefix.logits[None], keys, knobs, settings)
    ends, reason = finish_codes(tok, jnp.ones((1,), jnp.int32), knobs, budget)
    r = settings.max_new_tokens
    routing = state.routing
    if routing is not None:  # the slot's previous request's routing is not this one's
        routing = routing.at[slot].set(jnp.full(routing.shape[1:], NOT_RECORDED, routing.dtype))
    history = state.history
    if history is not None:  # the prompt, then token 0 (the rest of the row is never read)
        assert prefix.ids is not None
        row = jnp.zeros(history.shape[1:], jnp.int32).at[jnp.where(real, t, history.shape[1])].set(
            prefix.ids, mode="drop")
        history = history.at[slot].set(row.at[prefix.length].set(tok[0], mode="drop"))
    recurrent = state.recurrent
    if recurrent is not None:  # a hybrid model: the slot starts from the prompt's delta-net state
        assert prefix.recurrent is not None
        recurrent = jax.tree.map(lambda all_, one: all_.at[:, slot].set(one), recurrent, prefix.recurrent)
    rope_offset = state.rope_offset
    if rope_offset is not None:  # a vision-language prompt's M-RoPE delta (0: a text prompt)
        delta = jnp.int32(0) if prefix.rope_delta is None else prefix.rope_delta
        rope_offset = rope_offset.at[slot].set(delta)
    return state._replace(
        routing=routing, history=history, pool=new_pool, draft_pool=draft_pool, recurrent=recurrent,
        rope_offset=rope_offset,
        page_table=state.page_table.at[slot].set(page_row),
        positions=state.positions.at[slot].set(prefix.length), last=state.last.at[slot].set(tok[0]),
        num_gen=state.num_gen.at[slot].set(1), active=state.active.at[slot].set(~ends[0]),
        finish=state.finish.at[slot].set(reason[0]), request=state.request.at[slot].set(request),
        budget=state.budget.at[slot].set(budget),
        tokens=state.tokens.at[slot].set(jnp.full((r,), knobs.pad_id, jnp.int32).at[0].set(tok[0])),
        log_probs=state.log_probs.at[slot].set(jnp.zeros((r,), jnp.float32).at[0].set(lp[0])))


@functools.partial(jax.jit, static_argnames=("cfg", "settings", "attn_impl", "mesh", "speculative", "slot_axes"),
                   donate_argnames=("state",))
def generate(params: dict, cfg: ModelConfig, state: DecodeState, rng: Array, knobs: SampleKnobs,
             max_steps: Array, stop_on_finish: Array, stop_below: Array | int = 0, cascade: Cascade | None = None,
             draft_params: dict | None = None, *, settings: SampleSettings, attn_impl: str = "auto",
             mesh: Mesh | None = None, speculative: SpeculativeSpec | None = None,
             slot_axes: tuple[str, ...] = ()) -> DecodeState:
    """Decode steps for every active slot until `max_steps` steps ran, no slot is active, (with
    `stop_on_finish`) some slot finished, so the host can refill it from its queue, or at most
    `stop_below` slots are still active, so the host can move them to a smaller slot set.
    `mesh`: the state's mesh (`state_sharding`); an attention kernel then runs per kv-head shard, and the
    program is traced on it. `cascade`: groups of slots sharing their prompt's full pages, each read
    once per group (the slots stay where they are during the call; a finished member reads nothing).
    `speculative` (the spec's; the state then carries its history): every step verifies drafted
    tokens and emits 1 to num_tokens + 1 per slot (engine/verify.py); `draft_params`: the draft
    model's (method 'draft'). `slot_axes`: the mesh axes the slots and the pool's pages are split over
    (engine/slot_shards.py; the cascade rows then list local slots, each shard's rows a block of them as its
    slots are); `stop_below` then holds when every shard's live slots fit its share of the smaller set."""
    with mesh_context(mesh):
        return _generate(params, cfg, state, rng, knobs, max_steps, stop_on_finish, stop_below, cascade,
                         draft_params, settings=settings, attn_impl=attn_impl, mesh=mesh, speculative=speculative,
                         slot_axes=slot_axes)


def _generate(params: dict, cfg: ModelConfig, state: DecodeState, rng: Array, knobs: SampleKnobs,
              max_steps: Array, stop_on_finish: Array, stop_below: Array | int, cascade: Cascade | None,
              draft_params: dict | None, *, settings: SampleSettings, attn_impl: str, mesh: Mesh | None,
              speculative: SpeculativeSpec | None, slot_axes: tuple[str, ...]) -> DecodeState:
    dt = as_jnp_dtype(settings.compute_dtype)
    r = settings.max_new_tokens
    rows = jnp.arange(state.active.shape[0])
    shards = slot_shards.shard_count(mesh, slot_axes)

    def keep_going(c: tuple[Array, Array, DecodeState]) -> Array:
        i, finished, s = c
        live = jnp.sum(s.active.astype(jnp.int32))
        fullest = jnp.max(jnp.sum(s.active.reshape(shards, -1).astype(jnp.int32), axis=1))  # its shard's slots
        fits_smaller = (i > 0) & (fullest * shards <= stop_below)
        return (i < max_steps) & (live > 0) & ~(stop_on_finish & finished) & ~fits_smaller

    def step(c: tuple[Array, Array, DecodeState]) -> tuple[Array, Array, DecodeState]:
        i, _, s = c
        if speculative is not None:
            changes, finished = verify_step(params, cfg, s, rng, knobs, cascade, draft_params, settings=settings,
                                            speculative=speculative, compute_dtype=dt, attn_impl=attn_impl, mesh=mesh,
                                            slot_axes=slot_axes)
            return i + 1, finished, s._replace(**changes)
        kv = s.pool if s.recurrent is None else HybridState.of(s.pool, s.recurrent)  # with the slots' delta-net state
        logits, kv, fed = decode_logits(params, cfg, kv, s.last, s.positions, s.page_table, s.active,
                                        compute_dtype=dt, attn_impl=attn_impl, mesh=mesh,
                                        record_routing=s.routing is not None, cascade=cascade,
                                        rope_offset=s.rope_offset, slot_axes=slot_axes)
        pool, recurrent = (kv.attention, kv.recurrent) if isinstance(kv, HybridState) else (kv, None)
        routing = s.routing
        if routing is not None and fed is not None:  # the fed token is response token num_gen - 1
            fed_col = jnp.clip(s.num_gen - 1, 0, r - 1)
            old = routing[rows, fed_col]
            routing = routing.at[rows, fed_col].set(
                jnp.where(s.active[:, None, None], fed.astype(routing.dtype), old))
        keys = request_keys(rng, s.request, s.num_gen)
        tok, lp = choose_per_row(logits, keys, knobs, settings)
        act = s.active
        col = jnp.minimum(s.num_gen, r - 1)
        tok = jnp.where(act, tok, knobs.pad_id)
        num_gen = s.num_gen + act.astype(jnp.int32)
        ends, reason = finish_codes(tok, num_gen, knobs, s.budget)
        ends &= act
        s = s._replace(
            pool=pool, recurrent=recurrent, positions=s.positions + act.astype(jnp.int32), last=tok, num_gen=num_gen,
            active=act & ~ends, finish=jnp.where(ends, reason, s.finish),
            tokens=s.tokens.at[rows, col].set(jnp.where(act, tok, s.tokens[rows, col])),
            log_probs=s.log_probs.at[rows, col].set(jnp.where(act, lp, s.log_probs[rows, col])),
            steps=s.steps + 1, useful=s.useful + jnp.sum(act.astype(jnp.int32)), routing=routing)
        return i + 1, jnp.any(ends), s

    _, _, state = lax.while_loop(keep_going, step, (jnp.int32(0), jnp.bool_(False), state))
    return state

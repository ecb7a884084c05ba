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

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.arrays import HostOrDevice
from jaxrl_llm.models import (
    ModelConfig,
    as_jnp_dtype,
    forward_hidden,
    forward_hidden_routed,
    init_cache,
    logits_from_hidden,
)
from jaxrl_llm.models.gemma4 import typed_state
from jaxrl_llm.models.hybrid import RECURRENT_KEYS, HybridState, zero_recurrent
from jaxrl_llm.models.moe import NOT_RECORDED, routing_dtype
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine.draws import choose_per_row, finish_codes, request_keys
from jaxrl_llm.sampler.engine.forward import decode_logits, write_pool_rows
from jaxrl_llm.sampler.engine.verify import verify_step
from jaxrl_llm.sampler.kv_bits import storage_dtype, storage_head_dim
from jaxrl_llm.sampler.kv_shards import kv_head_axis
from jaxrl_llm.sampler.paged_attention import takes_xla_path
from jaxrl_llm.sampler.params import SampleKnobs, SampleSettings
from jaxrl_llm.sampler.speculative import SpeculativeSpec
from jaxrl_llm.sharding import mesh_context

Array = jax.Array
KV_CACHE_DTYPES = ("auto", "int8")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Static shape of an engine (hashable; a jit static argument).

    max_num_seqs: decode slots. page_size: tokens per KV page. num_pages: pool pages (page 0 is
    scratch). pages_per_slot: page-table width (max_model_len / page_size, rounded up).
    kv_cache_dtype: 'auto' (the compute dtype) or 'int8'. attn_impl: paged attention impl.
    cascade: the samples of a prompt read its shared full pages once per decode step
    (sampler/cascade_attention.py; the scheduler passes the groups to `generate`): True, False, or
    'auto' (only where decode attention is the TPU's Mosaic kernel; see `cascade_shape`).
    speculative: draft and verify several tokens per slot and step (engine/verify.py), or None.
    """

    max_num_seqs: int
    page_size: int
    num_pages: int
    pages_per_slot: int
    kv_cache_dtype: str = "auto"
    attn_impl: str = "auto"
    cascade: bool | str = "auto"
    speculative: SpeculativeSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cascade, bool) and self.cascade != "auto":
            raise ValueError(f"rollout.cascade_attention={self.cascade!r}: expected True, False or 'auto'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"rollout.kv_cache_dtype={self.kv_cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
        for name in ("max_num_seqs", "page_size", "pages_per_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineSpec.{name}={getattr(self, name)} must be >= 1")
        if self.num_pages < 2:
            raise ValueError(f"EngineSpec.num_pages={self.num_pages}: need the scratch page and at least one more")

    def page_bytes(self, cfg: ModelConfig, compute_dtype: str) -> int:
        """Bytes of one page over all layers, K and V (with int8 scales; MLA: the latent keys only)."""
        total = 0
        for layers, kv_heads, head_dim in pool_dims(cfg).values():
            per_token = layers * kv_heads * len(pool_arrays(cfg))
            if self.kv_cache_dtype == "int8":
                total += per_token * self.page_size * (storage_head_dim(head_dim) + 4)
            else:
                total += per_token * self.page_size * storage_head_dim(head_dim) * as_jnp_dtype(compute_dtype).itemsize
        return total


def pool_dims(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """(layers, kv heads, head dim) of each KV pool a model's engine holds: one, or for a Gemma 4 model one
    per attention type ("sliding", "full") over the layers of that type that compute keys / values (the
    KV-sharing layers read their producer's rows; engine/forward.py)."""
    if not cfg.typed_layers:  # MLA: the latent (models/mla.py); a hybrid model: its full-attention layers'
        return {"": (len(cfg.full_attention_layers), cfg.cache_kv_heads, cfg.cache_head_dim)}
    return {"sliding": (len(cfg.kv_layer_ids(True)), cfg.num_key_value_heads, cfg.head_dim),
            "full": (len(cfg.kv_layer_ids(False)), cfg.full_kv_heads, cfg.full_head_dim)}


class Prefix(NamedTuple):
    """A prefilled prompt: its KV (right-padded to the bucket) and the next-token logits."""

    k: Any  # [L, kv, Pb, D] (a Gemma 4 model: one per attention type, {"sliding": ..., "full": ...})
    v: Any
    logits: Array  # fp32 [V]
    length: Array  # int32 scalar
    routing: Array | None = None  # [Pb, L, k] the prompt tokens' experts (a MoE model, recording)
    ids: Array | None = None  # int32 [Pb] the prompt (a speculative engine's n-gram history)
    # a hybrid model's delta-net state after the prompt ({"conv", "delta"}, models/hybrid.py): [layers, ...] (one
    # prompt's; `prefill_batch`'s: [B, layers, ...])
    recurrent: dict | None = None
    # a vision-language prompt's M-RoPE delta (int32 scalar; models/vision/qwen_vl.py): what its decode steps add
    # to their rotary positions
    rope_delta: Array | None = None


class PromptImages(NamedTuple):
    """A vision-language prompt's images for its prefill, padded to the prompt's bucket Pb: M-RoPE positions
    [3, Pb] (0 on padding), the feature each image token takes [Pb] (-1 elsewhere), the features [K, H] (zeros past
    the prompt's own), and the decode delta (int32 scalar)."""

    positions: Array
    slots: Array
    features: Array
    delta: Array
    deepstack: Array | None = None  # [D, K, H] Qwen3-VL's deepstack features

    @property
    def embeds(self) -> tuple[Array, ...]:
        """`forward_hidden`'s embeds for this one prompt (a row of its own features)."""
        if self.deepstack is None:
            return self.slots[None], self.features[None]
        return self.slots[None], self.features[None], self.deepstack[:, None]


class DecodeState(NamedTuple):
    """Everything the decode loop carries (S = slots, R = max_new_tokens)."""

    pool: dict
    page_table: Array  # int32 [S, pages_per_slot]
    positions: Array  # int32 [S] tokens in the slot's KV (= position of the token fed next)
    last: Array  # int32 [S] last sampled token (fed at the next step)
    num_gen: Array  # int32 [S] response tokens so far
    active: Array  # bool [S] still generating
    finish: Array  # int32 [S] finish reason
    request: Array  # int32 [S, 2] (prompt index, sample index) of the slot's request
    budget: Array  # int32 [S] the slot's own max new tokens (<= R)
    tokens: Array  # int32 [S, R]
    log_probs: Array  # fp32 [S, R]
    steps: Array  # int32 scalar: decode steps run (slot-steps = steps * S)
    useful: Array  # int32 scalar: tokens generated by active slots in decode steps
    # settings.record_routing on a MoE model: [S, R, L, k] the experts of each fed response token
    # (column c: response token c, fed at the next step; NOT_RECORDED until then)
    routing: Array | None = None
    # speculative decoding (spec.speculative): n-gram drafts, [S, max_model_len + 1] each slot's prompt
    # and response tokens (what drafts are looked up in); int32 [3] counters: tokens emitted by
    # verification steps, drafts verified, drafts the target kept
    history: Array | None = None
    spec_counts: Array | None = None
    # a draft model's KV pool (speculative method 'draft'): its own dims, the same pages and tables
    draft_pool: dict | None = None
    # a hybrid model's per-slot delta-net state {"conv": [layers, S, ...], "delta": [layers, S, ...]}
    # (models/hybrid.py; slots on axis 1, `SLOT_AXIS`): beside the pool (which holds its full-attention layers),
    # set by `insert`, advanced by decode, cleared with the slot
    recurrent: dict | None = None
    # a vision-language model's (cfg.mrope_section) int32 [S]: each slot's M-RoPE delta, added to its rotary
    # positions (not to its KV positions) at every decode step; 0 for a text prompt
    rope_offset: Array | None = None


def empty_pool(cfg: ModelConfig, spec: EngineSpec, compute_dtype: str) -> dict:
    """A zero KV pool of `cfg`'s dims over the spec's pages (see engine/forward.py for the layout); a Gemma
    4 model's holds one per attention type (`pool_dims`)."""
    pools = {kind: _zero_pool((layers, kv_heads, spec.num_pages, spec.page_size, storage_head_dim(head_dim)), spec,
                              compute_dtype, pool_arrays(cfg))
             for kind, (layers, kv_heads, head_dim) in pool_dims(cfg).items()}
    return pools[""] if "" in pools else pools


def pool_arrays(cfg: ModelConfig) -> tuple[str, ...]:
    """The arrays a pool holds per token: keys and values, or for MLA keys only (the latent and rope key; its
    values are the keys' first kv_lora_rank numbers, models/mla.py)."""
    return ("k",) if cfg.is_mla else ("k", "v")


def _zero_pool(shape: tuple[int, ...], spec: EngineSpec, compute_dtype: str, names: tuple[str, ...]) -> dict:
    if spec.kv_cache_dtype == "int8":
        return {**{n: jnp.zeros(shape, jnp.int8) for n in names},
                **{f"{n}_scale": jnp.zeros(shape[:-1], jnp.float32) for n in names}}
    dt = storage_dtype(as_jnp_dtype(compute_dtype))  # bf16 on CPU: uint16 bits (sampler/kv_bits.py)
    return {n: jnp.zeros(shape, dt) for n in names}


def init_state(cfg: ModelConfig, spec: EngineSpec, max_new_tokens: int, compute_dtype: str,
               record_routing: bool = False) -> DecodeState:
    pool = empty_pool(cfg, spec, compute_dtype)
    routing = None
    if record_routing and cfg.is_moe:  # one slot row's shape [R, L, k]; empty_slots stacks S of them
        routing = jax.ShapeDtypeStruct((max_new_tokens, cfg.num_hidden_layers, cfg.num_experts_per_tok),
                                       routing_dtype(cfg.num_experts))
    state = empty_slots(pool, spec, max_new_tokens, routing)
    if cfg.hybrid:
        state = state._replace(recurrent=zero_recurrent(cfg, spec.max_num_seqs))
    if cfg.mrope_section:
        state = state._replace(rope_offset=jnp.zeros((spec.max_num_seqs,), jnp.int32))
    if spec.speculative is not None and spec.speculative.uses_draft_model:
        assert spec.speculative.draft_cfg is not None, "the draft model's config is filled in before the engine"
        state = state._replace(draft_pool=empty_pool(spec.speculative.draft_cfg, spec, compute_dtype))
    return state


def empty_slots(pool: dict, spec: EngineSpec, max_new_tokens: int, routing: Any = None) -> DecodeState:
    """Empty slots around `pool` (each field its own buffer: the state is donated); `routing`: one
    slot's recorded-routing row (shape and dtype) when recording, else None."""
    s, r = spec.max_num_seqs, max_new_tokens
    z = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731
    speculative = {}
    if spec.speculative is not None:
        speculative["spec_counts"] = jnp.zeros((3,), jnp.int32)
        if not spec.speculative.uses_draft_model:  # the n-gram drafter looks up the prompt and response
            speculative["history"] = jnp.zeros((s, spec.pages_per_slot * spec.page_size + 1), jnp.int32)
    return DecodeState(**speculative, pool=pool, page_table=jnp.zeros((s, spec.pages_per_slot), jnp.int32),
                       positions=z(), last=z(), num_gen=z(), active=jnp.zeros((s,), bool), finish=z(),
                       request=jnp.zeros((s, 2), jnp.int32), budget=z(), tokens=jnp.zeros((s, r), jnp.int32),
                       log_probs=jnp.zeros((s, r), jnp.float32),
                       steps=jnp.zeros((), jnp.int32), useful=jnp.zeros((), jnp.int32),
                       routing=None if routing is None else jnp.full((s, *routing.shape), NOT_RECORDED, routing.dtype))


def reset_slots(state: DecodeState, spec: EngineSpec, max_new_tokens: int) -> DecodeState:
    """Empty slots around the same pool."""
    row = None if state.routing is None else jax.ShapeDtypeStruct(state.routing.shape[1:], state.routing.dtype)
    recurrent = None if state.recurrent is None else jax.tree.map(jnp.zeros_like, state.recurrent)
    offset = None if state.rope_offset is None else jnp.zeros_like(state.rope_offset)
    return empty_slots(state.pool, spec, max_new_tokens, row)._replace(draft_pool=state.draft_pool,
                                                                       recurrent=recurrent, rope_offset=offset)


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_slots(state: DecodeState) -> DecodeState:
    """`reset_slots` of a live state, on device (the pools stay where they are)."""
    zero = lambda x: jnp.zeros_like(x)  # noqa: E731
    return jax.tree.map(zero, state._replace(pool=None, draft_pool=None))._replace(pool=state.pool,
                                                                                  draft_pool=state.draft_pool)


SLOT_FIELDS = ("page_table", "positions", "last", "num_gen", "active", "finish", "request", "budget", "tokens",
               "log_probs", "routing", "history", "recurrent", "rope_offset")
SLOT_AXIS = {"recurrent": 1}  # the fields whose slots are not on axis 0 (layer-major, as the pool)


def slot_fields(state: DecodeState) -> dict[str, Any]:
    """The per-slot arrays of `state` (routing only when recording)."""
    return {f: getattr(state, f) for f in SLOT_FIELDS if getattr(state, f) is not None}


def resize_slots(state: DecodeState, keep: HostOrDevice, num_keep: HostOrDevice, *, slots: int) -> DecodeState:
    """The state with `slots` slots: slot i is old slot keep[i] for i < num_keep, the rest empty
    (inactive, scratch page table); the pool and the counters stay as they are. The scheduler
    shrinks the slot set while the queue drains (decode cost follows the live sequences) and grows
    it back for new requests."""
    fields = _gather_slots(slot_fields(state), keep, num_keep, slots=slots)
    return state._replace(**fields)


@functools.partial(jax.jit, static_argnames=("slots",))
def _gather_slots(fields: dict, keep: Array, num_keep: Array, *, slots: int) -> dict:
    valid = jnp.arange(slots) < num_keep
    idx = jnp.where(valid, keep[:slots], 0)  # keep: [max_num_seqs] >= slots

    def take(x: Array, axis: int) -> Array:
        rows = jnp.take(x, idx, axis=axis)
        shape = [1] * x.ndim
        shape[axis] = slots
        return jnp.where(valid.reshape(shape), rows, jnp.zeros_like(rows))

    return {f: jax.tree.map(functools.partial(take, axis=SLOT_AXIS.get(f, 0)), x) for f, x in fields.items()}


def state_sharding(state: DecodeState, cfg: ModelConfig, mesh: Mesh) -> DecodeState:
    """Shardings of a state: the pools' kv-heads dim over 'tensor' when it divides, the rest (a hybrid model's
    per-slot delta-net state too) replicated (every process reads the same small slot arrays: identical
    scheduling)."""
    rep = NamedSharding(mesh, PartitionSpec())

    def pool_sharding(pool: dict) -> dict:
        if "k" not in pool:  # one pool per attention type (Gemma 4), each split by its own kv heads
            return {kind: pool_sharding(sub) for kind, sub in pool.items()}
        heads = kv_head_axis(mesh, pool["k"].shape[1])
        return {k: NamedSharding(mesh, PartitionSpec(None, heads)) for k in pool}

    pools = {"pool": pool_sharding(state.pool)}
    if state.draft_pool is not None:
        pools["draft_pool"] = pool_sharding(state.draft_pool)
    rest = {f: jax.tree.map(lambda _: rep, getattr(state, f))  # a hybrid model's state: a dict of arrays
            for f in state._fields if f not in pools and getattr(state, f) is not None}
    return state._replace(**pools, **rest)


def cascade_shape(spec: EngineSpec, slots: int, n: int) -> tuple[int, int] | None:
    """(rows, members per row) of the cascade groups `generate` takes for `slots` slots and n samples
    per prompt, or None when it takes none: cascade off, n = 1 (nothing shared), or 'auto' anywhere but
    a TPU's Mosaic kernel. Where measured, cascade rows were slower than plain paged attention: on
    CPU's XLA path the extra passes and row-to-slot moves cost more than the shared reads they save
    (0.86x useful tokens/s, SmolLM2 at 64 slots x 512 tokens), and on an H200's Triton kernel decode
    is bound by per-step overhead, not bytes (0.86x / 0.95x at 64 / 256 slots with 128-token prompts,
    0.74x / 0.95x with 1024 / 2048-token prompts x n=8; docs/performance-history.md). A TPU's decode is not
    measured yet: there the kernel reads pages at HBM speed, and reading them once per group is the
    point. slots // 2 rows hold every group with two or more members in slots."""
    if spec.cascade is False or n < 2:
        return None
    if spec.cascade == "auto" and (target_platform() != "tpu"
                                   or takes_xla_path(spec.attn_impl, spec.kv_cache_dtype == "int8")):
        return None
    return max(1, slots // 2), min(n, slots)


@functools.partial(jax.jit, static_argnames=("cfg", "compute_dtype", "record_routing", "mesh", "chunk"))
def prefill(params: dict, cfg: ModelConfig, prompt_ids: Array, length: Array, *, compute_dtype: str,
            record_routing: bool = False, mesh: Mesh | None = None, replay: Array | None = None,
            chunk: int | None = None, images: PromptImages | None = None) -> Prefix:
    """KV of one right-padded prompt [Pb] (its first `length` ids real) and its next-token logits
    (and with `record_routing`, a MoE model's experts per prompt token). `replay` [Pb, L, k]: experts
    to run (a multi-turn conversation's earlier turns; NOT_RECORDED: the router's choice); they are
    what is recorded for those tokens. `chunk` (chunked prefill, dividing Pb): the prompt runs `chunk`
    tokens at a time over the growing cache (a `lax.scan`), so the program's activations and attention
    scores are [chunk, Pb] rather than [Pb, Pb]. `images`: a vision-language prompt's (`PromptImages`): its image
    tokens take the features, every token its M-RoPE position, and the prefix carries the decode delta. Traced on
    `mesh`. A Gemma 3 prompt with images prefills whole: an image's tokens see each other, so no chunk boundary may
    split one (vLLM's answer is the same: an image is scheduled in one piece)."""
    if images is not None and cfg.bidirectional_image_tokens:
        chunk = None
    with mesh_context(mesh):
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


@functools.partial(jax.jit, static_argnames=("cfg", "compute_dtype", "mesh"))
def prefill_batch(params: dict, cfg: ModelConfig, prompt_ids: Array, lengths: Array, *, compute_dtype: str,
                  mesh: Mesh | None = None) -> Prefix:
    """`prefill` of B right-padded prompts [B, Pb] of one bucket in one forward (their first
    `lengths[b]` ids real): a Prefix whose every field has a leading [B] axis (`insert_at` takes
    one row). Many short prompts then cost one program call rather than one each (no routing
    recording, no chunking: the scheduler keeps those on `prefill`)."""
    with mesh_context(mesh):
        dt = as_jnp_dtype(compute_dtype)
        b, pb = prompt_ids.shape
        mask = (jnp.arange(pb)[None] < lengths[:, None]).astype(jnp.int32)
        hidden, cache = forward_hidden(params, cfg, prompt_ids.astype(jnp.int32), mask,
                                       cache=init_cache(cfg, b, pb, dt), compute_dtype=dt)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        k, v = _cache_kv(cfg, cache, lambda x: jnp.moveaxis(x, 1, 0))
        return Prefix(k=k, v=v, logits=logits_from_hidden(params, cfg, last), length=lengths.astype(jnp.int32),
                      ids=prompt_ids.astype(jnp.int32), recurrent=_cache_recurrent(cfg, cache, None))


@functools.partial(jax.jit, static_argnames=("settings",), donate_argnames=("state",))
def insert(prefix: Prefix, state: DecodeState, slot: Array, page_row: Array, request: Array, budget: Array,
           rng: Array, knobs: SampleKnobs, draft: Prefix | None = None, *, settings: SampleSettings) -> DecodeState:
    """Copies the prefix KV into the pages of `page_row` (the slot's page table), draws token 0.
    The slot then generates at most `budget` (<= settings.max_new_tokens) tokens. `draft`: the
    draft model's prefix of the same prompt (speculative method 'draft'), copied into its pool.

    Pages shared by the samples of one prompt are rewritten with identical values (harmless)."""
    return _insert(prefix, state, slot, page_row, request, budget, rng, knobs, draft, settings=settings)


@functools.partial(jax.jit, static_argnames=("settings",), donate_argnames=("state",))
def insert_at(prefixes: Prefix, index: Array, state: DecodeState, slot: Array, page_row: Array, request: Array,
              budget: Array, rng: Array, knobs: SampleKnobs, drafts: Prefix | None = None, *,
              settings: SampleSettings) -> DecodeState:
    """`insert` of row `index` of a batched prefix (`prefill_batch`), and of the draft model's."""
    row = lambda tree: jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, 0, keepdims=False), tree)  # noqa: E731
    return _insert(row(prefixes), state, slot, page_row, request, budget, rng, knobs,
                   None if drafts is None else row(drafts), settings=settings)


def _write_prefix(pool: dict, prefix: Prefix, page_row: Array) -> dict:
    """`pool` with the prompt KV of `prefix` written at its positions' pages of `page_row`."""
    if "k" not in pool:  # one pool per attention type (Gemma 4)
        return {kind: _write_kv(sub, prefix.k[kind], prefix.v[kind], prefix.length, page_row)
                for kind, sub in pool.items()}
    return _write_kv(pool, prefix.k, prefix.v, prefix.length, page_row)


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
            rng: Array, knobs: SampleKnobs, draft: Prefix | None, *, settings: SampleSettings) -> DecodeState:
    new_pool = _write_prefix(state.pool, prefix, page_row)
    draft_pool = state.draft_pool
    if draft_pool is not None:
        assert draft is not None, "a draft-model engine inserts the draft model's prefix too"
        draft_pool = _write_prefix(draft_pool, draft, page_row)
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


@functools.partial(jax.jit, static_argnames=("cfg", "settings", "attn_impl", "mesh", "speculative"),
                   donate_argnames=("state",))
def generate(params: dict, cfg: ModelConfig, state: DecodeState, rng: Array, knobs: SampleKnobs,
             max_steps: Array, stop_on_finish: Array, stop_below: Array | int = 0, cascade: Cascade | None = None,
             draft_params: dict | None = None, *, settings: SampleSettings, attn_impl: str = "auto",
             mesh: Mesh | None = None, speculative: SpeculativeSpec | None = None) -> DecodeState:
    """Decode steps for every active slot until `max_steps` steps ran, no slot is active, (with
    `stop_on_finish`) some slot finished, so the host can refill it from its queue, or at most
    `stop_below` slots are still active, so the host can move them to a smaller slot set.
    `mesh`: the state's mesh (`state_sharding`); an attention kernel then runs per kv-head shard, and the
    program is traced on it. `cascade`: groups of slots sharing their prompt's full pages, each read
    once per group (the slots stay where they are during the call; a finished member reads nothing).
    `speculative` (the spec's; the state then carries its history): every step verifies drafted
    tokens and emits 1 to num_tokens + 1 per slot (engine/verify.py); `draft_params`: the draft
    model's (method 'draft')."""
    with mesh_context(mesh):
        return _generate(params, cfg, state, rng, knobs, max_steps, stop_on_finish, stop_below, cascade,
                         draft_params, settings=settings, attn_impl=attn_impl, mesh=mesh, speculative=speculative)


def _generate(params: dict, cfg: ModelConfig, state: DecodeState, rng: Array, knobs: SampleKnobs,
              max_steps: Array, stop_on_finish: Array, stop_below: Array | int, cascade: Cascade | None,
              draft_params: dict | None, *, settings: SampleSettings, attn_impl: str, mesh: Mesh | None,
              speculative: SpeculativeSpec | None) -> DecodeState:
    dt = as_jnp_dtype(settings.compute_dtype)
    r = settings.max_new_tokens
    rows = jnp.arange(state.active.shape[0])

    def keep_going(c: tuple[Array, Array, DecodeState]) -> Array:
        i, finished, s = c
        live = jnp.sum(s.active.astype(jnp.int32))
        return (i < max_steps) & (live > 0) & ~(stop_on_finish & finished) & ~((i > 0) & (live <= stop_below))

    def step(c: tuple[Array, Array, DecodeState]) -> tuple[Array, Array, DecodeState]:
        i, _, s = c
        if speculative is not None:
            changes, finished = verify_step(params, cfg, s, rng, knobs, cascade, draft_params, settings=settings,
                                            speculative=speculative, compute_dtype=dt, attn_impl=attn_impl, mesh=mesh)
            return i + 1, finished, s._replace(**changes)
        kv = s.pool if s.recurrent is None else HybridState.of(s.pool, s.recurrent)  # with the slots' delta-net state
        logits, kv, fed = decode_logits(params, cfg, kv, s.last, s.positions, s.page_table, s.active,
                                        compute_dtype=dt, attn_impl=attn_impl, mesh=mesh,
                                        record_routing=s.routing is not None, cascade=cascade,
                                        rope_offset=s.rope_offset)
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

"""The paged engine's state and its layout: the spec (`EngineSpec`: slots, pages, pool size), the KV pool and the
slots' per-sequence fields (`DecodeState`), a prompt's prefill result (`Prefix`), and the host-free operations on
them (initialise, resize a slot set, shard on a mesh, the cascade rows' shape). engine/programs.py's
jitted programs read and write it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.arrays import HostOrDevice
from jaxrl_llm.models import (
    ModelConfig,
    as_jnp_dtype,
)
from jaxrl_llm.models.hybrid import zero_recurrent
from jaxrl_llm.models.moe import NOT_RECORDED, routing_dtype
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.sampler.engine.slot_shards import pool_spec
from jaxrl_llm.sampler.kv_bits import storage_dtype, storage_head_dim
from jaxrl_llm.sampler.paged_attention import takes_xla_path
from jaxrl_llm.sampler.speculative import SpeculativeSpec

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
    slot_shards: how many ways the slots and the pool's pages are split over the mesh's batch axes
    (engine/slot_shards.py; 1: every device holds every slot); it divides max_num_seqs and num_pages, and each
    shard's pages are num_pages / slot_shards with its own scratch page.
    """

    max_num_seqs: int
    page_size: int
    num_pages: int
    pages_per_slot: int
    kv_cache_dtype: str = "auto"
    attn_impl: str = "auto"
    cascade: bool | str = "auto"
    speculative: SpeculativeSpec | None = None
    slot_shards: int = 1

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
        shards = self.slot_shards
        if shards < 1 or self.max_num_seqs % shards or self.num_pages % shards or self.num_pages // shards < 2:
            raise ValueError(f"EngineSpec.slot_shards={shards} must divide max_num_seqs={self.max_num_seqs} and "
                             f"num_pages={self.num_pages} into shards of at least 2 pages (a scratch page each)")

    @property
    def shard_pages(self) -> int:
        """Pages of each slot shard's pool, its scratch page 0 included."""
        return self.num_pages // self.slot_shards

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
    # zero in a fresh state (`init_state`), set by `insert`, advanced by decode, moved with the slot (`resize_slots`)
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


SLOT_FIELDS = ("page_table", "positions", "last", "num_gen", "active", "finish", "request", "budget", "tokens",
               "log_probs", "routing", "history", "recurrent", "rope_offset")
SLOT_AXIS = {"recurrent": 1}  # the fields whose slots are not on axis 0 (layer-major, as the pool)


def slot_fields(state: DecodeState) -> dict[str, Any]:
    """The per-slot arrays of `state` (routing only when recording)."""
    return {f: getattr(state, f) for f in SLOT_FIELDS if getattr(state, f) is not None}


def resize_slots(state: DecodeState, keep: HostOrDevice, *, slots: int, mesh: Mesh | None = None,
                 slot_axes: tuple[str, ...] = ()) -> DecodeState:
    """The state with `slots` slots: slot i is old slot keep[i] where keep[i] >= 0, else empty (inactive,
    scratch page table); the pool and the counters stay as they are. The scheduler shrinks the slot set while
    the queue drains (decode cost follows the live sequences) and grows it back for new requests; with slot
    shards it keeps each slot in its shard (engine/slot_shards.py).
    `mesh` / `slot_axes`: the state's (`state_sharding`), which the resized slot fields keep."""
    fields = _gather_slots(slot_fields(state), keep, slots=slots, mesh=mesh, slot_axes=slot_axes)
    return state._replace(**fields)


@functools.partial(jax.jit, static_argnames=("slots", "mesh", "slot_axes"))
def _gather_slots(fields: dict, keep: Array, *, slots: int, mesh: Mesh | None, slot_axes: tuple[str, ...]) -> dict:
    valid = keep[:slots] >= 0  # keep: [max_num_seqs] >= slots
    idx = jnp.where(valid, keep[:slots], 0)

    def take(x: Array, axis: int) -> Array:
        rows = jnp.take(x, idx, axis=axis)
        shape = [1] * x.ndim
        shape[axis] = slots
        out = jnp.where(valid.reshape(shape), rows, jnp.zeros_like(rows))
        if mesh is None:
            return out
        return lax.with_sharding_constraint(out, NamedSharding(mesh, PartitionSpec(*(None,) * axis, slot_axes or None)))

    return {f: jax.tree.map(functools.partial(take, axis=SLOT_AXIS.get(f, 0)), x) for f, x in fields.items()}


def state_sharding(state: DecodeState, cfg: ModelConfig, mesh: Mesh, slot_axes: tuple[str, ...] = ()) -> DecodeState:
    """Shardings of a state: the pools' kv-heads dim over 'tensor' when it divides; with `slot_axes` (the slot
    shards', engine/slot_shards.py) the pools' pages and every per-slot field's slots over those axes, else the
    slot fields (a hybrid model's per-slot delta-net state too) replicated; the counters replicated. Every
    process reads the same slot arrays (gathered, `to_host`): identical scheduling."""
    rep = NamedSharding(mesh, PartitionSpec())

    def pool_sharding(pool: dict) -> dict:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pool_spec(mesh, pool, slot_axes),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def slot_sharding(field: str) -> NamedSharding:
        axis = SLOT_AXIS.get(field, 0)
        return NamedSharding(mesh, PartitionSpec(*(None,) * axis, slot_axes or None))

    pools = {"pool": pool_sharding(state.pool)}
    if state.draft_pool is not None:
        pools["draft_pool"] = pool_sharding(state.draft_pool)
    rest = {f: jax.tree.map(lambda _, f=f: slot_sharding(f) if f in SLOT_FIELDS else rep, getattr(state, f))
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
    point. slots // 2 rows hold every group with two or more members in slots; with slot shards, each shard's
    slots // 2 of its own (its block of the rows, listing its local slots)."""
    if spec.cascade is False or n < 2:
        return None
    if spec.cascade == "auto" and (target_platform() != "tpu"
                                   or takes_xla_path(spec.attn_impl, spec.kv_cache_dtype == "int8")):
        return None
    per_shard = slots // spec.slot_shards
    return spec.slot_shards * max(1, per_shard // 2), min(n, per_shard)

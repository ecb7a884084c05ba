"""The rollout's program for the memory plan: the static sampler's `sample_program` or the paged engine's
`generate`, lowered on the run's abstract weights and KV pool, and the whole rollout's cost from one decode
step's compiled count (the decode steps, the attention kernels' K/V reads, a prompt's shared keys once per
cascade group, the prefill)."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.arrays import Params
from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.bookkeeping.metrics import per_token_forward_flops
from jaxrl_llm.models import ModelConfig, init_cache
from jaxrl_llm.models.decoder import unstackable
from jaxrl_llm.models.dtypes import is_uncast_matmul_weight
from jaxrl_llm.models.expert_parallel import expert_ways
from jaxrl_llm.models.hybrid import layer_scan_trips
from jaxrl_llm.models.moe import active_params
from jaxrl_llm.models.moe_experts import uncounted_expert_flops
from jaxrl_llm.planning.context import (
    ARR,
    MESH_KEYS,
    Context,
    Program,
    abstract_arrays,
    bytes_per_device,
    lower_for,
    moe_layout_tokens,
    repeated,
)
from jaxrl_llm.planning.roofline import Cost
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.roles.forward import compute_dtype_of
from jaxrl_llm.roles.trained import param_shardings_of
from jaxrl_llm.sampler import core as sampler_core
from jaxrl_llm.sampler import eos_ids_of
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine import decode_layout, decode_state, slot_shards
from jaxrl_llm.sampler.engine import programs as engine_programs
from jaxrl_llm.sampler.engine.setup import engine_spec
from jaxrl_llm.sharding import batch_axis_size


def sample_program(ctx: Context) -> Program:
    """The rollout of the step's prompts x n: the paged engine's `generate` or the static sampler's program, with
    the decode steps its compiled count holds once added by formula."""
    spec, cfg, mesh = ctx.spec, ctx.actor.cfg, ctx.mesh
    sampling = spec.train_sampling
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    settings, knobs = sampling.compile_args(list(eos_ids_of(cfg, ctx.tokenizer)), pad, vocab_size=cfg.vocab_size,
                                            compute_dtype=spec.actor.compute_dtype)
    ways = batch_axis_size(mesh)
    prompts = -(-spec.plan.prompts // ways) * ways  # RolloutGenerator pads the batch to the mesh's batch ways
    rows, width, r = prompts * sampling.n, ctx.prompt_width, sampling.max_new_tokens
    # XLA counts the decode loop's body once: the other r - 1 tokens are ~2 FLOPs per active parameter per row
    # (a MoE token runs its top-k experts only)
    per_token = 2.0 * active_params(cfg, ctx.actor.num_params)
    decode = lambda plan: per_token * rows * (r - 1) / mesh.size  # noqa: E731
    if spec.rollout_engine.resolved(r, multi_turn=spec.multi_turn is not None).engine == "paged":
        return _paged_sample_program(ctx, settings, knobs, rows, decode)
    prefill_experts = uncounted_expert_flops(cfg, rows * width, moe_layout_tokens(ctx, rows, width),
                                             expert_ways(cfg, mesh)) / mesh.size

    def lower(plan: BatchPlan, repeat: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        ids = ctx.rows(prompts, width, jnp.int32)
        return lower_for(sampler_core.sample_program, platforms, ctx.policy_params(), repeated(cfg, repeat), ids, ids,
                      jax.random.PRNGKey(0), knobs, settings=settings, mesh=mesh)

    kv = jax.eval_shape(lambda: init_cache(cfg, rows, width + r - 1, compute_dtype_of(spec.actor.compute_dtype)))
    tensor = dict(mesh.shape).get("tensor", 1)
    kv_split = ways * (tensor if cfg.cache_kv_heads % tensor == 0 else 1)
    kv_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for name, x in kv.items()
                   if name not in ("mask", "index")) // kv_split
    keys = (f"data.train_batch_size={spec.plan.prompts} x {ARR}.rollout.n={sampling.n} (rows sampled at once)",
            f"data.max_prompt_length={spec.plan.max_prompt_length} + data.max_response_length={r} (the KV cache)",
            f"{ARR}.ref.param_offload", f"{ARR}.model.lora_rank", MESH_KEYS)
    return Program("sample", lower, (*ctx.policy_states, "kv_pool"), lambda plan: keys,
                   extra_flops=lambda plan: decode(plan) + prefill_experts, kv_bytes=kv_bytes,
                   layers=layer_scan_trips(cfg))


class DecodeWeights(NamedTuple):
    """What the paged engine decodes from, for abstract params (per-device bytes)."""

    params: Params  # the abstract params `generate` reads (the matmul weights in the compute dtype)
    held: int  # held besides them while it runs: the masters they were cast from, the per-layer copy
    copies: int  # the copies the rollout makes: the cast weights and the per-layer copy


def decode_weights(params: Params, cfg: ModelConfig, compute_dtype: str, unroll_layers: bool,
                   mesh: Any = None, slot_axes: tuple[str, ...] = ()) -> DecodeWeights:
    """The paged engine's decode weights for abstract `params` (with shardings). The engine
    (sampler/engine/scheduler.py) reads a copy of the matmul weights in the compute dtype, made once
    per rollout and laid out for decoding where its slots are split over `slot_axes`
    (sampler/engine/decode_layout.py), while the masters stay alive; with `rollout.unroll_layers` the steps
    read per-layer copies of that copy's layers, while prefill keeps the stacked ones. Unrolled layers are
    planned as the stack (the same bytes per device)."""
    target = jnp.dtype(compute_dtype_of(compute_dtype))

    def step_leaf(path: tuple, x: Any) -> Any:
        dtype = target if is_uncast_matmul_weight(path, x, target) else x.dtype
        names = decode_layout.leaf_names(path)
        sharding = decode_layout.decode_sharding(x, mesh, slot_axes, names, cfg.batch_invariant)
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)

    step = jax.tree_util.tree_map_with_path(step_leaf, params)
    # the leaves the engine copies (cast or moved): their masters stay alive beside the copies
    copied = [(x, y) for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(step))
              if (x.dtype, x.sharding) != (y.dtype, y.sharding)]
    per_layer = bytes_per_device(step["layers"]) if unroll_layers and unstackable(cfg) else 0
    return DecodeWeights(step, bytes_per_device([x for x, _ in copied]) + per_layer,
                         bytes_per_device([y for _, y in copied]) + per_layer)


def _paged_sample_program(ctx: Context, settings: Any, knobs: Any, rows: int, decode: Callable) -> Program:
    """The paged engine's `generate` (jaxrl_llm/sampler/engine): its decode state holds the KV pool,
    sized as the run sizes it (`engine_spec`), so the pool is among the program's arguments, as are
    the decode weights (`decode_weights`). The per-prompt prefill (chunked: one chunk's scores at
    a time) is far smaller and not planned."""
    spec, cfg, mesh = ctx.spec, ctx.actor.cfg, ctx.mesh
    opts, dtype = spec.rollout_engine, spec.actor.compute_dtype
    unroll = opts.unroll_for(settings.max_new_tokens, cfg)  # for the plan's target (its 'auto')
    engine = engine_spec(cfg, opts, num_requests=rows, max_prompt_len=spec.plan.max_prompt_length,
                         samples_per_prompt=settings.n,
                         max_new_tokens=settings.max_new_tokens, compute_dtype=dtype, mesh=mesh)
    slot_axes = slot_shards.slot_axes(mesh, engine.slot_shards)
    weights = [decode_weights(ctx.policy_params(), cfg, dtype, unroll, mesh, slot_axes)]
    # the decode loop's weights: the stack, or its per-layer copies (rollout.unroll_layers), which the step reads
    # one after another (no layer scan to count once: `layers` 1)
    step_params = _per_layer(weights[0].params, cfg, mesh) if unroll else weights[0].params
    scan_trips = layer_scan_trips(cfg) if step_params is weights[0].params else 1
    make = functools.partial(decode_state.init_state, cfg, engine, settings.max_new_tokens, dtype)
    abstract = jax.eval_shape(make)
    shardings = decode_state.state_sharding(abstract, cfg, mesh, slot_axes)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, shardings)

    draft = None  # a draft model's params (speculative method 'draft'), placed as the policy's shapes are
    if engine.speculative is not None and engine.speculative.draft_cfg is not None:
        draft_cfg = engine.speculative.draft_cfg
        abstract_draft, draft_shardings = param_shardings_of(draft_cfg, "lm", mesh, compute_dtype_of(
            spec.model.param_dtype))
        weights.append(decode_weights(abstract_arrays(abstract_draft, draft_shardings), draft_cfg, dtype, unroll, mesh,
                                      slot_axes))
        draft = _per_layer(weights[-1].params, draft_cfg, mesh) if unroll else weights[-1].params

    groups = decode_state.cascade_shape(engine, engine.max_num_seqs, settings.n)
    cascade = None if groups is None else Cascade(jax.ShapeDtypeStruct(groups, jnp.int32),
                                                  jax.ShapeDtypeStruct(groups[:1], jnp.int32))

    def lower(plan: BatchPlan, repeat: int = 1, platforms: tuple[str, ...] | None = None,
              pool_pages: int = 0) -> jax.stages.Lowered:
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        pool_pages = pool_pages // engine.slot_shards * engine.slot_shards  # whole pages per slot shard
        pages = lambda x: jax.ShapeDtypeStruct((*x.shape[:2], pool_pages, *x.shape[3:]), x.dtype,  # noqa: E731
                                               sharding=x.sharding)
        pooled = state if not pool_pages else state._replace(pool=jax.tree.map(pages, state.pool))
        return lower_for(engine_programs.generate, platforms, step_params, repeated(cfg, repeat), pooled,
                      jax.random.PRNGKey(0), knobs, scalar, jax.ShapeDtypeStruct((), jnp.bool_), scalar, cascade,
                      draft, settings=settings, attn_impl=engine.attn_impl, mesh=mesh, speculative=engine.speculative,
                      slot_axes=slot_axes)

    total_cost = functools.partial(_rollout_cost, ctx, engine, rows=rows, n=settings.n, r=settings.max_new_tokens,
                                   shared_tokens=_cascade_shared_tokens(ctx, engine, groups is not None),
                                   weight_bytes=bytes_per_device(weights[0].params),
                                   weight_split=_weight_split(weights[0].params))
    keys = (f"{ARR}.rollout.max_num_seqs={opts.max_num_seqs} (decode slots: {engine.max_num_seqs} here)",
            f"{ARR}.rollout.gpu_memory_utilization={opts.gpu_memory_utilization} (caps the KV pool)",
            f"{ARR}.rollout.kv_cache_dtype={opts.kv_cache_dtype}",
            f"data.max_prompt_length={spec.plan.max_prompt_length} + data.max_response_length="
            f"{settings.max_new_tokens} (pages per slot)", f"{ARR}.model.lora_rank", MESH_KEYS)
    if unroll:
        keys += (f"{ARR}.rollout.unroll_layers=False (no per-layer weight copy)",)
    return Program("sample", lower, (*ctx.policy_states, "kv_pool", "decode_weights"), lambda plan: keys,
                   extra_flops=decode, kv_bytes=bytes_per_device(state.pool), held_bytes=sum(w.held for w in weights),
                   copy_bytes=sum(w.copies for w in weights), layers=scan_trips, total_cost=total_cost,
                   pool_pages=engine.num_pages, prologue_once=True)


def _per_layer(params: Params, cfg: ModelConfig, mesh: Any) -> Params:
    """Abstract `params` as the engine's unrolled decode reads them (`unstack_layers`: a tuple of per-layer
    weights, each placed as the stack's layers are), or `params` where the model keeps its stack."""
    if not unstackable(cfg):
        return params

    def one_layer(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:  # the stack's placement less its layer dim
        spec = tuple(x.sharding.spec)[1:] if isinstance(x.sharding, NamedSharding) else ()
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=NamedSharding(mesh, P(*spec)))

    return dict(params, layers=(jax.tree.map(one_layer, params["layers"]),) * cfg.num_hidden_layers)


def _cascade_shared_tokens(ctx: Context, engine: Any, cascade: bool) -> int:
    """The prompt tokens a decode step reads once per group rather than once per sample: none without cascade
    rows; the prompt with them (sampler/cascade_attention.py); with `model.batch_invariant` the whole key
    blocks of the prompt's full pages, where the mode's paged kernel reads the pool in place (the block
    holding the prompt's end is each sample's own: sampler/paged_attention.py `invariant_cascade`)."""
    cfg = ctx.actor.cfg
    if not cascade:
        return 0
    if not cfg.batch_invariant:
        return ctx.prompt_width
    blocks = _invariant_paged_blocks(cfg, engine.page_size)
    if blocks is None:
        return 0  # the gathered form (CPU's blocked XLA; a head width the kernel does not read in place)
    keys = blocks[1]
    return ctx.prompt_width // engine.page_size * engine.page_size // keys * keys


def _invariant_paged_blocks(cfg: ModelConfig, page_size: int) -> tuple[int, int] | None:
    """(query rows, keys) per program of the mode's paged decode kernel where it reads the pool in place on the
    target platform (models/invariant_paged_attention.py), else None (the gathered form)."""
    from jaxrl_llm.models.invariant_paged_attention import paged_blocks, paged_supported

    variant = {"tpu": "mosaic", "gpu": "triton", "cuda": "triton"}.get(target_platform())
    width = cfg.cache_head_dim  # MLA: the absorbed latent + rope key
    if variant is None or not paged_supported(variant, width, width, page_size):
        return None
    return paged_blocks(variant, width)


def _padded_rows(cfg: ModelConfig, page_size: int, members: int = 1) -> float:
    """Query rows the mode's paged kernel computes per real query row: `members` slots' g query heads of a kv
    head fill whole tiles of its query rows (a slot's own keys: one member; a cascade group's shared keys: its
    members stacked), the padding computed as the real rows are. 1 off the mode or in the gathered form."""
    blocks = _invariant_paged_blocks(cfg, page_size) if cfg.batch_invariant else None
    if blocks is None:
        return 1.0
    rows = members * cfg.num_attention_heads // cfg.cache_kv_heads
    return -(-rows // blocks[0]) * blocks[0] / rows


def _weight_split(params: Params) -> float:
    """How many ways abstract `params` (with shardings) are split on average: their bytes over a device's."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return total / max(bytes_per_device(params), 1)


def _rollout_cost(ctx: Context, engine: Any, plan: BatchPlan, step: Cost, *, rows: int, n: int, r: int,
                  shared_tokens: int, weight_bytes: int, weight_split: float) -> Cost:
    """The paged engine's rollout of `rows` sequences of r new tokens (worst case: every one r long), per
    device, from one decode `step`'s compiled count (all layers): the steps its slots need (as many
    sequences at once as the slots and the pool's pages hold, a prompt's pages shared by its n samples),
    plus what the compiled step cannot count: the attention kernel's K/V reads and products (a custom call),
    every step's keys from the prompt (`shared_tokens` of them read once per group: cascade attention) and the
    response so far; and the prefill of each prompt (one call per prompt, not planned: its weights read once and
    2N FLOPs per token, split as the decode weights are: `weight_split`, their bytes over a device's; one prompt's
    rows cannot split over the batch axes, its weights' columns can: engine/decode_layout.py). The pool is split
    over the kv heads on 'tensor' and, with slot shards (engine/slot_shards.py), its slots over the batch axes: a
    device reads its kv heads of its shard's slots. `step` comes without the bytes the compiled count charges in
    proportion to the pool (`Planner.costed`)."""
    cfg, mesh = ctx.actor.cfg, ctx.mesh
    prompt, ps = ctx.prompt_width, engine.page_size
    prompt_pages = prompt // ps
    group_pages = prompt_pages + n * (-(-(prompt + r) // ps) - prompt_pages)
    # each slot shard's pool holds its own groups (engine/slot_shards.py)
    held = engine.slot_shards * (n * (engine.shard_pages - 1) // group_pages)
    concurrent = max(1, min(engine.max_num_seqs, held))
    steps = -(-rows // concurrent) * r
    tensor = dict(mesh.shape).get("tensor", 1)
    # a device holds its kv heads (over 'tensor' where they divide it) of its slot shard's pages
    pool_split = (tensor if cfg.cache_kv_heads % tensor == 0 else 1) * engine.slot_shards
    key_bytes = engine.page_bytes(cfg, ctx.spec.actor.compute_dtype) / ps / pool_split  # K and V, all layers
    own_keys, shared_keys = rows * r * (prompt - shared_tokens + (r + 1) / 2), rows * r * shared_tokens
    keys_read = own_keys + shared_keys / n  # a group reads its shared keys once
    # every (query, key) pair is computed, shared or not, and the mode's kernel computes whole tiles of query
    # rows: a slot's g heads (a group's n x g stacked on its shared keys)
    computed = own_keys * _padded_rows(cfg, ps) + shared_keys * _padded_rows(cfg, ps, n)
    attention_flops = 4.0 * cfg.num_hidden_layers * cfg.decode_attention_width * computed / pool_split
    prompts = -(-rows // n)
    prefill_flops = prompts * prompt * per_token_forward_flops(
        active_params(cfg, ctx.actor.num_params), cfg.num_hidden_layers, cfg.attention_width,
        (prompt + 1) / 2) / weight_split
    return step * steps + Cost(flops=attention_flops + prefill_flops,
                               hbm_bytes=keys_read * key_bytes + prompts * weight_bytes)

"""The programs of one RL step, lowered ahead of time on abstract inputs for the memory plan
(planning/memory.py): no weight is loaded, every array is a `jax.ShapeDtypeStruct` carrying
the sharding the run gives it.

Each builder lowers the same jitted function the run calls (`sampler.core.sample_program`,
`experience.log_probs_no_grad` / `values_no_grad`, `roles.jit_update`) with the step's
worst-case shapes: every prompt bucketed to `data.max_prompt_length`, every response
`rollout.response_length` long. `PROGRAM_BUILDERS` is the list the planner walks.

Packed runs (`model.use_remove_padding`) are planned in the padded layout: at the worst case every
sequence is full length, and a packed micro-batch then holds the same tokens in as many rows, so the
padded program bounds the packed one. LoRA (`model.lora_rank`): the update's arguments are the
adapters, their optimizer state and the frozen base; the reference pass reads the base itself.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxrl_llm.arrays import ArrayTree, DType, Params, ShardingTree
from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.bookkeeping.metrics import per_token_forward_flops, rollout_context
from jaxrl_llm.config.checks import reads_images
from jaxrl_llm.config.spec import ActorSpec, CriticSpec, ModelSpec, OptimSpec, RunSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.models import ModelConfig, init_cache
from jaxrl_llm.models.dtypes import is_uncast_matmul_weight, uncast_matmul_weights
from jaxrl_llm.models.lora import with_lora
from jaxrl_llm.models.moe import active_params, uncounted_expert_flops
from jaxrl_llm.models.vision.qwen_vl import RowImages
from jaxrl_llm.planning.roofline import Cost
from jaxrl_llm.platform.target import target_platform
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.experience import Experience, log_probs_no_grad, teacher_no_grad, values_no_grad
from jaxrl_llm.roles.forward import compute_dtype_of
from jaxrl_llm.roles.optim import make_optimizer
from jaxrl_llm.roles.reference import offload_supported
from jaxrl_llm.roles.trained import adapter_init, adapter_shardings, jit_update, model_config_of, param_shardings_of
from jaxrl_llm.roles.vision import vision_step_state
from jaxrl_llm.sampler import bucket_length, eos_ids_of
from jaxrl_llm.sampler import core as sampler_core
from jaxrl_llm.sampler.cascade_attention import Cascade
from jaxrl_llm.sampler.engine import programs as engine_programs
from jaxrl_llm.sampler.engine.setup import engine_spec
from jaxrl_llm.sharding import batch_axis_size, batch_sharding, optimizer_state_sharding

ARR = "actor_rollout_ref"
MESH_KEYS = "mesh.fsdp / mesh.tensor (shard the params and batch over more devices)"


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the step, ready to lower for a given `BatchPlan`."""

    name: str
    # (plan, unroll=1, platforms=None) -> jax.stages.Lowered; unroll: layers per layer-scan trip;
    # platforms: lower for those instead of the mesh's devices (("cuda",) from a CPU host)
    lower: Callable[..., Any]
    state_args: tuple[str, ...]  # the persistent states (see `State`) among its arguments
    keys: Callable[[BatchPlan], tuple[str, ...]]  # config keys that shrink it, with their values
    micro_pass: str | None = None  # the BatchPlan pass whose micro-batch it runs (for 'auto')
    trips: Callable[[BatchPlan], int] = lambda plan: 1  # loop trips XLA's cost analysis counts once
    extra_flops: Callable[[BatchPlan], float] = lambda plan: 0.0  # FLOPs outside any counted loop body
    # (per device, added as they are: the decode steps past the first, a MoE model's routed experts
    # inside the blocked kernel's loop, models/moe.py `uncounted_expert_flops`)
    kv_bytes: int = 0  # per device: the sampler's KV cache
    # per device: arrays its caller holds while it runs beside its arguments and the step's states (the paged
    # engine's fp32 masters under their compute-dtype decode copy, the per-layer copy of rollout.unroll_layers)
    held_bytes: int = 0
    # per device: the weight copies the paged engine makes for a rollout (resident beside the other programs
    # while a pipelined rollout runs, as its KV pool is)
    copy_bytes: int = 0
    layers: int = 1  # trips of its model's layer scan (counted once, like any loop body)
    # (plan, body) -> the program's whole cost per device, from `body`: the compiled count of one trip of its
    # loops with every layer (planning/roofline.py); None: body x trips + extra_flops
    total_cost: Callable[[BatchPlan, Cost], Cost] | None = None
    # (plan) -> model FLOPs per device of what it computes (no recompute): an update's MFU numerator
    model_flops: Callable[[BatchPlan], float] | None = None
    # pages of the KV pool among its arguments (the paged sampler; `lower(..., pool_pages=p)` lowers it on p)
    pool_pages: int = 0


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the run places it, without weights: config, abstract params (with shardings)."""

    cfg: ModelConfig
    params: Params  # ShapeDtypeStruct pytree with shardings
    shardings: ShardingTree

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))


@dataclasses.dataclass
class Context:
    """What every builder reads: the spec, mesh, abstract models and optimizer states."""

    spec: RunSpec
    mesh: Mesh
    tokenizer: Tokenizer
    actor: Model
    critic: Model | None
    states: dict[str, Any]  # name -> abstract pytree: actor_params, actor_opt, ref_params, critic_*, teacher_params
    txs: dict[str, Any]  # role -> optax transformation
    teacher: Model | None = None  # on-policy distillation's teacher

    @property
    def prompt_width(self) -> int:
        return bucket_length(self.spec.plan.max_prompt_length)

    @property
    def seq_len(self) -> int:
        return self.prompt_width + self.spec.plan.response_length

    @property
    def policy_states(self) -> tuple[str, ...]:
        """The states a policy forward reads: its params, or with LoRA the frozen base + adapters."""
        return ("actor_base_params", "actor_params") if self.spec.model.lora else ("actor_params",)

    def policy_params(self) -> Params:
        """The params the sampler / old-log-prob pass read (the base with the adapters under LoRA)."""
        lora = self.spec.model.lora
        if lora is None:
            return self.states["actor_params"]
        return with_lora(self.states["actor_base_params"], self.states["actor_params"]["lora"], lora.scale)

    def rows(self, n: int, width: int, dtype: DType) -> Any:  # a ShapeDtypeStruct where programs take an Array
        return jax.ShapeDtypeStruct((n, width), dtype, sharding=batch_sharding(self.mesh, 2))

    def row_values(self, n: int, dtype: DType) -> Any:  # [n]: one value per row
        return jax.ShapeDtypeStruct((n,), dtype, sharding=batch_sharding(self.mesh, 1))


def bytes_per_device(tree: ArrayTree) -> int:
    """Bytes one device holds of a pytree of sharded (abstract) arrays."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total


def matmul_params(cfg: ModelConfig, num_params: int) -> int:
    """Of a model's `num_params`, those a token multiplies by: the active ones (a MoE model's top-k
    experts) less an untied input embedding, which is looked up, not multiplied."""
    lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return active_params(cfg, num_params) - lookup


def head_cost(cfg: ModelConfig, tokens: float, passes: int, dtype: str) -> Cost:
    """The fused log-prob head over `tokens` rows, `passes` vocab-sized matmuls each (1 forward; an update's
    backward adds the recomputed logits and the two gradients: 4): its vocabulary chunks run in a loop the
    compiled count holds once, and its TPU / GPU kernel is a custom call XLA does not count. Bytes: the
    unembedding read once per pass and 2048-row block (losses/logprob.py)."""
    unembedding = cfg.vocab_size * cfg.hidden_size
    blocks = max(1.0, tokens / 2048)
    return Cost(flops=2.0 * passes * tokens * unembedding,
                hbm_bytes=passes * blocks * unembedding * jnp.dtype(compute_dtype_of(dtype)).itemsize)


def invariant_attention_cost(cfg: ModelConfig, sequences: float, t: int, passes: int, dtype: str) -> Cost:
    """The batch-invariant attention kernel's work in `passes` causal forwards of `sequences` rows of t tokens
    (models/invariant_attention.py; zero without `model.batch_invariant`): a custom call the compiled count
    does not see. Per tile of query rows it reads the keys and values of the blocks it visits (about half the
    row under a causal mask) and its rows of the int8 token mask; q.k and p.v (two products: p's high and low
    halves) over the same keys."""
    if not cfg.batch_invariant:
        return Cost()
    from jaxrl_llm.models.invariant_attention import TPU_BLOCKS, gpu_blocks

    rows, keys = TPU_BLOCKS if target_platform() == "tpu" else gpu_blocks(cfg.head_dim)[:2]
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    visited = t / 2 + keys / 2  # keys a query tile walks, on average, under a causal mask
    tiles = group * -(-t // rows)  # query tiles per (row, kv head): each group's tokens in whole tiles
    kv_bytes = tiles * visited * 2 * cfg.head_dim * jnp.dtype(compute_dtype_of(dtype)).itemsize
    mask_bytes = group * t * visited
    layers = cfg.num_hidden_layers * cfg.attention_width / (cfg.num_attention_heads * cfg.head_dim)  # attending ones
    per_row = layers * (cfg.num_key_value_heads * kv_bytes + mask_bytes)
    flops = 6.0 * layers * cfg.num_attention_heads * cfg.head_dim * t * visited
    return Cost(flops=passes * sequences * flops, hbm_bytes=passes * sequences * per_row)


def _lower(jitted: Any, platforms: tuple[str, ...] | None, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """`jitted.lower(*args, **kwargs)`, for `platforms` when given (the kernels of those platforms are
    then lowered: Pallas -> Triton for "cuda" runs on any host)."""
    if platforms is None:
        return jitted.lower(*args, **kwargs)
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=tuple(platforms))


def _unrolled(cfg: ModelConfig, unroll: int) -> ModelConfig:
    return cfg if unroll == cfg.scan_unroll else dataclasses.replace(cfg, scan_unroll=unroll)


def _abstract(tree: ArrayTree, shardings: ShardingTree, dtype: DType | None = None) -> ArrayTree:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s), tree, shardings)


def _model(model: ModelSpec, head: str, mesh: Mesh, tokenizer: Tokenizer) -> Model:
    cfg = model_config_of(model, tokenizer)
    abstract, shardings = param_shardings_of(cfg, head, mesh, compute_dtype_of(model.param_dtype))
    return Model(cfg, _abstract(abstract, shardings), shardings)


def _tx(optim: OptimSpec) -> optax.GradientTransformation:
    # the transformation's state does not depend on the schedule, unknown before the dataset is read
    if optim.total_steps is None:
        optim = dataclasses.replace(optim, total_steps=1, warmup_steps=0)
    return make_optimizer(optim)[0]


def _opt_state(tx: optax.GradientTransformation, model: Model) -> ArrayTree:
    abstract = jax.eval_shape(tx.init, model.params)
    return _abstract(abstract, optimizer_state_sharding(abstract, model.shardings))


def make_context(spec: RunSpec, mesh: Mesh, tokenizer: Tokenizer) -> Context:
    """Model configs from config.json / GGUF header / tiny dims; params via `jax.eval_shape`."""
    actor = _model(spec.model, "lm", mesh, tokenizer)
    txs = {"actor": _tx(spec.actor_optim)}
    vision: dict[str, Any] = {}  # a vision-language policy: its tower and the step's image rows
    if reads_images(spec.model.path):
        bp, trained = spec.plan, not spec.actor.freeze_vision_tower
        vision = vision_step_state(spec.model.path, actor.cfg, mesh, rows=bp.sequences,
                                   prompt_length=bp.max_prompt_length, response_length=bp.response_length,
                                   compute_dtype=spec.actor.compute_dtype, trained=trained)
        if trained:  # the actor's params["vision"] (optimizer moments, the reference's copy with the rest)
            tower = vision.pop("vision_tower")
            actor = Model(actor.cfg, {**actor.params, "vision": tower},
                          {**actor.shardings, "vision": jax.tree.map(lambda x: x.sharding, tower)})
    if spec.model.lora is not None:  # trained: the adapters only; the base is frozen and is the reference
        lora = spec.model.lora
        # LoRA on a trained tower too: its adapters beside the text model's (roles/trained.py `adapter_init`)
        init = adapter_init(actor.cfg, lora, actor.params.get("vision"))
        abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
        shardings = adapter_shardings(actor.cfg, lora, abstract, mesh)
        adapters = Model(actor.cfg, {"lora": _abstract(abstract, shardings)}, {"lora": shardings})
        states = {"actor_base_params": actor.params, "actor_params": adapters.params,
                  "actor_opt": _opt_state(txs["actor"], adapters)}
    else:
        states = {"actor_params": actor.params, "actor_opt": _opt_state(txs["actor"], actor)}
    if spec.sync.weight_copies:  # the off-policy pipeline's rollout weights (rollout/pipeline.py)
        states["rollout_params"] = [states["actor_params"]] * spec.sync.weight_copies
    if spec.need_ref and spec.model.lora is None:
        states["ref_params"] = _abstract(actor.params, actor.shardings, compute_dtype_of(spec.ref.param_dtype))
    teacher = None
    if spec.distillation is not None:  # the teacher's params, stored in its own dtype (roles/teacher.py)
        teacher = _model(spec.distillation.teacher, "lm", mesh, tokenizer)
        states["teacher_params"] = teacher.params
    states.update(vision)
    critic = None
    if spec.critic is not None:
        if spec.critic_model is None or spec.critic_optim is None:
            raise ValueError("a run with a critic needs its model and optimizer specs (config.resolve sets them)")
        critic = _model(spec.critic_model, "value", mesh, tokenizer)
        txs["critic"] = _tx(spec.critic_optim)
        states["critic_params"], states["critic_opt"] = critic.params, _opt_state(txs["critic"], critic)
    return Context(spec, mesh, tokenizer, actor, critic, states, txs, teacher)


def device_state_bytes(ctx: Context) -> dict[str, int]:
    """Per-device bytes of each persistent state between programs (an offloaded reference: 0)."""
    out = {name: bytes_per_device(tree) for name, tree in ctx.states.items()}
    if "ref_params" in out and ctx.spec.ref.param_offload and offload_supported():
        out["ref_params"] = 0
    for role, optim in (("actor", ctx.spec.actor_optim), ("critic", ctx.spec.critic_optim)):
        if f"{role}_opt" in out and optim is not None and optim.offload and offload_supported():
            out[f"{role}_opt"] = 0  # on the host but for its update, where it is an argument
    distill = ctx.spec.distillation
    if "teacher_params" in out and distill is not None and distill.param_offload and offload_supported():
        out["teacher_params"] = 0
    return out


# ---------------------------------------------------------------------------------------------- builders
def sample_program(ctx: Context) -> Program:
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
    prefill_experts = uncounted_expert_flops(cfg, rows * width, _layout_tokens(ctx, rows, width)) / mesh.size

    def lower(plan: BatchPlan, unroll: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        ids = ctx.rows(prompts, width, jnp.int32)
        return _lower(sampler_core.sample_program, platforms, ctx.policy_params(), _unrolled(cfg, unroll), ids, ids,
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
                   layers=cfg.num_hidden_layers)


class DecodeWeights(NamedTuple):
    """What the paged engine decodes from, for abstract params (per-device bytes)."""

    params: Params  # the abstract params `generate` reads (the matmul weights in the compute dtype)
    held: int  # held besides them while it runs: the masters they were cast from, the per-layer copy
    copies: int  # the copies the rollout makes: the cast weights and the per-layer copy


def decode_weights(params: Params, cfg: ModelConfig, compute_dtype: str, unroll_layers: bool) -> DecodeWeights:
    """The paged engine's decode weights for abstract `params` (with shardings). The engine
    (sampler/engine/scheduler.py) reads a copy of the matmul weights in the compute dtype, made once
    per rollout, while the masters stay alive; with `rollout.unroll_layers` the steps read per-layer
    copies of that copy's layers, while prefill keeps the stacked ones. Unrolled layers are planned
    as the stack (the same bytes per device)."""
    target = jnp.dtype(compute_dtype_of(compute_dtype))
    in_target = lambda x: jax.ShapeDtypeStruct(x.shape, target, sharding=x.sharding)  # noqa: E731
    cast = uncast_matmul_weights(params, target)
    step = jax.tree_util.tree_map_with_path(
        lambda path, x: in_target(x) if is_uncast_matmul_weight(path, x, target) else x, params)
    per_layer = bytes_per_device(step["layers"]) if unroll_layers and not cfg.mixed_layers else 0
    return DecodeWeights(step, bytes_per_device(cast) + per_layer,
                         bytes_per_device([in_target(x) for x in cast]) + per_layer)


def _paged_sample_program(ctx: Context, settings: Any, knobs: Any, rows: int, decode: Callable) -> Program:
    """The paged engine's `generate` (jaxrl_llm/sampler/engine): its decode state holds the KV pool,
    sized as the run sizes it (`engine_spec`), so the pool is among the program's arguments, as are
    the decode weights (`decode_weights`). The per-prompt prefill (chunked: one chunk's scores at
    a time) is far smaller and not planned."""
    spec, cfg, mesh = ctx.spec, ctx.actor.cfg, ctx.mesh
    opts, dtype = spec.rollout_engine, spec.actor.compute_dtype
    unroll = opts.unroll_for(settings.max_new_tokens)  # for the plan's target ('auto': on CPU at long responses)
    weights = [decode_weights(ctx.policy_params(), cfg, dtype, unroll)]
    engine = engine_spec(cfg, opts, num_requests=rows, max_prompt_len=spec.plan.max_prompt_length,
                         samples_per_prompt=settings.n,
                         max_new_tokens=settings.max_new_tokens, compute_dtype=dtype, mesh=mesh)
    make = functools.partial(engine_programs.init_state, cfg, engine, settings.max_new_tokens, dtype)
    abstract = jax.eval_shape(make)
    shardings = engine_programs.state_sharding(abstract, cfg, mesh)
    state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, shardings)

    draft = None  # a draft model's params (speculative method 'draft'), placed as the policy's shapes are
    if engine.speculative is not None and engine.speculative.draft_cfg is not None:
        draft_cfg = engine.speculative.draft_cfg
        abstract_draft, draft_shardings = param_shardings_of(draft_cfg, "lm", mesh, compute_dtype_of(
            spec.model.param_dtype))
        weights.append(decode_weights(_abstract(abstract_draft, draft_shardings), draft_cfg, dtype, unroll))
        draft = weights[-1].params

    groups = engine_programs.cascade_shape(engine, engine.max_num_seqs, settings.n)
    cascade = None if groups is None else Cascade(jax.ShapeDtypeStruct(groups, jnp.int32),
                                                  jax.ShapeDtypeStruct(groups[:1], jnp.int32))

    def lower(plan: BatchPlan, unroll: int = 1, platforms: tuple[str, ...] | None = None,
              pool_pages: int = 0) -> jax.stages.Lowered:
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        pages = lambda x: jax.ShapeDtypeStruct((*x.shape[:2], pool_pages, *x.shape[3:]), x.dtype,  # noqa: E731
                                               sharding=x.sharding)
        pooled = state if not pool_pages else state._replace(pool=jax.tree.map(pages, state.pool))
        return _lower(engine_programs.generate, platforms, weights[0].params, _unrolled(cfg, unroll), pooled,
                      jax.random.PRNGKey(0), knobs, scalar, jax.ShapeDtypeStruct((), jnp.bool_), scalar, cascade,
                      draft, settings=settings, attn_impl=engine.attn_impl, mesh=mesh, speculative=engine.speculative)

    total_cost = functools.partial(_rollout_cost, ctx, engine, rows=rows, n=settings.n, r=settings.max_new_tokens,
                                   shared_tokens=_cascade_shared_tokens(ctx, engine, groups is not None),
                                   weight_bytes=bytes_per_device(weights[0].params))
    keys = (f"{ARR}.rollout.max_num_seqs={opts.max_num_seqs} (decode slots: {engine.max_num_seqs} here)",
            f"{ARR}.rollout.gpu_memory_utilization={opts.gpu_memory_utilization} (caps the KV pool)",
            f"{ARR}.rollout.kv_cache_dtype={opts.kv_cache_dtype}",
            f"data.max_prompt_length={spec.plan.max_prompt_length} + data.max_response_length="
            f"{settings.max_new_tokens} (pages per slot)", f"{ARR}.model.lora_rank", MESH_KEYS)
    if unroll:
        keys += (f"{ARR}.rollout.unroll_layers=False (no per-layer weight copy)",)
    return Program("sample", lower, (*ctx.policy_states, "kv_pool", "decode_weights"), lambda plan: keys,
                   extra_flops=decode, kv_bytes=bytes_per_device(state.pool), held_bytes=sum(w.held for w in weights),
                   copy_bytes=sum(w.copies for w in weights), layers=cfg.num_hidden_layers, total_cost=total_cost,
                   pool_pages=engine.num_pages)


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
    from jaxrl_llm.models.invariant_paged_attention import paged_blocks, paged_supported

    variant = {"tpu": "mosaic", "gpu": "triton", "cuda": "triton"}.get(target_platform())
    if variant is None or not paged_supported(variant, cfg.head_dim, cfg.head_dim, engine.page_size):
        return 0  # the gathered form (CPU's blocked XLA; a head width the kernel does not read in place)
    keys = paged_blocks(variant, cfg.head_dim)[1]
    return ctx.prompt_width // engine.page_size * engine.page_size // keys * keys


def _rollout_cost(ctx: Context, engine: Any, plan: BatchPlan, step: Cost, *, rows: int, n: int, r: int,
                  shared_tokens: int, weight_bytes: int) -> Cost:
    """The paged engine's rollout of `rows` sequences of r new tokens (worst case: every one r long), per
    device, from one decode `step`'s compiled count (all layers): the steps its slots need (as many
    sequences at once as the slots and the pool's pages hold, a prompt's pages shared by its n samples),
    plus what the compiled step cannot count: the attention kernel's K/V reads and products (a custom call),
    every step's keys from the prompt (`shared_tokens` of them read once per group: cascade attention) and the
    response so far; and the prefill of each prompt (one call per prompt, not planned: its weights read once and
    2N FLOPs per token, split over the devices as decode's matmuls are). The pool is split over the kv
    heads on 'tensor' only, so every device reads its kv heads of every slot. `step` comes without the
    bytes the compiled count charges in proportion to the pool (`Planner.costed`)."""
    cfg, mesh = ctx.actor.cfg, ctx.mesh
    prompt, ps = ctx.prompt_width, engine.page_size
    prompt_pages = prompt // ps
    group_pages = prompt_pages + n * (-(-(prompt + r) // ps) - prompt_pages)
    concurrent = max(1, min(engine.max_num_seqs, n * (engine.num_pages - 1) // group_pages))
    steps = -(-rows // concurrent) * r
    tensor = dict(mesh.shape).get("tensor", 1)
    kv_shards = tensor if cfg.cache_kv_heads % tensor == 0 else 1
    key_bytes = engine.page_bytes(cfg, ctx.spec.actor.compute_dtype) / ps / kv_shards  # K and V, all layers
    keys_read = rows * r * (prompt - shared_tokens + shared_tokens / n + (r + 1) / 2)
    attention_flops = 4.0 * cfg.num_hidden_layers * cfg.attention_width * keys_read / kv_shards
    prompts = -(-rows // n)
    prefill_flops = prompts * prompt * per_token_forward_flops(
        active_params(cfg, ctx.actor.num_params), cfg.num_hidden_layers, cfg.attention_width,
        (prompt + 1) / 2) / mesh.size
    return step * steps + Cost(flops=attention_flops + prefill_flops,
                               hbm_bytes=keys_read * key_bytes + prompts * weight_bytes)


def _forward_program(ctx: Context, name: str, micro_pass: str, state: str, model: Model, fn: Callable, *,
                     seq_len: int | None = None, extra_keys: tuple[str, ...] = (), **settings: Any) -> Program:
    """A no-grad pass `fn` of `model` (experience.py `log_probs_no_grad`, `values_no_grad` or
    `teacher_no_grad`, with `settings`) over rows of `seq_len` tokens (default: the policy's), in the
    micro-batches of `micro_pass`; `extra_keys`: config keys beside the micro-batch that shrink it."""
    spec = ctx.spec
    n, t, r = spec.plan.sequences, seq_len or ctx.seq_len, spec.plan.response_length

    def micro_rows(plan: BatchPlan) -> int:
        return plan.forward_micro_rows(plan.micro_of(micro_pass), n, t)

    def lower(plan: BatchPlan, unroll: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        ids, mask = ctx.rows(n, t, jnp.int32), ctx.rows(n, r, jnp.float32)
        params = ctx.policy_params() if state == "actor_params" else ctx.states[state]
        return _lower(fn, platforms, params, ids, ids, mask, model_cfg=_unrolled(model.cfg, unroll),
                      micro_rows=micro_rows(plan), **settings)

    def keys(plan: BatchPlan) -> tuple[str, ...]:
        micro = plan.micro_of(micro_pass)
        return (f"{micro.key}={micro.describe()}", *extra_keys, MESH_KEYS)

    states = ctx.policy_states if state == "actor_params" else (state,)
    def experts(plan: BatchPlan) -> float:  # every row through the experts once
        return uncounted_expert_flops(model.cfg, n * t, _layout_tokens(ctx, micro_rows(plan), t)) / ctx.mesh.size
    trips = lambda plan: n // micro_rows(plan)  # noqa: E731
    head = Cost() if fn is values_no_grad else head_cost(model.cfg, n * t / ctx.mesh.size, 1,
                                                          settings.get("compute_dtype", "float32"))
    head += invariant_attention_cost(model.cfg, n / ctx.mesh.size, t, 1, settings.get("compute_dtype", "float32"))

    def total_cost(plan: BatchPlan, body: Cost) -> Cost:
        return body * trips(plan) + Cost(flops=experts(plan)) + head

    return Program(name, lower, states, keys, micro_pass=micro_pass, trips=trips,
                   extra_flops=experts, layers=model.cfg.num_hidden_layers, total_cost=total_cost)


def _log_prob_settings(ctx: Context, compute_dtype: str) -> dict[str, Any]:
    """The settings of a log-prob pass (`log_probs_no_grad`, `teacher_no_grad`) as a step runs it."""
    return dict(temperature=ctx.spec.actor.temperature, compute_dtype=compute_dtype,
                logprob_impl=ctx.spec.actor.logprob_impl, mesh=ctx.mesh)


def _row_images(ctx: Context) -> RowImages | None:
    """A vision-language policy's step rows' images as its passes take them (`RowImages`, abstract, the rows of the
    compiled [N, prompt width + R] batch; the features' room as the resident `image_rows`), else None: the policy's
    passes are then compiled with their feature gathers (and Qwen3-VL's deepstack adds)."""
    held = ctx.states.get("image_rows")
    if held is None:
        return None
    n, t = ctx.spec.plan.sequences, ctx.seq_len
    def rows(shape: tuple[int, ...], dtype: Any) -> Any:  # a ShapeDtypeStruct where the passes take an Array
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(ctx.mesh, len(shape)))

    deepstack, tower = held.get("deepstack"), held.get("tower")
    return RowImages(positions=rows((n, 3, t), jnp.int32), slots=rows((n, t), jnp.int32),
                     features=rows((n, *held["features"].shape[1:]), held["features"].dtype),
                     deepstack=None if deepstack is None else rows((n, *deepstack.shape[1:]), deepstack.dtype),
                     tower=None if tower is None else jax.tree.map(lambda x: rows(x.shape, x.dtype), tower),
                     vision=held.get("vision"))


def ref_program(ctx: Context) -> Program | None:
    spec = ctx.spec
    if not spec.need_ref:
        return None
    # with LoRA the reference is the frozen base itself (no copy)
    state = "actor_base_params" if spec.model.lora else "ref_params"
    return _forward_program(ctx, "ref_log_prob", "ref_log_prob", state, ctx.actor, log_probs_no_grad,
                            extra_keys=(f"{ARR}.ref.param_dtype={spec.ref.param_dtype}", f"{ARR}.ref.param_offload"),
                            images=_row_images(ctx), **_log_prob_settings(ctx, spec.actor.compute_dtype))


def teacher_program(ctx: Context) -> Program | None:
    """The teacher's pass (`teacher_no_grad`) in the reference pass's micro-batches, over rows whose
    prompt also holds the teacher's own context (its system prompt / few-shot turns, measured)."""
    distill, teacher = ctx.spec.distillation, ctx.teacher
    if distill is None or teacher is None:
        return None
    plan, dtype = ctx.spec.plan, distill.teacher.param_dtype
    prompt = bucket_length(plan.max_prompt_length + teacher_context_tokens(distill, ctx.tokenizer))
    seq_len = prompt + plan.response_length
    return _forward_program(ctx, "teacher", "ref_log_prob", "teacher_params", teacher, teacher_no_grad,
                            seq_len=seq_len, topk=distill.topk if distill.signal == "topk_forward_kl" else 0,
                            extra_keys=(f"algorithm.distillation.teacher.dtype={dtype}",
                                        "algorithm.distillation.teacher.param_offload"),
                            **_log_prob_settings(ctx, dtype))


def teacher_context_tokens(distill: Any, tokenizer: Tokenizer) -> int:
    """Tokens the teacher's own prompt adds to a row's (0 without context distillation)."""
    if not distill.own_prompt:
        return 0
    from jaxrl_llm.data.prompts import encode_prompts
    from jaxrl_llm.roles.teacher import teacher_messages

    chat = [{"role": "user", "content": "x"}]
    own, plain = encode_prompts([teacher_messages(chat, distill), chat], tokenizer, apply_chat_template=True)
    return max(len(own) - len(plain), 0)


def old_log_prob_program(ctx: Context) -> Program | None:
    if not ctx.spec.recompute_old_log_probs:
        return None
    return _forward_program(ctx, "old_log_prob", "old_log_prob", "actor_params", ctx.actor, log_probs_no_grad,
                            images=_row_images(ctx), **_log_prob_settings(ctx, ctx.spec.actor.compute_dtype))


def values_program(ctx: Context) -> Program | None:
    if ctx.critic is None or ctx.spec.critic is None:
        return None
    return _forward_program(ctx, "values", "values", "critic_params", ctx.critic, values_no_grad,
                            images=_row_images(ctx), compute_dtype=ctx.spec.critic.compute_dtype)


def _experience(ctx: Context) -> Experience:
    spec = ctx.spec
    n, t, r = spec.plan.sequences, ctx.seq_len, spec.plan.response_length
    f32 = lambda: ctx.rows(n, r, jnp.float32)  # noqa: E731
    weighed = spec.rollout_correction.rollout_is is not None and not spec.actor.rollout_is_in_loss
    return Experience(input_ids=ctx.rows(n, t, jnp.int32), attention_mask=ctx.rows(n, t, jnp.int32),
                      response_mask=f32(), old_log_probs=f32(), advantages=f32(), returns=f32(),
                      ref_log_probs=f32() if spec.need_ref else None,
                      values=f32() if spec.critic is not None else None,
                      rollout_is_weights=f32() if weighed else None,
                      sequence_scores=ctx.row_values(n, jnp.float32) if POLICY_LOSSES.capability(
                          spec.actor.loss_mode, "needs_scores") else None,
                      images=_row_images(ctx), **_teacher_topk(ctx))


def _teacher_topk(ctx: Context) -> dict[str, Any]:
    """The teacher's top-k [N, R, k] the actor update reads (signal topk_forward_kl), else nothing."""
    distill = ctx.spec.distillation
    if distill is None or distill.signal != "topk_forward_kl":
        return {}
    shape = (ctx.spec.plan.sequences, ctx.spec.plan.response_length, distill.topk)
    row = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(ctx.mesh, 3))  # noqa: E731
    return {"teacher_topk_ids": row(jnp.int32), "teacher_topk_log_probs": row(jnp.float32)}


def _update_program(ctx: Context, role: str, model: Model, s: ActorSpec | CriticSpec) -> Program:
    """The update of `model` (role "actor" or "critic") with its loss settings `s`."""
    spec = ctx.spec
    lora = spec.model.lora if role == "actor" else None

    def update_fn(unroll: int) -> Callable:
        cfg = _unrolled(model.cfg, unroll)
        if isinstance(s, CriticSpec):
            return functools.partial(update_critic, model_cfg=cfg, s=s)
        return functools.partial(update_actor, model_cfg=cfg, s=s, lora_scale=lora.scale if lora else 0.0,
                                 lora_dropout=lora.dropout if lora else 0.0)
    frozen = (ctx.states["actor_base_params"],) if lora else ()  # LoRA: the base, passed undifferentiated
    n, t = spec.plan.sequences, ctx.seq_len
    params, opt = ctx.states[f"{role}_params"], ctx.states[f"{role}_opt"]

    def split(plan: BatchPlan) -> tuple[int, int]:
        return plan.update_split(getattr(plan, role), n, t)

    def lower(plan: BatchPlan, unroll: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        num_mini, num_micro = split(plan)
        fn = jit_update(update_fn(unroll), ctx.txs[role], jax.tree.map(lambda x: x.sharding, params),
                        jax.tree.map(lambda x: x.sharding, opt),
                        num_mini_batches=num_mini, num_micro_batches=num_micro,
                        rows_sharding=batch_sharding(ctx.mesh, 1))
        return _lower(fn, platforms, params, opt, _experience(ctx), jax.random.PRNGKey(0),
                      jax.ShapeDtypeStruct((), jnp.float32), None, *frozen)

    def keys(plan: BatchPlan) -> tuple[str, ...]:
        section = f"{ARR}.actor" if role == "actor" else "critic"
        rb = getattr(plan, role)
        return (f"{rb.micro.key}={rb.micro.describe()}", f"{section}.remat_policy={s.remat}",
                f"{ARR}.model.lora_rank", f"{section}.ppo_mini_batch_size={rb.mini_batch_prompts}", MESH_KEYS)

    def trips(plan: BatchPlan) -> int:
        num_mini, num_micro = split(plan)
        return s.ppo_epochs * num_mini * num_micro

    states = (f"{role}_params", f"{role}_opt") + (("actor_base_params",) if lora else ())
    # each epoch: forward + backward (2x) through the experts, and the forward again under remat
    passes = s.ppo_epochs * (3 + (s.remat != "none"))

    def experts(plan: BatchPlan) -> float:
        micro = n // math.prod(split(plan))
        return uncounted_expert_flops(model.cfg, passes * n * t, _layout_tokens(ctx, micro, t)) / ctx.mesh.size

    # one optimizer step (per mini-batch and epoch, not per micro-batch, though the compiled body holds it):
    # reads params, grads and moments, writes params and moments
    param_bytes, opt_bytes = bytes_per_device(params), bytes_per_device(opt)
    optimizer_step = Cost(flops=12.0 * param_bytes / 4, hbm_bytes=3.0 * param_bytes + 2.0 * opt_bytes)

    cfg = model.cfg
    head = Cost() if role == "critic" else head_cost(cfg, n * t / ctx.mesh.size, 4 * s.ppo_epochs, s.compute_dtype)
    # the attention kernel runs in the forward (and its recompute under remat); the backward is XLA's, counted
    head += invariant_attention_cost(cfg, n / ctx.mesh.size, t, s.ppo_epochs * (1 + (s.remat != "none")),
                                     s.compute_dtype)

    def total_cost(plan: BatchPlan, body: Cost) -> Cost:
        num_mini, _ = split(plan)
        steps = s.ppo_epochs * num_mini
        return ((body - optimizer_step).at_least_zero() * trips(plan) + optimizer_step * steps
                + Cost(flops=experts(plan))
                + head)

    per_token = per_token_forward_flops(matmul_params(cfg, model.num_params), cfg.num_hidden_layers,
                                        cfg.attention_width, rollout_context(np.array([t])))
    model_flops = s.ppo_epochs * 3.0 * per_token * n * t / ctx.mesh.size  # forward + backward, no recompute
    return Program(f"update_{role}", lower, states, keys, micro_pass=role, trips=trips,
                   extra_flops=experts, layers=cfg.num_hidden_layers, total_cost=total_cost,
                   model_flops=lambda plan: model_flops)


def _layout_tokens(ctx: Context, rows: int, t: int) -> int:
    """Tokens one device lays out at once in a MoE layer for `rows` rows of `t` tokens over the mesh:
    its own share of the batch, times the expert ways (expert parallelism gathers its group's tokens)."""
    ways = dict(ctx.mesh.shape).get("expert", 1)
    return max(1, rows * t * ways // max(1, batch_axis_size(ctx.mesh)))


def critic_update_program(ctx: Context) -> Program | None:
    if ctx.critic is None or ctx.spec.critic is None:
        return None
    return _update_program(ctx, "critic", ctx.critic, ctx.spec.critic)


def actor_update_program(ctx: Context) -> Program:
    return _update_program(ctx, "actor", ctx.actor, ctx.spec.actor)


# In step order. A builder returns None when its program is not part of this run's step. This list and
# `Trainer.train_step` must name the same passes: each program's timing span in the step
# (`timing_s/<span>`) is in STEP_SPANS, and the trainer tests check, run by run, that the spans a step
# timed are the programs planned here (tests/tiny_runs.py `assert_step_runs_the_planned_programs`).
STEP_SPANS: dict[str, str] = {
    "sample": "gen", "ref_log_prob": "ref", "old_log_prob": "old_log_prob", "teacher": "teacher", "values": "values",
    "update_critic": "update_critic", "update_actor": "update_actor",
}
# the step's spans that run no planned program: the whole step, the experience (advantages, KL in reward:
# element-wise work beside the passes), and the rollout source's own timings
UNPLANNED_SPANS = frozenset({"step", "adv", "gen_job", "weight_sync"})
PROGRAM_BUILDERS: list[Callable[[Context], Program | None]] = [
    sample_program, ref_program, old_log_prob_program, teacher_program, values_program, critic_update_program,
    actor_update_program,
]

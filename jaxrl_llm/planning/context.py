"""What every builder of the step's programs reads (planning/programs.py, planning/sample_program.py): the
`Program` record the planner walks, the run's abstract models and persistent states (`make_context`: no weight
is loaded, every array a `jax.ShapeDtypeStruct` with the sharding the run gives it), and the helpers that lower a
jitted function on them."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxrl_llm.arrays import ArrayTree, DType, Params, ShardingTree
from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.config.checks import reads_images
from jaxrl_llm.config.spec import ModelSpec, OptimSpec, RunSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.lora import with_lora
from jaxrl_llm.models.moe import active_params
from jaxrl_llm.planning.roofline import Cost
from jaxrl_llm.roles.forward import compute_dtype_of
from jaxrl_llm.roles.optim import make_optimizer
from jaxrl_llm.roles.reference import offload_supported
from jaxrl_llm.roles.trained import adapter_init, adapter_shardings, model_config_of, param_shardings_of
from jaxrl_llm.roles.vision import vision_step_state
from jaxrl_llm.sampler import bucket_length
from jaxrl_llm.sharding import batch_axis_size, batch_sharding, optimizer_state_sharding

ARR = "actor_rollout_ref"
MESH_KEYS = "mesh.fsdp / mesh.tensor (shard the params and batch over more devices)"


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the step, ready to lower for a given `BatchPlan`."""

    name: str
    # (plan, repeat=1, platforms=None) -> jax.stages.Lowered; repeat: layers per layer-scan trip (scan_repeat);
    # platforms: lower for those instead of the mesh's devices (("cuda",) from a CPU host)
    lower: Callable[..., Any]
    state_args: tuple[str, ...]  # the persistent states (see `State`) among its arguments
    keys: Callable[[BatchPlan], tuple[str, ...]]  # config keys that shrink it, with their values
    micro_pass: str | None = None  # the BatchPlan pass whose micro-batch it runs (for 'auto')
    trips: Callable[[BatchPlan], int] = lambda plan: 1  # loop trips XLA's cost analysis counts once
    extra_flops: Callable[[BatchPlan], float] = lambda plan: 0.0  # FLOPs outside any counted loop body
    # (per device, added as they are: the decode steps past the first, a MoE model's routed experts
    # inside the blocked kernel's loop, models/moe_experts.py `uncounted_expert_flops`)
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
    # what one call moves outside its loops is counted once, not per trip of `total_cost` (the paged sampler: a
    # decode call's prologue is not a decode step's work)
    prologue_once: bool = False


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


def lower_for(jitted: Any, platforms: tuple[str, ...] | None, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """`jitted.lower(*args, **kwargs)`, for `platforms` when given (the kernels of those platforms are
    then lowered: Pallas -> Triton for "cuda" runs on any host)."""
    if platforms is None:
        return jitted.lower(*args, **kwargs)
    return jitted.trace(*args, **kwargs).lower(lowering_platforms=tuple(platforms))


def repeated(cfg: ModelConfig, repeat: int) -> ModelConfig:
    """`cfg` whose layer scans run each trip's layer `repeat` times (`ModelConfig.scan_repeat`)."""
    return cfg if repeat == cfg.scan_repeat else dataclasses.replace(cfg, scan_repeat=repeat)


def abstract_arrays(tree: ArrayTree, shardings: ShardingTree, dtype: DType | None = None) -> ArrayTree:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s), tree, shardings)


def _model(model: ModelSpec, head: str, mesh: Mesh, tokenizer: Tokenizer) -> Model:
    cfg = model_config_of(model, tokenizer)
    abstract, shardings = param_shardings_of(cfg, head, mesh, compute_dtype_of(model.param_dtype))
    return Model(cfg, abstract_arrays(abstract, shardings), shardings)


def _tx(optim: OptimSpec) -> optax.GradientTransformation:
    # the transformation's state does not depend on the schedule, unknown before the dataset is read
    if optim.total_steps is None:
        optim = dataclasses.replace(optim, total_steps=1, warmup_steps=0)
    return make_optimizer(optim)[0]


def _opt_state(tx: optax.GradientTransformation, model: Model) -> ArrayTree:
    abstract = jax.eval_shape(tx.init, model.params)
    return abstract_arrays(abstract, optimizer_state_sharding(abstract, model.shardings))


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
        adapters = Model(actor.cfg, {"lora": abstract_arrays(abstract, shardings)}, {"lora": shardings})
        states = {"actor_base_params": actor.params, "actor_params": adapters.params,
                  "actor_opt": _opt_state(txs["actor"], adapters)}
    else:
        states = {"actor_params": actor.params, "actor_opt": _opt_state(txs["actor"], actor)}
    if spec.sync.weight_copies:  # the off-policy pipeline's rollout weights (rollout/pipeline.py)
        states["rollout_params"] = [states["actor_params"]] * spec.sync.weight_copies
    if spec.need_ref and spec.model.lora is None:
        states["ref_params"] = abstract_arrays(actor.params, actor.shardings, compute_dtype_of(spec.ref.param_dtype))
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


def moe_layout_tokens(ctx: Context, rows: int, t: int) -> int:
    """Tokens one device lays out at once in a MoE layer for `rows` rows of `t` tokens over the mesh:
    its own share of the batch, times the expert ways (expert parallelism gathers its group's tokens)."""
    ways = dict(ctx.mesh.shape).get("expert", 1)
    return max(1, rows * t * ways // max(1, batch_axis_size(ctx.mesh)))

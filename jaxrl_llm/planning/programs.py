"""The programs of one RL step, lowered ahead of time on abstract inputs for the memory plan
(planning/memory.py): no weight is loaded, every array is a `jax.ShapeDtypeStruct` carrying
the sharding the run gives it.

Each builder lowers the same jitted function the run calls (`sampler.core.sample_program`,
`experience.log_probs_no_grad` / `values_no_grad`, `roles.jit_update`) with the step's
worst-case shapes: every prompt bucketed to `data.max_prompt_length`, every response
`rollout.response_length` long. `PROGRAM_BUILDERS` is the list the planner walks (the rollout's
builder: planning/sample_program.py; what every builder reads: planning/context.py).

Packed runs (`model.use_remove_padding`) are planned in the padded layout: at the worst case every
sequence is full length, and a packed micro-batch then holds the same tokens in as many rows, so the
padded program bounds the packed one. LoRA (`model.lora_rank`): the update's arguments are the
adapters, their optimizer state and the frozen base; the reference pass reads the base itself.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.bookkeeping.metrics import per_token_forward_flops, rollout_context
from jaxrl_llm.config.spec import ActorSpec, CriticSpec
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.models.expert_parallel import expert_ways
from jaxrl_llm.models.hybrid import layer_scan_trips
from jaxrl_llm.models.moe_experts import uncounted_expert_flops
from jaxrl_llm.models.vision.qwen_vl import RowImages
from jaxrl_llm.planning.context import (
    ARR,
    MESH_KEYS,
    Context,
    Model,
    Program,
    bytes_per_device,
    lower_for,
    matmul_params,
    moe_layout_tokens,
    repeated,
)
from jaxrl_llm.planning.kernel_costs import head_cost, invariant_attention_cost
from jaxrl_llm.planning.roofline import Cost
from jaxrl_llm.planning.sample_program import sample_program
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.experience import Experience, log_probs_no_grad, teacher_no_grad, values_no_grad
from jaxrl_llm.roles.trained import jit_update
from jaxrl_llm.sampler import bucket_length
from jaxrl_llm.sharding import batch_sharding


def _forward_program(ctx: Context, name: str, micro_pass: str, state: str, model: Model, fn: Callable, *,
                     seq_len: int | None = None, extra_keys: tuple[str, ...] = (), **settings: Any) -> Program:
    """A no-grad pass `fn` of `model` (experience.py `log_probs_no_grad`, `values_no_grad` or
    `teacher_no_grad`, with `settings`) over rows of `seq_len` tokens (default: the policy's), in the
    micro-batches of `micro_pass`; `extra_keys`: config keys beside the micro-batch that shrink it."""
    spec = ctx.spec
    n, t, r = spec.plan.sequences, seq_len or ctx.seq_len, spec.plan.response_length

    def micro_rows(plan: BatchPlan) -> int:
        return plan.forward_micro_rows(plan.micro_of(micro_pass), n, t)

    def lower(plan: BatchPlan, repeat: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        ids, mask = ctx.rows(n, t, jnp.int32), ctx.rows(n, r, jnp.float32)
        params = ctx.policy_params() if state == "actor_params" else ctx.states[state]
        return lower_for(fn, platforms, params, ids, ids, mask, model_cfg=repeated(model.cfg, repeat),
                      micro_rows=micro_rows(plan), **settings)

    def keys(plan: BatchPlan) -> tuple[str, ...]:
        micro = plan.micro_of(micro_pass)
        return (f"{micro.key}={micro.describe()}", *extra_keys, MESH_KEYS)

    states = ctx.policy_states if state == "actor_params" else (state,)
    def experts(plan: BatchPlan) -> float:  # every row through the experts once
        return uncounted_expert_flops(model.cfg, n * t, moe_layout_tokens(ctx, micro_rows(plan), t),
                                      expert_ways(model.cfg, ctx.mesh)) / ctx.mesh.size
    trips = lambda plan: n // micro_rows(plan)  # noqa: E731
    head = Cost() if fn is values_no_grad else head_cost(model.cfg, n * t / ctx.mesh.size, 1,
                                                          settings.get("compute_dtype", "float32"))
    head += invariant_attention_cost(model.cfg, n / ctx.mesh.size, t, 1, settings.get("compute_dtype", "float32"))

    def total_cost(plan: BatchPlan, body: Cost) -> Cost:
        return body * trips(plan) + Cost(flops=experts(plan)) + head

    return Program(name, lower, states, keys, micro_pass=micro_pass, trips=trips,
                   extra_flops=experts, layers=layer_scan_trips(model.cfg), total_cost=total_cost)


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

    def update_fn(repeat: int) -> Callable:
        cfg = repeated(model.cfg, repeat)
        if isinstance(s, CriticSpec):
            return functools.partial(update_critic, model_cfg=cfg, s=s)
        return functools.partial(update_actor, model_cfg=cfg, s=s, lora_scale=lora.scale if lora else 0.0,
                                 lora_dropout=lora.dropout if lora else 0.0)
    frozen = (ctx.states["actor_base_params"],) if lora else ()  # LoRA: the base, passed undifferentiated
    n, t = spec.plan.sequences, ctx.seq_len
    params, opt = ctx.states[f"{role}_params"], ctx.states[f"{role}_opt"]

    def split(plan: BatchPlan) -> tuple[int, int]:
        return plan.update_split(getattr(plan, role), n, t)

    def lower(plan: BatchPlan, repeat: int = 1, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        num_mini, num_micro = split(plan)
        fn = jit_update(update_fn(repeat), ctx.txs[role], jax.tree.map(lambda x: x.sharding, params),
                        jax.tree.map(lambda x: x.sharding, opt),
                        num_mini_batches=num_mini, num_micro_batches=num_micro,
                        rows_sharding=batch_sharding(ctx.mesh, 1))
        return lower_for(fn, platforms, params, opt, _experience(ctx), jax.random.PRNGKey(0),
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
        return uncounted_expert_flops(model.cfg, passes * n * t, moe_layout_tokens(ctx, micro, t),
                                      expert_ways(model.cfg, ctx.mesh)) / ctx.mesh.size

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
                   extra_flops=experts, layers=layer_scan_trips(cfg), total_cost=total_cost,
                   model_flops=lambda plan: model_flops)


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

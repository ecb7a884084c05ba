"""`build_run(config)`: everything a run holds, built once in this order, each step checked before the
next, heavier one starts:

    mesh -> config validated -> tokenizer -> dataset size -> RunSpec -> memory plan ('auto' sizes,
    levers; a step that cannot fit stops here) -> synthetic files -> loaders -> resume point ->
    tools / teacher vocabulary -> policy (actor) -> reference -> teacher -> critic -> reward manager,
    reward model or judge -> rollout generator -> rollout source -> KL controller, batching,
    checkpoint store, loggers

`Trainer(config)` (trainer.py) is a `Run` plus the loop and the step.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import TYPE_CHECKING

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm import storage
from jaxrl_llm.batching import StepBatching
from jaxrl_llm.bookkeeping.nonfinite import NonFiniteGuard
from jaxrl_llm.bookkeeping.tracking import Tracking
from jaxrl_llm.config import ConfigError, resolve, resolve_data, resolve_synthetic, validate_config
from jaxrl_llm.config.checks import check_context
from jaxrl_llm.config.spec import RunSpec
from jaxrl_llm.data.synthetic import write_synthetic_data
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.losses.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from jaxrl_llm.models import ModelConfig, invariant
from jaxrl_llm.models.remat import warn_once
from jaxrl_llm.planning.preflight import run_tokenizer
from jaxrl_llm.platform.compile_cache import use_compilation_cache
from jaxrl_llm.rewards import RewardManager, build_reward_manager
from jaxrl_llm.roles.actor import update_actor
from jaxrl_llm.roles.critic import update_critic
from jaxrl_llm.roles.draft import load_draft, with_draft_config
from jaxrl_llm.roles.reference import ReferenceRole, make_reference_role
from jaxrl_llm.roles.trained import TrainedRole, load_model, make_trained_role, model_config_of, packing_for
from jaxrl_llm.roles.vision import check_vision_run, image_tokens_of, load_vision_tower, with_vision_tokens
from jaxrl_llm.rollout.generator import RolloutGenerator
from jaxrl_llm.rollout.sources import RolloutSource, make_rollouts
from jaxrl_llm.sampler.engine.scheduler import speculative_refusal
from jaxrl_llm.sharding import batch_axes, batch_axis_size, initialize
from jaxrl_llm.sharding.split import make_split_meshes

if TYPE_CHECKING:
    from jaxrl_llm.data.loader import PromptLoader
    from jaxrl_llm.data.vision_prompts import ImageTokens
    from jaxrl_llm.planning.report import MemoryPlan
    from jaxrl_llm.roles.judge import Judge
    from jaxrl_llm.roles.reward_model import RewardModel
    from jaxrl_llm.roles.teacher import TeacherRole
    from jaxrl_llm.rollout.multi_turn import MultiTurn


@dataclasses.dataclass(eq=False, repr=False)  # a run is itself, not its fields' values
class Run:
    """What a run holds: its resolved spec, meshes, data, model roles, rollouts and bookkeeping."""

    spec: RunSpec  # resolved, with the memory plan's 'auto' sizes and levers filled in
    mesh: Mesh  # the training mesh
    rollout_mesh: Mesh | None  # the generation-only devices of a split mesh (mesh.rollout_devices)
    is_main: bool  # process 0: prints, plots, dumps
    tokenizer: Tokenizer
    memory_plan: MemoryPlan | None  # None when the plan was neither asked for nor needed
    total_steps: int
    run_dir: str
    resume_point: ckpt.ResumePoint | None  # checked before anything heavy loads or anything is written
    train_loader: PromptLoader
    val_loader: PromptLoader | None
    multi_turn: MultiTurn | None  # tools / interactions (rollout/multi_turn.py)
    actor: TrainedRole
    reference: ReferenceRole | None  # only when a KL is used
    teacher: TeacherRole | None  # on-policy distillation (roles/teacher.py)
    critic: TrainedRole | None
    reward_manager: RewardManager  # rule scorers (jaxrl_llm/rewards)
    reward_model: RewardModel | None  # reward_model.enable with a scalar head (roles/reward_model.py)
    judge: Judge | None  # reward_model.style=generative (roles/judge.py)
    generator: RolloutGenerator
    rollout_source: RolloutSource  # the run's one way to its rollouts (rollout/sources.py)
    base_rng: jax.Array
    kl_ctrl: FixedKLController | AdaptiveKLController
    nonfinite: NonFiniteGuard
    rows_sharding: NamedSharding  # a step's rows over the data-parallel axes
    batching: StepBatching  # every pass's split of a step (jaxrl_llm/batching)
    store: ckpt.CheckpointStore
    tracker: Tracking

    @property
    def dp_size(self) -> int:
        return batch_axis_size(self.mesh)


def build_run(config: ml_collections.ConfigDict) -> Run:
    """Validates and resolves `config`, plans the step's memory and builds the run (module doc)."""
    initialize()  # jax.distributed when several processes are configured; a no-op otherwise
    # before the plan's first compile: a relaunch reads the programs back (platform/compile_cache.py)
    use_compilation_cache(config.trainer.get("compilation_cache_dir", "auto"))
    mesh, rollout_mesh = make_split_meshes(config.mesh)
    spec, memory_plan, tokenizer, loaders, image_tokens = _plan_and_data(config, mesh)
    is_main = jax.process_index() == 0
    t = spec.trainer
    total_steps = t.total_steps
    assert total_steps is not None  # known once the dataset size is
    # where a resume would come from, checked before anything heavy loads or anything is written
    resume_point = ckpt.find_resume(t.resume_mode, t.run_dir, t.resume_from_path)
    # tools / interactions load before the model: a bad YAML or class path fails here (rollout/multi_turn.py)
    multi_turn = None
    if spec.multi_turn is not None:
        from jaxrl_llm.rollout.multi_turn import MultiTurn

        multi_turn = MultiTurn(spec.multi_turn, tokenizer, image_tokens)
    if spec.model.batch_invariant and (caveat := invariant.cpu_codegen_caveat(jax.default_backend(),
                                                                              os.environ.get("XLA_FLAGS", ""))):
        warn_once("batch_invariant_cpu_codegen", "%s", caveat)
    policy_cfg = model_config_of(spec.model, tokenizer)  # the policy's config.json: checks before any weight loads
    # the packing the policy's layers allow (a hybrid model's: no shared prompts), for every pass that reads it
    spec = dataclasses.replace(spec, model=packing_for(spec.model, policy_cfg))
    vision = None if image_tokens is None else load_vision_tower(
        spec.model.path, policy_cfg, image_tokens, tokenizer, mesh=mesh, compute_dtype=spec.actor.compute_dtype,
        seed=t.seed, trained=not spec.actor.freeze_vision_tower)
    # a trained tower is the actor's params["vision"]: updated, checkpointed and read by the sampler with the rest
    actor, reference, teacher, critic = _load_roles(spec, policy_cfg, mesh, tokenizer,
                                                    vision_params=vision.params if vision and vision.trained else None)
    reward_manager = build_reward_manager(spec.reward)
    reward_model, judge = None, None
    if spec.reward_model is not None and spec.reward_model.style == "generative":
        judge = load_run_judge(spec, mesh, rollout_mesh, tokenizer)  # a language model grading responses
    elif spec.reward_model is not None:
        from jaxrl_llm.roles.reward_model import RewardModel

        reward_model = RewardModel.load(spec.reward_model, tokenizer)
    generator = RolloutGenerator(model_cfg=actor.model_cfg, mesh=mesh, tokenizer=tokenizer,
                                 reward_manager=reward_manager, reward_model=reward_model,
                                 compute_dtype=spec.actor.compute_dtype, engine=spec.rollout_engine,
                                 multi_turn=multi_turn, max_prompt_length=spec.plan.max_prompt_length,
                                 record_routing=spec.actor.router_replay == "rollout", judge=judge,
                                 draft_params=load_draft(spec, tokenizer, mesh=mesh, seed=t.seed + 2), vision=vision)
    base_rng = jax.random.PRNGKey(t.seed)
    # each step's rollout: synchronous or the synchronizer's off-policy pipeline, with DAPO's group
    # filter or partial rollouts; with a split mesh a second generator samples on the rollout devices
    rollout_source = make_rollouts(
        spec, generator, policy=actor.weights(), loader=loaders[0],
        rng_for=lambda step: jax.random.fold_in(base_rng, step), train_mesh=mesh, rollout_mesh=rollout_mesh,
        total_steps=total_steps,
        rollout_generator=None if rollout_mesh is None else generator.on_mesh(rollout_mesh))
    kl = spec.kl_ctrl
    return Run(
        spec=spec, mesh=mesh, rollout_mesh=rollout_mesh, is_main=is_main, tokenizer=tokenizer,
        memory_plan=memory_plan, total_steps=total_steps, run_dir=t.run_dir, resume_point=resume_point,
        train_loader=loaders[0], val_loader=loaders[1], multi_turn=multi_turn, actor=actor, reference=reference,
        teacher=teacher, critic=critic, reward_manager=reward_manager, reward_model=reward_model, judge=judge,
        generator=generator, rollout_source=rollout_source, base_rng=base_rng,
        kl_ctrl=make_kl_controller(kl.type, kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon),
        nonfinite=NonFiniteGuard(t.max_consecutive_nonfinite),
        rows_sharding=NamedSharding(mesh, PartitionSpec(batch_axes(mesh))),
        batching=StepBatching(spec.plan, batch_axis_size(mesh)),
        store=ckpt.CheckpointStore(storage.join(t.run_dir, "checkpoints"), max_to_keep=t.max_ckpt_to_keep),
        tracker=Tracking(list(t.logger), t.run_dir, project_name=t.project_name, experiment_name=t.experiment_name,
                         config=json.loads(spec.config_json), is_main_process=is_main))


def _plan_and_data(config: ml_collections.ConfigDict, mesh: Mesh
                   ) -> tuple[RunSpec, MemoryPlan | None, Tokenizer, tuple[PromptLoader, PromptLoader | None],
                              ImageTokens | None]:
    """The validated, resolved and memory-planned spec, the tokenizer, the (train, val) loaders and how the
    policy reads images (None: a text policy). Nothing of the run is written and no weight loads before the plan
    has passed."""
    from jaxrl_llm.data import build_dataset, make_dataloader

    dp_size = batch_axis_size(mesh)
    is_main = jax.process_index() == 0
    checked = validate_config(config, dp_size=dp_size)
    data = resolve_data(checked)
    policy_path = checked.actor_rollout_ref.model.path
    # a tiny vision-language policy's tokenizer gains the vision tokens; its rows' images become image tokens
    tokenizer = with_vision_tokens(policy_path, run_tokenizer(data))
    image_tokens = image_tokens_of(policy_path, tokenizer)
    # A dataset of files is read first: its size gives the total steps. A synthetic task's size is in
    # its config (validation derived the steps from it), and its files are written only after the plan.
    synthetic = resolve_synthetic(checked)
    train_set = build_dataset(data, tokenizer, "train", image_tokens) if synthetic is None else None
    # a draft model (rollout.speculative.method='draft'): its vocabulary checked, its config read (roles/draft.py)
    spec = with_draft_config(resolve(
        checked, dp_size=dp_size, num_train_samples=None if train_set is None else len(train_set)), tokenizer)
    # what a vision-language policy's run with images takes (roles/vision.py); a text dataset runs as a text model's
    if image_tokens is not None and (train_set is None or any(r.get("images") for r in train_set.records)):
        check_vision_run(spec)
    spec, plan = plan_run_memory(spec, mesh, tokenizer, is_main=is_main)
    if train_set is None:
        write_synthetic_data(synthetic, is_main=is_main)
        train_set = build_dataset(data, tokenizer, "train", image_tokens)
    # Every process reads the whole global batch (prompts are small): host-side rewards and metrics are
    # then identical everywhere; device arrays take each process's own rows.
    train = make_dataloader(data, tokenizer, "train", dataset=train_set)
    val = make_dataloader(data, tokenizer, "val", image_tokens=image_tokens) if data.val_files else None
    return spec, plan, tokenizer, (train, val), image_tokens


def _load_roles(spec: RunSpec, policy_cfg: ModelConfig, mesh: Mesh, tokenizer: Tokenizer,
                vision_params: dict | None = None
                ) -> tuple[TrainedRole, ReferenceRole | None, TeacherRole | None, TrainedRole | None]:
    """The actor (policy), the reference, the distillation teacher and the critic, as the spec asks; `policy_cfg`:
    the policy's config (`model_config_of`), checked here before any weight loads. `vision_params`: a trained
    vision tower's, the actor's (and the reference's) params["vision"]."""
    seed = spec.trainer.seed
    teacher_tokenizer = None
    if spec.distillation is not None:  # the teacher's vocabulary
        from jaxrl_llm.roles.teacher import check_teacher

        teacher_tokenizer = check_teacher(spec.distillation, policy_cfg, tokenizer)
    refusal = speculative_refusal(policy_cfg, spec.rollout_engine.speculative)
    if refusal is not None:  # refused before any weight loads
        raise ConfigError(refusal)
    model_cfg, params = load_model(spec.model, head="lm", mesh=mesh, tokenizer=tokenizer, seed=seed)
    if spec.actor.router_replay != "none" and not model_cfg.is_moe:
        raise ConfigError(f"actor_rollout_ref.actor.router_replay={spec.actor.router_replay!r}: the policy "
                          f"({model_cfg.architecture}) has no mixture-of-experts layers to replay")
    experts_split = mesh.shape["expert"]
    if model_cfg.is_moe and model_cfg.num_experts % experts_split:
        raise ConfigError(f"mesh.expert={experts_split} does not divide the policy's {model_cfg.num_experts} "
                          "experts (each device holds num_experts / mesh.expert of them)")
    check_context(model_cfg, spec.plan.max_tokens_per_sequence)
    if vision_params is not None:
        params = {**params, "vision": vision_params}
    lora = spec.model.lora  # LoRA: adapters trained on the frozen `params` (roles/trained.py)
    actor = make_trained_role("actor", model_cfg, params, spec.actor_optim,
                              functools.partial(update_actor, model_cfg=model_cfg, s=spec.actor,
                                                lora_scale=lora.scale if lora else 0.0,
                                                lora_dropout=lora.dropout if lora else 0.0),
                              lora=lora, seed=seed, model=spec.model, settings=spec.actor,
                              batch=spec.plan.actor, lr_offset=spec.trainer.critic_warmup)
    # the initial policy in ref.param_dtype, in host memory with ref.param_offload (roles/reference.py);
    # with LoRA the reference is the frozen base itself (adapters off): no copy
    reference = None
    if spec.need_ref:
        reference = make_reference_role(spec.model, model_cfg, params, spec.ref, lora_base=actor.frozen)
    teacher = None  # on-policy distillation: a frozen teacher scores the student's samples
    if spec.distillation is not None:
        assert teacher_tokenizer is not None
        from jaxrl_llm.roles.teacher import load_teacher

        teacher = load_teacher(spec.distillation, teacher_tokenizer, mesh=mesh, seed=seed)
    critic = None
    if spec.critic is not None:
        critic_model, critic_optim, critic_batch = spec.critic_model, spec.critic_optim, spec.plan.critic
        assert critic_model and critic_optim and critic_batch, "resolve sets every critic part or none"
        critic_cfg, critic_params = load_model(critic_model, head="value", mesh=mesh, tokenizer=tokenizer,
                                               seed=seed + 1)
        critic = make_trained_role("critic", critic_cfg, critic_params, critic_optim,
                                   functools.partial(update_critic, model_cfg=critic_cfg, s=spec.critic),
                                   model=critic_model, settings=spec.critic, batch=critic_batch)
    return actor, reference, teacher, critic


def plan_run_memory(spec: RunSpec, mesh: Mesh, tokenizer: Tokenizer, *, is_main: bool
                    ) -> tuple[RunSpec, MemoryPlan | None]:
    """`spec` with its 'auto' micro-batch sizes resolved, and the memory plan (printed on the main
    process) when `trainer.memory_plan` is on or a size is 'auto'; else `spec` as it is and None. A step
    that would not fit raises here (planning/memory.py)."""
    from jaxrl_llm.planning.memory import check_plan_topology, plan_memory

    if spec.trainer.plan_topology is not None:
        check_plan_topology(spec, mesh)
    if not (spec.trainer.memory_plan or spec.plan.auto_passes):
        return spec, None
    plan = plan_memory(spec, mesh, tokenizer)
    if is_main:
        print(plan.table(), flush=True)
    assert plan.spec is not None  # plan_memory sets it
    return plan.spec, plan


def load_run_judge(spec: RunSpec, mesh: Mesh, rollout_mesh: Mesh | None, tokenizer: Tokenizer) -> Judge:
    """The judge of `reward_model.style=generative`, on the rollout devices of a split mesh when
    `judge.on_rollout_devices`, else on the training mesh."""
    from jaxrl_llm.roles.trained import load_judge

    rm = spec.reward_model
    assert rm is not None and rm.judge is not None
    on = rollout_mesh if rollout_mesh is not None and rm.judge.on_rollout_devices else mesh
    return load_judge(rm.path, rm.judge, policy_model=spec.model, tokenizer=tokenizer, mesh=on,
                      engine=spec.rollout_engine, dtype=rm.dtype, seed=spec.trainer.seed + 2)

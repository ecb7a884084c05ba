"""`RunSpec`: the typed, validated, fully derived run settings that everything below `trainer/`
consumes. Built once by `jaxrl_llm.config.resolve(config)`; frozen, so nothing re-reads a key or
re-applies a default after that.

Sections mirror the config tree (docs/config.md): data, model, actor (+ optim), rollout sampling,
critic (+ model, optim), advantage (+ KL controller, rollout correction, DAPO filter groups),
reward (+ reward model), trainer, mesh, and the `BatchPlan` with every batch size of a step.
The specs of lower packages live with them (`DataSpec` in data/, `RewardSpec` in rewards/,
`SamplingParams` in sampler/); the ones here are read by `trainer/`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.batching.batch_plan import BatchPlan
from jaxrl_llm.data.spec import DataSpec, SftSpec, SyntheticSpec
from jaxrl_llm.losses.advantages import ADV_ESTIMATORS
from jaxrl_llm.losses.trl_rloo import TrlRlooOptions
from jaxrl_llm.models.lora import LoraConfig
from jaxrl_llm.rewards.spec import RewardModelSpec, RewardSpec
from jaxrl_llm.sampler.engine.setup import EngineOptions
from jaxrl_llm.sampler.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to load (`actor_rollout_ref.model`, `critic.model`)."""

    path: str
    param_dtype: str  # master-weight dtype (the compute dtype and remat policy are the role's: ActorSpec)
    tiny: tuple[tuple[str, Any], ...]  # dims of a tiny:<arch> model (actor_rollout_ref.model.tiny)
    override_config: tuple[tuple[str, Any], ...] = ()  # HF config fields replaced at load (model.override_config)
    use_remove_padding: bool = True  # sequence packing (jaxrl_llm/batching)
    share_packed_prompts: bool = True  # packed rows hold a prompt once for the responses that share it
    lora: LoraConfig | None = None  # model.lora_rank > 0: train adapters on the frozen base (models/lora.py)
    context_attention: str = "ring"  # mesh.context_attention: how a context group attends (models/context_parallel.py)
    batch_invariant: bool = False  # model.batch_invariant: exact rollout log-probs (models/invariant.py)

    @property
    def is_tiny(self) -> bool:
        return self.path.startswith("tiny:")


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """AdamW and its LR schedule (`*.optim`), with warmup and total steps resolved."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    lr_scheduler_type: str  # constant | cosine | linear | wsd
    warmup_steps: int | None  # None only before the dataset size is known (--dry_run)
    total_steps: int | None
    min_lr_ratio: float
    num_cycles: float
    grad_clip: float | None
    moment_dtype: str = "float32"  # the Adam moments' storage dtype
    stable_ratio: float = 0.9  # wsd: the share of the post-warmup steps held at lr
    offload: bool = False  # the optimizer state in pinned host memory between updates


@dataclasses.dataclass(frozen=True)
class ActorSpec:
    """Hashable (a jit static argument): everything about the actor loss and update except arrays."""

    loss_mode: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float  # logprobs are scored under softmax(logits / temperature)
    compute_dtype: str
    remat: str  # remat policy name (jaxrl_llm/models/remat.py): none | full | dots_saveable | offload
    loss_scale_factor: float | None
    loss_kwargs: tuple[tuple[str, float], ...]  # extra arguments of the policy loss (sapo: tau_pos, tau_neg)
    ppo_epochs: int
    shuffle: bool
    # the update's own forward supplies the old log-probs (stop-gradient): set by `resolve` where a
    # separate pass would compute the same values (RunSpec.old_log_probs_from_update)
    old_log_probs_from_update: bool = False
    # rollout correction's IS weights ("token" | "sequence", truncated at the threshold) taken in the
    # loss from the update's own forward against the sampler's log-probs, which `old_log_probs` then
    # holds: set by `resolve` (RunSpec.rollout_is_in_update); None: the experience brings its weights
    rollout_is_in_loss: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False  # bypass mode's reinforce loss: mean 1 over each micro-batch
    logprob_impl: str = "auto"  # the fused log-prob head's backend (losses/logprob.py IMPLS)
    # mixture-of-experts models: None = the model's own (roles/actor.py router_aux_loss_coef)
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0
    freeze_vision_tower: bool = True  # False: a vision-language policy's tower trains with it (params["vision"])
    router_replay: str = "none"  # none | rollout: the update replays the sampler's recorded routing
    distill_topk_coef: float = 0.0  # algorithm.distillation with signal topk_forward_kl: its loss weight
    policy_loss_agg_mode: str | None = None  # policy_loss.loss_agg_mode: the policy loss's own aggregation
    dual_clip: bool | None = None  # policy_loss.dual_clip: None = the loss's own (vanilla on, gspo off)


@dataclasses.dataclass(frozen=True)
class CriticSpec:
    """Hashable: the critic's value loss and update."""

    cliprange_value: float
    loss_agg_mode: str
    compute_dtype: str
    remat: str  # remat policy name, as ActorSpec.remat
    ppo_epochs: int
    shuffle: bool


@dataclasses.dataclass(frozen=True)
class RefSpec:
    """The frozen reference policy (`actor_rollout_ref.ref`): how its params are stored."""

    param_dtype: str  # storage dtype of the copy (default: the compute dtype)
    param_offload: bool  # kept in pinned host memory between reference passes


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """`algorithm.distillation.*` when enabled: the teacher and its signal (roles/teacher.py)."""

    signal: str  # reverse_kl | topk_forward_kl (losses/distill.py)
    coef: float
    reward_coef: float  # weight of the task reward's advantage
    discount: float  # reverse_kl: discount over later tokens
    topk: int  # topk_forward_kl: teacher tokens per position
    teacher: ModelSpec  # its path, storage dtype (param_dtype) and packing (the policy's)
    param_offload: bool
    system_prompt: str | None = None  # context distillation: the teacher's own prompt
    prompt_template: str | None = None
    fewshot: tuple[tuple[str, str], ...] = ()  # (role, content) messages before the row's chat

    @property
    def own_prompt(self) -> bool:
        """Whether the teacher sees another prompt than the student (context distillation)."""
        return self.system_prompt is not None or self.prompt_template is not None or bool(self.fewshot)


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
    """Hashable: rewards -> advantages (`algorithm.*`)."""

    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    trl_rloo: TrlRlooOptions  # adv_estimator=trl_rloo only (algorithm.trl_rloo.*)
    # ROLL's shaping around the estimator (losses/shaping.py; None / False: off)
    norm_mean_type: str | None = None  # batch | group: each score minus that mean (ROLL's reward_norm)
    norm_std_type: str | None = None  # batch | group: ... divided by that std + 1e-6
    reward_clip: float | None = None
    whiten_rewards: bool = False
    whiten_advantages: bool = False
    advantage_clip: float | None = None
    max_len_mask: bool = False  # ROLL's sample-level masks (losses/shaping.py `sample_mask`)
    difficulty_mask: tuple[float, float] | None = None  # (low, high) thresholds on a prompt's mean score
    mask_truncated: bool = False  # TRL's mask_truncated_completions: no-EOS responses leave the loss only
    # veRL's pf-PPO (algorithm.use_pf_ppo): (reweight_method, weight_pow) of the rows' resampling after GAE
    pf_ppo: tuple[str, float] | None = None

    @property
    def masks_samples(self) -> bool:
        return self.max_len_mask or self.difficulty_mask is not None


@dataclasses.dataclass(frozen=True)
class KLControlSpec:
    type: str  # fixed | adaptive
    kl_coef: float
    target_kl: float
    horizon: int


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionSpec:
    rollout_is: str | None
    rollout_is_threshold: float
    rollout_is_batch_normalize: bool
    rollout_rs: str | None
    rollout_rs_threshold: Any  # str, float or tuple (one per mode)
    bypass_mode: bool
    loss_type: str = "ppo_clip"  # bypass mode's policy loss: ppo_clip or reinforce (the IS-weighted gradient)

    @property
    def bypass_reinforce(self) -> bool:
        """veRL's bypass mode with loss_type reinforce: the actor's loss is -A * w * log pi, its IS weights w
        taken in the update from its own (stop-gradient) log-probs against the sampler's."""
        return self.bypass_mode and self.loss_type == "reinforce"

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """The `synchronizer` section (Trinity-RFT's fixed schedule; rollout/pipeline.py)."""

    sync_interval: int = 1  # the rollout's weights are the actor's of the last multiple of this
    sync_offset: int = 0  # rollouts for step k + offset are generated while step k trains
    rollout_devices: Any = None  # mesh.rollout_devices: None, a count or device ids (split mesh)
    auto_correction: bool = False  # rollout correction turned on because the data is off-policy

    @property
    def off_policy(self) -> bool:
        return self.sync_offset > 0 or self.sync_interval > 1

    @property
    def max_staleness(self) -> int:
        """Policy versions between a rollout's weights and the step that trains on it, at most: the
        rollout for step j = k + offset is launched at step k on the weights of step
        k - k % interval, so j - that <= offset + interval - 1."""
        return self.sync_offset + self.sync_interval - 1

    @property
    def weight_copies(self) -> int:
        """Copies of the trained weights (the adapters with LoRA) the pipeline holds at once on the
        training devices (0: synchronous, or a split mesh, whose copies live on the rollout devices).
        At most at a sync: the pending rollouts were launched at the `offset` steps before it, on the
        weights of the ceil(offset / interval) interval blocks those steps lie in, and the sync makes
        one more copy while they still run (tests/rollout/test_pipeline.py simulates the schedule)."""
        if not self.off_policy or self.rollout_devices is not None:
            return 0
        return -(-self.sync_offset // self.sync_interval) + 1


@dataclasses.dataclass(frozen=True)
class FilterGroupsSpec:
    enable: bool
    metric: str
    max_num_gen_batches: int


@dataclasses.dataclass(frozen=True)
class PartialSpec:
    """`actor_rollout_ref.rollout.partial` (rollout/partial.py)."""

    enable: bool = False
    max_staleness: int = 1

    @property
    def active(self) -> bool:
        """Samples may wait for a later step (max_staleness = 0 is the plain rollout)."""
        return self.enable and self.max_staleness > 0


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
    """`actor_rollout_ref.rollout.multi_turn.*` when enabled (rollout/multi_turn.py builds the runtime)."""

    max_assistant_turns: int | None
    max_user_turns: int | None
    tool_config_path: str | None
    interaction_config_path: str | None
    max_parallel_calls: int
    max_tool_response_length: int
    tool_response_truncate_side: str
    format: str
    sanity_check: bool
    tool_call_timeout_s: float


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    run_dir: str  # trainer.default_local_dir: an absolute local path or a bucket URL (gs://...)
    total_steps: int | None  # None only before the dataset size is known (--dry_run)
    total_epochs: int
    project_name: str
    experiment_name: str
    logger: tuple[str, ...]
    log_val_generations: int
    save_freq: int
    test_freq: int
    val_before_train: bool
    val_only: bool
    resume_mode: str
    resume_from_path: str | None
    max_ckpt_to_keep: int | None
    critic_warmup: int
    max_consecutive_nonfinite: int  # skipped non-finite updates in a row that stop the run
    worker_timeout_s: float  # several processes: a peer silent this long is lost (bookkeeping/watchdog.py)
    worker_hang_timeout_s: float  # ... a peer stuck this long at a point the others passed is hung (0: off)
    rollout_data_dir: str | None
    validation_data_dir: str | None
    seed: int
    export_hf: bool
    memory_plan: bool = True  # compile the step's programs on abstract inputs first (planning/memory.py)
    device_memory_gb: float | None = None  # the memory plan's device memory; None = the device's own
    plan_topology: str | None = None  # the memory plan's TPU slice (platform/tpu.py); None = the local devices
    plan_num_slices: int = 1
    memory_levers: tuple[str, ...] = ()  # what the memory plan may change to fit (planning/levers.py)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    data: DataSpec
    synthetic: SyntheticSpec | None
    model: ModelSpec
    actor: ActorSpec
    actor_optim: OptimSpec
    ref: RefSpec
    train_sampling: SamplingParams
    val_sampling: SamplingParams
    rollout_engine: EngineOptions
    critic: CriticSpec | None
    critic_model: ModelSpec | None
    critic_optim: OptimSpec | None
    advantage: AdvantageSpec
    kl_ctrl: KLControlSpec
    rollout_correction: RolloutCorrectionSpec
    filter_groups: FilterGroupsSpec
    reward: RewardSpec
    reward_model: RewardModelSpec | None
    trainer: TrainerSpec
    mesh: tuple[tuple[str, int], ...]  # (axis, size) with -1 = the remaining devices
    plan: BatchPlan
    config_json: str  # the resolved config tree, for checkpoint metadata and loggers
    sync: SyncSpec = SyncSpec()  # off-policy pipelining (`synchronizer`, mesh.rollout_devices)
    multi_turn: MultiTurnSpec | None = None  # None: single-turn rollouts
    distillation: DistillSpec | None = None  # algorithm.distillation.enable
    partial: PartialSpec = PartialSpec()  # rollout.partial: paused samples resume at the next step
    sft_warmup: SftSpec | None = None  # sft.warmup_steps > 0: SFT steps on the policy before RL (sft/warmup.py)

    @property
    def need_ref(self) -> bool:
        """A reference policy is kept when a KL term reads it."""
        return (self.actor.use_kl_loss or self.advantage.use_kl_in_reward
                or ADV_ESTIMATORS.capability(self.advantage.adv_estimator, "needs_ref_log_probs"))

    @property
    def recompute_old_log_probs(self) -> bool:
        """The sampler's log-probs are the trainer's in fp32 (same code, same params); they are
        recomputed when they may differ (bf16 compute) or when rollout correction compares the two,
        unless the update's own forward supplies them (`old_log_probs_from_update`)."""
        rc = self.rollout_correction
        if self.actor.old_log_probs_from_update or rc.bypass_mode:  # bypass: the sampler's are the old ones
            return False
        return rc.enabled or self.actor.compute_dtype != "float32"

    @property
    def old_log_probs_from_update(self) -> bool:
        """Whether the actor update can take the old log-probs from its own forward (stop-gradient)
        instead of a separate no-grad pass: with ONE optimizer step per RL step, the recomputed old
        log-probs are the current policy's, i.e. what the update's forward computes (ratio 1, as
        TRL's GRPOTrainer with num_iterations=1), provided nothing reads them before the update (KL
        in the reward, TRL-RLOO's KL). Where a pass would run: in bf16 (the
        sampler's log-probs are not the trainer's), and for rollout correction whose weights the
        loss can take itself (`rollout_is_in_update`). Saves a forward pass over the batch per step."""
        if not self._update_is_first_use_of_old_log_probs or self.rollout_correction.bypass_mode:
            return False  # bypass: the sampler's log-probs are the old ones, in bf16 too
        bf16_only = self.actor.compute_dtype != "float32" and not self.rollout_correction.enabled
        return bf16_only or self.rollout_is_in_update

    @property
    def rollout_is_in_update(self) -> bool:
        """Whether rollout correction runs inside the actor's loss (`ActorSpec.rollout_is_in_loss`):
        IS weights per token or per sequence, truncated at the threshold, need only their own
        tokens, so each micro-batch takes them from its forward's log-probs (stop-gradient) and the
        sampler's, with values equal to a separate pass's when there is one optimizer step per RL
        step (partial rollouts' and the synchronizer's default token IS). Batch normalisation and
        rejection sampling need the whole batch before the update, so they keep the pass; bypass
        mode has none. The rollout_corr/* diagnostics are then computed after the update from the
        log-probs it returns (trainer.py)."""
        rc = self.rollout_correction
        return (rc.rollout_is is not None and rc.rollout_rs is None and not rc.rollout_is_batch_normalize
                and not rc.bypass_mode and self.distillation is None  # a teacher reads them first
                and self.advantage.pf_ppo is None  # its diagnostics compare the rows as sampled, not resampled
                and self._update_is_first_use_of_old_log_probs)

    @property
    def _update_is_first_use_of_old_log_probs(self) -> bool:
        """Nothing reads the old log-probs before the actor update, which takes one optimizer step."""
        return (not self.advantage.use_kl_in_reward
                and not ADV_ESTIMATORS.capability(self.advantage.adv_estimator, "needs_ref_log_probs")
                and self.plan.actor.optimizer_steps == 1)

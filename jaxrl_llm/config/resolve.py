"""`resolve(config) -> RunSpec`: the one place the config tree is read.

`validate_config` checks the tree and fills every derived value; `resolve` then turns the checked
tree into frozen, typed specs (jaxrl_llm/config/spec.py). Below `trainer/` nothing sees a
`ConfigDict`, and no key is re-defaulted anywhere else.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import ml_collections

from jaxrl_llm import storage
from jaxrl_llm.batching.batch_plan import BatchPlan, MicroBatching, RoleBatch
from jaxrl_llm.config.derive import AUTO, resolve_total_steps, synthetic_data_files
from jaxrl_llm.config.spec import (
    ActorSpec,
    AdvantageSpec,
    CriticSpec,
    DistillSpec,
    FilterGroupsSpec,
    KLControlSpec,
    ModelSpec,
    MultiTurnSpec,
    OptimSpec,
    PartialSpec,
    RefSpec,
    RolloutCorrectionSpec,
    RunSpec,
    SyncSpec,
    SyntheticSpec,
    TrainerSpec,
)
from jaxrl_llm.config.validate import validate_config
from jaxrl_llm.data.domains import DomainSpec
from jaxrl_llm.data.prompts import NATIVE_TEMPLATE
from jaxrl_llm.data.spec import VAL_OVERRIDABLE, DataSpec, SftSpec
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.losses.trl_rloo import TrlRlooOptions
from jaxrl_llm.models.lora import LoraConfig, parse_target_modules
from jaxrl_llm.rewards.custom import ScorerSpec
from jaxrl_llm.rewards.named import NamedRewards
from jaxrl_llm.rewards.spec import JudgeSpec, OverlongSpec, RewardModelSpec, RewardSpec
from jaxrl_llm.sampler.engine.setup import EngineOptions
from jaxrl_llm.sampler.params import SamplingParams
from jaxrl_llm.sampler.speculative import SpeculativeSpec
from jaxrl_llm.sharding.mesh import MESH_AXES

ConfigDict = ml_collections.ConfigDict


def _files(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


def _template_text(value: str | None) -> str | None:
    """data.chat_template: the Jinja text itself, or a file holding it."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if "{" not in value and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return value


def resolve_data(cfg: ConfigDict) -> DataSpec:
    """`data.*` of a validated config (also usable on a bare `data` section, where the reward
    settings, and so `builtin_scorers`, are unknown: False)."""
    whole = "data" in cfg and isinstance(cfg.data, ConfigDict)
    d = cfg.data if whole else cfg
    builtin = whole and cfg.custom_reward_function.path is None and not cfg.reward_model.enable
    # a judge's template and a teacher's own prompt are rendered from the row's chat messages
    needs_chat = whole and ((cfg.reward_model.enable and cfg.reward_model.style == "generative")
                            or cfg.algorithm.distillation.enable)
    return DataSpec(
        train_files=_files(d.train_files), val_files=_files(d.val_files), tokenizer=d.tokenizer,
        prompt_key=d.prompt_key, messages_key=d.messages_key, apply_chat_template=bool(d.apply_chat_template),
        max_prompt_length=int(d.max_prompt_length), train_batch_size=int(d.train_batch_size),
        val_batch_size=d.val_batch_size, truncation=d.truncation,
        # multi-turn rollouts render later turns from the row's chat messages, not only its ids
        return_raw_chat=(bool(d.return_raw_chat) or bool(needs_chat)
                         or bool(whole and cfg.actor_rollout_ref.rollout.multi_turn.enable)),
        filter_overlong_prompts=bool(d.filter_overlong_prompts),
        filter_overlong_prompts_workers=int(d.filter_overlong_prompts_workers), shuffle=bool(d.shuffle),
        seed=d.seed, train_max_samples=int(d.train_max_samples), val_max_samples=int(d.val_max_samples),
        dataloader_num_workers=int(d.dataloader_num_workers),
        custom_cls_path=d.custom_cls.path or None, custom_cls_name=d.custom_cls.name or None,
        system_prompt=d.system_prompt, chat_template=_template_text(d.chat_template),
        val_overrides=_val_overrides(d.val_overrides),
        ground_truth_key=d.ground_truth_key,
        default_data_source=d.default_data_source, builtin_scorers=bool(builtin), domains=_domains(d.domains),
        extra_info_keys=tuple(str(k) for k in d.extra_info_keys), skip_bad_rows=bool(d.skip_bad_rows),
        image_key=d.image_key or "", video_key=d.video_key or "")


def _val_overrides(section: ConfigDict) -> tuple[tuple[str, Any], ...]:
    """data.val_overrides, each key one validation may set, each value of its key's type."""
    out = []
    for key, value in _plain(section).items():
        if key not in VAL_OVERRIDABLE:
            raise ConfigError(f"data.val_overrides.{key}: not a key validation reads otherwise (one of "
                              f"{', '.join(VAL_OVERRIDABLE)})")
        want = bool if key == "apply_chat_template" else str
        if not isinstance(value, want) and not (value is None and key in ("ground_truth_key", "system_prompt",
                                                                          "default_data_source", "chat_template")):
            raise ConfigError(f"data.val_overrides.{key}={value!r}: a {want.__name__}")
        if key == "chat_template" and isinstance(value, str) and value != NATIVE_TEMPLATE:
            value = _template_text(value)
        out.append((str(key), value))
    return tuple(out)


def _domains(section: ConfigDict) -> DomainSpec:
    """data.domains.*, each value checked (the errors name the key)."""
    probs = _plain(section.probs)
    for domain, share in probs.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share > 0:
            raise ConfigError(f"data.domains.probs.{domain}={share!r}: a positive share of the batch")
    members = {}
    for domain, values in _plain(section.members).items():
        values = [values] if isinstance(values, str) else values
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, (str, int)) for v in values):
            raise ConfigError(f"data.domains.members.{domain}={values!r}: a list of the key column's values")
        members[str(domain)] = tuple(str(v) for v in values)
    sources = _plain(section.data_sources)
    for domain, source in sources.items():
        if not isinstance(source, str) or not source:
            raise ConfigError(f"data.domains.data_sources.{domain}={source!r}: a data_source name")
    columns = _plain(section.ground_truth_columns)
    for domain, names in columns.items():
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"data.domains.ground_truth_columns.{domain}={names!r}: a list of column names")
    return DomainSpec(key=str(section.key), probs=tuple((str(k), float(v)) for k, v in probs.items()),
                      members=tuple(members.items()), data_sources=tuple((str(k), v) for k, v in sources.items()),
                      ground_truth_columns=tuple((str(k), tuple(v)) for k, v in columns.items()))


def resolve_sampling(rollout: ConfigDict, *, validation: bool = False) -> SamplingParams:
    """Training sampling from `actor_rollout_ref.rollout`, or validation sampling from its
    `val_kwargs` (with the rollout's response_length, ignore_eos and stop_token_ids)."""
    knobs = rollout.val_kwargs if validation else rollout
    return SamplingParams(
        max_new_tokens=int(rollout.response_length), temperature=float(knobs.temperature), top_k=int(knobs.top_k),
        top_p=float(knobs.top_p), do_sample=bool(knobs.do_sample), n=int(knobs.n),
        ignore_eos=bool(rollout.ignore_eos), stop_token_ids=tuple(rollout.stop_token_ids))


def _fraction_or_auto(value: Any) -> float | str:
    return value if value == "auto" else float(value)


def resolve_rollout_engine(rollout: ConfigDict) -> EngineOptions:
    """The rollout engine options, 'auto' already resolved to the engine the run uses."""
    opts = EngineOptions(engine=rollout.engine, max_num_seqs=int(rollout.max_num_seqs),
                         max_num_batched_tokens=int(rollout.max_num_batched_tokens),
                         gpu_memory_utilization=_fraction_or_auto(rollout.gpu_memory_utilization),
                         kv_cache_dtype=rollout.kv_cache_dtype, attention_impl=rollout.paged_attention,
                         enable_chunked_prefill=bool(rollout.enable_chunked_prefill),
                         batch_prefill=bool(rollout.batch_prefill),
                         precompile_drain=bool(rollout.precompile_drain),
                         cascade_attention=rollout.cascade_attention,
                         unroll_layers=rollout.unroll_layers,
                         speculative=resolve_speculative(rollout.speculative))
    return opts.resolved(int(rollout.response_length), multi_turn=bool(rollout.multi_turn.enable))


def resolve_speculative(section: ConfigDict) -> SpeculativeSpec | None:
    """`rollout.speculative` as the engine's spec (None: off)."""
    if section.method == "none":
        return None
    path = section.draft_model.path
    if section.method == "draft" and path is not None and not path.startswith("tiny:"):
        path = os.path.abspath(os.path.expanduser(path))
    return SpeculativeSpec(method=section.method, num_tokens=int(section.num_tokens),
                           ngram_max=int(section.prompt_lookup_max), ngram_min=int(section.prompt_lookup_min),
                           draft_path=path if section.method == "draft" else None)


def resolve_multi_turn(rollout: ConfigDict) -> MultiTurnSpec | None:
    mt = rollout.multi_turn
    if not mt.enable:
        return None
    path = lambda p: None if p is None else os.path.abspath(os.path.expanduser(p))  # noqa: E731
    return MultiTurnSpec(
        max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
        tool_config_path=path(mt.tool_config_path), interaction_config_path=path(mt.interaction_config_path),
        max_parallel_calls=int(mt.max_parallel_calls), max_tool_response_length=int(mt.max_tool_response_length),
        tool_response_truncate_side=mt.tool_response_truncate_side, format=mt.format,
        sanity_check=bool(mt.enable_tokenization_sanity_check), tool_call_timeout_s=float(mt.tool_call_timeout_s))


def resolve_reward(cfg: ConfigDict) -> RewardSpec:
    rm, custom = cfg.reward_model, cfg.custom_reward_function
    kwargs, ob = rm.reward_kwargs, rm.reward_kwargs.overlong_buffer_cfg
    path = custom.path
    scorer = ScorerSpec(os.path.abspath(os.path.expanduser(path)) if path else None, custom.name,
                        tuple(sorted(custom.reward_kwargs.to_dict().items())))
    return RewardSpec(
        reward_manager=rm.reward_manager, scorer=scorer, timeout_s=float(kwargs.timeout_s),
        num_workers=int(kwargs.num_workers), max_resp_len=kwargs.max_resp_len,
        overlong=OverlongSpec(bool(ob.enable), int(ob.len), float(ob.penalty_factor), bool(ob.log)),
        missing_eos_penalty=rm.missing_eos_penalty,
        no_verdict_ok=bool(rm.enable and rm.style == "generative"), named=resolve_named_rewards(custom))


def resolve_named_rewards(custom: ConfigDict) -> NamedRewards | None:
    """`custom_reward_function.reward_funcs` / `reward_weights` / `openr1.*` (None without functions)."""
    funcs = tuple(str(f) for f in custom.reward_funcs)
    if not funcs:
        return None
    weights = tuple(float(w) for w in (custom.reward_weights or [1.0] * len(funcs)))
    o = custom.openr1
    return NamedRewards(funcs, weights, float(o.cosine_min_value_wrong), float(o.cosine_max_value_wrong),
                        float(o.cosine_min_value_correct), float(o.cosine_max_value_correct), int(o.cosine_max_len),
                        int(o.repetition_n_grams), float(o.repetition_max_penalty), str(o.code_language))


def resolve_optim(optim: ConfigDict, grad_clip: float | None) -> OptimSpec:
    total = int(optim.total_training_steps)
    return OptimSpec(
        lr=float(optim.lr), weight_decay=float(optim.weight_decay),
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        eps=float(optim.eps), lr_scheduler_type=optim.lr_scheduler_type,
        warmup_steps=int(optim.lr_warmup_steps) if total > 0 else None, total_steps=total if total > 0 else None,
        min_lr_ratio=float(optim.min_lr_ratio), num_cycles=float(optim.num_cycles),
        grad_clip=None if grad_clip is None else float(grad_clip), moment_dtype=optim.moment_dtype,
        offload=bool(optim.offload), stable_ratio=float(optim.get("stable_ratio", 0.9)))


def _plain(value: Any) -> dict:
    return value.to_dict() if isinstance(value, ConfigDict) else dict(value or {})


def _model(section: ConfigDict, tiny: ConfigDict, mesh: ConfigDict) -> ModelSpec:
    rank = int(section.get("lora_rank", 0))  # the policy's keys only (critic.model has none)
    lora = LoraConfig(rank, float(section.lora_alpha), parse_target_modules(section.target_modules),
                      float(section.get("lora_dropout", 0.0))) if rank else None
    return ModelSpec(path=section.path, param_dtype=section.param_dtype, tiny=tuple(tiny.to_dict().items()),
                     override_config=tuple(sorted(_plain(section.override_config).items())),
                     use_remove_padding=bool(section.use_remove_padding),
                     share_packed_prompts=bool(section.share_packed_prompts), lora=lora,
                     context_attention=mesh.context_attention,
                     batch_invariant=bool(section.get("batch_invariant", False)))


def resolve_actor(cfg: ConfigDict) -> ActorSpec:
    arr = cfg.actor_rollout_ref
    a = arr.actor
    mode = a.policy_loss.loss_mode
    return ActorSpec(
        loss_mode=mode, loss_agg_mode=a.loss_agg_mode, clip_ratio_low=float(a.clip_ratio_low),
        clip_ratio_high=float(a.clip_ratio_high), clip_ratio_c=float(a.clip_ratio_c),
        entropy_coeff=float(a.entropy_coeff), use_kl_loss=bool(a.use_kl_loss), kl_loss_coef=float(a.kl_loss_coef),
        kl_loss_type=a.kl_loss_type, temperature=float(arr.rollout.temperature) or 1.0,
        compute_dtype=arr.model.dtype, remat=a.remat_policy, logprob_impl=arr.model.logprob_impl,
        loss_scale_factor=None if a.loss_scale_factor is None else float(a.loss_scale_factor),
        loss_kwargs=tuple((k, float(a[k])) for k in POLICY_LOSSES.capability(mode, "extra_params")),
        ppo_epochs=int(a.ppo_epochs), shuffle=bool(a.shuffle),
        router_aux_loss_coef=None if a.router_aux_loss_coef is None else float(a.router_aux_loss_coef),
        router_z_loss_coef=float(a.router_z_loss_coef), router_replay=a.router_replay,
        freeze_vision_tower=bool(a.freeze_vision_tower),
        distill_topk_coef=_distill_topk_coef(cfg.algorithm.distillation),
        policy_loss_agg_mode=a.policy_loss.loss_agg_mode, dual_clip=a.policy_loss.dual_clip)


def _distill_topk_coef(distill: ConfigDict) -> float:
    return float(distill.coef) if distill.enable and distill.signal == "topk_forward_kl" else 0.0


def resolve_distillation(cfg: ConfigDict) -> DistillSpec | None:
    """`algorithm.distillation` when enabled: the teacher is loaded as the policy would be (packing,
    context attention, a tiny model's dims), in its own dtype."""
    distill, arr = cfg.algorithm.distillation, cfg.actor_rollout_ref
    if not distill.enable:
        return None
    teacher = distill.teacher
    policy = _model(arr.model, arr.model.tiny, cfg.mesh)
    model = dataclasses.replace(policy, path=teacher.path, param_dtype=teacher.dtype, override_config=(), lora=None)
    return DistillSpec(
        signal=distill.signal, coef=float(distill.coef), reward_coef=float(distill.reward_coef),
        discount=float(distill.discount), topk=int(distill.topk), teacher=model,
        param_offload=bool(teacher.param_offload), system_prompt=teacher.system_prompt,
        prompt_template=teacher.prompt_template,
        fewshot=tuple((str(m["role"]), str(m["content"])) for m in teacher.fewshot))


def resolve_reward_model(cfg: ConfigDict) -> RewardModelSpec | None:
    rm = cfg.reward_model
    if not rm.enable:
        return None
    judge = None
    if rm.style == "generative":
        j = rm.judge
        judge = JudgeSpec(
            template=j.template, system_prompt=j.system_prompt, parser=j.parser, min_score=float(j.min_score),
            max_score=float(j.max_score), default_score=float(j.default_score), max_new_tokens=int(j.max_new_tokens),
            temperature=float(j.temperature), max_prompt_length=int(j.max_prompt_length), combine=j.combine,
            rule_weight=float(j.rule_weight), judge_weight=float(j.judge_weight),
            on_rollout_devices=bool(j.on_rollout_devices), top_p=float(j.top_p), top_k=int(j.top_k),
            data_sources=tuple(str(s) for s in j.data_sources), rubric_key=j.rubric_key,
            chat_template_kwargs=tuple(sorted(_plain(j.chat_template_kwargs).items())))
    return RewardModelSpec(rm.model.path, rm.model.input_tokenizer, rm.max_length, rm.micro_batch_size_per_device,
                           style=rm.style, judge=judge, dtype=cfg.actor_rollout_ref.model.dtype)


def resolve_critic(cfg: ConfigDict) -> CriticSpec:
    c = cfg.critic
    return CriticSpec(cliprange_value=float(c.cliprange_value), loss_agg_mode=c.loss_agg_mode,
                      compute_dtype=c.model.dtype, remat=c.remat_policy,
                      ppo_epochs=int(c.ppo_epochs), shuffle=bool(c.shuffle))


def resolve_advantage(cfg: ConfigDict) -> AdvantageSpec:
    alg = cfg.algorithm
    trl = alg.trl_rloo
    return AdvantageSpec(
        adv_estimator=alg.adv_estimator, gamma=float(alg.gamma), lam=float(alg.lam),
        norm_adv_by_std_in_grpo=bool(alg.norm_adv_by_std_in_grpo), use_kl_in_reward=bool(alg.use_kl_in_reward),
        kl_penalty=alg.kl_penalty,
        trl_rloo=TrlRlooOptions(kl_coef=float(alg.kl_ctrl.kl_coef), token_level_kl=bool(trl.token_level_kl),
                                normalize_reward=bool(trl.normalize_reward),
                                reward_clip_range=float(trl.reward_clip_range),
                                normalize_advantage=bool(trl.normalize_advantage)),
        norm_mean_type=alg.norm_mean_type, norm_std_type=alg.norm_std_type,
        reward_clip=None if alg.reward_clip is None else float(alg.reward_clip),
        whiten_rewards=bool(alg.whiten_rewards), whiten_advantages=bool(alg.whiten_advantages),
        advantage_clip=None if alg.advantage_clip is None else float(alg.advantage_clip),
        max_len_mask=bool(alg.max_len_mask),
        difficulty_mask=((float(alg.difficulty_mask.low_threshold), float(alg.difficulty_mask.high_threshold))
                         if alg.difficulty_mask.enable else None),
        pf_ppo=((str(alg.pf_ppo.reweight_method), float(alg.pf_ppo.weight_pow)) if alg.use_pf_ppo else None),
        mask_truncated=bool(alg.mask_truncated_completions))


def _micro(key: str, fixed: int | str | None, dynamic: bool, budget: int | None) -> MicroBatching:
    if not dynamic and fixed == AUTO:
        return MicroBatching(key, None, None, auto=True)
    if dynamic:
        if budget is None:
            raise ValueError(f"{key}: dynamic batch size needs a token budget")
        return MicroBatching(key, None, int(budget))
    if isinstance(fixed, str):  # only `auto` is a string, handled above
        raise ValueError(f"{key}={fixed!r}: a number or {AUTO!r}")
    return MicroBatching(key, fixed, None)


def _role(cfg: ConfigDict, section: ConfigDict, name: str, dp_size: int) -> RoleBatch:
    prompts, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    micro = _micro(f"{name}.ppo_micro_batch_size_per_device", section.ppo_micro_batch_size_per_device,
                   section.use_dynamic_bsz, section.ppo_max_token_len_per_device)
    split = section.get("num_mini_batches")
    if split is not None:  # equal mini-batches of sequences, which may split a prompt's group
        sequences = prompts * n // split
        return RoleBatch(sequences / n, sequences, split, int(section.ppo_epochs), sequences // dp_size, micro)
    mini = section.ppo_mini_batch_size
    return RoleBatch(mini, mini * n, prompts // mini, int(section.ppo_epochs), mini * n // dp_size, micro)


def resolve_sft(cfg: ConfigDict) -> SftSpec:
    """The `sft` section of a config as an `SftSpec`."""
    s = cfg.sft
    warmup = s.warmup_files
    return SftSpec(
        response_key=s.response_key, prompt_key=s.prompt_key, messages_key=s.messages_key,
        prompt_dict_keys=tuple(s.prompt_dict_keys or ()),
        response_dict_keys=tuple(s.response_dict_keys or ()), multiturn=bool(s.multiturn), tools_key=s.tools_key,
        enable_thinking_key=s.enable_thinking_key,
        template_kwargs=tuple(sorted(dict(s.apply_chat_template_kwargs).items())), max_length=int(s.max_length),
        micro_batch_size_per_device=int(s.micro_batch_size_per_device), use_dynamic_bsz=bool(s.use_dynamic_bsz),
        max_token_len_per_device=int(s.max_token_len_per_device), warmup_steps=int(s.warmup_steps),
        warmup_files=(warmup,) if isinstance(warmup, str) else tuple(warmup) if warmup else None)


def resolve_batch_plan(cfg: ConfigDict, dp_size: int) -> BatchPlan:
    """Every batch size of a step, from a validated config."""
    arr = cfg.actor_rollout_ref
    ref, rollout, critic = arr.ref, arr.rollout, cfg.critic
    log_prob = lambda sec, name: _micro(  # noqa: E731
        f"actor_rollout_ref.{name}.log_prob_micro_batch_size_per_device", sec.log_prob_micro_batch_size_per_device,
        sec.log_prob_use_dynamic_bsz, sec.log_prob_max_token_len_per_device)
    values = (_micro("critic.forward_micro_batch_size_per_device", critic.forward_micro_batch_size_per_device,
                     critic.use_dynamic_bsz, critic.forward_max_token_len_per_device) if critic.enable else None)
    return BatchPlan(
        prompts=int(cfg.data.train_batch_size), n=int(rollout.n), dp_size=dp_size,
        max_prompt_length=int(cfg.data.max_prompt_length), response_length=int(rollout.response_length),
        actor=_role(cfg, arr.actor, "actor_rollout_ref.actor", dp_size),
        critic=_role(cfg, critic, "critic", dp_size) if critic.enable else None,
        ref_log_prob=log_prob(ref, "ref"), old_log_prob=log_prob(rollout, "rollout"), values=values)


def resolve_trainer(cfg: ConfigDict) -> TrainerSpec:
    t = cfg.trainer
    return TrainerSpec(
        run_dir=storage.normalize(t.default_local_dir), total_steps=t.total_training_steps,
        total_epochs=int(t.total_epochs), project_name=t.project_name, experiment_name=t.experiment_name,
        logger=tuple(t.logger), log_val_generations=int(t.log_val_generations), save_freq=int(t.save_freq),
        test_freq=int(t.test_freq), val_before_train=bool(t.val_before_train), val_only=bool(t.val_only),
        resume_mode=t.resume_mode, resume_from_path=_location(t.resume_from_path),
        max_ckpt_to_keep=t.max_actor_ckpt_to_keep, critic_warmup=int(t.critic_warmup),
        max_consecutive_nonfinite=int(t.max_consecutive_nonfinite), worker_timeout_s=float(t.worker_timeout_s),
        worker_hang_timeout_s=float(t.worker_hang_timeout_s),
        rollout_data_dir=_location(t.rollout_data_dir), validation_data_dir=_location(t.validation_data_dir),
        seed=int(t.seed), export_hf=bool(t.export_hf), memory_plan=bool(t.memory_plan),
        device_memory_gb=None if t.device_memory_gb is None else float(t.device_memory_gb),
        plan_topology=t.plan_topology, plan_num_slices=int(t.plan_num_slices), memory_levers=tuple(t.memory_levers))


def _location(path: str | None) -> str | None:
    """A local path made absolute, a bucket URL kept as it is (never a local folder named `gs:`)."""
    return None if path is None else storage.normalize(path)


def resolve_synthetic(cfg: ConfigDict) -> SyntheticSpec | None:
    syn = cfg.data.synthetic
    if syn.task is None:
        return None
    train, val = synthetic_data_files(cfg)
    return SyntheticSpec(syn.task, int(syn.n_train), int(syn.n_val), int(syn.difficulty), syn.answer_format,
                         int(syn.seed), train, val)


def resolve(cfg: ConfigDict, *, dp_size: int, num_train_samples: int | None = None) -> RunSpec:
    """The `RunSpec` of a config that `validate_config` returned (derived values filled in).

    num_train_samples: training prompts once the dataset is loaded; derives the total steps (and
    the LR schedule's) when the config does not set them.
    """
    unresolved = (cfg.trainer.total_training_steps is None
                  or cfg.actor_rollout_ref.actor.optim.total_training_steps <= 0)
    if num_train_samples is not None and unresolved:
        cfg = copy.deepcopy(cfg)  # the caller's tree is not changed
        resolve_total_steps(cfg, num_train_samples)
    arr, alg = cfg.actor_rollout_ref, cfg.algorithm
    critic_on = bool(cfg.critic.enable)
    kl, rc, fg = alg.kl_ctrl, alg.rollout_correction, alg.filter_groups
    threshold = rc.rollout_rs_threshold
    sync = resolve_sync(cfg)
    rollout_is = rc.rollout_is
    partial = PartialSpec(bool(arr.rollout.partial.enable), int(arr.rollout.partial.max_staleness))
    unset = rc.rollout_is is None and rc.rollout_rs is None
    # off-policy data (the synchronizer's schedule, or partial rollouts' resumed samples): token-level
    # IS (which also recomputes old log-probs) unless the user chose a correction
    if sync.auto_correction or (partial.active and unset):
        rollout_is = "token"
    spec = RunSpec(
        data=resolve_data(cfg), synthetic=resolve_synthetic(cfg),
        model=_model(arr.model, arr.model.tiny, cfg.mesh), actor=resolve_actor(cfg),
        actor_optim=resolve_optim(arr.actor.optim, arr.actor.grad_clip),
        ref=RefSpec(param_dtype=arr.ref.param_dtype, param_offload=bool(arr.ref.param_offload)),
        train_sampling=resolve_sampling(arr.rollout), val_sampling=resolve_sampling(arr.rollout, validation=True),
        rollout_engine=resolve_rollout_engine(arr.rollout),
        critic=resolve_critic(cfg) if critic_on else None,
        critic_model=_model(cfg.critic.model, arr.model.tiny, cfg.mesh) if critic_on else None,
        critic_optim=resolve_optim(cfg.critic.optim, cfg.critic.grad_clip) if critic_on else None,
        advantage=resolve_advantage(cfg),
        kl_ctrl=KLControlSpec(kl.type, float(kl.kl_coef), float(kl.target_kl), int(kl.horizon)),
        rollout_correction=RolloutCorrectionSpec(
            rollout_is, float(rc.rollout_is_threshold), bool(rc.rollout_is_batch_normalize), rc.rollout_rs,
            tuple(threshold) if isinstance(threshold, (list, tuple)) else threshold, bool(rc.bypass_mode),
            str(rc.loss_type)),
        filter_groups=FilterGroupsSpec(bool(fg.enable), fg.metric, int(fg.max_num_gen_batches)),
        reward=resolve_reward(cfg),
        reward_model=resolve_reward_model(cfg),
        trainer=resolve_trainer(cfg), mesh=tuple((k, int(cfg.mesh[k])) for k in MESH_AXES),
        plan=resolve_batch_plan(cfg, dp_size), config_json=cfg.to_json_best_effort(), sync=sync,
        multi_turn=resolve_multi_turn(arr.rollout), distillation=resolve_distillation(cfg), partial=partial,
        sft_warmup=resolve_sft(cfg) if cfg.sft.warmup_steps else None)
    in_loss = spec.rollout_is_in_update or spec.rollout_correction.bypass_reinforce
    actor = dataclasses.replace(
        spec.actor, old_log_probs_from_update=spec.old_log_probs_from_update,
        rollout_is_in_loss=spec.rollout_correction.rollout_is if in_loss else None,
        rollout_is_threshold=spec.rollout_correction.rollout_is_threshold)
    if spec.rollout_correction.bypass_reinforce:  # veRL's bypass dispatch: the IS-weighted policy gradient
        actor = dataclasses.replace(actor, loss_mode="reinforce", dual_clip=None,
                                    rollout_is_batch_normalize=spec.rollout_correction.rollout_is_batch_normalize)
    return dataclasses.replace(spec, actor=actor)


def resolve_sync(cfg: ConfigDict) -> SyncSpec:
    """The `synchronizer` section and `mesh.rollout_devices`. Off-policy data (offset > 0 or
    interval > 1) turns rollout correction on (token IS) unless the user set rollout_is / rollout_rs."""
    s, rc = cfg.synchronizer, cfg.algorithm.rollout_correction
    rd = cfg.mesh.get("rollout_devices")
    spec = SyncSpec(int(s.sync_interval), int(s.sync_offset), tuple(rd) if isinstance(rd, (list, tuple)) else rd)
    auto = spec.off_policy and rc.rollout_is is None and rc.rollout_rs is None
    return SyncSpec(spec.sync_interval, spec.sync_offset, spec.rollout_devices, auto_correction=auto)


def resolve_config(config: ConfigDict, *, dp_size: int, num_train_samples: int | None = None,
                   **validate_kwargs: Any) -> RunSpec:
    """`validate_config` then `resolve`, for callers that start from a raw config."""
    checked = validate_config(config, dp_size=dp_size, num_train_samples=num_train_samples, **validate_kwargs)
    return resolve(checked, dp_size=dp_size, num_train_samples=num_train_samples)

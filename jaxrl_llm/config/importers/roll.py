"""ROLL RLVR pipeline configs (`RLVRConfig`) -> our tree.

Batch sizes: `rollout_batch_size` prompts x `num_return_sequences_in_group` per step; one optimizer
step takes `per_device_train_batch_size x gradient_accumulation_steps x dp` sequences, where dp is
actor_train's data-parallel size in ROLL (len(device_mapping) / (tp x pp x cp) for Megatron), so
`ppo_mini_batch_size` = that / n prompts (the run's number of optimizer steps is kept whatever our
device count). Keys left unset take ROLL's defaults where they decide what is computed
(`loss_agg_mode: seq-mean-token-mean`, no dual clip, KL-loss estimator k3 = low_var_kl).
"""
from __future__ import annotations

import ast
import fnmatch
import os
import re
from typing import Any, cast

from jaxrl_llm.config.importers.common import (
    NO_DUAL_CLIP,
    PLACEMENT,
    Mapper,
    Source,
    SourceValue,
    flatten,
    int_or_error,
    leftover,
    logger_sinks,
    ratio_steps,
)
from jaxrl_llm.config.importers.roll_rewards import ROLL_SAMPLING, import_rewards
from jaxrl_llm.config.importers.verl import context_parallel, training_expert_parallel, training_tensor_parallel
from jaxrl_llm.models.lora import ARCH_MODULES, parse_target_modules

TOP_LEVEL = ("rollout_batch_size", "num_return_sequences_in_group", "actor_train", "actor_infer", "pretrain")
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"

SIMPLE = {  # ROLL key -> our key
    "rollout_batch_size": "data.train_batch_size", "num_return_sequences_in_group": f"{R}.n",
    "prompt_length": "data.max_prompt_length", "ppo_epochs": f"{A}.ppo_epochs",
    "val_batch_size": "data.val_batch_size", "max_steps": "trainer.total_training_steps",
    "save_steps": "trainer.save_freq", "eval_steps": "trainer.test_freq", "seed": "trainer.seed",
    "output_dir": "trainer.default_local_dir", "exp_name": "trainer.experiment_name",
    "pretrain": "actor_rollout_ref.model.path", "reward_pretrain": "critic.model.path",
    "gamma": "algorithm.gamma", "lambd": "algorithm.lam", "use_kl_loss": f"{A}.use_kl_loss",
    "kl_loss_coef": f"{A}.kl_loss_coef", "entropy_loss_coef": f"{A}.entropy_coeff",
    "loss_agg_mode": f"{A}.loss_agg_mode", "kl_penalty": "algorithm.kl_penalty",
    "init_kl_coef": "algorithm.kl_ctrl.kl_coef", "kl_horizon": "algorithm.kl_ctrl.horizon",
    "add_token_level_kl": "algorithm.use_kl_in_reward", "critic_warmup": "trainer.critic_warmup",
    "max_grad_norm": f"{A}.grad_clip",
    "actor_train.model_args.model_name_or_path": "actor_rollout_ref.model.path",
    "actor_train.data_args.prompt": "data.prompt_key", "actor_train.data_args.messages": "data.messages_key",
    "actor_infer.generating_args.temperature": f"{R}.temperature",
    "actor_infer.generating_args.top_p": f"{R}.top_p", "actor_infer.generating_args.top_k": f"{R}.top_k",
    "actor_infer.generating_args.do_sample": f"{R}.do_sample",
    "val_n_sample": f"{R}.val_kwargs.n",
}
TRAINING_ARGS = {"learning_rate": "optim.lr", "weight_decay": "optim.weight_decay",
                 "warmup_ratio": "optim.lr_warmup_steps_ratio",
                 "adam_epsilon": "optim.eps", "max_grad_norm": "grad_clip"}
ROLL_DEFAULTS = {"loss_agg_mode": "seq-mean-token-mean", "kl_loss_coef": 0.0, "init_kl_coef": 0.2,
                 "add_token_level_kl": False, "use_kl_loss": False, "entropy_loss_coef": 0.0, "lambd": 0.95,
                 "gamma": 1.0, "pg_clip": 0.2}
SHAPING = ("max_len_mask", "reward_clip", "whiten_rewards", "whiten_advantages", "advantage_clip")
IS_SET = lambda v: v not in (None, False, 0, 0.0, "", [], {}, "no_filter")  # noqa: E731
ERRORS = {  # key -> why (an error when set to anything but its off value)
    "use_reward_scaling": "reward scaling is not available",
    "use_reward_norm": "reward normalisation is not available", "add_len_reward": "length rewards are not available",
    "error_max_len_clip": "length-based masks of wrong answers are not available",
    "difficulty_loss_weight": "sample weights are not available", "length_loss_weight": "sample weights are not "
    "available", "postive_loss_coef": "an SFT loss on positive samples is not available",
    "use_rollout_importance_sampling_ratio": "set algorithm.rollout_correction instead",
    "train_infer_correction.is_weight.enabled": "set algorithm.rollout_correction instead",
    "train_infer_correction.filters": "set algorithm.rollout_correction instead",
    "reward_model": "a generative reward-model cluster is not available",
    "actor_infer.generating_args.num_beams": "beam search is not available",
    "validation.generating_args.num_beams": "beam search is not available",
    "dataset_filter.source": "dataset filters are not available",
    "dataset_filter.num_samples": "dataset filters are not available",
    "is_use_additional_prompts": "over-sampling additional prompts is not available",
}


def device_count(value: SourceValue) -> int | None:
    """ROLL's `device_mapping` (a list or a string such as 'list(range(0,16))') -> number of devices."""
    if isinstance(value, list):
        return len(value)
    if not isinstance(value, str):
        return None
    found = re.fullmatch(r"\s*(?:list\()?\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)?\s*", value)
    if found:
        lo, hi = (0, int(found[1])) if found[2] is None else (int(found[1]), int(found[2]))
        return max(hi - lo, 0)
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return len(parsed) if isinstance(parsed, (list, tuple)) else None


def _roll_dp(src: Source, role: str) -> int | None:
    devices = device_count(src.flat.get(f"{role}.device_mapping"))
    if devices is None:
        return None
    name = str(src.flat.get(f"{role}.strategy_args.strategy_name") or "")
    conf = f"{role}.strategy_args.strategy_config."
    if "megatron" in name:
        sizes = [src.flat.get(conf + k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                  "context_parallel_size")]
    else:
        sizes = [src.flat.get(f"{role}.model_args.ulysses_size")]
    div = 1
    for size in sizes:
        div *= size if isinstance(size, int) and size > 0 else 1
    return max(devices // div, 1)


# ROLL's ActorPGWorker (roll/pipeline/rlvr/actor_pg_worker.py): actor_train.pg_variant -> our policy loss
PG_VARIANTS = {"ppo": "vanilla", "vanilla": "gpg", "topr": "topr"}


def _pg_worker(m: Mapper, src: Source) -> bool:
    """`actor_train.pg_variant` (and TOPR's weights) when `actor_train.worker_cls` is ROLL's ActorPGWorker,
    the only worker that reads them; whether it is."""
    variant = src.take("actor_train.pg_variant")
    weights = {k: src.take(f"actor_train.{k}") for k in ("topr_positive_weight", "topr_negative_weight")}
    if not str(src.peek("actor_train.worker_cls") or "").endswith(".ActorPGWorker"):
        if variant is not None:
            m.ignore("actor_train.pg_variant", "read by ROLL's ActorPGWorker only, and actor_train.worker_cls is "
                                               "the PPO ActorWorker", variant)
        return False
    variant = variant or "vanilla"  # the worker's default
    if variant not in PG_VARIANTS:
        m.error("actor_train.pg_variant", f"{variant!r}: jaxrl_llm has {', '.join(PG_VARIANTS)} (ROLL's tis, cispo "
                                          "and kimi15 variants are not available)")
    m.set(f"{A}.policy_loss.loss_mode", PG_VARIANTS[variant], "actor_train.pg_variant")
    for key, value in weights.items():
        if value is not None:
            m.set(f"{A}.{key}", value, f"actor_train.{key}")
    return True


def _batch(m: Mapper, src: Source) -> None:
    ta = "actor_train.training_args."
    if not (src.has(ta + "per_device_train_batch_size") or src.has(ta + "gradient_accumulation_steps")):
        return
    per_device = int_or_error(m, ta + "per_device_train_batch_size",
                              src.take(ta + "per_device_train_batch_size", 8))
    accumulation = int_or_error(m, ta + "gradient_accumulation_steps",
                                src.take(ta + "gradient_accumulation_steps", 1))
    dp = _roll_dp(src, "actor_train") or m.dp()
    n, prompts = m.get(f"{R}.n"), m.get("data.train_batch_size")
    sequences = per_device * accumulation * dp
    if sequences % n or prompts % (sequences // n or 1) or sequences > prompts * n:
        m.error(ta + "gradient_accumulation_steps",
                f"{per_device} x {accumulation} x dp {dp} = {sequences} sequences per optimizer step is not a whole "
                f"number of groups (num_return_sequences_in_group={n}) dividing rollout_batch_size={prompts}")
    m.set(f"{A}.ppo_mini_batch_size", sequences // n, ta + "gradient_accumulation_steps")
    ours = m.dp()
    if (sequences // ours) % per_device == 0 and sequences % ours == 0:
        m.set(f"{A}.ppo_micro_batch_size_per_device", per_device, ta + "per_device_train_batch_size")


def _algorithm(m: Mapper, src: Source) -> None:
    estimator = src.take("adv_estimator", "gae")
    mean, std = src.take("norm_mean_type"), src.take("norm_std_type")
    if estimator == "gae":  # ours is veRL's, which whitens its advantages over the batch's response tokens
        if not src.peek("whiten_advantages"):
            m.error("adv_estimator", "'gae' without whiten_advantages: jaxrl_llm's gae (veRL's) always whitens "
                                     "its advantages over the batch's response tokens; set whiten_advantages: true")
        m.set("algorithm.adv_estimator", "gae", "adv_estimator")
        src.take("whiten_advantages")
    elif estimator == "grpo":
        m.set("algorithm.adv_estimator", estimator, "adv_estimator")
    elif estimator == "reinforce" and mean == "group" and std in ("group", None):
        m.set("algorithm.adv_estimator", "grpo", "adv_estimator")
        m.set("algorithm.norm_adv_by_std_in_grpo", std == "group", "norm_std_type")
    elif estimator == "reinforce" and src.peek("whiten_advantages"):
        # discounted returns whitened over the batch's response tokens: REINFORCE++ (the estimator whitens)
        m.set("algorithm.adv_estimator", "reinforce_plus_plus", "adv_estimator")
        src.take("whiten_advantages")
    elif estimator == "reinforce":
        # the discounted returns themselves (clipped by reward_clip / advantage_clip where set): our `reinforce`
        m.set("algorithm.adv_estimator", "reinforce", "adv_estimator")
        src.take("whiten_advantages")
    else:
        m.error("adv_estimator", f"{estimator!r}: jaxrl_llm has gae, grpo and reinforce")
    if m.get("algorithm.adv_estimator") != "grpo":  # ROLL's reward_norm before the estimator (grpo: its own)
        for key, value in (("norm_mean_type", mean), ("norm_std_type", std)):
            if value not in (None, "batch", "group"):
                m.error(key, f"{value!r}: jaxrl_llm normalises the scores over the batch or the group (a running "
                             "normalisation across steps is not available)")
            if value is not None:
                m.set(f"algorithm.{key}", value, key)
    for key in SHAPING:  # ROLL's shaping around the estimator: our keys of its names (losses/shaping.py)
        value = src.take(key)
        if value is not None:
            m.set(f"algorithm.{key}", value, key)
    low, high = src.take("difficulty_low_threshold", 0.0), src.take("difficulty_high_threshold", 1.0)
    if src.take("difficulty_mask", False):
        m.set("algorithm.difficulty_mask.enable", True, "difficulty_mask")
        m.set("algorithm.difficulty_mask.low_threshold", low, "difficulty_low_threshold")
        m.set("algorithm.difficulty_mask.high_threshold", high, "difficulty_high_threshold")
    for key, default in ROLL_DEFAULTS.items():
        if key in SIMPLE:
            m.set(SIMPLE[key], src.take(key, default), key)
    clip = src.take("pg_clip", 0.2)
    m.set(f"{A}.clip_ratio", clip, "pg_clip")
    low, high = src.take("pg_clip_low", 0.2), src.take("pg_clip_high", 0.2)
    if src.take("use_pg_clip_range", False):
        m.set(f"{A}.clip_ratio_low", low, "pg_clip_low")
        m.set(f"{A}.clip_ratio_high", high, "pg_clip_high")
    dual = src.take("dual_clip_loss", False)
    m.set(f"{A}.clip_ratio_c", 1.0 + 2.0 * clip if dual else NO_DUAL_CLIP, "dual_clip_loss")
    m.set(f"{A}.kl_loss_type", "low_var_kl", "use_kl_loss")  # ROLL's KL loss: k3 clamped to +-10
    target = src.take("target_kl")
    if target is not None:
        m.set("algorithm.kl_ctrl.type", "adaptive", "target_kl")
        m.set("algorithm.kl_ctrl.target_kl", target, "target_kl")
    if src.has("value_clip"):
        value_clip = src.take("value_clip")
        m.set("critic.cliprange_value", NO_DUAL_CLIP if value_clip is None else value_clip, "value_clip")
    sampling = src.take("importance_sampling", "token")
    if _pg_worker(m, src):
        if sampling == "seq":  # ROLL's ActorPGWorker computes the token ratio whatever this says
            m.ignore("importance_sampling", "ROLL's ActorPGWorker (actor_train.worker_cls) does not read it", sampling)
    elif sampling == "seq":  # the sequence-mean log-ratio in ROLL's PPO loss: our gspo (same values and gradients),
        # aggregated as ROLL's loss_agg_mode says, with the dual clip when dual_clip_loss
        m.set(f"{A}.policy_loss.loss_mode", "gspo", "importance_sampling")
        m.set(f"{A}.policy_loss.loss_agg_mode", m.get(f"{A}.loss_agg_mode"), "loss_agg_mode")
        m.set(f"{A}.policy_loss.dual_clip", bool(dual), "dual_clip_loss")
    policy = src.take("use_policy_loss_type", "PPO")
    if policy != "PPO":
        m.error("use_policy_loss_type", f"{policy!r}: only the PPO loss is available")
    coef = src.take("rl_loss_coef", 1.0)
    if coef != 1.0:
        m.error("rl_loss_coef", f"{coef!r}: a scaled RL loss is not available")


def _roles(m: Mapper, src: Source) -> None:
    for role, ours in (("actor_train", A), ("critic", "critic")):
        ta = f"{role}.training_args."
        for name, key in TRAINING_ARGS.items():
            if src.peek(ta + name) is not None:
                m.set(f"{ours}.{key}", src.take(ta + name), ta + name)
        warmup = src.take(ta + "warmup_steps")
        if warmup:  # optimizer steps (HF TrainingArguments) -> our training steps, rounded up
            section = "data.train_batch_size", f"{ours}.ppo_mini_batch_size", f"{ours}.ppo_epochs"
            per_step = m.get(section[0]) // (m.get(section[1]) or m.get(f"{A}.ppo_mini_batch_size")) * (
                m.get(section[2]) or m.get(f"{A}.ppo_epochs"))
            m.set(f"{ours}.optim.lr_warmup_steps", ratio_steps(int_or_error(m, ta + "warmup_steps", warmup),
                                                               per_step), ta + "warmup_steps")
        betas = [src.take(ta + "adam_beta1"), src.take(ta + "adam_beta2")]
        if any(b is not None for b in betas):
            old = m.get(f"{ours}.optim.betas")
            m.set(f"{ours}.optim.betas", [b if b is not None else o for b, o in zip(betas, old)], ta + "adam_beta1")
        schedule = src.take(ta + "lr_scheduler_type")
        if schedule is not None:
            if schedule not in ("constant", "constant_with_warmup", "cosine", "linear"):
                m.error(ta + "lr_scheduler_type", f"{schedule!r}: jaxrl_llm has constant, cosine and linear (with "
                                                  "warmup)")
            m.set(f"{ours}.optim.lr_scheduler_type", "constant" if schedule.startswith("constant") else schedule,
                  ta + "lr_scheduler_type")
        model = "actor_rollout_ref.model" if role == "actor_train" else "critic.model"
        dtype = src.take(f"{role}.model_args.dtype")
        if dtype in ("bf16", "bfloat16", "fp32", "float32"):
            m.set(f"{model}.dtype", "bfloat16" if dtype.startswith("b") else "float32", f"{role}.model_args.dtype")
        elif dtype is not None:
            m.ignore(f"{role}.model_args.dtype={dtype}", "only float32 / bfloat16 compute; the tree's dtype is kept")
        key = f"{role}.model_args.disable_gradient_checkpointing"
        if src.has(key):
            m.set(f"{model}.enable_gradient_checkpointing", not src.take(key), key)
    head = src.take("critic.model_args.model_type")
    if head == "trl":  # roll/models/model_providers.py: trl's AutoModelForCausalLMWithValueHead
        m.error("critic.model_args.model_type", "'trl': TRL's value head drops its input (dropout 0.1) before the "
                                                "linear head while training; jaxrl_llm's critic is veRL's token "
                                                "classifier without dropout: use auto_token_classification")
    elif head not in (None, "auto_token_classification"):
        m.error("critic.model_args.model_type", f"{head!r}: the critic is a value per token "
                                                "(auto_token_classification)")
    ref = src.take("reference.model_args.model_name_or_path")
    if ref not in (None, m.get("actor_rollout_ref.model.path")):
        m.error("reference.model_args.model_name_or_path", f"{ref!r}: the reference model is the initial policy "
                                                           "in jaxrl_llm")
    tp = src.drop("actor_train.strategy_args.strategy_config.tensor_model_parallel_size")
    if isinstance(tp, int) and tp > 0:  # the training engine's TP (verl.py's placement rule)
        training_tensor_parallel(m, "actor_train.strategy_args.strategy_config.tensor_model_parallel_size", tp)
    ep = src.drop("actor_train.strategy_args.strategy_config.expert_model_parallel_size")
    if isinstance(ep, int) and ep > 0:
        training_expert_parallel(m, "actor_train.strategy_args.strategy_config.expert_model_parallel_size", ep)
    for key in ("actor_train.model_args.ulysses_size",
                "actor_train.strategy_args.strategy_config.context_parallel_size"):
        size = src.drop(key)
        if isinstance(size, int) and size > 1:  # each sequence's tokens over a group of devices
            context_parallel(m, key, size)


def _data(m: Mapper, src: Source) -> None:
    for role, ours in (("actor_train", "data.train_files"), ("validation", "data.val_files")):
        files = src.take(f"{role}.data_args.file_name")
        folder = src.take(f"{role}.data_args.dataset_dir")
        if files is not None and folder not in (None, "", "."):  # ROLL joins each file name to it (get_dataset)
            files = ([os.path.join(str(folder), str(f)) for f in files] if isinstance(files, list)
                     else os.path.join(str(folder), str(files)))
        if files is not None:
            m.set(ours, files, f"{role}.data_args.file_name")
        template = src.take(f"{role}.data_args.template")
        if template not in (None, "native"):
            m.ignore(f"{role}.data_args.template={template}", "prompts use the tokenizer's chat template (native)")
    template = src.take("global_template")  # ROLL: replaces every data_args.template
    if template not in (None, "native"):
        m.ignore(f"global_template={template}", "prompts use the tokenizer's chat template (native)")
    response = src.take("response_length")
    if response is None and src.has("sequence_length"):
        response = src.take("sequence_length") - m.get("data.max_prompt_length")
    if response is not None:
        m.set("data.max_response_length", response, "response_length")
    if src.take("val_greedy", False):
        m.set(f"{R}.val_kwargs.do_sample", False, "val_greedy")
        m.set(f"{R}.val_kwargs.temperature", 0.0, "val_greedy")
    penalty = src.take("actor_infer.generating_args.repetition_penalty", 1.0)
    if penalty != 1.0:
        m.error("actor_infer.generating_args.repetition_penalty", f"{penalty!r}: not available (1.0 only)")
    import_rewards(m, src)
    track = src.take("track_with")
    if track is not None:
        m.set("trainer.logger", logger_sinks(m, "track_with", [track]), "track_with")
    keep = src.take("max_ckpt_to_keep")
    if keep is not None:
        m.set("trainer.max_actor_ckpt_to_keep", keep or None, "max_ckpt_to_keep")
    resume = src.take("resume_from_checkpoint")
    if isinstance(resume, str) and resume:
        m.set("trainer.resume_mode", "resume_path", "resume_from_checkpoint")
        m.set("trainer.resume_from_path", resume, "resume_from_checkpoint")
    elif resume is not None:
        m.set("trainer.resume_mode", "auto" if resume else "disable", "resume_from_checkpoint")


HARMLESS = {  # ROLL keys with no counterpart that change nothing computed -> why
    "ROLL's inference / reference engine settings (jaxrl_llm samples and scores with the trained model)": (
        "actor_infer.model_args.*", "reference.model_args.*", "actor_infer.training_args.*",
        "reference.training_args.*"),
    "ROLL recomputes it from the pipeline's own keys": (
        "*.generating_args.max_new_tokens", "*.generating_args.num_return_sequences",
        "actor_train.training_args.num_train_epochs"),
    "declared by ROLL's RLVR config and read by no worker (TOPR is actor_train.pg_variant: topr)": (
        "use_topr_loss", "use_topr_neg_loss_coef"),
    "not a field of ROLL's RLVR config (the file's own variable for ${...}; the worker reads actor_train.pg_variant)": (
        "pg_variant",),
    "not a field of ROLL's worker config, so ROLL reads it nowhere (the pipeline's eval_steps is read)": (
        "validation.eval_steps",),
    "not a field of ROLL's RLVR config (dacite drops unknown keys), so ROLL reads it nowhere": (
        "reward_norm", "reward_shift", "reward_scale"),
    "how ROLL hands a prompt's n samples to vLLM (n requests of one, or one request of n): the same samples": (
        "is_num_return_sequences_expand",),
    "data loading / logging / naming": ("*.preprocessing_num_workers", "*.data_args.template", "logging_steps",
                                        "render_save_dir", "*.model_args.attn_implementation",
                                        "*.model_args.flash_attn", "*.name"),
}
AGENTIC_KEYS = ("train_env_manager", "val_env_manager", "custom_envs", "env_manager")


def _validation_sampling(m: Mapper, src: Source) -> None:
    """ROLL validates with `validation.generating_args` over ROLL's defaults (sampling, not greedy)."""
    if not src.keys_under("validation.generating_args"):
        return
    knobs = {k: src.take(f"validation.generating_args.{k}", d) for k, d in ROLL_SAMPLING.items()}
    where = "validation.generating_args"
    greedy = not knobs["do_sample"] or knobs["temperature"] == 0 or m.origin.get(f"{R}.val_kwargs.do_sample") == \
        "val_greedy"
    m.set(f"{R}.val_kwargs.do_sample", not greedy, f"{where}.do_sample")
    m.set(f"{R}.val_kwargs.temperature", 0.0 if greedy else knobs["temperature"], f"{where}.temperature")
    m.set(f"{R}.val_kwargs.top_p", knobs["top_p"], f"{where}.top_p")
    m.set(f"{R}.val_kwargs.top_k", knobs["top_k"] or -1, f"{where}.top_k")
    n = src.take(f"{where}.num_return_sequences")
    if n is not None:
        m.set(f"{R}.val_kwargs.n", n, f"{where}.num_return_sequences")


def _same_targets(a: SourceValue, b: SourceValue) -> bool:
    """Two LoRA target settings naming the same projections (our `parse_target_modules`) of a standard decoder:
    'all-linear' also names DeepSeek's latent-attention and Qwen3.5's delta-net projections, which a Qwen / Llama
    model (ROLL's) lacks."""
    def standard(x: object) -> set[str]:
        return set(parse_target_modules(cast(Any, x))) - set(ARCH_MODULES)

    try:
        return standard(a) == standard(b)
    except ValueError:
        return False


def _lora(m: Mapper, src: Source) -> None:
    """`actor_train.model_args.lora_rank / lora_alpha / lora_target` -> our LoRA (the inference
    and reference roles' copies must agree: one model)."""
    rank = src.take("actor_train.model_args.lora_rank")
    for role in ("actor_infer", "reference"):
        for name in ("lora_rank", "lora_alpha", "lora_target"):
            other = src.take(f"{role}.model_args.{name}")
            mine = rank if name == "lora_rank" else src.peek(f"actor_train.model_args.{name}")
            if name == "lora_target" and other is not None and mine is not None and _same_targets(other, mine):
                continue  # e.g. all-linear and the seven projections it names
            if other is not None and other != mine:
                m.error(f"{role}.model_args.{name}", f"{other!r} differs from actor_train's {mine!r}: jaxrl_llm "
                                                     "samples with the model it trains")
    if not rank:
        for name in ("lora_alpha", "lora_target"):
            src.take(f"actor_train.model_args.{name}")
        return
    alpha = src.take("actor_train.model_args.lora_alpha")
    if alpha is None:
        m.error("actor_train.model_args.lora_alpha", "not given; set it (jaxrl_llm does not assume a default)")
    m.set_lora(rank, alpha, src.take("actor_train.model_args.lora_target", "all-linear"),
               ("actor_train.model_args.lora_rank", "actor_train.model_args.lora_alpha",
                "actor_train.model_args.lora_target"))


def _domains(m: Mapper, src: Source) -> None:
    """ROLL's per-domain mixture -> data.domains.probs, as shares that give ROLL's own counts (int(p * B) for
    each domain but the last listed, which takes the rest): one domain is plain sampling."""
    key = "actor_train.data_args.domain_interleave_probs"
    probs = {k[len(key) + 1:]: src.take(k) for k in src.keys_under(key) if k != key}
    if len(probs) > 1:
        batch = int(m.get("data.train_batch_size"))
        counts = {d: int(float(p) * batch) for d, p in list(probs.items())[:-1]}
        last = list(probs)[-1]
        counts[last] = batch - sum(counts.values())
        m.set("data.domains.probs", {d: c / batch for d, c in counts.items()}, key)
        sources = m.settings.get("data.domains.data_sources") or {}
        missing = [d for d in probs if d not in sources]
        if missing:
            m.error(f"{key}.{missing[0]}", f"no reward worker scores this domain (rewards: {', '.join(sources)})")
    val = "validation.data_args.domain_interleave_probs"
    for sub in src.keys_under(val):
        m.ignore(sub, "validation reads every row of its files, each scored by its domain's scorer")
        src.take(sub)
    for role in ("actor_train", "validation"):
        value = src.take(f"{role}.data_args.interleave_probs")
        if value is not None and str(value).strip() not in ("1", "1.0"):
            m.error(f"{role}.data_args.interleave_probs", f"{value!r}: a per-file sampling mixture is not "
                                                          "available (data.domains mixes by a column)")


def import_roll(data: dict[str, Any], m: Mapper) -> None:
    agentic = [k for k in AGENTIC_KEYS if k in data]
    if agentic:
        m.error(agentic[0], "a ROLL agentic pipeline (environment managers and their environments) is not "
                            "importable: jaxrl_llm's multi-turn rollouts take veRL's tool and interaction configs "
                            "(docs/agents.md)")
    src = Source(flatten(data, leaves=("rewards",)), m.source)
    for key, why in ERRORS.items():
        for sub in src.keys_under(key):
            value = src.drop(sub)
            if IS_SET(value) and not (key.endswith("generating_args.num_beams") and value == 1):
                m.error(sub, f"{value!r}: {why}")  # off: what jaxrl_llm computes, no line
    for key, ours in SIMPLE.items():
        if key in ROLL_DEFAULTS or not src.has(key):
            continue
        value = src.take(key)
        if value is not None:
            m.set(ours, value, key)
    if "trainer.seed" in m.settings:
        m.set("data.seed", m.settings["trainer.seed"], "seed")
    if m.settings.get("trainer.save_freq") == 0:
        m.set("trainer.save_freq", -1, "save_steps")
    ratio = src.take("async_generation_ratio", 0)
    if ratio:  # ROLL: generation runs `ratio` batches ahead of training (integers only) = our sync_offset
        if isinstance(ratio, bool) or not float(ratio).is_integer() or ratio < 0:
            m.error("async_generation_ratio", f"{ratio!r}: expected a whole number >= 0 (ROLL supports integers "
                                              "only)")
        m.set("synchronizer.sync_offset", int(ratio), "async_generation_ratio")
    _algorithm(m, src)
    _batch(m, src)  # before _roles, which takes the strategy keys _batch reads
    _lora(m, src)
    _roles(m, src)
    _data(m, src)
    _domains(m, src)
    _validation_sampling(m, src)
    for key in src.remaining():
        value = src.drop(key)
        head = key.split(".")[0]
        placement = any(part in key for part in ("strategy_args", "device_mapping", "infer_batch_size",
                                                 "num_gpus", "worker_cls", "system_envs", "offload", "profiler",
                                                 "rpc_timeout", "max_running_requests", "logging_dir")) \
            or head in ("defaults", "num_nodes", "checkpoint_config", "tracker_kwargs", "base_dir", "hydra")
        harmless = next((why for why, patterns in HARMLESS.items()
                         if any(fnmatch.fnmatchcase(key, p) for p in patterns)), None)
        leftover(m, key, value, PLACEMENT if placement else harmless)

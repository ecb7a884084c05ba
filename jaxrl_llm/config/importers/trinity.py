"""Trinity-RFT configs -> our tree, as Trinity's own "align with veRL" guide maps them.

Batch sizes (the guide): Trinity's `buffer.batch_size` tasks are explored per explorer step and
`synchronizer.sync_interval` explorer steps share one weight version, so veRL's
`data.train_batch_size = batch_size * sync_interval`; each trainer step is one optimizer step over
`buffer.train_batch_size` experiences (default `batch_size * repeat_times`), so
`ppo_mini_batch_size = train_batch_size / repeat_times` prompts. Explorer-step counters
(`total_steps`, `eval_interval`) are divided by `sync_interval`, trainer-step counters
(`save_interval`) by the optimizer steps per training step. So one jaxrl_llm step is one weight
version (our `synchronizer.sync_interval` stays 1), and Trinity's `sync_offset` (explorer steps
ahead of the trainer) becomes `synchronizer.sync_offset = ceil(sync_offset / sync_interval)`
jaxrl_llm steps (whole batches ahead; staleness bound: docs/async.md). Only `sync_style: fixed`
is available; another style is an error.

Algorithm functions left unset take Trinity's defaults for the `algorithm_type`
(trinity/algorithm/algorithm.py), e.g. GRPO's `kl_loss_fn: k2` with `kl_coef: 0.001`. The taskset
and workflow keys are in `trinity_data.py`; `trainer.trainer_config` is imported as veRL keys.
"""
from __future__ import annotations

import os
from typing import Any

from jaxrl_llm.config.importers.common import (
    PLACEMENT,
    Mapper,
    Source,
    flatten,
    int_or_error,
    is_off,
    leftover,
    load_yaml,
    logger_sinks,
    ratio_steps,
)
from jaxrl_llm.config.importers.trinity_data import import_tasksets, taskset_files
from jaxrl_llm.config.importers.trinity_judge import RUBRIC_WORKFLOWS, import_rubric_judge
from jaxrl_llm.config.importers.verl import context_parallel, import_verl_source, placement_only
from jaxrl_llm.config.overrides import OPEN_SECTIONS

TOP_LEVEL = ("algorithm", "model", "cluster", "buffer", "explorer", "synchronizer")

A = "actor_rollout_ref.actor"
_BASE = {"policy_loss_fn": "ppo", "kl_penalty_fn": "none", "kl_loss_fn": "k2", "entropy_loss_fn": "default"}
# algorithm_type -> Trinity's defaults for the functions left unset
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "ppo": {**_BASE, "repeat_times": 1, "advantage_fn": "ppo"},
    "grpo": {**_BASE, "repeat_times": 2, "advantage_fn": "grpo"},
    "dapo": {**_BASE, "repeat_times": 16, "advantage_fn": "grpo", "kl_loss_fn": "none"},
    "reinforceplusplus": {**_BASE, "repeat_times": 2, "advantage_fn": "reinforceplusplus"},
    "rloo": {**_BASE, "repeat_times": 2, "advantage_fn": "rloo"},
    "gspo": {**_BASE, "repeat_times": 2, "advantage_fn": "grpo", "policy_loss_fn": "gspo"},
    "cispo": {**_BASE, "repeat_times": 2, "advantage_fn": "grpo", "policy_loss_fn": "cispo"},
    "sapo": {**_BASE, "repeat_times": 2, "advantage_fn": "grpo", "policy_loss_fn": "sapo"},
    "m2po": {**_BASE, "repeat_times": 8, "advantage_fn": "grpo", "policy_loss_fn": "m2po", "kl_loss_fn": "none",
             "entropy_loss_fn": "none"},
    "multi_step_grpo": {**_BASE, "repeat_times": 8, "advantage_fn": "step_wise_grpo"},
}
# step_wise_grpo broadcasts each run's final-step GRPO advantage to its steps: with the single-turn workflows
# we import, a run is one step, so it is GRPO
ADVANTAGE_FNS = {"ppo": "gae", "grpo": "grpo", "reinforceplusplus": "reinforce_plus_plus", "rloo": "rloo",
                 "remax": "remax", "step_wise_grpo": "grpo"}
POLICY_LOSS_FNS = {"ppo": "vanilla", "gspo": "gspo", "cispo": "cispo", "sapo": "sapo", "m2po": "m2po"}
# Trinity's default_args of the policy losses whose defaults differ from ours
POLICY_LOSS_DEFAULT_ARGS = {"gspo": {"clip_range_low": 0.0003, "clip_range_high": 0.0004,
                                     "loss_agg_mode": "seq-mean-token-mean"},
                            "cispo": {"clip_range_low": 1.0, "clip_range_high": 0.28, "loss_agg_mode": "token-mean"},
                            "sapo": {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean"},
                            "m2po": {"m2_threshold": 0.04, "loss_agg_mode": "token-mean", "log_ratio_clip": 20.0}}
# losses whose aggregation veRL fixes: Trinity's own goes to policy_loss.loss_agg_mode (every loss takes one)
OWN_AGG = ("gspo", "sapo")
KL_FNS = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl", "abs": "abs"}
POLICY_ARGS = {"clip_range": f"{A}.clip_ratio", "clip_range_low": f"{A}.clip_ratio_low",
               "clip_range_high": f"{A}.clip_ratio_high", "clip_ratio_c": f"{A}.clip_ratio_c",
               "loss_agg_mode": f"{A}.loss_agg_mode", "tau_pos": f"{A}.tau_pos", "tau_neg": f"{A}.tau_neg",
               "m2_threshold": f"{A}.m2_threshold"}
OPTIM_ARGS = {"lr": "lr", "lr_warmup_steps": "lr_warmup_steps", "lr_warmup_steps_ratio": "lr_warmup_steps_ratio",
              "min_lr_ratio": "min_lr_ratio", "warmup_style": "lr_scheduler_type",
              "lr_scheduler_type": "lr_scheduler_type", "weight_decay": "weight_decay", "betas": "betas",
              "num_cycles": "num_cycles"}
# keys Trinity computes itself: ignored inside trainer.trainer_config (veRL names)
TRINITY_OWNED = ("data", "actor_rollout_ref.rollout", "actor_rollout_ref.actor.ppo_mini_batch_size",
                 "critic.ppo_mini_batch_size", "actor_rollout_ref.model.path", "critic.model.path",
                 "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir",
                 "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
                 "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.logger", "algorithm.adv_estimator",
                 "algorithm.use_kl_in_reward", "actor_rollout_ref.actor.use_kl_loss")


def _fn_args(m: Mapper, src: Source, name: str) -> dict[str, Any]:
    prefix = f"algorithm.{name}_args"
    args = {k[len(prefix) + 1:]: src.take(k) for k in src.keys_under(prefix) if k != prefix}
    src.take(prefix)  # an empty / null args section
    return {k: v for k, v in args.items() if v is not None}


def _unknown_args(m: Mapper, where: str, args: dict[str, Any], known: set[str]) -> None:
    for key, value in args.items():
        if key not in known and value not in (False, 0, "", {}, []):
            m.error(f"algorithm.{where}.{key}", f"{value!r}: not available in jaxrl_llm")


def _algorithm(m: Mapper, src: Source) -> None:
    kind = src.take("algorithm.algorithm_type", "ppo")
    if kind not in ALGORITHM_DEFAULTS:
        m.error("algorithm.algorithm_type", f"{kind!r}: jaxrl_llm has {', '.join(ALGORITHM_DEFAULTS)} "
                                            "(no SFT / DPO / mixed / off-policy algorithm types)")
    defaults = ALGORITHM_DEFAULTS[kind]
    fn = {k: src.take(f"algorithm.{k}") or v for k, v in defaults.items() if k != "repeat_times"}
    m.set("actor_rollout_ref.rollout.n", src.take("algorithm.repeat_times", defaults["repeat_times"]),
          "algorithm.repeat_times")

    adv, src_key = fn["advantage_fn"], "algorithm.advantage_fn"
    if adv not in ADVANTAGE_FNS:
        m.error(src_key, f"{adv!r}: jaxrl_llm has {', '.join(ADVANTAGE_FNS)} (as veRL's estimators)")
    m.set("algorithm.adv_estimator", ADVANTAGE_FNS[adv], src_key)
    args = _fn_args(m, src, "advantage_fn")
    for name in ("gamma", "lam"):
        if name in args:
            m.set(f"algorithm.{name}", args.pop(name), f"algorithm.advantage_fn_args.{name}")
    if "epsilon" in args:
        m.ignore("algorithm.advantage_fn_args.epsilon", "GRPO's std epsilon is fixed at 1e-6 (veRL's)")
        args.pop("epsilon")
    threshold = args.pop("std_threshold", args.pop("reward_std_threshold", None))
    if threshold is not None:  # Trinity skips a group whose scores' std is <= the threshold; its queue refills
        key = "algorithm.advantage_fn_args.std_threshold"
        if not 0 <= float(threshold) < ZERO_STD:
            m.error(key, f"{threshold!r}: the group filter drops zero-variance groups only (a threshold below "
                         f"{ZERO_STD:g} keeps the same groups but those whose std falls under it)")
        if args.pop("duplicate_experiences", False):
            m.error("algorithm.advantage_fn_args.duplicate_experiences", "True: duplicating the kept groups' "
                                                                          "experiences is not available")
        m.set("algorithm.filter_groups.enable", True, key)
        m.set("algorithm.filter_groups.metric", GROUP_FILTERS["reward_std_filter"], key)
        if threshold:
            m.ignore(f"{key}={threshold}", f"groups of std 0 are dropped; a group whose std is in (0, {threshold}] "
                                           "is kept here and skipped by Trinity")
    if adv == "step_wise_grpo":
        if args.pop("std_cal_level", "group") != "group":
            m.error("algorithm.advantage_fn_args.std_cal_level", "only 'group': GRPO's std is its group's")
        if args.pop("enable_step_norm", False):
            m.ignore("algorithm.advantage_fn_args.enable_step_norm", "a single-turn run is one step: dividing by "
                                                                     "its step count (1) changes nothing")
    _unknown_args(m, "advantage_fn_args", args, set())

    loss = fn["policy_loss_fn"]
    if loss not in POLICY_LOSS_FNS:
        m.error("algorithm.policy_loss_fn", f"{loss!r}: jaxrl_llm has {', '.join(POLICY_LOSS_FNS)}")
    m.set(f"{A}.policy_loss.loss_mode", POLICY_LOSS_FNS[loss], "algorithm.policy_loss_fn")
    args = {**POLICY_LOSS_DEFAULT_ARGS.get(loss, {}), **_fn_args(m, src, "policy_loss_fn")}  # Trinity's defaults
    if loss in OWN_AGG and "loss_agg_mode" in args:  # Trinity's gspo / sapo aggregate as their args say
        m.set(f"{A}.policy_loss.loss_agg_mode", args.pop("loss_agg_mode"),
              "algorithm.policy_loss_fn_args.loss_agg_mode")
    if loss == "m2po":
        _m2po(m, src, args)
    if args.pop("enable_sequence_masking", False):
        m.error("algorithm.policy_loss_fn_args.enable_sequence_masking", "True: sequence masking is not available")
    if "delta" in args:
        args.pop("delta")
        m.ignore("algorithm.policy_loss_fn_args.delta", "used only with enable_sequence_masking")
    for name in [k for k in args if k in POLICY_ARGS]:
        m.set(POLICY_ARGS[name], args.pop(name), f"algorithm.policy_loss_fn_args.{name}")
    _unknown_args(m, "policy_loss_fn_args", args, set())

    _kl(m, src, fn["kl_loss_fn"], "kl_loss_fn")
    _kl(m, src, fn["kl_penalty_fn"], "kl_penalty_fn")
    entropy = fn["entropy_loss_fn"]
    args = _fn_args(m, src, "entropy_loss_fn")
    if entropy not in ("default", "basic", "none"):
        m.error("algorithm.entropy_loss_fn", f"{entropy!r}: jaxrl_llm has an entropy bonus only (default / none)")
    m.set(f"{A}.entropy_coeff", 0.0 if entropy == "none" else args.pop("entropy_coef", 0.0),
          "algorithm.entropy_loss_fn")
    _unknown_args(m, "entropy_loss_fn_args", args, set())
    _optimizer(m, src)
    # the sampler's log-probs as the old ones: our bypass mode; m2po needs it (Trinity's default for it)
    bypass = src.take("algorithm.bypass_old_logprobs", True if loss == "m2po" else None)
    if loss == "m2po" and not bypass:
        m.error("algorithm.bypass_old_logprobs", "False: m2po needs the sampler's log-probs as the old ones (Trinity "
                                                 "refuses it too)")
    if bypass is not None:
        m.set("algorithm.rollout_correction.bypass_mode", bool(bypass), "algorithm.bypass_old_logprobs")
    strategy = src.take("algorithm.sample_strategy")
    if strategy not in (None, "default", "warmup"):
        m.error("algorithm.sample_strategy", f"{strategy!r}: only on-policy sampling of the taskset is available")
    for key in src.keys_under("algorithm"):
        leftover(m, key, src.drop(key))


def _m2po(m: Mapper, src: Source, args: dict[str, Any]) -> None:
    """Trinity's m2po: the log-ratio clamp is fixed at 20 here (its `bypass_old_logprobs`: `_algorithm`)."""
    clip = args.pop("log_ratio_clip", 20.0)
    if float(clip) != 20.0:
        m.error("algorithm.policy_loss_fn_args.log_ratio_clip", f"{clip!r}: jaxrl_llm's m2po clamps the log-ratio at "
                                                                "20 (Trinity's default)")


def _kl(m: Mapper, src: Source, name: str, role: str) -> None:
    args = _fn_args(m, src, role)
    key = f"algorithm.{role}"
    in_loss = role == "kl_loss_fn"
    if name == "none":
        m.set(f"{A}.use_kl_loss" if in_loss else "algorithm.use_kl_in_reward", False, key)
        return
    if name not in KL_FNS:
        m.error(key, f"{name!r}: jaxrl_llm has {', '.join(KL_FNS)} (and none)")
    coef = args.pop("kl_coef", 0.001)
    adaptive = args.pop("adaptive", False)
    if in_loss:
        if adaptive:
            m.error(f"{key}_args.adaptive", "True: an adaptive KL-loss coefficient is not available")
        m.set(f"{A}.use_kl_loss", True, key)
        m.set(f"{A}.kl_loss_type", KL_FNS[name], key)
        m.set(f"{A}.kl_loss_coef", coef, f"{key}_args.kl_coef")
    else:
        m.set("algorithm.use_kl_in_reward", True, key)
        m.set("algorithm.kl_penalty", KL_FNS[name], key)
        m.set("algorithm.kl_ctrl.kl_coef", coef, f"{key}_args.kl_coef")
        m.set("algorithm.kl_ctrl.type", "adaptive" if adaptive else "fixed", f"{key}_args.adaptive")
        for arg in ("target_kl", "horizon"):
            if arg in args:
                m.set(f"algorithm.kl_ctrl.{arg}", args.pop(arg), f"{key}_args.{arg}")
    _unknown_args(m, f"{role}_args", args, set())


def _optimizer(m: Mapper, src: Source) -> None:
    for key in src.keys_under("algorithm.optimizer"):
        name, value = key.rsplit(".", 1)[1], src.take(key)
        if name in OPTIM_ARGS and value is not None:
            m.set(f"{A}.optim.{OPTIM_ARGS[name]}", value, key)
        elif name in ("optimizer_type", "optimizer") and str(value).lower() not in ("adam", "adamw"):
            m.error(key, f"{value!r}: jaxrl_llm trains with AdamW only")
        elif name == "clip_grad" and value is not None:
            m.set(f"{A}.grad_clip", value, key)
        else:
            m.ignore(key, "derived by jaxrl_llm" if name == "total_training_steps" else "no counterpart in jaxrl_llm")


def _schedule(m: Mapper, src: Source) -> None:
    """Batch sizes and step counters (see the module docstring)."""
    style, offset = src.take("synchronizer.sync_style", "fixed"), src.take("synchronizer.sync_offset", 0)
    if style != "fixed":
        m.error("synchronizer.sync_style", f"{style!r}: only the fixed schedule is available")
    k = int_or_error(m, "synchronizer.sync_interval", src.take("synchronizer.sync_interval", 1))
    offset = int_or_error(m, "synchronizer.sync_offset", offset)
    if offset < 0:
        m.error("synchronizer.sync_offset", f"{offset}: must be >= 0")
    if offset:  # explorer steps ahead -> whole jaxrl_llm steps (k explorer steps each) ahead, rounded up
        m.set("synchronizer.sync_offset", -(-offset // max(k, 1)), "synchronizer.sync_offset")
    n = m.get("actor_rollout_ref.rollout.n")
    batch = int_or_error(m, "buffer.batch_size", src.take("buffer.batch_size", 1))
    experiences = src.take("buffer.train_batch_size") or batch * n
    if experiences % n:
        m.error("buffer.train_batch_size", f"{experiences}: not whole groups of repeat_times={n}")
    mini = experiences // n
    if (batch * k) % mini:
        m.error("buffer.train_batch_size", f"{experiences} experiences = {mini} tasks do not divide "
                                           f"batch_size x sync_interval = {batch * k}")
    m.set("data.train_batch_size", batch * k, "buffer.batch_size")
    m.set(f"{A}.ppo_mini_batch_size", mini, "buffer.train_batch_size")
    optimizer_steps = batch * k // mini
    for role in (A, "critic"):  # Trinity counts warmup in trainer steps (one optimizer step each)
        key = f"{role}.optim.lr_warmup_steps"
        if key in m.settings and m.settings[key] > 0:
            m.set(key, ratio_steps(m.settings[key], optimizer_steps), m.origin[key])
    if src.has("buffer.total_epochs"):
        m.set("trainer.total_epochs", src.take("buffer.total_epochs"), "buffer.total_epochs")
    total = src.take("buffer.total_steps")
    if total is not None:
        if total % k:
            m.error("buffer.total_steps", f"{total}: not a multiple of sync_interval={k} (one jaxrl_llm step "
                                          f"= {k} explorer steps)")
        m.set("trainer.total_training_steps", total // k, "buffer.total_steps")
    if src.has("explorer.eval_interval"):
        interval = src.take("explorer.eval_interval")
        m.set("trainer.test_freq", max(interval // k, 1), "explorer.eval_interval")
    save = src.take("trainer.save_interval")
    if save is not None:
        m.set("trainer.save_freq", ratio_steps(save, optimizer_steps) if save > 0 else -1, "trainer.save_interval")


def _model(m: Mapper, src: Source) -> None:
    simple = {"model.model_path": "actor_rollout_ref.model.path", "model.critic_model_path": "critic.model.path",
              "model.max_prompt_tokens": "data.max_prompt_length",
              "model.max_response_tokens": "data.max_response_length",
              "model.enable_prompt_truncation": "data.filter_overlong_prompts",
              "model.temperature": "actor_rollout_ref.rollout.temperature",
              "model.top_p": "actor_rollout_ref.rollout.top_p", "model.top_k": "actor_rollout_ref.rollout.top_k",
              "explorer.eval_on_startup": "trainer.val_before_train",
              "explorer.rollout_model.ignore_eos": "actor_rollout_ref.rollout.ignore_eos",
              "trainer.actor_grad_clip": f"{A}.grad_clip", "trainer.grad_clip": f"{A}.grad_clip",
              "trainer.use_dynamic_bsz": f"{A}.use_dynamic_bsz",
              "trainer.max_token_len_per_gpu": f"{A}.ppo_max_token_len_per_device",
              "trainer.ppo_max_token_len_per_gpu": f"{A}.ppo_max_token_len_per_device",
              "project": "trainer.project_name", "name": "trainer.experiment_name"}
    for key, ours in simple.items():
        value = src.take(key)
        if value not in (None, ""):
            m.set(ours, value, key)
    sp = src.take("trainer.ulysses_sequence_parallel_size")
    budget = f"{A}.ppo_max_token_len_per_device"
    if isinstance(sp, int) and sp > 1:  # veRL's Ulysses groups: mesh.context, budgets per group (verl.py's rule)
        context_parallel(m, "trainer.ulysses_sequence_parallel_size", sp)
        if budget in m.settings:
            m.set(budget, m.settings[budget] * sp, m.origin[budget])
    max_len, response = src.take("model.max_model_len"), m.get("data.max_response_length")
    if max_len is not None and "data.max_prompt_length" not in m.settings:  # Trinity: the prompt gets the rest
        if max_len <= response:
            m.error("model.max_model_len", f"{max_len}: leaves no prompt tokens beside max_response_tokens={response}")
        m.set("data.max_prompt_length", max_len - response, "model.max_model_len")
    for key in ("model.rope_theta", "model.rope_scaling"):
        if src.peek(key) is not None:
            m.set(f"actor_rollout_ref.model.override_config.{key[6:]}", src.take(key), key)
    keep = src.take("trainer.max_checkpoints_to_keep")
    if keep is not None:  # one checkpoint holds actor and critic
        m.set("trainer.max_actor_ckpt_to_keep", keep, "trainer.max_checkpoints_to_keep")
    if src.has("explorer.rollout_model.tensor_parallel_size"):  # the inference engine's layout (verl.py's rule)
        placement_only(m, "explorer.rollout_model.tensor_parallel_size",
                       src.take("explorer.rollout_model.tensor_parallel_size"))
    root = src.take("checkpoint_root_dir")
    if root:
        parts = [root, m.get("trainer.project_name"), src.take("group") or "", m.get("trainer.experiment_name")]
        m.set("trainer.default_local_dir", os.path.join(*[p for p in parts if p]), "checkpoint_root_dir")
    resume = src.take("continue_from_checkpoint")
    if resume is not None:
        m.set("trainer.resume_mode", "auto" if resume else "disable", "continue_from_checkpoint")
    monitor = src.take("monitor.monitor_type")
    if monitor is not None:
        m.set("trainer.logger", logger_sinks(m, "monitor.monitor_type", [monitor]), "monitor.monitor_type")


ZERO_STD = 1e-3  # the largest std_threshold read as "zero-variance groups" (see _algorithm)
ERRORS = {  # key -> (is it set?, why)
    "mode": (lambda v: v not in (None, "both"), "only mode 'both' (explore and train together) is available"),
    "model.min_response_tokens": (lambda v: v not in (None, 0, 1), "a minimum response length is not available"),
    # true is the Qwen3 template's own default (and other templates ignore the flag): only false changes the prompt
    "explorer.rollout_model.enable_thinking": (lambda v: v is False, "chat-template kwargs are not available, and "
                                               "enable_thinking: false changes what a Qwen3 template renders (true, "
                                               "its own default, is accepted)"),
    "model.max_token_len": (lambda v: v is not None, "not a field of Trinity's ModelConfig (Trinity's loader "
                                                     "refuses it too); set model.max_model_len"),
    "data_processor.task_pipeline": (bool, "task pipelines (Data-Juicer) are not available"),
    "stages": (bool, "multi-stage runs are not available"),
}


def _included(m: Mapper, path: str, key: str, name: str) -> str:
    """An included file: as Trinity reads it, from the working directory (Trinity's repository root);
    else beside the including file."""
    for candidate in (os.path.expanduser(name), os.path.join(os.path.dirname(path), name)):
        if os.path.isfile(candidate):
            return candidate
    m.error(key, f"{name!r}: the included file is not there (read from the working directory {os.getcwd()}, as "
                 f"Trinity does, and beside {path})")


def _lora(m: Mapper, src: Source) -> None:
    """Trinity's `model.lora_configs` (one adapter: name, lora_rank, lora_alpha, target_modules)."""
    configs = src.take("model.lora_configs")
    if not configs:
        return
    if not isinstance(configs, list) or len(configs) != 1 or not isinstance(configs[0], dict):
        m.error("model.lora_configs", f"{configs!r}: jaxrl_llm trains one LoRA adapter (a list of one)")
    lora = dict(configs[0])
    lora.pop("name", None)
    for name in ("lora_rank", "lora_alpha"):
        if name not in lora:  # Trinity's defaults have changed between versions: not assumed
            m.error(f"model.lora_configs.{name}", "not given; set it (jaxrl_llm does not assume a Trinity version's "
                                                  "default)")
    m.set_lora(lora.pop("lora_rank"), lora.pop("lora_alpha"), lora.pop("target_modules", "all-linear"),
               ("model.lora_configs.lora_rank", "model.lora_configs.lora_alpha", "model.lora_configs.target_modules"))
    if "lora_dropout" in lora:
        m.set("actor_rollout_ref.model.lora_dropout", float(lora.pop("lora_dropout")),
              "model.lora_configs.lora_dropout")
    for name, value in lora.items():
        if not is_off(value):
            m.error(f"model.lora_configs.{name}", f"{value!r}: not available for jaxrl_llm's LoRA (rank, alpha, "
                                                  "target_modules)")


# Trinity's experience operators that are jaxrl_llm's DAPO group filter (drop a task's group when its
# rewards / accuracies do not vary; jaxrl_llm then samples more groups to refill the batch, as veRL's DAPO)
GROUP_FILTERS = {"reward_std_filter": "seq_reward", "dapo_dynamic_sampling": "acc"}


def _operators(m: Mapper, src: Source) -> None:
    operators = src.take("data_processor.experience_pipeline.operators") or []
    key = "data_processor.experience_pipeline.operators"
    for i, op in enumerate(operators):
        name = op.get("name") if isinstance(op, dict) else op
        args = dict(op.get("args") or {}) if isinstance(op, dict) else {}
        if name not in GROUP_FILTERS:
            m.error(f"{key}[{i}].name", f"{name!r}: jaxrl_llm has the DAPO group filter only "
                                        f"({', '.join(GROUP_FILTERS)})")
        threshold = args.pop("threshold", args.pop("correct_threshold", 0.0))
        if threshold not in (0, 0.0):
            m.error(f"{key}[{i}].args.threshold", f"{threshold!r}: the group filter drops zero-variance groups only")
        m.set("algorithm.filter_groups.enable", True, f"{key}[{i}]")
        m.set("algorithm.filter_groups.metric", GROUP_FILTERS[name], f"{key}[{i}]")


WARMUP = "buffer.trainer_input.sft_warmup_dataset"
# the SFT warm-up dataset's format keys -> the sft section's (its own columns: the taskset's stay with RL)
WARMUP_FORMAT = {"prompt_key": "sft.prompt_key", "messages_key": "sft.messages_key", "response_key": "sft.response_key",
                 "tools_key": "sft.tools_key", "enable_thinking_key": "sft.enable_thinking_key"}


def _sft_warmup(m: Mapper, src: Source) -> None:
    """`buffer.trainer_input.sft_warmup_steps` / `sft_warmup_dataset` -> sft.warmup_steps / warmup_files and the
    dataset's columns (`format.prompt_type`: messages -> sft.multiturn, plaintext -> prompt + response)."""
    steps = src.take("buffer.trainer_input.sft_warmup_steps")
    dataset = {k[len(WARMUP) + 1:]: src.take(k) for k in src.keys_under(WARMUP)}
    if steps:
        m.set("sft.warmup_steps", int_or_error(m, "buffer.trainer_input.sft_warmup_steps", steps),
              "buffer.trainer_input.sft_warmup_steps")
    if not dataset or not any(v is not None for v in dataset.values()):
        return
    if dataset.get("storage_type", "file") not in ("file", None):
        m.error(f"{WARMUP}.storage_type", f"{dataset['storage_type']!r}: only file datasets are available")
    if not dataset.get("path"):
        m.error(f"{WARMUP}.path", "missing: the SFT warm-up dataset's file or folder")
    m.set("sft.warmup_files", taskset_files(dataset["path"], dataset.get("split") or "train",
                                            dataset.get("subset_name")), f"{WARMUP}.path")
    kind = dataset.get("format.prompt_type", "messages")
    if kind not in ("messages", "plaintext"):
        m.error(f"{WARMUP}.format.prompt_type", f"{kind!r}: SFT rows are messages or plaintext (prompt + response)")
    m.set("sft.multiturn", kind == "messages", f"{WARMUP}.format.prompt_type")
    for name, ours in WARMUP_FORMAT.items():
        if dataset.get(f"format.{name}") is not None:
            m.set(ours, dataset[f"format.{name}"], f"{WARMUP}.format.{name}")
    for key in dataset:
        if key not in ("path", "storage_type", "split", "subset_name", "name", "format.prompt_type") and not (
                key.startswith("format.") and key[len("format."):] in WARMUP_FORMAT):
            leftover(m, f"{WARMUP}.{key}", dataset[key])


def import_trinity(data: dict[str, Any], m: Mapper, path: str) -> None:
    trainer = data.get("trainer")
    trainer_config = trainer.pop("trainer_config", None) if isinstance(trainer, dict) else None
    src = Source(flatten(data, leaves=("buffer.explorer_input.taskset.rollout_args", "model.lora_configs",
                                       "data_processor.experience_pipeline.operators")), m.source)
    kind = src.peek("algorithm.algorithm_type", "ppo")
    if kind not in ALGORITHM_DEFAULTS:  # before the mode / SFT keys: the algorithm is the real difference
        m.error("algorithm.algorithm_type", f"{kind!r}: jaxrl_llm has {', '.join(ALGORITHM_DEFAULTS)} "
                                            "(no SFT / DPO / mixed / off-policy algorithm types)")
    for key, (is_set, why) in ERRORS.items():
        for sub in src.keys_under(key):
            if is_set(src.peek(sub)):
                m.error(sub, f"{src.peek(sub)!r}: {why}")
    verl_path = src.take("trainer.trainer_config_path")
    if verl_path:  # veRL keys first: Trinity's own keys below override them, as in Trinity
        full = _included(m, path, "trainer.trainer_config_path", verl_path)
        vsrc = Source(flatten(load_yaml(full), leaves=OPEN_SECTIONS), m.source, f"{verl_path}:")
        import_verl_source(m, vsrc, skip=TRINITY_OWNED)
    if isinstance(trainer_config, dict):
        vsrc = Source(flatten(trainer_config, leaves=OPEN_SECTIONS), m.source, "trainer.trainer_config.")
        import_verl_source(m, vsrc, skip=TRINITY_OWNED)
    _algorithm(m, src)
    _model(m, src)
    _lora(m, src)
    _operators(m, src)
    _schedule(m, src)
    workflow = src.peek("buffer.explorer_input.default_workflow_type")
    auxiliary = src.take("explorer.auxiliary_models") or []
    if workflow in RUBRIC_WORKFLOWS:
        import_rubric_judge(m, auxiliary, str(workflow))
    elif auxiliary:
        m.error("explorer.auxiliary_models", f"{auxiliary!r}: auxiliary models serve Trinity's judging workflows; "
                                             f"of those, {', '.join(RUBRIC_WORKFLOWS)} is built in (RULER and custom "
                                             f"workflows are not), and this file's workflow is {workflow!r}")
    import_tasksets(m, src, os.path.dirname(path))
    _sft_warmup(m, src)
    for key in src.remaining():
        value = src.drop(key)
        head = key.split(".")[0]
        placement = head in ("cluster", "synchronizer", "log", "service", "ray_namespace", "monitor") or \
            key.startswith(("explorer.rollout_model.", "explorer.runner", "explorer.max_", "trainer.trainer_",
                            "trainer.ulysses", "buffer.trainer_input.experience_buffer", "data_processor."))
        leftover(m, key, value, PLACEMENT if placement else None)

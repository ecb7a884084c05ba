"""TRL `GRPOConfig` / `RLOOConfig` arguments (command-line flags or a YAML file) -> our tree.

Flags are overrides: only the arguments given are translated, on top of the config they follow.
A TRL YAML file is a whole TRL run (`trl grpo --config FILE` / `trl rloo --config FILE`): it selects
the trainer (`--import_format=trl_grpo` / `trl_rloo`; `trl` decides from the file: RLOO when it has
the older RLOOTrainer's arguments or its name says rloo, else GRPO), turns off KL-in-reward, and
the arguments it leaves out take TRL's defaults (`GRPO_DEFAULTS` / `RLOO_DEFAULTS`, TRL's
GRPOConfig / RLOOConfig as of mid-2026: e.g. 8 generations and the `dapo` loss for GRPO, 2
generations and beta 0.05 for RLOO, a linear learning-rate decay).

RLOO is `algorithm.adv_estimator=trl_rloo` (TRL's sequence-level RLOO, `beta` the coefficient of the
KL folded into each sequence's reward); the older RLOOTrainer's arguments (`rloo_k`, `kl_coef`,
`num_ppo_epochs`, `total_episodes`, ...) map there too. `--use_peft` with its `lora_*` arguments
is LoRA. open-r1's recipe keys (`system_prompt`, `chat_template`, `dataset_prompt_column`) map to
data.*; its reward functions by name with `reward_weights` and their parameters (`cosine_*`,
`repetition_*`, `code_language`) map to custom_reward_function.* (rewards/named.py: accuracy is the
row's scorer per data_source or a custom_reward_function); the ones that need open-r1's judge servers
(`cf_code`, `ioi_code`) are refused. Batch sizes and step counters: `trl_batch.py`.
"""
from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from typing import Any

from jaxrl_llm.config.importers.common import PLACEMENT, Mapper, leftover, logger_sinks
from jaxrl_llm.config.importers.trl_batch import map_batch, map_steps
from jaxrl_llm.config.overrides import parse_value
from jaxrl_llm.config.schema import ConfigError

A, R, M = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
SIMPLE = {
    "learning_rate": f"{A}.optim.lr", "weight_decay": f"{A}.optim.weight_decay", "adam_epsilon": f"{A}.optim.eps",
    "max_grad_norm": f"{A}.grad_clip", "warmup_ratio": f"{A}.optim.lr_warmup_steps_ratio",
    "temperature": f"{R}.temperature", "top_p": f"{R}.top_p",
    "data_seed": "data.seed", "output_dir": "trainer.default_local_dir", "run_name": "trainer.experiment_name",
    "num_sample_generations": "trainer.log_val_generations", "missing_eos_penalty": "reward_model.missing_eos_penalty",
    "model_name_or_path": f"{M}.path", "sft_model_path": f"{M}.path", "shuffle_dataset": "data.shuffle",
    "dataloader_num_workers": "data.dataloader_num_workers", "eval_on_start": "trainer.val_before_train",
    "max_completion_length": "data.max_response_length", "response_length": "data.max_response_length",
    "num_generations": f"{R}.n", "rloo_k": f"{R}.n", "num_iterations": f"{A}.ppo_epochs",
    "num_ppo_epochs": f"{A}.ppo_epochs", "kl_coef": "algorithm.kl_ctrl.kl_coef",
    "normalize_reward": "algorithm.trl_rloo.normalize_reward",
    "reward_clip_range": "algorithm.trl_rloo.reward_clip_range",
    "normalize_advantage": "algorithm.trl_rloo.normalize_advantage",
    "token_level_kl": "algorithm.trl_rloo.token_level_kl",
    "mask_truncated_completions": "algorithm.mask_truncated_completions",
}
# the older RLOOTrainer's arguments (sequence-level RLOO, its own batch arithmetic)
RLOO_MODE = ("rloo_k", "kl_coef", "cliprange", "normalize_reward", "normalize_advantage",
             "token_level_kl", "num_ppo_epochs", "num_mini_batches", "total_episodes", "whiten_rewards")
GRPO_ONLY = ("delta", "loss_type", "scale_rewards", "importance_sampling_level")  # not RLOOConfig arguments
# TRL's defaults (GRPOConfig / RLOOConfig and transformers' TrainingArguments, mid-2026) for a whole-run file
_TRAINING_DEFAULTS = {"learning_rate": 1e-6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                      "num_train_epochs": 3, "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "weight_decay": 0.0,
                      "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
                      "bf16": True, "gradient_checkpointing": True, "max_completion_length": 512,
                      "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_iterations": 1, "epsilon": 0.2}
GRPO_DEFAULTS = {**_TRAINING_DEFAULTS, "num_generations": 8, "beta": 0.0, "loss_type": "dapo", "scale_rewards": "group"}
RLOO_DEFAULTS = {**_TRAINING_DEFAULTS, "num_generations": 2, "beta": 0.05}
# PEFT's default LoRA targets of the architectures jaxrl_llm loads (Llama, Qwen2/3, Mistral)
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]
# open-r1's reward functions: accuracy is the row's scorer (per data_source, or custom_reward_function.path);
# the others are rewards/named.py's; these run competition checkers on open-r1's Piston / Morph servers
ACCURACY_REWARDS = ("accuracy", "accuracy_reward")
SERVER_REWARDS = ("cf_code", "ioi_code")
# open-r1's reward-function arguments (GRPOScriptArguments)
OPENR1_ARGS = ("cosine_min_value_wrong", "cosine_max_value_wrong", "cosine_min_value_correct",
               "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams", "repetition_max_penalty",
               "code_language")
LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
              "dr_grpo": "seq-mean-token-sum-norm"}
SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "cosine": "cosine",
             "cosine_with_min_lr": "cosine", "linear": "linear"}
ERRORS = {  # argument -> (is its value unsupported?, why)
    "repetition_penalty": (lambda v: v not in (None, 1, 1.0), "a repetition penalty is not available (1.0 only)"),
    "min_p": (lambda v: v not in (None, 0, 0.0), "min-p sampling is not available"),
    "top_entropy_quantile": (lambda v: v not in (None, 1, 1.0), "entropy-quantile token masking is not available"),
    "sync_ref_model": (bool, "syncing the reference model to the policy is not available"),
    "whiten_rewards": (bool, "reward whitening is not available"),
    "generation_kwargs": (bool, "extra generation arguments are not available"),
    "chat_template_kwargs": (bool, "chat-template arguments are not available"),
    "use_rslora": (bool, "rank-stabilised LoRA scaling is not available (alpha / rank only)"),
    "use_dora": (bool, "DoRA is not available (plain LoRA only)"),
    "lora_modules_to_save": (bool, "fully trained extra modules beside LoRA are not available"),
    "load_in_4bit": (bool, "quantized (QLoRA) base weights are not available"),
    "load_in_8bit": (bool, "quantized base weights are not available"),
}
IGNORED = {  # patterns -> reason
    PLACEMENT: ("use_vllm", "vllm_*", "ds3_*", "deepspeed", "fsdp*", "ddp_*", "dataloader_*", "torch_*", "tf32",
                "use_liger*", "liger_*", "local_rank", "gradient_checkpointing_kwargs", "cache_implementation",
                "model_init_kwargs", "use_cpu", "no_cuda", "half_precision_backend", "fp16_*", "bf16_full_eval",
                "per_device_eval_batch_size", "eval_accumulation_steps", "local_rollout_forward_batch_size",
                "ray_scope", "accelerator_config", "use_transformers_paged", "average_tokens_across_devices",
                "auto_find_batch_size", "dataset_num_proc", "cast_lm_head_to_fp32", "torch_compile*",
                "attn_implementation", "torch_dtype", "dtype", "trust_remote_code", "world_size"),
    "logging / hub / bookkeeping": ("push_to_hub", "hub_*", "logging_*", "log_*", "disable_tqdm",
                                    "remove_unused_columns", "overwrite_output_dir", "do_train", "do_eval",
                                    "do_predict", "save_safetensors", "save_only_model", "save_on_each_node",
                                    "num_completions_to_print", "wandb_*", "include_*", "exp_name",
                                    "resume_from_checkpoint", "skip_memory_metrics", "label_names"),
    "data comes from data.train_files / data.val_files (local files; jaxrl_llm never downloads)": (
        "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "dataset_streaming",
        "dataset_mixture", "dataset_num_proc", "dataset_kwargs"),
    "the policy's own model (no separate reward model path here)": ("reward_model_name_or_path",),
    "the model is the local folder or file model_name_or_path names (jaxrl_llm never downloads; a revision is the "
    "snapshot that folder holds)": ("model_revision",),
    "code runs in the local sandbox (jaxrl_llm.sandbox), every test case of a row": (
        "code_provider", "e2b_router_url", "morph_router_url", "parallel_code_exec_per_proc",
        "code_eval_test_batch_size", "code_eval_scoring_mode"),
    "PEFT bookkeeping": ("lora_task_type",),
    "jaxrl_llm's models have no dropout": ("disable_dropout",),
    "jaxrl_llm stops at EOS (and rollout.stop_token_ids)": ("stop_token",),
}


def parse_trl_args(argv: Sequence[str]) -> dict[str, Any]:
    """`--name=value`, `--name value [value ...]`, `--flag` (true) and `--no_flag` (false) -> a dict."""
    args: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        item = argv[i]
        if not item.startswith("--") or item == "--":
            raise ConfigError(f"TRL flags: {item!r} is not a --name=value argument")
        body = item[2:]
        if "=" in body:
            name, text = body.split("=", 1)
            args[name] = parse_value(text)
        else:
            values = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("--") and "=" not in argv[i + 1]:
                values.append(parse_value(argv[i + 1]))
                i += 1
            if values:
                args[body] = values[0] if len(values) == 1 else values
            elif body.startswith("no_"):
                args[body[3:]] = False
            else:
                args[body] = True
        i += 1
    return args


def _clip(m: Mapper, args: dict[str, Any], key: str) -> None:
    eps = args[key]
    m.set(f"{A}.clip_ratio", eps, key)
    m.set(f"{A}.clip_ratio_low", eps, key)
    m.set(f"{A}.clip_ratio_high", args.get("epsilon_high") or eps, "epsilon_high" if "epsilon_high" in args else key)


def _special(m: Mapper, args: dict[str, Any]) -> None:
    get = args.get
    if "top_k" in args:
        m.set(f"{R}.top_k", get("top_k") or -1, "top_k")
    if "beta" in args:
        m.set(f"{A}.use_kl_loss", bool(get("beta")), "beta")
        if get("beta"):
            m.set(f"{A}.kl_loss_coef", get("beta"), "beta")
            m.set(f"{A}.kl_loss_type", "low_var_kl", "beta")  # TRL's per-token KL is k3
    for key in ("epsilon", "cliprange"):
        if key in args:
            _clip(m, args, key)
    if "epsilon_high" in args and "epsilon" not in args:
        m.set(f"{A}.clip_ratio_high", get("epsilon_high"), "epsilon_high")
    if get("delta") is not None:  # TRL clamps the unclipped ratio at delta = dual clip with c = delta
        high = m.get(f"{A}.clip_ratio_high") or m.get(f"{A}.clip_ratio")
        if get("delta") <= 1 + high:
            m.error("delta", f"{get('delta')!r}: equals dual clip only when delta > 1 + epsilon_high ({1 + high})")
        m.set(f"{A}.clip_ratio_c", get("delta"), "delta")
    if "loss_type" in args:
        loss_type = get("loss_type")
        if not isinstance(loss_type, str) or loss_type not in LOSS_TYPES:
            m.error("loss_type", f"{loss_type!r}: jaxrl_llm has {', '.join(LOSS_TYPES)}")
        m.set(f"{A}.loss_agg_mode", LOSS_TYPES[loss_type], "loss_type")
    if "scale_rewards" in args:
        scale = {True: True, "group": True, False: False, "none": False}.get(get("scale_rewards"))
        if scale is None:
            m.error("scale_rewards", f"{get('scale_rewards')!r}: jaxrl_llm scales by the group std or not at all")
        m.set("algorithm.norm_adv_by_std_in_grpo", scale, "scale_rewards")
    level = get("importance_sampling_level", "token")
    if level == "sequence":  # TRL's sequence IS with the grpo loss type = GSPO = our gspo loss
        if get("loss_type") != "grpo":
            m.error("importance_sampling_level", "'sequence' equals jaxrl_llm's gspo loss with loss_type='grpo'")
        m.set(f"{A}.policy_loss.loss_mode", "gspo", "importance_sampling_level")
    elif level != "token":
        m.error("importance_sampling_level", f"{level!r}: jaxrl_llm has token and sequence")
    if "max_prompt_length" in args:
        if get("max_prompt_length") is None:
            m.ignore("max_prompt_length=None", "a prompt budget is required; data.max_prompt_length is kept")
        else:
            m.set("data.max_prompt_length", get("max_prompt_length"), "max_prompt_length")
            m.set("data.truncation", "left", "max_prompt_length")  # TRL truncates prompts from the left
    if get("bf16") is not None:
        for model in (M, "critic.model"):
            m.set(f"{model}.dtype", "bfloat16" if get("bf16") else "float32", "bf16")
    if get("fp16"):
        m.ignore("fp16", "float16 is not available; the compute dtype follows bf16 / the tree")
    if "gradient_checkpointing" in args:
        for model in (M, "critic.model"):
            m.set(f"{model}.enable_gradient_checkpointing", bool(get("gradient_checkpointing")),
                  "gradient_checkpointing")
    map_optim(m, args)
    if "report_to" in args:
        targets = get("report_to")
        targets = [targets] if isinstance(targets, str) or targets is None else targets
        if "all" in targets:
            m.ignore("report_to=all", "name the loggers (tensorboard, wandb)")
            targets = [t for t in targets if t != "all"]
        m.set("trainer.logger", logger_sinks(m, "report_to", [t for t in targets if t]), "report_to")
    if get("seed") is not None:
        m.set("trainer.seed", get("seed"), "seed")
        if get("data_seed") is None:
            m.set("data.seed", get("seed"), "seed")
    if get("save_total_limit") is not None:
        for role in ("actor", "critic"):
            m.set(f"trainer.max_{role}_ckpt_to_keep", get("save_total_limit"), "save_total_limit")
    if get("reward_model_path"):
        m.set("reward_model.enable", True, "reward_model_path")
        m.set("reward_model.model.path", get("reward_model_path"), "reward_model_path")
    if get("stop_token_id") is not None:
        m.set(f"{R}.stop_token_ids", [get("stop_token_id")], "stop_token_id")


def map_optim(m: Mapper, args: dict[str, Any]) -> None:
    get = args.get
    if "adam_beta1" in args or "adam_beta2" in args:
        old = m.get(f"{A}.optim.betas")
        m.set(f"{A}.optim.betas", [get("adam_beta1", old[0]), get("adam_beta2", old[1])], "adam_beta1")
    if "lr_scheduler_type" in args:
        kind = get("lr_scheduler_type")
        if kind not in SCHEDULES:
            m.error("lr_scheduler_type", f"{kind!r}: jaxrl_llm has constant, cosine and linear (with linear warmup)")
        m.set(f"{A}.optim.lr_scheduler_type", SCHEDULES[kind], "lr_scheduler_type")
        kwargs = get("lr_scheduler_kwargs") or {}
        if "min_lr_rate" in kwargs:
            m.set(f"{A}.optim.min_lr_ratio", kwargs["min_lr_rate"], "lr_scheduler_kwargs.min_lr_rate")
        elif "min_lr" in kwargs:
            m.set(f"{A}.optim.min_lr_ratio", kwargs["min_lr"] / m.get(f"{A}.optim.lr"), "lr_scheduler_kwargs.min_lr")
    if get("optim") is not None and not str(get("optim")).startswith("adamw"):
        m.error("optim", f"{get('optim')!r}: jaxrl_llm trains with AdamW only")


HANDLED = set(SIMPLE) | {
    "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "reward_funcs", "reward_weights",
    *OPENR1_ARGS, "system_prompt",
    "chat_template", "dataset_prompt_column", "normalize_advantages",
    "top_k", "beta", "epsilon", "epsilon_high", "cliprange", "delta", "loss_type", "scale_rewards",
    "importance_sampling_level", "max_prompt_length", "bf16", "fp16", "gradient_checkpointing", "adam_beta1",
    "adam_beta2", "lr_scheduler_type", "lr_scheduler_kwargs", "optim", "report_to", "seed", "save_total_limit",
    "reward_model_path", "stop_token_id", "per_device_train_batch_size", "gradient_accumulation_steps",
    "steps_per_generation", "generation_batch_size", "num_mini_batches", "max_steps", "num_train_epochs",
    "total_episodes", "save_steps", "save_strategy", "eval_steps", "eval_strategy", "evaluation_strategy",
    "warmup_steps"}


def map_lora(m: Mapper, args: dict[str, Any]) -> None:
    """`--use_peft` with TRL's ModelConfig LoRA arguments (its defaults: r 16, alpha 32, dropout 0.05,
    PEFT's default targets)."""
    use = args.get("use_peft")
    for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
        if key in args and not use:
            m.ignore(key, "used only with use_peft")
    if not use:
        return
    m.set(f"{M}.lora_dropout", float(args.get("lora_dropout", 0.05)),
          "lora_dropout" if "lora_dropout" in args else "lora_dropout (TRL's default)")
    targets = args.get("lora_target_modules")
    m.set_lora(args.get("lora_r", 16), args.get("lora_alpha", 32), PEFT_DEFAULT_TARGETS if targets is None else targets,
               ("lora_r", "lora_alpha", "lora_target_modules"))


def _rewards(m: Mapper, args: dict[str, Any]) -> None:
    """open-r1 / TRL `reward_funcs` with `reward_weights` and open-r1's function arguments ->
    custom_reward_function.* (rewards/named.py; accuracy is the row's scorer)."""
    from jaxrl_llm.rewards.named import NAMES

    funcs = args.get("reward_funcs")
    for key in OPENR1_ARGS:
        if key in args:
            m.set(f"custom_reward_function.openr1.{key}", args[key], key)
    if funcs is None:
        if args.get("reward_weights") is not None:
            m.ignore("reward_weights", "no reward_funcs to weigh")
        return
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    server = [f for f in funcs if f in SERVER_REWARDS]
    if server:
        m.error("reward_funcs", f"{server!r}: these run competition checkers on open-r1's Piston / Morph servers "
                                "(its Codeforces / IOI test data); use code or binary_code, which run a row's test "
                                "cases in the local sandbox")
    unknown = [f for f in funcs if f not in NAMES and f not in ACCURACY_REWARDS]
    if unknown:
        m.error("reward_funcs", f"{unknown!r}: not among open-r1's reward functions jaxrl_llm builds in "
                                f"({', '.join(NAMES)}); write them into a custom_reward_function.path")
    names = ["accuracy" if f in ACCURACY_REWARDS else f for f in funcs]
    weights = args.get("reward_weights")
    if names == ["accuracy"] and weights in (None, [1.0], [1]):
        m.ignore(f"reward_funcs={funcs}", "the row's scorer alone (its data_source's, or custom_reward_function.path)")
        return
    m.set("custom_reward_function.reward_funcs", names, "reward_funcs")
    if weights is not None:
        m.set("custom_reward_function.reward_weights", [float(w) for w in weights], "reward_weights")


def _data_keys(m: Mapper, args: dict[str, Any]) -> None:
    """open-r1's recipe keys for the prompt."""
    if args.get("system_prompt") is not None:
        m.set("data.system_prompt", args["system_prompt"], "system_prompt")
    if args.get("chat_template") is not None:
        m.set("data.chat_template", args["chat_template"], "chat_template")
    if args.get("dataset_prompt_column") is not None:
        m.set("data.prompt_key", args["dataset_prompt_column"], "dataset_prompt_column")


def trl_trainer(args: dict[str, Any], source: str, fmt: str) -> str:
    """'rloo' or 'grpo': the format's when it names one (trl_grpo / trl_rloo), else RLOO when the
    arguments are the older RLOOTrainer's or the file's name says rloo."""
    if fmt in ("trl_grpo", "trl_rloo"):
        return fmt[4:]
    legacy = any(k in args for k in RLOO_MODE)
    return "rloo" if legacy or "rloo" in os.path.basename(source).lower() else "grpo"


def import_trl(args: dict[str, Any], m: Mapper, *, whole_run: bool, trainer: str | None = None) -> None:
    """TRL arguments into `m`; `whole_run` for a TRL YAML file (selects the algorithm and fills TRL's
    defaults); `trainer`: 'grpo' / 'rloo' (None: decided by the arguments, for flags)."""
    legacy = any(k in args for k in RLOO_MODE)
    rloo = trainer == "rloo" or legacy
    if rloo:
        mixed = [k for k in GRPO_ONLY if k in args]
        if mixed:
            m.error(mixed[0], "a GRPOConfig argument in an RLOO run (RLOOConfig has no such argument)")
    if whole_run:  # the arguments the file leaves out take TRL's defaults, as `trl grpo/rloo --config` does
        defaults = RLOO_DEFAULTS if rloo and not legacy else GRPO_DEFAULTS if not rloo else {}
        args = {**defaults, **args}
    _rewards(m, args)  # before reward_weights: the functions are what is refused
    for key, (bad, why) in ERRORS.items():
        if key in args and bad(args[key]):
            m.error(key, f"{args[key]!r}: {why}")
    if rloo or whole_run:
        m.set("algorithm.adv_estimator", "trl_rloo" if rloo else "grpo", "RLOOConfig" if rloo else "GRPOConfig")
        m.set("algorithm.use_kl_in_reward", False, "RLOOConfig" if rloo else "GRPOConfig")
    if rloo:  # TRL's RLOO (adv_estimator=trl_rloo): KL folded into the sequence score, no KL loss
        m.set(f"{A}.use_kl_loss", False, "RLOOConfig")
        if "beta" in args:  # RLOOConfig's beta: the coefficient of that KL
            m.set("algorithm.kl_ctrl.kl_coef", args.pop("beta"), "beta")
        if "normalize_advantages" in args:
            m.set("algorithm.trl_rloo.normalize_advantage", bool(args.pop("normalize_advantages")),
                  "normalize_advantages")
    for key, ours in SIMPLE.items():
        if key in args and args[key] is not None:
            m.set(ours, args[key], key)
    _special(m, args)
    map_lora(m, args)
    _data_keys(m, args)
    map_batch(m, args, legacy)
    map_steps(m, args, legacy)
    for key in args:
        if key in HANDLED or key in ERRORS:
            continue
        why = next((w for w, pats in IGNORED.items() if any(fnmatch.fnmatchcase(key, p) for p in pats)), None)
        leftover(m, key, args[key], "jaxrl_llm logs every step" if key == "logging_steps" else why)

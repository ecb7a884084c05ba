"""Preference-training configs -> our tree (`launch/dpo.py --import_config`): TRL's `DPOConfig` (a YAML
file as `trl dpo --config FILE` reads it, or its `--name=value` flags) and a Trinity-RFT file with
`algorithm.algorithm_type: dpo`.

TRL: `beta`, `loss_type` (sigmoid / ipo / hinge; others refused), `label_smoothing`, `reference_free`,
`max_length` -> dpo.*; `per_device_train_batch_size` x devices x `gradient_accumulation_steps` pairs per
optimizer step -> data.train_batch_size, with micro-batches of `per_device_train_batch_size` pairs;
`max_steps` / `num_train_epochs` / `save_steps` / `eval_steps` count optimizer steps, as ours do; the
optimizer, schedule and LoRA keys as TRL's GRPO import reads them (importers/trl.py). TRL's defaults apply
to the keys a file leaves out (`DPO_DEFAULTS`). `precompute_ref_log_probs` changes nothing computed: the
reference's log-probs of a pair are the same whenever they are computed (our reference scores each batch;
columns `ref_chosen_logps` / `ref_rejected_logps` already in the rows are read instead).

Trinity-RFT (`algorithm_type: dpo`): `algorithm.kl_coef` is beta (Trinity's DPO loss), `buffer.batch_size`
pairs a step, `buffer.total_epochs` / `total_steps`, the model path, the optimizer (its veRL trainer
config's actor.optim), and the dataset (`buffer.trainer_input.experience_buffer`: path, format keys
prompt_key / chosen_key / rejected_key, `prompt_type` messages or plaintext).
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Any

import ml_collections

from jaxrl_llm.config.importers import split_trl_flags
from jaxrl_llm.config.importers.common import (
    PLACEMENT,
    Mapper,
    flatten,
    int_or_error,
    leftover,
    load_yaml,
    logger_sinks,
)
from jaxrl_llm.config.importers.trinity_data import taskset_files
from jaxrl_llm.config.importers.trl import IGNORED, map_lora, map_optim, parse_trl_args
from jaxrl_llm.config.overrides import apply_overrides
from jaxrl_llm.config.schema import ConfigError

A, M = "actor_rollout_ref.actor", "actor_rollout_ref.model"
DPO_DEFAULTS = {"beta": 0.1, "loss_type": "sigmoid", "label_smoothing": 0.0, "learning_rate": 1e-6,
                "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_train_epochs": 3,
                "lr_scheduler_type": "linear", "warmup_ratio": 0.0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                "max_length": 1024}
TRL_SIMPLE = {"beta": "dpo.beta", "label_smoothing": "dpo.label_smoothing", "reference_free": "dpo.reference_free",
              "max_length": "dpo.max_length", "learning_rate": f"{A}.optim.lr",
              "weight_decay": f"{A}.optim.weight_decay", "adam_epsilon": f"{A}.optim.eps",
              "max_grad_norm": f"{A}.grad_clip", "warmup_ratio": f"{A}.optim.lr_warmup_steps_ratio",
              "model_name_or_path": f"{M}.path", "output_dir": "trainer.default_local_dir",
              "run_name": "trainer.experiment_name", "seed": "trainer.seed", "data_seed": "data.seed",
              "gradient_checkpointing": f"{M}.enable_gradient_checkpointing", "chat_template": "data.chat_template",
              "num_train_epochs": "trainer.total_epochs", "max_steps": "trainer.total_training_steps",
              "save_steps": "trainer.save_freq", "eval_steps": "trainer.test_freq",
              "save_total_limit": "trainer.max_actor_ckpt_to_keep"}
TRL_LOSSES = ("sigmoid", "ipo", "hinge")
TRL_HANDLED = {"per_device_train_batch_size", "gradient_accumulation_steps", "loss_type", "use_peft", "lora_r",
               "lora_alpha", "lora_dropout", "lora_target_modules", "adam_beta1", "adam_beta2", "lr_scheduler_type",
               "lr_scheduler_kwargs", "optim", "report_to", "warmup_steps", "precompute_ref_log_probs",
               "max_prompt_length", "max_completion_length", "truncation_mode", "bf16", "fp16", "padding_free",
               "save_strategy", "eval_strategy", "evaluation_strategy"}


def looks_like_trl_dpo(data: dict[str, Any]) -> bool:
    return bool(set(data) & {"beta", "loss_type", "per_device_train_batch_size", "model_name_or_path",
                             "precompute_ref_log_probs", "reference_free"}) and "algorithm" not in data


def import_trl_dpo(args: dict[str, Any], m: Mapper, *, whole_run: bool) -> None:
    """TRL DPOConfig arguments (a whole run's file: TRL's defaults fill what it leaves out)."""
    if whole_run:
        args = {**DPO_DEFAULTS, **args}
    for key, value in args.items():
        if key in TRL_SIMPLE and value is not None:
            m.set(TRL_SIMPLE[key], value, key)
    kind = args.get("loss_type")
    if isinstance(kind, list):  # TRL accepts a list of losses (weighted): one is what we have
        if len(kind) != 1:
            m.error("loss_type", f"{kind!r}: one loss (jaxrl_llm has {', '.join(TRL_LOSSES)})")
        kind = kind[0]
    if kind is not None:
        if kind not in TRL_LOSSES:
            m.error("loss_type", f"{kind!r}: jaxrl_llm has {', '.join(TRL_LOSSES)}")
        m.set("dpo.loss_type", kind, "loss_type")
    _batch(m, args)
    map_optim(m, args)
    map_lora(m, args)
    if args.get("warmup_steps"):
        m.set(f"{A}.optim.lr_warmup_steps", int_or_error(m, "warmup_steps", args["warmup_steps"]), "warmup_steps")
    if args.get("report_to") is not None:
        sinks = args["report_to"] if isinstance(args["report_to"], list) else [args["report_to"]]
        m.set("trainer.logger", logger_sinks(m, "report_to", [s for s in sinks if s not in ("all", "none")]),
              "report_to")
    if args.get("truncation_mode") not in (None, "keep_end", "keep_start"):
        m.error("truncation_mode", f"{args['truncation_mode']!r}: keep_end or keep_start")
    if args.get("truncation_mode"):
        m.set("data.truncation", "left" if args["truncation_mode"] == "keep_end" else "right", "truncation_mode")
    for key in ("max_prompt_length", "max_completion_length"):
        if args.get(key) is not None:
            m.ignore(key, "one budget per sequence: dpo.max_length (max_length)", args[key])
    if args.get("precompute_ref_log_probs"):
        m.ignore("precompute_ref_log_probs", "the reference's log-probs are the same whenever computed; rows with "
                                             "ref_chosen_logps / ref_rejected_logps columns use them")
    for key, value in args.items():
        if key in TRL_SIMPLE or key in TRL_HANDLED or key in DPO_DEFAULTS:
            continue
        why = next((reason for reason, patterns in IGNORED.items()
                    if any(fnmatch.fnmatch(key, p) for p in patterns)), None)
        leftover(m, key, value, why)


def _batch(m: Mapper, args: dict[str, Any]) -> None:
    if "per_device_train_batch_size" not in args and "gradient_accumulation_steps" not in args:
        return
    per_device = int_or_error(m, "per_device_train_batch_size", args.get("per_device_train_batch_size", 8))
    accumulation = int_or_error(m, "gradient_accumulation_steps", args.get("gradient_accumulation_steps", 1))
    m.set("dpo.micro_batch_size_per_device", per_device, "per_device_train_batch_size")
    m.set("data.train_batch_size", per_device * m.dp() * accumulation, "per_device_train_batch_size")


def import_trinity_dpo(data: dict[str, Any], m: Mapper) -> None:
    """A Trinity-RFT file whose algorithm_type is dpo (module doc)."""
    flat = flatten(data, leaves=("buffer.trainer_input.experience_buffer.format",))
    buffer = "buffer.trainer_input.experience_buffer"
    for key, value in flat.items():
        if key == "algorithm.algorithm_type":
            continue
        if key == "algorithm.kl_coef":
            m.set("dpo.beta", value, key)
        elif key == "model.model_path":
            m.set(f"{M}.path", value, key)
        elif key == "model.max_model_len":
            m.set("dpo.max_length", value, key)
        elif key == "buffer.batch_size":
            m.set("data.train_batch_size", value, key)
        elif key == "buffer.total_epochs":
            m.set("trainer.total_epochs", value, key)
        elif key == "buffer.total_steps":
            m.set("trainer.total_training_steps", value, key)
        elif key in ("project", "name"):
            m.set("trainer.project_name" if key == "project" else "trainer.experiment_name", value, key)
        elif key == "checkpoint_root_dir":
            m.set("trainer.default_local_dir", value, key)
        elif key == "monitor.monitor_type":
            m.set("trainer.logger", logger_sinks(m, key, [value]), key)
        elif key == f"{buffer}.path":
            m.set("data.train_files", taskset_files(value, flat.get(f"{buffer}.split") or "train",
                                                    flat.get(f"{buffer}.subset_name")), key)
        elif key == f"{buffer}.format":
            _trinity_format(m, dict(value or {}), key)
        elif key.startswith(f"{buffer}.") and key.rsplit(".", 1)[1] in ("name", "storage_type", "split",
                                                                         "subset_name", "schema_type"):
            if key.endswith("storage_type") and value not in ("file", None):
                m.error(key, f"{value!r}: only file datasets are available")
        elif key.startswith("trainer.trainer_config.actor_rollout_ref.actor.optim."):
            name = key.rsplit(".", 1)[1]
            if name in ("lr", "weight_decay", "lr_warmup_steps_ratio", "lr_warmup_steps", "min_lr_ratio", "betas"):
                m.set(f"{A}.optim.{name}", value, key)
            else:
                m.ignore(key, PLACEMENT, value)
        elif key.split(".")[0] in ("cluster", "synchronizer", "log", "explorer", "monitor", "trainer", "mode",
                                   "continue_from_checkpoint"):
            m.ignore(key, PLACEMENT, value)
        else:
            leftover(m, key, value)


def _trinity_format(m: Mapper, fmt: dict[str, Any], where: str) -> None:
    kinds = {"prompt_key": "data.prompt_key", "chosen_key": "dpo.chosen_key", "rejected_key": "dpo.rejected_key",
             "messages_key": "data.prompt_key", "chat_template": "data.chat_template"}
    for key, value in fmt.items():
        if key in kinds:
            m.set(kinds[key], value, f"{where}.{key}")
        elif key == "prompt_type":
            if value not in ("messages", "plaintext"):
                m.error(f"{where}.prompt_type", f"{value!r}: messages or plaintext")
        else:
            leftover(m, f"{where}.{key}", value)


def dpo_config(base: ml_collections.ConfigDict, items: list[str], import_path: str | None
               ) -> ml_collections.ConfigDict:
    """The config of a DPO run (launch/dpo.py): `base`, the imported TRL DPOConfig / Trinity DPO file, TRL
    `--name=value` flags, then our `a.b=c` overrides, later wins."""
    cfg = copy.deepcopy(base)
    if import_path:
        data = load_yaml(import_path, missing_groups="skip")
        m = Mapper("dpo", import_path, base=cfg)
        algorithm = data.get("algorithm")
        if isinstance(algorithm, dict) and algorithm.get("algorithm_type") == "dpo":
            import_trinity_dpo(data, m)
        elif isinstance(algorithm, dict) or not looks_like_trl_dpo(data):
            raise ConfigError(f"{import_path}: not a DPO config (a TRL DPOConfig file, or a Trinity-RFT file with "
                              f"algorithm.algorithm_type: dpo); its top-level keys are {sorted(data)}")
        else:
            import_trl_dpo(data, m, whole_run=True)
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    positional, flags = split_trl_flags([i for i in items if i != "--"])
    if flags:
        m = Mapper("trl_dpo", "command line", base=cfg)
        import_trl_dpo(parse_trl_args(flags), m, whole_run=False)
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    return apply_overrides(cfg, positional)

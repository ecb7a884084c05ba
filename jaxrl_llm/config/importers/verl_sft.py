"""veRL's SFT configs -> our tree: `sft_trainer.yaml` (the seed document's layout: `data`, `model`,
`optim`, `trainer`, top-level `ulysses_sequence_parallel_size` / `use_remove_padding`) and the engine
trainer's `sft_trainer_engine.yaml` (`model` as hf_model.yaml, `engine`, `optim` as optim/fsdp.yaml,
`checkpoint`; conversations only), as files (`launch/sft.py --import_config`) or as `key=value`
overrides in veRL's SFT names after `--`.

Rules as every importer's (docs/importing.md): a key maps to ours (`DIRECT`, and the rules below),
is listed with its value in one warning when it only places work (FSDP, offload, devices) or is off,
or is an error naming the file, key and value. The table with every key: docs/sft_dpo_eval.md.
"""
from __future__ import annotations

import copy
from typing import Any

import ml_collections

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
)
from jaxrl_llm.config.importers.verl import is_ours
from jaxrl_llm.config.overrides import apply_overrides, parse_value, split_override, unknown_key_message
from jaxrl_llm.config.schema import ConfigError

A = "actor_rollout_ref.actor"
M = "actor_rollout_ref.model"

# veRL SFT key -> ours, values as they are
DIRECT = {
    "data.train_batch_size": "data.train_batch_size",
    "data.micro_batch_size_per_gpu": "sft.micro_batch_size_per_device",
    "data.max_token_len_per_gpu": "sft.max_token_len_per_device",
    "data.use_dynamic_bsz": "sft.use_dynamic_bsz",
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.train_max_samples": "data.train_max_samples",
    "data.val_max_samples": "data.val_max_samples",
    "data.prompt_key": "data.prompt_key",
    "data.response_key": "sft.response_key",
    "data.prompt_dict_keys": "sft.prompt_dict_keys",
    "data.response_dict_keys": "sft.response_dict_keys",
    "data.multiturn.enable": "sft.multiturn",
    "data.multiturn.messages_key": "data.messages_key",
    "data.multiturn.tools_key": "sft.tools_key",
    "data.multiturn.enable_thinking_key": "sft.enable_thinking_key",
    "data.messages_key": "data.messages_key",
    "data.tools_key": "sft.tools_key",
    "data.enable_thinking_key": "sft.enable_thinking_key",
    "data.apply_chat_template_kwargs": "sft.apply_chat_template_kwargs",
    "data.max_length": "sft.max_length",
    "data.truncation": "data.truncation",
    "data.chat_template": "data.chat_template",
    "data.shuffle": "data.shuffle",
    "data.seed": "data.seed",
    "model.partial_pretrain": f"{M}.path",
    "model.path": f"{M}.path",
    "model.tokenizer_path": "data.tokenizer",
    "model.custom_chat_template": "data.chat_template",
    "model.override_config": f"{M}.override_config",
    "model.enable_gradient_checkpointing": f"{M}.enable_gradient_checkpointing",
    "model.use_remove_padding": f"{M}.use_remove_padding",
    "use_remove_padding": f"{M}.use_remove_padding",
    "optim.lr": f"{A}.optim.lr",
    "optim.betas": f"{A}.optim.betas",
    "optim.weight_decay": f"{A}.optim.weight_decay",
    "optim.eps": f"{A}.optim.eps",
    "optim.lr_warmup_steps": f"{A}.optim.lr_warmup_steps",
    "optim.min_lr_ratio": f"{A}.optim.min_lr_ratio",
    "optim.num_cycles": f"{A}.optim.num_cycles",
    "optim.clip_grad": f"{A}.grad_clip",
    "trainer.default_local_dir": "trainer.default_local_dir",
    "trainer.project_name": "trainer.project_name",
    "trainer.experiment_name": "trainer.experiment_name",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.total_training_steps": "trainer.total_training_steps",
    "trainer.seed": "trainer.seed",
    "trainer.save_freq": "trainer.save_freq",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.resume_mode": "trainer.resume_mode",
    "trainer.resume_from_path": "trainer.resume_from_path",
    "trainer.max_ckpt_to_keep": "trainer.max_actor_ckpt_to_keep",
}
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
          "float16": "float16"}
# keys that only place work or pick torch machinery: listed with their values
PLACEMENT_PREFIXES = ("model.fsdp_config.", "engine.", "data.use_shm", "model.use_shm", "trainer.nnodes",
                      "trainer.n_gpus_per_node", "trainer.device", "trainer.default_hdfs_dir", "model.external_lib",
                      "model.trust_remote_code", "model.use_liger", "model.use_fused_kernels",
                      "model.fused_kernel_options.", "model.enable_activation_offload", "checkpoint.",
                      "data.balance_dp_token", "optim.optimizer_impl", "optim.total_training_steps", "data.pad_mode",
                      "model.fsdp_config", "data.ignore_input_ids_mismatch", "optim.override_optimizer_config",
                      "model.lora_adapter_path", "model.exclude_modules", "model.target_parameters")
SCHEDULERS = {"cosine": "cosine", "wsd": "wsd", "constant": "constant", "linear": "linear"}


def looks_like_sft(data: dict[str, Any]) -> bool:
    """A veRL SFT file: its own top-level `model` / `optim` sections (the RL file nests them under
    actor_rollout_ref), or SFT-only data keys."""
    keys = set(data)
    sft_data = isinstance(data.get("data"), dict) and bool(
        set(data["data"]) & {"micro_batch_size_per_gpu", "response_key", "max_length", "multiturn", "messages_key"})
    return "actor_rollout_ref" not in keys and (bool(keys & {"optim", "model", "engine"}) or sft_data)


def import_verl_sft(data: dict[str, Any], m: Mapper) -> None:
    """Maps a veRL SFT config (a loaded YAML mapping or `key=value` overrides as a flat mapping)."""
    src = Source(flatten(data, leaves=("data.apply_chat_template_kwargs", "model.override_config")), m.source)
    import_verl_sft_source(m, src)


def import_verl_sft_source(m: Mapper, src: Source) -> None:
    flat = src.flat
    if "data.messages_key" in flat and "data.prompt_key" not in flat and "data.multiturn.enable" not in flat:
        m.set("sft.multiturn", True, "data.messages_key")  # the engine trainer reads conversations only
    for key in list(flat):
        value = src.take(key)
        key = key.lstrip("+")
        if key in DIRECT:
            m.set(DIRECT[key], value, key)
        elif key == "data.micro_batch_size":  # deprecated global size (null in current veRL)
            if value is not None:
                m.set("sft.micro_batch_size_per_device", max(1, int_or_error(m, key, value) // m.dp()), key)
        elif key in ("model.fsdp_config.model_dtype", "engine.model_dtype", "model.dtype"):
            if str(value) not in DTYPES:
                m.error(key, f"{value!r}: expected one of {', '.join(DTYPES)}")
            m.set(f"{M}.param_dtype", DTYPES[str(value)], key)
        elif key in ("optim.warmup_steps_ratio", "optim.lr_warmup_steps_ratio"):
            m.set(f"{A}.optim.lr_warmup_steps_ratio", value, key)
            if "optim.lr_warmup_steps" not in flat:
                m.set(f"{A}.optim.lr_warmup_steps", -1, key)
        elif key in ("optim.lr_scheduler", "optim.lr_scheduler_type", "optim.warmup_style"):
            if str(value) not in SCHEDULERS:
                m.error(key, f"{value!r}: the schedules are {', '.join(SCHEDULERS)}")
            m.set(f"{A}.optim.lr_scheduler_type", SCHEDULERS[str(value)], key)
        elif key == "optim.optimizer":
            if str(value).lower().lstrip("_") not in ("adamw", "adam"):
                m.error(key, f"{value!r}: jaxrl_llm trains with AdamW (optax.adamw)")
        elif key in ("model.lora_rank", "model.lora_alpha", "model.target_modules"):
            _lora(m, key, value, flat)
        elif key == "ulysses_sequence_parallel_size":
            size = int_or_error(m, key, value)
            if size > 1:
                m.set("mesh.context", size, key)
        elif key in ("data.custom_cls.path", "data.custom_cls.name"):
            if not is_off(value):
                m.error(key, f"{value!r}: SFT reads veRL's own row layouts (custom dataset classes run only for RL "
                             "prompts)")
        elif key == "trainer.resume_path":
            if value is not None:
                m.set("trainer.resume_mode", "resume_path", key)
                m.set("trainer.resume_from_path", value, key)
        elif key == "trainer.logger":
            m.set("trainer.logger", logger_sinks(m, key, value if isinstance(value, list) else [value]), key)
        elif key in ("model.lora_adapter_path", "model.exclude_modules", "model.target_parameters") and \
                not is_off(value):
            m.error(key, f"{value!r}: not available for SFT in jaxrl_llm")
        elif any(key == p.rstrip(".") or key.startswith(p) for p in PLACEMENT_PREFIXES):
            if key == "data.pad_mode" and value == "right_padding":
                m.set(f"{M}.use_remove_padding", False, key)
            m.ignore(key, PLACEMENT, value)
        else:
            leftover(m, key, value)


def _lora(m: Mapper, key: str, value: Any, flat: dict[str, Any]) -> None:
    """model.lora_rank / lora_alpha / target_modules: set together once the rank is read."""
    ours = {"model.lora_rank": f"{M}.lora_rank", "model.lora_alpha": f"{M}.lora_alpha",
            "model.target_modules": f"{M}.target_modules"}[key]
    if key == "model.target_modules" and isinstance(value, str) and value != "all-linear":
        value = [t.strip() for t in value.split(",") if t.strip()]
    m.set(ours, int_or_error(m, key, value) if key == "model.lora_rank" else value, key)


def is_verl_sft_key(key: str) -> bool:
    """A key of veRL's SFT layouts (mapped, warned or refused by this importer)."""
    key = key.lstrip("+")
    return key in DIRECT or key.split(".")[0] in ("model", "optim", "engine", "checkpoint") or key in (
        "ulysses_sequence_parallel_size", "use_remove_padding", "trainer.resume_path", "data.micro_batch_size",
        "trainer.logger") or any(
        key.startswith(p) for p in PLACEMENT_PREFIXES) or key.startswith("data.multiturn.")


def split_sft_overrides(items: list[str]) -> tuple[list[str], dict[str, object]]:
    """(overrides of ours, veRL SFT keys with their parsed values): a key veRL's SFT layout renames
    (data.micro_batch_size_per_gpu, model.*, optim.*, ...) goes to the SFT importer."""
    ours: list[str] = []
    peer: dict[str, object] = {}
    for item in items:
        if item == "--":
            continue
        key, text = split_override(item)
        bare = key.lstrip("+")
        renamed = bare in DIRECT and DIRECT[bare] != bare
        if is_ours(bare) and not renamed:
            ours.append(item)
        elif is_verl_sft_key(bare):
            peer[bare] = parse_value(text)
        else:
            raise ConfigError(unknown_key_message(bare))
    return ours, peer


def sft_config(base: ml_collections.ConfigDict, items: list[str], import_path: str | None
               ) -> ml_collections.ConfigDict:
    """The config of an SFT run (launch/sft.py): `base`, the imported veRL SFT file, then `items`
    (`--config.a.b=v` flags and the overrides after `--`: veRL SFT keys imported, ours applied), later wins."""
    cfg = copy.deepcopy(base)
    if import_path:
        data = load_yaml(import_path, missing_groups="skip")
        if not looks_like_sft(data):
            raise ConfigError(f"{import_path}: not a veRL SFT config (its top-level keys are {sorted(data)}; "
                              "an RL file runs with launch/train.py)")
        m = Mapper("verl_sft", import_path, base=cfg)
        import_verl_sft(data, m)
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    ours, peer = split_sft_overrides(items)
    if peer:
        m = Mapper("verl_sft", "command line", base=cfg)
        import_verl_sft_source(m, Source(peer, "command line"))
        result = m.result()
        result.warn()
        cfg = result.apply(cfg)
    return apply_overrides(cfg, ours)

"""Checks of a run's inputs beyond the shape of the config tree, each failure one `ConfigError`
naming the key (called by `validate_config`):

- `check_inputs`: run names, DAPO's filter metric, `model.override_config` keys; keys that have
  no effect here are warned about once.
- `check_sources` (with `check_paths`): what the paths hold, read before any model is loaded or
  any prompt is tokenised: the policy / critic / reward model folder or .gguf (an architecture
  this package implements, its weights present), the tokenizer folder, and the custom reward
  function and dataset class files (imported now, so a broken file fails at start).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

import ml_collections

from jaxrl_llm.checkpoint import is_checkpoint
from jaxrl_llm.config.schema import ConfigError, get_path

logger = logging.getLogger(__name__)

ARR = "actor_rollout_ref"

# veRL keys accepted for compatibility that do nothing here (warned when set to a non-default value).
NO_EFFECT: dict[str, str] = {
    f"{ARR}.rollout.calculate_log_probs": "the sampler always returns its per-token log-probs (rollout_log_probs)",
    "trainer.max_critic_ckpt_to_keep": "the critic is saved in the actor's checkpoint; "
                                       "trainer.max_actor_ckpt_to_keep keeps both",
}
# Per-sequence quantities DAPO's filter can always read; other names are keys the reward returns.
FILTER_METRICS = ("seq_reward", "seq_final_reward", "score")
BUILTIN_EXTRA_METRICS = ("acc",)  # numeric keys a built-in scorer returns (math_dapo)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_warned: set[tuple[str, str]] = set()


def _warn_once(key: str, message: str) -> None:
    if (key, message) not in _warned:
        _warned.add((key, message))
        logger.warning(message)


def check_inputs(cfg: ml_collections.ConfigDict) -> None:
    """Run names, the DAPO filter metric, override_config keys; warns about no-effect keys."""
    from jaxrl_llm.config.schema import iter_fields
    from jaxrl_llm.config.tree import TREE

    defaults = dict(iter_fields(TREE))
    for key, why in NO_EFFECT.items():
        value = get_path(cfg, key)
        if value != defaults[key].default:
            _warn_once(key, f"config key {key}={value!r} has no effect in jaxrl_llm ({why}); ignored")
    for key in ("trainer.project_name", "trainer.experiment_name"):
        name = get_path(cfg, key)
        if not name.strip() or "/" in name or "\\" in name or ".." in name or name != name.strip():
            raise ConfigError(f"{key}={name!r}: must be a plain, non-empty name without '/', '\\' or '..' "
                              "(it names the run folder and the logger run); set trainer.default_local_dir "
                              "to choose where the run is written")
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.metric not in FILTER_METRICS:
        if cfg.reward_model.enable:
            raise ConfigError(f"algorithm.filter_groups.metric={fg.metric!r}: a reward model returns only its "
                              f"score; valid: {', '.join(FILTER_METRICS)}")
        if cfg.custom_reward_function.path is None and fg.metric not in BUILTIN_EXTRA_METRICS:
            raise ConfigError(f"algorithm.filter_groups.metric={fg.metric!r}: the built-in scorers return no such "
                              f"key; valid: {', '.join(FILTER_METRICS + BUILTIN_EXTRA_METRICS)} (or a key your "
                              "custom_reward_function returns)")
    for section in (f"{ARR}.model", "critic.model"):
        _check_override_config(f"{section}.override_config", get_path(cfg, f"{section}.override_config"))


def _check_override_config(key: str, overrides: Any) -> None:
    from jaxrl_llm.models.config_hf import classify_hf_overrides

    keys = list(overrides.keys()) if overrides else []
    rejected, ignored = classify_hf_overrides(keys)
    if rejected:
        raise ConfigError(f"{key}.{rejected[0]}: changes the architecture or the parameter shapes of the "
                          "checkpoint, which an override cannot do (load a checkpoint that has it)")
    for name in ignored:
        _warn_once(f"{key}.{name}", f"config key {key}.{name} has no effect in jaxrl_llm (the decoder does not "
                                    "read that HF config field); ignored")


def _is_local(path: str) -> bool:
    return "://" not in path and os.path.exists(os.path.expanduser(path))


def _check_hf_folder(key: str, folder: pathlib.Path) -> Any:
    from jaxrl_llm.models.config import ModelConfig

    try:
        with open(folder / "config.json", encoding="utf-8") as handle:
            hf = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{key}={str(folder)!r}: cannot read config.json ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}={str(folder)!r}: config.json is not a JSON object")
    try:
        model_cfg = ModelConfig.from_hf_config(hf)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{key}={str(folder)!r}: {err}") from None
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        raise ConfigError(f"{key}={str(folder)!r}: no model.safetensors or model.safetensors.index.json "
                          "(weights are read from safetensors only)")
    return model_cfg


TINY_VISION_LANGUAGE = "tiny:qwen2_5_vl"


def reads_images(path: str | None) -> bool:
    """Whether the policy at `path` is a vision-language model here: a local Qwen2.5-VL / Qwen3-VL / Gemma 3 /
    Gemma 4 folder (config.json model_type 'qwen2_5_vl' / 'qwen3_vl' / 'qwen3_vl_moe' / 'gemma3', or 'gemma4' with a
    vision_config) or tiny:qwen2_5_vl (roles/vision.py loads its tower)."""
    if not path:
        return False
    if path == TINY_VISION_LANGUAGE:
        return True
    config = pathlib.Path(path).expanduser() / "config.json"
    if path.startswith("tiny:") or not _is_local(path) or not config.is_file():
        return False
    try:
        d = json.loads(config.read_text())
        return d.get("model_type") in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3") or (
            d.get("model_type") == "gemma4" and bool(d.get("vision_config")))
    except (OSError, ValueError):  # an unreadable config.json: the loaders say what is wrong with it
        return False


def check_model_source(key: str, path: str) -> Any:
    """`path` (a local model location) is an HF folder or .gguf of a supported architecture with its
    weights, or a jaxrl_llm checkpoint; other locations are left to the loaders. Returns what is known
    of the model's context when it was read: its `ModelConfig` (HF folder) or context length (.gguf),
    else None."""
    if path.startswith("tiny:") or not _is_local(path):
        return None
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return _check_hf_folder(key, p)
        if not is_checkpoint(p):
            raise ConfigError(f"{key}={path!r}: not a model folder (no config.json); expected an HF folder, a "
                              ".gguf file or a jaxrl_llm checkpoint")
        return None
    if p.suffix != ".gguf":
        raise ConfigError(f"{key}={path!r}: a file that is not .gguf; expected an HF folder, a .gguf file or a "
                          "jaxrl_llm checkpoint")
    from jaxrl_llm.hf.gguf_header import GGUFHeaderError, read_gguf_metadata
    from jaxrl_llm.hf.gguf_load import SUPPORTED_GGUF_ARCHITECTURES

    try:  # the header only: the full reader parses the whole vocabulary (seconds)
        meta = read_gguf_metadata(str(p), ("general.architecture", "llama.context_length"))
    except (GGUFHeaderError, OSError) as err:
        raise ConfigError(f"{key}={path!r}: {err}") from None
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConfigError(f"{key}={path!r}: unsupported GGUF architecture {arch!r}; supported: "
                          f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return int(meta.get("llama.context_length", 2048))


def check_context(model_cfg: Any, total: int, key: str = f"{ARR}.model") -> None:
    """Prompt + response (`total` tokens) fit the context of the model `model_cfg` (a ModelConfig):
    `max_position_embeddings`, or the scaled context of its RoPE scaling (`ModelConfig.context_length`).
    Dynamic NTK scaling past max_position_embeddings is refused: its frequencies follow each pass's
    longest position, so the sampler (growing one token a step) and the trainer (the whole sequence at
    once) would score the same tokens under different RoPE (models/decoder.py)."""
    scaling = model_cfg.rope_scaling_dict
    where = (f"({model_cfg.max_position_embeddings} positions" +
             (f", {model_cfg.context_length} with its rope_scaling {scaling.get('rope_type')!r})" if scaling else ")"))
    if total > model_cfg.context_length:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {total} exceeds the context of "
                          f"{key}.path {where}; shorten them, or extend the context with RoPE scaling "
                          f"({key}.override_config.rope_scaling, e.g. yarn)")
    if scaling.get("rope_type") == "dynamic" and total > model_cfg.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length = {total} exceeds {key}.path's "
                          f"max_position_embeddings={model_cfg.max_position_embeddings} under dynamic NTK RoPE "
                          "scaling, whose frequencies differ between the sampler's decode steps and the "
                          f"trainer's full-sequence pass; use yarn ({key}.override_config.rope_scaling) instead")


def _check_context(cfg: ml_collections.ConfigDict, key: str, section: ml_collections.ConfigDict,
                   known: Any) -> None:
    """Prompt + response fit the model's context (after override_config), known once its config is read."""
    if known is None:
        return
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    overrides = dict(section.override_config or {})
    if isinstance(known, int):  # a .gguf header's context length
        positions = int(overrides.get("max_position_embeddings", known))
        if total > positions:
            raise ConfigError(f"data.max_prompt_length={cfg.data.max_prompt_length}: prompt + response "
                              f"({cfg.data.max_prompt_length} + {cfg.data.max_response_length} = {total}) exceeds "
                              f"the context of {key}.path ({positions} positions)")
        return
    from jaxrl_llm.models.config import with_hf_overrides

    try:
        model_cfg = with_hf_overrides(known, overrides)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{key}.override_config: {err}") from None
    check_context(model_cfg, total, key)
    check_heads_split(cfg, key, model_cfg.num_attention_heads, model_cfg.num_key_value_heads)


def check_heads_split(cfg: ml_collections.ConfigDict, key: str, heads: int, kv_heads: int) -> None:
    """mesh.context_attention=all_to_all splits each device's attention heads (models/context_parallel.py
    `heads_per_device`) over the context axis: they must divide by mesh.context (an explicit size; -1 is
    checked when the program is traced)."""
    from jaxrl_llm.models.context_parallel import heads_per_device

    mesh = cfg.mesh
    if mesh.context_attention != "all_to_all" or mesh.context <= 1:
        return
    per_device = heads_per_device(heads, kv_heads, mesh.tensor)[0]
    if per_device % mesh.context:
        raise ConfigError(f"mesh.context_attention=all_to_all: {key} has {heads} attention heads, {per_device} per "
                          f"device, which do not split over mesh.context={mesh.context}; use ring, or a context "
                          f"size that divides {per_device}")


def check_tokenizer_source(key: str, path: str | None) -> None:
    if path is None or not _is_local(path):
        return
    p = pathlib.Path(path).expanduser()
    if p.is_dir() and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}={path!r}: no tokenizer in the folder (none of {', '.join(TOKENIZER_FILES)})")
    if p.is_file() and p.suffix != ".gguf":
        raise ConfigError(f"{key}={path!r}: a tokenizer is an HF folder or a .gguf file")


def check_user_code(cfg: ml_collections.ConfigDict) -> None:
    """Imports the custom reward function and dataset class files (errors name the key)."""
    from jaxrl_llm.rewards.custom import RewardFunctionError, ScorerSpec, load_from_file

    custom = cfg.custom_reward_function
    try:
        if custom.path is not None:
            ScorerSpec(os.path.abspath(os.path.expanduser(custom.path)), custom.name).load()
        cls = cfg.data.custom_cls
        if cls.path is not None:
            if not cls.name:
                raise ConfigError("data.custom_cls.name=None: required when data.custom_cls.path is set")
            load_from_file(cls.path, cls.name, "data.custom_cls")
    except RewardFunctionError as err:
        raise ConfigError(str(err)) from None


def check_sources(cfg: ml_collections.ConfigDict) -> None:
    """What the configured paths hold (see module docstring)."""
    policy = cfg.actor_rollout_ref.model
    _check_context(cfg, f"{ARR}.model", policy, check_model_source(f"{ARR}.model.path", policy.path))
    if policy.path.startswith("tiny:"):
        check_heads_split(cfg, f"{ARR}.model", int(policy.tiny.num_attention_heads),
                          int(policy.tiny.num_key_value_heads))
    if cfg.critic.enable and cfg.critic.model.path != policy.path:
        _check_context(cfg, "critic.model", cfg.critic.model,
                       check_model_source("critic.model.path", cfg.critic.model.path))
    if cfg.reward_model.enable:
        check_model_source("reward_model.model.path", cfg.reward_model.model.path)
    speculative = cfg.actor_rollout_ref.rollout.speculative
    if speculative.method == "draft" and speculative.draft_model.path is not None:
        check_model_source(f"{ARR}.rollout.speculative.draft_model.path", speculative.draft_model.path)
    check_tokenizer_source("data.tokenizer", cfg.data.tokenizer)
    check_user_code(cfg)

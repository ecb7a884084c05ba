"""Command-line overrides and the names other frameworks use.

- `apply_overrides(cfg, ["a.b=v", ...])`: veRL/Hydra-style `key=value` strings with YAML-like
  values (`1e-6`, `true`, `null`, `[a,b]`, `{k: v}`, quoted strings).
- Aliases mapped one to one onto our keys: TRL/ROLL names (`rloo_k`, `num_generations`,
  `num_return_sequences_in_group`, `rollout_batch_size`, `kl_coef`, `cliprange`,
  `missing_eos_penalty`, `token_level_kl`), veRL's `*_per_gpu` (-> `*_per_device`) and veRL's old
  `warmup_style` (-> `lr_scheduler_type`).
- Torch-only keys (FSDP, vLLM, Ray, torch.compile, ...) are accepted with one warning each and
  dropped: they have no effect in jaxrl_llm.
- `normalize_config(cfg)` applies the same rules to keys found inside a ConfigDict (a config file
  may use veRL names), and rejects unknown keys with close-match suggestions.
"""
from __future__ import annotations

import ast
import difflib
import fnmatch
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections
import yaml

from jaxrl_llm.config.schema import ConfigError, Field, has_path, iter_fields, set_path
from jaxrl_llm.config.tree import TREE

logger = logging.getLogger(__name__)

FIELDS: dict[str, Field] = dict(iter_fields(TREE))
OPEN_SECTIONS = tuple(k for k, f in FIELDS.items() if f.open)

# Other frameworks' names, mapped one to one.
NAME_ALIASES: dict[str, str] = {
    "rloo_k": "actor_rollout_ref.rollout.n",  # TRL RLOOConfig
    "num_generations": "actor_rollout_ref.rollout.n",  # TRL GRPOConfig
    "num_return_sequences_in_group": "actor_rollout_ref.rollout.n",  # ROLL
    "rollout_batch_size": "data.train_batch_size",  # TRL / ROLL
    "kl_coef": "algorithm.kl_ctrl.kl_coef",  # TRL
    "cliprange": "actor_rollout_ref.actor.clip_ratio",  # TRL
    "missing_eos_penalty": "reward_model.missing_eos_penalty",  # TRL
    "token_level_kl": "algorithm.trl_rloo.token_level_kl",  # TRL RLOOConfig
    # ROLL: generation runs this many batches ahead of training (integers only, as in ROLL)
    "async_generation_ratio": "synchronizer.sync_offset",
    # veRL's root reward_manager section (current veRL; its default follows reward_model.reward_manager)
    "reward_manager.name": "reward_model.reward_manager",
    # veRL's FSDP spelling of the same switch (host memory between reference passes)
    "actor_rollout_ref.ref.fsdp_config.param_offload": "actor_rollout_ref.ref.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "actor_rollout_ref.actor.optim.offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.optim.offload",
    # veRL's Ulysses sequence parallelism: each sequence's tokens split over a group of devices (the
    # actor's size; fsdp_config's is its current spelling)
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "mesh.context",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": "mesh.context",
}
LEAF_RENAMES: dict[str, str] = {"warmup_style": "lr_scheduler_type"}  # veRL's older name
# Values other frameworks write for one of ours: the same computation under another name.
VALUE_ALIASES: dict[str, dict[Any, Any]] = {
    # veRL's `dapo` manager = naive scoring + reward_kwargs.overlong_buffer_cfg, which our managers apply
    "reward_model.reward_manager": {"dapo": "naive"},
}


def our_value(key: str, value: Any) -> Any:
    """`value` of our key `key` in our spelling (VALUE_ALIASES), as a peer's file or command line wrote it."""
    aliases = VALUE_ALIASES.get(key, {})
    return aliases.get(value, value) if isinstance(value, str) else value

# Keys that only configure torch / FSDP / vLLM / Ray / Megatron: accepted, warned about, dropped.
TORCH_ONLY_PATTERNS: tuple[str, ...] = (
    "*fsdp_config", "*fsdp_config.*", "*megatron*", "*.strategy", "*.param_offload", "*.optimizer_offload",
    "*.offload_policy", "*.use_torch_compile", "*.ulysses_sequence_parallel_size",
    "reward_model.model.use_remove_padding",
    "*.use_fused_kernels", "*.fused_kernel_options*", "*.use_liger", "*.model.torch_dtype", "*.use_shm",
    "*.external_lib",
    "*.trust_remote_code", "*.enable_activation_offload", "*.checkpoint", "*.checkpoint.*", "*profiler*",
    "*.entropy_from_logits_with_chunking", "*.entropy_checkpointing", "*.tokenizer_path", "*.rollout_n",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.mode", "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.enforce_eager", "actor_rollout_ref.rollout.free_cache_engine",
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.load_format", "actor_rollout_ref.rollout.layered_summon",
    "actor_rollout_ref.rollout.disable_log_stats", "actor_rollout_ref.rollout.engine_kwargs*",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes", "actor_rollout_ref.rollout.multi_stage_wake_up",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes", "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.hybrid_engine", "actor_rollout_ref.nccl_timeout",
    "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.device", "trainer.balance_batch",
    "trainer.default_hdfs_dir", "trainer.del_local_ckpt_after_load", "trainer.ray_wait_register_center_timeout",
    "trainer.esi_redundant_time", "trainer.use_legacy_worker_impl", "ray_kwargs*", "ray_init*",
)


def is_torch_only(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in TORCH_ONLY_PATTERNS)


def warn_torch_only(key: str) -> None:
    logger.warning("config key %s has no effect in jaxrl_llm (torch/vLLM/Ray only); ignored", key)


def _in_open_section(key: str) -> bool:
    return any(key.startswith(s + ".") for s in OPEN_SECTIONS)


def canonical_key(key: str) -> str | None:
    """Our name for `key` (itself when known), or None when the key is torch-only (already warned).

    Raises ConfigError for unknown keys, suggesting close matches.
    """
    key = key.lstrip("+")  # Hydra's `+key=` / `++key=` (add / force-add) spelling
    if key in FIELDS or _in_open_section(key):
        return key
    renamed = NAME_ALIASES.get(key, key)
    parts = renamed.split(".")
    leaf = LEAF_RENAMES.get(parts[-1], parts[-1])
    if leaf.endswith("_per_gpu"):
        leaf = leaf[: -len("_per_gpu")] + "_per_device"
    renamed = ".".join(parts[:-1] + [leaf])
    if renamed in FIELDS:
        return renamed
    if is_torch_only(key) or is_torch_only(renamed):
        warn_torch_only(key)
        return None
    raise ConfigError(unknown_key_message(key))


def unknown_key_message(key: str) -> str:
    candidates = list(FIELDS) + list(NAME_ALIASES)
    close = difflib.get_close_matches(key, candidates, n=3, cutoff=0.6)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in FIELDS if k.rsplit(".", 1)[-1] == leaf and k not in close]
    close = close + same_leaf[:3]
    hint = f"; did you mean {', '.join(close)}?" if close else "; see docs/config.md for all keys"
    return f"{key}: unknown config key{hint}"


def parse_value(text: str) -> Any:
    """YAML-like scalar / list / dict parsing for `key=value` overrides."""
    s = text.strip()
    low = s.lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        if "_" in s:  # Python reads "0.5_2" as 0.52; here it is a k1 ratio range "lo_hi"
            break
        try:
            return cast(s)
        except ValueError:
            pass
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if s.startswith("[") and s.endswith("]"):
        inner = s[1:-1].strip()
        return [parse_value(item) for item in _split_top_level(inner)] if inner else []
    if s.startswith("{") and s.endswith("}"):
        try:
            value = yaml.safe_load(s)
        except yaml.YAMLError:
            value = ast.literal_eval(s)
        if not isinstance(value, dict):
            raise ConfigError(f"cannot parse {text!r} as a dict")
        return value
    return s


def _split_top_level(s: str) -> list[str]:
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(s):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(s[start:i])
            start = i + 1
    items.append(s[start:])
    return [item.strip() for item in items]


def _coerce_for_field(key: str, value: Any) -> Any:
    """Adjusts a parsed override to the key's type where the text was ambiguous."""
    f = FIELDS.get(key)
    if f is None:
        return value
    if f.types == (str,) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. experiment_name=2024
    if list in f.types and value is not None and not isinstance(value, f.types):
        return [value]  # trainer.logger=console (a bare value the key takes only as a list)
    return value


def set_value(cfg: ml_collections.ConfigDict, key: str, value: Any) -> None:
    """Sets one (possibly aliased) key; torch-only keys are warned about and dropped."""
    target = canonical_key(key)
    if target is None:
        return
    set_path(cfg, target, _coerce_for_field(target, our_value(target, value)))


def split_override(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. actor_rollout_ref.rollout.n=4)")
    key, text = item.split("=", 1)
    key = key.strip()
    if key.startswith("~"):  # Hydra delete: our tree has no optional sections to delete
        raise ConfigError(f"{key[1:]}: deleting keys (~key) is not supported; set it to null instead")
    return key, text


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Iterable[str]) -> ml_collections.ConfigDict:
    """Applies `key=value` strings in order (aliases resolved); returns `cfg` (modified in place)."""
    for item in overrides:
        key, text = split_override(item)
        set_value(cfg, key, parse_value(text))
    return cfg


def _holds_alias(section: str) -> bool:
    """A torch-only section with one of our aliases inside (veRL's ref.fsdp_config.param_offload)."""
    return any(alias.startswith(section + ".") for alias in NAME_ALIASES)


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for name in list(node.keys()):
        key = f"{prefix}{name}"
        value = node[name]
        if key in FIELDS:
            out.append((key, value))
        elif isinstance(value, (ml_collections.ConfigDict, dict)) and (
                not is_torch_only(key) or _holds_alias(key)) and (key in _SECTIONS or key not in NAME_ALIASES):
            out.extend(_flatten(value, key + "."))
        else:
            out.append((key, value))
    return out


def _sections(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for name, node in tree.items():
        if not isinstance(node, Field):
            out.add(prefix + name)
            out |= _sections(node, prefix + name + ".")
    return out


_SECTIONS = _sections(TREE)


def _delete(cfg: ml_collections.ConfigDict, key: str) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    # remove sections left empty by the deletion (e.g. a torch-only fsdp_config)
    for depth in range(len(parts) - 1, 0, -1):
        section = ".".join(parts[:depth])
        if section in _SECTIONS:
            break
        parent = cfg
        for part in parts[: depth - 1]:
            parent = parent[part]
        if len(parent[parts[depth - 1]]) == 0:
            del parent[parts[depth - 1]]


def normalize_config(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Resolves aliases / torch-only / unknown keys found inside `cfg`; returns cfg (in place).

    A value set under an alias (e.g. `ppo_micro_batch_size_per_gpu` written by a config file)
    moves onto our key; torch-only keys are warned about and removed; unknown keys raise.
    """
    for key, value in _flatten(cfg):
        if key in FIELDS or _in_open_section(key):
            continue
        target = canonical_key(key)  # raises for unknown keys
        _delete(cfg, key)
        if target is not None:
            set_path(cfg, target, our_value(target, value))
    for key in FIELDS:  # a config file may have deleted or replaced a section
        if not has_path(cfg, key):
            raise ConfigError(f"{key}: missing from the config (start from jaxrl_llm.config.default_config())")
    return cfg


def split_config_flag_overrides(argv: Sequence[str], flag: str = "config") -> tuple[list[str], list[str]]:
    """Takes absl-style `--config.a.b=v` / `--config.a.b v` / `--config.a.b` / `--noconfig.a.b` out of argv.

    Returns (argv without them, ["a.b=v", ...]). They are applied with `apply_overrides`, so the
    `--config.` and the veRL `a.b=v` spellings share one parser, aliases and torch-only handling
    (ml_collections' own override parser rejects None-valued keys, lists and unknown keys).
    """
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest.extend(argv[i:])
            break
        stripped = arg.lstrip("-")
        dashes = len(arg) - len(stripped)
        if dashes in (1, 2) and stripped.startswith(f"{flag}."):
            body = stripped[len(flag) + 1:]
            if "=" in body:
                overrides.append(body)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                overrides.append(f"{body}={argv[i + 1]}")
                i += 1
            else:
                overrides.append(f"{body}=true")
        elif dashes in (1, 2) and stripped.startswith(f"no{flag}."):
            overrides.append(f"{stripped[len(flag) + 3:]}=false")
        else:
            rest.append(arg)
        i += 1
    return rest, overrides

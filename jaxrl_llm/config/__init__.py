"""The config tree (veRL-shaped ml_collections), its validation, derived values and aliases.

    cfg = default_config()                     # every key with veRL's default
    cfg = apply_overrides(cfg, ["actor_rollout_ref.rollout.n=8", "rloo_k=4"])
    cfg = validate_config(cfg, dp_size=8)      # ConfigError naming the key, or a resolved copy
    spec = resolve(cfg, dp_size=8)             # the frozen, typed RunSpec everything below trainer/ reads
    print(spec.plan.summary())

Key docs: docs/config.md (generated from `jaxrl_llm/config/tree.py`).
"""
from __future__ import annotations

import ml_collections

from jaxrl_llm.batching.batch_plan import BatchPlan, MicroBatching, RoleBatch
from jaxrl_llm.config.derive import resolve_total_steps, synthetic_data_dir, synthetic_data_files
from jaxrl_llm.config.docs import render_config_docs
from jaxrl_llm.config.overrides import (
    NAME_ALIASES,
    apply_overrides,
    canonical_key,
    normalize_config,
    parse_value,
    split_config_flag_overrides,
)
from jaxrl_llm.config.paths import config_from_file, smollm2_gguf_path
from jaxrl_llm.config.resolve import (
    resolve,
    resolve_batch_plan,
    resolve_config,
    resolve_data,
    resolve_optim,
    resolve_reward,
    resolve_sampling,
    resolve_synthetic,
)
from jaxrl_llm.config.schema import ConfigError, Field, build_config, iter_fields
from jaxrl_llm.config.spec import (
    ActorSpec,
    AdvantageSpec,
    CriticSpec,
    KLControlSpec,
    ModelSpec,
    OptimSpec,
    RefSpec,
    RunSpec,
    TrainerSpec,
)
from jaxrl_llm.config.tree import TREE
from jaxrl_llm.config.validate import mesh_dp_size, validate_config


def default_config() -> ml_collections.ConfigDict:
    """A fresh ConfigDict with every key at its default (see docs/config.md)."""
    return build_config(TREE)


__all__ = [
    "ActorSpec", "AdvantageSpec", "BatchPlan", "ConfigError", "CriticSpec", "Field", "KLControlSpec", "MicroBatching",
    "ModelSpec", "NAME_ALIASES", "OptimSpec", "RefSpec", "RoleBatch", "RunSpec", "TREE", "TrainerSpec",
    "apply_overrides", "canonical_key", "config_from_file", "default_config", "iter_fields", "mesh_dp_size",
    "normalize_config", "parse_value",
    "render_config_docs", "resolve", "resolve_batch_plan", "resolve_config", "resolve_data", "resolve_optim",
    "resolve_reward", "resolve_sampling", "resolve_synthetic", "resolve_total_steps", "smollm2_gguf_path",
    "split_config_flag_overrides", "synthetic_data_dir", "synthetic_data_files", "validate_config",
]

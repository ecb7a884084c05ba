"""Typed specs for tests, built the way a run builds them: the default config tree with a few keys
changed, resolved by `jaxrl_llm.config` (so tests never restate a default)."""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_llm.config import default_config, resolve_data, resolve_optim, resolve_reward
from jaxrl_llm.data import DataSpec


def _update(section: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and key in section and hasattr(section[key], "keys"):
            _update(section[key], value)
        else:
            section[key] = value


def data_spec(builtin_scorers: bool = False, **values: Any) -> DataSpec:
    """`DataSpec` of the default `data` section with `values` set (nested dicts for sub-sections).
    `builtin_scorers` (a run with no custom reward: rows need a ground truth and a known data_source)
    is off unless asked, so data tests may use bare rows."""
    cfg = default_config()
    _update(cfg.data, values)
    return dataclasses.replace(resolve_data(cfg), builtin_scorers=builtin_scorers)


def optim_spec(total_steps: int, grad_clip: float | None = None, **values: Any):
    """`OptimSpec` of the default actor optimizer with `values` set and warmup resolved as validation does."""
    optim = default_config().actor_rollout_ref.actor.optim
    _update(optim, values)
    optim.total_training_steps = total_steps
    if optim.lr_warmup_steps is None or optim.lr_warmup_steps < 0:
        optim.lr_warmup_steps = int(optim.lr_warmup_steps_ratio * total_steps)
    return resolve_optim(optim, grad_clip)


def reward_spec(config: Any):
    """`RewardSpec` of a (validated) config."""
    return resolve_reward(config)

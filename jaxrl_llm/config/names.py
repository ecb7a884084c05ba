"""Valid names for the config's string choices.

Where a registry owns the names (advantage estimators, policy losses, KL kinds, aggregation modes,
rollout correction, reward managers, synthetic tasks, dtypes) they are read from it, so the
validator accepts exactly what the registry supports. The constants below are the choices that
belong to the config itself.
"""
from __future__ import annotations

from typing import Any

from jaxrl_llm.data import synthetic
from jaxrl_llm.losses import agg, rollout_correction
from jaxrl_llm.losses.advantages import ADV_ESTIMATORS
from jaxrl_llm.losses.kl import KL_ESTIMATORS, kl_penalty_kinds
from jaxrl_llm.losses.policy import POLICY_LOSSES
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES
from jaxrl_llm.models.remat import REMAT_POLICIES
from jaxrl_llm.rewards.managers import REWARD_MANAGERS

TRUNCATION = ("error", "left", "right", "middle")
LR_SCHEDULERS = ("constant", "cosine", "linear", "wsd")
KL_CTRL_TYPES = ("fixed", "adaptive")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# `trainer.memory_levers`, cheapest first: jaxrl_llm.planning.levers (which implements each)
MEMORY_LEVERS = ("ref_offload", "teacher_offload", "optimizer_offload", "remat", "bf16_moments")
DTYPES = COMPUTE_DTYPES  # `model.dtype` / `model.param_dtype`: jaxrl_llm.models.dtypes
TINY_MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen3_5_moe_text")
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "gemma4_text", "qwen3_5_text",
              "qwen2_5_vl", *TINY_MOE_ARCHS)
REMAT = REMAT_POLICIES  # `actor.remat_policy` / `critic.remat_policy`: jaxrl_llm.models.remat


def adv_estimators(**where: Any) -> tuple[str, ...]:
    """`algorithm.adv_estimator` names; `where` filters by capability, e.g. `needs_group_ids=True`."""
    return tuple(ADV_ESTIMATORS.names(**where))


def policy_losses(**where: Any) -> tuple[str, ...]:
    """`actor.policy_loss.loss_mode` names; `where` filters by capability (`fixed_agg_mode=None`)."""
    return tuple(POLICY_LOSSES.names(**where))


def kl_base_names() -> tuple[str, ...]:
    return tuple(KL_ESTIMATORS.names())


def kl_names() -> tuple[str, ...]:
    """KL kinds: the registry's, each also with a trailing '+' (k2 gradient), and 'full'."""
    return tuple(kl_penalty_kinds())


def loss_agg_modes() -> tuple[str, ...]:
    return tuple(sorted(agg.LOSS_AGG_MODES))


def rollout_is_levels() -> tuple[str, ...]:
    return tuple(sorted(rollout_correction.IS_LEVELS))


def rollout_rs_modes() -> tuple[str, ...]:
    """Rejection-sampling modes, including the legacy names (token, sequence, geometric)."""
    return tuple(sorted(tuple(rollout_correction.RS_MODES) + tuple(rollout_correction.RS_LEGACY)))


def reward_managers() -> tuple[str, ...]:
    return tuple(sorted(REWARD_MANAGERS))


def synthetic_tasks() -> tuple[str, ...]:
    return tuple(sorted(synthetic.TASKS))


def synthetic_answer_formats() -> tuple[str, ...]:
    return tuple(sorted(synthetic.ANSWER_FORMATS))

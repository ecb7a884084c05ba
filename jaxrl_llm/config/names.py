"""Valid names for the config's string choices.

Where a registry exists (losses, reward managers, synthetic tasks; keyed by veRL names) the names come from it, so the
validator never rejects a name the registry supports. The constant lists below are used only when
the registry module cannot be imported; `tests/config/test_config_names.py` checks they agree.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

FALLBACK_ADV_ESTIMATORS = (
    "gae", "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "rloo", "rloo_vectorized",
)
FALLBACK_POLICY_LOSSES = ("cispo", "geo_mean", "gpg", "gspo", "reinforce", "sapo", "vanilla")
FALLBACK_KL_BASE = ("abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse")
FALLBACK_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

FALLBACK_REWARD_MANAGERS = ("naive", "prime")
FALLBACK_SYNTHETIC_TASKS = ("add", "larger", "repeat")
FALLBACK_SYNTHETIC_FORMATS = ("first", "lenient", "strict")
TRUNCATION = ("error", "left", "right", "middle")
LR_SCHEDULERS = ("constant", "cosine")
RESUME_MODES = ("auto", "disable", "resume_path")
KL_CTRL_TYPES = ("fixed", "adaptive")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
DTYPES = ("float32", "bfloat16")
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
FALLBACK_ROLLOUT_IS = ("sequence", "token")
FALLBACK_ROLLOUT_RS = tuple(sorted(
    [f"token_k{i}" for i in (1, 2, 3)] + [f"seq_sum_k{i}" for i in (1, 2, 3)]
    + [f"seq_mean_k{i}" for i in (1, 2, 3)] + ["seq_max_k2", "seq_max_k3", "token", "sequence", "geometric"]
))


def _from_registry(module: str, read: Callable[[object], object], fallback: tuple[str, ...]) -> tuple[str, ...]:
    try:
        mod = importlib.import_module(module)
    except ImportError as err:  # the losses package is optional at config time
        logger.debug("config names: %s unavailable (%s); using the built-in list", module, err)
        return fallback
    return tuple(sorted(read(mod)))


def adv_estimators() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.losses.advantages", lambda m: m.ADV_ESTIMATORS.names(),
                          FALLBACK_ADV_ESTIMATORS)


def policy_losses() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.losses.policy", lambda m: m.POLICY_LOSSES.names(), FALLBACK_POLICY_LOSSES)


def kl_base_names() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.losses.kl", lambda m: m.KL_ESTIMATORS.names(), FALLBACK_KL_BASE)


def kl_names() -> tuple[str, ...]:
    """KL kinds: the registry's, each also with a trailing '+' (k2 gradient), and 'full'."""
    base = kl_base_names()
    return tuple(sorted(set(base) | {b + "+" for b in base} | {"full"}))


def loss_agg_modes() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.losses.agg", lambda m: m.LOSS_AGG_MODES, FALLBACK_LOSS_AGG_MODES)


def rollout_is_levels() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.losses.rollout_correction", lambda m: m.IS_LEVELS, FALLBACK_ROLLOUT_IS)


def rollout_rs_modes() -> tuple[str, ...]:
    """Rejection-sampling modes, including the legacy names (token, sequence, geometric)."""
    return _from_registry("jaxrl_llm.losses.rollout_correction", lambda m: tuple(m.RS_MODES) + tuple(m.RS_LEGACY),
                          FALLBACK_ROLLOUT_RS)


def reward_managers() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.rewards.managers", lambda m: m.REWARD_MANAGERS, FALLBACK_REWARD_MANAGERS)


def synthetic_tasks() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.data.synthetic", lambda m: m.TASKS, FALLBACK_SYNTHETIC_TASKS)


def synthetic_answer_formats() -> tuple[str, ...]:
    return _from_registry("jaxrl_llm.data.synthetic", lambda m: m.ANSWER_FORMATS, FALLBACK_SYNTHETIC_FORMATS)

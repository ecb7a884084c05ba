"""Rewards: rule-based scorers, custom reward functions, reward managers, reward model.

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None)  # veRL dispatch
    load_reward_fn(config) -> compute_score        # custom_reward_function.path/.name or the default
    build_reward_manager(config) -> RewardManager  # .score(...) -> RewardResult(scores, reward_extra_info, metrics)

The reward model (`jaxrl_llm.rewards.reward_model.RewardModel`, `score_sequences`) imports jax:
import it from its module when reward_model.enable is set.
"""
from jaxrl_llm.rewards.custom import RewardFunctionError, ScorerSpec, load_from_file, load_reward_fn
from jaxrl_llm.rewards.managers import (
    REWARD_MANAGERS,
    PrimeRewardManager,
    RewardManager,
    RewardResult,
    build_reward_manager,
)
from jaxrl_llm.rewards.scorers import UnknownDataSourceError, default_compute_score
from jaxrl_llm.rewards.shaping import missing_eos_penalty, overlong_penalty

__all__ = [
    "REWARD_MANAGERS",
    "PrimeRewardManager",
    "RewardFunctionError",
    "RewardManager",
    "RewardResult",
    "ScorerSpec",
    "UnknownDataSourceError",
    "build_reward_manager",
    "default_compute_score",
    "load_from_file",
    "load_reward_fn",
    "missing_eos_penalty",
    "overlong_penalty",
]

"""Rewards: rule-based scorers, custom reward functions, reward managers, reward model.

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None)  # veRL dispatch
    ScorerSpec(path, name, kwargs).load() -> compute_score   # custom_reward_function or the default
    build_reward_manager(spec: RewardSpec) -> RewardManager
        # .score(...) -> RewardResult(scores, reward_extra_info, metrics)

The reward model (`jaxrl_llm.roles.reward_model.RewardModel`, `score_sequences`) imports jax:
import it from its module when reward_model.enable is set.
"""
from jaxrl_llm.rewards.custom import RewardFunctionError, ScorerSpec, load_from_file
from jaxrl_llm.rewards.managers import (
    REWARD_MANAGERS,
    PrimeRewardManager,
    RewardManager,
    RewardResult,
    build_reward_manager,
)
from jaxrl_llm.rewards.scorers import UnknownDataSourceError, default_compute_score
from jaxrl_llm.rewards.shaping import missing_eos_penalty, overlong_penalty
from jaxrl_llm.rewards.spec import OverlongSpec, RewardModelSpec, RewardSpec

__all__ = [
    "REWARD_MANAGERS",
    "OverlongSpec",
    "PrimeRewardManager",
    "RewardFunctionError",
    "RewardManager",
    "RewardModelSpec",
    "RewardResult",
    "RewardSpec",
    "ScorerSpec",
    "UnknownDataSourceError",
    "build_reward_manager",
    "default_compute_score",
    "load_from_file",
    "missing_eos_penalty",
    "overlong_penalty",
]

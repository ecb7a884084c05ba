"""RL mathematics: logprobs, KL, policy/value/entropy losses, aggregation, advantages, rollout correction.

What each registered name computes: docs/algorithms.md. The registries are keyed by veRL's names:
`ADV_ESTIMATORS` (algorithm.adv_estimator), `POLICY_LOSSES` (actor.policy_loss.loss_mode),
`KL_ESTIMATORS` (kl_penalty / kl_loss_type).
"""
from jaxrl_llm.losses.advantages import ADV_ESTIMATORS, compute_advantage
from jaxrl_llm.losses.agg import agg_loss
from jaxrl_llm.losses.kl import KL_ESTIMATORS, kl_in_reward, kl_penalty, make_kl_controller
from jaxrl_llm.losses.logprob import token_logprobs
from jaxrl_llm.losses.masked import masked_mean, masked_sum, masked_whiten
from jaxrl_llm.losses.policy import POLICY_LOSSES, compute_policy_loss
from jaxrl_llm.losses.rollout_correction import compute_rollout_correction
from jaxrl_llm.losses.trl_rloo import TrlRlooOptions
from jaxrl_llm.losses.value import compute_value_loss

__all__ = ["ADV_ESTIMATORS", "KL_ESTIMATORS", "POLICY_LOSSES", "TrlRlooOptions", "agg_loss", "compute_advantage",
           "compute_policy_loss", "compute_rollout_correction", "compute_value_loss", "kl_in_reward", "kl_penalty",
           "make_kl_controller", "masked_mean", "masked_sum", "masked_whiten", "token_logprobs"]

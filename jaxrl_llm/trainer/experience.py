"""Experience: what the update needs beyond the rollout, computed on device.

reference log-probs (when a KL is used) -> old log-probs (the sampler's when they are exact) ->
critic values -> KL in reward (fixed / adaptive controller) -> advantages
(registry[algorithm.adv_estimator], or TRL's RLOO form) -> rollout correction weights.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from jaxrl_llm.losses.advantages import compute_advantage
from jaxrl_llm.losses.kl import kl_in_reward
from jaxrl_llm.losses.rollout_correction import compute_rollout_correction
from jaxrl_llm.losses.trl_rloo import trl_rloo_advantages
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.trainer.scoring import micro_batched, response_log_probs, response_values

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("model_cfg", "temperature", "compute_dtype", "micro_rows"))
def log_probs_no_grad(params: dict, input_ids: Array, attention_mask: Array, response_mask: Array, *,
                      model_cfg: ModelConfig, temperature: float, compute_dtype: str, micro_rows: int) -> Array:
    """Response log-probs [N, R] computed `micro_rows` rows at a time (reference / old policy)."""
    response_len = response_mask.shape[1]

    def one(chunk: dict) -> Array:
        return response_log_probs(params, model_cfg, chunk["ids"], chunk["mask"], response_len,
                                  temperature=temperature, compute_dtype=compute_dtype)

    return micro_batched(one, {"ids": input_ids, "mask": attention_mask}, micro_rows)


@functools.partial(jax.jit, static_argnames=("model_cfg", "compute_dtype", "micro_rows"))
def values_no_grad(params: dict, input_ids: Array, attention_mask: Array, response_mask: Array, *,
                   model_cfg: ModelConfig, compute_dtype: str, micro_rows: int) -> Array:
    response_len = response_mask.shape[1]

    def one(chunk: dict) -> Array:
        return response_values(params, model_cfg, chunk["ids"], chunk["mask"], response_len,
                               compute_dtype=compute_dtype)

    return micro_batched(one, {"ids": input_ids, "mask": attention_mask}, micro_rows)


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    trl_rloo: bool = False
    trl_kl_coef: float = 0.05
    trl_token_level_kl: bool = False
    trl_normalize_reward: bool = False
    trl_reward_clip_range: float = 10.0
    trl_normalize_advantage: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> "AdvantageSettings":
        alg = cfg.algorithm
        trl = alg.trl_rloo
        return cls(adv_estimator=alg.adv_estimator, gamma=float(alg.gamma), lam=float(alg.lam),
                   norm_adv_by_std_in_grpo=bool(alg.norm_adv_by_std_in_grpo),
                   use_kl_in_reward=bool(alg.use_kl_in_reward), kl_penalty=alg.kl_penalty,
                   trl_rloo=bool(trl.enable), trl_kl_coef=float(alg.kl_ctrl.kl_coef),
                   trl_token_level_kl=bool(trl.token_level_kl), trl_normalize_reward=bool(trl.normalize_reward),
                   trl_reward_clip_range=float(trl.reward_clip_range),
                   trl_normalize_advantage=bool(trl.normalize_advantage))


@functools.partial(jax.jit, static_argnames=("s",))
def advantages_and_returns(token_level_scores: Array, response_mask: Array, group_ids: Array,
                           old_log_probs: Array, ref_log_probs: Array | None, values: Array | None,
                           reward_baselines: Array | None, kl_coef: Array, *, s: AdvantageSettings
                           ) -> dict[str, Array]:
    """token_level_rewards (scores - beta * KL when KL is in the reward), advantages, returns."""
    out: dict[str, Array] = {}
    rewards = token_level_scores
    if s.use_kl_in_reward:
        rewards, current_kl = kl_in_reward(token_level_scores, old_log_probs, ref_log_probs, response_mask,
                                           kl_coef, s.kl_penalty)
        out["current_kl"] = current_kl
    if s.trl_rloo:
        seq_adv, trl_metrics = trl_rloo_advantages(
            token_level_scores.sum(-1), old_log_probs, ref_log_probs, response_mask, group_ids,
            kl_coef=s.trl_kl_coef, token_level_kl=s.trl_token_level_kl,
            normalize_reward=s.trl_normalize_reward, reward_clip_range=s.trl_reward_clip_range,
            normalize_advantage=s.trl_normalize_advantage)
        advantages = seq_adv[:, None] * response_mask
        returns = advantages
        out["trl_rlhf_reward"] = trl_metrics["rlhf_reward"].mean()
        out["trl_non_score_reward"] = trl_metrics["non_score_reward"].mean()
    else:
        advantages, returns = compute_advantage(
            s.adv_estimator, rewards, response_mask, group_ids=group_ids, values=values, gamma=s.gamma,
            lam=s.lam, norm_adv_by_std_in_grpo=s.norm_adv_by_std_in_grpo, reward_baselines=reward_baselines)
    out.update(token_level_rewards=rewards, advantages=advantages, returns=returns)
    return out


@functools.partial(jax.jit, static_argnames=("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                             "rollout_rs", "rollout_rs_threshold"))
def rollout_correction(old_log_probs: Array, rollout_log_probs: Array, response_mask: Array, *,
                       rollout_is: str | None, rollout_is_threshold: float, rollout_is_batch_normalize: bool,
                       rollout_rs: str | None, rollout_rs_threshold: Any):
    """(IS weights or None, response mask after rejection sampling, metrics) for the actor update."""
    return compute_rollout_correction(
        old_log_probs, rollout_log_probs, response_mask, rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold, rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)

"""RLOO in TRL's form (`RLOOTrainer`): KL folded into the sequence score, leave-one-out baseline.

Steps and config keys: docs/algorithms.md, "RLOO in TRL's form".
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.masked import dense_group_index, group_count, group_sum, masked_sum

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TrlRlooOptions:
    """The `adv_estimator=trl_rloo` settings (`algorithm.trl_rloo.*`, kl_coef from `algorithm.kl_ctrl`)."""

    kl_coef: float = 0.05
    token_level_kl: bool = False
    normalize_reward: bool = False
    reward_clip_range: float = 10.0
    normalize_advantage: bool = False


def _std(x: Array) -> Array:
    return jnp.std(x, ddof=1)  # torch.std is unbiased


def trl_rloo_advantages(
    scores: Array,
    logprobs: Array,
    ref_logprobs: Array,
    response_mask: Array,
    group_ids: Array,
    *,
    kl_coef: float = 0.05,
    token_level_kl: bool = False,
    normalize_reward: bool = False,
    reward_clip_range: float = 10.0,
    normalize_advantage: bool = False,
    missing_eos_penalty: float | None = None,
    has_eos: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Per-sequence advantages `[B]` with TRL's order of operations.

    1. `missing_eos_penalty` is subtracted from scores of responses without EOS (`has_eos` False);
    2. `normalize_reward`: `(s - mean) / (std + 1e-8)` over the batch, clipped to +-reward_clip_range;
    3. KL `logprobs - ref_logprobs` over valid tokens, `score = s - kl_coef * sum_t KL_t`. TRL's
       `token_level_kl` applies `-kl_coef * KL_t` per token and then sums it, which is the same
       number; it is accepted for config parity and both forms are tested to agree;
    4. advantage = score - mean of the other samples of the group (0 for a singleton);
    5. `normalize_advantage`: `(a - mean) / (std + 1e-8)` over the batch.
    Returns the advantages and `{"rlhf_reward": score, "non_score_reward": -kl_coef * sum KL}`.
    """
    scores = jnp.asarray(scores, jnp.float32)
    mask = jnp.asarray(response_mask, jnp.float32)
    if missing_eos_penalty is not None:
        if has_eos is None:
            raise ValueError("missing_eos_penalty needs has_eos [B] (does each response contain EOS)")
        scores = jnp.where(jnp.asarray(has_eos, bool), scores, scores - missing_eos_penalty)
    if normalize_reward:
        scores = (scores - jnp.mean(scores)) / (_std(scores) + 1e-8)
        scores = jnp.clip(scores, -reward_clip_range, reward_clip_range)
    kl = jnp.asarray(logprobs, jnp.float32) - jnp.asarray(ref_logprobs, jnp.float32)
    if token_level_kl:
        non_score_reward = masked_sum(-kl_coef * kl, mask, axis=-1)
    else:
        non_score_reward = -kl_coef * masked_sum(kl, mask, axis=-1)
    rlhf_reward = scores + non_score_reward
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    baseline = (group_sum(rlhf_reward, seg) - rlhf_reward) / jnp.maximum(n - 1, 1)
    advantages = jnp.where(n > 1, rlhf_reward - baseline, 0.0)
    if normalize_advantage:
        advantages = (advantages - jnp.mean(advantages)) / (_std(advantages) + 1e-8)
    return advantages, {"rlhf_reward": rlhf_reward, "non_score_reward": non_score_reward}


def trl_rloo_with(options: TrlRlooOptions, scores: Array, logprobs: Array, ref_logprobs: Array,
                  response_mask: Array, group_ids: Array) -> tuple[Array, dict[str, Array]]:
    """`trl_rloo_advantages` with the run's `options`."""
    return trl_rloo_advantages(scores, logprobs, ref_logprobs, response_mask, group_ids,
                               **dataclasses.asdict(options))

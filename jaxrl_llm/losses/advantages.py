"""Advantage estimators registered under veRL's `algorithm.adv_estimator` names.

Every estimator maps `(token_level_rewards [B,T], response_mask [B,T])` plus its extras to
`(advantages [B,T], returns [B,T])`, in the form docs/algorithms.md states. Groups are
`group_ids: int32[B]` (interleaved, any size, singletons allowed) and are reduced with segment
sums over dense indices, so everything is jittable with no host sync or Python loop over groups.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrl_llm.losses.masked import (
    dense_group_index,
    group_count,
    group_sum,
    is_concrete,
    masked_whiten,
)
from jaxrl_llm.losses.registry import Registry
from jaxrl_llm.losses.trl_rloo import TrlRlooOptions, trl_rloo_with

Array = jax.Array
# Each capability names the keyword input an estimator cannot run without. `needs_group_ids` also
# means "compares the samples of one prompt", so the config asks for rollout.n >= 2.
INPUT_CAPABILITIES = {
    "needs_group_ids": ("group_ids", "[B] int32, one id per prompt shared by its samples"),
    "needs_values": ("values", "[B, T] from the critic"),
    "needs_reward_baselines": ("reward_baselines", "[B] (the greedy rollout's scores)"),
    "needs_log_probs": ("log_probs", "[B, T] (the policy's, for a KL folded into the score)"),
    "needs_ref_log_probs": ("ref_log_probs", "[B, T] (the reference policy's)"),
}
ADV_ESTIMATORS: Registry[Callable] = Registry("advantage estimator", {cap: False for cap in INPUT_CAPABILITIES})
register_adv_est = ADV_ESTIMATORS.register


def compute_advantage(
    name: str,
    token_level_rewards: Array,
    response_mask: Array,
    *,
    group_ids: Array | None = None,
    values: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: Array | None = None,
    f_norm: float = 1.0,
    alpha: float | None = None,
    log_probs: Array | None = None,
    ref_log_probs: Array | None = None,
    trl_rloo: TrlRlooOptions | None = None,
) -> tuple[Array, Array]:
    """Dispatch to the estimator registered as `name` (veRL's `algorithm.adv_estimator`).
    `f_norm` is GPG's normaliser (veRL's `compute_gpg_outcome_advantage`); others ignore it.
    `alpha` is accepted for veRL's call signature of that function, which takes it and then uses
    B / (number of non-zero scores) instead; GPG here does the same, so its value changes nothing.
    `log_probs` / `ref_log_probs` [B, T] and `trl_rloo` (its options) are what `trl_rloo` folds
    into the score as TRL's KL."""
    del alpha
    fn = ADV_ESTIMATORS.get(name)
    given = {"group_ids": group_ids, "values": values, "reward_baselines": reward_baselines,
             "log_probs": log_probs, "ref_log_probs": ref_log_probs}
    for cap, (arg, what) in INPUT_CAPABILITIES.items():
        if ADV_ESTIMATORS.capability(name, cap) and given[arg] is None:
            raise ValueError(f"advantage estimator {name!r} needs {arg} {what}")
    rewards = jnp.asarray(token_level_rewards, jnp.float32)
    mask = jnp.asarray(response_mask, jnp.float32)
    if rewards.shape != mask.shape or rewards.ndim != 2:
        raise ValueError(f"token_level_rewards {rewards.shape} and response_mask {mask.shape} must both be [B, T]")
    return fn(rewards, mask, group_ids=group_ids, values=values, gamma=gamma, lam=lam, epsilon=epsilon,
              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, reward_baselines=reward_baselines, f_norm=f_norm,
              log_probs=log_probs, ref_log_probs=ref_log_probs, trl_rloo=trl_rloo or TrlRlooOptions())


def _group_mean_std(scores: Array, seg: Array) -> tuple[Array, Array, Array]:
    """Per-row group mean and unbiased std (two-pass, like torch.std), and group size n."""
    n = group_count(seg)
    mean = group_sum(scores, seg) / n
    var = group_sum((scores - mean) ** 2, seg) / jnp.maximum(n - 1, 1)
    return mean, jnp.sqrt(var), n


def _outcome(scalar: Array, mask: Array) -> tuple[Array, Array]:
    adv = scalar[:, None] * mask
    return adv, adv


@register_adv_est("gae", needs_values=True)
def gae(rewards, mask, *, values, gamma, lam, **_):
    """GAE; masked positions carry `nextvalue` and `lastgaelam` through unchanged (holes bridged)."""
    values = jnp.asarray(values, jnp.float32)

    def step(carry, xs):
        nextvalue, lastgaelam = carry
        r, v, m = xs
        valid = m > 0
        delta = r + gamma * nextvalue - v
        gaelam = delta + gamma * lam * lastgaelam
        nextvalue = jnp.where(valid, v, nextvalue)
        lastgaelam = jnp.where(valid, gaelam, lastgaelam)
        return (nextvalue, lastgaelam), lastgaelam

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, adv_t = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
    raw_adv = adv_t.T
    returns = raw_adv + values
    return masked_whiten(raw_adv, mask), returns


@register_adv_est("grpo", needs_group_ids=True)
def grpo(rewards, mask, *, group_ids, epsilon, norm_adv_by_std_in_grpo, **_):
    """(s - mean) / (std + eps) per group (Bessel std); Dr.GRPO `s - mean`; singleton mean 0 std 1."""
    scores = rewards.sum(-1)
    mean, std, n = _group_mean_std(scores, dense_group_index(group_ids))
    single = n <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    scalar = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    return _outcome(scalar, mask)


@register_adv_est("grpo_vectorized", needs_group_ids=True)
def grpo_vectorized(rewards, mask, *, group_ids, epsilon, norm_adv_by_std_in_grpo, **_):
    """As grpo with one-pass variance (sum s^2 - (sum s)^2/n)/max(n-1,1) floored at eps."""
    scores = rewards.sum(-1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    s1 = group_sum(scores, seg)
    s2 = group_sum(scores * scores, seg)
    mean = s1 / n
    var = (s2 - s1 * s1 / n) / jnp.maximum(n - 1, 1)
    std = jnp.sqrt(jnp.maximum(var, epsilon))
    single = n <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, std)
    scalar = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    return _outcome(scalar, mask)


@register_adv_est("grpo_passk", needs_group_ids=True)
def grpo_passk(rewards, mask, *, group_ids, epsilon, norm_adv_by_std_in_grpo, **_):
    """Only each group's best response (first on ties) gets r1 - r2 (/ (std + eps) if norm)."""
    scores = rewards.sum(-1)
    b = scores.shape[0]
    seg = dense_group_index(group_ids)
    _, std, n = _group_mean_std(scores, seg)
    if is_concrete(n) and bool(jnp.any(n < 2)):
        raise ValueError("grpo_passk needs at least 2 samples per group; got a group of size 1")
    gmax = jax.ops.segment_max(scores, seg, num_segments=b)[seg]
    rows = jnp.arange(b)
    first_max = jax.ops.segment_min(jnp.where(scores == gmax, rows, b), seg, num_segments=b)[seg]
    is_top = rows == first_max
    second = jax.ops.segment_max(jnp.where(is_top, -jnp.inf, scores), seg, num_segments=b)[seg]
    adv = gmax - second
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    scalar = jnp.where(is_top, adv, 0.0)
    scalar = jnp.where(n < 2, jnp.nan, scalar)  # under jit a singleton cannot raise: NaN marks it
    return _outcome(scalar, mask)


@register_adv_est("rloo", needs_group_ids=True)
def rloo(rewards, mask, *, group_ids, **_):
    """n/(n-1) * (s - mean); a singleton keeps its raw score."""
    scores = rewards.sum(-1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    mean = group_sum(scores, seg) / n
    scale = n / jnp.maximum(n - 1, 1)
    scalar = jnp.where(n > 1, scores * scale - mean * scale, scores)
    return _outcome(scalar, mask)


@register_adv_est("rloo_vectorized", needs_group_ids=True)
def rloo_vectorized(rewards, mask, *, group_ids, **_):
    """(n*s - sum s) / max(n-1, 1): the score minus the mean of the others; 0 for a singleton."""
    scores = rewards.sum(-1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    scalar = (n * scores - group_sum(scores, seg)) / jnp.maximum(n - 1, 1)
    return _outcome(scalar, mask)


@register_adv_est("opo", needs_group_ids=True)
def opo(rewards, mask, *, group_ids, **_):
    """Baseline = length-weighted group mean sum(len*s)/sum(len); singleton baseline 0."""
    scores = rewards.sum(-1)
    length = mask.sum(-1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    baseline = group_sum(length * scores, seg) / group_sum(length, seg)
    scalar = scores - jnp.where(n > 1, baseline, 0.0)
    return _outcome(scalar, mask)


def _discounted_returns(rewards: Array, mask: Array, gamma: float) -> Array:
    """Reverse discounted return over valid tokens, reset to 0 after each masked position; [B, T], unmasked."""

    def step(running, xs):
        r, m = xs
        running = r + gamma * running
        return jnp.where(m > 0, running, 0.0), running

    _, ret_t = jax.lax.scan(step, jnp.zeros(rewards.shape[0], jnp.float32), (rewards.T, mask.T), reverse=True)
    return ret_t.T


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(rewards, mask, *, gamma, **_):
    """Reverse discounted return, reset to 0 after each masked position; whitened * mask."""
    returns = _discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@register_adv_est("reinforce")
def reinforce(rewards, mask, *, gamma, **_):
    """ROLL's `reinforce` without reward normalisation or whitening (norm_mean_type / norm_std_type None,
    whiten_advantages false): the plain policy gradient's discounted return, as REINFORCE++ computes it,
    unwhitened; advantages = returns * mask."""
    returns = _discounted_returns(rewards, mask, gamma)
    return returns * mask, returns


@register_adv_est("reinforce_plus_plus_baseline", needs_group_ids=True)
def reinforce_plus_plus_baseline(rewards, mask, *, group_ids, **_):
    """s - group mean (singleton 0) tiled over tokens, whitened over all valid tokens, * mask."""
    scores = rewards.sum(-1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    mean = jnp.where(n > 1, group_sum(scores, seg) / n, 0.0)
    tiled = (scores - mean)[:, None] * mask
    adv = masked_whiten(tiled, mask) * mask
    return adv, adv


@register_adv_est("remax", needs_reward_baselines=True)
def remax(rewards, mask, *, reward_baselines, **_):
    """returns = reverse cumsum(rewards * mask); advantages = returns - baseline * mask."""
    masked = jnp.where(mask > 0, rewards, 0.0)
    returns = jnp.flip(jnp.cumsum(jnp.flip(masked, -1), -1), -1)
    adv = returns - jnp.asarray(reward_baselines, jnp.float32)[:, None] * mask
    return adv, returns


@register_adv_est("gpg", needs_group_ids=True)
def gpg(rewards, mask, *, group_ids, f_norm=1.0, **_):
    """alpha * (s - group mean) / f_norm, alpha = B / max(#non-zero scores, 1), singleton mean 0, no std."""
    scores = rewards.sum(-1)
    b = scores.shape[0]
    alpha = b / jnp.maximum(jnp.count_nonzero(scores), 1)
    seg = dense_group_index(group_ids)
    n = group_count(seg)
    mean = jnp.where(n > 1, group_sum(scores, seg) / n, 0.0)
    return _outcome(alpha * (scores - mean) / f_norm, mask)


__all__ = ["ADV_ESTIMATORS", "INPUT_CAPABILITIES", "compute_advantage", "register_adv_est"]


@register_adv_est("trl_rloo", needs_group_ids=True, needs_log_probs=True, needs_ref_log_probs=True)
def trl_rloo(rewards, mask, *, group_ids, log_probs, ref_log_probs, trl_rloo, **_):
    """TRL RLOOTrainer's sequence-level RLOO (losses/trl_rloo.py): the KL folded into the sequence
    score, leave-one-out baseline; every response token gets its sequence's advantage."""
    seq_adv, _ = trl_rloo_with(trl_rloo, rewards.sum(-1), log_probs, ref_log_probs, mask, group_ids)
    advantages = seq_adv[:, None] * mask
    return advantages, advantages

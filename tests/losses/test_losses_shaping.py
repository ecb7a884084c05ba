"""ROLL's shaping around the estimator (losses/shaping.py, roles/experience.py `advantages_and_returns`)
against ROLL's own formulas (roll/utils/functionals.py: `get_sample_level_mask`, `reward_postprocess`,
`compute_advantage`, `compute_reinforce_return`, `compute_gae_advantage_return`), written out here in
numpy, float64, on fixed inputs."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config.spec import AdvantageSpec
from jaxrl_llm.losses.shaping import clip_sequence_scores, clip_symmetric, sample_mask, whiten_tokens
from jaxrl_llm.losses.trl_rloo import TrlRlooOptions
from jaxrl_llm.roles.experience import advantages_and_returns

# 6 responses of up to 5 tokens, 3 prompts x 2 samples; one multi-turn row with a hole
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0],
                 [1, 1, 1, 1, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
SCORES = np.array([3.0, -0.5, 1.0, 0.0, 12.0, -20.0])
GROUPS = np.array([0, 0, 1, 1, 2, 2], np.int32)
VALUES = np.linspace(-0.4, 0.6, 30).reshape(6, 5).astype(np.float32) * MASK


def _last(mask):
    return np.array([np.nonzero(row)[0][-1] for row in mask])


def token_scores(scores, mask):
    out = np.zeros(mask.shape)
    out[np.arange(len(scores)), _last(mask)] = scores
    return out


# ---- ROLL's formulas, as its functionals.py writes them -------------------------------------------
def roll_masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = (((values - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8) * mask.sum() / (mask.sum() - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def roll_reinforce_return(rewards, gamma):
    out, running = np.zeros_like(rewards), np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out


def roll_group_norm(scores, n):
    grouped = scores.reshape(-1, n)
    return ((grouped - grouped.mean(-1, keepdims=True)) / (grouped.std(-1, ddof=1, keepdims=True) + 1e-6)).ravel()


def roll_compute_advantage(advantages, mask, *, whiten, clip):
    if whiten:
        advantages = roll_masked_whiten(advantages, mask)
    advantages = advantages * mask
    if clip is not None:
        advantages = np.clip(advantages, -clip, clip)
    return advantages


# ---------------------------------------------------------------------------------------------------
def spec(estimator, **kw):
    base = dict(adv_estimator=estimator, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, use_kl_in_reward=False,
                kl_penalty="kl", trl_rloo=TrlRlooOptions())
    return AdvantageSpec(**{**base, **kw})


def run(s, scores=SCORES, mask=MASK, values=None):
    out = advantages_and_returns(jnp.asarray(token_scores(scores, mask), jnp.float32), jnp.asarray(mask),
                                 jnp.asarray(GROUPS), jnp.zeros(mask.shape), None,
                                 None if values is None else jnp.asarray(values), None, jnp.float32(0.0), s=s)
    return {k: np.asarray(v) for k, v in out.items()}


def test_whiten_tokens_is_rolls_masked_whiten_times_the_mask():
    x = np.random.default_rng(0).normal(size=MASK.shape).astype(np.float32)
    want = roll_masked_whiten(x.astype(np.float64), MASK) * MASK
    np.testing.assert_allclose(np.asarray(whiten_tokens(jnp.asarray(x), jnp.asarray(MASK))), want, rtol=1e-5, atol=1e-6)
    one = np.zeros_like(MASK)
    one[0, 0] = 1  # one response token: ROLL does not whiten it (nothing to whiten over); no NaN
    np.testing.assert_array_equal(np.asarray(whiten_tokens(jnp.asarray(x), jnp.asarray(one))), x * one)


def test_clips_and_their_fractions():
    x = jnp.asarray([[-3.0, 0.5, 2.5], [1.0, -1.9, 9.0]])
    counted = jnp.asarray([[1, 1, 1], [1, 1, 0]])
    clipped, frac = clip_symmetric(x, 2.0, counted)
    np.testing.assert_allclose(np.asarray(clipped), [[-2.0, 0.5, 2.0], [1.0, -1.9, 2.0]])
    assert float(frac) == pytest.approx(2 / 5)  # the 9.0 is not a counted entry
    moved, frac = clip_sequence_scores(jnp.asarray(token_scores(SCORES, MASK), jnp.float32), jnp.asarray(MASK), 10.0)
    np.testing.assert_allclose(np.asarray(moved), token_scores(np.clip(SCORES, -10, 10), MASK))
    assert float(frac) == pytest.approx(2 / 6)


def test_sample_masks_follow_rolls_get_sample_level_mask():
    lengths = MASK.sum(-1).astype(np.int32)  # rows 1 and 5 reached the 5-token limit
    scores = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # group means 1.0, 0.5, 0.0
    keep, metrics = sample_mask(scores, lengths, GROUPS, max_response_length=5, max_len_mask=True,
                                difficulty=(0.1, 0.95))
    # ROLL: max_len_mask = (max_len != length); difficulty = low < group mean < high; the product
    max_len = (lengths != 5).astype(float)
    means = np.repeat(scores.reshape(-1, 2).mean(-1), 2)
    difficulty = ((means > 0.1) & (means < 0.95)).astype(float)
    np.testing.assert_array_equal(keep, max_len * difficulty)
    assert metrics == pytest.approx({"actor/max_len_mask_ratio": 4 / 6, "actor/difficulty_mask_ratio": 2 / 6,
                                     "actor/final_mask_ratio": 2 / 6, "actor/samples_used": 2.0,
                                     "actor/samples_total": 6.0})
    keep, metrics = sample_mask(scores, lengths, GROUPS, max_response_length=5, difficulty=(0.6, 0.9))
    np.testing.assert_array_equal(keep, np.ones(6))  # every prompt left out: ROLL keeps them all
    assert metrics["actor/difficulty_mask_ratio"] == 0.0 and metrics["actor/final_mask_ratio"] == 1.0


def test_rolls_grpo_chain_reward_clip_whiten_advantage_clip():
    """ROLL's grpo: group-normalised score, clipped (reward_clip), as the return of every response
    token, whitened over the batch, clipped again (advantage_clip)."""
    s = spec("grpo", reward_clip=0.6, whiten_advantages=True, advantage_clip=1.2)
    out = run(s)
    normalised = np.clip(roll_group_norm(SCORES, 2), -0.6, 0.6)
    returns = roll_reinforce_return(token_scores(normalised, MASK) * MASK, 1.0)
    want = roll_compute_advantage(returns, MASK, whiten=True, clip=1.2)
    np.testing.assert_allclose(out["advantages"] * MASK, want, rtol=1e-5, atol=1e-5)
    assert float(out["critic/reward_clip_frac"]) == pytest.approx(np.mean(np.abs(roll_group_norm(SCORES, 2)) > 0.6))
    assert float(out["critic/advantage_clip_frac"]) == pytest.approx(
        ((np.abs(roll_masked_whiten(returns, MASK)) > 1.2) * MASK).sum() / MASK.sum())


def test_rolls_reinforce_with_whitening_is_reinforce_plus_plus():
    """ROLL's reinforce without normalisation, whiten_advantages on (its RLVR recipes; the importer maps it
    to reinforce_plus_plus): the raw score clipped, discounted returns, whitened, clipped."""
    mask = np.ones_like(MASK)  # ROLL's return runs through holes; veRL's REINFORCE++ restarts there
    out = run(spec("reinforce_plus_plus", gamma=0.9, reward_clip=10.0, advantage_clip=1.5), mask=mask)
    returns = roll_reinforce_return(token_scores(np.clip(SCORES, -10, 10), mask) * mask, 0.9)
    want = roll_compute_advantage(returns, mask, whiten=True, clip=1.5)
    np.testing.assert_allclose(out["advantages"], want, rtol=1e-5, atol=1e-5)
    assert float(out["critic/reward_clip_frac"]) == pytest.approx(2 / 6)


def roll_reward_norm(scores, mean_type, std_type, n=2):
    """ROLL's reward_norm (functionals.py): batch or group (consecutive groups of n) statistics; torch's std is
    unbiased about its own mean."""
    grouped = scores.reshape(-1, n)
    means = {"batch": scores.mean(), "group": np.repeat(grouped.mean(-1), n), None: 0.0}
    stds = {"batch": scores.std(ddof=1), "group": np.repeat(grouped.std(-1, ddof=1), n)}
    out = scores - means[mean_type]
    return out / (stds[std_type] + 1e-6) if std_type else out


@pytest.mark.parametrize("mean_type,std_type", [("batch", "batch"), ("batch", None), (None, "batch"),
                                                ("group", "batch"), ("group", None)])
def test_rolls_batch_reward_norm_then_clip_then_reinforce(mean_type, std_type):
    """ROLL's reward_postprocess for a non-grpo estimator: the scores normalised over the batch, then
    clipped (its off-policy recipe: reinforce, batch / batch, reward_clip, whitened: REINFORCE++)."""
    mask = np.ones_like(MASK)
    scores = np.array([3.0, -0.5, 1.0, 0.0, 40.0, -20.0])
    out = run(spec("reinforce_plus_plus", reward_clip=1.5, advantage_clip=3.0, norm_mean_type=mean_type,
                   norm_std_type=std_type), scores=scores, mask=mask)
    normalised = np.clip(roll_reward_norm(scores, mean_type, std_type), -1.5, 1.5)
    returns = roll_reinforce_return(token_scores(normalised, mask) * mask, 1.0)
    np.testing.assert_allclose(out["advantages"], roll_compute_advantage(returns, mask, whiten=True, clip=3.0),
                               rtol=1e-5, atol=1e-5)
    assert float(out["critic/reward_clip_frac"]) == pytest.approx(
        np.mean(np.abs(roll_reward_norm(scores, mean_type, std_type)) > 1.5))
    assert 0 < float(out["critic/reward_clip_frac"]) < 1  # the clip binds on the normalised scores
    # a multi-turn row's change lands on its last response token; its other token scores stay
    moved = run(spec("reinforce", norm_mean_type="batch"), scores=SCORES)["token_level_rewards"]
    np.testing.assert_allclose(moved * MASK, token_scores(SCORES - SCORES.mean(), MASK) * MASK, atol=1e-5)


def test_rolls_gae_chain_whiten_rewards_then_advantages():
    """ROLL's gae with whitened token rewards and whitened advantages (ours: gae whitens, as veRL's does)."""
    mask = np.ones_like(MASK)
    out = run(spec("gae", gamma=0.95, lam=0.9, whiten_rewards=True), mask=mask, values=VALUES)
    rewards = roll_masked_whiten(token_scores(SCORES, mask), mask) * mask
    lastgaelam, adv = np.zeros(6), np.zeros(mask.shape)
    for t in reversed(range(mask.shape[1])):
        nextvalues = VALUES[:, t + 1] if t < mask.shape[1] - 1 else 0.0
        lastgaelam = rewards[:, t] + 0.95 * nextvalues - VALUES[:, t] + 0.95 * 0.9 * lastgaelam
        adv[:, t] = lastgaelam
    np.testing.assert_allclose(out["advantages"], roll_compute_advantage(adv, mask, whiten=True, clip=None),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["returns"], adv + VALUES, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["token_level_rewards"], rewards, rtol=1e-5, atol=1e-6)


def test_shaping_off_changes_nothing():
    plain = run(spec("grpo"))
    assert not any(k.endswith("clip_frac") for k in plain)
    again = run(dataclasses.replace(spec("grpo"), whiten_rewards=False, reward_clip=None))
    np.testing.assert_array_equal(plain["advantages"], again["advantages"])


def test_pf_ppo_weights_and_draws_follow_verls_formula():
    """veRL's compute_pf_ppo_reweight_data: weights from the sequence scores (+1e-8, at least 1e-8), rows
    drawn with replacement in proportion."""
    from jaxrl_llm.losses.shaping import pf_ppo_rows, pf_ppo_weights

    scores = np.array([-1.0, 0.0, 0.5, 2.0, 2.0])
    np.testing.assert_allclose(pf_ppo_weights(scores, "pow", 2.0), np.abs(scores) ** 2 + 1e-8)
    np.testing.assert_allclose(pf_ppo_weights(scores, "pow", 1.0), np.abs(scores) + 1e-8)
    np.testing.assert_allclose(pf_ppo_weights(scores, "max_min", 2.0), [1, 1e-8, 1e-8, 1, 1] + np.array(
        [1e-8, 0, 0, 1e-8, 1e-8]))
    np.testing.assert_allclose(pf_ppo_weights(scores, "max_random", 2.0), [0.1 + 1e-8] * 3 + [0.4 + 1e-8] * 2)
    with pytest.raises(ValueError, match="reweight_method"):
        pf_ppo_weights(scores, "top", 2.0)
    # the draws: as many as rows, with replacement, in proportion to the weights
    draws = np.concatenate([pf_ppo_rows(scores, "pow", 2.0, seed) for seed in range(4000)])
    assert draws.shape == (20000,)
    share = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(share, np.abs(scores) ** 2 / np.sum(np.abs(scores) ** 2), atol=0.015)
    assert share[1] == 0.0  # a zero score's 1e-8 weight is as good as never drawn
    assert np.array_equal(pf_ppo_rows(scores, "pow", 2.0, 7), pf_ppo_rows(scores, "pow", 2.0, 7))


def test_truncated_rows_are_trls():
    """TRL's mask_truncated_completions: a completion without an EOS token is truncated (here: its last
    response token is not an EOS id, or it is empty)."""
    from jaxrl_llm.losses.shaping import truncated_rows

    got = truncated_rows(np.array([2, 5, 2, 7]), np.array([3, 8, 0, 4]), (2, 7))
    np.testing.assert_array_equal(got, [False, True, True, False])

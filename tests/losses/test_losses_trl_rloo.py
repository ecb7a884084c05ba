import jax
import numpy as np
import pytest

from jaxrl_llm.losses.trl_rloo import trl_rloo_advantages

TOL = dict(atol=1e-5, rtol=1e-4)


def np_trl(scores, lp, rlp, m, k, kl_coef, norm_r, clip, norm_a, penalty, has_eos):
    """TRL RLOOTrainer order of operations on k-major batches (sample j of prompt p at j*P + p)."""
    s = scores.astype(np.float64).copy()
    if penalty is not None:
        s[~has_eos] -= penalty
    if norm_r:
        s = np.clip((s - s.mean()) / (s.std(ddof=1) + 1e-8), -clip, clip)
    kl = np.where(m > 0, lp - rlp, 0.0)  # TRL masks padding logprobs to the same value
    r = (s + (-kl_coef * kl).sum(1)).reshape(k, -1)
    a = (r - (r.sum(0) - r) / (k - 1)).flatten()
    if norm_a:
        a = (a - a.mean()) / (a.std(ddof=1) + 1e-8)
    return a


@pytest.mark.parametrize("token_level_kl", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_trl(batch, token_level_kl, norm):
    m, lp, rlp = batch["mask"], batch["lp"], batch["old"]
    k = 2  # 4 prompts x 2 samples in TRL's k-major layout
    ids = np.tile(np.arange(4), k).astype(np.int32)
    scores = batch["rng"].normal(size=8).astype(np.float32) * 3
    has_eos = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
    fn = jax.jit(lambda *a: trl_rloo_advantages(*a, kl_coef=0.05, token_level_kl=token_level_kl,
                                                normalize_reward=norm, reward_clip_range=1.0,
                                                normalize_advantage=norm, missing_eos_penalty=1.0,
                                                has_eos=has_eos)[0])
    got = fn(scores, lp, rlp, m, ids)
    np.testing.assert_allclose(got, np_trl(scores, lp, rlp, m, k, 0.05, norm, 1.0, norm, 1.0, has_eos), **TOL)


def test_equals_rloo_vectorized_and_singletons(batch):
    from jaxrl_llm.losses.advantages import compute_advantage

    m = batch["mask"]
    scores = batch["rng"].normal(size=8).astype(np.float32)
    rewards = np.zeros_like(m)
    rewards[:, 0] = scores
    a, _ = trl_rloo_advantages(scores, m * 0, m * 0, m, batch["group_ids"], kl_coef=0.1)
    b, _ = compute_advantage("rloo_vectorized", rewards, np.ones_like(m), group_ids=batch["group_ids"])
    np.testing.assert_allclose(a, b[:, 0], **TOL)
    assert a[3] == 0 and a[7] == 0  # singleton groups
    with pytest.raises(ValueError, match="has_eos"):
        trl_rloo_advantages(scores, m, m, m, batch["group_ids"], missing_eos_penalty=1.0)


@pytest.mark.parametrize("norm", [False, True])
def test_registered_estimator_is_trl_rloo_per_token(batch, norm):
    """adv_estimator=trl_rloo: the sequence advantage on every response token, with the run's options."""
    from jaxrl_llm.losses.advantages import compute_advantage
    from jaxrl_llm.losses.trl_rloo import TrlRlooOptions

    m, lp, rlp, ids = batch["mask"], batch["lp"], batch["old"], batch["group_ids"]
    scores = batch["rng"].normal(size=8).astype(np.float32) * 3
    rewards = np.zeros_like(m)
    rewards[np.arange(8), [np.nonzero(row)[0].max() for row in m]] = scores  # on each row's last token
    opts = TrlRlooOptions(kl_coef=0.07, token_level_kl=True, normalize_reward=norm, reward_clip_range=1.5,
                          normalize_advantage=norm)
    want, _ = trl_rloo_advantages(scores, lp, rlp, m, ids, kl_coef=0.07, normalize_reward=norm,
                                  reward_clip_range=1.5, normalize_advantage=norm)
    adv, ret = compute_advantage("trl_rloo", rewards, m, group_ids=ids, log_probs=lp, ref_log_probs=rlp,
                                 trl_rloo=opts)
    np.testing.assert_allclose(adv, np.asarray(want)[:, None] * m, **TOL)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(ret))
    with pytest.raises(ValueError, match="trl_rloo.*needs log_probs"):
        compute_advantage("trl_rloo", rewards, m, group_ids=ids)

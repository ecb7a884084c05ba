"""The peers' policy losses against their own formulas: M2PO (Trinity-RFT's m2po: its Algorithm-1 loop for the
mask, its unit tests' numbers for the loss), the policy loss's own aggregation (`policy_loss.loss_agg_mode`,
Trinity's sapo), ROLL's sequence-ratio loss with its dual clip (gspo with `policy_loss.dual_clip`) and ROLL's
TOPR (`topr`)."""
import jax
import jax.numpy as jnp
import losses_np_refs as ref
import numpy as np
import pytest

from jaxrl_llm.losses.agg import LOSS_AGG_MODES
from jaxrl_llm.losses.policy import compute_policy_loss, m2po_keep_mask

TOL = dict(atol=1e-5, rtol=1e-4)


def algorithm_one(log_ratio, mask, adv, threshold):
    """The paper's loop, as Trinity-RFT's test writes it: drop the largest trust-region second moment
    while their mean is above the threshold."""
    keep = mask.astype(bool).copy().reshape(-1)
    trust = (mask > 0) & (((adv > 0) & (log_ratio > 0)) | ((adv < 0) & (log_ratio < 0)))
    active = list(np.nonzero(trust.reshape(-1))[0])
    m2 = np.square(log_ratio.astype(np.float64)).reshape(-1)
    while active and m2[active].mean() > threshold:
        largest = int(np.argmax(m2[active]))
        keep[active.pop(largest)] = False
    return keep.reshape(mask.shape)


def test_mask_drops_the_largest_trust_region_token_until_m2_is_within_bound():
    ones = jnp.ones((1, 3))
    np.testing.assert_array_equal(m2po_keep_mask(jnp.array([[0.1, 0.2, 0.3]]), ones, ones, 0.04), [[1, 1, 0]])
    # only where PPO's clip would act: A > 0 with r > 1, A < 0 with r < 1
    np.testing.assert_array_equal(m2po_keep_mask(jnp.array([[1.0, -1.0, 1.0, -1.0]]), jnp.ones((1, 4)),
                                                 jnp.array([[-1.0, 1.0, 1.0, -1.0]]), 0.1), [[1, 1, 0, 0]])
    # over all the rows at once: halves masked apart give another answer (Trinity's test)
    log_ratio = jnp.sqrt(jnp.array([[0.01, 0.09, 0.05]]))
    np.testing.assert_array_equal(m2po_keep_mask(log_ratio, ones, ones, 0.04), [[1, 0, 1]])
    split = np.concatenate([m2po_keep_mask(log_ratio[:, :2], ones[:, :2], ones[:, :2], 0.04),
                            m2po_keep_mask(log_ratio[:, 2:], ones[:, 2:], ones[:, 2:], 0.04)], 1)
    np.testing.assert_array_equal(split, [[1, 0, 0]])


@pytest.mark.parametrize("seed", range(10))
def test_mask_equals_algorithm_one(seed):
    rng = np.random.default_rng(seed)
    log_ratio = (0.8 * rng.normal(size=(4, 7))).astype(np.float32)
    adv = rng.normal(size=(4, 7)).astype(np.float32)
    mask = (rng.uniform(size=(4, 7)) > 0.2).astype(np.float32)
    got = jax.jit(m2po_keep_mask, static_argnums=3)(log_ratio, mask, adv, 0.04)
    np.testing.assert_array_equal(np.asarray(got) > 0, algorithm_one(log_ratio, mask, adv, 0.04))
    assert np.all(np.asarray(got)[mask == 0] == 0)


def test_loss_keeps_the_valid_token_denominator_and_drops_the_gradient():
    """Trinity's numbers: the dropped token counts in the denominator and gets no gradient."""
    def loss(lp, keep):
        return compute_policy_loss("m2po", jnp.zeros((1, 2)), lp, jnp.ones((1, 2)), jnp.ones((1, 2)),
                                   token_mask=keep)[0]
    lp, keep = jnp.array([[0.0, 1.0]]), jnp.array([[1.0, 0.0]])
    np.testing.assert_allclose(loss(lp, keep), -0.5, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(loss)(lp, keep), [[-0.5, 0.0]], rtol=1e-6)


def test_loss_clamps_the_log_ratio_in_value_only():
    def loss(lp):
        return compute_policy_loss("m2po", jnp.zeros((1, 1)), lp, -jnp.ones((1, 1)), jnp.ones((1, 1)),
                                   token_mask=jnp.ones((1, 1)))[0]
    np.testing.assert_allclose(loss(jnp.array([[25.0]])), np.exp(20.0), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(loss)(jnp.array([[25.0]])), [[np.exp(20.0)]], rtol=1e-5)


def test_loss_without_a_given_mask_computes_it_over_its_rows(batch):
    old, lp, adv, m = batch["old"], batch["lp"], batch["adv"], batch["mask"]
    loss, metrics = compute_policy_loss("m2po", old, lp, adv, m, m2_threshold=0.05)
    keep = algorithm_one(lp - old, m, adv, 0.05)
    r = np.exp(np.clip(lp.astype(np.float64) - old, -20, 20))
    np.testing.assert_allclose(loss, ref.agg(np.where(keep, -adv * r, 0.0), m, "token-mean"), **TOL)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], ref.mmean((~keep).astype(float), m), **TOL)
    assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sapo_and_gspo_take_their_own_aggregation(batch, mode):
    """`policy_loss.loss_agg_mode` gives every loss the full range (Trinity's sapo: token-mean); unset, gspo
    and sapo keep veRL's seq-mean-token-mean whatever loss_agg_mode says."""
    old, lp, adv, m = (batch[k].astype(np.float64) for k in ("old", "lp", "adv", "mask"))
    tau = np.where(adv > 0, 1.0, 1.05)
    sapo = -adv / (1 + np.exp(-tau * (np.exp(np.clip(lp - old, -20, 20)) - 1))) * 4 / tau
    args = (batch["old"], batch["lp"], batch["adv"], batch["mask"])
    own, _ = compute_policy_loss("sapo", *args, loss_agg_mode="token-mean", policy_agg_mode=mode)
    np.testing.assert_allclose(own, ref.agg(sapo, m, mode, scale=m.shape[1]), **TOL)
    veRL, _ = compute_policy_loss("sapo", *args, loss_agg_mode=mode)
    np.testing.assert_allclose(veRL, ref.agg(sapo, m, "seq-mean-token-mean"), **TOL)
    seq = ((lp - old) * m).sum(-1) / np.maximum(m.sum(-1), 1)
    rs = np.exp(np.minimum(np.broadcast_to(seq[:, None], lp.shape), 10.0))
    gspo = np.maximum(-adv * rs, -adv * np.clip(rs, 0.8, 1.2))
    got, _ = compute_policy_loss("gspo", *args, policy_agg_mode=mode)
    np.testing.assert_allclose(got, ref.agg(gspo, m, mode, scale=m.shape[1]), **TOL)


def test_geo_mean_takes_no_aggregation_of_its_own(batch):
    with pytest.raises(ValueError, match="one number per sequence"):
        compute_policy_loss("geo_mean", batch["old"], batch["lp"], batch["adv"], batch["mask"],
                            policy_agg_mode="token-mean")


def roll_seq_ppo_loss(old, lp, adv, m, mode, clip, dual):
    """ROLL's actor loss with importance_sampling 'seq' (roll/pipeline/rlvr/actor_worker.py): the ratio
    exp(masked mean log-ratio) of each row, differentiable through every token, PPO's clip, and where
    A < 0 with dual_clip_loss min(loss, -(1 + 2 clip) A); then agg_loss."""
    from jaxrl_llm.losses.agg import agg_loss
    log_ratio = lp - old
    ratio = jnp.exp(jnp.sum(log_ratio * m, -1, keepdims=True) / (jnp.sum(m, -1, keepdims=True) + 1e-8))
    ratio = jnp.broadcast_to(ratio, lp.shape)
    loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    if dual:
        loss = jnp.where(adv < 0, -jnp.maximum(-loss, (1 + 2 * clip) * adv), loss)
    return agg_loss(loss, m, mode)


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_with_dual_clip_is_rolls_sequence_ratio_loss(batch, mode, dual):
    """ROLL's sequence ratio equals gspo's in value and gradient for any aggregation (one weight per row)
    when each row has one advantage (outcome rewards, as GRPO gives); its dual clip is gspo's `dual_clip`
    with clip_ratio_c = 1 + 2 clip."""
    old, m = batch["old"], batch["mask"]
    adv = jnp.broadcast_to(3.0 * batch["adv"][:, :1], m.shape)
    rng = np.random.default_rng(1)  # rows moved from -0.6 to +0.6 in log-ratio: inside, clipped and dual-clipped
    shift = rng.uniform(-0.6, 0.6, (old.shape[0], 1)) + 0.1 * rng.normal(size=old.shape)
    lp = old + jnp.asarray(shift, jnp.float32)

    def ours(x):
        return compute_policy_loss("gspo", old, x, adv, m, clip_ratio=0.2, clip_ratio_c=1.4, policy_agg_mode=mode,
                                   dual_clip=dual)[0]

    want, want_grad = jax.value_and_grad(roll_seq_ppo_loss, argnums=1)(old, lp, adv, m, mode, 0.2, dual)
    got, got_grad = jax.value_and_grad(ours)(lp)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6, rtol=1e-4)
    if dual:  # the data reach the dual clip: without it the loss moves
        assert abs(float(ours(lp)) - float(compute_policy_loss("gspo", old, lp, adv, m, clip_ratio=0.2,
                                                               policy_agg_mode=mode)[0])) > 1e-3


def test_dual_clip_only_where_a_loss_has_one(batch):
    args = (batch["old"], batch["lp"], batch["adv"], batch["mask"])
    off, _ = compute_policy_loss("vanilla", *args, clip_ratio_c=1e9)
    np.testing.assert_allclose(compute_policy_loss("vanilla", *args, clip_ratio_c=1.5, dual_clip=False)[0], off,
                               rtol=1e-6)
    with pytest.raises(ValueError, match="no dual clip"):
        compute_policy_loss("sapo", *args, dual_clip=True)


def roll_topr_loss(old, lp, adv, m, scores, pos_w, neg_w):
    """ROLL's _compute_topr_loss (roll/pipeline/rlvr/actor_pg_worker.py), then agg_loss token-mean."""
    from jaxrl_llm.losses.agg import agg_loss
    ratio = jnp.exp(lp - old)
    positive = (scores > 0).astype(jnp.float32)[:, None]
    positive_loss = -adv * lp * positive
    negative_loss = -jax.lax.stop_gradient(jnp.clip(ratio, 0.0, 1.0)) * adv * lp * (1.0 - positive)
    return agg_loss(pos_w * positive_loss + neg_w * negative_loss, m, "token-mean")


def test_topr_is_rolls_tapered_off_policy_reinforce(batch):
    """Rows with a positive score: plain -A log pi; the others: the ratio clipped to [0, 1] (no gradient through
    it) times -A log pi; each side weighted. Values and gradients."""
    old, adv, m = batch["old"], batch["adv"], batch["mask"]
    lp = old + jnp.asarray(0.4 * np.random.default_rng(2).normal(size=old.shape), jnp.float32)
    scores = jnp.asarray([1.0, 0.0, -1.0, 2.0, 0.5, -0.2, 0.0, 1.0], jnp.float32)

    def ours(x):
        return compute_policy_loss("topr", old, x, adv, m, scores=scores, topr_positive_weight=1.5,
                                   topr_negative_weight=0.7)[0]

    want, want_grad = jax.value_and_grad(roll_topr_loss, argnums=1)(old, lp, adv, m, scores, 1.5, 0.7)
    got, got_grad = jax.value_and_grad(ours)(lp)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got_grad, want_grad, atol=1e-6, rtol=1e-4)
    _, metrics = compute_policy_loss("topr", old, lp, adv, m, scores=scores)
    negative = np.asarray(scores <= 0)[:, None] & (np.asarray(lp - old) > 0)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], ref.mmean(negative.astype(float), m), **TOL)
    with pytest.raises(ValueError, match="sequence scores"):
        compute_policy_loss("topr", old, lp, adv, m)

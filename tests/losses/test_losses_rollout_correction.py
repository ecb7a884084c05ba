import math

import jax
import losses_np_refs as ref
import numpy as np
import pytest

from jaxrl_llm.losses.rollout_correction import compute_rollout_correction, parse_rejection_rules

TOL = dict(atol=1e-5, rtol=1e-4)


def data(batch):
    m = batch["mask"].astype(np.float64)
    train = batch["lp"].astype(np.float64)
    roll = np.where(m > 0, batch["old"], batch["junk"] * 3).astype(np.float64)
    return train, roll, m


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_and_metrics(batch, level, normalize):
    train, roll, m = data(batch)
    lr = np.where(m > 0, train - roll, 0.0)
    thr = 1.5
    fn = jax.jit(lambda a, b, c: compute_rollout_correction(a, b, c, rollout_is=level, rollout_is_threshold=thr,
                                                            rollout_is_batch_normalize=normalize))
    w, new_mask, metrics = fn(train.astype(np.float32), roll.astype(np.float32), m.astype(np.float32))
    if level == "token":
        raw = np.exp(np.clip(lr, -20, 20)) * m
    else:
        raw = np.exp(np.clip(lr.sum(-1), -20, 20))[:, None] * m
    want = np.minimum(raw, thr)
    if normalize:
        if level == "token":
            mean = ref.mmean(want, m)
        else:
            rows = m.sum(-1) > 0
            mean = ref.mmean(want, m, axis=-1)[rows].mean()
        want = want / mean
        np.testing.assert_allclose(metrics["rollout_corr/rollout_is_batch_norm_factor"], mean, **TOL)
    np.testing.assert_allclose(w, want, **TOL)
    np.testing.assert_array_equal(new_mask, m)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_mean"], ref.mmean(raw, m), **TOL)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_max"], raw[m > 0].max(), **TOL)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_min"], raw[m > 0].min(), **TOL)
    wc = np.clip(raw, 1 / thr, thr)
    mc = ref.mmean(wc, m)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_std"], np.sqrt(ref.mmean(wc**2, m) - mc**2), **TOL)
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_eff_sample_size"],
                               1 / ref.mmean((wc / (mc + 1e-8)) ** 2, m), **TOL)
    frac = ref.mmean((raw > thr).astype(float), m) if level == "token" else np.mean(lr.sum(-1) > math.log(thr))
    np.testing.assert_allclose(metrics["rollout_corr/rollout_is_ratio_fraction_high"], frac, **TOL)


def test_offpolicy_diagnostics(batch):
    train, roll, m = data(batch)
    _, _, met = compute_rollout_correction(train, roll, m)
    mt, mr = ref.mmean(train, m, axis=-1), ref.mmean(roll, m, axis=-1)
    lr = np.where(m > 0, train - roll, 0.0)
    want = {
        "training_ppl": np.exp(-mt).mean(), "rollout_ppl": np.exp(-mr).mean(),
        "kl": ref.mmean(roll - train, m), "k3_kl": ref.mmean(np.exp(lr) - lr - 1, m),
        "chi2_token": ref.mmean(np.exp(lr) ** 2, m) - 1, "chi2_seq": np.mean(np.exp(2 * lr.sum(-1))) - 1,
        "log_ppl_diff": (mr - mt).mean(),
    }
    for k, v in want.items():
        np.testing.assert_allclose(met[f"rollout_corr/{k}"], v, **TOL, err_msg=k)


def np_accept(mode, lr, m, lo, hi):
    k2 = 0.5 * lr**2
    k3 = np.exp(lr) - 1 - lr
    level, stat = mode.rsplit("_", 1)
    if stat == "k1":
        x = lr
    else:
        x = k2 if stat == "k2" else k3
    if level == "token":
        s = x
    else:
        rows = []
        for i in range(len(m)):
            v = x[i][m[i] > 0]
            rows.append({"seq_sum": v.sum(), "seq_mean": v.mean(), "seq_max": v.max()}[level])
        s = np.array(rows)[:, None]
    ok = (s >= math.log(lo)) & (s <= math.log(hi)) if stat == "k1" else s <= hi
    return np.broadcast_to(ok, lr.shape).astype(float)


@pytest.mark.parametrize("mode,thr,lo,hi", [
    ("token_k1", 1.3, 1 / 1.3, 1.3), ("token_k2", 0.02, None, 0.02), ("token_k3", 0.03, None, 0.03),
    ("seq_sum_k1", "0.5_1.5", 0.5, 1.5), ("seq_sum_k2", 0.1, None, 0.1), ("seq_sum_k3", 0.1, None, 0.1),
    ("seq_mean_k1", 1.1, 1 / 1.1, 1.1), ("seq_mean_k2", 0.03, None, 0.03), ("seq_mean_k3", 0.03, None, 0.03),
    ("seq_max_k2", 0.1, None, 0.1), ("seq_max_k3", 0.1, None, 0.1),
])
def test_rejection_modes(batch, mode, thr, lo, hi):
    train, roll, m = data(batch)
    lr = np.where(m > 0, train - roll, 0.0)
    _, new_mask, met = compute_rollout_correction(train, roll, m, rollout_rs=mode, rollout_rs_threshold=thr)
    want = m * np_accept(mode, lr, m, lo, hi)
    np.testing.assert_array_equal(new_mask, want)
    assert 0 < want.sum() < m.sum(), "thresholds should reject some but not all tokens"
    np.testing.assert_allclose(met["rollout_corr/rollout_rs_masked_fraction"], ref.mmean(m - want, m), **TOL)
    np.testing.assert_allclose(met["rollout_corr/rollout_rs_seq_masked_fraction"],
                               np.mean((m - want).sum(-1) > 0), **TOL)


def test_combined_and_legacy_modes(batch):
    train, roll, m = data(batch)
    lr = np.where(m > 0, train - roll, 0.0)
    _, new_mask, _ = compute_rollout_correction(train, roll, m, rollout_rs="token_k1,seq_max_k3",
                                                rollout_rs_threshold="0.7_1.6,0.1")
    want = m * np_accept("token_k1", lr, m, 0.7, 1.6) * np_accept("seq_max_k3", lr, m, None, 0.1)
    np.testing.assert_array_equal(new_mask, want)
    for legacy, new in (("token", "token_k1"), ("sequence", "seq_sum_k1"), ("geometric", "seq_mean_k1")):
        a = compute_rollout_correction(train, roll, m, rollout_rs=legacy, rollout_rs_threshold=1.2)[1]
        b = compute_rollout_correction(train, roll, m, rollout_rs=new, rollout_rs_threshold=1.2)[1]
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="valid names"):
        parse_rejection_rules("seq_max_k1", 2.0)
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rejection_rules("token_k2", None)
    with pytest.raises(ValueError, match="2 entries for 3 modes"):
        parse_rejection_rules("token_k2,token_k3,seq_sum_k1", "1,2")
    with pytest.raises(ValueError, match="valid names"):
        compute_rollout_correction(train, roll, m, rollout_is="geometric")

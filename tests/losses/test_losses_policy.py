import jax
import jax.numpy as jnp
import losses_np_refs as ref
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.agg import LOSS_AGG_MODES, agg_loss, global_counts
from jaxrl_llm.losses.entropy import entropy_bonus, entropy_from_logits
from jaxrl_llm.losses.policy import POLICY_LOSSES, compute_policy_loss
from jaxrl_llm.losses.value import compute_value_loss

TOL = dict(atol=1e-5, rtol=1e-4)
MODES = list(LOSS_AGG_MODES)


@pytest.mark.parametrize("mode", MODES)
def test_agg_modes(batch, mode):
    loss, m = batch["adv"], batch["mask"]
    np.testing.assert_allclose(agg_loss(loss, m, mode), ref.agg(loss.astype(np.float64), m, mode), **TOL)
    np.testing.assert_allclose(jax.jit(agg_loss, static_argnums=2)(loss, m, mode), ref.agg(loss, m, mode), **TOL)
    with pytest.raises(ValueError, match="valid names"):
        agg_loss(loss, m, "token-sum")


@pytest.mark.parametrize("clip_c", [3.0, 1.5])
@pytest.mark.parametrize("mode", MODES)
def test_vanilla_ppo(batch, mode, clip_c):
    old, lp, adv, m = batch["old"], batch["lp"], batch["adv"], batch["mask"]
    w = np.where(m > 0, batch["rng"].uniform(0.5, 2.0, m.shape), 0).astype(np.float32)
    loss, metrics = compute_policy_loss("vanilla", old, lp, adv, m, loss_agg_mode=mode, clip_ratio=0.2,
                                        clip_ratio_high=0.28, clip_ratio_c=clip_c, rollout_is_weights=w)
    want = ref.ppo(old.astype(np.float64), lp, adv, m, mode, 0.2, 0.28, clip_c, w)
    np.testing.assert_allclose(loss, want[0], **TOL)
    for key, v in zip(["actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"], want[1:]):
        np.testing.assert_allclose(metrics[key], v, **TOL)
    # gradient w.r.t. log_prob against central differences of the numpy reference
    g = jax.grad(lambda x: compute_policy_loss("vanilla", old, x, adv, m, loss_agg_mode=mode, clip_ratio=0.2,
                                               clip_ratio_high=0.28, clip_ratio_c=clip_c,
                                               rollout_is_weights=w)[0])(lp)
    eps = 1e-4
    num = np.zeros(lp.shape)
    lp64 = lp.astype(np.float64)
    for idx in zip(*np.nonzero(m)):
        d = np.zeros(lp.shape)
        d[idx] = eps
        num[idx] = (ref.ppo(old, lp64 + d, adv, m, mode, 0.2, 0.28, clip_c, w)[0]
                    - ref.ppo(old, lp64 - d, adv, m, mode, 0.2, 0.28, clip_c, w)[0]) / (2 * eps)
    np.testing.assert_allclose(g, num, atol=1e-4, rtol=1e-3)
    assert np.all(np.asarray(g)[m == 0] == 0)


def np_losses(name, old, lp, adv, m, lo=0.2, hi=0.2):
    """Loss matrices of the non-PPO losses (numpy), their aggregation mode, metrics."""
    lr = np.clip(lp - old, -20, 20)
    r = np.exp(lr)
    if name == "gspo":
        seq = ((lp - old) * m).sum(-1) / np.maximum(m.sum(-1), 1)
        rs = np.exp(np.minimum(np.broadcast_to(seq[:, None], lp.shape), 10.0))
        l1, l2 = -adv * rs, -adv * np.clip(rs, 1 - lo, 1 + hi)
        return np.maximum(l1, l2), "seq-mean-token-mean", ref.mmean((l2 > l1).astype(float), m)
    if name == "sapo":
        tau = np.where(adv > 0, 1.0, 1.05)
        return -adv / (1 + np.exp(-tau * (r - 1))) * 4 / tau, "seq-mean-token-mean", 0.0
    if name == "gpg":
        return -lp * adv, None, 0.0
    if name == "reinforce":
        return -adv * lp, None, 0.0
    if name == "cispo":
        c = np.clip(r, 1 - lo, 1 + hi)
        return -c * adv * lp, None, ref.mmean((r != c).astype(float), m)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["gspo", "sapo", "gpg", "reinforce", "cispo"])
def test_other_policy_losses(batch, name):
    old, lp, adv, m = (batch[k].astype(np.float64) for k in ("old", "lp", "adv", "mask"))
    mat, mode, clipfrac = np_losses(name, old, lp, adv, m)
    loss, metrics = jax.jit(lambda o, lp_, a, mm: compute_policy_loss(name, o, lp_, a, mm, loss_agg_mode="token-mean"))(
        batch["old"], batch["lp"], batch["adv"], batch["mask"])
    np.testing.assert_allclose(loss, ref.agg(mat, m, mode or "token-mean"), **TOL)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], clipfrac, **TOL)
    if name == "reinforce":
        np.testing.assert_allclose(metrics["actor/ppo_kl"], ref.mmean(old - lp, m), **TOL)


def test_policy_gradients_analytic(batch):
    """gpg/reinforce: d/dlp = -A/N; cispo: -sg(clip r) A/N; gspo token grad = seq ratio (unclipped)."""
    old, lp, adv, m = batch["old"], batch["lp"], batch["adv"], batch["mask"]
    n = m.sum()
    for name in ("gpg", "reinforce"):
        g = jax.grad(lambda x: compute_policy_loss(name, old, x, adv, m, loss_agg_mode="token-mean")[0])(lp)
        np.testing.assert_allclose(g, -adv * m / n, **TOL)
    r = np.exp(np.clip(lp.astype(np.float64) - old, -20, 20))
    g = jax.grad(lambda x: compute_policy_loss("cispo", old, x, adv, m, loss_agg_mode="token-mean")[0])(lp)
    np.testing.assert_allclose(g, -np.clip(r, 0.8, 1.2) * adv * m / n, **TOL)


def np_geo_mean(old, lp, adv, m, lo, hi):
    lr = lp - old
    sgn = np.sign(adv)
    lrc = np.clip(lr, -lo, hi)
    lrm = sgn * np.minimum(sgn * lr, sgn * lrc)
    ln = m.sum(-1)
    ratio = np.exp((lrm * m).sum(-1) / (ln + 1e-8))
    sa = (adv * m).sum(-1) / (ln + 1e-8)
    return np.mean(-sa * ratio)


def test_geo_mean(batch):
    old, lp, m = batch["old"], batch["lp"], batch["mask"]
    adv = np.where(m > 0, np.sign(batch["adv"]), 0).astype(np.float32)  # sequence-level style
    loss, metrics = compute_policy_loss("geo_mean", old, lp, adv, m, loss_agg_mode="token-mean",
                                        clip_ratio_low=0.1, clip_ratio_high=0.3)
    np.testing.assert_allclose(loss, np_geo_mean(old.astype(np.float64), lp, adv, m, 0.1, 0.3), **TOL)
    g = jax.grad(lambda x: compute_policy_loss("geo_mean", old, x, adv, m, loss_agg_mode="token-mean",
                                               clip_ratio_low=0.1, clip_ratio_high=0.3)[0])(lp)
    eps, lp64 = 1e-4, lp.astype(np.float64)
    for idx in list(zip(*np.nonzero(m)))[::3]:
        d = np.zeros(lp.shape)
        d[idx] = eps
        num = (np_geo_mean(old, lp64 + d, adv, m, 0.1, 0.3) - np_geo_mean(old, lp64 - d, adv, m, 0.1, 0.3)) / (2 * eps)
        np.testing.assert_allclose(g[idx], num, atol=1e-4)


def test_unknown_policy_loss():
    assert {"vanilla", "gspo", "sapo", "gpg", "reinforce", "cispo", "geo_mean"} <= set(POLICY_LOSSES.names())
    with pytest.raises(ValueError, match="valid names.*vanilla"):
        compute_policy_loss("ppo2", jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)))


def test_value_loss_and_entropy(batch):
    m, v, ret = batch["mask"], batch["values"], batch["token_rewards"]
    vp = (v + batch["rng"].normal(0, 0.5, v.shape)).astype(np.float32)
    loss, frac = compute_value_loss(vp, ret, v, m, 0.2, "token-mean")
    vc = v + np.clip(vp - v, -0.2, 0.2)
    l1, l2 = (vp - ret) ** 2, (vc - ret) ** 2
    np.testing.assert_allclose(loss, 0.5 * ref.agg(np.maximum(l1, l2), m, "token-mean"), **TOL)
    np.testing.assert_allclose(frac, ref.mmean((l2 > l1).astype(float), m), **TOL)
    logits = batch["rng"].normal(size=(8, 7, 13)).astype(np.float32) * 3
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ent = -(p * np.log(p)).sum(-1)
    np.testing.assert_allclose(entropy_from_logits(logits), ent, **TOL)
    np.testing.assert_allclose(entropy_bonus(ent, m, "seq-mean-token-mean"), ref.agg(ent, m, "seq-mean-token-mean"),
                               **TOL)


def split(x, parts):
    return np.split(x, parts)


@pytest.mark.parametrize("name,mode", [("vanilla", m) for m in MODES] + [
    ("gspo", "token-mean"), ("geo_mean", "token-mean"), ("cispo", "seq-mean-token-sum")])
def test_microbatch_accumulation_is_exact(batch, mode, name):
    old, lp, adv, m = batch["old"], batch["lp"], batch["adv"], batch["mask"]
    counts = global_counts(m)
    if name == "geo_mean":
        counts["num_seqs"] = float(m.shape[0])  # geo_mean's plain row mean counts every row

    def loss_fn(x, o, a, mm, **kw):
        loss, metrics = compute_policy_loss(name, o, x, a, mm, loss_agg_mode=mode, **kw)
        return loss, metrics

    full_grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (full, full_metrics), full_g = full_grad_fn(lp, old, adv, m, **counts)
    (plain, _), _ = full_grad_fn(lp, old, adv, m)
    np.testing.assert_allclose(full, plain, **TOL)  # global counts of the full batch == local ones
    total, grads, metric_sum = 0.0, [], 0.0
    for sl in (slice(0, 3), slice(3, 5), slice(5, 8)):  # uneven micro-batches
        (micro_loss, met), g = full_grad_fn(lp[sl], old[sl], adv[sl], m[sl], **counts)
        total += micro_loss
        grads.append(g)
        metric_sum += met["actor/ppo_kl"]
    np.testing.assert_allclose(total, full, **TOL)
    np.testing.assert_allclose(np.concatenate(grads), full_g, **TOL)
    np.testing.assert_allclose(metric_sum, full_metrics["actor/ppo_kl"], **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_agg_microbatch_value_loss(batch, mode):
    m, v, ret = batch["mask"], batch["values"], batch["token_rewards"]
    vp = v + 0.3
    counts = global_counts(m)
    f = jax.value_and_grad(lambda x, r, vv, mm: compute_value_loss(x, r, vv, mm, 0.2, mode, **counts)[0])
    full, g = f(vp, ret, v, m)
    parts = [f(vp[s], ret[s], v[s], m[s]) for s in (slice(0, 5), slice(5, 8))]
    np.testing.assert_allclose(sum(p[0] for p in parts), full, **TOL)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), g, **TOL)


def test_policy_loss_sharded(batch):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    args = [shard(batch[k]) for k in ("old", "lp", "adv", "mask")]
    f = jax.jit(jax.value_and_grad(
        lambda o, lp_, a, m: compute_policy_loss("vanilla", o, lp_, a, m, loss_agg_mode="seq-mean-token-mean")[0],
        argnums=1))
    loss, g = f(*args)
    want_loss, want_g = jax.value_and_grad(
        lambda o, lp_, a, m: compute_policy_loss("vanilla", o, lp_, a, m, loss_agg_mode="seq-mean-token-mean")[0],
        argnums=1)(batch["old"], batch["lp"], batch["adv"], batch["mask"])
    np.testing.assert_allclose(loss, want_loss, **TOL)
    np.testing.assert_allclose(g, want_g, **TOL)

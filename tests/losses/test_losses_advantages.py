import jax
import jax.numpy as jnp
import losses_np_refs as ref
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.losses.advantages import ADV_ESTIMATORS, compute_advantage
from jaxrl_llm.losses.masked import check_finite, masked_whiten

TOL = dict(atol=1e-5, rtol=1e-4)


def expected(name, b, rewards):
    m, ids = b["mask"].astype(np.float64), b["group_ids"]
    r = rewards.astype(np.float64)
    if name == "gae":
        return ref.gae(r, b["values"], m, 0.95, 0.9)
    if name == "reinforce_plus_plus":
        return ref.reinforce_pp(r, m, 0.9)
    if name == "reinforce":
        return ref.reinforce(r, m, 0.9)
    if name == "remax":
        return ref.remax(r, m, np.linspace(-1, 1, 8))
    adv = {
        "grpo": lambda: ref.grpo(r, m, ids, 1e-6, True),
        "grpo_vectorized": lambda: ref.grpo_vectorized(r, m, ids, 1e-6, True),
        "rloo": lambda: ref.rloo(r, m, ids),
        "rloo_vectorized": lambda: ref.rloo_vectorized(r, m, ids),
        "opo": lambda: ref.opo(r, m, ids),
        "reinforce_plus_plus_baseline": lambda: ref.reinforce_pp_baseline(r, m, ids),
        "gpg": lambda: ref.gpg(r, m, ids),
    }[name]()
    return adv, adv


NAMES = ["gae", "grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "reinforce_plus_plus",
         "reinforce_plus_plus_baseline", "reinforce", "remax", "gpg"]


def call(name, b, rewards, jit=False):
    kw = dict(group_ids=b["group_ids"], values=b["values"], gamma=0.95 if name == "gae" else 0.9, lam=0.9,
              reward_baselines=np.linspace(-1, 1, 8).astype(np.float32))
    fn = lambda r, m: compute_advantage(name, r, m, **kw)  # noqa: E731
    return (jax.jit(fn) if jit else fn)(rewards, b["mask"])


@pytest.mark.parametrize("name", NAMES)
def test_estimator_matches_reference(batch, name):
    token_level = ("gae", "reinforce_plus_plus", "reinforce", "remax")
    rewards = batch["token_rewards"] if name in token_level else batch["outcome"]
    want_adv, want_ret = expected(name, batch, rewards)
    for jit in (False, True):
        adv, ret = call(name, batch, rewards, jit)
        np.testing.assert_allclose(adv, want_adv, **TOL)
        np.testing.assert_allclose(ret, want_ret, **TOL)


@pytest.mark.parametrize("f_norm", [1.0, 2.5, 0.5])
def test_gpg_f_norm_as_verl(batch, f_norm):
    rewards = batch["outcome"].copy()
    rewards[0] = 0.0  # a zero score: alpha = B / #non-zero > 1
    want = ref.gpg(np.asarray(rewards, np.float64), batch["mask"].astype(np.float64), batch["group_ids"], f_norm)
    adv, ret = compute_advantage("gpg", rewards, batch["mask"], group_ids=batch["group_ids"], f_norm=f_norm)
    np.testing.assert_allclose(adv, want, **TOL)
    np.testing.assert_allclose(ret, want, **TOL)
    base, _ = compute_advantage("gpg", rewards, batch["mask"], group_ids=batch["group_ids"])
    np.testing.assert_allclose(np.asarray(adv) * f_norm, base, **TOL)
    # veRL's signature also takes `alpha`, which it overwrites with B / #non-zero scores: accepted, same numbers
    with_alpha, _ = compute_advantage("gpg", rewards, batch["mask"], group_ids=batch["group_ids"], f_norm=f_norm,
                                      alpha=7.0)
    np.testing.assert_array_equal(np.asarray(with_alpha), np.asarray(adv))


def test_all_names_registered():
    # grpo_passk and trl_rloo have their own tests: below, and test_losses_trl_rloo.py
    assert set(NAMES) | {"grpo_passk", "trl_rloo"} == set(ADV_ESTIMATORS.names())
    with pytest.raises(ValueError, match="valid names.*grpo"):
        compute_advantage("grpoo", jnp.zeros((2, 3)), jnp.ones((2, 3)))


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_and_dr_grpo(batch, norm):
    ids = np.array([3, 7, 3, 7, 7, 3, 9, 9], np.int32)  # no singletons for pass@k
    b = dict(batch, group_ids=ids)
    r = batch["outcome"].copy()
    r[1, 5], r[4, 0] = 1.0, 1.0  # a tie for the top of group 7: the first row wins
    m = batch["mask"]
    adv, _ = compute_advantage("grpo_passk", r, m, group_ids=ids, norm_adv_by_std_in_grpo=norm)
    np.testing.assert_allclose(adv, ref.grpo_passk(r.astype(np.float64), m, ids, 1e-6, norm), **TOL)
    adv, _ = jax.jit(lambda r: compute_advantage("grpo", r, m, group_ids=ids, norm_adv_by_std_in_grpo=norm))(r)
    np.testing.assert_allclose(adv, ref.grpo(r.astype(np.float64), m, ids, 1e-6, norm), **TOL)
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantage("grpo_passk", r, m, group_ids=b["group_ids"] * 0 + np.arange(8))


def test_grpo_vectorized_differs_on_near_constant_group():
    r = np.zeros((2, 2), np.float32)
    r[:, -1] = [1.0, 1.0 + 1e-4]
    m = np.ones((2, 2), np.float32)
    a, _ = compute_advantage("grpo", r, m, group_ids=np.zeros(2, np.int32))
    v, _ = compute_advantage("grpo_vectorized", r, m, group_ids=np.zeros(2, np.int32))
    assert abs(float(a[1, 0])) > 0.5 and abs(float(v[1, 0])) < 0.1


def test_missing_inputs_are_clear_errors(batch):
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantage("grpo", batch["outcome"], batch["mask"])
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", batch["outcome"], batch["mask"])
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", batch["outcome"], batch["mask"])


def test_whiten_needs_two_tokens():
    x = jnp.arange(4.0)
    m = jnp.array([0.0, 1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="more than one valid token"):
        masked_whiten(x, m)
    out = jax.jit(masked_whiten)(x, m)  # under jit: NaN, caught by the host-side check
    assert bool(jnp.all(jnp.isnan(out)))
    with pytest.raises(ValueError, match="NaN"):
        check_finite(out, "advantages")


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo_vectorized", "reinforce_plus_plus_baseline"])
def test_sharded_over_8_devices(batch, name):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    rewards = batch["token_rewards"] if name == "gae" else batch["outcome"]
    b = dict(batch, values=shard(batch["values"]), group_ids=shard(batch["group_ids"]), mask=shard(batch["mask"]))
    adv, ret = call(name, b, shard(rewards), jit=True)
    want_adv, want_ret = expected(name, batch, rewards)
    np.testing.assert_allclose(adv, want_adv, **TOL)
    np.testing.assert_allclose(ret, want_ret, **TOL)

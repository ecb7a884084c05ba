import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_in_reward,
    kl_penalty,
    make_kl_controller,
)

TOL = dict(atol=1e-5, rtol=1e-4)


def np_kl(lp, ref, kind):
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d**2
    x = np.clip(-d, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_values_and_grads(kind):
    rng = np.random.default_rng(1)
    lp = rng.normal(size=(3, 5)).astype(np.float32)
    ref = (lp + rng.normal(size=(3, 5))).astype(np.float32)
    ref[0, 0] = lp[0, 0] + 30.0  # k3 clamps: exp(20) - 21 > 10 -> clipped, zero gradient
    np.testing.assert_allclose(jax.jit(kl_penalty, static_argnums=2)(lp, ref, kind), np_kl(lp, ref, kind), **TOL)
    grad = jax.grad(lambda x: kl_penalty(x, ref, kind).sum())(lp)
    eps = 1e-3
    num = (np_kl(lp.astype(np.float64) + eps, ref, kind) - np_kl(lp.astype(np.float64) - eps, ref, kind)) / (2 * eps)
    np.testing.assert_allclose(grad, num, atol=2e-3, rtol=1e-3)
    if kind in ("low_var_kl", "k3"):
        assert float(grad[0, 0]) == 0.0


def test_abs_gradient_at_zero_difference_is_zero_as_torch():
    lp = jnp.asarray([0.5, -1.0, 4.0], jnp.float32)
    ref = jnp.asarray([0.5, 0.0, 3.0], jnp.float32)  # first token: no difference
    np.testing.assert_array_equal(kl_penalty(lp, ref, "abs"), [0.0, 1.0, 1.0])
    np.testing.assert_array_equal(jax.grad(lambda x: kl_penalty(x, ref, "abs").sum())(lp), [0.0, -1.0, 1.0])
    np.testing.assert_array_equal(jax.grad(lambda r: kl_penalty(lp, r, "abs").sum())(ref), [0.0, 1.0, -1.0])


@pytest.mark.parametrize("kind", ["k1+", "k3+", "abs+", "low_var_kl+"])
def test_straight_through_value_of_base_grad_of_k2(kind):
    rng = np.random.default_rng(2)
    lp = rng.normal(size=(2, 4)).astype(np.float32)
    ref = rng.normal(size=(2, 4)).astype(np.float32)
    np.testing.assert_allclose(kl_penalty(lp, ref, kind), np_kl(lp, ref, kind[:-1]), **TOL)
    np.testing.assert_allclose(jax.grad(lambda x: kl_penalty(x, ref, kind).sum())(lp), lp - ref, **TOL)


def test_full_kl_from_logits_and_unknown_kind():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, 3, 11)), rng.normal(size=(2, 3, 11))
    p = np.exp(a) / np.exp(a).sum(-1, keepdims=True)
    q = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    want = (p * (np.log(p) - np.log(q))).sum(-1)
    got = kl_penalty(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), "full")
    np.testing.assert_allclose(got, want, **TOL)
    with pytest.raises(ValueError, match="valid names"):
        kl_penalty(jnp.zeros(3), jnp.zeros(3), "k4")
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        kl_penalty(jnp.zeros(3), jnp.zeros(3), "full")


def test_controllers():
    c = AdaptiveKLController(0.1, target_kl=0.05, horizon=100)
    c.update(0.5, n_steps=10)  # error clipped at +0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    c.update(0.045, n_steps=10)
    assert c.value == pytest.approx(0.1 * 1.02 * (1 + (0.045 / 0.05 - 1) * 0.1))
    f = FixedKLController(0.3)
    f.update(9.0, 4)
    assert f.value == 0.3
    assert isinstance(make_kl_controller("adaptive", 0.2, target_kl=1, horizon=5),
                      AdaptiveKLController)
    assert make_kl_controller("fixed", 0.2, target_kl=0.1, horizon=10000).value == 0.2
    with pytest.raises(ValueError, match="valid names"):
        make_kl_controller("pid", 0.2, target_kl=0.1, horizon=10000)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.2, target_kl=0.1, horizon=0)


def test_apply_kl_penalty(batch):
    m, old, ref = batch["mask"], batch["old"], batch["lp"]
    scores = batch["outcome"]
    ctrl = AdaptiveKLController(0.1, target_kl=0.01, horizon=50)
    rewards, metrics = apply_kl_penalty(scores, old, ref, m, ctrl, "low_var_kl")
    kld = np_kl(old, ref, "k3") * m
    np.testing.assert_allclose(rewards, scores - 0.1 * kld, **TOL)
    row = (kld * m).sum(-1) / (m.sum(-1) + 1e-8)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(row.mean(), rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    err = np.clip(row.mean() / 0.01 - 1, -0.2, 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * 8 / 50))
    r2, kl2 = jax.jit(kl_in_reward, static_argnums=5)(scores, old, ref, m, 0.1, "low_var_kl")
    np.testing.assert_allclose(r2, rewards, **TOL)

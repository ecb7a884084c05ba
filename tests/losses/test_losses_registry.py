"""Registries declare capabilities where an entry registers; the declarations match the behaviour."""
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.losses.advantages import ADV_ESTIMATORS, INPUT_CAPABILITIES, compute_advantage
from jaxrl_llm.losses.agg import LOSS_AGG_MODES
from jaxrl_llm.losses.policy import POLICY_LOSSES, compute_policy_loss
from jaxrl_llm.losses.registry import Registry

TOL = dict(atol=1e-6, rtol=1e-6)


def test_registry_capabilities_defaults_filters_and_errors():
    reg = Registry("thing", {"fast": False, "extra": ()})
    reg.register("a", fast=True)(lambda: "a")
    reg.register("b", "b2", extra=("x",))(lambda: "b")
    assert reg.capabilities("a") == {"fast": True, "extra": ()}
    assert reg.capabilities("b2") == {"fast": False, "extra": ("x",)}
    assert reg.capability("b", "extra") == ("x",)
    assert reg.names() == ["a", "b", "b2"]
    assert reg.names(fast=True) == ["a"]
    assert reg.names(fast=False, extra=("x",)) == ["b", "b2"]
    with pytest.raises(TypeError):
        reg.capabilities("a")["fast"] = False  # read-only
    with pytest.raises(ValueError, match="unknown capabilities.*'slow'.*declared"):
        reg.register("c", slow=True)
    with pytest.raises(ValueError, match="Unknown thing 'z'; valid names: \\['a', 'b', 'b2'\\]"):
        reg.capabilities("z")
    with pytest.raises(KeyError, match="no capability 'slow'"):
        reg.names(slow=True)
    with pytest.raises(KeyError, match="no capability 'slow'"):
        reg.capability("a", "slow")


def test_adv_estimator_capabilities():
    assert ADV_ESTIMATORS.names(needs_group_ids=True) == [
        "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo", "reinforce_plus_plus_baseline", "rloo",
        "rloo_vectorized", "trl_rloo"]
    assert ADV_ESTIMATORS.names(needs_log_probs=True) == ADV_ESTIMATORS.names(needs_ref_log_probs=True) == ["trl_rloo"]
    assert ADV_ESTIMATORS.names(needs_values=True) == ["gae"]
    assert ADV_ESTIMATORS.names(needs_reward_baselines=True) == ["remax"]
    assert ADV_ESTIMATORS.capabilities("reinforce_plus_plus") == {cap: False for cap in INPUT_CAPABILITIES}


@pytest.mark.parametrize("name", ADV_ESTIMATORS.names())
def test_adv_estimator_needs_exactly_its_declared_inputs(batch, name):
    inputs = dict(group_ids=batch["group_ids"], values=batch["values"],
                  reward_baselines=np.linspace(-1, 1, 8).astype(np.float32), log_probs=batch["lp"],
                  ref_log_probs=batch["old"])
    if name == "grpo_passk":  # pass@k needs groups of 2 or more
        inputs["group_ids"] = np.array([3, 7, 3, 7, 7, 3, 9, 9], np.int32)
    caps = ADV_ESTIMATORS.capabilities(name)
    needed = {arg for cap, (arg, _) in INPUT_CAPABILITIES.items() if caps[cap]}
    compute_advantage(name, batch["outcome"], batch["mask"], **{k: inputs[k] for k in needed})
    for arg in needed:
        with pytest.raises(ValueError, match=f"needs {arg}"):
            compute_advantage(name, batch["outcome"], batch["mask"], **{k: inputs[k] for k in needed - {arg}})


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_fixed_agg_mode_is_what_the_loss_does(batch, name):
    """A loss with `fixed_agg_mode` ignores `loss_agg_mode`; one without it follows it."""
    # a loss that reads the rows' sequence scores (topr) gets some of each sign
    scores = ({"scores": np.linspace(-1.0, 1.0, batch["mask"].shape[0])}
              if POLICY_LOSSES.capability(name, "needs_scores") else {})
    losses = [compute_policy_loss(name, batch["old"], batch["lp"], batch["adv"], batch["mask"], loss_agg_mode=mode,
                                  **scores)[0] for mode in LOSS_AGG_MODES]
    fixed = POLICY_LOSSES.capability(name, "fixed_agg_mode")
    if fixed is not None:
        for loss in losses[1:]:
            np.testing.assert_allclose(loss, losses[0], **TOL)
        if fixed in LOSS_AGG_MODES:
            assert fixed in inspect.getsource(POLICY_LOSSES.get(name))
    else:
        assert len({round(float(x), 6) for x in losses}) > 1


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_extra_params_are_the_loss_keywords(batch, name):
    params = list(inspect.signature(POLICY_LOSSES.get(name)).parameters)[1:]
    assert tuple(params) == POLICY_LOSSES.capability(name, "extra_params")
    with pytest.raises(TypeError, match=f"policy loss '{name}' takes no \\['tau'\\]"):
        compute_policy_loss(name, batch["old"], batch["lp"], batch["adv"], batch["mask"], tau=1.0)


def test_sapo_extra_params_reach_the_loss(batch):
    args = (batch["old"], batch["lp"], batch["adv"], batch["mask"])
    default, _ = compute_policy_loss("sapo", *args)
    changed, _ = compute_policy_loss("sapo", *args, tau_pos=2.0, tau_neg=3.0)
    assert not np.allclose(default, changed)
    assert POLICY_LOSSES.names(fixed_agg_mode="seq-mean-token-mean") == ["gspo", "sapo"]
    assert jnp.isfinite(changed)


def test_every_name_is_documented():
    """docs/algorithms.md names every estimator, loss, KL kind, aggregation and correction mode."""
    import pathlib

    from jaxrl_llm.losses.kl import KL_ESTIMATORS
    from jaxrl_llm.losses.rollout_correction import IS_LEVELS, RS_LEGACY, RS_MODES

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    names = (ADV_ESTIMATORS.names() + POLICY_LOSSES.names() + KL_ESTIMATORS.names() + ["full"]
             + list(LOSS_AGG_MODES) + list(IS_LEVELS) + list(RS_LEGACY))
    missing = [n for n in names if f"`{n}`" not in doc]
    missing += [level for level in {m.rsplit("_", 1)[0] for m in RS_MODES} if f"`{level}_k" not in doc]
    assert not missing, missing

"""Where the old log-probs come from (config/spec.py `old_log_probs_from_update`): in bf16, or for
rollout correction's per-token / per-sequence IS weights, with one optimizer step per RL step the
update's own forward supplies them (no separate pass), with the same update as recomputing them;
anything that reads them before the update keeps the pass."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs

from jaxrl_llm.config import resolve, validate_config

BF16 = {"actor_rollout_ref.model.dtype": "bfloat16"}


RC = "algorithm.rollout_correction."


@pytest.mark.parametrize("overrides,from_update,in_loss", [
    ({}, False, False),  # fp32: the sampler's log-probs are the trainer's, nothing to compute
    (BF16, True, False),  # bf16, one optimizer step: the update's forward supplies them
    ({**BF16, "actor_rollout_ref.actor.ppo_epochs": 2}, False, False),  # later steps need the pre-update policy
    ({**BF16, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}, False, False),
    ({**BF16, "algorithm.use_kl_in_reward": True}, False, False),  # read before the update
    # rollout correction whose weights need only their own tokens: taken in the loss (fp32 and bf16)
    ({RC + "rollout_is": "token"}, True, True),
    ({**BF16, RC + "rollout_is": "sequence"}, True, True),
    # ... but not with more than one optimizer step, batch normalisation or rejection sampling
    ({RC + "rollout_is": "token", "actor_rollout_ref.actor.ppo_epochs": 2}, False, False),
    ({RC + "rollout_is": "token", RC + "rollout_is_batch_normalize": True}, False, False),
    ({RC + "rollout_is": "token", RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": "0.5_2.0"}, False, False),
    ({RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": "0.5_2.0"}, False, False),
    # bypass mode: the sampler's log-probs are the old ones, in bf16 too (no pass, not the update's own)
    ({**BF16, RC + "bypass_mode": True}, False, False),
    ({**BF16, RC + "bypass_mode": True, RC + "rollout_is": "token"}, False, False),
])
def test_which_runs_take_old_log_probs_from_the_update(tmp_path, overrides, from_update, in_loss):
    spec = resolve(validate_config(tiny_runs.tiny_config(tmp_path, **overrides), dp_size=1), dp_size=1)
    assert spec.actor.old_log_probs_from_update is from_update
    assert spec.rollout_is_in_update is in_loss
    assert spec.actor.rollout_is_in_loss == (overrides.get(RC + "rollout_is") if in_loss else None)
    bf16 = overrides.get("actor_rollout_ref.model.dtype") == "bfloat16"
    corrected = any(overrides.get(RC + k) for k in ("rollout_is", "rollout_rs"))
    bypass = bool(overrides.get(RC + "bypass_mode"))
    assert spec.recompute_old_log_probs is ((bf16 or corrected) and not from_update and not bypass)


def test_bypass_reinforce_takes_its_weights_in_the_loss(tmp_path):
    """veRL's bypass mode with loss_type reinforce: the sampler's log-probs are the old ones (no pass), and the
    actor's loss is the IS-weighted policy gradient with the weights from its own forward; the keys it cannot
    take are refused by name."""
    from jaxrl_llm.config.schema import ConfigError

    bypass = {RC + "bypass_mode": True, RC + "loss_type": "reinforce", RC + "rollout_is": "sequence",
              RC + "rollout_is_batch_normalize": True}
    spec = resolve(validate_config(tiny_runs.tiny_config(tmp_path, **bypass), dp_size=1), dp_size=1)
    a = spec.actor
    assert (a.loss_mode, a.rollout_is_in_loss, a.rollout_is_batch_normalize) == ("reinforce", "sequence", True)
    assert not spec.recompute_old_log_probs and not a.old_log_probs_from_update
    for extra, key in [({RC + "bypass_mode": False}, "loss_type='reinforce' is bypass mode's loss"),
                       ({RC + "rollout_rs": "token_k1", RC + "rollout_rs_threshold": 2.0}, "rollout_rs='token_k1'"),
                       ({"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}, "loss_mode='gspo'")]:
        with pytest.raises(ConfigError, match=key):
            validate_config(tiny_runs.tiny_config(tmp_path, **{**bypass, **extra}), dp_size=1)


def test_bf16_step_without_the_old_log_prob_pass_equals_recomputing(tmp_path):
    """The same bf16 GRPO step twice from the same state: old log-probs from the update's forward,
    then from a separate no-grad pass. Same update (up to bf16 kernel noise); no pass in the first."""
    from test_trainer_e2e import with_reward_file  # a reward that varies within a group

    from jaxrl_llm.trainer import Trainer

    cfg = with_reward_file(tiny_runs.tiny_config(tmp_path / "run", **BF16, **{
        "trainer.total_training_steps": 1, "trainer.test_freq": -1, "actor_rollout_ref.rollout.n": 4}), tmp_path)
    trainer = Trainer(cfg)
    assert trainer.spec.actor.old_log_probs_from_update and not trainer.spec.recompute_old_log_probs
    state = jax.tree.map(jnp.copy, trainer.state())
    loader_state = trainer.train_loader.get_state()
    batch = next(trainer.train_loader)
    from_update = trainer.train_step(batch)
    new_params = jax.device_get(trainer.actor.params)
    trainer.actor.params = jax.tree.map(jnp.copy, state["actor"]["params"])
    trainer.actor.opt_state = jax.tree.map(jnp.copy, state["actor"]["opt_state"])
    trainer.train_loader.set_state(loader_state)
    trainer.spec = dataclasses.replace(trainer.spec, actor=dataclasses.replace(trainer.spec.actor,
                                                                               old_log_probs_from_update=False))
    assert trainer.spec.recompute_old_log_probs
    recomputed = trainer.train_step(next(trainer.train_loader))
    trainer.close()
    # the pass ran only in the second step (the span exists in both, ~0 s without work)
    assert from_update["actor/ppo_kl"] == 0.0 and from_update["actor/pg_clipfrac"] == 0.0
    assert abs(recomputed["actor/ppo_kl"]) < 1e-3  # bf16 kernel noise between the two forwards
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(from_update[key], recomputed[key], rtol=2e-2, atol=1e-3, err_msg=key)
    assert from_update["actor/grad_norm"] > 0
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()),
                         new_params, jax.device_get(state["actor"]["params"]))
    assert max(jax.tree.leaves(moved)) > 0

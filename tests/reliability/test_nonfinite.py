"""Fault injection: NaN rewards and non-finite gradients (jaxrl_llm/bookkeeping/nonfinite.py).

- a non-finite loss / gradient skips exactly that optimizer update (params and optimizer state as
  if the mini-batch had not been there), on a sharded 8-device mesh too;
- NaN rewards from a custom reward function or a reward model are counted and scored 0, and the
  run goes on; a step whose rewards are all NaN skips its updates;
- K skipped updates in a row stop the run with one error naming the step and the first non-finite
  quantity (reward, advantage, log-prob); no non-finite state is ever checkpointed, and a run
  resumed from the last checkpoint goes on with the right learning rate.
"""
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tiny_runs import ToyBatch as Toy
from tiny_runs import toy_loss as _toy_loss

from jaxrl_llm.bookkeeping.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    assert_finite_state,
    nonfinite_leaves,
    sanitize_scores,
)
from jaxrl_llm.config import apply_overrides, default_config, resolve_config
from jaxrl_llm.losses.kl import make_kl_controller
from jaxrl_llm.roles.optim import make_optimizer
from jaxrl_llm.roles.update import run_update_epochs

# ---------------------------------------------------------------------------------------------
# The jitted update skips a non-finite mini-batch exactly.

def _toy(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    batch = Toy(np.asarray(rng.normal(size=(rows, 3)), np.float32), np.asarray(rng.normal(size=(rows, 4)), np.float32),
                np.ones((rows, 4), np.float32))
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4, jnp.float32)}
    return batch, params


def _optim_spec():
    cfg = apply_overrides(default_config(), [
        "actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=x.parquet",
        "trainer.total_training_steps=10", "actor_rollout_ref.actor.optim.lr=0.05"])
    return resolve_config(cfg, dp_size=1, check_paths=False).actor_optim


def _update(params, batch, *, num_mini, epochs=1, mesh=None):
    tx, _ = make_optimizer(_optim_spec())
    rows_sharding = None
    if mesh is not None:
        rows_sharding = NamedSharding(mesh, PartitionSpec("data"))
        batch = jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
            mesh, PartitionSpec("data", *([None] * (v.ndim - 1))))), batch)
    update = jax.jit(functools.partial(run_update_epochs, tx=tx, loss_fn=_toy_loss, metric_prefix="toy",
                                       ppo_epochs=epochs, num_mini_batches=num_mini, num_micro_batches=1,
                                       shuffle=False, rows_sharding=rows_sharding))
    new, state, metrics = update(params, tx.init(params), batch, jax.random.PRNGKey(0), np.float32(0.05))
    return jax.device_get(new), jax.device_get(state), jax.device_get(metrics)


@pytest.mark.parametrize("devices", [1, 8])
def test_nonfinite_minibatch_skips_exactly_that_update(devices):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",)) if devices == 8 else None
    batch, params = _toy()
    poisoned = batch._replace(y=batch.y.copy())
    poisoned.y[2, 1] = np.inf  # row 2: in the first of two mini-batches
    got, got_state, metrics = _update(params, poisoned, num_mini=2, mesh=mesh)
    # the same as updating on the second mini-batch alone, from the same fresh optimizer state
    second_half = Toy(*(a[8:] for a in batch))
    want, want_state, _ = _update(params, second_half, num_mini=1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got_state, want_state)
    assert metrics["toy/num_nonfinite_skipped"] == 1.0
    assert metrics["toy/_trailing_skipped"] == 0.0 and metrics["toy/_nonfinite_loss"] == 1.0
    assert metrics["toy/_num_updates"] == 2.0
    assert metrics["toy/lr"] == pytest.approx(0.05)


def test_every_update_skipped_leaves_params_and_state_unchanged():
    batch, params = _toy()
    poisoned = batch._replace(y=np.full_like(batch.y, np.nan))
    tx, _ = make_optimizer(_optim_spec())
    got, state, metrics = _update(params, poisoned, num_mini=2, epochs=2)
    jax.tree.map(np.testing.assert_array_equal, got, jax.device_get(params))
    jax.tree.map(np.testing.assert_array_equal, state, jax.device_get(tx.init(params)))  # Adam count 0 too
    assert metrics["toy/num_nonfinite_skipped"] == 4.0 and metrics["toy/_trailing_skipped"] == 4.0


# ---------------------------------------------------------------------------------------------
# Host pieces: the guard's count, rewards, the KL controller, the checkpoint check.

def _counters(role, skipped, total, trailing, loss_bad=0):
    return {f"{role}/num_nonfinite_skipped": float(skipped), f"{role}/_num_updates": float(total),
            f"{role}/_trailing_skipped": float(trailing), f"{role}/_nonfinite_loss": float(loss_bad),
            f"{role}/pg_loss": 0.5}


def test_guard_counts_consecutive_updates_across_steps():
    guard = NonFiniteGuard(5)
    described = []

    def describe():
        described.append(1)
        return None

    metrics = _counters("actor", 0, 4, 0)
    guard.check(1, metrics, describe)
    assert described == [] and sorted(metrics) == ["actor/num_nonfinite_skipped", "actor/pg_loss"]
    guard.check(2, _counters("actor", 2, 4, 0), describe)  # the first two updates skipped, then applied
    assert guard.consecutive["actor"] == 0 and described == [1]
    guard.check(3, _counters("actor", 3, 4, 3), describe)  # the last three in a row
    assert guard.consecutive["actor"] == 3
    with pytest.raises(NonFiniteError) as err:  # all 4 of step 4: 7 in a row
        guard.check(4, _counters("actor", 4, 4, 4), describe)
    msg = str(err.value)
    assert "step 4" in msg and "actor skipped 7 optimizer updates in a row" in msg
    assert "max_consecutive_nonfinite=5" in msg and "first non-finite quantity at step 4: grad" in msg

    guard = NonFiniteGuard(2)
    guard.check(1, {**_counters("actor", 0, 1, 0), **_counters("critic", 1, 1, 1, loss_bad=1)}, lambda: None)
    with pytest.raises(NonFiniteError, match=r"step 2: the critic .* quantity at step 2: return \(3 values\)"):
        guard.check(2, {**_counters("actor", 0, 1, 0), **_counters("critic", 1, 1, 1, loss_bad=1)},
                    lambda: "return (3 values)")


def test_rewards_kl_controller_and_checkpoint_checks():
    scores, count = sanitize_scores(np.float32([1.0, np.nan, -np.inf, 0.5]))
    np.testing.assert_array_equal(scores, np.float32([1.0, 0.0, 0.0, 0.5]))
    assert count == 2
    scores, count = sanitize_scores(np.float32([np.nan, np.nan]))  # no signal at all: left to skip the step
    assert count == 2 and np.isnan(scores).all()

    ctrl = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    ctrl.update(float("nan"), n_steps=8)
    ctrl.update(float("inf"), n_steps=8)
    assert ctrl.value == 0.1
    ctrl.update(0.1, n_steps=8)  # a finite KL still moves it: 0.1 * (1 + 0.2 * 8 / 100)
    assert ctrl.value == pytest.approx(0.1016)

    state = {"actor": {"params": {"w": jnp.ones(3), "b": jnp.zeros(2)}, "opt_state": (jnp.int32(3),)}}
    assert_finite_state(state, 7)
    state["actor"]["params"]["b"] = jnp.asarray([0.0, jnp.nan])
    assert nonfinite_leaves(state) == ["['actor']['params']['b']"]
    with pytest.raises(NonFiniteError, match=r"step 7: refusing to save a checkpoint: \['actor'\]\['params'\]\['b'\]"):
        assert_finite_state(state, 7)


# ---------------------------------------------------------------------------------------------
# Through the trainer.

REWARD_FILE = '''
import os

MODE_FILE = {mode_file!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    mode = open(MODE_FILE).read() if os.path.exists(MODE_FILE) else ""
    if mode == "all" or (mode == "some" and len(solution_str) % 3 == 0):
        return float("nan")
    return 1.0 if solution_str.startswith(" ") else 0.0
'''


def _tiny_config(run_dir, reward_file, **overrides):
    return tiny_runs.tiny_config(run_dir, **{"custom_reward_function.path": str(reward_file), **overrides})


class _Poison:
    """Test-only injection: inf advantages at every valid token while `on` (a non-finite gradient)."""

    def __init__(self, real):
        self.real, self.on = real, False

    def __call__(self, **kwargs):
        exp, rewards, metrics = self.real(**kwargs)
        if self.on:
            exp = exp.replace(advantages=jnp.where(exp.response_mask > 0, jnp.inf, exp.advantages))
        return exp, rewards, metrics


class _NanRewardModel:
    """A reward model whose scores are NaN at the given rows."""

    def __init__(self, nan_rows):
        self.nan_rows = nan_rows

    def score(self, prompt_ids, prompt_mask, response_ids, response_mask, raw_prompts=None):
        scores = np.ones(len(response_ids), np.float32)
        scores[self.nan_rows] = np.nan
        return scores


def _params(trainer):
    return jax.device_get(trainer.actor.params)


def _same(a, b):
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


def _saved_steps(run_dir):
    return sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit())


def test_nan_rewards_and_nonfinite_gradients_through_the_trainer(tmp_path, monkeypatch, smollm2_gguf):
    import jaxrl_llm.trainer.trainer as trainer_module
    from jaxrl_llm.trainer import Trainer

    poison = _Poison(trainer_module.make_experience)
    monkeypatch.setattr(trainer_module, "make_experience", poison)
    mode_file = tmp_path / "reward_mode"
    reward_file = tmp_path / "nan_reward.py"
    reward_file.write_text(REWARD_FILE.format(mode_file=str(mode_file)))
    run = tmp_path / "run"
    cfg = _tiny_config(run, reward_file, **{
        "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
        "data.synthetic.n_train": 64, "trainer.total_training_steps": 10, "trainer.save_freq": 1,
        "trainer.max_consecutive_nonfinite": 3, "trainer.rollout_data_dir": str(tmp_path / "dumps"),
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,  # 2 updates / step
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 0})
    rows = 4 * 4
    trainer = Trainer(cfg)
    trainer.start()

    # step 1: some rewards NaN -> counted, scored 0; every update applied
    mode_file.write_text("some")
    before = _params(trainer)
    m = trainer.step()
    dumped = [json.loads(line) for line in open(tmp_path / "dumps" / "0.jsonl")]
    nan_rows = [r for r in dumped if len(r["output"]) % 3 == 0]
    assert len(dumped) == rows and 0 < len(nan_rows) < rows
    assert m["reward/num_nonfinite"] == len(nan_rows) and all(r["score"] == 0.0 for r in nan_rows)
    assert np.isfinite(m["critic/score/mean"]) and np.isfinite(m["actor/pg_loss"])
    assert m["actor/num_nonfinite_skipped"] == 0 and not _same(before, _params(trainer))

    # step 2: a non-finite gradient (inf advantages): both updates skipped, params unchanged, run goes on
    mode_file.write_text("")
    poison.on = True
    before = _params(trainer)
    m = trainer.step()
    poison.on = False
    assert m["actor/num_nonfinite_skipped"] == 2 and m["reward/num_nonfinite"] == 0
    assert _same(before, _params(trainer))
    assert not any(k.startswith("actor/_") for k in m)  # the guard's counters are not logged

    # step 3: back to normal (the count of skips in a row starts again)
    m = trainer.step()
    assert m["actor/num_nonfinite_skipped"] == 0 and trainer.nonfinite.consecutive["actor"] == 0
    after_step_3 = _params(trainer)

    # steps 4 and 5: every reward NaN -> no signal, updates skipped; 4 in a row >= 3 stops the run
    mode_file.write_text("all")
    m = trainer.step()
    assert m["reward/num_nonfinite"] == rows and m["actor/num_nonfinite_skipped"] == 2
    with pytest.raises(NonFiniteError) as err:
        trainer.step()
    msg = str(err.value)
    assert msg.startswith("step 5: the actor skipped 4 optimizer updates in a row")
    assert "first non-finite quantity at step 5: reward (16 values)" in msg
    assert trainer.global_step == 4 and _same(after_step_3, _params(trainer))
    trainer.close()
    mode_file.write_text("")

    # nothing non-finite was saved: the checkpoints of steps 1-4, the last equal to step 3's params;
    # a resumed run starts from it and goes on at the schedule's rate for step 5
    assert _saved_steps(run) == [1, 2, 3, 4]
    resumed = Trainer(cfg)
    resumed.start()
    assert resumed.global_step == 4 and _same(after_step_3, _params(resumed))
    resumed.generator.reward_model = _NanRewardModel([0, 3])  # step 5: a reward model's NaN scores
    m = resumed.step()
    resumed.generator.reward_model = None
    assert m["reward/num_nonfinite"] == 2 and m["actor/num_nonfinite_skipped"] == 0
    assert m["critic/score/mean"] == pytest.approx((rows - 2) / rows)
    # veRL's cosine (no warmup, half a cycle) at RL step 4 of 10: 0.5 * (1 + cos(pi * 4 / 10))
    assert m["actor/lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 10)), rel=1e-6)

    # steps 6 and 7: inf advantages again -> stop at step 7, naming the advantage
    poison.on = True
    resumed.step()
    with pytest.raises(NonFiniteError, match=r"^step 7: the actor .* at step 7: advantage \(\d+ values\)"):
        resumed.step()
    poison.on = False
    resumed.store.wait()  # step 6's save is asynchronous: committed before the folders are listed
    assert _saved_steps(run) == [1, 2, 3, 4, 5, 6]

    # non-finite weights (injected): never checkpointed; the next step names the sampler's log-probs
    norm = resumed.actor.params["final_norm"]
    norm["scale"] = norm["scale"] * jnp.inf
    with pytest.raises(NonFiniteError, match=r"step 6: refusing to save a checkpoint: "
                                             r"\['actor'\]\['params'\]\['final_norm'\]\['scale'\] holds"):
        resumed.save_checkpoint()
    resumed.nonfinite.max_consecutive = 1
    with pytest.raises(NonFiniteError, match=r"at step 7: log-prob \(sampler\)"):
        resumed.step()
    resumed.close()
    assert _saved_steps(run) == [1, 2, 3, 4, 5, 6]

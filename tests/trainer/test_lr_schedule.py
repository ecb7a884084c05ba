"""The learning-rate schedule is veRL's: one scheduler step per RL step (every mini-batch and epoch
of step k uses lr(k)), warmup by steps or by ratio, constant or cosine with min_lr_ratio /
num_cycles; `actor/lr` and `critic/lr` report the rate applied at that step.

The reference formulas below are veRL's LambdaLR lambdas (get_constant_schedule_with_warmup,
get_cosine_schedule_with_warmup) and its warmup resolution, written out in plain Python."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tiny_runs
from tiny_runs import ToyBatch as Toy
from tiny_runs import toy_loss as _toy_loss

from jaxrl_llm.config import apply_overrides, default_config, resolve_config
from jaxrl_llm.roles.optim import make_lr_schedule, make_optimizer
from jaxrl_llm.roles.update import denominators, run_update_epochs


def verl_warmup(lr_warmup_steps: int, ratio: float, total: int) -> int:
    return int(ratio * total) if lr_warmup_steps < 0 else lr_warmup_steps


def verl_factor(step: int, style: str, warmup: int, total: int, min_lr_ratio: float = 0.0,
                num_cycles: float = 0.5) -> float:
    if style == "constant":
        return step / max(1.0, warmup) if step < warmup else 1.0
    if style == "wsd":  # veRL get_wsd_schedule_with_warmup (stable_ratio 0.9), its SFT trainer's lr_scheduler: wsd
        stable = int(max(0, total - warmup) * 0.9)
        if step < warmup:
            return step / max(1, warmup)
        if step < warmup + stable:
            return 1.0
        if step < total:
            progress = (step - warmup - stable) / max(1, total - warmup - stable)
            return (1 - min_lr_ratio) * max(0.0, 0.5 * (1 + math.cos(math.pi * num_cycles * 2.0 * progress))) \
                + min_lr_ratio
        return min_lr_ratio
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    x = math.cos(math.pi * num_cycles * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)


def _actor_optim(total: int, **optim):
    overrides = ["actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=x.parquet",
                 f"trainer.total_training_steps={total}"]
    overrides += [f"actor_rollout_ref.actor.optim.{k}={v}" for k, v in optim.items()]
    cfg = apply_overrides(default_config(), overrides)
    return resolve_config(cfg, dp_size=1, check_paths=False).actor_optim


@pytest.mark.parametrize("style, warmup_steps, ratio, min_lr_ratio, num_cycles", [
    ("constant", 3, 0.0, 0.0, 0.5),
    ("constant", -1, 0.25, 0.0, 0.5),   # warmup by ratio
    ("constant", 0, 0.25, 0.0, 0.5),    # 0 steps: no warmup, the ratio is not used (veRL: only < 0 is)
    ("cosine", -1, 0.1, 0.0, 0.5),
    ("cosine", 4, 0.0, 0.2, 0.5),
    ("cosine", 2, 0.0, 0.1, 1.0),       # a full cosine cycle: back up to lr at the end
    ("cosine", -1, 0.2, 0.05, 2.0),
    ("wsd", -1, 0.1, 0.0, 0.5),
    ("wsd", 3, 0.0, 0.1, 0.5),
])
def test_schedule_values_equal_verl(style, warmup_steps, ratio, min_lr_ratio, num_cycles):
    total, lr = 20, 1e-3
    spec = _actor_optim(total, lr=lr, lr_scheduler_type=style, lr_warmup_steps=warmup_steps,
                        lr_warmup_steps_ratio=ratio, min_lr_ratio=min_lr_ratio, num_cycles=num_cycles)
    warmup = verl_warmup(warmup_steps, ratio, total)
    assert (spec.warmup_steps, spec.total_steps) == (warmup, total)
    schedule = make_lr_schedule(spec)
    for step in range(total + 2):
        want = lr * verl_factor(step, style, warmup, total, min_lr_ratio, num_cycles)
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-12), step


def test_every_update_of_a_step_uses_that_steps_lr():
    """2 epochs x 2 mini-batches = 4 optimizer updates, all at the one rate passed in: the same as
    optax.adamw with that constant rate stepped over the same mini-batches."""
    rng = np.random.default_rng(0)
    batch = Toy(jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                jnp.ones((8, 4), jnp.float32))
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), "b": jnp.zeros(4, jnp.float32)}
    spec = _actor_optim(10, lr=0.05, lr_warmup_steps=4, weight_decay=0.01)
    tx, schedule = make_optimizer(spec)
    lr = np.float32(schedule(3))  # RL step 3 of a 4-step warmup: 0.75 * lr
    assert lr == pytest.approx(0.0375)
    update = jax.jit(functools.partial(run_update_epochs, tx=tx, loss_fn=_toy_loss, metric_prefix="toy",
                                       ppo_epochs=2, num_mini_batches=2, num_micro_batches=2, shuffle=False))
    got, got_state, metrics = update(params, tx.init(params), batch, jax.random.PRNGKey(0), lr)

    ref_tx = optax.chain(optax.clip_by_global_norm(spec.grad_clip), optax.adamw(
        float(lr), b1=spec.betas[0], b2=spec.betas[1], eps=spec.eps, weight_decay=spec.weight_decay))
    want, state = params, ref_tx.init(params)
    for _ in range(2):
        for half in (slice(0, 4), slice(4, 8)):
            mb = Toy(*(a[half] for a in batch))
            grads = jax.grad(lambda p: _toy_loss(p, mb, denominators(mb.response_mask))[0])(want)
            updates, state = ref_tx.update(grads, state, want)
            want = optax.apply_updates(want, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), got, want)
    assert float(metrics["toy/lr"]) == pytest.approx(0.0375)
    assert int(got_state[1].count) == 4  # Adam's bias correction counts optimizer updates, as torch's
    assert float(metrics["toy/num_nonfinite_skipped"]) == 0.0


# ---------------------------------------------------------------------------------------------
# Through the trainer: actor/lr and critic/lr per RL step, with several updates per step and a resume.

@pytest.fixture
def tiny_cfg(smollm2_gguf, tmp_path):

    def make(**overrides):
        return tiny_runs.tiny_config(tmp_path / "run", **{"data.synthetic.n_train": 32, **overrides})

    return make


def test_trainer_logs_verl_lr_per_rl_step(tiny_cfg):
    """actor/lr and critic/lr of every RL step equal veRL's schedule at that step's count of the role's
    updates (the actor's starts after critic_warmup), with 4 actor updates per step. After a resume
    the step count comes back with the checkpoint: tests/reliability/test_nonfinite.py checks the
    rate of a resumed run, test_trainer_e2e.py that a resumed run logs the same metrics."""
    from jaxrl_llm.trainer import Trainer

    total = 4
    cfg = tiny_cfg(**{
        "trainer.total_training_steps": total, "trainer.critic_warmup": 1,
        "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
        "algorithm.adv_estimator": "gae", "critic.enable": True,
        # 2 mini-batches x 2 epochs = 4 actor updates per RL step
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_epochs": 2,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.25,
        "actor_rollout_ref.actor.optim.min_lr_ratio": 0.1,
        "critic.optim.lr": 1e-3, "critic.optim.lr_warmup_steps": 2})
    trainer = Trainer(cfg)
    trainer.fit()
    history = trainer.history
    assert len(history) == total

    actor_warmup = verl_warmup(-1, 0.25, total)  # = 1
    for k, metrics in enumerate(history):  # k: 0-based RL step
        assert metrics["critic/lr"] == pytest.approx(1e-3 * verl_factor(k, "constant", 2, total), rel=1e-6)
        assert metrics["critic/num_nonfinite_skipped"] == 0
        if k < 1:  # critic warmup: the actor is not updated and its scheduler does not step
            assert "actor/lr" not in metrics
            continue
        want = 1e-3 * verl_factor(k - 1, "cosine", actor_warmup, total, 0.1)
        assert metrics["actor/lr"] == pytest.approx(want, rel=1e-6), k
        assert metrics["actor/num_nonfinite_skipped"] == 0
    assert [round(m["actor/lr"] / 1e-3, 6) for m in history[1:]] == [0.0, 1.0, 0.775]
    assert [m["critic/lr"] / 1e-3 for m in history] == pytest.approx([0.0, 0.5, 1.0, 1.0])

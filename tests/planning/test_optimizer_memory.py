"""The optimizer-state levers of the memory plan (docs/config.md, `*.optim.moment_dtype` / `*.optim.offload`):
bf16 Adam moments computed in fp32 and stored rounded to bf16, against the formula written out here;
the optimizer state offloaded to pinned host memory between updates, with the same numbers as on
device, through a checkpoint and resume, and counted off the other programs' resident bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs

from jaxrl_llm.config import apply_overrides, default_config, resolve_config
from jaxrl_llm.roles.optim import make_optimizer
from jaxrl_llm.roles.reference import is_offloaded
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")


def _optim(**optim):
    overrides = ["actor_rollout_ref.model.path=tiny:llama", "data.tokenizer=tok", "data.train_files=x.parquet",
                 "trainer.total_training_steps=10", "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
                 *(f"actor_rollout_ref.actor.optim.{k}={v}" for k, v in optim.items())]
    return resolve_config(apply_overrides(default_config(), overrides), dp_size=1, check_paths=False).actor_optim


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def test_bf16_moments_are_adam_in_fp32_stored_rounded():
    """Each step: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2 in fp32 from the stored (bf16) moments,
    update -lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) - lr wd p, then m and v stored as bf16."""
    spec = _optim(moment_dtype="bfloat16", weight_decay=0.01, lr=1e-3)
    assert spec.grad_clip is None or spec.grad_clip > 0
    tx, schedule = make_optimizer(spec)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)}
    state = tx.init(params)
    moments = [x for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (4, 8)]
    assert len(moments) == 2 and all(x.dtype == jnp.bfloat16 for x in moments)  # 4 bytes a parameter, not 8

    b1, b2, eps, lr, wd = spec.betas[0], spec.betas[1], spec.eps, float(schedule(0)), spec.weight_decay
    p, m, v = np.asarray(params["w"], np.float64), np.zeros((4, 8)), np.zeros((4, 8))
    fp32 = make_optimizer(_optim(weight_decay=0.01, lr=1e-3))[0]
    fp32_params, fp32_state = params, fp32.init(params)
    for t in range(1, 6):
        g = rng.normal(size=(4, 8)) * 1e-2  # below the clip norm: the clipping is the identity
        updates, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params, learning_rate=lr)
        params = {"w": params["w"] + updates["w"]}
        m = b1 * _bf16(m) + (1 - b1) * g
        v = b2 * _bf16(v) + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) - lr * wd * p
        m, v = _bf16(m), _bf16(v)
        np.testing.assert_allclose(np.asarray(params["w"]), p, rtol=2e-6, atol=1e-7)
        stored = [np.asarray(x, np.float64) for x in jax.tree.leaves(state) if getattr(x, "shape", ()) == (4, 8)]
        np.testing.assert_array_equal(stored[0], m)
        np.testing.assert_array_equal(stored[1], v)
        fp32_updates, fp32_state = fp32.update({"w": jnp.asarray(g, jnp.float32)}, fp32_state, fp32_params,
                                               learning_rate=lr)
        fp32_params = {"w": fp32_params["w"] + fp32_updates["w"]}
    # bf16 moments move the weights by a relative 2^-9 of an update at most: close to fp32, not equal
    diff = np.abs(np.asarray(params["w"]) - np.asarray(fp32_params["w"]))
    assert 0 < diff.max() < 5 * 2**-9 * lr * 5


def test_offloaded_optimizer_state_trains_the_same_and_resumes(tmp_path):
    def run(run_dir, steps, **overrides):
        cfg = tiny_runs.tiny_config(run_dir, **{"trainer.total_training_steps": steps, "trainer.logger": ["jsonl"],
                                                "data.synthetic.n_train": 32,
                                                "actor_rollout_ref.actor.optim.offload": True, **overrides})
        return Trainer(cfg)

    on_device = Trainer(tiny_runs.tiny_config(tmp_path / "device", **{"trainer.total_training_steps": 2,
                                                                      "trainer.logger": ["jsonl"],
                                                                      "data.synthetic.n_train": 32}))
    on_device.fit()
    full = run(tmp_path / "full", 3, **{"trainer.save_freq": 1})
    assert is_offloaded(full.actor.opt_state)
    full.fit()
    assert is_offloaded(full.actor.opt_state) and not is_offloaded(full.actor.params)  # back on the host
    device_rows, host_rows = tiny_runs.read_metrics(tmp_path / "device"), tiny_runs.read_metrics(tmp_path / "full")
    for step in (1, 2):
        assert tiny_runs.step_numbers(device_rows, step) == tiny_runs.step_numbers(host_rows, step)
    tiny_runs.assert_resume_equals_uninterrupted(run, tmp_path / "full", tmp_path / "resumed")


def test_the_plan_counts_an_offloaded_optimizer_state_off_the_other_programs(tmp_path):
    from jaxrl_llm.config import resolve as resolve_spec
    from jaxrl_llm.config import validate_config
    from jaxrl_llm.planning.memory import Planner, planning_context, planning_setup

    resident = {}
    for offload in (False, True):
        cfg = validate_config(tiny_runs.tiny_config(tmp_path, **{"actor_rollout_ref.actor.optim.offload": offload}),
                              num_devices=8)
        target, mesh, tokenizer = planning_setup(cfg)
        spec = resolve_spec(cfg, dp_size=8)
        with planning_context(mesh, target):
            planner = Planner(spec, mesh, tokenizer)
            resident[offload] = {p.name: planner.analyse(p, spec.plan) for p in planner.programs}
    opt = resident[False]["update_actor"].opt_state_bytes
    assert opt > 0 and resident[True]["update_actor"].opt_state_bytes == opt  # an argument of its update
    assert resident[False]["sample"].resident_bytes - resident[True]["sample"].resident_bytes == opt

"""Off-policy pipelining (rollout/pipeline.py, rollout/sources.py, sharding/split.py): the
synchronizer's schedule, offset 0 / interval 1 == synchronous training, staleness bound with rollout correction on, a
split mesh of 4 + 4 virtual CPU devices end to end, and resume == uninterrupted."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_runs

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm.config import ConfigError, resolve_config
from jaxrl_llm.config.spec import SyncSpec
from jaxrl_llm.sharding.split import copy_tree, make_split_meshes, split_devices, transfer
from jaxrl_llm.trainer import Trainer

pytestmark = pytest.mark.usefixtures("smollm2_gguf")


def tiny(run_dir, **overrides):
    return tiny_runs.tiny_config(run_dir, **{"trainer.logger": ["jsonl"], "data.synthetic.n_train": 32,
                                             "trainer.test_freq": -1, **overrides})


def run(cfg, steps):
    trainer = Trainer(cfg)
    try:
        return [trainer.step() for _ in range(steps)], trainer
    finally:
        trainer.close()


def test_offset0_interval1_equals_synchronous(tmp_path):
    # the pipeline's schedule (take, on weight copies) and the synchronous source against the plain
    # step on the same batches
    from jaxrl_llm.rollout.pipeline import RolloutPipeline
    from jaxrl_llm.rollout.sources import SynchronousSource

    cfg = tiny(tmp_path / "a", **{"trainer.total_training_steps": 2})
    t0 = Trainer(cfg)
    assert isinstance(t0.rollout_source, SynchronousSource) and t0.rollout_source.synchronous
    t0.rollout_source = RolloutPipeline(SyncSpec(1, 0, None), policy=t0.actor.weights(), loader=t0.train_loader,
                                        generate=t0.rollout_source.generate,
                                        rng_for=lambda k: jax.random.fold_in(t0.base_rng, k),
                                        train_mesh=t0.mesh, rollout_mesh=None, total_steps=2)
    try:
        piped = [t0.step() for _ in range(2)]
    finally:
        t0.close()
    synchronous, t1 = run(tiny(tmp_path / "b", **{"trainer.total_training_steps": 2}), 2)
    t2 = Trainer(tiny(tmp_path / "c", **{"trainer.total_training_steps": 2}))
    sync = []
    for _ in range(2):
        sync.append(t2.train_step(next(t2.train_loader)))
        t2.global_step += 1
    t2.close()
    for a, s, b in zip(piped, synchronous, sync):
        for k in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert a[k] == b[k] == s[k], (k, a[k], s[k], b[k])
        assert a["rollout/staleness"] == s["rollout/staleness"] == 0.0
        assert "timing_s/weight_sync" in a and "timing_s/weight_sync" not in s  # the pipeline copied weights
    for x, y, z in zip(jax.tree.leaves(t0.actor.params), jax.tree.leaves(t1.actor.params),
                       jax.tree.leaves(t2.actor.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(z))
    piped = synchronous
    assert not any(k.startswith("rollout_corr/") for k in piped[-1])  # on-policy: no correction


def test_offset_staleness_bounded_and_corrected(tmp_path):
    cfg = tiny(tmp_path / "run", **{"trainer.total_training_steps": 4, "synchronizer.sync_offset": 1,
                                    "synchronizer.sync_interval": 2, "actor_rollout_ref.actor.optim.lr": 5e-2})
    rows, trainer = run(cfg, 4)
    assert trainer.rollout_source.threaded and trainer.spec.rollout_correction.rollout_is == "token"
    staleness = [r["rollout/staleness"] for r in rows]
    # step k trains the rollout launched at k - 1 on the weights of (k - 1) - (k - 1) % 2
    assert staleness == [0.0, 1.0, 2.0, 1.0], staleness
    assert max(staleness) <= trainer.spec.sync.max_staleness == 2
    for r in rows:
        assert "rollout_corr/rollout_is_mean" in r or any(k.startswith("rollout_corr/") for k in r), sorted(r)
        assert all(np.isfinite(v) for k, v in r.items() if k.startswith(("actor/", "rollout_corr/")))
    # on-policy (step 0) the recomputed log-probs equal the sampler's to fp32 rounding; a stale rollout's do not
    kl = [abs(r["rollout_corr/kl"]) for r in rows]
    assert kl[0] < 1e-5 and min(kl[1:]) > 10 * max(kl[0], 1e-6), kl


def test_split_mesh_4_plus_4_end_to_end(tmp_path):
    cfg = tiny(tmp_path / "run", **{"trainer.total_training_steps": 2, "synchronizer.sync_offset": 1,
                                    "mesh.rollout_devices": 4})
    rows, trainer = run(cfg, 2)
    assert len(trainer.mesh.devices.flat) == 4 and len(trainer.rollout_mesh.devices.flat) == 4
    assert not set(trainer.mesh.devices.flat) & set(trainer.rollout_mesh.devices.flat)
    for r in rows:
        assert all(np.isfinite(v) for v in r.values()), r
        assert r["rollout/staleness"] <= trainer.spec.sync.max_staleness == 1
    # the weights generation reads live on the rollout devices only
    rollout_params = trainer.rollout_source.rollout_params
    assert {d for x in jax.tree.leaves(rollout_params) for d in x.devices()} == set(trainer.rollout_mesh.devices.flat)


def test_weight_copies_survive_donation_and_move_device_to_device():
    x = jax.device_put(jnp.arange(8.0))
    kept = copy_tree({"w": x})["w"]
    jax.jit(lambda a: a * 2, donate_argnums=0)(x)  # donates x's buffer
    np.testing.assert_array_equal(np.asarray(kept), np.arange(8.0))
    train, rollout = make_split_meshes({"data": 1, "fsdp": -1, "tensor": 1, "rollout_devices": [6, 7]})
    w = jax.device_put(jnp.ones((12, 3)), jax.sharding.NamedSharding(train, jax.sharding.PartitionSpec("fsdp")))
    moved = transfer(w, rollout)
    assert {d.id for d in moved.devices()} == {6, 7} and moved.sharding.spec[0] == "fsdp"
    assert len(train.devices.flat) == 6
    with pytest.raises(ValueError, match="mesh.rollout_devices"):
        split_devices(8)


def test_config_checks_and_derived_bound(tmp_path):
    spec = resolve_config(tiny(tmp_path, **{"synchronizer.sync_offset": 2, "synchronizer.sync_interval": 3}),
                          dp_size=8, check_paths=False)
    assert spec.sync == SyncSpec(3, 2, None, auto_correction=True) and spec.sync.max_staleness == 4
    # token IS on the off-policy data, its weights taken in the actor's loss (no old-log-prob pass)
    assert spec.rollout_correction.rollout_is == "token"
    assert spec.rollout_is_in_update and not spec.recompute_old_log_probs
    # an explicit correction is kept
    spec = resolve_config(tiny(tmp_path, **{"synchronizer.sync_offset": 1,
                                            "algorithm.rollout_correction.rollout_is": "sequence"}),
                          dp_size=8, check_paths=False)
    assert spec.rollout_correction.rollout_is == "sequence" and not spec.sync.auto_correction
    with pytest.raises(ConfigError, match="synchronizer.sync_style"):
        resolve_config(tiny(tmp_path, **{"synchronizer.sync_style": "dynamic_by_explorer"}), dp_size=8,
                       check_paths=False)
    with pytest.raises(ConfigError, match="synchronizer.sync_offset"):
        resolve_config(tiny(tmp_path, **{"synchronizer.sync_offset": -1}), dp_size=8, check_paths=False)


def test_resume_equals_uninterrupted_pipelined(tmp_path):
    """Checkpoint 1 of an offset-1 / interval-2 run holds the weights of version 0: both the
    in-flight rollout of step 1 and the next launch (step 2, no sync at 1) read them. A resume from
    it logs exactly the uninterrupted run's steps 2..4, staleness included."""
    extra = {"synchronizer.sync_offset": 1, "synchronizer.sync_interval": 2, "trainer.save_freq": 1}

    def run_dir(d, steps, **kw):
        return Trainer(tiny(d, **{"trainer.total_training_steps": steps, **extra, **kw}))

    full = tmp_path / "full"
    run_dir(full, 4).fit()
    meta = ckpt.read_checkpoint_meta(full / "checkpoints" / "1")
    assert meta["pipeline"] == {"in_flight": {"1": 0}, "current": 0, "versions": [0]}
    # step 2 syncs: checkpoint 2 needs only the in-flight version, checkpoint 3 the synced one
    assert ckpt.read_checkpoint_meta(full / "checkpoints" / "2")["pipeline"] == {
        "in_flight": {"2": 0}, "current": None, "versions": [0]}
    assert ckpt.read_checkpoint_meta(full / "checkpoints" / "3")["pipeline"]["versions"] == [2]
    tiny_runs.assert_resume_equals_uninterrupted(run_dir, full, tmp_path / "resumed", steps=4)
    staleness = [r["rollout/staleness"] for r in tiny_runs.read_metrics(tmp_path / "resumed")]
    assert staleness == [1.0, 2.0, 1.0], staleness


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 5])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_weight_copies_bound_the_schedule(offset, interval):
    """SyncSpec.weight_copies (what the memory plan counts) against the schedule itself: the distinct
    weight versions that pending rollouts read, plus the fresh copy, at every sync."""
    spec = SyncSpec(interval, offset)
    pending: dict[int, int] = {}  # step -> version it was launched on
    version, next_launch, held = -1, 0, 0
    for k in range(40):
        if version < 0 or k % interval == 0:
            version = k
            held = max(held, len(set(pending.values()) | {version}))
        while next_launch <= k + offset:
            pending[next_launch] = version
            next_launch += 1
        pending.pop(k)
    assert spec.weight_copies == (held if spec.off_policy else 0), (held, spec.weight_copies)

"""Optimizer schedule, checkpoint store and metric sinks of the trainer."""
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import optim_spec

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm.bookkeeping.tracking import Tracking
from jaxrl_llm.roles.optim import make_lr_schedule, make_optimizer


def _optim(total_steps=10, grad_clip=None, **kw):
    return optim_spec(total_steps, grad_clip, **{"lr": 1e-3, **kw})


def test_constant_schedule_with_warmup_matches_verl():
    sched = make_lr_schedule(_optim(20, lr_warmup_steps=4))
    got = [float(sched(s)) for s in range(8)]
    want = [1e-3 * min(1.0, s / 4) for s in range(8)]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cosine_schedule_matches_verl_formula():
    total, warm = 50, 5
    cfg = _optim(total, lr_scheduler_type="cosine", lr_warmup_steps_ratio=0.1, min_lr_ratio=0.1, num_cycles=0.5)
    assert cfg.warmup_steps == warm
    sched = make_lr_schedule(cfg)
    for s in range(total):
        if s < warm:
            want = s / warm
        else:
            progress = (s - warm) / (total - warm)
            x = math.cos(math.pi * 0.5 * 2.0 * progress)
            want = max(0.1, x * 0.9 * 0.5 + 1.1 * 0.5)
        assert float(sched(s)) == pytest.approx(1e-3 * want, rel=1e-5), s


def test_linear_schedule_matches_transformers_formula():
    total, warm = 20, 4  # transformers' get_linear_schedule_with_warmup (TRL's default schedule)
    sched = make_lr_schedule(_optim(total, lr_scheduler_type="linear", lr_warmup_steps=warm))
    for s in range(total + 2):
        want = s / warm if s < warm else max(0.0, (total - s) / (total - warm))
        assert float(sched(s)) == pytest.approx(1e-3 * want, rel=1e-5, abs=1e-12), s
    floored = make_lr_schedule(_optim(total, lr_scheduler_type="linear", lr_warmup_steps=warm, min_lr_ratio=0.25))
    assert float(floored(total - 1)) == pytest.approx(1e-3 * 0.25, rel=1e-5)  # (20-19)/16 < 0.25


def test_unknown_schedule_names_key():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        make_lr_schedule(_optim(lr_scheduler_type="polynomial"))


def test_optimizer_clips_then_applies_adamw():
    tx, _ = make_optimizer(_optim(grad_clip=1.0, lr=0.1, weight_decay=0.0))
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.full(4, 100.0)}, state, params, learning_rate=0.1)
    # First Adam step moves each coordinate by ~lr regardless of the gradient scale.
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * np.ones(4), rtol=1e-4)


def test_checkpoint_roundtrip_sharded_and_bytes(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = {"params": {"w": jax.device_put(jnp.arange(16.0), sharding)}, "step": jnp.int32(3)}
    store = ckpt.CheckpointStore(str(tmp_path / "checkpoints"), max_to_keep=2)
    for step in (1, 2, 3):
        store.save(step, state, {"pos": step, "blob": b"\x00\x01"}, {"kl_coef": 0.5, "step": step})
    store.wait()
    assert store.all_steps() == [2, 3]
    restored, data, meta = store.restore(3, ckpt.abstract_like(state))
    store.close()
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.arange(16.0))
    assert restored["params"]["w"].sharding == sharding
    assert data == {"pos": 3, "blob": b"\x00\x01"}
    assert meta["kl_coef"] == 0.5


def test_resolve_resume_modes(tmp_path):
    run = tmp_path / "run"
    assert ckpt.resolve_resume("auto", str(run), None) is None
    assert ckpt.resolve_resume("disable", str(run), None) is None
    store = ckpt.CheckpointStore(str(run / "checkpoints"), async_save=False)
    store.save(7, {"x": jnp.ones(2)}, {}, {})
    store.close()
    assert ckpt.resolve_resume("auto", str(run), None) == (str(run / "checkpoints"), 7)
    assert ckpt.resolve_resume("resume_path", "", str(run / "checkpoints" / "7")) == (
        str(run / "checkpoints"), 7)
    with pytest.raises(ValueError, match="resume_mode"):
        ckpt.resolve_resume("sometimes", str(run), None)
    with pytest.raises(FileNotFoundError, match="resume_from_path"):
        ckpt.resolve_resume("resume_path", str(run), str(tmp_path / "nope"))


def test_tracking_jsonl_and_tensorboard(tmp_path, capsys):
    tracker = Tracking(["console", "jsonl", "tensorboard"], str(tmp_path), config={"a": 1})
    tracker.log({"actor/pg_loss": np.float32(0.25), "timing_s/gen": 1.5, "text": "skip"}, step=1)
    tracker.log_generations("val/generations", [{"input": "q", "output": "a", "score": 1.0}], step=1)
    tracker.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines[0] == {"step": 1, "actor/pg_loss": 0.25, "timing_s/gen": 1.5}
    assert lines[1]["val/generations"][0]["score"] == 1.0
    assert os.listdir(tmp_path / "tensorboard")
    assert "actor/pg_loss:0.2500" in capsys.readouterr().out
    with pytest.raises(ValueError, match="trainer.logger"):
        Tracking(["stdout"], str(tmp_path))


def test_timer_blocks_on_device_work():
    """A span stops the clock only after the values it waits on are computed, not when dispatched."""
    from jaxrl_llm.bookkeeping.metrics import Timer

    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.ones((256, 256)) / 256
    slow(x).block_until_ready()  # compiled outside the timed spans
    start = time.perf_counter()
    slow(x).block_until_ready()
    compute = time.perf_counter() - start
    timer = Timer()
    with timer("waited") as span:
        out = span.wait(slow(x))
    assert out.shape == (256, 256)
    assert timer.times["waited"] >= 0.5 * compute
    assert set(timer.metrics()) == {"timing_s/waited"}

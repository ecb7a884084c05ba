"""Checkpoint safety: a refused save is an error, `resume_mode=disable` on a run dir with
checkpoints is one clear error, a corrupt or partial latest checkpoint falls back to the previous
one, temporary save folders are cleaned, config changes on resume are listed, and `fit()` closes
everything whatever happens."""
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm import storage
from jaxrl_llm.bookkeeping.watchdog import WorkerWatchdog
from jaxrl_llm.config import ConfigError
from jaxrl_llm.trainer import Trainer

META = {"global_step": 0, "kl_coef": 0.1}


def _state(step):
    return {"actor": {"params": {"w": jnp.arange(6.0) * step}, "opt_state": {"mu": jnp.ones(3) * step}}}


def _store_with(directory, steps, **kw):
    store = ckpt.CheckpointStore(str(directory), async_save=False, **kw)
    for step in steps:
        store.save(step, _state(step), {"pos": step}, {**META, "global_step": step})
    return store


def test_refused_save_is_an_error(tmp_path):
    store = _store_with(tmp_path / "checkpoints", [5])
    with pytest.raises(ckpt.CheckpointError, match=r"step 3 was not written: .* already holds step 5"):
        store.save(3, _state(3), {}, META)
    assert store.all_steps() == [5]  # nothing half-written either
    store.close()


def test_resume_disable_on_a_run_dir_with_checkpoints_is_one_clear_error(tmp_path):
    run = tmp_path / "run"
    assert ckpt.find_resume("disable", str(run), None) is None  # an empty run dir starts fresh
    _store_with(run / "checkpoints", [2, 4]).close()
    with pytest.raises(ConfigError) as err:
        ckpt.find_resume("disable", str(run), None)
    message = str(err.value)
    assert message.startswith("trainer.resume_mode='disable': ")
    for part in (str(run / "checkpoints"), "steps 2, 4", "trainer.resume_mode=auto", "trainer.default_local_dir"):
        assert part in message, part
    assert "\n" not in message
    point = ckpt.find_resume("auto", str(run), None)
    assert (point.directory, point.steps) == (str(run / "checkpoints"), (4, 2))


def test_resume_path_that_would_mix_two_runs_is_refused(tmp_path):
    _store_with(tmp_path / "a" / "checkpoints", [1, 2, 3]).close()
    _store_with(tmp_path / "b" / "checkpoints", [1]).close()
    source = str(tmp_path / "a" / "checkpoints" / "2")
    # into a run dir holding another run's checkpoints
    with pytest.raises(ConfigError, match=r"resume_from_path=.*of another run.*default_local_dir"):
        ckpt.find_resume("resume_path", str(tmp_path / "b"), source)
    # back to an earlier step of the same run dir while later steps remain: saves would be refused
    with pytest.raises(ConfigError, match=r"also holds later steps 3.*Delete those step folders"):
        ckpt.find_resume("resume_path", str(tmp_path / "a"), source)
    # into a fresh run dir: that step exactly, no fallback
    point = ckpt.find_resume("resume_path", str(tmp_path / "c"), source)
    assert (point.directory, point.steps) == (str(tmp_path / "a" / "checkpoints"), (2,))
    # a checkpoints folder: its latest, then the older ones to fall back on
    assert ckpt.find_resume("resume_path", str(tmp_path / "c"), str(tmp_path / "a" / "checkpoints")).steps == (3, 2, 1)


def _corrupt_meta(step_dir):
    path = step_dir / "meta" / "metadata"
    path.write_text(path.read_text()[:7])  # a torn JSON file


def _corrupt_state(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for name in files:
            if name != "_METADATA" and "manifest" not in name and "commit" not in name:
                os.truncate(os.path.join(root, name), 3)  # array data cut short


# orbax's async reader may report a closed event loop after a failed restore; the test checks the outcome
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    directory = tmp_path / "run" / "checkpoints"
    _store_with(directory, [1, 2, 3]).close()
    _corrupt_meta(directory / "3")
    _corrupt_state(directory / "2")
    store = ckpt.CheckpointStore(str(directory))
    point = ckpt.find_resume("auto", str(tmp_path / "run"), None)
    assert point.steps == (3, 2, 1)
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        step, state, data, meta = ckpt.restore_resume_point(store, point, ckpt.abstract_like(_state(0)))
    assert (step, data, meta["global_step"]) == (1, {"pos": 1}, 1)
    np.testing.assert_array_equal(np.asarray(state["actor"]["params"]["w"]), np.arange(6.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{directory}/3 cannot be read" in w and "falling back to step 2" in w for w in warnings), warnings
    assert any(f"{directory}/2 cannot be read" in w and "falling back to step 1" in w for w in warnings), warnings
    # the unreadable steps are gone, so this run's next saves are not refused
    assert store.all_steps() == [1]
    store.save(2, _state(2), {"pos": 2}, {**META, "global_step": 2})
    store.wait()
    assert store.all_steps() == [1, 2]
    store.close()


def test_an_explicit_corrupt_step_or_all_corrupt_is_an_error(tmp_path):
    directory = tmp_path / "run" / "checkpoints"
    _store_with(directory, [1, 2]).close()
    _corrupt_meta(directory / "2")
    point = ckpt.find_resume("resume_path", str(tmp_path / "other"), str(directory / "2"))
    store = ckpt.CheckpointStore(str(tmp_path / "other" / "checkpoints"))
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint in .* could be read: step 2: "):
        ckpt.restore_resume_point(store, point, ckpt.abstract_like(_state(0)))
    store.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]  # another run's folder is never cleaned up


def test_leftover_temporary_save_folders_are_cleaned(tmp_path):
    directory = tmp_path / "checkpoints"
    _store_with(directory, [1]).close()
    # what a kill during an async save leaves: orbax's temporary step folder, never renamed
    shutil.copytree(directory / "1", directory / "2.orbax-checkpoint-tmp-1712345678901234")
    assert ckpt.list_steps(str(directory)) == [1]  # never taken for a checkpoint
    store = ckpt.CheckpointStore(str(directory))
    store.save(2, _state(2), {"pos": 2}, {**META, "global_step": 2})
    store.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]

    # an interrupted HF export leaves a hidden temporary sibling; the next export removes it
    from jaxrl_llm.hf import export_hf
    from jaxrl_llm.models import ModelConfig, init_params

    cfg = ModelConfig.tiny("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)
    params = jax.device_get(init_params(cfg, jax.random.PRNGKey(0)))
    (tmp_path / ".hf.tmp-abc123").mkdir()
    (tmp_path / ".hf.tmp-abc123" / "model.safetensors").write_bytes(b"half")
    export_hf(cfg, params, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "hf"]


def test_config_changes_that_alter_the_run_are_listed_on_resume(caplog):
    saved = {"trainer": {"seed": 1, "logger": ["console"], "save_freq": 5, "default_local_dir": "/a"},
             "data": {"train_batch_size": 8, "train_files": ["a.parquet"], "synthetic": {"task": None}},
             "actor_rollout_ref": {"model": {"path": "m1"}}, "algorithm": {"adv_estimator": "grpo"},
             "critic": {"enable": False, "optim": {"lr": 1e-5}}, "mesh": {"fsdp": -1}}
    current = json.loads(json.dumps(saved))
    current["trainer"].update(seed=2, logger=["wandb"], save_freq=10, default_local_dir="/b")
    current["data"].update(train_batch_size=16, train_files=["b.parquet"])
    current["actor_rollout_ref"]["model"]["path"] = "m2"
    current["algorithm"]["adv_estimator"] = "rloo"
    current["critic"]["optim"]["lr"] = 1e-6  # the critic is off in both runs
    current["mesh"]["fsdp"] = 4  # another slice size: same run
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
        changed = ckpt.warn_config_changes(saved, current, where="run/checkpoints/7")
    assert changed == [
        "actor_rollout_ref.model.path: 'm1' -> 'm2'",
        "algorithm.adv_estimator: 'grpo' -> 'rloo'",
        "data.train_batch_size: 8 -> 16",
        "data.train_files: ['a.parquet'] -> ['b.parquet']",
        "trainer.seed: 1 -> 2",
    ]
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "run/checkpoints/7" in record.getMessage() and "5 key(s)" in record.getMessage()
    assert ckpt.warn_config_changes(saved, json.loads(json.dumps(saved)), where="x") == []


class _Closer:
    def __init__(self, calls, name, error=None):
        self.calls, self.name, self.error = calls, name, error

    def close(self):
        self.calls.append(self.name)
        if self.error is not None:
            raise self.error


def _closing_trainer(calls: list) -> Trainer:
    trainer = Trainer.__new__(Trainer)  # only what fit() and close() touch
    trainer._watchdog = WorkerWatchdog(30.0, lambda: "none")  # fit() starts it (a no-op with one process)
    trainer.store = _Closer(calls, "store")
    trainer.tracker = _Closer(calls, "tracker", OSError("disk full"))
    trainer.reward_manager = _Closer(calls, "reward workers")
    return trainer


def test_fit_closes_everything_when_a_step_fails(caplog):
    """A failing run still waits for its async saves and closes its sinks and reward workers; the
    error the user sees is the step's, not a closing one."""
    calls = []
    trainer = _closing_trainer(calls)

    def failing_start():
        raise RuntimeError("step failed")

    trainer.start = failing_start
    with caplog.at_level(logging.WARNING, logger="jaxrl_llm"), pytest.raises(RuntimeError, match="step failed"):
        trainer.fit()
    assert calls == ["store", "tracker", "reward workers"]
    assert any("disk full" in r.getMessage() for r in caplog.records)
    trainer.close()  # idempotent
    assert calls == ["store", "tracker", "reward workers"]

    # a clean close that fails raises that failure
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        _closing_trainer(calls).close()
    assert calls == ["store", "tracker", "reward workers"]


@pytest.mark.parametrize("error,reason", [
    # tensorstore on a full local disk (as seen on a 3.4 MB tmpfs)
    ('RESOURCE_EXHAUSTED: Error writing "actor.opt_state.1.count/0" in OCDBT database at local file "/fs/4.orbax-'
     'checkpoint-tmp/state": Failed writing: "/fs/4/d/07": Failed to write 766321 bytes to file 21: No space left '
     "on device [os_error_code='28']", "No space left on device (errno 28)"),
    ("[Errno 28] No space left on device: '/fs/4.orbax-checkpoint-tmp'", "No space left on device (errno 28)"),
    ("PERMISSION_DENIED: Error writing gs://b/x: [http_response_body='{\"error\":{\"code\":403,\"message\":\"no "
     "storage.objects.create access\"}}'] [http_response_code='403']",
     "the bucket answered HTTP 403: no storage.objects.create access"),
    ("something else\nwith a second line", "something else"),
])
def test_a_failed_save_is_reported_in_the_storages_own_words(error, reason):
    assert storage.reason(ValueError(error)) == reason


def test_gcsfs_errors_are_reported_in_the_buckets_words():
    """What gcsfs raises once its retries are spent (epath's paths: commit markers, metrics, listings)."""
    import aiohttp
    from gcsfs.retry import HttpError

    forbidden = OSError("Forbidden: http://127.0.0.1:1/upload/storage/v1/b/b/o?name=run%2Fx\nme@x.iam does not have "
                        "storage.objects.create access to the Google Cloud Storage object.")
    assert storage.reason(forbidden) == ("the bucket answered HTTP 403: me@x.iam does not have storage.objects.create "
                                         "access to the Google Cloud Storage object.")
    unavailable = HttpError({"code": 503, "message": "Service Unavailable"})
    assert storage.reason(unavailable) == "the bucket answered HTTP 503: Service Unavailable (after retries)"
    stalled = aiohttp.ServerTimeoutError("Timeout on reading data from socket")
    within = f"within {storage.GCS_READ_TIMEOUT_S:g} s"
    assert storage.reason(stalled) == f"no answer from the bucket {within} (after retries)"
    assert storage.reason(OSError(28, "No space left on device")) == "No space left on device (errno 28)"

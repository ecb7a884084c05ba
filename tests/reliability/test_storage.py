"""Bucket run dirs: every path a run writes or reads goes through etils.epath, so `gs://` works and
is never turned into a local folder; a scheme no installed back-end opens is one config error.

The non-local code path runs against `fake_gcs.FakeGCS` (tests/reliability/fake_gcs.py): the GCS
JSON API served on 127.0.0.1 to tensorstore's real `gcs` driver (what orbax writes arrays with),
and fsspec's `gcs` protocol, which etils.epath opens, over the same objects with GCS semantics (no
folders, no append). So orbax, epath, the record, the dumps and the export run the very code a
bucket would, without network."""
import os
import tempfile

import jax
import numpy as np
import pytest
from fake_gcs import FakeGCS
from storage_util import tiny_config

from jaxrl_llm import checkpoint as ckpt
from jaxrl_llm import storage
from jaxrl_llm.bookkeeping import tracking
from jaxrl_llm.config import ConfigError, resolve_config, validate_config

BUCKET = "test-bucket"


@pytest.fixture
def gcs():
    with FakeGCS((BUCKET,)) as fake:
        yield fake


def _objects(gcs, prefix=""):
    return [n for n in gcs.store.names(BUCKET) if n.startswith(prefix)]


def _text(gcs, name):
    found = gcs.store.get(BUCKET, name)
    assert found is not None, name
    return found[0].decode()


def test_paths_keep_urls_and_make_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.normalize("gs://b/run/") == "gs://b/run"
    assert storage.normalize("runs/x") == str(tmp_path / "runs" / "x")
    assert storage.join("gs://b/run", "checkpoints", "3") == "gs://b/run/checkpoints/3"
    assert storage.split("gs://b/run/checkpoints/3") == ("gs://b/run/checkpoints", "3")
    assert (storage.is_url("gs://b"), storage.is_url("/tmp/gs:/b"), storage.is_url("C:\\x")) == (True, False, False)


def _validate(cfg):
    return validate_config(cfg, dp_size=1, check_paths=False)


def test_a_scheme_no_backend_opens_is_one_config_error(monkeypatch):
    cases = {
        ("trainer.default_local_dir", "foo://bucket/run"): "checkpoints (orbax) go to local paths or gs:// URLs only",
        ("trainer.default_local_dir", "s3://bucket/run"): "not s3://",
        ("trainer.rollout_data_dir", "foo://bucket/dumps"): "no filesystem back-end opens foo:// URLs",
    }
    for (key, value), why in cases.items():
        cfg = tiny_config("/tmp/unused")
        section, leaf = key.split(".")
        cfg[section][leaf] = value
        with pytest.raises(ConfigError) as err:
            _validate(cfg)
        assert str(err.value).startswith(f"{key}={value!r}: ") and why in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    # gs:// without its back-ends (gcsfs or TensorFlow for epath, google-cloud-storage for orbax)
    monkeypatch.setattr(storage, "_module_available", lambda name: False)
    monkeypatch.setattr(storage, "_epath_backend_installed", lambda name: False)
    with pytest.raises(ConfigError, match=r"default_local_dir='gs://b/run': gs:// needs gcsfs and "
                                          r"google-cloud-storage installed \(pip install gcsfs google-cloud-storage"):
        _validate(tiny_config("gs://b/run"))


def test_bucket_urls_are_kept_in_the_resolved_spec_and_model_paths_must_be_local(gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"gs://{BUCKET}/runs/a"
    spec = resolve_config(tiny_config(url, **{"trainer.rollout_data_dir": url + "/rollouts",
                                              "trainer.validation_data_dir": "val"}), dp_size=1, check_paths=False)
    assert spec.trainer.run_dir == url
    assert spec.trainer.rollout_data_dir == url + "/rollouts"
    assert spec.trainer.validation_data_dir == str(tmp_path / "val")
    assert spec.data.train_files == (f"{url}/data/train.parquet",)
    assert spec.synthetic.train_path == f"{url}/data/train.parquet"
    assert not os.path.exists(tmp_path / "gs:")
    cfg = tiny_config(url, **{"data.tokenizer": f"gs://{BUCKET}/tok"})
    with pytest.raises(ConfigError, match=r"data.tokenizer='gs://test-bucket/tok': the tokenizer must be a local path"):
        validate_config(cfg, dp_size=1)
    cfg = tiny_config(url, **{"trainer.resume_mode": "resume_path",
                              "trainer.resume_from_path": f"gs://{BUCKET}/runs/old/checkpoints/4"})
    with pytest.raises(ConfigError, match=r"resume_from_path='gs://test-bucket/runs/old/checkpoints/4': checkpoint "
                                          "not found"):
        validate_config(cfg, dp_size=1)


def test_checkpoints_on_a_bucket_save_keep_restore_and_clean_up(gcs):
    import jax.numpy as jnp

    directory = f"gs://{BUCKET}/run/checkpoints"
    store = ckpt.CheckpointStore(directory, max_to_keep=2)
    for step in (1, 2, 3):
        store.save(step, {"w": jnp.arange(4.0) * step}, {"blob": b"\x00\x01", "pos": step}, {"global_step": step})
    store.close()
    assert ckpt.list_steps(directory) == [2, 3]  # keep-N deleted step 1's objects
    assert not _objects(gcs, "run/checkpoints/1/")
    assert _objects(gcs, "run/checkpoints/3/state/")
    # a save killed before its commit marker: never taken for a checkpoint, removed at the next start
    for name in _objects(gcs, "run/checkpoints/3/"):
        if name.endswith("commit_success.txt"):
            gcs.store.delete(BUCKET, name)
    point = ckpt.find_resume("auto", f"gs://{BUCKET}/run", None)
    assert (point.directory, point.steps) == (directory, (2,))
    store = ckpt.CheckpointStore(directory)
    store.wait()
    state, data, meta = store.restore(2, ckpt.abstract_like({"w": jnp.zeros(4)}))
    store.close()
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4.0) * 2)
    assert (data, meta) == ({"blob": b"\x00\x01", "pos": 2}, {"global_step": 2})
    assert not _objects(gcs, "run/checkpoints/3/")
    assert ckpt.is_checkpoint(f"gs://{BUCKET}/run") and ckpt.read_checkpoint_meta(directory) == {"global_step": 2}
    # tensorstore wrote the arrays through the fake's HTTP API, not through a local folder
    assert any(method == "POST" and "/upload/storage/v1/b/test-bucket/o" in path for method, path in gcs.store.requests)


def test_a_bucket_that_refuses_writes_fails_the_save_with_one_error(gcs):
    """A save whose uploads the bucket answers 403 (lost write access): the store's next call raises one
    `CheckpointSaveError` naming the step, the folder, the HTTP status and the last committed step."""
    import jax.numpy as jnp

    directory = f"gs://{BUCKET}/run/checkpoints"
    store = ckpt.CheckpointStore(directory)
    store.save(1, {"w": jnp.arange(4.0)}, {"pos": 1}, {"global_step": 1})
    store.wait()
    gcs.store.faults.refuse = lambda name: True  # every write refused: the bucket lost write access
    try:
        with pytest.raises(ckpt.CheckpointSaveError) as caught:
            store.save(2, {"w": jnp.arange(4.0) * 2}, {"pos": 2}, {"global_step": 2})
            store.wait()
    finally:
        gcs.store.faults.refuse = None
        store.close()
    message = str(caught.value)
    assert message.startswith(f"the save of step 2 to {directory} failed: the bucket answered HTTP 403: fake@test.iam "
                              "does not have storage.objects.create access"), message
    assert message.endswith("the last committed checkpoint is step 1"), message
    assert ckpt.list_steps(directory) == [1]


def test_record_dumps_data_and_export_on_a_bucket(gcs, monkeypatch):
    run = f"gs://{BUCKET}/run"
    # the record: a bucket object cannot be appended to, so it is rewritten whole when due
    monkeypatch.setattr(tracking, "URL_FLUSH_S", 3600.0)
    tracker = tracking.Tracking(["console"], run)
    gcs.store.put(BUCKET, "run/metrics.jsonl", b'{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')
    tracker.rewind(1)
    assert _text(gcs, "run/metrics.jsonl") == '{"step": 1}\n'
    tracker.log({"actor/lr": 0.5}, step=2)
    assert _text(gcs, "run/metrics.jsonl") == '{"step": 1}\n'  # not due yet
    tracker.flush()  # what the trainer does before each checkpoint
    assert tracking.parse_records(_text(gcs, "run/metrics.jsonl")) == [{"step": 1}, {"step": 2, "actor/lr": 0.5}]
    tracker.close()

    tracking.dump_jsonl(f"{run}/rollouts/3.jsonl", [{"output": "a"}] * 4)
    tracking.dump_jsonl(f"{run}/rollouts/3.jsonl", [{"output": "b"}] * 2)
    assert _text(gcs, "run/rollouts/3.jsonl") == '{"output": "b"}\n' * 2

    # synthetic data written to the bucket and read back; errors name the URL, not a temporary copy
    from jaxrl_llm.data.sources import DataError, read_rows
    from jaxrl_llm.data.synthetic import write_synthetic

    train, _ = write_synthetic(f"{run}/data", "add", 5, 2)
    rows, refs = read_rows(train)
    assert len(rows) == 5 and str(refs[0]) == f"{run}/data/train.parquet row 0"
    gcs.store.put(BUCKET, "run/data/bad.jsonl", b'{"prompt": "x"}\n{oops\n')
    with pytest.raises(DataError, match=rf"^{run}/data/bad.jsonl line 2: malformed JSON"):
        read_rows(f"{run}/data/bad.jsonl")

    # an HF export uploaded with config.json last; loadable once copied down
    from jaxrl_llm.hf import export_hf, load_hf_folder
    from jaxrl_llm.models import ModelConfig, init_params

    cfg = ModelConfig.tiny("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64)
    params = jax.device_get(init_params(cfg, jax.random.PRNGKey(0)))
    uploads = _record_uploads(gcs)
    export_hf(cfg, params, f"{run}/hf")
    assert uploads[-1] == "run/hf/config.json", uploads  # a reader never sees config.json without weights
    assert sorted(n.rsplit("/", 1)[1] for n in _objects(gcs, "run/hf/")) == [
        "config.json", "generation_config.json", "model.safetensors"]
    with tempfile.TemporaryDirectory() as local:
        for name in _objects(gcs, "run/hf/"):
            with open(os.path.join(local, name.rsplit("/", 1)[1]), "wb") as handle:
                handle.write(gcs.store.get(BUCKET, name)[0])
        cfg2, params2 = load_hf_folder(local)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def _record_uploads(gcs):
    """Names of the objects written from now on, in order."""
    order = []
    original = gcs.store.put

    def put(bucket, name, data, if_generation_match=None):
        order.append(name)
        return original(bucket, name, data, if_generation_match)

    gcs.store.put = put
    return order


def test_tensorboard_and_wandb_on_a_bucket_run_dir(gcs, monkeypatch):
    import sys
    import types

    inits = []
    fake_wandb = types.ModuleType("wandb")
    fake_wandb.init = lambda **kw: inits.append(kw) or types.SimpleNamespace(log=lambda *a, **k: None,
                                                                           finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    for _ in range(2):  # a job, then its resumed continuation
        tracker = tracking.Tracking(["tensorboard", "wandb"], f"gs://{BUCKET}/run")
        tracker.log({"actor/pg_loss": 0.25}, step=1)
        tracker.close()
    events = _objects(gcs, "run/tensorboard/events.out.tfevents.")
    assert events and all(b"actor/pg_loss" in gcs.store.get(BUCKET, e)[0] for e in events)
    run_id = _text(gcs, "run/wandb_run_id").strip()
    # the same W&B run both times; W&B's own files go to its default local folder, not "gs:/..."
    assert [(kw["id"], kw["resume"], kw["dir"]) for kw in inits] == [(run_id, "allow", None)] * 2


def test_bucket_run_dir_written_and_resumed(gcs, tmp_path, monkeypatch):
    """A tiny GRPO run whose run dir is a gs:// URL, killed during its last checkpoint and resumed
    from the bucket, ends exactly where the uninterrupted run ended."""
    monkeypatch.chdir(tmp_path)  # anything written as a local "gs:" folder would land here
    from jaxrl_llm.trainer import Trainer

    url = f"gs://{BUCKET}/runs/tiny"
    cfg = tiny_config(url, **{"trainer.total_training_steps": 3, "trainer.save_freq": 1,
                              "trainer.logger": ["console"], "trainer.rollout_data_dir": f"{url}/rollouts"})
    full = Trainer(cfg)
    full.fit()
    want_state = jax.device_get(full.state())
    want = tracking.parse_records(_text(gcs, "runs/tiny/metrics.jsonl"))
    assert [r["step"] for r in want] == [1, 2, 3]  # written although trainer.logger has no 'jsonl'
    names = set(_objects(gcs, "runs/tiny/"))
    assert {"runs/tiny/data/train.parquet", "runs/tiny/plot.png", "runs/tiny/rollouts/2.jsonl",
            "runs/tiny/checkpoints/3/commit_success.txt"} <= names
    assert os.listdir(tmp_path) == []

    # the kill: step 3's save never committed, step 3's record and dump were written, plus a torn line
    for name in _objects(gcs, "runs/tiny/checkpoints/3/"):
        if name.endswith("commit_success.txt"):
            gcs.store.delete(BUCKET, name)
    record = _text(gcs, "runs/tiny/metrics.jsonl") + '{"step": 4, "actor/'
    gcs.store.put(BUCKET, "runs/tiny/metrics.jsonl", record.encode())
    gcs.store.put(BUCKET, "runs/tiny/rollouts/2.jsonl", _text(gcs, "runs/tiny/rollouts/2.jsonl").encode() * 2)

    # starting over on that run dir by mistake is refused before the model loads
    fresh = tiny_config(url, **{"trainer.total_training_steps": 3, "trainer.resume_mode": "disable"})
    with pytest.raises(ConfigError, match=r"resume_mode='disable': gs://test-bucket/runs/tiny/checkpoints "
                                          r"already holds checkpoints \(steps 1, 2\)"):
        Trainer(fresh)

    resumed = Trainer(cfg)
    resumed.fit()
    assert resumed.global_step == 3
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.device_get(resumed.state()), want_state)
    got = tracking.parse_records(_text(gcs, "runs/tiny/metrics.jsonl"))
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[:2] == want[:2]
    for key, value in want[2].items():
        if not key.startswith(("timing_s/", "perf/")):
            assert got[2][key] == value, key
    assert len(_text(gcs, "runs/tiny/rollouts/2.jsonl").splitlines()) == 8  # 4 prompts x n=2, once
    assert ckpt.list_steps(f"{url}/checkpoints") == [1, 2, 3]
    assert os.listdir(tmp_path) == []

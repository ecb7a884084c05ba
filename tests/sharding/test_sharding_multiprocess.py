"""Multi-host: initialize() decisions, and a real 2-process x 4-device run with gloo collectives."""
import pathlib
import sys

import jax
import numpy as np
import pytest
from sharding_fixtures import GLOBAL_BATCH, loss_grad_metrics, make_batch, make_params

from jaxrl_llm import sharding
from jaxrl_llm.sharding import distributed

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from multiprocess_util import MultiProcessError, run_processes

WORKER = pathlib.Path(__file__).with_name("mp_sharded_sum_worker.py")
CLUSTER_ENV = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
               "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
               "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES"]


@pytest.fixture
def fake_distributed(monkeypatch):
    """Records jax.distributed.initialize calls instead of joining a runtime."""
    for name in CLUSTER_ENV:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_use_gloo_for_cpu_collectives", lambda: calls.append("gloo"))
    return calls


def test_initialize_single_process_is_a_noop(fake_distributed, monkeypatch):
    assert sharding.initialize() is False
    assert sharding.initialize(num_processes=1) is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert sharding.initialize() is False
    # SLURM with one task: still a single process
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node1", "SLURM_NTASKS": "1",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert sharding.initialize() is False
    assert fake_distributed == []


def test_initialize_explicit_and_env(fake_distributed, monkeypatch):
    assert sharding.initialize("10.0.0.1:1234", num_processes=4, process_id=2) is True
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:99")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert sharding.initialize(local_device_ids=[0, 1]) is True
    assert fake_distributed == [
        "gloo", dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2, local_device_ids=None),
        "gloo", dict(coordinator_address="10.0.0.1:99", num_processes=2, process_id=1, local_device_ids=[0, 1]),
    ]


def test_initialize_detects_a_slurm_job(fake_distributed, monkeypatch):
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2",
                       "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)
    assert sharding.detect_cluster() == ("SlurmCluster", 2)
    assert sharding.initialize() is True
    # unset arguments are left to jax's own cluster detection
    assert fake_distributed == ["gloo", dict(coordinator_address=None, num_processes=None,
                                             process_id=None, local_device_ids=None)]


@pytest.mark.parametrize("kwargs, env, message", [
    (dict(num_processes=2, process_id=0), {}, "needs coordinator_address"),
    (dict(coordinator_address="h:1", num_processes=2), {}, "needs process_id"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), {}, r"process_id=2 must be in \[0, 2\)"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' must be an integer"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "number of processes is unknown"),
])
def test_initialize_errors(fake_distributed, monkeypatch, kwargs, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        sharding.initialize(**kwargs)


def test_two_processes_share_one_mesh():
    """2 processes x 4 CPU devices = a global mesh of 8; host-local rows -> global batch -> jitted
    loss and grads with cross-process collectives; both processes agree with one process."""
    results = [r.json for r in run_processes(WORKER, num_processes=2, devices_per_process=4, timeout=180)]
    params, batch = make_params(), make_batch()
    device = jax.devices()[0]
    want = jax.jit(loss_grad_metrics)(jax.device_put(params, device), jax.device_put(batch, device))
    for pid, res in enumerate(results):
        assert (res["process_index"], res["process_count"]) == (pid, 2)
        assert (res["local_devices"], res["global_devices"]) == (4, 8)
    for name in ("data2_tensor4", "fsdp8"):
        first, second = results[0][name], results[1][name]
        # each process loaded its own half of the batch
        assert first["rows"] == [0, GLOBAL_BATCH // 2] and second["rows"] == [GLOBAL_BATCH // 2, GLOBAL_BATCH]
        for key in ("loss", "grad_sq", "x_sum"):
            assert first[key] == second[key], (name, key)
        np.testing.assert_allclose(first["loss"], float(want["loss"]), rtol=1e-5)
        np.testing.assert_allclose(first["grad_sq"], float(want["grad_sq"]), rtol=1e-4)
        np.testing.assert_allclose(first["x_sum"], float(np.sum(batch["x"], dtype=np.float64)), rtol=1e-4)


def test_harness_reports_failures_from_every_process():
    code = "import os, sys\nif os.environ['JAX_PROCESS_ID'] == '1':\n    sys.exit('boom from one')\nprint('{}')\n"
    with pytest.raises(MultiProcessError, match="(?s)process 1 \\(returncode 1\\) stderr ---\nboom from one"):
        run_processes(code, num_processes=2, timeout=30)
    hang = "import time\ntime.sleep(60)\n"
    with pytest.raises(MultiProcessError, match="timed out after 2 s"):
        run_processes(hang, num_processes=2, timeout=2)


SPLIT_TRANSFER = """
import json
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxrl_llm import sharding
from jaxrl_llm.sharding.split import move, transfer
sharding.initialize()
devices = jax.devices()  # process 0: positions 0-3, process 1: 4-7
mesh = lambda positions: Mesh(np.array([devices[i] for i in positions]), ("fsdp",))
whole = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
source = jax.make_array_from_callback(whole.shape, NamedSharding(mesh([0, 1, 4, 5]), P("fsdp")),
                                      lambda index: whole[index])
out = {}
# each process's rows stay on its own devices: copied device to device
local = transfer({"w": source}, mesh([2, 3, 6, 7]))["w"]
# process 1's devices first: its shards need process 0's rows, so the array travels through the hosts
crossed = transfer({"w": source}, mesh([6, 7, 2, 3]))["w"]
back = move(crossed, NamedSharding(mesh([0, 1, 4, 5]), P(None, "fsdp")))  # and a new layout on the way back
for name, array in (("local", local), ("crossed", crossed), ("back", back)):
    out[name] = {"devices": sorted(d.id for d in array.sharding.device_set),
                 "shards": sorted([int(s.data[0, 0]), s.device.id] for s in array.addressable_shards),
                 "equal": all(np.array_equal(np.asarray(s.data), whole[s.index]) for s in array.addressable_shards)}
print(json.dumps(out))
"""


def test_arrays_move_between_meshes_that_span_both_processes():
    """`mesh.rollout_devices` across hosts: jax.device_put refuses meshes of different device sets in
    multi-controller JAX, so `sharding.split.transfer` copies each process's own shards, or, where a
    target shard's rows live on the other process, goes through the hosts; every shard holds its rows."""
    results = run_processes(SPLIT_TRANSFER, num_processes=2, devices_per_process=4, timeout=240)
    for proc in results:
        for name in ("local", "crossed", "back"):
            assert proc.json[name]["equal"], (proc.process_id, name, proc.json[name])
    first, second = (r.json for r in results)
    assert first["local"]["devices"] == second["local"]["devices"] and len(first["local"]["devices"]) == 4
    # mesh([6, 7, 2, 3]): process 0's devices hold rows 4-7 (the second half), which process 1 held
    assert [value for value, _ in first["crossed"]["shards"]] == [32, 48]  # whole[4, 0], whole[6, 0]
    assert [value for value, _ in second["crossed"]["shards"]] == [0, 16]

"""The trainer as 2 JAX processes (4 CPU devices each, gloo) gives the same numbers as one process
with 8 devices, and writes one set of metrics, checkpoints and HF export."""
import json
import os
import pathlib

import numpy as np
from multiprocess_util import run_processes

WORKER = pathlib.Path(__file__).resolve().parent / "mp_trainer_worker.py"


def test_two_processes_equal_one(tmp_path, smollm2_gguf):
    one = run_processes(WORKER, num_processes=1, devices_per_process=8, timeout=600,
                        args=(str(tmp_path / "one"), "2"))
    two = run_processes(WORKER, num_processes=2, devices_per_process=4, timeout=600,
                        args=(str(tmp_path / "two"), "2"))
    assert one[0].json["process_count"] == 1 and [p.json["process_count"] for p in two] == [2, 2]
    want = one[0].json["metrics"]
    assert "critic/score/mean" in want and "actor/pg_loss" in want
    for proc in two:
        got = proc.json["metrics"]
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=k)
    rows = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # only the main process logs
    assert os.path.isdir(tmp_path / "two" / "checkpoints" / "2" / "state")
    assert os.path.isfile(tmp_path / "two" / "hf" / "config.json")


def test_a_split_rollout_mesh_over_both_processes_equals_one_process(tmp_path, smollm2_gguf):
    """`mesh.rollout_devices` with the training and rollout meshes each spanning both processes: the
    weights move to the rollout mesh and the rollouts back across processes (where `jax.device_put`
    alone refuses), and the run's numbers equal the same split on one process's 8 devices."""
    one = run_processes(WORKER, num_processes=1, devices_per_process=8, timeout=600,
                        args=(str(tmp_path / "one"), "2", "split"))
    two = run_processes(WORKER, num_processes=2, devices_per_process=4, timeout=600,
                        args=(str(tmp_path / "two"), "2", "split"))
    want = one[0].json["metrics"]
    assert "actor/pg_loss" in want
    for proc in two:
        got = proc.json["metrics"]
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-4, atol=2e-5, err_msg=k)
    assert "rollout mesh" in two[0].stderr + two[0].stdout  # the run said where it generates

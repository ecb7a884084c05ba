"""Multi-host rewards: scored once on process 0 and broadcast, so two processes whose reward
function would disagree (here: it returns the process index) still get identical scores, and an
error on process 0 is raised on every process instead of leaving the others waiting."""
from multiprocess_util import run_processes

SCRIPT = r'''
import json

import numpy as np

from jaxrl_llm import sharding

sharding.initialize()
import jax

from jaxrl_llm.rewards import RewardManager, UnknownDataSourceError
from jaxrl_llm.rollout.batch import score_responses

calls = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append(solution_str)
    return {"score": float(jax.process_index()) + len(solution_str), "tag": 10.0 * jax.process_index()}


meta = {"data_source": np.array(["s", "s", "s"], object), "ground_truth": np.array(["1", "1", "1"], object),
        "extra_info": np.array([{}, {}, {}], object)}
result = score_responses(RewardManager(compute_score), ["a", "bb", "ccc"], meta,
                         response_lengths=np.array([1, 2, 3]), finished_with_eos=np.array([True] * 3))
try:
    score_responses(RewardManager(), ["x"], {"data_source": np.array(["no/such"], object),
                                             "ground_truth": np.array(["1"], object)},
                    response_lengths=np.array([1]), finished_with_eos=np.array([True]))
    error = None
except UnknownDataSourceError as err:
    error = str(err)
print(json.dumps({"process": jax.process_index(), "scores": result.scores.tolist(),
                  "tag": result.reward_extra_info["tag"].tolist(), "calls": calls, "error": error}))
'''


def test_rewards_are_scored_on_process_zero_and_broadcast():
    results = run_processes(SCRIPT, num_processes=2, devices_per_process=1, timeout=180)
    zero, one = (r.json for r in results)
    assert zero["process"] == 0 and one["process"] == 1
    assert zero["scores"] == one["scores"] == [1.0, 2.0, 3.0]  # process 0's values everywhere
    assert zero["tag"] == one["tag"] == [0.0, 0.0, 0.0]
    assert zero["calls"] == ["a", "bb", "ccc"] and one["calls"] == []  # scored once
    assert zero["error"] == one["error"] and "no/such" in zero["error"]

"""Batch generation and offline evaluation: pass@k / best@k against brute force, scores equal to the
scorers called directly (and veRL main_eval's mean), a resumed generation writes each row once and equals
an uninterrupted one, veRL's generation.yaml / evaluation.yaml keys, bad rows in one line."""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from jaxrl_llm.config import ConfigError, config_from_file, default_config
from jaxrl_llm.config.importers.verl_offline import EVALUATION, GENERATION, offline_config
from jaxrl_llm.data import DataError
from jaxrl_llm.data.synthetic import write_rows, write_synthetic_files
from jaxrl_llm.evaluation import BatchGenerator, best_at_k, evaluate_file, pass_at_k, summarize
from jaxrl_llm.rewards import ScorerSpec, default_compute_score

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scores", [[0, 1, 0, 1, 1], [0.2, 0.9, 0.5, 0.1], [1, 1, 1], [0, 0, 0, 0, 0, 0]])
def test_pass_and_best_at_k_equal_brute_force_over_every_subset(scores):
    n = len(scores)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(scores, k))
        assert pass_at_k(sum(s > 0 for s in scores), n, k) == pytest.approx(
            np.mean([any(s > 0 for s in sub) for sub in subsets]))
        assert best_at_k(scores, k) == pytest.approx(np.mean([max(sub) for sub in subsets]))


def test_summary_per_data_source_and_all():
    summary = summarize(["a", "a", "b"], [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert summary["a"]["mean@4"] == pytest.approx(0.625) and summary["b"]["pass@1"] == pytest.approx(0.25)
    assert summary["all"]["prompts"] == 3 and summary["a"]["pass@4"] == 1.0
    assert set(summary["a"]) == {"prompts", "responses", "mean@4", "pass@1", "best@1", "pass@2", "best@2", "pass@4",
                                 "best@4"}


def _config(tmp_path, **generation):
    cfg = config_from_file(ROOT / "configs" / "tiny.py")
    cfg.trainer.default_local_dir = str(tmp_path / "run")
    cfg.data.max_response_length = 5
    for key, value in generation.items():
        cfg.generation[key] = value
    return cfg


def test_generate_then_evaluate_scores_equal_the_scorers_and_resume_writes_each_row_once(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.parquet"
    write_synthetic_files(str(prompts), str(tmp_path / "unused.parquet"), "add", 6, 2, seed=1)
    full = BatchGenerator(_config(tmp_path, input_path=str(prompts), output_path=str(tmp_path / "full.parquet"),
                                  n_samples=2, batch_size=2))
    out = full.run()
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 6 and all(len(r["responses"]) == 2 for r in rows)
    assert not os.path.exists(out + ".parts")

    # a run killed after its first batch: the relaunch generates the other batches only, and the file is the same
    path = str(tmp_path / "resumed.parquet")
    first = BatchGenerator(_config(tmp_path, input_path=str(prompts), output_path=path, n_samples=2, batch_size=2))
    calls: list[int] = []
    original = BatchGenerator._generate_batch

    def dies_after_one(self, index, start):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(index)
        original(self, index, start)

    monkeypatch.setattr(BatchGenerator, "_generate_batch", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        first.run()
    assert sorted(os.listdir(path + ".parts")) == ["000000.parquet"]
    monkeypatch.setattr(BatchGenerator, "_generate_batch", lambda self, i, s: (calls.append(i), original(self, i, s)))
    second = BatchGenerator(_config(tmp_path, input_path=str(prompts), output_path=path, n_samples=2, batch_size=2))
    second.run()
    assert calls == [0, 1, 2]  # batch 0 once, in the first run
    assert pq.read_table(path).to_pylist() == rows

    # the evaluation's numbers are the scorers' own, and mean@n is veRL main_eval's test_score
    direct = [[float(default_compute_score(r["data_source"], t, r["reward_model"]["ground_truth"], r["extra_info"]))
               for t in r["responses"]] for r in rows]
    summary = evaluate_file(out, ScorerSpec())
    assert summary["synthetic/add"]["mean@2"] == pytest.approx(np.mean([np.mean(d) for d in direct]))
    report = json.loads((tmp_path / "full.eval.json").read_text())
    assert report["metrics"]["synthetic/add"]["prompts"] == 6

    right = [{**r, "responses": [r["reward_model"]["ground_truth"], "nope"]} for r in rows]
    write_rows(right, str(tmp_path / "right.parquet"))
    summary = evaluate_file(str(tmp_path / "right.parquet"), ScorerSpec())["synthetic/add"]
    assert (summary["mean@2"], summary["pass@1"], summary["pass@2"], summary["best@2"]) == (0.5, 0.5, 1.0, 1.0)


@pytest.mark.parametrize("row,message", [
    ({"data_source": "synthetic/add", "reward_model": {"ground_truth": "3"}, "responses": 3},
     "bad.jsonl line 1: column .responses. is not a string or a non-empty list of strings"),
    ({"data_source": "synthetic/add", "reward_model": {}, "responses": ["3"]}, "line 1: column .reward_model."),
    ({"reward_model": {"ground_truth": "3"}, "responses": ["3"]}, "line 1: missing column .data_source."),
])
def test_bad_rows_name_file_and_row(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        evaluate_file(str(path), ScorerSpec())


def test_verl_generation_and_evaluation_keys(tmp_path):
    gen = tmp_path / "generation.yaml"
    gen.write_text("trainer:\n  nnodes: 1\n  n_gpus_per_node: 8\ndata:\n  path: ~/data/test.parquet\n"
                   "  prompt_key: prompt\n  n_samples: 5\n  output_path: ~/out.parquet\n  batch_size: 64\n"
                   "model:\n  path: ~/models/m\n  trust_remote_code: false\nrollout:\n  temperature: 0.8\n"
                   "  top_k: 50\n  top_p: 0.9\n  response_length: 256\n  gpu_memory_utilization: 0.6\n")
    cfg = offline_config(default_config(), ["data.n_samples=7"], str(gen), GENERATION)
    g = cfg.generation
    assert (g.input_path, g.output_path, g.n_samples, g.batch_size) == ("~/data/test.parquet", "~/out.parquet", 7, 64)
    arr = cfg.actor_rollout_ref
    assert (arr.rollout.temperature, arr.rollout.top_k, cfg.data.max_response_length) == (0.8, 50, 256)
    assert arr.model.path == "~/models/m"
    cfg = offline_config(default_config(), ["data.path=x.parquet", "data.response_key=gen"], None, EVALUATION)
    assert (cfg.evaluation.path, cfg.evaluation.response_key) == ("x.parquet", "gen")
    with pytest.raises(ConfigError, match="rollout.n: 4: the samples per prompt are data.n_samples"):
        offline_config(default_config(), ["rollout.n=4"], None, GENERATION)


def test_launch_evaluate_reports_a_bad_row_in_one_line(tmp_path):
    path = tmp_path / "gen.jsonl"
    path.write_text(json.dumps({"data_source": "synthetic/add", "reward_model": {"ground_truth": "3"},
                                "responses": [1, 2]}) + "\n")
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "launch/evaluate.py", "--", f"data.path={path}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("data error: ") and "gen.jsonl line 1" in last


KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from tiny_runs import tiny_config
from jaxrl_llm.evaluation import BatchGenerator

original = BatchGenerator._generate_batch
def dies_after_one(self, index, start):
    original(self, index, start)
    os.kill(os.getpid(), signal.SIGKILL)  # kill -9 right after the first part is written
BatchGenerator._generate_batch = dies_after_one
cfg = tiny_config({run!r}, **{{"generation.input_path": {prompts!r}, "generation.output_path": {out!r},
                              "generation.n_samples": 2, "generation.batch_size": 2, "data.max_response_length": 5}})
BatchGenerator(cfg).run()
"""


def test_a_generation_killed_with_sigkill_resumes_and_writes_each_row_once(tmp_path):
    prompts, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "out.parquet")
    write_synthetic_files(prompts, str(tmp_path / "unused.parquet"), "add", 4, 2, seed=2)
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    code = KILLED_RUN.format(tests=str(ROOT / "tests"), run=str(tmp_path / "run"), prompts=prompts, out=out)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert os.listdir(out + ".parts") == ["000000.parquet"] and not os.path.exists(out)
    first = pq.read_table(out + ".parts/000000.parquet").to_pylist()
    resumed = BatchGenerator(_config(tmp_path, input_path=prompts, output_path=out, n_samples=2, batch_size=2))
    resumed.run()
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 4 and rows[:2] == first  # the killed run's part kept, the rest generated once

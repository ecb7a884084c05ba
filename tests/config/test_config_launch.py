"""launch/train.py --dry_run: --config.x=y overrides and veRL-style a.b=c after --."""
import json
import os
import pathlib
import subprocess
import sys

import yaml
from compile_flags import cpu_devices_flags

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args):
    env = dict(os.environ, XLA_FLAGS=cpu_devices_flags(8), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _split(stdout: str):
    head, _, tail = stdout.partition("\nbatch: ")
    return yaml.safe_load(head), "batch: " + tail


def test_dry_run_with_flag_and_verl_overrides(tmp_path):
    proc = run("--config=configs/tiny.py", "--dry_run", "--eval_only", "--config.actor_rollout_ref.actor.optim.lr=2e-6",
               f"--config.trainer.default_local_dir={tmp_path}", "--",
               "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "num_generations=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
               "actor_rollout_ref.rollout.enforce_eager=True", "trainer.logger=[console,jsonl]")
    assert proc.returncode == 0, proc.stderr
    cfg, summary = _split(proc.stdout)
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["optim"]["lr"] == 2e-6
    assert actor["ppo_micro_batch_size_per_device"] == 1
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 4
    assert cfg["trainer"]["logger"] == ["console", "jsonl"]
    assert cfg["trainer"]["val_only"]  # --eval_only: veRL's trainer.val_only
    assert cfg["data"]["train_files"] == f"{tmp_path}/data/train.parquet"
    assert "actor_rollout_ref.rollout.enforce_eager=True (torch/vLLM/Ray/placement only)" in proc.stderr
    assert "8 prompts x n=4 = 32 sequences per step; data-parallel size 8 -> 4 sequences/device" in summary
    assert "2 mini-batch(es) of 4 prompts = 16 sequences (2/device)" in summary
    assert "micro-batch 1/device -> 2 accumulation step(s)" in summary


def test_dry_run_reports_a_config_error_in_one_line():
    proc = run("--config=configs/tiny.py", "--dry_run", "--", "actor_rollout_ref.actor.ppo_mini_batch=3")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: actor_rollout_ref.actor.ppo_mini_batch: unknown config key; did you mean "
        "actor_rollout_ref.actor.ppo_mini_batch_size, actor_rollout_ref.actor.num_mini_batches, "
        "actor_rollout_ref.actor.ppo_epochs?")
    proc = run("--config=configs/tiny.py", "--dry_run", "--config.actor_rollout_ref.rollout.n=3")
    assert proc.returncode != 0
    assert "config error: actor_rollout_ref.actor.ppo_mini_batch_size=4: 4 prompts x rollout.n=3" in proc.stderr


def test_pasted_verl_line_with_hydra_config_path_and_name(tmp_path, smollm2_gguf):
    # a veRL command line pasted after `--`: Hydra's --config-path / --config-name name the YAML imported
    # (as --import_config would), `dapo` is our naive manager (its overlong shaping is reward_kwargs'),
    # and with no --config the run starts from the default tree, not the quickstart's synthetic task
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "my_grpo.yaml").write_text(yaml.safe_dump({
        "data": {"train_batch_size": 8, "max_prompt_length": 64, "max_response_length": 32},
        "actor_rollout_ref": {"rollout": {"n": 4},
                              "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1}},
        "algorithm": {"adv_estimator": "grpo"}}))
    import pandas as pd

    pd.DataFrame({"prompt": [[{"role": "user", "content": "1+1?"}]] * 16, "data_source": ["openai/gsm8k"] * 16,
                  "reward_model": [{"style": "rule", "ground_truth": "2"}] * 16}).to_parquet(tmp_path / "t.parquet")
    common = ["actor_rollout_ref.model.path=tiny:llama", f"data.tokenizer={smollm2_gguf}",
              f"data.train_files={tmp_path / 't.parquet'}", "data.val_files=null",
              f"trainer.default_local_dir={tmp_path / 'run'}", "reward_model.reward_manager=dapo"]
    for hydra in (["--config-path", str(tmp_path / "config"), "--config-name", "my_grpo"],
                  [f"--config-path={tmp_path / 'config'}", "--config-name=my_grpo.yaml"]):
        proc = run("--dry_run", "--", *hydra, *common)
        assert proc.returncode == 0, proc.stderr
        cfg, _ = _split(proc.stdout)
        assert cfg["data"]["train_batch_size"] == 8 and cfg["actor_rollout_ref"]["rollout"]["n"] == 4
        assert cfg["algorithm"]["adv_estimator"] == "grpo"
        assert cfg["reward_model"]["reward_manager"] == "naive"
        assert cfg["data"]["synthetic"]["task"] is None  # the default tree's, not the quickstart's
    proc = run("--dry_run", "--", "--config-path", str(tmp_path / "config"), "--config-name", "missing", *common)
    assert proc.returncode != 0
    assert f"no file {tmp_path / 'config' / 'missing.yaml'}" in proc.stderr.strip().splitlines()[-1]


def test_pasted_overrides_without_config_start_from_the_default_tree():
    # before: the quickstart's synthetic task stayed underneath and `--dry_run` exited 0
    proc = run("--dry_run", "--", "data.train_files=/nonexistent.parquet")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: actor_rollout_ref.model.path=None")


def test_dry_run_loads_tool_configs_and_reports_a_bad_one_in_one_line(tmp_path):
    # a veRL tool config naming veRL's own class: the dry run loads it as a start would and stops with
    # one `config error:` line (before: it passed --dry_run and the start printed a traceback)
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "config": {},
                                               "tool_schema": {"type": "function", "function": {
                                                   "name": "calc_gsm8k_reward", "description": "d",
                                                   "parameters": {"type": "object", "properties": {}}}}}]}))
    base = ["--config=configs/multiturn_tool.py", "--dry_run", f"--config.trainer.default_local_dir={tmp_path}"]
    assert run(*base).returncode == 0  # the shipped calculator tool loads
    proc = run(*base, f"--config.actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"config error: {tools}: tools[0].class_name: cannot import module 'verl.tools.gsm8k_tool'")
    assert "Traceback" not in proc.stderr


def test_dry_run_of_a_verl_script_prints_the_tree_then_the_missing_file(tmp_path):
    """A veRL example script as it ships: read (not run), resolved on the default tree; a missing data
    file does not hide the resolved tree, it is the last line and the exit status is 1."""
    script = ROOT / "tests" / "config" / "peers" / "verl" / "examples" / "grpo_trainer" / "run_qwen2-7b_math.sh"
    env = dict(os.environ, XLA_FLAGS=cpu_devices_flags(8), JAX_PLATFORMS="cpu",
               HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), f"--import_config={script}",
                           "--dry_run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    cfg, summary = _split(proc.stdout)
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["actor_rollout_ref"]["rollout"]["n"] == 5
    assert "1024 prompts x n=5 = 5120 sequences per step" in summary
    assert proc.stderr.strip().splitlines()[-1] == (
        f"config error: data.train_files='{tmp_path}/data/gsm8k/train.parquet': data file not found (local paths "
        "only; jaxrl_llm never downloads)")
    # the script's placement and engine keys are one warning, with their values
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=2" not in proc.stderr  # veRL's default: no line
    assert "actor_rollout_ref.rollout.name='vllm' (torch/vLLM/Ray/placement only)" in proc.stderr


def test_dry_run_reads_the_first_rows_as_a_start_would(tmp_path):
    """A row the built-in scorers cannot score (no data_source) stops the dry run with the start's own
    `data error:` line naming file and row; a Trinity-style file read through data.* keys passes."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"... #### {i + 1}"}) + "\n"
                            for i in range(8)))
    base = ["--config=configs/tiny.py", "--dry_run", f"--config.trainer.default_local_dir={tmp_path}", "--",
            "data.synthetic.task=null", f"data.train_files={rows}", f"data.val_files={rows}",
            "data.prompt_key=question"]
    proc = run(*base)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"data error: {rows}")
    assert "no ground truth" in proc.stderr.strip().splitlines()[-1]
    ok = run(*base, "data.ground_truth_key=answer", "data.default_data_source=openai/gsm8k")
    assert ok.returncode == 0, ok.stderr

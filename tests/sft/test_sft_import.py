"""veRL's SFT configs (sft_trainer.yaml as the seed document lays it out, sft_trainer_engine.yaml) and
veRL's SFT command-line keys map onto our tree; launch/sft.py runs and reports bad inputs in one line."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from jaxrl_llm.config import ConfigError, default_config
from jaxrl_llm.config.importers.verl_sft import sft_config

ROOT = pathlib.Path(__file__).resolve().parents[2]

SFT_TRAINER_YAML = """
data:
  train_batch_size: 256
  micro_batch_size_per_gpu: 4
  train_files: ~/data/gsm8k/train.parquet
  val_files: ~/data/gsm8k/test.parquet
  prompt_key: extra_info
  response_key: extra_info
  prompt_dict_keys: ['question']
  response_dict_keys: ['answer']
  multiturn:
    enable: false
    messages_key: messages
  max_length: 1024
  truncation: left
  balance_dp_token: False
  chat_template: null
  custom_cls:
    path: null
    name: null
model:
  partial_pretrain: ~/models/gemma-1.1-7b-it
  fsdp_config:
    model_dtype: fp32
    wrap_policy:
      min_num_params: 0
    cpu_offload: False
    offload_params: False
  external_lib: null
  enable_gradient_checkpointing: True
  trust_remote_code: False
  lora_rank: 32
  lora_alpha: 16
  target_modules: all-linear
  use_liger: False
optim:
  optimizer: AdamW
  optimizer_impl: torch.optim
  lr: 1e-4
  betas: [0.9, 0.95]
  weight_decay: 0.01
  lr_warmup_steps_ratio: 0.1
  clip_grad: 1.0
  lr_scheduler: wsd
  override_optimizer_config: null
ulysses_sequence_parallel_size: 1
use_remove_padding: True
trainer:
  default_local_dir: checkpoints/gsm8k-sft/test
  default_hdfs_dir: null
  project_name: gsm8k-sft
  experiment_name: test
  total_epochs: 2
  total_training_steps: null
  logger: ['console']
  seed: 1
  save_freq: 100
  test_freq: 50
  nnodes: 1
  n_gpus_per_node: 8
"""

ENGINE_YAML = """
data:
  train_batch_size: 64
  micro_batch_size_per_gpu: 2
  max_token_len_per_gpu: 4096
  use_dynamic_bsz: True
  train_files: ~/data/multiturn/train.parquet
  messages_key: messages
  tools_key: tools
  enable_thinking_key: enable_thinking
  pad_mode: no_padding
  max_length: 2048
  truncation: error
  ignore_input_ids_mismatch: False
model:
  path: ~/models/Qwen3-0.6B
  use_remove_padding: True
engine:
  strategy: fsdp
  param_offload: False
optim:
  lr: 2e-5
  lr_warmup_steps_ratio: 0.0
  lr_scheduler_type: cosine
  min_lr_ratio: 0.1
checkpoint:
  save_contents: ["model", "optimizer", "extra"]
trainer:
  total_epochs: 1
  resume_mode: auto
"""


def _config(tmp_path, text: str, items=()):
    path = tmp_path / "sft_trainer.yaml"
    path.write_text(text)
    return sft_config(default_config(), list(items), str(path))


def test_the_seed_documents_sft_trainer_yaml_maps(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        cfg = _config(tmp_path, SFT_TRAINER_YAML)
    arr = cfg.actor_rollout_ref
    assert cfg.sft.micro_batch_size_per_device == 4 and cfg.data.train_batch_size == 256
    assert (cfg.data.prompt_key, cfg.sft.response_key) == ("extra_info", "extra_info")
    assert list(cfg.sft.prompt_dict_keys) == ["question"] and list(cfg.sft.response_dict_keys) == ["answer"]
    assert cfg.sft.max_length == 1024 and cfg.data.truncation == "left" and not cfg.sft.multiturn
    assert arr.model.path == "~/models/gemma-1.1-7b-it" and arr.model.param_dtype == "float32"
    assert (arr.model.lora_rank, arr.model.lora_alpha, arr.model.target_modules) == (32, 16, "all-linear")
    assert arr.model.enable_gradient_checkpointing and arr.model.use_remove_padding
    optim = arr.actor.optim
    assert (optim.lr, list(optim.betas), optim.lr_scheduler_type) == (1e-4, [0.9, 0.95], "wsd")
    assert (optim.lr_warmup_steps_ratio, optim.lr_warmup_steps, arr.actor.grad_clip) == (0.1, -1, 1.0)
    assert (cfg.trainer.total_epochs, cfg.trainer.save_freq, cfg.trainer.test_freq) == (2, 100, 50)
    assert "model.fsdp_config.cpu_offload" in caplog.text and "trainer.n_gpus_per_node" in caplog.text


def test_the_engine_layout_reads_conversations(tmp_path):
    cfg = _config(tmp_path, ENGINE_YAML)
    assert cfg.sft.multiturn and cfg.sft.use_dynamic_bsz and cfg.sft.max_token_len_per_device == 4096
    assert cfg.actor_rollout_ref.model.path == "~/models/Qwen3-0.6B"
    assert cfg.actor_rollout_ref.actor.optim.min_lr_ratio == 0.1


def test_command_line_keys_in_verls_sft_names_and_ours(tmp_path):
    cfg = sft_config(default_config(), ["data.micro_batch_size_per_gpu=2", "optim.lr=3e-5",
                                        "model.partial_pretrain=tiny:llama", "sft.max_length=77",
                                        "+data.response_dict_keys=[answer]", "trainer.logger=[console]"], None)
    assert cfg.sft.micro_batch_size_per_device == 2 and cfg.actor_rollout_ref.actor.optim.lr == 3e-5
    assert cfg.actor_rollout_ref.model.path == "tiny:llama" and cfg.sft.max_length == 77
    assert list(cfg.sft.response_dict_keys) == ["answer"]


@pytest.mark.parametrize("text,message", [
    (SFT_TRAINER_YAML.replace("optimizer: AdamW", "optimizer: SGD"), "optim.optimizer: 'SGD'"),
    (SFT_TRAINER_YAML.replace("lr_scheduler: wsd", "lr_scheduler: polynomial"), "optim.lr_scheduler: 'polynomial'"),
    (SFT_TRAINER_YAML.replace("    path: null\n    name: null", "    path: my.py\n    name: D"),
     "data.custom_cls.path: 'my.py'"),
    (SFT_TRAINER_YAML + "\nfoo:\n  bar: 3\n", "foo.bar: 3: no counterpart"),
])
def test_keys_we_cannot_honour_are_refused_naming_file_and_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=r"sft_trainer.yaml: " + message.replace("(", r"\(").replace(")", r"\)")):
        _config(tmp_path, text)


def _launch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}
    return subprocess.run([sys.executable, "launch/sft.py", "--config=configs/sft_tiny.py",
                           f"--config.trainer.default_local_dir={tmp_path}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_launch_dry_run_reads_every_row_and_a_bad_column_is_one_data_error_line(tmp_path):
    ok = _launch(tmp_path / "ok", "--dry_run", "--", "data.micro_batch_size_per_gpu=2", "optim.lr=1e-4")
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert "sft: 16 train / 8 val items" in ok.stdout and "lr: 0.0001" in ok.stdout
    bad = _launch(tmp_path / "bad", "--", "sft.response_key=answer")
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("data error: ") and "train.parquet row 0: missing column 'answer'" in last

"""GRPO end to end on a random tiny Qwen3.5 (4 layers: gated delta-net, gated attention, delta-net, attention) on
CPU, in about a minute:

    python launch/train.py --config=configs/grpo_qwen35_tiny.py

Every Qwen3.5 trait runs in every program of the step (docs/qwen35.md): the rollout engine's pool holds the two
attention layers' KV and each slot holds its delta-net layers' conv window and state (set by the prompt's prefill,
advanced by every decode step); the trainer's forward runs the chunked gated delta rule over packed rows, each
response with its own copy of the prompt. The weights are random, so the reward does not rise in 4 steps: point
`model.path` at a checkpoint folder for a run that learns. The tokenizer is SmolLM2's; the task is synthetic
addition.
"""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    cfg = config_from_file(pathlib.Path(__file__).with_name("tiny.py"))
    cfg.actor_rollout_ref.model.path = "tiny:qwen3_5_text"
    cfg.actor_rollout_ref.model.tiny.num_hidden_layers = 4
    cfg.actor_rollout_ref.rollout.n = 4
    cfg.actor_rollout_ref.rollout.engine = "paged"
    cfg.algorithm.rollout_correction.rollout_is = "token"  # the rollout_corr/* metrics: sampler vs trainer
    cfg.trainer.total_training_steps = 4
    cfg.trainer.experiment_name = "grpo_qwen35_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_qwen35_tiny"
    return cfg

"""GRPO end to end on a random tiny GPT-OSS (8 experts, top-2, 2 layers: one sliding, one full) on CPU,
in about a minute:

    python launch/train.py --config=configs/grpo_gpt_oss_tiny.py

Every GPT-OSS trait runs in every program of the step (docs/gpt_oss.md): attention sinks in the rollout
engine's paged attention and the trainer's, q / k / v / o and expert biases, the top-k softmax router and
the clamped SwiGLU; the actor loss adds the load-balancing loss at `actor.router_aux_loss_coef`. The
weights are random, so the reward does not rise in 4 steps: the smallest released GPT-OSS has 21B
parameters, which a CI machine cannot train; point `model.path` at a checkpoint folder (MXFP4 experts are
dequantised on load) for a run that learns. The tokenizer is SmolLM2's; the task is synthetic addition.
"""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    # the same run, sizes and task as the tiny Qwen3-MoE one
    cfg = config_from_file(pathlib.Path(__file__).with_name("grpo_moe_tiny.py"))
    cfg.actor_rollout_ref.model.path = "tiny:gpt_oss"
    cfg.actor_rollout_ref.actor.router_aux_loss_coef = 0.001  # GPT-OSS's config.json value, applied in training
    cfg.trainer.experiment_name = "grpo_gpt_oss_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_gpt_oss_tiny"
    return cfg

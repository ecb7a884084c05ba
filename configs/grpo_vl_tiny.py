"""GRPO end to end on a random tiny Qwen2.5-VL (`tiny:qwen2_5_vl`: the tiny Qwen2 text model with M-RoPE and a
2-block vision tower) on the synthetic picture task, on CPU in about a minute:

    python launch/train.py --config=configs/grpo_vl_tiny.py

Each step's prompts are 112 x 112 pictures of coloured shapes ("How many red shapes are in the picture?", veRL's
multimodal rows: `<image>` in the prompt, PNG bytes in `images`). The frozen tower runs once per batch over the
prompts' images; the paged engine prefills each prompt once with its image features and M-RoPE positions (its n
samples share the prompt's pages) and each slot decodes at its position plus its M-RoPE delta; the trainer's passes
(old log-probs, the update) read the same features row by row (docs/vision.md). `rollout_corr/max_abs_log_ratio`
compares the sampler's log-probs with the trainer's. The weights are random, so the reward does not rise: point
`model.path` at a Qwen2.5-VL folder for a run that learns. The tokenizer is SmolLM2's with the vision tokens added.
"""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    cfg = config_from_file(pathlib.Path(__file__).with_name("tiny.py"))
    cfg.actor_rollout_ref.model.path = "tiny:qwen2_5_vl"
    cfg.actor_rollout_ref.model.use_remove_padding = False  # rows with images run unpacked (docs/vision.md)
    cfg.data.synthetic.task = "shapes"
    cfg.data.max_prompt_length = 96  # ~47 text tokens (SmolLM2's template) + 16 image tokens (112 x 112 pixels)
    cfg.actor_rollout_ref.rollout.n = 4
    cfg.actor_rollout_ref.rollout.engine = "paged"  # "static" works too
    cfg.algorithm.rollout_correction.rollout_is = "token"  # the rollout_corr/* metrics: sampler vs trainer
    cfg.trainer.total_training_steps = 3
    cfg.trainer.experiment_name = "grpo_vl_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_vl_tiny"
    return cfg

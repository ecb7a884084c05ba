"""GRPO end to end on a random tiny DeepSeek-V3 (2 layers: one dense, one with 8 routed experts in 4 groups and
a shared expert; multi-head latent attention) on CPU, in about a minute:

    python launch/train.py --config=configs/grpo_deepseek_tiny.py

Every DeepSeek-V3 trait runs in every program of the step (docs/deepseek.md): the rollout engine's pool holds
each token's latent and rope key (kv_lora_rank + qk_rope_head_dim numbers a layer) and decodes with the
up-projections absorbed into the query and the output; the trainer's forward expands keys and values per head;
the router scores experts with sigmoids, chooses within the best groups with the correction bias and scales the
weights by routed_scaling_factor. The weights are random, so the reward does not rise in 4 steps: point
`model.path` at a checkpoint folder for a run that learns. The tokenizer is SmolLM2's; the task is synthetic
addition.
"""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    # the same run, sizes and task as the tiny Qwen3-MoE one
    cfg = config_from_file(pathlib.Path(__file__).with_name("grpo_moe_tiny.py"))
    cfg.actor_rollout_ref.model.path = "tiny:deepseek_v3"
    cfg.actor_rollout_ref.model.tiny.num_key_value_heads = 4  # MLA: one per head
    cfg.actor_rollout_ref.actor.router_aux_loss_coef = 0.0  # DeepSeek-V3 balances with its bias, not a loss
    cfg.trainer.experiment_name = "grpo_deepseek_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_deepseek_tiny"
    return cfg

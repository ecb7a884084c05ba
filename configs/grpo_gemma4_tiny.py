"""GRPO end to end on a random tiny Gemma 4 on CPU, in about a minute:

    python launch/train.py --config=configs/grpo_gemma4_tiny.py

Every Gemma 4 trait runs in every program of the step (models/gemma4.py, docs/gemma4.md): sliding and full
layers with heads of their own shapes, k = v on the full layers, the last two layers reading the K / V of
the two before them with a double-wide MLP, per-layer input embeddings, layer scalars and proportional
RoPE. The rollout runs on the paged engine, whose pool holds one set of pages per attention type over the
layers that compute keys / values (the sharing layers have none). The weights are random, so the reward
does not rise in 4 steps; point `model.path` at a Gemma 4 checkpoint folder (gemma-4-E2B-it has the same
traits) for a run that learns. The tokenizer is SmolLM2's; the task is synthetic addition.
"""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    # the same run, sizes and task as the tiny Qwen3-MoE one, on a dense model
    cfg = config_from_file(pathlib.Path(__file__).with_name("grpo_moe_tiny.py"))
    model = cfg.actor_rollout_ref.model
    model.path = "tiny:gemma4_text"
    model.tiny.num_hidden_layers = 4  # the last 2 layers read the K / V of layers 0 and 1
    model.tiny.head_dim = 16  # the full layers' heads: 32
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        model.tiny[key] = None
    cfg.actor_rollout_ref.actor.router_aux_loss_coef = 0.0
    cfg.actor_rollout_ref.rollout.engine = "paged"  # 'auto' would pick the static engine for 8-token responses
    cfg.trainer.experiment_name = "grpo_gemma4_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_gemma4_tiny"
    return cfg

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
from jaxrl_llm.config import default_config, smollm2_gguf_path


def get_config():
    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    model.path = "tiny:gpt_oss"
    model.tiny.num_hidden_layers = 2
    model.tiny.hidden_size = 64
    model.tiny.num_attention_heads = 4
    model.tiny.num_key_value_heads = 2
    model.tiny.num_experts = 8
    model.tiny.num_experts_per_tok = 2
    model.tiny.moe_intermediate_size = 32
    model.tiny.max_position_embeddings = 256
    cfg.data.tokenizer = smollm2_gguf_path()

    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = 32
    cfg.data.synthetic.n_val = 8
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 8
    cfg.data.train_batch_size = 4

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 4
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 4
    actor.router_aux_loss_coef = 0.001  # GPT-OSS's config.json value, applied in training
    actor.router_z_loss_coef = 0.0
    actor.optim.lr = 1e-3
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.experiment_name = "grpo_gpt_oss_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_gpt_oss_tiny"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 4
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    cfg.trainer.logger = ["console", "jsonl"]
    cfg.trainer.export_hf = True
    return cfg

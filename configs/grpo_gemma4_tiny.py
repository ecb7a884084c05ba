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
from jaxrl_llm.config import default_config, smollm2_gguf_path


def get_config():
    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    model.path = "tiny:gemma4_text"
    model.tiny.num_hidden_layers = 4
    model.tiny.hidden_size = 64
    model.tiny.num_attention_heads = 4
    model.tiny.num_key_value_heads = 2
    model.tiny.head_dim = 16
    model.tiny.max_position_embeddings = 256
    cfg.data.tokenizer = smollm2_gguf_path()

    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = 32
    cfg.data.synthetic.n_val = 8
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 8
    cfg.data.train_batch_size = 4

    cfg.algorithm.adv_estimator = "grpo"
    rollout = cfg.actor_rollout_ref.rollout
    rollout.n = 4
    rollout.engine = "paged"  # 'auto' would pick the static engine for 8-token responses
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 4
    actor.optim.lr = 1e-3
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.experiment_name = "grpo_gemma4_tiny"
    cfg.trainer.default_local_dir = "runs/grpo_gemma4_tiny"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 4
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    cfg.trainer.logger = ["console", "jsonl"]
    cfg.trainer.export_hf = True
    return cfg

"""DAPO (Yu et al. 2025) with veRL's DAPO recipe settings: clip-higher (0.2 / 0.28), token-mean
loss, soft overlong punishment, dynamic sampling (filter_groups), no KL (docs/algorithms.md)."""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/dapo-math-17k.parquet"
    cfg.data.val_files = "~/data/aime-2024.parquet"
    cfg.data.train_batch_size = 512
    cfg.data.max_prompt_length = 2048
    cfg.data.max_response_length = 8192
    cfg.data.truncation = "left"
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-7B"

    alg = cfg.algorithm
    alg.adv_estimator = "grpo"
    alg.use_kl_in_reward = False
    alg.kl_ctrl.kl_coef = 0.0
    alg.filter_groups.enable = True
    alg.filter_groups.metric = "seq_reward"
    alg.filter_groups.max_num_gen_batches = 10

    actor = cfg.actor_rollout_ref.actor
    actor.clip_ratio_low = 0.2
    actor.clip_ratio_high = 0.28
    actor.clip_ratio_c = 10.0
    actor.loss_agg_mode = "token-mean"
    actor.use_kl_loss = False
    actor.kl_loss_coef = 0.0
    actor.entropy_coeff = 0.0
    actor.ppo_mini_batch_size = 32
    actor.ppo_micro_batch_size_per_device = 8
    actor.use_dynamic_bsz = True
    actor.ppo_max_token_len_per_device = 2 * (2048 + 8192)
    actor.grad_clip = 1.0
    actor.optim.lr = 1e-6
    actor.optim.lr_warmup_steps = 10
    actor.optim.weight_decay = 0.1

    rollout = cfg.actor_rollout_ref.rollout
    rollout.n = 16
    rollout.temperature = 1.0
    rollout.top_p = 1.0
    rollout.top_k = -1
    rollout.val_kwargs.do_sample = True
    rollout.val_kwargs.temperature = 1.0
    rollout.val_kwargs.top_p = 0.7
    rollout.val_kwargs.n = 1

    overlong = cfg.reward_model.reward_kwargs.overlong_buffer_cfg
    overlong.enable = True
    overlong.len = 4096
    overlong.penalty_factor = 1.0

    cfg.trainer.project_name = "jaxrl_llm_dapo"
    cfg.trainer.experiment_name = "dapo"
    cfg.trainer.total_epochs = 1
    cfg.trainer.save_freq = 10
    cfg.trainer.test_freq = 5
    return cfg

"""REINFORCE++ (Hu 2025) on GSM8K with veRL's example settings: discounted token returns whitened
over the batch, PPO clipping, k2 KL loss (docs/algorithms.md, reinforce_plus_plus)."""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/gsm8k/train.parquet"
    cfg.data.val_files = "~/data/gsm8k/test.parquet"
    cfg.data.train_batch_size = 1024
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = 1024
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-0.5B-Instruct"

    cfg.algorithm.adv_estimator = "reinforce_plus_plus"
    cfg.algorithm.gamma = 1.0
    cfg.algorithm.use_kl_in_reward = False
    actor = cfg.actor_rollout_ref.actor
    actor.optim.lr = 3e-7
    actor.ppo_mini_batch_size = 1024
    actor.ppo_micro_batch_size_per_device = 16
    actor.use_kl_loss = True
    actor.kl_loss_coef = 0.001
    actor.kl_loss_type = "mse"
    cfg.actor_rollout_ref.rollout.n = 8

    cfg.trainer.project_name = "jaxrl_llm_gsm8k"
    cfg.trainer.experiment_name = "reinforce_pp"
    cfg.trainer.total_epochs = 15
    cfg.trainer.save_freq = 20
    cfg.trainer.test_freq = 5
    return cfg

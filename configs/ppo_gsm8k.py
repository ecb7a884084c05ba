"""PPO with a critic and GAE on GSM8K, as veRL's examples/ppo_trainer/run_deepseek7b_llm.sh."""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/gsm8k/train.parquet"
    cfg.data.val_files = "~/data/gsm8k/test.parquet"
    cfg.data.train_batch_size = 1024
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = 512
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-0.5B-Instruct"

    cfg.algorithm.adv_estimator = "gae"
    cfg.algorithm.gamma = 1.0
    cfg.algorithm.lam = 1.0
    cfg.algorithm.use_kl_in_reward = False
    cfg.algorithm.kl_ctrl.kl_coef = 0.001
    actor = cfg.actor_rollout_ref.actor
    actor.optim.lr = 1e-6
    actor.ppo_mini_batch_size = 256
    actor.ppo_micro_batch_size_per_device = 16
    actor.use_kl_loss = False
    cfg.actor_rollout_ref.rollout.n = 1

    critic = cfg.critic
    critic.enable = True
    critic.optim.lr = 1e-5
    critic.ppo_micro_batch_size_per_device = 32
    critic.cliprange_value = 0.5

    cfg.trainer.project_name = "jaxrl_llm_gsm8k"
    cfg.trainer.experiment_name = "ppo"
    cfg.trainer.critic_warmup = 0
    cfg.trainer.total_epochs = 15
    cfg.trainer.save_freq = 20
    cfg.trainer.test_freq = 5
    return cfg

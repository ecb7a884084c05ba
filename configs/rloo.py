"""RLOO (Ahmadian et al. 2024) on GSM8K, as veRL's examples/rloo_trainer: leave-one-out baseline
over n samples, KL in the reward. Set `algorithm.adv_estimator=trl_rloo` (and
`algorithm.use_kl_in_reward=False`) for TRL's RLOOTrainer form (sequence-level score - kl_coef * KL,
TRL's normalisation options under `algorithm.trl_rloo`)."""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/gsm8k/train.parquet"
    cfg.data.val_files = "~/data/gsm8k/test.parquet"
    cfg.data.train_batch_size = 1024
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = 1024
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-0.5B-Instruct"

    cfg.algorithm.adv_estimator = "rloo"
    cfg.algorithm.use_kl_in_reward = True
    cfg.algorithm.kl_penalty = "kl"
    cfg.algorithm.kl_ctrl.kl_coef = 0.001
    actor = cfg.actor_rollout_ref.actor
    actor.optim.lr = 1e-6
    actor.ppo_mini_batch_size = 256
    actor.ppo_micro_batch_size_per_device = 40
    actor.use_kl_loss = False
    cfg.actor_rollout_ref.rollout.n = 5

    cfg.trainer.project_name = "jaxrl_llm_gsm8k"
    cfg.trainer.experiment_name = "rloo"
    cfg.trainer.total_epochs = 15
    cfg.trainer.save_freq = 20
    cfg.trainer.test_freq = 5
    return cfg

"""GRPO on GSM8K, as veRL's examples/grpo_trainer/run_qwen2-7b.sh (sizes for 8 devices).

Data: veRL's gsm8k parquet (examples/data_preprocess/gsm8k.py); model: any local HF folder or
.gguf. Override paths on the command line, e.g.
    python launch/train.py --config=configs/grpo_gsm8k.py \
        --config.actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct
"""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/gsm8k/train.parquet"
    cfg.data.val_files = "~/data/gsm8k/test.parquet"
    cfg.data.train_batch_size = 1024
    cfg.data.max_prompt_length = 512
    cfg.data.max_response_length = 1024
    cfg.data.filter_overlong_prompts = True
    cfg.data.truncation = "error"
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-0.5B-Instruct"

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    actor = cfg.actor_rollout_ref.actor
    actor.optim.lr = 1e-6
    actor.ppo_mini_batch_size = 256
    actor.ppo_micro_batch_size_per_device = 32
    actor.use_kl_loss = True
    actor.kl_loss_coef = 0.001
    actor.kl_loss_type = "low_var_kl"
    actor.entropy_coeff = 0.0
    cfg.actor_rollout_ref.rollout.n = 5
    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_device = 32
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device = 32

    cfg.trainer.project_name = "jaxrl_llm_gsm8k"
    cfg.trainer.experiment_name = "grpo"
    cfg.trainer.total_epochs = 15
    cfg.trainer.save_freq = 20
    cfg.trainer.test_freq = 5
    cfg.trainer.logger = ["console", "jsonl", "tensorboard"]
    return cfg

"""SFT on GSM8K, as veRL's examples/sft/gsm8k/run_qwen_05_sp2.sh (sizes for 8 devices): veRL's gsm8k parquet
(examples/data_preprocess/gsm8k.py) read through its nested columns, prompt = extra_info.question,
response = extra_info.answer (the worked solution ending in `#### <answer>`). Override paths on the
command line, e.g.
    python launch/sft.py --config=configs/sft_gsm8k.py \
        --config.actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct
The checkpoint it writes is a policy for RL: `launch/train.py --config=configs/grpo_gsm8k.py
--config.actor_rollout_ref.model.path=checkpoints/gsm8k-sft/checkpoints`.
"""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/gsm8k/train.parquet"
    cfg.data.val_files = "~/data/gsm8k/test.parquet"
    cfg.data.prompt_key = "extra_info"
    cfg.data.train_batch_size = 256
    cfg.data.truncation = "error"
    cfg.sft.prompt_dict_keys = ["question"]
    cfg.sft.response_key = "extra_info"
    cfg.sft.response_dict_keys = ["answer"]
    cfg.sft.max_length = 1024
    cfg.sft.micro_batch_size_per_device = 4
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-0.5B-Instruct"
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = True
    optim = cfg.actor_rollout_ref.actor.optim
    optim.lr = 1e-4
    optim.betas = [0.9, 0.95]
    optim.weight_decay = 0.01
    optim.lr_warmup_steps = -1
    optim.lr_warmup_steps_ratio = 0.1
    optim.lr_scheduler_type = "cosine"
    cfg.actor_rollout_ref.actor.grad_clip = 1.0
    cfg.trainer.project_name = "gsm8k-sft"
    cfg.trainer.experiment_name = "qwen2.5-0.5b"
    cfg.trainer.default_local_dir = "checkpoints/gsm8k-sft"
    cfg.trainer.total_epochs = 4
    cfg.trainer.save_freq = 100
    cfg.trainer.test_freq = 50
    cfg.trainer.logger = ["console", "jsonl", "tensorboard"]
    return cfg

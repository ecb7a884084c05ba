"""SFT on the tiny model (CI): the synthetic `add` task's rows (written at start, veRL's RL row layout),
trained on their ground truths as responses through veRL's nested-column keys
(sft.response_key=reward_model, sft.response_dict_keys=[ground_truth]). `python launch/sft.py
--config=configs/sft_tiny.py`."""
import pathlib

from jaxrl_llm.config import config_from_file


def get_config():
    cfg = config_from_file(pathlib.Path(__file__).with_name("tiny.py"))
    cfg.sft.response_key = "reward_model"
    cfg.sft.response_dict_keys = ["ground_truth"]
    cfg.sft.max_length = 64
    cfg.sft.micro_batch_size_per_device = 1
    cfg.data.train_batch_size = 8
    cfg.actor_rollout_ref.actor.optim.lr = 1e-3
    cfg.actor_rollout_ref.actor.optim.lr_scheduler_type = "cosine"
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio = 0.1
    cfg.actor_rollout_ref.actor.optim.lr_warmup_steps = -1
    cfg.trainer.experiment_name = "sft_tiny"
    cfg.trainer.default_local_dir = "runs/sft_tiny"
    cfg.trainer.total_training_steps = 4
    cfg.trainer.test_freq = 2
    cfg.trainer.save_freq = 2
    return cfg

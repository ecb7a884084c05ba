"""GRPO on Geometry3K with Qwen2.5-VL-3B-Instruct, veRL's geometry recipe (examples/grpo_trainer/
run_qwen2_5_vl-7b.sh's settings; sizes for 8 devices).

Data: `python scripts/prepare_geo3k.py --input <local copy of hiyouga/geometry3k> --split train --output
~/data/geo3k/train.parquet` (and `--split test`): veRL's rows, each problem's `<image>` and its picture, scored
by the geo3k scorer (0.9 x the boxed answer + 0.1 x the format). Model: a local Qwen2.5-VL folder; its tower
trains with the text model, as veRL's default (actor.freeze_vision_tower=False; True keeps it frozen and each
row's features computed once per batch: docs/vision.md). Override paths on the command line, e.g.
    python launch/train.py --config=configs/grpo_geo3k_vl.py \
        --config.actor_rollout_ref.model.path=/models/Qwen2.5-VL-3B-Instruct
"""
from jaxrl_llm.config import default_config


def get_config():
    cfg = default_config()
    cfg.data.train_files = "~/data/geo3k/train.parquet"
    cfg.data.val_files = "~/data/geo3k/test.parquet"
    cfg.data.image_key = "images"
    cfg.data.train_batch_size = 512
    cfg.data.max_prompt_length = 1024  # the picture's image tokens included
    cfg.data.max_response_length = 2048
    cfg.data.filter_overlong_prompts = True
    cfg.data.truncation = "error"
    cfg.actor_rollout_ref.model.path = "~/models/Qwen2.5-VL-3B-Instruct"
    cfg.actor_rollout_ref.model.use_remove_padding = True
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = True

    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.use_kl_in_reward = False
    actor = cfg.actor_rollout_ref.actor
    actor.optim.lr = 1e-6
    actor.ppo_mini_batch_size = 128
    # veRL's micro-batches (per GPU); on a TPU v5p-8 (4 chips) the trained tower's passes fit at 5: the memory plan
    # (`--plan --topology=v5p-8`) gives update_actor 82.4 GB and ref_log_prob 74.1 GB per chip there (95 GB), with
    # ...ppo_micro_batch_size_per_device=5 ...ref.log_prob_micro_batch_size_per_device=5 (docs/vision.md)
    actor.ppo_micro_batch_size_per_device = 10
    actor.use_kl_loss = True
    actor.kl_loss_coef = 0.01
    actor.kl_loss_type = "low_var_kl"
    actor.entropy_coeff = 0.0
    actor.freeze_vision_tower = False  # veRL's default: the tower trains too
    cfg.actor_rollout_ref.rollout.n = 5
    cfg.actor_rollout_ref.rollout.gpu_memory_utilization = 0.6
    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_device = 20
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_device = 20

    cfg.trainer.project_name = "jaxrl_llm_geo3k"
    cfg.trainer.experiment_name = "qwen2_5_vl_3b_grpo"
    cfg.trainer.total_epochs = 15
    cfg.trainer.save_freq = 20
    cfg.trainer.test_freq = 5
    cfg.trainer.logger = ["console", "jsonl", "tensorboard"]
    return cfg

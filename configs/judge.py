"""A generative reward model on the 2-core CPU: SmolLM2-135M-Instruct judged by SmolLM2-135M-Instruct.

The judge reads each response and answers a yes / no question about a checkable property: is the
response just a number? (the add task's "Answer with only the number."). Its verdict, parsed by the
built-in `yes_no` parser, is the whole reward (combine=judge); GRPO raises it as the policy drops
"3 + 4 = 7" and "The answer is 7." for a bare "7". The rule check of the same property
(configs/rewards/bare_number.py) runs beside it and is never trained on: `reward/judge_rule_agreement`
is how often the judge's verdict matches it, and `critic/score/mean` is the judge's reward.

    python launch/train.py --config=configs/judge.py
"""
import os

from jaxrl_llm.config import default_config, smollm2_gguf_path

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = smollm2_gguf_path()  # None (a clear error) if not installed

    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = 256
    cfg.data.synthetic.n_val = 32
    cfg.data.max_prompt_length = 96
    # 4 tokens: a bare answer and its end of turn fit; room for "76\n\nThis is a number" (which talks a
    # 135M judge into "Yes" and took over a run with 8 tokens within 8 steps) does not
    cfg.data.max_response_length = 4
    cfg.data.train_batch_size = 8
    cfg.custom_reward_function.path = os.path.join(HERE, "rewards", "bare_number.py")  # the rule check

    rm = cfg.reward_model
    rm.enable = True
    rm.style = "generative"
    rm.model.path = smollm2_gguf_path()  # the policy's own initial weights judge it
    # a phrasing this 135M judge answers well: on SmolLM2's own add answers its yes / no matched the
    # rule on 94% of them (a quoted text, then the question)
    rm.judge.template = '"{response}"\nIs that a number? Answer yes or no.'
    rm.judge.parser = "yes_no"
    rm.judge.max_new_tokens = 4
    # judge + rule: a 135M judge alone is talked into "yes" within 8 steps (the policy answered
    # "SmolLM" to every question: rule agreement fell from 0.89 to 0.0; with 8 response tokens
    # "76\n\nThis is a number"), so the rule check anchors it (docs/algorithms.md, generative rewards)
    rm.judge.combine = "sum"
    rm.judge.rule_weight = 1.0
    rm.judge.judge_weight = 1.0

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = False
    cfg.actor_rollout_ref.rollout.n = 4
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 8
    actor.use_kl_loss = False
    actor.optim.lr = 5e-5
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.experiment_name = "judge"
    cfg.trainer.default_local_dir = "runs/judge"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 12
    cfg.trainer.test_freq = 6
    cfg.trainer.save_freq = -1
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 4
    cfg.trainer.logger = ["console", "jsonl"]
    cfg.trainer.rollout_data_dir = "runs/judge/rollouts"  # each response beside the judge's verdict
    return cfg

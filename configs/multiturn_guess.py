"""Multi-turn environment: GRPO teaches SmolLM2-135M-Instruct to play guess-the-number
(GuessNumberEnv: "higher" / "lower" replies, 1..10, up to 4 guesses) on 2 CPU cores.

    python launch/train.py --config=configs/multiturn_guess.py

Rows come from data.synthetic.task=guess (the target in extra_info.interaction_kwargs); the
environment (configs/agents/guess_number.yaml) opens the game and answers each guess; the reward
is the environment's (1 when found, else 0; the synthetic scorer gives 0 for this task). The
user turns are attended but not trained (docs/agents.md).
"""
import os

from jaxrl_llm.config import default_config, smollm2_gguf_path

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = smollm2_gguf_path()

    cfg.data.synthetic.task = "guess"
    cfg.data.synthetic.difficulty = 1  # targets 1..10, the range in guess_number.yaml
    cfg.data.synthetic.n_train = 256
    cfg.data.synthetic.n_val = 10
    cfg.data.max_prompt_length = 96
    cfg.data.max_response_length = 96
    cfg.data.train_batch_size = 4

    rollout = cfg.actor_rollout_ref.rollout
    rollout.n = 4
    # streamed through the continuous-batching engine: no rounds, a turn's slot is refilled at once
    # (docs/agents.md); the static sampler would make every trajectory wait for the round's longest turn
    rollout.engine = "paged"
    mt = rollout.multi_turn
    mt.enable = True
    mt.interaction_config_path = os.path.join(HERE, "agents", "guess_number.yaml")
    mt.max_assistant_turns = 4

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.model.enable_gradient_checkpointing = False
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 4
    # micro-batches packed to a token budget (about 4 full rows): bounds the update's memory (16 full rows at
    # once need ~17 GB of temporaries) and divides any mesh, unlike a fixed micro-batch size
    actor.use_dynamic_bsz = True
    actor.ppo_max_token_len_per_device = 1536
    actor.use_kl_loss = False
    actor.optim.lr = 5e-5
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.project_name = "jaxrl_llm"
    cfg.trainer.experiment_name = "multiturn_guess"
    cfg.trainer.default_local_dir = "runs/multiturn_guess"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 16
    cfg.trainer.test_freq = 4
    cfg.trainer.save_freq = -1
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 4
    cfg.trainer.logger = ["console", "jsonl"]
    return cfg

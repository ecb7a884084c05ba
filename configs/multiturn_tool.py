"""Multi-turn tool use: GRPO teaches SmolLM2-135M-Instruct to call a calculator for the
multiplications it gets wrong alone (2-digit x 2-digit), on 2 CPU cores.

    python launch/train.py --config=configs/multiturn_tool.py

Each prompt (data.synthetic.task=multiply) is one worked example (a hermes <tool_call> to the
calculator, the tool's reply, the bare answer) and the question; the tool instructions and schema
go into the system turn (SmolLM2's template does not render tools itself). A rollout is up to two
model turns: the call, then the answer after the tool's reply. The scorer checks the FIRST number
of the last assistant message (answer_format=first); tool tokens are attended but not trained
(docs/agents.md).
"""
import os

from jaxrl_llm.config import default_config, smollm2_gguf_path

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    cfg = default_config()
    cfg.actor_rollout_ref.model.path = smollm2_gguf_path()

    cfg.data.synthetic.task = "multiply"
    cfg.data.synthetic.difficulty = 2
    cfg.data.synthetic.answer_format = "first"
    cfg.data.synthetic.n_train = 256
    cfg.data.synthetic.n_val = 16
    cfg.data.max_prompt_length = 320
    cfg.data.max_response_length = 64
    cfg.data.train_batch_size = 4

    rollout = cfg.actor_rollout_ref.rollout
    rollout.n = 4
    # streamed through the continuous-batching engine: no rounds, a turn's slot is refilled at once
    # (docs/agents.md); the static sampler would make every trajectory wait for the round's longest turn
    rollout.engine = "paged"
    mt = rollout.multi_turn
    mt.enable = True
    mt.tool_config_path = os.path.join(HERE, "agents", "calculator_tools.yaml")
    mt.max_assistant_turns = 2

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
    cfg.trainer.experiment_name = "multiturn_tool"
    cfg.trainer.default_local_dir = "runs/multiturn_tool"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 10
    cfg.trainer.test_freq = 5
    cfg.trainer.save_freq = -1
    cfg.trainer.val_before_train = True
    cfg.trainer.log_val_generations = 4
    cfg.trainer.logger = ["console", "jsonl"]
    return cfg

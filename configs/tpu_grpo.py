"""GRPO at the published shapes of Qwen2-0.5B / 1.5B / 7B and Qwen3-30B-A3B, with random weights
(`tiny:<arch>` at those dimensions, so no checkpoint is needed), sized as a TPU user runs them:
bf16 compute, fp32 master weights, every micro-batch 'auto'. The argument after ':' picks the shape:

    JAX_PLATFORMS=cpu python launch/train.py --config=configs/tpu_grpo.py:0.5b --plan --topology=v5e-8
    JAX_PLATFORMS=cpu python launch/train.py --config=configs/tpu_grpo.py:30b-a3b --plan --topology=v5p-32

The workloads are the ones docs/performance.md plans: 0.5b samples 8 answers to each of 32 prompts
of up to 1k tokens, up to 2k tokens each; the larger shapes 8 x 64 prompts, 4k-token answers and the
KL loss (a reference pass). `--plan` compiles every program for the slice on any x86 host (libtpu:
`pip install -e ".[tpu-plan]"`); on the slice itself the same command without `--plan` trains (the
synthetic addition task, SmolLM2's tokenizer). Point `actor_rollout_ref.model.path` at a real
checkpoint of the same family to train it instead.
"""
from jaxrl_llm.config import default_config, smollm2_gguf_path

QWEN2 = dict(arch="qwen2", vocab_size=151936, max_position_embeddings=32768)
SHAPES = {
    "0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, in every layer; heads of 128 over a 2048 hidden size
    "30b-a3b": dict(arch="qwen3_moe", vocab_size=151936, max_position_embeddings=40960, hidden_size=2048,
                    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                    tie_word_embeddings=False),
}
# shape -> (prompts per step, response tokens, KL loss)
WORKLOADS = {"0.5b": (32, 2048, False), "1.5b": (64, 4096, True), "7b": (64, 4096, True), "30b-a3b": (64, 4096, True)}


def get_config(shape: str = "0.5b"):
    if shape not in SHAPES:
        raise ValueError(f"configs/tpu_grpo.py:{shape}: expected one of {', '.join(SHAPES)}")
    cfg = default_config()
    model = cfg.actor_rollout_ref.model
    dims = dict(SHAPES[shape])
    model.path = f"tiny:{dims.pop('arch')}"
    for key, value in dims.items():
        model.tiny[key] = value
    model.dtype = "bfloat16"
    model.param_dtype = "float32"
    cfg.data.tokenizer = smollm2_gguf_path()  # token ids of the synthetic task; the vocabulary is the shape's

    prompts, response, kl_loss = WORKLOADS[shape]
    cfg.data.synthetic.task = "add"
    cfg.data.synthetic.n_train = 4 * prompts
    cfg.data.synthetic.n_val = 8
    cfg.data.max_prompt_length = 1024
    cfg.data.max_response_length = response
    cfg.data.train_batch_size = prompts

    cfg.algorithm.adv_estimator = "grpo"
    cfg.actor_rollout_ref.rollout.n = 8
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = prompts
    actor.ppo_micro_batch_size_per_device = "auto"
    actor.use_kl_loss = kl_loss
    cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_device = "auto"
    if shape == "30b-a3b":
        cfg.mesh.expert = -1  # the experts split over every chip, the other weights fsdp
        cfg.mesh.fsdp = 1

    cfg.trainer.experiment_name = f"tpu_grpo_{shape}"
    cfg.trainer.default_local_dir = f"runs/tpu_grpo_{shape}"
    cfg.trainer.total_epochs = 1
    cfg.trainer.total_training_steps = 4
    cfg.trainer.val_before_train = False
    cfg.trainer.test_freq = -1
    cfg.trainer.save_freq = -1
    return cfg

"""A tiny mixture-of-experts policy and one experience batch for actor-update tests (shared by
tests/trainer/test_moe_update.py and tests/sharding/test_expert_parallel.py)."""
import jax.numpy as jnp
import numpy as np
from tiny_models import random_rollout

from jaxrl_llm.config import ActorSpec
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.roles.experience import Experience

CFG = ModelConfig.tiny("qwen2_moe", vocab_size=64, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, moe_block_rows=8)
# the same with a dense MLP layer between two sparse ones (Qwen2-MoE's mlp_only_layers)
MIXED_CFG = ModelConfig.tiny("qwen2_moe", vocab_size=64, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, moe_block_rows=8, num_hidden_layers=3,
                             mlp_only_layers=(1,))
# GPT-OSS: attention sinks, biases on q / k / v / o, the router and the experts, the top-k softmax router and a
# SwiGLU clamp these scales reach
GPT_OSS_CFG = ModelConfig.tiny("gpt_oss", vocab_size=64, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                               intermediate_size=16, moe_block_rows=8, swiglu_limit=0.3)
# DeepSeek-V3: latent attention (a q bottleneck), a dense first layer, 8 experts in 4 groups of which 2 open, a
# shared expert, sigmoid routing with a correction bias (drawn by `with_random_biases`)
DEEPSEEK_CFG = ModelConfig.tiny("deepseek_v3", vocab_size=64, hidden_size=32, head_dim=8, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16, moe_block_rows=8, num_hidden_layers=3)
N, P, R = 8, 5, 6
SETTINGS = ActorSpec(loss_mode="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.28,
                     clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0,
                     kl_loss_type="low_var_kl", temperature=1.0, compute_dtype="float32", remat="none",
                     loss_scale_factor=None, loss_kwargs=(), ppo_epochs=1, shuffle=False,
                     router_aux_loss_coef=0.01, router_z_loss_coef=0.001)


def near_tied(params: dict, eps: float = 1e-6) -> dict:
    """Every expert's router column = one shared column + eps x its own: the top-k is decided by
    differences at the level of fp32 rounding, which the decode step and the full-sequence forward
    (another matmul summation order) do not share (routing replay tests)."""
    router = params["layers"]["moe"]["router"]["kernel"]
    moe = {**params["layers"]["moe"], "router": {"kernel": router[:, :, :1] + eps * router}}
    return {**params, "layers": {**params["layers"], "moe": moe}}


def with_random_biases(params: dict, seed: int = 0, scale: float = 0.3) -> dict:
    """`params` with every bias and attention sink drawn normal(0, scale): fresh ones are zeros, which would
    leave their paths untested."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [jax.random.normal(k, x.shape, x.dtype) * scale if p[-1].key in ("bias", "sinks", "score_bias") else x
             for (p, x), k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, drawn)


def moe_batch(seed: int = 0) -> Experience:
    rng = np.random.default_rng(seed)
    ids, mask, resp_mask, _, _ = random_rollout(rng, N, P, R)
    return Experience(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.asarray(mask),
        response_mask=jnp.asarray(resp_mask, jnp.float32),
        old_log_probs=jnp.asarray(rng.normal(-3.0, 0.3, (N, R)), jnp.float32),
        advantages=jnp.asarray(rng.normal(size=(N, R)), jnp.float32),
        returns=jnp.zeros((N, R), jnp.float32))

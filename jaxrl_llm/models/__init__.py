"""Decoder families (Llama / Qwen2 / Qwen3 / Mistral; MoE: Qwen3-MoE / Qwen2-MoE / Mixtral), KV cache,
value and score heads.

Everything other components call is re-exported here; see `param_init.py` for the params layout,
`decoder.py` for the one decoder every path runs and `cache.py` for the KV-cache calling convention.
"""
from jaxrl_llm.models.cache import init_cache
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, DTYPES, as_jnp_dtype, dtype_name
from jaxrl_llm.models.families import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError
from jaxrl_llm.models.greedy import greedy_generate
from jaxrl_llm.models.model import (
    compute_logits,
    forward_hidden,
    forward_hidden_moe,
    forward_hidden_routed,
    last_valid_index,
    lm_head_weight,
    logits_from_hidden,
    score_from_hidden,
    value_from_hidden,
)
from jaxrl_llm.models.param_init import HEADS, init_head_params, init_params, param_logical_axes
from jaxrl_llm.models.rope_freqs import rope_inv_freq

__all__ = [
    "COMPUTE_DTYPES", "DTYPES", "HEADS", "SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedArchitectureError",
    "as_jnp_dtype", "compute_logits", "dtype_name", "forward_hidden", "forward_hidden_moe", "forward_hidden_routed",
    "greedy_generate", "init_cache",
    "init_head_params", "init_params", "last_valid_index", "lm_head_weight", "logits_from_hidden", "param_logical_axes",
    "rope_inv_freq", "score_from_hidden", "value_from_hidden",
]

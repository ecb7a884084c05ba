"""Flax decoder family (Llama / Qwen2 / Qwen3 / Mistral), KV cache, value and score heads.

Everything other components call is re-exported here; see `model.py` for the params layout and
`cache.py` for the KV-cache calling convention.
"""
from jaxrl_llm.models.cache import init_cache
from jaxrl_llm.models.greedy import greedy_generate
from jaxrl_llm.models.dtypes import COMPUTE_DTYPES, DTYPES, as_jnp_dtype, dtype_name
from jaxrl_llm.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedArchitectureError,
    rope_inv_freq,
)
from jaxrl_llm.models.model import (
    HEADS,
    compute_logits,
    forward_hidden,
    init_head_params,
    init_params,
    last_valid_index,
    lm_head_weight,
    logits_from_hidden,
    param_logical_axes,
    score_from_hidden,
    value_from_hidden,
)

__all__ = [
    "COMPUTE_DTYPES", "DTYPES", "HEADS", "SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedArchitectureError",
    "as_jnp_dtype", "compute_logits", "dtype_name", "forward_hidden", "greedy_generate", "init_cache",
    "init_head_params", "init_params", "last_valid_index", "lm_head_weight", "logits_from_hidden", "param_logical_axes",
    "rope_inv_freq", "score_from_hidden", "value_from_hidden",
]

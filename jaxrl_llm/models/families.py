"""The decoder families ModelConfig describes: each transformers architecture's model_type and traits, the
architectures, activations, RoPE types and kernels it supports, and the error for the others. Kept apart from
models/config.py (the dataclass) and models/config_hf.py (config.json in and out), which both read it."""
from __future__ import annotations

from typing import Any

# HF `architectures[0]` -> (model_type, family traits)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"prefix": "Llama", "attention_bias": False, "qk_norm": False},
    "mistral": {"prefix": "Mistral", "attention_bias": False, "qk_norm": False},
    "qwen2": {"prefix": "Qwen2", "attention_bias": True, "qk_norm": False},
    "qwen3": {"prefix": "Qwen3", "attention_bias": False, "qk_norm": True},
    # mixture-of-experts families (models/moe.py): every layer's MLP is a routed set of experts
    "qwen3_moe": {"prefix": "Qwen3Moe", "attention_bias": False, "qk_norm": True, "moe": True},
    "qwen2_moe": {"prefix": "Qwen2Moe", "attention_bias": True, "qk_norm": False, "moe": True},
    "mixtral": {"prefix": "Mixtral", "attention_bias": False, "qk_norm": False, "moe": True},
    # Gemma (models/decoder.py): GeGLU, embeddings x sqrt(hidden), (1 + w) norms (norm_offset),
    # norms before and after attention and MLP, query_pre_attn_scalar, per-layer sliding windows;
    # Gemma 2 soft-caps attention and final logits, Gemma 3 has QK-norm and a RoPE base of its own for local layers
    "gemma2": {"prefix": "Gemma2", "attention_bias": False, "qk_norm": False, "gemma": True},
    "gemma3_text": {"prefix": "Gemma3", "attention_bias": False, "qk_norm": True, "gemma": True},
    # Gemma 4 (models/gemma4.py, config fields: models/config_gemma4.py): plain-w norms, unscaled scores of
    # RMS-normed q / k, unscaled-RMS-normed values, full layers with heads of their own shape, KV shared by the
    # last layers, per-layer input embeddings, a learned scalar per layer
    "gemma4_text": {"prefix": "Gemma4", "attention_bias": False, "qk_norm": True, "gemma": True},
    # GPT-OSS: learned attention sinks, biases on q / k / v / o, alternating sliding (128) / full layers,
    # routed experts with biases, a biased router whose softmax runs over the chosen experts' logits, and
    # the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`)
    "gpt_oss": {"prefix": "GptOss", "attention_bias": True, "qk_norm": False, "moe": True},
    # DeepSeek-V3 (models/config_deepseek.py): multi-head latent attention (models/mla.py), a sigmoid router with a
    # correction bias choosing within the best groups of experts, shared experts, dense first layers
    "deepseek_v3": {"prefix": "DeepseekV3", "attention_bias": False, "qk_norm": False, "moe": True},
    # DeepSeek-V2 / V2-Lite: the same attention; softmax routing, greedy or limited to the groups of the best experts
    "deepseek_v2": {"prefix": "DeepseekV2", "attention_bias": False, "qk_norm": False, "moe": True},
    # Qwen3.5 (models/config_qwen35.py, models/hybrid.py): gated delta-net linear-attention layers between gated
    # full-attention layers (an output gate, QK-norm, RoPE on a quarter of each head), (1 + w) norms
    "qwen3_5_text": {"prefix": "Qwen3_5", "attention_bias": False, "qk_norm": True},
    # Qwen3.5-MoE: the same layers with Qwen2-MoE's MLP (softmax top-k renormalised, a sigmoid-gated shared expert)
    "qwen3_5_moe_text": {"prefix": "Qwen3_5Moe", "attention_bias": False, "qk_norm": True, "moe": True},
}
GEMMA_FAMILIES: tuple[str, ...] = tuple(k for k, f in FAMILIES.items() if f.get("gemma"))
QWEN35_FAMILIES: tuple[str, ...] = ("qwen3_5_text", "qwen3_5_moe_text")  # the hybrid decoder (models/hybrid.py)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
MOE_FAMILIES: tuple[str, ...] = tuple(k for k, f in FAMILIES.items() if f.get("moe"))
# the grouped matmul of models/moe_experts.py: "blocked" (ours, any backend), "ragged_dot" (jax.lax.ragged_dot:
# XLA's native grouped matmul on TPU; a dense tokens x experts decomposition on CPU / GPU), "auto" (ragged_dot
# on TPU, blocked elsewhere)
MOE_KERNELS: tuple[str, ...] = ("auto", "blocked", "ragged_dot")
# how attention runs on a mesh whose 'context' axis splits the tokens (models/context_parallel.py)
CONTEXT_ATTENTION: tuple[str, ...] = ("ring", "all_to_all", "gather")
HEAD_SUFFIXES = ("ForCausalLM", "ForSequenceClassification")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    f["prefix"] + s for f in FAMILIES.values() for s in HEAD_SUFFIXES
) + ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
     "Qwen3_5MoeForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
     "Qwen3VLForConditionalGeneration")  # their text towers (models/config_hf.py `_text_tower`)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# rope types whose scaling is relative to the pre-training context (HF moves it into the rope parameters)
ORIGINAL_CONTEXT_ROPE_TYPES = ("llama3", "yarn")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture / model_type is not one this package implements."""


# Relatives of a supported family that need more than it has: said by name, with what is missing
_NOT_YET = {
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (the lightning indexer, its own key cache and the "
                              "top-k token selection per query) is not implemented; DeepSeek-V3's dense latent "
                              "attention is (docs/deepseek.md)",
    "GlmMoeDsaForCausalLM": "GLM-MoE-DSA's DeepSeek sparse attention (indexer and top-k selection) is not implemented",
    "DeepseekV4ForCausalLM": "DeepSeek-V4's compressed sparse attention, hyper-connections and hash routing are not "
                             "implemented",
}


def arch_to_model_type(arch: str) -> str:
    for model_type, fam in FAMILIES.items():
        if arch in (fam["prefix"] + s for s in HEAD_SUFFIXES):
            return model_type
    why = f" ({_NOT_YET[arch]})" if arch in _NOT_YET else ""
    raise UnsupportedArchitectureError(
        f"unsupported architecture {arch!r}{why}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )

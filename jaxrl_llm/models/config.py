"""ModelConfig: the one description of a decoder (Llama 1/2/3, Mistral, Qwen2, Qwen3 and the
mixture-of-experts families Qwen3-MoE, Qwen2-MoE, Mixtral).

Built from a transformers `config.json` dict (`from_hf_config`) and written back (`to_hf_config`)
so that `transformers` reads it with the same numbers. Frozen and hashable so it can be a static
argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrl_llm.models.config_deepseek import DEEPSEEK_FAMILIES, check_deepseek, deepseek_fields, deepseek_hf_fields
from jaxrl_llm.models.config_gemma4 import gemma4_fields, gemma4_hf_fields
from jaxrl_llm.models.config_qwen35 import check_qwen35, qwen35_fields, qwen35_hf_fields

# HF `architectures[0]` -> (model_type, family traits)
_FAMILIES: dict[str, dict[str, Any]] = {
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
GEMMA_FAMILIES: tuple[str, ...] = tuple(k for k, f in _FAMILIES.items() if f.get("gemma"))
QWEN35_FAMILIES: tuple[str, ...] = ("qwen3_5_text", "qwen3_5_moe_text")  # the hybrid decoder (models/hybrid.py)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
MOE_FAMILIES: tuple[str, ...] = tuple(k for k, f in _FAMILIES.items() if f.get("moe"))
# the grouped matmul of models/moe.py: "blocked" (ours, any backend), "ragged_dot" (jax.lax.ragged_dot:
# XLA's native grouped matmul on TPU; a dense tokens x experts decomposition on CPU / GPU), "auto" (ragged_dot
# on TPU, blocked elsewhere)
MOE_KERNELS: tuple[str, ...] = ("auto", "blocked", "ragged_dot")
# how attention runs on a mesh whose 'context' axis splits the tokens (models/context_parallel.py)
CONTEXT_ATTENTION: tuple[str, ...] = ("ring", "all_to_all", "gather")
_HEAD_SUFFIXES = ("ForCausalLM", "ForSequenceClassification")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    f["prefix"] + s for f in _FAMILIES.values() for s in _HEAD_SUFFIXES
) + ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
     "Qwen3_5MoeForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
     "Qwen3VLForConditionalGeneration")  # their text towers (`_text_tower`)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
# rope types whose scaling is relative to the pre-training context (HF moves it into the rope parameters)
_ORIGINAL_CONTEXT_ROPE_TYPES = ("llama3", "yarn")


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


def _arch_to_model_type(arch: str) -> str:
    for model_type, fam in _FAMILIES.items():
        if arch in (fam["prefix"] + s for s in _HEAD_SUFFIXES):
            return model_type
    why = f" ({_NOT_YET[arch]})" if arch in _NOT_YET else ""
    raise UnsupportedArchitectureError(
        f"unsupported architecture {arch!r}{why}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _token_ids(value: Any) -> int | tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value) if len(value) != 1 else int(value[0])
    return int(value)


def _first_token_id(value: Any) -> int | None:
    """One token id (the first, when a config lists several)."""
    ids = _token_ids(value)
    if isinstance(ids, tuple):
        return ids[0] if ids else None
    return ids


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope scaling as sorted (key, value) pairs (hashable); None = plain RoPE. See `rope_scaling_dict`.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    # M-RoPE (Qwen2.5-VL): head_dim / 2 rotary frequencies split into (temporal, height, width) sections, each
    # turned by its own position stream when positions are [3, B, T] (models/vision/qwen_vl.py); text positions
    # [B, T] (the three streams equal) give plain RoPE. None: plain RoPE only.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL's layout of the sections: frequency j turned by stream j % 3 within 3 x each section (height /
    # width), the rest temporal; False: contiguous sections (Qwen2.5-VL)
    mrope_interleaved: bool = False
    # Gemma 3 / Gemma 4 multimodal: the tokens of one image attend to each other both ways (the rest stays causal;
    # Gemma 4: on its sliding layers only); the value is the most tokens one image holds (Gemma 3's
    # mm_tokens_per_image, Gemma 4's largest soft-token budget), how far past a query its attention may reach.
    # 0: causal everywhere
    bidirectional_image_tokens: int = 0
    # the checkpoint stores each MoE layer's experts as two tensors, `experts.gate_up_proj` [E, 2F, H] and
    # `experts.down_proj` [E, H, F] (Qwen3-VL-MoE; its releases' [E, in, out] read transposed), not one per expert
    experts_fused: bool = False
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # the layers that attend within `sliding_window` (HF `layer_types` "sliding_attention"); None: every
    # layer (Mistral / Mixtral, Qwen3-MoE), when there is a window
    sliding_layers: tuple[int, ...] | None = None
    # Gemma: the MLP's activation (GeGLU), embeddings times sqrt(hidden_size), a norm after the attention
    # and after the MLP as well as before each, attention scaled by query_pre_attn_scalar^-0.5 (not
    # head_dim^-0.5), cap * tanh(x / cap) on attention scores and final logits (Gemma 2), and the RoPE
    # base of the sliding layers (Gemma 3: rope_theta is the full-attention layers')
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + scale): Gemma's 1 + w (its weights stay HF's w)
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    bos_token_id: int | tuple[int, ...] | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    # mixture of experts (num_experts > 0; models/moe.py). Experts' FFN width is moe_intermediate_size
    # (Mixtral: intermediate_size); Qwen2-MoE adds a shared expert of shared_expert_intermediate_size with a
    # sigmoid gate. norm_topk_prob renormalises the top-k router probabilities (Mixtral always does).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    # which layers are sparse (Qwen2-MoE / Qwen3-MoE): layer i has routed experts iff i is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0; the others have a dense MLP of intermediate_size
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # GPT-OSS: a learned logit per query head that joins every softmax's denominator (a key with value 0:
    # "attention sinks"), a bias on o_proj as well as q / k / v, biases on the router and the experts' three
    # projections, the router's softmax over the top-k logits only, and the experts' clamped SwiGLU:
    # (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)
    attention_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    router_topk_softmax: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Gemma 4 (`typed_layers`; models/gemma4.py): the full-attention layers' head width and kv heads
    # (None: head_dim / num_key_value_heads), their keys doubling as values (attention_k_eq_v: no v_proj),
    # the last kv_shared_layers layers attending with the keys / values of the last earlier layer of their
    # type (computing none), an MLP twice as wide on those layers (double_wide_mlp), per-layer input embeddings
    # of per_layer_input_size per layer (a table of per_layer_vocab_size rows), and RoPE on the first
    # rope_partial_factor of a full layer's head dims only (HF's "proportional")
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    rope_partial_factor: float = 1.0
    # DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0; models/mla.py): queries through a rank
    # q_lora_rank bottleneck (0: one q_proj), keys and values expanded per head from a normed latent of
    # kv_lora_rank, plus one RoPE'd key of head_dim (the rope part) shared by the heads; a query / key head is
    # qk_nope_head_dim + head_dim wide, a value head v_head_dim; rope_interleave: the rope dims come in
    # (even, odd) pairs. The KV caches hold the latent and the rope key (`cache_head_dim`), not K / V.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek-V3's router (models/moe.py `route`): sigmoid scores; the experts are chosen by score + a correction
    # bias (`router/score_bias`, not trained by the gradient) among the topk_group best of n_group groups (a group
    # scored by its best two), and mixed by their scores times routed_scaling_factor
    router_sigmoid: bool = False
    # DeepSeek-V2's router: softmax scores chosen within the topk_group groups whose best expert scores highest
    # (`group_limited_greedy`; plain top-k when off), the chosen scores times routed_scaling_factor, not renormalised
    router_group_max: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Qwen3.5's hybrid layers (models/hybrid.py): the layers that are gated delta-net linear attention (the rest
    # are full attention), their key / value heads and head dims and the width of their causal depthwise conv;
    # the full layers' output gate (q_proj twice as wide: query and gate per head) and RoPE on the first
    # partial_rotary_factor of each head's dims (rotate-half within them, frequencies over them)
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    # compute choices (not model shape): the grouped matmul and its row-block size (MOE_KERNELS)
    moe_kernel: str = "auto"
    moe_block_rows: int = 32
    # the most (token, expert) assignments one pass of the grouped matmul lays out: more tokens run in
    # rematerialised chunks of that many (`held_expert_ffn`), so the [assignments, hidden] rows and outputs
    # never exist whole; under expert parallelism a device lays out its whole expert group's tokens
    moe_chunk_rows: int = 65536
    # attention under context parallelism (CONTEXT_ATTENTION; the config's mesh.context_attention)
    context_attention: str = "ring"
    # layers per trip of the layer scan (`lax.scan(unroll=...)` in models/decoder.py); same numbers
    # either way. The memory plan lowers with 2 to count one layer's FLOPs, which XLA's cost analysis sees once per
    # loop body (planning/memory.py); runs keep 1.
    scan_unroll: int = 1
    # every sum of a token's row in an order independent of the other rows (models/invariant.py): the
    # sampler's log-probs equal the trainer's bit for bit (actor_rollout_ref.model.batch_invariant)
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} unsupported; supported: {HIDDEN_ACTS}")
        if self.sliding_layers is not None and any(not 0 <= i < self.num_hidden_layers for i in self.sliding_layers):
            raise ValueError(f"sliding_layers={list(self.sliding_layers)}: layers are 0..{self.num_hidden_layers - 1}")
        if self.head_dim % 2 or self.full_head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} (full layers: {self.full_head_dim}) must be even for RoPE")
        if self.num_attention_heads % self.full_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of the full layers' "
                             f"kv heads {self.full_kv_heads}")
        if not self.typed_layers and (self.global_head_dim or self.global_kv_heads or self.attention_k_eq_v
                                      or self.kv_shared_layers or self.per_layer_input_size):
            raise ValueError(f"{self.model_type}: per-type attention shapes, shared KV and per-layer inputs are "
                             "Gemma 4's (gemma4_text)")
        if not 0 <= self.kv_shared_layers < self.num_hidden_layers:
            raise ValueError(f"kv_shared_layers={self.kv_shared_layers} must be in 0..{self.num_hidden_layers - 1}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                                 f"{self.num_experts}")
            if self.moe_intermediate_size < 1:
                raise ValueError("moe_intermediate_size must be positive for a mixture-of-experts model")
            if self.model_type in ("mixtral", "gpt_oss"):  # one width: config.json's intermediate_size is the experts'
                object.__setattr__(self, "intermediate_size", self.moe_intermediate_size)
            object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(int(i) for i in self.mlp_only_layers))))
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be positive")
            outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
            if outside:
                raise ValueError(f"mlp_only_layers={list(self.mlp_only_layers)}: layer {outside[0]} is not in "
                                 f"0..{self.num_hidden_layers - 1}")
            if not self.moe_layer_ids:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} and mlp_only_layers="
                                 f"{list(self.mlp_only_layers)} leave no layer with experts in a {self.model_type} "
                                 f"model of {self.num_hidden_layers} layers")
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"moe_kernel={self.moe_kernel!r}; expected one of {MOE_KERNELS}")
        if self.context_attention not in CONTEXT_ATTENTION:
            raise ValueError(f"context_attention={self.context_attention!r}; expected one of {CONTEXT_ATTENTION}")
        if self.moe_block_rows < 1:
            raise ValueError(f"moe_block_rows={self.moe_block_rows} must be positive")
        if self.moe_chunk_rows < self.moe_block_rows:
            raise ValueError(f"moe_chunk_rows={self.moe_chunk_rows} must be at least moe_block_rows="
                             f"{self.moe_block_rows}")
        check_deepseek(self)
        check_qwen35(self)
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """The layers whose MLP is a routed set of experts (HF's rule; none in a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """The layers whose MLP is dense (every layer of a dense model)."""
        sparse = set(self.moe_layer_ids)
        return tuple(i for i in range(self.num_hidden_layers) if i not in sparse)

    @property
    def mixed_layers(self) -> bool:
        """A mixture-of-experts model with dense MLP layers between the sparse ones: its `mlp` and `moe`
        params are stacked over their own layers (models/param_init.py)."""
        return self.is_moe and bool(self.dense_layer_ids)

    @property
    def local_layer_ids(self) -> tuple[int, ...]:
        """The layers that attend within `sliding_window` (none without a window)."""
        if self.sliding_window is None:
            return ()
        if self.sliding_layers is None:
            return tuple(range(self.num_hidden_layers))
        return self.sliding_layers

    @property
    def local_layer_flags(self) -> np.ndarray:
        """[L] bool: layer i attends within the sliding window (what a layer scan indexes by layer)."""
        flags = np.zeros(self.num_hidden_layers, bool)
        flags[list(self.local_layer_ids)] = True
        return flags

    @property
    def layer_types(self) -> list[str]:
        """HF's `layer_types`: "sliding_attention" / "full_attention" per layer."""
        return ["sliding_attention" if local else "full_attention" for local in self.local_layer_flags]

    @property
    def mixed_windows(self) -> bool:
        """Some layers attend within the sliding window and others over the whole context (Qwen2 / Qwen3
        with `max_window_layers`): each layer picks its mask (dense attention) or kernel (paged) by index."""
        return 0 < len(self.local_layer_ids) < self.num_hidden_layers

    @property
    def typed_layers(self) -> bool:
        """Gemma 4: the attention and MLP weights are stacked per layer kind (models/gemma4.py)."""
        return self.model_type == "gemma4_text"

    @property
    def full_head_dim(self) -> int:
        return self.global_head_dim or self.head_dim

    @property
    def full_kv_heads(self) -> int:
        return self.global_kv_heads or self.num_key_value_heads

    @property
    def hybrid(self) -> bool:
        """Gated delta-net layers between the attention layers (Qwen3.5; models/hybrid.py)."""
        return bool(self.linear_layers)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """The layers with (softmax) attention: all but a hybrid model's linear layers."""
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        """The head dims RoPE turns (Qwen3.5: the first partial_rotary_factor of them)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3; models/mla.py)."""
        return self.kv_lora_rank > 0

    @property
    def cache_kv_heads(self) -> int:
        """The kv heads of a KV cache / pool: one for MLA (the latent and rope key every head reads)."""
        return 1 if self.is_mla else self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        """A cached key's width: MLA's latent + rope key (kv_lora_rank + head_dim numbers a token a layer, the
        value being the key's first kv_lora_rank), else head_dim."""
        return self.kv_lora_rank + self.head_dim if self.is_mla else self.head_dim

    @property
    def shared_expert_gated(self) -> bool:
        """Qwen2-MoE's shared expert is gated by sigmoid(x @ w); DeepSeek's shared experts are added as they are."""
        return self.model_type in ("qwen2_moe", "qwen3_5_moe_text")

    @property
    def attention_width(self) -> int:
        """heads x head_dim of a query, averaged over the layers (Gemma 4's full layers are wider): what the
        attention's FLOPs per (query, key) pair scale with, per layer (planning / MFU). MLA: the mean of a
        query / key head's width and a value head's (the trainer's expanded attention)."""
        if self.is_mla:
            return round(self.num_attention_heads * (self.qk_nope_head_dim + self.head_dim + self.v_head_dim) / 2)
        if self.hybrid:  # only the full-attention layers attend over the context (the delta net: a fixed state)
            return round(self.num_attention_heads * self.head_dim * len(self.full_attention_layers)
                         / self.num_hidden_layers)
        full = self.num_hidden_layers - len(self.local_layer_ids) if self.typed_layers else 0
        widths = (self.num_hidden_layers - full) * self.head_dim + full * self.full_head_dim
        return round(self.num_attention_heads * widths / self.num_hidden_layers)

    @property
    def first_shared_layer(self) -> int:
        """The first layer that reads an earlier layer's keys / values (num_hidden_layers: none does)."""
        return self.num_hidden_layers - self.kv_shared_layers

    def kv_layer_ids(self, local: bool) -> tuple[int, ...]:
        """The layers of one attention type (sliding: `local`) that compute their own keys / values: the rows
        of that type's KV cache (the shared layers hold none)."""
        flags = self.local_layer_flags
        return tuple(i for i in range(self.first_shared_layer) if bool(flags[i]) == local)

    @property
    def kv_rows(self) -> np.ndarray:
        """[L] int32: the row of each layer's keys / values in its type's KV cache (a shared layer: its
        producer's, the last layer of its type before the shared ones)."""
        rows = np.zeros(self.num_hidden_layers, np.int32)
        for local in (True, False):
            own = self.kv_layer_ids(local)
            for row, i in enumerate(own):
                rows[i] = row
            for i in range(self.first_shared_layer, self.num_hidden_layers):
                if bool(self.local_layer_flags[i]) == local:
                    rows[i] = len(own) - 1
        return rows

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def context_length(self) -> int:
        """The positions the model serves: `max_position_embeddings`, or with RoPE scaling the scaled
        pre-training context (factor x original_max_position_embeddings), when that is longer."""
        s = self.rope_scaling_dict
        if not s:
            return self.max_position_embeddings
        original = int(s.get("original_max_position_embeddings", self.max_position_embeddings))
        return max(self.max_position_embeddings, int(float(s.get("factor", 1.0)) * original))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "ModelConfig":
        d = _text_tower(d)
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if archs:
            arch = archs[0]
            arch_type = _arch_to_model_type(arch)
            if model_type is not None and model_type != arch_type:
                raise ValueError(f"config.json: model_type {model_type!r} does not match {arch!r}")
            model_type = arch_type
        elif model_type in _FAMILIES:
            arch = _FAMILIES[model_type]["prefix"] + "ForCausalLM"
        else:
            raise UnsupportedArchitectureError(
                f"unsupported model_type {model_type!r} (no 'architectures' in config.json); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type == "qwen3_5_moe_text":  # no dense MLP: every layer's is the experts'
            d = {**d, "intermediate_size": d.get("intermediate_size") or d.get("moe_intermediate_size")}
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json is missing required key {key!r}")
        fam = _FAMILIES[model_type]
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in HIDDEN_ACTS or (act != "silu") != bool(fam.get("gemma")):
            raise ValueError(f"config.json: hidden_act {act!r} unsupported for {model_type} "
                             f"(only {'gelu_pytorch_tanh' if fam.get('gemma') else 'silu'})")
        if d.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=True is unsupported")
        quant = d.get("quantization_config") or {}
        if quant and (quant.get("quant_method") != "mxfp4" or model_type != "gpt_oss"):
            raise ValueError(f"config.json: quantization_config.quant_method={quant.get('quant_method')!r} is "
                             f"unsupported for {model_type} (only GPT-OSS's mxfp4 experts, dequantised on load)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention=True (an encoder) is unsupported")
        # transformers 5 keeps theta and scaling in `rope_parameters`; older files use top-level keys.
        # Gemma 3 (transformers 5) keeps one entry per layer type
        rope = dict(d.get("rope_parameters") or {})
        local_theta = None
        if model_type == "gemma3_text":
            local = dict(rope.pop("sliding_attention", None) or {})
            rope = dict(rope.pop("full_attention", None) or rope)
            local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"config.json: rope_parameters.sliding_attention.rope_type={local['rope_type']!r} "
                                 "is unsupported (only 'default')")
        legacy = d.get("rope_scaling") or {}
        rope_theta = float(rope.pop("rope_theta", d.get("rope_theta", 1e6 if local_theta else 10000.0)))
        scaling = {**legacy, **rope}
        scaling.pop("rope_theta", None)  # a legacy rope_scaling written beside rope_parameters repeats it
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        scaling.pop("type", None)
        # Qwen2.5-VL's / Qwen3-VL(-MoE)'s text model: Qwen2 / Qwen3 / Qwen3-MoE with M-RoPE (contiguous / interleaved)
        mrope = scaling.pop("mrope_section", None) if model_type in ("qwen2", "qwen3", "qwen3_moe") else None
        interleaved = bool(scaling.pop("mrope_interleaved", False)) if mrope else False
        if scaling.get("rope_type", "default") == "default":
            scaling = {}
        elif scaling["rope_type"] in _ORIGINAL_CONTEXT_ROPE_TYPES:  # HF's default: the config's own context
            scaling.setdefault("original_max_position_embeddings",
                               d.get("original_max_position_embeddings") or d.get("max_position_embeddings", 2048))
        if scaling.get("rope_type") == "yarn" and scaling.get("factor") is None:  # DeepSeek's convention, as HF
            scaling["factor"] = d.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
        if model_type in QWEN35_FAMILIES:  # text positions: M-RoPE's three axes agree, so it is plain RoPE
            for key in ("partial_rotary_factor", "mrope_section", "mrope_interleaved"):
                scaling.pop(key, None)
            if scaling.get("rope_type", "default") == "default":
                scaling = {}
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0 and model_type != "gemma4_text":
            raise ValueError(f"config.json: partial_rotary_factor={scaling['partial_rotary_factor']} is unsupported "
                             "(RoPE on every head dimension only)")
        if model_type in DEEPSEEK_FAMILIES:
            moe = deepseek_fields(d, model_type)
        else:
            moe = _moe_fields(d, model_type) if fam.get("moe") else {}
        if model_type == "gpt_oss":
            moe.update(_gpt_oss_fields(d))
        sliding_window, sliding_layers = _sliding_windows(d, model_type)
        gemma = _gemma_fields(d, act, local_theta) if fam.get("gemma") else {}
        if model_type in QWEN35_FAMILIES:
            gemma = qwen35_fields(d, model_type)
        if model_type == "gemma4_text":
            gemma = gemma4_fields(d, sliding_layers or ())
            rope_theta, scaling = gemma.pop("rope_theta"), dict(gemma.pop("rope_scaling") or ())
        heads = int(d["num_attention_heads"])
        shape = dict(num_key_value_heads=int(moe.pop("num_key_value_heads", None) or d.get("num_key_value_heads")
                                             or heads),
                     head_dim=int(moe.pop("head_dim", None) or d.get("head_dim") or d["hidden_size"] // heads))
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            **shape,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted(scaling.items())) or None,
            mrope_section=tuple(int(x) for x in mrope) if mrope else None, mrope_interleaved=interleaved,
            bidirectional_image_tokens=int(d.get("bidirectional_image_tokens", 0)),
            experts_fused=bool(d.get("experts_fused", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", bool(fam.get("gemma")))),  # Gemma ties by default
            attention_bias=bool(d.get("qkv_bias" if model_type == "qwen2_moe" else "attention_bias",
                                      fam["attention_bias"])),
            qk_norm=fam["qk_norm"],
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            bos_token_id=_token_ids(d.get("bos_token_id")),
            eos_token_id=_token_ids(d.get("eos_token_id")),
            pad_token_id=_first_token_id(d.get("pad_token_id")),
            initializer_range=float(d.get("initializer_range", 0.02)),
            **moe,
            **gemma,
        )

    def to_hf_config(self, *, architecture: str | None = None, num_labels: int | None = None,
                     dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict transformers 4.x and 5.x both read back to the same model."""
        arch = architecture or self.architecture
        if _arch_to_model_type(arch) != self.model_type:
            raise ValueError(f"architecture {arch!r} does not match model_type {self.model_type!r}")
        rope_params = {"rope_type": "default", **self.rope_scaling_dict, "rope_theta": self.rope_theta}
        if self.mrope_section:  # a Qwen2.5-VL / Qwen3-VL text model's (read back by `from_hf_config`)
            rope_params["mrope_section"] = list(self.mrope_section)
            if self.mrope_interleaved:
                rope_params["mrope_interleaved"] = True
        extra: dict[str, Any] = {"bidirectional_image_tokens": self.bidirectional_image_tokens} \
            if self.bidirectional_image_tokens else {}
        if self.experts_fused:
            extra["experts_fused"] = True
        d: dict[str, Any] = {
            **extra,
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_params,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": _json_ids(self.bos_token_id),
            "eos_token_id": _json_ids(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
            "torch_dtype": dtype,
            "use_cache": True,
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(rope_params)
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "qwen2_moe":
            d["qkv_bias"] = self.attention_bias
        if self.model_type == "llama":
            d["mlp_bias"] = False
        if self.model_type in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
        if self.model_type == "gpt_oss":
            d.update(attention_bias=True, sliding_window=self.sliding_window, layer_types=self.layer_types,
                     swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
        if self.model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            if self.sliding_window is not None and self.model_type != "qwen3_moe":
                d["layer_types"] = self.layer_types
                # transformers derives layer_types from it when a reader drops them: the first local layer
                d["max_window_layers"] = min(self.local_layer_ids, default=self.num_hidden_layers)
        if self.model_type == "gemma4_text":
            d.update(gemma4_hf_fields(self))
        elif self.model_type in GEMMA_FAMILIES:
            d.update(self._hf_gemma_fields(rope_params))
        if self.model_type in QWEN35_FAMILIES:
            d.update(qwen35_hf_fields(self))
            d["rope_parameters"] = {**rope_params, "partial_rotary_factor": self.partial_rotary_factor}
        if self.model_type in DEEPSEEK_FAMILIES:
            d.update(deepseek_hf_fields(self))
        elif self.is_moe and not self.typed_layers:  # Gemma 4's: models/config_gemma4.py
            d.update(self._hf_moe_fields())
        if num_labels is not None:
            d["num_labels"] = num_labels
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
        return d

    def _hf_gemma_fields(self, rope_params: dict[str, Any]) -> dict[str, Any]:
        d: dict[str, Any] = {
            "hidden_activation": self.hidden_act,
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar),  # transformers 5 wants an int
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping, "attention_bias": False,
            "sliding_window": self.sliding_window, "layer_types": self.layer_types}
        if self.model_type == "gemma3_text":
            local_theta = self.rope_local_theta or 10000.0
            d["rope_parameters"] = {"full_attention": rope_params,
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
            d["rope_local_base_freq"] = local_theta  # transformers 4
            if self.rope_scaling:
                d["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return d

    def _hf_moe_fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"num_experts_per_tok": self.num_experts_per_tok,
                             "router_aux_loss_coef": self.router_aux_loss_coef,
                             "output_router_logits": self.output_router_logits}
        if self.model_type in ("mixtral", "gpt_oss"):  # their experts are `intermediate_size` wide
            d.update(num_local_experts=self.num_experts, intermediate_size=self.moe_intermediate_size)
            return d
        d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type in ("qwen2_moe", "qwen3_5_moe_text"):
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type == "qwen3_5_moe_text":  # its router always renormalises; no dense layers
            for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                d.pop(key, None)
        return d

    # ------------------------------------------------------------------ tests
    @classmethod
    def tiny(cls, family: str = "llama", **overrides: Any) -> "ModelConfig":
        """A 2-layer, hidden-64, vocab-256 config of `family` for tests."""
        if family not in _FAMILIES:
            raise ValueError(f"unknown family {family!r}; known: {sorted(_FAMILIES)}")
        fam = _FAMILIES[family]
        base: dict[str, Any] = dict(
            architecture=fam["prefix"] + "ForCausalLM", model_type=family, vocab_size=256,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=256, tie_word_embeddings=False,
            attention_bias=fam["attention_bias"], qk_norm=fam["qk_norm"],
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        if fam.get("moe"):
            base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        norm_topk_prob=family not in ("qwen2_moe", "gpt_oss"), router_aux_loss_coef=0.001,
                        shared_expert_intermediate_size=48 if family in ("qwen2_moe", "qwen3_5_moe_text") else 0)
        if family == "gpt_oss":  # layer 0 local (window 4), layer 1 global; a low clamp so that tests reach it
            base.update(attention_sinks=True, o_proj_bias=True, expert_bias=True, router_topk_softmax=True,
                        swiglu_limit=0.05, sliding_window=4, sliding_layers=(0,), intermediate_size=32)
        if fam.get("gemma"):  # layer 0 local (window 4), layer 1 global
            base.update(hidden_act="gelu_pytorch_tanh", norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
                        query_pre_attn_scalar=32.0, tie_word_embeddings=True, sliding_window=4, sliding_layers=(0,))
            if family == "gemma2":
                base.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
            else:
                base.update(rope_theta=1e6, rope_local_theta=1e4)
        if family == "deepseek_v2":  # as deepseek_v3's below, with V2's softmax group-limited router
            base.update(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=8,
                        v_head_dim=16, rope_interleave=True, router_group_max=True, n_group=4, topk_group=2,
                        routed_scaling_factor=2.0, norm_topk_prob=False, shared_expert_intermediate_size=32,
                        mlp_only_layers=(0,), router_aux_loss_coef=0.0)
        if family == "deepseek_v3":  # layer 0 dense, layer 1 sparse; 8 experts in 4 groups (the best 2 open);
            # a q bottleneck; heads of 8 nope + 8 rope dims, values of 16
            base.update(num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=8,
                        v_head_dim=16, rope_interleave=True, router_sigmoid=True, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True, shared_expert_intermediate_size=32,
                        mlp_only_layers=(0,), router_aux_loss_coef=0.0)
        if family in QWEN35_FAMILIES:  # linear, full, linear, full: key / value heads 2 / 4 of 8 dims, a conv of 4
            layers = int(overrides.get("num_hidden_layers", 4))
            base.update(num_hidden_layers=layers, linear_layers=tuple(range(0, layers, 2)), linear_key_heads=2,
                        linear_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4,
                        attention_output_gate=True, partial_rotary_factor=0.25, norm_offset=1.0)
        if family == "gemma4_text":  # sliding / full alternating (the last full), full heads twice as wide with one
            # kv head and k = v, per-layer inputs; from 4 layers on the last 2 read the K / V of the 2 before them
            layers = int(overrides.get("num_hidden_layers", 4))
            shared = 2 if layers >= 4 else 0
            base.update(num_hidden_layers=layers, sliding_layers=tuple(range(0, layers - 1, 2)), norm_offset=0.0,
                        query_pre_attn_scalar=1.0, final_logit_softcapping=30.0, global_kv_heads=1,
                        global_head_dim=2 * int(overrides.get("head_dim", base["head_dim"])), attention_k_eq_v=True,
                        kv_shared_layers=shared, double_wide_mlp=shared > 0, per_layer_input_size=8,
                        per_layer_vocab_size=int(overrides.get("vocab_size", base["vocab_size"])),
                        rope_partial_factor=0.25)
        base.update(overrides)
        if family in DEEPSEEK_FAMILIES:  # MLA: each head expands the latent its own way (kv heads = heads)
            base["num_key_value_heads"] = base["num_attention_heads"]
        return cls(**base)


# `model.override_config`: HF config.json fields an override may change (they reach ModelConfig
# without changing any parameter's shape) and fields it may not (architecture, shapes).
OVERRIDABLE_HF_KEYS = ("rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                       "sliding_window", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                       "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits",
                       "swiglu_limit", "swiglu_alpha")
FIXED_HF_KEYS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 "attention_bias", "hidden_act", "mlp_bias", "use_sliding_window", "layer_types",
                 "num_experts", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "decoder_sparse_step", "mlp_only_layers", "qkv_bias", "kv_lora_rank", "q_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                 "first_k_dense_replace", "n_group")


def classify_hf_overrides(keys: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(keys an override may not change, keys ModelConfig does not read) among `keys`."""
    rejected = [k for k in keys if k in FIXED_HF_KEYS]
    ignored = [k for k in keys if k not in FIXED_HF_KEYS and k not in OVERRIDABLE_HF_KEYS]
    return rejected, ignored


def with_hf_overrides(cfg: ModelConfig, overrides: dict[str, Any] | None) -> ModelConfig:
    """`cfg` with HF config fields replaced (veRL's `model.override_config`, e.g. {rope_theta: 1e6}):
    the config is written as config.json, the fields set, and read back. Fields that would change
    the architecture or a parameter shape raise ValueError; fields the decoder does not read
    (e.g. dropout rates) change nothing."""
    if not overrides:
        return cfg
    rejected, _ = classify_hf_overrides(list(overrides))
    if rejected:
        raise ValueError(f"override_config.{rejected[0]} would change the architecture or parameter shapes")
    d = cfg.to_hf_config()
    # rope as legacy top-level keys only, so an overridden rope_theta / rope_scaling is the one read back
    d.pop("rope_parameters")
    d.pop("rope_scaling", None)
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling_dict
    d.update(overrides)
    return ModelConfig.from_hf_config(d)


def _moe_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a MoE family's config.json."""
    # transformers 5 writes either name for either family (its attribute_map aliases them)
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    layout: dict[str, Any] = {}
    if model_type in ("mixtral", "gpt_oss"):
        width = int(d["intermediate_size"])
        norm_topk = model_type == "mixtral"  # Mixtral's router always renormalises its top-k (GPT-OSS: a softmax of
        # the top-k logits, `router_topk_softmax`)
    else:
        width = int(d.get("moe_intermediate_size") or 0)
        # Qwen3.5-MoE's router renormalises its top-k always (its config has no norm_topk_prob)
        norm_topk = model_type == "qwen3_5_moe_text" or bool(d.get("norm_topk_prob", False))
        if experts == 0:
            raise ValueError(f"config.json: num_experts=0 makes every layer a dense MLP in a {model_type} model; "
                             f"load it as its dense family")
        layout = dict(decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                      mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
    if d.get("router_jitter_noise"):
        raise ValueError(f"config.json: router_jitter_noise={d['router_jitter_noise']} is unsupported "
                         "(it multiplies hidden states by training-time noise)")
    return dict(num_experts=experts, num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                moe_intermediate_size=width,
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0)
                if model_type in ("qwen2_moe", "qwen3_5_moe_text") else 0,
                norm_topk_prob=norm_topk, router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
                output_router_logits=bool(d.get("output_router_logits", False)), **layout)


def _gpt_oss_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a GPT-OSS config.json beyond the MoE ones."""
    if d.get("attention_bias") is False:
        raise ValueError("config.json: attention_bias=False is unsupported for gpt_oss (every released checkpoint "
                         "has q / k / v / o biases)")
    limit = d.get("swiglu_limit", 7.0)
    return dict(attention_sinks=True, o_proj_bias=True, expert_bias=True, router_topk_softmax=True,
                swiglu_limit=None if limit is None else float(limit), swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))


# multimodal model types -> their text model's class prefix in transformers (`_text_tower`)
_MULTIMODAL = {"gemma3": "Gemma3", "gemma4": "Gemma4", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe",
               "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}


# Qwen vision-language model types -> (transformers' config class, their text model's family, interleaved M-RoPE)
_QWEN_VL = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "qwen2", False), "qwen3_vl": ("Qwen3VLConfig", "qwen3", True),
            "qwen3_vl_moe": ("Qwen3VLMoeConfig", "qwen3_moe", True)}


def _text_tower(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 / Gemma 4 / Qwen3.5 checkpoint's config.json (`Gemma3ForConditionalGeneration`,
    `Qwen3_5ForConditionalGeneration`, ...) read as its text model's, `Gemma3ForCausalLM` / `Qwen3_5ForCausalLM`
    (the language model is what RL trains; the vision tower is not loaded, hf/hf_folder.py maps its tensor names).
    Its `text_config` may list only what differs from transformers' defaults, so transformers fills in the rest;
    token ids come from the top level where it has them."""
    if d.get("model_type") in _QWEN_VL:  # Qwen2 / Qwen3 with M-RoPE (Qwen2.5-VL's releases: text keys on top)
        import transformers

        config_class, family, interleaved = _QWEN_VL[d["model_type"]]
        vl = getattr(transformers, config_class)(**{k: v for k, v in d.items()
                                                    if k not in ("model_type", "architectures")})
        text_config = vl.text_config
        assert text_config is not None
        out = dict(text_config) if isinstance(text_config, dict) else text_config.to_dict()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            if d.get(key) is not None:
                out[key] = d[key]
        out.update(model_type=family, architectures=[_FAMILIES[family]["prefix"] + "ForCausalLM"])
        if interleaved:  # Qwen3-VL's layout of the M-RoPE sections (its config does not say it: its code does)
            out["rope_parameters"] = {**(out.get("rope_parameters") or {}), "mrope_interleaved": True}
        if d["model_type"] == "qwen3_vl_moe":  # its router renormalises its top-k; each layer's experts in 2 tensors
            out.update(norm_topk_prob=True, experts_fused=True)
        return out
    if d.get("model_type") not in _MULTIMODAL or not isinstance(d.get("text_config"), dict):
        return d
    import transformers

    family = _MULTIMODAL[d["model_type"]]
    text = {k: v for k, v in d["text_config"].items() if k not in ("model_type", "architectures")}
    out = getattr(transformers, f"{family}TextConfig")(**text).to_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if d.get(key) is not None:
            out[key] = d[key]
    out.update(model_type=f"{d['model_type']}_text", architectures=[f"{family}ForCausalLM"])
    if d["model_type"] == "gemma3":  # an image's tokens see each other (models/vision/siglip.py)
        out["bidirectional_image_tokens"] = int(d.get("mm_tokens_per_image", 256))
    if d["model_type"] == "gemma4" and out.get("use_bidirectional_attention") == "vision" and d.get("vision_config"):
        # on its sliding layers (models/model.py); an image holds at most 1120 tokens (the processor's largest budget)
        out["bidirectional_image_tokens"] = 1120
    if out.get("use_bidirectional_attention") == "vision":  # what it means is the line above's, not an encoder's
        out.pop("use_bidirectional_attention")
    return out


def _int_if_whole(x: float | None) -> float | int | None:
    return int(x) if x is not None and float(x).is_integer() else x


def _gemma_fields(d: dict[str, Any], act: str, local_theta: float | None) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 / Gemma 3 config.json beyond the shared ones."""
    def optional(key: str) -> float | None:
        return None if d.get(key) is None else float(d[key])

    return dict(hidden_act=act, norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
                query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                attn_logit_softcapping=optional("attn_logit_softcapping"),
                final_logit_softcapping=optional("final_logit_softcapping"),
                rope_local_theta=local_theta)


def _sliding_windows(d: dict[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, sliding_layers) of a config.json, as transformers reads it per family: Mistral /
    Mixtral window every layer; Qwen2 / Qwen3 only with `use_sliding_window`, on the layers `layer_types`
    marks "sliding_attention" (default: from `max_window_layers` on); Qwen3-MoE every layer."""
    layers = int(d["num_hidden_layers"])
    if model_type in GEMMA_FAMILIES:  # Gemma 2: every other layer from the first; Gemma 3: 5 of every 6
        pattern = 2 if model_type == "gemma2" else int(d.get("sliding_window_pattern", 6))
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                         for i in range(layers)]
        if model_type == "gemma4_text":  # transformers makes the last layer a full one whatever the file says
            types = list(types)[:-1] + ["full_attention"]
        window = d.get("sliding_window")
        if window is None:
            return None, None
        return int(window), _sliding_layer_ids(types, layers)
    if model_type == "gpt_oss":  # every other layer from the first, unless layer_types says otherwise
        window = d.get("sliding_window", 128)
        if window is None:
            return None, None
        types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                         for i in range(layers)]
        return int(window), _sliding_layer_ids(types, layers)
    if model_type in ("mistral", "mixtral"):
        window = d.get("sliding_window")
        return (None if window is None else int(window)), None
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is None:
        return None, None
    if model_type == "qwen3_moe":
        return int(window), None
    if model_type == "qwen2_moe":
        raise ValueError("config.json: use_sliding_window is unsupported for qwen2_moe (its layer_types rule "
                         "differs from Qwen2's; no released checkpoint sets it)")
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", layers))
        return int(window), tuple(range(first, layers))
    return int(window), _sliding_layer_ids(types, layers)


def _sliding_layer_ids(types: list[str], layers: int) -> tuple[int, ...]:
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"config.json: layer_types={types!r} must list 'sliding_attention' or 'full_attention' "
                         f"for each of the {layers} layers")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _json_ids(v: int | tuple[int, ...] | None) -> int | list[int] | None:
    return list(v) if isinstance(v, tuple) else v


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor transformers multiplies RoPE's cos and sin by (YaRN's attention temperature; else 1):
    `attention_factor` when given, else 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim ratio
    when both are set)."""
    s = cfg.rope_scaling_dict
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(inv: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency blends the interpolated
    (inv / factor) and the original one by a linear ramp over the dims between the rotation counts
    beta_slow and beta_fast of the original context."""
    s, dim = cfg.rope_scaling_dict, cfg.rotary_dim
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (the original frequency), 0: interpolate
    return (inv / np.float32(factor) * (1 - keep) + inv * keep).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float32), with linear / llama3 / yarn scaling as transformers does
    (`dynamic` depends on the positions of each forward: models/decoder.py `rope_cos_sin`; these are its
    frequencies within max_position_embeddings). Over `cfg.rotary_dim` (Qwen3.5's partial rotary)."""
    dim = cfg.rotary_dim
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)))
    inv = inv.astype(np.float32)
    s = cfg.rope_scaling_dict
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / np.float32(s["factor"])
    elif kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, cfg)
    return inv

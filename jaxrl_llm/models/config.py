"""ModelConfig: the one description of a decoder (every family of models/families.py: Llama, Mistral, Qwen2 / 3,
their mixture-of-experts relatives, Gemma 2 / 3 / 4, GPT-OSS, DeepSeek-V2 / V3, Qwen3.5).

Built from a transformers `config.json` dict (`from_hf_config`) and written back (`to_hf_config`)
so that `transformers` reads it with the same numbers (the keys: models/config_hf.py). Frozen and hashable
so it can be a static argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_llm.models.config_deepseek import DEEPSEEK_FAMILIES, check_deepseek
from jaxrl_llm.models.config_hf import classify_hf_overrides, hf_config_dict, model_config_fields
from jaxrl_llm.models.config_qwen35 import check_qwen35
from jaxrl_llm.models.families import (
    CONTEXT_ATTENTION,
    FAMILIES,
    HIDDEN_ACTS,
    MOE_KERNELS,
    QWEN35_FAMILIES,
    SUPPORTED_ROPE_TYPES,
)


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
    # times each trip of the layer scan runs its layer (models/remat.py `scan_step`); runs keep 1. The memory
    # plan compiles a program with 2 to count one layer's cost, which XLA's cost analysis sees once per loop body
    # (planning/memory.py). Not `lax.scan(unroll=2)`: the TPU compiler moves an unrolled trip's two-layer weight
    # slabs differently (a scan of 17 MB layers: 70 MB more a trip, planning/hbm_bytes.py; 87 MB by XLA's count).
    scan_repeat: int = 1
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
    def decode_attention_width(self) -> int:
        """`attention_width` as the sampler's decode step computes it over the KV pool: MLA attends in its
        absorbed form there (a query head's q.k over the latent and the rope key, kv_lora_rank + head_dim wide,
        its p.v over the latent, kv_lora_rank wide: models/mla.py), 3.4x the expanded width at DeepSeek-V3's
        dims; every other model as `attention_width` (the prefill is the trainer's forward: expanded)."""
        if self.is_mla:
            return round(self.num_attention_heads * (self.cache_head_dim + self.kv_lora_rank) / 2)
        return self.attention_width

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
        """The model a transformers config.json dict describes (models/config_hf.py reads its keys)."""
        return cls(**model_config_fields(d))

    def to_hf_config(self, *, architecture: str | None = None, num_labels: int | None = None,
                     dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict transformers 4.x and 5.x both read back to the same model."""
        return hf_config_dict(self, architecture=architecture, num_labels=num_labels, dtype=dtype)

    # ------------------------------------------------------------------ tests
    @classmethod
    def tiny(cls, family: str = "llama", **overrides: Any) -> "ModelConfig":
        """A 2-layer, hidden-64, vocab-256 config of `family` for tests."""
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
        fam = FAMILIES[family]
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

"""The params layout: fresh params (`init_params`) and each leaf's logical axes (`param_logical_axes`; the tables:
models/param_axes.py).

The backbone's weights (names, shapes, initialisers) are declared as flax modules; no math lives
here (the forward is `jaxrl_llm.models.decoder`, pure functions over the params dict). flax is
used for its per-module random streams, so a seed gives the same weights as it always did
(`nn.scan` splits the layers' keys, each module folds in its name).

Layout (a plain nested dict of arrays; layer params stacked on a leading axis of size L):

    embedding [V, H]
    layers/attn_norm/scale [L, H]          layers/mlp_norm/scale [L, H]
    layers/attn_post_norm/scale [L, H]     layers/mlp_post_norm/scale [L, H]   (sandwich_norms: Gemma)
    layers/attn/{q,k,v}_proj/kernel [L, H, heads|kv_heads, D]   (+ bias [L, heads, D] with attention_bias)
    layers/attn/{q,k}_norm/scale [L, D]    (qk_norm)
    layers/attn/o_proj/kernel [L, heads, D, H]    (+ bias [L, H] with o_proj_bias: GPT-OSS)
    layers/attn/sinks [L, heads]           (attention_sinks: GPT-OSS's per-head softmax logit)
    multi-head latent attention (cfg.is_mla: DeepSeek-V3, models/mla.py) has in place of q / k / v_proj:
      layers/attn/q_proj/kernel [L, H, heads, nope + rope]   or, with q_lora_rank, layers/attn/q_a_proj/kernel
      [L, H, q_lora], q_a_norm/scale [L, q_lora], q_b_proj/kernel [L, q_lora, heads, nope + rope];
      layers/attn/kv_a_proj_with_mqa/kernel [L, H, kv_lora + rope], kv_a_norm/scale [L, kv_lora],
      kv_b_proj/kernel [L, kv_lora, heads, nope + v]; o_proj/kernel [L, heads, v, H]
    layers/mlp/{gate,up}_proj/kernel [L, H, F]   layers/mlp/down_proj/kernel [L, F, H]
    mixture-of-experts families (cfg.is_moe) have layers/moe in place of layers/mlp (models/moe.py):
      layers/moe/router/kernel [L, H, E]
      layers/moe/experts/{gate,up}_proj/kernel [L, E, H, Fe]   layers/moe/experts/down_proj/kernel [L, E, Fe, H]
      layers/moe/router/bias [L, E], layers/moe/experts/{gate,up}_proj/bias [L, E, Fe],
      layers/moe/experts/down_proj/bias [L, E, H]                                   (expert_bias: GPT-OSS)
      layers/moe/shared_expert/{gate,up,down}_proj/kernel [L, H, Fs] / [L, Fs, H]   (Qwen2-MoE)
      layers/moe/shared_expert_gate/kernel [L, H, 1]                               (Qwen2-MoE)
      layers/moe/shared_expert/... [L, H, n_shared x Fe] without a gate, layers/moe/score_bias [L, E] (DeepSeek-V3)
    a MoE model with dense MLP layers between the sparse ones (cfg.mixed_layers: Qwen2-MoE / Qwen3-MoE
    `decoder_sparse_step` > 1 or `mlp_only_layers`) has both, each stacked over its own layers only:
      layers/mlp/... [L_dense, ...] (cfg.dense_layer_ids, in order)   layers/moe/... [L_moe, ...] (cfg.moe_layer_ids)
    Gemma 4 (cfg.typed_layers; models/gemma4.py) stacks its attention and MLP weights per layer kind, each
    over its own layers (`typed_stacks`): layers/attn/{q_proj, q_norm, o_proj} [L_sliding, ...] and
    layers/attn_full/... [L_full, ...] (the full layers' head shape); layers/kv/{k_proj, k_norm, v_proj}
    [L_sliding_own, ...] and layers/kv_full/... [L_full_own, ...] over the layers that compute keys / values
    (no v_proj with attention_k_eq_v); layers/mlp [L_narrow, ...] and layers/mlp_wide [L_shared, H, 2F]
    (double_wide_mlp); and, stacked over every layer, layers/layer_scalar [L], the per-layer-input gate
    layers/ple_gate/kernel [L, H, P], layers/ple_proj/kernel [L, P, H], layers/ple_norm/scale [L, H], with
    ple_embedding [V_ple, L * P], ple_model_proj/kernel [H, L * P], ple_proj_norm/scale [P] at the top; with
    the MoE block (cfg.is_moe) layers/moe/... as above plus moe/router_scale [L, H], moe/expert_scale [L, E]
    and the norms layers/{mlp_out_norm, moe_norm, moe_out_norm}/scale [L, H]
    Qwen3.5 (cfg.hybrid; models/hybrid.py) stacks its mixers per kind (`hybrid_layer_ids`): layers/attn/{q_proj
    [L_full, H, heads, 2 x D] (query and output gate per head), k_proj, v_proj, q_norm, k_norm, o_proj} over the
    full-attention layers and layers/linear/{in_proj_qkv [L_lin, H, 2 Hk Dk + Hv Dv], in_proj_z [L_lin, H, Hv, Dv],
    in_proj_b / in_proj_a [L_lin, H, Hv], conv1d/kernel [L_lin, K, 2 Hk Dk + Hv Dv], dt_bias, A_log [L_lin, Hv],
    norm/scale [L_lin, Dv], out_proj [L_lin, Hv, Dv, H]} over the gated delta-net layers
    final_norm/scale [H]
    lm_head/kernel [H, V]                  (head="lm", untied only)
    value_head/kernel [H, 1], bias [1]     (head="value")
    score/kernel [H, num_labels]           (head="score"; HF `score.weight`, no bias)
    lora                                   (optional) LoRA adapters, models/lora.py `with_lora`
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm.arrays import ArrayTree, DType
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.dtypes import as_jnp_dtype
from jaxrl_llm.models.param_axes import axes_at

Array = jax.Array
Initializer = Callable[..., Array]
HEADS = ("lm", "value", "score")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")


def init_head_params(cfg: ModelConfig, rng: Array, *, head: str = "lm", num_labels: int = 1,
                     dtype: DType = jnp.float32) -> dict:
    """Freshly initialised head params (the part of `init_params` outside the backbone)."""
    _check_head(head)
    normal = jax.nn.initializers.normal(cfg.initializer_range)
    h = cfg.hidden_size
    if head == "lm":
        return {} if cfg.tie_word_embeddings else {
            "lm_head": {"kernel": normal(rng, (h, cfg.vocab_size), dtype)}}
    if head == "value":
        return {"value_head": {"kernel": normal(rng, (h, 1), dtype), "bias": jnp.zeros((1,), dtype)}}
    return {"score": {"kernel": normal(rng, (h, num_labels), dtype)}}


def init_params(cfg: ModelConfig, rng: Array, *, head: str = "lm", num_labels: int = 1,
                dtype: DType = jnp.float32) -> dict:
    """Random params (normal(initializer_range) matrices, unit norms) as a plain nested dict."""
    _check_head(head)
    return _init_params_jit(cfg, rng, head, num_labels, as_jnp_dtype(dtype))


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4))
def _init_params_jit(cfg: ModelConfig, rng: Array, head: str, num_labels: int, dtype: DType) -> dict:
    backbone_rng, head_rng = jax.random.split(rng)
    params = init_backbone(cfg, backbone_rng, dtype)
    params.update(init_head_params(cfg, head_rng, head=head, num_labels=num_labels, dtype=dtype))
    return params


def param_logical_axes(cfg: ModelConfig, *, head: str = "lm", num_labels: int = 1) -> dict:
    """Same structure as params; each leaf is a tuple of logical axis names (or None) per dim.

    Leaves are tuples, so map with `is_leaf=lambda x: isinstance(x, tuple)`.
    """
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), head=head,
                                                num_labels=num_labels))

    return jax.tree_util.tree_map_with_path(lambda path, _: axes_at(tuple(p.key for p in path)), shapes)


class _Norm(nn.Module):
    """A norm's scale: ones, or zeros where the norm multiplies by (offset + scale) (Gemma's 1 + w)."""

    size: int
    dtype: DType
    offset: float = 0.0

    @nn.compact
    def __call__(self) -> None:
        self.param("scale", nn.initializers.zeros if self.offset else nn.initializers.ones, (self.size,), self.dtype)


class _Projection(nn.Module):
    """kernel [*inputs, *outputs] drawn as one [prod(inputs), prod(outputs)] matrix (bias zeros)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    use_bias: bool
    initializer: Initializer
    dtype: DType

    @nn.compact
    def __call__(self) -> None:
        matrix = (math.prod(self.inputs), math.prod(self.outputs))
        self.param("kernel", lambda rng, shape, dtype: self.initializer(rng, matrix, dtype).reshape(shape),
                   self.inputs + self.outputs, self.dtype)
        if self.use_bias:
            self.param("bias", nn.initializers.zeros, self.outputs, self.dtype)


class _LayerParams(nn.Module):
    """One layer's params; `mlp`: which MLP it holds ("dense", "moe", or "none" when a mixed-layer
    model stacks its MLPs apart: `_MlpStack`)."""

    cfg: ModelConfig
    dtype: DType
    mlp: str

    @nn.compact
    def __call__(self, carry: None, _: None = None) -> tuple[None, None]:
        cfg, dt = self.cfg, self.dtype
        init = nn.initializers.normal(cfg.initializer_range)
        _Norm(cfg.hidden_size, dt, cfg.norm_offset, name="attn_norm")()
        if cfg.typed_layers:  # the attention and MLP are stacked per kind (`_TypedStack`)
            self.param("layer_scalar", nn.initializers.ones, (), dt)
            if cfg.per_layer_input_size:
                p = cfg.per_layer_input_size
                _Projection((cfg.hidden_size,), (p,), False, init, dt, name="ple_gate")()
                _Projection((p,), (cfg.hidden_size,), False, init, dt, name="ple_proj")()
                _Norm(cfg.hidden_size, dt, cfg.norm_offset, name="ple_norm")()
            if cfg.is_moe:  # the MoE block beside the dense MLP, with its own input and output norms
                _MoeParams(cfg, dt, init, name="moe")()
                for name in ("mlp_out_norm", "moe_norm", "moe_out_norm"):
                    _Norm(cfg.hidden_size, dt, cfg.norm_offset, name=name)()
        elif not cfg.hybrid:  # a hybrid model stacks its attention per layer kind (`_HybridStack`)
            _AttentionParams(cfg, dt, init, name="attn")()
        if cfg.sandwich_norms:
            _Norm(cfg.hidden_size, dt, cfg.norm_offset, name="attn_post_norm")()
            _Norm(cfg.hidden_size, dt, cfg.norm_offset, name="mlp_post_norm")()
        _Norm(cfg.hidden_size, dt, cfg.norm_offset, name="mlp_norm")()
        if self.mlp == "moe":
            _MoeParams(cfg, dt, init, name="moe")()
        elif self.mlp == "dense":
            _MlpParams(cfg.hidden_size, cfg.intermediate_size, dt, init, name="mlp")()
        return carry, None


class _HybridStack(nn.Module):
    """One kind of a Qwen3.5 layer's mixer (`kind`: "attn", the gated full attention; "linear", the gated delta
    net; models/hybrid.py), one scan step per layer of that kind."""

    cfg: ModelConfig
    dtype: DType
    kind: str

    @nn.compact
    def __call__(self, carry: None, _: None = None) -> tuple[None, None]:
        cfg, dt = self.cfg, self.dtype
        init = nn.initializers.normal(cfg.initializer_range)
        h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if self.kind == "attn":  # q_proj: query and output gate per head ([H, heads, 2 x head_dim])
            _Projection((h,), (nh, 2 * hd if cfg.attention_output_gate else hd), cfg.attention_bias, init, dt,
                        name="q_proj")()
            for name in ("k_proj", "v_proj"):
                _Projection((h,), (nkv, hd), cfg.attention_bias, init, dt, name=name)()
            _Norm(hd, dt, cfg.norm_offset, name="q_norm")()
            _Norm(hd, dt, cfg.norm_offset, name="k_norm")()
            _Projection((nh, hd), (h,), cfg.attention_bias, init, dt, name="o_proj")()
            return carry, None
        hv, dk, dv = cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv = 2 * cfg.linear_key_heads * dk + hv * dv
        _Projection((h,), (conv,), False, init, dt, name="in_proj_qkv")()
        _Projection((h,), (hv, dv), False, init, dt, name="in_proj_z")()
        _Projection((h,), (hv,), False, init, dt, name="in_proj_b")()
        _Projection((h,), (hv,), False, init, dt, name="in_proj_a")()
        _Projection((cfg.linear_conv_kernel,), (conv,), False, init, dt, name="conv1d")()
        self.param("dt_bias", nn.initializers.ones, (hv,), dt)
        self.param("A_log", nn.initializers.zeros, (hv,), dt)
        _Norm(dv, dt, name="norm")()  # the gated RMSNorm's plain w
        _Projection((hv, dv), (h,), False, init, dt, name="out_proj")()
        return carry, None


class _MlpStack(nn.Module):
    """A mixed-layer model's MLPs of one kind ("dense" or "moe"), one scan step per layer of that kind."""

    cfg: ModelConfig
    dtype: DType
    kind: str

    @nn.compact
    def __call__(self, carry: None, _: None = None) -> tuple[None, None]:
        init = nn.initializers.normal(self.cfg.initializer_range)
        if self.kind == "moe":
            _MoeParams(self.cfg, self.dtype, init, name="moe")()
        else:
            _MlpParams(self.cfg.hidden_size, self.cfg.intermediate_size, self.dtype, init, name="mlp")()
        return carry, None


class _TypedStack(nn.Module):
    """One Gemma 4 layer kind's weights (`kind`: attn / attn_full, kv / kv_full, mlp / mlp_wide; module doc),
    one scan step per layer of that kind."""

    cfg: ModelConfig
    dtype: DType
    kind: str

    @nn.compact
    def __call__(self, carry: None, _: None = None) -> tuple[None, None]:
        cfg, dt, kind = self.cfg, self.dtype, self.kind
        init = nn.initializers.normal(cfg.initializer_range)
        h, full = cfg.hidden_size, kind.endswith("_full")
        hd = cfg.full_head_dim if full else cfg.head_dim
        if kind.startswith("attn"):
            _Projection((h,), (cfg.num_attention_heads, hd), False, init, dt, name="q_proj")()
            _Norm(hd, dt, cfg.norm_offset, name="q_norm")()
            _Projection((cfg.num_attention_heads, hd), (h,), False, init, dt, name="o_proj")()
        elif kind.startswith("kv"):
            kv = cfg.full_kv_heads if full else cfg.num_key_value_heads
            _Projection((h,), (kv, hd), False, init, dt, name="k_proj")()
            _Norm(hd, dt, cfg.norm_offset, name="k_norm")()
            if not (full and cfg.attention_k_eq_v):
                _Projection((h,), (kv, hd), False, init, dt, name="v_proj")()
        else:
            width = cfg.intermediate_size * (2 if kind == "mlp_wide" else 1)
            _MlpParams(h, width, dt, init, name="mlp")()
        return carry, None


class _AttentionParams(nn.Module):
    cfg: ModelConfig
    dtype: DType
    initializer: Initializer

    @nn.compact
    def __call__(self) -> None:
        cfg, dt = self.cfg, self.dtype
        h, hd = cfg.hidden_size, cfg.head_dim
        if cfg.is_mla:
            _mla_params(cfg, dt, self.initializer)
            return
        for name, heads in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads),
                            ("v_proj", cfg.num_key_value_heads)):
            _Projection((h,), (heads, hd), cfg.attention_bias, self.initializer, dt, name=name)()
        if cfg.qk_norm:
            _Norm(hd, dt, cfg.norm_offset, name="q_norm")()
            _Norm(hd, dt, cfg.norm_offset, name="k_norm")()
        _Projection((cfg.num_attention_heads, hd), (h,), cfg.o_proj_bias, self.initializer, dt, name="o_proj")()
        if cfg.attention_sinks:  # transformers draws them normal(initializer_range)
            self.param("sinks", self.initializer, (cfg.num_attention_heads,), dt)


def _mla_params(cfg: ModelConfig, dt: DType, init: Initializer) -> None:
    """DeepSeek-V3's multi-head latent attention (models/mla.py) in the calling module's (the layer's `attn`)."""
    h, nh, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    qk = cfg.qk_nope_head_dim + cfg.head_dim
    if cfg.q_lora_rank:
        _Projection((h,), (cfg.q_lora_rank,), bias, init, dt, name="q_a_proj")()
        _Norm(cfg.q_lora_rank, dt, name="q_a_norm")()
        _Projection((cfg.q_lora_rank,), (nh, qk), False, init, dt, name="q_b_proj")()
    else:
        _Projection((h,), (nh, qk), False, init, dt, name="q_proj")()
    _Projection((h,), (cfg.kv_lora_rank + cfg.head_dim,), bias, init, dt, name="kv_a_proj_with_mqa")()
    _Norm(cfg.kv_lora_rank, dt, name="kv_a_norm")()
    _Projection((cfg.kv_lora_rank,), (nh, cfg.qk_nope_head_dim + cfg.v_head_dim), False, init, dt,
                name="kv_b_proj")()
    _Projection((nh, cfg.v_head_dim), (h,), bias, init, dt, name="o_proj")()


class _MlpParams(nn.Module):
    hidden: int
    intermediate: int
    dtype: DType
    initializer: Initializer

    @nn.compact
    def __call__(self) -> None:
        h, f = self.hidden, self.intermediate
        for name, (n_in, n_out) in (("gate_proj", (h, f)), ("up_proj", (h, f)), ("down_proj", (f, h))):
            _Projection((n_in,), (n_out,), False, self.initializer, self.dtype, name=name)()


class _MoeParams(nn.Module):
    cfg: ModelConfig
    dtype: DType
    initializer: Initializer

    @nn.compact
    def __call__(self) -> None:
        cfg, dt, init = self.cfg, self.dtype, self.initializer
        h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        _Projection((h,), (e,), cfg.expert_bias, init, dt, name="router")()
        _ExpertParams(h, f, e, dt, init, cfg.expert_bias, name="experts")()
        if cfg.typed_layers:  # Gemma 4's router: a scale on its (RMS-normed) input, one on each expert's weight
            self.param("router_scale", nn.initializers.ones, (h,), dt)
            self.param("expert_scale", nn.initializers.ones, (e,), dt)
        if cfg.router_sigmoid:  # DeepSeek's e_score_correction_bias: chooses experts, weighs none (zeros, as HF)
            self.param("score_bias", nn.initializers.zeros, (e,), dt)
        if cfg.shared_expert_intermediate_size:
            _MlpParams(h, cfg.shared_expert_intermediate_size, dt, init, name="shared_expert")()
            if cfg.shared_expert_gated:
                _Projection((h,), (1,), False, init, dt, name="shared_expert_gate")()


class _ExpertParams(nn.Module):
    """Each expert's SwiGLU weights stacked on a leading expert axis (experts/<proj>/kernel)."""

    hidden: int
    intermediate: int
    experts: int
    dtype: DType
    initializer: Initializer
    use_bias: bool = False

    @nn.compact
    def __call__(self) -> None:
        h, f, e = self.hidden, self.intermediate, self.experts
        for name, shape in (("gate_proj", (e, h, f)), ("up_proj", (e, h, f)), ("down_proj", (e, f, h))):
            _Stacked(shape, self.initializer, self.dtype, self.use_bias, name=name)()


class _Stacked(nn.Module):
    """kernel [E, in, out] (and bias [E, out] zeros)."""

    shape: tuple[int, ...]
    initializer: Initializer
    dtype: DType
    use_bias: bool = False

    @nn.compact
    def __call__(self) -> None:
        self.param("kernel", self.initializer, self.shape, self.dtype)
        if self.use_bias:
            self.param("bias", nn.initializers.zeros, (self.shape[0], self.shape[-1]), self.dtype)


class _BackboneParams(nn.Module):
    cfg: ModelConfig
    dtype: DType

    @nn.compact
    def __call__(self) -> None:
        cfg = self.cfg
        self.param("embedding", nn.initializers.normal(cfg.initializer_range), (cfg.vocab_size, cfg.hidden_size),
                   self.dtype)
        scan = functools.partial(nn.scan, variable_axes={"params": 0}, split_rngs={"params": True})
        mlp = "none" if cfg.mixed_layers or cfg.typed_layers else "moe" if cfg.is_moe else "dense"
        scan(_LayerParams, length=cfg.num_hidden_layers)(cfg, self.dtype, mlp, name="layers")(None)
        _Norm(cfg.hidden_size, self.dtype, cfg.norm_offset, name="final_norm")()
        if cfg.typed_layers:
            for kind, layers in typed_layer_ids(cfg).items():
                scan(_TypedStack, length=len(layers))(cfg, self.dtype, kind, name=f"typed_{kind}")(None)
            if cfg.per_layer_input_size:
                width = cfg.num_hidden_layers * cfg.per_layer_input_size
                self.param("ple_embedding", nn.initializers.normal(cfg.initializer_range),
                           (cfg.per_layer_vocab_size, width), self.dtype)
                _Projection((cfg.hidden_size,), (width,), False, nn.initializers.normal(cfg.initializer_range),
                            self.dtype, name="ple_model_proj")()
                _Norm(cfg.per_layer_input_size, self.dtype, cfg.norm_offset, name="ple_proj_norm")()
        if cfg.hybrid:
            for kind, layers in hybrid_layer_ids(cfg).items():
                scan(_HybridStack, length=len(layers))(cfg, self.dtype, kind, name=f"hybrid_{kind}")(None)
        if cfg.mixed_layers:
            scan(_MlpStack, length=len(cfg.dense_layer_ids))(cfg, self.dtype, "dense", name="dense_mlps")(None)
            scan(_MlpStack, length=len(cfg.moe_layer_ids))(cfg, self.dtype, "moe", name="moe_mlps")(None)


def init_backbone(cfg: ModelConfig, rng: Array, dtype: DType = jnp.float32) -> dict:
    """Random backbone params (normal(initializer_range) matrices, unit norms) as a plain nested dict."""
    variables = _BackboneParams(cfg, dtype).init(rng)
    params = _plain(variables["params"])
    if cfg.mixed_layers:  # the MLP stacks join the layers (layout above)
        params["layers"].update(params.pop("dense_mlps"), **params.pop("moe_mlps"))
    for kind in typed_layer_ids(cfg) if cfg.typed_layers else ():
        stack = params.pop(f"typed_{kind}")
        params["layers"][kind] = stack["mlp"] if kind.startswith("mlp") else stack
    for kind in hybrid_layer_ids(cfg) if cfg.hybrid else ():
        params["layers"][kind] = params.pop(f"hybrid_{kind}")
    return params


def hybrid_layer_ids(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Qwen3.5 model's mixer stacks -> the layers each is stacked over: "attn" (full attention), "linear"
    (gated delta net); the kinds no layer has are left out."""
    kinds = {"attn": cfg.full_attention_layers, "linear": tuple(cfg.linear_layers)}
    return {kind: ids for kind, ids in kinds.items() if ids}


def typed_layer_ids(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Gemma 4 model's weight stacks (module doc) -> the layers each is stacked over, in order; the
    kinds no layer has are left out."""
    every = range(cfg.num_hidden_layers)
    local = set(cfg.local_layer_ids)
    shared = set(range(cfg.first_shared_layer, cfg.num_hidden_layers))
    wide = shared if cfg.double_wide_mlp else set()
    kinds = {"attn": tuple(i for i in every if i in local), "attn_full": tuple(i for i in every if i not in local),
             "kv": cfg.kv_layer_ids(True), "kv_full": cfg.kv_layer_ids(False),
             "mlp": tuple(i for i in every if i not in wide), "mlp_wide": tuple(i for i in every if i in wide)}
    return {kind: ids for kind, ids in kinds.items() if ids}


def _plain(tree: ArrayTree) -> ArrayTree:
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree

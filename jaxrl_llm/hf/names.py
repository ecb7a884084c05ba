"""The one map between our params and Hugging Face tensor names / layouts (import and export).

Each `TensorSpec` names one of our leaves, its HF tensor (with `{i}` for the layer index when the
leaf is stacked over layers, and `{e}` for the expert index when it is stacked over experts too), the
HF shape, and the two layout conversions. HF `nn.Linear` weights
are [out, in]; ours are [in, ...out] split into (heads, head_dim) where attention needs it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.lora import MLP_MODULES
from jaxrl_llm.models.param_init import HEADS, hybrid_layer_ids, typed_layer_ids


class MissingTensorError(KeyError):
    """A tensor the model needs is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class TensorShapeError(ValueError):
    """A checkpoint tensor has a different shape from the one the config implies."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    path: tuple[str, ...]                   # our params path
    hf_name: str                            # HF name; contains "{i}" when stacked over layers
    hf_shape: tuple[int, ...]               # per layer
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    optional: bool = False                  # absent in the file -> keep the fresh init
    experts: int = 0                        # > 0: hf_name has "{e}", our leaf is [L, experts, ...]
    # the HF layer of each row of a stacked leaf (None: every layer; a mixed-layer MoE model's dense MLPs
    # and experts are stacked over their own layers, models/param_init.py)
    layer_ids: tuple[int, ...] | None = None
    # several of our leaves interleaved along the HF tensor's last axis (GPT-OSS's experts' gate_up_proj:
    # gate at even, up at odd columns): every part's leaf path in order; this spec is part `part` (its
    # to_ours takes every len(parts)-th column). Export writes the tensor once, from part 0.
    parts: tuple[tuple[str, ...], ...] = ()
    part: int = 0
    # how export makes the HF tensor of the parts' leaves (None: interleaved columns, `interleave_parts`)
    join: Callable[[list[np.ndarray]], np.ndarray] | None = None

    @property
    def layered(self) -> bool:
        return "{i}" in self.hf_name

    def _layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        return tuple(range(cfg.num_hidden_layers)) if self.layer_ids is None else self.layer_ids

    def our_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        per_tensor = self.to_ours(np.zeros(self.hf_shape, np.float32)).shape
        stacked = ((len(self._layers(cfg)),) if self.layered else ()) + ((self.experts,) if self.experts else ())
        return stacked + per_tensor

    def units(self, cfg: ModelConfig) -> list[tuple[tuple[int, ...], str]]:
        """(index into our leaf, HF tensor name) of every HF tensor this leaf holds."""
        if not self.layered:
            return [((), self.hf_name)]
        out = []
        for row, i in enumerate(self._layers(cfg)):
            if self.experts:
                out += [((row, e), self.hf_name.format(i=i, e=e)) for e in range(self.experts)]
            else:
                out.append(((row,), self.hf_name.format(i=i)))
        return out

    def check(self, name: str, array_shape: tuple[int, ...]) -> None:
        if tuple(array_shape) != tuple(self.hf_shape):
            raise TensorShapeError(
                f"tensor {name!r} has shape {tuple(array_shape)}, expected {tuple(self.hf_shape)}")


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def interleave_parts(parts: list[np.ndarray]) -> np.ndarray:
    """The HF tensor of interleaved parts (each [..., F]) -> [..., len(parts) * F], part k at columns k::n."""
    return np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)


def _linear(in_dim: int, out_shape: tuple[int, ...]) -> tuple[Callable, Callable]:
    """HF [prod(out), in] <-> ours [in, *out]."""
    return (lambda w: w.T.reshape(in_dim, *out_shape),
            lambda k: k.reshape(in_dim, -1).T)


def _linear_in_heads(in_shape: tuple[int, ...], out_dim: int) -> tuple[Callable, Callable]:
    """HF [out, prod(in)] <-> ours [*in, out] (o_proj)."""
    return (lambda w: w.T.reshape(*in_shape, out_dim),
            lambda k: k.reshape(-1, out_dim).T)


def _mlp_tensor(proj: str, hidden: int, width: int) -> tuple[tuple[int, ...], tuple[Callable, Callable]]:
    """(HF shape, conversions) of one SwiGLU projection: gate / up [width, hidden], down [hidden, width]."""
    if proj == "down_proj":
        return (hidden, width), _linear(width, (hidden,))
    return (width, hidden), _linear(hidden, (width,))


def tensor_specs(cfg: ModelConfig, *, head: str = "lm", num_labels: int = 1) -> list[TensorSpec]:
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; expected one of {HEADS}")
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    lay = "model.layers.{i}."
    specs = [TensorSpec(("embedding",), "model.embed_tokens.weight", (cfg.vocab_size, h),
                        _identity, _identity),
             TensorSpec(("final_norm", "scale"), "model.norm.weight", (h,), _identity, _identity)]

    def layer(path: tuple[str, ...], name: str, shape: tuple[int, ...], conv=None, layer_ids=None) -> None:
        to_ours, to_hf = conv or (_identity, _identity)
        specs.append(TensorSpec(("layers",) + path, lay + name, shape, to_ours, to_hf, layer_ids=layer_ids))

    layer(("attn_norm", "scale"), "input_layernorm.weight", (h,))
    if cfg.sandwich_norms:  # Gemma: post_attention_layernorm is the attention's output norm
        layer(("attn_post_norm", "scale"), "post_attention_layernorm.weight", (h,))
        layer(("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", (h,))
        layer(("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", (h,))
    else:
        layer(("mlp_norm", "scale"), "post_attention_layernorm.weight", (h,))
    if cfg.typed_layers:
        specs += _gemma4_specs(cfg)
    if cfg.is_mla:
        specs += _mla_specs(cfg)
    if cfg.hybrid:
        specs += _hybrid_specs(cfg)
    stacked_attention = cfg.typed_layers or cfg.is_mla or cfg.hybrid  # their attention tensors: the specs above
    for proj, heads in () if stacked_attention else (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
        layer(("attn", proj, "kernel"), f"self_attn.{proj}.weight", (heads * d, h),
              _linear(h, (heads, d)))
        if cfg.attention_bias:
            layer(("attn", proj, "bias"), f"self_attn.{proj}.bias", (heads * d,),
                  (lambda b, n=heads: b.reshape(n, d), lambda b: b.reshape(-1)))
    if not stacked_attention:
        layer(("attn", "o_proj", "kernel"), "self_attn.o_proj.weight", (h, nh * d), _linear_in_heads((nh, d), h))
    if cfg.o_proj_bias:
        layer(("attn", "o_proj", "bias"), "self_attn.o_proj.bias", (h,))
    if cfg.attention_sinks:
        layer(("attn", "sinks"), "self_attn.sinks", (nh,))
    if cfg.qk_norm and not stacked_attention:
        layer(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", (d,))
        layer(("attn", "k_norm", "scale"), "self_attn.k_norm.weight", (d,))
    if cfg.is_moe and not cfg.typed_layers:
        specs += _moe_specs(cfg)
    for proj in MLP_MODULES if cfg.dense_layer_ids and not cfg.typed_layers else ():  # mixed: its dense layers
        layer(("mlp", proj, "kernel"), f"mlp.{proj}.weight", *_mlp_tensor(proj, h, f), layer_ids=cfg.dense_layer_ids)

    transpose = (lambda w: w.T, lambda k: k.T)
    if head == "lm" and not cfg.tie_word_embeddings:
        specs.append(TensorSpec(("lm_head", "kernel"), "lm_head.weight", (cfg.vocab_size, h),
                                *transpose))
    elif head == "score":
        specs.append(TensorSpec(("score", "kernel"), "score.weight", (num_labels, h), *transpose))
    elif head == "value":  # a critic / reward checkpoint's 1-label `score` initialises the value head
        specs.append(TensorSpec(("value_head", "kernel"), "score.weight", (1, h), *transpose,
                                optional=True))
        specs.append(TensorSpec(("value_head", "bias"), "score.bias", (1,), _identity, _identity,
                                optional=True))
    return specs


def _hybrid_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Qwen3.5's mixers, each kind stacked over its own layers (models/param_init.py `hybrid_layer_ids`): the
    gated attention (`self_attn.*`, q_proj holding query and gate per head) and the gated delta net
    (`linear_attn.*`: the conv's [C, 1, K] weight as our [K, C] taps)."""
    h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hv, dk, dv = cfg.linear_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv, taps = 2 * cfg.linear_key_heads * dk + hv * dv, cfg.linear_conv_kernel
    lay = "model.layers.{i}."
    specs: list[TensorSpec] = []
    kinds = hybrid_layer_ids(cfg)

    def spec(kind: str, path: tuple[str, ...], name: str, shape: tuple[int, ...], conv_=None) -> None:
        to_ours, to_hf = conv_ or (_identity, _identity)
        specs.append(TensorSpec(("layers", kind) + path, lay + name, shape, to_ours, to_hf, layer_ids=kinds[kind]))

    if "attn" in kinds:
        qw = 2 * d if cfg.attention_output_gate else d
        for proj, heads, width in (("q_proj", nh, qw), ("k_proj", nkv, d), ("v_proj", nkv, d)):
            spec("attn", (proj, "kernel"), f"self_attn.{proj}.weight", (heads * width, h), _linear(h, (heads, width)))
            if cfg.attention_bias:
                spec("attn", (proj, "bias"), f"self_attn.{proj}.bias", (heads * width,),
                     (lambda b, n=heads, w=width: b.reshape(n, w), lambda b: b.reshape(-1)))
        spec("attn", ("o_proj", "kernel"), "self_attn.o_proj.weight", (h, nh * d), _linear_in_heads((nh, d), h))
        if cfg.attention_bias:
            spec("attn", ("o_proj", "bias"), "self_attn.o_proj.bias", (h,))
        spec("attn", ("q_norm", "scale"), "self_attn.q_norm.weight", (d,))
        spec("attn", ("k_norm", "scale"), "self_attn.k_norm.weight", (d,))
    if "linear" in kinds:
        for name, out in (("in_proj_qkv", (conv,)), ("in_proj_z", (hv, dv)), ("in_proj_b", (hv,)),
                          ("in_proj_a", (hv,))):
            spec("linear", (name, "kernel"), f"linear_attn.{name}.weight", (int(np.prod(out)), h), _linear(h, out))
        spec("linear", ("conv1d", "kernel"), "linear_attn.conv1d.weight", (conv, 1, taps),
             (lambda w: w[:, 0].T, lambda k: k.T[:, None]))
        spec("linear", ("dt_bias",), "linear_attn.dt_bias", (hv,))
        spec("linear", ("A_log",), "linear_attn.A_log", (hv,))
        spec("linear", ("norm", "scale"), "linear_attn.norm.weight", (dv,))
        spec("linear", ("out_proj", "kernel"), "linear_attn.out_proj.weight", (h, hv * dv),
             _linear_in_heads((hv, dv), h))
    return specs


def _mla_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """DeepSeek-V3's multi-head latent attention (models/mla.py): the q bottleneck (or one q_proj), the
    latent's down projection with the rope key (`kv_a_proj_with_mqa`), its norm, the per-head expansion and
    o_proj (biases on the down projections and o_proj with attention_bias)."""
    h, nh, lay = cfg.hidden_size, cfg.num_attention_heads, "model.layers.{i}.self_attn."
    qk, vd, r = cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    specs: list[TensorSpec] = []

    def spec(ours: str, theirs: str, shape: tuple[int, ...], conv=None, leaf: str = "kernel") -> None:
        to_ours, to_hf = conv or (_identity, _identity)
        specs.append(TensorSpec(("layers", "attn", ours, leaf), lay + theirs, shape, to_ours, to_hf))

    down = [("kv_a_proj_with_mqa", "kv_a_proj_with_mqa", r + cfg.head_dim)]
    if cfg.q_lora_rank:
        down.append(("q_a_proj", "q_a_proj", cfg.q_lora_rank))
        spec("q_a_norm", "q_a_layernorm.weight", (cfg.q_lora_rank,), leaf="scale")
        spec("q_b_proj", "q_b_proj.weight", (nh * qk, cfg.q_lora_rank), _linear(cfg.q_lora_rank, (nh, qk)))
    else:
        spec("q_proj", "q_proj.weight", (nh * qk, h), _linear(h, (nh, qk)))
    for ours, theirs, width in down:
        spec(ours, f"{theirs}.weight", (width, h), _linear(h, (width,)))
        if cfg.attention_bias:
            spec(ours, f"{theirs}.bias", (width,), leaf="bias")
    spec("kv_a_norm", "kv_a_layernorm.weight", (r,), leaf="scale")
    spec("kv_b_proj", "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + vd), r),
         _linear(r, (nh, cfg.qk_nope_head_dim + vd)))
    spec("o_proj", "o_proj.weight", (h, nh * vd), _linear_in_heads((nh, vd), h))
    if cfg.attention_bias:
        spec("o_proj", "o_proj.bias", (h,), leaf="bias")
    return specs


def _gemma4_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """A Gemma 4 model's tensors beyond the norms: the attention and MLP of each layer kind (stacked over
    its own layers, models/param_init.py), the layer scalars and the per-layer-input weights."""
    h, nh, lay = cfg.hidden_size, cfg.num_attention_heads, "model.layers.{i}."
    kinds = typed_layer_ids(cfg)
    specs = [TensorSpec(("layers", "layer_scalar"), lay + "layer_scalar", (1,), lambda w: w.reshape(()),
                        lambda k: k.reshape(1))]
    for kind, ids in kinds.items():
        full = kind.endswith("_full")
        d = cfg.full_head_dim if full else cfg.head_dim
        kv = cfg.full_kv_heads if full else cfg.num_key_value_heads

        def spec(path: tuple[str, ...], name: str, shape: tuple[int, ...], conv=None) -> None:
            to_ours, to_hf = conv or (_identity, _identity)
            specs.append(TensorSpec(("layers", kind) + path, lay + name, shape, to_ours, to_hf, layer_ids=ids))

        if kind.startswith("attn"):
            spec(("q_proj", "kernel"), "self_attn.q_proj.weight", (nh * d, h), _linear(h, (nh, d)))
            spec(("q_norm", "scale"), "self_attn.q_norm.weight", (d,))
            spec(("o_proj", "kernel"), "self_attn.o_proj.weight", (h, nh * d), _linear_in_heads((nh, d), h))
        elif kind.startswith("kv"):
            for proj in ("k_proj",) if full and cfg.attention_k_eq_v else ("k_proj", "v_proj"):
                spec((proj, "kernel"), f"self_attn.{proj}.weight", (kv * d, h), _linear(h, (kv, d)))
            spec(("k_norm", "scale"), "self_attn.k_norm.weight", (d,))
        else:
            width = cfg.intermediate_size * (2 if kind == "mlp_wide" else 1)
            for proj in MLP_MODULES:
                spec((proj, "kernel"), f"mlp.{proj}.weight", *_mlp_tensor(proj, h, width))
    if cfg.is_moe:
        specs += _gemma4_moe_specs(cfg)
    p = cfg.per_layer_input_size
    if p:
        width = cfg.num_hidden_layers * p
        for path, name, shape, conv in (
                (("ple_gate", "kernel"), "per_layer_input_gate.weight", (p, h), _linear(h, (p,))),
                (("ple_proj", "kernel"), "per_layer_projection.weight", (h, p), _linear(p, (h,))),
                (("ple_norm", "scale"), "post_per_layer_input_norm.weight", (h,), (_identity, _identity))):
            specs.append(TensorSpec(("layers",) + path, lay + name, shape, *conv))
        specs += [TensorSpec(("ple_embedding",), "model.embed_tokens_per_layer.weight",
                             (cfg.per_layer_vocab_size, width), _identity, _identity),
                  TensorSpec(("ple_model_proj", "kernel"), "model.per_layer_model_projection.weight", (width, h),
                             *_linear(h, (width,))),
                  TensorSpec(("ple_proj_norm", "scale"), "model.per_layer_projection_norm.weight", (p,),
                             _identity, _identity)]
    return specs


def _gemma4_moe_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Gemma 4's MoE block (beside each layer's MLP): `router.{proj.weight, scale, per_expert_scale}`, the
    experts as one [E, out, in] tensor per layer with gate and up stacked in `gate_up_proj` (gate the first
    half of its rows), and the block's three norms."""
    h, e = cfg.hidden_size, cfg.num_experts
    lay, root = "model.layers.{i}.", ("layers", "moe")
    specs = [TensorSpec(root + ("router", "kernel"), lay + "router.proj.weight", (e, h), *_linear(h, (e,))),
             TensorSpec(root + ("router_scale",), lay + "router.scale", (h,), _identity, _identity),
             TensorSpec(root + ("expert_scale",), lay + "router.per_expert_scale", (e,), _identity, _identity),
             *_fused_expert_specs(cfg, lay + "experts.")]
    for ours, theirs in (("mlp_out_norm", "post_feedforward_layernorm_1"), ("moe_norm", "pre_feedforward_layernorm_2"),
                         ("moe_out_norm", "post_feedforward_layernorm_2")):
        specs.append(TensorSpec(("layers", ours, "scale"), lay + theirs + ".weight", (h,), _identity, _identity))
    return specs


def _fused_expert_specs(cfg: ModelConfig, prefix: str, layer_ids: tuple[int, ...] | None = None
                        ) -> list[TensorSpec]:
    """Experts as Gemma 4's checkpoints store them: one [E, out, in] tensor per layer for all experts, gate and up
    stacked in `gate_up_proj` (gate the first half of its rows)."""
    h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    root = ("layers", "moe")
    swap = (lambda w: w.transpose(0, 2, 1), lambda k: k.transpose(0, 2, 1))  # [E, out, in] <-> [E, in, out]
    gate_up = (("experts", "gate_proj", "kernel"), ("experts", "up_proj", "kernel"))
    specs = [TensorSpec(root + ("experts", "down_proj", "kernel"), prefix + "down_proj", (e, h, f), *swap,
                        layer_ids=layer_ids)]
    for k, part in enumerate(gate_up):
        specs.append(TensorSpec(root + part, prefix + "gate_up_proj", (e, 2 * f, h),
                                lambda w, k=k: w[:, k * f:(k + 1) * f].transpose(0, 2, 1), swap[1],
                                parts=tuple(root + p for p in gate_up), part=k, join=_stacked_rows,
                                layer_ids=layer_ids))
    return specs


def _stacked_rows(parts: list[np.ndarray]) -> np.ndarray:
    """Gemma 4's gate_up_proj [E, 2F, H] from our gate and up [E, H, F]: gate's rows, then up's."""
    return np.concatenate([p.transpose(0, 2, 1) for p in parts], axis=1)


def _moe_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """A MoE layer's tensors as the checkpoints on the Hub store them (one tensor per expert; Mixtral's
    `block_sparse_moe.experts.{e}.w1 / w3 / w2` are gate / up / down), which transformers 4 loads as
    they are and transformers 5 fuses on load and splits again on save."""
    h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    lay = "model.layers.{i}."
    if cfg.model_type == "gpt_oss":
        return _gpt_oss_moe_specs(cfg)
    mixtral = cfg.model_type == "mixtral"
    block = lay + ("block_sparse_moe." if mixtral else "mlp.")
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {m: m for m in MLP_MODULES}
    ids = cfg.moe_layer_ids
    specs = [TensorSpec(("layers", "moe", "router", "kernel"), block + "gate.weight", (e, h), *_linear(h, (e,)),
                        layer_ids=ids)]
    if cfg.experts_fused:  # Qwen3-VL-MoE: each layer's experts in two tensors (as Gemma 4's)
        return specs + _fused_expert_specs(cfg, block + "experts.", layer_ids=ids)
    for ours, theirs in names.items():
        shape, conv = _mlp_tensor(ours, h, f)
        specs.append(TensorSpec(("layers", "moe", "experts", ours, "kernel"), block + f"experts.{{e}}.{theirs}.weight",
                                shape, *conv, experts=e, layer_ids=ids))
    if cfg.router_sigmoid:  # DeepSeek's correction bias, a buffer of the router (`gate`)
        specs.append(TensorSpec(("layers", "moe", "score_bias"), block + "gate.e_score_correction_bias", (e,),
                                _identity, _identity, layer_ids=ids))
    fs = cfg.shared_expert_intermediate_size
    shared = "shared_expert" if cfg.shared_expert_gated else "shared_experts"  # Qwen2-MoE's name, DeepSeek's
    if fs:
        for ours in MLP_MODULES:
            shape, conv = _mlp_tensor(ours, h, fs)
            specs.append(TensorSpec(("layers", "moe", "shared_expert", ours, "kernel"),
                                    block + f"{shared}.{ours}.weight", shape, *conv, layer_ids=ids))
    if fs and cfg.shared_expert_gated:
        specs.append(TensorSpec(("layers", "moe", "shared_expert_gate", "kernel"), block + "shared_expert_gate.weight",
                                (1, h), *_linear(h, (1,)), layer_ids=ids))
    return specs


def _gpt_oss_moe_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """GPT-OSS's experts as its checkpoints store them: one tensor per layer for all experts, [E, in, out]
    (our layout), gate and up interleaved in `gate_up_proj` (gate at even columns), every projection with
    a bias, and a biased router `mlp.router` (MXFP4 checkpoints: hf/hf_folder.py dequantises the blocks)."""
    h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    block = "model.layers.{i}.mlp."
    root = ("layers", "moe")
    specs = [TensorSpec(root + ("router", "kernel"), block + "router.weight", (e, h), *_linear(h, (e,))),
             TensorSpec(root + ("router", "bias"), block + "router.bias", (e,), _identity, _identity)]
    for leaf, suffix, shape in (("kernel", "", (e, h, 2 * f)), ("bias", "_bias", (e, 2 * f))):
        parts = (root + ("experts", "gate_proj", leaf), root + ("experts", "up_proj", leaf))
        for k, path in enumerate(parts):
            specs.append(TensorSpec(path, block + f"experts.gate_up_proj{suffix}", shape,
                                    lambda w, k=k: w[..., k::2], _identity, parts=parts, part=k))
    specs.append(TensorSpec(root + ("experts", "down_proj", "kernel"), block + "experts.down_proj", (e, f, h),
                            _identity, _identity))
    specs.append(TensorSpec(root + ("experts", "down_proj", "bias"), block + "experts.down_proj_bias", (e, h),
                            _identity, _identity))
    return specs


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree

"""Gemma 3's vision tower: SigLIP (patches -> ViT blocks over the whole image) and the multimodal projector (average
pooling to `mm_tokens_per_image` tokens, RMSNorm, one matmul into the text model's width), as transformers'
`SiglipVisionModel` and `Gemma3MultiModalProjector` compute them.

Input: the processor's `pixel_values` [N, C, S, S] (every image resized to S = image_size, normalised); output
[N, mm_tokens_per_image, text hidden] fp32: an image token's embedding each (the text model does not scale them as
it scales its token embeddings).

- Patch embedding: a P x P convolution with stride P as one matmul over each patch's C x P x P pixels, plus a bias
  and the learned position embedding of each of the (S / P)^2 patches (no resampling: every image is S x S).
- Blocks: LayerNorm (with bias), q / k / v with biases, softmax attention over the image's patches (no mask: each
  image is its own sequence), output projection, LayerNorm, fc1 -> GELU (tanh) -> fc2; the post LayerNorm.
- Projector: the (S / P) x (S / P) patch grid average-pooled in k x k squares (k = (S / P) / sqrt(tokens)), each
  pooled vector RMS-normed with Gemma's (1 + w) scale, then times `mm_input_projection_weight` [hidden, text].
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.vision.qwen_vit import TensorLookup, first_prefix, tensor_reader

Array = jax.Array
# transformers 5's module paths, the released checkpoints', transformers 5's saved files' (the tower, the projector)
SIGLIP_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "vision_tower.",
                   "model.vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    """A Gemma 3 `vision_config` (SigLIP's keys this tower reads) with the projector's sizes from the top level."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int  # the text model's hidden size (the projector's output)
    image_size: int = 896
    patch_size: int = 14
    in_channels: int = 3
    layer_norm_eps: float = 1e-6
    mm_tokens_per_image: int = 256
    spatial_merge_size: int = 1  # no merge: the pooling sets the token count (`VisionLanguage`'s shared field)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @property
    def pool(self) -> int:
        """The side of the square of patches one image token averages."""
        return self.patches_per_side // self.tokens_per_side

    @classmethod
    def from_hf(cls, vision: Mapping[str, Any], *, text_hidden_size: int, mm_tokens_per_image: int = 256
                ) -> SiglipVisionConfig:
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act={act!r}: Gemma 3's SigLIP tower's MLP is GELU (tanh)")
        cfg = cls(depth=int(vision.get("num_hidden_layers", 27)), hidden_size=int(vision.get("hidden_size", 1152)),
                  num_heads=int(vision.get("num_attention_heads", 16)),
                  intermediate_size=int(vision.get("intermediate_size", 4304)), out_hidden_size=int(text_hidden_size),
                  image_size=int(vision.get("image_size", 896)), patch_size=int(vision.get("patch_size", 14)),
                  in_channels=int(vision.get("num_channels", 3)),
                  layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
                  mm_tokens_per_image=int(mm_tokens_per_image))
        side, tokens = cfg.patches_per_side, cfg.tokens_per_side
        if tokens * tokens != cfg.mm_tokens_per_image or side % tokens:
            raise ValueError(f"mm_tokens_per_image={cfg.mm_tokens_per_image}: must be a square whose side divides the "
                             f"{side} x {side} patch grid (image_size {cfg.image_size} / patch_size {cfg.patch_size})")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` transformers reads back to this tower (the projector's sizes live at the top level)."""
        return {"model_type": "siglip_vision_model", "num_hidden_layers": self.depth, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
                "image_size": self.image_size, "patch_size": self.patch_size, "num_channels": self.in_channels,
                "layer_norm_eps": self.layer_norm_eps, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False}


def init_siglip_params(cfg: SiglipVisionConfig, rng: Array, std: float = 0.02) -> dict[str, Any]:
    """Random fp32 tower + projector params (normal(std) matrices, zero biases, unit LayerNorms, a zero projector
    norm: scale 1 + 0) in `siglip_features`' layout."""
    keys = iter(jax.random.split(rng, 8))
    d, h, i = cfg.depth, cfg.hidden_size, cfg.intermediate_size
    patch = cfg.in_channels * cfg.patch_size ** 2

    def normal(*shape: int) -> Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = {"norm1": jnp.ones((d, h)), "norm1_bias": jnp.zeros((d, h)),
              "norm2": jnp.ones((d, h)), "norm2_bias": jnp.zeros((d, h)),
              "qkv": normal(d, h, 3 * h), "qkv_bias": jnp.zeros((d, 3 * h)),
              "proj": normal(d, h, h), "proj_bias": jnp.zeros((d, h)),
              "fc1": normal(d, h, i), "fc1_bias": jnp.zeros((d, i)),
              "fc2": normal(d, i, h), "fc2_bias": jnp.zeros((d, h))}
    return {"patch_embed": normal(patch, h), "patch_bias": jnp.zeros((h,)),
            "position": normal(cfg.patches_per_side ** 2, h), "blocks": blocks,
            "post_norm": jnp.ones((h,)), "post_norm_bias": jnp.zeros((h,)),
            "projector": {"norm": jnp.zeros((h,)), "kernel": normal(h, cfg.out_hidden_size)}}


def _linear(x: Array, kernel: Array, bias: Array | None, dtype: DType) -> Array:
    out = jnp.einsum("...i,io->...o", x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    return out if bias is None else out + bias.astype(jnp.float32)


def _layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


def patches_of(cfg: SiglipVisionConfig, pixel_values: Array) -> Array:
    """[N, C, S, S] -> [N, (S / P)^2, C x P x P]: each patch's pixels in the convolution weight's (C, P, P) order,
    patches row-major (the convolution's output flattened)."""
    n, c, s, _ = pixel_values.shape
    p, side = cfg.patch_size, cfg.patches_per_side
    if s != cfg.image_size or pixel_values.shape[3] != cfg.image_size:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: Gemma 3's tower takes {cfg.image_size} x "
                         f"{cfg.image_size} images (the processor resizes them)")
    x = pixel_values.reshape(n, c, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(n, side * side, c * p * p)


def siglip_features(params: Mapping[str, Any], cfg: SiglipVisionConfig, pixel_values: Array, *,
                    dtype: DType = jnp.float32) -> Array:
    """[N, mm_tokens_per_image, out_hidden_size] fp32 image-token embeddings of `pixel_values` [N, C, S, S]
    (module doc)."""
    heads, hd, eps = cfg.num_heads, cfg.head_dim, cfg.layer_norm_eps
    patches = patches_of(cfg, jnp.asarray(pixel_values, jnp.float32))
    n, t = patches.shape[:2]
    x = _linear(patches, params["patch_embed"], params["patch_bias"], dtype) + params["position"].astype(jnp.float32)

    def block(x: Array, p: Mapping[str, Any]) -> tuple[Array, None]:
        h = _layer_norm(x, p["norm1"], p["norm1_bias"], eps)
        qkv = _linear(h, p["qkv"], p["qkv_bias"], dtype).reshape(n, t, 3, heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("nqhd,nkhd->nhqk", q.astype(dtype), k.astype(dtype),
                            preferred_element_type=jnp.float32) * hd ** -0.5
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("nhqk,nkhd->nqhd", probs.astype(dtype), v.astype(dtype),
                         preferred_element_type=jnp.float32).reshape(n, t, heads * hd)
        x = x + _linear(out, p["proj"], p["proj_bias"], dtype)
        h = _layer_norm(x, p["norm2"], p["norm2_bias"], eps)
        h = jax.nn.gelu(_linear(h, p["fc1"], p["fc1_bias"], dtype), approximate=True)
        return x + _linear(h, p["fc2"], p["fc2_bias"], dtype), None

    x, _ = lax.scan(jax.checkpoint(block), x, params["blocks"])  # a trained tower's backward: each block's input only
    x = _layer_norm(x, params["post_norm"], params["post_norm_bias"], eps)
    # the projector: k x k average pooling of the patch grid, Gemma's RMSNorm (1 + w), the projection
    tokens, k = cfg.tokens_per_side, cfg.pool
    pooled = x.reshape(n, tokens, k, tokens, k, -1).mean(axis=(2, 4)).reshape(n, tokens * tokens, -1)
    normed = pooled * lax.rsqrt(jnp.square(pooled).mean(-1, keepdims=True) + eps)
    normed = normed * (1.0 + params["projector"]["norm"].astype(jnp.float32))
    return _linear(normed, params["projector"]["kernel"], None, dtype)


# ours -> (transformers' name under the encoder layer, transposed)
_BLOCK_WEIGHTS = {"norm1": ("layer_norm1.weight", False), "norm1_bias": ("layer_norm1.bias", False),
                  "norm2": ("layer_norm2.weight", False), "norm2_bias": ("layer_norm2.bias", False),
                  "proj": ("self_attn.out_proj.weight", True), "proj_bias": ("self_attn.out_proj.bias", False),
                  "fc1": ("mlp.fc1.weight", True), "fc1_bias": ("mlp.fc1.bias", False),
                  "fc2": ("mlp.fc2.weight", True), "fc2_bias": ("mlp.fc2.bias", False)}
_QKV = ("q_proj", "k_proj", "v_proj")
BLOCK_MODULES = "model.vision_tower.encoder.layers.{i}."  # block i in transformers 5's model (no vision_model)


def siglip_block_linears(cfg: SiglipVisionConfig) -> dict[str, tuple[tuple[str, int, int | None], ...]]:
    """Each block kernel of ours -> the transformers Linear(s) it is, (module under the block, first output column,
    end: None for all): our fused qkv is SigLIP's three projections side by side (a PEFT adapter on each:
    hf/peft.py)."""
    h = cfg.hidden_size
    out: dict[str, tuple[tuple[str, int, int | None], ...]] = {
        ours: ((hf.removesuffix(".weight"), 0, None),) for ours, (hf, transposed) in _BLOCK_WEIGHTS.items()
        if transposed}
    out["qkv"] = tuple((f"self_attn.{name}", j * h, (j + 1) * h) for j, name in enumerate(_QKV))
    return out


def siglip_params_from_hf(tensors: TensorLookup, cfg: SiglipVisionConfig) -> dict[str, Any]:
    """Our params from a state dict (name -> array) of a Gemma 3 checkpoint (`vision_tower.vision_model.*` and
    `multi_modal_projector.*`, with or without transformers 5's `model.` in front). A missing tensor is a KeyError
    naming it."""
    tower = first_prefix(tensors, SIGLIP_PREFIXES, "embeddings.patch_embedding.weight")
    projector = first_prefix(tensors, PROJECTOR_PREFIXES, "mm_input_projection_weight")
    get = tensor_reader(tensors)

    layer = lambda i, name: f"{tower}encoder.layers.{i}.{name}"  # noqa: E731
    blocks = {ours: np.stack([get(layer(i, name), t) for i in range(cfg.depth)])
              for ours, (name, t) in _BLOCK_WEIGHTS.items()}
    blocks["qkv"] = np.stack([np.concatenate([get(layer(i, f"self_attn.{n}.weight"), True) for n in _QKV], axis=1)
                              for i in range(cfg.depth)])
    blocks["qkv_bias"] = np.stack([np.concatenate([get(layer(i, f"self_attn.{n}.bias")) for n in _QKV])
                                   for i in range(cfg.depth)])
    patch = get(f"{tower}embeddings.patch_embedding.weight")  # [hidden, C, P, P]
    return {"patch_embed": patch.reshape(patch.shape[0], -1).T,
            "patch_bias": get(f"{tower}embeddings.patch_embedding.bias"),
            "position": get(f"{tower}embeddings.position_embedding.weight"), "blocks": blocks,
            "post_norm": get(f"{tower}post_layernorm.weight"), "post_norm_bias": get(f"{tower}post_layernorm.bias"),
            "projector": {"norm": get(f"{projector}mm_soft_emb_norm.weight"),
                          "kernel": get(f"{projector}mm_input_projection_weight")}}


def siglip_params_to_hf(params: Mapping[str, Any], cfg: SiglipVisionConfig, prefix: str = "model."
                        ) -> dict[str, np.ndarray]:
    """The tower's and projector's tensors under transformers' names (`{prefix}vision_tower.vision_model.*`,
    `{prefix}multi_modal_projector.*`), fp32: the inverse of `siglip_params_from_hf`."""
    tower, h = f"{prefix}vision_tower.vision_model.", cfg.hidden_size
    array = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {f"{tower}embeddings.patch_embedding.weight": array(params["patch_embed"]).T.reshape(
               h, cfg.in_channels, cfg.patch_size, cfg.patch_size),
           f"{tower}embeddings.patch_embedding.bias": array(params["patch_bias"]),
           f"{tower}embeddings.position_embedding.weight": array(params["position"]),
           f"{tower}post_layernorm.weight": array(params["post_norm"]),
           f"{tower}post_layernorm.bias": array(params["post_norm_bias"]),
           f"{prefix}multi_modal_projector.mm_soft_emb_norm.weight": array(params["projector"]["norm"]),
           f"{prefix}multi_modal_projector.mm_input_projection_weight": array(params["projector"]["kernel"])}
    blocks = params["blocks"]
    for i in range(cfg.depth):
        layer = f"{tower}encoder.layers.{i}."
        for ours, (name, transpose) in _BLOCK_WEIGHTS.items():
            value = array(blocks[ours][i])
            out[layer + name] = value.T if transpose else value
        qkv, qkv_bias = array(blocks["qkv"][i]), array(blocks["qkv_bias"][i])
        for j, name in enumerate(_QKV):
            out[f"{layer}self_attn.{name}.weight"] = qkv[:, j * h:(j + 1) * h].T
            out[f"{layer}self_attn.{name}.bias"] = qkv_bias[j * h:(j + 1) * h]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}

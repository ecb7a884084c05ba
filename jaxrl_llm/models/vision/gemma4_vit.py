"""Gemma 4's vision tower: variable-resolution patches -> ViT blocks with 2-D RoPE -> position-aware pooling -> the
multimodal embedder, as transformers' `Gemma4VisionModel` and `Gemma4MultimodalEmbedder` compute them.

Input: the processor's `pixel_values` [N, max_patches, P x P x C] (each image resized keeping its aspect ratio to
at most max_soft_tokens x k^2 patches, its sides multiples of k x P; patches row-major, each patch's pixels in
(row, column, channel) order, zero padding after the real ones) and each image's patch grid (rows, columns), from
which `patch_positions` gives the (x, y) of every patch ((-1, -1) on padding). Output [N, max_soft_tokens, text
hidden] fp32: an image's first (rows / k) x (columns / k) tokens are its features (row-major over the pooled grid),
the rest padding nothing reads.

- Patch embedding: pixels scaled to [-1, 1] (2 x (p - 0.5); the processor only rescales to [0, 1]), one matmul
  without bias, plus a learned table per axis: table[0][x] + table[1][y] (zero on padding).
- Blocks: Gemma's plain-w RMSNorm around attention and MLP (pre and post, the sandwich), q / k RMS-normed per head
  with a scale and v without one, 2-D RoPE (the first half of each head turned by x, the second by y: head_dim / 4
  frequencies of base rope_theta per axis), scores unscaled (q . k), softmax over the image's real patches
  (bidirectional; padding keys masked), a GeGLU (tanh) MLP. `use_clipped_linears`: every projection clamps its input
  and its output to the checkpoint's per-linear bounds (buffers, not trained here: their gradient is stopped).
- Pooling: the k x k patches of each pooled cell averaged (cell = (x // k) + (columns / k) x (y // k), read from the
  positions as transformers does), times sqrt(hidden); `standardize`: (h - std_bias) x std_scale.
- Embedder: RMSNorm without a scale, one matmul into the text model's width (the text model does not scale them).
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
TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
EMBEDDER_PREFIXES = ("model.embed_vision.", "embed_vision.")
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the image processor's allowed max_soft_tokens
_LINEARS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
BLOCK_MODULES = "model.vision_tower.encoder.layers.{i}."  # block i's module path in transformers 5's model


def gemma4_block_linears(cfg: Gemma4VisionConfig) -> dict[str, tuple[tuple[str, int, int | None], ...]]:
    """Each block kernel of ours -> the transformers Linear it is (the clippable linear's inner `.linear`), (module
    under the block, 0, None: all its columns): what a PEFT adapter folder names LoRA on the tower by (hf/peft.py)."""
    del cfg
    return {ours: ((f"{hf}.linear", 0, None),) for ours, hf in _LINEARS.items()}


_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
          "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


@dataclasses.dataclass(frozen=True)
class Gemma4VisionConfig:
    """A Gemma 4 `vision_config` (the keys this tower reads), the text model's width and the processor's soft-token
    budget (`max_soft_tokens`: its preprocessor_config.json's, 280 by default)."""

    depth: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    out_hidden_size: int  # the text model's hidden size (the embedder's output)
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False
    standardize: bool = False
    max_soft_tokens: int = 280
    in_channels: int = 3
    spatial_merge_size: int = 1  # no merge: the pooling sets the token count (`VisionLanguage`'s shared field)

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size ** 2

    @classmethod
    def from_hf(cls, vision: Mapping[str, Any], *, text_hidden_size: int, max_soft_tokens: int = 280
                ) -> Gemma4VisionConfig:
        act = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_activation={act!r}: Gemma 4's tower's MLP is GELU (tanh)")
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: Gemma 4's tower "
                             "turns its heads by 2-D axial RoPE only")
        if int(max_soft_tokens) not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens={max_soft_tokens}: Gemma 4's image processor takes one of "
                             f"{SOFT_TOKEN_BUDGETS}")
        heads = int(vision.get("num_attention_heads", 12))
        hidden = int(vision.get("hidden_size", 768))
        cfg = cls(depth=int(vision.get("num_hidden_layers", 16)), hidden_size=hidden, num_heads=heads,
                  num_kv_heads=int(vision.get("num_key_value_heads", heads)),
                  head_dim=int(vision.get("head_dim") or hidden // heads),
                  intermediate_size=int(vision.get("intermediate_size", 3072)), out_hidden_size=int(text_hidden_size),
                  patch_size=int(vision.get("patch_size", 16)),
                  pooling_kernel_size=int(vision.get("pooling_kernel_size", 3)),
                  position_embedding_size=int(vision.get("position_embedding_size", 10240)),
                  rope_theta=float(rope.get("rope_theta", 100.0)), rms_norm_eps=float(vision.get("rms_norm_eps", 1e-6)),
                  use_clipped_linears=bool(vision.get("use_clipped_linears", False)),
                  standardize=bool(vision.get("standardize", False)), max_soft_tokens=int(max_soft_tokens))
        if cfg.head_dim % 4:
            raise ValueError(f"vision_config.head_dim={cfg.head_dim}: 2-D RoPE turns a quarter of each head per axis "
                             "and needs a multiple of 4")
        return cfg

    def to_hf(self) -> dict[str, Any]:
        """The `vision_config` transformers reads back to this tower."""
        return {"model_type": "gemma4_vision", "num_hidden_layers": self.depth, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "patch_size": self.patch_size, "pooling_kernel_size": self.pooling_kernel_size,
                "position_embedding_size": self.position_embedding_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
                "use_clipped_linears": self.use_clipped_linears, "standardize": self.standardize,
                "hidden_activation": "gelu_pytorch_tanh"}


def patch_positions(grid_thw: np.ndarray, max_patches: int) -> np.ndarray:
    """[images, max_patches, 2] int32 (x, y) of each image's patches, row-major over its grid (frames, rows,
    columns), (-1, -1) past them: the processor's `image_position_ids`."""
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    out = np.full((len(grids), max_patches, 2), -1, np.int32)
    for i, (_, rows, cols) in enumerate(grids.tolist()):
        if rows * cols > max_patches:
            raise ValueError(f"image {i}: a {rows} x {cols} patch grid is more than the {max_patches} patches of "
                             "the pixel values")
        y, x = np.divmod(np.arange(rows * cols), cols)
        out[i, :rows * cols] = np.stack([x, y], axis=-1)
    return out


def soft_tokens(cfg: Gemma4VisionConfig, grid_thw: np.ndarray) -> np.ndarray:
    """[images] int: each image's features (its pooled cells)."""
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return grids[:, 1] * grids[:, 2] // cfg.pooling_kernel_size ** 2


def init_gemma4_vision_params(cfg: Gemma4VisionConfig, rng: Array, std: float = 0.02) -> dict[str, Any]:
    """Random fp32 tower + embedder params in `gemma4_vision_features`' layout (unit norms, open clip bounds, no
    standardisation shift)."""
    keys = iter(jax.random.split(rng, 12))
    d, h, i = cfg.depth, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def normal(*shape: int) -> Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    blocks: dict[str, Any] = {name: normal(d, *shape) for name, shape in shapes.items()}
    blocks.update({name: jnp.ones((d, h)) for name in ("input_norm", "post_attn_norm", "pre_mlp_norm",
                                                        "post_mlp_norm")})
    blocks.update(q_norm=jnp.ones((d, cfg.head_dim)), k_norm=jnp.ones((d, cfg.head_dim)))
    if cfg.use_clipped_linears:  # [d, 4]: input min / max, output min / max of each projection
        open_bounds = jnp.tile(jnp.asarray([-jnp.inf, jnp.inf, -jnp.inf, jnp.inf], jnp.float32), (d, 1))
        blocks["clip"] = {name: open_bounds for name in shapes}
    out: dict[str, Any] = {"patch_embed": normal(cfg.patch_dim, h),
                           "position_table": normal(2, cfg.position_embedding_size, h), "blocks": blocks,
                           "embedder": {"kernel": normal(h, cfg.out_hidden_size)}}
    if cfg.standardize:
        out.update(std_bias=jnp.zeros((h,)), std_scale=jnp.ones((h,)))
    return out


def _rms(x: Array, scale: Array | None, eps: float) -> Array:
    x = x.astype(jnp.float32)
    normed = x * lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    return normed if scale is None else normed * scale.astype(jnp.float32)


def _rope_2d(x: Array, positions: Array, theta: float) -> Array:
    """x [..., N, heads, D] turned by 2-D RoPE: dims [0, D/2) by each patch's x, [D/2, D) by its y (rotate-half
    within each half)."""
    d = x.shape[-1]
    quarter = d // 4
    inv = 1.0 / (theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2)))  # [D / 4]
    halves = []
    for axis in range(2):
        angles = positions[..., axis].astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [..., N, D / 4]
        angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., N, 1, D / 2]
        part = x[..., axis * (d // 2):(axis + 1) * (d // 2)]
        rotated = jnp.concatenate([-part[..., quarter:], part[..., :quarter]], axis=-1)
        halves.append(part * jnp.cos(angles) + rotated * jnp.sin(angles))
    return jnp.concatenate(halves, axis=-1)


def gemma4_vision_features(params: Mapping[str, Any], cfg: Gemma4VisionConfig, pixel_values: Array,
                           positions: Array, *, dtype: DType = jnp.float32) -> Array:
    """[N, max_patches / k^2, out_hidden_size] fp32 image-token embeddings (module doc) of `pixel_values`
    [N, max_patches, patch_dim] at `positions` [N, max_patches, 2] (`patch_positions`). The soft-token budget is
    the pixels' (max_patches = max_soft_tokens x k^2), not the config's."""
    heads, kv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    pixels = jnp.asarray(pixel_values, jnp.float32)
    positions = jnp.asarray(positions, jnp.int32)
    n, t = pixels.shape[:2]
    padding = jnp.all(positions < 0, axis=-1)  # [N, T]
    clamped = jnp.maximum(positions, 0)

    def linear(x: Array, kernel: Array, bounds: Array | None) -> Array:
        if bounds is not None:
            bounds = lax.stop_gradient(bounds.astype(jnp.float32))
            x = jnp.clip(x, bounds[0], bounds[1])
        out = jnp.einsum("...i,io->...o", x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
        return out if bounds is None else jnp.clip(out, bounds[2], bounds[3])

    table = params["position_table"].astype(jnp.float32)
    x = linear(2.0 * (pixels - 0.5), params["patch_embed"], None)
    x = x + jnp.where(padding[..., None], 0.0, table[0][clamped[..., 0]] + table[1][clamped[..., 1]])
    key_mask = ~padding[:, None, None, :]  # [N, 1, 1, T]: bidirectional over the real patches

    def block(x: Array, p: Mapping[str, Any]) -> tuple[Array, None]:
        clip = p.get("clip") or {}
        h = _rms(x, p["input_norm"], eps)
        q = _rope_2d(_rms(linear(h, p["q"], clip.get("q")).reshape(n, t, heads, hd), p["q_norm"], eps), clamped,
                     cfg.rope_theta)
        k = _rope_2d(_rms(linear(h, p["k"], clip.get("k")).reshape(n, t, kv, hd), p["k_norm"], eps), clamped,
                     cfg.rope_theta)
        v = _rms(linear(h, p["v"], clip.get("v")).reshape(n, t, kv, hd), None, eps)
        group = heads // kv
        q = q.reshape(n, t, kv, group, hd)
        scores = jnp.einsum("nqkgd,nskd->nkgqs", q.astype(dtype), k.astype(dtype), preferred_element_type=jnp.float32)
        scores = jnp.where(key_mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("nkgqs,nskd->nqkgd", probs.astype(dtype), v.astype(dtype),
                         preferred_element_type=jnp.float32).reshape(n, t, heads * hd)
        x = x + _rms(linear(out, p["o"], clip.get("o")), p["post_attn_norm"], eps)
        h = _rms(x, p["pre_mlp_norm"], eps)
        gated = jax.nn.gelu(linear(h, p["gate"], clip.get("gate")), approximate=True) * linear(h, p["up"],
                                                                                             clip.get("up"))
        return x + _rms(linear(gated, p["down"], clip.get("down")), p["post_mlp_norm"], eps), None

    x, _ = lax.scan(jax.checkpoint(block), x, params["blocks"])  # a trained tower's backward: each block's input only
    # pooling: cell (x // k) + (columns / k) * (y // k) averages its k x k patches (padding contributes zeros)
    k = cfg.pooling_kernel_size
    x = jnp.where(padding[..., None], 0.0, x)
    columns = jnp.max(clamped[..., 0], axis=-1, keepdims=True) + 1  # [N, 1]
    cell = clamped[..., 0] // k + (columns // k) * (clamped[..., 1] // k)  # [N, T]
    weights = jax.nn.one_hot(cell, t // (k * k), dtype=jnp.float32) / (k * k)  # [N, T, S]
    pooled = jnp.einsum("nts,nth->nsh", weights, x) * np.float32(cfg.hidden_size ** 0.5)
    if cfg.standardize:
        pooled = (pooled - params["std_bias"].astype(jnp.float32)) * params["std_scale"].astype(jnp.float32)
    return linear(_rms(pooled, None, eps), params["embedder"]["kernel"], None)


def gemma4_vision_params_from_hf(tensors: TensorLookup, cfg: Gemma4VisionConfig) -> dict[str, Any]:
    """Our params from a Gemma 4 checkpoint's state dict (`model.vision_tower.*`, `model.embed_vision.*`, with or
    without `model.` in front). A missing tensor is a KeyError naming it."""
    tower = first_prefix(tensors, TOWER_PREFIXES, "patch_embedder.input_proj.weight")
    embedder = first_prefix(tensors, EMBEDDER_PREFIXES, "embedding_projection.weight")
    get = tensor_reader(tensors)

    layer = lambda i, name: f"{tower}encoder.layers.{i}.{name}"  # noqa: E731
    blocks: dict[str, Any] = {ours: np.stack([get(layer(i, f"{name}.linear.weight"), True) for i in range(cfg.depth)])
                              for ours, name in _LINEARS.items()}
    blocks.update({ours: np.stack([get(layer(i, f"{name}.weight")) for i in range(cfg.depth)])
                   for ours, name in _NORMS.items()})
    if cfg.use_clipped_linears:
        blocks["clip"] = {ours: np.stack([np.stack([get(layer(i, f"{name}.{b}")).reshape(()) for b in _CLIP_BOUNDS])
                                          for i in range(cfg.depth)]) for ours, name in _LINEARS.items()}
    out: dict[str, Any] = {"patch_embed": get(f"{tower}patch_embedder.input_proj.weight", True),
                           "position_table": get(f"{tower}patch_embedder.position_embedding_table"),
                           "blocks": blocks,
                           "embedder": {"kernel": get(f"{embedder}embedding_projection.weight", True)}}
    if cfg.standardize:
        out.update(std_bias=get(f"{tower}std_bias"), std_scale=get(f"{tower}std_scale"))
    return out


def gemma4_vision_params_to_hf(params: Mapping[str, Any], cfg: Gemma4VisionConfig, prefix: str = "model."
                               ) -> dict[str, np.ndarray]:
    """The tower's and embedder's tensors under transformers 5's names, fp32: the inverse of
    `gemma4_vision_params_from_hf`."""
    tower = f"{prefix}vision_tower."
    array = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out = {f"{tower}patch_embedder.input_proj.weight": array(params["patch_embed"]).T,
           f"{tower}patch_embedder.position_embedding_table": array(params["position_table"]),
           f"{prefix}embed_vision.embedding_projection.weight": array(params["embedder"]["kernel"]).T}
    if cfg.standardize:
        out.update({f"{tower}std_bias": array(params["std_bias"]), f"{tower}std_scale": array(params["std_scale"])})
    blocks = params["blocks"]
    for i in range(cfg.depth):
        layer = f"{tower}encoder.layers.{i}."
        for ours, name in _LINEARS.items():
            out[f"{layer}{name}.linear.weight"] = array(blocks[ours][i]).T
            if cfg.use_clipped_linears:
                for j, bound in enumerate(_CLIP_BOUNDS):
                    out[f"{layer}{name}.{bound}"] = array(blocks["clip"][ours][i][j])
        for ours, name in _NORMS.items():
            out[f"{layer}{name}.weight"] = array(blocks[ours][i])
    return {k: np.ascontiguousarray(v) if v.ndim else v for k, v in out.items()}  # the clip bounds are scalars

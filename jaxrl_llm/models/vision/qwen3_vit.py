"""Qwen3-VL's vision tower: patches -> ViT blocks (full attention within each image) -> the merger, plus the
deepstack mergers' features of some blocks, as transformers' `Qwen3VLVisionModel` computes them.

Input as Qwen2.5-VL's (models/vision/qwen_vit.py): the processor's `pixel_values` [N, C x T x P x P] (each image's
patches in merge-block order) and `image_grid_thw`. Output: [1 + D, N / S^2, out_hidden_size]: the merger's features
(one per merged S x S block, an image token each) and the D deepstack features (the block outputs at
`deepstack_visual_indexes`, each through its own merger), which the text model adds to the image tokens' hidden
states after its first D layers (models/decoder.py).

- Patch embedding: one matmul with a bias; learned position embeddings (a square table of num_position_embeddings),
  resampled to each image's grid bilinearly with aligned corners (`position_taps`: 4 taps per patch).
- 2-D rotary positions as Qwen2.5-VL's (each patch's row and column, head_dim / 4 frequencies per axis).
- Blocks: LayerNorm (with bias), fused qkv with bias, softmax attention within each image frame, output projection,
  LayerNorm, Linear -> GELU (tanh) -> Linear. No window attention.
- Mergers: LayerNorm over the hidden size (the final merger) or over the S^2 concatenated neighbours (deepstack),
  then Linear -> GELU (erf) -> Linear.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.blocks import apply_rope
from jaxrl_llm.models.vision.qwen_vit import (
    TensorLookup,
    TowerGeometry,
    VisionLayout,
    by_image,
    padded_layout,
    rotary_tables,
)

Array = jax.Array
LAYER_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(TowerGeometry):
    """A Qwen3-VL `vision_config` (the keys this tower reads)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Qwen3VisionConfig:
        if d.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act={d['hidden_act']!r}: the Qwen3-VL tower's MLP is GELU (tanh)")
        rope = d.get("rope_parameters") or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in fields if k in d and k not in ("deepstack_visual_indexes", "rope_theta")}
        return cls(**kw, deepstack_visual_indexes=tuple(int(i) for i in d.get("deepstack_visual_indexes", ())),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped) and weights of `index` on an axis of `size` resampled from `side`
    entries with aligned corners."""
    src = index.astype(np.float64) * (side - 1) / max(size - 1, 1)
    floor = np.floor(src)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2)[None], 0, side - 1)
    weights = np.clip(1.0 - np.abs(src[:, None] - floor[:, None] - np.arange(2)[None]), 0.0, None)
    return taps, weights


def position_taps(cfg: Qwen3VisionConfig, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices [N, 4] into the position table, weights [N, 4] fp32): each patch's learned position embedding as
    the bilinear resampling of the square table to its image's grid (aligned corners), patches in merge-block
    order, repeated over frames."""
    side, s = cfg.grid_side, cfg.spatial_merge_size
    indices, weights = [], []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        rows = rows.reshape(h // s, s, w // s, s).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(h // s, s, w // s, s).transpose(0, 2, 1, 3).reshape(-1)
        (h_taps, h_weights), (w_taps, w_weights) = _axis_taps(rows, h, side), _axis_taps(cols, w, side)
        idx = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        wts = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wts, (t, 1)))
    return np.concatenate(indices).astype(np.int32), np.concatenate(weights).astype(np.float32)


def qwen3_layout(cfg: Qwen3VisionConfig, grid_thw: np.ndarray) -> tuple[VisionLayout, np.ndarray, np.ndarray]:
    """(the layout: identity order, each patch's (row, column), its frame as both segment kinds; the position
    taps' indices and weights) of images with these grids."""
    s = cfg.spatial_merge_size
    positions, frames, frame = [], [], 0
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        if h % s or w % s:
            raise ValueError(f"image grid {h} x {w} patches is not a multiple of spatial_merge_size={s}")
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = np.stack([rows.reshape(h // s, s, w // s, s).transpose(0, 2, 1, 3).reshape(-1),
                          cols.reshape(h // s, s, w // s, s).transpose(0, 2, 1, 3).reshape(-1)], axis=-1)
        for _ in range(t):
            positions.append(block)
            frames.append(np.full(h * w, frame))
            frame += 1
    n = sum(len(p) for p in positions)
    frame_ids = np.concatenate(frames)
    layout = VisionLayout(order=np.arange(n), restore=np.arange(n // cfg.merge_unit),
                          positions=np.concatenate(positions), frame=frame_ids, window=frame_ids)
    return (layout, *position_taps(cfg, grid_thw))


def _linear(x: Array, kernel: Array, bias: Array, dtype: DType) -> Array:
    return jnp.dot(x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32) + bias.astype(
        jnp.float32)


def _layer_norm(x: Array, p: Mapping[str, Any]) -> Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * p["scale"] + p["bias"]


def _merge(x: Array, p: Mapping[str, Any], unit: int, dtype: DType, *, postshuffle: bool) -> Array:
    """A merger: LayerNorm before (over one patch) or after (over the S^2 neighbours) concatenating them, then
    Linear -> GELU (erf) -> Linear."""
    n, hidden = x.shape
    merged = (_layer_norm(x.reshape(n // unit, unit * hidden), p["norm"]) if postshuffle
              else _layer_norm(x, p["norm"]).reshape(n // unit, unit * hidden))
    merged = jax.nn.gelu(_linear(merged, p["fc1"], p["fc1_bias"], dtype), approximate=False)
    return _linear(merged, p["fc2"], p["fc2_bias"], dtype)


def qwen3_vision_features(params: Mapping[str, Any], cfg: Qwen3VisionConfig, pixel_values: Array,
                          layout: tuple[VisionLayout, Array, Array], *, dtype: DType = jnp.float32) -> Array:
    """[1 + D, N / S^2, out_hidden_size] fp32: the merger's features and the D deepstack features (module doc)."""
    grid, tap_index, tap_weight = layout
    n = pixel_values.shape[0]
    heads, hd = cfg.num_heads, cfg.head_dim
    x = _linear(pixel_values, params["patch_embed"], params["patch_embed_bias"], dtype)
    table = params["pos_embed"].astype(jnp.float32)
    x = x + jnp.sum(jnp.take(table, jnp.asarray(tap_index), axis=0) * jnp.asarray(tap_weight)[..., None], axis=1)
    cos, sin = rotary_tables(cfg.head_dim, cfg.rope_theta, jnp.asarray(grid.positions))
    frame = jnp.asarray(grid.frame)
    mask = frame[:, None] == frame[None, :]

    @jax.checkpoint  # a trained tower's backward keeps each block's input, not its [heads, N, N] scores
    def block(x: Array, p: Mapping[str, Any]) -> Array:
        h = _layer_norm(x, p["norm1"])
        qkv = _linear(h, p["qkv"], p["qkv_bias"], dtype).reshape(n, 3, heads, hd)
        q, k = (apply_rope(a[None], cos[None], sin[None])[0] for a in (qkv[:, 0], qkv[:, 1]))
        scores = jnp.einsum("qhd,khd->hqk", q.astype(dtype), k.astype(dtype),
                            preferred_element_type=jnp.float32) * hd ** -0.5
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("hqk,khd->qhd", probs.astype(dtype), qkv[:, 2].astype(dtype),
                          preferred_element_type=jnp.float32)
        x = x + _linear(attn.reshape(n, heads * hd), p["proj"], p["proj_bias"], dtype)
        h = jax.nn.gelu(_linear(_layer_norm(x, p["norm2"]), p["fc1"], p["fc1_bias"], dtype), approximate=True)
        return x + _linear(h, p["fc2"], p["fc2_bias"], dtype)

    deep = []
    for i in range(cfg.depth):
        x = block(x, jax.tree.map(lambda a, i=i: a[i], params["blocks"]))
        if i in cfg.deepstack_visual_indexes:
            j = cfg.deepstack_visual_indexes.index(i)
            deep.append(_merge(x, jax.tree.map(lambda a, j=j: a[j], params["deepstack"]), cfg.merge_unit, dtype,
                               postshuffle=True))
    features = _merge(x, params["merger"], cfg.merge_unit, dtype, postshuffle=False)
    return jnp.stack([features, *deep])


def qwen3_image_features(params: Mapping[str, Any], cfg: Qwen3VisionConfig, pixel_values: np.ndarray,
                         grid_thw: np.ndarray, *, dtype: DType = jnp.float32) -> Array:
    """`qwen3_vision_features` of a batch's images, image by image (`qwen_vit.by_image`): [1 + D, M, out]."""
    return by_image(qwen3_vision_features, params, cfg, pixel_values, grid_thw, layout_of=qwen3_layout,
                    pad_layout=_padded, dtype=dtype)


def _padded(layout: tuple[VisionLayout, np.ndarray, np.ndarray], patches: int, unit: int
            ) -> tuple[VisionLayout, np.ndarray, np.ndarray]:
    """A Qwen3 layout over `patches` (padding patches: a frame of their own, no position embedding)."""
    grid, index, weight = layout
    extra = patches - len(index)
    return (padded_layout(grid, patches, unit), np.concatenate([index, np.zeros((extra, 4), index.dtype)]),
            np.concatenate([weight, np.zeros((extra, 4), weight.dtype)]))


_BLOCK = {  # ours: (HF name under blocks.{i}., transposed)
    "qkv": ("attn.qkv.weight", True), "qkv_bias": ("attn.qkv.bias", False),
    "proj": ("attn.proj.weight", True), "proj_bias": ("attn.proj.bias", False),
    "fc1": ("mlp.linear_fc1.weight", True), "fc1_bias": ("mlp.linear_fc1.bias", False),
    "fc2": ("mlp.linear_fc2.weight", True), "fc2_bias": ("mlp.linear_fc2.bias", False),
}
BLOCK_MODULES = "model.visual.blocks.{i}."  # block i's module path in transformers 5's model


def qwen3_block_linears(cfg: Qwen3VisionConfig) -> dict[str, tuple[tuple[str, int, int | None], ...]]:
    """Each block kernel of ours -> the transformers Linear it is, (module under the block, 0, None: all its
    columns): what a PEFT adapter folder names LoRA on the tower by (hf/peft.py)."""
    del cfg
    return {ours: ((hf.removesuffix(".weight"), 0, None),) for ours, (hf, transposed) in _BLOCK.items() if transposed}


_MERGER = {"fc1": ("linear_fc1.weight", True), "fc1_bias": ("linear_fc1.bias", False),
           "fc2": ("linear_fc2.weight", True), "fc2_bias": ("linear_fc2.bias", False)}


def qwen3_vision_params_from_hf(tensors: TensorLookup, cfg: Qwen3VisionConfig) -> dict[str, Any]:
    """Our params from a state dict holding the tower under `model.visual.` or `visual.` (a KeyError names a
    missing tensor)."""
    prefix = next((p for p in ("model.visual.", "visual.") if f"{p}patch_embed.proj.weight" in tensors), "")

    def get(name: str, transpose: bool = False) -> np.ndarray:
        if prefix + name not in tensors:
            raise KeyError(f"vision tower: no tensor {prefix + name!r} in the checkpoint")
        value = np.asarray(tensors[prefix + name], np.float32)
        return value.T if transpose else value

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"scale": get(f"{name}.weight"), "bias": get(f"{name}.bias")}

    def merger(name: str) -> dict[str, Any]:
        return {"norm": norm(f"{name}.norm"), **{ours: get(f"{name}.{hf}", t) for ours, (hf, t) in _MERGER.items()}}

    def stacked(items: list[dict[str, Any]]) -> dict[str, Any]:
        return jax.tree.map(lambda *xs: np.stack(xs), *items)

    blocks = stacked([{"norm1": norm(f"blocks.{i}.norm1"), "norm2": norm(f"blocks.{i}.norm2"),
                       **{ours: get(f"blocks.{i}.{hf}", t) for ours, (hf, t) in _BLOCK.items()}}
                      for i in range(cfg.depth)])
    patch = get("patch_embed.proj.weight")
    out = {"patch_embed": patch.reshape(patch.shape[0], -1).T, "patch_embed_bias": get("patch_embed.proj.bias"),
           "pos_embed": get("pos_embed.weight"), "blocks": blocks, "merger": merger("merger")}
    if cfg.deepstack_visual_indexes:
        out["deepstack"] = stacked([merger(f"deepstack_merger_list.{j}")
                                    for j in range(len(cfg.deepstack_visual_indexes))])
    return out


def qwen3_vision_params_to_hf(params: Mapping[str, Any], cfg: Qwen3VisionConfig, prefix: str = "model.visual."
                              ) -> dict[str, np.ndarray]:
    """The tower's tensors under transformers' names (the inverse of `qwen3_vision_params_from_hf`), fp32."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), dict(params))
    out = {f"{prefix}patch_embed.proj.weight": p["patch_embed"].T.reshape(
               cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
           f"{prefix}patch_embed.proj.bias": p["patch_embed_bias"], f"{prefix}pos_embed.weight": p["pos_embed"]}

    def put(name: str, tree: Mapping[str, Any], table: Mapping[str, tuple[str, bool]]) -> None:
        for norm in ("norm", "norm1", "norm2"):
            if norm in tree:
                out[f"{name}.{norm}.weight"], out[f"{name}.{norm}.bias"] = tree[norm]["scale"], tree[norm]["bias"]
        for ours, (hf, transpose) in table.items():
            out[f"{name}.{hf}"] = tree[ours].T if transpose else tree[ours]

    for i in range(cfg.depth):
        put(f"{prefix}blocks.{i}", jax.tree.map(lambda a, i=i: a[i], p["blocks"]), _BLOCK)
    put(f"{prefix}merger", p["merger"], _MERGER)
    for j in range(len(cfg.deepstack_visual_indexes)):
        put(f"{prefix}deepstack_merger_list.{j}", jax.tree.map(lambda a, j=j: a[j], p["deepstack"]), _MERGER)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def init_qwen3_vision_params(cfg: Qwen3VisionConfig, rng: Array, std: float = 0.02) -> dict[str, Any]:
    """Random fp32 tower params (normal(std) matrices and position table, zero biases, unit norms)."""
    keys = iter(jax.random.split(rng, 16))
    d, h, i, m, out = cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size, \
        cfg.out_hidden_size

    def normal(*shape: int) -> Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    def norm(*shape: int) -> dict[str, Array]:
        return {"scale": jnp.ones(shape), "bias": jnp.zeros(shape)}

    def merger(width: int, *lead: int) -> dict[str, Any]:
        return {"norm": norm(*lead, width), "fc1": normal(*lead, m, m), "fc1_bias": jnp.zeros((*lead, m)),
                "fc2": normal(*lead, m, out), "fc2_bias": jnp.zeros((*lead, out))}

    blocks = {"norm1": norm(d, h), "norm2": norm(d, h), "qkv": normal(d, h, 3 * h), "qkv_bias": jnp.zeros((d, 3 * h)),
              "proj": normal(d, h, h), "proj_bias": jnp.zeros((d, h)), "fc1": normal(d, h, i),
              "fc1_bias": jnp.zeros((d, i)), "fc2": normal(d, i, h), "fc2_bias": jnp.zeros((d, h))}
    params = {"patch_embed": normal(cfg.patch_dim, h), "patch_embed_bias": jnp.zeros((h,)),
              "pos_embed": normal(cfg.num_position_embeddings, h), "blocks": blocks, "merger": merger(h)}
    if cfg.deepstack_visual_indexes:
        params["deepstack"] = merger(m, len(cfg.deepstack_visual_indexes))
    return params

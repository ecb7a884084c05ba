"""A trained vision tower's inputs row by row (`actor.freeze_vision_tower=False`, docs/vision.md): each row carries its
prompt's images as pixels, so every pass that reads the policy computes the image features with the params it
differentiates (the tower's too), not from features computed once per batch.

Layout (`TowerRows`, every leaf leading with the rows, so micro-batches and row shards split them as the batch's
other arrays):

- `pixels` [N, I, ...]: the row's I images (I: the most any prompt of the batch holds; rows with fewer repeat their
  first image, whose features nothing reads). Qwen: each image's patches [P, C x T x p x p], padded to the batch's
  largest image's power of two (a frame of their own: no real patch sees them); Gemma 3: [C, S, S]; Gemma 4: the
  processor's [max_patches, P x P x C] (every image the same shape already).
- `layout`: Qwen's per-image index arrays (window order, 2-D positions, frames; Qwen3-VL's position taps), [N, I, ...];
  Gemma 4's patch positions [N, I, max_patches, 2]; None for Gemma 3.
- `feature_index` [N, K]: the row's k-th image token's feature in its images' features laid end to end (image i's
  blocks at i x blocks per image).

`row_tower_features` runs the tower over the N x I images (vmapped: one compiled shape per batch) and gathers each
row's K features (and Qwen3-VL's deepstack features) as `RowImages` holds them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.vision.gemma4_vit import (
    Gemma4VisionConfig,
    gemma4_vision_features,
    patch_positions,
    soft_tokens,
)
from jaxrl_llm.models.vision.qwen3_vit import Qwen3VisionConfig, qwen3_layout, qwen3_vision_features
from jaxrl_llm.models.vision.qwen3_vit import _padded as qwen3_padded_layout
from jaxrl_llm.models.vision.qwen_vit import (
    VisionConfig,
    _patch_bucket,
    padded_layout,
    vision_features,
    vision_layout,
)
from jaxrl_llm.models.vision.siglip import SiglipVisionConfig, siglip_features

Array = jax.Array


class TowerRows(NamedTuple):
    """Each row's images as a trained tower reads them (module doc)."""

    pixels: Any  # [N, I, P, patch] (Qwen), [N, I, C, S, S] (Gemma 3) or [N, I, max_patches, patch] (Gemma 4)
    layout: Any  # Qwen's per-image layout arrays [N, I, ...], Gemma 4's patch positions; None for Gemma 3
    feature_index: Any  # int32 [N, K]


def _qwen_parts(cfg: VisionConfig | Qwen3VisionConfig) -> tuple[Callable, Callable, Callable]:
    if isinstance(cfg, Qwen3VisionConfig):
        return qwen3_vision_features, qwen3_layout, qwen3_padded_layout
    return vision_features, vision_layout, padded_layout


def prompt_tower_rows(cfg: Any, pixel_values: np.ndarray, grid_thw: np.ndarray, counts: Sequence[int],
                      room: int) -> TowerRows:
    """Host arrays of B prompts (prompt b holds counts[b] images, processor order): one row per prompt, K = `room`
    feature slots. `pixel_values` / `grid_thw`: the batch's, as the processor gives them."""
    counts = [int(c) for c in counts]
    images = max(max(counts), 1)
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    firsts = np.concatenate([[0], np.cumsum(counts)])[:-1]
    if isinstance(cfg, (SiglipVisionConfig, Gemma4VisionConfig)):  # every image's pixels one shape
        pixels = np.asarray(pixel_values, np.float32)
        take = np.asarray([[int(firsts[b]) + (i if i < counts[b] else 0) for i in range(images)] if counts[b] else
                           [0] * images for b in range(len(counts))])
        if isinstance(cfg, SiglipVisionConfig):  # fixed squares: blocks = mm_tokens_per_image
            per_image, cells, layout = np.full(len(grids), cfg.mm_tokens_per_image), cfg.mm_tokens_per_image, None
        else:  # image i's tokens: the first of its max_patches / k^2 cells
            per_image, cells = soft_tokens(cfg, grids), pixels.shape[1] // cfg.pooling_kernel_size ** 2
            layout = patch_positions(grids, pixels.shape[1])[take]
        index = np.zeros((len(counts), room), np.int32)
        for b, c in enumerate(counts):
            at = 0
            for i in range(c):
                n = int(per_image[firsts[b] + i])
                index[b, at:at + n] = i * cells + np.arange(n)
                at += n
        return TowerRows(pixels[take], layout, index)
    forward, layout_of, pad_layout = _qwen_parts(cfg)
    del forward
    unit = cfg.merge_unit
    patches = grids.prod(axis=1)
    starts = np.concatenate([[0], np.cumsum(patches)])
    bucket = _patch_bucket(int(patches.max()), unit)
    pixels = np.asarray(pixel_values, np.float32)
    rows_pixels = np.zeros((len(counts), images, bucket, pixels.shape[1]), np.float32)
    layouts, index = [], np.zeros((len(counts), room), np.int32)
    for b, c in enumerate(counts):
        row_layouts, at = [], 0
        for i in range(images):
            g = int(firsts[b]) + (i if i < c else 0) if c else 0
            rows_pixels[b, i, :patches[g]] = pixels[starts[g]:starts[g + 1]]
            row_layouts.append(pad_layout(layout_of(cfg, grids[g:g + 1]), bucket, unit))
            if i < c:  # this image's blocks: at i x (bucket / unit) in the row's features laid end to end
                blocks = int(patches[g]) // unit
                index[b, at:at + blocks] = i * (bucket // unit) + np.arange(blocks)
                at += blocks
        layouts.append(jax.tree.map(lambda *xs: np.stack(xs), *row_layouts))
    return TowerRows(rows_pixels, jax.tree.map(lambda *xs: np.stack(xs), *layouts), index)


def row_tower_features(params: Mapping[str, Any], cfg: Any, rows: TowerRows, *, dtype: DType = jnp.float32
                       ) -> tuple[Array, Array | None]:
    """(features [N, K, H] fp32, deepstack [N, D, K, H] or None) of each row's images through the tower at
    `params` (differentiable: the update trains the tower through them)."""
    n, images = rows.pixels.shape[:2]
    flat = rows.pixels.reshape(n * images, *rows.pixels.shape[2:])
    if isinstance(cfg, (SiglipVisionConfig, Gemma4VisionConfig)):
        if isinstance(cfg, SiglipVisionConfig):
            out = siglip_features(params, cfg, flat, dtype=dtype)  # [N * I, T, H]
        else:
            positions = rows.layout.reshape(n * images, *rows.layout.shape[2:])
            out = gemma4_vision_features(params, cfg, flat, positions, dtype=dtype)
        features = out.reshape(n, -1, out.shape[-1])
        return jnp.take_along_axis(features, rows.feature_index[..., None], axis=1), None
    forward, _, _ = _qwen_parts(cfg)
    layout = jax.tree.map(lambda x: x.reshape(n * images, *x.shape[2:]), rows.layout)
    out = jax.vmap(lambda px, lay: forward(params, cfg, px, lay, dtype=dtype))(flat, layout)
    if isinstance(cfg, Qwen3VisionConfig):  # [N * I, 1 + D, blocks, H]: the merger's, then the deepstack's
        stacked = out.reshape(n, images, out.shape[1], -1, out.shape[-1])
        stacked = jnp.moveaxis(stacked, 2, 1).reshape(n, out.shape[1], -1, out.shape[-1])  # [N, 1 + D, I * b, H]
        picked = jnp.take_along_axis(stacked, rows.feature_index[:, None, :, None], axis=2)
        return picked[:, 0], picked[:, 1:]
    features = out.reshape(n, -1, out.shape[-1])  # [N, I * blocks, H]
    return jnp.take_along_axis(features, rows.feature_index[..., None], axis=1), None

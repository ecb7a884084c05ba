"""Qwen2.5-VL's vision tower: patches -> ViT blocks (window and full attention) -> the merger, as transformers'
`Qwen2_5_VisionTransformerPretrainedModel` computes it.

Input: the HF image processor's `pixel_values` [N, C x T x P x P] (N patches of all images, each image's patches
in its processor order: merge blocks of S x S patches, row-major over blocks) and `image_grid_thw` [images, 3]
(frames, patch rows, patch columns). Output: [N / S^2, out_hidden_size] features, one per merged S x S block (one
image token of the language model each), in the processor's order.

- Patch embedding: a Conv3d whose stride equals its kernel is one matmul over the flattened patch.
- 2-D rotary positions: each patch's (row, column); head_dim / 4 frequencies per axis, [rows | columns] over half
  the head, repeated over the other half (rotate-half), the same in every block.
- Window attention: blocks not in `fullatt_block_indexes` attend inside windows of window_size / patch_size
  patches a side (window_size / S / P merged blocks); the sequence is reordered window by window (the merge
  blocks of a window contiguous), as transformers does, and the merger's output put back in the processor's
  order. Full-attention blocks attend inside each image frame. Both are masks over the one packed sequence
  (`VisionLayout`, computed on the host from the grids: the shapes follow the images).
- Blocks: pre-norm RMSNorm, fused qkv with bias, softmax attention (fp32), output projection with bias; a gated
  MLP (SiLU) with biases. Merger: RMSNorm, the S^2 neighbours concatenated, Linear -> GELU (erf) -> Linear.

Numerics: fp32 throughout unless `dtype` says otherwise for the matmul inputs (fp32 accumulation).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.blocks import apply_rope, rms_norm

Array = jax.Array


class TowerGeometry:
    """What a Qwen tower's config derives from its sizes (Qwen2.5-VL's and Qwen3-VL's alike)."""

    hidden_size: int
    num_heads: int
    in_channels: int
    temporal_patch_size: int
    patch_size: int
    spatial_merge_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2


@dataclasses.dataclass(frozen=True)
class VisionConfig(TowerGeometry):
    """A Qwen2.5-VL `vision_config` (the keys this tower reads)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> VisionConfig:
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act={d['hidden_act']!r}: the Qwen2.5-VL tower's MLP is SiLU-gated")
        rope = d.get("rope_parameters") or {}
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in fields if k in d and k not in ("fullatt_block_indexes", "rope_theta")}
        return cls(**kw, fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
                   rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))))

    @classmethod
    def tiny(cls, out_hidden_size: int) -> VisionConfig:
        """A 2-block tower for tests and tiny:qwen2_5_vl: block 0 windowed (windows of 2 x 2 merged blocks), block 1
        full; 28-pixel merge blocks as the releases'."""
        return cls(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=out_hidden_size,
                   window_size=56, fullatt_block_indexes=(1,))


def init_vision_params(cfg: VisionConfig, rng: Array, std: float = 0.02) -> dict[str, Any]:
    """Random fp32 tower params (normal(std) matrices, zero biases, unit norms) in `vision_features`' layout."""
    keys = iter(jax.random.split(rng, 8))
    d, h, i, m = cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit * cfg.hidden_size

    def normal(*shape: int) -> Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    blocks = {"norm1": jnp.ones((d, h)), "norm2": jnp.ones((d, h)),
              "qkv": normal(d, h, 3 * h), "qkv_bias": jnp.zeros((d, 3 * h)),
              "proj": normal(d, h, h), "proj_bias": jnp.zeros((d, h)),
              "gate_proj": normal(d, h, i), "gate_proj_bias": jnp.zeros((d, i)),
              "up_proj": normal(d, h, i), "up_proj_bias": jnp.zeros((d, i)),
              "down_proj": normal(d, i, h), "down_proj_bias": jnp.zeros((d, h))}
    merger = {"norm": jnp.ones((h,)), "fc1": normal(m, m), "fc1_bias": jnp.zeros((m,)),
              "fc2": normal(m, cfg.out_hidden_size), "fc2_bias": jnp.zeros((cfg.out_hidden_size,))}
    return {"patch_embed": normal(cfg.patch_dim, h), "blocks": blocks, "merger": merger}


class VisionLayout(NamedTuple):
    """Host-computed index arrays of one batch of images (their grids): the packed sequence in window order."""

    order: np.ndarray  # [N] patch index (processor order) at each position of the window-ordered sequence
    restore: np.ndarray  # [N / S^2] merged-block index -> its position in the window order (argsort)
    positions: np.ndarray  # [N, 2] (row, column) of each window-ordered patch
    frame: np.ndarray  # [N] the image frame of each window-ordered patch (full attention: within it)
    window: np.ndarray  # [N] the window of each window-ordered patch (window attention: within it)


def vision_layout(cfg: VisionConfig, grid_thw: np.ndarray) -> VisionLayout:
    """The window order, positions and attention segments of images with these grids [images, 3]."""
    s = cfg.spatial_merge_size
    side = cfg.window_size // s // cfg.patch_size  # merged blocks per window side
    blocks, positions, frames, windows = [], [], [], []
    block_base = frame_base = window_base = 0
    for t, h, w in np.asarray(grid_thw, np.int64).tolist():
        if h % s or w % s:
            raise ValueError(f"image grid {h} x {w} patches is not a multiple of spatial_merge_size={s}")
        bh, bw = h // s, w // s
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        # each patch's (row, col) in the processor's order: merge blocks row-major, patches inside row-major
        block_rows = rows.reshape(bh, s, bw, s).transpose(0, 2, 1, 3).reshape(-1)
        block_cols = cols.reshape(bh, s, bw, s).transpose(0, 2, 1, 3).reshape(-1)
        wh, ww = -(-bh // side), -(-bw // side)
        for frame in range(t):
            index = np.arange(bh * bw).reshape(bh, bw) + block_base + frame * bh * bw
            for i in range(wh):
                for j in range(ww):
                    part = index[i * side:(i + 1) * side, j * side:(j + 1) * side].reshape(-1)
                    if part.size:
                        blocks.append(part)
                        windows.append(np.full(part.size * s * s, window_base))
                        window_base += 1
            frames.append(np.full(h * w, frame_base))
            frame_base += 1
            positions.append(np.stack([block_rows, block_cols], axis=-1))
        block_base += t * bh * bw
    block_order = np.concatenate(blocks)
    unit = cfg.merge_unit
    order = (block_order[:, None] * unit + np.arange(unit)[None]).reshape(-1)
    all_positions, all_frames = np.concatenate(positions), np.concatenate(frames)
    return VisionLayout(order=order, restore=np.argsort(block_order), positions=all_positions[order],
                        frame=all_frames[order], window=np.concatenate(windows))


def _linear(x: Array, kernel: Array, bias: Array | None, dtype: DType) -> Array:
    out = jnp.dot(x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    return out if bias is None else out + bias.astype(jnp.float32)


def rotary_tables(head_dim: int, theta: float, positions: Array) -> tuple[Array, Array]:
    """cos / sin [N, head_dim] of 2-D positions [N, 2] (row frequencies | column frequencies, twice)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, quarter, 2, dtype=jnp.float32) / quarter))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, head_dim / 4]
    freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(freqs), jnp.sin(freqs)


def vision_features(params: Mapping[str, Any], cfg: VisionConfig, pixel_values: Array, layout: VisionLayout, *,
                    dtype: DType = jnp.float32) -> Array:
    """[N / S^2, out_hidden_size] fp32 features of the images in `pixel_values` [N, patch_dim] (module doc)."""
    n = pixel_values.shape[0]
    heads, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    x = _linear(pixel_values[jnp.asarray(layout.order)], params["patch_embed"], None, dtype)  # window order
    cos, sin = rotary_tables(cfg.head_dim, cfg.rope_theta, jnp.asarray(layout.positions))
    frame, window = jnp.asarray(layout.frame), jnp.asarray(layout.window)
    full_mask = frame[:, None] == frame[None, :]
    window_mask = window[:, None] == window[None, :]
    full_layers = jnp.asarray([i in cfg.fullatt_block_indexes for i in range(cfg.depth)])

    def block(x: Array, layer: tuple[Mapping[str, Any], Array]) -> tuple[Array, None]:
        p, full = layer
        h = rms_norm(x, p["norm1"], eps, jnp.float32)
        qkv = _linear(h, p["qkv"], p["qkv_bias"], dtype).reshape(n, 3, heads, hd)
        # the decoder's rotate-half RoPE over the packed patches as one row: [1, N, heads, hd]
        q, k = (apply_rope(a[None], cos[None], sin[None])[0] for a in (qkv[:, 0], qkv[:, 1]))
        v = qkv[:, 2]
        scores = jnp.einsum("qhd,khd->hqk", q.astype(dtype), k.astype(dtype),
                            preferred_element_type=jnp.float32) * hd ** -0.5
        mask = jnp.where(full, full_mask, window_mask)
        probs = jax.nn.softmax(jnp.where(mask[None], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("hqk,khd->qhd", probs.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32)
        x = x + _linear(attn.reshape(n, heads * hd), p["proj"], p["proj_bias"], dtype)
        h = rms_norm(x, p["norm2"], eps, jnp.float32)
        gate = jax.nn.silu(_linear(h, p["gate_proj"], p["gate_proj_bias"], dtype))
        up = _linear(h, p["up_proj"], p["up_proj_bias"], dtype)
        return x + _linear(gate * up, p["down_proj"], p["down_proj_bias"], dtype), None

    # rematerialised: a trained tower's backward keeps each block's input, not its [heads, N, N] scores (an image of
    # 4096 patches: 1 GiB per block and row, planned at 763 GB for Qwen2.5-VL-3B's update on v5p-8 without it)
    x, _ = lax.scan(jax.checkpoint(block), x, (params["blocks"], full_layers))
    m = params["merger"]
    merged = rms_norm(x, m["norm"], eps, jnp.float32).reshape(n // cfg.merge_unit, cfg.merge_unit * cfg.hidden_size)
    merged = jax.nn.gelu(_linear(merged, m["fc1"], m["fc1_bias"], dtype), approximate=False)
    merged = _linear(merged, m["fc2"], m["fc2_bias"], dtype)
    return merged[jnp.asarray(layout.restore)]


def padded_layout(layout: VisionLayout, patches: int, unit: int) -> VisionLayout:
    """`layout` over `patches` (>= its own, a multiple of the merge unit): the padding patches (zeros appended to
    the pixels) form a frame and a window of their own, so no real patch sees them, and merge into blocks the
    restore order keeps after the real ones."""
    n, blocks = len(layout.order), len(layout.restore)
    extra = patches - n
    if extra < 0 or extra % unit:
        raise ValueError(f"{patches} patches cannot pad a layout of {n} (merge unit {unit})")
    pad = lambda x, fill: np.concatenate([x, np.full((extra, *x.shape[1:]), fill, x.dtype)])  # noqa: E731
    return VisionLayout(order=np.concatenate([layout.order, np.arange(n, patches)]),
                        restore=np.concatenate([layout.restore, np.arange(blocks, patches // unit)]),
                        positions=pad(layout.positions, 0), frame=pad(layout.frame, -1), window=pad(layout.window, -1))


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames=("dtype",))
def _many_features(forward: Callable[..., Array], params: Mapping[str, Any], cfg: Any, pixels: Array, layout: Any,
                   *, dtype: DType) -> Array:
    """`forward` (a tower's features) of images stacked on a leading axis, each with its own layout."""
    return jax.vmap(lambda one, own: forward(params, cfg, one, own, dtype=dtype))(pixels, layout)


def _patch_bucket(patches: int, unit: int) -> int:
    """A power of two >= patches (at least the merge unit): a handful of compiled tower shapes."""
    return max(unit, 1 << max(patches - 1, 0).bit_length())


def image_features(params: Mapping[str, Any], cfg: VisionConfig, pixel_values: np.ndarray, grid_thw: np.ndarray, *,
                   dtype: DType = jnp.float32) -> Array:
    """[N / S^2, out_hidden_size] features of a batch's images (the processor's packed `pixel_values` and grids),
    as `vision_features` over all of them, computed image by image (`by_image`)."""
    return by_image(vision_features, params, cfg, pixel_values, grid_thw, layout_of=vision_layout,
                    pad_layout=padded_layout, dtype=dtype)


def by_image(forward: Callable[..., Array], params: Mapping[str, Any], cfg: Any, pixel_values: np.ndarray,
             grid_thw: np.ndarray, *, layout_of: Callable[[Any, np.ndarray], Any],
             pad_layout: Callable[[Any, int, int], Any], dtype: DType = jnp.float32) -> Array:
    """A tower's `forward(params, cfg, pixels, layout)` (features [..., N / S^2, out]) over a batch's images, image
    by image: attention never crosses an image, so each image's patches (padded to a power of two with
    `pad_layout`: a frame of their own) go through the tower on their own, the images of a size in one batched
    call; the features concatenated in the processor's order. The cost is each image's patches squared, not the
    batch's. `layout_of(cfg, grid [1, 3])`: one image's layout."""
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    counts = grids.prod(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts)])
    by_bucket: dict[int, list[int]] = {}
    for i, count in enumerate(counts.tolist()):
        by_bucket.setdefault(_patch_bucket(count, cfg.merge_unit), []).append(i)
    out: list[Array | None] = [None] * len(grids)
    pixels = np.asarray(pixel_values)
    for bucket, members in by_bucket.items():
        stacked = np.zeros((len(members), bucket, pixels.shape[1]), pixels.dtype)
        layouts = []
        for row, i in enumerate(members):
            stacked[row, :counts[i]] = pixels[starts[i]:starts[i + 1]]
            layouts.append(pad_layout(layout_of(cfg, grids[i:i + 1]), bucket, cfg.merge_unit))
        layout = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *layouts)
        features = _many_features(forward, params, cfg, jnp.asarray(stacked), layout, dtype=dtype)
        for row, i in enumerate(members):
            out[i] = features[row, ..., :counts[i] // cfg.merge_unit, :]
    return jnp.concatenate([f for f in out if f is not None], axis=-2)


_BLOCK_WEIGHTS = {  # ours: (HF name under blocks.{i}., transposed: a Linear's [out, in] -> [in, out])
    "norm1": ("norm1.weight", False), "norm2": ("norm2.weight", False),
    "qkv": ("attn.qkv.weight", True), "qkv_bias": ("attn.qkv.bias", False),
    "proj": ("attn.proj.weight", True), "proj_bias": ("attn.proj.bias", False),
    "gate_proj": ("mlp.gate_proj.weight", True), "gate_proj_bias": ("mlp.gate_proj.bias", False),
    "up_proj": ("mlp.up_proj.weight", True), "up_proj_bias": ("mlp.up_proj.bias", False),
    "down_proj": ("mlp.down_proj.weight", True), "down_proj_bias": ("mlp.down_proj.bias", False),
}
_MERGER_WEIGHTS = {"norm": ("ln_q.weight", False), "fc1": ("mlp.0.weight", True), "fc1_bias": ("mlp.0.bias", False),
                   "fc2": ("mlp.2.weight", True), "fc2_bias": ("mlp.2.bias", False)}
VISION_PREFIXES = ("model.visual.", "visual.")  # transformers' module path, and the released checkpoints'
BLOCK_MODULES = "model.visual.blocks.{i}."  # block i's module path in transformers 5's model


def block_linears(cfg: VisionConfig) -> dict[str, tuple[tuple[str, int, int | None], ...]]:
    """Each block kernel of ours -> the transformers Linear(s) it is, as (module under the block, first output
    column, end: None for all): what a PEFT adapter folder names LoRA on the tower by (hf/peft.py)."""
    del cfg
    return {ours: ((hf.removesuffix(".weight"), 0, None),) for ours, (hf, transposed) in _BLOCK_WEIGHTS.items()
            if transposed}


class TensorLookup(Protocol):
    """Tensors by name: a dict, or an HF folder's `SafetensorsSource` (read on demand)."""

    def __contains__(self, name: object, /) -> bool: ...
    def __getitem__(self, name: str, /) -> Any: ...


def first_prefix(tensors: TensorLookup, prefixes: tuple[str, ...], probe: str) -> str:
    """The first of `prefixes` under which `tensors` holds `probe` (a checkpoint's naming); the first without."""
    return next((p for p in prefixes if p + probe in tensors), prefixes[0])


def tensor_reader(tensors: TensorLookup) -> Callable[..., np.ndarray]:
    """get(name, transpose=False): a tensor by its full name as fp32 (transposed: a torch Linear's weight as our
    [in, out] kernel); a KeyError naming it when the checkpoint lacks it."""
    def get(key: str, transpose: bool = False) -> np.ndarray:
        if key not in tensors:
            raise KeyError(f"vision tower: no tensor {key!r} in the checkpoint")
        value = np.asarray(tensors[key], np.float32)
        return value.T if transpose else value

    return get


def vision_params_from_hf(tensors: TensorLookup, cfg: VisionConfig) -> dict[str, Any]:
    """Our params from a state dict (name -> array) holding the tower under `visual.` or `model.visual.` (or at
    its root: the tower alone). A missing tensor is a KeyError naming it."""
    prefix = next((p for p in VISION_PREFIXES if f"{p}patch_embed.proj.weight" in tensors), "")

    def get(name: str, transpose: bool) -> np.ndarray:
        key = prefix + name
        if key not in tensors:
            raise KeyError(f"vision tower: no tensor {key!r} in the checkpoint")
        value = np.asarray(tensors[key], np.float32)
        return value.T if transpose else value

    patch = get("patch_embed.proj.weight", False)  # [hidden, C, T, P, P]
    blocks = {ours: np.stack([get(f"blocks.{i}.{name}", t) for i in range(cfg.depth)])
              for ours, (name, t) in _BLOCK_WEIGHTS.items()}
    merger = {ours: get(f"merger.{name}", t) for ours, (name, t) in _MERGER_WEIGHTS.items()}
    return {"patch_embed": patch.reshape(patch.shape[0], -1).T, "blocks": blocks, "merger": merger}


def vision_params_to_hf(params: Mapping[str, Any], cfg: VisionConfig, prefix: str = "visual.") -> dict[str, np.ndarray]:
    """The tower's tensors under transformers' names (the inverse of `vision_params_from_hf`), fp32."""
    out = {f"{prefix}patch_embed.proj.weight": np.asarray(params["patch_embed"], np.float32).T.reshape(
        cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)}
    for ours, (name, transpose) in _BLOCK_WEIGHTS.items():
        stacked = np.asarray(params["blocks"][ours], np.float32)
        for i in range(cfg.depth):
            out[f"{prefix}blocks.{i}.{name}"] = stacked[i].T if transpose else stacked[i]
    for ours, (name, transpose) in _MERGER_WEIGHTS.items():
        value = np.asarray(params["merger"][ours], np.float32)
        out[f"{prefix}merger.{name}"] = value.T if transpose else value
    return {k: np.ascontiguousarray(v) for k, v in out.items()}

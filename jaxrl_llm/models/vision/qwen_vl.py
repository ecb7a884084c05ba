"""Qwen2.5-VL as one forward: the vision tower's features (models/vision/qwen_vit.py) in place of the image tokens'
embeddings, and the text model (Qwen2's decoder, `ModelConfig` with `mrope_section`) over M-RoPE positions.

A prompt holds, per image, `<|vision_start|>` then as many `<|image_pad|>` tokens as the image has merged
blocks (grid t x h x w / S^2) then `<|vision_end|>`. `image_slots` numbers the image tokens of a batch in row-major
order: token (b, t) takes feature slots[b, t] of the batch's images, in the order the processor packed them.

M-RoPE positions (`mrope_positions`, transformers' `get_rope_index` for images): text tokens count on in all three
streams; an image's tokens take (start, start + row, start + column) for (temporal, height, width), start being
the position the image begins at, and the text after it continues from start + max(h, w) / S. Padding takes 0.
A row's positions thus run shorter than its length; `deltas` [B] = (last position + 1) - valid tokens is what a
decode step adds to its 1-D position (all three streams equal from there on).

Gemma 3 (a SigLIP tower: models/vision/siglip.py) shares this module's plumbing: each image is
`<start_of_image>`, mm_tokens_per_image image tokens, `<end_of_image>`; its positions are the plain 1-D ones (given as
three equal streams, which the decoder reads as one), its deltas 0, and its text model lets an image's tokens see
each other (`ModelConfig.bidirectional_image_tokens`). Gemma 4 (models/vision/gemma4_vit.py) the same, with as many
image tokens as its processor's aspect-preserving resize gives the image (the grids say how many: rows x columns
/ k^2), and an image's tokens see each other on the sliding layers only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.arrays import DType
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.greedy import greedy_generate
from jaxrl_llm.models.model import forward_hidden, logits_from_hidden
from jaxrl_llm.models.vision.gemma4_vit import Gemma4VisionConfig, gemma4_vision_features, patch_positions, soft_tokens
from jaxrl_llm.models.vision.qwen3_vit import Qwen3VisionConfig, qwen3_image_features
from jaxrl_llm.models.vision.qwen_vit import VisionConfig, image_features
from jaxrl_llm.models.vision.siglip import SiglipVisionConfig, siglip_features
from jaxrl_llm.models.vision.tower_rows import TowerRows, row_tower_features

Array = jax.Array
QWEN_IMAGE_TOKEN_ID = 151655  # `<|image_pad|>` in the Qwen2.5-VL releases' vocabulary (config.json's default)


TowerConfig = VisionConfig | Qwen3VisionConfig | SiglipVisionConfig | Gemma4VisionConfig  # a tower of any kind


@jax.tree_util.register_static  # carried by `RowImages` through jit as static data (a trained tower's config)
@dataclasses.dataclass(frozen=True)
class VisionLanguage:
    """What a Qwen2.5-VL / Qwen3-VL / Gemma 3 / Gemma 4 policy adds to its text model: the tower's config and the
    image token ids (`vision_start_token_id`: Gemma's begin-of-image token)."""

    vision: TowerConfig
    image_token_id: int
    vision_start_token_id: int

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> VisionLanguage | None:
        """From a config.json; None when it is not a Qwen2.5-VL, Qwen3-VL, Gemma 3 or Gemma 4 multimodal model's (a
        Gemma 4 folder without a vision_config is a text model)."""
        if d.get("model_type") == "gemma4" and d.get("vision_config"):
            text_hidden = ModelConfig.from_hf_config(dict(d)).hidden_size
            tower4 = Gemma4VisionConfig.from_hf(d["vision_config"], text_hidden_size=text_hidden)
            return cls(vision=tower4, image_token_id=int(d.get("image_token_id", 258880)),
                       vision_start_token_id=int(d.get("boi_token_id", 255999)))
        if d.get("model_type") == "gemma3":
            text_hidden = ModelConfig.from_hf_config(dict(d)).hidden_size  # a sparse text_config: transformers' fills
            tower = SiglipVisionConfig.from_hf(d.get("vision_config") or {}, text_hidden_size=text_hidden,
                                               mm_tokens_per_image=int(d.get("mm_tokens_per_image", 256)))
            return cls(vision=tower, image_token_id=int(d.get("image_token_id", d.get("image_token_index", 262144))),
                       vision_start_token_id=int(d.get("boi_token_id", d.get("boi_token_index", 255999))))
        towers = {"qwen2_5_vl": VisionConfig, "qwen3_vl": Qwen3VisionConfig, "qwen3_vl_moe": Qwen3VisionConfig}
        if d.get("model_type") not in towers:
            return None
        return cls(vision=towers[d["model_type"]].from_hf(d.get("vision_config") or {}),
                   image_token_id=int(d.get("image_token_id", QWEN_IMAGE_TOKEN_ID)),
                   vision_start_token_id=int(d.get("vision_start_token_id", 151652)))

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers that add deepstack features (Qwen3-VL's; 0 for Qwen2.5-VL)."""
        return len(self.vision.deepstack_visual_indexes) if isinstance(self.vision, Qwen3VisionConfig) else 0

    @property
    def mrope(self) -> bool:
        """Whether the text model takes M-RoPE positions (Qwen) or plain ones (Gemma 3)."""
        return not isinstance(self.vision, (SiglipVisionConfig, Gemma4VisionConfig))

    def image_token_counts(self, image_grid_thw: np.ndarray) -> np.ndarray:
        """[images] int: each image's tokens in the prompt (Gemma 3's fixed count; otherwise the grid's blocks)."""
        grids = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
        if isinstance(self.vision, SiglipVisionConfig):
            return np.full(len(grids), self.vision.mm_tokens_per_image, np.int64)
        if isinstance(self.vision, Gemma4VisionConfig):
            return soft_tokens(self.vision, grids)
        return grids.prod(axis=1) // self.vision.spatial_merge_size ** 2

    def features(self, params: Mapping[str, Any], pixel_values: np.ndarray, image_grid_thw: np.ndarray, *,
                 dtype: DType = jnp.float32) -> tuple[Array, Array | None]:
        """(features [M, H], deepstack features [D, M, H] or None) of a batch's images through the tower
        (Gemma 3's pixel_values: [images, C, S, S], its grids not read; Gemma 4's: [images, max_patches, patch],
        its grids (1, rows, columns) of patches)."""
        if isinstance(self.vision, Gemma4VisionConfig):
            pixels = np.asarray(pixel_values, np.float32)
            out = gemma4_vision_features(params, self.vision, jnp.asarray(pixels),
                                         jnp.asarray(patch_positions(image_grid_thw, pixels.shape[1])), dtype=dtype)
            counts, room = self.image_token_counts(image_grid_thw), out.shape[1]
            index = np.concatenate([i * room + np.arange(c) for i, c in enumerate(counts.tolist())])
            return jnp.take(out.reshape(-1, out.shape[-1]), jnp.asarray(index, jnp.int32), axis=0), None
        if isinstance(self.vision, SiglipVisionConfig):
            out = siglip_features(params, self.vision, jnp.asarray(pixel_values), dtype=dtype)
            return out.reshape(-1, out.shape[-1]), None
        if isinstance(self.vision, Qwen3VisionConfig):
            stacked = qwen3_image_features(params, self.vision, pixel_values, image_grid_thw, dtype=dtype)
            return stacked[0], stacked[1:]
        return image_features(params, self.vision, pixel_values, image_grid_thw, dtype=dtype), None


def _image_runs(ids: np.ndarray, image_token_id: int) -> list[tuple[int, int]]:
    """[start, end) of each run of image tokens in one row's valid ids."""
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def mrope_positions(input_ids: np.ndarray, attention_mask: np.ndarray, image_grid_thw: np.ndarray,
                    vl: VisionLanguage) -> tuple[np.ndarray, np.ndarray]:
    """(positions [3, B, T] int32, deltas [B] int32) of a left- or right-padded batch (module doc)."""
    if not vl.mrope:  # Gemma 3 / 4: the plain positions in every stream
        return _plain_positions(input_ids, attention_mask, image_grid_thw, vl)
    merge = vl.vision.spatial_merge_size
    b, t = input_ids.shape
    positions = np.zeros((3, b, t), np.int32)
    deltas = np.zeros((b,), np.int32)
    grids = iter(np.asarray(image_grid_thw, np.int64).reshape(-1, 3).tolist())
    for row in range(b):
        valid = np.asarray(attention_mask[row]) > 0
        ids = np.asarray(input_ids[row])[valid]
        streams, pos, cursor = [], 0, 0
        for start, end in _image_runs(ids, vl.image_token_id):
            text = start - cursor
            streams.append(np.broadcast_to(pos + np.arange(text), (3, text)))
            pos += text
            try:
                gt, gh, gw = next(grids)
            except StopIteration:
                raise ValueError(f"row {row}: more runs of image tokens than images ({len(image_grid_thw)})") from None
            gh, gw = gh // merge, gw // merge
            if gt * gh * gw != end - start:
                raise ValueError(f"row {row}: a run of {end - start} image tokens for an image of {gt * gh * gw} "
                                 f"merged blocks (grid {gt} x {gh * merge} x {gw * merge})")
            tt, hh, ww = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
            streams.append(np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos)
            pos += max(gh, gw)
            cursor = end
        text = len(ids) - cursor
        streams.append(np.broadcast_to(pos + np.arange(text), (3, text)))
        row_positions = np.concatenate(streams, axis=1) if streams else np.zeros((3, 0), np.int64)
        positions[:, row, valid] = row_positions
        deltas[row] = (int(row_positions.max()) + 1 if row_positions.size else 0) - len(ids)
    if next(grids, None) is not None:
        raise ValueError(f"{len(image_grid_thw)} images but fewer runs of image tokens in the batch")
    return positions, deltas


def _plain_positions(input_ids: np.ndarray, attention_mask: np.ndarray, image_grid_thw: np.ndarray,
                     vl: VisionLanguage) -> tuple[np.ndarray, np.ndarray]:
    """`mrope_positions` of a model without M-RoPE: each valid token's index among its row's valid tokens, in all
    three streams; deltas 0. Each run of image tokens must be one image's, in order."""
    counts, mask = vl.image_token_counts(image_grid_thw).tolist(), np.asarray(attention_mask) > 0
    runs = 0
    for row in range(len(input_ids)):
        for start, end in _image_runs(np.asarray(input_ids[row])[mask[row]], vl.image_token_id):
            if runs < len(counts) and end - start != counts[runs]:
                raise ValueError(f"row {row}: a run of {end - start} image tokens for image {runs} of "
                                 f"{counts[runs]} tokens")
            runs += 1
    if runs != len(counts):
        raise ValueError(f"{len(image_grid_thw)} images but {runs} runs of image tokens in the batch")
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) * mask
    return np.broadcast_to(positions[None], (3, *positions.shape)).astype(np.int32), np.zeros(len(mask), np.int32)


def image_slots(input_ids: np.ndarray, attention_mask: np.ndarray, vl: VisionLanguage, num_features: int
                ) -> np.ndarray:
    """[B, T] int32: the feature each valid image token takes (row-major over the batch), -1 elsewhere."""
    is_image = (np.asarray(input_ids) == vl.image_token_id) & (np.asarray(attention_mask) > 0)
    if int(is_image.sum()) != num_features:
        raise ValueError(f"{int(is_image.sum())} image tokens in the batch but the images give {num_features} "
                         "features")
    slots = np.cumsum(is_image.reshape(-1)).reshape(is_image.shape) - 1
    return np.where(is_image, slots, -1).astype(np.int32)


class ImagePrompt(NamedTuple):
    """What a batch of prompts with images adds to their token ids for a sampler's prefill and decode."""

    positions: Array  # [3, B, P] int32 M-RoPE positions of the prompt tokens
    slots: Array  # [B, P] int32: the feature each image token takes, -1 elsewhere
    features: Array  # [M, H] fp32 image features
    deltas: Array  # [B] int32: added to each row's 1-D position when it decodes
    deepstack: Array | None = None  # [D, M, H] Qwen3-VL's deepstack features (None: Qwen2.5-VL)
    # a trained tower's: each prompt's images as pixels (host arrays, models/vision/tower_rows.py) and the tower
    tower_rows: TowerRows | None = None
    vision: VisionLanguage | None = None

    @property
    def embeds(self) -> tuple[Array, ...]:
        """`forward_hidden`'s embeds: (slots, features[, deepstack])."""
        return (self.slots, self.features) if self.deepstack is None else (self.slots, self.features, self.deepstack)

    def for_sampler(self) -> ImagePrompt:
        """What a sampler reads (the features): without a trained tower's pixels."""
        return self._replace(tower_rows=None, vision=None)


class RowImages(NamedTuple):
    """A scored batch's images, row by row (prompt + response columns): every leaf leads with the rows, so splitting
    rows into micro-batches, taking them and sharding them treats the images as the batch's other arrays."""

    positions: Array  # int32 [N, 3, T] M-RoPE positions (0 on padding)
    slots: Array  # int32 [N, T]: the row's own feature each image token takes, -1 elsewhere
    features: Array  # [N, K, H] each row's image features (K: the most any row holds, bucketed; zeros past a row's)
    deepstack: Array | None = None  # [N, D, K, H] Qwen3-VL's deepstack features (None: Qwen2.5-VL)
    # a trained tower (actor.freeze_vision_tower=False): each row's pixels, from which every pass computes the
    # features with the params it reads (`with_tower_features`); `vision`: the tower's config (static)
    tower: TowerRows | None = None
    vision: VisionLanguage | None = None

    def with_tower_features(self, vision_params: Mapping[str, Any], dtype: DType) -> RowImages:
        """These rows with their features (and deepstack) computed from their pixels by the tower at
        `vision_params` (the pass's own params: the update differentiates through them); unchanged without pixels."""
        if self.tower is None:
            return self
        assert self.vision is not None
        features, deepstack = row_tower_features(vision_params, self.vision.vision, self.tower, dtype=dtype)
        return self._replace(features=features, deepstack=deepstack)

    def decoder_inputs(self) -> tuple[Array, tuple[Array, ...]]:
        """(positions [3, N, T], embeds) as `forward_hidden` takes them."""
        if self.deepstack is None:
            return jnp.moveaxis(self.positions, 1, 0), (self.slots, self.features)
        return jnp.moveaxis(self.positions, 1, 0), (self.slots, self.features, jnp.moveaxis(self.deepstack, 1, 0))

    def pad_columns(self, before: int, after: int) -> RowImages:
        """Columns added as `batching.ops.pad_columns` adds them: `before` prompt columns on the left, `after`
        response columns on the right (padding: position 0, no feature)."""
        if not (before or after):
            return self
        return self._replace(positions=jnp.pad(self.positions, ((0, 0), (0, 0), (before, after))),
                             slots=jnp.pad(self.slots, ((0, 0), (before, after)), constant_values=-1))

    def pad_features(self, count: int) -> RowImages:
        """Room for `count` features per row (another batch's K, to join the two)."""
        extra = count - self.features.shape[1]
        if extra <= 0:
            return self
        if self.tower is not None:
            raise ValueError("joining rollouts whose rows carry a trained tower's pixels is not supported (DAPO's "
                             "group filter with actor.freeze_vision_tower=False)")
        deepstack = None if self.deepstack is None else jnp.pad(self.deepstack, ((0, 0), (0, 0), (0, extra), (0, 0)))
        return self._replace(features=jnp.pad(self.features, ((0, 0), (0, extra), (0, 0))), deepstack=deepstack)


def feature_bucket(count: int) -> int:
    """Per-row feature room: a power of two >= count (min 8), so image sizes compile a few update programs."""
    return max(8, 1 << max(count - 1, 0).bit_length())


def row_images(prompt: ImagePrompt, prompt_mask: np.ndarray, n: int, response_len: int) -> dict[str, Any]:
    """The `RowImages` fields of a sampled batch (for `RowImages(**placed)` once on the mesh): `prompt` (its [B, P]
    prompts' images: positions, slots and deltas as host arrays, the features where they are: the tower's device
    arrays are gathered on the devices, not fetched), `n` samples per prompt (prompt-major rows) and `response_len`
    response columns. Positions and slots come back as host arrays, the features as device arrays. A response token
    j of a row is at 1-D position (the row's prompt tokens + j) + its delta in every stream, as the sampler decoded
    it."""
    slots = np.asarray(prompt.slots)
    prompt_mask = np.asarray(prompt_mask) > 0
    counts = (slots >= 0).sum(axis=1)
    first = np.where(counts > 0, np.where(slots >= 0, slots, np.iinfo(np.int32).max).min(axis=1), 0)
    room = feature_bucket(int(counts.max()) if counts.size else 0)
    local = np.where(slots >= 0, slots - first[:, None], -1).astype(np.int32)
    # each row's features: its slice of the batch's packed features (processor order), zeros past it
    index = first[:, None] + np.arange(room)[None]
    valid = np.arange(room)[None] < counts[:, None]
    take = jnp.asarray(np.where(valid, index, 0))
    keep = jnp.asarray(valid)
    features = jnp.where(keep[..., None], jnp.take(jnp.asarray(prompt.features), take, axis=0), 0)
    lengths = prompt_mask.sum(axis=1)
    response = lengths[:, None] + np.arange(response_len)[None] + np.asarray(prompt.deltas)[:, None]
    positions = np.concatenate([np.asarray(prompt.positions),
                                np.broadcast_to(response[None], (3, *response.shape))], axis=2)
    positions = np.moveaxis(positions, 0, 1).astype(np.int32)  # [B, 3, P + R]
    slots_rows = np.concatenate([local, np.full((len(local), response_len), -1, np.int32)], axis=1)
    # row b * n + j: sample j of prompt b
    out: dict[str, Any] = {"positions": np.repeat(positions, n, axis=0), "slots": np.repeat(slots_rows, n, axis=0),
                           "features": jnp.repeat(features, n, axis=0)}
    if prompt.deepstack is not None:  # [D, M, H] -> each row's [D, K, H], as its features
        deep = jnp.moveaxis(jnp.take(jnp.asarray(prompt.deepstack), take, axis=1), 0, 1)  # [B, D, K, H]
        out["deepstack"] = jnp.repeat(jnp.where(keep[:, None, :, None], deep, 0), n, axis=0)
    if prompt.tower_rows is not None:  # a trained tower's pixels, each prompt's for its n rows, K slots as above
        rows = prompt.tower_rows
        index = np.zeros((len(slots), room), np.int32)
        index[:, :min(room, rows.feature_index.shape[1])] = np.asarray(rows.feature_index)[:, :room]
        out["tower"] = jax.tree.map(lambda x: np.repeat(np.asarray(x), n, axis=0), rows._replace(feature_index=index))
        out["vision"] = prompt.vision
    return out



def image_prompt(vision_params: Mapping[str, Any], vl: VisionLanguage, input_ids: np.ndarray,
                 attention_mask: np.ndarray, pixel_values: np.ndarray, image_grid_thw: np.ndarray, *,
                 compute_dtype: DType = jnp.float32) -> ImagePrompt:
    """The tower run once over the batch's images (processor order; image by image, `image_features`) and the
    positions / slots of its tokens."""
    features, deepstack = vl.features(vision_params, pixel_values, image_grid_thw, dtype=compute_dtype)
    positions, deltas = mrope_positions(input_ids, attention_mask, image_grid_thw, vl)
    slots = image_slots(input_ids, attention_mask, vl, features.shape[0])
    return ImagePrompt(jnp.asarray(positions), jnp.asarray(slots), features, jnp.asarray(deltas), deepstack)


def image_text_logits(params: dict, cfg: ModelConfig, vision_params: Mapping[str, Any], vl: VisionLanguage,
                      input_ids: np.ndarray, attention_mask: np.ndarray, pixel_values: np.ndarray,
                      image_grid_thw: np.ndarray, *, compute_dtype: DType = jnp.float32) -> Array:
    """[B, T, V] fp32 logits of prompts with images (the processor's pixel_values and grids)."""
    if vl.mrope and not cfg.mrope_section:
        raise ValueError(f"{cfg.architecture}: the text model has no mrope_section (not a Qwen2.5-VL text model)")
    prompt = image_prompt(vision_params, vl, input_ids, attention_mask, pixel_values, image_grid_thw,
                          compute_dtype=compute_dtype)
    hidden, _ = forward_hidden(params, cfg, jnp.asarray(input_ids), jnp.asarray(attention_mask),
                               positions=prompt.positions, compute_dtype=compute_dtype,
                               embeds=prompt.embeds)
    return logits_from_hidden(params, cfg, hidden)


def image_text_greedy(params: dict, cfg: ModelConfig, vision_params: Mapping[str, Any], vl: VisionLanguage,
                      input_ids: np.ndarray, attention_mask: np.ndarray, pixel_values: np.ndarray,
                      image_grid_thw: np.ndarray, max_new_tokens: int, *,
                      compute_dtype: DType = jnp.float32) -> Array:
    """[B, max_new_tokens] argmax continuations of left-padded prompts with images (the reference decoding the
    engines are tested against): the prefill over M-RoPE positions with the image features, then each new token
    at its row's 1-D position plus the row's M-RoPE delta (the three streams equal)."""
    prompt = image_prompt(vision_params, vl, input_ids, attention_mask, pixel_values, image_grid_thw,
                          compute_dtype=compute_dtype)
    return greedy_generate(params, cfg, jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32),
                           max_new_tokens, compute_dtype=compute_dtype, positions=prompt.positions,
                           embeds=prompt.embeds, position_offset=prompt.deltas)

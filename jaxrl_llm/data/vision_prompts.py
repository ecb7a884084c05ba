"""A vision-language policy's prompts: each image's placeholder as the model's own tokens, as many image tokens as
the HF image processor's resize gives the image, and a batch's pixels for the vision tower.

veRL renders a row's `<image>` placeholders through the processor's chat template (an image entry becomes
`<|vision_start|><|image_pad|><|vision_end|>`) and the processor then repeats `<|image_pad|>` once per merged
S x S block of the resized image. Here the placeholder text replaces each image in the messages before the
tokenizer's chat template renders them (the same tokens for Qwen2.5-VL's template, and any tokenizer that knows
the three tokens works), and `expand_image_tokens` repeats each `<|image_pad|>` id. The resize is the processor's
`smart_resize` (sides multiples of patch x merge, pixels within [min_pixels, max_pixels]), so the count is known
from the image's size alone and `data.max_prompt_length` counts the image tokens.

The pixels are transformers' `Qwen2VLImageProcessorPil` (PIL and numpy: no torch, no torchvision).

Gemma 3 (`ImageTokens.gemma3`): an image is `\n\n<start_of_image>`, mm_tokens_per_image `<image_soft_token>`,
`<end_of_image>\n\n` whatever its size (its processor resizes every image to the tower's square), pixels from
`Gemma3ImageProcessorPil` (no pan-and-scan crops).

Gemma 4 (`ImageTokens.gemma4`): an image is its begin-of-image token, one image token per pooled k x k cell of the
image resized keeping its aspect ratio within max_soft_tokens cells (`Gemma4ImageProcessorPil`'s
`get_aspect_ratio_preserving_size`), its end-of-image token; pixels [images, max_patches, P x P x C] and grids
(1, patch rows, patch columns) from `Gemma4ImageProcessorPil`.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.images import (
    IMAGE_PLACEHOLDER,
    content_parts,
    count_placeholders,
    decode_image,
    inline_images,
    load_image,
)
from jaxrl_llm.data.sources import DataError, RowRef
from jaxrl_llm.hf.tokenizer import Tokenizer, render_chat

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the Qwen VL processors' defaults (OpenAI CLIP's)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """How a policy's prompt holds an image (its tokens) and how its processor sizes and normalises it."""

    image_token_id: int
    start_text: str = "<|vision_start|>"
    pad_text: str = "<|image_pad|>"
    end_text: str = "<|vision_end|>"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    # Gemma 3: every image resized to image_size x image_size and `fixed_tokens` image tokens (0: Qwen's sizing)
    fixed_tokens: int = 0
    image_size: int = 0
    # Gemma 3: text its processor puts around each image's sequence once the chat template has rendered ("\n\n")
    around_text: str = ""
    # Gemma 4: at most max_soft_tokens image tokens per image, each a pooling_kernel_size^2 square of patches
    max_soft_tokens: int = 0
    pooling_kernel_size: int = 0

    @classmethod
    def gemma3(cls, image_token_id: int, mm_tokens_per_image: int, image_size: int) -> ImageTokens:
        """Gemma 3's: `<start_of_image>`, its soft tokens, `<end_of_image>` between blank lines (its processor's
        full image sequence), pixels normalised to [-1, 1]."""
        return cls(image_token_id=image_token_id, start_text="<start_of_image>", pad_text="<image_soft_token>",
                   end_text="<end_of_image>", fixed_tokens=mm_tokens_per_image, image_size=image_size,
                   image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), around_text="\n\n")

    @classmethod
    def gemma4(cls, image_token_id: int, start_text: str, pad_text: str, end_text: str, *, patch_size: int = 16,
               max_soft_tokens: int = 280, pooling_kernel_size: int = 3) -> ImageTokens:
        """Gemma 4's: its begin-of-image text, one image token per pooled cell of the resized image, its
        end-of-image text (the tokenizer's strings for the model's ids); pixels rescaled to [0, 1] only."""
        return cls(image_token_id=image_token_id, start_text=start_text, pad_text=pad_text, end_text=end_text,
                   patch_size=patch_size, merge_size=1, max_soft_tokens=max_soft_tokens,
                   pooling_kernel_size=pooling_kernel_size, image_mean=(0.0, 0.0, 0.0), image_std=(1.0, 1.0, 1.0))

    @property
    def placeholder(self) -> str:
        """What one image becomes in the messages the chat template renders."""
        return self.start_text + self.pad_text + self.end_text

    def after_render(self, text: str) -> str:
        """A rendered prompt as the model's processor leaves it: Gemma 3's processor puts a blank line before and
        after each image once the template has rendered (so a template that trims messages keeps them)."""
        if not self.around_text:
            return text
        return text.replace(self.placeholder, self.around_text + self.placeholder + self.around_text)

    def describe(self) -> str:
        """How images become tokens (the run summary)."""
        if self.fixed_tokens:
            return f"images resized to {self.image_size} x {self.image_size}, {self.fixed_tokens} image tokens each"
        if self.max_soft_tokens:
            side = self.patch_size * self.pooling_kernel_size
            return (f"images resized keeping their aspect ratio to at most {self.max_soft_tokens} image tokens, one "
                    f"per {side}-pixel square")
        return (f"images resized to {self.min_pixels}..{self.max_pixels} pixels, one image token per "
                f"{self.patch_size * self.merge_size}-pixel square")

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the processor resizes a width x height image to."""
        if self.max_soft_tokens:
            from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

            return get_aspect_ratio_preserving_size(height, width, patch_size=self.patch_size,
                                                    max_patches=self.max_soft_tokens * self.pooling_kernel_size ** 2,
                                                    pooling_kernel_size=self.pooling_kernel_size)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        return smart_resize(height, width, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels,
                            max_pixels=self.max_pixels)

    def tokens_for(self, width: int, height: int) -> int:
        """Image tokens of a width x height image: its merged blocks after the resize (Gemma 3: a fixed count)."""
        if self.fixed_tokens:
            return self.fixed_tokens
        h, w = self.resized(width, height)
        merge = self.pooling_kernel_size if self.max_soft_tokens else self.merge_size
        return (h // self.patch_size) * (w // self.patch_size) // merge ** 2

    def processor(self) -> Any:
        if self.max_soft_tokens:
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

            return Gemma4ImageProcessorPil(patch_size=self.patch_size, max_soft_tokens=self.max_soft_tokens,
                                           pooling_kernel_size=self.pooling_kernel_size)
        if self.fixed_tokens:
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

            return Gemma3ImageProcessorPil(size={"height": self.image_size, "width": self.image_size},
                                           image_mean=list(self.image_mean), image_std=list(self.image_std))
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(patch_size=self.patch_size, merge_size=self.merge_size,
                                        temporal_patch_size=self.temporal_patch_size, min_pixels=self.min_pixels,
                                        max_pixels=self.max_pixels, image_mean=list(self.image_mean),
                                        image_std=list(self.image_std))

    def pixels(self, images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches, C x T x P x P] fp32, image_grid_thw [images, 3] int64) of `images` (what
        `data.images.row_images` kept: bytes, paths, PIL images), in order. Gemma 3: pixel_values [images, C, S, S]
        and grids of ones (one per image; the tower does not read them). Gemma 4: pixel_values [images, max_patches,
        P x P x C] and grids (1, patch rows, patch columns)."""
        out = self.processor()(images=[load_image(image) for image in images], return_tensors="np")
        if self.max_soft_tokens:
            positions = np.asarray(out["image_position_ids"], np.int64)  # (x, y) per patch, -1 on padding
            grids = np.stack([np.ones(len(positions), np.int64), positions[..., 1].max(axis=1) + 1,
                              positions[..., 0].max(axis=1) + 1], axis=1)
            return np.asarray(out["pixel_values"], np.float32), grids
        if self.fixed_tokens:
            return np.asarray(out["pixel_values"], np.float32), np.ones((len(images), 3), np.int64)
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def with_preprocessor(self, folder: str | pathlib.Path) -> ImageTokens:
        """These tokens with a model folder's `preprocessor_config.json` sizes and normalisation (unchanged without
        one)."""
        path = pathlib.Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            return self
        d = json.loads(path.read_text())
        size = d.get("size") or {}
        if self.max_soft_tokens:  # Gemma 4's: the patch, the soft-token budget, the pooling
            return dataclasses.replace(
                self, patch_size=int(d.get("patch_size", self.patch_size)),
                max_soft_tokens=int(d.get("max_soft_tokens", self.max_soft_tokens)),
                pooling_kernel_size=int(d.get("pooling_kernel_size", self.pooling_kernel_size)))
        if self.fixed_tokens:  # Gemma 3's: {"height": 896, "width": 896}
            return dataclasses.replace(
                self, image_size=int(size.get("height", self.image_size)),
                image_mean=tuple(float(x) for x in d.get("image_mean", self.image_mean)),
                image_std=tuple(float(x) for x in d.get("image_std", self.image_std)))
        return dataclasses.replace(
            self, patch_size=int(d.get("patch_size", self.patch_size)),
            merge_size=int(d.get("merge_size", self.merge_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", self.temporal_patch_size)),
            min_pixels=int(d.get("min_pixels", size.get("shortest_edge", self.min_pixels))),
            max_pixels=int(d.get("max_pixels", size.get("longest_edge", self.max_pixels))),
            image_mean=tuple(float(x) for x in d.get("image_mean", self.image_mean)),
            image_std=tuple(float(x) for x in d.get("image_std", self.image_std)))


def with_image_tokens(prompt: Sequence[Mapping[str, Any]] | str, placeholder: str) -> list[dict[str, Any]] | str:
    """`prompt` with each image (`<image>` in its text, an HF content entry of type 'image') as `placeholder`, the
    messages' content joined into text (what a chat template renders)."""
    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, placeholder)
    out = []
    for message in prompt:
        text = []
        for part in content_parts(message):
            if isinstance(part, str):
                text.append(part.replace(IMAGE_PLACEHOLDER, placeholder))
            elif isinstance(part, Mapping) and part.get("type") == "image":
                text.append(placeholder)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                text.append(part["text"].replace(IMAGE_PLACEHOLDER, placeholder))
        out.append({**message, "content": "".join(text)})
    return out


def expand_image_tokens(ids: np.ndarray, counts: Sequence[int], image_token_id: int, where: RowRef | str
                        ) -> np.ndarray:
    """`ids` with its k-th image token repeated counts[k] times; a DataError naming the row when the rendered
    prompt holds another number of image tokens than images (a template that drops or repeats them)."""
    ids = np.asarray(ids, np.int32)
    at = np.flatnonzero(ids == image_token_id)
    if len(at) != len(counts):
        raise DataError(f"{where}: the rendered prompt holds {len(at)} image token(s) (id {image_token_id}) for "
                        f"{len(counts)} image(s): the chat template or the text changed the placeholders")
    repeats = np.ones(len(ids), np.int64)
    repeats[at] = np.asarray(counts, np.int64)
    return np.repeat(ids, repeats)


def chat_with_images(messages: Sequence[Mapping[str, Any]], tokens: ImageTokens, tokenizer: Tokenizer,
                     images: Sequence[Any] = (), where: str = "prompt") -> tuple[np.ndarray, list[Any]]:
    """(token ids with each image's tokens, the RGB images in order) of one chat whose messages hold HF content
    lists ({"type": "image", "image": PIL-or-path-or-bytes}, {"type": "text", "text": ...}) and / or `<image>`
    placeholders taking `images` in order (the images a content entry carries come first, as the row readers
    take them); a DataError naming `where` when images and placeholders disagree or an image does not decode."""
    listed = [*inline_images(messages), *images]
    wanted = count_placeholders(messages)
    if wanted != len(listed):
        raise DataError(f"{where}: {wanted} image placeholder(s) ({IMAGE_PLACEHOLDER!r} or {{'type': 'image'}}) but "
                        f"{len(listed)} image(s)")
    decoded = [decode_image(image, f"{where}: image {i}") for i, image in enumerate(listed)]
    rendered = with_image_tokens(messages, tokens.placeholder)
    assert not isinstance(rendered, str)
    text = tokens.after_render(render_chat(tokenizer, rendered, add_generation_prompt=True))
    ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    counts = [tokens.tokens_for(*image.size) for image in decoded]
    return expand_image_tokens(ids, counts, tokens.image_token_id, where), decoded

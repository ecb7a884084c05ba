"""Images of multimodal prompt rows, in veRL's data format.

veRL's vision-language rows (its geo3k / multimodal preprocessing scripts) hold

    prompt   chat messages whose text holds one `<image>` placeholder per image, in order
    images   a list per row (column `data.image_key`): {"bytes": PNG/JPEG bytes}, {"path": file}, a PIL image,
             raw bytes or a path string
    videos   a list per row (column `data.video_key`): refused (video frames are not read yet)

HF chat messages may instead hold content lists ({"type": "image", "image": PIL-or-path}, {"type": "text",
...}): their image entries count as placeholders, and their inline images are the row's when it has no
`images` column.

`row_images(row, ref, data)` reads and checks one row: every image decodes (PIL, converted to RGB), and the
placeholders and images agree in number; a failure is a `DataError` naming the file, row and image. A relative
path is read from the data file's folder (veRL writes absolute paths or bytes; a copied dataset keeps its
relative layout).
"""
from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.sources import DataError, RowRef

IMAGE_PLACEHOLDER = "<image>"  # veRL's text placeholder (its rows' prompts hold one per image)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        return list(value)
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]  # one image given alone


def _folder(ref: RowRef | str) -> str:
    path = ref.path if isinstance(ref, RowRef) else ""
    return os.path.dirname(os.path.abspath(path)) if path and "://" not in path else os.getcwd()


def decode_image(value: Any, where: str, folder: str = "") -> Any:
    """One image as an RGB `PIL.Image.Image`: from a PIL image, {"bytes": ...} / {"path": ...} (veRL / HF datasets'
    Image feature), raw bytes, a path, or an [H, W, 3] uint8 array. A DataError names `where` when it cannot."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = str(value["path"])
        elif value.get("image") is not None:  # an HF content entry {"type": "image", "image": ...}
            return decode_image(value["image"], where, folder)
        else:
            raise DataError(f"{where}: an image entry needs 'bytes' or 'path'; got keys {sorted(value)}")
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3:
        return Image.fromarray(value).convert("RGB")
    try:
        if isinstance(value, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(bytes(value))) as image:
                return image.convert("RGB")
        if isinstance(value, str):
            path = value if os.path.isabs(value) or not folder else os.path.join(folder, value)
            if not os.path.exists(path):
                raise DataError(f"{where}: image file {value!r} not found (relative paths are read from {folder})")
            with Image.open(path) as image:
                return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"{where}: cannot decode the image ({type(err).__name__}: {err})") from err
    raise DataError(f"{where}: an image must be bytes, a path, {{'bytes': ...}} / {{'path': ...}}, a PIL image or "
                    f"an [H, W, 3] uint8 array; got {type(value).__name__}")


def content_parts(message: Mapping[str, Any]) -> list[Any]:
    content = message.get("content")
    if isinstance(content, np.ndarray):
        content = content.tolist()
    return list(content) if isinstance(content, (list, tuple)) else [content]


def count_placeholders(prompt: Sequence[Mapping[str, Any]] | str) -> int:
    """Images a prompt refers to: `<image>` in its text, plus HF content entries of type 'image'."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    count = 0
    for message in prompt:
        for part in content_parts(message):
            if isinstance(part, str):
                count += part.count(IMAGE_PLACEHOLDER)
            elif isinstance(part, Mapping) and part.get("type") == "image":
                count += 1
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                count += part["text"].count(IMAGE_PLACEHOLDER)
    return count


def inline_images(prompt: Sequence[Mapping[str, Any]] | str) -> list[Any]:
    """The images HF content entries carry themselves ({"type": "image", "image": ...}), in order."""
    if isinstance(prompt, str):
        return []
    return [part for message in prompt for part in content_parts(message)
            if isinstance(part, Mapping) and part.get("type") == "image" and part.get("image") is not None]


def row_images(row: Mapping[str, Any], prompt: Sequence[Mapping[str, Any]] | str, ref: RowRef | str,
               image_key: str, video_key: str) -> list[Any]:
    """The images of one row (empty for a text row), each checked to decode and counted against the prompt's
    placeholders; returned as given, a relative path made absolute (a dataset keeps its encoded images, not
    decoded pixels: `load_image` decodes one when a batch needs it)."""
    return [value for value, _ in sized_row_images(row, prompt, ref, image_key, video_key)]


def sized_row_images(row: Mapping[str, Any], prompt: Sequence[Mapping[str, Any]] | str, ref: RowRef | str,
                     image_key: str, video_key: str) -> list[tuple[Any, tuple[int, int]]]:
    """`row_images` with each image's (width, height), read by the one decode that checks it (a
    vision-language policy's image token counts follow from the sizes)."""
    videos = _as_list(row.get(video_key)) if video_key else []
    if videos:
        raise DataError(f"{ref}: column {video_key!r} (data.video_key) holds {len(videos)} video(s); videos are "
                        "not supported (only images: data.image_key)")
    listed = _as_list(row.get(image_key)) if image_key else []
    column = f"column {image_key!r} (data.image_key)"
    if not listed:
        listed, column = inline_images(prompt), "the prompt's image entries"
    wanted = count_placeholders(prompt)
    if wanted != len(listed):
        raise DataError(f"{ref}: the prompt has {wanted} image placeholder(s) ({IMAGE_PLACEHOLDER!r} or "
                        f"{{'type': 'image'}}) but {column} holds {len(listed)} image(s)")
    folder = _folder(ref)
    out = []
    for i, value in enumerate(listed):
        size = decode_image(value, f"{ref}: image {i} of {column}", folder).size
        out.append((_absolute(value, folder), size))
    return out


def _absolute(value: Any, folder: str) -> Any:
    """`value` with a relative path made absolute (read from `folder`, the data file's)."""
    if isinstance(value, Mapping) and "image" in value and value.get("bytes") is None and value.get("path") is None:
        value = value["image"]
    if isinstance(value, str):
        return os.path.join(folder, value)
    if isinstance(value, Mapping) and value.get("bytes") is None and isinstance(value.get("path"), str):
        return {"path": os.path.join(folder, value["path"])}
    return value


def load_image(source: Any) -> Any:
    """An RGB PIL image from what `row_images` returned (checked then: decoding cannot fail but for a file
    removed since)."""
    return decode_image(source, "image")

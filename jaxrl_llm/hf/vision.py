"""A Qwen2.5-VL folder's vision tower: its config and weights (`visual.*` as the releases save them, or
`model.visual.*` as transformers 5 does), beside the text model `load_hf_folder` loads (docs/vision.md)."""
from __future__ import annotations

import pathlib
from typing import Any

from jaxrl_llm.hf.hf_folder import SafetensorsSource, read_hf_config
from jaxrl_llm.models.vision.qwen_vit import VISION_PREFIXES, vision_params_from_hf
from jaxrl_llm.models.vision.qwen_vl import VisionLanguage


class _Tower:
    """The tower's tensors of a folder, read by name on demand (`vision_params_from_hf` asks for each)."""

    def __init__(self, source: SafetensorsSource):
        self.source = source

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.source.shape(name) is not None

    def __getitem__(self, name: str) -> Any:
        return self.source.read(name)


def load_vision_tower(path: str | pathlib.Path) -> tuple[VisionLanguage, dict[str, Any]]:
    """(the vision-language settings, the tower's fp32 params) of a Qwen2.5-VL folder; a ValueError for a folder
    of another model."""
    vl = VisionLanguage.from_hf_config(read_hf_config(path))
    if vl is None:
        raise ValueError(f"{path}: not a Qwen2.5-VL folder (config.json model_type is not 'qwen2_5_vl')")
    tensors = _Tower(SafetensorsSource(path))
    if not any(f"{p}patch_embed.proj.weight" in tensors for p in VISION_PREFIXES):
        raise ValueError(f"{path}: no vision tower weights ({' or '.join(p + '*' for p in VISION_PREFIXES)})")
    return vl, vision_params_from_hf(tensors, vl.vision)  # type: ignore[arg-type]

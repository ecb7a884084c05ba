"""A Qwen2.5-VL / Qwen3-VL / Gemma 3 / Gemma 4 folder's vision tower: its config and weights (`visual.*` as the Qwen
releases save them, or `model.visual.*` as transformers 5 does; Gemma 3's `vision_tower.*` and
`multi_modal_projector.*`, Gemma 4's `vision_tower.*` and `embed_vision.*`),
beside the text model `load_hf_folder` loads (docs/vision.md); and the export of both back to a folder transformers
loads."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf.export import export_hf, staged_folder
from jaxrl_llm.hf.hf_folder import SafetensorsSource, read_hf_config
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models import ModelConfig
from jaxrl_llm.models.dtypes import as_jnp_dtype
from jaxrl_llm.models.vision.gemma4_vit import (
    Gemma4VisionConfig,
    gemma4_vision_params_from_hf,
    gemma4_vision_params_to_hf,
)
from jaxrl_llm.models.vision.qwen3_vit import (
    Qwen3VisionConfig,
    qwen3_vision_params_from_hf,
    qwen3_vision_params_to_hf,
)
from jaxrl_llm.models.vision.qwen_vit import VISION_PREFIXES, VisionConfig, vision_params_from_hf, vision_params_to_hf
from jaxrl_llm.models.vision.qwen_vl import VisionLanguage
from jaxrl_llm.models.vision.siglip import SiglipVisionConfig, siglip_params_from_hf, siglip_params_to_hf

_ARCHITECTURES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
                  "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
                  "gemma4": "Gemma4ForConditionalGeneration"}
_NOT_VL = ("not a Qwen2.5-VL / Qwen3-VL / Gemma 3 / Gemma 4 folder (config.json model_type is not 'qwen2_5_vl', "
           "'qwen3_vl', 'qwen3_vl_moe' or 'gemma3', nor 'gemma4' with a vision_config)")


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # an image processor's settings


def folder_vision_language(path: str | pathlib.Path) -> VisionLanguage:
    """The `VisionLanguage` of a folder (no weight read): its config.json's, with Gemma 4's soft-token budget from
    its preprocessor_config.json (`max_soft_tokens`, 280 without one); a ValueError for a folder of another model."""
    config = read_hf_config(path)
    vl = VisionLanguage.from_hf_config(config)
    if vl is None:
        raise ValueError(f"{path}: {_NOT_VL}")
    preprocessor = pathlib.Path(path) / "preprocessor_config.json"
    if isinstance(vl.vision, Gemma4VisionConfig) and preprocessor.is_file():
        budget = json.loads(preprocessor.read_text()).get("max_soft_tokens")
        if budget is not None:  # from_hf again: it checks the budget is one the processor takes
            vl = dataclasses.replace(vl, vision=Gemma4VisionConfig.from_hf(
                config["vision_config"], text_hidden_size=vl.vision.out_hidden_size, max_soft_tokens=int(budget)))
    return vl


def load_vision_tower(path: str | pathlib.Path) -> tuple[VisionLanguage, dict[str, Any]]:
    """(the vision-language settings, the tower's fp32 params) of a vision-language folder; a ValueError for a
    folder of another model."""
    vl = folder_vision_language(path)
    tensors = SafetensorsSource(path)  # read by name on demand
    if isinstance(vl.vision, Gemma4VisionConfig):
        return vl, gemma4_vision_params_from_hf(tensors, vl.vision)
    if isinstance(vl.vision, SiglipVisionConfig):
        return vl, siglip_params_from_hf(tensors, vl.vision)
    if not any(f"{p}patch_embed.proj.weight" in tensors for p in VISION_PREFIXES):
        raise ValueError(f"{path}: no vision tower weights ({' or '.join(p + '*' for p in VISION_PREFIXES)})")
    if isinstance(vl.vision, Qwen3VisionConfig):
        return vl, qwen3_vision_params_from_hf(tensors, vl.vision)
    return vl, vision_params_from_hf(tensors, vl.vision)


def export_vision_language(cfg: ModelConfig, params: dict, vl_config: Mapping[str, Any],
                           vision_params: Mapping[str, Any], out_dir: str | pathlib.Path, *,
                           tokenizer: Tokenizer | None = None, dtype: DType | None = None,
                           processor_from: str | pathlib.Path | None = None) -> pathlib.Path:
    """A Qwen2.5-VL / Qwen3-VL / Gemma 3 / Gemma 4 folder transformers loads: the text model as `export_hf` writes it
    (`model.*`, `lm_head.*`, the released checkpoints' names; Qwen3-VL's and Gemma 3's under `model.language_model.*`),
    the tower under transformers 5's names (`model.visual.*`; `model.vision_tower.*` and the projector) in a file of
    its own, one index over both, and `vl_config` (the source folder's config.json) as config.json; the processor's
    settings (`PROCESSOR_FILES`) copied from `processor_from` (the source folder) where it has them, so the export
    sizes images as the source does (Gemma 4's soft-token budget). Local folders only."""
    out_dir = pathlib.Path(out_dir)
    vl = VisionLanguage.from_hf_config(vl_config)
    if vl is None:
        raise ValueError(f"vl_config: {_NOT_VL}")
    np_dtype = np.dtype(as_jnp_dtype(dtype if dtype is not None else params["embedding"].dtype, what="export"))
    # transformers 5 maps the released text names (model.layers.*) to its own but not the tower's visual.*
    if isinstance(vl.vision, Gemma4VisionConfig):
        named = gemma4_vision_params_to_hf(vision_params, vl.vision, "model.")
    elif isinstance(vl.vision, SiglipVisionConfig):
        named = siglip_params_to_hf(vision_params, vl.vision, "model.")
    elif isinstance(vl.vision, Qwen3VisionConfig):
        named = qwen3_vision_params_to_hf(vision_params, vl.vision, "model.visual.")
    else:
        named = vision_params_to_hf(vision_params, vl.vision, "model.visual.")
    architecture = _ARCHITECTURES[str(vl_config["model_type"])]
    tower = {k: v.astype(np_dtype) for k, v in named.items()}
    with staged_folder(out_dir) as tmp:  # all of it or nothing at out_dir
        folder = export_hf(cfg, params, tmp / "hf", tokenizer=tokenizer, dtype=dtype)
        index_path = folder / "model.safetensors.index.json"
        if index_path.is_file():
            index = json.loads(index_path.read_text())
        else:  # one text file: renamed into a sharded layout (a reader takes a lone model.safetensors over an index)
            text_file = "model-text.safetensors"
            (folder / "model.safetensors").rename(folder / text_file)
            with safe_open(str(folder / text_file), framework="numpy") as handle:
                names = list(handle.keys())
            index = {"metadata": {"total_size": (folder / text_file).stat().st_size},
                     "weight_map": dict.fromkeys(names, text_file)}
        if not isinstance(vl.vision, VisionConfig):  # Qwen3-VL's / Gemma's text names: model.language_model.*
            index["weight_map"] = _language_model_names(folder, index["weight_map"])
        save_file(tower, str(folder / "model-vision.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tower, "model-vision.safetensors"))
        index["metadata"]["total_size"] = int(index["metadata"].get("total_size", 0)) + sum(
            t.nbytes for t in tower.values())
        index_path.write_text(json.dumps({"metadata": index["metadata"],
                                          "weight_map": dict(sorted(index["weight_map"].items()))}, indent=2))
        config = {**dict(vl_config), "architectures": [architecture],
                  "dtype": np_dtype.name, "torch_dtype": np_dtype.name}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        source = pathlib.Path(processor_from) if processor_from is not None else None
        for name in PROCESSOR_FILES:
            if source is not None and (source / name).is_file():
                (folder / name).write_bytes((source / name).read_bytes())
        for item in folder.iterdir():  # the folder's files to the staged root
            item.rename(tmp / item.name)
        folder.rmdir()
    return out_dir


def _language_model_names(folder: pathlib.Path, weight_map: dict[str, str]) -> dict[str, str]:
    """The text files of `folder` rewritten with `model.*` named `model.language_model.*` (Qwen3-VL's layout,
    which transformers reads without renaming); the new weight map."""
    rename = lambda name: "model.language_model." + name[len("model."):] if name.startswith("model.") else name  # noqa: E731
    for file in sorted(set(weight_map.values())):
        with safe_open(str(folder / file), framework="numpy") as handle:
            tensors = {rename(name): handle.get_tensor(name) for name in handle.keys()}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    return {rename(name): file for name, file in weight_map.items()}


def vision_language_config(cfg: ModelConfig, vl: VisionLanguage, *, vision_end_token_id: int,
                           video_token_id: int) -> dict[str, Any]:
    """A Qwen2.5-VL config.json (transformers 5's layout: `text_config`, `vision_config`) for a text model `cfg`
    with M-RoPE and the tower of `vl`: what a policy without a source folder (tiny:qwen2_5_vl) exports with."""
    if not cfg.mrope_section or not isinstance(vl.vision, VisionConfig):
        raise ValueError(f"{cfg.architecture}: a Qwen2.5-VL config needs a text model with an mrope_section and "
                         "Qwen2.5-VL's tower")
    text = cfg.to_hf_config()
    text.pop("architectures", None)
    text.update(model_type="qwen2_5_vl_text",
                rope_parameters={**text.get("rope_parameters", {}), "mrope_section": list(cfg.mrope_section)})
    vision = {f.name: getattr(vl.vision, f.name) for f in dataclasses.fields(vl.vision)}
    vision["fullatt_block_indexes"] = list(vl.vision.fullatt_block_indexes)
    return {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "text_config": text, "vision_config": vision, "image_token_id": vl.image_token_id,
            "vision_start_token_id": vl.vision_start_token_id, "vision_end_token_id": vision_end_token_id,
            "video_token_id": video_token_id, "tie_word_embeddings": cfg.tie_word_embeddings,
            **{k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in text}}

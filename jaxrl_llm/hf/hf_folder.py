"""Load a Hugging Face model folder (config.json + safetensors, single file or sharded) without torch.

Tensors are read one at a time with `safetensors.safe_open(..., framework="numpy")` (bf16 comes
back as an `ml_dtypes` array), so nothing but the parameter being assembled lives on the host.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxrl_llm.arrays import DType
from jaxrl_llm.hf import mxfp4
from jaxrl_llm.hf.assemble import Shardings, assemble_params
from jaxrl_llm.models.config import ModelConfig

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def read_hf_config(folder: str | pathlib.Path) -> dict[str, Any]:
    folder = pathlib.Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model folder {str(folder)!r}")
    with open(path) as f:
        return json.load(f)


TEXT_TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head."))


class SafetensorsSource:
    """HF-named tensors across one or more .safetensors files, opened lazily."""

    def __init__(self, folder: str | pathlib.Path):
        folder = pathlib.Path(folder)
        if (folder / INDEX_NAME).is_file():
            with open(folder / INDEX_NAME) as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {name: folder / file for name, file in weight_map.items()}
        elif (folder / WEIGHTS_NAME).is_file():
            self._file_of = None
            self._single = folder / WEIGHTS_NAME
        else:
            raise FileNotFoundError(
                f"no {WEIGHTS_NAME} or {INDEX_NAME} in model folder {str(folder)!r}")
        self._handles: dict[pathlib.Path, Any] = {}
        self._transposed: set[str] = set()  # names read transposed (`orient_experts`)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._stored: dict[str, str] = {}  # the name a tensor is read by -> its name in the file
        for file in self._files():
            handle = self._open(file)
            for name in handle.keys():
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())
                self._stored[name] = name
        # a multimodal checkpoint's language model (Gemma 3: `language_model.model.*` as transformers 4
        # saves it, `model.language_model.*` as transformers 5 does) answers to the text model's names
        for name in list(self._shapes):
            for theirs, ours in TEXT_TOWER_PREFIXES:
                if name.startswith(theirs) and ours + name[len(theirs):] not in self._shapes:
                    alias = ours + name[len(theirs):]
                    self._shapes[alias], self._stored[alias] = self._shapes[name], name
        # MXFP4 experts (GPT-OSS releases): `<name>_blocks` + `<name>_scales` answer to `<name>`, dequantised
        self._mxfp4: dict[str, tuple[str, str]] = {}
        for name in list(self._shapes):
            base = name[:-len(mxfp4.BLOCKS_SUFFIX)]
            if name.endswith(mxfp4.BLOCKS_SUFFIX) and base + mxfp4.SCALES_SUFFIX in self._shapes \
                    and base not in self._shapes:
                self._shapes[base] = mxfp4.dequantized_shape(self._shapes[name])
                self._mxfp4[base] = (name, base + mxfp4.SCALES_SUFFIX)

    def orient_experts(self, cfg: ModelConfig) -> None:
        """Fused expert tensors stored [E, in, out] (Qwen3-VL-MoE's releases: gate_up_proj [E, H, 2F], down_proj
        [E, F, H]) read as [E, out, in], the layout transformers 5 holds and saves."""
        h, f = cfg.hidden_size, cfg.moe_intermediate_size
        for name, shape in list(self._shapes.items()):
            stored = {"mlp.experts.gate_up_proj": (h, 2 * f), "mlp.experts.down_proj": (f, h)}
            for suffix, (rows, cols) in stored.items():
                if name.endswith(suffix) and len(shape) == 3 and shape[1:] == (rows, cols) and rows != cols:
                    self._shapes[name] = (shape[0], cols, rows)
                    self._transposed.add(name)

    def _files(self) -> list[pathlib.Path]:
        if self._file_of is None:
            return [self._single]
        files = sorted(set(self._file_of.values()))
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"weights shard {str(file)!r} named in {INDEX_NAME} is missing")
        return files

    def _open(self, file: pathlib.Path):
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="numpy")
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __getitem__(self, name: str) -> np.ndarray:
        return self.read(name)

    def read(self, name: str) -> np.ndarray:
        if name in self._mxfp4:
            blocks, scales = self._mxfp4[name]
            return mxfp4.dequantize(self.read(blocks), self.read(scales))
        transposed = name in self._transposed
        name = self._stored.get(name, name)
        file = self._single if self._file_of is None else self._file_of[name]
        tensor = self._open(file).get_tensor(name)
        return tensor.transpose(0, 2, 1) if transposed else tensor


def _head_for(cfg_dict: dict[str, Any], head: str | None) -> str:
    if head is not None:
        return head
    archs = cfg_dict.get("architectures") or []
    return "score" if archs and archs[0].endswith("ForSequenceClassification") else "lm"


def load_hf_folder(path: str | pathlib.Path, *, dtype: DType = jnp.float32,
                   shardings: Shardings = None, head: str | None = None, num_labels: int | None = None,
                   rng: jax.Array | None = None) -> tuple[ModelConfig, dict]:
    """(cfg, params) from an HF folder. `head`: "lm" | "value" | "score" (default: from the
    architecture: *ForSequenceClassification -> "score", else "lm"). "value" takes the backbone of
    a causal-LM checkpoint and a fresh value head (from `rng`), or `score.weight` when present.
    `shardings`: see `jaxrl_llm.hf.assemble`.
    """
    cfg_dict = read_hf_config(path)
    cfg = ModelConfig.from_hf_config(cfg_dict)
    head = _head_for(cfg_dict, head)
    if num_labels is None:
        num_labels = int(cfg_dict.get("num_labels") or len(cfg_dict.get("id2label") or {}) or 1)
    source = SafetensorsSource(path)
    if cfg.experts_fused:
        source.orient_experts(cfg)
    params = assemble_params(cfg, source, head=head, num_labels=num_labels, dtype=dtype,
                             shardings=shardings, rng=rng)
    return cfg, params

"""Export params to a Hugging Face folder `transformers.from_pretrained` loads with equal logits.

Writes config.json, model.safetensors (or model-0000k-of-0000n.safetensors shards plus
model.safetensors.index.json past `max_shard_size` bytes), generation_config.json, and the
tokenizer's files (chat template included) when a tokenizer is given. Everything is written into a
temporary sibling folder that is renamed into place at the end, so a failure leaves no
half-written output (leftovers of a killed export are removed by the next one). A bucket URL
(jaxrl_llm/storage.py) gets the folder built locally and then uploaded. One shard's tensors are on
the host at a time.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxrl_llm import storage
from jaxrl_llm.arrays import DType
from jaxrl_llm.hf import mxfp4
from jaxrl_llm.hf.names import TensorSpec, get_path, interleave_parts, tensor_specs
from jaxrl_llm.hf.tokenizer import Tokenizer
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.dtypes import as_jnp_dtype

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3


def _head_of(params: dict) -> tuple[str, int]:
    if "value_head" in params:
        raise ValueError("cannot export value-head params as an HF model; export the policy "
                         "(head='lm') or a reward model (head='score')")
    if "score" in params:
        return "score", int(params["score"]["kernel"].shape[-1])
    return "lm", 1


Unit = tuple[TensorSpec, tuple[int, ...], str]  # (spec, index into our leaf, HF tensor name)


EXPERT_FORMATS = ("dense", "mxfp4")
# GPT-OSS's expert matrices, the tensors an MXFP4 export stores as blocks and scales (as its releases do)
_MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# what transformers' MXFP4 quantizer leaves in the compute dtype (the releases' list)
_MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _hf_tensors(unit: Unit, params: dict, dtype: np.dtype, experts: str) -> dict[str, np.ndarray]:
    """The HF tensors of one unit: itself, or with `experts="mxfp4"` a GPT-OSS expert matrix as
    `<name>_blocks` / `<name>_scales` (hf/mxfp4.py)."""
    name = unit[2]
    if experts == "mxfp4" and name.endswith(_MXFP4_TENSORS):
        blocks, scales = mxfp4.quantize(_hf_tensor(unit, params, np.dtype(np.float32)))
        return {name + mxfp4.BLOCKS_SUFFIX: blocks, name + mxfp4.SCALES_SUFFIX: scales}
    return {name: _hf_tensor(unit, params, dtype)}


def _hf_tensor(unit: Unit, params: dict, dtype: np.dtype) -> np.ndarray:
    """One HF tensor (numpy, HF layout) of a spec's leaf."""
    spec, index, _ = unit

    def leaf(path: tuple[str, ...]) -> np.ndarray:
        value = get_path(params, path)
        return np.asarray(value[index] if index else value).astype(dtype)

    if spec.parts:  # several leaves in one HF tensor (interleaved columns unless the spec joins them otherwise)
        return np.ascontiguousarray((spec.join or interleave_parts)([leaf(p) for p in spec.parts]))
    return np.ascontiguousarray(spec.to_hf(leaf(spec.path)))


def _plan_shards(cfg: ModelConfig, specs: list[TensorSpec], itemsize: int, max_shard_size: int) -> list[list[Unit]]:
    """Group the HF tensors into shards of at most max_shard_size bytes (one tensor minimum)."""
    shards: list[list[Unit]] = [[]]
    size = 0
    for spec in specs:
        if spec.part:  # written with part 0 (`_hf_tensor`)
            continue
        nbytes = int(np.prod(spec.hf_shape)) * itemsize
        for index, name in spec.units(cfg):
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append((spec, index, name))
            size += nbytes
    return shards


def _generation_config(cfg: ModelConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, key)
        if value is not None:
            d[key] = list(value) if isinstance(value, tuple) else value
    return d


@contextmanager
def staged_folder(out_dir: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temp folder beside `out_dir` to write into; on success it replaces `out_dir` in one rename
    (an existing `out_dir` is moved aside first), on error it is removed: never a half-written folder."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_leftovers(out_dir: pathlib.Path) -> None:
    """Temporary folders an interrupted export left beside `out_dir` (`.<name>.tmp-*`, `.<name>.old-*`)."""
    if out_dir.parent.is_dir():
        for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
            for stale in out_dir.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)


def export_hf(cfg: ModelConfig, params: dict, out_dir: str | pathlib.Path, *, tokenizer: Tokenizer | None = None,
              max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, dtype: DType | None = None,
              overwrite: bool = True, experts: str = "dense") -> Any:
    """Write an HF folder at `out_dir` (a local path or a bucket URL); returns its path (an
    `epath.Path` for a URL). `dtype` defaults to the params' dtype. `experts`: "dense" (every tensor in
    `dtype`), or "mxfp4" for GPT-OSS: its expert matrices as MXFP4 blocks and scales with config.json's
    `quantization_config`, the layout its releases ship (rounded to the nearest E2M1 value of each
    32-input block's power-of-two scale; the rest in `dtype`).

    A URL gets the folder built locally first, then uploaded over the old one with config.json
    last, so a reader never sees a config.json beside missing weights."""
    if storage.is_url(out_dir):
        url = storage.normalize(out_dir)
        if storage.exists(url) and not overwrite:
            raise FileExistsError(f"output folder {url!r} exists (pass overwrite=True)")
        with tempfile.TemporaryDirectory(prefix="jaxrl_llm-hf-") as local:
            export_hf(cfg, params, pathlib.Path(local) / "hf", tokenizer=tokenizer, max_shard_size=max_shard_size,
                      dtype=dtype, experts=experts)
            storage.remove_tree(url)
            storage.upload_dir(str(pathlib.Path(local) / "hf"), url, last=("config.json",))
        return storage.as_path(url)
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: expected one of {EXPERT_FORMATS}")
    if experts == "mxfp4" and cfg.model_type != "gpt_oss":
        raise ValueError(f"experts='mxfp4' is GPT-OSS's checkpoint format; {cfg.model_type} exports dense tensors")
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"output folder {str(out_dir)!r} exists (pass overwrite=True)")
    _remove_leftovers(out_dir)
    head, num_labels = _head_of(params)
    np_dtype = np.dtype(as_jnp_dtype(dtype if dtype is not None else params["embedding"].dtype, what="export"))
    specs = tensor_specs(cfg, head=head, num_labels=num_labels)
    arch = cfg.architecture.replace("ForSequenceClassification", "ForCausalLM")
    if head == "score":
        arch = arch.replace("ForCausalLM", "ForSequenceClassification")

    with staged_folder(out_dir) as tmp:
        hf_config = cfg.to_hf_config(architecture=arch, dtype=np_dtype.name,
                                     num_labels=num_labels if head == "score" else None)
        if experts == "mxfp4":
            hf_config["quantization_config"] = {"quant_method": "mxfp4",
                                                "modules_to_not_convert": list(_MXFP4_NOT_CONVERTED)}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2))
        shards = _plan_shards(cfg, specs, np_dtype.itemsize, max_shard_size)
        weight_map: dict[str, str] = {}
        total = 0
        for k, shard in enumerate(shards):
            name = ("model.safetensors" if len(shards) == 1
                    else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
            tensors: dict[str, np.ndarray] = {}
            for unit in shard:
                tensors.update(_hf_tensors(unit, params, np_dtype, experts))
            for hf_name, tensor in tensors.items():
                weight_map[hf_name] = name
                total += tensor.nbytes
            save_file(tensors, str(tmp / name), metadata={"format": "pt"})
            del tensors
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out_dir

"""Bad input -> one clear error that names the file / key / tensor / type."""
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny_models import build_hf_model

from jaxrl_llm.hf import (
    MissingTensorError,
    TensorShapeError,
    UnsupportedQuantizationError,
    export_hf,
    load_any,
    load_gguf,
    load_hf_folder,
)
from jaxrl_llm.models import ModelConfig, UnsupportedArchitectureError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    build_hf_model("llama", folder)
    return folder


def _copy_with(tiny_folder, dst, edit_tensors=None, edit_config=None):
    dst.mkdir()
    config = json.loads((tiny_folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tiny_folder / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_any(tmp_path)


def test_missing_weights(tiny_folder, tmp_path):
    (tmp_path / "config.json").write_text((tiny_folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_folder(tmp_path)


def test_unsupported_architecture_lists_supported(tiny_folder, tmp_path):
    def gpt2(c):
        c["architectures"], c["model_type"] = ["GPT2LMHeadModel"], "gpt2"

    folder = _copy_with(tiny_folder, tmp_path / "m", edit_config=gpt2)
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_hf_folder(folder)


def test_missing_tensor_is_named(tiny_folder, tmp_path):
    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]

    folder = _copy_with(tiny_folder, tmp_path / "m", edit_tensors=drop)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_folder(folder)


def test_wrong_shape_is_named_with_expected_and_got(tiny_folder, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

    folder = _copy_with(tiny_folder, tmp_path / "m", edit_tensors=shrink)
    with pytest.raises(TensorShapeError, match=r"k_proj\.weight.*\(16, 64\).*expected \(32, 64\)"):
        load_hf_folder(folder)


def test_unsupported_gguf_quant_type_is_named(tmp_path):
    import gguf

    path = tmp_path / "q4k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    block = np.zeros((4, 144), np.uint8)  # 4 rows of one 256-element Q4_K block
    writer.add_tensor("blk.0.attn_q.weight", block, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedQuantizationError, match=r"blk\.0\.attn_q\.weight.*Q4_K"):
        load_gguf(path)


def test_unknown_path_kind_and_value_head_export(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="hf_folder, gguf"):
        load_any(tmp_path / "x.bin")
    cfg = ModelConfig.tiny("llama")
    with pytest.raises(ValueError, match="value-head"):
        export_hf(cfg, {"value_head": {}, "embedding": np.zeros((1,))}, tmp_path / "out")
    assert not (tmp_path / "out").exists()

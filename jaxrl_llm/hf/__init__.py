"""Hugging Face bridge: HF folder (safetensors) and GGUF import, HF export, tokenizer loading."""
from jaxrl_llm.hf.assemble import assemble_params
from jaxrl_llm.hf.export import DEFAULT_MAX_SHARD_SIZE, export_hf
from jaxrl_llm.hf.gguf_load import (
    SUPPORTED_GGUF_TYPES,
    UnsupportedQuantizationError,
    load_gguf,
)
from jaxrl_llm.hf.hf_folder import load_hf_folder, read_hf_config
from jaxrl_llm.hf.load import BUILTIN_LOADERS, load_any, loaders, register_loader, unregister_loader
from jaxrl_llm.hf.names import MissingTensorError, TensorShapeError, tensor_specs
from jaxrl_llm.hf.tokenizer import load_tokenizer

__all__ = [
    "BUILTIN_LOADERS", "DEFAULT_MAX_SHARD_SIZE", "MissingTensorError", "SUPPORTED_GGUF_TYPES", "TensorShapeError",
    "UnsupportedQuantizationError", "assemble_params", "export_hf", "load_any", "load_gguf",
    "load_hf_folder", "load_tokenizer", "loaders", "read_hf_config", "register_loader", "tensor_specs",
    "unregister_loader",
]

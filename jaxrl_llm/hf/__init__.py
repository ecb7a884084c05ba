"""Hugging Face bridge: HF folder (safetensors) and GGUF import, HF export, tokenizer loading."""
from jaxrl_llm.hf.hf_folder import load_hf_folder
from jaxrl_llm.hf.names import MissingTensorError, TensorShapeError

__all__ = ["MissingTensorError", "TensorShapeError", "load_hf_folder"]

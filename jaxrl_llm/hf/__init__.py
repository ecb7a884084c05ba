"""Hugging Face bridge: HF folder (safetensors) and GGUF import, HF export, tokenizer loading."""
